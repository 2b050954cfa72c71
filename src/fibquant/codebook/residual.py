"""Universal residual codebooks: S stages of N codewords in R^k, and their searches.

A residual (multi-stage) code of a k-block y is a tuple (i_1, ..., i_S) with
y_hat = C_1[i_1] + ... + C_S[i_S]: S * ceil(log2 N) bits for N^S codewords, searched with a beam
instead of one flat N^S-entry codebook (k = 8, S = 2, N = 256: 65 536 codewords at 2 bits per
coordinate, two searches of 256). Calibration-free like every FibQuant codebook: the stages are
fitted on the canonical source only (k-blocks of a uniformly random unit vector of R^dim, the
input of every codec after its norm and Haar rotation), so the residuals each stage sees are
themselves data-independent and one set of stages serves every layer, head and model.

Searches (x [n, k] -> indices [n, S]):

- `exhaustive_search` (the reference): every one of the N^S sums, squared distances in float64,
  argmin, the lowest flat index (i_1 * N^(S-1) + ... + i_S) among equals. Affordable for
  N^S <= EXHAUSTIVE_MAX (tests, and the measurement of the beam's gap).
- `beam_search` (the spec of the codec's encoder; `residual_numba.fast_beam_search` gives the same
  indices faster and is what the codec runs on the CPU): stage by stage keep the `beam` best partial sums
  (float64 scores ||r - c||^2 of every kept residual r against every codeword c of the stage).
  Not exact in general: it can miss the best sum when the best first stage choices are not among
  the kept ones. With beam >= N^(S-1) it keeps every partial sum and is the exhaustive search (up
  to float64 rounding at exact ties). The measured gap to the exhaustive search is in docs/codecs.md
  ("FibQuant-RVQ"); tests bound it.

Construction (recipe RECIPE, `build_residual`): stages are added one at a time; after adding a
stage (initialised with random residuals of the current code), ITERATIONS joint Lloyd steps, each
on a *fresh* seeded batch of BATCH canonical blocks: encode with the beam (TRAIN_BEAM, float32
scores), then move
every stage's codewords to the mean of (x - the other stages' codewords) over its cell (the
block-coordinate-descent update of a residual code); empty cells keep their codeword. Seeds are
derived from (dim, k, S, N, seed, RECIPE), so a build is reproducible (float32 matmuls: the same
bits on the same BLAS and thread count; a rebuild elsewhere agrees to float32 rounding of the
assignments).

Files: safetensors, tensor "codewords" [S, N, k] float32 (`store.write_file`), named
`fibquant-rvq_d{d}_k{k}_s{S}_n{N}_seed{seed}_{RECIPE}.safetensors`, looked up in the shipped folder
then the user cache (`store.find_first`), built and cached when absent.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass

import torch

from ..canonical import check_dim_block, sample_blocks
from . import store

RECIPE = "r1"
BATCH = 1 << 15          # fresh canonical blocks per Lloyd step
ITERATIONS = 12          # joint Lloyd steps after adding each stage
TRAIN_BEAM = 16          # beam of the encoder during construction
EXHAUSTIVE_MAX = 1 << 20  # the largest N^S the exhaustive reference enumerates
MAX_STAGES = 8
MAX_STAGE_CODEWORDS = 4096
SCORE_BUDGET = 1 << 22   # scores per chunk of the beam search (n_chunk * beam * N)
SCORE_DTYPE = torch.float64  # the codec's beam scores: float64, so one row and a batch pick the same sums
                             # (float32 matmuls round differently by batch size); ~2.5x the float32 time
BUILD_DTYPE = torch.float32  # the construction's beam scores (recipe r1)


@dataclass(frozen=True)
class ResidualSpec:
    """What identifies a residual codebook: k-blocks of unit vectors of R^dim, `stages` x N, seed."""

    dim: int
    k: int
    stages: int
    n_codewords: int
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("dim", "k", "stages", "n_codewords", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.dim < 2:
            raise ValueError(f"dim must be >= 2, got {self.dim}")
        check_dim_block(self.dim, self.k)
        if not 1 <= self.stages <= MAX_STAGES:
            raise ValueError(f"stages must be in 1..{MAX_STAGES}, got {self.stages}")
        if not 2 <= self.n_codewords <= MAX_STAGE_CODEWORDS:
            raise ValueError(f"codewords per stage N must be in 2..{MAX_STAGE_CODEWORDS}, got {self.n_codewords}")
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")

    @property
    def file_name(self) -> str:
        return (f"fibquant-rvq_d{self.dim}_k{self.k}_s{self.stages}_n{self.n_codewords}_seed{self.seed}"
                f"_{RECIPE}.safetensors")

    def derived_seed(self, purpose: str) -> int:
        text = f"rvq,{self.dim},{self.k},{self.stages},{self.n_codewords},{self.seed},{RECIPE},{purpose}"
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def check_stages(x: torch.Tensor, stages: torch.Tensor) -> None:
    if not isinstance(stages, torch.Tensor) or stages.ndim != 3 or not stages.is_floating_point():
        raise ValueError(f"stages must be a float tensor [S, N, k], got {getattr(stages, 'shape', stages)!r}")
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.shape[1] != stages.shape[2]:
        raise ValueError(f"blocks must be [n, k={stages.shape[2]}], got {tuple(getattr(x, 'shape', ()))}")


def exhaustive_search(x: torch.Tensor, stages: torch.Tensor) -> torch.Tensor:
    """The reference: blocks x [n, k] -> indices [n, S] (int64) of the nearest of all N^S sums
    (float64 distances, lowest flat index among equals). ValueError when N^S > EXHAUSTIVE_MAX."""
    check_stages(x, stages)
    s, n_cw, k = stages.shape
    if n_cw ** s > EXHAUSTIVE_MAX:
        raise ValueError(f"exhaustive search over {n_cw}^{s} sums exceeds {EXHAUSTIVE_MAX}")
    book = stages.to(torch.float64)
    sums = torch.zeros(1, k, dtype=torch.float64)
    for j in range(s):  # flat index i_1 * N^(S-1) + ... + i_S: row-major over the stages
        sums = (sums[:, None, :] + book[j][None, :, :]).reshape(-1, k)
    xd = x.to(torch.float64)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    chunk = max(1, (1 << 24) // sums.shape[0])
    for start in range(0, x.shape[0], chunk):
        part = xd[start:start + chunk]
        dist = ((part[:, None, :] - sums[None]) ** 2).sum(-1)
        out[start:start + chunk] = dist.argmin(1)  # torch.argmin returns the first minimum
    digits = []
    for _ in range(s):
        digits.append(out % n_cw)
        out = out // n_cw
    return torch.stack(digits[::-1], dim=1)


def beam_search(x: torch.Tensor, stages: torch.Tensor, beam: int, dtype: torch.dtype = SCORE_DTYPE) -> torch.Tensor:
    """Blocks x [n, k] -> indices [n, S] (int64): stage by stage, the `beam` best partial sums
    (squared distances in `dtype`: float64 for the codec, float32 in the construction) are kept;
    the best final one is returned (the lowest (parent, codeword) order among equal scores, as
    torch.topk sorts). See the module docstring for how it relates to `exhaustive_search`."""
    check_stages(x, stages)
    if isinstance(beam, bool) or not isinstance(beam, int) or beam < 1:
        raise ValueError(f"beam must be a positive integer, got {beam!r}")
    s, n_cw, k = stages.shape
    book = stages.to(device=x.device, dtype=dtype)
    sq = (book ** 2).sum(-1)  # [S, N]
    x = x.to(dtype)
    out = torch.empty(x.shape[0], s, dtype=torch.int64, device=x.device)
    chunk = max(1, SCORE_BUDGET // (beam * n_cw))
    for start in range(0, x.shape[0], chunk):
        part = x[start:start + chunk]
        m = part.shape[0]
        resid = part[:, None, :]                                   # [m, b, k]
        err = (part * part).sum(-1, keepdim=True)                  # [m, b]
        idx = torch.zeros(m, 1, 0, dtype=torch.int64, device=x.device)
        for j in range(s):
            scores = err[:, :, None] - 2.0 * (resid @ book[j].T) + sq[j]  # [m, b, N]
            flat = scores.reshape(m, -1)
            keep = min(beam, flat.shape[1]) if j < s - 1 else 1
            err, pick = flat.topk(keep, dim=1, largest=False, sorted=True)
            parent, word = pick // n_cw, pick % n_cw
            resid = torch.gather(resid, 1, parent[..., None].expand(-1, -1, k)) - book[j][word]
            idx = torch.cat([torch.gather(idx, 1, parent[..., None].expand(-1, -1, j)), word[..., None]], 2)
        out[start:start + m] = idx[:, 0]
    return out


def reconstruct(indices: torch.Tensor, stages: torch.Tensor) -> torch.Tensor:
    """indices [n, S] -> the sums of their codewords [n, k]."""
    total = stages[0][indices[:, 0]]
    for j in range(1, stages.shape[0]):
        total = total + stages[j][indices[:, j]]
    return total


def block_mse(x: torch.Tensor, stages: torch.Tensor, indices: torch.Tensor) -> float:
    """Mean squared error per block of `indices` on blocks x (float64)."""
    return float(((x.to(torch.float64) - reconstruct(indices, stages.to(torch.float64))) ** 2).sum(-1).mean())


def build_residual(spec: ResidualSpec, *, batch: int = BATCH, iterations: int = ITERATIONS,
                   beam: int = TRAIN_BEAM, progress: bool = False) -> tuple[torch.Tensor, dict[str, str]]:
    """Construct the stages [S, N, k] (float32) of `spec` with recipe RECIPE; returns them and the
    file metadata (sizes, the last batch's total MSE per unit vector before the last update, seconds)."""
    start_time = time.process_time()
    blocks_per_vector = spec.dim // spec.k
    stages: list[torch.Tensor] = []
    last_mse = float("nan")
    for stage in range(spec.stages):
        x = sample_blocks(batch, spec.dim, spec.k, seed=spec.derived_seed(f"init{stage}"))
        book = torch.stack(stages) if stages else None
        resid = x - reconstruct(beam_search(x, book, beam, BUILD_DTYPE), book) if stages else x
        pick = torch.randperm(batch, generator=torch.Generator().manual_seed(spec.derived_seed(f"pick{stage}")))
        stages.append(resid[pick[:spec.n_codewords]].clone())
        for it in range(iterations):
            x = sample_blocks(batch, spec.dim, spec.k, seed=spec.derived_seed(f"batch{stage},{it}"))
            book = torch.stack(stages)
            idx = beam_search(x, book, beam, BUILD_DTYPE)
            full = reconstruct(idx, book)
            last_mse = blocks_per_vector * float(((x - full) ** 2).sum(-1).mean())
            for j in range(len(stages)):  # block coordinate descent: every stage to its cells' means
                target = x - (full - book[j][idx[:, j]])
                counts = torch.bincount(idx[:, j], minlength=spec.n_codewords)
                sums = torch.zeros(spec.n_codewords, spec.k, dtype=torch.float64).index_add_(
                    0, idx[:, j], target.to(torch.float64))
                filled = counts > 0
                new = stages[j].clone()
                new[filled] = (sums[filled] / counts[filled, None]).to(torch.float32)
                full = full - book[j][idx[:, j]] + new[idx[:, j]]
                stages[j] = new
                book = torch.stack(stages)
            if progress:
                print(f"  rvq {spec.file_name}: stage {stage + 1} step {it + 1}: total MSE {last_mse:.5f}",
                      flush=True)
    metadata = {"dim": str(spec.dim), "k": str(spec.k), "stages": str(spec.stages),
                "n_codewords": str(spec.n_codewords), "seed": str(spec.seed), "recipe": RECIPE,
                "batch": str(batch), "iterations": str(iterations), "train_beam": str(beam),
                "total_mse": repr(last_mse), "build_cpu_seconds": repr(time.process_time() - start_time)}
    return torch.stack(stages).contiguous(), metadata


def load_residual(spec: ResidualSpec, *, build: bool = True) -> torch.Tensor:
    """The stages [S, N, k] of `spec`: shipped or cached, else built (and cached) when `build`,
    else FileNotFoundError."""
    path = store.find_first([spec.file_name])
    if path is not None:
        stages, _ = store.read_file(path)
        if tuple(stages.shape) != (spec.stages, spec.n_codewords, spec.k):
            raise ValueError(f"{path}: codewords of shape {tuple(stages.shape)}, expected "
                             f"{(spec.stages, spec.n_codewords, spec.k)}")
        return stages.to(torch.float32)
    if not build:
        raise FileNotFoundError(f"residual codebook {spec.file_name} neither shipped nor cached")
    stages, metadata = build_residual(spec)
    store.write_file(store.cache_dir() / spec.file_name, stages, metadata)
    return stages


def index_bits(n_codewords: int) -> int:
    return max(1, math.ceil(math.log2(n_codewords)))
