"""Recall's top-k on the CPU: each row's k largest scores in one pass (numba), for few rows of many columns.

torch.topk over [rows, 8192] scores takes ~0.6 ms for a decode step's 9 rows on one thread; a pass
that keeps the k best seen so far (replacing the smallest of them when a larger score comes, then
rescanning the k) costs M comparisons plus about k ln(M / k) rescans of k, ~0.1 ms there. `row_topk`
returns the same set of columns as `torch.topk(scores, k).indices` (ties broken by the first column),
in no particular order; the tests hold it to torch.topk.
"""
from __future__ import annotations

from pathlib import Path

import torch

from fibquant._numba import njit_tracking, numba_available

_KERNEL = None


def _topk_py(scores, k, out):
    """out[r] = the columns of the k largest scores[r] (the first of equal ones)."""
    rows, columns = scores.shape
    best = scores[0, :k].copy()
    for r in range(rows):
        for j in range(k):
            best[j] = scores[r, j]
            out[r, j] = j
        low = 0
        for j in range(1, k):
            if best[j] < best[low]:
                low = j
        for c in range(k, columns):
            value = scores[r, c]
            if value > best[low]:
                best[low] = value
                out[r, low] = c
                low = 0
                for j in range(1, k):
                    if best[j] < best[low]:
                        low = j
    return 0


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = njit_tracking("int64(float32[:, ::1], int64, int64[:, ::1])", depends_on=(Path(__file__),),
                                nogil=True)(_topk_py)
    return _KERNEL


def row_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Column indices long [..., k] of each row's k largest `scores` [..., M] (float32), in no order:
    the numba pass for CPU tensors when numba imports and 0 < k <= M, else torch.topk."""
    columns = scores.shape[-1]
    if (scores.device.type != "cpu" or scores.dtype != torch.float32 or not 0 < k <= columns
            or scores.requires_grad or not numba_available()):
        return scores.topk(k, dim=-1, sorted=False).indices
    flat = scores.reshape(-1, columns).contiguous()
    out = torch.empty(flat.shape[0], k, dtype=torch.int64)
    _kernel()(flat.numpy(), k, out.numpy())
    return out.view(*scores.shape[:-1], k)
