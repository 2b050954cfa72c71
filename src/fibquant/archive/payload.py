"""The payload-coder protocol: how one archive variant turns a block of symbols into bytes.

An `Archive` holds one `PayloadCoder` and never asks which variant it is: every reading
method takes the buffer, the block's symbol count and `base` (the payload's offset in the
buffer), so blocks are decoded in place from the memory-mapped file. The two coders are
`exact.RadixCoder` (variant "exact") and `floatmap.FloatMapCoder` (variant "float").
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from .format import ArchiveError


def as_symbols(symbols, alphabet_size: int, what: str = "symbols") -> np.ndarray:
    """Validate one int or a 1-D integer sequence/array/tensor -> int64 [n]."""
    if hasattr(symbols, "detach") and hasattr(symbols, "cpu"):  # a torch tensor on any device
        symbols = symbols.detach().cpu().numpy()
    if isinstance(symbols, (bool, np.bool_)):
        raise ArchiveError(f"{what} must be integers, got a bool")
    arr = np.asarray(symbols)
    if arr.dtype == object or arr.dtype.kind not in "iu":
        raise ArchiveError(f"{what} must have an integer dtype, got {arr.dtype}")
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ArchiveError(f"{what} must be one int or a 1-D sequence, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= alphabet_size):
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        raise ArchiveError(f"{what} must lie in [0, {alphabet_size}), got {bad}")
    return arr.astype(np.int64, copy=False)


class PayloadCoder(ABC):
    """Symbols in [0, alphabet_size) <-> the payload bytes of one archive block.

    Attributes every coder has (they fill the file header and size the blocks):
        variant        the header's variant name ("exact", "float")
        alphabet_size  N
        r              contraction of the iterated map (1/N for the exact variant)
        segment        symbols per independently decoded unit; a block holds a multiple of it
        segment_bytes  bytes one full segment costs (used to size blocks near a byte target)

    Payloads are validated ints in, int64 out; `check_payload` raises ValueError for bytes
    that are not a valid encoding of `count` symbols (the archive reports them as corrupt).
    """

    variant: ClassVar[str]

    @classmethod
    def make(cls, alphabet_size: int, r: float | None = None) -> "PayloadCoder":
        """The coder for N symbols; r = None picks the variant's default contraction."""
        return cls(alphabet_size, r)

    @abstractmethod
    def encode(self, symbols: np.ndarray) -> bytes:
        """Validated int array [n] -> the payload of one block."""

    def encode_blocks(self, symbols: np.ndarray, block_symbols: int) -> list[bytes]:
        """Payloads of consecutive blocks of `block_symbols` symbols (the last may be short)."""
        return [self.encode(symbols[s:s + block_symbols]) for s in range(0, symbols.shape[0], block_symbols)]

    @abstractmethod
    def decode(self, payload, count: int) -> np.ndarray:
        """The payload at the start of `payload` (bytes-like) -> int64 [count]."""

    def decode_range(self, payload, count: int, start: int, stop: int, base: int = 0) -> np.ndarray:
        """Symbols [start, stop) of the count-symbol payload at payload[base:] (int64)."""
        return self.decode(memoryview(payload)[base:], count)[start:stop]

    @abstractmethod
    def decode_at(self, payload, count: int, index: int, base: int = 0) -> int:
        """Symbol `index` of the count-symbol payload at payload[base:]."""

    @abstractmethod
    def check_payload(self, payload, count: int) -> None:
        """Raise ValueError unless `payload` (exactly one block) validly encodes `count` symbols."""

    @abstractmethod
    def search_index(self, symbols: np.ndarray):
        """The suffix-search index of a whole stream (int64 [n]); it has `length`,
        `search(query)` and `search_many(queries)` (see `search.py`)."""
