"""Nearest-codeword search: a plain reference (the spec) and the fast chunked matmul path.

For blocks x [m, k] and codewords c [N, k] the nearest codeword minimises
||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2; ||x||^2 is the same for every c, so the fast path
takes argmin_c (||c||^2 - 2 x.c), one [m, k] x [k, N] matmul per chunk of rows. Chunks keep
the [rows, N] score matrix small (about `chunk_elements` floats) so that it stays in cache and
memory stays bounded whatever m is.
"""
from __future__ import annotations

import torch

DEFAULT_CHUNK_ELEMENTS = 1 << 18  # 1 MiB of float32 scores per chunk


def nearest_codeword_reference(blocks: torch.Tensor, codewords: torch.Tensor) -> torch.Tensor:
    """Plain squared-distance argmin: blocks [m, k], codewords [N, k] -> int64 [m]."""
    diff = blocks.unsqueeze(1).to(torch.float64) - codewords.unsqueeze(0).to(torch.float64)
    return (diff ** 2).sum(-1).argmin(dim=1)


def nearest_codeword(blocks: torch.Tensor, codewords: torch.Tensor,
                     sq_norms: torch.Tensor | None = None, *,
                     chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """Fast argmin: blocks [m, k] float32, codewords [N, k] float32 (same device) -> int64 [m].

    `sq_norms` [N] (= ||c||^2) may be passed precomputed. Ties and float rounding may pick a
    different codeword than the reference only when two distances agree to float32 precision.
    """
    if sq_norms is None:
        sq_norms = (codewords ** 2).sum(-1)
    m = blocks.shape[0]
    n_codewords = codewords.shape[0]
    out = torch.empty(m, dtype=torch.int64, device=blocks.device)
    rows = max(1, chunk_elements // n_codewords)
    codewords_t = codewords.T.contiguous()
    scores = None
    for start in range(0, m, rows):
        stop = min(m, start + rows)
        # scores = ||c||^2 - 2 x.c, written into a reused buffer.
        if scores is None or scores.shape[0] != stop - start:
            scores = torch.empty(stop - start, n_codewords, dtype=blocks.dtype, device=blocks.device)
        torch.addmm(sq_norms, blocks[start:stop], codewords_t, beta=1.0, alpha=-2.0, out=scores)
        torch.argmin(scores, dim=1, out=out[start:stop])
    return out


def nearest_level(values: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Scalar search: values [...] and sorted decision thresholds [N-1] -> int64 level index [...].

    With levels sorted ascending and thresholds at the midpoints between neighbours this is the
    same nearest-level choice as the reference (up to exact ties at a midpoint).
    """
    return torch.bucketize(values, thresholds)
