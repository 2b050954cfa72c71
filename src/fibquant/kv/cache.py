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

from dataclasses import dataclass
from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from fibquant.codecs.base import Codec

_FLOAT_FIELDS = ("sink_keys", "sink_values", "recent_keys", "recent_values")
ATTENTION_MODES = ("codes", "decode")
MIN_GROWTH = 64      # code rows added at least when a buffer grows
GROWTH_FRACTION = 16  # ... and at least capacity / 16: copies stay amortised O(1), reserve <= 6.25 %


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes (a slice would keep its parent's storage alive)."""
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() or not tensor.is_contiguous():
        return tensor.contiguous().clone()
    return tensor


def _check_codec(codec, role: str) -> None:
    if not isinstance(codec, Codec):
        raise ValueError(f"{role} must be a fibquant Codec, got {type(codec).__name__}")


def _check_window(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _check_attention(value) -> str:
    if value not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {value!r}")
    return value


class CodeBuffer:
    """Append-only rows of uint8 codes [B, H, capacity, code_size], grown geometrically.

    Growth adds max(capacity / 16, 64) rows (or what the append needs): each stored row is copied
    O(1) times on average (at most ~16 times), and the reserve never exceeds 6.25 % of the
    capacity (+64 rows).

    `view()` is [B, H, used, code_size]; a view taken before an append stays valid (appends
    write past it, and growth copies into a new buffer without touching the old one).
    """

    def __init__(self, batch: int, heads: int, code_size: int, device: torch.device):
        self.data = torch.empty(batch, heads, 0, code_size, dtype=torch.uint8, device=device)
        self.used = 0

    @classmethod
    def from_rows(cls, rows: torch.Tensor) -> "CodeBuffer":
        buffer = cls(rows.shape[0], rows.shape[1], rows.shape[-1], rows.device)
        buffer.data, buffer.used = _owned(rows), rows.shape[-2]
        return buffer

    @property
    def capacity(self) -> int:
        return self.data.shape[-2]

    def view(self) -> torch.Tensor:
        return self.data[..., : self.used, :]

    def append(self, rows: torch.Tensor) -> None:
        """rows: uint8 [B, H, n, code_size]."""
        n = rows.shape[-2]
        if self.used + n > self.capacity:
            capacity = max(self.capacity + max(self.capacity // GROWTH_FRACTION, MIN_GROWTH), self.used + n)
            grown = torch.empty(*self.data.shape[:2], capacity, self.data.shape[-1], dtype=torch.uint8,
                                device=self.data.device)
            grown[..., : self.used, :] = self.view()
            self.data = grown
        self.data[..., self.used: self.used + n, :] = rows
        self.used += n

    def truncate(self, used: int) -> None:
        self.used = min(self.used, max(used, 0))

    def remap(self, fn) -> None:
        """Apply a batch edit (select, repeat, move) to the stored rows; capacity shrinks to fit."""
        self.data = _owned(fn(self.view()))
        self.used = self.data.shape[-2]

    def nbytes(self) -> int:
        return self.data.untyped_storage().nbytes()

    def used_nbytes(self) -> int:
        return self.view().numel()


@dataclass(frozen=True)
class CodedKV:
    """What the new tokens of one update attend to, with the coded part still as codes.

    Column order (= absolute token order): sinks [B,H,s,D], coded [B,H,m,code_size] (uint8),
    recent [B,H,r,D], new [B,H,T,D]. Returned by `CompressedLayer.update` in "codes" mode in
    place of both the key and the value tensor; `materialize()` gives the reference floats.
    """

    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    key_codes: torch.Tensor
    value_codes: torch.Tensor
    recent_keys: torch.Tensor
    recent_values: torch.Tensor
    new_keys: torch.Tensor
    new_values: torch.Tensor
    key_codec: Codec
    value_codec: Codec
    key_mean: Optional[torch.Tensor] = None    # [B, H, D] float32 added back to decoded keys (centring)
    value_mean: Optional[torch.Tensor] = None  # [B, H, D] float32 added back to decoded values

    @property
    def num_sink(self) -> int:
        return self.sink_keys.shape[-2]

    @property
    def num_coded(self) -> int:
        return self.key_codes.shape[-2]

    @property
    def length(self) -> int:
        return self.num_sink + self.num_coded + self.recent_keys.shape[-2] + self.new_keys.shape[-2]

    def exact(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact part after the codes (recent window + new tokens), [B, H, r+T, D] each."""
        dtype_k, dtype_v = self.new_keys.dtype, self.new_values.dtype
        return (torch.cat([self.recent_keys.to(dtype_k), self.new_keys], dim=-2),
                torch.cat([self.recent_values.to(dtype_v), self.new_values], dim=-2))

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Float keys and values [B, H, length, D]: the coded part decoded (the reference path)."""
        exact_keys, exact_values = self.exact()
        keys = torch.cat([self.sink_keys.to(exact_keys.dtype),
                          _decode_centred(self.key_codec, self.key_codes, self.key_mean, exact_keys.dtype),
                          exact_keys], dim=-2)
        values = torch.cat([self.sink_values.to(exact_values.dtype),
                            _decode_centred(self.value_codec, self.value_codes, self.value_mean, exact_values.dtype),
                            exact_values], dim=-2)
        return keys, values

    def __getattr__(self, name: str):
        # Only reached for attributes a CodedKV does not have, i.e. when an attention function
        # other than fibquant's treats it as a tensor: say what to do instead of failing obscurely.
        raise AttributeError(
            f"CodedKV has no attribute {name!r}: a CompressedCache with attention='codes' must be used by a model "
            "whose attention implementation is 'fibquant' (CompressedCache.for_model or "
            "fibquant.kv.attention.use_coded_attention(model) set it), or create the cache with attention='decode'")


def _decode_centred(codec: Codec, codes: torch.Tensor, mean: Optional[torch.Tensor], dtype) -> torch.Tensor:
    """codec.decode(codes) [B, H, m, D], plus the layer's mean [B, H, D] when the cache centres."""
    if mean is None:
        return codec.decode(codes, dtype=dtype)
    return (codec.decode(codes) + mean.unsqueeze(-2)).to(dtype)


class CompressedLayer(CacheLayerMixin):
    """One layer of a `CompressedCache` (see the module docstring for the semantics)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False  # a crop inside the coded part cannot restore the exact recent window

    def __init__(self, key_codec: Codec, value_codec: Codec, sink_tokens: int, recent_tokens: int,
                 attention: str = "decode", encode_batch: int = 1, centre: bool = False):
        # CacheLayerMixin.__init__ would create float `keys`/`values` slots; this layer has none.
        self.key_codec = key_codec
        self.value_codec = value_codec
        self.sink_tokens = sink_tokens
        self.recent_tokens = recent_tokens
        self.encode_batch = max(1, encode_batch)
        self.attention = _check_attention(attention)
        self.centre = bool(centre)
        # Centring: the mean key / value [B, H, D] (float32) of the first tokens this layer encodes,
        # subtracted before every encode and added back on every read; None until then.
        self.key_mean: Optional[torch.Tensor] = None
        self.value_mean: Optional[torch.Tensor] = None
        self.is_initialized = False
        for name in _FLOAT_FIELDS:
            setattr(self, name, None)
        self.key_buffer: Optional[CodeBuffer] = None
        self.value_buffer: Optional[CodeBuffer] = None

    def __repr__(self) -> str:
        return (f"CompressedLayer(tokens={self.get_seq_length()}, sinks={self.num_sink}, "
                f"coded={self.num_coded}, recent={self.num_recent}, attention={self.attention!r})")

    # ----------------------------------------------------------------- bookkeeping
    @property
    def num_sink(self) -> int:
        return 0 if self.sink_keys is None else self.sink_keys.shape[-2]

    @property
    def num_coded(self) -> int:
        return 0 if self.key_buffer is None else self.key_buffer.used

    @property
    def num_recent(self) -> int:
        return 0 if self.recent_keys is None else self.recent_keys.shape[-2]

    @property
    def key_codes(self) -> Optional[torch.Tensor]:
        """Stored key codes, uint8 [B, H, num_coded, key code_size] (a view of the buffer)."""
        return None if self.key_buffer is None else self.key_buffer.view()

    @property
    def value_codes(self) -> Optional[torch.Tensor]:
        return None if self.value_buffer is None else self.value_buffer.view()

    @property
    def batch_size(self) -> int:
        return self.sink_keys.shape[0] if self.is_initialized else -1

    def _float_tensors(self) -> list[torch.Tensor]:
        """The exact window (sinks, recent) and, when centring, the means: every float tensor held."""
        means = [t for t in (self.key_mean, self.value_mean) if t is not None]
        return [getattr(self, name) for name in _FLOAT_FIELDS] + means

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds (code buffers with their reserved capacity)."""
        if not self.is_initialized:
            return []
        return self._float_tensors() + [self.key_buffer.data, self.value_buffer.data]

    def nbytes(self) -> int:
        """Bytes of storage held by this layer, reserved code capacity included."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    def used_nbytes(self) -> int:
        """Bytes of the stored tokens only: exact window (+ means) + num_coded code rows."""
        if not self.is_initialized:
            return 0
        return (sum(t.numel() * t.element_size() for t in self._float_tensors())
                + self.key_buffer.used_nbytes() + self.value_buffer.used_nbytes())

    # ----------------------------------------------------------------- contract
    def lazy_initialization(self, key_states: torch.Tensor, value_states: Optional[torch.Tensor] = None):
        value_states = key_states if value_states is None else value_states
        self._check_states(key_states, value_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads = key_states.shape[:2]

        def empty(last: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(batch, heads, 0, last, dtype=dtype, device=self.device)

        self.sink_keys, self.recent_keys = empty(self.key_codec.dim, self.dtype), empty(self.key_codec.dim, self.dtype)
        self.sink_values = empty(self.value_codec.dim, value_states.dtype)
        self.recent_values = empty(self.value_codec.dim, value_states.dtype)
        self.key_buffer = CodeBuffer(batch, heads, self.key_codec.code_size, self.device)
        self.value_buffer = CodeBuffer(batch, heads, self.value_codec.code_size, self.device)
        self.is_initialized = True

    def _check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        for name, states in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(states, torch.Tensor) or states.ndim != 4:
                shape = tuple(states.shape) if isinstance(states, torch.Tensor) else type(states).__name__
                raise ValueError(f"CompressedCache expects {name} of shape [batch, kv_heads, tokens, head_dim], "
                                 f"got {shape}")
            if not states.is_floating_point():
                raise ValueError(f"CompressedCache expects floating {name}, got dtype {states.dtype}")
        if key_states.shape[-1] != self.key_codec.dim:
            raise ValueError(f"key head_dim {key_states.shape[-1]} differs from the key codec dim "
                             f"{self.key_codec.dim} ({self.key_codec!r})")
        if value_states.shape[-1] != self.value_codec.dim:
            raise ValueError(f"value head_dim {value_states.shape[-1]} differs from the value codec dim "
                             f"{self.value_codec.dim} ({self.value_codec!r})")
        if key_states.shape[:3] != value_states.shape[:3]:
            raise ValueError(f"key and value states disagree on [batch, heads, tokens]: "
                             f"{tuple(key_states.shape)} vs {tuple(value_states.shape)}")
        if self.is_initialized and tuple(key_states.shape[:2]) != tuple(self.sink_keys.shape[:2]):
            raise ValueError(f"[batch, kv_heads] changed from {tuple(self.sink_keys.shape[:2])} to "
                             f"{tuple(key_states.shape[:2])}; use batch_select_indices/reorder_cache")

    def snapshot(self, key_states: torch.Tensor, value_states: torch.Tensor) -> CodedKV:
        """What tokens `key_states`/`value_states` [B, H, T, D] attend to, before they are stored."""
        return CodedKV(self.sink_keys, self.sink_values, self.key_codes, self.value_codes, self.recent_keys,
                       self.recent_values, key_states, value_states, self.key_codec, self.value_codec,
                       self.key_mean, self.value_mean)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Return what the new tokens attend to, then archive what left the window.

        key_states, value_states: [batch, kv_heads, T, head_dim]. "decode" mode returns two
        float tensors [batch, kv_heads, seq_length_before + T, head_dim] in the inputs' dtype;
        "codes" mode returns the same `CodedKV` twice (read by fibquant's attention function).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_states(key_states, value_states)
        view = self.snapshot(key_states, value_states)
        self._absorb(key_states, value_states)
        if self.attention == "codes":
            return view, view
        return view.materialize()

    def _absorb(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store new tokens: fill the sinks first, then the recent window; encode the overflow."""
        to_sink = max(min(self.sink_tokens - self.num_sink, key_states.shape[-2]), 0)
        if to_sink > 0:
            self.sink_keys = _owned(torch.cat([self.sink_keys, key_states[..., :to_sink, :]], dim=-2))
            self.sink_values = _owned(torch.cat([self.sink_values, value_states[..., :to_sink, :]], dim=-2))
        recent_keys = torch.cat([self.recent_keys, key_states[..., to_sink:, :]], dim=-2)
        recent_values = torch.cat([self.recent_values, value_states[..., to_sink:, :]], dim=-2)
        overflow = recent_keys.shape[-2] - self.recent_tokens
        if overflow >= self.encode_batch:
            leaving_keys, leaving_values = recent_keys[..., :overflow, :], recent_values[..., :overflow, :]
            if self.centre:
                if self.key_mean is None:  # fixed once, from the first tokens encoded (e.g. the prefill)
                    self.key_mean = leaving_keys.to(torch.float32).mean(dim=-2)
                    self.value_mean = leaving_values.to(torch.float32).mean(dim=-2)
                leaving_keys = leaving_keys.to(torch.float32) - self.key_mean.unsqueeze(-2)
                leaving_values = leaving_values.to(torch.float32) - self.value_mean.unsqueeze(-2)
            self.key_buffer.append(self.key_codec.encode(leaving_keys))
            self.value_buffer.append(self.value_codec.encode(leaving_values))
            recent_keys, recent_values = recent_keys[..., overflow:, :], recent_values[..., overflow:, :]
        # The recent slice is copied so the dropped (now encoded) floats are really freed.
        self.recent_keys, self.recent_values = _owned(recent_keys), _owned(recent_values)

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # transformers < 5 passed cache_position
            query_length = query_length.shape[0]
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.num_sink + self.num_coded + self.num_recent

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length

    # ----------------------------------------------------------------- read-back views
    @property
    def keys(self) -> Optional[torch.Tensor]:
        """All keys [batch, kv_heads, seq, head_dim], decoded on request (not stored)."""
        if not self.is_initialized:
            return None
        return torch.cat([self.sink_keys,
                          _decode_centred(self.key_codec, self.key_codes, self.key_mean, self.sink_keys.dtype),
                          self.recent_keys], dim=-2)

    @property
    def values(self) -> Optional[torch.Tensor]:
        """All values [batch, kv_heads, seq, head_dim], decoded on request (not stored)."""
        if not self.is_initialized:
            return None
        return torch.cat([self.sink_values,
                          _decode_centred(self.value_codec, self.value_codes, self.value_mean, self.sink_values.dtype),
                          self.recent_values], dim=-2)

    # ----------------------------------------------------------------- persistence (kv/persist.py)
    @classmethod
    def from_state(cls, key_codec: Codec, value_codec: Codec, sink_tokens: int, recent_tokens: int,
                   state: dict, key_codes: torch.Tensor, value_codes: torch.Tensor, attention: str = "decode",
                   encode_batch: int = 1) -> "CompressedLayer":
        """An initialised layer holding `state` (sink_keys, sink_values, recent_keys, recent_values:
        [B, H, s|r, D] floats, copied) and the code rows uint8 [B, H, m, code_size] (owned)."""
        layer = cls(key_codec, value_codec, sink_tokens, recent_tokens, attention, encode_batch)
        layer.lazy_initialization(state["sink_keys"], state["sink_values"])
        for name in _FLOAT_FIELDS:
            setattr(layer, name, state[name].clone())
        for role, codes, codec in (("key", key_codes, key_codec), ("value", value_codes, value_codec)):
            if codes.dtype != torch.uint8 or codes.ndim != 4 or codes.shape[-1] != codec.code_size \
                    or tuple(codes.shape[:2]) != tuple(state["sink_keys"].shape[:2]):
                raise ValueError(f"{role} codes must be uint8 [B, H, m, {codec.code_size}], got "
                                 f"{codes.dtype} {tuple(codes.shape)}")
        if key_codes.shape[-2] != value_codes.shape[-2]:
            raise ValueError(f"{key_codes.shape[-2]} key code rows but {value_codes.shape[-2]} value code rows")
        layer.key_buffer = CodeBuffer.from_rows(key_codes)
        layer.value_buffer = CodeBuffer.from_rows(value_codes)
        return layer

    # ----------------------------------------------------------------- editing
    def _apply(self, fn) -> None:
        if self.is_initialized:
            for name in _FLOAT_FIELDS:
                setattr(self, name, _owned(fn(getattr(self, name))))
            self.key_buffer.remap(fn)
            self.value_buffer.remap(fn)
            if self.key_mean is not None:  # [B, H, D]: batch edits apply, token edits do not
                self.key_mean, self.value_mean = fn(self.key_mean), fn(self.value_mean)

    def reset(self) -> None:
        self.key_mean = self.value_mean = None
        self._apply(lambda t: t[..., :0, :])

    def crop(self, max_length: int) -> None:
        """Drop `-max_length` tokens from the end (transformers 5 passes a negative count);
        a non-negative value keeps the first `max_length` tokens.

        Tokens keep the form they are stored in: if the cut falls inside the coded part, the
        recent window is empty until new tokens arrive (nothing is re-created exactly).
        """
        if max_length < 0:
            max_length = self.get_seq_length() - abs(max_length)
        max_length = max(max_length, 0)
        if self.get_seq_length() <= max_length:
            return
        keep_sink = min(self.num_sink, max_length)
        keep_coded = min(self.num_coded, max_length - keep_sink)
        keep_recent = max_length - keep_sink - keep_coded
        for prefix, keep in (("sink", keep_sink), ("recent", keep_recent)):
            for kind in ("keys", "values"):
                name = f"{prefix}_{kind}"
                setattr(self, name, _owned(getattr(self, name)[..., :keep, :]))
        self.key_buffer.truncate(keep_coded)
        self.value_buffer.truncate(keep_coded)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices.to(t.device)])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def offload(self) -> None:
        self._apply(lambda t: t.to("cpu"))

    def prefetch(self) -> None:
        if self.is_initialized:
            self._apply(lambda t: t.to(self.device))


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


def _per_token(total: int, cache: Cache) -> float:
    tokens = cache.get_seq_length()
    if tokens == 0 or not cache.layers or not cache.layers[0].is_initialized:
        return 0.0
    batch = cache.layers[0].batch_size if isinstance(cache, CompressedCache) else cache.layers[0].keys.shape[0]
    return total / (batch * tokens)


def codec_state_nbytes(codec) -> int:
    """Bytes of the tensors a codec holds (codebooks, rotations, per-device tables), each storage once.

    Walks attributes, dicts, lists and fibquant objects (e.g. the lazily loaded `Codebook` and
    `RotationState`), so state kept behind helper objects is counted too.
    """
    seen, total, stack = set(), 0, [codec]
    visited = set()
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif type(item).__module__.startswith("fibquant") and hasattr(item, "__dict__") and id(item) not in visited:
            visited.add(id(item))
            stack.extend(vars(item).values())
    return total


def dynamic_cache_nbytes(cache: Cache) -> int:
    """Bytes of storage held by an uncompressed cache (e.g. `DynamicCache`), all layers."""
    seen, total = set(), 0
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def dynamic_cache_bytes_per_token(cache: Cache) -> float:
    """dynamic_cache_nbytes / (batch * tokens)."""
    return _per_token(dynamic_cache_nbytes(cache), cache)


def check_model_supported(model, key_codec: Optional[Codec] = None, value_codec: Optional[Codec] = None) -> dict:
    """Check that `model` (or its config) has plain full causal self-attention with a standard cache.

    Returns {"layers", "kv_heads", "head_dim"}; raises ValueError naming the problem otherwise.
    """
    config = getattr(model, "config", model)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("CompressedCache supports decoder-only models; this model is encoder-decoder")
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    for attr in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if not getattr(config, attr, None):
            raise ValueError(f"unsupported model: its config has no {attr} (not a standard attention model)")
    if getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None):
        raise ValueError("unsupported model: sliding-window/chunked attention is not supported by CompressedCache")
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"unsupported model: layer types {sorted(set(layer_types))}; only full_attention")
    if getattr(config, "kv_lora_rank", None) or getattr(config, "v_head_dim", None):
        raise ValueError("unsupported model: latent/decoupled KV attention (MLA) has a non-standard cache")
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv_heads < 1 or config.num_attention_heads % kv_heads:
        raise ValueError(f"unsupported model: {config.num_attention_heads} query heads and {kv_heads} KV heads")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for role, codec in (("key", key_codec), ("value", value_codec)):
        if codec is not None and codec.dim != head_dim:
            raise ValueError(f"model head_dim {head_dim} differs from the {role} codec dim {codec.dim} ({codec!r})")
    return {"layers": config.num_hidden_layers, "kv_heads": kv_heads, "head_dim": head_dim}
