"""Construction version v2 (the recipe of every shipped d = 64 codebook), kept verbatim.

The shipped `*_v2.safetensors` files are what `load_codebook` returns for their keys; this module
rebuilds them (`build_codebook(..., version="v2")`), for the benchmark that compares the recipes and
for anyone reproducing a v2 file. New builds use v3 (`recipe_v3.py`).

Recipe: training samples S = clamp(SAMPLES_PER_CODEWORD * N, MIN_SAMPLES, MAX_SAMPLES * max(1, k // 16))
k-blocks of uniform points on S^{d-1}; RESTARTS restarts (restart 0 from the canonical quasi-uniform
initialisation; restart 1 from N seeded random training samples, which in high dimension is a
better start than a low-discrepancy sequence; further restarts from the quasi-uniform
construction with a seeded random sequence offset s). Each restart runs Lloyd in two phases: first
on the first S/COARSE_FRACTION samples (cheap steps that do most of the moving), then on all S
samples; each phase stops at relative improvement < TOL or after as many steps as its work budget
(multiply-adds) allows, within [MIN_ITERATIONS, MAX_ITERATIONS]. The restart with the lowest MSE on
all S samples wins. Build times: 5-100 s for N <= 256, 324 s for k = 4, N = 1024, ~20 min for
N = 4096 at d = 64 (shared 2-core machine).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from tqdm.auto import tqdm

from ..canonical import sample_blocks
from .construct import initial_codebook
from .lloyd import lloyd

VERSION = "v2"
MAX_SAMPLES = 1 << 18
SAMPLES_PER_CODEWORD = 1024
MIN_SAMPLES = 1 << 14
RESTARTS = 2
COARSE_FRACTION = 4
MAX_ITERATIONS = (60, 10)         # (coarse phase, full phase)
PHASE_WORK = (1.5e12, 1.5e12)       # per phase and restart, in units of samples * N * (k + 8)
MIN_ITERATIONS = 4
TOL = 1e-5
PROGRESS_WORK = 2e11  # show a progress bar when restarts * iterations * S * N * k exceeds this


def n_training_samples(spec) -> int:
    # High-dimensional blocks need more samples per cell before Lloyd stops overfitting.
    cap = MAX_SAMPLES * max(1, spec.k // 16)
    return int(min(cap, max(MIN_SAMPLES, SAMPLES_PER_CODEWORD * spec.n_codewords)))


def training_samples(spec, n: int | None = None) -> torch.Tensor:
    """The canonical-source k-blocks a v2 codebook is trained on: [S, k] float32 (CPU)."""
    gen = torch.Generator().manual_seed(spec.derived_seed("train", VERSION))
    return sample_blocks(n_training_samples(spec) if n is None else n, spec.dim, spec.k, generator=gen)


def phase_plan(spec) -> list[tuple[int, int]]:
    """[(samples, max iterations)] of the coarse and the full Lloyd phase of one restart."""
    total = n_training_samples(spec)
    plan = []
    for samples, cap, budget in zip((total // COARSE_FRACTION, total), MAX_ITERATIONS, PHASE_WORK):
        # search cost per sample and codeword: k multiply-adds plus ~8 for the argmin pass
        steps = int(budget // (samples * spec.n_codewords * (spec.k + 8)))
        plan.append((samples, max(MIN_ITERATIONS, min(cap, steps))))
    return plan


def build_vector(spec, progress: bool | None) -> tuple[torch.Tensor, float]:
    """The v2 codebook [N, k] float32 of `spec` (k >= 2) and its training-set total MSE."""
    samples = training_samples(spec)
    plan = phase_plan(spec)
    steps = RESTARTS * sum(cap for _, cap in plan)
    work = RESTARTS * sum(n * cap for n, cap in plan) * spec.n_codewords * (spec.k + 8)
    show = progress if progress is not None else work > PROGRESS_WORK
    rng = np.random.default_rng(spec.derived_seed("restarts", VERSION))
    best, best_mse = None, math.inf
    with tqdm(total=steps, disable=not show, leave=False,
              desc=f"codebook v2 d={spec.dim} k={spec.k} N={spec.n_codewords}") as bar:
        for restart in range(RESTARTS):
            if restart == 1:
                picks = rng.choice(samples.shape[0], size=spec.n_codewords, replace=False)
                codewords = samples[torch.from_numpy(np.sort(picks))].clone()
            else:
                offset = None if restart == 0 else rng.random(spec.k + 1)
                codewords = initial_codebook(spec.dim, spec.k, spec.n_codewords, offset).to(torch.float32)
            for n, cap in plan:
                result = lloyd(samples[:n], codewords, max_iterations=cap, tol=TOL, progress=bar)
                bar.update(cap - result.iterations)
                codewords = result.codewords
            if result.block_mse < best_mse:
                best, best_mse = result.codewords, result.block_mse
    return best, best_mse * spec.dim / spec.k
