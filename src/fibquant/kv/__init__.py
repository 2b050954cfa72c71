"""The transformers KV cache that stores codes, attention on those codes, and their persistence.

    cache, layer, buffer   `CompressedCache`, its layers and the code rows they hold
    attention/             attention on codes (the "fibquant" attention function and kernels)
    persist/               saving, reopening, appending and prefix search of caches
    specs, allocation      the cache spec grammar (`fibquant:b=4/fibquant:b=2`, peers, `@decode`)
                           and per-layer rate allocation
    accounting             the bytes a cache or codec holds
    model                  model loading and the support checks
    options                `AttentionOptions`: the paths attention on codes takes (no module switches)
    headwise               per-head (and per-layer) codecs fitted per head
    roundtrip_cache        the peers' float round-trip cache
    heavy                  heavy tokens kept at a second, higher rate (`@heavy=`)
"""
# Wires persistence into CompressedCache.save / load (see fibquant.kv.cache.register_persistence).
import fibquant.kv.persist  # noqa: F401
