"""fibquant: universal vector quantization of transformer KV caches.

Public names, by area (each imported lazily from its module, so `import fibquant` stays cheap
and the heavy framework glue — transformers, model files — loads only when used):

- codecs: `Codec`, `FibQuantCodec`, `E8ShellCodec`, `FibRVQCodec`, `TurboQuantCodec`, `IntCodec`,
  `LowRankCodec`, `RVQCodec`, `IdentityCodec`; `parse_codec_spec` (spec strings such as "fibquant:b=2", `.build(dim)`), `load_codec`;
  codebooks `build_codebook`, `load_codebook`
- caches: `CompressedCache` (`CompressedCache.for_model(model, "e8shell:b=2,nc=1")`), `attention_on_codes`
  (the explicit, reversible switch of a model to attention on codes; `AttentionNotOnCodes` without it),
  `choose_code` (budget first: the best shipped code for a ratio or bytes per token), `parse_cache_spec`
  ("fibquant:b=4/fibquant:b=2", "ratio=6", peers, "@decode", "@recall=32"), `Recall` (exact rows recalled
  from a cold tier: `for_model(model, code, recall=Recall(tokens=32))`), `build_cache` (any spec: fp, ours, a peer),
  `attend_codes`, `cache_nbytes`, `load_model`, `check_model_supported`, `cache_kwarg`
- persistence: `PersistentCache`, `save_cache`, `load_cache`, `CacheWriter`,
  `generate_persistent`, `resume_generate`, `find_prefix`, `prefill_with_prefix`
- archive: `Archive`, `CodeArchive`
- peers: `parse_peer`, `build_peer`
- data: `load_text`, `list_texts`, `load_bigbench_task`
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_AREAS = {
    "codecs": {
        "fibquant.codecs.base": ("Codec",),
        "fibquant.codecs.fibquant": ("FibQuantCodec",),
        "fibquant.codecs.turboquant": ("TurboQuantCodec",),
        "fibquant.codecs.integer": ("IntCodec",),
        "fibquant.codecs.lowrank": ("LowRankCodec",),
        "fibquant.codecs.rvq": ("RVQCodec",),
        "fibquant.codecs.e8shell": ("E8ShellCodec",),
        "fibquant.codecs.fibrvq": ("FibRVQCodec",),
        "fibquant.codecs.identity": ("IdentityCodec",),
        "fibquant.codecs.registry": ("parse_codec_spec", "load_codec"),
        "fibquant.codebook": ("build_codebook", "load_codebook"),
    },
    "caches": {
        "fibquant.kv.cache": ("CompressedCache",),
        "fibquant.kv.cold": ("Recall",),
        "fibquant.kv.specs": ("parse_cache_spec",),
        "fibquant.kv.budget": ("choose_code",),
        "fibquant.kv.build": ("build_cache",),
        "fibquant.kv.attention.switch": ("attention_on_codes", "AttentionNotOnCodes"),
        "fibquant.kv.attention": ("attend_codes",),
        "fibquant.kv.accounting": ("cache_nbytes",),
        "fibquant.kv.model": ("load_model", "check_model_supported", "cache_kwarg"),
    },
    "persistence": {
        "fibquant.kv.persist": ("PersistentCache", "save_cache", "load_cache", "CacheWriter", "generate_persistent",
                                "resume_generate", "find_prefix", "prefill_with_prefix"),
    },
    "archive": {
        "fibquant.archive": ("Archive", "CodeArchive"),
    },
    "peers": {
        "fibquant.peers": ("parse_peer", "build_peer"),
    },
    "data": {
        "fibquant.data.text": ("load_text", "list_texts"),
        "fibquant.data.bigbench": ("load_bigbench_task",),
    },
}
_EXPORTS = {name: module for area in _AREAS.values() for module, names in area.items() for name in names}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fibquant' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
