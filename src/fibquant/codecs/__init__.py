"""Codecs sharing one vocabulary (see base.Codec): encode float [..., dim] -> uint8 codes.

The families used by the experiments are registered in `fibquant.codecs.registry.REGISTRY`.
"""
from .base import Codec
from .e8shell import E8ShellCodec
from .fibquant import FibQuantCodec
from .identity import IdentityCodec
from .integer import IntCodec
from .lowrank import LowRankCodec
from .fibrvq import FibRVQCodec
from .rvq import RVQCodec
from .turboquant import TurboQuantCodec

__all__ = ["Codec", "E8ShellCodec", "FibQuantCodec", "IdentityCodec", "IntCodec", "LowRankCodec", "RVQCodec", "FibRVQCodec",
           "TurboQuantCodec"]
