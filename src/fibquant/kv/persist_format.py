"""On-disk pieces of a persisted `CompressedCache`: codec specs, the model fingerprint, the
code streams and the exact-window snapshot (see docs/persistent-cache.md).

A saved cache is a directory:

    manifest.json       format/version, model fingerprint, codec specs, window sizes,
                        [layers, batch, kv_heads, head_dim], float dtype (written once)
    tokens.fqa          token ids, one symbol per position (alphabet = vocab size)
    keys/ values/       one code stream per role: a `CodeArchive` (FibQuant/TurboQuant
                        [fp16 norm][packed indices] codes) or `bytes.fqa` (any other codec)
    exact.safetensors   the exact part: every layer's sinks and recent window, plus the
                        number of coded tokens it goes with (replaced atomically)

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fibquant.archive import Archive, CodeArchive, CodeLayout, RecoveryWarning
from fibquant.archive.format import HEADER_SIZE, RECORD_HEADER_SIZE, ArchiveError
from fibquant.codecs.base import Codec

FORMAT_NAME = "fibquant-kv-cache"
FORMAT_VERSION = 1
SNAPSHOT_FILE = "exact.safetensors"
MANIFEST_FILE = "manifest.json"
TOKENS_FILE = "tokens.fqa"
_FIELDS = ("sink_keys", "sink_values", "recent_keys", "recent_values")


# ---------------------------------------------------------------------------- codecs
@dataclass(frozen=True)
class CodecSpec:
    """What rebuilds a codec bit-for-bit: family and parameters, plus a hash of its shared state."""

    family: str
    dim: int
    k: Optional[int] = None
    n_codewords: Optional[int] = None
    bits: Optional[int] = None
    group_size: Optional[int] = None
    seed: int = 0
    state_sha256: str = ""

    def __post_init__(self) -> None:
        if self.family not in ("fibquant", "turboquant", "int"):
            raise ValueError(f"unsupported codec family {self.family!r} (fibquant, turboquant, int can be saved; "
                             "calibrated codecs carry per-model state that is not persisted)")

    @classmethod
    def from_codec(cls, codec: Codec) -> "CodecSpec":
        from fibquant.codecs.fibquant import FibQuantCodec
        from fibquant.codecs.integer import IntCodec
        from fibquant.codecs.turboquant import TurboQuantCodec

        if isinstance(codec, FibQuantCodec):
            spec = cls("fibquant", codec.dim, k=codec.k, n_codewords=codec.n_codewords, seed=codec.seed)
        elif isinstance(codec, TurboQuantCodec):
            spec = cls("turboquant", codec.dim, bits=codec.bits, seed=codec.seed)
        elif isinstance(codec, IntCodec):
            spec = cls("int", codec.dim, bits=codec.bits, group_size=codec.config.group_size)
        else:
            raise ValueError(f"cannot persist a cache whose codec is {type(codec).__name__} "
                             "(supported: FibQuantCodec, TurboQuantCodec, IntCodec)")
        return cls(**{**asdict(spec), "state_sha256": codec_state_sha256(codec)})

    def build(self) -> Codec:
        """The codec, checked against the saved state hash (a different codebook is refused)."""
        if self.family == "fibquant":
            from fibquant.codecs.fibquant import FibQuantCodec
            codec = FibQuantCodec(self.dim, self.k, self.n_codewords, self.seed)
        elif self.family == "turboquant":
            from fibquant.codecs.turboquant import TurboQuantCodec
            codec = TurboQuantCodec(self.dim, self.bits, self.seed)
        else:
            from fibquant.codecs.integer import IntCodec
            codec = IntCodec(self.dim, self.bits, self.group_size)
        if self.state_sha256 and codec_state_sha256(codec) != self.state_sha256:
            raise ValueError(f"the {self.family} codebook/rotation here differs from the one the cache was saved "
                             f"with ({self}): its codes would decode to other vectors")
        return codec

    def layout(self) -> Optional[CodeLayout]:
        """The [norm][indices] layout a `CodeArchive` stores at log2(N) bits, or None (byte stream)."""
        if self.family == "fibquant":
            return CodeLayout(self.n_codewords, self.dim // self.k)
        if self.family == "turboquant":
            return CodeLayout(1 << self.bits, self.dim)
        return None


def codec_state_sha256(codec: Codec) -> str:
    """sha256 of the tensors that define a codec's decoding (codebook, rotation), in a fixed order."""
    digest = hashlib.sha256(repr((type(codec).__name__, codec.dim, codec.code_size)).encode())
    book = codec.rotated_codebook(torch.device("cpu"))
    if book is not None:
        for tensor in (book.forward, book.codewords):
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------- model
def model_fingerprint(model) -> str:
    """sha256 of the model's architecture and a strided sample (<= 4096 values) of every parameter.

    Two models with the same architecture but other weights (another fine-tune, another
    quantisation) get different fingerprints; hashing a sample keeps it ~0.1 s for 135M params.
    """
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    keys = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
            "head_dim", "vocab_size", "rope_theta", "max_position_embeddings")
    digest = hashlib.sha256(json.dumps({k: getattr(config, k, None) for k in keys}, sort_keys=True,
                                       default=str).encode())
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 4096)].float().cpu().contiguous()
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------- code streams
def truncate_archive(path: Path, n_symbols: int) -> None:
    """Cut an archive file back to its first `n_symbols` sealed symbols (crash recovery).

    The file is cut at the record that holds symbol `n_symbols`, and that record's leading
    symbols are appended again (sealed). Archives are append-only by design; this is only
    used to bring independently sealed streams back into step after an interrupted write.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecoveryWarning)
        archive = Archive.open(path, "r")
    try:
        if n_symbols >= len(archive):
            return
        starts = archive._starts  # noqa: SLF001 - record index of the archive (see docs/archive-format.md)
        block = max(i for i, s in enumerate(starts) if s <= n_symbols) if n_symbols else 0
        keep = archive.read(starts[block], n_symbols) if starts else np.empty(0, np.int64)
        cut = archive._offsets[block] - RECORD_HEADER_SIZE if starts else HEADER_SIZE  # noqa: SLF001
    finally:
        archive.close()
    with open(path, "r+b") as handle:
        handle.truncate(cut)
    with Archive.open(path, "a") as archive:
        archive.append(keep)


class CodeStream:
    """Append-only rows of codes uint8 [n, code_size] in a directory, crash-consistent on open.

    A `CodeArchive` (indices at log2(N) bits + fp16 norms) when the codec has the
    [norm][indices] layout, else the raw code bytes as one archive of alphabet 256.
    """

    def __init__(self, path: Path, code_size: int, layout: Optional[CodeLayout], archives: list[Archive]):
        self.path, self.code_size, self.layout, self.archives = path, code_size, layout, archives
        self._codes = CodeArchive(path, layout, *archives) if layout is not None else None

    def _symbols_per_row(self) -> list[int]:
        return [self.layout.n_blocks, 1] if self.layout is not None else [self.code_size]

    @classmethod
    def create(cls, path: Path, spec: CodecSpec, code_size: int) -> "CodeStream":
        layout = spec.layout()
        if layout is not None:
            if layout.code_size != code_size:
                raise ValueError(f"codec code_size {code_size} does not match its layout {layout}")
            codes = CodeArchive.create(path, layout)
            return cls(path, code_size, layout, [codes.indices, codes.norms])
        path.mkdir(parents=True)
        return cls(path, code_size, None, [Archive.create(path / "bytes.fqa", 256)])

    @classmethod
    def open(cls, path: Path, spec: CodecSpec, code_size: int, mode: str, rows: Optional[int] = None) -> "CodeStream":
        """Open; with `rows` given, streams holding more are cut back to it (mode "a" only)."""
        layout = spec.layout()
        names = ["indices.fqa", "norms.fqa"] if layout is not None else ["bytes.fqa"]
        per_row = [layout.n_blocks, 1] if layout is not None else [code_size]
        if rows is not None and mode == "a":
            for name, count in zip(names, per_row):
                truncate_archive(path / name, rows * count)
        archives = []
        try:
            for name in names:
                archives.append(Archive.open(path / name, mode))
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

    def nbytes(self) -> int:
        return sum(a.info()["file_bytes"] for a in self.archives)

    def close(self) -> None:
        for archive in self.archives:
            archive.close()


# ---------------------------------------------------------------------------- snapshot
def write_snapshot(path: Path, layers: list[dict[str, torch.Tensor]], coded: int, durable: bool = True) -> None:
    """Atomically write every layer's exact tensors (sinks, recent window) and the coded count."""
    from safetensors.torch import save

    tensors = {f"{i}.{name}": layer[name].detach().cpu().contiguous() for i, layer in enumerate(layers)
               for name in _FIELDS}
    digest = hashlib.sha256()
    for key in sorted(tensors):
        digest.update(key.encode())
        digest.update(tensors[key].view(torch.uint8).numpy().tobytes() if tensors[key].numel() else b"")
    metadata = {"coded": str(coded), "layers": str(len(layers)), "sha256": digest.hexdigest()}
    blob = save(tensors, metadata=metadata)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(blob)
        handle.flush()
        if durable:
            os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_snapshot(path: Path, n_layers: int) -> tuple[list[dict[str, torch.Tensor]], int]:
    """(per-layer dict of sink/recent tensors [B, H, s|r, D], coded count); ValueError when corrupt."""
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
    digest = hashlib.sha256()
    for key in sorted(tensors):
        digest.update(key.encode())
        digest.update(tensors[key].view(torch.uint8).numpy().tobytes() if tensors[key].numel() else b"")
    if digest.hexdigest() != expected:
        raise ValueError(f"{path}: exact-window snapshot checksum mismatch (corrupt file)")
    if layers != n_layers or any(f"{i}.{n}" not in tensors for i in range(layers) for n in _FIELDS):
        raise ValueError(f"{path}: snapshot holds {layers} layers, the manifest says {n_layers}")
    return [{n: tensors[f"{i}.{n}"] for n in _FIELDS} for i in range(layers)], coded


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


def open_tokens(path: Path, mode: str) -> Archive:
    try:
        return Archive.open(path, mode)
    except ArchiveError as exc:
        raise ValueError(f"{path}: token archive unreadable ({exc})") from None
