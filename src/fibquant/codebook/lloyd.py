"""Lloyd (k-means) refinement of a codebook on samples of the canonical source.

Plain batch Lloyd: assign every sample to its nearest codeword (chunked matmul search),
move every codeword to the mean of its cell (float64 sums), repeat until the relative MSE
improvement falls below `tol`. An empty cell is re-seeded deterministically at the samples
with the largest current error, so N codewords stay in use. CPU-only and deterministic:
the same inputs give bit-identical outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .search import nearest_codeword


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


def lloyd(samples: torch.Tensor, init: torch.Tensor, *, max_iterations: int = 50, tol: float = 1e-4,
          progress=None) -> LloydResult:
    """Refine `init` [N, k] on `samples` [S, k] (both CPU float32). `progress`: tqdm-like or None."""
    codewords = init.to(torch.float32).clone()
    n_codewords, k = codewords.shape
    previous = float("inf")
    mse = previous
    iterations = 0
    for iterations in range(1, max_iterations + 1):
        index, error = assign(samples, codewords)
        mse = float(error.to(torch.float64).mean())
        counts = torch.bincount(index, minlength=n_codewords)
        sums = torch.zeros(n_codewords, k, dtype=torch.float64).index_add_(0, index, samples.to(torch.float64))
        filled = counts > 0
        means = sums / counts.clamp(min=1).unsqueeze(1)
        codewords = torch.where(filled.unsqueeze(1), means.to(torch.float32), codewords)
        empty = torch.nonzero(~filled).flatten()
        if empty.numel():
            worst = torch.topk(error, empty.numel()).indices  # deterministic re-seeding
            codewords[empty] = samples[worst]
        if progress is not None:
            progress.update(1)
            progress.set_postfix(mse=f"{mse:.5g}")
        if empty.numel() == 0 and previous - mse <= tol * mse:
            break
        previous = mse
    _, error = assign(samples, codewords)
    return LloydResult(codewords.contiguous(), float(error.to(torch.float64).mean()), iterations)
