"""Exact scalar Lloyd-Max quantizer of one coordinate of a uniform point on S^{d-1}.

The coordinate t has density f(t) = C (1 - t^2)^{(d-3)/2} on [-1, 1] with
C = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)), i.e. t^2 ~ Beta(1/2, (d-1)/2). Cell masses and
first moments have closed forms, so the Lloyd-Max iteration (levels = cell centroids,
thresholds = midpoints) runs on the exact density, not on samples:

    P(a < t < b) = G(b) - G(a),  G(t) = 1/2 + sign(t)/2 * I_{t^2}(1/2, (d-1)/2)
    int_a^b t f(t) dt = C/(d-1) * [(1 - a^2)^{(d-1)/2} - (1 - b^2)^{(d-1)/2}]

This is TurboQuant's codebook and FibQuant's k = 1 codebook.
"""
from __future__ import annotations

import math

import numpy as np
from scipy import special


def _cdf(t: np.ndarray, dim: int) -> np.ndarray:
    return 0.5 + 0.5 * np.sign(t) * special.betainc(0.5, (dim - 1) / 2, t * t)


def _first_moment_antiderivative(t: np.ndarray, dim: int) -> np.ndarray:
    const = math.exp(math.lgamma(dim / 2) - 0.5 * math.log(math.pi) - math.lgamma((dim - 1) / 2))
    return -const / (dim - 1) * np.clip(1.0 - t * t, 0.0, None) ** ((dim - 1) / 2)


def cell_statistics(thresholds: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Masses and first moments of the cells cut by sorted `thresholds` [N-1] -> ([N], [N])."""
    edges = np.concatenate([[-1.0], thresholds, [1.0]])
    mass = np.diff(_cdf(edges, dim))
    moment = np.diff(_first_moment_antiderivative(edges, dim))
    return mass, moment


def lloyd_max_table(dim: int, n_levels: int, *, tol: float = 1e-13,
                    max_iterations: int = 100_000) -> tuple[np.ndarray, float]:
    """Exact Lloyd-Max levels [n_levels] (ascending, float64) and the total MSE E||u - u_hat||^2.

    Total MSE = dim * E[(t - q(t))^2] = dim * (1/dim - sum_i P_i c_i^2) at a centroid fixed point.
    """
    if dim < 2:
        raise ValueError(f"dim must be >= 2 for a scalar Lloyd-Max table, got {dim}")
    if n_levels < 2:
        raise ValueError(f"need at least 2 levels, got {n_levels}")
    # Start from the quantiles of the marginal (a good, symmetric initial guess).
    p = (np.arange(n_levels) + 0.5) / n_levels
    levels = np.sign(p - 0.5) * np.sqrt(special.betaincinv(0.5, (dim - 1) / 2, np.abs(2 * p - 1)))
    for _ in range(max_iterations):
        thresholds = 0.5 * (levels[1:] + levels[:-1])
        mass, moment = cell_statistics(thresholds, dim)
        new = np.where(mass > 0, moment / np.where(mass > 0, mass, 1.0), levels)
        # Exact symmetry of the density: keep the table exactly antisymmetric.
        new = 0.5 * (new - new[::-1])
        change = float(np.max(np.abs(new - levels)))
        levels = new
        if change < tol:
            break
    mass, _ = cell_statistics(0.5 * (levels[1:] + levels[:-1]), dim)
    total_mse = float(1.0 - dim * np.sum(mass * levels * levels))
    return levels, total_mse
