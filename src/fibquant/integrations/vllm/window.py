"""The exact window of the vLLM backend: the first `sink_tokens` and the last `recent_tokens`
keys/values of each live sequence, kept in the model dtype beside the pages (which hold every
token as codes too), so attention reads them exactly, as `CompressedCache(sink_tokens=S,
recent_tokens=R, encode_batch=1)` does in transformers.

A page has room for codes only, so the window lives in a small side store keyed by the sequence's
first block id: vLLM hands a forward the block table, not a request id, and a sequence's first
block stays its own while it lives (prefix caching, which would share it, is refused at engine
start). One entry per sequence: keys / values [Hkv, S + R, D], the sinks at [0, S), the recent
positions p >= S in a ring at S + (p - S) % R, and the position recorded up to. Attention is
order-free over its columns (RoPE is in the keys already), so the exact columns of a sequence
with `past` earlier tokens are simply entry[:, :n] with n = min(past, S) + min(R, past - S): the
sinks, then ring slots in any order; its coded positions are [min(past, S), past - (n - S)).

The store is an accuracy bonus, never a correctness risk: an entry is used only when it holds
every position before the forward (recorded without a gap); a missing, evicted or broken entry
falls back to the codes in the pages. Record after the layer's attention (lookups return views).
Memory, counted against the KV budget by the engine (`VllmCacheConfig.window_bytes`): (S + R) x
KV heads x 2 x head_dim values per layer and entry, at most `max_entries` entries per layer
(the engine's max_num_seqs; the least recently recorded dropped first).
"""
from __future__ import annotations

from collections import OrderedDict

import torch


class ExactWindow:
    def __init__(self, sink_tokens: int, recent_tokens: int, max_entries: int) -> None:
        if sink_tokens < 0 or recent_tokens < 0 or max_entries < 1:
            raise ValueError(f"sink_tokens and recent_tokens must be >= 0 and max_entries >= 1, got "
                             f"{sink_tokens}, {recent_tokens}, {max_entries}")
        self.sink_tokens = sink_tokens
        self.recent_tokens = recent_tokens
        self.max_entries = max_entries
        self._entries: OrderedDict[int, list] = OrderedDict()  # first block -> [keys, values, recorded up to]

    @property
    def size(self) -> int:
        return self.sink_tokens + self.recent_tokens

    def record(self, first_block: int, past: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep the window positions among a forward's new tokens (positions past.., keys [T, Hk, D])."""
        if self.size == 0 or keys.shape[0] == 0:
            return
        if past == 0:  # a new sequence on this block: whatever the entry held is stale
            shape = (keys.shape[1], self.size, keys.shape[2])
            self._entries[first_block] = [keys.new_zeros(shape), values.new_zeros(shape), 0]
        entry = self._entries.get(first_block)
        if entry is None or entry[2] != past:  # evicted, or a gap: the window of this sequence is off
            self._entries.pop(first_block, None)
            return
        count, sinks, recent = keys.shape[0], self.sink_tokens, self.recent_tokens
        stop = min(sinks, past + count)
        if past < stop:  # sink positions
            entry[0][:, past:stop] = keys[: stop - past].transpose(0, 1)
            entry[1][:, past:stop] = values[: stop - past].transpose(0, 1)
        first = max(past, sinks, past + count - recent)  # the newest positions >= S that stay in the ring
        if recent and first == past + count - 1:  # one position (every decode step): one copy per role
            slot = sinks + (first - sinks) % recent
            entry[0][:, slot] = keys[count - 1]
            entry[1][:, slot] = values[count - 1]
        elif recent and first < past + count:
            slots = torch.arange(first, past + count).sub_(sinks).remainder_(recent).add_(sinks)
            entry[0][:, slots] = keys[first - past:].transpose(0, 1)
            entry[1][:, slots] = values[first - past:].transpose(0, 1)
        entry[2] = past + count
        self._entries.move_to_end(first_block)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def counts(self, past: int) -> tuple[int, int]:
        """(sinks, recent) exact positions of a sequence with `past` earlier tokens, when its entry is whole."""
        sinks = min(past, self.sink_tokens)
        return sinks, min(self.recent_tokens, past - sinks)

    def lookup(self, first_block: int, past: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Exact keys/values [Hk, n, D] (views; n = sinks + recent of `counts(past)`) of a sequence with
        `past` earlier tokens, or None when the store does not hold all of them (or n = 0)."""
        n = sum(self.counts(past))
        entry = self._entries.get(first_block)
        if n == 0 or entry is None or entry[2] != past:
            return None
        return entry[0][:, :n], entry[1][:, :n]
