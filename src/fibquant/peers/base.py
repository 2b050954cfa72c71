"""The peer registry: spec grammar, one `PeerFamily` per registered family, builders and checks.

Each peer is one *vector quantizer side* (keys or values): a round trip
`roundtrip(x [B, H, n, D], start) -> [B, H, n, D]` taken from the peer's own code (`start` is
the absolute position of x's first token, for peers that undo RoPE) and the bytes its stored
format spends per D-dimensional vector, every stored bit counted at a fixed rate (indices at
their fixed-rate size, norms, scales). None of these packages exposes byte codes we could
store, so the caches hold their round trips (`fibquant.kv.roundtrip_cache.RoundTripCache`, with
the same exact window as `CompressedCache`) and the bytes are derived from each package's own
documented format (`bytes_note`).

Adding a peer: one module under `fibquant/peers/` defining `FAMILIES = {name: PeerFamily(...)}`
and one line in `REGISTRY` below. Its spec strings, default rows, plot style, install hint and
(where it has one) transformers-native cache then reach every experiment.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import lru_cache
from collections.abc import Mapping
from typing import Callable, Optional

import torch

REGISTRY = (
    "fibquant.peers.quantized_cache",
    "fibquant.peers.kakeya",
    "fibquant.peers.nexus",
)


@dataclass(frozen=True)
class PeerFamily:
    """How to build one registered peer: parameter name and check, label, byte count, builder,
    the package it runs from, its plot style and its default values in experiments.

    `native`, where set, names the family's own transformers cache in the cache-spec grammar:
    `<native>:<param>=<value>` is transformers' `QuantizedCache(backend=<native>, nbits=value)`,
    what the speed experiment times (the family itself is the float round trip)."""

    param: str
    param_help: str
    allowed: Callable[[int], bool]
    label: Callable[[int], str]
    bytes_per_vector: Callable[[int, int], float]          # (value, dim) -> bytes
    bytes_note: str
    build: Callable[..., "PeerQuantizer"] = field(repr=False)
    package: tuple[str, str] = ("", "")                   # (importable module, PyPI name)
    style: tuple[str, str] = ("C7", "o")                  # (matplotlib colour, marker)
    defaults: tuple[int, ...] = ()                        # default values in experiments, highest rate first
    native: Optional[str] = None


@lru_cache(maxsize=None)
def peer_families() -> dict[str, PeerFamily]:
    """family -> PeerFamily, in registry order (ValueError on a duplicate family)."""
    out: dict[str, PeerFamily] = {}
    for module in REGISTRY:
        for name, family in importlib.import_module(module).FAMILIES.items():
            if name in out:
                raise ValueError(f"peer family {name!r} registered twice ({module})")
            out[name] = family
    return out


class _Registry(Mapping):
    """`PEERS`: the registry as a read-only mapping, its modules imported on first use."""

    def __getitem__(self, family: str) -> PeerFamily:
        return peer_families()[family]

    def __iter__(self):
        return iter(peer_families())

    def __len__(self) -> int:
        return len(peer_families())


PEERS: Mapping[str, PeerFamily] = _Registry()


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


def one_of(values):
    """`allowed` for a parameter taking one of `values`."""
    values = tuple(values)
    return lambda v: v in values


def native_families() -> dict[str, str]:
    """native cache name (e.g. "quanto") -> the round-trip family that has it (e.g. "quanto-rt")."""
    return {family.native: name for name, family in PEERS.items() if family.native}


def _family_name(text: str) -> str:
    """The family of a peer spec; ValueError for a native name (quanto, hqq) where a round trip is meant."""
    family = text.strip().partition(":")[0].strip().lower()
    if family in native_families():
        raise ValueError(f"{family!r} names transformers' QuantizedCache (measured by `eval decode-speed`); its "
                         f"float round trip under fibquant's exact window is spelled {native_families()[family]!r}")
    return family


def parse_peer(text: str) -> PeerSpec:
    """'kakeya-e8:q=2' -> PeerSpec('kakeya-e8', 2). ValueError for an unknown family or parameter."""
    family = _family_name(text)
    params = text.strip().partition(":")[2]
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
    family = text.strip().partition(":")[0].strip().lower()
    return family in PEERS or family in native_families()


def peer_specs(lowest: Optional[int] = None) -> tuple[str, ...]:
    """The experiments' default peer rows: each family's `defaults` (highest rate first), or only
    its `lowest` lowest-rate ones."""
    return tuple(PeerSpec(name, value).spec for name, family in PEERS.items()
                 for value in (family.defaults[-lowest:] if lowest else family.defaults))


def unavailable_reason(spec: PeerSpec | str) -> Optional[str]:
    """None when the peer's package imports here, else one line saying what to install."""
    return family_unavailable_reason((parse_peer(spec) if isinstance(spec, str) else spec).family)


def family_unavailable_reason(family: str) -> Optional[str]:
    """`unavailable_reason` of the registered family `family` (any of its values)."""
    module, package = PEERS[family].package
    try:
        importlib.import_module(module)
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
    """PyPI name -> installed version (None when absent), for every registered peer's package."""
    from importlib import metadata

    out = {}
    for family in PEERS.values():
        package = family.package[1]
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out
