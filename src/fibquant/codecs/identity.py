"""The uncompressed reference as a codec: a vector stored as its IEEE fp16 values.

Code of one vector: dim fp16 values, little-endian, 2 * dim bytes (compression ratio 1.0).
`bits_per_coordinate` is 16. Magnitudes beyond the fp16 range are rejected (ValueError).

Spec string "fp". The family is the reference of every experiment (`reference = True`): they
run it on the exact states (a DynamicCache, the captured tensors) and take its bytes, label and
plot style from here, so the fp row needs no special case in tables and plots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import FP16_MAX, Codec, PlotStyle
from .bitpack import bytes_to_float16, float16_to_bytes


@dataclass(frozen=True)
class IdentityConfig:
    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"dim must be a positive integer, got {self.dim!r}")


class IdentityCodec(Codec):
    """fp16 storage: float [..., dim] -> uint8 [..., 2*dim] and back (exact for fp16 inputs)."""

    family = "fp"
    reference = True
    style = PlotStyle("fp (uncompressed)", "k", "")

    def __init__(self, dim: int):
        super().__init__(IdentityConfig(dim))

    @classmethod
    def spec_label(cls, dim: int) -> str:
        return "fp (uncompressed)"

    @classmethod
    def from_spec(cls, dim: int) -> "IdentityCodec":
        return cls(dim)

    @property
    def code_size(self) -> int:
        return 2 * self.dim

    @property
    def bits_per_coordinate(self) -> float:
        return 16.0

    def _encode_flat(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.abs().max()) > FP16_MAX:
            raise ValueError("IdentityCodec: input magnitude exceeds the fp16 range")
        return float16_to_bytes(x).reshape(x.shape[0], self.code_size)

    def _decode_flat(self, codes: torch.Tensor) -> torch.Tensor:
        return bytes_to_float16(codes.reshape(codes.shape[0], self.dim, 2))
