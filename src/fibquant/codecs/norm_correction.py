"""FibQuant's norm correction: the stored norm ||x|| / ||u_hat|| of a code (bytes [0, 2)), from the input
rows and the code's block indices (u_hat = the concatenated codewords, so ||u_hat||^2 = the sum of their
squared norms).

The spec, `corrected_norms_reference` (torch, float64): ||u_hat|| = sqrt(sum_j ||c_{i_j}||^2) over the
float32 squared norms widened to float64, ||x|| = x.to(float64).norm(dim=1), the stored value
||x|| / max(||u_hat||, 1e-30) (0 for a zero row), rounded to float32 and then to fp16 (the bytes).

The fast path, `corrected_norm_bytes` (numba, CPU): the same formula with both sums in its own order
(vectorised). Two float64 sums of m non-negative terms in any two orders differ by at most
2 (m - 1) 2^-53 of the sum, so with the square roots and the division the stored value differs from the
spec's by a relative < 1e-13 for rows and index lists of m <= MAX_TERMS = 256 terms (2e-14 at dim 64).
A row's bytes are taken only when round16(round32(.)) gives the same bytes at v (1 - REL) and v (1 + REL)
(v the fast value, REL = 1e-12 >= 10x that bound): the composite rounding is monotone, so the spec's
value, which lies between the two, rounds to those bytes as well. A row where they differ (~4e-9 of rows:
within REL of an fp16 rounding boundary), longer rows, a row whose ||u_hat|| is near the spec's 1e-30
clamp, and a call where a value reaches the fp16 range's end (the spec raises there) make the whole call
take the spec, so the bytes are the spec's in every case.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from .._numba import njit_cached
from .base import FP16_MAX
from .bitpack import float16_to_bytes

REL = 1e-12          # relative half-width of the interval the spec's value is known to lie in (see above)
MAX_TERMS = 256      # the bound above holds for rows and index lists up to this long; longer ones take the spec
CLAMP = 1e-30        # the spec's floor on ||u_hat||

_KERNEL = None
_LOCK = threading.Lock()


def corrected_norms_reference(x: torch.Tensor, index: torch.Tensor, sq_norms64: torch.Tensor) -> torch.Tensor:
    """The spec: stored norms float32 [n] of rows x [n, dim] (float) whose codes hold block indices
    index [n, blocks] (int64), sq_norms64 float64 [N] the codewords' squared norms. ValueError when a
    value exceeds the fp16 range of the stored norm."""
    # index_select on the flat indices: the same float64 values as sq_norms[index], ~2.5x faster
    u_norm = sq_norms64.index_select(0, index.reshape(-1)).view(index.shape).sum(1).sqrt()
    norms = x.to(torch.float64).norm(dim=1)
    stored = torch.where(norms > 0, norms / u_norm.clamp_min(CLAMP), torch.zeros_like(norms))
    if len(stored) and float(stored.max()) > FP16_MAX:
        raise ValueError("corrected norm exceeds the fp16 range of the stored norm")
    return stored.to(torch.float32)


def _bounds_py(x, index, sq, rel, lo32, hi32):
    """Per row r of x [n, dim] (float32) with indices index [n, blocks]: lo32[r], hi32[r] = the corrected
    norm times (1 -+ rel), rounded to float32; 0, 0 for a zero row; 0, 1 (undecided) where ||u_hat|| is
    within 2x of the clamp. Sums in any order (fastmath reassoc: vectorised)."""
    n, dim = x.shape
    blocks = index.shape[1]
    for r in range(n):
        s = 0.0
        for j in range(dim):
            v = np.float64(x[r, j])
            s += v * v
        if s == 0.0:
            lo32[r] = 0.0
            hi32[r] = 0.0
            continue
        t = 0.0
        for b in range(blocks):
            t += sq[index[r, b]]
        un = np.sqrt(t)
        if not un > 2.0 * CLAMP:
            lo32[r] = 0.0
            hi32[r] = 1.0
            continue
        value = np.sqrt(s) / un
        lo32[r] = np.float32(value * (1.0 - rel))
        hi32[r] = np.float32(value * (1.0 + rel))
    return 0


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        with _LOCK:
            if _KERNEL is None:
                _KERNEL = njit_cached("int64(float32[:, ::1], int64[:, ::1], float64[::1], float64, float32[::1], "
                                      "float32[::1])", nogil=True,
                                      fastmath={"reassoc", "contract"})(_bounds_py)
    return _KERNEL


def corrected_norm_bytes(x: np.ndarray, index: np.ndarray, sq_norms64: np.ndarray) -> np.ndarray | None:
    """The spec's bytes uint8 [n, 2] (`corrected_norms_reference`, then fp16) from x float32 [n, dim]
    (C-contiguous, finite), index int64 [n, blocks] (C-contiguous, each < len(sq_norms64)) and sq_norms64
    float64 [N]; None when a row is undecided or a value reaches the fp16 range's end (the caller then
    runs the spec: module docstring). Needs numba."""
    n = x.shape[0]
    if x.shape[1] > MAX_TERMS or index.shape[1] > MAX_TERMS:
        return None
    lo32 = np.empty(n, dtype=np.float32)
    hi32 = np.empty(n, dtype=np.float32)
    _kernel()(x, index, sq_norms64, REL, lo32, hi32)
    if n and float(hi32.max()) >= FP16_MAX:
        return None
    # numpy's float32 -> float16 rounding equals torch's (round to nearest even; checked once for every float32
    # in [0, FP16_MAX], sampled by tests/codebook/test_search_kernels.py::test_numpy_fp16_norm_bytes_match_torch)
    lo16, hi16 = lo32.astype(np.float16).view(np.uint16), hi32.astype(np.float16).view(np.uint16)
    if not np.array_equal(lo16, hi16):
        return None
    return lo16.view(np.uint8).reshape(n, 2)


def reference_norm_bytes(x: torch.Tensor, index: torch.Tensor, sq_norms64: torch.Tensor) -> torch.Tensor:
    """The spec's bytes uint8 [n, 2] (`corrected_norms_reference` through `float16_to_bytes`)."""
    return float16_to_bytes(corrected_norms_reference(x, index, sq_norms64))
