"""Exact nearest-codeword search and index packing on the CPU with numba (`search_kernels` kernels).

`NumbaSearch(codewords, dim)` picks a method for the codebook [N, k] (`choose_method`):

- `scalar` (k = 1: FibQuant `k=1`, the 4-bit in-register code of the paged kernel): the cell of each
  coordinate among the sorted codewords' midpoints, ~15 compares at N = 16 (the k-d tree it replaces
  took ~4.5 us per 64-d row, 7x k = 2's grid search); up to N = 32 (`scalar_rows`) the compares are
  float32, vectorised over a row, and a coordinate is decided by its cell's proof interval
  (`scalar_safe_cells`), the float64 distances only for the flagged few;

- `walk` (k = 4, 256 < N <= 4096: the 2.5 and 3 bit defaults): a walk over the codebook's Delaunay
  graph (`build_delaunay`, scipy / Qhull) from a start codeword looked up in a coarse grid
  (`walk_guess`) to the codeword whose Voronoi cell holds the block, each cell *certified* at build
  time (its Delaunay simplices have empty circumspheres with a margin, so the cell is exactly the
  intersection of its listed neighbours' half-spaces and every unlisted codeword is farther by more
  than the margin); neighbour lists sorted by face distance, so a scan stops at the first face too
  far to matter (`walk_lists`). ~17 codewords looked at per block at N = 4096, against the k-d
  tree's ~100s; build ~1-3 s (Qhull dominates);
- `grid` (k = 2, 3 with N <= 1024, k = 4 with N <= 256): the candidate lists of `box_grid.GridSearch`, further pruned
  by `prune_dominated`; at k = 2 and 4 branch-free kernels (`grid2`, `grid4`: k = 2 lists padded to one
  width with a far sentinel codeword, the fold as selects; heavy boxes and far blocks through the float32
  screen, at k = 4 a row's boxes first and the heavy-box screen vectorised over `scan4_table`), and at k = 2
  first a table of *sure* sub-boxes (`sure_table`: 8 x 8 per grid cell, those whose
  one codeword is the nearest of the whole sub-box by SURE_MARGIN) that answers ~89 % of blocks by a lookup
  (a row's lookups vectorised first, the other blocks listed and searched after; blocks beyond the inner grid
  look up a coarser outer table over [-1, 1]^2, `OUTER_SURE`, instead of the full scan);
- `tree` (other k <= TREE_MAX_K): a k-d tree;
- `brute` (k > 4): a full scan (for k <= SCAN_MAX_K the fused float32 `scan` kernel; above, a numba
  loop for few blocks and a float32 BLAS matmul from MATMUL_MIN_BLOCKS blocks; the near-best of
  each decided in float64);
- `cluster` (opt-in only, `NumbaSearch(codewords, dim, "cluster")`): k-means clusters of the
  codebook (`build_clusters`), clusters skipped by a ball and a half-space lower bound, float32
  screen, float64 decision. Exact; at k = 8, N = 4096 it scores ~1110 of 4096 codewords per
  canonical block but measured no faster than the full scan (docs/codecs.md, "Why 1.5 bits stays
  a full scan").

All return the index of `nearest_codeword_reference` (float64 squared distances, the lowest index
among equals): blocks whose best two distances agree to a relative 1e-12 are flagged by the kernel
and recomputed with the reference itself, so even exact ties break as the reference breaks them.

numba is imported on first use; kernels compile once per machine (numba's on-disk cache, a few
seconds the first time). Threads: with torch.get_num_threads() > 1 and enough rows, the rows are
split over a small thread pool (the kernels release the GIL; `fibquant._numba.run_split`, shared with
`fibquant.kv.attention.kernels`); `torch.set_num_threads(1)` keeps it single-threaded.
"""
from __future__ import annotations

import math
import threading

import numpy as np
import torch

from .._numba import numba_available, run_split  # noqa: F401  (numba_available: re-exported)
from .box_grid import GRID_CELLS, OUTER, GridSearch
from .nearest import DEFAULT_CHUNK_ELEMENTS, nearest_codeword_reference

TREE_MAX_K = 4        # k-d tree pruning pays up to here (k = 8, N = 256: the full scan is ~4x faster)
TREE_LEAF = 8         # codewords per tree leaf
# k -> (grid cells per axis, largest N): the grid's tables cost cells^k * N to build (k = 4, N = 256:
# 2.4-4.7 s measured 2026-12-03, then ~1 us per vector against 6 for the tree; N = 1024 would take 4x
# longer and ~1 GB).
GRID = {2: (GRID_CELLS[2], 1024), 3: (GRID_CELLS[3], 1024), 4: (12, 256)}
MATMUL_MIN_BLOCKS = 256  # "brute": from this many blocks a BLAS matmul screens (a numba loop below)
SCAN_MAX_K = 8           # up to this k the full scan's float32 screen runs in one kernel (`scan`), any batch size
_MIN_BLOCKS_PER_THREAD = 4096
CLUSTER_G = 64           # clusters of the opt-in "cluster" search (NumbaSearch(..., method="cluster"), k = 8 measured)
CLUSTER_MIN_SEP = 1e-6   # centres closer than this (relative) give no half-space bound
WALK = {4: (16, 4096)}   # k -> (start-grid cells per axis, largest N): the Delaunay walk ("walk")
WALK_CHUNK = 4           # the walk scans its lists this many entries at a time (= search_kernels.WALK_CHUNK)
WALK_STARTS = 1          # start candidates per box of the walk's grid (the nearest to the block is taken)
WALK_BINS = 2048         # the walk's start grid: bins per axis of the cell lookup table
WALK_MARGIN = 1e-10      # certified: unlisted codewords farther by > this * (1 + max ||c||^2) (squared)
SURE_SPLIT = 8          # grid2: sure boxes per grid cell and axis (`sure_table`: ~89 % of KV-like blocks at N = 256;
                        # 4: ~79 %, the search ~1.3x slower; built once per codebook and process, ~0.3-1 s)
_SURE_TABLES: dict = {}  # (codewords bytes, lo, hi, fine) -> `sure_table`'s table (a few codebooks per process)
_SURE_LOCK = threading.Lock()
# grid2: the outer sure table (half-width R, boxes per axis) for blocks beyond the inner one (the grid's outer
# boxes, all heavy, i.e. the full scan otherwise): [-1, 1]^2 holds every block of a unit row; 512 boxes per axis
# answer ~93 % of those KV-like blocks (256: ~85 %), built in ~0.15 s.
OUTER_SURE = (1.0, 512)
SURE_DIRECT = 256       # `sure_table` computes up to this many boxes per axis directly, finer ones from the coarser
SURE_MARGIN = 1e-7      # a sure box's codeword is nearer than every other by more than this (squared distance)
SCALAR_ROW_MAX = 31     # scalar: up to this many midpoints (N <= 32) the row-vectorised kernel `scalar_rows`
SENTINEL = 1e300        # coordinates of the padding codeword of the grid2 / grid4 tables (distance inf)
SCAN4_PAD = 1e15        # coordinates of grid4's float32 padding codewords (`scan4_table`: far, squares finite)
DOMINANCE_MARGIN = 1e-9  # a listed codeword beaten by this much on its whole box is dropped
CHALLENGERS = 6          # per box, the listed codewords tried as the one that beats another

_KERNELS = None
_LOCK = threading.Lock()


def _kernels() -> dict:
    global _KERNELS
    if _KERNELS is None:
        with _LOCK:
            if _KERNELS is None:
                from .search_kernels import compile_kernels
                _KERNELS = compile_kernels()
    return _KERNELS


def _run_rows(kernel, args: tuple, rows: int, blocks_per_row: int) -> int:
    """kernel(*args, start, stop) over `rows`, split across up to torch.get_num_threads() threads."""
    return run_split(kernel, args, rows, blocks_per_row, _MIN_BLOCKS_PER_THREAD, "fibquant-search")


def choose_method(k: int, n_codewords: int) -> str:
    """"scalar", "grid", "walk", "tree" or "brute" for a codebook [n_codewords, k]."""
    if k == 1:
        return "scalar"
    if k in GRID and n_codewords <= GRID[k][1]:
        return "grid"
    if k in WALK and n_codewords <= WALK[k][1]:
        return "walk"
    return "tree" if k <= TREE_MAX_K else "brute"


def scalar_safe_cells(sorted64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The `scalar_rows` kernel's proof table for sorted codewords [N] (float64 values of float32 codewords,
    ascending): float32 [N] bounds (lo[p], hi[p]) such that for every float x in [lo[p], hi[p]] the codeword of
    sorted position p is strictly the nearest of all in the reference's float64 squared distances, whatever
    their rounding: for each neighbour n of c = sorted[p], (1 - e)(x - n)^2 > (1 + e)(x - c)^2 with e = 1e-14
    (>> the ~3.4e-16 relative rounding of fl(fl(x - c)^2)), checked in exact rational arithmetic at both ends
    (the difference is concave in x, so it holds between them); farther codewords are farther still, and the
    rounding is monotone. The interval stops 1e-9 of the gap short of each midpoint and 1e6 gaps beyond an end
    codeword; a codeword with an equal neighbour (a tie everywhere) gets the empty interval (inf, -inf)."""
    from fractions import Fraction

    values = [float(v) for v in sorted64]
    top = float(np.finfo(np.float32).max)
    lo = np.full(len(values), np.inf, dtype=np.float32)
    hi = np.full(len(values), -np.inf, dtype=np.float32)
    e = Fraction(1, 10 ** 14)
    for p, c in enumerate(values):
        below = values[p - 1] if p > 0 else None
        above = values[p + 1] if p + 1 < len(values) else None
        if c == below or c == above:
            continue
        a = (below + c) / 2 + 1e-9 * (c - below) if below is not None else (
            c - 1e6 * (above - c) if above is not None else -top)
        b = (c + above) / 2 - 1e-9 * (above - c) if above is not None else (
            c + 1e6 * (c - below) if below is not None else top)
        a32 = np.float32(max(a, -top))
        if float(a32) < a:
            a32 = np.nextafter(a32, np.float32(np.inf))
        b32 = np.float32(min(b, top))
        if float(b32) > b:
            b32 = np.nextafter(b32, np.float32(-np.inf))
        if not (np.isfinite(a32) and np.isfinite(b32) and a32 <= b32):
            continue
        ends, cf = (Fraction(float(a32)), Fraction(float(b32))), Fraction(c)
        if all((1 - e) * (x - Fraction(n)) ** 2 > (1 + e) * (x - cf) ** 2
               for n in (below, above) if n is not None for x in ends):
            lo[p], hi[p] = a32, b32
    return torch.from_numpy(lo), torch.from_numpy(hi)


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


def build_delaunay(points: np.ndarray, margin: float = WALK_MARGIN) -> tuple[np.ndarray, ...]:
    """Tables of the Delaunay walk (`search_kernels._walk_py`) over codewords points [N, k] (k >= 2).

    The codewords and 2^k far points (dummies: the corners of a cube, each coordinate stretched by a
    fixed random factor in [1, 1.5] so that they are not cospherical; every codeword's Voronoi cell
    is then bounded) are triangulated (scipy / Qhull). A codeword v is *certified* when every
    simplex S containing v has a circumcentre y (solved in float64, refined once against a
    long-double residual, with an error bound e from ||A^-1||) whose sphere is empty with room to
    spare: every point u not in S has ||y - u||^2 - max_{s in S} ||y - s||^2 > margin (1 + max
    ||c||^2) + 4 e (2 r + sqrt(gap)) (r^2 = that max, gap = the left side), and no facet through v
    lies on the hull. Then the simplices around v are Delaunay simplices that close around it, so
    they are all of v's Delaunay simplices: v's Voronoi cell is the intersection of the half-spaces
    of its listed neighbours, its vertices are those circumcentres, and (the gap ||x - u||^2 - ||x -
    v||^2 being affine in x) every unlisted u is farther than v by more than `margin` at every x of
    the cell. Non-certified codewords (degenerate, duplicate or skipped points, too thin a simplex)
    make the walk fall back to the full search.

    Returns (offsets int64 [N + D + 1], neighbours int32 [...] (CSR; dummies are indices >= N),
    pts float64 [N + D, k] (codewords then dummies), certified bool [N]).
    """
    from scipy.spatial import Delaunay, cKDTree

    points = np.ascontiguousarray(points, dtype=np.float64)
    n, k = points.shape
    span = 4.0 * (1.0 + float(np.abs(points).max()))
    corners = np.array(np.meshgrid(*[[-span, span]] * k, indexing="ij")).reshape(k, -1).T
    corners *= np.random.default_rng(0).uniform(1.0, 1.5, corners.shape)  # not cospherical (no degenerate simplices)
    pts = np.ascontiguousarray(np.vstack([points, corners]))
    certified = np.zeros(n, dtype=bool)
    try:
        tri = Delaunay(pts)
    except Exception:  # Qhull refuses (too few or flat points): nothing certified, no lists
        return np.zeros(len(pts) + 1, dtype=np.int64), np.zeros(0, dtype=np.int32), pts, certified
    simplices = tri.simplices.astype(np.int64)                             # [m, k + 1]
    corner = pts[simplices]                                                # [m, k + 1, k]
    a = 2.0 * (corner[:, 1:] - corner[:, :1])
    rhs = (corner[:, 1:] ** 2).sum(-1) - (corner[:, :1] ** 2).sum(-1)
    ok = np.abs(np.linalg.det(a)) > 0
    a_safe = np.where(ok[:, None, None], a, np.eye(k))
    y = np.linalg.solve(a_safe, rhs[..., None])[..., 0]
    wide = corner.astype(np.longdouble)
    a_wide = 2.0 * (wide[:, 1:] - wide[:, :1])
    rhs_wide = (wide[:, 1:] ** 2).sum(-1) - (wide[:, :1] ** 2).sum(-1)
    def residual(c: np.ndarray) -> np.ndarray:
        return (rhs_wide - np.einsum("mij,mj->mi", a_wide, c.astype(np.longdouble))).astype(np.float64)

    y = y + np.linalg.solve(a_safe, residual(y)[..., None])[..., 0]
    inverse = np.linalg.norm(np.linalg.inv(a_safe), ord=2, axis=(1, 2))
    scale_ab = np.abs(a).sum((1, 2)) * np.abs(y).max(1) + np.abs(rhs).max(1)
    error = inverse * (np.linalg.norm(residual(y), axis=1) + 1e-15 * scale_ab) + 1e-15 * np.abs(y).max(1)
    radius = ((corner - y[:, None]) ** 2).sum(-1).max(1)
    _, near = cKDTree(pts).query(y, k=min(k + 2, len(pts)))
    near = near.reshape(len(y), -1)
    outside = (near[:, :, None] != simplices[:, None, :]).all(-1)         # [m, k + 2]: not a vertex
    gap = ((pts[near] - y[:, None]) ** 2).sum(-1) - radius[:, None]
    gap = np.where(outside, gap, np.inf).min(1)
    # y off by e moves ||y - u||^2 - ||y - s||^2 by at most 2 e ||s - u|| <= 2 e (2 r + sqrt(gap)) (r^2 = radius).
    reach = 2.0 * np.sqrt(radius) + np.sqrt(np.maximum(gap, 0.0))
    good = ok & np.isfinite(y).all(1) & np.isfinite(gap) & (gap > margin * (1.0 + float((points ** 2).sum(1).max()))
                                                             + 4.0 * error * reach)
    bad_vertex = np.zeros(len(pts), dtype=bool)
    bad_vertex[simplices[~good].reshape(-1)] = True
    on_hull = tri.neighbors < 0                                            # facet opposite vertex j
    for j in range(k + 1):
        facet = np.delete(simplices[on_hull[:, j]], j, axis=1)
        bad_vertex[facet.reshape(-1)] = True
    seen = np.zeros(len(pts), dtype=bool)
    seen[simplices.reshape(-1)] = True
    certified = seen[:n] & ~bad_vertex[:n]
    pairs = np.array([(i, j) for i in range(k + 1) for j in range(k + 1) if i != j])
    edge = simplices[:, pairs].reshape(-1, 2)
    key = np.unique(edge[:, 0] * len(pts) + edge[:, 1])                    # both directions, sorted
    offsets = np.zeros(len(pts) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(np.bincount(key // len(pts), minlength=len(pts)))
    return offsets, (key % len(pts)).astype(np.int32), pts, certified


def walk_lists(offsets: np.ndarray, nbr: np.ndarray, pts: np.ndarray) -> tuple[np.ndarray, ...]:
    """The walk's tables from the neighbour lists: (offsets, nbr int32 with each codeword's list sorted
    by face distance ||w - v|| / 2 ascending (ties by index) and padded to a multiple of WALK_CHUNK by
    repeating its last entry, reach float32 [entries / WALK_CHUNK] = the face distance of each
    chunk's first entry rounded down (so the kernel's skip bound stays a bound), table float64
    [N + D, k + 1] = (coordinates, ||c||^2 / 2))."""
    owner = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    reach = 0.5 * np.sqrt(((pts[nbr] - pts[owner]) ** 2).sum(1))
    order = np.lexsort((nbr, reach, owner))
    nbr, reach = nbr[order], reach[order]
    reach32 = reach.astype(np.float32)
    high = reach32.astype(np.float64) > reach
    reach32[high] = np.nextafter(reach32[high], np.float32(0))
    table = np.ascontiguousarray(np.hstack([pts, 0.5 * (pts ** 2).sum(1, keepdims=True)]))
    # Pad every non-empty list to a multiple of WALK_CHUNK with repeats of its last entry.
    length = np.diff(offsets)
    padded = -(-length // WALK_CHUNK) * WALK_CHUNK
    new_offsets = np.zeros_like(offsets)
    new_offsets[1:] = np.cumsum(padded)
    slot = np.arange(int(padded.sum())) - np.repeat(new_offsets[:-1], padded)   # position within its list
    source = np.repeat(offsets[:-1], padded) + np.minimum(slot, np.repeat(length, padded) - 1)
    nbr_padded = nbr[source]
    reach_padded = np.where(slot < np.repeat(length, padded), reach32[source], np.float32(np.inf)).astype(np.float32)
    chunk_reach = np.ascontiguousarray(reach_padded[::WALK_CHUNK])                # each chunk's first face
    return new_offsets, np.ascontiguousarray(nbr_padded, dtype=np.int32), chunk_reach, table


def coordinate_quantile(dim: int, q: np.ndarray) -> np.ndarray:
    """Quantiles q of one coordinate of a uniform point on S^{dim-1} (x^2 ~ Beta(1/2, (dim - 1) / 2))."""
    from scipy import special

    q = np.asarray(q, dtype=np.float64)
    tail = np.abs(2.0 * q - 1.0)
    return np.sign(q - 0.5) * np.sqrt(special.betaincinv(0.5, (dim - 1) / 2, tail))


def walk_guess(codewords: torch.Tensor, dim: int, cells: int,
               starts: int = WALK_STARTS) -> tuple[float, float, np.ndarray, np.ndarray]:
    """The walk's start table: (origin, scale, lut int64 [WALK_BINS], guess int32 [cells^k, WALK_STARTS]). Per axis
    `cells` cells of equal probability under one coordinate of the canonical source for `dim`
    (finest where blocks are densest); a coordinate v falls in bin floor((v - origin) * scale)
    (clamped) of WALK_BINS equal bins over [-R, R] (R its 1 - 1e-4 quantile) and lut maps bins to
    cells (a bin's centre's cell). guess[box] (axis j: stride cells^j) = the WALK_STARTS codewords
    nearest the box's centre (its cells' median coordinates); the kernel starts at the nearest of
    them. Any codeword would be correct; a near one saves moves (at k = 4, N = 4096 the best of 4 is
    the nearest codeword of ~89 % of canonical blocks, of 2 ~75 %, the centre's nearest alone ~56 %)."""
    from scipy.spatial import cKDTree

    k = codewords.shape[1]
    radius = float(coordinate_quantile(dim, 1 - 1e-4))
    edges = coordinate_quantile(dim, np.arange(1, cells) / cells)
    width = 2.0 * radius / WALK_BINS
    lut = np.searchsorted(edges, -radius + width * (np.arange(WALK_BINS) + 0.5)).astype(np.int64)
    tree = cKDTree(codewords.detach().to("cpu", torch.float64).numpy())
    boxes = np.arange(cells ** k)
    cell = np.stack([(boxes // cells ** j) % cells for j in range(k)], 1)             # axis j: stride cells^j
    starts = min(starts, codewords.shape[0])
    _, guess = tree.query(coordinate_quantile(dim, (cell + 0.5) / cells), k=starts)  # nearest the centre
    guess = guess.reshape(len(boxes), starts).astype(np.int32)
    return -radius, 1.0 / width, lut, np.ascontiguousarray(guess)


def build_clusters(points: np.ndarray, n_clusters: int) -> tuple[np.ndarray, ...]:
    """The cluster search's tables (`search_kernels._cluster_py`) over codewords points [N, k]: k-means
    centres (scipy kmeans2, k-means++ seeded with 0: deterministic), each codeword in the cluster of
    its nearest centre (float64, ties to the lower centre). Returns (centres [G, k], sep [G, G] =
    ||mu_g - mu_h|| (0 where below CLUSTER_MIN_SEP (1 + max ||mu||): no half-space bound there), rho [G]
    (cluster radii, rounded up), offsets [G + 1], pts [N, k] (codewords in cluster order), ids [N])."""
    from scipy.cluster.vq import kmeans2

    points = np.ascontiguousarray(points, dtype=np.float64)
    n = len(points)
    g = max(1, min(n_clusters, n))
    centres = points[:g].copy()
    if g > 1 and np.isfinite(points).all():
        try:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # empty clusters: kept empty (the kernel skips them)
                fitted, _ = kmeans2(points, g, iter=20, minit="++", seed=0)
            if np.isfinite(fitted).all():
                centres = fitted
        except Exception:  # degenerate codebooks: any centres are correct, only slower
            pass
    centres = np.ascontiguousarray(centres.astype(np.float32), dtype=np.float64)  # the kernel's float32 centres
    label = ((points[:, None, :] - centres[None, :, :]) ** 2).sum(-1).argmin(1)
    order = np.argsort(label, kind="stable")
    offsets = np.zeros(g + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(np.bincount(label, minlength=g))
    pts = np.ascontiguousarray(points[order])
    rho = np.zeros(g)
    np.maximum.at(rho, label, np.sqrt(((points - centres[label]) ** 2).sum(1)))
    rho = rho * (1.0 + 1e-12) + 1e-300
    sep = np.sqrt(((centres[:, None, :] - centres[None, :, :]) ** 2).sum(-1))
    sep = np.where(sep > CLUSTER_MIN_SEP * (1.0 + float(np.abs(centres).max())), sep, 0.0)
    return centres, np.ascontiguousarray(sep), rho, offsets, pts, order.astype(np.int64)


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


def padded_lists(offsets: torch.Tensor, candidates: torch.Tensor, sentinel: int) -> torch.Tensor:
    """The compact lists (`compact_lists`) as int16 [boxes, W] (W the longest list), each list padded with
    `sentinel` (the index of the far-out row the `grid2` kernel appends to the codewords)."""
    counts = offsets[1:] - offsets[:-1]
    width = max(1, int(counts.max()) if len(counts) else 1)
    slot = torch.arange(width)
    valid = slot[None, :] < counts[:, None]
    where = (offsets[:-1, None] + slot[None, :]).clamp(max=max(0, len(candidates) - 1))
    picked = candidates[where].to(torch.int64) if len(candidates) else torch.zeros_like(where)
    return torch.where(valid, picked, torch.full_like(picked, sentinel)).to(torch.int16).contiguous()


def sure_table(codewords: torch.Tensor, lo: float, hi: float, fine: int) -> torch.Tensor:
    """The `grid2` kernel's table of sure boxes for codewords [N, 2] (float64): [lo, hi]^2 cut into
    fine x fine equal boxes (box (i, j) at i + fine * j, i the cell of axis 0); a box holds the
    codeword c* that is the nearest of every point of the box by more than SURE_MARGIN in squared
    distance (so the unique nearest, no near tie at any rounding: the reference's index, unflagged),
    else -1. The gap ||x - c||^2 - ||x - c*||^2 is affine in x, so it exceeds the margin on the whole
    box when it does at the box's four corners: a box is sure when its corners share their nearest
    codeword and each corner's second nearest is farther by more than the margin (float64 distances
    ||c||^2 - 2 x.c + ||x||^2, their rounding ~1e-15 far below the margin, which also covers the
    kernel's rounding of a block's box; a near tie at a corner only makes the box unsure). Returns
    int16 [fine * fine] (kept per codebook for the process: shared, never to be written)."""
    key = (codewords.detach().to("cpu", torch.float64).numpy().tobytes(), tuple(codewords.shape), float(lo), float(hi),
           int(fine), SURE_MARGIN)
    with _SURE_LOCK:
        table = _SURE_TABLES.get(key)
        if table is None:
            table = _SURE_TABLES[key] = _sure_table(codewords, lo, hi, fine)
            while len(_SURE_TABLES) > 8:
                _SURE_TABLES.pop(next(iter(_SURE_TABLES)))
    return table


def _sure_table(codewords: torch.Tensor, lo: float, hi: float, fine: int) -> torch.Tensor:
    """`sure_table`, computed. For an even `fine` above SURE_DIRECT, from the table at fine / 2: a fine box
    inside a sure coarse box is sure with its codeword (the gap exceeds the margin on the whole coarse box),
    so only the fine boxes of unsure coarse boxes (~13 % at N = 256) have their corners' distances computed."""
    axis = torch.linspace(lo, hi, fine + 1, dtype=torch.float64)
    inherited = None
    if fine % 2 == 0 and fine > SURE_DIRECT:
        coarse = _sure_table(codewords, lo, hi, fine // 2).view(fine // 2, fine // 2).to(torch.int64)  # [j, i]
        inherited = coarse.repeat_interleave(2, 0).repeat_interleave(2, 1)                            # [fine, fine]
        need = torch.zeros(fine + 1, fine + 1, dtype=torch.bool)
        for dj, di in ((0, 0), (0, 1), (1, 0), (1, 1)):  # the corners of every box left to decide
            need[dj:dj + fine, di:di + fine] |= inherited < 0
        chosen = torch.nonzero(need.reshape(-1)).reshape(-1)
    else:
        chosen = torch.arange((fine + 1) ** 2)
    points = torch.stack([axis[chosen % (fine + 1)], axis[chosen // (fine + 1)]], 1)  # point (i, j) at i + (fine + 1) j
    best = torch.full(((fine + 1) ** 2,), -1, dtype=torch.int64)
    gap = torch.full(((fine + 1) ** 2,), -math.inf, dtype=torch.float64)  # points not computed: never clear
    columns, sq = codewords.T.contiguous(), (codewords ** 2).sum(1)
    rows = max(1, (1 << 20) // max(1, len(codewords)))
    for start in range(0, len(points), rows):
        part = points[start:start + rows]
        dist = torch.addmm(sq, part, columns, alpha=-2.0) + (part ** 2).sum(1, keepdim=True)  # [rows, N]
        first, where = dist.min(1)
        dist.scatter_(1, where[:, None], math.inf)
        best[chosen[start:start + rows]] = where
        gap[chosen[start:start + rows]] = dist.min(1).values - first
    best, clear = best.view(fine + 1, fine + 1), (gap > SURE_MARGIN).view(fine + 1, fine + 1)  # [j, i]
    corner = best[:-1, :-1]
    sure = clear[:-1, :-1].clone()
    for dj, di in ((0, 1), (1, 0), (1, 1)):
        sure &= clear[dj:dj + fine, di:di + fine] & (best[dj:dj + fine, di:di + fine] == corner)
    table = torch.where(sure, corner, torch.full_like(corner, -1))
    if inherited is not None:
        table = torch.where(inherited >= 0, inherited, table)
    return table.reshape(-1).to(torch.int16).contiguous()


def scan4_table(codewords: torch.Tensor) -> torch.Tensor:
    """The `grid4` kernel's heavy-box screen table: codewords [N, 4] as float32 [4 * P], axis-major (axis j of
    codeword c at j * P + c), P = N rounded up to a multiple of 16 with padding codewords at SCAN4_PAD (their
    float32 distances ~1e30: finite, never the minimum, never under the screen's limit)."""
    width = -(-codewords.shape[0] // 16) * 16
    flat = torch.full((4, width), SCAN4_PAD, dtype=torch.float32)
    flat[:, :codewords.shape[0]] = codewords.to(torch.float32).T
    return flat.reshape(-1).contiguous()


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


def _kernel_args(k: int, tables) -> tuple:
    """(k, *tables) as a search kernel takes them: tensors as numpy views, other values as they are."""
    return (k, *(t.numpy() if isinstance(t, torch.Tensor) else t for t in tables))


class NumbaSearch:
    """Search tables of one codebook [N, k] (CPU float32) and the numba encode of rotated rows."""

    def __init__(self, codewords: torch.Tensor, dim: int, method: str | None = None):
        cw = codewords.detach().to("cpu", torch.float32).contiguous()
        self.n_codewords, self.k = cw.shape
        self.method = method or choose_method(self.k, self.n_codewords)
        builders = {"scalar": self._scalar_tables, "grid": self._grid_tables, "walk": self._walk_tables,
                    "cluster": self._cluster_tables, "tree": self._tree_tables, "brute": self._brute_tables}
        if self.method not in builders:
            raise ValueError(f"unknown search method {self.method!r}")
        # Tables are tensor attributes (counted with the codec's device state); kernels get numpy views.
        self.codewords = cw
        self.codewords_t64 = cw.T.to(torch.float64).contiguous()          # [k, N]
        # row_kernel: (kernel name, its tables) where a faster row kernel than the method's own serves
        tables, row_kernel = builders[self.method](cw, dim)
        self._args = _kernel_args(self.k, tables)
        self._row_kernel = row_kernel or (self.method, self._args)

    def _scalar_tables(self, cw: torch.Tensor, dim: int) -> tuple:
        """Sorted codewords and their midpoints (k = 1); the row-vectorised kernel `scalar_rows` for short
        tables."""
        row_kernel = None
        if self.k != 1:
            raise ValueError(f"the scalar search needs k=1, not k={self.k}")
        sorted64, order = torch.sort(self.codewords_t64[0], stable=True)  # equal codewords: lowest index first
        self.order = order.contiguous()
        self.mids = ((sorted64[:-1] + sorted64[1:]) * 0.5).contiguous()  # exact: float32 sums in float64
        tables = (self.mids, self.order, self.codewords_t64)
        if len(self.mids) <= SCALAR_ROW_MAX:  # the row-vectorised kernel `scalar_rows`
            mids32 = self.mids.to(torch.float32)  # each midpoint rounded down to float32 (see the kernel)
            above = mids32.to(torch.float64) > self.mids
            mids32[above] = torch.nextafter(mids32[above], torch.tensor(-math.inf))
            self.mids32 = mids32.contiguous()
            self.safe_lo, self.safe_hi = scalar_safe_cells(sorted64)
            row_kernel = ("scalar_rows", _kernel_args(1, (self.mids32, self.safe_lo, self.safe_hi, self.order)))
        return tables, row_kernel

    def _grid_tables(self, cw: torch.Tensor, dim: int) -> tuple:
        """The grid of boxes with their pruned candidate lists; the branch-free `grid2` / `grid4` kernels at
        k = 2, 4."""
        row_kernel = None
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
        if self.k in (2, 4):  # the branch-free kernels `grid2` / `grid4` (search_numba)
            self.codewords_pad = torch.cat([self.codewords64, torch.full((1, self.k), SENTINEL, dtype=torch.float64)])
            self.codewords_t32 = cw.T.contiguous()
            if self.k == 2:
                self.padded = padded_lists(self.offsets, self.candidates, self.n_codewords)
                lo, hi = float(self.edges[0]), float(self.edges[-1])
                fine = (len(self.edges) - 1) * SURE_SPLIT
                olo, ofine = -OUTER_SURE[0], OUTER_SURE[1]
                # inner table, then the outer one (its boxes inside [lo, hi]^2 are never looked up)
                self.sure = torch.cat([sure_table(self.codewords64, lo, hi, fine),
                                       sure_table(self.codewords64, olo, -olo, ofine)]).contiguous()
                lists = (self.padded, self.sure, lo, fine / (hi - lo), fine, olo, ofine / (-2 * olo), ofine)
            else:
                self.scan4 = scan4_table(cw)
                lists = (self.offsets, self.candidates)
            fast_tables = (self.edges, cells, *lists, self.heavy, self.codewords_pad, self.codewords_t64,
                           self.codewords_t32, *((self.scan4,) if self.k == 4 else ()))
            row_kernel = (f"grid{self.k}", _kernel_args(self.k, fast_tables))
        return tables, row_kernel

    def _walk_tables(self, cw: torch.Tensor, dim: int) -> tuple:
        """A guess table and the Delaunay neighbour lists the greedy walk follows."""
        cells = WALK.get(self.k, (GRID_CELLS.get(self.k, 8), 0))[0]
        origin, scale, lut, guess = walk_guess(cw, dim, cells)
        offsets, nbr, pts, certified = build_delaunay(cw.numpy())
        offsets, nbr, reach, table = walk_lists(offsets, nbr, pts)
        if len(pts) > np.iinfo(np.int16).max:
            raise ValueError(f"walk: N + 2^k = {len(pts)} codewords and dummies exceed its int16 tables")
        guess, nbr = guess.astype(np.int16), nbr.astype(np.int16)  # smaller tables: fewer cache misses
        self.lut, self.guess, self.offsets, self.neighbours, self.reach, self.table, self.certified = (
            torch.from_numpy(a) for a in (lut, guess, offsets, nbr, reach, table, certified))
        size2 = float((pts[:self.n_codewords] ** 2).sum(1).max())
        tables = (origin, scale, self.lut, cells, self.guess, self.offsets, self.neighbours, self.reach,
                  self.table, self.n_codewords, self.certified, size2, self.codewords_t64)
        return tables, None

    def _cluster_tables(self, cw: torch.Tensor, dim: int) -> tuple:
        """Clusters of codewords with their centres, separations and radii."""
        centres, sep, rho, offsets, pts, ids = build_clusters(cw.numpy(), CLUSTER_G)
        self.centres_t32 = torch.from_numpy(centres.T.astype(np.float32).copy())
        self.sep, self.rho, self.cluster_offsets, self.ids = (torch.from_numpy(a) for a in (sep, rho, offsets, ids))
        sorted32 = cw[torch.from_numpy(ids)]
        self.centres_sq32 = (self.centres_t32 ** 2).sum(0)
        self.sorted_flat32 = torch.cat([sorted32[int(offsets[g]):int(offsets[g + 1])].T.reshape(-1)
                                        for g in range(len(offsets) - 1)]).contiguous()
        self.sorted_sq32 = (sorted32 ** 2).sum(-1)
        self.sorted_t64 = sorted32.T.to(torch.float64).contiguous()
        self.cmax = float(cw.to(torch.float64).norm(dim=1).max())
        tables = (self.centres_t32, self.centres_sq32, self.sep, self.rho, self.cluster_offsets, self.sorted_flat32,
                  self.sorted_sq32,
                  self.sorted_t64, self.ids, self.codewords_t64, self.cmax)
        return tables, None

    def _tree_tables(self, cw: torch.Tensor, dim: int) -> tuple:
        """A k-d tree of the codewords with its boxes."""
        self.lo, self.hi, self.child, self.bounds, self.points, self.ids = (
            torch.from_numpy(a) for a in build_tree(cw.numpy()))
        tables = (self.lo, self.hi, self.child, self.bounds, self.points, self.ids, self.codewords_t64)
        return tables, None

    def _brute_tables(self, cw: torch.Tensor, dim: int) -> tuple:
        """The codewords transposed (every codeword scored)."""
        self.codewords_t32 = cw.T.contiguous()
        self.sq_norms = (cw ** 2).sum(-1)
        self.cmax = float(cw.to(torch.float64).norm(dim=1).max())
        tables = (self.codewords_t32, self.codewords_t64)
        return tables, None

    def _run(self, u: torch.Tensor, codes: np.ndarray, head: int, bits: int,
             scratch: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Search (and with bits > 0 pack into codes[:, head:]) rows u [n, dim]; returns index [n, dim/k].
        `scratch`: (int64, int8) arrays of at least [n, dim/k] to hold the index and flags (reused
        working memory, `encode_index`); fresh arrays otherwise."""
        u = u.detach()
        if u.device.type != "cpu" or u.dtype != torch.float32 or not u.is_contiguous():
            u = u.to("cpu", torch.float32).contiguous()
        n, dim = u.shape
        if dim % self.k:
            raise ValueError(f"row length {dim} is not a multiple of k={self.k}")
        n_blocks = dim // self.k
        if scratch is not None and scratch[0].shape[0] >= n and scratch[0].shape[1:] == (n_blocks,):
            index, flags = scratch[0][:n], scratch[1][:n]
            flags.fill(0)  # the kernels only set flags
        else:
            index = np.empty((n, n_blocks), dtype=np.int64)
            flags = np.zeros((n, n_blocks), dtype=np.int8)
        if n == 0:
            return index
        kernels = _KERNELS or _kernels()
        out = (index, flags, codes, head, bits)
        if self.method == "brute" and self.k <= SCAN_MAX_K:
            flagged = _run_rows(kernels["scan"], (u.numpy(), self.k, self.codewords_t32.numpy(), self.sq_norms.numpy(),
                                                  self._args[2], self.cmax, *out), n, n_blocks)
        elif self.method == "brute" and n * n_blocks >= MATMUL_MIN_BLOCKS:
            flagged = self._matmul_screen(u, kernels["verify"], out)
        else:
            name, args = self._row_kernel
            flagged = _run_rows(kernels[name], (u.numpy(), *args, *out), n, n_blocks)
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
        return self.encode_index(u, norm_bytes, index_bits)[0]

    def encode_index(self, u: torch.Tensor, norm_bytes: torch.Tensor | np.ndarray, index_bits: int,
                     scratch: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[torch.Tensor, np.ndarray]:
        """(`encode`'s codes, the indices they pack: int64 [n, dim/k]); with `scratch` (`_run`) the indices
        are a view of scratch[0], valid until its next use."""
        n, head = norm_bytes.shape
        n_blocks = u.shape[1] // self.k
        # every byte of a row is written: the norm bytes here, then each packed byte (a partial last byte too)
        codes = np.empty((n, head + (n_blocks * index_bits + 7) // 8), dtype=np.uint8)
        codes[:, :head] = norm_bytes.numpy() if isinstance(norm_bytes, torch.Tensor) else norm_bytes
        index = self._run(u, codes, head, index_bits, scratch)
        return torch.from_numpy(codes), index
