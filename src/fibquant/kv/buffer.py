"""Where coded tokens live: `CodeBuffer` (append-only uint8 code rows) and `CodedKV` (what one
update of a `CompressedCache` layer attends to, with the coded part still as codes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from fibquant.codecs.base import Codec
from fibquant.kv.options import DEFAULT_OPTIONS, AttentionOptions

MIN_GROWTH = 64      # code rows added at least when a buffer grows
GROWTH_FRACTION = 16  # ... and at least capacity / 16: copies stay amortised O(1), reserve <= 6.25 %


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes (a slice would keep its parent's storage alive)."""
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() or not tensor.is_contiguous():
        return tensor.contiguous().clone()
    return tensor


def _array_of(tensor: torch.Tensor):
    """A numpy view of `tensor` (same memory) when it is a CPU tensor of float32 or uint8 outside
    autograd, else None (the fused CPU decode kernel reads these views; see `CodedKV.arrays`)."""
    if tensor.device.type != "cpu" or tensor.requires_grad or tensor.dtype not in (torch.float32, torch.uint8):
        return None
    return tensor.numpy()


class _RowSpan:
    """Live rows [start, stop) of a preallocated `data` [..., capacity, width]."""

    data: torch.Tensor
    start: int
    stop: int

    @property
    def used(self) -> int:
        return self.stop - self.start

    @property
    def capacity(self) -> int:
        return self.data.shape[-2]


class CodeBuffer(_RowSpan):
    """Rows of uint8 codes [B, H, capacity, code_size]: appended at the end, dropped from the front.

    Growth adds max(capacity / 16, 64) rows (or what the append needs): each stored row is copied
    O(1) times on average (at most ~16 times), and the reserve never exceeds 6.25 % of the
    capacity (+64 rows). With `max_rows` (a sliding-window layer) the capacity never exceeds
    max_rows: rows dropped from the front (`drop_front`) leave a gap that an append closes by
    moving the live rows down first.

    `view()` is [B, H, used, code_size] (the live rows, in place); a view taken before an append
    stays valid (appends write past it, and growth or compaction copies into a new buffer).
    """

    def __init__(self, batch: int, heads: int, code_size: int, device: torch.device,
                 max_rows: Optional[int] = None):
        self.data = torch.empty(batch, heads, 0, code_size, dtype=torch.uint8, device=device)
        self.start = 0  # first live row (rows before it were dropped)
        self.stop = 0   # one past the last live row
        self.max_rows = max_rows
        self._view = None  # view() cached until the rows change (a decode step reads it every layer)
        self._array = None  # array() likewise
        self._norms = None  # [B, H, capacity] float32: rows [start, _norms_stop) of `data` hold their norm
        self._norms_stop = 0

    @classmethod
    def from_rows(cls, rows: torch.Tensor, max_rows: Optional[int] = None) -> "CodeBuffer":
        buffer = cls(rows.shape[0], rows.shape[1], rows.shape[-1], rows.device, max_rows)
        buffer.data, buffer.stop = _owned(rows), rows.shape[-2]
        return buffer

    def view(self) -> torch.Tensor:
        if self._view is None:
            self._view = self.data[..., self.start: self.stop, :]
        return self._view

    def array(self):
        """`view()` as a numpy view of the same memory (CPU buffers), or None; cached like view()."""
        if self._array is None:
            full = _array_of(self.data)
            self._array = False if full is None else full[:, :, self.start: self.stop]
        return None if self._array is False else self._array

    def norms_array(self):
        """The live rows' norms as float32 [B, H, used] (numpy, CPU uint8 buffers; else None): each
        row's first two bytes read as a little-endian fp16 and widened (exact); None for rows of
        fewer than two bytes (e.g. 1-byte calibrated codes: no fp16 norm there). Decoded once per row
        as rows are first asked for (a stored row never changes), so a decode step does not re-decode
        every row's norm per layer and step. Only meaningful for codes that start with an fp16 norm
        (FibQuant's layout); the fused decode kernel is the only reader. A view taken before an append
        stays valid, as `array()`'s."""
        rows = self.array()
        if rows is None or rows.shape[-1] < 2:
            return None
        if self._norms is None or self._norms.shape[-1] != self.capacity:
            self._norms = np.empty((*self.data.shape[:2], self.capacity), dtype=np.float32)
            self._norms_stop = self.start
        lo = max(self._norms_stop, self.start)
        if lo < self.stop:
            halves = np.ascontiguousarray(_array_of(self.data)[:, :, lo: self.stop, :2]).view("<f2")[..., 0]
            self._norms[:, :, lo: self.stop] = halves
            self._norms_stop = self.stop
        return self._norms[:, :, self.start: self.stop]

    def reserve(self, n: int) -> None:
        """Make room for `n` more rows now (growing as `append` would), so that a later append of
        up to n rows allocates nothing: a layer reserves before it encodes, so its long-lived
        buffer is allocated before the encode's transient buffers, not on top of them (glibc's heap
        cannot shrink below a live block: one allocated above large transients pins their pages)."""
        if self.max_rows is not None and self.used + n > self.max_rows:
            raise ValueError(f"CodeBuffer: {self.used} + {n} rows exceed max_rows={self.max_rows}")
        if self.stop + n > self.capacity:
            capacity = max(self.capacity + max(self.capacity // GROWTH_FRACTION, MIN_GROWTH), self.used + n)
            if self.max_rows is not None:
                capacity = min(capacity, self.max_rows)
            grown = torch.empty(*self.data.shape[:2], capacity, self.data.shape[-1], dtype=torch.uint8,
                                device=self.data.device)
            grown[..., : self.used, :] = self.view()
            self.data, self.start, self.stop = grown, 0, self.used
            self._view = self._array = self._norms = None  # reset last: the copy above reads the old rows

    def append(self, rows: torch.Tensor) -> None:
        """rows: uint8 [B, H, n, code_size]."""
        n = rows.shape[-2]
        self.reserve(n)
        self.data[..., self.stop: self.stop + n, :] = rows
        self.stop += n
        self._view = self._array = None  # reset last: growth above reads the old rows through view()

    def drop_front(self, n: int) -> None:
        """Forget the oldest `n` live rows (tokens that left a sliding window)."""
        self.start = min(self.stop, self.start + max(n, 0))
        self._view = self._array = None

    def truncate(self, used: int) -> None:
        self.stop = self.start + min(self.used, max(used, 0))
        self._norms_stop = min(self._norms_stop, self.stop)  # rows appended there later are new rows
        self._view = self._array = None

    def remap(self, fn) -> None:
        """Apply a batch edit (select, repeat, move) to the stored rows; capacity shrinks to fit."""
        self.data = _owned(fn(self.view()))
        self.start, self.stop = 0, self.data.shape[-2]
        self._view = self._array = self._norms = None

    def nbytes(self) -> int:
        return self.data.untyped_storage().nbytes()

    def used_nbytes(self) -> int:
        return self.view().numel()


WINDOW_RESERVE_FRACTION = 8  # a window buffer that outgrows its capacity gets used / 8 rows of reserve


class WindowBuffer(_RowSpan):
    """The float rows of an exact window [B, H, capacity, D]: appended at the end, dropped from the front.

    `view()` is [B, H, used, D], the live rows in place (the last dimension contiguous). An append
    that does not fit after the last live row moves the live rows into a new buffer of capacity
    max(used + n + (used + n) / 8, `min_capacity`), so a view taken before an append stays valid
    (appends write past it, a move leaves the old buffer as it was). With `min_capacity` = the
    window's steady size (recent_tokens + encode_batch) a decode step writes its row in place and the
    live rows move once every `encode_batch` steps, instead of two concatenations per step.
    Setting a window from a tensor (`from_rows`) keeps that tensor as the buffer, full: the next
    append moves the rows first, so a tensor handed in is never written to.
    """

    def __init__(self, rows: torch.Tensor, min_capacity: int = 0):
        if rows.stride(-1) != 1 and rows.shape[-1] > 1:
            rows = rows.contiguous()
        self._set(rows)
        self.start = 0
        self.stop = rows.shape[-2]
        self.min_capacity = min_capacity

    def _set(self, data: torch.Tensor) -> None:
        self.data = data
        # a numpy view of a float32 CPU buffer: array() and the in-place append go through it
        # (a few numpy index operations instead of torch's narrow / copy_ dispatch per step)
        self._array = _array_of(data) if data.dtype == torch.float32 else None

    def view(self) -> torch.Tensor:
        if self._array is not None:  # the same view, built from numpy's slice (cheaper than narrow)
            return torch.from_numpy(self._array[:, :, self.start: self.stop])
        return self.data.narrow(-2, self.start, self.stop - self.start)

    def array(self):
        """`view()` as a numpy view of the same memory (float32 CPU buffers), or None."""
        return None if self._array is None else self._array[:, :, self.start: self.stop]

    def append(self, rows: torch.Tensor) -> None:
        """rows: [B, H, n, D] (cast to the buffer's dtype)."""
        n = rows.shape[-2]
        if self.stop + n > self.capacity:
            need = self.used + n
            capacity = max(need + need // WINDOW_RESERVE_FRACTION, self.min_capacity)
            moved = self.data.new_empty(*self.data.shape[:2], capacity, self.data.shape[-1])
            moved.narrow(-2, 0, self.used).copy_(self.view())
            self._set(moved)
            self.start, self.stop = 0, self.used
        if n:
            source = rows.numpy() if self._array is not None and rows.is_cpu and rows.dtype is torch.float32 \
                and not rows.requires_grad else None
            if source is not None and source.shape[:2] == self._array.shape[:2] \
                    and source.shape[-1] == self._array.shape[-1]:
                self._array[:, :, self.stop: self.stop + n] = source
            else:
                self.data.narrow(-2, self.stop, n).copy_(rows)
            self.stop += n

    def drop_front(self, n: int) -> None:
        self.start = min(self.stop, self.start + max(n, 0))

    def truncate(self, used: int) -> None:
        self.stop = self.start + min(self.used, max(used, 0))


@dataclass(frozen=True)
class CodedKV:
    """What the new tokens of one update attend to, with the coded part still as codes.

    Column order (= absolute token order): sinks [B,H,s,D], coded [B,H,m,code_size] (uint8),
    recent [B,H,r,D], new [B,H,T,D]. Returned by `CompressedLayer.update` in "codes" mode in
    place of both the key and the value tensor; `materialize()` gives the reference floats.
    """

    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    key_codes: torch.Tensor
    value_codes: torch.Tensor
    recent_keys: torch.Tensor
    recent_values: torch.Tensor
    new_keys: torch.Tensor
    new_values: torch.Tensor
    key_codec: Codec
    value_codec: Codec
    key_mean: Optional[torch.Tensor] = None    # [B, H, D] float32 added back to decoded keys (centring)
    value_mean: Optional[torch.Tensor] = None  # [B, H, D] float32 added back to decoded values
    # numpy views of the same memory as (sink_keys, sink_values, key_codes, value_codes, recent_keys,
    # recent_values), set by a float32 CPU `CompressedLayer`, then the code rows' fp16 norms as float32
    # [B, H, m] (key, value; decoded once per row): the fused CPU decode kernel reads them instead of
    # converting six tensors and decoding every norm per layer and step. None: it converts the tensors.
    arrays: Optional[tuple] = field(default=None, repr=False, compare=False)
    # the paths attention takes (the cache's `options`; `fibquant.kv.options`)
    options: AttentionOptions = field(default=DEFAULT_OPTIONS, repr=False, compare=False)
    # The layer's cold tier (`fibquant.kv.cold.ColdStore`, with recall on): the exact rows of the coded
    # tokens, of which attention on the codes recalls the top-k per query (`fibquant.kv.attention.recall`).
    cold: Optional[object] = field(default=None, repr=False, compare=False)

    @classmethod
    def of_tensors(cls, keys: torch.Tensor, values: torch.Tensor) -> "CodedKV":
        """Plain keys/values [B, H, L, D|Dv] as a CodedKV with no sinks, codes or window (all "new")."""
        batch, heads = keys.shape[:2]
        no_codes = torch.empty(batch, heads, 0, 1, dtype=torch.uint8, device=keys.device)
        return cls(keys[..., :0, :], values[..., :0, :], no_codes, no_codes, keys[..., :0, :], values[..., :0, :],
                   keys, values, None, None)

    @property
    def num_sink(self) -> int:
        return self.sink_keys.shape[-2]

    @property
    def num_coded(self) -> int:
        return self.key_codes.shape[-2]

    @property
    def length(self) -> int:
        return self.num_sink + self.num_coded + self.recent_keys.shape[-2] + self.new_keys.shape[-2]

    def exact(self, with_sinks: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact part after the codes (recent window + new tokens), [B, H, r+T, D] each; with
        `with_sinks`, the sinks first: [B, H, s+r+T, D]. With nothing before the new tokens these are
        `new_keys` / `new_values` themselves (read them, do not write to them)."""
        dtype_k, dtype_v = self.new_keys.dtype, self.new_values.dtype
        keys, values = [self.recent_keys, self.new_keys], [self.recent_values, self.new_values]
        if with_sinks:
            keys.insert(0, self.sink_keys)
            values.insert(0, self.sink_values)
        if all(t.shape[-2] == 0 for t in keys[:-1]):  # a first chunk: the new tokens themselves, not a copy
            return self.new_keys, self.new_values
        return (torch.cat([t.to(dtype_k) for t in keys], dim=-2),
                torch.cat([t.to(dtype_v) for t in values], dim=-2))

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Float keys and values [B, H, length, D]: the coded part decoded (the reference path)."""
        exact_keys, exact_values = self.exact()
        keys = torch.cat([self.sink_keys.to(exact_keys.dtype),
                          _decode_centred(self.key_codec, self.key_codes, self.key_mean, exact_keys.dtype),
                          exact_keys], dim=-2)
        values = torch.cat([self.sink_values.to(exact_values.dtype),
                            _decode_centred(self.value_codec, self.value_codes, self.value_mean, exact_values.dtype),
                            exact_values], dim=-2)
        return keys, values

    def __getattr__(self, name: str):
        # Only reached for attributes a CodedKV does not have, i.e. when an attention function
        # other than fibquant's treats it as a tensor: say what to do instead of failing obscurely.
        raise AttributeError(
            f"CodedKV has no attribute {name!r}: a CompressedCache with attention='codes' must be used by a model "
            "whose attention implementation is 'fibquant' (CompressedCache.for_model or "
            "fibquant.kv.attention.entry.use_coded_attention(model) set it), or create the cache with attention='decode'")


def _decode_centred(codec: Codec, codes: torch.Tensor, mean: Optional[torch.Tensor], dtype) -> torch.Tensor:
    """codec.decode(codes) [B, H, m, D], plus the layer's mean [B, H, D] when the cache centres."""
    if mean is None:
        return codec.decode(codes, dtype=dtype)
    return (codec.decode(codes) + mean.unsqueeze(-2)).to(dtype)

