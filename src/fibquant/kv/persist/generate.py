"""Generation that writes the cache to disk as it grows, and resumption from a saved cache.

    out = generate_persistent(model, input_ids, "run.fqkv", codec, codec, max_new_tokens=64)
    out = resume_generate(model, "run.fqkv", max_new_tokens=64)   # identical continuation

`CacheWriter` is a transformers `StoppingCriteria` that never stops: generate calls it after
every forward pass with the ids so far, and it appends the code rows that left the exact
window and the new token ids, and checkpoints after the prefill (a crash then keeps the
prompt; a new store appears on disk there) and every `checkpoint_every` tokens.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from fibquant.kv.cache import CompressedCache
from fibquant.kv.model import cache_kwarg
from fibquant.kv.plan import LayerPlan
from fibquant.kv.persist.store import PersistentCache
from fibquant.kv.attention.switch import attention_on_codes


_BATCH_ONE = ("CacheWriter saves batch-1 generation only (got batch {batch}): a saved cache holds one token-id "
              "sequence to resume from. Save each sequence's cache on its own, or a batch-B cache without "
              "token ids via PersistentCache.create(..., batch=B) + append_from/checkpoint")


def _check_every(checkpoint_every) -> None:
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be a positive integer, got {checkpoint_every!r}")


class CacheWriter(StoppingCriteria):
    """Appends `cache` to `store` after every generation step; checkpoints every `checkpoint_every` tokens."""

    def __init__(self, store: PersistentCache, cache: CompressedCache, checkpoint_every: int = 64):
        _check_every(checkpoint_every)
        if store.manifest.batch != 1:
            raise ValueError(_BATCH_ONE.format(batch=store.manifest.batch))
        self.store, self.cache, self.checkpoint_every = store, cache, checkpoint_every
        self._last = cache.get_seq_length()
        self.steps = 0
        self.failed = False

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            self.failed = True  # nothing of this batch was written; close() must not checkpoint it
            raise ValueError(_BATCH_ONE.format(batch=input_ids.shape[0] if input_ids.ndim == 2 else "?"))
        self.store.append_from(self.cache, input_ids[0])
        length = self.cache.get_seq_length()
        if self.steps == 0 or length - self._last >= self.checkpoint_every:
            self.store.checkpoint(self.cache)
            self._last = length
        self.steps += 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def close(self) -> None:
        """Final append and checkpoint (not after a refused batch), then close the store."""
        try:
            if not self.failed:
                self.store.checkpoint(self.cache)
        finally:
            self.store.close()


def _generate(model, ids: torch.Tensor, cache: CompressedCache, writer: CacheWriter, **generate_kwargs):
    with attention_on_codes(model):
        criteria = StoppingCriteriaList(generate_kwargs.pop("stopping_criteria", None) or [])
        criteria.append(writer)
        generate_kwargs.setdefault("do_sample", False)
        try:
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwarg(model, cache),
                                  stopping_criteria=criteria, **generate_kwargs)
        finally:
            writer.close()


def generate_persistent(model, input_ids, path, key_codec, value_codec, *, sink_tokens: int = 4,
                        recent_tokens: int = 32, encode_batch: int = 16, checkpoint_every: int = 64,
                        overwrite: bool = False, durable: bool = False, layer_plan: Optional[LayerPlan] = None,
                        **generate_kwargs):
    """`model.generate` with a fresh `CompressedCache` that is saved to `path` while it grows.

    input_ids: int [1, T]. layer_plan: how the cache makes its layers (`fibquant.kv.plan`: `Centred()` saves
    the means with the exact window; a plan whose caches cannot be saved is refused). Other keyword arguments go to `generate` (greedy by default).
    Returns what `generate` returns; the directory holds the cache and every token id."""
    ids = torch.as_tensor(input_ids)
    ids = ids[None] if ids.ndim == 1 else ids
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [T] or [1, T], got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    _check_every(checkpoint_every)
    cache = CompressedCache.for_model(model, key_codec, value_codec, sink_tokens, recent_tokens,
                                      encode_batch=encode_batch, layer_plan=layer_plan)
    refusal = cache.layer_plan.save_refusal(cache)
    if refusal is not None:
        raise ValueError(f"this cache cannot be saved: {refusal}")
    store = PersistentCache.create(path, model, key_codec, value_codec, sink_tokens=sink_tokens,
                                   recent_tokens=recent_tokens, encode_batch=encode_batch,
                                   dtype=model.dtype, overwrite=overwrite, durable=durable,
                                   centre=cache.layer_plan.centred)
    return _generate(model, ids, cache, CacheWriter(store, cache, checkpoint_every), **generate_kwargs)


def resume_generate(model, path, extra_ids: Optional[torch.Tensor] = None, *, checkpoint_every: int = 64,
                    durable: bool = False, attention: Optional[str] = None, **generate_kwargs):
    """Continue generating from a saved cache, appending to it.

    The stored ids not yet in the KV (the last generated token; after a crash, every token
    past the recovered prefix) are fed first, then `extra_ids` [n] (e.g. a user turn) if given.
    With nothing to feed (a cache saved from a prefill of every id), the last token is
    cropped from the recent window and fed again."""
    store = PersistentCache.open(Path(path), "a", model=model, durable=durable)
    try:
        cache = store.to_cache(model, attention)
        ids = store.token_ids()
        if extra_ids is not None:
            ids = torch.cat([ids, torch.as_tensor(extra_ids).reshape(-1).to(ids.dtype)])
        if ids.shape[0] == 0:
            raise ValueError(f"{path}: no token ids stored, nothing to continue from")
        if ids.shape[0] <= cache.get_seq_length():
            if store.num_tokens and cache.layers[0].num_recent == 0:
                raise ValueError(f"{path}: every stored token is in the KV and none is in the exact window: "
                                 "pass extra_ids to continue")
            cache.crop(ids.shape[0] - 1)
    except BaseException:
        store.close()
        raise
    return _generate(model, ids[None], cache, CacheWriter(store, cache, checkpoint_every), **generate_kwargs)
