"""How a `CompressedCache` makes its layers: the one extension point research features plug into.

A cache asks its plan (`CompressedCache(layer_plan=...)`) for each layer, so a feature that changes what
a layer stores or which codecs it gets is one `LayerPlan` subclass, not a constructor argument:

    check(cache)                  ValueError when the plan does not fit the cache (called once, by the
                                  constructor, after the window and attention are set)
    new_layer(cache, index)       layer `index` (as the model reaches it, or up front for a hybrid model);
                                  `cache.plain_layer(index)` builds the ordinary one
    start(cache, samples)         `from_cache` only: the source's per-layer (keys, values) after the sinks
                                  ([B, H, n, D]), before any layer is built
    save_refusal(cache)           why `kv/persist` cannot write the cache (None: it can)
    centred                       its layers subtract a per-layer, per-head mean (persistence stores them)

Here: `LayerPlan` (the plain cache, the default) and `Centred`. The experiments' plans (per-layer rate
allocation, heavy tokens) live in `fibquant.eval.cache_plans`, which also registers their cache-spec
options (`fibquant.kv.specs.register_plan_option`).

`Centred` keeps its place in the core because the saved-cache format stores the means
(`kv/persist/format.MEAN_FIELDS`) and every attention path reads them (`CodedKV.key_mean`). It is off
by default: measured on SmolLM2-135M (docs/quality-improvements.md) it improves the average-case
metrics (perplexity at 2 bits +4.69 % against +5.81 % uncentred; attention cosine at 1 bit 0.934
against 0.841) but lowers needle retrieval in every configuration tested (K2/V1: 12/20 against 17/20).
"""
from __future__ import annotations

from typing import Optional

from fibquant.kv.layer import CompressedLayer


class LayerPlan:
    """The plain plan: every layer a `CompressedLayer` (a `CompressedSlidingLayer` on a sliding-window
    layer) with the cache's codecs for that layer. Subclass it for a feature (see the module docstring)."""

    centred: bool = False

    def check(self, cache) -> None:
        """ValueError when this plan does not fit `cache` (its window, attention, recall or codecs)."""

    def new_layer(self, cache, index: int) -> CompressedLayer:
        """Layer `index` of `cache`."""
        return cache.plain_layer(index, centre=self.centred)

    def start(self, cache, samples: list) -> None:
        """`from_cache`: the source's per-layer (keys, values) after the sinks, before any layer is built."""

    def save_refusal(self, cache) -> Optional[str]:
        """Why `cache` cannot be saved (`CompressedCache.save`), None when it can."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Centred(LayerPlan):
    """Each layer quantises keys and values minus a mean [B, H, D] fixed at its first encode (e.g. the
    prefill: calibration-free, one vector per KV head) and adds it back on every read; the codec's bits go
    to what varies between tokens. Saved caches keep the means."""

    centred = True


PLAIN = LayerPlan()


def check_plan(plan) -> LayerPlan:
    """`plan`, or ValueError when it is not a `LayerPlan` (None means the plain one)."""
    if plan is None:
        return PLAIN
    if not isinstance(plan, LayerPlan):
        raise ValueError(f"layer_plan must be a fibquant.kv.plan.LayerPlan (e.g. Centred(), or one of "
                         f"fibquant.eval.cache_plans), got {type(plan).__name__}")
    return plan
