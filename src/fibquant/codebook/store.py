"""Codebook files: safetensors (never pickle), one file per (d, k, N, seed, construction version).

Lookup order (`find_first`, names in the caller's order within each folder): the codebooks shipped
inside the package (`codebook/shipped/`), then the user
cache directory `<cache root>/codebooks`, the root being `$FIBQUANT_CACHE_DIR` or `~/.cache/fibquant`
(`fibquant.paths.cache_root`, the same root the text and BIG-bench caches use).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from safetensors import safe_open

from ..paths import cache_root

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"


def cache_dir() -> Path:
    """The user codebook cache: `<cache root>/codebooks` (see fibquant.paths)."""
    return cache_root() / "codebooks"


def file_name(dim: int, k: int, n_codewords: int, seed: int, version: str) -> str:
    return f"fibquant_d{dim}_k{k}_n{n_codewords}_s{seed}_{version}.safetensors"


def find_file(name: str) -> Path | None:
    return find_first([name])


def find_first(names: list[str]) -> Path | None:
    """The first existing file among `names`, folder by folder (shipped, then the cache)."""
    for folder in (SHIPPED_DIR, cache_dir()):
        for name in names:
            path = folder / name
            if path.is_file():
                return path
    return None


def write_file(path: Path, codewords: torch.Tensor, metadata: dict[str, str]) -> None:
    """Write atomically (temporary file + rename) so a concurrent reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({"codewords": codewords.detach().cpu().contiguous()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def read_file(path: Path) -> tuple[torch.Tensor, dict[str, str]]:
    tensors = load_file(str(path))
    if set(tensors) != {"codewords"}:
        raise ValueError(f"{path}: not a fibquant codebook file (tensors {sorted(tensors)})")
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
    return tensors["codewords"], metadata
