"""The canonical source of FibQuant: rotated unit vectors and the law of their k-blocks.

For any nonzero x in R^d, u = Pi x / ||x|| with one shared Haar-random orthogonal Pi is
uniform on the unit sphere S^{d-1}. Every block y of k consecutive coordinates of u then has
the spherical-Beta density on the unit ball B^k

    f_{d,k}(y) = Gamma(d/2) / (pi^{k/2} Gamma((d-k)/2)) * (1 - ||y||^2)^{(d-k)/2 - 1},

so ||y||^2 ~ Beta(k/2, (d-k)/2) and y/||y|| is uniform on S^{k-1}, independent of the radius.
Everything here is deterministic by seed: random draws use a seeded CPU `torch.Generator`
(so the same seed gives the same numbers on every device) and are moved afterwards.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
from scipy import stats


def check_dim_block(dim: int, k: int) -> None:
    """Raise ValueError unless dim >= 1 and 1 <= k <= dim with k dividing dim."""
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim!r}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"block size k must be a positive integer, got {k!r}")
    if k > dim or dim % k:
        raise ValueError(f"block size k={k} must divide dim={dim}")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(int(seed))


def sample_sphere(n: int, dim: int, seed: int = 0, *, generator: torch.Generator | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """n points uniform on S^{dim-1}: normalised standard Gaussians. Returns [n, dim] on CPU."""
    if n < 0:
        raise ValueError(f"number of samples must be >= 0, got {n}")
    gen = generator if generator is not None else _generator(seed)
    gauss = torch.randn(n, dim, generator=gen, dtype=torch.float64)
    return (gauss / gauss.norm(dim=1, keepdim=True)).to(dtype)


def sample_blocks(n_blocks: int, dim: int, k: int, seed: int = 0, *,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """n_blocks k-blocks of uniform points on S^{dim-1}: [n_blocks, k] float32 on CPU.

    Consecutive blocks come from the same sphere point (dim/k blocks per point); each block
    is marginally f_{dim,k}-distributed, which is all that codebook training needs.
    """
    check_dim_block(dim, k)
    per_point = dim // k
    points = sample_sphere(math.ceil(n_blocks / per_point), dim, seed, generator=generator)
    return points.reshape(-1, k)[:n_blocks].contiguous()


def log_block_density(y: torch.Tensor, dim: int, k: int) -> torch.Tensor:
    """log f_{dim,k}(y) for blocks y [..., k]; -inf outside the open unit ball. Needs k < dim."""
    check_dim_block(dim, k)
    if k == dim:
        raise ValueError("k = dim: the block is the whole unit vector, its law has no density on B^k")
    log_const = (math.lgamma(dim / 2) - (k / 2) * math.log(math.pi) - math.lgamma((dim - k) / 2))
    gap = 1.0 - (y.to(torch.float64) ** 2).sum(-1)
    inside = gap > 0
    safe = torch.where(inside, gap, torch.ones_like(gap))
    value = log_const + ((dim - k) / 2 - 1) * torch.log(safe)
    return torch.where(inside, value, torch.full_like(value, -math.inf))


def radius_law(dim: int, k: int):
    """The law of ||y||^2 for a k-block: scipy.stats.beta(k/2, (dim-k)/2). Needs k < dim."""
    check_dim_block(dim, k)
    if k == dim:
        raise ValueError("k = dim: the block radius is always 1 (a point mass, not a Beta law)")
    return stats.beta(k / 2, (dim - k) / 2)


def companded_radius_law(dim: int, k: int):
    """Law of ||c||^2 for Bennett-Gersho point density lambda ~ f^{k/(k+2)} (Beta). Needs k < dim.

    f_{dim,k}^{k/(k+2)} is proportional to (1 - r^2)^{((dim-k)/2 - 1) k/(k+2)}, so the radial
    law of the optimal high-rate codeword density is r^2 ~ Beta(k/2, ((dim-k)/2 - 1) k/(k+2) + 1).
    """
    check_dim_block(dim, k)
    if k == dim:
        raise ValueError("k = dim: all codewords sit on the unit sphere")
    return stats.beta(k / 2, ((dim - k) / 2 - 1) * k / (k + 2) + 1)


@lru_cache(maxsize=64)
def _haar_cpu(dim: int, seed: int) -> torch.Tensor:
    gauss = torch.randn(dim, dim, generator=_generator(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    # Fix the column signs so that Q is Haar distributed (and unique for this Gaussian draw).
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return (q * signs).contiguous()


def haar_rotation(dim: int, seed: int = 0, *, device: torch.device | str | None = None,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Haar-random orthogonal Pi [dim, dim]: QR of a seeded Gaussian, columns signed by sign(diag R).

    Computed in float64 on the CPU, so every device gets the same matrix for the same seed.
    """
    if not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim!r}")
    return _haar_cpu(dim, int(seed)).to(device=device, dtype=dtype)


def canonicalize(x: torch.Tensor, rotation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, d] -> (norms [n], u [n, d]) with u = Pi x / ||x|| row-wise (u = 0 where x = 0)."""
    norms = x.norm(dim=-1)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    unit = x / safe.unsqueeze(-1)
    return norms, unit @ rotation.to(dtype=x.dtype, device=x.device).T


def block_radii(u: torch.Tensor, k: int) -> torch.Tensor:
    """Squared radii ||y||^2 of the consecutive k-blocks of rows u [n, d] -> [n * d/k]."""
    check_dim_block(u.shape[-1], k)
    return (u.reshape(-1, k) ** 2).sum(-1)
