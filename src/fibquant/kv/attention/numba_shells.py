"""The fused numba decode step (kv/attention/numba_decode.py) for E8 shell codes (FibQuant-E8, codecs/e8shell.py).

A shell code stores per 8-block j of the rotated unit vector ONE index into 2^(8 b) points: no codebook small
enough for per-query score tables over whole blocks (65 536 points at 2 bits, 2^32 at 4). In the rotated
domain (un-rotated once per query row)

    q . x_hat_i = nu_i (q @ forward) . u_hat_i           (the G query rows of the KV head: G dot products)
    sum_i p_i x_hat_i = (sum_i p_i nu_i u_hat_i) @ forward.T

At <= 16 index bits (b <= 2, `codebook.e8shell_tables.CompactPointTables`) every point is s_g (+-h_a, +-h_b), two
4-d halves of at most 541 (up to sign) and its level's scale, named by one 32-bit word per index: so the
scores come from per-query tables of (quarter of the query row) . h over the halves (built per KV head, 4
query rows per entry), two reads per block, and the value sums from a histogram over the halves contracted
with them once (FibQuant's scheme on the halves). Above 16 bits each block is decoded into u_hat [64] through
`point_py` (the index's orbit, its composition's slot word and its sign row: four dependent table reads;
exactly `unrank`'s point rounded to float32) and dotted / accumulated (each value row decoded once, G FMAs).
Everything else (norms, exact columns, bias, one softmax over the row and a sink logit, centring) is
numba_decode's step, whose helpers this kernel calls. Keys and values may be shell codes of different rates;
both roles must be shell codes (else `shell_decode_plans` says None and another path serves the step).
Results equal `attend_codes` on the decoded floats to float32 rounding (tests/kv/attention/test_numba_shells.py).
"""
from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from fibquant.codebook.e8shell_tables import BAD_WORD_BIT, CompactPointTables
from fibquant.codecs.reader import ShellsReader
from fibquant.kv.attention.host_arrays import f32
from fibquant.kv.attention.numba_epilogue import (STEP_CODES_TYPE, STEP_EPILOGUE_TYPE, STEP_EXACT_TYPE, StepCodes,
                                                  StepEpilogue, StepExact, step_parts)

_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_KERNEL = None
_LOCK = threading.Lock()
MAX_GROUPS = 8  # query heads per KV head



class ShellRole(NamedTuple):
    """One role (the keys or the values) as the shell step reads it (`_role`): its rotation and its code's
    tables, of one kind (the other kind's arrays are dummies): the compact `CompactPointTables` when words is
    not empty, else the decomposed `ShellPointTables`."""

    rotation: object    # float32 [D, D] (C): keys: the forward rotation; values: its inverse
    ibits: int          # index bits per 8-block
    count: int          # the code's points (an index >= count is invalid)
    bucket: object      # the decomposed tables (`ShellPointTables.args`): bucket .. comps, signs
    bshift: int
    orbits: object
    orbit_vals: object
    comps: object
    words: object       # the compact tables: `step_words`' words, the halves, `step_words`' pairs
    halves: object
    scales32: object
    signs: object


_point = _norms = _add_key_mean = None
_exact_part_scores = _exact_part_values = _row_weights = _write_out = None  # numba_epilogue's
_code_scores = _code_values = _row_indices = _row_words = _code_scores_compact = _code_values_compact = None
_scores_table = _hist_contract = _halves_scores = _halves_hist = _halves_build = _halves_contract = None
_code_scores_halves = _code_values_halves = None


def _row_indices_py(rows, i, ibits, count, idx):
    """The block indices of code row i into idx (int64 [dim/8]): ibits (8..32) bits each after the 2-byte norm,
    little-endian as `codecs.bitpack` packs them (12 / 14-bit codes are not byte-aligned), all read before any
    table (independent loads); an index >= count reads as 0. Returns how many were >= count."""
    n_blk = idx.shape[0]
    if ibits == 16:
        for blk in range(n_blk):
            idx[blk] = np.int64(rows[i, 2 + 2 * blk]) | (np.int64(rows[i, 3 + 2 * blk]) << 8)
    elif ibits == 8:
        for blk in range(n_blk):
            idx[blk] = np.int64(rows[i, 2 + blk])
    else:  # a bit stream: only the row's own bytes are read
        mask = (np.int64(1) << ibits) - 1
        buf = np.int64(0)
        have = 0
        o = 2
        for blk in range(n_blk):
            while have < ibits:
                buf |= np.int64(rows[i, o]) << have
                o += 1
                have += 8
            idx[blk] = buf & mask
            buf >>= ibits
            have -= ibits
    bad = 0
    for blk in range(n_blk):
        if idx[blk] >= count:
            bad += 1
            idx[blk] = 0
    return bad


def _code_scores_py(rows, rq, groups, norms, coded, u, idx, ibits, count, bucket, bshift, orbits, orbit_vals,
                    comps, signs):
    """coded[t, i] = norms[i] * (rq[t] . u_hat_i) for every code row i (u: float32 scratch [dim], idx: int64
    scratch [dim/8]); returns the count of indices >= count (decoded as index 0)."""
    n_tokens = rows.shape[0]
    dim = rq.shape[1]
    bad = 0
    for i in range(n_tokens):
        bad += _row_indices(rows, i, ibits, count, idx)
        for blk in range(dim // 8):
            _point(idx[blk], bucket, bshift, orbits, orbit_vals, comps, signs, u, blk * 8)
        nu = norms[i]
        for t in range(groups):
            s = np.float32(0.0)
            for e in range(dim):
                s += rq[t, e] * u[e]
            coded[t, i] = s * nu
    return bad


def _code_values_py(rows, weights, groups, norms, acc, u, idx, ibits, count, bucket, bshift, orbits, orbit_vals,
                    comps, signs):
    """acc[t] += weights[t, i] * norms[i] * u_hat_i over every code row i (acc [groups, dim] rotated domain);
    returns the count of indices >= count."""
    n_tokens = rows.shape[0]
    dim = acc.shape[1]
    bad = 0
    for i in range(n_tokens):
        bad += _row_indices(rows, i, ibits, count, idx)
        for blk in range(dim // 8):
            _point(idx[blk], bucket, bshift, orbits, orbit_vals, comps, signs, u, blk * 8)
        nu = norms[i]
        for t in range(groups):
            w = weights[t, i] * nu
            if w != 0.0:
                for e in range(dim):
                    acc[t, e] += w * u[e]
    return bad


def _row_words_py(rows, i, ibits, words, wr):
    """wr [dim/8] (int64) = the compact words (`CompactPointTables.words`) of code row i's block indices, ibits
    (8..16) bits each after the 2-byte norm, little-endian as `codecs.bitpack` packs them; only the row's own
    bytes are read, and the branch on ibits is taken once per row (inlined: a per-block helper call cost 2-4x)."""
    n_blk = wr.shape[0]
    if ibits == 16:
        for blk in range(n_blk):
            wr[blk] = words[np.int64(rows[i, 2 + 2 * blk]) | (np.int64(rows[i, 3 + 2 * blk]) << 8)]
    elif ibits == 8:
        for blk in range(n_blk):
            wr[blk] = words[np.int64(rows[i, 2 + blk])]
    else:  # 12 / 14 bits: a bit stream
        mask = (np.int64(1) << ibits) - 1
        buf = np.int64(0)
        have = 0
        o = 2
        for blk in range(n_blk):
            while have < ibits:
                buf |= np.int64(rows[i, o]) << have
                o += 1
                have += 8
            wr[blk] = words[buf & mask]
            buf >>= ibits
            have -= ibits


def _scores_table_py(rq, groups, t0, halves, table, rq4):
    """table[q, h, t] = rq[t0 + t, 4 q : 4 q + 4] . halves[h] for the query rows t0 + t < groups (rq4: float32
    [4, 4] scratch, zero in the lanes past groups)."""
    for q in range(table.shape[0]):
        for t in range(min(4, groups - t0)):
            for k in range(4):
                rq4[k, t] = rq[t0 + t, 4 * q + k]
        for h in range(halves.shape[0]):  # lanes innermost: 4-wide multiply-adds
            for t in range(4):
                table[q, h, t] = (halves[h, 0] * rq4[0, t] + halves[h, 1] * rq4[1, t] + halves[h, 2] * rq4[2, t]
                                  + halves[h, 3] * rq4[3, t])


def _hist_contract_py(table, halves, acc, groups, t0, sums):
    """acc[t0 + t, 4 q + k] += sum_h table[q, h, t] halves[h, k] for t0 + t < groups (sums: float32 [4, 4])."""
    for q in range(table.shape[0]):
        for k in range(4):
            for t in range(4):
                sums[k, t] = 0.0
        for h in range(halves.shape[0]):  # lanes innermost: 4-wide multiply-adds
            for k in range(4):
                x = halves[h, k]
                for t in range(4):
                    sums[k, t] += table[q, h, t] * x
        for t in range(min(4, groups - t0)):
            for k in range(4):
                acc[t0 + t, 4 * q + k] += sums[k, t]


def _code_scores_compact_py(rows, rq, groups, norms, coded, ibits, words, halves, scales32, table, wr):
    """`_code_scores` for `CompactPointTables` codes (b <= 2) through per-query tables over the 4-d halves,
    FibQuant-style: table [dim/4, H, 4] (scratch) = 4 query rows' quarter-blocks . each half, then per block
    s_g (+-table[2 blk, first half] +- table[2 blk + 1, second half]) for 4 rows at once (groups > 4: twice);
    wr int64 [dim/8] scratch, dim/8 a multiple of 8. words (2^ibits: one per index the code's bits can hold)
    carry bit 31 for indices beyond the points; returns how many of those were read (decoded as index 0)."""
    n_tokens = rows.shape[0]
    n_blk = wr.shape[0]
    bad = 0
    rq4 = np.zeros((4, 4), np.float32)  # [k, lane]: one quarter-block of 4 query rows (zero lanes past groups)
    for t0 in range(0, groups, 4):
        _scores_table(rq, groups, t0, halves, table, rq4)
        for i in range(n_tokens):
            _row_words(rows, i, ibits, words, wr)
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            for b8 in range(0, n_blk, 8):
                for b in range(8):  # a constant trip count: unrolled
                    blk = b8 + b
                    w = wr[blk]
                    bad += w >> 31
                    lo = w & 2047
                    hi = (w >> 12) & 2047
                    s = scales32[(w >> 24) & 127]
                    s_lo = s * np.float32(1 - 2 * ((w >> 11) & 1))  # the halves' signs (tables hold one of +-h)
                    s_hi = s * np.float32(1 - 2 * ((w >> 23) & 1))
                    a0 += s_lo * table[2 * blk, lo, 0] + s_hi * table[2 * blk + 1, hi, 0]
                    a1 += s_lo * table[2 * blk, lo, 1] + s_hi * table[2 * blk + 1, hi, 1]
                    a2 += s_lo * table[2 * blk, lo, 2] + s_hi * table[2 * blk + 1, hi, 2]
                    a3 += s_lo * table[2 * blk, lo, 3] + s_hi * table[2 * blk + 1, hi, 3]
            nu = norms[i]
            coded[t0, i] = a0 * nu
            if t0 + 1 < groups:
                coded[t0 + 1, i] = a1 * nu
            if t0 + 2 < groups:
                coded[t0 + 2, i] = a2 * nu
            if t0 + 3 < groups:
                coded[t0 + 3, i] = a3 * nu
    return bad if groups <= 4 else bad // 2


def _code_values_compact_py(rows, weights, groups, norms, acc, ibits, words, halves, scales32, table, wr):
    """`_code_values` for `CompactPointTables` codes: each row's weights x nu x s_g added into a histogram over
    the halves (table [dim/4, H, 4], scratch; 4 query rows at a time), then acc[t, 4 q + k] += sum_h
    table[q, h, t] halves[h, k]. Returns the count of indices beyond the points."""
    n_tokens = rows.shape[0]
    n_blk = wr.shape[0]
    bad = 0
    sums = np.empty((4, 4), np.float32)
    for t0 in range(0, groups, 4):
        table[:] = 0.0
        for i in range(n_tokens):
            _row_words(rows, i, ibits, words, wr)
            nu = norms[i]
            w0 = weights[t0, i] * nu
            w1 = weights[t0 + 1, i] * nu if t0 + 1 < groups else np.float32(0.0)
            w2 = weights[t0 + 2, i] * nu if t0 + 2 < groups else np.float32(0.0)
            w3 = weights[t0 + 3, i] * nu if t0 + 3 < groups else np.float32(0.0)
            for b8 in range(0, n_blk, 8):
                for b in range(8):
                    blk = b8 + b
                    w = wr[blk]
                    bad += w >> 31
                    lo = w & 2047
                    hi = (w >> 12) & 2047
                    s = scales32[(w >> 24) & 127]
                    s_lo = s * np.float32(1 - 2 * ((w >> 11) & 1))
                    s_hi = s * np.float32(1 - 2 * ((w >> 23) & 1))
                    table[2 * blk, lo, 0] += s_lo * w0
                    table[2 * blk, lo, 1] += s_lo * w1
                    table[2 * blk, lo, 2] += s_lo * w2
                    table[2 * blk, lo, 3] += s_lo * w3
                    table[2 * blk + 1, hi, 0] += s_hi * w0
                    table[2 * blk + 1, hi, 1] += s_hi * w1
                    table[2 * blk + 1, hi, 2] += s_hi * w2
                    table[2 * blk + 1, hi, 3] += s_hi * w3
        _hist_contract(table, halves, acc, groups, t0, sums)
    return bad if groups <= 4 else bad // 2


def _code_scores_halves_py(rows, rq, groups, norms, coded, ibits, words, halves, pairs, table, wr):
    """`_code_scores_compact` (same result; words / pairs: `step_words`) with each row's blocks summed by the
    vector intrinsic `intrinsics._build_halves` (one <4 x float> load and fused multiply-add per half: 4 query
    lanes at once; lanes past groups hold stale rows, never stored)."""
    n_tokens = rows.shape[0]
    bad = 0
    rq44 = np.zeros((table.shape[0], 4, 4), np.float32)  # [q, k, lane], zero lanes past groups
    res = np.empty(4, np.float32)
    for t0 in range(0, groups, 4):
        for q in range(table.shape[0]):
            for t in range(min(4, groups - t0)):
                for k in range(4):
                    rq44[q, k, t] = rq[t0 + t, 4 * q + k]
        _halves_build(table, halves, rq44)
        for i in range(n_tokens):
            _row_words(rows, i, ibits, words, wr)
            bad += _halves_scores(table, wr, pairs, res)
            nu = norms[i]
            for t in range(min(4, groups - t0)):
                coded[t0 + t, i] = res[t] * nu
    return bad if groups <= 4 else bad // 2


def _code_values_halves_py(rows, weights, groups, norms, acc, ibits, words, halves, pairs, table, wr):
    """`_code_values_compact` (same result; words / pairs: `step_words`) with each row's weights added into the
    histogram by the vector intrinsic `intrinsics._build_halves` (one <4 x float> read-modify-write per half)."""
    n_tokens = rows.shape[0]
    bad = 0
    sums = np.empty((table.shape[0], 4, 4), np.float32)  # [q, k, lane]
    w4 = np.zeros(4, np.float32)
    for t0 in range(0, groups, 4):
        table[:] = 0.0
        for i in range(n_tokens):
            _row_words(rows, i, ibits, words, wr)
            nu = norms[i]
            for t in range(min(4, groups - t0)):
                w4[t] = weights[t0 + t, i] * nu
            bad += _halves_hist(table, wr, pairs, w4)
        _halves_contract(table, halves, sums)
        for q in range(table.shape[0]):
            for t in range(min(4, groups - t0)):
                for k in range(4):
                    acc[t0 + t, 4 * q + k] += sums[q, k, t]
    return bad if groups <= 4 else bad // 2


def _decode_step_py(query, out, keys, values, codes, exact, epilogue, unit_start, unit_stop):
    """out[b, h*G + t] for units [unit_start, unit_stop) of (b, KV head h), as numba_decode's step, the coded
    columns read from shell codes: keys / values `ShellRole` (each role's rotation, index bits, point count
    and tables: the compact `CompactPointTables` (`step_words`' words, halves, its pairs) when words is not
    empty, else the decomposed `ShellPointTables` (bucket .. comps, signs)); codes, exact, epilogue: the
    structures of `numba_epilogue` (`StepCodes`, `StepExact`, `StepEpilogue`), each passed as a plain tuple
    of its fields and named again here (as numba_decode's step). Returns the count of invalid indices (>= the
    code's point count) seen. One function for numba_decode's reason: its
    per-unit loop shares the per-call buffers across its phases."""
    keys, values, codes = ShellRole(*keys), ShellRole(*values), StepCodes(*codes)
    exact, epilogue = StepExact(*exact), StepEpilogue(*epilogue)
    # every array taken out of its structure once: each access in a loop would pay numba's reference count
    key_forward, value_inverse = keys.rotation, values.rotation
    k_ibits, k_count, k_bucket, k_bshift, k_orbits = keys.ibits, keys.count, keys.bucket, keys.bshift, keys.orbits
    k_orbit_vals, k_comps, k_words, k_halves, k_scales32 = (keys.orbit_vals, keys.comps, keys.words, keys.halves,
                                                            keys.scales32)
    v_ibits, v_count, v_bucket, v_bshift, v_orbits = (values.ibits, values.count, values.bucket, values.bshift,
                                                      values.orbits)
    v_orbit_vals, v_comps, v_words, v_halves, v_scales32 = (values.orbit_vals, values.comps, values.words,
                                                            values.halves, values.scales32)
    k_signs, v_signs = keys.signs, values.signs
    key_codes, value_codes, key_norms, value_norms = codes.key_codes, codes.value_codes, codes.key_norms, codes.value_norms
    key_mean, value_mean = codes.key_mean, codes.value_mean
    has_norms, has_key_mean, has_value_mean = codes.has_norms, codes.has_key_mean, codes.has_value_mean
    sink_keys, sink_values, recent_keys, recent_values = (exact.sink_keys, exact.sink_values, exact.recent_keys,
                                                          exact.recent_values)
    new_keys, new_values = exact.new_keys, exact.new_values
    scaling, softcap, bias, sinks = epilogue.scaling, epilogue.softcap, epilogue.bias, epilogue.sinks
    has_bias, has_sinks = epilogue.has_bias, epilogue.has_sinks
    n_b, n_qh, dim = query.shape
    n_h = key_codes.shape[1]
    groups = n_qh // n_h
    n_tokens = key_codes.shape[2]
    n_sink, n_recent, n_new = sink_keys.shape[2], recent_keys.shape[2], new_keys.shape[2]
    n_exact = n_sink + n_recent + n_new
    value_dim = value_inverse.shape[0]
    coded = np.empty((groups, max(n_tokens, 1)), dtype=np.float32)
    norms = np.empty(max(n_tokens, 1), dtype=np.float32)
    ibits = np.empty(max(n_tokens, n_exact, 1), dtype=np.int32)  # the softmax's exps: coded and exact columns
    scaled = np.empty((groups, dim), dtype=np.float32)
    rq = np.empty((groups, dim), dtype=np.float32)
    acc = np.empty((groups, value_dim), dtype=np.float32)
    u = np.empty(max(dim, value_dim), dtype=np.float32)
    blk_idx = np.empty(dim // 8, dtype=np.int64)
    blk_idx_v = np.empty(value_dim // 8, dtype=np.int64)
    k_table = np.empty((dim // 4 if k_words.shape[0] else 0, k_halves.shape[0], 4), dtype=np.float32)
    v_table = np.empty((value_dim // 4 if v_words.shape[0] else 0, v_halves.shape[0], 4), dtype=np.float32)
    exact = np.empty((groups, n_exact), dtype=np.float32)
    total = np.empty(groups, dtype=np.float32)
    coded_total = np.empty(groups, dtype=np.float32)
    result = np.empty((groups, value_dim), dtype=np.float32)
    key_row = np.empty(dim, dtype=np.float32)
    exact_rows = np.empty(max(n_sink, n_recent, n_new) * value_dim, dtype=np.float32)
    bad = 0
    for unit in range(unit_start, unit_stop):
        b = unit // n_h
        h = unit % n_h
        for t in range(groups):
            for d in range(dim):
                scaled[t, d] = query[b, h * groups + t, d] * scaling
        # --- coded scores: the rotated query rows . each decoded key row
        if n_tokens:
            for t in range(groups):
                for e in range(dim):
                    rq[t, e] = 0.0
                for d in range(dim):
                    x = scaled[t, d]
                    for e in range(dim):
                        rq[t, e] += x * key_forward[d, e]
            if has_norms:
                row_norms = key_norms[b, h]
            else:
                _norms(key_codes[b, h], norms, ibits)
                row_norms = norms
            if k_words.shape[0]:
                bad += _code_scores_halves(key_codes[b, h], rq, groups, row_norms, coded, k_ibits, k_words,
                                            k_halves, k_scales32, k_table, blk_idx)
            else:
                bad += _code_scores(key_codes[b, h], rq, groups, row_norms, coded, u, blk_idx, k_ibits, k_count,
                                    k_bucket, k_bshift, k_orbits, k_orbit_vals, k_comps, k_signs)
            if has_key_mean:
                _add_key_mean(coded, groups, n_tokens, scaled, key_mean, b, h, dim)
        # --- the epilogue (numba_epilogue): exact scores, soft-cap, bias, one softmax with the sink logit
        _exact_part_scores(sink_keys, recent_keys, new_keys, b, h, exact, scaled, groups, key_row)
        _row_weights(coded, exact, groups, n_tokens, n_exact, n_sink, softcap, bias, has_bias, sinks, has_sinks,
                     b, h, coded_total, total, ibits)
        # --- value sums: each value row decoded once, accumulated in the rotated domain, un-rotated once
        for t in range(groups):
            for d in range(value_dim):
                result[t, d] = 0.0
        if n_tokens:
            if has_norms:
                row_norms = value_norms[b, h]
            else:
                _norms(value_codes[b, h], norms, ibits)
                row_norms = norms
            for t in range(groups):
                for e in range(value_dim):
                    acc[t, e] = 0.0
            if v_words.shape[0]:
                bad += _code_values_halves(value_codes[b, h], coded, groups, row_norms, acc, v_ibits, v_words,
                                            v_halves, v_scales32, v_table, blk_idx_v)
            else:
                bad += _code_values(value_codes[b, h], coded, groups, row_norms, acc, u, blk_idx_v, v_ibits,
                                    v_count, v_bucket, v_bshift, v_orbits, v_orbit_vals, v_comps, v_signs)
            for t in range(groups):  # inverse = forward.T
                for e in range(value_dim):
                    x = acc[t, e]
                    for d in range(value_dim):
                        result[t, d] += x * value_inverse[e, d]
                if has_value_mean:
                    for d in range(value_dim):
                        result[t, d] += coded_total[t] * value_mean[b, h, d]
        _exact_part_values(sink_values, recent_values, new_values, b, h, exact, result, groups, exact_rows)
        _write_out(result, total, out, b, h, groups)
    return bad


def _signature() -> str:
    """The kernel's one signature: each structure as a plain tuple of its fields (in their order;
    tests/kv/attention/test_numba_decode.py::test_step_signatures_match_their_structures holds the two
    together)."""
    role = ("Tuple((float32[:, ::1], int64, int64, int16[::1], int64, int64[:, ::1], float32[:, ::1], uint32[::1], "
            "uint32[::1], float32[:, ::1], float32[::1], uint8[:, ::1]))")  # `ShellRole`
    return (f"int64(float32[:, :, ::1], float32[:, :, ::1], {role}, {role}, {STEP_CODES_TYPE}, {STEP_EXACT_TYPE}, "
            f"{STEP_EPILOGUE_TYPE}, int64, int64)")


def compile_shell_kernel():
    """The shell-code decode-step dispatcher (numba, disk-cached as `jit.kernel_jit`, keyed also on
    codebook/e8shell_tables.py, whose `point_py` it inlines), after binding numba_decode's helpers."""
    global _KERNEL, _point, _norms, _add_key_mean, _exact_part_scores, _exact_part_values, _row_weights, _write_out
    global _code_scores, _code_values, _row_indices, _row_words, _code_scores_compact, _code_values_compact
    global _scores_table, _hist_contract, _halves_scores, _halves_hist, _halves_build, _halves_contract
    global _code_scores_halves, _code_values_halves
    if _KERNEL is not None:
        return _KERNEL
    with _LOCK:
        if _KERNEL is not None:
            return _KERNEL
        import fibquant.codebook.e8shell_tables as e8shell_tables
        import fibquant.kv.attention.numba_decode as numba_decode
        from fibquant.kv.attention.intrinsics import _build_halves
        from fibquant.kv.attention.jit import KERNEL_SOURCES
        from fibquant._numba import njit_tracking

        numba_decode.compile_decode_kernel()  # binds its helpers
        for name in ("_norms", "_add_key_mean", "_exact_part_scores", "_exact_part_values", "_row_weights",
                     "_write_out"):
            globals()[name] = getattr(numba_decode, name)
        sources = (*KERNEL_SOURCES, Path(e8shell_tables.__file__).resolve())

        def jit(*signature, **options):
            return njit_tracking(*signature, depends_on=sources, nogil=True, **options)

        _point, _row_indices = jit()(e8shell_tables.point_py), jit()(_row_indices_py)
        _row_words = jit(inline="always")(_row_words_py)
        fast = jit(fastmath={"contract", "reassoc", "nsz"})  # float sums in any order
        _code_scores, _code_values = fast(_code_scores_py), fast(_code_values_py)
        inline = jit(inline="always", fastmath={"contract", "reassoc", "nsz"})
        _scores_table, _hist_contract = inline(_scores_table_py), inline(_hist_contract_py)
        _halves_scores, _halves_hist, _halves_build, _halves_contract = _build_halves()
        _code_scores_compact, _code_values_compact = fast(_code_scores_compact_py), fast(_code_values_compact_py)
        _code_scores_halves, _code_values_halves = fast(_code_scores_halves_py), fast(_code_values_halves_py)
        _KERNEL = jit(_signature(), fastmath={"contract", "reassoc", "nsz"})(_decode_step_py)
    return _KERNEL


# the arrays of the table kind a role does not use (the kernel's signature takes both kinds per role)
_NO_SIGNS = np.zeros((1, 1), np.uint8)
_NO_DECOMPOSED = (np.zeros(1, np.int16), 0, np.zeros((1, 8), np.int64), np.zeros((1, 16), np.float32),
                  np.zeros(1, np.uint32))
_NO_COMPACT = (np.zeros(0, np.uint32), np.zeros((1, 4), np.float32), np.zeros(1, np.float32))


def step_words(tables: CompactPointTables) -> tuple:
    """(words uint32 [len(tables.words)], pairs float32 [1024]): each compact word re-cut for the step's vector
    loop (`intrinsics._build_halves`): bits 0..10 / 11..21 the two halves, 22 / 23 their signs, 24..30 the
    level, 31 an index beyond the points (BAD_WORD_BIT; index 0's fields); pairs[2 p : 2 p + 2] = (s_lo, s_hi)
    for p = bits 22..30 (the level's float32 scale with each half's sign): two broadcast loads per block instead
    of a scale lookup and two sign products."""
    w = tables.words.astype(np.uint32)
    lo, hi = w & 2047, (w >> 12) & 2047
    sign_lo, sign_hi = (w >> 11) & 1, (w >> 23) & 1
    level = (w >> 24) & 127
    words = lo | hi << 11 | sign_lo << 22 | sign_hi << 23 | level << 24 | (w & BAD_WORD_BIT)
    p = np.arange(512)
    scale = np.zeros(512, np.float32)
    scale[:] = tables.scales32[np.minimum(p >> 2, len(tables.scales32) - 1)]
    pairs = np.stack([scale * (1 - 2 * (p & 1)), scale * (1 - 2 * ((p >> 1) & 1))], axis=1).astype(np.float32)
    return words.astype(np.uint32), pairs.reshape(-1)


def _role(rotation, plan) -> ShellRole:
    """The kernel's `ShellRole` of a role: its rotation (keys: forward, values: inverse), its plan's index bits and
    tables, a dummy for each array of the table kind it does not use."""
    ibits, tables, step = plan[2], plan[3], plan[5]
    if isinstance(tables, CompactPointTables):
        return ShellRole(rotation, ibits, tables.count, *_NO_DECOMPOSED, step[0], tables.halves, step[1], _NO_SIGNS)
    return ShellRole(rotation, ibits, tables.count, *tables.args()[:-1], *_NO_COMPACT, tables.signs)


def shell_plan(codec):
    """(forward, forward.T, index bits, tables (CompactPointTables at <= 16 index bits, else ShellPointTables),
    (torch tensors kept alive), `step_words` of compact tables else None, (its `ShellRole` as keys, as values)
    as the kernel takes them) for a codec whose codes are E8 shell codes (`ShellsReader`), else None."""
    try:
        plan = _PLANS.get(codec)
    except TypeError:
        plan = None
    if plan is not None:
        return plan or None
    plan = ()
    shells = codec.reader(torch.device("cpu"))
    if isinstance(shells, ShellsReader):
        forward = shells.forward.detach().to(torch.float32).contiguous()
        tables = shells.tables
        if isinstance(tables, CompactPointTables) and (len(tables.words) != 1 << shells.index_bits
                                                        or forward.shape[0] % 64):
            raise ValueError(f"compact tables of {len(tables.words)} words for {shells.index_bits}-bit indices, "
                             f"dim {forward.shape[0]} (the step needs 2^bits words, dim a multiple of 64)")
        words = step_words(tables) if isinstance(tables, CompactPointTables) else None
        plan = (forward.numpy(), forward.T.contiguous().numpy(), shells.index_bits, shells.tables, (forward,), words)
        plan += ((tuple(_role(plan[0], plan)), tuple(_role(plan[1], plan))),)  # built once: ~1 us a call otherwise
    try:
        _PLANS[codec] = plan
    except TypeError:
        pass
    return plan or None


def shell_decode_plans(query: torch.Tensor, kv):
    """(key plan, value plan) when this one-token step can run the shell kernel (both roles shell codes,
    <= MAX_GROUPS query heads per KV head, CPU, numba), else None."""
    if query.device.type != "cpu" or not kv.key_codes.shape[-2] or (query.requires_grad and torch.is_grad_enabled()):
        return None
    if query.shape[1] // kv.new_keys.shape[1] > MAX_GROUPS:
        return None
    from fibquant._numba import numba_available
    if not numba_available():
        return None
    keys, values = shell_plan(kv.key_codec), shell_plan(kv.value_codec)
    if keys is None or values is None:
        return None
    return keys, values


def attend_decode_shells(query: torch.Tensor, kv, epilogue, plans) -> torch.Tensor:
    """`attend_codes` for one query token on the CPU through the shell kernel (as `codebook_step.attend_codebook_step`;
    epilogue: `numba_epilogue.Epilogue`, its bias from `entry._bias_block`): out [B, 1, Hq, Dv] in query's dtype. ValueError when a code holds an index beyond its code's points."""
    from fibquant._numba import run_split
    from fibquant.kv.attention.kernels import _MIN_WORK_PER_THREAD

    kernel = compile_shell_kernel()
    keys, values = plans
    batch, q_heads = query.shape[:2]
    heads = kv.new_keys.shape[1]
    codes, exact, step_epilogue = step_parts(kv, epilogue)
    value_dim = values[1].shape[0]
    out = torch.empty(batch, q_heads, value_dim, dtype=torch.float32)
    if query.dtype is torch.float32 and not query.requires_grad and query.stride(-1) == 1:
        query_np = np.ascontiguousarray(query.numpy()[:, :, 0])
    else:
        query_np = f32(query[:, :, 0])
    args = (query_np, out.numpy(), keys[6][0], values[6][1], tuple(codes), tuple(exact), tuple(step_epilogue))
    coded = codes.key_codes.shape[2]
    bad = run_split(kernel, args, batch * heads, coded * 2 * query.shape[-1], _MIN_WORK_PER_THREAD,
                    "fibquant-decode-e8")
    if bad:
        raise ValueError(f"E8 shell codes hold {bad} index(es) beyond their code's points "
                         f"({keys[3].count} keys / {values[3].count} values)")
    out = out.unsqueeze(1)
    return out if query.dtype == torch.float32 else out.to(query.dtype)
