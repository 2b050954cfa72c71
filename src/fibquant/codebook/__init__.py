"""Universal FibQuant codebooks: one codebook per (d, k, N, seed) serves all data.

`build_codebook` constructs one (deterministic initialisation + multi-restart Lloyd on
canonical-source samples, keeping the best restart; k = 1 is the exact scalar Lloyd-Max
table); `load_codebook` returns the shipped or cached copy and builds + caches it if absent.

Recipe (part of construction version `CONSTRUCTION_VERSION`; changing it changes the key):
training samples S = clamp(SAMPLES_PER_CODEWORD * N, MIN_SAMPLES, MAX_SAMPLES * max(1, k // 16))
k-blocks of uniform points on S^{d-1}; RESTARTS restarts (restart 0 from the canonical quasi-uniform
initialisation; restart 1 from N seeded random training samples, which in high dimension is a
better start than a low-discrepancy sequence; further restarts from the quasi-uniform
construction with a seeded random sequence offset s). Each restart runs Lloyd in two phases: first on the first S/COARSE_FRACTION samples (cheap
steps that do most of the moving), then on all S samples; each phase stops at relative
improvement < TOL or after as many steps as its work budget (multiply-adds) allows, within
[MIN_ITERATIONS, MAX_ITERATIONS]. The restart with the lowest MSE on all S samples wins.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from ..source import check_dim_block, sample_blocks
from . import store
from .construct import initial_codebook
from .lloyd import lloyd
from .scalar import lloyd_max_table
from .search import nearest_codeword, nearest_codeword_reference, nearest_level

CONSTRUCTION_VERSION = "v2"  # v1: first recipe (3 restarts, fixed budget), never shipped
MAX_SAMPLES = 1 << 18
SAMPLES_PER_CODEWORD = 1024
MIN_SAMPLES = 1 << 14
RESTARTS = 2
COARSE_FRACTION = 4
MAX_ITERATIONS = (60, 10)         # (coarse phase, full phase)
PHASE_WORK = (1.5e12, 1.5e12)       # per phase and restart, in units of samples * N * (k + 8)
MIN_ITERATIONS = 4
TOL = 1e-5
MAX_CODEWORDS = 1 << 16
PROGRESS_WORK = 2e11  # show a progress bar when restarts * iterations * S * N * k exceeds this

__all__ = [
    "CONSTRUCTION_VERSION", "Codebook", "CodebookSpec", "build_codebook", "load_codebook",
    "nearest_codeword", "nearest_codeword_reference", "nearest_level", "lloyd_max_table",
    "training_samples", "save_codebook", "read_codebook",
]


@dataclass(frozen=True)
class CodebookSpec:
    """What identifies a codebook: block size k of vectors of dimension dim, N codewords, seed."""
    dim: int
    k: int
    n_codewords: int
    seed: int = 0

    def __post_init__(self) -> None:
        check_dim_block(self.dim, self.k)
        if self.dim < 2:
            raise ValueError(f"dim must be >= 2, got {self.dim}")
        if not isinstance(self.n_codewords, int) or isinstance(self.n_codewords, bool) or self.n_codewords < 2:
            raise ValueError(f"number of codewords N must be an integer >= 2, got {self.n_codewords!r}")
        if self.n_codewords > MAX_CODEWORDS:
            raise ValueError(f"number of codewords N={self.n_codewords} exceeds the supported {MAX_CODEWORDS}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def file_name(self) -> str:
        return store.file_name(self.dim, self.k, self.n_codewords, self.seed, CONSTRUCTION_VERSION)

    def derived_seed(self, purpose: str) -> int:
        """A 63-bit seed for one purpose, stable across runs and Python versions."""
        text = f"{self.dim},{self.k},{self.n_codewords},{self.seed},{CONSTRUCTION_VERSION},{purpose}"
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

    @property
    def n_training_samples(self) -> int:
        # High-dimensional blocks need more samples per cell before Lloyd stops overfitting.
        cap = MAX_SAMPLES * max(1, self.k // 16)
        return int(min(cap, max(MIN_SAMPLES, SAMPLES_PER_CODEWORD * self.n_codewords)))


@dataclass(frozen=True)
class Codebook:
    """codewords [N, k] float32 on the CPU, for k-blocks of unit vectors in R^dim.

    `total_mse` estimates E||u - u_hat||^2 for a whole unit vector, (dim/k) times the block MSE
    on the training samples (exact for k = 1); measure on fresh samples for an unbiased figure.
    """
    spec: CodebookSpec
    codewords: torch.Tensor
    total_mse: float
    build_seconds: float

    @property
    def bits_per_coordinate(self) -> float:
        return math.log2(self.spec.n_codewords) / self.spec.k

    def metadata(self) -> dict[str, str]:
        s = self.spec
        return {"dim": str(s.dim), "k": str(s.k), "n_codewords": str(s.n_codewords), "seed": str(s.seed),
                "version": CONSTRUCTION_VERSION, "total_mse": repr(self.total_mse),
                "build_seconds": repr(self.build_seconds)}


def training_samples(spec: CodebookSpec, n: int | None = None) -> torch.Tensor:
    """The canonical-source k-blocks a codebook is trained on: [S, k] float32 (CPU)."""
    gen = torch.Generator().manual_seed(spec.derived_seed("train"))
    return sample_blocks(spec.n_training_samples if n is None else n, spec.dim, spec.k, generator=gen)


def _build_scalar(spec: CodebookSpec) -> tuple[torch.Tensor, float]:
    levels, total_mse = lloyd_max_table(spec.dim, spec.n_codewords)
    return torch.from_numpy(levels).to(torch.float32).unsqueeze(1), total_mse


def phase_plan(spec: CodebookSpec) -> list[tuple[int, int]]:
    """[(samples, max iterations)] of the coarse and the full Lloyd phase of one restart."""
    total = spec.n_training_samples
    plan = []
    for samples, cap, budget in zip((total // COARSE_FRACTION, total), MAX_ITERATIONS, PHASE_WORK):
        # search cost per sample and codeword: k multiply-adds plus ~8 for the argmin pass
        steps = int(budget // (samples * spec.n_codewords * (spec.k + 8)))
        plan.append((samples, max(MIN_ITERATIONS, min(cap, steps))))
    return plan


def _build_vector(spec: CodebookSpec, progress: bool | None) -> tuple[torch.Tensor, float]:
    samples = training_samples(spec)
    plan = phase_plan(spec)
    steps = RESTARTS * sum(cap for _, cap in plan)
    work = RESTARTS * sum(n * cap for n, cap in plan) * spec.n_codewords * (spec.k + 8)
    show = progress if progress is not None else work > PROGRESS_WORK
    rng = np.random.default_rng(spec.derived_seed("restarts"))
    best, best_mse = None, math.inf
    with tqdm(total=steps, disable=not show, leave=False,
              desc=f"codebook d={spec.dim} k={spec.k} N={spec.n_codewords}") as bar:
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


def build_codebook(dim: int, k: int, n_codewords: int, seed: int = 0, *,
                   progress: bool | None = None) -> Codebook:
    """Construct the (dim, k, N, seed) codebook from scratch (no cache). Deterministic.

    Returns a `Codebook` with codewords [N, k] float32. `progress`: force the tqdm bar on/off
    (default: on for long builds).
    """
    spec = CodebookSpec(dim, k, n_codewords, seed)
    start = time.perf_counter()
    codewords, total_mse = _build_scalar(spec) if k == 1 else _build_vector(spec, progress)
    return Codebook(spec, codewords, total_mse, time.perf_counter() - start)


def load_codebook(dim: int, k: int, n_codewords: int, seed: int = 0, *, build: bool = True,
                  progress: bool | None = None) -> Codebook:
    """The shipped or cached (dim, k, N, seed) codebook; builds and caches it when absent.

    With build=False a missing codebook raises FileNotFoundError.
    """
    spec = CodebookSpec(dim, k, n_codewords, seed)
    path = store.find_file(spec.file_name)
    if path is not None:
        codewords, meta = store.read_file(path)
        if codewords.shape != (n_codewords, k) or codewords.dtype != torch.float32:
            raise ValueError(f"{path}: codebook has shape {tuple(codewords.shape)} {codewords.dtype}, "
                             f"expected ({n_codewords}, {k}) float32")
        return Codebook(spec, codewords, float(meta.get("total_mse", "nan")),
                        float(meta.get("build_seconds", "nan")))
    if not build:
        raise FileNotFoundError(f"codebook {spec.file_name} is neither shipped nor in {store.cache_dir()}")
    codebook = build_codebook(dim, k, n_codewords, seed, progress=progress)
    save_codebook(codebook)
    return codebook


def save_codebook(codebook: Codebook, path=None):
    """Write `codebook` as safetensors (default: into the cache directory); returns the path."""
    from pathlib import Path
    target = Path(path) if path is not None else store.cache_dir() / codebook.spec.file_name
    store.write_file(target, codebook.codewords, codebook.metadata())
    return target


def read_codebook(path) -> Codebook:
    """Read a codebook file written by `save_codebook` (spec taken from its metadata)."""
    from pathlib import Path
    codewords, meta = store.read_file(Path(path))
    try:
        spec = CodebookSpec(int(meta["dim"]), int(meta["k"]), int(meta["n_codewords"]), int(meta["seed"]))
    except KeyError as exc:
        raise ValueError(f"{path}: codebook metadata lacks {exc}") from None
    if codewords.shape != (spec.n_codewords, spec.k):
        raise ValueError(f"{path}: codewords shape {tuple(codewords.shape)} does not match its metadata")
    return Codebook(spec, codewords, float(meta.get("total_mse", "nan")), float(meta.get("build_seconds", "nan")))
