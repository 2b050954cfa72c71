"""The one vocabulary every codec speaks.

A codec maps float vectors x of shape [..., dim] to fixed-size byte codes of shape
[..., code_size] (torch.uint8) and back. Because every vector's code has the same size,
vector i of a flat batch sits at byte offset i * code_size: random access is address
arithmetic, and decoding one row gives exactly the vector the batch decode gives.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FP16_MAX = float(torch.finfo(torch.float16).max)


@dataclass(frozen=True)
class RotatedCodebook:
    """What attention on codes needs from a rotate-then-quantize codec (FibQuant, TurboQuant).

    A code row [nu (fp16), idx_0 .. idx_{dim/k-1} (index_bits each)] decodes to
    x_hat = nu * concat_j(codewords[idx_j]) @ forward.T, so for any query q,
    q . x_hat = nu * (q @ forward) . concat_j(codewords[idx_j]): rotate the query once, never a key.

    forward: float32 [dim, dim] (Pi^T, u = x @ forward); codewords: float32 [N, k]; both on one device.
    """

    forward: torch.Tensor
    codewords: torch.Tensor
    index_bits: int


class Codec(ABC):
    """Fixed-rate vector codec.

    Subclasses set `dim` and implement `code_size`, `bits_per_coordinate`,
    `_encode_flat` ([n, dim] float32 -> [n, code_size] uint8) and
    `_decode_flat` ([n, code_size] uint8 -> [n, dim] float32).
    """

    dim: int

    @property
    @abstractmethod
    def code_size(self) -> int:
        """Bytes per encoded vector, everything included (indices, norm, scales)."""

    @property
    @abstractmethod
    def bits_per_coordinate(self) -> float:
        """Nominal rate of the index stream, in bits per coordinate."""

    @property
    def stored_bits_per_coordinate(self) -> float:
        """Every stored bit (indices + side information) per coordinate."""
        return 8.0 * self.code_size / self.dim

    @property
    def compression_ratio(self) -> float:
        """Size of the fp16 vector over the size of its code: 2*dim / code_size."""
        return 2.0 * self.dim / self.code_size

    @abstractmethod
    def _encode_flat(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _decode_flat(self, codes: torch.Tensor) -> torch.Tensor: ...

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """float [..., dim] (fp16/bf16/fp32/fp64, any device) -> uint8 [..., code_size]."""
        self.check_input(x)
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.dim).to(torch.float32)
        if flat.shape[0] == 0:
            return torch.empty(*lead, self.code_size, dtype=torch.uint8, device=x.device)
        return self._encode_flat(flat).reshape(*lead, self.code_size)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 [..., code_size] -> `dtype` [..., dim] on the codes' device."""
        self.check_codes(codes)
        lead = codes.shape[:-1]
        flat = codes.reshape(-1, self.code_size)
        if flat.shape[0] == 0:
            return torch.empty(*lead, self.dim, dtype=dtype, device=codes.device)
        return self._decode_flat(flat).reshape(*lead, self.dim).to(dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)) in x's dtype."""
        return self.decode(self.encode(x), dtype=x.dtype)

    def rotated_codebook(self, device: torch.device) -> RotatedCodebook | None:
        """The codec's rotated-domain structure on `device`, or None when it has none (then
        attention on codes falls back to decoding this codec's codes to floats)."""
        return None

    def check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{type(self).__name__}.encode expects a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{type(self).__name__}.encode expects a floating tensor, got dtype {x.dtype}")
        if x.ndim == 0 or x.shape[-1] != self.dim:
            raise ValueError(
                f"{type(self).__name__}: last dimension must be dim={self.dim}, got shape {tuple(x.shape)}"
            )
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{type(self).__name__}.encode: input contains NaN or Inf")

    def check_codes(self, codes: torch.Tensor) -> None:
        if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
            got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
            raise ValueError(f"{type(self).__name__}.decode expects a torch.uint8 tensor, got {got}")
        if codes.ndim == 0 or codes.shape[-1] != self.code_size:
            raise ValueError(
                f"{type(self).__name__}: codes must have last dimension code_size={self.code_size}, "
                f"got shape {tuple(codes.shape)}"
            )

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(dim={self.dim}, bits/coord={self.bits_per_coordinate:.4g}, "
                f"code_size={self.code_size}B, ratio={self.compression_ratio:.2f}x)")
