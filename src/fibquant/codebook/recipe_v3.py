"""Construction version v3: fresh-sample Lloyd on a fixed work budget (every new build).

Starts (`starts`): the companded quasi-uniform grid (`construct.initial_codebook`) first for
k <= GRID_INIT_MAX_K (in 2-4 dimensions random points leave clusters and holes that Lloyd is slow
to spread), N seeded random source samples first above (in high dimension a better start than a
low-discrepancy sequence). Where the budget affords both (one start's planned work <= WORK / 2:
small N), both run on the same batches and the one with the lower MSE on a common held-out batch
(at least SELECT_BATCH blocks) is kept (measured: at small N neither start always wins; d = 32,
k = 2: at N = 32 the samples by 1.0 %, at N = 64 the grid by 0.7 %); elsewhere the first start
only (a restart does not pay for its cost there).

Every Lloyd iteration draws a *fresh* batch of canonical-source k-blocks (seeded per iteration), so
the codebook never fits one training set (v2 trained on a fixed 2^18-sample set: its fresh-sample
MSE was 1-3 % above its training MSE at N = 256 and 13 % at k = 4, N = 4096) and every batch MSE is
an unbiased estimate for the codebook of that moment. Two phases (`plan`):

- coarse: `coarse_iterations` iterations on batches of `final_batch / COARSE_RATIO` blocks (cheap
  steps that do most of the moving);
- final: FINAL_ITERATIONS iterations on batches of `final_batch` blocks whose cell counts and sums
  are pooled, so the last codewords are the cell means of FINAL_ITERATIONS * final_batch blocks.

The budget: WORK multiply-add equivalents, a sample costing `sample_cost(k, N)` to assign (the
full scan's N (k + 24) for k > 4; the k-d tree's ~64 (k + 24) log2 N for k <= 4); FINAL_SHARE of
it goes to the final phase (60 % below k = HIGH_K, where convergence from the start needs more
coarse iterations; 75 % from it on, where the centroids' sampling noise costs more: measured at
d = 64 on k = 8 and k = 64, N = 4096), with final_batch in [MIN_FINAL_PER_CODEWORD * N,
MAX_FINAL_PER_CODEWORD * N] (and in [MIN_BATCH, MAX_BATCH]); the rest goes to the coarse phase,
within [MIN_COARSE_ITERATIONS, MAX_COARSE_ITERATIONS] iterations (small N: many cheap iterations,
as 2-D Lloyd needs). Assignment is exact (`lloyd.assign_exact`: the plain reference's index, found by the numba search), so the result is
bit-identical for the same (d, k, N, seed) whatever the thread count or search path.

`total_mse` of a v3 codebook: with two starts the winner's MSE on the held-out batch; with one,
the last batch's MSE (fresh samples, before the last update).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from tqdm.auto import tqdm

from ..canonical import sample_blocks
from .construct import initial_codebook
from .lloyd import assign_exact, cell_statistics, move_codewords

VERSION = "v3"
WORK = 4e11                      # multiply-add equivalents per build (<= 21 CPU-s measured, one thread)
MAX_BATCH = 1 << 20              # blocks per final-phase batch
MIN_BATCH = 1 << 12              # blocks per coarse batch, at least
MIN_FINAL_PER_CODEWORD = 16      # final batch >= this * N (only binds at the largest k * N)
MAX_FINAL_PER_CODEWORD = 1024    # final batch <= this * N (pooled 3x: >= 3072 blocks per cell at the cap)
FINAL_ITERATIONS = 3
FINAL_SHARE = (0.6, 0.75)        # of the budget, for k < HIGH_K and k >= HIGH_K
HIGH_K = 32                      # from here centroid noise costs more than coarse iterations gain
COARSE_RATIO = 4
MIN_COARSE_ITERATIONS = 4
MAX_COARSE_ITERATIONS = 60
GRID_INIT_MAX_K = 4
SELECT_BATCH = 1 << 18           # held-out blocks (at least) that decide between two starts
TREE_SAMPLE_COST = 64            # the tree search's cost per sample, in units of (k + 24) log2 N
PROGRESS_SECONDS = 3.0           # show a bar when the build should take longer than this
WORK_PER_SECOND = 1e10           # rough single-core rate, only for that decision


def sample_cost(k: int, n_codewords: int) -> float:
    """Multiply-add equivalents to assign one k-block to the nearest of N codewords."""
    from .numba_search import TREE_MAX_K
    if k <= TREE_MAX_K:
        return TREE_SAMPLE_COST * (k + 24) * math.ceil(math.log2(n_codewords))
    return n_codewords * (k + 24)


def plan(spec) -> tuple[tuple[int, int], tuple[int, int]]:
    """((coarse batch, coarse iterations), (final batch, final iterations)) of a v3 build."""
    n = spec.n_codewords
    budget = WORK / sample_cost(spec.k, n)                          # samples, all iterations
    share = FINAL_SHARE[spec.k >= HIGH_K]
    final = int(max(MIN_BATCH, min(MAX_BATCH, MAX_FINAL_PER_CODEWORD * n,
                                   max(MIN_FINAL_PER_CODEWORD * n, budget * share / FINAL_ITERATIONS))))
    coarse = max(MIN_BATCH, final // COARSE_RATIO)
    iterations = int(min(MAX_COARSE_ITERATIONS, max(MIN_COARSE_ITERATIONS, budget * (1 - share) // coarse)))
    return (coarse, iterations), (final, FINAL_ITERATIONS)


def starts(spec) -> list[str]:
    """The Lloyd starts of a v3 build: "grid" (companded quasi-uniform) and/or "samples"."""
    first, second = ("grid", "samples") if spec.k <= GRID_INIT_MAX_K else ("samples", "grid")
    return [first, second] if planned_work(spec) * 2 <= WORK else [first]


def planned_work(spec) -> float:
    """Multiply-add equivalents of one start's Lloyd iterations."""
    (coarse, coarse_iterations), (final, final_iterations) = plan(spec)
    return (coarse * coarse_iterations + final * final_iterations) * sample_cost(spec.k, spec.n_codewords)


def initial(spec, start: str = "grid") -> torch.Tensor:
    """A start of the Lloyd iteration: [N, k] float32."""
    if start == "grid":
        return initial_codebook(spec.dim, spec.k, spec.n_codewords).to(torch.float32)
    gen = torch.Generator().manual_seed(spec.derived_seed("init", VERSION))
    return sample_blocks(spec.n_codewords, spec.dim, spec.k, generator=gen)


def batch(spec, iteration: int, n: int) -> torch.Tensor:
    """The fresh canonical-source batch of one iteration: [n, k] float32."""
    gen = torch.Generator().manual_seed(spec.derived_seed(f"batch{iteration}", VERSION))
    return sample_blocks(n, spec.dim, spec.k, generator=gen)


def build_vector(spec, progress: bool | None, *, use_numba: bool | None = None) -> tuple[torch.Tensor, float]:
    """The v3 codebook [N, k] float32 of `spec` (k >= 2) and its fresh-sample total MSE.

    `use_numba`: None = the numba search when available, False = the plain reference assignment
    (same indices, slower; the tests compare the two).
    """
    (coarse, coarse_iterations), (final, final_iterations) = plan(spec)
    schedule = [(coarse, False)] * coarse_iterations + [(final, True)] * final_iterations
    kinds = starts(spec)
    seconds = planned_work(spec) * len(kinds) / WORK_PER_SECOND
    show = progress if progress is not None else seconds > PROGRESS_SECONDS
    best, best_mse = None, math.inf
    with tqdm(total=len(schedule) * len(kinds), disable=not show, leave=False, unit="it",
              desc=f"codebook d={spec.dim} k={spec.k} N={spec.n_codewords}") as bar:
        for kind in kinds:
            codewords, block_mse = _lloyd(spec, initial(spec, kind), schedule, bar, use_numba)
            if len(kinds) > 1:  # compare the starts on one common held-out batch
                held_out = batch(spec, -1, max(final, SELECT_BATCH))
                index = assign_exact(held_out, codewords, use_numba=use_numba)
                block_mse = _mean(cell_statistics(held_out, codewords, index)[0])
            if block_mse < best_mse:
                best, best_mse = codewords, block_mse
    return best, best_mse * spec.dim / spec.k


def _mean(error: torch.Tensor) -> float:
    """float64 mean in numpy's fixed (single-threaded, pairwise) order: the same for any thread count."""
    return float(np.mean(error.numpy(), dtype=np.float64))


def _lloyd(spec, codewords: torch.Tensor, schedule: list[tuple[int, bool]], bar,
           use_numba: bool | None) -> tuple[torch.Tensor, float]:
    """Fresh-sample Lloyd from `codewords` over `schedule` [(batch size, pooled)]: (codewords, last batch MSE)."""
    pooled_counts = pooled_sums = None
    block_mse = math.nan
    for iteration, (n, pool) in enumerate(schedule):
        samples = batch(spec, iteration, n)
        index = assign_exact(samples, codewords, use_numba=use_numba)
        error, counts, sums = cell_statistics(samples, codewords, index)
        block_mse = _mean(error)
        if pool:
            pooled_counts = counts if pooled_counts is None else pooled_counts + counts
            pooled_sums = sums if pooled_sums is None else pooled_sums + sums
            counts, sums = pooled_counts, pooled_sums
        codewords, _ = move_codewords(codewords, samples, error, counts, sums)  # empty cells: batch's worst samples
        bar.update(1)
        bar.set_postfix(mse=f"{block_mse * spec.dim / spec.k:.5g}", batch=n)
    return codewords.contiguous(), block_mse
