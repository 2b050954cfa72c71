"""Codecs sharing one vocabulary (see base.Codec): encode float [..., dim] -> uint8 codes."""
from .base import Codec
from .fibquant import FibQuantCodec
from .integer import IntCodec
from .turboquant import TurboQuantCodec

__all__ = ["Codec", "FibQuantCodec", "IntCodec", "TurboQuantCodec", "LowRankCodec"]


def __getattr__(name: str):
    # LowRankCodec lives in codecs/lowrank.py (another module owner); import it lazily.
    if name == "LowRankCodec":
        from .lowrank import LowRankCodec
        return LowRankCodec
    raise AttributeError(f"module 'fibquant.codecs' has no attribute {name!r}")
