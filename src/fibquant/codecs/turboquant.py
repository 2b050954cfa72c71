"""TurboQuant (MSE variant): normalise, Haar-rotate, scalar Lloyd-Max per coordinate.

The levels are the exact Lloyd-Max table of one coordinate of a uniform point on S^{dim-1}
(the Beta marginal; FibQuant's k = 1 codebook). Code layout of one vector:

    bytes [0, 2)           nu = ||x|| as IEEE fp16
    bytes [2, code_size)   dim level indices of `bits` bits each, bit-packed little-endian

code_size = 2 + ceil(dim * bits / 8). Zero vectors store nu = 0 and decode to zero.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codebook import load_codebook
from ..codebook.search import nearest_level
from .base import Codec, RotatedCodebook
from .bitpack import pack_bits, packed_size, unpack_bits
from .rotation import NORM_BYTES, RotationState

SUPPORTED_BITS = (1, 2, 3, 4)


@dataclass(frozen=True)
class TurboQuantConfig:
    dim: int
    bits: int
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 2:
            raise ValueError(f"dim must be an integer >= 2, got {self.dim!r}")
        if self.bits not in SUPPORTED_BITS or isinstance(self.bits, bool):
            raise ValueError(f"TurboQuantCodec supports bits in {SUPPORTED_BITS}, got {self.bits!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")


class TurboQuantCodec(Codec):
    """Scalar Lloyd-Max after a random rotation: float [..., dim] <-> uint8 [..., code_size]."""

    def __init__(self, dim: int, bits: int, seed: int = 0):
        self.config = TurboQuantConfig(dim, bits, seed)
        self.dim, self.bits, self.seed = dim, bits, seed
        self.levels = load_codebook(dim, 1, 1 << bits, seed).codewords.flatten()  # ascending [2^bits]
        self.thresholds = 0.5 * (self.levels[1:] + self.levels[:-1])
        self._rotation = RotationState(dim, seed)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def code_size(self) -> int:
        return NORM_BYTES + packed_size(self.dim, self.bits)

    @property
    def bits_per_coordinate(self) -> float:
        return float(self.bits)

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:
            self._tables[device] = (self.levels.to(device), self.thresholds.to(device))
        return self._tables[device]

    def rotated_codebook(self, device: torch.device) -> RotatedCodebook:
        levels, _ = self._table(torch.device(device))
        return RotatedCodebook(self._rotation.forward_matrix(torch.device(device)), levels.reshape(-1, 1), self.bits)

    def _encode_flat(self, x: torch.Tensor) -> torch.Tensor:
        norm_bytes, u = self._rotation.normalise_rotate(x, type(self).__name__)
        _, thresholds = self._table(x.device)
        return torch.cat([norm_bytes, pack_bits(nearest_level(u, thresholds), self.bits)], dim=1)

    def _decode_flat(self, codes: torch.Tensor) -> torch.Tensor:
        levels, _ = self._table(codes.device)
        index = unpack_bits(codes[:, NORM_BYTES:], self.bits, self.dim)
        return self._rotation.unrotate_scale(levels[index], codes[:, :NORM_BYTES])
