"""How attention reads a codec's code rows without decoding them back to the model's domain.

Every codec owns one `CodeReader` (`Codec.reader(device)`). Attention on codes speaks only to it:

    rotate(queries [..., Q, D])          -> the queries in the reader's domain (q @ forward; once per query)
    scores(rotated [..., Q, D], codes [..., M, C])   -> [..., Q, M]   = rotated . rows(codes)
    values(weights [..., Q, M], codes [..., M, C])   -> [..., Q, D]   = weights @ rows(codes)
    unrotate(out [..., Q, D])            -> back in the model's domain (out @ forward.T; once per query)
    rows(codes [..., M, C])              -> float32 [..., M, D]: the code rows in the reader's domain

`rows`, `scores` and `values` here are plain torch: the spec. The fast paths (numba tables and
histograms, the fused one-token steps, Triton) are registered per reader class in
`fibquant.kv.attention.readers` and tested against these methods. A family whose reader has no
registered kernel still runs attention through these torch methods, on any device.

The readers of the rotate-then-quantize families: a code row [nu (fp16), indices] is
x_hat = nu * u_hat(indices) @ forward.T, u_hat a unit vector in the rotated domain, so
q . x_hat = nu * (q @ forward) . u_hat: the query is rotated once, never a key.

    CodebookReader  one codebook of N k-d codewords (FibQuant; TurboQuant, k = 1): u_hat = concat_j codewords[idx_j]
    StagesReader    S residual stages (FibQuant-RVQ): u_hat = concat_j sum_s stages[s, idx_js]
    ShellsReader    E8 shell codes (FibQuant-E8): u_hat = concat_j point(idx_j), decoded by the codec
    DecodedReader   any other codec (INT, low-rank, RVQ, fp16): rows are the decoded vectors
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .bitpack import NORM_BYTES, bytes_to_float16, unpack_bits


class CodeReader:
    """A codec's code rows as attention reads them (see the module docstring).

    dim: the vectors' dimension D. forward: float32 [D, D] (u = x @ forward) or None (rows are in the
    model's domain: no rotation)."""

    def __init__(self, dim: int, forward: torch.Tensor | None = None):
        self.dim = dim
        self.forward = forward

    def rotate(self, queries: torch.Tensor) -> torch.Tensor:
        """queries float32 [..., Q, D] -> the same in the reader's domain."""
        return queries if self.forward is None else queries @ self.forward

    def unrotate(self, out: torch.Tensor) -> torch.Tensor:
        """out float32 [..., Q, D] in the reader's domain -> the model's domain."""
        return out if self.forward is None else out @ self.forward.T

    def rows(self, codes: torch.Tensor) -> torch.Tensor:
        """codes uint8 [..., M, C] -> float32 [..., M, D] in the reader's domain."""
        raise NotImplementedError(f"{type(self).__name__} must implement rows(codes)")

    def scores(self, rotated: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """rotated queries float32 [..., Q, D] . code rows [..., M, C] -> [..., Q, M]."""
        return rotated @ self.rows(codes).transpose(-1, -2)

    def values(self, weights: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """weights float32 [..., Q, M] x code rows [..., M, C] -> [..., Q, D] in the reader's domain."""
        return weights @ self.rows(codes)


class DecodedReader(CodeReader):
    """Rows are the codec's decoded vectors (no rotation): how attention reads a codec with no reader of
    its own (INT, low-rank, RVQ, the fp16 identity)."""

    def __init__(self, codec):
        super().__init__(codec.dim)
        self.codec = codec

    def rows(self, codes: torch.Tensor) -> torch.Tensor:
        return self.codec.decode(codes).to(torch.float32)


class RotatedReader(CodeReader):
    """Code rows [nu (fp16), indices]: rows = nu * unit_rows(codes) in the rotated domain.

    unit_rows: flat codes uint8 [n, C] -> u_hat float [n, D] (the codec's own index decoding; the codec's
    decode is unrotate_scale(unit_rows(codes), norms), so rows and decode never disagree);
    index_bits: the stored width of one index; owner: the codec's name, for errors."""

    def __init__(self, dim: int, forward: torch.Tensor, index_bits: int,
                 unit_rows: Callable[[torch.Tensor], torch.Tensor], owner: str = "codec"):
        super().__init__(dim, forward)
        self.index_bits = index_bits
        self.unit_rows = unit_rows
        self.owner = owner

    def _indices(self, flat: torch.Tensor, count: int, n_codewords: int) -> torch.Tensor:
        """The `count` indices int64 [n, count] of flat code rows; ValueError for one >= n_codewords."""
        index = unpack_bits(flat[:, NORM_BYTES:], self.index_bits, count)
        # Only a field wider than log2(N) can hold an invalid index (skip the pass otherwise).
        if n_codewords != 1 << self.index_bits and index.numel() and int(index.max()) >= n_codewords:
            raise ValueError(f"{self.owner}.decode: code holds index >= N={n_codewords}")
        return index

    def rows(self, codes: torch.Tensor) -> torch.Tensor:
        lead = codes.shape[:-1]
        flat = codes.reshape(-1, codes.shape[-1])
        if not flat.shape[0]:
            return torch.zeros(*lead, self.dim, dtype=torch.float32, device=codes.device)
        norms = bytes_to_float16(flat[:, :NORM_BYTES])
        return (self.unit_rows(flat) * norms.unsqueeze(1)).to(torch.float32).reshape(*lead, self.dim)


class CodebookReader(RotatedReader):
    """One codebook (FibQuant; TurboQuant with k = 1): row = nu * concat_j codewords[idx_j].

    codewords: float32 [N, k] on the reader's device."""

    def __init__(self, dim: int, forward: torch.Tensor, index_bits: int, codewords: torch.Tensor,
                 owner: str = "codec"):
        self.codewords = codewords
        super().__init__(dim, forward, index_bits, self._codebook_rows, owner)

    def _codebook_rows(self, flat: torch.Tensor) -> torch.Tensor:
        n_codewords, k = self.codewords.shape
        return self.codewords[self._indices(flat, self.dim // k, n_codewords)].reshape(flat.shape[0], self.dim)


class StagesReader(RotatedReader):
    """S residual stages (FibQuant-RVQ): row = nu * concat_j sum_s stages[s, idx_js], index j * S + s.

    stages: float32 [S, N, k] on the reader's device."""

    def __init__(self, dim: int, forward: torch.Tensor, index_bits: int, stages: torch.Tensor,
                 owner: str = "codec"):
        self.stages = stages
        super().__init__(dim, forward, index_bits, self._stage_rows, owner)

    def _stage_rows(self, flat: torch.Tensor) -> torch.Tensor:
        count, n_codewords, k = self.stages.shape
        index = self._indices(flat, self.dim // k * count, n_codewords)
        return self.stage_sum(index.reshape(flat.shape[0], self.dim // k, count))

    def stage_sum(self, index: torch.Tensor) -> torch.Tensor:
        """indices int [n, D/k, S] -> u_hat float32 [n, D]: the sum of each block's stage codewords."""
        total = self.stages[0][index[..., 0]]
        for s in range(1, self.stages.shape[0]):
            total = total + self.stages[s][index[..., s]]
        return total.reshape(index.shape[0], self.dim)


class ShellsReader(RotatedReader):
    """E8 shell codes (FibQuant-E8): row = nu * concat_j point(idx_j), the points decoded by the codec
    (`unit_rows`; too many for per-query tables). tables: the shell code's point tables the one-token
    kernel reads (`codebook.e8shell_tables.CompactPointTables` up to 2^16 points, else `ShellPointTables`)."""

    def __init__(self, dim: int, forward: torch.Tensor, index_bits: int,
                 unit_rows: Callable[[torch.Tensor], torch.Tensor], tables: Any, owner: str = "codec"):
        super().__init__(dim, forward, index_bits, unit_rows, owner)
        self.tables = tables
