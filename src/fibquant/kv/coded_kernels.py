"""Attention on codes: q.K^T and p.V computed straight from FibQuant / TurboQuant code rows.

A code row (see codecs/fibquant.py) is `code_size` bytes: bytes [0, 2) the vector's norm nu as
IEEE fp16 (little-endian), bytes [2, code_size) `n_blocks` indices of `w = index_bits` bits,
bit-packed little-endian (index j at bits [j*w, (j+1)*w) of that range). In the rotated domain
the row decodes to nu * concat_j codewords[idx_j], codewords float32 [N, k], D = n_blocks * k;
TurboQuant is k = 1 (codewords = its levels as [N, 1]). Everything here stays in the rotated
domain: queries arrive rotated, `coded_weighted_sum` returns rotated outputs.

    coded_scores(queries [B,H,Q,D], codes [B,H,M,C], codewords [N,k], w)       -> [B,H,Q,M]
        s[b,h,q,i] = nu[b,h,i] * sum_j <queries[b,h,q, j*k:(j+1)*k], codewords[idx[b,h,i,j]]>
    coded_weighted_sum(weights [B,H,Q,M], codes [B,H,M,C], codewords [N,k], w) -> [B,H,Q,D]
        out[b,h,q, j*k:(j+1)*k] = sum_i weights[b,h,q,i] * nu[b,h,i] * codewords[idx[b,h,i,j]]

`*_reference` (plain torch: unpack, gather, einsum; any device) are the spec. The numba kernels
(CPU, inference only: no autograd) never materialise a decoded vector. Per unit of work
(b, h, tile of L queries; L = 4, or 8 / 16 for more queries, see `_lanes`):

* scores: a lookup table of partial dot products, LUT[position, value, 0:L], is built once (from
  T[n, j, :] = <queries[tile, j*k:(j+1)*k], codewords[n]>), then each token costs one L-float
  vector load + add per position. When w in {1, 2, 4, 8} and N = 2^w (every TurboQuant and the
  N = 256 FibQuant codebooks) a position is a whole index *byte* (256 values; the entry sums the
  8/w blocks packed in that byte), so a token costs n_index_bytes lookups (TurboQuant 4 bit: 32
  instead of 64, 2 bit: 16) with constant address strides. Other widths (10, 12, ...) read each
  w-bit field with one little-endian word load + shift + mask and look up T[idx, j].
* weighted sum: the transpose. A weighted histogram Hist[position, value, 0:L] += weights[tile, i]
  * nu_i over the tokens (one L-float read-modify-write per position), then spread back to blocks
  and contracted with the codewords: out[q, j*k + c] = sum_n Hist[n, j, q] * codewords[n, c]
  (n_blocks * N * k * L multiply-adds per unit, independent of M).

The hot loops are two small LLVM intrinsics that keep the L lanes in one vector register (see
`_build_intrinsics`); everything else is plain numba (no fastmath). Both kernels accumulate in
float32, like the dense float32 attention they replace; the order of summation differs from the
reference, so results agree to float32 rounding (tests: 1e-5 of the magnitude sum
sum_d |q_d| |x_d|), not bit for bit. `codes` may be a strided view (e.g. [:, :, :M] of a
capacity buffer): it is read in place, as long as each row's bytes are contiguous.

Invalid indices (>= N, possible only when N < 2^w): `coded_scores`/`coded_weighted_sum` and the
references raise ValueError (as `FibQuantCodec.decode` does). The numba kernels never read out of
bounds: a field is clamped to N - 1 before its table lookup, and when N < 2^w every index is
checked and the count reported (then the wrapper raises).

Threads: the numba kernels are compiled without numba's own threading (`parallel=False`, nogil);
when torch.get_num_threads() > 1 and there is more than one (b, h, query-tile) unit of enough
work, the units are split over a small thread pool of at most torch.get_num_threads() threads.
So `torch.set_num_threads(1)` gives a single-threaded kernel. numba is imported on first use only;
compiled kernels are cached on disk by numba (cache=True), ~5 s to compile the first time.
"""
from __future__ import annotations

import math
import threading
from typing import Optional

import torch

from ..codecs.bitpack import MAX_BITS, bytes_to_float16, packed_size, unpack_bits
from ..codecs.rotation import NORM_BYTES

BACKENDS = ("auto", "torch", "numba")
_MIN_WORK_PER_THREAD = 1 << 16  # token-positions per unit below which threads do not pay

__all__ = [
    "coded_scores",
    "coded_weighted_sum",
    "coded_scores_reference",
    "coded_weighted_sum_reference",
    "numba_available",
    "BACKENDS",
]


# --------------------------------------------------------------------------- validation
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_codebook(codewords, index_bits) -> tuple[int, int]:
    if not isinstance(codewords, torch.Tensor):
        raise ValueError(f"codewords must be a torch.Tensor, got {type(codewords).__name__}")
    if codewords.dtype != torch.float32:
        raise ValueError(f"codewords must be float32, got dtype {codewords.dtype}")
    if codewords.ndim != 2 or codewords.shape[0] < 1 or codewords.shape[1] < 1:
        raise ValueError(f"codewords must have shape [N, k] with N, k >= 1, got {tuple(codewords.shape)}")
    if not _is_int(index_bits) or not 1 <= index_bits <= MAX_BITS:
        raise ValueError(f"index_bits must be an integer in 1..{MAX_BITS}, got {index_bits!r}")
    n_codewords, k = codewords.shape
    if n_codewords > 1 << index_bits:
        raise ValueError(f"index_bits={index_bits} cannot address N={n_codewords} codewords "
                         f"(need at least {max(1, math.ceil(math.log2(n_codewords)))})")
    return int(n_codewords), int(k)


def _check_codes(codes) -> None:
    if not isinstance(codes, torch.Tensor):
        raise ValueError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be torch.uint8, got dtype {codes.dtype}")
    if codes.ndim != 4:
        raise ValueError(f"codes must have shape [B, H, M, code_size], got {tuple(codes.shape)}")


def _check_float4(tensor, name: str, shape_doc: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got dtype {tensor.dtype}")
    if tensor.ndim != 4:
        raise ValueError(f"{name} must have shape {shape_doc}, got {tuple(tensor.shape)}")


def _check_device(tensor: torch.Tensor, codes: torch.Tensor, name: str) -> None:
    if tensor.device != codes.device:
        raise ValueError(f"{name} ({tensor.device}) and codes ({codes.device}) must be on the same device")


def _validate_scores(queries, codes, codewords, index_bits) -> tuple[int, int, int]:
    """-> (N, k, n_blocks)."""
    n_codewords, k = _check_codebook(codewords, index_bits)
    _check_float4(queries, "queries", "[B, H, Q, D]")
    _check_codes(codes)
    _check_device(queries, codes, "queries")
    bq, hq, _, dim = queries.shape
    bc, hc, _, code_size = codes.shape
    if (bq, hq) != (bc, hc):
        raise ValueError(f"queries [B={bq}, H={hq}, ...] and codes [B={bc}, H={hc}, ...] disagree on B/H")
    if dim % k:
        raise ValueError(f"query dim D={dim} is not a multiple of the codeword size k={k}")
    n_blocks = dim // k
    expected = NORM_BYTES + packed_size(n_blocks, index_bits)
    if code_size != expected:
        raise ValueError(f"codes have code_size={code_size} bytes, but D={dim}, k={k}, index_bits={index_bits} "
                         f"need {expected} ({NORM_BYTES} norm bytes + {n_blocks} x {index_bits} bits)")
    return n_codewords, k, n_blocks


def _validate_weighted_sum(weights, codes, codewords, index_bits, dim) -> tuple[int, int, int]:
    """-> (N, k, n_blocks)."""
    n_codewords, k = _check_codebook(codewords, index_bits)
    _check_float4(weights, "weights", "[B, H, Q, M]")
    _check_codes(codes)
    _check_device(weights, codes, "weights")
    bw, hw, _, mw = weights.shape
    bc, hc, mc, code_size = codes.shape
    if (bw, hw) != (bc, hc):
        raise ValueError(f"weights [B={bw}, H={hw}, ...] and codes [B={bc}, H={hc}, ...] disagree on B/H")
    if mw != mc:
        raise ValueError(f"weights have M={mw} tokens but codes have M={mc}")
    if code_size < NORM_BYTES:
        raise ValueError(f"code_size={code_size} is smaller than the {NORM_BYTES} norm bytes")
    if dim is None:
        # The largest block count whose indices fit the index bytes (exact whenever, as for every
        # FibQuant/TurboQuant config with 8 | D*w/k, the packing has no spare index-sized slot).
        n_blocks = (code_size - NORM_BYTES) * 8 // index_bits
        if n_blocks < 1:
            raise ValueError(f"code_size={code_size} holds no {index_bits}-bit index")
    else:
        if not _is_int(dim) or dim < 1 or dim % k:
            raise ValueError(f"dim must be a positive multiple of k={k}, got {dim!r}")
        n_blocks = dim // k
    expected = NORM_BYTES + packed_size(n_blocks, index_bits)
    if code_size != expected:
        raise ValueError(f"codes have code_size={code_size} bytes, but D={n_blocks * k}, k={k}, "
                         f"index_bits={index_bits} need {expected}")
    return n_codewords, k, n_blocks


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


# --------------------------------------------------------------------------- torch reference
def _unpack(codes: torch.Tensor, codewords: torch.Tensor, index_bits: int, n_blocks: int):
    """codes [..., C] -> (indices int64 [..., n_blocks], norms float32 [...]) with the index check."""
    index = unpack_bits(codes[..., NORM_BYTES:], index_bits, n_blocks)
    n_codewords = codewords.shape[0]
    if n_codewords != 1 << index_bits and index.numel() and int(index.max()) >= n_codewords:
        raise ValueError(f"codes hold an index >= N={n_codewords} (index_bits={index_bits})")
    return index, bytes_to_float16(codes[..., :NORM_BYTES])


def _decoded_rotated(codes, codewords, index_bits, n_blocks) -> torch.Tensor:
    """codes [B, H, M, C] -> rotated decoded vectors nu * concat_j c[idx_j], float32 [B, H, M, D]."""
    index, norms = _unpack(codes, codewords, index_bits, n_blocks)
    codewords = codewords.to(codes.device)
    units = codewords[index].reshape(*index.shape[:-1], n_blocks * codewords.shape[1])
    return units * norms.unsqueeze(-1)


def coded_scores_reference(queries: torch.Tensor, codes: torch.Tensor, codewords: torch.Tensor,
                           index_bits: int) -> torch.Tensor:
    """The spec of `coded_scores`: unpack, gather the codewords, scale by nu, einsum (any device)."""
    _, _, n_blocks = _validate_scores(queries, codes, codewords, index_bits)
    keys = _decoded_rotated(codes, codewords, index_bits, n_blocks)
    return torch.einsum("bhqd,bhmd->bhqm", queries, keys)


def coded_weighted_sum_reference(weights: torch.Tensor, codes: torch.Tensor, codewords: torch.Tensor,
                                 index_bits: int, *, dim: Optional[int] = None) -> torch.Tensor:
    """The spec of `coded_weighted_sum`: unpack, gather, scale by nu, einsum (any device)."""
    _, _, n_blocks = _validate_weighted_sum(weights, codes, codewords, index_bits, dim)
    values = _decoded_rotated(codes, codewords, index_bits, n_blocks)
    return torch.einsum("bhqm,bhmd->bhqd", weights, values)


# --------------------------------------------------------------------------- numba kernels
# The kernels are plain Python functions compiled by `_kernels()` on first use. `_kernels()` also
# binds the module globals they call (`np`, the jitted helpers `_decode_norms` ... `_contract`
# and the vector intrinsics `_lut_sum`, `_hist_add`, `_copy4`, `_add4`), so numba and llvmlite
# load only when a kernel first runs.
#
# Work unit: (b, h, tile of L queries), L = `lanes` in {4, 8, 16} (`_lanes`). The tables are
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
_LUT_L2_BYTES = 512 * 1024   # 16 lanes only when the byte table stays within this (an L2's worth)

np = None              # numpy, bound by _kernels() (kept off this module's import path)
_decode_norms = _count_invalid = _safe_fields = None
_build_table = _nibble_table = _bytes_table = _spread_bytes = _contract = None
_lut_sum = _hist_add = _copy4 = _add4 = _sum4 = None


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


def _contract_py(hist1, codewords, acc):
    """acc[c, x] = sum_n codewords[n, c] * hist1[n, x] (x = j*L + lane)."""
    n_codewords, k = codewords.shape
    width = acc.shape[1]
    acc[:, :] = 0.0
    for n in range(n_codewords):
        base = n * width
        for c in range(k):
            cv = codewords[n, c]
            for x in range(width):
                acc[c, x] += cv * hist1[base + x]


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
    the number of invalid indices (>= N) seen."""
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


def _build_intrinsics():
    """The vector intrinsics: LLVM-level code keeping L query lanes in one <L x float> register.

    Field p of code row i of `rows` (2-d uint8, any row stride, bytes of a row contiguous) is
    f(p) = bits [p*bits, (p+1)*bits) of the row's bytes 2.. (little-endian), clamped to limit - 1,
    and its table entry is o(p) = p * pstride + f(p) * estride. Fields p < safe are read with one
    `word`-byte load (a literal 4, enough for bits <= 25, or 8; LLVM merges the byte loads), the
    others byte by byte, reading only the bytes that hold them (see `_safe_fields`). With a
    literal `bits`, the loop is unrolled over whole bytes so every shift is a constant.
    _lut_sum(table, rows, i, n, bits, pstride, estride, limit, safe, word, L, res, q0, nq, nu):
        s = sum_{p < n} table[o(p)*L : o(p)*L + L]   (4 interleaved vector accumulators);
        res[q0 + t, i] = nu * s[t] for t < nq
    _hist_add(table, rows, i, n, bits, pstride, estride, limit, safe, word, L, wts, q0, nq, nu):
        w[t] = wts[q0 + t, i] * nu for t < nq, 0 for nq <= t < L;
        table[o(p)*L : o(p)*L + L] += w for p < n, in order
    (res / wts: 2-d float32 arrays, any strides; nq <= L.)
    _copy4(dst, d, src, s):  dst[d*4 : d*4 + 4] = src[s*4 : s*4 + 4]
    _add4(dst, d, src, s):   dst[d*4 : d*4 + 4] += src[s*4 : s*4 + 4]
    _sum4(dst, d, a, x, b, y):  dst[d*4 : d*4 + 4] = a[x*4 : x*4 + 4] + b[y*4 : y*4 + 4]
    Tables are 1-d float32 C arrays; L (`lanes`) is a literal 4, 8 or 16. The callers
    guarantee in-range offsets (the clamp keeps f(p) < limit) and rows whose bytes are contiguous.
    Literal arguments (bits 8, strides 256 and 1, limit 256) fold into the address arithmetic.
    """
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    f32 = ir.FloatType()
    i32 = ir.IntType(32)
    i64 = ir.IntType(64)
    no_wrap = ["nuw", "nsw"]

    def const(value):
        return ir.Constant(i64, value)

    def _is_table(ty):
        return isinstance(ty, types.Array) and ty.ndim == 1 and ty.dtype == types.float32 and ty.layout == "C"

    def _literal(ty, allowed):
        return isinstance(ty, types.IntegerLiteral) and ty.literal_value in allowed

    def _typed(table, rows, scalars, word, lanes, mat, q0, nq, nu):
        return (_is_table(table) and isinstance(rows, types.Array) and rows.ndim == 2
                and rows.dtype == types.uint8 and isinstance(mat, types.Array) and mat.ndim == 2
                and mat.dtype == types.float32 and nu == types.float32
                and all(isinstance(x, types.Integer) for x in (*scalars, q0, nq))
                and _literal(word, (4, 8)) and _literal(lanes, (4, 8, 16)))

    def _lane_pointers(context, builder, signature, args, lanes):
        """(nq as i64, [float* of mat[q0 + t, i] for t < lanes]) for _lut_sum / _hist_add."""
        mat = context.make_array(signature.args[11])(context, builder, args[11])
        i_v, q0_v, nq_v = [context.cast(builder, args[x], signature.args[x], types.int64) for x in (2, 12, 13)]
        row_stride = builder.extract_value(mat.strides, 0)
        column = builder.add(builder.mul(q0_v, row_stride), builder.mul(i_v, builder.extract_value(mat.strides, 1)))
        base = builder.bitcast(mat.data, ir.IntType(8).as_pointer())
        pointers = [builder.bitcast(builder.gep(base, [builder.add(column, builder.mul(const(t), row_stride))]),
                                    f32.as_pointer()) for t in range(lanes)]
        return nq_v, pointers

    def _slot(context, builder, table_ty, table_v, offset, lanes):
        """<lanes x float>* to table[offset*lanes : (offset + 1)*lanes] (offset an i64)."""
        table = context.make_array(table_ty)(context, builder, table_v)
        at = builder.mul(offset, const(lanes), flags=no_wrap)
        return builder.bitcast(builder.gep(table.data, [at], inbounds=True), ir.VectorType(f32, lanes).as_pointer())

    def _fields(context, builder, signature, args):
        """-> (n, safe, entry, groups): entry(p, whole_word[, at, shift]) is the vector pointer of
        field p's table entry; groups(body) runs body(u, p, at, shift) over the fields p < safe in
        an unrolled loop (u = the position in the unroll); with a literal `bits` the unroll spans
        whole bytes, so each field's byte offset from the group's and its shift are constants."""
        table_ty, rows_ty = signature.args[0], signature.args[1]
        rows = context.make_array(rows_ty)(context, builder, args[1])
        i_v, n_v, bits_v, pstride_v, estride_v, limit_v, safe_v = [
            context.cast(builder, v, t, types.int64) for v, t in zip(args[2:9], signature.args[2:9])]
        word_bytes = signature.args[9].literal_value
        lanes = signature.args[10].literal_value
        row_stride = builder.extract_value(rows.strides, 0)
        payload = builder.gep(rows.data, [builder.add(builder.mul(i_v, row_stride), const(2))])
        mask = builder.sub(builder.shl(const(1), bits_v), const(1))
        top = builder.sub(limit_v, const(1))

        def byte(at):
            return builder.zext(builder.load(builder.gep(payload, [at])), i64)

        def entry(p, whole_word, at=None, shift=None):
            if at is None:
                bit = builder.mul(p, bits_v, flags=no_wrap)  # no wrap: (p*8) >> 3 folds to p
                at = builder.lshr(bit, const(3))
                shift = builder.and_(bit, const(7))
            if whole_word:
                value = byte(at)
                for b in range(1, word_bytes):
                    piece = byte(builder.add(at, const(b), flags=no_wrap))
                    value = builder.or_(value, builder.shl(piece, const(8 * b)))
            else:
                n_bytes = builder.lshr(builder.add(builder.add(shift, bits_v), const(7)), const(3))
                slot = cgutils.alloca_once_value(builder, const(0))
                with cgutils.for_range(builder, n_bytes) as loop:
                    piece = builder.shl(byte(builder.add(at, loop.index)), builder.mul(loop.index, const(8)))
                    builder.store(builder.or_(builder.load(slot), piece), slot)
                value = builder.load(slot)
            field = builder.and_(builder.lshr(value, shift), mask)
            field = builder.select(builder.icmp_unsigned("<", field, limit_v), field, top)
            offset = builder.add(builder.mul(p, pstride_v, flags=no_wrap),
                                 builder.mul(field, estride_v, flags=no_wrap), flags=no_wrap)
            return _slot(context, builder, table_ty, args[0], offset, lanes)

        safe_v = builder.select(builder.icmp_signed("<", safe_v, n_v), safe_v, n_v)
        bits_ty = signature.args[4]
        literal_bits = bits_ty.literal_value if isinstance(bits_ty, types.IntegerLiteral) else None

        def groups(body):
            if literal_bits is not None:
                unroll = math.lcm(4, 8 // math.gcd(literal_bits, 8))
                group_bytes = unroll * literal_bits // 8
            else:
                unroll, group_bytes = 4, None
            count = builder.udiv(safe_v, const(unroll))
            with cgutils.for_range(builder, count) as loop:
                first = builder.mul(loop.index, const(unroll), flags=no_wrap)
                if group_bytes is not None:
                    base = builder.mul(loop.index, const(group_bytes), flags=no_wrap)
                for u in range(unroll):
                    p = builder.add(first, const(u), flags=no_wrap)
                    if group_bytes is None:
                        body(u, p, None, None)
                    else:
                        at = builder.add(base, const((u * literal_bits) >> 3), flags=no_wrap)
                        body(u, p, at, const((u * literal_bits) & 7))
            with cgutils.for_range(builder, safe_v, start=builder.mul(count, const(unroll))) as loop:
                body(0, loop.index, None, None)

        return n_v, safe_v, entry, groups, lanes

    @intrinsic
    def lut_sum(typingctx, table, rows, i, n, bits, pstride, estride, limit, safe, word, lanes, res, q0, nq, nu):
        if not _typed(table, rows, (i, n, bits, pstride, estride, limit, safe), word, lanes, res, q0, nq, nu):
            return None
        sig = types.void(table, rows, i, n, bits, pstride, estride, limit, safe, word, lanes, res, q0, nq, nu)

        def codegen(context, builder, signature, args):
            n_v, safe_v, entry, groups, width = _fields(context, builder, signature, args)
            vec = ir.VectorType(f32, width)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * width)) for _ in range(4)]

            def accumulate(acc, pointer):
                builder.store(builder.fadd(builder.load(acc), builder.load(pointer, align=4)), acc)

            groups(lambda u, p, at, shift: accumulate(accs[u % 4], entry(p, True, at, shift)))
            with cgutils.for_range(builder, n_v, start=safe_v) as loop:
                accumulate(accs[1], entry(loop.index, False))
            total = builder.fadd(builder.fadd(builder.load(accs[0]), builder.load(accs[1])),
                                 builder.fadd(builder.load(accs[2]), builder.load(accs[3])))
            nu_v = builder.insert_element(ir.Constant(vec, ir.Undefined), args[14], ir.Constant(i32, 0))
            total = builder.fmul(total, builder.shuffle_vector(nu_v, nu_v, ir.Constant(ir.VectorType(i32, width),
                                                                                          [0] * width)))
            nq_v, pointers = _lane_pointers(context, builder, signature, args, width)
            for t, pointer in enumerate(pointers):
                with builder.if_then(builder.icmp_signed(">", nq_v, const(t)), likely=True):
                    builder.store(builder.extract_element(total, ir.Constant(i32, t)), pointer)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def hist_add(typingctx, table, rows, i, n, bits, pstride, estride, limit, safe, word, lanes, wts, q0, nq, nu):
        if not _typed(table, rows, (i, n, bits, pstride, estride, limit, safe), word, lanes, wts, q0, nq, nu):
            return None
        sig = types.void(table, rows, i, n, bits, pstride, estride, limit, safe, word, lanes, wts, q0, nq, nu)

        def codegen(context, builder, signature, args):
            n_v, safe_v, entry, groups, width = _fields(context, builder, signature, args)
            vec = ir.VectorType(f32, width)
            nq_v, pointers = _lane_pointers(context, builder, signature, args, width)
            slot = cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * width))
            for t, pointer in enumerate(pointers):
                with builder.if_then(builder.icmp_signed(">", nq_v, const(t)), likely=True):
                    lane = builder.fmul(builder.load(pointer), args[14])
                    builder.store(builder.insert_element(builder.load(slot), lane, ir.Constant(i32, t)), slot)
            add = builder.load(slot)

            def scatter(pointer):
                builder.store(builder.fadd(builder.load(pointer, align=4), add), pointer, align=4)

            groups(lambda u, p, at, shift: scatter(entry(p, True, at, shift)))
            with cgutils.for_range(builder, n_v, start=safe_v) as loop:
                scatter(entry(loop.index, False))
            return context.get_dummy_value()

        return sig, codegen

    def _mover(accumulate):
        def typer(typingctx, dst, d, src, s):
            if not (_is_table(dst) and _is_table(src) and isinstance(d, types.Integer)
                    and isinstance(s, types.Integer)):
                return None
            sig = types.void(dst, d, src, s)

            def codegen(context, builder, signature, args):
                d_v, s_v = [context.cast(builder, args[x], signature.args[x], types.int64) for x in (1, 3)]
                target = _slot(context, builder, signature.args[0], args[0], d_v, 4)
                value = builder.load(_slot(context, builder, signature.args[2], args[2], s_v, 4), align=4)
                if accumulate:
                    value = builder.fadd(builder.load(target, align=4), value)
                builder.store(value, target, align=4)
                return context.get_dummy_value()

            return sig, codegen

        typer.__name__ = "add4" if accumulate else "copy4"
        return intrinsic(typer)

    @intrinsic
    def sum4(typingctx, dst, d, a, x, b, y):
        if not (_is_table(dst) and _is_table(a) and _is_table(b)
                and all(isinstance(v, types.Integer) for v in (d, x, y))):
            return None
        sig = types.void(dst, d, a, x, b, y)

        def codegen(context, builder, signature, args):
            d_v, x_v, y_v = [context.cast(builder, args[i], signature.args[i], types.int64) for i in (1, 3, 5)]
            left = builder.load(_slot(context, builder, signature.args[2], args[2], x_v, 4), align=4)
            right = builder.load(_slot(context, builder, signature.args[4], args[4], y_v, 4), align=4)
            target = _slot(context, builder, signature.args[0], args[0], d_v, 4)
            builder.store(builder.fadd(left, right), target, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return lut_sum, hist_add, _mover(False), _mover(True), sum4


_KERNELS = None
_KERNELS_LOCK = threading.Lock()
_NUMBA_OK: Optional[bool] = None


def numba_available() -> bool:
    """Whether numba imports (the numba backend can run)."""
    global _NUMBA_OK
    if _NUMBA_OK is None:
        try:
            import numba  # noqa: F401
            _NUMBA_OK = True
        except Exception:  # ImportError, or a numba/numpy version clash at import
            _NUMBA_OK = False
    return _NUMBA_OK


def _kernels():
    """(scores, weighted_sum) numba dispatchers, compiled (or loaded from numba's cache) once."""
    global _KERNELS, np, _decode_norms, _count_invalid, _safe_fields
    global _build_table, _nibble_table, _bytes_table, _spread_bytes, _contract
    global _lut_sum, _hist_add, _copy4, _add4, _sum4
    if _KERNELS is None:
        with _KERNELS_LOCK:
            if _KERNELS is None:
                import numba
                import numpy

                # Globals of the kernel functions, bound before numba compiles (or loads) them.
                np = numpy
                _lut_sum, _hist_add, _copy4, _add4, _sum4 = _build_intrinsics()
                helper = numba.njit(nogil=True)
                _decode_norms = helper(_decode_norms_py)
                _count_invalid = helper(_count_invalid_py)
                _safe_fields = helper(_safe_fields_py)
                _build_table = helper(_build_table_py)
                _nibble_table = helper(_nibble_table_py)
                _bytes_table = helper(_bytes_table_py)
                _spread_bytes = helper(_spread_bytes_py)
                _contract = helper(_contract_py)
                signature = ("int64(float32[:, :, :, ::1], uint8[:, :, :, :], float32[:, ::1], "
                             "float32[:, :, :, ::1], int64, int64, int64, int64, int64, int64)")
                scores = numba.njit(signature, cache=True, nogil=True)(_scores_py)
                weighted = numba.njit(signature, cache=True, nogil=True)(_weighted_sum_py)
                _KERNELS = (scores, weighted)
    return _KERNELS


_POOL = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()


def _pool(threads: int):
    """A shared thread pool of at least `threads` workers (grown, never shrunk)."""
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE < threads:
            from concurrent.futures import ThreadPoolExecutor
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fibquant-coded")
            _POOL_SIZE = threads
        return _POOL


def _run_units(kernel, args, units: int, work_per_unit: int) -> int:
    """Run `kernel(*args, start, stop)` over `units`, split across up to torch.get_num_threads() threads."""
    threads = min(torch.get_num_threads(), units, max(1, units * work_per_unit // _MIN_WORK_PER_THREAD))
    if threads <= 1:
        return int(kernel(*args, 0, units))
    bounds = [units * t // threads for t in range(threads + 1)]
    futures = [_pool(threads).submit(kernel, *args, bounds[t], bounds[t + 1]) for t in range(threads)]
    return sum(int(f.result()) for f in futures)


def _numba_mode(n_codewords: int, index_bits: int) -> int:
    return _MODE_BYTES if index_bits in (1, 2, 4, 8) and n_codewords == 1 << index_bits else _MODE_FIELDS


def _lanes(n_queries: int, mode: int, index_bits: int, n_blocks: int) -> int:
    """Queries per tile: 4 (one 128-bit vector) up to 4 queries, else 8; 16 for more than 8 queries
    when the byte table (index bytes x 256 x 16 floats) stays within an L2's worth."""
    if n_queries <= 4 or (mode == _MODE_FIELDS and index_bits > 25):
        return 4
    if mode == _MODE_FIELDS or n_queries <= 8:
        return 8
    n_pos = -(-n_blocks // (8 // index_bits))
    return 16 if n_pos * 256 * 16 * 4 <= _LUT_L2_BYTES else 8


def _use_numba(backend: str, *tensors: torch.Tensor) -> bool:
    _check_backend(backend)
    if backend == "torch":
        return False
    on_cpu = all(t.device.type == "cpu" for t in tensors)
    if backend == "numba":
        if not numba_available():
            raise ValueError("backend='numba' requested but numba is not importable (pip install numba)")
        if not on_cpu:
            raise ValueError("backend='numba' needs CPU tensors; got "
                             + ", ".join(str(t.device) for t in tensors))
        return True
    return on_cpu and numba_available()


def _codes_array(codes: torch.Tensor):
    """A numpy view of `codes` keeping its strides (a [:, :, :M] view of a capacity buffer is not copied)."""
    codes = codes.detach()
    if codes.shape[-1] > 1 and codes.stride(-1) != 1:  # the kernels read a row's bytes as one run
        codes = codes.contiguous()
    return codes.numpy()


# --------------------------------------------------------------------------- public API
def coded_scores(queries: torch.Tensor, codes: torch.Tensor, codewords: torch.Tensor, index_bits: int,
                 backend: str = "auto") -> torch.Tensor:
    """queries float32 [B, H, Q, D] (rotated domain), codes uint8 [B, H, M, code_size], codewords float32 [N, k]
    -> float32 [B, H, Q, M]: s[b,h,q,i] = nu[b,h,i] * sum_j <queries[b,h,q, j*k:(j+1)*k], codewords[idx[b,h,i,j]]>

    backend: "auto" (numba for CPU tensors when numba imports, else torch), "torch" (the reference),
    "numba" (ValueError if numba is missing or a tensor is not on the CPU). `codes` may be a strided
    view (e.g. [:, :, :M] of a capacity buffer); it is read in place. Raises ValueError for bad
    shapes/dtypes and for indices >= N (possible only when N < 2^index_bits).
    """
    n_codewords, k, n_blocks = _validate_scores(queries, codes, codewords, index_bits)
    _check_backend(backend)
    if not _use_numba(backend, queries, codes, codewords):
        return coded_scores_reference(queries, codes, codewords, index_bits)
    n_b, n_h, n_q, _ = queries.shape
    n_tokens = codes.shape[2]
    out = torch.empty(n_b, n_h, n_q, n_tokens, dtype=torch.float32)
    if out.numel() == 0:
        return out
    mode = _numba_mode(n_codewords, index_bits)
    lanes = _lanes(n_q, mode, index_bits, n_blocks)
    units = n_b * n_h * -(-n_q // lanes)
    args = (queries.detach().contiguous().numpy(), _codes_array(codes),
            codewords.detach().contiguous().numpy(), out.numpy(), index_bits, n_blocks, mode, lanes)
    bad = _run_units(_kernels()[0], args, units, n_tokens * n_blocks)
    if bad:
        raise ValueError(f"codes hold {bad} index(es) >= N={n_codewords} (index_bits={index_bits})")
    return out


def coded_weighted_sum(weights: torch.Tensor, codes: torch.Tensor, codewords: torch.Tensor, index_bits: int,
                       backend: str = "auto", *, dim: Optional[int] = None) -> torch.Tensor:
    """weights float32 [B, H, Q, M], codes uint8 [B, H, M, code_size] -> float32 [B, H, Q, D]:
    out[b,h,q, j*k:(j+1)*k] = sum_i weights[b,h,q,i] * nu[b,h,i] * codewords[idx[b,h,i,j]]

    D = n_blocks * k with n_blocks = the number of index_bits-bit indices that fill code_size - 2
    bytes (exact for every FibQuant/TurboQuant config whose D * index_bits / k is a multiple of 8);
    pass `dim` to state D when the packing leaves an index-sized gap. backend and errors as in
    `coded_scores`. M = 0 gives zeros.
    """
    n_codewords, k, n_blocks = _validate_weighted_sum(weights, codes, codewords, index_bits, dim)
    _check_backend(backend)
    if not _use_numba(backend, weights, codes, codewords):
        return coded_weighted_sum_reference(weights, codes, codewords, index_bits, dim=n_blocks * k)
    n_b, n_h, n_q, n_tokens = weights.shape
    out = torch.empty(n_b, n_h, n_q, n_blocks * k, dtype=torch.float32)
    if n_tokens == 0 or out.numel() == 0:
        return out.zero_()
    mode = _numba_mode(n_codewords, index_bits)
    lanes = _lanes(n_q, mode, index_bits, n_blocks)
    units = n_b * n_h * -(-n_q // lanes)
    args = (weights.detach().contiguous().numpy(), _codes_array(codes),
            codewords.detach().contiguous().numpy(), out.numpy(), index_bits, n_blocks, mode, lanes)
    bad = _run_units(_kernels()[1], args, units, n_tokens * n_blocks)
    if bad:
        raise ValueError(f"codes hold {bad} index(es) >= N={n_codewords} (index_bits={index_bits})")
    return out
