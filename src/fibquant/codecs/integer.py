"""Per-token asymmetric min-max integer quantization (the INT baseline).

Each group of `group_size` coordinates (the whole vector by default) stores its
minimum and step as fp16 (4 bytes per group) and one `bits`-bit level per coordinate,
bit-packed: code = [min, step] * groups + packed levels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import FP16_MAX, Codec, PlotStyle, SpecParam
from .bitpack import bytes_to_float16, float16_to_bytes, pack_bits, packed_size, unpack_bits

SIDE_BYTES_PER_GROUP = 4  # fp16 minimum + fp16 step


@dataclass(frozen=True)
class IntConfig:
    dim: int
    bits: int
    group_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"dim must be a positive integer, got {self.dim!r}")
        if not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"IntCodec supports 2..8 bits, got {self.bits!r}")
        group = self.dim if self.group_size is None else self.group_size
        if not isinstance(group, int) or group < 1 or self.dim % group:
            raise ValueError(f"group_size must divide dim={self.dim}, got {self.group_size!r}")

    @property
    def group(self) -> int:
        return self.dim if self.group_size is None else self.group_size


class IntCodec(Codec):
    """Asymmetric INT-`bits` quantization per token (and per group).

    encode: float [..., dim] -> uint8 [..., code_size]; decode: the reverse.
    Spec string: "int:b=4" (per token, no groups).
    """

    family = "int"
    spec_params = (SpecParam("b", "bits"),)
    style = PlotStyle("INT", "C2", "^")

    def __init__(self, dim: int, bits: int, group_size: int | None = None):
        super().__init__(IntConfig(dim, bits, group_size))
        self.bits = bits
        self.groups = dim // self.config.group
        self._levels = (1 << bits) - 1

    @classmethod
    def check_spec(cls, params: dict) -> None:
        if params.get("bits") is None:
            raise ValueError("int needs b=<bits>")

    @classmethod
    def spec_label(cls, dim: int, bits: int) -> str:
        return f"INT{bits:g}"

    @classmethod
    def from_spec(cls, dim: int, bits: int) -> "IntCodec":
        return cls(dim, bits)

    @property
    def code_size(self) -> int:
        return self.groups * SIDE_BYTES_PER_GROUP + packed_size(self.dim, self.bits)

    @property
    def bits_per_coordinate(self) -> float:
        return float(self.bits)

    def _encode_flat(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.abs().max()) > FP16_MAX:
            raise ValueError("IntCodec: input magnitude exceeds the fp16 range of the stored scales")
        n = x.shape[0]
        grouped = x.reshape(n, self.groups, self.config.group)
        low = grouped.amin(-1).to(torch.float16).to(torch.float32)
        step = ((grouped.amax(-1) - low) / self._levels).to(torch.float16).to(torch.float32)
        safe_step = torch.where(step > 0, step, torch.ones_like(step))
        levels = torch.round((grouped - low.unsqueeze(-1)) / safe_step.unsqueeze(-1))
        levels = levels.clamp_(0, self._levels).reshape(n, self.dim)
        side = torch.cat([float16_to_bytes(low), float16_to_bytes(step)], dim=-1).reshape(n, -1)
        return torch.cat([side, pack_bits(levels, self.bits)], dim=-1)

    def _decode_flat(self, codes: torch.Tensor) -> torch.Tensor:
        n = codes.shape[0]
        side = codes[:, : self.groups * SIDE_BYTES_PER_GROUP].reshape(n, self.groups, 2, 2)
        low, step = bytes_to_float16(side[:, :, 0]), bytes_to_float16(side[:, :, 1])
        levels = unpack_bits(codes[:, self.groups * SIDE_BYTES_PER_GROUP:], self.bits, self.dim)
        grouped = levels.reshape(n, self.groups, self.config.group).to(torch.float32)
        return (low.unsqueeze(-1) + grouped * step.unsqueeze(-1)).reshape(n, self.dim)
