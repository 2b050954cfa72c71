"""`Archive`: one file that is the storage, the random-access decoder and the search index
of a stream of symbols from an alphabet of N.

    with Archive.create("codes.fqa", alphabet_size=256) as a:
        a.append(symbols)          # one int or an int array; amortised O(1) per symbol
    a = Archive.open("codes.fqa")  # memory-mapped; recovers from a torn tail
    a[123], a[10:20], len(a), a.search([3, 1, 4]), a.context(position, 8)

Symbols are buffered until a block of `block_symbols` is full, then the block is encoded
(vectorised), checksummed and written with one write call (see `format.py`); `close()`
seals the partial last block. Random access touches one block: its CRC is verified the
first time the block is read after opening, then one key (exact) or one anchor (float) is
decoded.
"""
from __future__ import annotations

import mmap
import os
import warnings
import zlib
from bisect import bisect_right
from pathlib import Path

import numpy as np

from .exact import RadixCoder
from .floatmap import FloatMapCoder
from .format import (HEADER_SIZE, RECORD_HEADER_SIZE, ArchiveCorruptError, ArchiveError, Header, RecoveryWarning,
                     pack_record, scan_records, unpack_header)
from .payload import PayloadCoder, as_symbols
from .writer import WriterLock, check_new_store

DEFAULT_VARIANT = "exact"
TARGET_BLOCK_BYTES = 8192  # a block costs one CRC on first touch; ~8 KB keeps that ~1 us


PAYLOAD_CODERS: dict[str, type[PayloadCoder]] = {RadixCoder.variant: RadixCoder, FloatMapCoder.variant: FloatMapCoder}


def make_coder(variant: str, alphabet_size: int, r: float | None = None) -> PayloadCoder:
    """The payload coder of an archive variant ("exact" or "float")."""
    if variant not in PAYLOAD_CODERS:
        raise ArchiveError(f"variant must be one of {sorted(PAYLOAD_CODERS)}, got {variant!r}")
    return PAYLOAD_CODERS[variant].make(alphabet_size, r)


class Archive:
    """A fractal archive file. Build with `Archive.create` or `Archive.open`."""

    def __init__(self, path: Path, header: Header, coder: PayloadCoder, handle, writable: bool, durable: bool):
        self.path = path
        self.header = header
        self.alphabet_size = header.alphabet_size
        self.variant = header.variant
        self.block_symbols = header.block_symbols
        self._coder = coder
        self._handle = handle
        self._writable = writable
        self._durable = durable
        self._offsets: list[int] = []
        self._lengths: list[int] = []
        self._counts: list[int] = []
        self._crcs: list[int] = []
        self._starts: list[int] = []
        self._lock: WriterLock | None = None  # held while writable (unless the caller locks an enclosing store)
        self._building: Path | None = None  # a new archive's file: in place, or aside until close() publishes it
        self._lock_only = True  # _building is the path itself: nothing to publish
        self._verified = bytearray()
        self._sealed = 0
        self._uniform = True  # every block but the last is full: block = i // block_symbols
        self._pending: list[int] = []
        self._end = HEADER_SIZE
        self._map = None
        self._mapped = 0
        self._index = None
        # Byte-aligned one-symbol keys (N = 256, 2^16, 2^32): symbol i is one little-endian
        # unsigned int at a fixed offset of its block, so `view` can hand out the mapped bytes.
        self._direct = np.dtype(f"<u{coder.key_bytes}") if isinstance(coder, RadixCoder) and coder.group == 1 \
            and coder.byte_aligned and coder.key_bytes in (1, 2, 4, 8) else None
        self.closed = False

    # ---------------------------------------------------------------- creation
    @classmethod
    def create(cls, path, alphabet_size: int, *, variant: str = DEFAULT_VARIANT, r: float | None = None,
               block_symbols: int | None = None, overwrite: bool = False, durable: bool = False,
               lock: bool = True) -> "Archive":
        """New empty archive for symbols in [0, alphabet_size).

        variant "exact" (default: radix keys, bit-tight, platform independent) or "float"
        (the paper's 2-D map, float64 anchors; r defaults below the disc bound, r > r*(N) is
        refused). durable=True fsyncs after every sealed block. The writer lock is taken
        (`fibquant.archive.writer`) and held until `close()`. A new file grows in place (a crash
        leaves a recoverable prefix); an exception inside `with` deletes it. With overwrite, the
        new file is built under a temporary name and replaces the old one at `close()`, once
        complete. lock=False: the caller locks an enclosing store (a code archive, a saved cache);
        the file is written in place."""
        coder = make_coder(variant, alphabet_size, r)
        if block_symbols is None:
            # A multiple of 8 segments: bit-packed keys then end each block on a byte boundary.
            block_symbols = coder.segment * max(8, TARGET_BLOCK_BYTES // coder.segment_bytes // 8 * 8)
        header = Header(coder.variant, coder.alphabet_size, coder.r, coder.segment, block_symbols)
        path = Path(path)
        writer = WriterLock.acquire(path) if lock else None
        try:
            check_new_store(path, overwrite, "file")
            building = writer.building() if writer is not None and path.exists() else path
            try:
                handle = open(building, "w+b")
            except OSError as exc:
                raise ArchiveError(f"cannot create archive {path}: {exc.strerror}") from None
        except BaseException:
            if writer is not None:
                writer.release()
            raise
        handle.write(header.pack())
        handle.flush()
        if durable:
            os.fsync(handle.fileno())
        archive = cls(path, header, coder, handle, True, durable)
        archive._lock, archive._building = writer, (building if writer is not None else None)
        archive._lock_only = building == path
        return archive

    @classmethod
    def open(cls, path, mode: str = "r", *, durable: bool = False, lock: bool = True) -> "Archive":
        """Open an archive for reading ("r") or reading and appending ("a").

        An unsealed tail left by a crash is dropped with a RecoveryWarning (and cut off the
        file in mode "a"); every other inconsistency raises ArchiveCorruptError. Mode "a" takes
        the writer lock first (StoreLockedError while another process writes it; lock=False:
        the caller locks an enclosing store); reading takes none."""
        if mode not in ("r", "a"):
            raise ArchiveError(f"mode must be 'r' or 'a', got {mode!r}")
        path = Path(path)
        writer = WriterLock.acquire(path) if mode == "a" and lock else None
        try:
            handle = open(path, "rb" if mode == "r" else "r+b")
        except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
            if writer is not None:
                writer.release()
            raise ArchiveError(f"cannot open archive {path}: {exc.strerror}") from None
        try:
            size = os.fstat(handle.fileno()).st_size
            header = unpack_header(handle.read(HEADER_SIZE))
            try:
                coder = make_coder(header.variant, header.alphabet_size, header.r)
            except ValueError as exc:  # a header with a valid checksum but impossible fields
                raise ArchiveCorruptError(f"{path}: inconsistent archive header: {exc}") from None
            archive = cls(path, header, coder, handle, mode == "a", durable)
            archive._remap(size)
            index = scan_records(archive._map, size, header.block_symbols)
        except BaseException:
            handle.close()
            if writer is not None:
                writer.release()
            raise
        archive._lock = writer
        if index.dropped_tail:
            warnings.warn(f"{path}: dropped an unsealed tail of {index.dropped_tail} bytes "
                          f"(an interrupted write); {len(index.counts)} sealed blocks recovered",
                          RecoveryWarning, stacklevel=2)
            if mode == "a":
                handle.truncate(index.end)
        for offset, length, count, crc in zip(index.offsets, index.lengths, index.counts, index.crcs):
            archive._register(offset, length, count, crc)
        archive._end = index.end
        handle.seek(index.end)
        return archive

    def _register(self, offset: int, length: int, count: int, crc: int) -> None:
        if self._counts and self._counts[-1] != self.block_symbols:
            self._uniform = False
        self._offsets.append(offset)
        self._lengths.append(length)
        self._counts.append(count)
        self._crcs.append(crc)
        self._starts.append(self._sealed)
        self._verified.append(0)
        self._sealed += count

    # --------------------------------------------------------------- appending
    def append(self, symbols) -> None:
        """Append one symbol (int) or many (1-D int array/list/tensor)."""
        if type(symbols) is int and self._writable and 0 <= symbols < self.alphabet_size:
            pending = self._pending  # fast path for one symbol at a time
            pending.append(symbols)
            if len(pending) >= self.block_symbols:
                self._write_blocks(np.array(pending, dtype=np.int64))
                pending.clear()
            return
        self._check_writable()
        arr = as_symbols(symbols, self.alphabet_size)
        room = self.block_symbols - len(self._pending)
        if arr.shape[0] < room:
            self._pending.extend(arr.tolist())
            return
        if self._pending:
            head = np.concatenate([np.array(self._pending, dtype=np.int64), arr[:room]])
            arr = arr[room:]
            self._write_blocks(head)
            self._pending.clear()
        full = arr.shape[0] - arr.shape[0] % self.block_symbols
        if full:
            self._write_blocks(arr[:full])
        self._pending.extend(arr[full:].tolist())

    def _write_blocks(self, symbols: np.ndarray) -> None:
        """Encode, checksum and write consecutive blocks (the last may be short)."""
        size = self.block_symbols
        payloads = self._coder.encode_blocks(symbols, size)
        records, entries = [], []
        offset, first = self._end, self._sealed
        for k, payload in enumerate(payloads):
            count = min(size, symbols.shape[0] - k * size)
            record = pack_record(first, count, payload)
            records.append(record)
            entries.append((offset + len(record) - len(payload), len(payload), count, zlib.crc32(payload)))
            offset += len(record)
            first += count
        self._handle.seek(self._end)
        self._handle.write(b"".join(records))
        self._handle.flush()
        if self._durable:
            os.fsync(self._handle.fileno())
        for entry in entries:  # only once the bytes are written: a failed write leaves no phantom blocks
            self._register(*entry)
            self._verified[-1] = 1  # written from memory just now
        self._end = offset

    def truncate(self, n_symbols: int) -> None:
        """Cut the archive back to its first `n_symbols` symbols (open for appending).

        Archives are append-only by design; this brings independently sealed streams back into
        step after an interrupted write (crash recovery). The file is cut at the record holding
        symbol `n_symbols`, and that record's leading symbols are written again as one sealed
        record (fsynced when durable), so the archive holds exactly n_symbols sealed symbols."""
        self._check_writable()
        if isinstance(n_symbols, bool) or not isinstance(n_symbols, (int, np.integer)) or n_symbols < 0:
            raise ArchiveError(f"n_symbols must be a non-negative int, got {n_symbols!r}")
        n_symbols = int(n_symbols)
        if n_symbols >= len(self):
            return
        if n_symbols >= self._sealed:
            del self._pending[n_symbols - self._sealed:]
            return
        block = self._locate(n_symbols)[0]
        start = self._starts[block]
        keep = self.read(start, n_symbols)
        cut = self._offsets[block] - RECORD_HEADER_SIZE
        self._pending.clear()
        for entries in (self._offsets, self._lengths, self._counts, self._crcs, self._starts, self._verified):
            del entries[block:]
        self._sealed = start
        self._uniform = all(count == self.block_symbols for count in self._counts[:-1])
        self._index = None
        self._map, self._mapped = None, 0  # the file shrinks: no map may reach past its new end
        self._handle.truncate(cut)
        self._handle.flush()
        if self._durable:
            os.fsync(self._handle.fileno())
        self._end = cut
        if keep.size:
            self._write_blocks(keep)

    def _check_writable(self) -> None:
        if self.closed:
            raise ArchiveError("archive is closed")
        if not self._writable:
            raise ArchiveError(f"{self.path} is open read-only (use Archive.open(path, mode='a'))")

    # ----------------------------------------------------------------- reading
    def __len__(self) -> int:
        return self._sealed + len(self._pending)

    def _remap(self, size: int) -> None:
        if size <= self._mapped:
            return
        # The old map is dropped, not closed: numpy views of it may still be alive.
        self._map = mmap.mmap(self._handle.fileno(), size, access=mmap.ACCESS_READ)
        self._mapped = size

    def _verify(self, block: int) -> None:
        offset, length, count = self._offsets[block], self._lengths[block], self._counts[block]
        view = memoryview(self._map)[offset:offset + length]
        try:
            if zlib.crc32(view) != self._crcs[block]:
                raise ArchiveCorruptError(f"{self.path}: checksum mismatch in block {block} (offset {offset})")
            try:
                self._coder.check_payload(view, count)
            except ValueError as exc:
                raise ArchiveCorruptError(f"{self.path}: block {block}: {exc}") from None
        finally:
            view.release()
        self._verified[block] = 1

    def _locate(self, i: int) -> tuple[int, int]:
        if self._uniform:
            return divmod(i, self.block_symbols)
        block = bisect_right(self._starts, i) - 1
        return block, i - self._starts[block]

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step == 1:
                return self.read(start, max(start, stop))
            if (step > 0 and start >= stop) or (step < 0 and start <= stop):
                return np.empty(0, dtype=np.int64)
            low, high = (start, stop) if step > 0 else (stop + 1, start + 1)
            return self.read(low, high)[start - low::step]
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)):
            raise TypeError(f"archive indices must be int or slice, got {type(key).__name__}")
        i = int(key)
        n = self._sealed + len(self._pending)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"archive index {key} out of range for length {n}")
        if i >= self._sealed:
            return self._pending[i - self._sealed]
        if self.closed:
            raise ArchiveError("archive is closed")
        if self._mapped < self._end:
            self._remap(self._end)  # blocks appended since the map was made
        block, j = self._locate(i)
        if not self._verified[block]:
            self._verify(block)
        return self._coder.decode_at(self._map, self._counts[block], j, self._offsets[block])

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Symbols [start, stop) as int64, decoding only the blocks they touch."""
        n = len(self)
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise IndexError(f"range [{start}, {stop}) out of bounds for length {n}")
        if self.closed:
            raise ArchiveError("archive is closed")
        if self._mapped < self._end:
            self._remap(self._end)
        parts = []
        sealed_stop = min(stop, self._sealed)
        if start < sealed_stop:
            first, _ = self._locate(start)
            last, _ = self._locate(sealed_stop - 1)
            for block in range(first, last + 1):
                if not self._verified[block]:
                    self._verify(block)
                first_symbol, count = self._starts[block], self._counts[block]
                a, b = max(start - first_symbol, 0), min(sealed_stop - first_symbol, count)
                parts.append(self._coder.decode_range(self._map, count, a, b, self._offsets[block]))
        if stop > self._sealed:
            parts.append(np.array(self._pending[max(start - self._sealed, 0):stop - self._sealed], dtype=np.int64))
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def view(self, start: int, count: int) -> np.ndarray:
        """Symbols [start, start + count) with the least work (random access of a short run):
        for byte-aligned one-symbol keys (N = 256, 2^16, 2^32) inside one sealed block, a
        read-only view of the mapped payload (its unsigned key dtype, valid while the archive
        is open); otherwise `read` (int64). The block's CRC is verified on first touch."""
        direct = self._direct
        if direct is not None and 0 <= start and 0 < count and start + count <= self._sealed and not self.closed:
            if self._uniform:
                block, j = divmod(start, self.block_symbols)
            else:
                block, j = self._locate(start)
            if j + count <= self._counts[block]:
                if self._mapped < self._end:
                    self._remap(self._end)  # blocks appended since the map was made
                if not self._verified[block]:
                    self._verify(block)
                return np.frombuffer(self._map, direct, count, self._offsets[block] + j * direct.itemsize)
        return self.read(start, start + count)

    def context(self, position: int, length: int) -> np.ndarray:
        """The `length` symbols ending at `position` (a search hit), decoded backward from it."""
        if not isinstance(length, (int, np.integer)) or length < 0:
            raise ArchiveError(f"context length must be a non-negative int, got {length!r}")
        if not 0 <= position < len(self):
            raise IndexError(f"position {position} out of range for length {len(self)}")
        return self.read(max(0, position - length + 1), position + 1)

    # ------------------------------------------------------------------ search
    def search_index(self):
        """The (cached) suffix index; rebuilt after appends."""
        if self._index is None or self._index.length != len(self):
            self._index = self._coder.search_index(self.read())
        return self._index

    def search(self, query) -> np.ndarray:
        """Sorted end positions i with archive[i-l+1 : i+1] == query (l = len(query))."""
        if isinstance(query, np.ndarray) and query.ndim == 1 and query.dtype.kind in "iu":
            symbols = query.tolist()  # short queries: Python-level checks beat numpy reductions
        elif isinstance(query, (list, tuple)) and all(type(c) is int for c in query):
            symbols = list(query)
        else:
            symbols = as_symbols(query, self.alphabet_size, "query").tolist()
        if symbols and (min(symbols) < 0 or max(symbols) >= self.alphabet_size):
            as_symbols(symbols, self.alphabet_size, "query")  # raises the range error
        index = self._index
        if index is None or index.length != len(self):
            index = self.search_index()
        return index.search(symbols)

    def search_many(self, queries) -> list[np.ndarray]:
        """Batched search of equal-length queries, int [q, l] -> one sorted array per query."""
        arr = np.asarray(queries)
        if arr.ndim != 2:
            raise ArchiveError(f"queries must be a 2-D int array [q, l], got shape {arr.shape}")
        flat = as_symbols(arr.reshape(-1), self.alphabet_size, "queries").reshape(arr.shape)
        return self.search_index().search_many(flat)

    def points(self, start: int = 0, stop: int | None = None, depth: int | None = None,
               r: float | None = None) -> np.ndarray:
        """2-D iterated-map points of positions [start, stop): float64 [m, 2] (for plots and
        geometric queries; any variant). Position i's point encodes its last `depth`
        symbols (default: what a float64 point resolves) with contraction r (default:
        the float variant's safe default, or the archive's r for a float archive)."""
        own_map = r is None and isinstance(self._coder, FloatMapCoder)
        coder = self._coder if own_map else FloatMapCoder(self.alphabet_size, r)
        depth = coder.segment if depth is None else depth
        stop = len(self) if stop is None else stop
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"range [{start}, {stop}) out of bounds for length {len(self)}")
        history = max(0, start - depth + 1)
        return coder.suffix_points(self.read(history, stop), depth)[start - history:]

    # ------------------------------------------------------------------- misc
    def verify(self) -> int:
        """Check every sealed block's checksum and payload now (reads verify the blocks they touch
        on first use); ArchiveCorruptError naming the first bad block. Returns the blocks checked."""
        if self.closed:
            raise ArchiveError("archive is closed")
        if self._mapped < self._end:
            self._remap(self._end)
        for block in range(len(self._counts)):
            if not self._verified[block]:
                self._verify(block)
        return len(self._counts)

    def info(self) -> dict:
        """Header and size figures; `bits_per_symbol` is None for an empty archive (no rate to state)."""
        file_bytes = self._end
        n = len(self)
        return {
            "path": str(self.path), "variant": self.variant, "alphabet_size": self.alphabet_size,
            "r": self.header.r, "segment": self.header.segment, "block_symbols": self.block_symbols,
            "symbols": n, "sealed_symbols": self._sealed, "blocks": len(self._counts),
            "file_bytes": file_bytes,
            "bits_per_symbol": 8.0 * file_bytes / n if n else None,
        }

    def close(self, discard: bool = False) -> None:
        """Seal the partial last block (if writable), put a new archive in place (discard=True:
        delete it instead) and release the file and the writer lock."""
        if self.closed:
            return
        done = False
        try:
            if self._writable and self._pending and not discard:
                self._write_blocks(np.array(self._pending, dtype=np.int64))
                self._pending.clear()
            done = True
        finally:
            self._map = None
            self._handle.close()
            self._writable = False
            self.closed = True
            self._finish(done and not discard)

    def _finish(self, publish: bool) -> None:
        """Publish or discard a new archive's temporary file; release the writer lock."""
        building, lock = self._building, self._lock
        self._building = self._lock = None
        if lock is not None:
            outcome = "discard" if not publish else "keep" if self._lock_only else "publish"
            lock.finish(building, outcome, self._durable)

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # An exception discards a new archive that replaces another (the old one stays) or holds
        # nothing sealed yet; sealed symbols of a new file are kept, as a crash would keep them.
        self.close(discard=exc_type is not None and self._building is not None
                   and (not self._lock_only or self._sealed == 0))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self)} symbols"
        return f"Archive({str(self.path)!r}, N={self.alphabet_size}, variant={self.variant!r}, {state})"
