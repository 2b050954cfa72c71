"""Shared normalise + Haar-rotate step of FibQuant and TurboQuant, kept per device (in the
owning codec's `device_state`, so its memory is counted with the codec's).

Encode side: nu = ||x|| and u = Pi x / nu (rows: u = (x / nu) @ Pi^T), in float32.
Decode side: x_hat = nu * (u_hat @ Pi) computed in float64 and rounded to float32: a float32
matmul rounds differently for one row than for a batch (different BLAS kernels), float64
followed by rounding to float32 gives the same bits whatever the batch size.
"""
from __future__ import annotations

import torch

from ..canonical import haar_rotation
from .base import FP16_MAX, DeviceState
from .bitpack import bytes_to_float16, float16_to_bytes

ROTATION_SEED_PARAM = "rotation_seed"  # the spec keyword (key "r") of every codec whose rotation is a seed


def check_rotation_seed(rotation_seed) -> None:
    """A codec config's `rotation_seed`: None (the rotation of the codec's `seed`) or an integer >= 0."""
    if rotation_seed is not None and (isinstance(rotation_seed, bool) or not isinstance(rotation_seed, int)
                                      or rotation_seed < 0):
        raise ValueError(f"rotation_seed must be None or a non-negative integer, got {rotation_seed!r}")


def rotation_seed_of(seed: int, rotation_seed) -> int:
    """The seed of Pi: `rotation_seed` where given, else the codec's `seed` (what every codec used before
    the field existed, so a saved config without it decodes as it always did). Only Pi changes with it:
    the universal codebook is fitted on the rotation-invariant canonical source and stays that of `seed`."""
    return seed if rotation_seed is None else rotation_seed


class RotationState:
    """Pi [dim, dim] for one (dim, seed), built on each device on first use and kept in `state`."""

    def __init__(self, dim: int, seed: int, state: DeviceState | None = None):
        self.dim = dim
        self.seed = seed
        self.state = state if state is not None else DeviceState()

    def forward_matrix(self, device: torch.device) -> torch.Tensor:
        """Pi^T in float32 on `device`: u = x @ Pi^T."""
        return self.state.get("rotation_forward", device, lambda d: haar_rotation(self.dim, self.seed, device=d)
                              .T.to(torch.float32).contiguous())

    def inverse_matrix(self, device: torch.device) -> torch.Tensor:
        """Pi in float64 on `device`: x = u @ Pi."""
        return self.state.get("rotation_inverse", device,
                              lambda d: haar_rotation(self.dim, self.seed, device=d, dtype=torch.float64))

    def normalise_rotate(self, x: torch.Tensor, codec_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, dim] float32 -> (fp16 norm bytes [n, 2], rotated unit rows u [n, dim] float32)."""
        norms = x.norm(dim=1)
        if float(norms.max()) > FP16_MAX:
            raise ValueError(f"{codec_name}: vector norm exceeds the fp16 range of the stored norm")
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        u = (x / safe.unsqueeze(1)) @ self.forward_matrix(x.device)
        return float16_to_bytes(norms), u

    def unrotate_scale(self, u_hat: torch.Tensor, norm_bytes: torch.Tensor) -> torch.Tensor:
        """u_hat [n, dim] (any float) and fp16 norm bytes [n, 2] -> x_hat [n, dim] float32."""
        # A fresh dense copy: a [1, 2] slice of a code row can carry an odd row stride.
        norms = bytes_to_float16(norm_bytes).to(torch.float64)
        x_hat = (u_hat.to(torch.float64) @ self.inverse_matrix(u_hat.device)) * norms.unsqueeze(1)
        return x_hat.to(torch.float32)
