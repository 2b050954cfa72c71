"""`CompressedLayer`: one layer of a `CompressedCache` (semantics in the `fibquant.kv.cache` docstring)."""
from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import CacheLayerMixin

from fibquant.codecs.base import Codec
from fibquant.kv.buffer import CodeBuffer, CodedKV, WindowBuffer, _array_of, _decode_centred, _owned
from fibquant.kv.options import DEFAULT_OPTIONS

_FLOAT_FIELDS = ("sink_keys", "sink_values", "recent_keys", "recent_values")
WINDOW_MIN_RESERVE = 16  # rows a window buffer reserves beyond recent_tokens at least
# Vectors per encode call (keys and values together): a one-shot prefill's leaving tokens are encoded
# in pieces, so the encode's float copies and search buffers stay ~2 MB (8192 x 64 floats) whatever
# the prompt length, instead of several copies of the whole prompt's keys and values per layer.
ENCODE_CHUNK_ROWS = 8192
ATTENTION_MODES = ("codes", "decode")


def _check_attention(value) -> str:
    if value not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {value!r}")
    return value


class CompressedLayer(CacheLayerMixin):
    """One layer of a `CompressedCache` (see the `fibquant.kv.cache` docstring for the semantics)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False  # a crop inside the coded part cannot restore the exact recent window

    def __init__(self, key_codec: Codec, value_codec: Codec, sink_tokens: int, recent_tokens: int,
                 attention: str = "decode", encode_batch: int = 1, centre: bool = False, recall=None):
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
        # Set by a layer plan that chooses the per-layer codecs from the data (`fibquant.eval.cache_plans.
        # RateAllocation`) before they are chosen: resolver(layer, keys, values)
        # -> True once they are (then set_codecs has run); until then tokens leaving the window stay exact.
        self.resolver = None
        # The last (key shape, value shape, key dtype, value dtype) `_check_states` accepted: a decode
        # step with the same ones skips the checks (reset by batch edits, which change [B, H]).
        self._checked = None
        self._sink_arrays = None  # (sink_keys, sink_values, their numpy views) for `snapshot`
        self.options = DEFAULT_OPTIONS  # the paths attention takes (the cache sets its own: `_new_layer`)
        # Query-aware recall (`fibquant.kv.cold.Recall`): the exact rows of the coded tokens in a cold
        # store (`ColdStore`, created with the layer's tensors), read by attention on the codes.
        self.recall = recall
        self.cold = None

    # The recent window lives in two `WindowBuffer`s (rows written in place, no concatenation per
    # step); recent_keys / recent_values read and set it as tensors [B, H, r, D] (a view of the live rows).
    @property
    def recent_keys(self) -> Optional[torch.Tensor]:
        return None if self._recent_k is None else self._recent_k.view()

    @recent_keys.setter
    def recent_keys(self, rows: Optional[torch.Tensor]) -> None:
        self._recent_k = None if rows is None else WindowBuffer(rows, self._window_capacity())

    @property
    def recent_values(self) -> Optional[torch.Tensor]:
        return None if self._recent_v is None else self._recent_v.view()

    @recent_values.setter
    def recent_values(self, rows: Optional[torch.Tensor]) -> None:
        self._recent_v = None if rows is None else WindowBuffer(rows, self._window_capacity())

    def _window_capacity(self) -> int:
        """Rows reserved for the window: what it holds at most in a steady decode (recent_tokens +
        encode_batch - 1, plus one), and at least 16 rows beyond recent_tokens, so its live rows move to
        a new buffer at most once every 16 steps."""
        return self.recent_tokens + max(self.encode_batch, WINDOW_MIN_RESERVE)

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
        return 0 if self._recent_k is None else self._recent_k.used

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
        """Every tensor this layer holds (window and code buffers with their reserved capacity)."""
        if not self.is_initialized:
            return []
        means = [t for t in (self.key_mean, self.value_mean) if t is not None]
        return [self.sink_keys, self.sink_values, self._recent_k.data, self._recent_v.data] + means + [
            self.key_buffer.data, self.value_buffer.data]

    def nbytes(self) -> int:
        """Bytes of storage held by this layer, reserved code capacity included."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    def used_nbytes(self) -> int:
        """Bytes of the stored tokens only: exact window (+ means) + num_coded code rows."""
        if not self.is_initialized:
            return 0
        return (sum(t.numel() * t.element_size() for t in self._float_tensors())
                + self.key_buffer.used_nbytes() + self.value_buffer.used_nbytes())

    def cold_nbytes(self) -> int:
        """Bytes of the stored rows of the cold tier (0 without recall); not part of `nbytes`."""
        return 0 if self.cold is None else self.cold.used_nbytes()

    # ----------------------------------------------------------------- contract
    def lazy_initialization(self, key_states: torch.Tensor, value_states: Optional[torch.Tensor] = None):
        value_states = key_states if value_states is None else value_states
        self._check_states(key_states, value_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self._checked = None
        batch, heads = key_states.shape[:2]

        def empty(last: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(batch, heads, 0, last, dtype=dtype, device=self.device)

        self.sink_keys, self.recent_keys = empty(self.key_codec.dim, self.dtype), empty(self.key_codec.dim, self.dtype)
        self.sink_values = empty(self.value_codec.dim, value_states.dtype)
        self.recent_values = empty(self.value_codec.dim, value_states.dtype)
        self.key_buffer = CodeBuffer(batch, heads, self.key_codec.code_size, self.device)
        self.value_buffer = CodeBuffer(batch, heads, self.value_codec.code_size, self.device)
        if self.recall is not None:
            self.cold = self.recall.store_for(batch, heads, self.key_codec.dim, self.value_codec.dim, self.dtype,
                                              self.device)
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
        """What tokens `key_states`/`value_states` [B, H, T, D] attend to, before they are stored
        (with numpy views of the stored parts when they are all float32 / uint8 CPU tensors)."""
        return CodedKV(self.sink_keys, self.sink_values, self.key_codes, self.value_codes, self.recent_keys,
                       self.recent_values, key_states, value_states, self.key_codec, self.value_codec,
                       self.key_mean, self.value_mean, self._arrays(), self.options, self.cold)

    def _arrays(self) -> Optional[tuple]:
        """numpy views of (sink_keys, sink_values, key_codes, value_codes, recent_keys, recent_values) and
        the code rows' decoded norms (`CodeBuffer.norms_array`) (`CodedKV.arrays`), or None when one of
        them is not a float32 / uint8 CPU tensor."""
        cached = self._sink_arrays
        if cached is None or cached[0] is not self.sink_keys or cached[1] is not self.sink_values:
            sink_k, sink_v = _array_of(self.sink_keys), _array_of(self.sink_values)
            if sink_k is not None and (sink_k.dtype != "float32" or sink_v is None or sink_v.dtype != "float32"):
                sink_k = None
            cached = self._sink_arrays = (self.sink_keys, self.sink_values, sink_k, sink_v)
        recent_k, recent_v = self._recent_k.array(), self._recent_v.array()
        key_codes, value_codes = self.key_buffer.array(), self.value_buffer.array()
        if cached[2] is None or recent_k is None or recent_v is None or key_codes is None or value_codes is None:
            return None
        arrays = (cached[2], cached[3], key_codes, value_codes, recent_k, recent_v)
        norms = (self.key_buffer.norms_array(), self.value_buffer.norms_array())
        return arrays if any(n is None for n in norms) else arrays + norms

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Return what the new tokens attend to, then archive what left the window.

        key_states, value_states: [batch, kv_heads, T, head_dim]. "decode" mode returns two
        float tensors [batch, kv_heads, seq_length_before + T, head_dim] in the inputs' dtype;
        "codes" mode returns the same `CodedKV` twice (read by fibquant's attention function).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        seen = (key_states.shape, value_states.shape, key_states.dtype, value_states.dtype) \
            if isinstance(key_states, torch.Tensor) and isinstance(value_states, torch.Tensor) else None
        if seen is None or seen != self._checked:
            self._check_states(key_states, value_states)
            self._checked = seen
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
        new_keys = key_states[..., to_sink:, :] if to_sink else key_states
        new_values = value_states[..., to_sink:, :] if to_sink else value_states
        held = self._recent_k.used
        overflow = held + new_keys.shape[-2] - self.recent_tokens
        if overflow < self.encode_batch:  # a decode step between encodes: the rows go in place
            self._recent_k.append(new_keys)
            self._recent_v.append(new_values)
            return
        if self.resolver is None and overflow <= held:
            # a decode step that encodes: the leaving rows are the window's oldest, read in place
            # (no concatenation of the window with the new rows)
            self._encode_leaving(self.recent_keys[..., :overflow, :], self.recent_values[..., :overflow, :])
            self._recent_k.drop_front(overflow)
            self._recent_v.drop_front(overflow)
            self._recent_k.append(new_keys)
            self._recent_v.append(new_values)
            return
        if self.resolver is None and not (self.centre and self.key_mean is None):
            # a prefill chunk: the whole window and the chunk's first rows leave; encoded where they
            # are (no concatenation of the window with the chunk: a float copy of the whole prompt)
            from_new = overflow - held
            self.key_buffer.reserve(overflow)
            self.value_buffer.reserve(overflow)
            if held:
                self._encode_leaving(self.recent_keys, self.recent_values)
            self._encode_leaving(new_keys[..., :from_new, :], new_values[..., :from_new, :])
            # copied (`_owned`) so that the chunk's floats are not kept alive by the window
            self.recent_keys = _owned(new_keys[..., from_new:, :].to(self._recent_k.data.dtype))
            self.recent_values = _owned(new_values[..., from_new:, :].to(self._recent_v.data.dtype))
            return
        recent_keys = torch.cat([self.recent_keys, new_keys], dim=-2)
        recent_values = torch.cat([self.recent_values, new_values], dim=-2)
        if self.resolver is None or self.resolver(self, recent_keys, recent_values):
            self._encode_leaving(recent_keys[..., :overflow, :], recent_values[..., :overflow, :])
            if overflow <= held:
                # what stays: the held rows after the leaving ones, then the new rows, in place
                self._recent_k.drop_front(overflow)
                self._recent_v.drop_front(overflow)
                self._recent_k.append(new_keys)
                self._recent_v.append(new_values)
                return
            recent_keys, recent_values = recent_keys[..., overflow:, :], recent_values[..., overflow:, :]
        # The recent slice is copied so the dropped (now encoded) floats are really freed.
        self.recent_keys, self.recent_values = _owned(recent_keys), _owned(recent_values)

    def _encode_leaving(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the tokens leaving the window, [B, H, n, D] (the layer's mean fixed from them when it
        centres and has none yet)."""
        if self.centre and self.key_mean is None:  # fixed once, from the first tokens encoded (e.g. the prefill)
            self.key_mean = keys.to(torch.float32).mean(dim=-2)
            self.value_mean = values.to(torch.float32).mean(dim=-2)
        if self.cold is not None:  # the exact rows, uncentred, in the cold tier
            self.cold.append(keys, values)
        self._store_codes(keys, values)

    def _store_codes(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Encode tokens leaving the window ([B, H, n, D]; centred here when the layer centres) and
        append their code rows, `ENCODE_CHUNK_ROWS` vectors per encode call (each row is encoded on its
        own: the codes do not depend on the split). A tiered layer (`fibquant.eval.heavy`) overrides this."""
        n = keys.shape[-2]
        # the code rows' long-lived storage first, below the encode's transient buffers (CodeBuffer.reserve)
        self.key_buffer.reserve(n)
        self.value_buffer.reserve(n)
        # one codec for both roles: one encode call for keys and values (`encode_parts`; a decode step's
        # encode of 16 tokens is mostly per-call cost)
        joint = self.key_codec is self.value_codec and keys.shape == values.shape and keys.dtype == values.dtype
        per_token = keys.shape[0] * keys.shape[1] * (2 if joint else 1)
        step = max(1, ENCODE_CHUNK_ROWS // max(per_token, 1))
        for start in range(0, n, step):
            part_k, part_v = (keys, values) if n <= step else (keys[..., start:start + step, :],
                                                                 values[..., start:start + step, :])
            if self.centre:
                part_k = part_k.to(torch.float32) - self.key_mean.unsqueeze(-2)
                part_v = part_v.to(torch.float32) - self.value_mean.unsqueeze(-2)
            if joint:
                codes_k, codes_v = self.key_codec.encode_parts([part_k, part_v])
                self.key_buffer.append(codes_k)
                self.value_buffer.append(codes_v)
            else:
                self.key_buffer.append(self.key_codec.encode(part_k))
                self.value_buffer.append(self.value_codec.encode(part_v))

    def set_codecs(self, key_codec: Codec, value_codec: Codec) -> None:
        """Change the codecs of a layer that has coded nothing yet (per-layer allocation)."""
        if self.num_coded:
            raise ValueError("set_codecs: this layer already holds codes of its old codecs")
        for role, codec, old in (("key", key_codec, self.key_codec), ("value", value_codec, self.value_codec)):
            if not isinstance(codec, Codec) or codec.dim != old.dim:
                raise ValueError(f"set_codecs: the {role} codec must be a Codec of dim {old.dim}, got {codec!r}")
        self.key_codec, self.value_codec = key_codec, value_codec
        if self.is_initialized:
            self.key_buffer = CodeBuffer(*self.key_buffer.data.shape[:2], key_codec.code_size, self.device)
            self.value_buffer = CodeBuffer(*self.value_buffer.data.shape[:2], value_codec.code_size, self.device)

    def flush(self) -> None:
        """Encode what has left the recent window but waited (at least `encode_batch` tokens)."""
        if self.is_initialized:
            self._absorb(self.recent_keys[..., :0, :], self.recent_values[..., :0, :])

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

    # ----------------------------------------------------------------- persistence (kv/persist/store.py)
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
        self._checked = None
        if self.is_initialized:
            for name in _FLOAT_FIELDS:
                setattr(self, name, _owned(fn(getattr(self, name))))
            self.key_buffer.remap(fn)
            self.value_buffer.remap(fn)
            if self.cold is not None:
                self.cold.remap(fn)
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
        if self.cold is not None:
            self.cold.truncate(keep_coded)

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


class CompressedSlidingLayer(CompressedLayer):
    """A sliding-window (or chunked-attention) layer of a `CompressedCache`.

    Holds at most the last `sliding_window - 1` tokens, exactly as transformers'
    `DynamicSlidingWindowLayer` does (a query sees those plus the tokens of its own chunk, the
    model's sliding mask doing the rest): tokens that leave the window are dropped, never
    encoded. Inside the window the newest `recent_tokens` (to `recent_tokens + encode_batch - 1`)
    are exact and the older ones coded, or, with `exact_window=True`, the whole window is exact
    (nothing is ever encoded). There are no sink tokens: the first tokens leave the window.
    `get_seq_length` counts every token seen (positions), `get_mask_sizes` gives the mask's
    (kv_length, kv_offset) over the held tokens, both as transformers' sliding layer.
    """

    is_sliding = True

    def __init__(self, key_codec: Codec, value_codec: Codec, sliding_window: int, recent_tokens: int,
                 attention: str = "decode", encode_batch: int = 1, centre: bool = False,
                 exact_window: bool = False):
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 2:
            raise ValueError(f"sliding_window must be an integer >= 2, got {sliding_window!r}")
        self.sliding_window = sliding_window
        self.exact_window = bool(exact_window)
        self.cumulative_length = 0
        super().__init__(key_codec, value_codec, 0, sliding_window if exact_window else recent_tokens,
                         attention, encode_batch, centre)

    @property
    def max_held(self) -> int:
        return self.sliding_window - 1

    def __repr__(self) -> str:
        return (f"CompressedSlidingLayer(window={self.sliding_window}, seen={self.cumulative_length}, "
                f"coded={self.num_coded}, recent={self.num_recent}, attention={self.attention!r})")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: Optional[torch.Tensor] = None):
        super().lazy_initialization(key_states, value_states)
        for buffer in (self.key_buffer, self.value_buffer):
            buffer.max_rows = self.max_held

    def set_codecs(self, key_codec: Codec, value_codec: Codec) -> None:
        super().set_codecs(key_codec, value_codec)
        if self.is_initialized:
            self.key_buffer.max_rows = self.value_buffer.max_rows = self.max_held

    def _absorb(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Drop what the new tokens push out of the window (oldest first: codes, then exact), then store."""
        self.cumulative_length += key_states.shape[-2]
        excess = self.num_coded + self.num_recent + key_states.shape[-2] - self.max_held
        if excess > 0:
            from_codes = min(excess, self.num_coded)
            self.key_buffer.drop_front(from_codes)
            self.value_buffer.drop_front(from_codes)
            excess -= from_codes
        if excess > 0:
            from_recent = min(excess, self.num_recent)
            self._recent_k.drop_front(from_recent)
            self._recent_v.drop_front(from_recent)
            excess -= from_recent
        if excess > 0:  # a chunk longer than the window: its first tokens are never held
            key_states, value_states = key_states[..., excess:, :], value_states[..., excess:, :]
        super()._absorb(key_states, value_states)

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        seen = self.cumulative_length
        offset = max(seen - self.sliding_window + 1, 0)
        held = self.max_held if seen >= self.sliding_window else seen
        return held + query_length, offset

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.sliding_window

    get_max_cache_shape = get_max_length

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0

    def crop(self, max_length: int) -> None:
        """Forget the newest tokens down to `max_length` seen (negative: that many fewer); tokens that
        already left the window do not come back."""
        if max_length < 0:
            max_length = self.cumulative_length - abs(max_length)
        remove = self.cumulative_length - max(max_length, 0)
        if remove <= 0:
            return
        held = self.num_coded + self.num_recent
        from_recent = min(remove, self.num_recent)
        keep_recent = self.num_recent - from_recent
        self.recent_keys = _owned(self.recent_keys[..., :keep_recent, :])
        self.recent_values = _owned(self.recent_values[..., :keep_recent, :])
        keep_coded = max(self.num_coded - (min(remove, held) - from_recent), 0)
        self.key_buffer.truncate(keep_coded)
        self.value_buffer.truncate(keep_coded)
        self.cumulative_length -= remove
