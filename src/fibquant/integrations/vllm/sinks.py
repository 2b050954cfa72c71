"""Exact attention sinks for the vLLM backend: the first `sink_tokens` keys/values of each live
sequence, kept in the model dtype beside the pages (which hold those tokens as codes too).

A page has room for codes only, so the sinks live in a small side store keyed by the sequence's
first block id: vLLM hands a forward the block table, not a request id, and a sequence's first
block stays its own while it lives (with prefix caching, sequences sharing a first block share its
tokens, hence its sinks). The store is an accuracy bonus, never a correctness risk: an entry is
used only when it holds every sink position before the forward; a missing, evicted or incomplete
entry falls back to the codes in the pages. Memory: sink_tokens x KV heads x 2 x head_dim values
per layer and live sequence (SmolLM2, 4 sinks: 3 KiB per layer, 92 KiB per sequence in bf16),
outside vLLM's KV budget; at most `max_entries` entries per layer (oldest dropped first).
"""
from __future__ import annotations

from collections import OrderedDict

import torch


class SinkStore:
    def __init__(self, sink_tokens: int, max_entries: int) -> None:
        if sink_tokens < 0 or max_entries < 1:
            raise ValueError(f"sink_tokens must be >= 0 and max_entries >= 1, got {sink_tokens}, {max_entries}")
        self.sink_tokens = sink_tokens
        self.max_entries = max_entries
        self._entries: OrderedDict[int, list] = OrderedDict()  # first block -> [keys, values, filled]

    def record(self, first_block: int, past: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep the sink positions among a forward's new tokens (positions past.., keys [T, Hk, D])."""
        if past >= self.sink_tokens:
            return
        if past == 0:  # a new sequence on this block: whatever the entry held is stale
            shape = (self.sink_tokens, *keys.shape[1:])
            self._entries[first_block] = [keys.new_zeros(shape), values.new_zeros(shape), 0]
        entry = self._entries.get(first_block)
        if entry is None or entry[2] < past:  # evicted, or a gap: sinks for this sequence are off
            self._entries.pop(first_block, None)
            return
        stop = min(self.sink_tokens, past + keys.shape[0])
        entry[0][past:stop] = keys[: stop - past]
        entry[1][past:stop] = values[: stop - past]
        entry[2] = stop
        self._entries.move_to_end(first_block)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def lookup(self, first_block: int, past: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Exact keys/values [min(past, sink_tokens), Hk, D] of a sequence with `past` earlier tokens,
        or None when the store does not hold all of them."""
        count = min(past, self.sink_tokens)
        entry = self._entries.get(first_block)
        if count == 0 or entry is None or entry[2] < count:
            return None
        return entry[0][:count], entry[1][:count]
