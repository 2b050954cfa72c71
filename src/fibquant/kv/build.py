"""One cache spec -> one KV cache of any kind (the experiments compare them): `build_cache`.

    fp                      a `DynamicCache` (a copy of the prefill)
    our codecs, both sides  a `CompressedCache` (`for_model`, or `from_cache` with a prefill)
    a peer on either side   a `RoundTripCache` with the same exact window (`fibquant.kv.roundtrip_cache`)
"""
from __future__ import annotations

from typing import Optional, Union

from fibquant.kv.cache import CompressedCache
from fibquant.kv.specs import CacheSpec, parse_cache_spec


def build_cache(spec: Union[str, CacheSpec], model, sink_tokens: int = 4, recent_tokens: int = 32,
                attention: str = "codes", prefill=None, quantizers: Optional[tuple] = None):
    """A fresh cache for `model`, or (prefill = a DynamicCache) one holding the prefill compressed.

    Our codecs on both sides: a `CompressedCache` with the spec's options (`CacheSpec.cache_options`: its
    layer plan, recall, @decode). `quantizers`: (key, value) from `spec.quantizers(model)`, built here when
    None. A CompressedCache on codes runs inside `fibquant.attention_on_codes(model)`."""
    from transformers import DynamicCache

    from fibquant.kv.model import copy_dynamic_cache

    spec = parse_cache_spec(spec, model) if isinstance(spec, str) else spec
    if spec.is_fp:
        return DynamicCache(config=model.config) if prefill is None else copy_dynamic_cache(prefill, model.config)
    key, value = quantizers if quantizers is not None else spec.quantizers(model)
    if not spec.uses_peer:
        options = dict({"attention": attention}, **spec.cache_options(model, key.dim))
        if prefill is None:
            return CompressedCache.for_model(model, key, value, sink_tokens, recent_tokens, **options)
        return CompressedCache.from_cache(prefill, key, value, sink_tokens, recent_tokens, model=model, **options)
    from fibquant.kv.roundtrip_cache import RoundTripCache

    def as_roundtrip(quantizer):
        if hasattr(quantizer, "encode"):  # one of our codecs
            return lambda x, start: quantizer.roundtrip(x)
        return quantizer.roundtrip

    if prefill is None:
        return RoundTripCache(as_roundtrip(key), as_roundtrip(value), sink_tokens, recent_tokens)
    return RoundTripCache.from_cache(prefill, as_roundtrip(key), as_roundtrip(value), sink_tokens, recent_tokens)
