"""Deterministic initial codebooks: companded radii times quasi-uniform directions.

Radii follow the Bennett-Gersho companded radial law of f_{d,k} (the optimal high-rate point
density is proportional to f^{k/(k+2)}), evaluated at the quantiles (i + 1/2)/N:
closed form for k = 2, scipy's Beta quantile otherwise. Directions are quasi-uniform on
S^{k-1}:

- k = 2: golden-angle (Vogel / "Golden Quantizer") spiral, theta_i = 2 pi frac(s + i / phi);
- k = 3: Fibonacci sphere, z_i = 1 - 2 (i + 1/2)/N, theta_i = 2 pi frac(s + i / phi), with the
  radius driven by a second irrational rotation so that shells and directions interleave;
- k >= 4: Roberts-Kronecker sequence t_n = frac(s + n alpha), alpha_j = phi_m^{-j} with phi_m the
  positive root of x^{m+1} = x + 1 (a different alpha per dimension); coordinate 0 gives the
  radius quantile, the other k coordinates map through the inverse normal CDF to a Gaussian
  direction (uniform on the sphere). For k = d all blocks have radius 1.

k = 1 is not built here: it is the exact scalar Lloyd-Max table (`scalar.py`).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from scipy import special

from ..canonical import check_dim_block, companded_radius_law

GOLDEN = (1 + math.sqrt(5)) / 2
RADIUS_ALPHA_K3 = math.sqrt(2) - 1  # irrational rotation for the k = 3 radius sequence


def roberts_alphas(m: int) -> np.ndarray:
    """alpha_j = phi_m^{-j}, j = 1..m, phi_m the positive root of x^{m+1} = x + 1."""
    phi = 2.0
    for _ in range(100):  # fixed point phi = (1 + phi)^{1/(m+1)} converges fast
        phi = (1.0 + phi) ** (1.0 / (m + 1))
    return phi ** -np.arange(1, m + 1, dtype=np.float64)


def companded_radii(dim: int, k: int, fractions: np.ndarray) -> np.ndarray:
    """Radii at quantile `fractions` (in (0,1)) of the companded radial law; ones for k = dim."""
    check_dim_block(dim, k)
    if k == dim:
        return np.ones_like(fractions)
    if k == 2:
        # r^2 ~ Beta(1, dim/4): CDF 1 - (1 - s)^{dim/4}, so s = 1 - (1 - p)^{4/dim}.
        return np.sqrt(1.0 - (1.0 - fractions) ** (4.0 / dim))
    return np.sqrt(companded_radius_law(dim, k).ppf(fractions))


def initial_codebook(dim: int, k: int, n_codewords: int, offset: np.ndarray | None = None) -> torch.Tensor:
    """Deterministic initial codebook [n_codewords, k] float64 for k >= 2.

    `offset` (the s of the sequences, shape [k + 1], entries in [0, 1)) selects a different but
    equally quasi-uniform point set; None is the canonical s = 1/2.
    """
    check_dim_block(dim, k)
    if k < 2:
        raise ValueError("k = 1 codebooks are the exact scalar Lloyd-Max table, not a spiral")
    s = np.full(k + 1, 0.5) if offset is None else np.asarray(offset, dtype=np.float64)
    i = np.arange(n_codewords, dtype=np.float64)
    if k == 2:
        fractions = np.mod(s[1] + (i + 0.5) / n_codewords, 1.0)
        radii = companded_radii(dim, k, np.clip(fractions, 1e-12, 1 - 1e-12))
        theta = 2 * math.pi * np.mod(s[0] + i / GOLDEN, 1.0)
        points = np.stack([np.cos(theta), np.sin(theta)], axis=1)
    elif k == 3:
        z = 1.0 - 2.0 * (i + 0.5) / n_codewords
        theta = 2 * math.pi * np.mod(s[0] + i / GOLDEN, 1.0)
        ring = np.sqrt(np.clip(1.0 - z * z, 0.0, None))
        points = np.stack([ring * np.cos(theta), ring * np.sin(theta), z], axis=1)
        fractions = np.mod(s[1] + (i + 0.5) * RADIUS_ALPHA_K3, 1.0)
        radii = companded_radii(dim, k, np.clip(fractions, 1e-12, 1 - 1e-12))
    else:
        alphas = roberts_alphas(k + 1)
        t = np.mod(s[None, :] + (i[:, None] + 1.0) * alphas[None, :], 1.0)
        t = np.clip(t, 1e-12, 1 - 1e-12)
        gauss = special.ndtri(t[:, 1:])
        points = gauss / np.linalg.norm(gauss, axis=1, keepdims=True)
        radii = companded_radii(dim, k, t[:, 0])
    return torch.from_numpy(points * radii[:, None])
