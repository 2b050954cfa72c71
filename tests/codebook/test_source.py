"""Canonical source: sphere sampling, Haar rotation, f_{d,k}, and Theorem 1 (KS tests)."""
import math
from functools import lru_cache

import numpy as np
import pytest
import torch
from scipy import stats

from fibquant.canonical import (block_radii, canonicalize, haar_rotation, log_block_density, radius_law,
                             sample_blocks, sample_sphere)

KS_ALPHA = 1e-3  # a true null fails one KS test with probability 0.001
N_VECTORS = 1500


def test_sample_sphere_is_unit_and_seeded():
    a = sample_sphere(100, 32, seed=5)
    assert a.shape == (100, 32) and a.dtype == torch.float32
    torch.testing.assert_close(a.norm(dim=1), torch.ones(100))
    assert torch.equal(a, sample_sphere(100, 32, seed=5))
    assert not torch.equal(a, sample_sphere(100, 32, seed=6))


def test_haar_rotation_orthogonal_deterministic_and_sign_fixed():
    q = haar_rotation(48, seed=3)
    torch.testing.assert_close(q @ q.T, torch.eye(48, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(q, haar_rotation(48, seed=3))
    # Recompute the QR of the same Gaussian: the columns of Q were flipped so that diag(R) > 0.
    gen = torch.Generator().manual_seed(3)
    gauss = torch.randn(48, 48, generator=gen, dtype=torch.float64)
    r = q.T @ gauss
    assert bool((torch.diagonal(r) > 0).all())
    torch.testing.assert_close(torch.tril(r, -1), torch.zeros_like(r), atol=1e-10, rtol=0)


@pytest.mark.parametrize("dim,k", [(64, 1), (64, 4), (32, 8)])
def test_sample_blocks_radius_follows_beta(dim, k):
    blocks = sample_blocks(4000, dim, k, seed=11)
    assert blocks.shape == (4000, k)
    radii = (blocks.double() ** 2).sum(1).numpy()[:: dim // k]  # one block per point: independent
    assert stats.kstest(radii, radius_law(dim, k).cdf).pvalue > KS_ALPHA


def test_block_density_integrates_to_one_and_matches_radius_law():
    dim, k = 16, 2
    grid = torch.linspace(-1, 1, 801, dtype=torch.float64)
    yy = torch.stack(torch.meshgrid(grid, grid, indexing="ij"), dim=-1)
    density = log_block_density(yy, dim, k).exp()
    cell = float(grid[1] - grid[0]) ** 2
    assert abs(float(density.sum()) * cell - 1.0) < 2e-3
    # P(||y||^2 <= 0.1) from the density against the Beta CDF.
    inside = (yy ** 2).sum(-1) <= 0.1
    assert abs(float(density[inside].sum()) * cell - radius_law(dim, k).cdf(0.1)) < 5e-3
    assert math.isinf(float(log_block_density(torch.tensor([[0.8, 0.8]]), dim, k)[0]))


def test_full_vector_has_no_radius_law():
    with pytest.raises(ValueError, match="k = dim"):
        radius_law(8, 8)
    with pytest.raises(ValueError, match="divide"):
        radius_law(10, 3)


def _non_uniform_inputs(dim: int) -> dict[str, torch.Tensor]:
    """Four input families far from uniform on the sphere, [N_VECTORS, dim] each."""
    gen = torch.Generator().manual_seed(2024)
    t = torch.distributions.StudentT(1.5)
    torch.manual_seed(7)
    heavy = t.sample((N_VECTORS, dim))
    low_rank = torch.randn(N_VECTORS, 2, generator=gen, dtype=torch.float64) @ torch.randn(
        2, dim, generator=gen, dtype=torch.float64)
    outliers = torch.randn(N_VECTORS, dim, generator=gen, dtype=torch.float64)
    outliers[:, [0, 5]] *= 1000.0  # two huge channels, as in real key caches
    positive = torch.rand(N_VECTORS, dim, generator=gen, dtype=torch.float64) + 0.5
    return {"heavy_tailed": heavy.double(), "low_rank": low_rank, "outlier_channels": outliers,
            "all_positive": positive}


@lru_cache(maxsize=2)
def _rotations(dim: int) -> torch.Tensor:
    """N_VECTORS independent Haar rotations [N_VECTORS, dim, dim]."""
    return torch.stack([haar_rotation(dim, seed=10_000 + i) for i in range(N_VECTORS)])


def _canonical(x: torch.Tensor, rotate: bool) -> torch.Tensor:
    """Pi_i x_i / ||x_i|| with a fresh Haar Pi_i per vector (Theorem 1 is a statement over the
    random rotation), or just x_i / ||x_i|| when rotate is False."""
    if not rotate:
        return x / x.norm(dim=1, keepdim=True)
    unit = canonicalize(x, torch.eye(x.shape[1], dtype=x.dtype))[1]
    return torch.einsum("nij,nj->ni", _rotations(x.shape[1]), unit)


def _first_block_radii(u: torch.Tensor, k: int) -> np.ndarray:
    """Radius^2 of the first k-block of each row: one independent sample per vector."""
    return block_radii(u, k).reshape(u.shape[0], -1)[:, 0].numpy()


@pytest.mark.parametrize("dim,ks", [(64, (1, 2, 8, 16)), (32, (4,))])
def test_theorem1_rotation_makes_any_input_canonical(dim, ks):
    for name, x in _non_uniform_inputs(dim).items():
        u = _canonical(x, rotate=True)
        for k in ks:
            radii = _first_block_radii(u, k)
            p = stats.kstest(radii, radius_law(dim, k).cdf).pvalue
            assert p > KS_ALPHA, f"{name}, d={dim}, k={k}: KS p-value {p:.2g}"


def test_without_rotation_the_ks_check_fails():
    """The same check on normalised but unrotated inputs rejects the Beta law: the test has teeth."""
    dim, k = 64, 4
    p_values = {name: stats.kstest(_first_block_radii(_canonical(x, rotate=False), k), radius_law(dim, k).cdf).pvalue
                for name, x in _non_uniform_inputs(dim).items()}
    assert p_values["outlier_channels"] < 1e-10
    assert p_values["all_positive"] < 1e-10
    assert min(p_values.values()) < KS_ALPHA
