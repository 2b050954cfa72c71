"""The exact window of the vLLM backend: the first `sink_tokens` and the last `recent_tokens`
keys/values of each live sequence, kept in the model dtype beside the pages (which hold every
token as codes too), so attention reads them exactly, as `CompressedCache(sink_tokens=S,
recent_tokens=R, encode_batch=1)` does in transformers.

A page has room for codes only, so the window lives in a small side store. vLLM hands a forward
block tables, not request ids, so an entry is keyed by a physical block: the block holding the
sequence's newest recorded token (position `recorded - 1`). That block is the sequence's own while
it writes it: a block is shared (prefix caching) only once it is full, and a sharer's newest token
is in a block of its own from its first forward on. When a record moves the newest token into the
next block, the entry moves with it (`record(key, ..., new_key)`); with `snapshots` > 0 (prefix
caching on) it is copied instead, and the row it leaves stays as a *boundary snapshot*: the exact
window of every sequence whose first `recorded` tokens are those blocks' tokens, keyed by the block
ending there. A sequence that arrives on a prefix-cache hit of `past` tokens finds its window at
`row(key of position past - 1, past)` (a snapshot, or the live entry of a sequence at the same
boundary) and forks it on its first record: the cached blocks' tokens are identical, so is their
window. A prefill chunk crossing block boundaries leaves a snapshot at each
(`record(boundaries=)`).

One entry: a row of two slabs keys / values [rows, Hkv, S + R, D] (grown by doubling), the sinks
at [0, S), the recent positions p >= S in a ring at S + (p - S) % R, and the position recorded up
to. Attention is order-free over its columns (RoPE is in the keys already), so the exact columns
of a sequence with `past` earlier tokens are simply row[:, :n] with n = min(past, S) + min(R,
past - S): the sinks, then ring slots in any order; its coded positions are
[min(past, S), past - (n - S)).

Decode steps go through the batched calls: `row` (which sequences have a whole entry), `gather`
(their exact columns, one index_select per role) and `record_tokens` (one token per sequence, one
indexed write per role), so a step costs a few torch calls whatever the batch; `lookup` / `record`
serve a single sequence's prefill chunk.

The store is an accuracy bonus, never a correctness risk: an entry is used only when it holds
every position before the forward (recorded without a gap); a missing, evicted or broken entry
falls back to the codes in the pages. A block whose first slot is written again has been handed to
another sequence: the backend `invalidate`s its entries before the forward's attention. Record
after the layer's attention (lookups return views).
Memory, counted against the KV budget by the engine (`VllmCacheConfig.window_bytes`): (S + R) x
KV heads x 2 x head_dim values per layer and entry, at most `max_entries` live entries per layer
(the engine's max_num_seqs; the least recently recorded dropped first) and at most `snapshots`
boundary snapshots (the oldest dropped first).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch


def _host(tensor: torch.Tensor):
    """A numpy view of a CPU tensor (bf16 as its uint16 bits: numpy has no bf16), any strides."""
    return tensor.view(torch.uint16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()


class ExactWindow:
    def __init__(self, sink_tokens: int, recent_tokens: int, max_entries: int, snapshots: int = 0) -> None:
        if sink_tokens < 0 or recent_tokens < 0 or max_entries < 1 or snapshots < 0:
            raise ValueError(f"sink_tokens, recent_tokens and snapshots must be >= 0 and max_entries >= 1, got "
                             f"{sink_tokens}, {recent_tokens}, {snapshots}, {max_entries}")
        self.sink_tokens = sink_tokens
        self.recent_tokens = recent_tokens
        self.max_entries = max_entries
        self.snapshots = snapshots
        # block of the newest recorded token -> [slab row, recorded up to]: live entries, and boundary snapshots
        self._entries: OrderedDict[int, list] = OrderedDict()
        self._frozen: OrderedDict[int, list] = OrderedDict()
        self._keys: torch.Tensor | None = None    # [rows, Hk, S + R, D]
        self._values: torch.Tensor | None = None  # [rows, Hk, S + R, Dv]
        self._free: list[int] = []
        self._hosts: tuple | None = None  # (slab keys, numpy views of both slabs), kept while the slabs are

    @property
    def size(self) -> int:
        return self.sink_tokens + self.recent_tokens

    def _new_row(self, keys: torch.Tensor, values: torch.Tensor, frozen: bool = False) -> int:
        """A free slab row (the slabs grown by doubling), or the row of the oldest entry of the kind
        (live / snapshot) that is at its bound."""
        if self._keys is None:
            self._keys = keys.new_zeros((1, keys.shape[-2], self.size, keys.shape[-1]))
            self._values = values.new_zeros((1, values.shape[-2], self.size, values.shape[-1]))
            self._free = [0]
        store, bound = (self._frozen, self.snapshots) if frozen else (self._entries, self.max_entries)
        if len(store) >= bound:  # this kind is at its bound: its oldest entry gives up its row
            self._free.append(store.popitem(last=False)[1][0])
        if not self._free:
            old = self._keys.shape[0]
            grown = min(self.max_entries + self.snapshots, 2 * old)
            self._keys = torch.cat([self._keys, self._keys.new_zeros((grown - old, *self._keys.shape[1:]))])
            self._values = torch.cat([self._values, self._values.new_zeros((grown - old, *self._values.shape[1:]))])
            self._free.extend(range(old, grown))
        return self._free.pop()

    def _drop(self, key: int) -> None:
        for store in (self._entries, self._frozen):
            entry = store.pop(key, None)
            if entry is not None:
                self._free.append(entry[0])

    def invalidate(self, blocks) -> None:
        """Forget the entries keyed by `blocks` (ints): blocks whose first slot this forward writes, i.e.
        handed to a sequence anew, so whatever was recorded of their old tokens is stale."""
        if self._entries or self._frozen:
            for block in blocks:
                self._drop(block)

    def slot(self, position: int) -> int:
        """The slab column of a window position (a sink, or a ring slot), -1 when it is not kept."""
        if position < self.sink_tokens:
            return position
        return self.sink_tokens + (position - self.sink_tokens) % self.recent_tokens if self.recent_tokens else -1

    def _entry(self, key: int, past: int) -> list | None:
        """The entry keyed `key` (live, else a snapshot) recorded up to exactly `past`, or None."""
        entry = self._entries.get(key)
        if entry is None or entry[1] != past:
            entry = self._frozen.get(key)
        return entry if entry is not None and entry[1] == past else None

    def _advance(self, key: int | None, past: int, new_key: int, keys, values) -> list | None:
        """The entry a record of tokens from position `past` writes to, now keyed by `new_key` (the block of
        its newest token): the entry under `key` recorded up to `past`, moved, or (a snapshot kept at
        the old key) copied; a fresh zeroed one when past == 0; None when there is none (evicted, a gap)."""
        if past == 0:
            self._drop(new_key)
            row = self._new_row(keys, values)
            self._keys[row].zero_()
            self._values[row].zero_()
            entry = [row, 0]
            self._entries[new_key] = entry
            return entry
        entry = self._entry(key, past)
        if entry is None:
            return None
        if new_key == key and self._entries.get(key) is entry:  # still in its own block: in place
            self._entries.move_to_end(key)
            return entry
        if self.snapshots:  # the row stays as the snapshot at this boundary; the sequence goes on in a copy
            if self._frozen.get(key) is not entry:
                self._entries.pop(key, None)
                self._frozen.pop(key, None)
                self._frozen[key] = entry
                while len(self._frozen) > self.snapshots:  # the oldest snapshots give up their rows
                    self._free.append(self._frozen.popitem(last=False)[1][0])
            self._frozen.move_to_end(key)
            self._drop(new_key)
            row = self._new_row(keys, values)
            if self._frozen.get(key) is not entry:  # its own row went to the new entry (bound 0 cannot be)
                return None
            self._keys[row].copy_(self._keys[entry[0]])
            self._values[row].copy_(self._values[entry[0]])
            moved = [row, past]
        else:
            self._entries.pop(key, None)
            self._drop(new_key)
            moved = entry
        self._entries[new_key] = moved
        return moved

    def _freeze(self, key: int, entry: list) -> None:
        """A snapshot of `entry` (its window as recorded so far) under `key`: a boundary inside a chunk."""
        if not self.snapshots:
            return
        self._drop(key)
        row = self._new_row(self._keys, self._values, frozen=True)
        self._keys[row].copy_(self._keys[entry[0]])
        self._values[row].copy_(self._values[entry[0]])
        self._frozen[key] = [row, entry[1]]

    def _write(self, entry: list, past: int, keys: torch.Tensor, values: torch.Tensor) -> None:
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

    def record(self, key: int | None, past: int, keys: torch.Tensor, values: torch.Tensor, new_key: int,
               boundaries: list[tuple[int, int]] = ()) -> None:
        """Keep the window positions among a forward's new tokens (positions past.., keys [T, Hk, D]) of
        the sequence whose entry is keyed `key` (the block of position past - 1; ignored when past == 0),
        then keyed `new_key` (the block of its newest token, position past + T - 1). `boundaries`:
        (position P, block of position P - 1) of block ends inside (past, past + T): each leaves a
        snapshot of the window at P (when `snapshots` > 0)."""
        if self.size == 0 or keys.shape[0] == 0:
            return
        entry = self._advance(key, past, new_key, keys, values)
        if entry is None:
            return
        at = past
        if self.snapshots:
            for position, block in boundaries:
                if past < position < past + keys.shape[0]:
                    self._write(entry, at, keys[at - past:position - past], values[at - past:position - past])
                    self._freeze(block, entry)
                    at = position
        self._write(entry, at, keys[at - past:], values[at - past:])

    def counts(self, past: int) -> tuple[int, int]:
        """(sinks, recent) exact positions of a sequence with `past` earlier tokens, when its entry is whole."""
        sinks = min(past, self.sink_tokens)
        return sinks, min(self.recent_tokens, past - sinks)

    def lookup(self, key: int, past: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Exact keys/values [Hk, n, D] (views; n = sinks + recent of `counts(past)`) of a sequence with
        `past` earlier tokens whose position past - 1 is in block `key`, or None when the store does not
        hold all of them (or n = 0)."""
        row = self.row(key, past)
        if row < 0:
            return None
        n = sum(self.counts(past))
        return self._keys[row, :, :n], self._values[row, :, :n]

    def row(self, key: int, past: int) -> int:
        """The slab row of an entry keyed `key` that holds all the window positions of `past` earlier
        tokens, else -1 (no entry, a gap, or nothing to hold: n = 0)."""
        if past == 0 or self.size == 0:
            return -1
        entry = self._entry(key, past)
        return -1 if entry is None else entry[0]

    def gather(self, rows: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact keys/values [len(rows), Hk, n, D] of slab rows `rows` (from `row`, all with the same n):
        one index_select per role (a copy)."""
        index = torch.tensor(rows, dtype=torch.long)
        return self._keys.index_select(0, index)[:, :, :n], self._values.index_select(0, index)[:, :, :n]

    @property
    def dtype(self) -> torch.dtype | None:
        """The slabs' dtype (the model's), None before the first record."""
        return None if self._keys is None else self._keys.dtype

    def slabs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact keys/values of every slab row, [rows, Hk, n, D] (views: a kernel reads rows `row`
        hands out in place, through their row indices)."""
        return self._keys[:, :, :n], self._values[:, :, :n]

    def _host_slabs(self):
        """numpy views of both slabs (bf16 as uint16 bits), kept until the slabs are grown (replaced)."""
        hosts = self._hosts
        if hosts is None or hosts[0] is not self._keys:
            hosts = self._hosts = (self._keys, _host(self._keys), _host(self._values))
        return hosts[1], hosts[2]

    def host_slab_arrays(self):
        """numpy views of both whole slabs [rows, Hk, S + R, D] (C arrays; bf16 as uint16 bits): a kernel
        reads the first n columns of the rows `entries` hands out, in place, with no view per call."""
        return self._host_slabs()

    def entries(self, keys_of: list[int], pasts: list[int]) -> list[list] | None:
        """The entry (live, else a snapshot; [slab row, recorded up to]) holding every window position of
        each (key, past), or None when any of them has none (their slab rows are entry[0]), kept by a
        decode step for `live` / `advance_decode`."""
        if self.size == 0:
            return None
        found = []
        for key, past in zip(keys_of, pasts):
            entry = self._entries.get(key)
            if entry is None or entry[1] != past:
                entry = self._entry(key, past)
            if entry is None or past == 0:
                return None
            found.append(entry)
        return found

    def live(self, entries: list[list], keys_of: list[int]) -> bool:
        """Whether each of `entries` (from `entries(keys_of, ...)`) is its sequence's live entry (the steady
        state; a snapshot, under prefix caching, is forked by `record_tokens` instead)."""
        live = self._entries
        for entry, key in zip(entries, keys_of):
            if live.get(key) is not entry:
                return False
        return True

    def advance_decode(self, entries: list[list], keys_of: list[int], pasts: list[int]) -> None:
        """A decode step's record for a caller that wrote the new tokens into the entries' slab rows itself
        (at ring slots `slot(past)`; the paged kernel's `record_slots`), every token staying in the block of
        its sequence's previous token: each live entry (`live`) now holds position `past` too, and is the
        most recently recorded (no `record_tokens` lookups)."""
        live = self._entries
        for entry, key, past in zip(entries, keys_of, pasts):
            live.move_to_end(key)
            entry[1] = past + 1

    def record_tokens(self, keys_of: list[int], pasts: list[int], new_keys: list[int], keys: torch.Tensor,
                      values: torch.Tensor, host: tuple | None = None) -> None:
        """`record` of one new token per sequence (a batch of decode steps; pasts > 0): sequence i's entry
        keyed keys_of[i], then new_keys[i]; its token at position pasts[i], keys / values [B, Hk, D]. One
        indexed write per role for the whole batch. `host`: keys / values already as numpy views in the
        slabs' host form (bf16 as uint16 bits; a caller that has them saves the conversion)."""
        if self.size == 0 or not keys_of:
            return
        picks, rows, slots = [], [], []
        for i, (key, past, new_key) in enumerate(zip(keys_of, pasts, new_keys)):
            entry = self._entries.get(key)
            if entry is not None and entry[1] == past and new_key == key:  # the common case: in place
                self._entries.move_to_end(key)
            else:
                entry = self._advance(key, past, new_key, keys, values)
                if entry is None:
                    continue
            entry[1] = past + 1
            slot = self.slot(past)
            if slot >= 0:
                picks.append(i)
                rows.append(entry[0])
                slots.append(slot)
        if not picks:
            return
        if host is not None or (self._keys.device.type == "cpu" and keys.dtype == self._keys.dtype
                                and values.dtype == self._values.dtype):
            # numpy's indexed store (bf16 as its uint16 bits) costs a fraction of torch's index_put
            host_keys, host_values = self._host_slabs()
            keys, values = host if host is not None else (_host(keys), _host(values))
            if len(picks) < keys.shape[0]:
                keys, values = keys[picks], values[picks]
            rows, slots = np.array(rows, dtype=np.int64), np.array(slots, dtype=np.int64)
            host_keys[rows, :, slots] = keys  # advanced indices around a slice: [B, Hk, D]
            host_values[rows, :, slots] = values
            return
        if len(picks) < keys.shape[0]:
            chosen = torch.tensor(picks, dtype=torch.long)
            keys, values = keys.index_select(0, chosen), values.index_select(0, chosen)
        row_index, slot_index = torch.tensor(rows, dtype=torch.long), torch.tensor(slots, dtype=torch.long)
        self._keys[row_index, :, slot_index] = keys  # (advanced indices around a slice: [B, Hk, D] in order)
        self._values[row_index, :, slot_index] = values
