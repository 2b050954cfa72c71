"""fibquant: universal vector quantization of transformer KV caches.

Public names are imported lazily so that `import fibquant` stays cheap and the
heavy framework glue (transformers, model files) loads only when used.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    # codecs
    "Codec": "fibquant.codecs.base",
    "FibQuantCodec": "fibquant.codecs.fibquant",
    "TurboQuantCodec": "fibquant.codecs.turboquant",
    "IntCodec": "fibquant.codecs.integer",
    "LowRankCodec": "fibquant.codecs.lowrank",
    "RVQCodec": "fibquant.codecs.rvq",
    # codebooks and canonical source
    "build_codebook": "fibquant.codebook",
    "load_codebook": "fibquant.codebook",
    # KV cache and real components
    "CompressedCache": "fibquant.kv.cache",
    "use_coded_attention": "fibquant.kv.attention",
    "load_model": "fibquant.kv.model",
    "cache_kwarg": "fibquant.kv.model",
    "load_text": "fibquant.data.text",
    "load_bigbench_task": "fibquant.data.bigbench",
    # archive
    "Archive": "fibquant.archive",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fibquant' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
