"""Universal FibQuant codebooks: one codebook per (d, k, N, seed) serves all data.

`build_codebook` constructs one (k = 1: the exact scalar Lloyd-Max table; k >= 2: Lloyd on
canonical-source samples, recipe `CONSTRUCTION_VERSION`); `load_codebook` returns the shipped or
cached copy and builds + caches it if absent.

Construction versions. The version is part of every file name
(`fibquant_d{d}_k{k}_n{N}_s{seed}_{version}.safetensors`) and of every derived seed:

- v2 (`recipe_v2.py`, kept verbatim): 2 restarts of two-phase Lloyd on one fixed set of up to
  2^18 (2^20 at k = 64) training samples. The shipped d = 64 codebooks are v2 files and stay
  bit-for-bit as they are: every measured d = 64 figure depends on them. Builds took 5-100 s for
  N <= 256 and ~20 min for N = 4096.
- v3 (`recipe_v3.py`, the current one): fresh-sample Lloyd (a new seeded batch every iteration)
  on a fixed work budget, the final phase's cells pooled, exact numba assignment; one start (the
  companded grid for k <= 4, random source samples above), both starts where they are cheap.
  Any (d, k, N <= 4096) costs at most ~4e11 multiply-adds (15-30 CPU-seconds on one core here)
  and measures no worse on fresh samples than v2 at the shipped d = 64 rates
  (benchmarks/codebook_build.py; docs/codecs.md has the table). The d = 128 codebooks of the
  for_rate table ship as v3 files.

Lookup (`load_codebook`): in each folder (shipped, then the cache) a file of an earlier version
(LEGACY_VERSIONS) is taken before one of the current version, so every key that had a v2 file keeps
it, shipped or cached, and results measured with it stay identical; keys without one get v3.
`build_codebook(..., version="v2")` rebuilds the old recipe (slow; for comparisons).
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass

import torch

from ..canonical import check_dim_block
from . import store
from . import recipe_v2, recipe_v3
from .scalar import lloyd_max_table
from .nearest import nearest_codeword, nearest_codeword_reference, nearest_level

CONSTRUCTION_VERSION = recipe_v3.VERSION  # v1: first recipe (3 restarts, fixed budget), never shipped
LEGACY_VERSIONS = (recipe_v2.VERSION,)     # looked up before the current version, never built by default
_RECIPES = {recipe_v2.VERSION: recipe_v2, recipe_v3.VERSION: recipe_v3}
MAX_CODEWORDS = 1 << 16

__all__ = [
    "CONSTRUCTION_VERSION", "LEGACY_VERSIONS", "Codebook", "CodebookSpec", "build_codebook", "load_codebook",
    "nearest_codeword", "nearest_codeword_reference", "nearest_level", "lloyd_max_table",
    "training_samples", "save_codebook", "read_codebook", "find_codebook_file",
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
        """The file name of this codebook under the current construction version."""
        return self.file_name_for(CONSTRUCTION_VERSION)

    def file_name_for(self, version: str) -> str:
        return store.file_name(self.dim, self.k, self.n_codewords, self.seed, version)

    def derived_seed(self, purpose: str, version: str = CONSTRUCTION_VERSION) -> int:
        """A 63-bit seed for one purpose of one construction version, stable across runs and Pythons."""
        text = f"{self.dim},{self.k},{self.n_codewords},{self.seed},{version},{purpose}"
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class Codebook:
    """codewords [N, k] float32 on the CPU, for k-blocks of unit vectors in R^dim.

    `total_mse` estimates E||u - u_hat||^2 for a whole unit vector, (dim/k) times the block MSE
    (exact for k = 1; v2: on the training samples, optimistic; v3: on the last fresh batch, before
    the last update); measure on fresh samples for a figure to compare. `version`: the construction
    version that made it.
    """
    spec: CodebookSpec
    codewords: torch.Tensor
    total_mse: float
    build_seconds: float
    version: str = CONSTRUCTION_VERSION

    @property
    def file_name(self) -> str:
        return self.spec.file_name_for(self.version)

    @property
    def bits_per_coordinate(self) -> float:
        return math.log2(self.spec.n_codewords) / self.spec.k

    def metadata(self) -> dict[str, str]:
        s = self.spec
        return {"dim": str(s.dim), "k": str(s.k), "n_codewords": str(s.n_codewords), "seed": str(s.seed),
                "version": self.version, "total_mse": repr(self.total_mse),
                "build_seconds": repr(self.build_seconds)}


def training_samples(spec: CodebookSpec, n: int | None = None) -> torch.Tensor:
    """The fixed training set of the v2 recipe: [S, k] float32 (CPU). (v3 draws fresh batches.)"""
    return recipe_v2.training_samples(spec, n)


def _build_scalar(spec: CodebookSpec) -> tuple[torch.Tensor, float]:
    levels, total_mse = lloyd_max_table(spec.dim, spec.n_codewords)
    return torch.from_numpy(levels).to(torch.float32).unsqueeze(1), total_mse


def build_codebook(dim: int, k: int, n_codewords: int, seed: int = 0, *,
                   progress: bool | None = None, version: str = CONSTRUCTION_VERSION) -> Codebook:
    """Construct the (dim, k, N, seed) codebook from scratch (no cache). Deterministic.

    Returns a `Codebook` with codewords [N, k] float32. `progress`: force the tqdm bar on/off
    (default: on for builds expected to take more than a few seconds). `version`: the construction
    recipe (default the current one; "v2" rebuilds the recipe of the shipped d = 64 files, slowly).
    """
    spec = CodebookSpec(dim, k, n_codewords, seed)
    if version not in _RECIPES:
        raise ValueError(f"unknown construction version {version!r} (known: {sorted(_RECIPES)})")
    start = time.perf_counter()
    if k == 1:
        codewords, total_mse = _build_scalar(spec)
    else:
        codewords, total_mse = _RECIPES[version].build_vector(spec, progress)
    return Codebook(spec, codewords, total_mse, time.perf_counter() - start, version)


def find_codebook_file(spec: CodebookSpec):
    """The file `load_codebook` would read for `spec` (see the lookup order above), or None."""
    return store.find_first([spec.file_name_for(v) for v in (*LEGACY_VERSIONS, CONSTRUCTION_VERSION)])


def load_codebook(dim: int, k: int, n_codewords: int, seed: int = 0, *, build: bool = True,
                  progress: bool | None = None) -> Codebook:
    """The shipped or cached (dim, k, N, seed) codebook; builds and caches it when absent.

    With build=False a missing codebook raises FileNotFoundError.
    """
    spec = CodebookSpec(dim, k, n_codewords, seed)
    path = find_codebook_file(spec)
    if path is not None:
        codewords, meta = store.read_file(path)
        if codewords.shape != (n_codewords, k) or codewords.dtype != torch.float32:
            raise ValueError(f"{path}: codebook has shape {tuple(codewords.shape)} {codewords.dtype}, "
                             f"expected ({n_codewords}, {k}) float32")
        return Codebook(spec, codewords, float(meta.get("total_mse", "nan")),
                        float(meta.get("build_seconds", "nan")), _version_of(path, meta))
    if not build:
        raise FileNotFoundError(f"codebook {spec.file_name} is neither shipped nor in {store.cache_dir()}")
    codebook = build_codebook(dim, k, n_codewords, seed, progress=progress)
    save_codebook(codebook)
    return codebook


def save_codebook(codebook: Codebook, path=None):
    """Write `codebook` as safetensors (default: into the cache directory); returns the path."""
    from pathlib import Path
    target = Path(path) if path is not None else store.cache_dir() / codebook.file_name
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
    return Codebook(spec, codewords, float(meta.get("total_mse", "nan")), float(meta.get("build_seconds", "nan")),
                    _version_of(Path(path), meta))


def _version_of(path, meta: dict[str, str]) -> str:
    """The construction version of a codebook file: its metadata, else its file name's suffix."""
    if "version" in meta:
        return meta["version"]
    stem = path.name.rsplit(".", 1)[0]
    return stem.rsplit("_", 1)[-1]
