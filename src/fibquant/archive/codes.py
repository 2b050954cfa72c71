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
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..codecs.layout import CodeLayout
from .archive import Archive
from .format import ArchiveError

NORM_ALPHABET = 1 << 16


class CodeArchive:
    """Directory archive of fixed-size codes; vector i decodes by position."""

    def __init__(self, path: Path, layout: CodeLayout, indices: Archive, norms: Archive | None = None):
        if (norms is None) != (layout.norm_bytes == 0):
            raise ArchiveError(f"a norms archive is needed exactly when the layout has a norm ({layout})")
        self.path, self.layout, self.indices, self.norms = path, layout, indices, norms

    @classmethod
    def for_codec(cls, path, codec, *, overwrite: bool = False) -> "CodeArchive":
        """New empty archive for the codes of `codec` (any codec with a `code_layout`)."""
        return cls.create(path, CodeLayout.from_codec(codec), overwrite=overwrite)

    @classmethod
    def create(cls, path, layout: CodeLayout, *, overwrite: bool = False) -> "CodeArchive":
        if not isinstance(layout, CodeLayout):
            raise ArchiveError(f"layout must be a CodeLayout (use CodeArchive.for_codec for a codec), "
                               f"got {type(layout).__name__}")
        path = Path(path)
        if path.exists() and not overwrite:
            raise ArchiveError(f"{path} exists (pass overwrite=True to replace it)")
        path.mkdir(parents=True, exist_ok=True)
        (path / "layout.json").write_text(json.dumps(asdict(layout)))
        indices = Archive.create(path / "indices.fqa", layout.n_codewords, overwrite=True)
        norms = Archive.create(path / "norms.fqa", NORM_ALPHABET, overwrite=True) if layout.norm_bytes else None
        return cls(path, layout, indices, norms)

    @classmethod
    def open(cls, path, mode: str = "r") -> "CodeArchive":
        path = Path(path)
        try:
            layout = CodeLayout(**json.loads((path / "layout.json").read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise ArchiveError(f"{path}: not a code archive ({exc})") from None
        indices = Archive.open(path / "indices.fqa", mode)
        norms = None
        try:
            if layout.norm_bytes:
                norms = Archive.open(path / "norms.fqa", mode)
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
        return len(self.norms) if self.norms is not None else len(self.indices) // self.layout.n_blocks

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

    def close(self) -> None:
        self.indices.close()
        if self.norms is not None:
            self.norms.close()

    def __enter__(self) -> "CodeArchive":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
