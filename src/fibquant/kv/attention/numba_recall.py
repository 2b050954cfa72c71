"""Recall's top-k on the CPU: each row's k largest scores in one pass (numba), for few rows of many columns.

torch.topk over [rows, 8192] scores takes ~0.6 ms for a decode step's 9 rows on one thread; a pass
that keeps the k best seen so far (replacing the smallest of them when a larger score comes, then
rescanning the k) costs M comparisons plus about k ln(M / k) rescans of k, ~0.1 ms there. `row_topk`
returns the same set of columns as `torch.topk(scores, k).indices` (ties broken by the first column),
in no particular order; the tests hold it to torch.topk.
"""
from __future__ import annotations

import torch

from fibquant._numba import numba_available

_KERNEL = None
_topk_row = None  # _topk_row_py, jitted (bound by `_kernel`)


def _topk_row_py(row, n, k, out, best):
    """out[:k] = the columns of the k largest of row[:n] (the first of equal ones); best: scratch [>= k]."""
    for j in range(k):
        best[j] = row[j]
        out[j] = j
    low = 0
    for j in range(1, k):
        if best[j] < best[low]:
            low = j
    for c in range(k, n):
        value = row[c]
        if value > best[low]:
            best[low] = value
            out[low] = c
            low = 0
            for j in range(1, k):
                if best[j] < best[low]:
                    low = j
    return 0


def _topk_rows_py(scores, k, out):
    """out[r] = `_topk_row` of scores[r], every row."""
    best = np.empty(k, dtype=np.float32)
    for r in range(scores.shape[0]):
        _topk_row(scores[r], scores.shape[1], k, out[r], best)
    return 0


np = None  # numpy, bound by `_kernel`


def _kernel():
    global _KERNEL, _topk_row, np
    if _KERNEL is None:
        import numpy

        from fibquant.kv.attention.jit import kernel_jit

        np = numpy
        _topk_row = kernel_jit(nogil=True)(_topk_row_py)
        _KERNEL = kernel_jit("int64(float32[:, ::1], int64, int64[:, ::1])", nogil=True)(_topk_rows_py)
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
