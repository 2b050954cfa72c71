"""The exact window of the vLLM backend: the first `sink_tokens` and the last `recent_tokens`
keys/values of each live sequence, kept in the model dtype beside the pages (which hold every
token as codes too), so attention reads them exactly, as `CompressedCache(sink_tokens=S,
recent_tokens=R, encode_batch=1)` does in transformers.

A page has room for codes only, so the window lives in a small side store keyed by the sequence's
first block id: vLLM hands a forward the block table, not a request id, and a sequence's first
block stays its own while it lives (prefix caching, which would share it, is refused at engine
start). One entry per sequence: a row of two slabs keys / values [rows, Hkv, S + R, D] (grown by
doubling up to `max_entries` rows), the sinks at [0, S), the recent positions p >= S in a ring at
S + (p - S) % R, and the position recorded up to. Attention is order-free over its columns (RoPE
is in the keys already), so the exact columns of a sequence with `past` earlier tokens are simply
row[:, :n] with n = min(past, S) + min(R, past - S): the sinks, then ring slots in any order; its
coded positions are [min(past, S), past - (n - S)).

Decode steps go through the batched calls: `rows` (which sequences have a whole entry), `gather`
(their exact columns, one index_select per role) and `record_tokens` (one token per sequence, one
indexed write per role), so a step costs a few torch calls whatever the batch; `lookup` / `record`
serve a single sequence's prefill chunk.

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
        self._entries: OrderedDict[int, list] = OrderedDict()  # first block -> [slab row, recorded up to]
        self._keys: torch.Tensor | None = None    # [rows, Hk, S + R, D]
        self._values: torch.Tensor | None = None  # [rows, Hk, S + R, Dv]
        self._free: list[int] = []

    @property
    def size(self) -> int:
        return self.sink_tokens + self.recent_tokens

    def _new_row(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """A free slab row for a new entry (the slabs grown by doubling, or the oldest entry's row)."""
        if self._keys is None:
            self._keys = keys.new_zeros((1, keys.shape[1], self.size, keys.shape[2]))
            self._values = values.new_zeros((1, values.shape[1], self.size, values.shape[2]))
            self._free = [0]
        if not self._free and self._keys.shape[0] < self.max_entries:
            old = self._keys.shape[0]
            grown = min(self.max_entries, 2 * old)
            self._keys = torch.cat([self._keys, self._keys.new_zeros((grown - old, *self._keys.shape[1:]))])
            self._values = torch.cat([self._values, self._values.new_zeros((grown - old, *self._values.shape[1:]))])
            self._free.extend(range(old, grown))
        if not self._free:  # every row taken: the least recently recorded entry gives up its row
            self._free.append(self._entries.popitem(last=False)[1][0])
        return self._free.pop()

    def _drop(self, first_block: int) -> None:
        entry = self._entries.pop(first_block, None)
        if entry is not None:
            self._free.append(entry[0])

    def _slot(self, position: int) -> int:
        """The slab column of a window position (a sink, or a ring slot), -1 when it is not kept."""
        if position < self.sink_tokens:
            return position
        return self.sink_tokens + (position - self.sink_tokens) % self.recent_tokens if self.recent_tokens else -1

    def record(self, first_block: int, past: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep the window positions among a forward's new tokens (positions past.., keys [T, Hk, D])."""
        if self.size == 0 or keys.shape[0] == 0:
            return
        if past == 0:  # a new sequence on this block: whatever the entry held is stale
            entry = self._entries.get(first_block)
            row = entry[0] if entry is not None else self._new_row(keys, values)
            self._keys[row].zero_()
            self._values[row].zero_()
            self._entries[first_block] = [row, 0]
        entry = self._entries.get(first_block)
        if entry is None or entry[1] != past:  # evicted, or a gap: the window of this sequence is off
            self._drop(first_block)
            return
        row_keys, row_values = self._keys[entry[0]], self._values[entry[0]]
        count, sinks, recent = keys.shape[0], self.sink_tokens, self.recent_tokens
        stop = min(sinks, past + count)
        if past < stop:  # sink positions
            row_keys[:, past:stop] = keys[: stop - past].transpose(0, 1)
            row_values[:, past:stop] = values[: stop - past].transpose(0, 1)
        first = max(past, sinks, past + count - recent)  # the newest positions >= S that stay in the ring
        if recent and first < past + count:
            slots = torch.arange(first, past + count).sub_(sinks).remainder_(recent).add_(sinks)
            row_keys[:, slots] = keys[first - past:].transpose(0, 1)
            row_values[:, slots] = values[first - past:].transpose(0, 1)
        entry[1] = past + count
        self._entries.move_to_end(first_block)

    def counts(self, past: int) -> tuple[int, int]:
        """(sinks, recent) exact positions of a sequence with `past` earlier tokens, when its entry is whole."""
        sinks = min(past, self.sink_tokens)
        return sinks, min(self.recent_tokens, past - sinks)

    def lookup(self, first_block: int, past: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Exact keys/values [Hk, n, D] (views; n = sinks + recent of `counts(past)`) of a sequence with
        `past` earlier tokens, or None when the store does not hold all of them (or n = 0)."""
        row = self.row(first_block, past)
        if row < 0:
            return None
        n = sum(self.counts(past))
        return self._keys[row, :, :n], self._values[row, :, :n]

    def row(self, first_block: int, past: int) -> int:
        """The slab row of a sequence with `past` earlier tokens whose entry holds all of its window
        positions, else -1 (no entry, a gap, or nothing to hold: n = 0)."""
        entry = self._entries.get(first_block)
        if entry is None or entry[1] != past or past == 0 or self.size == 0:
            return -1
        return entry[0]

    def gather(self, rows: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact keys/values [len(rows), Hk, n, D] of slab rows `rows` (from `row`, all with the same n):
        one index_select per role (a copy)."""
        index = torch.tensor(rows, dtype=torch.long)
        return self._keys.index_select(0, index)[:, :, :n], self._values.index_select(0, index)[:, :, :n]

    def record_tokens(self, first_blocks: list[int], pasts: list[int], keys: torch.Tensor,
                      values: torch.Tensor) -> None:
        """`record` of one new token per sequence (a batch of decode steps; pasts > 0): sequence i's token
        at position pasts[i], keys / values [B, Hk, D]. One indexed write per role for the whole batch."""
        if self.size == 0 or not first_blocks:
            return
        picks, rows, slots = [], [], []
        for i, (first_block, past) in enumerate(zip(first_blocks, pasts)):
            entry = self._entries.get(first_block)
            if entry is None or entry[1] != past:
                self._drop(first_block)
                continue
            entry[1] = past + 1
            self._entries.move_to_end(first_block)
            slot = self._slot(past)
            if slot >= 0:
                picks.append(i)
                rows.append(entry[0])
                slots.append(slot)
        if not picks:
            return
        row_index, slot_index = torch.tensor(rows, dtype=torch.long), torch.tensor(slots, dtype=torch.long)
        if len(picks) < keys.shape[0]:
            chosen = torch.tensor(picks, dtype=torch.long)
            keys, values = keys.index_select(0, chosen), values.index_select(0, chosen)
        self._keys[row_index, :, slot_index] = keys  # (advanced indices around a slice: [B, Hk, D] in order)
        self._values[row_index, :, slot_index] = values
