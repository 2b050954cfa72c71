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

Per-layer codecs: `key_codec` / `value_codec` may each be a sequence with one codec per layer
(layer l uses entry l). Or `allocate` (a callable) chooses them from the data itself: it is
called once with, per layer, that layer's exact tokens after the sinks ([B, H, n, D] keys and
values) and returns the per-layer key and value codecs (e.g. `fibquant.kv.allocation`).
`from_cache` calls it with the whole source cache before anything is coded; a cache filled
through `update` calls it when a layer first has tokens to encode and every layer
(`num_layers`, from the model with `for_model`) holds tokens; until then tokens stay exact
(a layer that had to wait encodes its backlog as soon as the codecs are chosen).

A heavy tier (`tier=`, a `fibquant.kv.heavy.HeavyTier`): each layer is a `TieredLayer` that also
stores a fixed fraction of its coded tokens per KV head (the highest by a score of the tokens
themselves, e.g. key norm) at a second, higher rate, as a second fixed-size code stream with an int32
index; reads patch those rows in, and attention runs on the decoded floats (see `fibquant.kv.heavy`).

Two ways to read the coded part (`attention=`):

- "decode" (the reference): `update` returns float keys/values with the coded part decoded,
  for any attention implementation;
- "codes": `update` returns a `CodedKV` snapshot (no float copy of the coded part) that the
  attention function of `fibquant.kv.attention.entry` scores directly from the codes; the model
  must use it while it runs (`with fibquant.attention_on_codes(model):`, `fibquant.kv.attention.switch`).

Tested against the Cache / CacheLayerMixin contract of transformers 5.x.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional, Sequence, Union

import torch
from transformers.cache_utils import Cache

from fibquant.codecs.base import Codec
from fibquant.kv.buffer import CodeBuffer, CodedKV
from fibquant.kv.layer import ATTENTION_MODES, CompressedLayer, CompressedSlidingLayer, _check_attention
from fibquant.kv.accounting import _per_token, codec_state_nbytes, dynamic_cache_bytes_per_token, dynamic_cache_nbytes
from fibquant.kv.model import check_model_supported
from fibquant.kv.options import DEFAULT_OPTIONS, AttentionOptions

# The persistence package registers its save function, store and writer classes here on import
# (`fibquant.kv`'s __init__ imports it), so `save` / `load` work without a cache -> persist import.
_PERSISTENCE: list = []


def register_persistence(save_cache, store_cls, writer_cls) -> None:
    """Called by `fibquant.kv.persist`: what `CompressedCache.save` / `load` use."""
    _PERSISTENCE[:] = [save_cache, store_cls, writer_cls]


def _persistence():
    if not _PERSISTENCE:
        raise RuntimeError("fibquant.kv.persist is not imported (the fibquant.kv package imports it)")
    return _PERSISTENCE

# The layer, its code storage, the model check and the byte counts live in kv/layer.py, kv/buffer.py,
# kv/model.py and kv/accounting.py; they stay importable from here, where they were first defined.
__all__ = ["ATTENTION_MODES", "CodeBuffer", "CodedKV", "CompressedCache", "CompressedLayer", "CompressedSlidingLayer",
           "check_model_supported",
           "codec_state_nbytes", "dynamic_cache_bytes_per_token", "dynamic_cache_nbytes"]


def _check_codec(codec, role: str) -> None:
    if not isinstance(codec, Codec):
        raise ValueError(f"{role} must be a fibquant Codec, got {type(codec).__name__}")


def _codec_list(codecs, role: str) -> tuple[Codec, Optional[list[Codec]]]:
    """(the first codec, the per-layer list or None) of a codec or a sequence of codecs."""
    if isinstance(codecs, Codec):
        return codecs, None
    if isinstance(codecs, (list, tuple)) and codecs:
        for index, codec in enumerate(codecs):
            _check_codec(codec, f"{role}[{index}]")
        return codecs[0], list(codecs)
    raise ValueError(f"{role} must be a fibquant Codec or a non-empty sequence of them (one per layer), "
                     f"got {type(codecs).__name__}")


def _check_layer_windows(windows) -> Optional[list]:
    if windows is None:
        return None
    windows = list(windows)
    for index, window in enumerate(windows):
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 2):
            raise ValueError(f"layer_windows[{index}] must be None (full attention) or an integer >= 2, "
                             f"got {window!r}")
    return windows if any(w is not None for w in windows) else None


def _check_window(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _resolve_codecs(model, code, value_codec, centre: bool, allocate, tier, recall=None) -> tuple:
    """(key codec(s), value codec(s), cache options) of `for_model`'s code: a spec or codec objects."""
    options = {"centre": centre, "allocate": allocate, "tier": tier, "recall": recall}
    if isinstance(code, Codec) or isinstance(code, (list, tuple)):
        if value_codec is None:
            sizes = check_model_supported(model)
            if sizes["key_dim"] != sizes["value_dim"]:
                raise ValueError(f"this model caches keys of {sizes['key_dim']} and values of {sizes['value_dim']} "
                                 "dims (an MLA latent): pass a value codec too, or a cache spec")
            value_codec = code
        return code, value_codec, options
    from fibquant.kv.specs import CacheSpec, parse_cache_spec

    if not isinstance(code, (str, CacheSpec)):
        raise ValueError(f"code must be a cache spec (e.g. 'e8shell:b=2,nc=1' or 'ratio=6'), a CacheSpec or "
                         f"fibquant Codec(s), got {type(code).__name__}")
    if value_codec is not None:
        raise ValueError("a cache spec names both roles ('KEY/VALUE'): pass no value codec with it")
    spec = parse_cache_spec(code, model) if isinstance(code, str) else code
    key, value = spec.quantizers(model)
    spec_options = spec.cache_options(model, key.dim, centre)
    for name in ("allocate", "tier", "recall"):
        if options[name] is not None and spec_options.get(name) is not None:
            raise ValueError(f"{spec.spec} sets {name} already: pass it in the spec or as an argument, not both")
        spec_options[name] = spec_options.get(name) if spec_options.get(name) is not None else options[name]
    return key, value, spec_options


def _check_recall(recall, attention: str, tier):
    if recall is None:
        return None
    from fibquant.kv.cold import Recall

    if not isinstance(recall, Recall):
        raise ValueError(f"recall must be a fibquant.kv.cold.Recall, got {type(recall).__name__}")
    if attention != "codes":
        raise ValueError("recall works with attention on the codes (attention='codes'), not the decode path")
    if tier is not None:
        raise ValueError("recall does not combine with a heavy tier")
    return recall


class CompressedCache(Cache):
    """KV cache holding tokens outside an exact window only as codec codes.

    key_codec / value_codec: fibquant codecs whose `dim` equals the model's head_dim (checked
    at the first update). sink_tokens / recent_tokens: sizes of the exact window (first and
    last tokens kept in the model's dtype). attention: "decode" (update returns floats, works
    with any attention implementation) or "codes" (attention runs on the codes; the model must
    use fibquant's attention function: run it inside `fibquant.attention_on_codes(model)`).
    encode_batch: tokens leaving the window are encoded once this many have gathered (the
    window then holds up to recent_tokens + encode_batch - 1). centre: quantise keys and values
    minus a per-layer, per-head mean fixed at the first encode (see the module docstring).
    layer_windows: per layer, None (full attention) or the sliding-window / attention-chunk size of
    that layer (a `CompressedSlidingLayer`: at most window - 1 tokens held, older ones dropped);
    `for_model` reads them from the model's config (`layer_types`). With it the layers are
    created up front (transformers builds a hybrid model's masks from them), else lazily on
    first update. sliding_exact: keep the whole window of sliding layers exact instead of coding
    its older tokens. recall: a `fibquant.kv.cold.Recall` (attention on codes only): the exact rows of
    the coded tokens go to a cold store, and each query recalls its top-k coded tokens from it, scored
    exactly (`fibquant.kv.cold`, `fibquant.kv.attention.recall`); full-attention layers only, the
    store's bytes not counted in `nbytes` (see `cold_nbytes`). options: the paths attention on codes takes
    (`fibquant.kv.options.AttentionOptions`, default the tuned ones). Pass it to a forward pass or to `model.generate` as `**cache_kwarg(model, cache)`
    (fibquant.kv.model: `cache=` on transformers >= 5.24, else `past_key_values=`).
    """

    def __init__(self, key_codec: Union[Codec, Sequence[Codec]], value_codec: Union[Codec, Sequence[Codec]],
                 sink_tokens: int = 4, recent_tokens: int = 32, attention: str = "decode", encode_batch: int = 16,
                 centre: bool = False, allocate: Optional[Callable] = None, num_layers: Optional[int] = None,
                 layer_windows: Optional[Sequence[Optional[int]]] = None, sliding_exact: bool = False,
                 tier=None, recall=None, options: Optional[AttentionOptions] = None):
        key_codec, key_codecs = _codec_list(key_codec, "key_codec")
        value_codec, value_codecs = _codec_list(value_codec, "value_codec")
        if (key_codecs is None) != (value_codecs is None) or (key_codecs is not None
                                                              and len(key_codecs) != len(value_codecs)):
            raise ValueError("per-layer codecs: pass one key and one value codec per layer (two sequences of "
                             "the same length), or one codec per role")
        if allocate is not None and key_codecs is not None:
            raise ValueError("pass per-layer codecs or an allocate callable, not both")
        if allocate is not None and not callable(allocate):
            raise ValueError(f"allocate must be callable, got {type(allocate).__name__}")
        if allocate is not None and num_layers is None:
            raise ValueError("allocate needs num_layers (the model's layer count; for_model and from_cache "
                             "set it)")
        if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)
                                       or num_layers < 1):
            raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
        # One codec per layer (a sequence given, or chosen by `allocate`), else None: every layer
        # uses key_codec / value_codec.
        self.key_codecs: Optional[list] = key_codecs
        self.value_codecs: Optional[list] = value_codecs
        self.key_codec, self.value_codec = key_codec, value_codec
        self.allocate, self.num_layers = allocate, num_layers
        self.allocation: Optional[dict] = None  # what `allocate` returned, once it ran
        self.sink_tokens = _check_window(sink_tokens, "sink_tokens")
        self.recent_tokens = _check_window(recent_tokens, "recent_tokens")
        self.encode_batch = _check_window(encode_batch, "encode_batch")
        if self.encode_batch < 1:
            raise ValueError(f"encode_batch must be >= 1, got {encode_batch}")
        self.attention = _check_attention(attention)
        if not isinstance(centre, bool):
            raise ValueError(f"centre must be True or False, got {centre!r}")
        self.centre = centre
        if not isinstance(sliding_exact, bool):
            raise ValueError(f"sliding_exact must be True or False, got {sliding_exact!r}")
        self.sliding_exact = sliding_exact
        self.layer_windows = _check_layer_windows(layer_windows)
        if tier is not None:
            from fibquant.kv.heavy import HeavyTier

            if not isinstance(tier, HeavyTier):
                raise ValueError(f"tier must be a fibquant.kv.heavy.HeavyTier, got {type(tier).__name__}")
            if centre:
                raise ValueError("a heavy tier does not combine with centre=True")
            if self.layer_windows is not None:
                raise ValueError("a heavy tier applies to full-attention layers only (this model has sliding ones)")
        self.tier = tier
        self._options = DEFAULT_OPTIONS
        self.recall = _check_recall(recall, self.attention, tier)
        if self.layer_windows is not None:
            for name, count in (("num_layers", num_layers), ("per-layer codecs", len(key_codecs or ()) or None)):
                if count is not None and count != len(self.layer_windows):
                    raise ValueError(f"layer_windows has {len(self.layer_windows)} entries but {name} says {count}")
        self._switch = None  # (model, MLA modules) weak references: for_model's cache on codes checks them
        super().__init__(layer_class_to_replicate=self._new_layer)
        if self.layer_windows is not None:
            for _ in self.layer_windows:
                self.layers.append(self._new_layer())
        if options is not None:
            self.options = options

    @property
    def options(self) -> AttentionOptions:
        """The paths attention on codes takes (`fibquant.kv.options`); setting it applies to every layer."""
        return self._options

    @options.setter
    def options(self, options: AttentionOptions) -> None:
        if not isinstance(options, AttentionOptions):
            raise ValueError(f"options must be a fibquant.kv.options.AttentionOptions, got {type(options).__name__}")
        self._options = options
        for layer in self.layers:
            layer.options = options

    def layer_codecs(self, index: int) -> tuple[Codec, Codec]:
        """(key codec, value codec) of layer `index`."""
        if self.key_codecs is None:
            return self.key_codec, self.value_codec
        if index >= len(self.key_codecs):
            raise ValueError(f"this cache has codecs for {len(self.key_codecs)} layers; the model asked for "
                             f"layer {index}")
        return self.key_codecs[index], self.value_codecs[index]

    def _new_layer(self) -> CompressedLayer:
        pending = self.allocate is not None and self.key_codecs is None
        key, value = (self.key_codec, self.value_codec) if pending else self.layer_codecs(len(self.layers))
        index = len(self.layers)
        window = self.layer_windows[index] if self.layer_windows and index < len(self.layer_windows) else None
        if window is not None:
            layer = CompressedSlidingLayer(key, value, window, self.recent_tokens, self.attention, self.encode_batch,
                                           self.centre, exact_window=self.sliding_exact)
        elif self.tier is not None:
            from fibquant.kv.heavy import TieredLayer

            layer = TieredLayer(key, value, self.sink_tokens, self.recent_tokens, self.tier, self.attention,
                                self.encode_batch)
        else:
            layer = CompressedLayer(key, value, self.sink_tokens, self.recent_tokens, self.attention,
                                    self.encode_batch, self.centre, recall=self.recall)
        if pending:
            layer.resolver = self._resolve_allocation
        layer.options = self.options
        return layer

    # ----------------------------------------------------------------- per-layer allocation
    def _set_allocation(self, samples: list) -> None:
        """Run `allocate` on per-layer (keys, values) samples and fix the per-layer codecs."""
        result = self.allocate(samples)
        key_codecs, value_codecs = result[0], result[1]
        _, key_codecs = _codec_list(list(key_codecs), "allocated key codecs")
        _, value_codecs = _codec_list(list(value_codecs), "allocated value codecs")
        if len(key_codecs) != len(samples) or len(value_codecs) != len(samples):
            raise ValueError(f"allocate returned {len(key_codecs)} key and {len(value_codecs)} value codecs "
                             f"for {len(samples)} layers")
        self.key_codecs, self.value_codecs = key_codecs, value_codecs
        self.allocation = result[2] if len(result) > 2 else {}

    def _resolve_allocation(self, caller: CompressedLayer, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Called by a layer with tokens to encode before the codecs are chosen; True once they are.

        Chooses them when every layer (`num_layers`) holds tokens: the sample of a layer is its
        exact tokens after the sinks (the caller's `keys`/`values`: its recent window with the new
        tokens)."""
        layers = self.layers
        if len(layers) < self.num_layers or any(not layer.is_initialized for layer in layers):
            return False
        samples = []
        for layer in layers:
            if layer is caller:
                samples.append((keys, values))
            else:
                samples.append((layer.recent_keys, layer.recent_values))
        if any(k.shape[-2] == 0 for k, _ in samples):
            return False
        self._set_allocation(samples)
        for index, layer in enumerate(layers):
            layer.resolver = None
            layer.set_codecs(*self.layer_codecs(index))
        for layer in layers:  # layers that waited encode their backlog now (the caller goes on itself)
            if layer is not caller:
                layer.flush()
        return True

    @classmethod
    def for_model(cls, model, code, value_codec=None, sink_tokens: int = 4,
                  recent_tokens: int = 32, attention: str = "codes", encode_batch: int = 16,
                  centre: bool = False, allocate: Optional[Callable] = None,
                  sliding_exact: bool = False, tier=None, recall=None) -> "CompressedCache":
        """A cache for `model`, each role's size read from the model; the model itself is not changed.

        code: a cache spec (`fibquant.kv.specs`: "e8shell:b=2,nc=1", "fibquant:b=4/fibquant:b=2",
        "fibquant:b=2@centre", a budget "ratio=6" / "bytes=4000,context=8192" (`fibquant.kv.budget`), or a
        parsed `CacheSpec`), or codec objects: the key codec (or one per layer) with `value_codec` (the key
        codec serves both roles when it is omitted and the roles have one size). The layers follow the
        model's own layer types (full / sliding / chunked attention). MLA models (DeepSeek V3, Kimi) cache
        their latent (key role: `kv_lora_rank` dims, value role: `qk_rope_head_dim`).

        attention="codes" (the default) attends on the codes, which needs the model switched to fibquant's
        attention while it runs: `with fibquant.attention_on_codes(model): ...`; used outside that block the
        cache raises `AttentionNotOnCodes` at its first update. A model that cannot run it (its attention is
        not dispatched through transformers' AttentionInterface, or an MLA module of a form
        `fibquant.kv.attention.mla` does not know) gets attention="decode" with a one-time warning naming why.
        """
        key_codec, value_codec, options = _resolve_codecs(model, code, value_codec, centre, allocate, tier, recall)
        first_key, key_codecs = _codec_list(key_codec, "key_codec")
        first_value, value_codecs = _codec_list(value_codec, "value_codec")
        info = check_model_supported(model, first_key, first_value)
        for key, value in zip(key_codecs or [], value_codecs or []):
            check_model_supported(model, key, value)
        if key_codecs is not None and len(key_codecs) != info["layers"]:
            raise ValueError(f"{len(key_codecs)} per-layer codecs for a model of {info['layers']} layers")
        attention = _check_attention(options.pop("attention", attention))
        latent_modules = []
        if attention == "codes":
            from fibquant.kv.attention.switch import codes_or_decode

            attention, latent_modules = codes_or_decode(model, info["latent"])
        if options.get("recall") is not None and (attention != "codes" or info["latent"]):
            raise ValueError("recall needs attention on the codes of a model with per-head keys and values; this "
                             f"model runs {'an MLA latent' if info['latent'] else 'attention=' + repr(attention)}")
        cache = cls(key_codec, value_codec, sink_tokens, recent_tokens, attention, encode_batch,
                    num_layers=info["layers"], layer_windows=info["windows"], sliding_exact=sliding_exact, **options)
        if attention == "codes":
            cache._switch = (weakref.ref(model), [weakref.ref(module) for module in latent_modules])
        return cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Cache.update; a cache on codes built for a model first checks (at layer 0, once per forward) that the
        model runs fibquant's attention (`attention_on_codes`), before anything is stored."""
        if layer_idx == 0 and self._switch is not None and self.attention == "codes":
            model = self._switch[0]()
            if model is not None:
                from fibquant.kv.attention.switch import check_on_codes

                check_on_codes(model, [module for module in (ref() for ref in self._switch[1]) if module is not None])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @classmethod
    def from_cache(cls, cache: Cache, key_codec, value_codec, sink_tokens: int = 4,
                   recent_tokens: int = 32, attention: str = "decode", model=None,
                   encode_batch: int = 16, centre: bool = False,
                   allocate: Optional[Callable] = None, sliding_exact: bool = False,
                   tier=None, recall=None) -> "CompressedCache":
        """Compress an already computed cache (e.g. a `DynamicCache` after a float prefill).

        The result holds what this cache would hold had it seen the same tokens in one update:
        the first `sink_tokens` and last `recent_tokens` exact, the rest as codes. The source is
        left untouched. With `model` given, `for_model`'s checks apply (and the codes may be a cache spec). With
        `allocate`, it chooses the per-layer codecs from the source's tokens after the sinks first.
        """
        if model is not None:
            target = cls.for_model(model, key_codec, value_codec, sink_tokens, recent_tokens, attention,
                                   encode_batch, centre, allocate, sliding_exact=sliding_exact, tier=tier,
                                   recall=recall)
        else:
            target = cls(key_codec, value_codec, sink_tokens, recent_tokens, attention, encode_batch, centre,
                         allocate=allocate, num_layers=len(cache.layers) if allocate is not None else None,
                         tier=tier, recall=recall)
        for index, layer in enumerate(cache.layers):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                raise ValueError(f"from_cache: layer {index} of the source ({type(layer).__name__}) holds no "
                                 "float keys/values tensors (e.g. a linear-attention or uninitialised layer)")
        if target.allocate is not None:
            target._set_allocation([(layer.keys[..., sink_tokens:, :], layer.values[..., sink_tokens:, :])
                                    for layer in cache.layers])
        target.layers = []  # rebuilt in order (for_model creates a hybrid model's layers up front)
        for index, layer in enumerate(cache.layers):
            keys, values = layer.keys, layer.values
            new_layer = target._new_layer()
            if getattr(layer, "is_sliding", False) and not new_layer.is_sliding:
                raise ValueError(f"from_cache: layer {index} of the source is a sliding-window layer (it holds only "
                                 "the window); pass model= so this cache slides that layer too")
            if keys.ndim == 4 and keys.shape[-2] > 0:
                new_layer.lazy_initialization(keys, values)
                new_layer._absorb(keys, values)
                if new_layer.is_sliding:  # positions count every token the source saw, not just those held
                    new_layer.cumulative_length = max(getattr(layer, "cumulative_length", 0), keys.shape[-2])
            target.layers.append(new_layer)
        return target

    def __repr__(self) -> str:
        per_layer = "" if self.key_codecs is None else ", per-layer codecs"
        return (f"CompressedCache(key={self.key_codec!r}, value={self.value_codec!r}{per_layer}, "
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

    def cold_nbytes(self) -> int:
        """Bytes of the cold tier's stored rows (exact keys and values of the coded tokens, host memory or
        disk; 0 without recall), every layer: not part of `nbytes` / `used_nbytes`, the hot bytes."""
        return sum(layer.cold_nbytes() for layer in self.layers if hasattr(layer, "cold_nbytes"))

    def cold_bytes_per_token(self) -> float:
        """cold_nbytes / (batch * tokens)."""
        return _per_token(self.cold_nbytes(), self)

    def cold_reads(self) -> dict:
        """Reads from the cold tier so far, every layer: {"rows": (batch, head, token) rows fetched,
        "bytes": their key + value bytes, "calls": fetch calls (one per layer and attention call)}."""
        stores = [layer.cold for layer in self.layers if getattr(layer, "cold", None) is not None]
        rows = sum(store.rows_read for store in stores)
        per_row = [(store.keys.shape[-1] + store.values.shape[-1]) * store.keys.data.element_size() for store in stores]
        return {"rows": rows, "bytes": sum(s.rows_read * b for s, b in zip(stores, per_row)),
                "calls": sum(store.reads for store in stores)}

    def shared_nbytes(self) -> int:
        """Bytes of the codecs' shared state (codebooks, rotations), held once for the model."""
        codecs = [self.key_codec, self.value_codec] + list(self.key_codecs or []) + list(self.value_codecs or [])
        return sum(codec_state_nbytes(c) for c in {id(c): c for c in codecs}.values())

    # ----------------------------------------------------------------- persistence (kv/persist/store.py)
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
        """Write this cache (and its token ids) to the directory `path` (fibquant.kv.persist.store).

        `model` is the model that filled the cache (its identity is stored: config, parameter
        names/shapes/dtypes and weight fingerprints). With
        append=False the store is sealed and closed (returned closed). With append=True a
        `CacheWriter` is returned that stays open: pass it to `model.generate(...,
        stopping_criteria=[writer])` and every newly coded token is appended to the archive
        after each step (checkpoint every `checkpoint_every` tokens); `writer.close()` (or a
        `with` block) seals the end. See docs/persistent-cache.md."""
        if getattr(self, "tier", None) is not None:
            raise ValueError("saving a cache with a heavy tier is not implemented (the store holds one code "
                             "stream per role)")
        save_cache, store_cls, writer_cls = _persistence()
        if not append:
            return save_cache(self, path, model, token_ids, overwrite=overwrite, durable=durable)
        save_cache(self, path, model, token_ids, overwrite=overwrite, durable=durable)
        store = store_cls.open(path, "a", model=model, durable=durable)
        return writer_cls(store, self, checkpoint_every)

    @classmethod
    def load(cls, path, model=None, attention: Optional[str] = None) -> "CompressedCache":
        """The cache saved at `path`, bit for bit. With `model`, it must be the saved model
        (config and parameter shapes exactly, weights within a tolerance; ValueError otherwise) and the attention is set up as `for_model` does; the
        saved token ids are attached as `cache.token_ids` (int64 [n])."""
        _, store_cls, _ = _persistence()
        with store_cls.open(path, model=model) as store:
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

