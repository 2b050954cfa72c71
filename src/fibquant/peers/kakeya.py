"""KakeyaLattice (PyPI `kakeyalattice`): nested E8 (1.5, `V15KakeyaZamirE8GPU`) and D4 (1.4,
`V14KakeyaZamirLatticeGPU`) lattice quantizers after a Hadamard rotation, range Q."""
from __future__ import annotations

import math

from fibquant.peers.base import PeerFamily, PeerQuantizer, PeerSpec


def kakeya_bits(lattice: str, q_range: int, dim: int) -> int:
    """kakeyalattice's own count (LatticeCodebook): (D / block) * ceil(bits per block) + 32 (fp16 norm and qmax)."""
    block = 8 if lattice == "e8" else 4
    per_block = 8 * math.log2(2 * q_range + 1) if lattice == "e8" else 4 * math.log2(2 * q_range + 1) - 1
    return (dim // block) * math.ceil(per_block) + 32


def _build_kakeya(spec: PeerSpec, dim: int, role: str, model=None) -> PeerQuantizer:
    import kakeyalattice

    cls = kakeyalattice.V15KakeyaZamirE8GPU if spec.family == "kakeya-e8" else kakeyalattice.V14KakeyaZamirLatticeGPU
    block = 8 if spec.family == "kakeya-e8" else 4
    if dim % block or dim & (dim - 1):
        raise ValueError(f"{spec.spec}: kakeyalattice needs a power-of-two head_dim divisible by {block}, got {dim}")
    codec = cls(dim, spec.value, device="cpu")
    devices: dict = {}

    def fn(x, start):
        if x.device not in devices:  # the Hadamard matrix lives on one device
            devices[x.device] = cls(dim, spec.value, device=str(x.device)) if x.device.type != "cpu" else codec
        return devices[x.device].roundtrip(x)
    return PeerQuantizer(spec, dim, role, fn)


FAMILIES = {
    "kakeya-e8": PeerFamily(
        "q", "integer q >= 1", lambda q: q >= 1, lambda q: f"KakeyaLattice E8 Q={q}",
        lambda q, d: kakeya_bits("e8", q, d) / 8,
        "kakeyalattice's own count: (D/8) * ceil(8 log2(2Q+1)) lattice bits + fp16 norm + fp16 qmax", _build_kakeya,
        package=("kakeyalattice", "kakeyalattice"), style=("C8", ">"), defaults=(4, 2, 1)),
    "kakeya-d4": PeerFamily(
        "q", "integer q >= 1", lambda q: q >= 1, lambda q: f"KakeyaLattice D4 Q={q}",
        lambda q, d: kakeya_bits("d4", q, d) / 8,
        "kakeyalattice's own count: (D/4) * ceil(4 log2(2Q+1) - 1) lattice bits + fp16 norm + fp16 qmax",
        _build_kakeya, package=("kakeyalattice", "kakeyalattice"), style=("C9", "h"), defaults=(4, 2, 1)),
}
