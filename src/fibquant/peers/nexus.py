"""NexusQuant (PyPI `nexusquant-kv`): `E8QuantizedCache`'s inverse RoPE (keys), Hadamard rotation
and relaxed E8 vector quantization with 2^b levels per coordinate."""
from __future__ import annotations

import math

from fibquant.peers.base import PeerFamily, PeerQuantizer, PeerSpec, one_of


def nexus_block_points(levels: int) -> int:
    """Points nexusquant's relaxed E8 quantizer outputs per 8-block inside [-L/2, L/2]^8 (L = levels):
    integer points with even coordinate sum, plus every half-integer point (parity not enforced)."""
    half = levels // 2
    odd_sum = sum((-1) ** abs(v) for v in range(-half, half + 1))  # sum over one coordinate of (-1)^x
    even_integer = ((levels + 1) ** 8 + odd_sum ** 8) // 2
    return even_integer + levels ** 8


def nexus_bytes(bits: int, dim: int) -> float:
    """Fixed-rate size of one nexusquant vector: ceil((D/8) log2 points) index bits + an fp16 scale."""
    blocks = math.ceil(dim / 8)
    return (math.ceil(blocks * math.log2(nexus_block_points(2 ** bits))) + 16) / 8


def _build_nexus(spec: PeerSpec, dim: int, role: str, model=None) -> PeerQuantizer:
    from nexusquant.integrations.quantized_cache import E8QuantizedCache

    if model is None:
        raise ValueError(f"{spec.spec}: nexusquant needs the model (its RoPE settings undo RoPE on the keys)")
    cache = E8QuantizedCache.from_model(model, key_bits=spec.value, value_bits=spec.value)
    if role == "key":
        def fn(x, start):
            return cache._e8_keys(x, seq_offset=start)
    else:
        def fn(x, start):
            return cache._e8_values(x)
    return PeerQuantizer(spec, dim, role, fn)


FAMILIES = {
    "nexus": PeerFamily(
        "b", "b in (2, 3, 4)", one_of((2, 3, 4)), lambda b: f"NexusQuant E8 {b}-bit",
        nexus_bytes,
        "fixed-rate: ceil((D/8) log2 P) bits, P = even-sum integer points + all half-integer points of "
        "[-2^(b-1), 2^(b-1)]^8 (its relaxed E8), + fp16 scale per vector; its own format stores int8 "
        "coordinates zstd-compressed (variable rate, not used here)", _build_nexus,
        package=("nexusquant", "nexusquant-kv"), style=("C6", "*"), defaults=(4, 3, 2)),
}
