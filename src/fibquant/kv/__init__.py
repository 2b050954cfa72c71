"""The transformers KV cache that stores codes, attention on those codes, and their persistence.

    cache, layer, buffer   `CompressedCache`, its layers and the code rows they hold
    attention/             attention on codes (the "fibquant" attention function and kernels)
    persist/               saving, reopening, appending and prefix search of caches
    specs                  the cache spec grammar (`fibquant:b=4/fibquant:b=2`, peers, `@decode`), with
                           the hook the experiments register their options through
    plan                   `LayerPlan`: how a cache makes its layers (the plain one, `Centred`); the
                           experiments' plans are in `fibquant.eval.cache_plans`
    accounting             the bytes a cache or codec holds
    model                  model loading and the support checks
    options                `AttentionOptions`: the paths attention on codes takes (no module switches)
    headwise               per-head (and per-layer) codecs fitted per head
    roundtrip_cache        the peers' float round-trip cache
"""
# Wires persistence into CompressedCache.save / load (see fibquant.kv.cache.register_persistence).
import fibquant.kv.persist  # noqa: F401
