"""Exact nearest-codeword search and index packing on the CPU with numba (`search_numba` kernels).

`NumbaSearch(codewords, dim)` picks a method for the codebook [N, k] (`choose_method`): the
candidate lists of `grid_search.GridSearch` for k <= 4 and small N (`GRID`; the lists further
pruned by `prune_dominated`), a k-d tree for other k <= TREE_MAX_K, else a full scan (a numba
loop for few blocks, a float32 BLAS matmul from MATMUL_MIN_BLOCKS blocks; the near-best of either
decided in float64). All three return the index of `nearest_codeword_reference` (float64 squared
distances, the lowest index among equals): blocks whose best two distances agree to a relative
1e-12 are flagged by the kernel and recomputed with the reference itself, so even exact ties break
as the reference breaks them.

numba is imported on first use; kernels compile once per machine (numba's on-disk cache, a few
seconds the first time). Threads: with torch.get_num_threads() > 1 and enough rows, the rows are
split over a small thread pool (the kernels release the GIL; `fibquant._numba.run_split`, shared with
`fibquant.kv.coded_kernels`); `torch.set_num_threads(1)` keeps it single-threaded.
"""
from __future__ import annotations

import math
import threading

import numpy as np
import torch

from .._numba import numba_available, run_split  # noqa: F401  (numba_available: re-exported)
from .grid_search import GRID_CELLS, OUTER, GridSearch
from .search import DEFAULT_CHUNK_ELEMENTS, nearest_codeword_reference

TREE_MAX_K = 4        # k-d tree pruning pays up to here (k = 8, N = 256: the full scan is ~4x faster)
TREE_LEAF = 8         # codewords per tree leaf
# k -> (grid cells per axis, largest N): the grid's tables cost cells^k * N to build (k = 4, N = 256:
# 0.35 s, 1.8 us per vector against 6 for the tree; N = 1024 would take 4x longer and ~1 GB).
GRID = {2: (GRID_CELLS[2], 1024), 3: (GRID_CELLS[3], 1024), 4: (12, 256)}
MATMUL_MIN_BLOCKS = 256  # "brute": from this many blocks a BLAS matmul screens (a numba loop below)
_MIN_BLOCKS_PER_THREAD = 4096
DOMINANCE_MARGIN = 1e-9  # a listed codeword beaten by this much on its whole box is dropped
CHALLENGERS = 6          # per box, the listed codewords tried as the one that beats another

_KERNELS = None
_LOCK = threading.Lock()


def _kernels() -> dict:
    global _KERNELS
    if _KERNELS is None:
        with _LOCK:
            if _KERNELS is None:
                from .search_numba import compile_kernels
                _KERNELS = compile_kernels()
    return _KERNELS


def _run_rows(kernel, args: tuple, rows: int, blocks_per_row: int) -> int:
    """kernel(*args, start, stop) over `rows`, split across up to torch.get_num_threads() threads."""
    return run_split(kernel, args, rows, blocks_per_row, _MIN_BLOCKS_PER_THREAD, "fibquant-search")


def choose_method(k: int, n_codewords: int) -> str:
    """"grid", "tree" or "brute" for a codebook [n_codewords, k]."""
    if k in GRID and n_codewords <= GRID[k][1]:
        return "grid"
    return "tree" if k <= TREE_MAX_K else "brute"


def build_tree(points: np.ndarray, leaf: int = TREE_LEAF) -> tuple[np.ndarray, ...]:
    """k-d tree over points [N, k] (median splits on the widest axis, ties by index).

    Returns (lo, hi [nodes, k] float64 bounding boxes, child [nodes, 3] = (left, right, axis),
    left = -1 at a leaf, bounds [nodes, 2] = the leaf's slice of pts, pts [N, k] float64 in leaf
    order, ids [N] the codeword index of each row of pts). Node 0 is the root.
    """
    order = np.arange(points.shape[0])
    lo, hi, child, bounds = [], [], [], []

    def build(start: int, stop: int) -> int:
        part = points[order[start:stop]]
        node = len(lo)
        lo.append(part.min(0))
        hi.append(part.max(0))
        child.append([-1, -1, 0])
        bounds.append([start, stop])
        if stop - start > leaf:
            axis = int(np.argmax(hi[node] - lo[node]))
            sub = order[start:stop]
            order[start:stop] = sub[np.lexsort((sub, part[:, axis]))]
            mid = (start + stop) // 2
            left = build(start, mid)
            child[node] = [left, build(mid, stop), axis]
        return node

    build(0, points.shape[0])
    f64 = lambda rows: np.ascontiguousarray(np.array(rows, dtype=np.float64))  # noqa: E731
    return (f64(lo), f64(hi), np.array(child, dtype=np.int64), np.array(bounds, dtype=np.int64),
            f64(points[order]), order.astype(np.int64))


def compact_lists(padded: torch.Tensor, heavy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GridSearch's candidate lists [boxes, width] (ascending, padded by repeating the first entry)
    -> (offsets int64 [boxes + 1], candidates int32 [total]): box b's list is
    candidates[offsets[b]:offsets[b + 1]] (a table that stays in cache), empty for heavy boxes
    (the kernel searches all codewords there)."""
    ascending = torch.ones_like(padded, dtype=torch.bool)
    ascending[:, 1:] = padded[:, 1:] > padded[:, :-1]
    keep = ascending.to(torch.int8).cumprod(1).bool() & ~heavy[:, None]  # up to the first repeat
    offsets = torch.zeros(padded.shape[0] + 1, dtype=torch.int64)
    offsets[1:] = keep.sum(1).cumsum(0)
    return offsets, padded[keep].to(torch.int32).contiguous()


def prune_dominated(offsets: torch.Tensor, candidates: torch.Tensor, edges: torch.Tensor, cells: int,
                    codewords: torch.Tensor, outer: float, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop from each box's list every codeword c that a listed c' (one of the CHALLENGERS nearest
    the box's far corners) beats on the whole box by
    more than DOMINANCE_MARGIN: ||x - c||^2 - ||x - c'||^2 = ||c||^2 - ||c'||^2 - 2 x.(c - c') is
    linear in x, so its minimum over the box is at a corner, sum_j min(lo_j d_j, hi_j d_j) with
    d = -2 (c - c'). Such a c is never the nearest, nor within the kernels' tie window of it, at any
    x in the box (boxes are closed: [edge, edge] of the float32 edges, +-outer outside; blocks
    beyond +-outer take the full search). Returns the pruned (offsets, candidates)."""
    k = codewords.shape[1]
    cw = codewords.to(torch.float64)
    sq = (cw ** 2).sum(1)
    inner = edges.to(torch.float64)
    low = torch.cat([torch.tensor([-outer], dtype=torch.float64), inner])       # per cell
    high = torch.cat([inner, torch.tensor([outer], dtype=torch.float64)])
    counts = offsets[1:] - offsets[:-1]
    width = int(counts.max()) if len(counts) else 0
    keep_parts = []
    for start in range(0, len(counts), chunk):
        stop = min(len(counts), start + chunk)
        slot = torch.arange(width)
        valid = slot[None, :] < counts[start:stop, None]                        # [B, W]
        idx = torch.where(valid, offsets[start:stop, None] + slot[None, :], offsets[start:stop, None])
        idx = candidates[idx.clamp(max=max(0, len(candidates) - 1))].to(torch.int64) if len(candidates) else idx
        box = torch.arange(start, stop)
        cell = torch.stack([(box // cells ** j) % cells for j in range(k)], 1)  # [B, k]
        lo, hi = low[cell], high[cell]
        c = cw[idx]                                                             # [B, W, k]
        # Challengers c': the listed codewords with the smallest farthest-corner distance.
        far = torch.maximum((lo[:, None, :] - c) ** 2, (hi[:, None, :] - c) ** 2).sum(-1)
        far = torch.where(valid, far, torch.full_like(far, math.inf))
        rival = torch.gather(idx, 1, far.topk(min(CHALLENGERS, width), dim=1, largest=False).indices)
        d = -2.0 * (c[:, :, None, :] - cw[rival][:, None, :, :])                # [B, W(c), R(c'), k]
        corner = torch.minimum(lo[:, None, None, :] * d, hi[:, None, None, :] * d).sum(-1)
        gap = sq[idx][:, :, None] - sq[rival][:, None, :] + corner              # min over box of the gap
        beaten = (gap > DOMINANCE_MARGIN).any(-1)
        keep_parts.append((valid & ~beaten)[valid])
    keep = torch.cat(keep_parts) if keep_parts else torch.zeros(0, dtype=torch.bool)
    kept_counts = torch.zeros(len(counts) + 1, dtype=torch.int64)
    box_of = torch.repeat_interleave(torch.arange(len(counts)), counts)
    kept_counts[1:].index_add_(0, box_of[keep], torch.ones(int(keep.sum()), dtype=torch.int64))
    return kept_counts.cumsum(0), candidates[keep].contiguous()


class NumbaSearch:
    """Search tables of one codebook [N, k] (CPU float32) and the numba encode of rotated rows."""

    def __init__(self, codewords: torch.Tensor, dim: int, method: str | None = None):
        cw = codewords.detach().to("cpu", torch.float32).contiguous()
        self.n_codewords, self.k = cw.shape
        self.method = method or choose_method(self.k, self.n_codewords)
        if self.method not in ("grid", "tree", "brute"):
            raise ValueError(f"unknown search method {self.method!r}")
        # Tables are tensor attributes (counted with the codec's device state); kernels get numpy views.
        self.codewords = cw
        self.codewords_t64 = cw.T.to(torch.float64).contiguous()          # [k, N]
        if self.method == "grid":
            if self.k not in GRID:
                raise ValueError(f"no grid for k={self.k}")
            cells = GRID[self.k][0]
            grid = GridSearch(cw, dim, cells)
            self.edges, self.heavy = grid.inner_edges, grid.heavy
            self.offsets, self.candidates = prune_dominated(*compact_lists(grid.candidates, grid.heavy), self.edges,
                                                            cells, cw, OUTER)
            self.codewords64 = cw.to(torch.float64)
            tables = (self.edges, cells, self.offsets, self.candidates, self.heavy, self.codewords64,
                      self.codewords_t64)
        elif self.method == "tree":
            self.lo, self.hi, self.child, self.bounds, self.points, self.ids = (
                torch.from_numpy(a) for a in build_tree(cw.numpy()))
            tables = (self.lo, self.hi, self.child, self.bounds, self.points, self.ids, self.codewords_t64)
        else:
            self.codewords_t32 = cw.T.contiguous()
            self.sq_norms = (cw ** 2).sum(-1)
            self.cmax = float(cw.to(torch.float64).norm(dim=1).max())
            tables = (self.codewords_t32, self.codewords_t64)
        self._args = (self.k, *(t.numpy() if isinstance(t, torch.Tensor) else t for t in tables))

    def _run(self, u: torch.Tensor, codes: np.ndarray, head: int, bits: int) -> np.ndarray:
        """Search (and with bits > 0 pack into codes[:, head:]) rows u [n, dim]; returns index [n, dim/k]."""
        u = u.detach()
        if u.device.type != "cpu" or u.dtype != torch.float32 or not u.is_contiguous():
            u = u.to("cpu", torch.float32).contiguous()
        n, dim = u.shape
        if dim % self.k:
            raise ValueError(f"row length {dim} is not a multiple of k={self.k}")
        n_blocks = dim // self.k
        index = np.empty((n, n_blocks), dtype=np.int64)
        flags = np.zeros((n, n_blocks), dtype=np.int8)
        if n == 0:
            return index
        kernels = _KERNELS or _kernels()
        out = (index, flags, codes, head, bits)
        if self.method == "brute" and n * n_blocks >= MATMUL_MIN_BLOCKS:
            flagged = self._matmul_screen(u, kernels["verify"], out)
        else:
            flagged = _run_rows(kernels[self.method], (u.numpy(), *self._args, *out), n, n_blocks)
        if flagged:  # near ties (and non-finite blocks): the reference decides
            where = np.flatnonzero(flags)
            blocks = u.reshape(-1, self.k)[torch.from_numpy(where)]
            index.reshape(-1)[where] = nearest_codeword_reference(blocks, self.codewords).numpy()
            if bits > 0:
                kernels["pack"](index, bits, codes, head, np.unique(where // n_blocks))
        return index

    def table_nbytes(self) -> int:
        """Bytes of the search tables (the codewords themselves not included)."""
        return sum(t.untyped_storage().nbytes() for name, t in vars(self).items()
                   if isinstance(t, torch.Tensor) and name != "codewords")

    def _matmul_screen(self, u: torch.Tensor, verify, out: tuple) -> int:
        """The full scan as a float32 BLAS matmul per chunk of rows (scores ||c||^2 - 2 x.c), the
        near-best codewords of each block then decided in float64 by the `verify` kernel."""
        n, dim = u.shape
        n_blocks = dim // self.k
        rows = max(1, DEFAULT_CHUNK_ELEMENTS // (n_blocks * self.n_codewords))
        scores = None
        flagged = 0
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            blocks = u[start:stop].reshape(-1, self.k)
            if scores is None or scores.shape[0] != blocks.shape[0]:
                scores = torch.empty(blocks.shape[0], self.n_codewords)
            torch.addmm(self.sq_norms, blocks, self.codewords_t32, beta=1.0, alpha=-2.0, out=scores)
            args = (u.numpy(), self.k, scores.numpy(), start, self._args[2], self.cmax, *out)
            flagged += _run_rows(lambda *a: verify(*a[:-2], a[-2] + start, a[-1] + start), args,
                                 stop - start, n_blocks)
        return flagged

    def indices(self, u: torch.Tensor) -> torch.Tensor:
        """Rotated rows u [n, dim] (float32) -> int64 [n, dim/k], the reference's indices."""
        return torch.from_numpy(self._run(u, np.empty((1, 1), dtype=np.uint8), 0, 0))

    def encode(self, u: torch.Tensor, norm_bytes: torch.Tensor | np.ndarray, index_bits: int) -> torch.Tensor:
        """Codes [n, h + packed] = norm bytes [n, h] (uint8), then the packed indices of u (`pack_bits`)."""
        n, head = norm_bytes.shape
        n_blocks = u.shape[1] // self.k
        codes = np.zeros((n, head + (n_blocks * index_bits + 7) // 8), dtype=np.uint8)
        codes[:, :head] = norm_bytes.numpy() if isinstance(norm_bytes, torch.Tensor) else norm_bytes
        self._run(u, codes, head, index_bits)
        return torch.from_numpy(codes)
