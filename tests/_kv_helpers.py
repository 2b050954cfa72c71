"""Shared helpers for the KV-cache tests: a tiny random Llama and a process-wide real model."""
from __future__ import annotations

import functools

import pytest
import torch

REAL_PROMPT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of"
)


def tiny_llama(seed: int = 0, **overrides):
    """A randomly initialised LlamaForCausalLM with GQA (4 query heads, 2 KV heads, head_dim 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    settings = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    settings.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**settings)).eval()


@functools.lru_cache(maxsize=1)
def _load_real_model():
    from fibquant.kv.model import load_model

    return load_model()


def real_model(request):
    """The session fixture `model_and_tokenizer` when conftest provides it, else a cached load."""
    try:
        return request.getfixturevalue("model_and_tokenizer")
    except pytest.FixtureLookupError:
        return _load_real_model()
