"""The caches a decode-speed run measures, its configuration, and what it needs from the machine.

Caches are named in the one cache-spec grammar (`fibquant.kv.specs`):

    fp                      transformers' DynamicCache (the reference of every ratio)
    fibquant:b=4            a CompressedCache of a registered codec built from `b=` alone (fibquant,
                            turboquant, int), attention on the codes
    fibquant:b=4@decode     the same cache through the decode path (attention='decode')
    fibquant:b=2@recall=32  the same codes with query-aware recall from a cold tier (`fibquant.kv.cold`)
    quanto:b=4, hqq:b=2     transformers' own QuantizedCache with that backend (`PeerFamily.native`)

Torch-free at import (the CLI reads `DEFAULT_CACHES` for its
help text).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

OUR_CACHES = ("fibquant:b=4", "fibquant:b=3", "fibquant:b=2", "turboquant:b=4", "turboquant:b=2")
PEER_CACHES = ("quanto:b=4", "quanto:b=2", "hqq:b=4", "hqq:b=2")
DEFAULT_CACHES = ("fp", *OUR_CACHES, *PEER_CACHES, *(f"{name}@decode" for name in OUR_CACHES))
DECODE_OPTION = "@decode"
# What a run measures per cache and context (`--parts`):
#   ttft    - one-shot time to first token: a fresh cache, the whole prompt in one forward, argmax;
#   chunked - the same with the prompt fed in chunks of `chunk_tokens` (one forward per chunk);
#   decode  - the shared-prefill protocol: one float prefill, each cache built from it, greedy steps.
PARTS = ("ttft", "chunked", "decode")


@dataclass(frozen=True)
class SpeedCache:
    """One cache under test: its spec (`name`, canonical spelling) and what the run builds from it."""

    name: str
    kind: str                        # "dynamic" | "compressed" | "quantized"
    family: str = "dynamic"          # a registered codec family (ours) | a QuantizedCache backend | dynamic
    bits: Optional[float] = None
    attention: Optional[str] = None  # "codes" | "decode" for ours
    recall: Optional[str] = None     # ours with @recall: the `fibquant.kv.cold.Recall` text

    @property
    def label(self) -> str:
        if self.kind == "dynamic":
            return "DynamicCache"
        bits = f"{self.bits:g}b"
        if self.kind == "compressed":
            recall = f" recall={self.recall}" if self.recall else ""
            return f"{self.codec_spec().style.name} {bits} ({self.attention}{recall})"
        return f"QuantizedCache {self.family} {bits}"

    def codec_spec(self):
        """The codec spec of one of ours (`fibquant.codecs.registry.CodecSpec`)."""
        from fibquant.codecs.registry import parse_codec_spec

        if self.kind != "compressed":
            raise ValueError(f"{self.name} is not one of our compressed caches")
        return parse_codec_spec(self.name.partition("@")[0])

    def recall_option(self):
        """The `fibquant.kv.cold.Recall` of a cache with @recall, else None."""
        if self.recall is None:
            return None
        from fibquant.kv.cold import Recall

        return Recall.parse(self.recall)


def our_families() -> tuple[str, ...]:
    """Registered codec families built from a bit count alone (`b=`; not calibrated, not the reference)."""
    from fibquant.codecs.registry import codec_classes

    return tuple(family for family, cls in codec_classes().items()
                 if not cls.calibrated and not cls.reference and any(p.name == "bits" for p in cls.spec_params))


def parse_cache_name(name: str) -> SpeedCache:
    """`name` in the cache-spec grammar (module docstring) -> SpeedCache; ValueError otherwise."""
    from fibquant.peers import native_families, parse_peer

    text = name.strip().lower()
    base = text.removesuffix(DECODE_OPTION)
    family = base.partition(":")[0].strip()
    hint = f"expected fp, ours as fibquant:b=4 (optionally {DECODE_OPTION}) or a QuantizedCache quanto:b=4 / hqq:b=2"
    if family in native_families():
        if base != text:
            raise ValueError(f"cache {name!r}: {DECODE_OPTION} applies to our codecs; {hint}")
        try:
            peer = parse_peer(f"{native_families()[family]}:{base.partition(':')[2]}")
        except ValueError as exc:
            raise ValueError(f"cache {name!r}: {exc}") from None
        return SpeedCache(f"{family}:b={peer.value}", "quantized", family, peer.value)
    from fibquant.kv.specs import parse_cache_spec

    try:
        spec = parse_cache_spec(base)
    except ValueError as exc:
        raise ValueError(f"unknown cache {name!r} ({exc}); {hint}") from None
    if spec.is_fp and base == text:
        return SpeedCache("fp", "dynamic")
    recall = spec.recall.text if spec.recall is not None and spec.options == f"@recall={spec.recall.text}" else None
    if spec.is_fp or not spec.symmetric or spec.uses_peer or (spec.options and recall is None) \
            or spec.key.quantizer.family not in our_families():
        raise ValueError(f"cache {name!r} cannot be timed here: {hint} (ours: {', '.join(our_families())})")
    method = spec.key.quantizer
    bits = method.param("bits")
    if bits is None or not 0 < bits <= 8:
        raise ValueError(f"cache {name!r}: the speed run builds ours from b= alone, 0 < b <= 8; {hint}")
    decode = base != text
    return SpeedCache(method.spec + (DECODE_OPTION if decode else "") + (f"@recall={recall}" if recall else ""),
                      "compressed", method.family, bits, "decode" if decode else "codes", recall)


# ----------------------------------------------------------------------------- config

@dataclass(frozen=True)
class DecodeSpeedConfig:
    contexts: tuple[int, ...] = (1024, 2048, 4096, 8192)
    decode_tokens: int = 32             # interleaved rounds of the decode part: one timed step per cache each
    # Untimed steps per cache after the rounds, one cache at a time, under the memory monitor: 16 = one
    # encode batch of ours (CompressedCache's encode_batch), so a step that encodes is among them.
    memory_steps: int = 16
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
        if self.memory_steps < 1:
            raise ValueError(f"memory_steps must be >= 1, got {self.memory_steps}")
        if self.sink_tokens < 0 or self.recent_tokens < 0:
            raise ValueError("sink_tokens and recent_tokens must be >= 0")
        if not self.caches:
            raise ValueError("no caches to run")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in self.caches:
            parse_cache_name(name)  # raises ValueError on a bad name

    def specs(self) -> list[SpeedCache]:
        """Parsed caches, DynamicCache first (always run: it is the reference of every ratio)."""
        specs = [parse_cache_name(name) for name in self.caches]
        unique = {spec.name: spec for spec in [SpeedCache("fp", "dynamic"), *specs]}
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
    from fibquant.peers import family_unavailable_reason, native_families

    reason = family_unavailable_reason(native_families()[backend])
    if reason is not None:
        return reason
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


def cache_bytes(spec: SpeedCache, cache) -> dict:
    """{"held", "used", and parts}: bytes of `cache` counted as described in `BYTES_COUNTING`."""
    from fibquant.kv.accounting import cache_nbytes, quantized_cache_nbytes

    held = cache_nbytes(cache)
    if spec.kind == "dynamic":
        return {"held": held, "used": held}
    if spec.kind == "compressed":
        return {"held": held, "used": cache.used_nbytes(), "codec_shared": cache.shared_nbytes(),
                "cold": cache.cold_nbytes(), "cold_rows_read": cache.cold_reads()["rows"]}
    parts = quantized_cache_nbytes(cache)
    return {"held": held, "used": held, "quantized": parts["quantized"], "residual": parts["residual"]}


BYTES_COUNTING = {
    "dynamic": "fibquant.kv.accounting.cache_nbytes: storage of every layer's keys/values (float32 here); "
               "dynamic_fp16_bytes = that / element size * 2, what an fp16 DynamicCache holds",
    "compressed": "CompressedCache.nbytes(): exact sinks + recent window (float32) + code buffers including "
                  "their reserved capacity (grown by 1/16 of their capacity); used = used_nbytes(): only stored code rows; "
                  "with @recall the cold tier's exact rows (host memory) are bytes_parts.cold, not in held/used; "
                  "the codecs' shared codebook/rotation (codec_shared, once per model) is not included",
    "quantized": "storage of every layer's _quantized_keys/_quantized_values (quanto: packed integer data + "
                 "per-group scale and shift, through the tensor subclass's __tensor_flatten__; hqq: packed "
                 "uint8 tensor + the scale/zero tensors of its meta dict; scales are in the model dtype, "
                 "float32 here) + the float residual keys/values window (< residual_length tokens); each "
                 "storage once at its real size",
}
