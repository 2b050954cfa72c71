"""The numba kernels of attention on codes: `coded_scores` / `coded_weighted_sum` over a range of
work units (see `fibquant.kv.attention.kernels`, which validates, dispatches and threads them).
"""
from __future__ import annotations

# The kernels are plain Python functions compiled by `compile_kernels()` on first use. It also
# binds the module globals they call (`np`, the jitted helpers `_decode_norms` ... `_contract`
# of `numba_tables` and the vector intrinsics `_lut_sum`, `_hist_add` of `intrinsics`),
# so numba and llvmlite load only when a kernel first runs.
#
# Work unit: (b, h, tile of L queries), L = `lanes` in {4, 8, 16} (`kernels._lanes`). The tables are
# float32 [., ., L] flattened, the L query lanes contiguous: one L-wide vector load (scores) or
# read-modify-write (weighted sum) per token and position, kept in a vector register by the
# intrinsics (numba's scalar code would keep L scalar chains: without fastmath LLVM does not merge
# them into vector adds, and LLVM's vectoriser does not see through the table lookup).
#   _MODE_BYTES  (w in {1, 2, 4, 8}, N = 2^w): the token loop reads whole index bytes; the table is
#                [index byte p, byte value v, lane] (stride 256 per position: constant address
#                arithmetic), entry = the sum over the 8/w blocks packed in that byte.
#   _MODE_FIELDS (any other w, or N < 2^w): the token loop reads each w-bit field with one
#                little-endian word load + shift + mask; the table is [codeword n, block j, lane].
# Both are derived from the [codeword, block, lane] table, whose build (and the histogram's
# contraction with the codewords) loops over the long contiguous (block, lane) axis, which LLVM
# vectorises.

_MODE_BYTES = 0
_MODE_FIELDS = 1
# Both kernels: (queries, codes, codewords, out, index_bits, n_blocks, mode, lanes, unit_start, unit_stop).
SIGNATURE = ("int64(float32[:, :, :, ::1], uint8[:, :, :, :], float32[:, ::1], "
             "float32[:, :, :, ::1], int64, int64, int64, int64, int64, int64)")

np = None              # numpy, bound by compile_kernels() (kept off this module's import path)
_decode_norms = _count_invalid = _safe_fields = None
_build_table = _bytes_table = _spread_bytes = _contract = _contract_clear = None
_lut_sum = _hist_add = None


def _scores_py(queries, codes, codewords, out, index_bits, n_blocks, mode, lanes, unit_start, unit_stop):
    """coded_scores for units [unit_start, unit_stop) of (b, h, tile of `lanes` queries); returns the
    number of invalid indices (>= N) seen."""
    n_b, n_h, n_q, dim = queries.shape
    n_tokens, code_size = codes.shape[2], codes.shape[3]
    n_codewords, k = codewords.shape
    n_tiles = (n_q + lanes - 1) // lanes
    per_byte = 8 // index_bits if mode == 0 else 1
    n_pos = (n_blocks + per_byte - 1) // per_byte
    width = n_blocks * lanes
    table1 = np.empty(n_codewords * width, dtype=np.float32)                  # [codeword, block, lane]
    lut = np.empty(n_pos * 256 * lanes if mode == 0 else 4, dtype=np.float32)  # [index byte, value, lane]
    qmat = np.empty((k, width), dtype=np.float32)                  # qmat[c, j*L + t] = q[t, j*k + c]
    norms = np.empty(n_tokens, dtype=np.float32)
    word = 4 if index_bits <= 25 else 8  # bytes one whole-word field read loads
    safe_bytes = _safe_fields(n_pos, 8, code_size - 2, 4)
    safe = _safe_fields(n_blocks, index_bits, code_size - 2, word)
    check = mode == 1 and n_codewords < (1 << index_bits)
    bad = 0
    last_bh = -1
    for unit in range(unit_start, unit_stop):
        bh = unit // n_tiles
        q0 = (unit % n_tiles) * lanes
        b = bh // n_h
        h = bh % n_h
        nq = min(lanes, n_q - q0)
        rows = codes[b, h]
        res = out[b, h]
        if bh != last_bh:
            _decode_norms(rows, norms)
            if check:
                bad += _count_invalid(rows, index_bits, n_blocks, n_codewords)
            last_bh = bh
        qmat[:, :] = 0.0
        for t in range(nq):
            for j in range(n_blocks):
                for c in range(k):
                    qmat[c, j * lanes + t] = queries[b, h, q0 + t, j * k + c]
        _build_table(codewords, qmat, table1)
        if mode == 0:
            _bytes_table(table1, n_blocks, index_bits, lanes, lut)
        # res[q0 + t, i] = nu_i * (sum over the positions of token i of its table entries)[t]. The
        # calls differ only in literal arguments (lanes, bits, strides): constants in the loop code.
        if mode == 0:
            if lanes == 4:
                for i in range(n_tokens):
                    _lut_sum(lut, rows, i, n_pos, 8, 256, 1, 256, safe_bytes, 4, 4, res, q0, nq, norms[i])
            elif lanes == 8:
                for i in range(n_tokens):
                    _lut_sum(lut, rows, i, n_pos, 8, 256, 1, 256, safe_bytes, 4, 8, res, q0, nq, norms[i])
            else:
                for i in range(n_tokens):
                    _lut_sum(lut, rows, i, n_pos, 8, 256, 1, 256, safe_bytes, 4, 16, res, q0, nq, norms[i])
        elif lanes == 4:
            if index_bits == 10:    # FibQuant N = 1024: literal width, constant shifts
                for i in range(n_tokens):
                    _lut_sum(table1, rows, i, n_blocks, 10, 1, n_blocks, n_codewords, safe, 4, 4, res, q0, nq, norms[i])
            elif index_bits == 12:  # FibQuant N = 4096
                for i in range(n_tokens):
                    _lut_sum(table1, rows, i, n_blocks, 12, 1, n_blocks, n_codewords, safe, 4, 4, res, q0, nq, norms[i])
            elif word == 4:
                for i in range(n_tokens):
                    _lut_sum(table1, rows, i, n_blocks, index_bits, 1, n_blocks, n_codewords, safe,
                             4, 4, res, q0, nq, norms[i])
            else:
                for i in range(n_tokens):
                    _lut_sum(table1, rows, i, n_blocks, index_bits, 1, n_blocks, n_codewords, safe,
                             8, 4, res, q0, nq, norms[i])
        else:  # 8 lanes (_lanes never gives fields mode 16 lanes, nor 8 lanes with 8-byte words)
            if index_bits == 10:
                for i in range(n_tokens):
                    _lut_sum(table1, rows, i, n_blocks, 10, 1, n_blocks, n_codewords, safe, 4, 8, res, q0, nq, norms[i])
            elif index_bits == 12:
                for i in range(n_tokens):
                    _lut_sum(table1, rows, i, n_blocks, 12, 1, n_blocks, n_codewords, safe, 4, 8, res, q0, nq, norms[i])
            else:
                for i in range(n_tokens):
                    _lut_sum(table1, rows, i, n_blocks, index_bits, 1, n_blocks, n_codewords, safe,
                             4, 8, res, q0, nq, norms[i])
    return bad


def _weighted_sum_py(weights, codes, codewords, out, index_bits, n_blocks, mode, lanes, unit_start, unit_stop):
    """coded_weighted_sum for units [unit_start, unit_stop) of (b, h, tile of `lanes` queries); returns
    the number of invalid indices (>= N) seen.

    It stays one function: a numba nopython kernel whose length is mostly the literal variants of the `_hist_add`
    call (lanes and index bits passed as constants, so the intrinsic's loop is unrolled with constant shifts; a
    helper taking them as arguments would make them run-time values again); its scratch tables are allocated
    once per call and reused by every unit."""
    n_b, n_h, n_q, n_tokens = weights.shape
    code_size = codes.shape[3]
    n_codewords, k = codewords.shape
    n_tiles = (n_q + lanes - 1) // lanes
    per_byte = 8 // index_bits if mode == 0 else 1
    n_pos = (n_blocks + per_byte - 1) // per_byte
    width = n_blocks * lanes
    hist1 = np.empty(n_codewords * width, dtype=np.float32)                   # [codeword, block, lane]
    hist = np.empty(n_pos * 256 * lanes if mode == 0 else 4, dtype=np.float32)  # [index byte, value, lane]
    acc = np.empty((k, width), dtype=np.float32)                              # acc[c, j*L + t]
    norms = np.empty(n_tokens, dtype=np.float32)
    word = 4 if index_bits <= 25 else 8
    safe_bytes = _safe_fields(n_pos, 8, code_size - 2, 4)
    safe = _safe_fields(n_blocks, index_bits, code_size - 2, word)
    check = mode == 1 and n_codewords < (1 << index_bits)
    bad = 0
    last_bh = -1
    for unit in range(unit_start, unit_stop):
        bh = unit // n_tiles
        q0 = (unit % n_tiles) * lanes
        b = bh // n_h
        h = bh % n_h
        nq = min(lanes, n_q - q0)
        rows = codes[b, h]
        wts = weights[b, h]
        if bh != last_bh:
            _decode_norms(rows, norms)
            if check:
                bad += _count_invalid(rows, index_bits, n_blocks, n_codewords)
            last_bh = bh
        # Histogram of weights[q0 + t, i] * nu_i over what each token's positions hold.
        if mode == 0:
            hist[:] = 0.0
        else:
            hist1[:] = 0.0
        # hist[., ., t] += weights[q0 + t, i] * nu_i at every position of token i (literal variants as above).
        if mode == 0:
            if lanes == 4:
                for i in range(n_tokens):
                    _hist_add(hist, rows, i, n_pos, 8, 256, 1, 256, safe_bytes, 4, 4, wts, q0, nq, norms[i])
            elif lanes == 8:
                for i in range(n_tokens):
                    _hist_add(hist, rows, i, n_pos, 8, 256, 1, 256, safe_bytes, 4, 8, wts, q0, nq, norms[i])
            else:
                for i in range(n_tokens):
                    _hist_add(hist, rows, i, n_pos, 8, 256, 1, 256, safe_bytes, 4, 16, wts, q0, nq, norms[i])
        elif lanes == 4:
            if index_bits == 10:
                for i in range(n_tokens):
                    _hist_add(hist1, rows, i, n_blocks, 10, 1, n_blocks, n_codewords, safe, 4, 4,
                              wts, q0, nq, norms[i])
            elif index_bits == 12:
                for i in range(n_tokens):
                    _hist_add(hist1, rows, i, n_blocks, 12, 1, n_blocks, n_codewords, safe, 4, 4,
                              wts, q0, nq, norms[i])
            elif word == 4:
                for i in range(n_tokens):
                    _hist_add(hist1, rows, i, n_blocks, index_bits, 1, n_blocks, n_codewords, safe,
                              4, 4, wts, q0, nq, norms[i])
            else:
                for i in range(n_tokens):
                    _hist_add(hist1, rows, i, n_blocks, index_bits, 1, n_blocks, n_codewords, safe,
                              8, 4, wts, q0, nq, norms[i])
        else:
            if index_bits == 10:
                for i in range(n_tokens):
                    _hist_add(hist1, rows, i, n_blocks, 10, 1, n_blocks, n_codewords, safe, 4, 8,
                              wts, q0, nq, norms[i])
            elif index_bits == 12:
                for i in range(n_tokens):
                    _hist_add(hist1, rows, i, n_blocks, 12, 1, n_blocks, n_codewords, safe, 4, 8,
                              wts, q0, nq, norms[i])
            else:
                for i in range(n_tokens):
                    _hist_add(hist1, rows, i, n_blocks, index_bits, 1, n_blocks, n_codewords, safe,
                              4, 8, wts, q0, nq, norms[i])
        if mode == 0:
            _spread_bytes(hist, n_blocks, index_bits, lanes, hist1)
        # out[q0 + t, j*k + c] = sum_n hist1[n, j, t] * codewords[n, c]
        _contract(hist1, codewords, acc)
        for t in range(nq):
            for j in range(n_blocks):
                for c in range(k):
                    out[b, h, q0 + t, j * k + c] = acc[c, j * lanes + t]
    return bad



def compile_kernels():
    """(scores, weighted_sum) numba dispatchers, compiled (or loaded from numba's cache); call once
    (`fibquant.kv.attention.kernels._kernels` does, under a lock)."""
    global np, _decode_norms, _count_invalid, _safe_fields
    global _build_table, _bytes_table, _spread_bytes, _contract, _contract_clear, _lut_sum, _hist_add
    import numpy

    from fibquant.kv.attention.intrinsics import _build_intrinsics
    from fibquant.kv.attention.jit import kernel_jit
    from fibquant.kv.attention.numba_tables import compile_helpers

    # Globals of the kernel functions, bound before numba compiles (or loads) them.
    np = numpy
    _lut_sum, _hist_add, copy4, add4, sum4 = _build_intrinsics()
    helpers = compile_helpers(numpy, copy4, add4, sum4)
    _decode_norms, _count_invalid, _safe_fields = helpers["decode_norms"], helpers["count_invalid"], \
        helpers["safe_fields"]
    _build_table, _bytes_table = helpers["build_table"], helpers["bytes_table"]
    _spread_bytes, _contract = helpers["spread_bytes"], helpers["contract"]
    _contract_clear = helpers["contract_clear"]  # not called here: bound for numba_decode / numba_paged
    scores = kernel_jit(SIGNATURE, nogil=True)(_scores_py)
    weighted = kernel_jit(SIGNATURE, nogil=True)(_weighted_sum_py)
    return scores, weighted
