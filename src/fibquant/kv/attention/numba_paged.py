"""The fused one-token decode step of `numba_decode`, reading each sequence's codes in place from
paged storage (vLLM's KV pages) through its block-table row, for exactly its own coded range.

`paged_step` (prepared by `fibquant.kv.attention.paged.paged_decode_attention`) does, per unit
(sequence b, KV head h) and the G = Hq / Hkv query heads that read it, what `numba_decode`'s
`decode_step` does over a `CodedKV`, with one difference: the coded positions [start_b, stop_b)
of sequence b are not a contiguous [M, C] row block but slots of pages

    position p  ->  pages[tables[b, p // block_size], h, p % block_size, offset : offset + code_size]

so the token loops (`_score_tokens`, `_hist_tokens` of numba_decode, the same lookup-table and
histogram intrinsics; for FibQuant's 4-bit codes, when the caller's flags ask, decode-then-dot by vector
gathers instead: `_gather_scores`, `_gather_values`; for 4-bit codes of 16 scalar codewords (k = 1),
decode-then-dot in registers by variable permutes: `_perm_scores`, `_perm_values`) run block by block over 2-d strided views of the pages, writing the scores
of block j into columns [j * block_size - start_b, ...) of the row's score scratch. No codes are
copied, and no sequence is padded to the longest: the work of sequence b is its own length.

Exact columns (the sinks and the recent window the caller keeps beside the pages, read in place
from the caller's window slabs through `exact_rows`, and the new token) are float dot products
over rows converted once to float32 (vectorised: numba_decode's `_exact_scores`, `_exact_values`); every
column of the row (and a learned sink logit) goes through one softmax. No additive bias: each sequence sees all of its own columns.
Block ids outside [0, num_blocks) are counted (the caller raises) and skipped, never read.

The query, the exact parts and `out` are float32 or bf16 bits (uint16 views of the model's bf16
tensors: `intrinsics._build_bf16`), any strides: the caller passes vLLM's tensors as they are,
with no float32 copies in and no bf16 conversion out (one compiled variant per combination).
"""
from __future__ import annotations

np = None
_count_invalid = _role_fields = None
_build_table = _bytes_table = _spread_bytes = None
_score_tokens = _hist_tokens = None
_norms = None
_as_f32 = _from_f32 = None
_exact_scores = _exact_values = _contract_dot = _rotate_rows = None
_softmax_row = None
_g_scores = _g_values = _gather_scores = _gather_values = _gather_ok = None
_p_scores = _p_values = _perm_scores = _perm_values = _perm_ok = None
# flags bits: decode-then-dot for the keys / values when their codes allow it (vector gathers: `_gather_ok`;
# in-register permutes of 16 scalar codewords: `_perm_ok`)
GATHER_KEYS, GATHER_VALUES = 16, 32


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


def _paged_step_py(query, scaling, key_forward, value_inverse, key_codewords, value_codewords, pages, tables,
                   starts, stops, key_offset, key_size, value_offset, value_size, exact_keys, exact_values,
                   exact_rows, n_exact_in, record_slots, new_keys, new_values, sinks, out, flags, key_bits,
                   value_bits, key_blocks, value_blocks, key_mode, value_mode, lanes, table1, lut, hist1, hist,
                   coded, norms, ibits, unit_start, unit_stop):
    """out[b, h*G + t] for units [unit_start, unit_stop) of (b, KV head h); returns the count of
    invalid indices (>= N) and out-of-range block ids seen. query [B, Hq, D] (unscaled, unrotated),
    pages uint8 [num_blocks, H, block_size, slot] (any strides, slot bytes contiguous), tables
    int32 [B, max_blocks], starts / stops int64 [B] (coded positions [start, stop)), exact window
    exact_keys / exact_values [R, H, >= n, D] of which sequence b reads the first n = n_exact_in (may
    be 0) columns of row exact_rows[b] (int64 [B], in [0, R): e.g. the rows of the caller's window
    slabs, read in place), new_keys / new_values [B, H, n_new, D], sinks [Hq] (read when flags bit 3),
    out [B, Hq, Dv]; query, exact parts and out float32 or bf16 bits (uint16); the exact and new parts
    C-contiguous, query and out any strides. record_slots int64 [B]: where record_slots[b] >= 0 the new
    token (n_new = 1) is written into column record_slots[b] of its exact row once the unit has read it
    (a decode step's window record, fused: the caller keeps the rows distinct, so no unit reads a
    column another one writes). flags bits 4 / 5 (`GATHER_KEYS`,
    `GATHER_VALUES`): the keys / values, when their codes allow it (`_gather_ok`: FibQuant at 4 bits;
    `_perm_ok`: 4-bit codes of 16 scalar codewords), are read by decode-then-dot (`_gather_scores`,
    `_gather_values`; `_perm_scores`, `_perm_values`) instead of the lookup table / histogram (the same
    sums to float32 rounding).
    Scratch as `numba_decode.scratch_sizes`, coded [lanes, >= max coded tokens], norms and ibits
    (int32) [>= that].

    Three passes: (1) every query row of the units scaled and rotated (`_rotate_rows`: one matrix
    product for all rows); (2) per unit the tables, scores, softmax and value histogram, whose contraction is
    kept in the rotated basis, with the unit's exact weights; (3) every row's coded sum un-rotated
    in one pass, then the exact values added and the row normalised."""
    n_b, n_qh, dim = query.shape
    n_h = pages.shape[1]
    block_size = pages.shape[2]
    n_pages = pages.shape[0]
    groups = n_qh // n_h
    n_new = new_keys.shape[2]
    n_exact = n_exact_in + n_new
    value_dim = value_inverse.shape[0]
    has_sinks = (flags & 8) != 0
    kn, kk = key_codewords.shape
    key_mode, k_pos, k_word, k_safe_bytes, k_safe, k_check = _role_fields(kn, key_bits, key_blocks, key_mode,
                                                                          key_size)
    qmat = np.zeros((kk, key_blocks * lanes), dtype=np.float32)
    vn, vk = value_codewords.shape
    value_mode, v_pos, v_word, v_safe_bytes, v_safe, v_check = _role_fields(vn, value_bits, value_blocks,
                                                                            value_mode, value_size)
    acc = np.empty((vk, value_blocks * lanes), dtype=np.float32)
    # Decode-then-dot where the codes allow it: at 4 bits (k = 2, 32 blocks) the table / histogram
    # are 128 KB each (beyond L1) and the histogram needs its contraction; gathers from the 2 KB
    # codebook replace both (values 23 -> 15 us, scores 19 -> 18 us per 1,024 tokens, table build incl.).
    # 4-bit codes of 16 scalar codewords (k = 1) decode in registers instead (`_perm_ok`): the byte
    # table / histogram of their 32 index bytes is as large, and no gather is needed.
    k_gather = (flags & GATHER_KEYS) != 0 and _gather_ok(key_mode, key_codewords, key_blocks, groups)
    v_gather = (flags & GATHER_VALUES) != 0 and _gather_ok(value_mode, value_codewords, value_blocks, groups)
    k_perm = (flags & GATHER_KEYS) != 0 and _perm_ok(key_mode, key_codewords, key_bits, key_blocks, groups)
    v_perm = (flags & GATHER_VALUES) != 0 and _perm_ok(value_mode, value_codewords, value_bits, value_blocks,
                                                       groups)
    k_direct, v_direct = k_gather or k_perm, v_gather or v_perm  # decode-then-dot: no tables / histograms
    value_codewords_t = np.ascontiguousarray(value_codewords.T)  # [vk, vn]: the contraction's left factor

    n_rows = (unit_stop - unit_start) * groups  # query rows of this call's units: row u * G + t
    scaled = np.empty((n_rows, dim), dtype=np.float32)
    rotated = np.empty((n_rows, dim), dtype=np.float32)
    weights = np.empty((n_rows, n_exact), dtype=np.float32)  # each row's exact weights (unnormalised)
    total = np.empty(n_rows, dtype=np.float32)
    coded_sum = np.zeros((n_rows, value_dim), dtype=np.float32)  # coded value sums, rotated basis
    result = np.empty((n_rows, value_dim), dtype=np.float32)
    if value_mode != 0 and not v_direct:  # the [codeword, block, lane] histogram starts clear; each unit's contraction clears it
        hist1[:vn * value_blocks * lanes] = 0.0
    key_row = np.empty(dim, dtype=np.float32)
    value_rows = np.empty(max(n_exact_in, n_new) * value_dim, dtype=np.float32)
    # --- (1) the queries, scaled, then rotated by the key codec: all rows in one pass
    for unit in range(unit_start, unit_stop):
        b = unit // n_h
        q0 = (unit % n_h) * groups
        o = (unit - unit_start) * groups
        for t in range(groups):
            for d in range(dim):
                scaled[o + t, d] = _as_f32(query[b, q0 + t, d]) * scaling
    _rotate_rows(scaled, key_forward, rotated, n_rows)
    bad = 0
    # --- (2) per unit: coded and exact scores, one softmax, the coded value sums (rotated)
    for unit in range(unit_start, unit_stop):
        b = unit // n_h
        h = unit % n_h
        o = (unit - unit_start) * groups
        r = exact_rows[b]
        start = starts[b]
        stop = stops[b]
        n_tokens = stop - start if stop > start else 0
        first_block = start // block_size
        last_block = (stop + block_size - 1) // block_size
        unit_scaled = scaled[o:o + groups]
        exact = weights[o:o + groups]
        if n_tokens and not k_direct:
            for t in range(groups):  # the key table's right-hand side (lanes >= G stay 0)
                for j in range(key_blocks):
                    for c in range(kk):
                        qmat[c, j * lanes + t] = rotated[o + t, j * kk + c]
            _build_table(key_codewords, qmat, table1)
            if key_mode == 0:
                _bytes_table(table1, key_blocks, key_bits, lanes, lut)
        if n_tokens:
            for j in range(first_block, last_block):
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
                rows = pages[page, h, lo - j * block_size:hi - j * block_size, key_offset:key_offset + key_size]
                block_norms = norms[base:base + hi - lo]
                if not k_perm:  # the in-register path reads the fp16 norms itself
                    _norms(rows, block_norms, ibits)
                if k_check:
                    bad += _count_invalid(rows, key_bits, key_blocks, kn)
                if k_perm:
                    _perm_scores(key_codewords, rows, rotated, o, coded[:, base:base + hi - lo], groups, key_blocks)
                elif k_gather:
                    _gather_scores(key_codewords, rows, rotated, o, block_norms, coded[:, base:base + hi - lo], groups,
                                   key_blocks)
                else:
                    _score_tokens(table1, lut, rows, coded[:, base:base + hi - lo], groups, block_norms, key_mode,
                                  lanes, key_bits, key_blocks, k_pos, kn, k_safe, k_safe_bytes, k_word)
        # --- exact scores: columns [the caller's exact window, the new token]
        _exact_scores(exact_keys, r, h, n_exact_in, 0, exact, unit_scaled, groups, key_row)
        _exact_scores(new_keys, b, h, n_new, n_exact_in, exact, unit_scaled, groups, key_row)
        # --- one softmax over the row (and the sink logit)
        for t in range(groups):
            sink_logit = np.float32(sinks[h * groups + t]) if has_sinks else np.float32(-np.inf)
            total[o + t] = _softmax_row(coded[t], n_tokens, exact[t], n_exact, sink_logit, ibits)[1]
        # --- coded value sums, block by block (left in the rotated basis: un-rotated in pass 3)
        if n_tokens:
            if value_mode == 0 and not v_direct:
                hist[:v_pos * 256 * lanes] = 0.0
            for j in range(first_block, last_block):
                lo = max(start, j * block_size)
                hi = min(stop, (j + 1) * block_size)
                base = lo - start
                page = tables[b, j]
                if page < 0 or page >= n_pages:
                    continue
                rows = pages[page, h, lo - j * block_size:hi - j * block_size, value_offset:value_offset + value_size]
                block_norms = norms[base:base + hi - lo]
                if not v_perm:
                    _norms(rows, block_norms, ibits)
                if v_check:
                    bad += _count_invalid(rows, value_bits, value_blocks, vn)
                if v_perm:  # straight into the unit's rows of coded_sum (rotated basis, zero so far)
                    _perm_values(value_codewords, rows, coded[:, base:base + hi - lo], coded_sum, o, groups,
                                 value_blocks)
                elif v_gather:  # straight into the unit's rows of coded_sum (rotated basis, zero so far)
                    _gather_values(value_codewords, rows, coded[:, base:base + hi - lo], block_norms, coded_sum, o,
                                   groups, value_blocks)
                else:
                    _hist_tokens(hist1, hist, rows, coded[:, base:base + hi - lo], groups, block_norms, value_mode,
                                 lanes, value_bits, value_blocks, v_pos, vn, v_safe, v_safe_bytes, v_word)
            if not v_direct:
                if value_mode == 0:
                    _spread_bytes(hist, value_blocks, value_bits, lanes, hist1)
                _contract_dot(hist1, value_codewords_t, acc)
                for t in range(groups):  # lane t of the contraction, as numba_decode._unrotate_add lays it out
                    for j in range(value_blocks):
                        for c in range(vk):
                            coded_sum[o + t, j * vk + c] = acc[c, j * lanes + t]
    # --- (3) every row's coded sum un-rotated (inverse = forward.T) in one product, then the exact values
    _rotate_rows(coded_sum, value_inverse, result, n_rows)
    for unit in range(unit_start, unit_stop):
        b = unit // n_h
        h = unit % n_h
        o = (unit - unit_start) * groups
        unit_result = result[o:o + groups]
        exact = weights[o:o + groups]
        _exact_values(exact_values, exact_rows[b], h, n_exact_in, 0, exact, unit_result, groups, value_rows)
        _exact_values(new_values, b, h, n_new, n_exact_in, exact, unit_result, groups, value_rows)
        slot = record_slots[b]
        if slot >= 0:  # the window record, after this unit's last read of its exact row
            for d in range(dim):
                exact_keys[exact_rows[b], h, slot, d] = new_keys[b, h, 0, d]
            for d in range(value_dim):
                exact_values[exact_rows[b], h, slot, d] = new_values[b, h, 0, d]
        for t in range(groups):
            scale = np.float32(1.0) / total[o + t] if total[o + t] > 0 else np.float32(0.0)
            for d in range(value_dim):
                out[b, h * groups + t, d] = _from_f32(unit_result[t, d] * scale, out)
    return bad


_KERNELS: dict = {}


def compile_paged_kernel(inputs: str = "float32", output: str = "float32"):
    """The paged decode-step dispatcher (numba, disk-cached: `jit.kernel_jit`) for query / exact parts of dtype `inputs`
    and out of dtype `output` ("float32" or "uint16": bf16 bits); binds numba_decode's helpers first.
    One dispatcher per combination, each compiled for its one signature (arguments of another
    layout are converted, never compiled anew)."""
    global np, _count_invalid, _role_fields, _build_table, _bytes_table, _spread_bytes
    global _score_tokens, _hist_tokens, _norms
    global _as_f32, _from_f32, _exact_scores, _exact_values
    global _contract_dot, _rotate_rows, _g_scores, _g_values, _gather_scores, _gather_values, _gather_ok
    global _p_scores, _p_values, _perm_scores, _perm_values, _perm_ok, _softmax_row
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
    np = numba_decode.np
    _as_f32, _from_f32 = _build_bf16()
    _count_invalid, _role_fields = numba_decode._count_invalid, numba_decode._role_fields
    _build_table, _bytes_table = numba_decode._build_table, numba_decode._bytes_table
    _spread_bytes = numba_decode._spread_bytes
    _score_tokens, _hist_tokens = numba_decode._score_tokens, numba_decode._hist_tokens
    _norms = numba_decode._norms
    # the exact window's columns, read in place (float32 or bf16 bits, C arrays: vectorised conversion)
    _exact_scores = kernel_jit(nogil=True, fastmath={"reassoc", "nsz", "contract"})(numba_epilogue._exact_scores_py)
    _exact_values = kernel_jit(nogil=True)(numba_epilogue._exact_values_py)
    _softmax_row = numba_epilogue._softmax_row  # the shared epilogue's (bound by numba_decode's compile)
    _rotate_rows = kernel_jit(nogil=True)(_rotate_rows_py)
    _contract_dot = kernel_jit(nogil=True)(_contract_dot_py)
    _g_scores, _g_values = _build_gathers()
    _gather_ok = kernel_jit(nogil=True)(_gather_ok_py)
    _gather_scores = kernel_jit(nogil=True)(_gather_scores_py)
    _gather_values = kernel_jit(nogil=True)(_gather_values_py)
    _p_scores, _p_values = _build_permutes()
    _perm_ok = kernel_jit(nogil=True)(_perm_ok_py)
    _perm_scores = kernel_jit(nogil=True)(_perm_scores_py)
    _perm_values = kernel_jit(nogil=True)(_perm_values_py)
    part = f"{inputs}[:, :, :, ::1]"  # exact / new parts: C arrays (the caller makes them so, `paged._c_part`)
    signature = (f"int64({inputs}[:, :, :], float32, float32[:, ::1], float32[:, ::1], float32[:, ::1], "
                 "float32[:, ::1], uint8[:, :, :, :], int32[:, :], int64[::1], int64[::1], int64, int64, int64, "
                 f"int64, {part}, {part}, int64[::1], int64, int64[::1], {part}, {part}, float32[::1], "
                 f"{output}[:, :, :], "
                 "int64, int64, int64, int64, int64, int64, int64, int64, float32[::1], float32[::1], float32[::1], "
                 "float32[::1], float32[:, ::1], float32[::1], int32[::1], int64, int64)")
    kernel = _KERNELS[inputs, output] = kernel_jit(signature, nogil=True)(_paged_step_py)
    return kernel
