"""The KV quantizers users would pick instead of FibQuant, run from their own packages.

Each peer is one *vector quantizer side* (keys or values): a round trip
`roundtrip(x [B, H, n, D], start) -> [B, H, n, D]` taken from the peer's own code (`start` is
the absolute position of x's first token, for peers that undo RoPE) and the bytes its stored
format spends per D-dimensional vector, every stored bit counted at a fixed rate (indices at
their fixed-rate size, norms, scales). None of these packages exposes byte codes we could
store, so the caches here hold their round trips (`fibquant.kv.roundtrip.RoundTripCache`,
with the same exact window as `CompressedCache`) and the bytes are derived from each
package's own documented format (`bytes_note`).

Spec strings (registered in `PEERS`; `b` bits, `q` lattice range):

    quanto:b=2|4          transformers QuantizedCache's quanto layer (optimum-quanto): per-token groups of 64
    hqq:b=1|2|3|4|8       transformers QuantizedCache's HQQ layer (hqq): groups of 64 along axis 0
    kakeya-e8:q=Q         kakeyalattice 1.5 V15KakeyaZamirE8GPU (E8 nested lattice), range Q
    kakeya-d4:q=Q         kakeyalattice 1.4 V14KakeyaZamirLatticeGPU (D4 nested lattice), range Q
    nexus:b=2|3|4         nexusquant-kv E8QuantizedCache: inverse RoPE (keys), Hadamard, E8 VQ with 2^b levels

Absent packages: `unavailable_reason(spec)` says why (install `pip install 'fibquant[peers]'`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

PEER_PACKAGES = {  # family -> (importable module, PyPI name)
    "quanto": ("optimum.quanto", "optimum-quanto"),
    "hqq": ("hqq.core.quantize", "hqq"),
    "kakeya-e8": ("kakeyalattice", "kakeyalattice"),
    "kakeya-d4": ("kakeyalattice", "kakeyalattice"),
    "nexus": ("nexusquant", "nexusquant-kv"),
}
GROUP_SIZE = 64  # QuantizedCache's default q_group_size


@dataclass(frozen=True)
class PeerSpec:
    """A parsed peer spec: family and its one parameter (bits b or lattice range q)."""

    family: str
    value: int

    def __post_init__(self) -> None:
        if self.family not in PEERS:
            raise ValueError(f"unknown peer {self.family!r}; expected one of {tuple(PEERS)}")
        allowed = PEERS[self.family].allowed
        if isinstance(self.value, bool) or not isinstance(self.value, int) or not allowed(self.value):
            raise ValueError(f"{self.family}: {PEERS[self.family].param}={self.value!r} is not supported "
                             f"({PEERS[self.family].param_help})")

    @property
    def spec(self) -> str:
        return f"{self.family}:{PEERS[self.family].param}={self.value}"

    @property
    def label(self) -> str:
        return PEERS[self.family].label(self.value)


@dataclass(frozen=True)
class PeerFamily:
    """How to build one registered peer: parameter name and check, label, byte count, builder."""

    param: str
    param_help: str
    allowed: Callable[[int], bool]
    label: Callable[[int], str]
    bytes_per_vector: Callable[[int, int], float]          # (value, dim) -> bytes
    bytes_note: str
    build: Callable[..., "PeerQuantizer"] = field(repr=False)


class PeerQuantizer:
    """One side (keys or values) of a peer: `roundtrip(x, start)` and `bytes_per_vector`."""

    def __init__(self, spec: PeerSpec, dim: int, role: str, fn: Callable[[torch.Tensor, int], torch.Tensor]):
        self.spec, self.dim, self.role, self._fn = spec, dim, role, fn
        self.bytes_per_vector = float(PEERS[spec.family].bytes_per_vector(spec.value, dim))

    def roundtrip(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """x [B, H, n, D] (absolute positions start..start+n-1) -> its reconstruction, x's dtype."""
        if x.ndim != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"{self.spec.spec}: expected [batch, heads, tokens, {self.dim}], got {tuple(x.shape)}")
        if x.shape[-2] == 0:
            return x
        return self._fn(x, start).to(x.dtype)

    def __repr__(self) -> str:
        return f"PeerQuantizer({self.spec.spec}, dim={self.dim}, role={self.role}, {self.bytes_per_vector:g} B/vector)"


# ----------------------------------------------------------------------------- byte counts

def _group_int_bytes(bits: int, dim: int) -> float:
    """b-bit levels + one fp16 scale and one fp16 zero/shift per group of 64 elements."""
    return dim * bits / 8 + (dim / GROUP_SIZE) * 4


def kakeya_bits(lattice: str, q_range: int, dim: int) -> int:
    """kakeyalattice's own count (LatticeCodebook): (D / block) * ceil(bits per block) + 32 (fp16 norm and qmax)."""
    block = 8 if lattice == "e8" else 4
    per_block = 8 * math.log2(2 * q_range + 1) if lattice == "e8" else 4 * math.log2(2 * q_range + 1) - 1
    return (dim // block) * math.ceil(per_block) + 32


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


# ----------------------------------------------------------------------------- builders

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


def _power_of_two_bits(values):
    return lambda b: b in values


PEERS: dict[str, PeerFamily] = {
    "quanto": PeerFamily(
        "b", "b in (2, 4)", _power_of_two_bits((2, 4)), lambda b: f"quanto INT{b} (QuantizedCache)",
        _group_int_bytes,
        "b bits per element + fp16 scale and fp16 shift per group of 64 (quanto stores them in the model dtype; "
        "counted as fp16, i.e. what an fp16 model holds)", _build_quanto),
    "hqq": PeerFamily(
        "b", "b in (1, 2, 3, 4, 8)", _power_of_two_bits((1, 2, 3, 4, 8)), lambda b: f"HQQ INT{b} (QuantizedCache)",
        _group_int_bytes,
        "b bits per element + fp16 scale and fp16 zero per group of 64 (axis 0, transformers' default)", _build_hqq),
    "kakeya-e8": PeerFamily(
        "q", "integer q >= 1", lambda q: q >= 1, lambda q: f"KakeyaLattice E8 Q={q}",
        lambda q, d: kakeya_bits("e8", q, d) / 8,
        "kakeyalattice's own count: (D/8) * ceil(8 log2(2Q+1)) lattice bits + fp16 norm + fp16 qmax", _build_kakeya),
    "kakeya-d4": PeerFamily(
        "q", "integer q >= 1", lambda q: q >= 1, lambda q: f"KakeyaLattice D4 Q={q}",
        lambda q, d: kakeya_bits("d4", q, d) / 8,
        "kakeyalattice's own count: (D/4) * ceil(4 log2(2Q+1) - 1) lattice bits + fp16 norm + fp16 qmax",
        _build_kakeya),
    "nexus": PeerFamily(
        "b", "b in (2, 3, 4)", _power_of_two_bits((2, 3, 4)), lambda b: f"NexusQuant E8 {b}-bit",
        nexus_bytes,
        "fixed-rate: ceil((D/8) log2 P) bits, P = even-sum integer points + all half-integer points of "
        "[-2^(b-1), 2^(b-1)]^8 (its relaxed E8), + fp16 scale per vector; its own format stores int8 "
        "coordinates zstd-compressed (variable rate, not used here)", _build_nexus),
}


def parse_peer(text: str) -> PeerSpec:
    """'kakeya-e8:q=2' -> PeerSpec('kakeya-e8', 2). ValueError for an unknown family or parameter."""
    family, _, params = text.strip().partition(":")
    family = family.strip().lower()
    if family not in PEERS:
        raise ValueError(f"unknown peer {family!r}; expected one of {tuple(PEERS)}")
    name, eq, raw = params.partition("=")
    if not eq or name.strip() != PEERS[family].param:
        raise ValueError(f"peer {text!r} needs {PEERS[family].param}=<int> ({PEERS[family].param_help})")
    try:
        value = int(raw)
    except ValueError as exc:
        raise ValueError(f"bad integer {raw!r} in peer {text!r}") from exc
    return PeerSpec(family, value)


def is_peer(text: str) -> bool:
    return text.strip().partition(":")[0].strip().lower() in PEERS


def unavailable_reason(spec: PeerSpec | str) -> Optional[str]:
    """None when the peer's package imports here, else one line saying what to install."""
    spec = parse_peer(spec) if isinstance(spec, str) else spec
    module, package = PEER_PACKAGES[spec.family]
    try:
        __import__(module)
    except Exception as exc:  # a missing or broken package both mean: skip
        return (f"{package} is not importable ({type(exc).__name__}: {exc}); "
                f"install the peers extra: pip install 'fibquant[peers]'")
    return None


def build_peer(spec: PeerSpec | str, dim: int, role: str = "key", model=None) -> PeerQuantizer:
    """The peer's quantizer for one role ("key" or "value") at head dimension `dim`."""
    spec = parse_peer(spec) if isinstance(spec, str) else spec
    if role not in ("key", "value"):
        raise ValueError(f"role must be 'key' or 'value', got {role!r}")
    reason = unavailable_reason(spec)
    if reason is not None:
        raise ValueError(f"{spec.spec}: {reason}")
    return PEERS[spec.family].build(spec, dim, role, model)


def package_versions() -> dict:
    from importlib import metadata

    out = {}
    for _, package in PEER_PACKAGES.values():
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out
