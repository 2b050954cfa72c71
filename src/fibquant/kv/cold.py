"""The cold tier of a `CompressedCache`: the exact rows of its coded tokens, recalled by the query.

As a layer codes the tokens that leave its exact window, it also appends their exact keys and values
(the model's dtype, or the `Recall.dtype` asked for) to a `ColdStore`: a growing host-memory tensor
(pinned when the cache lives on CUDA) or a memory-mapped file on disk. Both hold rows token-major,
keys [capacity, B, H, Dk] and values [capacity, B, H, Dv], so an append writes at the end (a file just
grows; a tensor grows like the code buffers, by max(capacity / 16, 64) rows) and reading the row of
(batch, head, token) is one indexed read, O(1) whatever the length.

`Recall` is the option that turns it on (`CompressedCache(..., recall=Recall(tokens=32))`, spec option
`@recall=32`): in each attention call, per layer, KV head and query row, the coded scores pick the top-k
coded tokens, whose exact rows are read from the store and scored exactly
(`fibquant.kv.attention.recall`). The store is not part of the hot bytes (`CompressedCache.nbytes`
counts codes and window); `CompressedCache.cold_nbytes` counts it, and each store counts the rows
read from it (`rows_read`, `reads`).
"""
from __future__ import annotations

import math
import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from fibquant.kv.buffer import GROWTH_FRACTION, MIN_GROWTH

STORES = ("memory", "disk")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_NUMPY = {torch.float16: np.float16, torch.bfloat16: np.uint16, torch.float32: np.float32}


@dataclass(frozen=True)
class Recall:
    """Query-aware recall from the cold tier: `tokens` coded tokens per query row (k, fixed), or a
    `fraction` of the coded tokens (k = ceil(fraction x coded)), exactly one of the two. store:
    "memory" (host memory) or "disk" (memory-mapped files in `directory`, a temporary directory when
    None). dtype: the exact rows' dtype (None: the model's; fp16, bf16 or fp32)."""

    tokens: Optional[int] = None
    fraction: Optional[float] = None
    store: str = "memory"
    directory: Optional[str] = None
    dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.fraction is None):
            raise ValueError("recall takes tokens (k, an integer >= 0) or a fraction in (0, 1], exactly one")
        if self.tokens is not None and (isinstance(self.tokens, bool) or not isinstance(self.tokens, int)
                                        or self.tokens < 0):
            raise ValueError(f"recall tokens must be an integer >= 0, got {self.tokens!r}")
        if self.fraction is not None and (isinstance(self.fraction, bool)
                                          or not isinstance(self.fraction, (int, float))
                                          or not 0.0 < float(self.fraction) <= 1.0):
            raise ValueError(f"recall fraction must be a number in (0, 1], got {self.fraction!r}")
        if self.store not in STORES:
            raise ValueError(f"recall store must be one of {STORES}, got {self.store!r}")
        if self.dtype is not None and self.dtype not in _NUMPY:
            raise ValueError(f"recall dtype must be None (the model's) or one of {list(_NUMPY)}, got {self.dtype!r}")

    def count(self, coded: int) -> int:
        """k for a layer holding `coded` coded tokens (at most all of them)."""
        if self.tokens is not None:
            return min(self.tokens, coded)
        return min(coded, math.ceil(float(self.fraction) * coded - 1e-9))

    @classmethod
    def parse(cls, text: str) -> "Recall":
        """'K' (tokens, an integer) or 'F' (a fraction, with a '.'), then ':disk' / ':memory' and
        ':fp16' / ':bf16' / ':fp32' in any order, e.g. '32', '0.02', '64:disk:fp16'."""
        head, *extras = text.strip().split(":")
        try:
            number = float(head)
        except ValueError:
            raise ValueError(f"@recall={text!r}: expected K (tokens) or F (a fraction), e.g. 32 or 0.02") from None
        options: dict = {}
        for extra in extras:
            key = "store" if extra in STORES else "dtype" if extra in DTYPES else None
            if key is None or key in options:
                raise ValueError(f"@recall={text!r}: after K or F come at most one of {STORES} and one of "
                                 f"{sorted(DTYPES)}")
            options[key] = extra if key == "store" else DTYPES[extra]
        if "." in head or "e" in head.lower():
            return cls(fraction=number, **options)
        return cls(tokens=int(number), **options)

    @property
    def text(self) -> str:
        parts = [str(self.tokens) if self.tokens is not None else f"{float(self.fraction):g}"]
        if self.fraction is not None and "." not in parts[0] and "e" not in parts[0]:
            parts[0] += ".0"  # '1.0' stays a fraction when parsed back
        if self.store != "memory":
            parts.append(self.store)
        if self.dtype is not None:
            parts.append(next(name for name, dtype in DTYPES.items() if dtype is self.dtype))
        return ":".join(parts)

    def store_for(self, batch: int, heads: int, key_dim: int, value_dim: int, dtype: torch.dtype,
                  device: torch.device) -> "ColdStore":
        """A layer's empty store (its rows in `self.dtype`, else `dtype`, the model's)."""
        path = None
        if self.store == "disk":
            directory = self.directory or tempfile.mkdtemp(prefix="fibquant-cold-")
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"layer-{uuid.uuid4().hex}")
        return ColdStore(batch, heads, key_dim, value_dim, self.dtype or dtype, device, path, recall=self)


class _Rows:
    """One role's rows [capacity, B, H, D] in host memory (a tensor) or a memory-mapped file."""

    def __init__(self, shape: tuple, dtype: torch.dtype, pinned: bool, path: Optional[str]):
        self.shape, self.dtype, self.pinned, self.path, self.generation = shape, dtype, pinned, path, 0
        if path is not None:
            open(path, "wb").close()
        self.data = self._allocate(0)

    def _allocate(self, capacity: int) -> torch.Tensor:
        if self.path is None:
            return torch.empty(capacity, *self.shape, dtype=self.dtype, pin_memory=self.pinned)
        row_bytes = int(np.prod(self.shape)) * torch.empty(0, dtype=self.dtype).element_size()
        with open(self.path, "r+b") as handle:  # the file grows; the rows already written stay where they are
            handle.truncate(max(capacity * row_bytes, 0))
        if capacity == 0:
            return torch.empty(0, *self.shape, dtype=self.dtype)
        array = np.memmap(self.path, dtype=_NUMPY[self.dtype], mode="r+", shape=(capacity, *self.shape))
        return torch.from_numpy(array).view(self.dtype)

    def grow(self, used: int, capacity: int) -> None:
        if self.path is None:
            grown = self._allocate(capacity)
            grown[:used] = self.data[:used]
            self.data = grown
        else:
            self.data = self._allocate(capacity)

    def replace(self, rows: torch.Tensor) -> None:
        """Set the rows to `rows` [n, B, H, D] (batch edits change B). A disk store writes a new file and
        unlinks the old one (a file is never shrunk under a mapping: a view taken before stays readable)."""
        self.shape = tuple(rows.shape[1:])
        if self.path is not None:
            old, self.generation = self.path, self.generation + 1
            self.path = f"{old.rsplit('~', 1)[0]}~{self.generation}"
            open(self.path, "wb").close()
            os.remove(old)
        self.data = self._allocate(rows.shape[0])
        self.data[:] = rows


class ColdStore:
    """Exact keys and values of one layer's coded tokens (see the module docstring): `append` as tokens
    are coded, `fetch` rows by (batch, head, token), `truncate` / `remap` follow the layer's edits."""

    def __init__(self, batch: int, heads: int, key_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device, path: Optional[str] = None, recall: Optional[Recall] = None):
        device = torch.device(device)
        self.recall = recall  # the options its reader (attention with recall) follows
        pinned = path is None and device.type == "cuda" and torch.cuda.is_available()
        self.device, self.path = device, path
        self.keys = _Rows((batch, heads, key_dim), dtype, pinned, path and path + ".keys")
        self.values = _Rows((batch, heads, value_dim), dtype, pinned, path and path + ".values")
        self.used = 0
        self.rows_read = 0  # (batch, head, token) rows fetched so far, keys and values counted once
        self.reads = 0      # fetch calls so far

    @property
    def capacity(self) -> int:
        return self.keys.data.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys [B, H, n, Dk], values [B, H, n, Dv] (any float dtype, any device)."""
        n = keys.shape[-2]
        if tuple(keys.shape[:2]) != self.keys.shape[:2] or keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"cold store rows are [B, H] = {self.keys.shape[:2]}, got keys {tuple(keys.shape)} "
                             f"and values {tuple(values.shape)}")
        if self.used + n > self.capacity:
            capacity = max(self.capacity + max(self.capacity // GROWTH_FRACTION, MIN_GROWTH), self.used + n)
            self.keys.grow(self.used, capacity)
            self.values.grow(self.used, capacity)
        for rows, states in ((self.keys, keys), (self.values, values)):
            rows.data[self.used: self.used + n] = states.detach().permute(2, 0, 1, 3).to("cpu", rows.dtype)
        self.used += n

    def fetch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `index` (int [B, H, u], token positions < used) -> keys [B, H, u, Dk], values
        [B, H, u, Dv] on the cache's device, in the store's dtype; counted in rows_read / reads."""
        if index.numel() and int(index.max()) >= self.used:
            raise ValueError(f"cold store holds {self.used} tokens; asked for row {int(index.max())}")
        index = index.to("cpu", torch.long)
        batch, heads, count = index.shape
        # row (token t, batch b, head h) of the flat [capacity * B * H, D] rows: (t * B + b) * H + h
        offsets = (torch.arange(batch).view(batch, 1, 1) * heads + torch.arange(heads).view(1, heads, 1))
        flat = (index * (batch * heads) + offsets).reshape(-1)
        keys = self.keys.data.view(-1, self.keys.shape[-1]).index_select(0, flat).view(batch, heads, count, -1)
        values = self.values.data.view(-1, self.values.shape[-1]).index_select(0, flat).view(batch, heads, count, -1)
        self.rows_read += index.numel()
        self.reads += 1
        if self.device.type != "cpu":
            keys, values = keys.to(self.device, non_blocking=True), values.to(self.device, non_blocking=True)
        return keys, values

    def count_reads(self, rows: int) -> None:
        """Count `rows` rows read by a kernel that reads the store's memory itself (the fused decode step)."""
        self.rows_read += rows
        self.reads += 1

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored row: keys [B, H, used, Dk], values [B, H, used, Dv] (views, host side)."""
        return (self.keys.data[: self.used].permute(1, 2, 0, 3), self.values.data[: self.used].permute(1, 2, 0, 3))

    def truncate(self, used: int) -> None:
        self.used = min(self.used, max(used, 0))

    def remap(self, fn) -> None:
        """Apply a layer's batch edit `fn` (on [B, H, n, D] tensors) to the stored rows."""
        for rows, stored in zip((self.keys, self.values), self.rows()):
            edited = fn(stored.to(self.device)).to("cpu")
            rows.replace(edited.permute(2, 0, 1, 3).contiguous())
        self.used = self.keys.data.shape[0]

    def nbytes(self) -> int:
        """Bytes reserved (capacity), keys and values."""
        return sum(r.data.numel() * r.data.element_size() for r in (self.keys, self.values))

    def used_nbytes(self) -> int:
        """Bytes of the stored rows."""
        return sum(r.data[: self.used].numel() * r.data.element_size() for r in (self.keys, self.values))

    def close(self) -> None:
        """Drop the rows (and delete a disk store's files)."""
        for rows in (self.keys, self.values):
            rows.data = torch.empty(0)
            if rows.path is not None and os.path.exists(rows.path):
                os.remove(rows.path)
        self.used = 0
