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
from ..codebook.nearest import nearest_level
from .base import Codec, PlotStyle, SpecParam
from .bitpack import NORM_BYTES, pack_bits, packed_size, unpack_bits
from .reader import CodebookReader
from .layout import CodeLayout
from .rotation import RotationState, check_rotation_seed, rotation_seed_of

SUPPORTED_BITS = (1, 2, 3, 4)


@dataclass(frozen=True)
class TurboQuantConfig:
    dim: int
    bits: int
    seed: int = 0
    rotation_seed: int | None = None  # the seed of Pi (None: `seed`); the levels do not depend on it

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 2:
            raise ValueError(f"dim must be an integer >= 2, got {self.dim!r}")
        if self.bits not in SUPPORTED_BITS or isinstance(self.bits, bool):
            raise ValueError(f"TurboQuantCodec supports bits in {SUPPORTED_BITS}, got {self.bits!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        check_rotation_seed(self.rotation_seed)


class TurboQuantCodec(Codec):
    """Scalar Lloyd-Max after a random rotation: float [..., dim] <-> uint8 [..., code_size].

    Spec string: "turboquant:b=3" (",r=<seed>": another rotation draw). The level table loads on first use.
    """

    family = "turboquant"
    spec_params = (SpecParam("b", "bits"), SpecParam("r", "rotation_seed"))
    style = PlotStyle("TurboQuant", "C0", "s")

    def __init__(self, dim: int, bits: int, seed: int = 0, rotation_seed: int | None = None):
        super().__init__(TurboQuantConfig(dim, bits, seed, rotation_seed))
        self.bits, self.seed, self.rotation_seed = bits, seed, rotation_seed
        self._levels: torch.Tensor | None = None
        self._thresholds: torch.Tensor | None = None
        self._rotation = RotationState(dim, rotation_seed_of(seed, rotation_seed), self.device_state)

    @classmethod
    def check_spec(cls, params: dict) -> None:
        if params.get("bits") is None:
            raise ValueError("turboquant needs b=<bits>")
        check_rotation_seed(params.get("rotation_seed"))

    @classmethod
    def spec_label(cls, dim: int, bits: int, rotation_seed: int | None = None) -> str:
        return f"TurboQuant b={bits:g}" + (f" (r={rotation_seed})" if rotation_seed is not None else "")

    @classmethod
    def from_spec(cls, dim: int, bits: int, rotation_seed: int | None = None) -> "TurboQuantCodec":
        return cls(dim, bits, rotation_seed=rotation_seed)

    @property
    def levels(self) -> torch.Tensor:
        """The 2^bits Lloyd-Max levels, ascending, float32 on the CPU (loaded on first access)."""
        if self._levels is None:
            self._levels = load_codebook(self.dim, 1, 1 << self.bits, self.seed).codewords.flatten()
        return self._levels

    @property
    def thresholds(self) -> torch.Tensor:
        """The 2^bits - 1 midpoints between consecutive levels."""
        if self._thresholds is None:
            self._thresholds = 0.5 * (self.levels[1:] + self.levels[:-1])
        return self._thresholds

    def shared_tensors(self) -> list[torch.Tensor]:
        loaded = [t for t in (self._levels, self._thresholds) if t is not None]
        return loaded + super().shared_tensors()

    @property
    def code_size(self) -> int:
        return NORM_BYTES + packed_size(self.dim, self.bits)

    @property
    def bits_per_coordinate(self) -> float:
        return float(self.bits)

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(levels [2^bits], thresholds [2^bits - 1]) on `device`, float32."""
        return self.device_state.get("levels", device, lambda d: (self.levels.to(d), self.thresholds.to(d)))

    def reader(self, device: torch.device) -> CodebookReader:
        """Its levels as a codebook of N = 2^bits one-dimensional codewords."""
        device = torch.device(device)
        levels, _ = self._table(device)
        return CodebookReader(self.dim, self._rotation.forward_matrix(device), self.bits, levels.reshape(-1, 1),
                              type(self).__name__)

    def _encode_flat(self, x: torch.Tensor) -> torch.Tensor:
        norm_bytes, u = self._rotation.normalise_rotate(x, type(self).__name__)
        _, thresholds = self._table(x.device)
        return torch.cat([norm_bytes, pack_bits(nearest_level(u, thresholds), self.bits)], dim=1)

    def _decode_flat(self, codes: torch.Tensor) -> torch.Tensor:
        u_hat = self.reader(codes.device).unit_rows(codes)
        return self._rotation.unrotate_scale(u_hat, codes[:, :NORM_BYTES])

    @property
    def code_layout(self) -> CodeLayout:
        """[fp16 norm][dim packed level indices in [0, 2^bits)]: what `CodeArchive` needs to store the codes."""
        return CodeLayout(1 << self.bits, self.dim, NORM_BYTES)
