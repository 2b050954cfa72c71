"""Attention's fast paths, registered per code reader class (`fibquant.codecs.reader`).

A codec enters attention on codes through its `CodeReader` only. This module picks, for a reader, the
fastest registered path and falls back to the reader's own torch methods (the spec):

    read_scores(codec, queries [B, H, Q, D], codes [B, H, M, C]) -> [B, H, Q, M]   (queries already scaled)
    read_values(codec, weights [B, H, Q, M], codes [B, H, M, C]) -> [B, H, Q, D]   (the model's domain)
    one_token_steps(key reader, value reader) -> the fused one-token steps (CPU) that may serve the pair

`KERNELS` maps a reader class to its `ReaderKernels`: scores / values on a block of queries (numba or
Triton lookup tables: `kernels.coded_scores` / `coded_weighted_sum`), and a one-token step `(module, plans,
step)`: module.plans(query, kv) -> plans or None (cannot serve this pair), module.step(query, kv, epilogue,
plans) -> out [B, 1, Hq, Dv], looked up at each call (a patched binding is the one run) (`numba_epilogue.Epilogue`: scaling, soft-cap, bias, sinks, applied by the shared epilogue).
A reader class with no entry (a new family) runs attention through its torch methods, on any device; a
faster path is one entry here, tested against those methods. A `DecodedReader` (a codec with no reader of
its own) warns once that its codes are decoded.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from fibquant.codecs.base import Codec
from fibquant.codecs.reader import CodebookReader, CodeReader, DecodedReader, ShellsReader, StagesReader
import fibquant.kv.attention.codebook_step as codebook_step
import fibquant.kv.attention.numba_residual as numba_residual
import fibquant.kv.attention.numba_shells as numba_shells
from fibquant.kv.attention.kernels import coded_scores, coded_weighted_sum
from fibquant.kv.attention.notices import warn_once


class ReaderKernels(NamedTuple):
    """The fast paths of one reader class (None: the reader's torch method)."""
    scores: Optional[Callable] = None     # (reader, rotated queries [B,H,Q,D], codes) -> [B,H,Q,M]
    values: Optional[Callable] = None     # (reader, weights [B,H,Q,M], codes) -> rotated [B,H,Q,D]
    one_token: Optional[tuple] = None     # (module, plans name, step name) of a fused one-token step on the CPU


def _codebook_scores(reader: CodebookReader, rotated: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    return coded_scores(rotated, codes, reader.codewords, reader.index_bits)


def _codebook_values(reader: CodebookReader, weights: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    return coded_weighted_sum(weights, codes, reader.codewords, reader.index_bits)


KERNELS: dict[type, ReaderKernels] = {
    CodebookReader: ReaderKernels(_codebook_scores, _codebook_values,
                                  (codebook_step, "codebook_step_plans", "attend_codebook_step")),
    StagesReader: ReaderKernels(one_token=(numba_residual, "residual_decode_plans", "attend_decode_residual")),
    ShellsReader: ReaderKernels(one_token=(numba_shells, "shell_decode_plans", "attend_decode_shells")),
}
_NONE = ReaderKernels()


def kernels_of(reader: CodeReader) -> ReaderKernels:
    """The registered paths of `reader`'s class or its nearest registered base class (none: all torch)."""
    for cls in type(reader).__mro__:
        if cls in KERNELS:
            return KERNELS[cls]
    return _NONE


def _reader(codec: Codec, device: torch.device) -> CodeReader:
    reader = codec.reader(device)
    if isinstance(reader, DecodedReader):
        name = type(codec).__name__
        warn_once(f"codec:{name}", f"{name} has no reader of its own: its codes are decoded to floats for "
                  "attention (the 'decode' path for this role)", stacklevel=4)
    return reader


def read_scores(codec: Codec, queries: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """queries float32 [B, H, Q, D] (already scaled) . the rows of `codes` [B, H, M, C] -> [B, H, Q, M]."""
    reader = _reader(codec, queries.device)
    rotated, scores = reader.rotate(queries), kernels_of(reader).scores
    return reader.scores(rotated, codes) if scores is None else scores(reader, rotated, codes)


def read_values(codec: Codec, weights: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """weights float32 [B, H, Q, M] x the rows of `codes` [B, H, M, C] -> float32 [B, H, Q, D]."""
    reader = _reader(codec, weights.device)
    values = kernels_of(reader).values
    return reader.unrotate(reader.values(weights, codes) if values is None else values(reader, weights, codes))


def one_token_steps(key_codec: Codec, value_codec: Codec):
    """The registered one-token steps (plans, step) of the key reader's class, then the value reader's (the
    last pair's readers are kept: a decode step asks once per layer)."""
    global _LAST_READERS
    if key_codec is None or value_codec is None:  # plain tensors (`CodedKV.of_tensors`): nothing coded
        return
    last = _LAST_READERS
    if last is None or last[0] is not key_codec or last[1] is not value_codec:
        cpu = torch.device("cpu")
        last = _LAST_READERS = (key_codec, value_codec, key_codec.reader(cpu), value_codec.reader(cpu))
    seen = []
    for reader in last[2:]:
        step = kernels_of(reader).one_token
        if step is not None and step not in seen:
            seen.append(step)
            module, plans, run = step
            yield getattr(module, plans), getattr(module, run)


_LAST_READERS = None  # (key codec, value codec, their CPU readers); holds the codecs: `is` stays meaningful
