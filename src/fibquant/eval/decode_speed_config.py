"""The caches a decode-speed run measures (parsed from names such as `fibquant4`, `hqq2`), its
configuration, and what it needs from the machine (the model, the peers' packages).

Ours are the registered codecs (`fibquant.codecs.registry.REGISTRY`) that are built from a bit
count alone (a `b=` spec parameter, neither calibrated nor the fp reference): `<family><bits>`,
e.g. `fibquant4`, `turboquant2`, `int4`. Torch-free at import (the CLI reads `DEFAULT_CACHES`
for its help text).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

PEER_BACKENDS = {"quanto": "optimum-quanto", "hqq": "hqq"}
OUR_CACHES = ("fibquant4", "fibquant3", "fibquant2", "turboquant4", "turboquant2")
PEER_CACHES = ("quanto4", "quanto2", "hqq4", "hqq2")
DEFAULT_CACHES = ("dynamic", *OUR_CACHES, *PEER_CACHES, *(f"{name}-old" for name in OUR_CACHES))
# What a run measures per cache and context (`--parts`):
#   ttft    - one-shot time to first token: a fresh cache, the whole prompt in one forward, argmax;
#   chunked - the same with the prompt fed in chunks of `chunk_tokens` (one forward per chunk);
#   decode  - the shared-prefill protocol: one float prefill, each cache built from it, greedy steps.
PARTS = ("ttft", "chunked", "decode")


@dataclass(frozen=True)
class CacheSpec:
    """One cache under test, parsed from a name such as `fibquant4`, `turboquant2-old`, `hqq4`."""

    name: str
    kind: str                        # "dynamic" | "compressed" | "quantized"
    family: str = "dynamic"          # a registered codec family (ours) | quanto | hqq | dynamic
    bits: Optional[int] = None
    attention: Optional[str] = None  # "codes" | "decode" for ours

    @property
    def label(self) -> str:
        if self.kind == "dynamic":
            return "DynamicCache"
        if self.kind == "compressed":
            return f"{self.method().style.name} {self.bits}b ({self.attention})"
        return f"QuantizedCache {self.family} {self.bits}b"

    def method(self):
        """The registered codec method of one of ours (`fibquant.codecs.registry.Method`)."""
        from fibquant.codecs.registry import Method

        if self.kind != "compressed":
            raise ValueError(f"{self.name} is not one of our compressed caches")
        return Method(self.family, bits=self.bits)


def our_families() -> tuple[str, ...]:
    """Registered codec families built from a bit count alone (`b=`; not calibrated, not the reference)."""
    from fibquant.codecs.registry import codec_classes

    return tuple(family for family, cls in codec_classes().items()
                 if not cls.calibrated and not cls.reference and any(p.name == "bits" for p in cls.spec_params))


def parse_cache_name(name: str) -> CacheSpec:
    """`dynamic`, ours as `<family><bits>` (`fibquant4`, `turboquant2`, `int4`; + `-old`: the decode path),
    `quanto{2,4}`, `hqq{1,2,3,4,8}`; ValueError otherwise."""
    text = name.strip().lower()
    if text == "dynamic":
        return CacheSpec("dynamic", "dynamic")
    old = text.endswith("-old")
    stem = text[: -len("-old")] if old else text
    family = stem.rstrip("0123456789")
    digits = stem[len(family):]
    if not digits:
        raise ValueError(f"cache name {name!r} has no bit count (e.g. fibquant4, quanto2)")
    bits = int(digits)
    ours = our_families()
    if family in ours:
        if not 1 <= bits <= 8:
            raise ValueError(f"cache name {name!r}: bits must be in 1..8")
        spec = CacheSpec(text, "compressed", family, bits, "decode" if old else "codes")
        try:
            spec.method()
        except ValueError as exc:
            raise ValueError(f"cache name {name!r}: {exc}") from None
        return spec
    if family in PEER_BACKENDS and not old:
        allowed = (2, 4) if family == "quanto" else (1, 2, 3, 4, 8)
        if bits not in allowed:
            raise ValueError(f"cache name {name!r}: the {family} backend takes nbits in {allowed}")
        return CacheSpec(text, "quantized", family, bits)
    raise ValueError(f"unknown cache name {name!r}: expected dynamic, {', '.join(f + 'B' for f in ours)} "
                     f"(optionally -old), quantoB or hqqB, e.g. {' '.join(DEFAULT_CACHES[:4])}")


# ----------------------------------------------------------------------------- config

@dataclass(frozen=True)
class DecodeSpeedConfig:
    contexts: tuple[int, ...] = (1024, 2048, 4096, 8192)
    decode_tokens: int = 32
    caches: tuple[str, ...] = DEFAULT_CACHES
    text: str = "emma"
    sink_tokens: int = 4
    recent_tokens: int = 32
    # QuantizedCache settings (transformers' defaults): group size and float residual length.
    q_group_size: int = 64
    residual_length: int = 128
    warmup: bool = True                 # one short untimed run of every cache first (JIT, codebook loads)
    device: str = "cpu"                 # "cuda": model and caches on the GPU (timed with synchronize)
    random_weights: bool = False        # the default model's architecture with random weights, random ids
    memory_interval_s: float = 0.002    # RSS sampling period of the memory monitor
    parts: tuple[str, ...] = PARTS      # which measurements run (see PARTS)
    chunk_tokens: int = 512             # prompt chunk of the chunked TTFT
    prefill_repeats: int = 1            # timed fresh prefills per cache, context and part (median reported)
    threads: Optional[int] = 1          # torch (and numba) threads during the run; None: leave as set

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(dict.fromkeys(str(p).strip().lower() for p in self.parts)))
        unknown = [p for p in self.parts if p not in PARTS]
        if unknown or not self.parts:
            raise ValueError(f"parts must be a non-empty subset of {PARTS}, got {self.parts}")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.prefill_repeats < 1:
            raise ValueError(f"prefill_repeats must be >= 1, got {self.prefill_repeats}")
        if self.threads is not None and (isinstance(self.threads, bool) or int(self.threads) < 1):
            raise ValueError(f"threads must be >= 1 or None, got {self.threads}")
        if not self.contexts or any(int(c) < 2 for c in self.contexts):
            raise ValueError(f"contexts must be integers >= 2, got {self.contexts}")
        if self.decode_tokens < 1:
            raise ValueError(f"decode_tokens must be >= 1, got {self.decode_tokens}")
        if self.sink_tokens < 0 or self.recent_tokens < 0:
            raise ValueError("sink_tokens and recent_tokens must be >= 0")
        if not self.caches:
            raise ValueError("no caches to run")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in self.caches:
            parse_cache_name(name)  # raises ValueError on a bad name

    def specs(self) -> list[CacheSpec]:
        """Parsed caches, DynamicCache first (always run: it is the reference of every ratio)."""
        specs = [parse_cache_name(name) for name in self.caches]
        unique = {spec.name: spec for spec in [CacheSpec("dynamic", "dynamic"), *specs]}
        return list(unique.values())


def load_benchmark_model(config: "DecodeSpeedConfig"):
    """(model, tokenizer) on config.device: the default model, or its architecture with random
    weights (tokenizer None) where the weights cannot be loaded (e.g. a GPU machine offline)."""
    import torch

    from fibquant.kv.model import load_model, random_model

    if config.random_weights:
        return random_model(torch.float32, config.device), None
    model, tokenizer = load_model()
    return model.to(config.device), tokenizer


# ----------------------------------------------------------------------------- availability

def peer_unavailable_reason(backend: str) -> Optional[str]:
    """None when transformers' QuantizedCache can use `backend` here, else why not."""
    module = {"quanto": "optimum.quanto", "hqq": "hqq.core.quantize"}[backend]
    try:
        __import__(module)
    except Exception as exc:  # any import failure (missing package, broken build) means: skip
        return (f"{PEER_BACKENDS[backend]} is not importable ({type(exc).__name__}: {exc}); "
                f"install the peers extra: pip install 'fibquant[peers]'")
    try:
        from transformers import QuantizedCache  # noqa: F401
    except ImportError as exc:
        return f"this transformers has no QuantizedCache ({exc})"
    return None


def _package_version(name: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cache_bytes(spec: CacheSpec, cache) -> dict:
    """{"held", "used", and parts}: bytes of `cache` counted as described in `BYTES_COUNTING`."""
    from fibquant.kv.accounting import cache_nbytes, quantized_cache_nbytes

    held = cache_nbytes(cache)
    if spec.kind == "dynamic":
        return {"held": held, "used": held}
    if spec.kind == "compressed":
        return {"held": held, "used": cache.used_nbytes(), "codec_shared": cache.shared_nbytes()}
    parts = quantized_cache_nbytes(cache)
    return {"held": held, "used": held, "quantized": parts["quantized"], "residual": parts["residual"]}


BYTES_COUNTING = {
    "dynamic": "fibquant.kv.accounting.cache_nbytes: storage of every layer's keys/values (float32 here); "
               "dynamic_fp16_bytes = that / element size * 2, what an fp16 DynamicCache holds",
    "compressed": "CompressedCache.nbytes(): exact sinks + recent window (float32) + code buffers including "
                  "their reserved capacity (grown by 1/16 of their capacity); used = used_nbytes(): only stored code rows; "
                  "the codecs' shared codebook/rotation (codec_shared, once per model) is not included",
    "quantized": "storage of every layer's _quantized_keys/_quantized_values (quanto: packed integer data + "
                 "per-group scale and shift, through the tensor subclass's __tensor_flatten__; hqq: packed "
                 "uint8 tensor + the scale/zero tensors of its meta dict; scales are in the model dtype, "
                 "float32 here) + the float residual keys/values window (< residual_length tokens); each "
                 "storage once at its real size",
}
