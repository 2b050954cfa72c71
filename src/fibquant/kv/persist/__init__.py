"""Persistent KV caches: a `CompressedCache` saved to a directory of fractal archives, reopened
bit for bit, appended to while generating, searched by prefix.

    store     `PersistentCache` (open / append / seal / to_cache), `save_cache`, `load_cache`
    generate  `CacheWriter` (a stopping criterion that appends each step), `generate_persistent`,
              `resume_generate`
    prefix    `find_prefix`, `prefill_with_prefix` (reuse the longest saved prefix of a prompt)
    read      `PersistentCacheReader` (lazy, read-only access to the code streams)
    format / state / entries   the on-disk layout, the manifest and exact state, codec entries

Importing this package also gives `CompressedCache.save` / `CompressedCache.load` their storage
(registered through `fibquant.kv.cache.register_persistence`, so the cache never imports it).
"""
from fibquant.kv.cache import register_persistence
from fibquant.kv.persist.generate import CacheWriter, generate_persistent, resume_generate
from fibquant.kv.persist.prefix import find_prefix, prefill_with_prefix
from fibquant.kv.persist.read import PersistentCacheReader
from fibquant.kv.persist.store import PersistentCache, load_cache, save_cache

register_persistence(save_cache, PersistentCache, CacheWriter)

__all__ = ["CacheWriter", "PersistentCache", "PersistentCacheReader", "find_prefix", "generate_persistent",
           "load_cache", "prefill_with_prefix", "resume_generate", "save_cache"]
