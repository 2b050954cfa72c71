"""transformers' own `QuantizedCache` layers as peers: quanto (optimum-quanto) and HQQ (hqq).

Two spellings, two things measured:

- `quanto-rt:b=4`, `hqq-rt:b=2`: the layer's own `_quantize` / dequantize as a float round trip
  of every vector outside fibquant's exact window (`RoundTripCache`), so quality experiments
  compare the quantizers under the same window as `CompressedCache`;
- `quanto:b=4`, `hqq:b=2`: transformers' `QuantizedCache(backend=..., nbits=b)` itself (its own
  float residual of `residual_length` tokens), what `eval decode-speed` times (`PeerFamily.native`).

Both quantize per-token groups of 64 elements (transformers' default `q_group_size`). In quality
experiments `quanto:b=B` / `hqq:b=B` are refused with the round trip's spelling.
"""
from __future__ import annotations

import torch

from fibquant.peers.base import PeerFamily, PeerQuantizer, PeerSpec, one_of

GROUP_SIZE = 64  # QuantizedCache's default q_group_size


def group_int_bytes(bits: int, dim: int) -> float:
    """b-bit levels + one fp16 scale and one fp16 zero/shift per group of 64 elements."""
    return dim * bits / 8 + (dim / GROUP_SIZE) * 4


def _build_quanto(spec: PeerSpec, dim: int, role: str, model=None) -> PeerQuantizer:
    from transformers.cache_utils import QuantoQuantizedLayer

    layer = QuantoQuantizedLayer(nbits=spec.value, q_group_size=GROUP_SIZE)

    def fn(x, start):
        return layer._quantize(x.contiguous(), axis=0).dequantize()
    return PeerQuantizer(spec, dim, role, fn)


def _build_hqq(spec: PeerSpec, dim: int, role: str, model=None) -> PeerQuantizer:
    from transformers.cache_utils import HQQQuantizedLayer

    layer = HQQQuantizedLayer(nbits=spec.value, q_group_size=GROUP_SIZE)

    def fn(x, start):
        layer.keys = torch.empty(0, dtype=x.dtype, device=x.device)  # _quantize reads device/dtype from it
        return layer._dequantize(layer._quantize(x.contiguous(), axis=0))
    return PeerQuantizer(spec, dim, role, fn)


FAMILIES = {
    "quanto-rt": PeerFamily(
        "b", "b in (2, 4)", one_of((2, 4)), lambda b: f"quanto INT{b} (round trip)",
        group_int_bytes,
        "b bits per element + fp16 scale and fp16 shift per group of 64 (quanto stores them in the model dtype; "
        "counted as fp16, i.e. what an fp16 model holds)", _build_quanto,
        package=("optimum.quanto", "optimum-quanto"), style=("C1", "v"), defaults=(4, 2),
        native="quanto"),
    "hqq-rt": PeerFamily(
        "b", "b in (1, 2, 3, 4, 8)", one_of((1, 2, 3, 4, 8)), lambda b: f"HQQ INT{b} (round trip)",
        group_int_bytes,
        "b bits per element + fp16 scale and fp16 zero per group of 64 (axis 0, transformers' default)", _build_hqq,
        package=("hqq.core.quantize", "hqq"), style=("C5", "<"), defaults=(4, 2),
        native="hqq"),
}
