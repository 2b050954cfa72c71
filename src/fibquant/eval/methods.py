"""Named compression methods for the KV experiments: one spec -> one codec (per layer/head if calibrated).

Spec strings (also accepted on the command line):
    fp                      no compression (the reference)
    fibquant:b=2            FibQuant at 2 bits/coordinate, (k, N) chosen by FibQuantCodec.for_rate
    fibquant:k=64,n=4096    FibQuant with an explicit block size and codebook size
    turboquant:b=3          TurboQuant (scalar Lloyd-Max after a rotation), integer bits 1..4
    int:b=4                 per-token asymmetric INT quantization
    lowrank:r=8             calibrated PCA projection (fitted per layer and KV head)
    rvq:s=2,n=256           learned residual VQ, s stages of n codewords (fitted per layer and KV head)
"""
from __future__ import annotations

from dataclasses import dataclass

from fibquant.codecs.base import Codec

FAMILIES = ("fp", "fibquant", "turboquant", "int", "lowrank", "rvq")


@dataclass(frozen=True)
class Method:
    family: str
    bits: float | None = None
    k: int | None = None
    n: int | None = None
    rank: int | None = None
    stages: int | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown method family {self.family!r}; expected one of {FAMILIES}")
        if self.family == "fibquant" and self.bits is None and (self.k is None or self.n is None):
            raise ValueError("fibquant needs b=<bits> or both k=<block> and n=<codewords>")
        if self.family in ("turboquant", "int") and self.bits is None:
            raise ValueError(f"{self.family} needs b=<bits>")
        if self.family == "lowrank" and self.rank is None:
            raise ValueError("lowrank needs r=<rank>")
        if self.family == "rvq" and (self.stages is None or self.n is None):
            raise ValueError("rvq needs s=<stages> and n=<codewords>")

    @property
    def calibrated(self) -> bool:
        return self.family in ("lowrank", "rvq")

    @property
    def spec(self) -> str:
        if self.family == "fp":
            return "fp"
        if self.family == "lowrank":
            return f"lowrank:r={self.rank}"
        if self.family == "rvq":
            return f"rvq:s={self.stages},n={self.n}"
        if self.family == "fibquant" and self.k is not None:
            return f"fibquant:k={self.k},n={self.n}"
        return f"{self.family}:b={self.bits:g}"

    def label(self, dim: int = 64) -> str:
        if self.family == "fp":
            return "fp (uncompressed)"
        if self.family == "lowrank":
            return f"low-rank r={self.rank}"
        if self.family == "rvq":
            return f"RVQ {self.stages}x{self.n} per head"
        if self.family == "int":
            return f"INT{self.bits:g}"
        if self.family == "turboquant":
            return f"TurboQuant b={self.bits:g}"
        from fibquant.codecs.fibquant import choose_block

        k, n = (self.k, self.n) if self.k is not None else choose_block(dim, self.bits)
        return f"FibQuant b={(n - 1).bit_length() / k:.4g} (k={k},N={n})"

    def build(self, dim: int) -> Codec:
        """The codec for head dimension `dim` (not for fp or calibrated methods)."""
        if self.family == "fibquant":
            from fibquant.codecs.fibquant import FibQuantCodec

            if self.k is not None:
                return FibQuantCodec(dim, self.k, self.n)
            return FibQuantCodec.for_rate(dim, self.bits)
        if self.family == "turboquant":
            from fibquant.codecs.turboquant import TurboQuantCodec

            return TurboQuantCodec(dim, int(self.bits))
        if self.family == "int":
            from fibquant.codecs.integer import IntCodec

            return IntCodec(dim, int(self.bits))
        raise ValueError(f"{self.spec} has no stand-alone codec (fp is uncompressed, lowrank/rvq need calibration)")


def parse_method(text: str) -> Method:
    """Parse a spec string such as 'fibquant:k=64,n=4096' (see the module docstring)."""
    family, _, params = text.strip().partition(":")
    values: dict[str, float | int] = {}
    for item in filter(None, params.split(",")):
        key, eq, raw = item.partition("=")
        names = {"b": "bits", "k": "k", "n": "n", "r": "rank", "s": "stages"}
        if not eq or key.strip() not in names:
            raise ValueError(f"bad method parameter {item!r} in {text!r}; expected b=, k=, n=, r= or s=")
        try:
            number = float(raw)
        except ValueError as exc:
            raise ValueError(f"bad number {raw!r} in method {text!r}") from exc
        values[names[key.strip()]] = number if key.strip() == "b" else int(number)
    return Method(family.strip().lower(), **values)


def parse_methods(texts: list[str] | str) -> list[Method]:
    if isinstance(texts, str):
        texts = [t for t in texts.split(";") if t.strip()]
    return [parse_method(t) for t in texts]


def fibquant_block(method: Method, dim: int) -> tuple[int, int]:
    """(k, N) of a FibQuant method."""
    from fibquant.codecs.fibquant import choose_block

    return (method.k, method.n) if method.k is not None else choose_block(dim, method.bits)


def split_ready(methods: list[Method], dim: int, build_codebooks: bool) -> tuple[list[Method], list[str]]:
    """Methods whose codebooks are shipped or cached (all when `build_codebooks`), and notes on the rest.

    Building a large FibQuant codebook (e.g. k=64, N=4096) takes long on a small CPU; the
    experiments use what is shipped/cached unless asked to build.
    """
    from fibquant.codebook import load_codebook

    ready, skipped = [], []
    for method in methods:
        if method.family == "fibquant" and not build_codebooks:
            k, n = fibquant_block(method, dim)
            try:
                load_codebook(dim, k, n, build=False)
            except FileNotFoundError:
                skipped.append(f"{method.spec} (codebook d={dim} k={k} N={n} neither shipped nor cached; "
                               f"pass --build-codebooks to build it)")
                continue
        ready.append(method)
    return ready, skipped


def prepare_run(specs: list[str], build_codebooks: bool, model_and_tokenizer=None):
    """Load the model (unless given) and split `specs` into ready methods and skip notes.

    Returns (model, tokenizer, ready methods, skip notes).
    """
    from fibquant.kv.cache import check_model_supported
    from fibquant.kv.model import load_model

    model, tokenizer = model_and_tokenizer or load_model()
    dim = check_model_supported(model)["head_dim"]
    ready, skipped = split_ready(parse_methods(list(specs)), dim, build_codebooks)
    return model, tokenizer, ready, skipped
