"""Archiving FibQuant code streams: one symbol per block index, alphabet N.

A FibQuant code of one vector is [fp16 norm (2 bytes)][n_blocks indices of
ceil(log2 N) bits, bit-packed little-endian] (see `fibquant.codecs.fibquant`). A
`CodeArchive` is a directory with two archives and the layout:

    indices.fqa   the block indices of vector 0, then vector 1, ... (alphabet N)
    norms.fqa     the fp16 norm bit patterns, one symbol per vector (alphabet 2^16)
    layout.json   n_codewords, n_blocks, norm_bytes

so the index stream costs log2(N) bits per index up to byte rounding (instead of
ceil(log2 N) bits), and vector i is decoded by position: symbols [i*n_blocks,
(i+1)*n_blocks) plus norm i, re-packed into exactly the bytes the codec produced.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..codecs.bitpack import pack_bits, packed_size, unpack_bits
from .archive import Archive
from .format import ArchiveError

NORM_ALPHABET = 1 << 16


@dataclass(frozen=True)
class CodeLayout:
    """Byte layout of a [norm][packed block indices] code; code_size bytes per vector."""

    n_codewords: int
    n_blocks: int
    norm_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("n_codewords", "n_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (2 if name == "n_codewords" else 1):
                raise ValueError(f"{name} must be a positive integer (n_codewords >= 2), got {value!r}")
        if self.norm_bytes != 2:
            raise ValueError(f"only 2-byte (fp16) norms are supported, got norm_bytes={self.norm_bytes!r}")

    @classmethod
    def from_codec(cls, codec) -> "CodeLayout":
        """Layout of a FibQuantCodec (public attributes n_codewords, dim, k, code_size)."""
        layout = cls(int(codec.n_codewords), int(codec.dim) // int(codec.k))
        if layout.code_size != codec.code_size:
            raise ValueError(f"codec code_size {codec.code_size} does not match the [fp16 norm][packed indices] "
                             f"layout ({layout.code_size} bytes)")
        return layout

    @property
    def index_bits(self) -> int:
        return max(1, math.ceil(math.log2(self.n_codewords)))

    @property
    def code_size(self) -> int:
        return self.norm_bytes + packed_size(self.n_blocks, self.index_bits)

    def split(self, codes) -> tuple[np.ndarray, np.ndarray]:
        """uint8 [n, code_size] -> (indices int64 [n, n_blocks], norm bit patterns int64 [n])."""
        if isinstance(codes, np.ndarray):
            codes = torch.from_numpy(codes)
        if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
            raise ValueError(f"codes must be a uint8 tensor/array, got {getattr(codes, 'dtype', type(codes))}")
        if codes.ndim != 2 or codes.shape[1] != self.code_size:
            raise ValueError(f"codes must have shape [n, {self.code_size}], got {tuple(codes.shape)}")
        codes = codes.detach().cpu()
        indices = unpack_bits(codes[:, self.norm_bytes:], self.index_bits, self.n_blocks).numpy()
        if indices.size and int(indices.max()) >= self.n_codewords:
            raise ValueError(f"codes hold a block index >= n_codewords={self.n_codewords}")
        norms = codes[:, :2].numpy().astype(np.int64)
        return indices, norms[:, 0] | (norms[:, 1] << 8)

    def join(self, indices: np.ndarray, norms: np.ndarray) -> np.ndarray:
        """Inverse of `split`: -> uint8 [n, code_size], byte-identical to the codec's output."""
        packed = pack_bits(torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64)), self.index_bits)
        norm_bytes = np.stack([norms & 0xFF, norms >> 8], axis=1).astype(np.uint8)
        return np.concatenate([norm_bytes, packed.numpy()], axis=1)


class CodeArchive:
    """Directory archive of fixed-size codes; vector i decodes by position."""

    def __init__(self, path: Path, layout: CodeLayout, indices: Archive, norms: Archive):
        self.path, self.layout, self.indices, self.norms = path, layout, indices, norms

    @classmethod
    def create(cls, path, layout: CodeLayout, *, overwrite: bool = False) -> "CodeArchive":
        path = Path(path)
        if path.exists() and not overwrite:
            raise ArchiveError(f"{path} exists (pass overwrite=True to replace it)")
        path.mkdir(parents=True, exist_ok=True)
        (path / "layout.json").write_text(json.dumps(asdict(layout)))
        indices = Archive.create(path / "indices.fqa", layout.n_codewords, overwrite=True)
        norms = Archive.create(path / "norms.fqa", NORM_ALPHABET, overwrite=True)
        return cls(path, layout, indices, norms)

    @classmethod
    def open(cls, path, mode: str = "r") -> "CodeArchive":
        path = Path(path)
        try:
            layout = CodeLayout(**json.loads((path / "layout.json").read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise ArchiveError(f"{path}: not a code archive ({exc})") from None
        indices = Archive.open(path / "indices.fqa", mode)
        norms = Archive.open(path / "norms.fqa", mode)
        if len(indices) != len(norms) * layout.n_blocks:
            # The two archives seal blocks independently: a crash can leave them out of step.
            raise ArchiveError(f"{path}: {len(indices)} indices do not match {len(norms)} norms "
                               f"x {layout.n_blocks} blocks (interrupted append)")
        return cls(path, layout, indices, norms)

    def append(self, codes) -> None:
        """Append codes uint8 [n, code_size] (torch on any device, or numpy)."""
        indices, norms = self.layout.split(codes)
        self.indices.append(indices.reshape(-1))
        self.norms.append(norms)

    def __len__(self) -> int:
        return len(self.norms)

    def codes(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Codes of vectors [start, stop): uint8 [m, code_size], as the codec produced them."""
        stop = len(self) if stop is None else stop
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"vector range [{start}, {stop}) out of bounds for {len(self)} vectors")
        nb = self.layout.n_blocks
        indices = self.indices.read(start * nb, stop * nb).reshape(stop - start, nb)
        return self.layout.join(indices, self.norms.read(start, stop))

    def code(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"vector {i} out of range for {len(self)} vectors")
        i %= len(self)
        return self.codes(i, i + 1)[0]

    def decode(self, i: int, codec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Vector i through `codec.decode`: float [dim]."""
        return codec.decode(torch.from_numpy(self.code(i)), dtype=dtype)

    def close(self) -> None:
        self.indices.close()
        self.norms.close()

    def __enter__(self) -> "CodeArchive":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
