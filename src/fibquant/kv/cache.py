"""A transformers `Cache` that really holds compressed KV codes.

Layout of one layer (tensors are [batch, kv_heads, tokens, ...]):

    position:  0 .. s-1         s .. s+m-1                 s+m .. s+m+r-1
    storage:   exact sinks      packed codes (uint8 rows)  exact recent window
               [B, H, s, D]     [B, H, m, code_size]       [B, H, r, D]

with s <= sink_tokens and r < recent_tokens + encode_batch. Tokens between the sinks and the recent
window exist only as the codec's uint8 codes; no float copy of them is kept anywhere. The
codes live in a buffer [B, H, capacity, code_size] grown geometrically (by 1/16), so appending
a token copies nothing already stored but at a growth (amortised O(1)); `nbytes()` counts the
reserved capacity,
`used_nbytes()` only the stored tokens.

Semantics of one `update(key_states, value_states)` with T new tokens (a prefill chunk or
one decoded token): the new tokens attend to

    [exact sinks, the coded tokens, exact recent window, exact new T tokens]

i.e. every token archived *before* this update is read through its codes, while the tokens
of the current chunk are seen exactly (they are being computed in this pass). After that
the new tokens enter the cache: the first `sink_tokens` of the sequence stay exact forever,
the newest `recent_tokens` stay exact, and once at least `encode_batch` tokens have slid out
of the recent window they are encoded together and their float copies dropped (encoding one
token per layer per step costs more in call overhead than the attention itself; with
`encode_batch=1` every token is encoded as soon as it leaves the window). Hence a query at
offset o of a chunk of C tokens sees at least `recent_tokens + 1` newest tokens exactly; with
token-by-token decoding (C = 1) it sees exactly the sinks, the previous `recent_tokens`
(to `recent_tokens + encode_batch - 1`) tokens and itself.

With `centre=True` a layer subtracts a fixed mean key and mean value [B, H, D] (of the first
tokens it encodes, e.g. the prefill: calibration-free, one vector per head) before encoding,
and adds it back on every read: the codec's bits go to what varies between tokens.

Two ways to read the coded part (`attention=`):

- "decode" (the reference): `update` returns float keys/values with the coded part decoded,
  for any attention implementation;
- "codes": `update` returns a `CodedKV` snapshot (no float copy of the coded part) that the
  attention function of `fibquant.kv.attention` scores directly from the codes; the model
  must use it (`CompressedCache.for_model` sets that up).

Tested against the Cache / CacheLayerMixin contract of transformers 5.x.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache

from fibquant.codecs.base import Codec
from fibquant.kv.codes import CodeBuffer, CodedKV
from fibquant.kv.layer import ATTENTION_MODES, CompressedLayer, _check_attention
from fibquant.kv.memory import _per_token, codec_state_nbytes, dynamic_cache_bytes_per_token, dynamic_cache_nbytes
from fibquant.kv.model import check_model_supported

# The layer, its code storage, the model check and the byte counts live in kv/layer.py, kv/codes.py,
# kv/model.py and kv/memory.py; they stay importable from here, where they were first defined.
__all__ = ["ATTENTION_MODES", "CodeBuffer", "CodedKV", "CompressedCache", "CompressedLayer", "check_model_supported",
           "codec_state_nbytes", "dynamic_cache_bytes_per_token", "dynamic_cache_nbytes"]


def _check_codec(codec, role: str) -> None:
    if not isinstance(codec, Codec):
        raise ValueError(f"{role} must be a fibquant Codec, got {type(codec).__name__}")


def _check_window(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


class CompressedCache(Cache):
    """KV cache holding tokens outside an exact window only as codec codes.

    key_codec / value_codec: fibquant codecs whose `dim` equals the model's head_dim (checked
    at the first update). sink_tokens / recent_tokens: sizes of the exact window (first and
    last tokens kept in the model's dtype). attention: "decode" (update returns floats, works
    with any attention implementation) or "codes" (attention runs on the codes; the model must
    use fibquant's attention function: build the cache with `for_model`, which sets it up).
    encode_batch: tokens leaving the window are encoded once this many have gathered (the
    window then holds up to recent_tokens + encode_batch - 1). centre: quantise keys and values
    minus a per-layer, per-head mean fixed at the first encode (see the module docstring).
    Layers are created lazily on first update. Pass it as `past_key_values=` to a forward pass
    or to `model.generate`.
    """

    def __init__(self, key_codec: Codec, value_codec: Codec, sink_tokens: int = 4, recent_tokens: int = 32,
                 attention: str = "decode", encode_batch: int = 16, centre: bool = False):
        _check_codec(key_codec, "key_codec")
        _check_codec(value_codec, "value_codec")
        self.key_codec, self.value_codec = key_codec, value_codec
        self.sink_tokens = _check_window(sink_tokens, "sink_tokens")
        self.recent_tokens = _check_window(recent_tokens, "recent_tokens")
        self.encode_batch = _check_window(encode_batch, "encode_batch")
        if self.encode_batch < 1:
            raise ValueError(f"encode_batch must be >= 1, got {encode_batch}")
        self.attention = _check_attention(attention)
        if not isinstance(centre, bool):
            raise ValueError(f"centre must be True or False, got {centre!r}")
        self.centre = centre
        super().__init__(layer_class_to_replicate=self._new_layer)

    def _new_layer(self) -> CompressedLayer:
        return CompressedLayer(self.key_codec, self.value_codec, self.sink_tokens, self.recent_tokens,
                               self.attention, self.encode_batch, self.centre)

    @classmethod
    def for_model(cls, model, key_codec: Codec, value_codec: Codec, sink_tokens: int = 4,
                  recent_tokens: int = 32, attention: str = "codes", encode_batch: int = 16,
                  centre: bool = False) -> "CompressedCache":
        """A cache for `model` after checking that the model's attention is supported.

        attention="codes" switches the model to fibquant's attention function (which serves
        every other cache as SDPA does); a model that cannot use it gets "decode" with a
        one-time warning.
        """
        check_model_supported(model, key_codec, value_codec)
        attention = _check_attention(attention)
        if attention == "codes":
            from fibquant.kv.attention import try_use_coded_attention

            if not try_use_coded_attention(model):
                attention = "decode"
        return cls(key_codec, value_codec, sink_tokens, recent_tokens, attention, encode_batch, centre)

    @classmethod
    def from_cache(cls, cache: Cache, key_codec: Codec, value_codec: Codec, sink_tokens: int = 4,
                   recent_tokens: int = 32, attention: str = "decode", model=None,
                   encode_batch: int = 16, centre: bool = False) -> "CompressedCache":
        """Compress an already computed cache (e.g. a `DynamicCache` after a float prefill).

        The result holds what this cache would hold had it seen the same tokens in one update:
        the first `sink_tokens` and last `recent_tokens` exact, the rest as codes. The source is
        left untouched. With `model` given, `for_model`'s checks and attention set-up apply.
        """
        if model is not None:
            target = cls.for_model(model, key_codec, value_codec, sink_tokens, recent_tokens, attention,
                                   encode_batch, centre)
        else:
            target = cls(key_codec, value_codec, sink_tokens, recent_tokens, attention, encode_batch, centre)
        for index, layer in enumerate(cache.layers):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                raise ValueError(f"from_cache: layer {index} of the source ({type(layer).__name__}) holds no "
                                 "float keys/values tensors (e.g. a linear-attention or uninitialised layer)")
            new_layer = target._new_layer()
            if keys.ndim == 4 and keys.shape[-2] > 0:
                new_layer.lazy_initialization(keys, values)
                new_layer._absorb(keys, values)
            target.layers.append(new_layer)
        return target

    def __repr__(self) -> str:
        return (f"CompressedCache(key={self.key_codec!r}, value={self.value_codec!r}, "
                f"sinks={self.sink_tokens}, recent={self.recent_tokens}, attention={self.attention!r}, "
                f"layers={len(self.layers)})")

    def nbytes(self) -> int:
        """Real bytes held by the cache: code buffers (reserved capacity included), exact sinks
        and recent windows, every layer."""
        return sum(layer.nbytes() for layer in self.layers)

    def used_nbytes(self) -> int:
        """Bytes of the stored tokens only (code rows in use + exact windows), every layer."""
        return sum(layer.used_nbytes() for layer in self.layers)

    def bytes_per_token(self) -> float:
        """used_nbytes / (batch * tokens): all layers, keys and values, window included."""
        return _per_token(self.used_nbytes(), self)

    def shared_nbytes(self) -> int:
        """Bytes of the codecs' shared state (codebooks, rotations), held once for the model."""
        return sum(codec_state_nbytes(c) for c in {id(c): c for c in (self.key_codec, self.value_codec)}.values())

    # ----------------------------------------------------------------- persistence (kv/persist.py)
    def coded_rows_since(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value code rows of coded tokens [start, num_coded) of every layer:
        uint8 [L, B, H, n, code_size] each (what a persistent writer appends)."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        if not layers:
            raise ValueError("coded_rows_since: the cache has not seen a token")
        return (torch.stack([layer.key_codes[..., start:, :] for layer in layers]),
                torch.stack([layer.value_codes[..., start:, :] for layer in layers]))

    def save(self, path, model, token_ids=None, *, append: bool = False, overwrite: bool = False,
             durable: bool = False, checkpoint_every: int = 64):
        """Write this cache (and its token ids) to the directory `path` (fibquant.kv.persist).

        `model` is the model that filled the cache (its config fingerprint is stored). With
        append=False the store is sealed and closed (returned closed). With append=True a
        `CacheWriter` is returned that stays open: pass it to `model.generate(...,
        stopping_criteria=[writer])` and every newly coded token is appended to the archive
        after each step (checkpoint every `checkpoint_every` tokens); `writer.close()` (or a
        `with` block) seals the end. See docs/persistent-cache.md."""
        from fibquant.kv.persist import save_cache

        if not append:
            return save_cache(self, path, model, token_ids, overwrite=overwrite, durable=durable)
        from fibquant.kv.persist import PersistentCache
        from fibquant.kv.persist_generate import CacheWriter

        save_cache(self, path, model, token_ids, overwrite=overwrite, durable=durable)
        store = PersistentCache.open(path, "a", model=model, durable=durable)
        return CacheWriter(store, self, checkpoint_every)

    @classmethod
    def load(cls, path, model=None, attention: Optional[str] = None) -> "CompressedCache":
        """The cache saved at `path`, bit for bit. With `model`, its fingerprint must match the
        saved one (ValueError otherwise) and the attention is set up as `for_model` does; the
        saved token ids are attached as `cache.token_ids` (int64 [n])."""
        from fibquant.kv.persist import PersistentCache

        with PersistentCache.open(path, model=model) as store:
            cache = store.to_cache(model, attention)
            cache.token_ids = store.token_ids()
        return cache

    @classmethod
    def from_layers(cls, layers: list["CompressedLayer"], attention: Optional[str] = None) -> "CompressedCache":
        """A cache made of already built layers (e.g. `CompressedLayer.from_state`), sharing their
        codecs and window; attention defaults to the first layer's."""
        if not layers:
            raise ValueError("from_layers needs at least one layer")
        first = layers[0]
        cache = cls(first.key_codec, first.value_codec, first.sink_tokens, first.recent_tokens,
                    attention or first.attention, first.encode_batch)
        for layer in layers:
            if attention is not None:
                layer.attention = _check_attention(attention)
            cache.layers.append(layer)
        return cache

