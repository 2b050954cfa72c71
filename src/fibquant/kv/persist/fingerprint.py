"""A codec's decoding state in a saved cache's manifest, compared with a tolerance (format version 3).

The state that decodes a code (FibQuant's Haar rotation from a float64 QR, a codebook built on
first use, a calibrated codec's learned tensors) is float data computed on the machine that
runs the codec: another CPU's BLAS/LAPACK or libm vector paths can change its last bits. A hash
of those floats would refuse, on another machine, a cache whose codes decode the same there.
So each float tensor is summarised by a few numbers and compared with a tolerance:

    numel, rms = sqrt(mean(t^2)), proj_j = sum_i s_ji t_i / sqrt(numel)   (j < PROJECTIONS)

in float64, with fixed pseudo-random signs s_ji in {-1, +1} (splitmix64 of (j, i): the same on
every machine and numpy version). Two states match when numel is equal and rms and every
projection differ by at most TOLERANCE x rms. One float32 ulp on every entry moves a projection
by ~1e-7 x rms (random signs: the errors add like a random walk; at most sqrt(numel) x 6e-8 x
max|t|, ~1e-5 x rms for a 4096 x 8 codebook, which is 10x under the tolerance); another rotation
or codebook (other seed, rate, recipe) moves them by O(rms), and one changed codeword of
4096 x 8 by ~5e-3 x rms. Integer tensors are lossless data and are compared exactly (sha256).

The exact part of a codec's identity (family, config with its seeds, code size) is compared
exactly by `fibquant.kv.persist.entries`; version-1/2 manifests hold a sha256 of the float state
instead (`entries.codec_state_sha256`), still checked for them.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
from typing import Optional

import numpy as np
import torch

from fibquant.codecs.reader import CodebookReader

PROJECTIONS = 8
TOLERANCE = 1e-4  # relative to the tensor's rms
FLOOR = float(np.finfo(np.float32).tiny)  # an absolute gap always accepted (an all-zero tensor's)


def _signs(n: int, j: int) -> np.ndarray:
    """Signs s_j [n] in {-1.0, +1.0}: the top bit of splitmix64(j * 2^32 + i)."""
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) + np.uint64(j << 32) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return np.where(z >> np.uint64(63) == 1, -1.0, 1.0)


@functools.lru_cache(maxsize=32)
def _sign_matrix(n: int) -> np.ndarray:
    """[PROJECTIONS, n] float64: row j = _signs(n, j) (read-only; a model's samples share a few sizes)."""
    signs = np.stack([_signs(n, j) for j in range(PROJECTIONS)])
    signs.setflags(write=False)
    return signs


def tensor_fingerprint(tensor: torch.Tensor) -> dict:
    """{"numel", "rms", "proj"} of a float tensor (any shape, read flat), {"numel", "sha256"} of another."""
    t = tensor.detach().cpu().contiguous()
    if not t.is_floating_point():
        return {"numel": t.numel(), "sha256": hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()}
    flat = t.reshape(-1).to(torch.float64).numpy()
    n = flat.size
    scale = 1.0 / math.sqrt(max(n, 1))
    return {"numel": n, "rms": float(np.sqrt(np.mean(flat * flat))) if n else 0.0,
            "proj": [float(p) * scale for p in _sign_matrix(n) @ flat]}


def state_fingerprint(codec) -> dict:
    """{"code_size", "tensors": {name: tensor_fingerprint}} of what decodes `codec`'s codes: its
    codebook ("rotation" = the forward matrix, "codewords" of a `CodebookReader`), if any, and its state
    tensors."""
    tensors = {}
    book = codec.reader(torch.device("cpu"))
    if isinstance(book, CodebookReader):
        tensors["rotation"], tensors["codewords"] = book.forward, book.codewords
    for name, tensor in codec.state_tensors().items():
        tensors[f"state:{name}"] = tensor
    return {"code_size": int(codec.code_size),
            "tensors": {name: tensor_fingerprint(t) for name, t in sorted(tensors.items())}}


def fingerprint_mismatch(saved: dict, here: dict) -> Optional[str]:
    """Why two state fingerprints differ beyond TOLERANCE (which tensor, by how much), or None."""
    if saved.get("code_size") != here.get("code_size"):
        return f"code size {here.get('code_size')}, saved {saved.get('code_size')}"
    names, saved_names = sorted(here.get("tensors", {})), sorted(saved.get("tensors", {}))
    if names != saved_names:
        return f"state tensors {names}, saved {saved_names}"
    for name in names:
        problem = tensor_mismatch(saved["tensors"][name], here["tensors"][name])
        if problem is not None:
            return f"{name}{problem}"
    return None


def tensor_mismatch(saved: dict, here: dict, tolerance: float = TOLERANCE) -> Optional[str]:
    """How two `tensor_fingerprint`s differ (": ..." or " differs by ..."), or None when the integer
    hashes are equal / the rms and every projection agree within `tolerance` x rms (or FLOOR)."""
    if saved.get("numel") != here.get("numel") or ("sha256" in saved) != ("sha256" in here):
        return f": {here.get('numel')} values, saved {saved.get('numel')}"
    if "sha256" in saved:
        return None if saved["sha256"] == here["sha256"] else ": other integer values"
    if len(saved.get("proj", ())) != len(here["proj"]):
        return f": {len(here['proj'])} projections, saved {len(saved.get('proj', ()))}"
    gap, scale = fingerprint_gap(saved, here)
    # Gaps below float32's smallest normal are subnormal noise (flushed to zero or not by the CPU).
    if not gap <= max(tolerance * scale, FLOOR):  # also refuses NaN
        return f" differs by {gap / scale if scale else math.inf:.2e} of its rms (tolerance {tolerance:g})"
    return None


def fingerprint_gap(saved: dict, here: dict) -> tuple[float, float]:
    """(gap, scale) of two float `tensor_fingerprint`s: the largest move of the rms or a projection,
    and the larger rms (the tolerance's unit)."""
    scale = max(float(saved["rms"]), float(here["rms"]))
    gap = max([abs(float(saved["rms"]) - float(here["rms"]))]
              + [abs(float(x) - float(y)) for x, y in zip(saved["proj"], here["proj"])])
    return gap, scale


def fingerprint_label(fingerprint) -> str:
    """12 hex digits naming a saved fingerprint in `fibquant cache info` (a display label, never
    compared: the same state fingerprinted on another machine gets another label)."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]
