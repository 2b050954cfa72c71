"""On-disk pieces of a persisted `CompressedCache`: the code streams and the exact-window snapshot
(docs/persistent-cache.md; codec specs: `fibquant.kv.persist.entries`, the model's identity:
`fibquant.kv.persist.model_identity`).

A saved cache is a directory:

    manifest.json       format/version, model identity, codec specs (per role, or per layer
                        and KV head), stream formats, window sizes, centring, [layers, batch,
                        kv_heads], float dtype (written once)
    tokens.fqa          token ids, one symbol per position (alphabet = vocab size)
    keys/ values/       one code stream per role: a `CodeArchive` when the codecs declare a
                        `code_layout` (FibQuant/TurboQuant [fp16 norm][packed indices]),
                        else `bytes.fqa` (any other codec)
    codecs/             calibrated codecs (RVQ, low-rank), one `Codec.save` safetensors file
                        each, named by family and sha256 (the manifest keeps the sha256)
    exact.safetensors   the exact part: every layer's sinks and recent window, a centred
                        cache's means, and the number of coded tokens it goes with (replaced
                        atomically)

Row order of a code stream: token-major, then layer, batch row, KV head: the code of
(token t, layer l, batch b, head h) is row ((t * L + l) * B + b) * H + h. All layers of one
token are therefore adjacent (a sealed block covers whole recent tokens of every layer, so
a crash loses only the last few tokens), and token t is one contiguous row range.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fibquant.archive import Archive, CodeArchive, CodeLayout, RecoveryWarning
from fibquant.archive.codes import read_layout
from fibquant.archive.writer import fsync_directory
from fibquant.archive.format import ArchiveError

FORMAT_NAME = "fibquant-kv-cache"
# 2: registry codec specs, codec files, centring means; 3: codec state and model weights as
# fingerprints compared with a tolerance, not sha256s of their floats; 4: a checksum per manifest
# field, verified on open (1-3 still read, unchecked)
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
SNAPSHOT_FILE = "exact.safetensors"
MANIFEST_FILE = "manifest.json"
TOKENS_FILE = "tokens.fqa"
_FIELDS = ("sink_keys", "sink_values", "recent_keys", "recent_values")
MEAN_FIELDS = ("key_mean", "value_mean")  # centred caches: [B, H, D] float32 per layer


# ---------------------------------------------------------------------------- code streams
def truncate_archive(path: Path, n_symbols: int, durable: bool = False) -> None:
    """Cut an archive file back to its first `n_symbols` sealed symbols (crash recovery):
    `Archive.truncate` (cut at the record, its leading symbols re-appended, sealed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecoveryWarning)  # reported by the caller
        archive = Archive.open(path, "a", durable=durable, lock=False)
    with archive:
        archive.truncate(n_symbols)


def _stream_files(layout: Optional[CodeLayout], code_size: int) -> tuple[list[str], list[int]]:
    """(archive files of a code stream, symbols each holds per row)."""
    if layout is None:
        return ["bytes.fqa"], [code_size]
    if layout.norm_bytes:
        return ["indices.fqa", "norms.fqa"], [layout.n_blocks, 1]
    return ["indices.fqa"], [layout.n_blocks]


def stored_layout(path: Path) -> Optional[CodeLayout]:
    """The layout of the code stream directory `path` (layout.json of a `CodeArchive`), None for a byte stream."""
    try:
        return read_layout(path)
    except FileNotFoundError:
        return None


class CodeStream:
    """Append-only rows of codes uint8 [n, code_size] in a directory, crash-consistent on open.

    A `CodeArchive` (indices at log2(N) bits + fp16 norms) when the codec has the
    [norm][indices] layout, else the raw code bytes as one archive of alphabet 256.
    """

    def __init__(self, path: Path, code_size: int, layout: Optional[CodeLayout], archives: list[Archive]):
        self.path, self.code_size, self.layout, self.archives = path, code_size, layout, archives
        self._codes = CodeArchive(path, layout, *archives) if layout is not None else None

    def _symbols_per_row(self) -> list[int]:
        return _stream_files(self.layout, self.code_size)[1]

    @classmethod
    def create(cls, path: Path, layout: Optional[CodeLayout], code_size: int, durable: bool = False) -> "CodeStream":
        """durable=True: every archive fsyncs its sealed blocks (and the files' directory entries)."""
        if layout is not None:
            if layout.code_size != code_size:
                raise ValueError(f"codec code_size {code_size} does not match its layout {layout}")
            codes = CodeArchive.create(path, layout, durable=durable, lock=False)
            return cls(path, code_size, layout, [a for a in (codes.indices, codes.norms) if a is not None])
        path.mkdir(parents=True)
        archive = Archive.create(path / "bytes.fqa", 256, durable=durable, lock=False)
        if durable:
            fsync_directory(path)
        return cls(path, code_size, None, [archive])

    @classmethod
    def open(cls, path: Path, layout: Optional[CodeLayout], code_size: int, mode: str,
             rows: Optional[int] = None, durable: bool = False) -> "CodeStream":
        """Open; with `rows` given, streams holding more are cut back to it (mode "a" only)."""
        names, per_row = _stream_files(layout, code_size)
        if rows is not None and mode == "a":
            for name, count in zip(names, per_row):
                truncate_archive(path / name, rows * count, durable)
        archives = []
        try:
            for name in names:
                archives.append(Archive.open(path / name, mode, durable=durable, lock=False))
        except BaseException:
            for archive in archives:
                archive.close()
            raise
        return cls(path, code_size, layout, archives)

    def sealed_rows(self) -> int:
        """Whole rows present in every underlying archive."""
        return min(len(a) // n for a, n in zip(self.archives, self._symbols_per_row()))

    def append(self, rows: torch.Tensor) -> None:
        """rows: uint8 [n, code_size]."""
        if self._codes is not None:
            self._codes.append(rows)
        else:
            self.archives[0].append(rows.detach().cpu().reshape(-1).to(torch.int64).numpy())

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop): uint8 [m, code_size], exactly the bytes the codec produced."""
        if self._codes is not None:
            return self._codes.codes(start, stop)
        return self.archives[0].read(start * self.code_size, stop * self.code_size).astype(np.uint8) \
            .reshape(stop - start, self.code_size)

    def find(self, codes: np.ndarray, stride: int, offset: int, stop: int) -> np.ndarray:
        """`CodeArchive.find` of a code-archive stream."""
        if self._codes is None:
            raise ValueError("code search needs a [norm][indices] codec stream (FibQuant, TurboQuant)")
        return self._codes.find(codes, stride, offset, stop)

    def find_many(self, queries: np.ndarray, stride: int, offsets, stop: int) -> list[np.ndarray]:
        """Rows r = offset (mod stride) where rows r, r + stride, ... equal each query's codes
        (`CodeArchive.find_many`); code-archive streams only."""
        if self._codes is None:
            raise ValueError("code search needs a [norm][indices] codec stream (FibQuant, TurboQuant)")
        return self._codes.find_many(queries, stride, offsets, stop)

    def nbytes(self) -> int:
        return sum(a.info()["file_bytes"] for a in self.archives)

    def verify(self) -> int:
        """`Archive.verify` of every file of the stream: blocks checked."""
        return sum(archive.verify() for archive in self.archives)

    def close(self) -> None:
        for archive in self.archives:
            archive.close()


# ---------------------------------------------------------------------------- snapshot
def _snapshot_sha256(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key in sorted(tensors):
        digest.update(key.encode())
        digest.update(tensors[key].view(torch.uint8).numpy().tobytes() if tensors[key].numel() else b"")
    return digest.hexdigest()


def write_snapshot(path: Path, layers: list[dict[str, torch.Tensor]], coded: int, durable: bool = True) -> None:
    """Atomically write every layer's exact tensors (sinks, recent window; a centred cache's
    means, exact float32, once set) and the coded count."""
    from safetensors.torch import save

    tensors = {f"{i}.{name}": layer[name].detach().cpu().contiguous() for i, layer in enumerate(layers)
               for name in _FIELDS + MEAN_FIELDS if layer.get(name) is not None}
    metadata = {"coded": str(coded), "layers": str(len(layers)), "sha256": _snapshot_sha256(tensors)}
    write_atomic(path, save(tensors, metadata=metadata), durable)


def read_snapshot(path: Path, n_layers: int) -> tuple[list[dict[str, torch.Tensor]], int]:
    """(per-layer dict of sink/recent tensors [B, H, s|r, D] and, when stored, the means
    key_mean/value_mean [B, H, D]; coded count); ValueError when corrupt."""
    from safetensors import safe_open
    from safetensors.torch import load

    try:
        raw = path.read_bytes()
        tensors = load(raw)
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        coded, layers, expected = int(metadata["coded"]), int(metadata["layers"]), metadata["sha256"]
    except FileNotFoundError:
        raise
    except Exception as exc:  # safetensors raises its own error types for bad headers/truncation
        raise ValueError(f"{path}: corrupt or truncated exact-window snapshot ({exc})") from None
    if _snapshot_sha256(tensors) != expected:
        raise ValueError(f"{path}: exact-window snapshot checksum mismatch (corrupt file)")
    if layers != n_layers or any(f"{i}.{n}" not in tensors for i in range(layers) for n in _FIELDS):
        raise ValueError(f"{path}: snapshot holds {layers} layers, the manifest says {n_layers}")
    out = []
    for i in range(layers):
        layer = {n: tensors[f"{i}.{n}"] for n in _FIELDS}
        means = [f"{i}.{n}" in tensors for n in MEAN_FIELDS]
        if any(means) and not all(means):
            raise ValueError(f"{path}: layer {i} stores one of key_mean/value_mean without the other")
        if all(means):
            layer.update({n: tensors[f"{i}.{n}"] for n in MEAN_FIELDS})
        out.append(layer)
    return out, coded


def write_atomic(path: Path, data: bytes, durable: bool) -> None:
    """Replace `path` by `data` through a temporary file and a rename (readers see the old or the
    new file, never a mix); durable=True fsyncs the file and then the directory (the rename itself)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        if durable:
            os.fsync(handle.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_directory(path.parent)


def write_json_atomic(path: Path, data: dict, durable: bool = False) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True).encode(), durable)


def open_tokens(path: Path, mode: str, durable: bool = False) -> Archive:
    try:
        return Archive.open(path, mode, durable=durable, lock=False)
    except ArchiveError as exc:
        raise ValueError(f"{path}: token archive unreadable ({exc})") from None
