"""The explicit, reversible switch of a model to attention on codes: `attention_on_codes(model)`.

A `CompressedCache` built with attention="codes" hands the model's attention function a `CodedKV`
(codes, not float keys/values), which only fibquant's attention function ("fibquant" in transformers'
`AttentionInterface`) reads. Building the cache changes nothing in the model; this context manager
switches the model's attention implementation to "fibquant" (and, for an MLA model, lets its attention
modules pass the latent's codes through unexpanded, `fibquant.kv.attention.mla`) and puts back the
previous implementation on exit, also on an exception:

    cache = CompressedCache.for_model(model, "e8shell:b=2,nc=1")
    with attention_on_codes(model):
        model.generate(**inputs, past_key_values=cache, max_new_tokens=64)

Inside the context every other cache (DynamicCache, a decode-mode CompressedCache) is served as SDPA
serves it. A model that cannot dispatch to an attention function (`unsupported_reason`) is left as it
is, with a one-time warning; `for_model` gives such a model a cache with attention="decode". A cache on
codes used outside the context raises `AttentionNotOnCodes` at its first update, before it stores a token.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from fibquant.kv.attention import mla
from fibquant.kv.attention.entry import ATTENTION_NAME, unsupported_reason, use_coded_attention
from fibquant.kv.attention.notices import warn_once


class AttentionNotOnCodes(RuntimeError):
    """A CompressedCache with attention="codes" was used by a model not switched to attention on codes."""


@contextmanager
def attention_on_codes(model) -> Iterator[bool]:
    """Run `model` with fibquant's attention inside the block; yields whether it switched (False: the model
    cannot dispatch to an attention function, it runs unchanged and its caches decode). Nests."""
    reason = unsupported_reason(model)
    if reason is not None:
        warn_once(f"model:{type(model).__name__}", f"attention on codes is unsupported for this model: {reason}; "
                   "the model runs unchanged (a CompressedCache for it decodes its codes)")
        yield False
        return
    previous = model.config._attn_implementation
    latent = mla.enable(model)
    try:
        use_coded_attention(model)
        yield True
    finally:
        if previous != model.config._attn_implementation:
            model.set_attn_implementation(previous)
        mla.disable(latent)


def is_on_codes(model, latent_modules=()) -> bool:
    """Whether `model` runs fibquant's attention now (and every MLA module in `latent_modules` reads codes)."""
    return (getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME
            and all(mla.reads_codes(module) for module in latent_modules))


def check_on_codes(model, latent_modules=()) -> None:
    """Raise `AttentionNotOnCodes` naming the fix unless `is_on_codes(model, latent_modules)`."""
    if not is_on_codes(model, latent_modules):
        raise AttentionNotOnCodes(
            f"this CompressedCache attends on its codes (attention='codes') but {type(model).__name__} runs "
            f"attention implementation {getattr(model.config, '_attn_implementation', None)!r}: run the model inside "
            "`with fibquant.attention_on_codes(model):`, or build the cache with attention='decode'")


def codes_or_decode(model, latent: bool) -> tuple[str, list]:
    """("codes", the MLA modules to check) when `model` can run attention on codes, else ("decode", []) with a
    one-time warning naming why. Changes nothing in the model."""
    reason = unsupported_reason(model)
    if reason is not None:
        warn_once(f"model:{type(model).__name__}", f"attention on codes is unsupported for this model: {reason}; "
                   "the CompressedCache falls back to attention='decode'")
        return "decode", []
    if not latent:
        return "codes", []
    modules = mla.latent_modules(model)
    if not modules:
        warn_once(f"latent:{type(model).__name__}", f"{type(model).__name__} caches an MLA latent but its attention "
                   "modules are not the form fibquant's latent attention knows (expand_kv + kv_b_proj): the "
                   "CompressedCache codes the latent and uses attention='decode'")
        return "decode", []
    return "codes", modules
