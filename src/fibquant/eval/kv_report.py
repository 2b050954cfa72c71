"""Tokenised text spans for the KV experiments."""
from __future__ import annotations

import torch


def text_tokens(tokenizer, text_name: str, count: int, offset: int = 0) -> torch.Tensor:
    """Token ids [count] of the novel `text_name`, starting `offset` tokens in.

    Raises ValueError when the book is shorter than offset + count tokens.
    """
    from fibquant.data.text import load_text

    if count < 1 or offset < 0:
        raise ValueError(f"need count >= 1 and offset >= 0, got count={count}, offset={offset}")
    text = load_text(text_name)
    # Tokenise only as much text as needed (about 4 characters per token, generous margin).
    budget = (offset + count) * 8 + 1000
    ids = tokenizer(text[:budget], return_tensors="pt", add_special_tokens=False).input_ids[0]
    if ids.shape[0] < offset + count and budget < len(text):
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    if ids.shape[0] < offset + count:
        raise ValueError(f"text {text_name!r} has {ids.shape[0]} tokens, fewer than offset {offset} + {count}")
    return ids[offset: offset + count]
