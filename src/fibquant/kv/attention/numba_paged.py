"""The fused one-token decode step of `numba_decode`, reading each sequence's codes in place from
paged storage (vLLM's KV pages) through its block-table row, for exactly its own coded range.

`paged_step` (prepared by `fibquant.kv.attention.paged`) does, per unit (sequence b, KV head h) and
the G = Hq / Hkv query heads that read it, what `numba_decode`'s `decode_step` does over a
`CodedKV`, with one difference: the coded positions [start_b, stop_b) of sequence b are not a
contiguous [M, C] row block but slots of pages

    position p  ->  pages[tables[b, p // block_size], h, p % block_size, offset : offset + code_size]

so the token loops (`_score_tokens`, `_hist_tokens` of numba_decode, the same lookup-table and
histogram intrinsics; for FibQuant's 4-bit codes, when the role asks, decode-then-dot by vector
gathers instead: `_gather_scores`, `_gather_values`; for 4-bit codes of 16 scalar codewords (k = 1),
decode-then-dot in registers by variable permutes: `_perm_scores`, `_perm_values`) run block by
block over 2-d strided views of the pages, writing the scores of block j into columns
[j * block_size - start_b, ...) of the row's score scratch. No codes are copied, and no sequence is
padded to the longest: the work of sequence b is its own length.

Exact columns (the sinks and the recent window the caller keeps beside the pages, read in place
from the caller's window slabs through `ExactParts.rows`, and the new token) are float dot products
over rows converted once to float32 (`numba_epilogue._exact_scores`, `_exact_values`); the row's
weights come from the epilogue every one-token step shares (`numba_epilogue._row_weights`:
soft-capping, one softmax with a learned sink logit). No additive bias: each sequence sees all of
its own columns. Block ids outside [0, num_blocks) are counted (the caller raises) and skipped,
never read.

The kernel's arguments are the query, the output and five small structures (`PagedRole` of the keys
and of the values, `PagedCodes`, `ExactParts`, `PagedEpilogue`) plus the per-thread `numba_decode.StepScratch`.
The query, the exact parts and `out` are float32 or bf16 bits (uint16 views of the model's bf16
tensors: `intrinsics._build_bf16`), any strides: the caller passes vLLM's tensors as they are,
with no float32 copies in and no bf16 conversion out (one compiled variant per combination, each
for one signature).
"""
from __future__ import annotations

from typing import NamedTuple

from fibquant.kv.attention.numba_decode import STEP_SCRATCH_TYPE, StepScratch

np = None
_count_invalid = _role_fields = None
_build_table = _bytes_table = _spread_bytes = None
_score_tokens = _hist_tokens = None
_norms = None
_as_f32 = _from_f32 = None
_exact_scores = _exact_values = _row_weights = None  # numba_epilogue's
_contract_dot = _rotate_rows = None
_g_scores = _g_values = _gather_scores = _gather_values = _gather_ok = None
_p_scores = _p_values = _perm_scores = _perm_values = _perm_ok = None
_reader = _coded_scores = _coded_values = _finish_unit = _check_call = None


class PagedRole(NamedTuple):
    """One role (the keys or the values) as the kernel reads it: the code family's rotated codebook
    (`codebook_step.codec_plan`) and where its code lies in a slot."""

    rotation: object   # float32 [D, D] (C): keys: the forward rotation (queries into the codes' basis);
    #                    values: its inverse (the coded sums back out)
    codewords: object  # float32 [N, k] (C)
    offset: int        # the code's first byte in a slot
    size: int          # the code's bytes ([fp16 norm][packed indices])
    bits: int          # bits per index
    blocks: int        # codeword blocks per row (D / k)
    mode: int          # the index layout (`kernels._numba_mode`)
    direct: bool       # decode-then-dot where the codes allow it (`_reader`; `AttentionOptions.gather_decode`)


class PagedCodes(NamedTuple):
    """Where each sequence's coded positions lie: position p in [starts[b], stops[b]) of sequence b
    is slot p % block_size of page tables[b, p // block_size]."""

    pages: object   # uint8 [num_blocks, Hkv, block_size, slot bytes], any strides, each slot's bytes contiguous
    tables: object  # int32 [B, max_blocks]
    starts: object  # int64 [B] (C)
    stops: object   # int64 [B] (C)


class ExactParts(NamedTuple):
    """Each sequence's exact columns: the first `count` columns of row rows[b] of the window, then its
    new tokens."""

    keys: object          # [R, Hkv, >= count, D] (C): e.g. the caller's window slabs, read in place
    values: object        # [R, Hkv, >= count, Dv] (C)
    rows: object          # int64 [B] (C), in [0, R)
    count: int
    new_keys: object      # [B, Hkv, n_new, D] (C)
    new_values: object    # [B, Hkv, n_new, Dv] (C)
    record_slots: object  # int64 [B] (C): where >= 0, sequence b's new token (n_new = 1) is written into that
    #                       column of its window row once its units have read it (a decode step's window
    #                       record, fused: the caller keeps the rows distinct, so no unit reads a column
    #                       another one writes)


class PagedEpilogue(NamedTuple):
    """The model's attention options the kernel applies (the shared epilogue's, `numba_epilogue.Epilogue`)."""

    scaling: float  # float32: the score scale
    softcap: float  # float32: c of tanh(s / c) * c (Gemma 2), 0 for none
    sinks: object   # float32 [Hq] learned sink logits (gpt-oss), or an empty array for none


def _rotate_rows_py(rows, matrix, out, n):
    """out[:n] = rows[:n] @ matrix (rows [>= n, D_in], matrix [D_in, D_out], out [>= n, D_out], all C
    arrays): one BLAS call for every query row of a call (numba's np.dot: scipy's sgemm), where a
    numba loop per row waits on its own store -> load chain at every d (36 rows, 2 x 64 x 64: ~4 us
    against ~8 us looped over all rows at once, ~10 us one row at a time, loaded machine)."""
    if n:
        np.dot(rows[:n], matrix, out[:n])


def _contract_dot_py(hist1, codewords_t, acc):
    """acc[c, x] = sum_n codewords_t[c, n] * hist1[n * width + x] (width = acc.shape[1]) as one BLAS
    product, then hist1[:N * width] zeroed for the next unit. numba_tables' `_contract_clear` does the
    same sums one histogram row at a time (bitwise the transformers kernels' order) at ~2 MACs per
    cycle; sgemm's blocked sums: ~5-7 us -> ~2-3 us per unit (4 bits, 2 bits: 256 x 128 / 256 x 64
    histograms), equal to float32 rounding."""
    n_codewords = codewords_t.shape[1]
    size = n_codewords * acc.shape[1]
    np.dot(codewords_t, hist1[:size].reshape((n_codewords, acc.shape[1])), acc)
    hist1[:size] = 0.0


def _gather_ok_py(mode, codewords, blocks, groups):
    """Whether a role takes the gather path: whole index bytes into 256 codewords (`_role_fields`
    mode 2) of k = 2 floats, D = 64 or 128, at most 4 query heads per KV head (`intrinsics._build_gathers`)."""
    return mode == 2 and codewords.shape[1] == 2 and (blocks == 32 or blocks == 64) and 1 <= groups <= 4


def _gather_scores_py(codewords, rows, rotated, q0, norms, res, groups, blocks):
    """res[t, i] = norms[i] * rotated[q0 + t] . (decoded row i) for t < groups (literal variants)."""
    n = rows.shape[0]
    if blocks == 32:
        if groups == 3:
            _g_scores(codewords, rows, n, 4, 3, rotated, q0, norms, res)
        elif groups == 4:
            _g_scores(codewords, rows, n, 4, 4, rotated, q0, norms, res)
        elif groups == 2:
            _g_scores(codewords, rows, n, 4, 2, rotated, q0, norms, res)
        else:
            _g_scores(codewords, rows, n, 4, 1, rotated, q0, norms, res)
    elif groups == 3:
        _g_scores(codewords, rows, n, 8, 3, rotated, q0, norms, res)
    elif groups == 4:
        _g_scores(codewords, rows, n, 8, 4, rotated, q0, norms, res)
    elif groups == 2:
        _g_scores(codewords, rows, n, 8, 2, rotated, q0, norms, res)
    else:
        _g_scores(codewords, rows, n, 8, 1, rotated, q0, norms, res)


def _gather_values_py(codewords, rows, wts, norms, acc, a0, groups, blocks):
    """acc[a0 + t] += sum_i wts[t, i] * norms[i] * (decoded row i) for t < groups (literal variants)."""
    n = rows.shape[0]
    if blocks == 32:
        if groups == 3:
            _g_values(codewords, rows, n, 4, 3, wts, norms, acc, a0)
        elif groups == 4:
            _g_values(codewords, rows, n, 4, 4, wts, norms, acc, a0)
        elif groups == 2:
            _g_values(codewords, rows, n, 4, 2, wts, norms, acc, a0)
        else:
            _g_values(codewords, rows, n, 4, 1, wts, norms, acc, a0)
    elif groups == 3:
        _g_values(codewords, rows, n, 8, 3, wts, norms, acc, a0)
    elif groups == 4:
        _g_values(codewords, rows, n, 8, 4, wts, norms, acc, a0)
    elif groups == 2:
        _g_values(codewords, rows, n, 8, 2, wts, norms, acc, a0)
    else:
        _g_values(codewords, rows, n, 8, 1, wts, norms, acc, a0)


def _perm_ok_py(mode, codewords, bits, blocks, groups):
    """Whether a role takes the in-register path: 4-bit indices, two per byte (`_role_fields` mode 0),
    into 16 scalar codewords (k = 1, N = 16), D = 64 or 128, at most 4 query heads per KV head
    (`intrinsics._build_permutes`)."""
    return (mode == 0 and bits == 4 and codewords.shape[0] == 16 and codewords.shape[1] == 1
            and (blocks == 64 or blocks == 128) and 1 <= groups <= 4)


def _perm_scores_py(codewords, rows, rotated, q0, res, groups, blocks):
    """res[t, i] = (row i's norm) * rotated[q0 + t] . (decoded row i) for t < groups (literal variants)."""
    n = rows.shape[0]
    if blocks == 64:
        if groups == 3:
            _p_scores(codewords, rows, n, 4, 3, rotated, q0, res)
        elif groups == 4:
            _p_scores(codewords, rows, n, 4, 4, rotated, q0, res)
        elif groups == 2:
            _p_scores(codewords, rows, n, 4, 2, rotated, q0, res)
        else:
            _p_scores(codewords, rows, n, 4, 1, rotated, q0, res)
    elif groups == 3:
        _p_scores(codewords, rows, n, 8, 3, rotated, q0, res)
    elif groups == 4:
        _p_scores(codewords, rows, n, 8, 4, rotated, q0, res)
    elif groups == 2:
        _p_scores(codewords, rows, n, 8, 2, rotated, q0, res)
    else:
        _p_scores(codewords, rows, n, 8, 1, rotated, q0, res)


def _perm_values_py(codewords, rows, wts, acc, a0, groups, blocks):
    """acc[a0 + t] += sum_i wts[t, i] * (row i's norm) * (decoded row i) for t < groups (literal variants)."""
    n = rows.shape[0]
    if blocks == 64:
        if groups == 3:
            _p_values(codewords, rows, n, 4, 3, wts, acc, a0)
        elif groups == 4:
            _p_values(codewords, rows, n, 4, 4, wts, acc, a0)
        elif groups == 2:
            _p_values(codewords, rows, n, 4, 2, wts, acc, a0)
        else:
            _p_values(codewords, rows, n, 4, 1, wts, acc, a0)
    elif groups == 3:
        _p_values(codewords, rows, n, 8, 3, wts, acc, a0)
    elif groups == 4:
        _p_values(codewords, rows, n, 8, 4, wts, acc, a0)
    elif groups == 2:
        _p_values(codewords, rows, n, 8, 2, wts, acc, a0)
    else:
        _p_values(codewords, rows, n, 8, 1, wts, acc, a0)


def _reader_py(role, groups):
    """(fields, gathers, permutes): the role's code-reading constants (numba_decode's `_role_fields`) and
    whether it is read by decode-then-dot (`role.direct`, when its codes allow it: `_gather_ok`,
    `_perm_ok`) instead of the lookup table / histogram (the same sums to float32 rounding). At 4 bits (k = 2, 32 blocks) the table / histogram are 128 KB each (beyond L1) and the
    histogram needs its contraction; gathers from the 2 KB codebook replace both (values 23 -> 15 us,
    scores 19 -> 18 us per 1,024 tokens, table build incl.). 4-bit codes of 16 scalar codewords (k = 1)
    decode in registers instead: the byte table / histogram of their 32 index bytes is as large, and no
    gather is needed."""
    fields = _role_fields(role.codewords.shape[0], role.bits, role.blocks, role.mode, role.size)
    mode = fields[0]
    if not role.direct:
        return fields, False, False
    return (fields, _gather_ok(mode, role.codewords, role.blocks, groups),
            _perm_ok(mode, role.codewords, role.bits, role.blocks, groups))


def _coded_scores_py(role, fields, gather, perm, codes, b, h, rotated, o, groups, scratch, qmat):
    """scratch.coded[t, i] = (rotated query row o + t) . (key at coded position starts[b] + i of unit
    (b, KV head h)), t < G, page by page (-inf for a page id outside the pages). Returns the count of
    invalid indices and page ids seen."""
    mode, pos, word, safe_bytes, safe, check = fields
    # every array taken out of its structure once: each access in a loop would pay numba's reference count
    pages, tables, codewords, table1, lut = codes.pages, codes.tables, role.codewords, scratch.table1, scratch.lut
    coded, norms, ibits, lanes = scratch.coded, scratch.norms, scratch.ibits, scratch.lanes
    offset, size, bits, blocks = role.offset, role.size, role.bits, role.blocks
    start, stop = codes.starts[b], codes.stops[b]
    n_pages, block_size = pages.shape[0], pages.shape[2]
    n_codewords, k = codewords.shape
    if not (gather or perm):
        for t in range(groups):  # the key table's right-hand side (lanes >= G stay 0)
            for j in range(blocks):
                for c in range(k):
                    qmat[c, j * lanes + t] = rotated[o + t, j * k + c]
        _build_table(codewords, qmat, table1)
        if mode == 0:
            _bytes_table(table1, blocks, bits, lanes, lut)
    bad = 0
    for j in range(start // block_size, (stop + block_size - 1) // block_size):
        lo = max(start, j * block_size)
        hi = min(stop, (j + 1) * block_size)
        base = lo - start
        page = tables[b, j]
        if page < 0 or page >= n_pages:
            bad += 1
            for t in range(groups):
                for i in range(hi - lo):
                    coded[t, base + i] = -np.inf
            continue
        rows = pages[page, h, lo - j * block_size:hi - j * block_size, offset:offset + size]
        block_norms = norms[base:base + hi - lo]
        if not perm:  # the in-register path reads the fp16 norms itself
            _norms(rows, block_norms, ibits)
        if check:
            bad += _count_invalid(rows, bits, blocks, n_codewords)
        if perm:
            _perm_scores(codewords, rows, rotated, o, coded[:, base:base + hi - lo], groups, blocks)
        elif gather:
            _gather_scores(codewords, rows, rotated, o, block_norms, coded[:, base:base + hi - lo], groups, blocks)
        else:
            _score_tokens(table1, lut, rows, coded[:, base:base + hi - lo], groups, block_norms, mode, lanes, bits,
                          blocks, pos, n_codewords, safe, safe_bytes, word)
    return bad


def _coded_values_py(role, fields, gather, perm, codes, b, h, o, groups, scratch, codewords_t, acc, coded_sum):
    """coded_sum[o + t] = sum_i scratch.coded[t, i] * (value at coded position starts[b] + i of unit (b, h)),
    t < G, in the values' rotated basis (the caller un-rotates every row at once); pages outside the
    pages skipped (`_coded_scores` counted them). Returns the count of invalid indices seen."""
    mode, pos, word, safe_bytes, safe, check = fields
    pages, tables, codewords, hist1, hist = codes.pages, codes.tables, role.codewords, scratch.hist1, scratch.hist
    coded, norms, ibits, lanes = scratch.coded, scratch.norms, scratch.ibits, scratch.lanes
    offset, size, bits, blocks = role.offset, role.size, role.bits, role.blocks
    start, stop = codes.starts[b], codes.stops[b]
    n_pages, block_size = pages.shape[0], pages.shape[2]
    n_codewords, k = codewords.shape
    direct = gather or perm  # decode-then-dot: straight into the unit's rows of coded_sum (zero so far)
    if mode == 0 and not direct:
        hist[:pos * 256 * lanes] = 0.0
    bad = 0
    for j in range(start // block_size, (stop + block_size - 1) // block_size):
        lo = max(start, j * block_size)
        hi = min(stop, (j + 1) * block_size)
        base = lo - start
        page = tables[b, j]
        if page < 0 or page >= n_pages:
            continue
        rows = pages[page, h, lo - j * block_size:hi - j * block_size, offset:offset + size]
        block_norms = norms[base:base + hi - lo]
        if not perm:
            _norms(rows, block_norms, ibits)
        if check:
            bad += _count_invalid(rows, bits, blocks, n_codewords)
        if perm:
            _perm_values(codewords, rows, coded[:, base:base + hi - lo], coded_sum, o, groups, blocks)
        elif gather:
            _gather_values(codewords, rows, coded[:, base:base + hi - lo], block_norms, coded_sum, o, groups, blocks)
        else:
            _hist_tokens(hist1, hist, rows, coded[:, base:base + hi - lo], groups, block_norms, mode, lanes, bits,
                         blocks, pos, n_codewords, safe, safe_bytes, word)
    if not direct:  # the histogram contracted with the codewords (it is left clear for the next unit)
        if mode == 0:
            _spread_bytes(hist, blocks, bits, lanes, hist1)
        _contract_dot(hist1, codewords_t, acc)
        for t in range(groups):  # lane t of the contraction, as numba_decode._unrotate_add lays it out
            for j in range(blocks):
                for c in range(k):
                    coded_sum[o + t, j * k + c] = acc[c, j * lanes + t]
    return bad


def _finish_unit_py(exact, b, h, weights, result, total, out, groups, value_rows):
    """Unit (b, h)'s exact value sums added to its rows `result` [G, Dv] (its coded sums), the new
    token recorded into its window row where exact.record_slots[b] >= 0 (after the unit's last read of
    that row), then out[b, h*G + t] = result[t] / total[t] (zeros for a row with every column masked)."""
    keys, values, new_keys, new_values = exact.keys, exact.values, exact.new_keys, exact.new_values
    r = exact.rows[b]
    _exact_values(values, r, h, exact.count, 0, weights, result, groups, value_rows)
    _exact_values(new_values, b, h, new_keys.shape[2], exact.count, weights, result, groups, value_rows)
    slot = exact.record_slots[b]
    if slot >= 0:
        for d in range(keys.shape[3]):
            keys[r, h, slot, d] = new_keys[b, h, 0, d]
        for d in range(values.shape[3]):
            values[r, h, slot, d] = new_values[b, h, 0, d]
    for t in range(groups):
        scale = np.float32(1.0) / total[t] if total[t] > 0 else np.float32(0.0)
        for d in range(result.shape[1]):
            out[b, h * groups + t, d] = _from_f32(result[t, d] * scale, out)


def _check_call_py(query, out, codes, exact, scratch):
    """What the kernel's reads and writes rely on, checked here at no cost per call (numba checks no
    bounds; `paged.paged_decode_attention` checks the same in Python with messages naming the argument):
    every per-sequence array holds B entries, the exact rows lie in the window, the coded ranges in
    their table rows and the scratch, the exact count within the window's columns, and the record
    slots within them, for one new token per sequence."""
    n_b = query.shape[0]
    if (out.shape[0] != n_b or out.shape[1] != query.shape[1] or codes.tables.shape[0] < n_b
            or codes.starts.shape[0] < n_b or codes.stops.shape[0] < n_b or exact.rows.shape[0] < n_b
            or exact.record_slots.shape[0] < n_b or exact.new_keys.shape[0] < n_b or exact.new_values.shape[0] < n_b
            or exact.new_keys.shape[2] != exact.new_values.shape[2]):
        raise ValueError("the paged kernel's arrays disagree on the batch, head or new-token counts")
    columns = min(exact.keys.shape[2], exact.values.shape[2])
    if exact.count < 0 or exact.count > columns:
        raise ValueError("exact_count lies outside the exact parts' columns")
    if exact.count + exact.new_keys.shape[2] > scratch.ibits.shape[0]:
        raise ValueError("the scratch holds fewer columns than the exact parts")
    capacity = codes.tables.shape[1] * codes.pages.shape[2]
    tokens = min(scratch.coded.shape[1], scratch.norms.shape[0], scratch.ibits.shape[0])
    for b in range(n_b):
        if exact.rows[b] < 0 or exact.rows[b] >= min(exact.keys.shape[0], exact.values.shape[0]):
            raise ValueError("exact_rows must lie in the exact parts' rows")
        if codes.starts[b] < 0 or codes.stops[b] > capacity or codes.stops[b] - codes.starts[b] > tokens:
            raise ValueError("a coded range [start, stop) lies outside its table row or the scratch")
        if exact.record_slots[b] >= columns or (exact.record_slots[b] >= 0 and exact.new_keys.shape[2] != 1):
            raise ValueError("record_slots must be columns of the exact parts, for one new token per sequence")


def _paged_step_py(query, out, keys, values, codes, exact, epilogue, scratch, unit_start, unit_stop):
    """out[b, h*G + t] for units [unit_start, unit_stop) of (sequence b, KV head h); returns the count of
    invalid indices (>= N) and out-of-range page ids seen (the caller raises). query [B, Hq, D]
    (unscaled, unrotated) and out [B, Hq, Dv], any strides; keys / values `PagedRole`, codes
    `PagedCodes`, exact `ExactParts`, epilogue `PagedEpilogue`, scratch `StepScratch`, each passed as a
    plain tuple of its fields and named again here: numba types a plain tuple argument in its C
    dispatcher, a NamedTuple in Python (~0.7 us per NamedTuple per call, measured).

    Three passes: (1) every query row of the units scaled and rotated (`_rotate_rows`: one matrix
    product for all rows); (2) per unit the coded scores (`_coded_scores`), the exact scores, the
    shared epilogue's weights (`numba_epilogue._row_weights`: soft-capping, one softmax with the sink
    logit) and the coded value sums, kept in the rotated basis (`_coded_values`); (3) every row's coded
    sum un-rotated in one product, then the exact values added and the row normalised (`_finish_unit`)."""
    keys, values, codes = PagedRole(*keys), PagedRole(*values), PagedCodes(*codes)
    exact, epilogue, scratch = ExactParts(*exact), PagedEpilogue(*epilogue), StepScratch(*scratch)
    dim, n_h, value_dim, lanes = query.shape[2], codes.pages.shape[1], values.rotation.shape[0], scratch.lanes
    groups = query.shape[1] // n_h
    n_new = exact.new_keys.shape[2]
    n_exact = exact.count + n_new
    _check_call(query, out, codes, exact, scratch)
    k_fields, k_gather, k_perm = _reader(keys, groups)
    v_fields, v_gather, v_perm = _reader(values, groups)
    qmat = np.zeros((keys.codewords.shape[1], keys.blocks * lanes), dtype=np.float32)
    acc = np.empty((values.codewords.shape[1], values.blocks * lanes), dtype=np.float32)
    codewords_t = np.ascontiguousarray(values.codewords.T)  # [k, N]: the contraction's left factor
    n_rows = (unit_stop - unit_start) * groups  # query rows of this call's units: row u * G + t
    scaled = np.empty((n_rows, dim), dtype=np.float32)
    rotated = np.empty((n_rows, dim), dtype=np.float32)
    weights = np.empty((n_rows, n_exact), dtype=np.float32)  # each row's exact weights (unnormalised)
    total = np.empty(n_rows, dtype=np.float32)
    coded_total = np.empty(groups, dtype=np.float32)
    coded_sum = np.zeros((n_rows, value_dim), dtype=np.float32)  # coded value sums, rotated basis
    result = np.empty((n_rows, value_dim), dtype=np.float32)
    no_bias = np.zeros((1, 1, 1), dtype=np.float32)  # each sequence sees all of its own columns
    # the arrays the unit loops read, taken out of their structures once (numba counts a reference per access)
    sinks, coded, ibits, starts, stops = epilogue.sinks, scratch.coded, scratch.ibits, codes.starts, codes.stops
    exact_keys, new_keys, exact_rows = exact.keys, exact.new_keys, exact.rows
    has_sinks = sinks.shape[0] != 0
    if v_fields[0] != 0 and not (v_gather or v_perm):  # the [codeword, block, lane] histogram starts clear;
        scratch.hist1[:values.codewords.shape[0] * values.blocks * lanes] = 0.0  # each contraction clears it
    key_row = np.empty(dim, dtype=np.float32)
    value_rows = np.empty(max(exact.count, n_new) * value_dim, dtype=np.float32)
    # --- (1) the queries, scaled, then rotated by the key codec: all rows in one pass
    scaling = epilogue.scaling
    for unit in range(unit_start, unit_stop):
        b = unit // n_h
        q0 = (unit % n_h) * groups
        o = (unit - unit_start) * groups
        for t in range(groups):
            for d in range(dim):
                scaled[o + t, d] = _as_f32(query[b, q0 + t, d]) * scaling
    _rotate_rows(scaled, keys.rotation, rotated, n_rows)
    bad = 0
    # --- (2) per unit: coded and exact scores, the epilogue's weights, the coded value sums (rotated)
    for unit in range(unit_start, unit_stop):
        b = unit // n_h
        h = unit % n_h
        o = (unit - unit_start) * groups
        n_tokens = max(stops[b] - starts[b], 0)
        unit_scaled = scaled[o:o + groups]
        unit_weights = weights[o:o + groups]
        if n_tokens:
            bad += _coded_scores(keys, k_fields, k_gather, k_perm, codes, b, h, rotated, o, groups, scratch, qmat)
        # exact scores: columns [the caller's exact window, the new token]
        _exact_scores(exact_keys, exact_rows[b], h, exact.count, 0, unit_weights, unit_scaled, groups, key_row)
        _exact_scores(new_keys, b, h, n_new, exact.count, unit_weights, unit_scaled, groups, key_row)
        _row_weights(coded, unit_weights, groups, n_tokens, n_exact, 0, epilogue.softcap, no_bias, False, sinks,
                     has_sinks, b, h, coded_total, total[o:o + groups], ibits)
        if n_tokens:
            bad += _coded_values(values, v_fields, v_gather, v_perm, codes, b, h, o, groups, scratch, codewords_t,
                                 acc, coded_sum)
    # --- (3) every row's coded sum un-rotated (inverse = forward.T) in one product, then the exact values
    _rotate_rows(coded_sum, values.rotation, result, n_rows)
    for unit in range(unit_start, unit_stop):
        b = unit // n_h
        o = (unit - unit_start) * groups
        _finish_unit(exact, b, unit % n_h, weights[o:o + groups], result[o:o + groups], total[o:o + groups], out,
                     groups, value_rows)
    return bad


_KERNELS: dict = {}


def _signature(inputs: str, output: str) -> str:
    """The kernel's one signature: query and exact parts of dtype `inputs`, out of dtype `output`, each
    structure as a plain tuple of its fields (in their order; tests/kv/attention/test_paged_decode.py
    holds the two together)."""
    part = f"{inputs}[:, :, :, ::1]"  # exact / new parts: C arrays (the caller makes them so, `paged._c_part`)
    role = "Tuple((float32[:, ::1], float32[:, ::1], int64, int64, int64, int64, int64, boolean))"
    codes = "Tuple((uint8[:, :, :, :], int32[:, :], int64[::1], int64[::1]))"
    exact = f"Tuple(({part}, {part}, int64[::1], int64, {part}, {part}, int64[::1]))"
    epilogue = "Tuple((float32, float32, float32[::1]))"
    return (f"int64({inputs}[:, :, :], {output}[:, :, :], {role}, {role}, {codes}, {exact}, {epilogue}, "
            f"{STEP_SCRATCH_TYPE}, int64, int64)")


def compile_paged_kernel(inputs: str = "float32", output: str = "float32"):
    """The paged decode-step dispatcher (numba, disk-cached: `jit.kernel_jit`) for query / exact parts of dtype `inputs`
    and out of dtype `output` ("float32" or "uint16": bf16 bits); binds numba_decode's and the shared
    epilogue's helpers first. One dispatcher per combination, each compiled for its one signature
    (arguments of another layout are converted, never compiled anew)."""
    global np, _count_invalid, _role_fields, _build_table, _bytes_table, _spread_bytes
    global _score_tokens, _hist_tokens, _norms
    global _as_f32, _from_f32, _exact_scores, _exact_values, _row_weights
    global _contract_dot, _rotate_rows, _g_scores, _g_values, _gather_scores, _gather_values, _gather_ok
    global _p_scores, _p_values, _perm_scores, _perm_values, _perm_ok
    global _reader, _coded_scores, _coded_values, _finish_unit, _check_call
    kernel = _KERNELS.get((inputs, output))
    if kernel is not None:
        return kernel
    if inputs not in ("float32", "uint16") or output not in ("float32", "uint16"):
        raise ValueError(f"paged kernel dtypes are float32 or uint16 (bf16 bits), got {inputs} / {output}")
    import fibquant.kv.attention.numba_decode as numba_decode
    import fibquant.kv.attention.numba_epilogue as numba_epilogue
    from fibquant.kv.attention.intrinsics import _build_bf16, _build_gathers, _build_permutes
    from fibquant.kv.attention.jit import kernel_jit

    numba_decode.compile_decode_kernel()  # binds numba_decode's (and numba_kernels') helpers
    numba_epilogue.bind_epilogue()
    np = numba_decode.np
    _as_f32, _from_f32 = _build_bf16()
    _count_invalid, _role_fields = numba_decode._count_invalid, numba_decode._role_fields
    _build_table, _bytes_table = numba_decode._build_table, numba_decode._bytes_table
    _spread_bytes = numba_decode._spread_bytes
    _score_tokens, _hist_tokens = numba_decode._score_tokens, numba_decode._hist_tokens
    _norms = numba_decode._norms
    # the shared epilogue: the exact columns (read in place: C arrays, a vectorised conversion) and the weights
    _exact_scores, _exact_values = numba_epilogue._exact_scores, numba_epilogue._exact_values
    _row_weights = numba_epilogue._row_weights
    helper = kernel_jit(nogil=True)
    _rotate_rows, _contract_dot = helper(_rotate_rows_py), helper(_contract_dot_py)
    _g_scores, _g_values = _build_gathers()
    _gather_ok, _gather_scores, _gather_values = helper(_gather_ok_py), helper(_gather_scores_py), helper(
        _gather_values_py)
    _p_scores, _p_values = _build_permutes()
    _perm_ok, _perm_scores, _perm_values = helper(_perm_ok_py), helper(_perm_scores_py), helper(_perm_values_py)
    _reader, _check_call = helper(_reader_py), helper(_check_call_py)  # bind the helpers above: compiled after
    _coded_scores, _coded_values = helper(_coded_scores_py), helper(_coded_values_py)
    _finish_unit = helper(_finish_unit_py)
    kernel = _KERNELS[inputs, output] = kernel_jit(_signature(inputs, output), nogil=True)(_paged_step_py)
    return kernel
