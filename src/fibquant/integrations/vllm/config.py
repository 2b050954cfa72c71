"""The one switch of the vLLM plugin: `FIBQUANT_VLLM_CACHE`, a cache spec read in every vLLM process.

    unset / empty               the plugin does nothing: vLLM runs exactly as without it
    fibquant:b=4                keys and values with FibQuant at 4 bits/coordinate
    fibquant:b=4/fibquant:b=2   keys / values at different rates (or codecs: turboquant:b=3, ...)

Any calibration-free codec spec of `fibquant.codecs.registry` works on each side; codecs with a rotated
codebook (FibQuant, TurboQuant) are attended on their codes, others are decoded for attention.

`FIBQUANT_VLLM_SINK_TOKENS` (default 4, 0 turns them off): the first tokens of each sequence that
attention also reads exactly (attention sinks); `FIBQUANT_VLLM_RECENT_TOKENS` (default 32, as the
transformers cache's `recent_tokens`; 0 turns it off): the last tokens before each forward that
attention reads exactly. `FIBQUANT_VLLM_ATTENTION` (default empty: the tuned paths): the attention options,
`NAME=VALUE,...` of `fibquant.kv.options.AttentionOptions` (e.g. `defer_codes=off,gather_decode=values`). Both
windows live in a side store beside the pages (`window`); its bytes (`window_bytes`) are taken off the KV
budget by vLLM's worker (`budget`).

A spec is checked when the plugin loads, before vLLM loads a model (`check_rates`: its codecs must
build for some common head dimension), and again for the model's own head dimension when its
attention layers are built; every error is one line naming the variable.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fibquant.kv.options import DEFAULT_OPTIONS, AttentionOptions

if TYPE_CHECKING:
    from fibquant.kv.budget import Budget
    from fibquant.kv.specs import CacheSpec

ENV_VAR = "FIBQUANT_VLLM_CACHE"
SINKS_ENV_VAR = "FIBQUANT_VLLM_SINK_TOKENS"
RECENT_ENV_VAR = "FIBQUANT_VLLM_RECENT_TOKENS"
ATTENTION_ENV_VAR = "FIBQUANT_VLLM_ATTENTION"
DEFAULT_SINK_TOKENS = 4
DEFAULT_RECENT_TOKENS = 32
# Head dimensions a spec is checked against before any model is known (`check_rates`).
COMMON_HEAD_DIMS = (64, 80, 96, 112, 128, 160, 192, 256)
# Decode steps whose new tokens' codes are written in one batched encode (`deferred.DeferredCodes`),
# capped by the recent window (those tokens are read exactly until they leave it).
DEFERRED_STEPS = 16


@dataclass(frozen=True)
class VllmCacheConfig:
    """A cache spec of our own codecs (`fibquant.kv.specs`) or a ratio budget (`fibquant.kv.budget`: the best
    shipped code within it, chosen per head dimension), the exact window (sink and recent tokens) and the
    attention options (validated on construction)."""

    cache: "CacheSpec | Budget"
    sink_tokens: int = DEFAULT_SINK_TOKENS
    recent_tokens: int = DEFAULT_RECENT_TOKENS
    options: AttentionOptions = DEFAULT_OPTIONS

    def __post_init__(self) -> None:
        from fibquant.kv.budget import Budget

        for name, value, var in (("sink", self.sink_tokens, SINKS_ENV_VAR),
                                 ("recent", self.recent_tokens, RECENT_ENV_VAR)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{var}: {name} tokens must be an integer >= 0, got {value!r}")
        if not isinstance(self.options, AttentionOptions):
            raise ValueError(f"options must be a fibquant.kv.options.AttentionOptions, got {self.options!r}")
        if isinstance(self.cache, Budget):
            if self.cache.bytes_per_token is not None:
                raise ValueError(f"{ENV_VAR}={self.cache.spec!r}: a bytes= budget depends on the model's layers and "
                                 "heads; the vLLM switch takes ratio=R (a ratio against bf16 pages)")
            return
        if self.cache.is_fp or self.cache.uses_peer:
            raise ValueError(f"{ENV_VAR}={self.cache.spec!r}: the pages need one of our calibration-free codecs "
                             "on both sides, e.g. fibquant:b=4 or turboquant:b=3")
        if self.cache.centre or self.cache.plans:
            raise ValueError(f"{ENV_VAR}={self.cache.spec!r}: @centre and the experiments' options (@alloc, "
                             "@heavy) are transformers-cache options; vLLM pages hold one codec per role for every "
                             "layer, uncentred")

    @classmethod
    def parse(cls, text: str, sink_tokens: int = DEFAULT_SINK_TOKENS, recent_tokens: int = DEFAULT_RECENT_TOKENS,
              options: AttentionOptions = DEFAULT_OPTIONS) -> "VllmCacheConfig":
        """SPEC or KEY_SPEC/VALUE_SPEC, as every cache spec of the project, or a budget `ratio=R[,context=N]`."""
        from fibquant.kv.budget import is_budget, parse_budget
        from fibquant.kv.specs import parse_cache_spec

        try:
            cache = parse_budget(text) if is_budget(text) else parse_cache_spec(text)
        except ValueError as exc:
            raise ValueError(f"{ENV_VAR}={text!r}: {exc}") from exc
        return cls(cache, sink_tokens, recent_tokens, options)

    def spec_for(self, head_dim: int) -> "CacheSpec":
        """The cache spec served at `head_dim`: the spec itself, or the budget's choice (ValueError, one line
        naming the variable, when no shipped code fits)."""
        try:
            return self._spec_for(head_dim)
        except ValueError as exc:
            raise ValueError(f"{ENV_VAR}={self.cache.spec!r}: {_one_line(exc)}") from exc

    def codecs(self, head_dim: int):
        """(key codec, value codec) for `head_dim`, shared by every layer of the process (ValueError,
        one line naming the variable, when a side has no codec for that head dimension)."""
        try:
            return self._codecs(head_dim)
        except ValueError as exc:
            raise ValueError(f"{ENV_VAR}={self.cache.spec!r}: no codec for head dimension {head_dim}: "
                             f"{_one_line(exc)}") from exc

    def _spec_for(self, head_dim: int) -> "CacheSpec":
        from fibquant.kv.budget import Budget, choose_in_layout, head_layout
        from fibquant.kv.specs import parse_cache_spec

        if not isinstance(self.cache, Budget):
            return self.cache
        return parse_cache_spec(choose_in_layout(head_layout(head_dim), self.cache, self.sink_tokens,
                                                 self.recent_tokens, max(1, self.deferred_steps)))

    def _codecs(self, head_dim: int):
        spec = self._spec_for(head_dim)
        return _codec(spec.key.spec, head_dim), _codec(spec.value.spec, head_dim)

    def check_rates(self, head_dims: tuple[int, ...] = COMMON_HEAD_DIMS) -> None:
        """ValueError (one line naming the variable) unless both sides build for at least one of
        `head_dims`: the check a spec's numbers get before vLLM has loaded a model (a rate no codec
        reaches, such as fibquant:b=99 or b=0, fails here rather than in a worker)."""
        errors = {}
        for dim in head_dims:
            try:
                self._codecs(dim)
                return
            except ValueError as exc:
                errors[dim] = _one_line(exc)
        reason = errors.get(128) or next(iter(errors.values()))
        raise ValueError(f"{ENV_VAR}={self.cache.spec!r}: no codec for any head dimension in {list(head_dims)}: "
                         f"{reason}")

    def slot_bytes(self, head_dim: int) -> int:
        """Bytes of one token of one KV head in a page: key code, value code, padded to an even
        count because vLLM views the page in the model dtype (2 bytes) before handing it over."""
        key, value = self.codecs(head_dim)
        size = key.code_size + value.code_size
        return size + (size % 2)

    @property
    def deferred_steps(self) -> int:
        """Decode steps whose codes wait for one batched encode (0: written at once, or `defer_codes` off):
        DEFERRED_STEPS, at most the recent window, which reads those tokens exactly meanwhile (`deferred`)."""
        return min(DEFERRED_STEPS, self.recent_tokens) if self.options.defer_codes else 0

    def window_bytes(self, head_dim: int, kv_heads: int, layers: int, sequences: int, element_bytes: int = 2,
                     prefix_caching: bool = False) -> int:
        """Bytes of the exact-window side stores at their bound: (sinks + recent) keys and values of
        `kv_heads` x `head_dim` in the model dtype, per layer and live sequence (`window.ExactWindow`),
        as many again for its boundary snapshots when prefix caching is on (`snapshots` = sequences),
        and the decode tokens awaiting their batched encode (`deferred_steps` per sequence,
        `deferred.DeferredCodes`)."""
        tokens = (self.sink_tokens + self.recent_tokens) * (2 if prefix_caching else 1) + self.deferred_steps
        return tokens * kv_heads * head_dim * 2 * element_bytes * layers * sequences


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


@functools.lru_cache(maxsize=None)
def _codec(spec: str, head_dim: int):
    from fibquant.codecs.registry import parse_codec_spec

    return parse_codec_spec(spec).build(head_dim)


def active_config() -> VllmCacheConfig | None:
    """The config named by `FIBQUANT_VLLM_CACHE` (with the window and attention options of the other
    variables), or None when the switch is off. The one place the plugin reads the environment."""
    text = os.environ.get(ENV_VAR, "").strip()
    if not text:
        return None
    counts = []
    for var, default in ((SINKS_ENV_VAR, DEFAULT_SINK_TOKENS), (RECENT_ENV_VAR, DEFAULT_RECENT_TOKENS)):
        value = os.environ.get(var, "").strip() or str(default)
        if not value.isdigit():
            raise ValueError(f"{var}={value!r}: expected an integer >= 0")
        counts.append(int(value))
    options = os.environ.get(ATTENTION_ENV_VAR, "")
    try:
        parsed = AttentionOptions.parse(options)
    except ValueError as exc:
        raise ValueError(f"{ATTENTION_ENV_VAR}={options!r}: {exc}") from exc
    return VllmCacheConfig.parse(text, *counts, parsed)
