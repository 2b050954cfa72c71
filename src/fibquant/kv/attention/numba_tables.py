"""Jitted helpers of the numba kernels (`fibquant.kv.attention.numba_kernels`): norm decoding, index checks
and the lookup-table / histogram transforms. Plain Python functions compiled by `compile_helpers`
on first use; it also binds the module globals they call (`np`, `_nibble_table`, `_contract_rows` and
the vector intrinsics `_copy4`, `_add4`, `_sum4`), so numba loads only when a kernel first runs.
"""
from __future__ import annotations

np = None  # numpy, bound by compile_helpers() (kept off this module's import path)
_nibble_table = _contract_rows = None
_copy4 = _add4 = _sum4 = None


def _decode_norms_py(rows, norms):
    """norms[i] = the fp16 norm of code row i, decoded from its two little-endian bytes (exact)."""
    scale = np.empty(32, dtype=np.float32)  # scale[e] = 2^(e - 25) for e = 1..30; scale[0] = 2^-24
    scale[0] = np.float32(2.0 ** -24)
    for e in range(1, 32):
        scale[e] = np.float32(2.0 ** (e - 25))
    for i in range(rows.shape[0]):
        half = np.int64(rows[i, 0]) | (np.int64(rows[i, 1]) << 8)
        expo = (half >> 10) & 0x1F
        mant = half & 0x3FF
        if expo == 0:      # zero and subnormals: mant * 2^-24
            value = np.float32(mant) * scale[0]
        elif expo == 31:   # inf / nan (never written by the codecs)
            value = np.float32(np.inf) if mant == 0 else np.float32(np.nan)
        else:              # normal: (1024 + mant) * 2^(expo - 25)
            value = np.float32(mant + 1024) * scale[expo]
        norms[i] = -value if half & 0x8000 else value


def _count_invalid_py(rows, bits, n_blocks, n_codewords):
    """How many of the n_blocks bits-wide indices of the code rows are >= N (plain bit reader)."""
    bad = 0
    for i in range(rows.shape[0]):
        for j in range(n_blocks):
            value = 0
            for t in range(bits):
                bit = j * bits + t
                value |= ((np.int64(rows[i, 2 + (bit >> 3)]) >> (bit & 7)) & 1) << t
            if value >= n_codewords:
                bad += 1
    return bad


def _safe_fields_py(n_fields, bits, payload, word):
    """The fields p < n_fields that one `word`-byte read can fetch inside a payload of `payload`
    bytes: (p*bits >> 3) + word <= payload. They form a prefix 0..safe-1; returns safe."""
    safe = 0
    while safe < n_fields and ((safe * bits) >> 3) + word <= payload:
        safe += 1
    return safe


def _build_table_py(codewords, qmat, table):
    """table[n, x] = sum_c codewords[n, c] * qmat[c, x] (x = j*L + lane): the [codeword, block, lane]
    table of partial dot products. Written out for k = 1, 2, 4, 8 (each row computed in registers,
    ~6x faster than accumulating the table row k times); the same sum order (c ascending) for all k."""
    n_codewords, k = codewords.shape
    width = qmat.shape[1]
    if k == 1:
        for n in range(n_codewords):
            base = n * width
            c0 = codewords[n, 0]
            for x in range(width):
                table[base + x] = c0 * qmat[0, x]
    elif k == 2:
        for n in range(n_codewords):
            base = n * width
            c0, c1 = codewords[n, 0], codewords[n, 1]
            for x in range(width):
                table[base + x] = c0 * qmat[0, x] + c1 * qmat[1, x]
    elif k == 4:
        for n in range(n_codewords):
            base = n * width
            c0, c1, c2, c3 = codewords[n, 0], codewords[n, 1], codewords[n, 2], codewords[n, 3]
            for x in range(width):
                table[base + x] = c0 * qmat[0, x] + c1 * qmat[1, x] + c2 * qmat[2, x] + c3 * qmat[3, x]
    elif k == 8:
        for n in range(n_codewords):
            base = n * width
            c0, c1, c2, c3 = codewords[n, 0], codewords[n, 1], codewords[n, 2], codewords[n, 3]
            c4, c5, c6, c7 = codewords[n, 4], codewords[n, 5], codewords[n, 6], codewords[n, 7]
            for x in range(width):
                table[base + x] = (c0 * qmat[0, x] + c1 * qmat[1, x] + c2 * qmat[2, x] + c3 * qmat[3, x]
                                   + c4 * qmat[4, x] + c5 * qmat[5, x] + c6 * qmat[6, x] + c7 * qmat[7, x])
    else:
        for n in range(n_codewords):
            base = n * width
            for x in range(width):
                table[base + x] = 0.0
            for c in range(k):
                cv = codewords[n, c]
                for x in range(width):
                    table[base + x] += cv * qmat[c, x]


def _nibble_table_py(table1, n_blocks, bits, quads, p, high, nibble):
    """nibble[u, :] = sum over the blocks s packed in the low (high) half of index byte p of
    table1[sub-index s of the 4-bit value u, block, :] (zero where the blocks run out)."""
    per_byte = 8 // bits
    half = per_byte // 2
    mask = (1 << bits) - 1
    nibble[:] = 0.0
    for u in range(16):
        for s in range(half):
            j = p * per_byte + high * half + s
            if j < n_blocks:
                src = (((u >> (s * bits)) & mask) * n_blocks + j) * quads
                for m in range(quads):
                    _add4(nibble, u * quads + m, table1, src + m)


def _bytes_table_py(table1, n_blocks, bits, lanes, lut):
    """lut[p, v, :] = sum over the blocks s packed in index byte p of table1[sub-index s of v, p*(8/bits) + s, :]
    (entries of `lanes` floats, moved as lanes/4 vectors of 4). For bits < 8, via the two nibble
    tables: lut[p, v] = low[v & 15] + high[v >> 4] (one vector add per entry)."""
    per_byte = 8 // bits
    n_pos = (n_blocks + per_byte - 1) // per_byte
    quads = lanes // 4
    if per_byte == 1:
        for p in range(n_pos):
            for v in range(256):
                for m in range(quads):
                    _copy4(lut, (p * 256 + v) * quads + m, table1, (v * n_blocks + p) * quads + m)
        return
    low = np.empty(16 * lanes, dtype=np.float32)
    high = np.empty(16 * lanes, dtype=np.float32)
    for p in range(n_pos):
        _nibble_table(table1, n_blocks, bits, quads, p, 0, low)
        _nibble_table(table1, n_blocks, bits, quads, p, 1, high)
        for v in range(256):
            for m in range(quads):
                _sum4(lut, (p * 256 + v) * quads + m, low, (v & 15) * quads + m, high, (v >> 4) * quads + m)


def _spread_bytes_py(hist, n_blocks, bits, lanes, hist1):
    """The transpose of _bytes_table: hist1[n, j, :] = sum of hist[p, v, :] over the byte values v
    of index byte p = j // (8/bits) whose sub-index for block j is n. For bits < 8, via the two
    nibble marginals low[u] = sum_v [v & 15 = u] hist[p, v], high[u] = sum_v [v >> 4 = u] hist[p, v]."""
    per_byte = 8 // bits
    n_pos = (n_blocks + per_byte - 1) // per_byte
    mask = (1 << bits) - 1
    quads = lanes // 4
    if per_byte == 1:
        for p in range(n_pos):
            for v in range(256):
                for m in range(quads):
                    _copy4(hist1, (v * n_blocks + p) * quads + m, hist, (p * 256 + v) * quads + m)
        return
    half = per_byte // 2
    low = np.empty(16 * lanes, dtype=np.float32)
    high = np.empty(16 * lanes, dtype=np.float32)
    hist1[:] = 0.0
    for p in range(n_pos):
        low[:] = 0.0
        high[:] = 0.0
        for hi in range(16):          # consecutive adds go to different nibble entries
            for lo in range(16):
                src = (p * 256 + (hi << 4) + lo) * quads
                for m in range(quads):
                    _add4(low, lo * quads + m, hist, src + m)
        for lo in range(16):
            for hi in range(16):
                src = (p * 256 + (hi << 4) + lo) * quads
                for m in range(quads):
                    _add4(high, hi * quads + m, hist, src + m)
        for u in range(16):
            for s in range(half):
                for top in range(2):
                    j = p * per_byte + top * half + s
                    if j < n_blocks:
                        dst = (((u >> (s * bits)) & mask) * n_blocks + j) * quads
                        source = high if top else low
                        for m in range(quads):
                            _add4(hist1, dst + m, source, u * quads + m)


def _contract_rows_py(hist1, codewords, acc, clear):
    """acc[c, x] = sum_n codewords[n, c] * hist1[n, x] (x = j*L + lane); with `clear`, each histogram
    row hist1[n, :] is zeroed once read, while it is in L1 (hist1[:N * width] is then all zero)."""
    n_codewords, k = codewords.shape
    width = acc.shape[1]
    acc[:, :] = 0.0
    for n in range(n_codewords):
        base = n * width
        for c in range(k):
            cv = codewords[n, c]
            for x in range(width):
                acc[c, x] += cv * hist1[base + x]
        if clear:
            for x in range(width):
                hist1[base + x] = 0.0


def _contract_py(hist1, codewords, acc):
    """acc[c, x] = sum_n codewords[n, c] * hist1[n, x]; hist1 left as it is."""
    _contract_rows(hist1, codewords, acc, False)


def _contract_clear_py(hist1, codewords, acc):
    """`_contract` (the same sums in the same order) that leaves hist1[:N * width] zero, clearing each
    row as it reads it: a fused decode kernel (numba_decode, numba_paged) clears its 64-128 KB value
    histogram once per call, and each unit's contraction leaves it clear for the next unit, instead
    of a separate zeroing pass over it per unit."""
    _contract_rows(hist1, codewords, acc, True)


def compile_helpers(numpy, copy4, add4, sum4) -> dict:
    """The helpers above as numba dispatchers (`jit.kernel_jit`; keyed by name without `_py`), after
    binding the globals they call. Called once, by `fibquant.kv.attention.numba_kernels.compile_kernels`."""
    global np, _nibble_table, _contract_rows, _copy4, _add4, _sum4
    from fibquant.kv.attention.jit import kernel_jit

    np, _copy4, _add4, _sum4 = numpy, copy4, add4, sum4
    helper = kernel_jit(nogil=True)
    _nibble_table, _contract_rows = helper(_nibble_table_py), helper(_contract_rows_py)
    return {"decode_norms": helper(_decode_norms_py), "count_invalid": helper(_count_invalid_py),
            "safe_fields": helper(_safe_fields_py), "build_table": helper(_build_table_py),
            "bytes_table": helper(_bytes_table_py), "spread_bytes": helper(_spread_bytes_py),
            "contract": helper(_contract_py), "contract_clear": helper(_contract_clear_py)}
