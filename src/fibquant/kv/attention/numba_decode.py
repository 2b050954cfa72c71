"""One fused numba kernel for a decode step on codes: one query token, every column of a `CodedKV`.

`decode_step` (see `fibquant.kv.attention.codebook_step.attend_codebook_step`, which prepares the arguments)
does, per unit (b, KV head h) and the G = Hq / Hkv query heads that read it, what `attend_codes`
does with ~20 torch ops and two kernel calls:

1. the queries scaled and rotated by the key codec (q @ forward), laid out as the L = 4 / 8
   lanes of the lookup table of `numba_kernels` (one tile: G <= L);
2. the coded scores through that table (`_lut_sum`, the same intrinsic as `coded_scores`), plus
   q . mu for centred keys;
3. the shared epilogue (`numba_epilogue`): the exact columns (sinks, recent window, the new token) as
   float dot products, soft-capping, the additive bias (padding / sliding mask), one softmax over every
   column of the row (and a learned sink logit, which takes weight but has no value);
4. the value sums: the coded part as the weighted histogram of `coded_weighted_sum`
   (`_hist_add`, spread and contracted with the codewords by `_contract_clear`, which leaves the
   histogram zero for the next unit: it is cleared once per call), un-rotated once (@ forward.T), plus
   (sum of coded weights) * mu for centred values; the exact part as float sums;
5. out = (coded + exact) / total, a fully masked row gives zeros (as `attend_codes`).

With recall (`RecallRows.k` > 0, `fibquant.kv.attention.recall`): after step 2 each query row takes its top-k
coded columns (`numba_recall._topk_row`), scores them exactly from the cold tier's rows (`RecallRows.cold_keys`
/ `cold_values` [tokens * B * H, D], row (token * B + b) * H + h), and after step 3 moves their weights from
the coded value sums (and the coded total of the value mean) to the exact values.

So the per-layer cost of a step is this one call plus the argument conversion, not the torch
dispatch of ~20 small ops. Results equal `attend_codes`' joint softmax to float32 rounding (the
order of summation differs). Compiled on first use (cached on disk by numba, keyed on every kernel source: `jit`).
"""
from __future__ import annotations

from typing import NamedTuple

from fibquant.kv.attention.numba_epilogue import (STEP_CODES_TYPE, STEP_EPILOGUE_TYPE, STEP_EXACT_TYPE, StepCodes,
                                                  StepEpilogue, StepExact)

np = None
_count_invalid = _safe_fields = None
_build_table = _bytes_table = _spread_bytes = _contract_clear = None
_lut_sum = _hist_add = None
_score_tokens = _hist_tokens = _norms = None
_query_table = _unrotate_add = _role_fields = _add_key_mean = None
_exact_part_scores = _exact_part_values = _row_weights = _write_out = None  # numba_epilogue's
_recall_scores = _topk_row = _add_bias = None  # recall (numba_recall's top-k) and numba_epilogue's bias


class CodebookRole(NamedTuple):
    """One role (the keys or the values) as the step reads it: the code family's rotated codebook
    (`codebook_step.codec_plan`)."""

    rotation: object   # float32 [D, D] (C): keys: the forward rotation (queries into the codes' basis);
    #                    values: its inverse (the coded sums back out)
    codewords: object  # float32 [N, k] (C)
    bits: int          # bits per index
    blocks: int        # codeword blocks per row (D / k)
    mode: int          # the index layout (`kernels._numba_mode`)


class RecallRows(NamedTuple):
    """Recall (`fibquant.kv.attention.recall`): each query row's top-k coded columns read exactly."""

    cold_keys: object    # float32 [tokens * B * H, D] (C): the cold tier's rows, row (token * B + b) * H + h
    cold_values: object  # float32 [tokens * B * H, Dv] (C)
    k: int               # columns recalled per query row, 0: no recall


class StepScratch(NamedTuple):
    """One thread's scratch, reused across calls (`codebook_step.scratch`): the key tables and value
    histograms (`scratch_sizes` for `lanes` query lanes), and per token column coded [lanes, n], norms
    [n] and ibits (int32) [n], n >= the coded columns and the exact ones. The paged step
    (`numba_paged`) takes the same."""

    table1: object
    lut: object
    hist1: object
    hist: object
    coded: object
    norms: object
    ibits: object
    lanes: int  # query lanes of the tables (4 or 8)


# the groups' types in a kernel signature (fields in their order)
CODEBOOK_ROLE_TYPE = "Tuple((float32[:, ::1], float32[:, ::1], int64, int64, int64))"
STEP_SCRATCH_TYPE = ("Tuple((float32[::1], float32[::1], float32[::1], float32[::1], float32[:, ::1], float32[::1], "
                     "int32[::1], int64))")


def _score_tokens_py(table1, lut, rows, res, nq, norms, mode, lanes, bits, n_blocks, n_pos, n_codewords,
                     safe, safe_bytes, word):
    """res[t, i] = nu_i * (table sum of code row i)[t] for t < nq (literal variants as in numba_kernels)."""
    n_tokens = rows.shape[0]
    if mode == 2:  # whole index bytes (8-bit indices) looked up in the [codeword, block, lane] table
        if lanes == 4:
            if n_blocks == 32:
                for i in range(n_tokens):
                    _lut_sum(table1, rows, i, 32, 8, 1, 32, 256, safe_bytes, 4, 4, res, 0, nq, norms[i])
            elif n_blocks == 16:
                for i in range(n_tokens):
                    _lut_sum(table1, rows, i, 16, 8, 1, 16, 256, safe_bytes, 4, 4, res, 0, nq, norms[i])
            else:
                for i in range(n_tokens):
                    _lut_sum(table1, rows, i, n_blocks, 8, 1, n_blocks, 256, safe_bytes, 4, 4, res, 0, nq, norms[i])
        else:
            for i in range(n_tokens):
                _lut_sum(table1, rows, i, n_blocks, 8, 1, n_blocks, 256, safe_bytes, 4, 8, res, 0, nq, norms[i])
    elif mode == 0:
        if lanes == 4:
            for i in range(n_tokens):
                _lut_sum(lut, rows, i, n_pos, 8, 256, 1, 256, safe_bytes, 4, 4, res, 0, nq, norms[i])
        else:
            for i in range(n_tokens):
                _lut_sum(lut, rows, i, n_pos, 8, 256, 1, 256, safe_bytes, 4, 8, res, 0, nq, norms[i])
    elif lanes == 4:
        if bits == 10:
            for i in range(n_tokens):
                _lut_sum(table1, rows, i, n_blocks, 10, 1, n_blocks, n_codewords, safe, 4, 4, res, 0, nq, norms[i])
        elif bits == 12:
            for i in range(n_tokens):
                _lut_sum(table1, rows, i, n_blocks, 12, 1, n_blocks, n_codewords, safe, 4, 4, res, 0, nq, norms[i])
        elif word == 4:
            for i in range(n_tokens):
                _lut_sum(table1, rows, i, n_blocks, bits, 1, n_blocks, n_codewords, safe, 4, 4, res, 0, nq, norms[i])
        else:
            for i in range(n_tokens):
                _lut_sum(table1, rows, i, n_blocks, bits, 1, n_blocks, n_codewords, safe, 8, 4, res, 0, nq, norms[i])
    else:
        for i in range(n_tokens):
            _lut_sum(table1, rows, i, n_blocks, bits, 1, n_blocks, n_codewords, safe, 4, 8, res, 0, nq, norms[i])


def _hist_tokens_py(hist1, hist, rows, wts, nq, norms, mode, lanes, bits, n_blocks, n_pos, n_codewords,
                    safe, safe_bytes, word):
    """The weighted histogram of wts[t, i] * nu_i over the code rows (literal variants as in numba_kernels)."""
    n_tokens = rows.shape[0]
    if mode == 2:  # whole index bytes (8-bit indices) added into the [codeword, block, lane] histogram
        if lanes == 4:
            if n_blocks == 32:
                for i in range(n_tokens):
                    _hist_add(hist1, rows, i, 32, 8, 1, 32, 256, safe_bytes, 4, 4, wts, 0, nq, norms[i])
            elif n_blocks == 16:
                for i in range(n_tokens):
                    _hist_add(hist1, rows, i, 16, 8, 1, 16, 256, safe_bytes, 4, 4, wts, 0, nq, norms[i])
            else:
                for i in range(n_tokens):
                    _hist_add(hist1, rows, i, n_blocks, 8, 1, n_blocks, 256, safe_bytes, 4, 4, wts, 0, nq, norms[i])
        else:
            for i in range(n_tokens):
                _hist_add(hist1, rows, i, n_blocks, 8, 1, n_blocks, 256, safe_bytes, 4, 8, wts, 0, nq, norms[i])
    elif mode == 0:
        if lanes == 4:
            for i in range(n_tokens):
                _hist_add(hist, rows, i, n_pos, 8, 256, 1, 256, safe_bytes, 4, 4, wts, 0, nq, norms[i])
        else:
            for i in range(n_tokens):
                _hist_add(hist, rows, i, n_pos, 8, 256, 1, 256, safe_bytes, 4, 8, wts, 0, nq, norms[i])
    elif lanes == 4:
        if bits == 10:
            for i in range(n_tokens):
                _hist_add(hist1, rows, i, n_blocks, 10, 1, n_blocks, n_codewords, safe, 4, 4, wts, 0, nq, norms[i])
        elif bits == 12:
            for i in range(n_tokens):
                _hist_add(hist1, rows, i, n_blocks, 12, 1, n_blocks, n_codewords, safe, 4, 4, wts, 0, nq, norms[i])
        elif word == 4:
            for i in range(n_tokens):
                _hist_add(hist1, rows, i, n_blocks, bits, 1, n_blocks, n_codewords, safe, 4, 4, wts, 0, nq, norms[i])
        else:
            for i in range(n_tokens):
                _hist_add(hist1, rows, i, n_blocks, bits, 1, n_blocks, n_codewords, safe, 8, 4, wts, 0, nq, norms[i])
    else:
        for i in range(n_tokens):
            _hist_add(hist1, rows, i, n_blocks, bits, 1, n_blocks, n_codewords, safe, 4, 8, wts, 0, nq, norms[i])


def _norms_py(rows, norms, bits):
    """norms[i] = the fp16 norm of code row i (its two little-endian bytes), bit-exact like
    numba_tables._decode_norms but branch-free. Three passes: the strided one only copies the halves
    (bits[i] = half); the other two run over contiguous arrays (vectorised). Normals and inf / nan:
    the exponent and mantissa bits moved into place (bits[i], read as float32); subnormals and zeros:
    +-m 2^-24 (exact), held in norms[i] while bits[i] is +-0.0; the last pass picks the non-zero one."""
    n = rows.shape[0]
    for i in range(n):
        bits[i] = np.int32(rows[i, 0]) | (np.int32(rows[i, 1]) << np.int32(8))
    for i in range(n):
        half = bits[i]
        em = half & np.int32(0x7FFF)
        sign = (half & np.int32(0x8000)) << np.int32(16)
        small = em < np.int32(0x400)
        shift = np.int32(224 << 23) if em >= np.int32(0x7C00) else np.int32(112 << 23)
        bits[i] = sign if small else ((em << np.int32(13)) + shift) | sign
        m = np.float32(em) * np.float32(2.0 ** -24)
        m = -m if sign != np.int32(0) else m
        norms[i] = m if small else np.float32(0.0)
    value = bits[:n].view(np.float32)
    for i in range(n):
        x = norms[i]
        norms[i] = x if x != np.float32(0.0) else value[i]


def _role_fields_py(n_codewords, bits, blocks, mode, code_size):
    """A role's code-reading constants: (mode, byte positions, word bytes, safe byte fields, safe
    index fields, whether indices >= N can occur). 8-bit indices with N = 256 (mode 0, one block per
    byte) read the [codeword, block, lane] table and histogram in place: mode 2, no byte-table copy."""
    if mode == 0 and bits == 8:
        mode = 2
    per_byte = 8 // bits if mode == 0 else 1
    pos = (blocks + per_byte - 1) // per_byte
    word = 4 if bits <= 25 else 8
    safe_bytes = _safe_fields(pos, 8, code_size - 2, 4)
    safe = _safe_fields(blocks, bits, code_size - 2, word)
    return mode, pos, word, safe_bytes, safe, mode == 1 and n_codewords < (1 << bits)


def _query_table_py(scaled, groups, key_forward, rotated, qmat, key_blocks, kk, lanes):
    """qmat[c, j * lanes + t] = (rotated scaled query t)[j * kk + c]: the key table's right-hand side."""
    dim = scaled.shape[1]
    for t in range(groups):
        for e in range(dim):
            rotated[e] = 0.0
        for d in range(dim):
            x = scaled[t, d]
            for e in range(dim):
                rotated[e] += x * key_forward[d, e]
        for j in range(key_blocks):
            for c in range(kk):
                qmat[c, j * lanes + t] = rotated[j * kk + c]


def _unrotate_add_py(acc, t, value_blocks, vk, lanes, value_inverse, unrot, result):
    """result[t, d] += sum_e acc_t[e] * value_inverse[e, d] (acc_t: lane t of the contracted histogram)."""
    for j in range(value_blocks):
        for c in range(vk):
            unrot[j * vk + c] = acc[c, j * lanes + t]
    value_dim = value_inverse.shape[0]
    for e in range(value_dim):
        x = unrot[e]
        for d in range(value_dim):
            result[t, d] += x * value_inverse[e, d]


def _add_key_mean_py(coded, groups, n_tokens, scaled, key_mean, b, h, dim):
    """Centred keys: add q . mean (scaled query [groups, dim], mean [B, H, dim]) to every coded score."""
    for t in range(groups):
        shift = np.float32(0.0)
        for d in range(dim):
            shift += scaled[t, d] * key_mean[b, h, d]
        for i in range(n_tokens):
            coded[t, i] += shift


def _recall_scores_py(coded, groups, n_tokens, k, picked, best, scaled, cold_keys, bias, has_bias, n_sink, n_b,
                      n_h, b, h):
    """Recall: per row t, picked[t] = the top-k of coded[t, :n_tokens] (biased scores); those scores become
    q . (exact key) + their bias."""
    dim = scaled.shape[1]
    bb = b if bias.shape[0] > 1 else 0
    for t in range(groups):
        _topk_row(coded[t], n_tokens, k, picked[t], best)
        hb = h * groups + t if bias.shape[1] > 1 else 0
        for j in range(k):
            i = picked[t, j]
            row = (i * n_b + b) * n_h + h
            score = np.float32(0.0)
            for d in range(dim):
                score += scaled[t, d] * cold_keys[row, d]
            if has_bias:
                score += bias[bb, hb, n_sink + i]
            coded[t, i] = score


def _decode_step_py(query, out, keys, values, codes, exact, epilogue, recall, scratch, unit_start, unit_stop):
    """out[b, h*G + t] for units [unit_start, unit_stop) of (b, KV head h); returns the count of
    invalid indices (>= N) seen. query [B, Hq, D] (unscaled, unrotated), out [B, Hq, Dv] float32; keys /
    values `CodebookRole`, codes `numba_epilogue.StepCodes`, exact `StepExact`, epilogue `StepEpilogue`,
    recall `RecallRows` (k > 0: recall from the cold rows, module docstring), scratch `StepScratch`, each
    passed as a plain tuple of its fields and named again here: numba types a plain tuple argument in
    its C dispatcher, a NamedTuple in Python (~0.7 us per NamedTuple per call, measured on numba_paged's).

    One function (a numba kernel): the per-unit loop shares a dozen per-call buffers and locals across
    its phases (coded scores, epilogue, value sums), each phase already a compiled helper; split further,
    each piece would take those buffers as arguments again."""
    keys, values, codes = CodebookRole(*keys), CodebookRole(*values), StepCodes(*codes)
    exact, epilogue, recall, scratch = StepExact(*exact), StepEpilogue(*epilogue), RecallRows(*recall), StepScratch(
        *scratch)
    # every array taken out of its structure once: each access in a loop would pay numba's reference count
    key_forward, value_inverse, key_codewords, value_codewords = (keys.rotation, values.rotation, keys.codewords,
                                                                  values.codewords)
    key_bits, value_bits, key_blocks, value_blocks = keys.bits, values.bits, keys.blocks, values.blocks
    key_codes, value_codes, key_norms, value_norms = codes.key_codes, codes.value_codes, codes.key_norms, codes.value_norms
    key_mean, value_mean = codes.key_mean, codes.value_mean
    has_norms, has_key_mean, has_value_mean = codes.has_norms, codes.has_key_mean, codes.has_value_mean
    sink_keys, sink_values, recent_keys, recent_values = (exact.sink_keys, exact.sink_values, exact.recent_keys,
                                                          exact.recent_values)
    new_keys, new_values = exact.new_keys, exact.new_values
    scaling, softcap, bias, sinks = epilogue.scaling, epilogue.softcap, epilogue.bias, epilogue.sinks
    has_bias, has_sinks = epilogue.has_bias, epilogue.has_sinks
    cold_keys, cold_values = recall.cold_keys, recall.cold_values
    table1, lut, hist1, hist, coded = scratch.table1, scratch.lut, scratch.hist1, scratch.hist, scratch.coded
    norms, ibits, lanes = scratch.norms, scratch.ibits, scratch.lanes
    n_b, n_qh, dim = query.shape
    n_h = key_codes.shape[1]
    groups = n_qh // n_h
    n_tokens = key_codes.shape[2]
    n_sink, n_recent, n_new = sink_keys.shape[2], recent_keys.shape[2], new_keys.shape[2]
    n_exact = n_sink + n_recent + n_new
    value_dim = value_inverse.shape[0]
    kn, kk = key_codewords.shape
    key_mode, k_pos, k_word, k_safe_bytes, k_safe, k_check = _role_fields(kn, key_bits, key_blocks, keys.mode,
                                                                          key_codes.shape[3])
    qmat = np.zeros((kk, key_blocks * lanes), dtype=np.float32)
    vn, vk = value_codewords.shape
    value_mode, v_pos, v_word, v_safe_bytes, v_safe, v_check = _role_fields(vn, value_bits, value_blocks,
                                                                            values.mode, value_codes.shape[3])
    acc = np.empty((vk, value_blocks * lanes), dtype=np.float32)

    scaled = np.empty((groups, dim), dtype=np.float32)
    rotated = np.empty(dim, dtype=np.float32)
    exact = np.empty((groups, n_exact), dtype=np.float32)
    total = np.empty(groups, dtype=np.float32)
    coded_total = np.empty(groups, dtype=np.float32)
    result = np.empty((groups, value_dim), dtype=np.float32)
    unrot = np.empty(value_dim, dtype=np.float32)
    key_row = np.empty(dim, dtype=np.float32)  # scratch of _exact_scores / _exact_values (exact_rows)
    exact_rows = np.empty(max(n_sink, n_recent, n_new) * value_dim, dtype=np.float32)
    k = min(recall.k, n_tokens)
    picked = np.empty((groups, max(k, 1)), dtype=np.int64)
    picked_w = np.empty((groups, max(k, 1)), dtype=np.float32)
    best = np.empty(max(k, 1), dtype=np.float32)
    if n_tokens and value_mode != 0:  # the [codeword, block, lane] histogram starts clear; each unit's
        hist1[:vn * value_blocks * lanes] = 0.0  # contraction (`_contract_clear`) leaves it clear again
    bad = 0
    for unit in range(unit_start, unit_stop):
        b = unit // n_h
        h = unit % n_h
        for t in range(groups):
            for d in range(dim):
                scaled[t, d] = query[b, h * groups + t, d] * scaling
        # --- coded scores
        if n_tokens:
            key_rows = key_codes[b, h]
            if has_norms:
                row_norms = key_norms[b, h]
            else:
                _norms(key_rows, norms, ibits)
                row_norms = norms
            if k_check:
                bad += _count_invalid(key_rows, key_bits, key_blocks, kn)
            _query_table(scaled, groups, key_forward, rotated, qmat, key_blocks, kk, lanes)
            _build_table(key_codewords, qmat, table1)
            if key_mode == 0:
                _bytes_table(table1, key_blocks, key_bits, lanes, lut)
            _score_tokens(table1, lut, key_rows, coded, groups, row_norms, key_mode, lanes, key_bits, key_blocks,
                          k_pos, kn, k_safe, k_safe_bytes, k_word)
            if has_key_mean:
                _add_key_mean(coded, groups, n_tokens, scaled, key_mean, b, h, dim)
        # --- the epilogue (numba_epilogue): exact scores, soft-cap, bias, one softmax with the sink logit
        _exact_part_scores(sink_keys, recent_keys, new_keys, b, h, exact, scaled, groups, key_row)
        if k > 0:  # recall (no soft-cap: refused with recall): the bias first, then each row's top-k coded
            if has_bias:  # columns (by biased score) scored exactly, then the softmax
                _add_bias(coded, exact, groups, n_sink, n_tokens, n_exact, bias, b, h)
            _recall_scores(coded, groups, n_tokens, k, picked, best, scaled, cold_keys, bias, has_bias,
                           n_sink, n_b, n_h, b, h)
            _row_weights(coded, exact, groups, n_tokens, n_exact, n_sink, softcap, bias, False, sinks, has_sinks,
                         b, h, coded_total, total, ibits)
            for t in range(groups):
                for j in range(k):  # recalled columns: their weight leaves the coded sums
                    picked_w[t, j] = coded[t, picked[t, j]]
                    coded[t, picked[t, j]] = 0.0
                    coded_total[t] -= picked_w[t, j]
        else:
            _row_weights(coded, exact, groups, n_tokens, n_exact, n_sink, softcap, bias, has_bias, sinks, has_sinks,
                         b, h, coded_total, total, ibits)
        # --- value sums
        for t in range(groups):
            for d in range(value_dim):
                result[t, d] = 0.0
        if n_tokens:
            value_rows = value_codes[b, h]
            if has_norms:
                row_norms = value_norms[b, h]
            else:
                _norms(value_rows, norms, ibits)
                row_norms = norms
            if v_check:
                bad += _count_invalid(value_rows, value_bits, value_blocks, vn)
            if value_mode == 0:
                hist[:v_pos * 256 * lanes] = 0.0
            _hist_tokens(hist1, hist, value_rows, coded, groups, row_norms, value_mode, lanes, value_bits, value_blocks,
                         v_pos, vn, v_safe, v_safe_bytes, v_word)
            if value_mode == 0:
                _spread_bytes(hist, value_blocks, value_bits, lanes, hist1)
            _contract_clear(hist1, value_codewords, acc)
            for t in range(groups):  # un-rotate (inverse = forward.T)
                _unrotate_add(acc, t, value_blocks, vk, lanes, value_inverse, unrot, result)
                if has_value_mean:
                    for d in range(value_dim):
                        result[t, d] += coded_total[t] * value_mean[b, h, d]
        _exact_part_values(sink_values, recent_values, new_values, b, h, exact, result, groups, exact_rows)
        for t in range(groups):
            for j in range(k):
                row = (picked[t, j] * n_b + b) * n_h + h
                for d in range(value_dim):
                    result[t, d] += picked_w[t, j] * cold_values[row, d]
        _write_out(result, total, out, b, h, groups)
    return bad


_KERNEL = None


def scratch_sizes(key_codewords: int, key_blocks: int, key_bits: int, key_mode: int, value_codewords: int,
                  value_blocks: int, value_bits: int, value_mode: int, lanes: int) -> tuple[int, int, int, int]:
    """Floats of the scratch tables table1, lut, hist1, hist of `_decode_step_py` (mode as in numba_kernels)."""
    lut = -(-key_blocks // (8 // key_bits)) * 256 * lanes if key_mode == 0 and key_bits != 8 else 4
    hist = -(-value_blocks // (8 // value_bits)) * 256 * lanes if value_mode == 0 and value_bits != 8 else 4
    return key_codewords * key_blocks * lanes, lut, value_codewords * value_blocks * lanes, hist


def _signature() -> str:
    """The kernel's one signature: each structure as a plain tuple of its fields (in their order;
    tests/kv/attention/test_numba_decode.py holds the two together)."""
    recall = "Tuple((float32[:, ::1], float32[:, ::1], int64))"
    return (f"int64(float32[:, :, ::1], float32[:, :, ::1], {CODEBOOK_ROLE_TYPE}, {CODEBOOK_ROLE_TYPE}, "
            f"{STEP_CODES_TYPE}, {STEP_EXACT_TYPE}, {STEP_EPILOGUE_TYPE}, {recall}, {STEP_SCRATCH_TYPE}, int64, int64)")


def compile_decode_kernel():
    """The fused decode-step dispatcher (numba, disk-cached: `jit.kernel_jit`); binds the helpers of numba_kernels first."""
    global _KERNEL, np, _count_invalid, _safe_fields, _build_table, _bytes_table, _spread_bytes
    global _contract_clear, _lut_sum, _hist_add, _score_tokens, _hist_tokens
    global _norms, _query_table, _unrotate_add, _role_fields, _add_key_mean
    global _exact_part_scores, _exact_part_values, _row_weights, _write_out
    global _topk_row, _recall_scores, _add_bias
    if _KERNEL is not None:
        return _KERNEL
    import fibquant.kv.attention.numba_epilogue as numba_epilogue
    from fibquant.kv.attention.jit import kernel_jit

    import fibquant.kv.attention.numba_kernels as numba_kernels
    from fibquant.kv.attention.kernels import _kernels

    _kernels()  # binds numba_kernels's globals (numpy, helpers, intrinsics)
    np = numba_kernels.np
    numba_epilogue.bind_epilogue()
    _exact_part_scores, _exact_part_values = numba_epilogue._exact_part_scores, numba_epilogue._exact_part_values
    _row_weights, _write_out = numba_epilogue._row_weights, numba_epilogue._write_out
    _add_bias = numba_epilogue._add_bias
    _count_invalid, _safe_fields = numba_kernels._count_invalid, numba_kernels._safe_fields
    _build_table, _bytes_table = numba_kernels._build_table, numba_kernels._bytes_table
    _spread_bytes, _contract_clear = numba_kernels._spread_bytes, numba_kernels._contract_clear
    _lut_sum, _hist_add = numba_kernels._lut_sum, numba_kernels._hist_add
    helper = kernel_jit(nogil=True)
    _score_tokens, _hist_tokens = helper(_score_tokens_py), helper(_hist_tokens_py)
    _norms = helper(_norms_py)
    _query_table, _unrotate_add = helper(_query_table_py), helper(_unrotate_add_py)
    _role_fields = helper(_role_fields_py)
    _add_key_mean = helper(_add_key_mean_py)
    from fibquant.kv.attention.numba_recall import _topk_row_py

    _topk_row = helper(_topk_row_py)
    _recall_scores = helper(_recall_scores_py)  # binds _topk_row: compiled after it
    _KERNEL = kernel_jit(_signature(), nogil=True)(_decode_step_py)
    return _KERNEL
