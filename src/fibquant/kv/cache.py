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

Per-layer codecs: `key_codec` / `value_codec` may each be a sequence with one codec per layer
(layer l uses entry l).

What a layer stores beyond that is its plan's (`layer_plan=`, a `fibquant.kv.plan.LayerPlan`): the
plain layer by default, `Centred()` (keys and values coded minus a per-layer, per-head mean), or an
experiment's plan from `fibquant.eval.cache_plans` (per-layer rates chosen from the data, heavy tokens
kept at a second rate).

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
from typing import Optional, Sequence, Union

import torch
from transformers.cache_utils import Cache

from fibquant.codecs.base import Codec
from fibquant.kv.buffer import CodeBuffer, CodedKV
from fibquant.kv.layer import ATTENTION_MODES, CompressedLayer, CompressedSlidingLayer, _check_attention
from fibquant.kv.accounting import _per_token, codec_state_nbytes, dynamic_cache_bytes_per_token, dynamic_cache_nbytes
from fibquant.kv.model import check_model_supported
from fibquant.kv.options import DEFAULT_OPTIONS, AttentionOptions
from fibquant.kv.plan import Centred, LayerPlan, check_plan

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


def _check_per_layer(key_codecs: Optional[list], value_codecs: Optional[list]) -> None:
    if (key_codecs is None) != (value_codecs is None) or (key_codecs is not None
                                                          and len(key_codecs) != len(value_codecs)):
        raise ValueError("per-layer codecs: pass one key and one value codec per layer (two sequences of "
                         "the same length), or one codec per role")


def _check_layer_windows(windows, key_codecs: Optional[list]) -> Optional[list]:
    if windows is None:
        return None
    windows = list(windows)
    for index, window in enumerate(windows):
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 2):
            raise ValueError(f"layer_windows[{index}] must be None (full attention) or an integer >= 2, "
                             f"got {window!r}")
    if not any(w is not None for w in windows):
        return None
    if key_codecs is not None and len(key_codecs) != len(windows):
        raise ValueError(f"layer_windows has {len(windows)} entries but per-layer codecs says {len(key_codecs)}")
    return windows


def _check_window(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _resolve_codecs(model, code, value_codec, recall, layer_plan) -> tuple:
    """(key codec(s), value codec(s), cache keyword arguments) of `for_model`'s code: a spec or codec objects."""
    arguments = {"recall": recall, "layer_plan": layer_plan}
    if isinstance(code, Codec) or isinstance(code, (list, tuple)):
        if value_codec is None:
            sizes = check_model_supported(model)
            if sizes["key_dim"] != sizes["value_dim"]:
                raise ValueError(f"this model caches keys of {sizes['key_dim']} and values of {sizes['value_dim']} "
                                 "dims (an MLA latent): pass a value codec too, or a cache spec")
            value_codec = code
        return code, value_codec, arguments
    from fibquant.kv.specs import CacheSpec, parse_cache_spec

    if not isinstance(code, (str, CacheSpec)):
        raise ValueError(f"code must be a cache spec (e.g. 'e8shell:b=2,nc=1' or 'ratio=6'), a CacheSpec or "
                         f"fibquant Codec(s), got {type(code).__name__}")
    if value_codec is not None:
        raise ValueError("a cache spec names both roles ('KEY/VALUE'): pass no value codec with it")
    spec = parse_cache_spec(code, model) if isinstance(code, str) else code
    key, value = spec.quantizers(model)
    spec_arguments = spec.cache_options(model, key.dim)
    for name, given in arguments.items():
        if given is not None and spec_arguments.get(name) is not None:
            raise ValueError(f"{spec.spec} sets {name} already: pass it in the spec or as an argument, not both")
        if spec_arguments.get(name) is None:
            spec_arguments[name] = given
    return key, value, spec_arguments


def _check_recall(recall, attention: str):
    if recall is None:
        return None
    from fibquant.kv.cold import Recall

    if not isinstance(recall, Recall):
        raise ValueError(f"recall must be a fibquant.kv.cold.Recall, got {type(recall).__name__}")
    if attention != "codes":
        raise ValueError("recall works with attention on the codes (attention='codes'), not the decode path")
    return recall


def _check_encode_batch(encode_batch) -> int:
    if _check_window(encode_batch, "encode_batch") < 1:
        raise ValueError(f"encode_batch must be >= 1, got {encode_batch}")
    return encode_batch


def _check_model_codecs(model, key_codec, value_codec) -> dict:
    """`check_model_supported` of the model with every codec `for_model` got (one per role, or one per layer)."""
    first_key, key_codecs = _codec_list(key_codec, "key_codec")
    first_value, value_codecs = _codec_list(value_codec, "value_codec")
    info = check_model_supported(model, first_key, first_value)
    for key, value in zip(key_codecs or [], value_codecs or []):
        check_model_supported(model, key, value)
    if key_codecs is not None and len(key_codecs) != info["layers"]:
        raise ValueError(f"{len(key_codecs)} per-layer codecs for a model of {info['layers']} layers")
    return info


def _source_layers(cache: Cache) -> list:
    """The layers of `from_cache`'s source, each checked to hold float keys and values."""
    for index, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise ValueError(f"from_cache: layer {index} of the source ({type(layer).__name__}) holds no "
                             "float keys/values tensors (e.g. a linear-attention or uninitialised layer)")
    return list(cache.layers)


class CompressedCache(Cache):
    """KV cache holding tokens outside an exact window only as codec codes.

    key_codec / value_codec: fibquant codecs whose `dim` equals the model's head_dim (checked
    at the first update), or one sequence per role with one codec per layer. sink_tokens / recent_tokens:
    sizes of the exact window (first and last tokens kept in the model's dtype). attention: "decode"
    (update returns floats, works with any attention implementation) or "codes" (attention runs on the
    codes; the model must use fibquant's attention function: run it inside
    `fibquant.attention_on_codes(model)`). encode_batch: tokens leaving the window are encoded once this
    many have gathered (the window then holds up to recent_tokens + encode_batch - 1).
    layer_windows: per layer, None (full attention) or the sliding-window / attention-chunk size of
    that layer (a `CompressedSlidingLayer`: at most window - 1 tokens held, older ones dropped);
    `for_model` reads them from the model's config (`layer_types`). With it the layers are
    created up front (transformers builds a hybrid model's masks from them), else lazily on
    first update. sliding_exact: keep the whole window of sliding layers exact instead of coding
    its older tokens. recall: a `fibquant.kv.cold.Recall` (attention on codes only): the exact rows of
    the coded tokens go to a cold store, and each query recalls its top-k coded tokens from it, scored
    exactly (`fibquant.kv.cold`, `fibquant.kv.attention.recall`); full-attention layers only, the
    store's bytes not counted in `nbytes` (see `cold_nbytes`). options: the paths attention on codes takes
    (`fibquant.kv.options.AttentionOptions`, default the tuned ones). layer_plan: how the layers are made
    (`fibquant.kv.plan.LayerPlan`; default the plain layer; `Centred()`; the experiments' plans in
    `fibquant.eval.cache_plans`). Pass it to a forward pass or to `model.generate` as `**cache_kwarg(model, cache)`
    (fibquant.kv.model: `cache=` on transformers >= 5.24, else `past_key_values=`).
    """

    def __init__(self, key_codec: Union[Codec, Sequence[Codec]], value_codec: Union[Codec, Sequence[Codec]],
                 sink_tokens: int = 4, recent_tokens: int = 32, attention: str = "decode", encode_batch: int = 16,
                 *, layer_windows: Optional[Sequence[Optional[int]]] = None, sliding_exact: bool = False,
                 recall=None, options: Optional[AttentionOptions] = None, layer_plan: Optional[LayerPlan] = None):
        key_codec, key_codecs = _codec_list(key_codec, "key_codec")
        value_codec, value_codecs = _codec_list(value_codec, "value_codec")
        _check_per_layer(key_codecs, value_codecs)
        # One codec per layer (a sequence given, or set by the plan through `set_layer_codecs`), else None:
        # every layer uses key_codec / value_codec.
        self.key_codecs: Optional[list] = key_codecs
        self.value_codecs: Optional[list] = value_codecs
        self.key_codec, self.value_codec = key_codec, value_codec
        self.sink_tokens = _check_window(sink_tokens, "sink_tokens")
        self.recent_tokens = _check_window(recent_tokens, "recent_tokens")
        self.encode_batch = _check_encode_batch(encode_batch)
        self.attention = _check_attention(attention)
        if not isinstance(sliding_exact, bool):
            raise ValueError(f"sliding_exact must be True or False, got {sliding_exact!r}")
        self.sliding_exact = sliding_exact
        self.layer_windows = _check_layer_windows(layer_windows, key_codecs)
        self.recall = _check_recall(recall, self.attention)
        self._options = DEFAULT_OPTIONS
        self.layer_plan = check_plan(layer_plan)
        self.layer_plan.check(self)
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

    def set_layer_codecs(self, key_codecs: Sequence[Codec], value_codecs: Sequence[Codec]) -> None:
        """Fix one key and one value codec per layer (a plan that chooses them from the data calls this before
        any layer has coded a token; the layers already built take theirs with `set_codecs`)."""
        _, key_codecs = _codec_list(list(key_codecs), "key_codecs")
        _, value_codecs = _codec_list(list(value_codecs), "value_codecs")
        _check_per_layer(key_codecs, value_codecs)
        if self.layer_windows is not None and len(key_codecs) != len(self.layer_windows):
            raise ValueError(f"{len(key_codecs)} per-layer codecs for a cache of {len(self.layer_windows)} layers")
        self.key_codecs, self.value_codecs = key_codecs, value_codecs

    def plain_layer(self, index: int, centre: bool = False) -> CompressedLayer:
        """The ordinary layer `index` (what the plain plan builds): a `CompressedSlidingLayer` where
        `layer_windows` says so, else a `CompressedLayer` (with the cold tier when `recall` is set);
        centre: it codes keys and values minus a mean fixed at its first encode."""
        key, value = self.layer_codecs(index)
        window = self.layer_windows[index] if self.layer_windows and index < len(self.layer_windows) else None
        if window is not None:
            return CompressedSlidingLayer(key, value, window, self.recent_tokens, self.attention, self.encode_batch,
                                          centre, exact_window=self.sliding_exact)
        return CompressedLayer(key, value, self.sink_tokens, self.recent_tokens, self.attention, self.encode_batch,
                               centre, recall=self.recall)

    def _new_layer(self) -> CompressedLayer:
        layer = self.layer_plan.new_layer(self, len(self.layers))
        layer.options = self.options
        return layer

    @classmethod
    def for_model(cls, model, code, value_codec=None, sink_tokens: int = 4, recent_tokens: int = 32,
                  attention: str = "codes", encode_batch: int = 16, *, sliding_exact: bool = False, recall=None,
                  layer_plan: Optional[LayerPlan] = None) -> "CompressedCache":
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
        key_codec, value_codec, arguments = _resolve_codecs(model, code, value_codec, recall, layer_plan)
        info = _check_model_codecs(model, key_codec, value_codec)
        attention = _check_attention(arguments.pop("attention", attention))
        latent_modules = []
        if attention == "codes":
            from fibquant.kv.attention.switch import codes_or_decode

            attention, latent_modules = codes_or_decode(model, info["latent"])
        if arguments.get("recall") is not None and (attention != "codes" or info["latent"]):
            raise ValueError("recall needs attention on the codes of a model with per-head keys and values; this "
                             f"model runs {'an MLA latent' if info['latent'] else 'attention=' + repr(attention)}")
        cache = cls(key_codec, value_codec, sink_tokens, recent_tokens, attention, encode_batch,
                    layer_windows=info["windows"], sliding_exact=sliding_exact, **arguments)
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
    def from_cache(cls, cache: Cache, key_codec, value_codec, sink_tokens: int = 4, recent_tokens: int = 32,
                   attention: str = "decode", model=None, encode_batch: int = 16, *, sliding_exact: bool = False,
                   recall=None, layer_plan: Optional[LayerPlan] = None) -> "CompressedCache":
        """Compress an already computed cache (e.g. a `DynamicCache` after a float prefill).

        The result holds what this cache would hold had it seen the same tokens in one update:
        the first `sink_tokens` and last `recent_tokens` exact, the rest as codes. The source is
        left untouched. With `model` given, `for_model`'s checks apply (and the codes may be a cache spec).
        The plan sees the source's tokens after the sinks first (`LayerPlan.start`: e.g. to choose per-layer
        codecs from them).
        """
        if model is not None:
            target = cls.for_model(model, key_codec, value_codec, sink_tokens, recent_tokens, attention,
                                   encode_batch, sliding_exact=sliding_exact, recall=recall, layer_plan=layer_plan)
        else:
            target = cls(key_codec, value_codec, sink_tokens, recent_tokens, attention, encode_batch, recall=recall,
                         layer_plan=layer_plan)
        source = _source_layers(cache)
        target.layer_plan.start(target, [(layer.keys[..., sink_tokens:, :], layer.values[..., sink_tokens:, :])
                                         for layer in source])
        target.layers = []  # rebuilt in order (for_model creates a hybrid model's layers up front)
        for index, layer in enumerate(source):
            target.layers.append(target._absorbed_layer(index, layer))
        return target

    def _absorbed_layer(self, index: int, source) -> CompressedLayer:
        """A new layer holding the tokens of `from_cache`'s source layer `index`."""
        keys, values = source.keys, source.values
        layer = self._new_layer()
        if getattr(source, "is_sliding", False) and not layer.is_sliding:
            raise ValueError(f"from_cache: layer {index} of the source is a sliding-window layer (it holds only "
                             "the window); pass model= so this cache slides that layer too")
        if keys.ndim == 4 and keys.shape[-2] > 0:
            layer.lazy_initialization(keys, values)
            layer._absorb(keys, values)
            if layer.is_sliding:  # positions count every token the source saw, not just those held
                layer.cumulative_length = max(getattr(source, "cumulative_length", 0), keys.shape[-2])
        return layer

    def __repr__(self) -> str:
        per_layer = "" if self.key_codecs is None else ", per-layer codecs"
        plan = "" if type(self.layer_plan) is LayerPlan else f", plan={self.layer_plan!r}"
        return (f"CompressedCache(key={self.key_codec!r}, value={self.value_codec!r}{per_layer}{plan}, "
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
                    attention or first.attention, first.encode_batch, layer_plan=Centred() if first.centre else None)
        for layer in layers:
            if attention is not None:
                layer.attention = _check_attention(attention)
            cache.layers.append(layer)
        return cache

