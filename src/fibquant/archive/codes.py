"""Archiving codec code streams: one symbol per index, alphabet N.

Any codec whose code of one vector is [fp16 norm (2 bytes)][n_blocks indices of
ceil(log2 N) bits, bit-packed little-endian] declares it as `codec.code_layout` (a
`fibquant.codecs.layout.CodeLayout`; FibQuant and TurboQuant do). A `CodeArchive` is a
directory with two archives and the layout:

    indices.fqa   the block indices of vector 0, then vector 1, ... (alphabet N)
    norms.fqa     the fp16 norm bit patterns, one symbol per vector (alphabet 2^16);
                  absent when the layout has no norm (norm_bytes = 0)
    layout.json   n_codewords, n_blocks, norm_bytes

so the index stream costs log2(N) bits per index up to byte rounding (instead of
ceil(log2 N) bits), and vector i is decoded by position: symbols [i*n_blocks,
(i+1)*n_blocks) plus norm i, re-packed into exactly the bytes the codec produced.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..codecs.layout import CodeLayout
from .archive import Archive
from .format import ArchiveError
from .metadata import CHECKSUMS, check_fields, read_json, with_checksums
from .writer import WriterLock, check_new_store, fsync_directory  # noqa: F401 - fsync_directory re-exported
from .search_numba import kernels

NORM_ALPHABET = 1 << 16


def as_codes(codes) -> np.ndarray:
    """A tensor or array of codes as a numpy uint8 array; ArchiveError (a ValueError) for other dtypes."""
    if isinstance(codes, torch.Tensor):
        codes = codes.detach().cpu().numpy()
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise ArchiveError(f"codes must be uint8, got {codes.dtype}")
    return codes


class CodeArchive:
    """Directory archive of fixed-size codes; vector i decodes by position."""

    def __init__(self, path: Path, layout: CodeLayout, indices: Archive, norms: Archive | None = None):
        if (norms is None) != (layout.norm_bytes == 0):
            raise ArchiveError(f"a norms archive is needed exactly when the layout has a norm ({layout})")
        self.path, self.layout, self.indices, self.norms = path, layout, indices, norms
        self._code_size = layout.code_size
        self._byte_indices = layout.index_bits == 8 and layout.n_codewords == 256 and layout.norm_bytes in (0, 2)
        self._row_index = None
        self._lock: WriterLock | None = None  # held by a writer (append, create)
        self._building: Path | None = None  # a new archive's temporary directory, published by close()

    @classmethod
    def for_codec(cls, path, codec, *, overwrite: bool = False, durable: bool = False) -> "CodeArchive":
        """New empty archive for the codes of `codec` (any codec with a `code_layout`)."""
        return cls.create(path, CodeLayout.from_codec(codec), overwrite=overwrite, durable=durable)

    @classmethod
    def create(cls, path, layout: CodeLayout, *, overwrite: bool = False, durable: bool = False,
               lock: bool = True) -> "CodeArchive":
        """New empty code archive. durable=True fsyncs layout.json and the directory now, and
        both archives after every sealed block (hence at `close`, which seals the last one).
        The writer lock is held until `close()` (`fibquant.archive.writer`); a new archive grows
        in place (an exception inside `with` deletes it), one that overwrites is built aside and
        replaces the old one at `close()`. lock=False: the caller locks an enclosing store and
        the directory is written in place."""
        if not isinstance(layout, CodeLayout):
            raise ArchiveError(f"layout must be a CodeLayout (use CodeArchive.for_codec for a codec), "
                               f"got {type(layout).__name__}")
        path = Path(path)
        writer = WriterLock.acquire(path) if lock else None
        building = None
        try:
            check_new_store(path, overwrite, "directory")
            building = writer.building() if writer is not None and path.exists() else path
            building.mkdir(parents=True, exist_ok=True)
            write_layout(building, layout, durable)
            indices = Archive.create(building / "indices.fqa", layout.n_codewords, overwrite=True, durable=durable,
                                     lock=False)
            norms = Archive.create(building / "norms.fqa", NORM_ALPHABET, overwrite=True, durable=durable,
                                   lock=False) if layout.norm_bytes else None
        except BaseException:
            if writer is not None:
                if building is not None and building.exists():
                    writer.discard(building)
                writer.release()
            raise
        if durable:
            fsync_directory(building)
        archive = cls(path, layout, indices, norms)
        archive._lock, archive._building = writer, (building if writer is not None else None)
        return archive

    @classmethod
    def open(cls, path, mode: str = "r", *, durable: bool = False, lock: bool = True) -> "CodeArchive":
        """Open for reading ("r") or appending ("a"; durable=True: fsync every sealed block; the
        writer lock is taken, StoreLockedError while another process writes)."""
        path = Path(path)
        writer = WriterLock.acquire(path) if mode == "a" and lock else None
        try:
            archive = cls._open(path, mode, durable)
        except BaseException:
            if writer is not None:
                writer.release()
            raise
        archive._lock = writer
        return archive

    @classmethod
    def _open(cls, path: Path, mode: str, durable: bool) -> "CodeArchive":
        try:
            layout = read_layout(path)
        except FileNotFoundError as exc:
            raise ArchiveError(f"{path}: not a code archive ({exc.strerror}: layout.json)") from None
        indices = Archive.open(path / "indices.fqa", mode, durable=durable, lock=False)
        norms = None
        try:
            if layout.norm_bytes:
                norms = Archive.open(path / "norms.fqa", mode, durable=durable, lock=False)
            vectors = len(norms) if norms is not None else len(indices) // layout.n_blocks
            if len(indices) != vectors * layout.n_blocks:
                # Archives seal blocks independently: a crash can leave the indices mid-vector
                # or out of step with the norms.
                raise ArchiveError(f"{path}: {len(indices)} indices do not make {vectors} vectors "
                                   f"x {layout.n_blocks} blocks (interrupted append)")
        except BaseException:
            indices.close()
            if norms is not None:
                norms.close()
            raise
        return cls(path, layout, indices, norms)

    def append(self, codes) -> None:
        """Append codes uint8 [n, code_size] (torch on any device, or numpy)."""
        indices, norms = self.layout.split(codes)
        self.indices.append(indices.reshape(-1))
        if self.norms is not None:
            self.norms.append(norms)

    def __len__(self) -> int:
        """Whole vectors present in both streams (after a crash one may hold more than the other)."""
        whole = len(self.indices) // self.layout.n_blocks
        return whole if self.norms is None else min(whole, len(self.norms))

    def codes(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Codes of vectors [start, stop): uint8 [m, code_size], as the codec produced them."""
        stop = len(self) if stop is None else stop
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"vector range [{start}, {stop}) out of bounds for {len(self)} vectors")
        nb = self.layout.n_blocks
        indices = self.indices.read(start * nb, stop * nb).reshape(stop - start, nb)
        norms = self.norms.read(start, stop) if self.norms is not None else None
        return self.layout.join(indices, norms)

    def code(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"vector {i} out of range for {len(self)} vectors")
        i %= len(self)
        return self.codes(i, i + 1)[0]

    def decode(self, i: int, codec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Vector i through `codec.decode`: float [dim]."""
        if getattr(codec, "code_layout", None) != self.layout:
            raise ArchiveError(f"{type(codec).__name__} does not have this archive's layout {self.layout}")
        return codec.decode(torch.from_numpy(self.code(i)), dtype=dtype)

    # ------------------------------------------------------------------ search
    def _split_queries(self, queries) -> tuple[np.ndarray, np.ndarray | None]:
        """uint8 [m, code_size] -> (indices int64 [m, n_blocks], norm patterns int64 [m] | None)."""
        layout = self.layout
        if self._byte_indices and queries.shape[1] == self._code_size:  # N = 256: the indices are the bytes
            indices = queries[:, layout.norm_bytes:].astype(np.int64)
            if not layout.norm_bytes:
                return indices, None
            return indices, queries[:, :2].copy().view("<u2")[:, 0].astype(np.int64)
        try:
            return layout.split(queries)
        except ValueError as exc:
            raise ArchiveError(str(exc)) from None

    def row_index(self):
        """The (cached) `RowIndex` of the vectors: chunk values of their index symbols and their
        norm; built from the decoded streams on first use, rebuilt after appends."""
        from .search import RowIndex

        index = self._row_index
        if index is None or index.length != len(self):
            vectors = len(self)
            symbols = self.indices.read(0, vectors * self.layout.n_blocks)
            norms = self.norms.read(0, vectors) if self.norms is not None else None
            index = RowIndex(symbols, self.layout.n_blocks, self.layout.n_codewords, norms)
            self._row_index = index
        return index

    def find(self, codes, stride: int = 1, offset: int = 0, stop: int | None = None) -> np.ndarray:
        """Every vector r (sorted) with r % stride == offset whose codes r, r + stride, ...,
        r + (n-1) stride equal `codes` uint8 [n, code_size], among vectors [0, stop): exact.

        `row_index` holds each vector's index symbols as chunk values (the archive's suffix keys
        at the vector's end) and its norm; candidates come from the rarest query code's cell,
        then all n codes are compared as integers. stride > 1 searches one interleaved
        sub-stream (e.g. one (layer, head) of a token-major KV stream)."""
        codes = as_codes(codes)
        if codes.ndim != 2 or codes.shape[0] < 1 or codes.shape[1] != self._code_size:
            raise ArchiveError(f"codes must be uint8 [n >= 1, {self._code_size}], got shape {codes.shape}")
        if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or stride < 1:
            raise ArchiveError(f"stride must be a positive integer, got {stride!r}")
        if not 0 <= offset < stride:
            raise ArchiveError(f"offsets must lie in [0, stride={stride})")
        return self._find(codes, codes.shape[0], int(stride), np.full(1, offset, dtype=np.int64), stop, True)[0]

    def find_many(self, queries, stride: int = 1, offsets=0, stop: int | None = None,
                  use_numba: bool = True) -> list[np.ndarray]:
        """`find` for q code sequences of one length at once, uint8 [q, n, code_size]; offsets: one
        int or one per query; one sorted array each. One compiled pass over the batch (numba), or
        numpy vectorised over the queries (use_numba=False, or without numba)."""
        from .search import split_by_owner

        queries = as_codes(queries)
        if queries.ndim != 3 or queries.shape[1] < 1 or queries.shape[2] != self._code_size:
            raise ArchiveError(f"queries must be uint8 [q, n >= 1, {self._code_size}], got {queries.shape}")
        if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or stride < 1:
            raise ArchiveError(f"stride must be a positive integer, got {stride!r}")
        q, n, _ = queries.shape
        offsets = np.full(q, offsets, dtype=np.int64) if np.ndim(offsets) == 0 else \
            np.ascontiguousarray(offsets, dtype=np.int64).reshape(q)
        if q and (int(offsets.min()) < 0 or int(offsets.max()) >= stride):
            raise ArchiveError(f"offsets must lie in [0, stride={stride})")
        if q == 0:
            return []
        flat, owner = self._find(queries.reshape(q * n, -1), n, int(stride), offsets, stop, use_numba)
        return split_by_owner(flat, owner, q)

    def _find(self, rows: np.ndarray, n: int, stride: int, offsets: np.ndarray, stop, use_numba: bool):
        """Validated query codes uint8 [q*n, code_size] -> `RowIndex.find`'s (rows, owners)."""
        index = self.row_index()
        if self._byte_indices and use_numba and kernels() is not None:  # the kernel reads the bytes itself
            return index.find(None, None, n, stride, offsets, stop, codes=np.ascontiguousarray(rows),
                              norm_bytes=self.layout.norm_bytes)
        indices, norms = self._split_queries(rows)
        return index.find(indices, norms, n, stride, offsets, stop, use_numba)

    def close(self, discard: bool = False) -> None:
        """Seal both streams, put a new archive in place (discard=True: delete it) and release the lock."""
        done = False
        try:
            self.indices.close(discard)
            if self.norms is not None:
                self.norms.close(discard)
            done = True
        finally:
            building, lock = self._building, self._lock
            self._building = self._lock = None
            if lock is not None:
                outcome = "discard" if not done or discard else "keep" if building == self.path else "publish"
                lock.finish(building, outcome, self.indices._durable)  # noqa: SLF001

    def __enter__(self) -> "CodeArchive":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # As `Archive`: discard a replacement, or a new archive with nothing sealed.
        self.close(discard=exc_type is not None and self._building is not None
                   and (self._building != self.path or self.indices._sealed == 0))  # noqa: SLF001


def write_layout(path: Path, layout: CodeLayout, durable: bool = False) -> None:
    """`path`/layout.json: the layout's fields and their checksums (`fibquant.archive.metadata`)."""
    with open(path / "layout.json", "w") as handle:
        handle.write(json.dumps(with_checksums(asdict(layout)), sort_keys=True))
        handle.flush()
        if durable:
            os.fsync(handle.fileno())


def read_layout(path: Path) -> CodeLayout:
    """The `CodeLayout` in `path`/layout.json, its checksums verified (files written before they
    existed carry none and are read as they are); ArchiveError when corrupt; FileNotFoundError passed on."""
    where = path / "layout.json"
    data = read_json(where)
    if CHECKSUMS in data:
        data = check_fields(data, where)
    try:
        return CodeLayout(**data)
    except (TypeError, ValueError) as exc:
        raise ArchiveError(f"{where}: corrupt layout ({exc})") from None
