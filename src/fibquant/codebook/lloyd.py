"""Lloyd (k-means) refinement of a codebook on samples of the canonical source.

Plain batch Lloyd: assign every sample to its nearest codeword (chunked matmul search),
move every codeword to the mean of its cell (float64 sums), repeat until the relative MSE
improvement falls below `tol`. An empty cell is re-seeded deterministically at the samples
with the largest current error, so N codewords stay in use. CPU-only and deterministic:
the same inputs give bit-identical outputs. (`lloyd` is the v2 recipe's and RVQ's Lloyd; unchanged.)

For the v3 recipe (`recipe_v3.py`): `assign_exact` returns the index of the plain reference
`nearest_codeword_reference` (float64 distances, lowest index among equals) through the numba search
(`numba_search.NumbaSearch`: k-d tree for k <= TREE_MAX_K, float32 BLAS screen + float64 check
otherwise), or through `assign_reference` (the reference itself, chunked) without numba; both give
the same indices, so a v3 codebook does not depend on the path, the thread count or float32 ties.
`cell_statistics` is one Lloyd accumulation: per-codeword counts and float64 sums.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .nearest import nearest_codeword, nearest_codeword_reference

REFERENCE_CHUNK_ELEMENTS = 1 << 22  # float64 differences per chunk of the reference assignment


@dataclass(frozen=True)
class LloydResult:
    codewords: torch.Tensor  # [N, k] float32
    block_mse: float         # E||y - y_hat||^2 per block on the training samples
    iterations: int


def assign(samples: torch.Tensor, codewords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """samples [S, k], codewords [N, k] -> (index int64 [S], squared error float32 [S])."""
    index = nearest_codeword(samples, codewords, chunk_elements=1 << 22)
    error = ((samples - codewords[index]) ** 2).sum(-1)
    return index, error


def assign_reference(samples: torch.Tensor, codewords: torch.Tensor) -> torch.Tensor:
    """The plain reference assignment (float64 squared distances, argmin), chunked: int64 [S]."""
    n_codewords, k = codewords.shape
    rows = max(1, REFERENCE_CHUNK_ELEMENTS // (n_codewords * k))
    out = torch.empty(samples.shape[0], dtype=torch.int64)
    for start in range(0, samples.shape[0], rows):
        out[start:start + rows] = nearest_codeword_reference(samples[start:start + rows], codewords)
    return out


def assign_exact(samples: torch.Tensor, codewords: torch.Tensor, *, use_numba: bool | None = None) -> torch.Tensor:
    """samples [S, k], codewords [N, k] (CPU float32) -> the reference's nearest index, int64 [S].

    The numba search when numba imports (use_numba=None) or when asked (True); else the reference.
    """
    from .numba_search import TREE_MAX_K, NumbaSearch, numba_available
    if use_numba is None:
        use_numba = numba_available()
    if not use_numba:
        return assign_reference(samples, codewords)
    k = codewords.shape[1]
    search = NumbaSearch(codewords, k, method="tree" if k <= TREE_MAX_K else "brute")
    return search.indices(samples.contiguous()).reshape(-1)


def cell_statistics(samples: torch.Tensor, codewords: torch.Tensor,
                    index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(squared error float32 [S], counts int64 [N], float64 sums [N, k]) of an assignment."""
    n_codewords, k = codewords.shape
    error = ((samples - codewords[index]) ** 2).sum(-1)
    counts = torch.bincount(index, minlength=n_codewords)
    sums = torch.zeros(n_codewords, k, dtype=torch.float64).index_add_(0, index, samples.to(torch.float64))
    return error, counts, sums


def move_codewords(codewords: torch.Tensor, samples: torch.Tensor, error: torch.Tensor, counts: torch.Tensor,
                   sums: torch.Tensor) -> tuple[torch.Tensor, int]:
    """One Lloyd step from `cell_statistics`: each codeword to its cell's mean (float32); an empty
    cell re-seeded deterministically at the samples with the largest error -> (codewords, empty cells)."""
    filled = counts > 0
    means = (sums / counts.clamp(min=1).unsqueeze(1)).to(torch.float32)
    codewords = torch.where(filled.unsqueeze(1), means, codewords)
    empty = torch.nonzero(~filled).flatten()
    if empty.numel():
        codewords[empty] = samples[torch.topk(error, empty.numel()).indices]
    return codewords, int(empty.numel())


def lloyd(samples: torch.Tensor, init: torch.Tensor, *, max_iterations: int = 50, tol: float = 1e-4,
          progress=None) -> LloydResult:
    """Refine `init` [N, k] on `samples` [S, k] (both CPU float32). `progress`: tqdm-like or None."""
    codewords = init.to(torch.float32).clone()
    previous = float("inf")
    mse = previous
    iterations = 0
    for iterations in range(1, max_iterations + 1):
        index = nearest_codeword(samples, codewords, chunk_elements=1 << 22)
        error, counts, sums = cell_statistics(samples, codewords, index)
        mse = float(error.to(torch.float64).mean())
        codewords, empty = move_codewords(codewords, samples, error, counts, sums)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(mse=f"{mse:.5g}")
        if empty == 0 and previous - mse <= tol * mse:
            break
        previous = mse
    _, error = assign(samples, codewords)
    return LloydResult(codewords.contiguous(), float(error.to(torch.float64).mean()), iterations)
