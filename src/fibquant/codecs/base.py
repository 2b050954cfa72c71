"""The one vocabulary every codec speaks.

A codec maps float vectors x of shape [..., dim] to fixed-size byte codes of shape
[..., code_size] (torch.uint8) and back. Because every vector's code has the same size,
vector i of a flat batch sits at byte offset i * code_size: random access is address
arithmetic, and decoding one row gives exactly the vector the batch decode gives.

Rates (one meaning each, for every codec):

    bits_per_coordinate         the per-vector index stream, in bits per coordinate: the fixed-width
                                fields that select codewords, levels or coefficients, counted at their
                                stored width (ceil(log2 N) bits for an N-entry codebook, 16 for an fp16
                                coefficient). Per-vector side information (an fp16 norm, INT scales)
                                and byte padding are not counted. FibQuant k=4, N=256: 2; TurboQuant
                                b=3: 3; INT4: 4; low-rank r=8 of d=64: 16*8/64 = 2; RVQ 2x256 at d=64:
                                2*8/64 = 0.25; the fp16 identity: 16.
    stored_bits_per_coordinate  8 * code_size / dim: every stored bit, side information and padding
                                included (what the compression ratio counts).

State (one place, for every codec):

    config              a frozen, validated dataclass with at least `dim`: the parameters
    state_tensors()     tensors that define the codec beyond its config (calibration state such
                        as a fitted basis), by name; `save`/`load` write and read them (safetensors)
    device_state        tensors derived per device (codebook copies, rotations, search tables),
                        built on first use on that device
    shared_tensors()    every tensor the codec holds that all vectors share, as held now (the
                        memory accounting of a cache counts these once per storage)

Codebooks load lazily: constructing a codec reads no file and builds no table.

Registry metadata (class attributes, read by `fibquant.codecs.registry`):

    family          the spec prefix ("fibquant" in "fibquant:b=2") and the family column of results
    calibrated      True when the codec is fitted on calibration vectors (`fit_spec`), not built
    reference       True for the uncompressed reference (experiments run it on the exact states)
    fibquant_code   True for FibQuant's own codes (a universal codebook matched to the spherical-Beta
                    density, one stage or residual): the peers budget check counts these as FibQuant
    spec_params     the spec-string parameters, in the order a spec string writes them
    style           legend name, colour and marker in every plot
"""
from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional, Sequence, TypeVar

import numpy as np
import torch

from .reader import CodeReader, DecodedReader

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FP16_MAX = float(torch.finfo(torch.float16).max)
FORMAT_NAME = "fibquant-codec"
CHUNK_ROWS = 1 << 14  # rows encoded / decoded per step of a large batch (bounded working memory)
T = TypeVar("T")


def _all_finite(x: torch.Tensor) -> bool:
    """Whether every element of the floating tensor x is finite (numpy's check for CPU float32 /
    float64 tensors outside autograd: ~7x cheaper per call than torch's isfinite + all on a
    decode step's few rows; the same answer)."""
    if x.is_cpu and not x.requires_grad and x.dtype in (torch.float32, torch.float64):
        return bool(np.isfinite(x.numpy()).all())
    return bool(torch.isfinite(x).all())


@dataclass(frozen=True)
class PlotStyle:
    """How a codec family appears in every plot: legend name, matplotlib colour and marker.

    frontier: when set, plots with many points per family at one rate (e.g. every FibQuant (k, N))
    draw the family's Pareto front and the points off it as dots, with this note in the legend (only when some
    point is off the front: otherwise there are no dots to name).
    """

    name: str
    color: str
    marker: str
    frontier: str = ""


@dataclass(frozen=True)
class SpecParam:
    """One spec-string parameter: `key` as written ("b" in "int:b=4"), `name` as a keyword
    (CodecSpec(..., bits=4), from_spec(dim, bits=4)), `kind` int or float."""

    key: str
    name: str
    kind: type = int

    def convert(self, value: Any, where: str) -> int | float:
        """`value` as this parameter's kind; ValueError naming `where` when it is not one."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"bad number {value!r} for {self.key}= in {where}")
        if self.kind is int:
            if value != int(value):
                raise ValueError(f"{self.key}= must be an integer in {where}, got {value!r}")
            return int(value)
        return float(value)


class DeviceState:
    """State a codec derives per device (tensors, tuples of tensors or small helper objects such
    as a search table), built by `get` once per (name, device) and kept for the codec's life."""

    def __init__(self) -> None:
        self._items: dict[tuple[str, torch.device], Any] = {}

    def get(self, name: str, device: torch.device | str, build: Callable[[torch.device], T]) -> T:
        key = (name, torch.device(device))
        if key not in self._items:
            self._items[key] = build(key[1])
        return self._items[key]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held: items, members of tuple items, tensor attributes of helper objects."""
        out: list[torch.Tensor] = []
        for item in self._items.values():
            members = item if isinstance(item, (tuple, list)) else [item]
            for member in members:
                if isinstance(member, torch.Tensor):
                    out.append(member)
                elif hasattr(member, "__dict__"):
                    out.extend(v for v in vars(member).values() if isinstance(v, torch.Tensor))
        return out


class Codec(ABC):
    """Fixed-rate vector codec (see the module docstring for rates, state and registry metadata).

    Subclasses call `super().__init__(config)` and implement `code_size`, `bits_per_coordinate`,
    `_encode_flat` ([n, dim] float32 -> [n, code_size] uint8) and `_decode_flat`
    ([n, code_size] uint8 -> [n, dim] float32); registered families also set the class
    attributes below and `check_spec`, `spec_label` and `from_spec` (or `fit_spec`).
    """

    family: ClassVar[str] = ""
    calibrated: ClassVar[bool] = False
    reference: ClassVar[bool] = False
    fibquant_code: ClassVar[bool] = False
    spec_params: ClassVar[tuple[SpecParam, ...]] = ()
    style: ClassVar[Optional[PlotStyle]] = None
    # decode refuses codes that decode to NaN/Inf (corrupt norm or scale bytes); False for a codec
    # whose codes may hold infinities by design (the saturating fp16 codec of the K/V studies)
    finite_decode: ClassVar[bool] = True

    config: Any = None
    dim: int

    def __init__(self, config: Any) -> None:
        self.config = config
        self.dim = config.dim

    # ------------------------------------------------------------------ rates
    @property
    @abstractmethod
    def code_size(self) -> int:
        """Bytes per encoded vector, everything included (indices, norm, scales)."""

    @property
    @abstractmethod
    def bits_per_coordinate(self) -> float:
        """Bits per coordinate of the per-vector index stream (module docstring)."""

    @property
    def stored_bits_per_coordinate(self) -> float:
        """Every stored bit (indices + side information + padding) per coordinate: 8 * code_size / dim."""
        return 8.0 * self.code_size / self.dim

    @property
    def compression_ratio(self) -> float:
        """Size of the fp16 vector over the size of its code: 2*dim / code_size."""
        return 2.0 * self.dim / self.code_size

    # ------------------------------------------------------------------ state
    @property
    def device_state(self) -> DeviceState:
        """This codec's per-device state (created on first access, whatever the subclass __init__)."""
        state = self.__dict__.get("_device_state")
        if state is None:
            state = self.__dict__["_device_state"] = DeviceState()
        return state

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors that define the codec beyond its config (calibration state), by name; none by default."""
        return {}

    def shared_tensors(self) -> list[torch.Tensor]:
        """Every tensor held now that all vectors share: state tensors, per-device state, and the
        shared tensors of codecs this one is made of (e.g. one codec per head). Loads nothing."""
        tensors = list(self.state_tensors().values()) + self.device_state.tensors()
        for value in vars(self).values():
            parts = value if isinstance(value, (list, tuple)) else [value]
            for part in parts:
                if isinstance(part, Codec):
                    tensors.extend(part.shared_tensors())
        return tensors

    def reader(self, device: torch.device) -> CodeReader:
        """How attention on codes reads this codec's code rows on `device` (`fibquant.codecs.reader`). The
        default decodes them (`DecodedReader`); a family with a structure attention can read without
        decoding (a rotated codebook, stages, shells) returns its own reader."""
        return DecodedReader(self)

    # ------------------------------------------------------------------ save / load
    def save(self, path: str | Path) -> None:
        """Write the codec to a safetensors file: its state tensors, family and config."""
        from safetensors.torch import save_file

        if not self.family or not is_dataclass(self.config):
            raise ValueError(f"{type(self).__name__} has no registered family and config to save")
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in self.state_tensors().items()}
        metadata = {"format": FORMAT_NAME, "family": self.family, "config": json.dumps(asdict(self.config))}
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path) -> "Codec":
        """The codec `save` wrote to `path` (ValueError if it holds another family)."""
        family, config, tensors = read_codec_file(path)
        if family != cls.family:
            raise ValueError(f"{path} holds a {family!r} codec, not {cls.family!r} ({cls.__name__})")
        codec = cls.from_state(config, tensors)
        if not config_matches(codec.config, config):
            raise ValueError(f"{path}: the stored tensors give config {codec.config}, the file says {config}")
        return codec

    @classmethod
    def from_state(cls, config: dict, tensors: dict[str, torch.Tensor]) -> "Codec":
        """Rebuild from a saved config (a dict of the config's fields) and state tensors."""
        if tensors:
            raise ValueError(f"{cls.__name__} has no state tensors, the file holds {sorted(tensors)}")
        return cls(**config)

    # ------------------------------------------------------------------ spec strings
    @classmethod
    def check_spec(cls, params: dict[str, int | float]) -> None:
        """ValueError unless `params` (keyword names of `spec_params`) determine a codec."""

    @classmethod
    def spec_label(cls, dim: int, **params: int | float) -> str:
        """The label shown in results and legends for head dimension `dim`."""
        return cls.family + "".join(f" {name}={value:g}" for name, value in params.items())

    @classmethod
    def from_spec(cls, dim: int, **params: int | float) -> "Codec":
        """The codec of a spec for head dimension `dim` (calibration-free families)."""
        raise ValueError(f"{cls.family} is calibrated: fit it on calibration vectors (fit_spec)")

    @classmethod
    def fit_spec(cls, samples: torch.Tensor, **params: int | float) -> "Codec":
        """The codec of a spec fitted on calibration vectors `samples` [n, dim] (calibrated families)."""
        raise ValueError(f"{cls.family} is not calibrated: build it with from_spec")

    @classmethod
    def spec_unavailable(cls, dim: int, **params: int | float) -> Optional[str]:
        """Why the spec cannot run without building assets (e.g. a codebook neither shipped nor
        cached), or None."""
        return None

    # ------------------------------------------------------------------ coding
    @abstractmethod
    def _encode_flat(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _decode_flat(self, codes: torch.Tensor) -> torch.Tensor: ...

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """float [..., dim] (fp16/bf16/fp32/fp64, any device) -> uint8 [..., code_size]. Large
        batches are encoded `CHUNK_ROWS` rows at a time: the codec's working memory stays that
        of one chunk (peak about the input plus the codes)."""
        self.check_input(x)
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.dim)
        n = flat.shape[0]
        if n <= CHUNK_ROWS:
            if n == 0:
                return torch.empty(*lead, self.code_size, dtype=torch.uint8, device=x.device)
            return self._encode_flat(flat.to(torch.float32)).reshape(*lead, self.code_size)
        out = torch.empty(n, self.code_size, dtype=torch.uint8, device=x.device)
        for start in range(0, n, CHUNK_ROWS):
            out[start:start + CHUNK_ROWS] = self._encode_flat(flat[start:start + CHUNK_ROWS].to(torch.float32))
        return out.reshape(*lead, self.code_size)

    def encode_parts(self, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Several float tensors [..., dim] in one encode call: uint8 [..., code_size] per part, the codes
        `encode` gives for the parts' rows concatenated in order (flattened) and split back. One call's
        fixed cost instead of one per part (a cache layer encodes its keys and values together)."""
        parts = list(parts)
        for part in parts:
            self.check_input(part)
        if len(parts) <= 1:
            return [self.encode(part) for part in parts]
        flat = torch.cat([part.reshape(-1, self.dim).to(torch.float32) for part in parts])
        return _split_codes(self.encode(flat), parts, self.code_size)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 [..., code_size] -> `dtype` [..., dim] on the codes' device, `CHUNK_ROWS` rows at a
        time. ValueError for codes that decode to NaN/Inf (a stored norm or scale that is not a
        finite number: corrupt or foreign bytes)."""
        self.check_codes(codes)
        lead = codes.shape[:-1]
        flat = codes.reshape(-1, self.code_size)
        n = flat.shape[0]
        if n <= CHUNK_ROWS:
            if n == 0:
                return torch.empty(*lead, self.dim, dtype=dtype, device=codes.device)
            return self._checked_decode(flat).reshape(*lead, self.dim).to(dtype)
        out = torch.empty(n, self.dim, dtype=dtype, device=codes.device)
        for start in range(0, n, CHUNK_ROWS):
            out[start:start + CHUNK_ROWS] = self._checked_decode(flat[start:start + CHUNK_ROWS])
        return out.reshape(*lead, self.dim)

    def _checked_decode(self, flat: torch.Tensor) -> torch.Tensor:
        x = self._decode_flat(flat)
        if self.finite_decode and not _all_finite(x):
            raise ValueError(f"{type(self).__name__}.decode: codes decode to NaN/Inf (a stored norm or scale is "
                             "not a finite number: corrupt codes)")
        return x

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)) in x's dtype."""
        return self.decode(self.encode(x), dtype=x.dtype)

    def check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{type(self).__name__}.encode expects a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{type(self).__name__}.encode expects a floating tensor, got dtype {x.dtype}")
        if x.ndim == 0 or x.shape[-1] != self.dim:
            raise ValueError(
                f"{type(self).__name__}: last dimension must be dim={self.dim}, got shape {tuple(x.shape)}"
            )
        if not _all_finite(x):
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


def _split_codes(codes: torch.Tensor, parts: Sequence[torch.Tensor], code_size: int) -> list[torch.Tensor]:
    """codes [sum of the parts' rows, code_size] -> one view [..., code_size] per part (its leading shape)."""
    out, at = [], 0
    for part in parts:
        rows = part.numel() // part.shape[-1]
        out.append(codes[at:at + rows].reshape(*part.shape[:-1], code_size))
        at += rows
    return out


def config_matches(config: Any, saved: dict) -> bool:
    """Whether a codec's config dataclass equals a saved config dict, a field the saved dict lacks
    counting as its default (so a file saved before a defaulted field was added, e.g. FibQuant's
    norm_correction, still matches the codec it describes)."""
    defaults = {f.name: f.default for f in fields(config) if f.default is not MISSING}
    return asdict(config) == {**defaults, **saved}


def read_codec_file(path: str | Path) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """(family, config fields, state tensors on the CPU) of a file written by `Codec.save`."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path} is not a readable codec file: {exc}") from exc
    if metadata.get("format") != FORMAT_NAME or "family" not in metadata or "config" not in metadata:
        raise ValueError(f"{path} is not a codec file written by Codec.save (metadata {metadata})")
    return metadata["family"], json.loads(metadata["config"]), tensors
