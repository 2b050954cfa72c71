"""A float KV cache that applies a quantizer's round trip outside the same exact window as
`CompressedCache`: for quantizers that offer only a round trip (the peers of
`fibquant.peers`), or to compare any two key / value quantizers under one protocol.

Layout of one layer ([batch, kv_heads, tokens, head_dim], all float):

    0 .. s-1          exact sinks
    s .. t-r-1        round-tripped once, when they left the recent window
    t-r .. t-1        exact recent window

Semantics of one `update(key_states, value_states)` with T new tokens, as `CompressedCache` with
`encode_batch=1`: the new tokens attend to [exact sinks, round-tripped tokens, exact recent
window, the exact new tokens]; then every token that has left the window is round-tripped (keys
with `key_roundtrip(x, start)`, values with `value_roundtrip(x, start)`, `start` the absolute
position of x's first token) and stored in place of its float copy. Bytes are not measured
here (the storage is float); the caller counts the quantizer's format.
"""
from __future__ import annotations

from typing import Callable

import torch
from transformers.cache_utils import Cache, DynamicLayer

from fibquant.kv.cache import _check_window

RoundTrip = Callable[[torch.Tensor, int], torch.Tensor]  # x [B, H, n, D], start position -> same shape


class RoundTripLayer(DynamicLayer):
    """One layer of a `RoundTripCache`."""

    is_croppable = False  # a crop inside the round-tripped part cannot restore the exact window

    def __init__(self, key_roundtrip: RoundTrip, value_roundtrip: RoundTrip, sink_tokens: int, recent_tokens: int):
        super().__init__()
        self.key_roundtrip, self.value_roundtrip = key_roundtrip, value_roundtrip
        self.sink_tokens, self.recent_tokens = sink_tokens, recent_tokens
        self.archived = 0  # tokens [0, archived) are sinks or round-tripped

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Return [B, H, seq_before + T, D] keys and values (what the new tokens attend to), then
        round-trip what left the window."""
        if key_states.ndim != 4 or value_states.ndim != 4:
            raise ValueError(f"RoundTripCache expects [batch, kv_heads, tokens, head_dim] states, got "
                             f"{tuple(key_states.shape)} and {tuple(value_states.shape)}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        start, end = max(self.archived, self.sink_tokens), keys.shape[-2] - self.recent_tokens
        if end > start:
            stored_keys, stored_values = keys.clone(), values.clone()
            stored_keys[..., start:end, :] = self.key_roundtrip(keys[..., start:end, :], start).to(keys.dtype)
            stored_values[..., start:end, :] = self.value_roundtrip(values[..., start:end, :], start).to(values.dtype)
            self.keys, self.values = stored_keys, stored_values
            self.archived = end
        else:
            self.keys, self.values = keys, values
        return keys, values

    def reset(self) -> None:
        super().reset()
        self.archived = 0


class RoundTripCache(Cache):
    """Float cache whose tokens outside the exact window are replaced by their round trip.

    key_roundtrip / value_roundtrip: callables (x [B, H, n, D], start) -> [B, H, n, D].
    sink_tokens / recent_tokens: the exact window (as in `CompressedCache`).
    """

    def __init__(self, key_roundtrip: RoundTrip, value_roundtrip: RoundTrip, sink_tokens: int = 4,
                 recent_tokens: int = 32):
        for name, fn in (("key_roundtrip", key_roundtrip), ("value_roundtrip", value_roundtrip)):
            if not callable(fn):
                raise ValueError(f"{name} must be callable (x, start) -> x_hat, got {type(fn).__name__}")
        self.key_roundtrip, self.value_roundtrip = key_roundtrip, value_roundtrip
        self.sink_tokens = _check_window(sink_tokens, "sink_tokens")
        self.recent_tokens = _check_window(recent_tokens, "recent_tokens")
        super().__init__(layer_class_to_replicate=self._new_layer)

    def _new_layer(self) -> RoundTripLayer:
        return RoundTripLayer(self.key_roundtrip, self.value_roundtrip, self.sink_tokens, self.recent_tokens)

    def format_nbytes(self, key_bytes: float, value_bytes: float) -> int:
        """Bytes this cache would hold in the quantizer's format: the exact sinks and recent window in
        the states' dtype, and key_bytes + value_bytes per round-tripped token, head and batch row."""
        total = 0.0
        for layer in self.layers:
            if not layer.is_initialized or layer.keys.ndim != 4:
                continue
            batch, heads, tokens, dim = layer.keys.shape
            coded = max(layer.archived - min(self.sink_tokens, layer.archived), 0)
            exact = tokens - coded
            total += batch * heads * (exact * dim * (layer.keys.element_size() + layer.values.element_size())
                                      + coded * (key_bytes + value_bytes))
        return int(round(total))

    @classmethod
    def from_cache(cls, cache: Cache, key_roundtrip: RoundTrip, value_roundtrip: RoundTrip, sink_tokens: int = 4,
                   recent_tokens: int = 32) -> "RoundTripCache":
        """What this cache would hold had it seen `cache`'s tokens in one update (the source is untouched)."""
        target = cls(key_roundtrip, value_roundtrip, sink_tokens, recent_tokens)
        for index, layer in enumerate(cache.layers):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.ndim != 4:
                raise ValueError(f"from_cache: layer {index} of the source ({type(layer).__name__}) holds no "
                                 "float keys/values tensors")
            new_layer = target._new_layer()
            new_layer.update(keys, values)
            target.layers.append(new_layer)
        return target
