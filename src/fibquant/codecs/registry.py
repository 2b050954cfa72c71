"""The codec registry: one spec string -> one codec (per layer/head when calibrated).

Spec strings (also accepted on the command line):
    fp                      no compression (the reference)
    fibquant:b=2            FibQuant at 2 bits/coordinate, (k, N) chosen by FibQuantCodec.for_rate
    fibquant:k=64,n=4096    FibQuant with an explicit block size and codebook size
    fibquant:b=2,nc=1       FibQuant with norm correction (stores ||x|| / ||u_hat||, same bytes); without
                            nc= the per-rate default: on at 4 bits (fibquant:b=4 = fibquant:b=4,nc=1), off below
    fibrvq:b=2              FibQuant-RVQ: universal residual codes in k = 8, b stages of 256 (beam search)
    fibrvq:b=2,k=16         FibQuant-RVQ in 16-dimensional blocks, b * 2 stages of 256 (same bytes)
    e8shell:b=2,nc=1        FibQuant-E8: one E8 shell-code index per 8-block (b in 1, 1.5, 1.75, 2..4, d = 64 or 128; exact search)
    turboquant:b=3          TurboQuant (scalar Lloyd-Max after a rotation), integer bits 1..4
    fibquant:b=2,r=3        any rotation-based codec (fibquant, fibrvq, e8shell, turboquant) with the Haar rotation
                            of seed 3 (the same codebook; for means over draws, `eval peers --rotation-seeds`)
    int:b=4                 per-token asymmetric INT quantization
    lowrank:r=8             calibrated PCA projection (fitted per layer and KV head)
    rvq:s=2,n=256           learned residual VQ, s stages of n codewords (fitted per layer and KV head)

Everything family-specific lives on the codec class (`fibquant.codecs.base.Codec`: `family`,
`calibrated`, `reference`, `spec_params`, `style`, `check_spec`, `spec_label`, `from_spec` or
`fit_spec`, `spec_unavailable`). Adding a codec is one new file under `fibquant/codecs/` and one
line in `REGISTRY` below; every experiment, table and plot then accepts its spec strings.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from fibquant.codecs.base import Codec, PlotStyle, read_codec_file

REGISTRY = (
    "fibquant.codecs.identity.IdentityCodec",
    "fibquant.codecs.fibquant.FibQuantCodec",
    "fibquant.codecs.fibrvq.FibRVQCodec",
    "fibquant.codecs.e8shell.E8ShellCodec",
    "fibquant.codecs.turboquant.TurboQuantCodec",
    "fibquant.codecs.integer.IntCodec",
    "fibquant.codecs.lowrank.LowRankCodec",
    "fibquant.codecs.rvq.RVQCodec",
)


@lru_cache(maxsize=None)
def codec_classes() -> dict[str, type[Codec]]:
    """family -> codec class, in registry order (ValueError on a duplicate family)."""
    classes: dict[str, type[Codec]] = {}
    for path in REGISTRY:
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        if not cls.family or cls.family in classes:
            raise ValueError(f"{path}: codec family {cls.family!r} is empty or registered twice")
        classes[cls.family] = cls
    return classes


def codec_class(family: str) -> type[Codec]:
    classes = codec_classes()
    if family not in classes:
        raise ValueError(f"unknown method family {family!r}; expected one of {tuple(classes)}")
    return classes[family]


def plot_style(family: str) -> PlotStyle | None:
    """The registered plot style of `family`, None for an unregistered one (e.g. a peer)."""
    cls = codec_classes().get(family)
    return None if cls is None else cls.style


def is_reference(family: str) -> bool:
    """True for the uncompressed reference family ("fp")."""
    cls = codec_classes().get(family)
    return cls is not None and cls.reference


def reference_codec_spec() -> "CodecSpec":
    """The CodecSpec of the registered uncompressed reference (spec "fp")."""
    return CodecSpec(next(family for family, cls in codec_classes().items() if cls.reference))


@dataclass(frozen=True, init=False)
class CodecSpec:
    """One registered codec family and its spec parameters, e.g. CodecSpec("fibquant", bits=2).

    params: ((keyword, value), ...) in the order the family's `spec_params` declare them.
    Validated on construction (ValueError for an unknown family, parameter or missing value).
    """

    family: str
    params: tuple[tuple[str, int | float], ...]

    def __init__(self, family: str, **params: int | float | None) -> None:
        cls = codec_class(family)
        declared = {p.name: p for p in cls.spec_params}
        given = {name: value for name, value in params.items() if value is not None}
        unknown = sorted(set(given) - set(declared))
        if unknown:
            raise ValueError(f"{family} takes no parameter {unknown}; its parameters are "
                             f"{[p.key + '=' for p in cls.spec_params]}")
        values = {name: declared[name].convert(value, family) for name, value in given.items()}
        cls.check_spec(values)
        object.__setattr__(self, "family", family)
        object.__setattr__(self, "params", tuple((p.name, values[p.name]) for p in cls.spec_params
                                                 if p.name in values))

    @property
    def codec_class(self) -> type[Codec]:
        return codec_class(self.family)

    @property
    def kwargs(self) -> dict[str, int | float]:
        return dict(self.params)

    def param(self, name: str) -> int | float | None:
        """The value of keyword `name` (e.g. "bits", "k", "rank"), None when not given."""
        return self.kwargs.get(name)

    @property
    def calibrated(self) -> bool:
        return self.codec_class.calibrated

    @property
    def reference(self) -> bool:
        return self.codec_class.reference

    @property
    def style(self) -> PlotStyle | None:
        return self.codec_class.style

    @property
    def spec(self) -> str:
        keys = {p.name: p.key for p in self.codec_class.spec_params}
        text = ",".join(f"{keys[name]}={value:g}" for name, value in self.params)
        return f"{self.family}:{text}" if text else self.family

    def label(self, dim: int = 64) -> str:
        return self.codec_class.spec_label(dim, **self.kwargs)

    def build(self, dim: int) -> Codec:
        """The codec for head dimension `dim` (ValueError for calibrated methods: use `fit`)."""
        if self.calibrated:
            raise ValueError(f"{self.spec} has no stand-alone codec (calibrated: fit it per layer and head)")
        return self.codec_class.from_spec(dim, **self.kwargs)

    def fit(self, samples: torch.Tensor) -> Codec:
        """The codec fitted on calibration vectors `samples` [n, dim] (calibrated methods only)."""
        return self.codec_class.fit_spec(samples, **self.kwargs)

    def unavailable_reason(self, dim: int) -> str | None:
        """Why this method cannot run without building assets (a codebook not shipped), or None."""
        return self.codec_class.spec_unavailable(dim, **self.kwargs)


def parse_codec_spec(text: str) -> CodecSpec:
    """Parse a spec string such as 'fibquant:k=64,n=4096' (see the module docstring)."""
    family, _, params = text.strip().partition(":")
    cls = codec_class(family.strip().lower())
    by_key = {p.key: p for p in cls.spec_params}
    values: dict[str, float] = {}
    for item in filter(None, params.split(",")):
        key, eq, raw = item.partition("=")
        if not eq or key.strip() not in by_key:
            expected = ", ".join(f"{k}=" for k in by_key) or "no parameters"
            raise ValueError(f"bad method parameter {item!r} in {text!r}; expected {expected}")
        try:
            values[by_key[key.strip()].name] = float(raw)
        except ValueError as exc:
            raise ValueError(f"bad number {raw!r} in method {text!r}") from exc
    return CodecSpec(cls.family, **values)


def parse_codec_specs(texts: list[str] | str) -> list[CodecSpec]:
    if isinstance(texts, str):
        texts = [t for t in texts.split(";") if t.strip()]
    return [parse_codec_spec(t) for t in texts]


def load_codec(path: str | Path) -> Codec:
    """A codec written by `Codec.save` (e.g. a fitted low-rank or RVQ codec), any registered family."""
    family, _, _ = read_codec_file(path)
    return codec_class(family).load(path)


def split_ready(methods: list[CodecSpec], dim: int, build_codebooks: bool) -> tuple[list[CodecSpec], list[str]]:
    """Methods whose assets are shipped or cached (all when `build_codebooks`), and notes on the rest.

    Building a large FibQuant codebook (e.g. k=64, N=4096) takes long on a small CPU; the
    experiments use what is shipped/cached unless asked to build.
    """
    ready, skipped = [], []
    for method in methods:
        reason = None if build_codebooks else method.unavailable_reason(dim)
        if reason is not None:
            skipped.append(f"{method.spec} ({reason})")
            continue
        ready.append(method)
    return ready, skipped
