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

Modules: `coded_reference` (argument checks and the torch reference), `coded_numba` (the kernels),
`coded_numba_tables` (their jitted helpers), `coded_intrinsics` (the vector intrinsics); this
module picks the backend and splits the work over threads.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

from .._numba import numba_available, run_split
from .coded_numba import _MODE_BYTES, _MODE_FIELDS
from .coded_reference import (BACKENDS, _check_backend, _validate_scores, _validate_weighted_sum,
                              coded_scores_reference, coded_weighted_sum_reference)

_MIN_WORK_PER_THREAD = 1 << 16  # token-positions per unit below which threads do not pay
_LUT_L2_BYTES = 512 * 1024   # 16 lanes only when the byte table stays within this (an L2's worth)

__all__ = [
    "coded_scores",
    "coded_weighted_sum",
    "coded_scores_reference",
    "coded_weighted_sum_reference",
    "numba_available",
    "BACKENDS",
]

_KERNELS = None
_KERNELS_LOCK = threading.Lock()


def _kernels():
    """(scores, weighted_sum) numba dispatchers, compiled (or loaded from numba's cache) once."""
    global _KERNELS
    if _KERNELS is None:
        with _KERNELS_LOCK:
            if _KERNELS is None:
                from .coded_numba import compile_kernels

                _KERNELS = compile_kernels()
    return _KERNELS


def _run_units(kernel, args, units: int, work_per_unit: int) -> int:
    """Run `kernel(*args, start, stop)` over `units`, split across up to torch.get_num_threads() threads."""
    return run_split(kernel, args, units, work_per_unit, _MIN_WORK_PER_THREAD, "fibquant-coded")


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
