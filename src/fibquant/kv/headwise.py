"""Per-layer and per-head codecs for a `CompressedCache` (learned codebooks fitted per head).

A `CompressedCache` holds one codec per role (keys, values) shared by every layer and head,
which is right for FibQuant's universal codebook but not for calibrated codecs such as
`RVQCodec`, whose codebooks are fitted per layer and KV head ("per head") or once on all of
them ("pooled", which a plain `CompressedCache` already serves). Two small pieces close the gap:

- `HeadwiseCodec([codec_h for each KV head])` encodes/decodes a [..., H, n, D] tensor with
  codec h on head h (every codec has the same dim and code_size, so code rows keep the
  cache's [B, H, n, code_size] layout);
- `LayerwiseCompressedCache(key_codecs, value_codecs, ...)` gives layer l the codecs
  key_codecs[l] / value_codecs[l] (layers are created in order by transformers, so the
  index is the number of layers already made).

`Fp16Codec` stores a vector as its fp16 bytes (2*dim bytes: no compression, an `IdentityCodec`
that saturates to inf instead of raising), the "exact" role of K-only / V-only studies.

    codecs = [HeadwiseCodec([RVQCodec.fit(keys[l, h], 4) for h in range(H)]) for l in range(L)]
    cache = LayerwiseCompressedCache(codecs, value_codecs, sink_tokens=4, recent_tokens=32)

Attention on codes needs a rotated codebook; these codecs have none, so the cache's
"codes" attention decodes them (use attention="decode", the default here). Such caches are
saved by `fibquant.kv.persist.store` with one codec entry per layer (and head); learned codebooks
go to safetensors files next to the manifest.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from fibquant.codecs.base import Codec
from fibquant.codecs.bitpack import float16_to_bytes
from fibquant.codecs.identity import IdentityCodec
from fibquant.kv.cache import CompressedCache, _check_codec
from fibquant.kv.plan import LayerPlan


class Fp16Codec(IdentityCodec):
    """`IdentityCodec` (family "fp": a vector as its fp16 bytes, the same bytes) that stores
    magnitudes beyond the fp16 range as +-inf instead of refusing them, as the K-only / V-only
    studies always did. A saved cache records it as "fp": it loads back as an `IdentityCodec`
    (identical decoding; only a later out-of-range encode raises there)."""

    finite_decode = False  # +-inf codes are its saturation, not corruption

    def _encode_flat(self, x: torch.Tensor) -> torch.Tensor:
        return float16_to_bytes(x).reshape(x.shape[0], self.code_size)


class HeadwiseCodec(Codec):
    """One codec per KV head: codec h encodes/decodes head h of a [..., H, n, D] tensor."""

    def __init__(self, codecs: Sequence[Codec]):
        codecs = list(codecs)
        if not codecs:
            raise ValueError("HeadwiseCodec needs at least one codec")
        for i, codec in enumerate(codecs):
            _check_codec(codec, f"codecs[{i}]")
        if len({(c.dim, c.code_size) for c in codecs}) != 1:
            raise ValueError("HeadwiseCodec: every head's codec must have the same dim and code_size, got "
                             f"{sorted({(c.dim, c.code_size) for c in codecs})}")
        self.codecs = codecs
        self.dim = codecs[0].dim

    @property
    def heads(self) -> int:
        return len(self.codecs)

    @property
    def code_size(self) -> int:
        return self.codecs[0].code_size

    @property
    def bits_per_coordinate(self) -> float:
        return self.codecs[0].bits_per_coordinate

    def _check_heads(self, tensor: torch.Tensor, what: str) -> None:
        if tensor.ndim < 3 or tensor.shape[-3] != self.heads:
            raise ValueError(f"HeadwiseCodec with {self.heads} heads expects {what} [..., {self.heads}, n, last], "
                             f"got shape {tuple(tensor.shape)}")

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self._check_heads(x, "x")
        return torch.stack([codec.encode(x[..., h, :, :]) for h, codec in enumerate(self.codecs)], dim=-3)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        self._check_heads(codes, "codes")
        return torch.stack([codec.decode(codes[..., h, :, :], dtype=dtype) for h, codec in enumerate(self.codecs)],
                           dim=-3)

    def _encode_flat(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - encode is overridden
        raise ValueError("HeadwiseCodec needs the head axis: call encode on [..., H, n, D]")

    _decode_flat = _encode_flat

    def __repr__(self) -> str:
        return f"HeadwiseCodec({self.heads} x {self.codecs[0]!r})"


class LayerwiseCompressedCache(CompressedCache):
    """A `CompressedCache` whose layer l uses key_codecs[l] and value_codecs[l] (the name saved
    caches load as; `CompressedCache` itself takes the two sequences)."""

    def __init__(self, key_codecs: Sequence[Codec], value_codecs: Sequence[Codec], sink_tokens: int = 4,
                 recent_tokens: int = 32, attention: str = "decode", encode_batch: int = 16, *,
                 layer_plan: Optional[LayerPlan] = None):
        super().__init__(list(key_codecs), list(value_codecs), sink_tokens, recent_tokens, attention, encode_batch,
                         layer_plan=layer_plan)
