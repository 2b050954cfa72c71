"""Memory accounting for KV caches: the bytes a cache or a codec holds.

`cache_nbytes(cache)` is the one count every benchmark uses (the hot bytes: codes, exact window, any
index); `cold_nbytes(cache)` counts a cold tier apart (`fibquant.kv.cold`) and `cold_reads(cache)` what
was read from it; the helpers below them count one kind of cache each. Storage shared by several tensors is counted once.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache

from fibquant.kv.layer import CompressedLayer


def codec_state_nbytes(codec) -> int:
    """Bytes of the tensors a codec holds (codebooks, rotations, per-device tables), each storage once:
    the storages of `codec.shared_tensors()` (see `fibquant.codecs.base.Codec`)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in codec.shared_tensors()}
    return sum(storages.values())


def cache_nbytes(cache: Cache, format_bytes: Optional[tuple[float, float]] = None, stored: bool = False) -> int:
    """Bytes a KV cache holds:

    - `CompressedCache`: `nbytes()`, the exact windows + the code buffers with their reserved capacity
      (with `stored`: `used_nbytes()`, the stored tokens only, counted as the peers' formats are);
    - `RoundTripCache`: what its quantizer's format would hold (its storage is float), with
      `format_bytes` = (key bytes, value bytes) per stored vector (ValueError without it);
    - transformers' `QuantizedCache`: quantized storage + float residual (`quantized_cache_nbytes`);
    - any other cache (e.g. `DynamicCache`): the storage of every layer's keys and values.
    """
    # Duck-typed, so that the caches below can use this module's counts without a cycle.
    if callable(getattr(cache, "format_nbytes", None)):  # RoundTripCache
        if format_bytes is None:
            raise ValueError("a RoundTripCache stores floats: pass format_bytes=(key bytes, value bytes) per vector "
                             "of its quantizer's format")
        return cache.format_nbytes(*format_bytes)
    if callable(getattr(cache, "nbytes", None)):  # CompressedCache (and its layered variants)
        return cache.used_nbytes() if stored else cache.nbytes()
    if _is_quantized_cache(cache):
        return quantized_cache_nbytes(cache)["total"]
    return dynamic_cache_nbytes(cache)


def cold_nbytes(cache: Cache) -> int:
    """Bytes of a cache's cold tier (`CompressedCache.cold_nbytes`: the exact rows that recall reads, in host
    memory or on disk), 0 for any cache without one. Never part of `cache_nbytes`, the hot bytes."""
    count = getattr(cache, "cold_nbytes", None)
    return count() if callable(count) else 0


def cold_reads(cache: Cache) -> dict:
    """{"rows", "bytes", "calls"} read from a cache's cold tier so far (`CompressedCache.cold_reads`); zeros
    for a cache without one."""
    reads = getattr(cache, "cold_reads", None)
    return reads() if callable(reads) else {"rows": 0, "bytes": 0, "calls": 0}


def _is_quantized_cache(cache) -> bool:
    try:
        from transformers.cache_utils import QuantizedCache
    except ImportError:  # a transformers without quantized caches
        return False
    return isinstance(cache, QuantizedCache)


def _storage_nbytes(obj, seen: set) -> int:
    """Bytes of every distinct storage reachable from `obj`: tensors, tensor subclasses
    (through `__tensor_flatten__`, e.g. quanto's packed tensors), tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(_storage_nbytes(getattr(obj, n), seen) for n in names)
        storage = obj.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.nbytes() == 0 or key in seen:
            return 0
        seen.add(key)
        return storage.nbytes()
    if isinstance(obj, dict):
        return sum(_storage_nbytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_storage_nbytes(v, seen) for v in obj)
    return 0


def dynamic_cache_nbytes(cache: Cache) -> int:
    """Bytes of storage held by an uncompressed cache (e.g. `DynamicCache`), all layers."""
    return _storage_nbytes([[layer.keys, layer.values] for layer in cache.layers], set())


def dynamic_cache_bytes_per_token(cache: Cache) -> float:
    """dynamic_cache_nbytes / (batch * tokens)."""
    return _per_token(dynamic_cache_nbytes(cache), cache)


def _per_token(total: int, cache: Cache) -> float:
    """total / (batch * tokens) of `cache`; 0.0 for an empty cache."""
    tokens = cache.get_seq_length()
    if tokens == 0 or not cache.layers or not cache.layers[0].is_initialized:
        return 0.0
    first = cache.layers[0]
    # A compressed layer's `keys` decodes every code: read its batch size from the exact window instead.
    batch = first.batch_size if isinstance(first, CompressedLayer) else first.keys.shape[0]
    return total / (batch * tokens)


def quantized_cache_nbytes(cache) -> dict:
    """Bytes held by a transformers `QuantizedCache`: {"quantized", "residual", "total"}.

    quantized: storage of every layer's `_quantized_keys` / `_quantized_values` (quanto: the
    packed integer data plus per-group scale and shift; hqq: the packed uint8 tensor plus the
    scale and zero tensors of its meta dict), each storage counted once at its real size;
    residual: storage of the float residual window (`keys` / `values`) each layer keeps.
    """
    seen: set = set()
    quantized = residual = 0
    for layer in cache.layers:
        quantized += _storage_nbytes([getattr(layer, "_quantized_keys", None),
                                      getattr(layer, "_quantized_values", None)], seen)
        residual += _storage_nbytes([getattr(layer, "keys", None), getattr(layer, "values", None)], seen)
    return {"quantized": quantized, "residual": residual, "total": quantized + residual}
