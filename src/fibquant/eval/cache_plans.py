"""The experiments' layer plans for a `CompressedCache` (`fibquant.kv.plan.LayerPlan`) and their spec options.

    RateAllocation(allocate, num_layers)   per-layer codecs chosen from the cached tokens themselves
                                           (spec option `@alloc=SIGNAL`; the allocator: `fibquant.eval.allocation`)
    HeavyTokens(tier)                      a fraction of the coded tokens also kept at a second, higher rate
                                           (spec option `@heavy=F[:SCORE[:RATE]]`; `fibquant.eval.heavy`)

Both were measured on SmolLM2-135M / Emma and left off (docs/quality-improvements.md): no allocation signal
beat the uniform rates on needle retrieval or perplexity, and the heavy tier, the best cache found at >= 10x
(43/50 needles against fp's 50/50), does not reach fp's retrieval; so they stay experiments. Importing this
module registers both spec options with `fibquant.kv.specs` (`fibquant.eval`'s `__init__` imports it, so
every experiment and every command taking `--caches` accepts them).

    cache = CompressedCache.for_model(model, key, value, layer_plan=RateAllocation(RateAllocator(64, 2, 1),
                                                                                    num_layers=30))
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch

from fibquant.eval.allocation import SIGNALS, RateAllocator, attention_weights, rung_of
from fibquant.eval.heavy import HeavySpec, HeavyTier, TieredLayer
from fibquant.kv.layer import CompressedLayer
from fibquant.kv.model import check_model_supported
from fibquant.kv.plan import LayerPlan, check_plan
from fibquant.kv.specs import CacheSpec, PlanOption, Side, register_plan_option


class RateAllocation(LayerPlan):
    """Per-layer codecs chosen by `allocate` (e.g. a `RateAllocator`) from the data itself.

    `allocate(samples)` gets, per layer, that layer's exact tokens after the sinks ([B, H, n, D] keys and
    values) and returns the per-layer key and value codecs (and optionally an info dict, kept as
    `allocation`). `from_cache` calls it with the whole source before anything is coded; a cache filled
    through `update` calls it when a layer first has tokens to encode and every layer (`num_layers`, the
    model's layer count) holds tokens; until then tokens stay exact (a layer that had to wait encodes its
    backlog as soon as the codecs are chosen). inner: the plan that builds the layers (the plain one,
    `Centred()`, or `HeavyTokens`). One RateAllocation serves one cache."""

    def __init__(self, allocate: Callable, num_layers: int, inner: Optional[LayerPlan] = None):
        if not callable(allocate):
            raise ValueError(f"allocate must be callable, got {type(allocate).__name__}")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
        self.allocate, self.num_layers, self.inner = allocate, num_layers, check_plan(inner)
        self.allocation: Optional[dict] = None  # what `allocate` returned besides the codecs, once it ran
        self._cache = None  # a weak reference to the cache it serves

    @property
    def centred(self) -> bool:
        return self.inner.centred

    def __repr__(self) -> str:
        return f"RateAllocation({self.allocate!r}, num_layers={self.num_layers}, inner={self.inner!r})"

    def check(self, cache) -> None:
        if self._cache is not None and self._cache() is not cache:
            raise ValueError("a RateAllocation serves one cache (it keeps that cache's allocation): make one per cache")
        if cache.key_codecs is not None:
            raise ValueError("pass per-layer codecs or a RateAllocation, not both")
        if cache.layer_windows is not None and len(cache.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(cache.layer_windows)} entries but num_layers says "
                             f"{self.num_layers}")
        self.inner.check(cache)
        self._cache = weakref.ref(cache)

    def new_layer(self, cache, index: int) -> CompressedLayer:
        layer = self.inner.new_layer(cache, index)
        if cache.key_codecs is None:  # codecs not chosen yet: the layer asks before it encodes
            layer.resolver = partial(self._resolve, cache)
        return layer

    def start(self, cache, samples: list) -> None:
        self.inner.start(cache, samples)
        self._choose(cache, samples)

    def save_refusal(self, cache) -> Optional[str]:
        if cache.key_codecs is None:
            return "its per-layer codecs are not chosen yet (RateAllocation chooses them once every layer holds tokens)"
        return self.inner.save_refusal(cache)

    def _choose(self, cache, samples: list) -> None:
        """Run `allocate` on per-layer (keys, values) samples and fix the cache's per-layer codecs."""
        result = self.allocate(samples)
        key_codecs, value_codecs = list(result[0]), list(result[1])
        if len(key_codecs) != len(samples) or len(value_codecs) != len(samples):
            raise ValueError(f"allocate returned {len(key_codecs)} key and {len(value_codecs)} value codecs "
                             f"for {len(samples)} layers")
        cache.set_layer_codecs(key_codecs, value_codecs)
        self.allocation = result[2] if len(result) > 2 else {}

    def _resolve(self, cache, caller: CompressedLayer, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Called by a layer with tokens to encode before the codecs are chosen; True once they are.

        Chooses them when every layer (`num_layers`) holds tokens: the sample of a layer is its exact tokens
        after the sinks (the caller's `keys`/`values`: its recent window with the new tokens)."""
        layers = cache.layers
        if len(layers) < self.num_layers or any(not layer.is_initialized for layer in layers):
            return False
        samples = [(keys, values) if layer is caller else (layer.recent_keys, layer.recent_values)
                   for layer in layers]
        if any(k.shape[-2] == 0 for k, _ in samples):
            return False
        self._choose(cache, samples)
        for index, layer in enumerate(layers):
            layer.resolver = None
            layer.set_codecs(*cache.layer_codecs(index))
        for layer in layers:  # layers that waited encode their backlog now (the caller goes on itself)
            if layer is not caller:
                layer.flush()
        return True


class HeavyTokens(LayerPlan):
    """Every layer a `TieredLayer` (`fibquant.eval.heavy`): it also stores a fixed fraction of its coded tokens
    per KV head (the highest by a score of the tokens themselves, e.g. key norm) at a second, higher rate;
    reads patch those rows in and attention runs on the decoded floats. Full-attention layers only; no
    recall; not saved (the store holds one code stream per role)."""

    def __init__(self, tier: HeavyTier):
        if not isinstance(tier, HeavyTier):
            raise ValueError(f"tier must be a fibquant.eval.heavy.HeavyTier, got {type(tier).__name__}")
        self.tier = tier

    def __repr__(self) -> str:
        return f"HeavyTokens({self.tier!r})"

    def check(self, cache) -> None:
        if cache.layer_windows is not None:
            raise ValueError("a heavy tier applies to full-attention layers only (this model has sliding ones)")
        if cache.recall is not None:
            raise ValueError("recall does not combine with a heavy tier")

    def new_layer(self, cache, index: int) -> CompressedLayer:
        key, value = cache.layer_codecs(index)
        return TieredLayer(key, value, cache.sink_tokens, cache.recent_tokens, self.tier, cache.attention,
                           cache.encode_batch)

    def save_refusal(self, cache) -> Optional[str]:
        return "saving a heavy tier is not implemented (the store holds one code stream per role)"


# ---------------------------------------------------------------------- the spec options
def _fibquant_bits(side: Side) -> Optional[float]:
    """The `b=` rate of a FibQuant side, None for anything else (explicit k, n or another codec)."""
    if side.is_peer or side.quantizer.family != "fibquant":
        return None
    return side.quantizer.param("bits")


@dataclass(frozen=True)
class AllocOption(PlanOption):
    """`@alloc=SIGNAL` (a `RateAllocator` signal) or `@alloc=ends:N` (the first and last N layers one step up,
    as many middle layers one step down); FibQuant `b=` rates on both sides, each role's base rate its
    average budget."""

    alloc: str

    @classmethod
    def parse(cls, value: str) -> "AllocOption":
        if not value:
            raise ValueError(f"@alloc needs a signal: @alloc=SIGNAL, one of {SIGNALS}")
        return cls(value)

    @property
    def text(self) -> str:
        return f"@alloc={self.alloc}"

    @property
    def label(self) -> str:
        return f" alloc={self.alloc}"

    def parts(self) -> tuple[str, Optional[int]]:
        """'ends:4' -> ('ends', 4); a plain signal -> (signal, None)."""
        signal, colon, count = self.alloc.partition(":")
        if not colon:
            return signal, None
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"@alloc={self.alloc}: the layer count after ':' must be an integer >= 1")
        return signal, int(count)

    def check(self, spec: CacheSpec) -> None:
        signal, count = self.parts()
        if signal not in SIGNALS:
            raise ValueError(f"@alloc={self.alloc}: the signal must be one of {SIGNALS}")
        if count is not None and signal != "ends":
            raise ValueError(f"@alloc={self.alloc}: only ends takes a layer count (ends:N)")
        for side in (spec.key, spec.value):
            bits = _fibquant_bits(side)
            if bits is None:
                raise ValueError(f"@alloc needs FibQuant rates on both sides (fibquant:b=...), got {side.spec}")
            rung_of(bits)

    def allocator(self, spec: CacheSpec, dim: int, centre: bool, model=None) -> RateAllocator:
        """The `RateAllocator` of this option; signal "attn" reads its weights from `model` (ValueError when it
        has none)."""
        signal, count = self.parts()
        weights = (None, None)
        if signal in ("attn", "attn-keys"):
            weights = attention_weights(model) if model is not None else None
            if weights is None:
                raise ValueError(f"{spec.spec}: signal attn needs a model with q/k/o projections it can read")
        extra = {} if count is None else {"ends": count}
        return RateAllocator(dim, _fibquant_bits(spec.key), _fibquant_bits(spec.value), signal, **extra,
                             centre=centre, key_weights=weights[0], value_weights=weights[1])

    def build(self, plan: LayerPlan, spec: CacheSpec, model, key_dim: int) -> LayerPlan:
        layers = check_model_supported(model)["layers"]
        return RateAllocation(self.allocator(spec, key_dim, plan.centred, model), layers, inner=plan)


@dataclass(frozen=True)
class HeavyOption(PlanOption):
    """`@heavy=F[:SCORE[:RATE]]` (`HeavySpec.parse`): heavy tokens at a second rate, counted in the bytes."""

    heavy: HeavySpec

    @classmethod
    def parse(cls, value: str) -> "HeavyOption":
        if not value:
            raise ValueError("@heavy needs a fraction: @heavy=F[:SCORE[:RATE]], e.g. @heavy=0.02:knorm:4")
        return cls(HeavySpec.parse(value))

    @property
    def text(self) -> str:
        return f"@heavy={self.heavy.text}"

    @property
    def label(self) -> str:
        return f" heavy={self.heavy.text}"

    def check(self, spec: CacheSpec) -> None:
        if spec.centre:
            raise ValueError("@heavy does not combine with @centre")
        if spec.recall is not None:
            raise ValueError("@recall works on the codes: it does not combine with @heavy")

    def extra_bytes(self, dim: int) -> tuple[float, float]:
        return self.heavy.extra_bytes(dim)

    def build(self, plan: LayerPlan, spec: CacheSpec, model, key_dim: int) -> LayerPlan:
        heavy = HeavyTokens(self.heavy.build(key_dim))
        if isinstance(plan, RateAllocation):  # @alloc comes first: its layers become tiered
            return RateAllocation(plan.allocate, plan.num_layers, inner=heavy)
        return heavy


register_plan_option("alloc", AllocOption.parse)
register_plan_option("heavy", HeavyOption.parse)
