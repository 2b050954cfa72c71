"""`CodeLayout`: the byte layout of a code that is [norm][bit-packed indices].

The code of one vector is

    bytes [0, norm_bytes)            the norm as IEEE fp16 (norm_bytes = 2), or nothing (0)
    bytes [norm_bytes, code_size)    n_blocks indices in [0, n_codewords), ceil(log2 n_codewords)
                                     bits each, bit-packed little-endian

FibQuant codes have this layout with a norm, TurboQuant too (the k = 1 case: n_blocks = dim
scalar levels, n_codewords = 2^bits), residual VQ without one (n_blocks = stages). A codec
with this layout exposes it as `codec.code_layout`; `fibquant.archive.CodeArchive` uses it
to store the indices at log2(n_codewords) bits and give back byte-identical codes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .bitpack import pack_bits, packed_size, unpack_bits


@dataclass(frozen=True)
class CodeLayout:
    """Byte layout of a [norm][packed indices] code; `code_size` bytes per vector."""

    n_codewords: int  # each index lies in [0, n_codewords)
    n_blocks: int  # indices per vector
    norm_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("n_codewords", "n_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (2 if name == "n_codewords" else 1):
                raise ValueError(f"{name} must be a positive integer (n_codewords >= 2), got {value!r}")
        if self.norm_bytes not in (0, 2):
            raise ValueError(f"norm_bytes must be 2 (an fp16 norm) or 0 (no norm), got {self.norm_bytes!r}")

    @classmethod
    def from_codec(cls, codec) -> "CodeLayout":
        """The layout a codec declares as `code_layout`, checked against its `code_size`."""
        layout = getattr(codec, "code_layout", None)
        if not isinstance(layout, cls):
            raise ValueError(f"{type(codec).__name__} does not declare a [norm][packed indices] code_layout")
        if layout.code_size != codec.code_size:
            raise ValueError(f"{type(codec).__name__} code_size {codec.code_size} does not match its "
                             f"code_layout ({layout.code_size} bytes)")
        return layout

    @property
    def index_bits(self) -> int:
        return max(1, math.ceil(math.log2(self.n_codewords)))

    @property
    def code_size(self) -> int:
        return self.norm_bytes + packed_size(self.n_blocks, self.index_bits)

    def split(self, codes) -> tuple[np.ndarray, np.ndarray | None]:
        """uint8 [n, code_size] -> (indices int64 [n, n_blocks], norm bit patterns int64 [n],
        or None when the layout has no norm)."""
        if isinstance(codes, np.ndarray):
            codes = torch.from_numpy(codes)
        if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
            raise ValueError(f"codes must be a uint8 tensor/array, got {getattr(codes, 'dtype', type(codes))}")
        if codes.ndim != 2 or codes.shape[1] != self.code_size:
            raise ValueError(f"codes must have shape [n, {self.code_size}], got {tuple(codes.shape)}")
        codes = codes.detach().cpu()
        indices = unpack_bits(codes[:, self.norm_bytes:], self.index_bits, self.n_blocks).numpy()
        if indices.size and int(indices.max()) >= self.n_codewords:
            raise ValueError(f"codes hold a block index >= n_codewords={self.n_codewords}")
        if not self.norm_bytes:
            return indices, None
        norms = codes[:, :self.norm_bytes].numpy().astype(np.int64)
        return indices, norms[:, 0] | (norms[:, 1] << 8)

    def join(self, indices: np.ndarray, norms: np.ndarray | None) -> np.ndarray:
        """Inverse of `split`: -> uint8 [n, code_size], byte-identical to the codec's output."""
        packed = pack_bits(torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64)), self.index_bits)
        if not self.norm_bytes:
            return packed.numpy()
        norm_bytes = np.stack([norms & 0xFF, norms >> 8], axis=1).astype(np.uint8)
        return np.concatenate([norm_bytes, packed.numpy()], axis=1)
