"""numba kernels of the exact nearest-codeword search (see `numba_search`, which builds their tables,
threads them and resolves the blocks they flag).

Every kernel searches the blocks of rows [start, stop) of u [n, dim] (float32, k-blocks of each row)
and writes index[row, block]. Distances are float64 sums of squared float64 differences, the
reference's arithmetic; the sum order may differ from torch's, so a block whose best and
second-best distances lie within a relative 1e-12 (a tie, or a near tie where rounding could
decide) is flagged (flags[row, block] = 1) and left to the reference. A kernel returns the number
of flagged blocks. Pruning (grid candidate lists, tree bounding boxes, the walk's certified cells
and face-distance stop) keeps every codeword within that window of the best, so an unflagged
block's index is the reference's.

With bits > 0 each row's indices are also bit-packed into codes[row, head:] (= `pack_bits`).

Methods: `scalar` (k = 1: the cell of each coordinate among the sorted codewords' midpoints; `scalar_rows` for
N <= 32 counts a row's cells vectorised and flags a coordinate outside its cell's proof interval), `grid` (candidate lists of the box of a block, `box_grid.GridSearch`, stored compactly:
box b's list is candidates[offsets[b]:offsets[b + 1]]), `tree` (a k-d
tree with per-node bounding boxes, depth-first, nearer child first), `walk` (a walk over the
codebook's Delaunay graph to the certified Voronoi cell holding the block, `_walk_py`), `brute` (all
N, the distance loop running over codewords so that LLVM vectorises it; float32 distances screen,
the float64 distances of the survivors decide), `scan` (the same full search from float32 scores
||c||^2 - 2 x.c computed per block, the many-blocks path for k <= 8) and `verify` (the decision
after a BLAS score matrix).
"""
from __future__ import annotations

TIE_REL = 1e-12      # best and second best closer than this (relative): flagged for the reference
PRUNE_REL = 1e-9     # a node / box is skipped only when its bound exceeds best * (1 + PRUNE_REL)
SCREEN_ULPS = 8      # float32 screening slack: (2k + SCREEN_ULPS) float32 epsilons, relative
GRID_OUTER = 1.5     # = box_grid.OUTER: the grid's boxes cover [-GRID_OUTER, GRID_OUTER]^k
STACK = 128          # tree search stack (depth of a tree over <= 2^20 codewords is far below)
WALK_STEPS = 64      # Delaunay walk: after this many moves the block takes the full search
WALK_CHUNK = 4       # = numba_search.WALK_CHUNK: the walk's lists are padded to multiples of this
CLUSTER_REL = 1e-7   # cluster search: a cluster is skipped when its bound exceeds r (1 + this) + CLUSTER_ABS (1 + ||x||^2)
CLUSTER_ABS = 1e-9
WALK_SLACK = 1e-9    # Delaunay walk: slacks within +-WALK_SLACK (1 + ||x||^2 + max ||c||^2) use distances

np = None            # numpy, bound by compile_kernels()
_consider = _finish = _brute_block = _cell = _range_scores = _screen = _pack_row = _min = _count_below = _slack = _settle = None
_far_block = _row_cells = _scan4 = _count_bits_below = _heavy4 = None


def _consider_py(d1, i1, d2, d, idx):
    """Fold distance d of codeword idx into (best, its index, second best); returns the new triple."""
    if d < d1 or (d == d1 and idx < i1):
        return d, idx, d1
    if d < d2:
        return d1, i1, d
    return d1, i1, d2


def _finish_py(d1, i1, d2, x, index, flags, row, block):
    """Write the block's index; flag it (return 1) on a near tie or a non-finite block."""
    index[row, block] = i1
    bad = i1 < 0 or (d2 - d1 <= TIE_REL * d2 and d2 < np.inf)
    for j in range(x.shape[0]):
        if not np.isfinite(x[j]):
            bad = True
    if bad:
        flags[row, block] = 1
        return 1
    return 0


def _brute_block_py(x, cw_t, dist):
    """Exact search of x [k] (float64) over all codewords cw_t [k, N] (float64): (d1, i1, d2)."""
    k, n = cw_t.shape
    for c in range(n):
        dist[c] = 0.0
    for j in range(k):
        xj = x[j]
        for c in range(n):
            t = xj - cw_t[j, c]
            dist[c] += t * t
    d1, i1, d2 = np.inf, -1, np.inf
    for c in range(n):
        d1, i1, d2 = _consider(d1, i1, d2, dist[c], c)
    return d1, i1, d2


def _grid_py(u, k, edges, cells, offsets, candidates, heavy, cw, cw_t, index, flags, codes, head, bits, start, stop):
    n_blocks = u.shape[1] // k
    last = edges.shape[0]
    origin = np.float64(edges[0])
    scale = (last - 1) / (np.float64(edges[last - 1]) - origin)  # the edges are equally spaced
    x = np.empty(k, dtype=np.float64)
    dist = np.empty(cw_t.shape[1], dtype=np.float64)
    flagged = 0
    for row in range(start, stop):
        for b in range(n_blocks):
            box = 0
            stride = 1
            outside = False
            for j in range(k):
                v = u[row, b * k + j]
                x[j] = v
                if not -GRID_OUTER <= v <= GRID_OUTER:  # beyond the outer cells (or NaN)
                    outside = True
                box += _cell(v, edges, origin, scale, last) * stride
                stride *= cells
            d1, i1, d2 = np.inf, -1, np.inf
            if outside or heavy[box]:  # far out: the full search
                d1, i1, d2 = _brute_block(x, cw_t, dist)
            else:
                for t in range(offsets[box], offsets[box + 1]):  # the box's candidates, ascending
                    c = np.int64(candidates[t])
                    d = 0.0
                    for j in range(k):
                        g = x[j] - cw[c, j]
                        d += g * g
                    d1, i1, d2 = _consider(d1, i1, d2, d, c)
            flagged += _finish(d1, i1, d2, x, index, flags, row, b)
        if bits > 0:
            _pack_row(index, row, bits, codes, head)
    return flagged


def _cell_py(v, edges, origin, scale, last):
    """Grid cell of coordinate v (float32): #edges < v (torch.bucketize, right=False), from an
    estimate on the equally spaced edges, then made exact against the float32 edges."""
    f = (np.float64(v) - origin) * scale
    cell = 0 if not f > -1.0 else (last if f >= last else int(f) + 1)
    while cell > 0 and edges[cell - 1] >= v:
        cell -= 1
    while cell < last and edges[cell] < v:
        cell += 1
    return cell


def _far_block_py(x0, x1, x2, x3, k, cw_t, cw32_t, x, xs, dist, dist32, index, flags, row, block):
    """A block outside the grid's boxes or in a heavy box: the full search. A finite block takes `_brute_py`'s
    float32 screen (vectorised) and the float64 decision of its survivors (`_settle`), a non-finite one the
    float64 scan (`_brute_block`); both flag as `_finish` does. Returns the flags added."""
    x[0] = x0
    x[1] = x1
    if k == 4:
        x[2] = x2
        x[3] = x3
    finite = True
    for j in range(k):
        xs[j] = np.float32(x[j])
        if not np.isfinite(x[j]):
            finite = False
    if not finite:
        d1, i1, d2 = _brute_block(x, cw_t, dist)
        return _finish(d1, i1, d2, x, index, flags, row, block)
    slack = np.float32(1.0 + (2 * k + SCREEN_ULPS) * 2.0 ** -23)
    limit = _screen(xs, cw32_t, dist32) * slack + np.float32(1e-30)
    return _settle(x, cw_t, dist32, np.float64(limit), index, flags, row, block)


def _grid2_py(u, k, edges, cells, padded, sure, lo, fscale, fine, olo, oscale, ofine, heavy, cwp, cw_t, cw32_t, index,
              flags, codes, head, bits, start, stop):
    """`_grid_py` for k = 2, branch-free: the block in registers, every box's candidate list padded to one
    width with a sentinel codeword N (cwp[N] is far out: distance inf, never the best nor the second),
    and the fold of `_consider` as selects (candidates ascend, so a later equal distance never wins: the
    lowest index among equals, as the reference). The same boxes, float64 distances (the same sum
    order) and tie flags as `_grid_py`, so the same indices and flags; heavy boxes and blocks beyond the
    boxes take `_far_block`. First, a block in a sure box (`numba_search.sure_table`: the fine boxes of
    [lo, hi]^2, box floor((x - lo) * fscale) per axis, whose one codeword is the nearest of all their
    points by a margin) takes that codeword, unflagged: what the search would find. A block beyond [lo, hi]^2 looks up the
    coarser outer table sure[fine^2:] of [olo, -olo]^2 (ofine x ofine boxes, box floor((x - olo) * oscale)): the
    outer boxes, all heavy, would otherwise send it to the full scan."""
    n_blocks = u.shape[1] // 2
    width = padded.shape[1]
    last = edges.shape[0]
    origin = np.float64(edges[0])
    scale = (last - 1) / (np.float64(edges[last - 1]) - origin)
    x = np.empty(2, dtype=np.float64)
    xs = np.empty(2, dtype=np.float32)
    dist = np.empty(cw_t.shape[1], dtype=np.float64)
    dist32 = np.empty(cw_t.shape[1], dtype=np.float32)
    subs = np.empty(n_blocks, dtype=np.int64)
    misses = np.empty(n_blocks, dtype=np.int64)
    flagged = 0
    for row in range(start, stop):
        # A row in three passes, so that the ~90 % of blocks a sure box answers pay no mispredicted branch:
        # every block's sure sub-box (vectorised; -1 beyond the table or NaN), the table's answers with the
        # other blocks listed (branch-free), then the search of the listed blocks.
        for b in range(n_blocks):
            f0 = (np.float64(u[row, 2 * b]) - lo) * fscale
            f1 = (np.float64(u[row, 2 * b + 1]) - lo) * fscale
            ok = (f0 >= 0.0) & (f0 < fine) & (f1 >= 0.0) & (f1 < fine)
            sub = np.int64(f0 if ok else 0.0) + fine * np.int64(f1 if ok else 0.0)
            g0 = (np.float64(u[row, 2 * b]) - olo) * oscale
            g1 = (np.float64(u[row, 2 * b + 1]) - olo) * oscale
            out = (g0 >= 0.0) & (g0 < ofine) & (g1 >= 0.0) & (g1 < ofine)
            osub = fine * fine + np.int64(g0 if out else 0.0) + ofine * np.int64(g1 if out else 0.0)
            subs[b] = sub if ok else (osub if out else -1)
        missed = 0
        for b in range(n_blocks):
            sub = subs[b]
            s = np.int64(sure[sub if sub >= 0 else 0])
            s = s if sub >= 0 else -1
            index[row, b] = s
            misses[missed] = b
            missed += 1 if s < 0 else 0
        for t in range(missed):
            b = misses[t]
            v0 = u[row, 2 * b]
            v1 = u[row, 2 * b + 1]
            x0 = np.float64(v0)
            x1 = np.float64(v1)
            box = -1
            if -GRID_OUTER <= v0 <= GRID_OUTER and -GRID_OUTER <= v1 <= GRID_OUTER:
                box = _cell(v0, edges, origin, scale, last) + _cell(v1, edges, origin, scale, last) * cells
                if heavy[box]:
                    box = -1
            if box < 0:
                flagged += _far_block(x0, x1, 0.0, 0.0, 2, cw_t, cw32_t, x, xs, dist, dist32, index, flags, row, b)
                continue
            d1 = np.inf
            i1 = np.int64(-1)
            d2 = np.inf
            for w in range(width):
                c = np.int64(padded[box, w])
                g0 = x0 - cwp[c, 0]
                g1 = x1 - cwp[c, 1]
                d = g0 * g0
                d += g1 * g1
                better = d < d1
                d2 = d1 if better else min(d2, d)
                i1 = c if better else i1
                d1 = d if better else d1
            index[row, b] = i1
            if d2 - d1 <= TIE_REL * d2 and d2 < np.inf:
                flags[row, b] = 1
                flagged += 1
        if bits > 0:
            _pack_row(index, row, bits, codes, head)
    return flagged


def _row_cells_py(u, row, edges, cells_out):
    """cells_out[i] = the number of edges < u[row, i] for every coordinate of the row: `_cell`'s answer
    (torch.bucketize, right=False) counted directly, vectorised over the row (fastmath: integer
    counts of exact float32 comparisons; a NaN coordinate counts 0, the caller sends it to the full
    search)."""
    d = u.shape[1]
    for i in range(d):
        cells_out[i] = 0
    for j in range(edges.shape[0]):
        e = edges[j]
        for i in range(d):
            cells_out[i] += np.int32(1) if u[row, i] > e else np.int32(0)


def _scan4_py(x0, x1, x2, x3, flat, out):
    """float32 squared distances of the block (x0..x3) to every codeword of flat (axis-major [4 * P],
    P a multiple of 16, padding codewords far out) into out [P] (fastmath: vectorised; the caller's
    slack covers any summation order and fused multiply-adds; its inputs are finite and bounded)."""
    n = out.shape[0]
    for i in range(n):
        g0 = x0 - flat[i]
        g1 = x1 - flat[n + i]
        g2 = x2 - flat[2 * n + i]
        g3 = x3 - flat[3 * n + i]
        out[i] = g0 * g0 + g1 * g1 + g2 * g2 + g3 * g3


def _count_bits_below_py(bits, limit):
    """(how many of bits [P] are <= limit, the sum of their positions) over int32 bit patterns of
    non-negative floats (ordered like the values; fastmath: vectorised)."""
    count = 0
    total = 0
    for c in range(bits.shape[0]):
        ok = bits[c] <= limit
        count += 1 if ok else 0
        total += c if ok else 0
    return count, total


def _heavy4_py(v0, v1, v2, v3, flat, cwp, n, out, limit_box, index, flags, row, block):
    """A finite block inside the grid's span in a heavy box (k = 4): `_far_block`'s proof (every
    codeword whose float32 distance could round from within the tie window of the best passes the
    screen; one passes: the nearest, no near tie; else the float64 decision of those that pass, in
    ascending index) with the screen vectorised: float32 distances to all codewords (`_scan4`), their
    minimum and the count below the limit on the int32 bit patterns (`limit_box`: a float32 [1] with its
    int32 view, scratch). Returns the flags added."""
    _scan4(v0, v1, v2, v3, flat, out)
    bits = out.view(np.int32)
    slack = np.float32(1.0 + (2 * 4 + SCREEN_ULPS) * 2.0 ** -23)
    limit_bits = limit_box.view(np.int32)
    limit_bits[0] = _bits_min(bits)
    limit_box[0] = limit_box[0] * slack + np.float32(1e-30)
    count, position = _count_bits_below(bits, limit_bits[0])
    if count == 1:
        index[row, block] = position
        return 0
    x0 = np.float64(v0)
    x1 = np.float64(v1)
    x2 = np.float64(v2)
    x3 = np.float64(v3)
    d1 = np.inf
    i1 = np.int64(-1)
    d2 = np.inf
    for c in range(n):
        if bits[c] <= limit_bits[0]:
            g0 = x0 - cwp[c, 0]
            g1 = x1 - cwp[c, 1]
            g2 = x2 - cwp[c, 2]
            g3 = x3 - cwp[c, 3]
            d = g0 * g0
            d += g1 * g1
            d += g2 * g2
            d += g3 * g3
            i1 = c if d < d1 else i1
            d2 = min(d2, max(d1, d))
            d1 = min(d1, d)
    index[row, block] = i1
    if i1 < 0 or (d2 - d1 <= TIE_REL * d2 and d2 < np.inf):
        flags[row, block] = 1
        return 1
    return 0


def _grid4_py(u, k, edges, cells, offsets, candidates, heavy, cwp, cw_t, cw32_t, flat, index, flags, codes, head, bits,
              start, stop):
    """`_grid_py` for k = 4 over the compact lists (box b: candidates[offsets[b]:offsets[b + 1]], ascending;
    distances summed over j = 0..3 in order, as `_grid_py`), in two passes per row: first every block's box
    (`_row_cells`: the row's grid cells vectorised; -1 for a block beyond the boxes or in a heavy box), then
    the searches, which no longer wait on the cell arithmetic. The fold is min / max selects (the best, its
    index by a strict `<`: the lowest among equals, candidates ascending; the second best as
    min(second, max(best, d))), the same values as `_consider`. A heavy box takes `_heavy4` (the float32
    screen vectorised over flat, the axis-major padded codewords), a block beyond the boxes or non-finite
    `_far_block`. The same indices and flags as `_grid_py`."""
    n_blocks = u.shape[1] // 4
    n = cw_t.shape[1]
    x = np.empty(4, dtype=np.float64)
    xs = np.empty(4, dtype=np.float32)
    dist = np.empty(n, dtype=np.float64)
    dist32 = np.empty(n, dtype=np.float32)
    out = np.empty(flat.shape[0] // 4, dtype=np.float32)
    limit_box = np.empty(1, dtype=np.float32)
    row_cells = np.empty(u.shape[1], dtype=np.int32)
    boxes = np.empty(n_blocks, dtype=np.int64)
    flagged = 0
    for row in range(start, stop):
        _row_cells(u, row, edges, row_cells)
        for b in range(n_blocks):
            box = np.int64(row_cells[4 * b]) + cells * (np.int64(row_cells[4 * b + 1]) + cells * (
                np.int64(row_cells[4 * b + 2]) + cells * np.int64(row_cells[4 * b + 3])))
            inside = True
            for j in range(4):
                v = u[row, 4 * b + j]
                if not -GRID_OUTER <= v <= GRID_OUTER:  # beyond the outer cells (or NaN)
                    inside = False
            boxes[b] = box if inside else -1
        for b in range(n_blocks):
            v0 = u[row, 4 * b]
            v1 = u[row, 4 * b + 1]
            v2 = u[row, 4 * b + 2]
            v3 = u[row, 4 * b + 3]
            box = boxes[b]
            if box < 0:
                flagged += _far_block(np.float64(v0), np.float64(v1), np.float64(v2), np.float64(v3), 4, cw_t, cw32_t,
                                      x, xs, dist, dist32, index, flags, row, b)
                continue
            if heavy[box]:
                flagged += _heavy4(v0, v1, v2, v3, flat, cwp, n, out, limit_box, index, flags, row, b)
                continue
            x0 = np.float64(v0)
            x1 = np.float64(v1)
            x2 = np.float64(v2)
            x3 = np.float64(v3)
            d1 = np.inf
            i1 = np.int64(-1)
            d2 = np.inf
            for t in range(offsets[box], offsets[box + 1]):
                c = np.int64(candidates[t])
                g0 = x0 - cwp[c, 0]
                g1 = x1 - cwp[c, 1]
                g2 = x2 - cwp[c, 2]
                g3 = x3 - cwp[c, 3]
                d = g0 * g0
                d += g1 * g1
                d += g2 * g2
                d += g3 * g3
                i1 = c if d < d1 else i1
                d2 = min(d2, max(d1, d))
                d1 = min(d1, d)
            index[row, b] = i1
            if i1 < 0 or (d2 - d1 <= TIE_REL * d2 and d2 < np.inf):
                flags[row, b] = 1
                flagged += 1
        if bits > 0:
            _pack_row(index, row, bits, codes, head)
    return flagged


def _tree_py(u, k, lo, hi, child, bounds, pts, ids, cw_t, index, flags, codes, head, bits, start, stop):
    n_blocks = u.shape[1] // k
    x = np.empty(k, dtype=np.float64)
    dist = np.empty(cw_t.shape[1], dtype=np.float64)
    stack = np.empty(STACK, dtype=np.int64)
    flagged = 0
    for row in range(start, stop):
        for b in range(n_blocks):
            finite = True
            for j in range(k):
                x[j] = u[row, b * k + j]
                if not np.isfinite(x[j]):
                    finite = False
            d1, i1, d2 = np.inf, -1, np.inf
            if not finite:
                d1, i1, d2 = _brute_block(x, cw_t, dist)
                flagged += _finish(d1, i1, d2, x, index, flags, row, b)
                continue
            top = 1
            stack[0] = 0
            while top > 0:
                top -= 1
                node = stack[top]
                bound = 0.0
                for j in range(k):
                    g = max(max(lo[node, j] - x[j], x[j] - hi[node, j]), 0.0)
                    bound += g * g
                if bound > d1 * (1.0 + PRUNE_REL):
                    continue
                left = child[node, 0]
                if left < 0:
                    for p in range(bounds[node, 0], bounds[node, 1]):
                        d = 0.0
                        for j in range(k):
                            g = x[j] - pts[p, j]
                            d += g * g
                        d1, i1, d2 = _consider(d1, i1, d2, d, ids[p])
                    continue
                right = child[node, 1]
                axis = child[node, 2]
                # Push the farther child first so that the nearer one is searched first.
                if x[axis] - hi[left, axis] <= lo[right, axis] - x[axis]:
                    stack[top] = right
                    stack[top + 1] = left
                else:
                    stack[top] = left
                    stack[top + 1] = right
                top += 2
            flagged += _finish(d1, i1, d2, x, index, flags, row, b)
        if bits > 0:
            _pack_row(index, row, bits, codes, head)
    return flagged


def _scalar_py(u, k, mids, order, cw_t, index, flags, codes, head, bits, start, stop):
    """k = 1: the codewords sorted (sorted[j] = cw_t[0, order[j]], ascending) and their float64 midpoints
    mids[j] = (sorted[j] + sorted[j + 1]) / 2 (exact); a coordinate x falls in cell pos = #{mids < x}
    (a branch-free count for up to 32 codewords, a binary search beyond), and its runner-up is a
    neighbouring cell. The float64 distances of the three decide the flag as `_finish` does, so a block
    whose rounded distances could order otherwise than the exact cells (near ties) goes to the reference."""
    n_blocks = u.shape[1]
    m = mids.shape[0]
    last = m  # sorted positions 0..m
    flagged = 0
    for row in range(start, stop):
        for b in range(n_blocks):
            x = np.float64(u[row, b])
            if m <= 31:
                pos = 0
                for j in range(m):
                    pos += x > mids[j]
            else:
                pos = np.searchsorted(mids, x)
            c = cw_t[0, order[pos]]
            d1 = (x - c) * (x - c)
            d2 = np.inf
            if pos > 0:
                g = x - cw_t[0, order[pos - 1]]
                d2 = g * g
            if pos < last:
                g = x - cw_t[0, order[pos + 1]]
                d2 = min(d2, g * g)
            index[row, b] = order[pos]
            if not np.isfinite(x) or (d2 - d1 <= TIE_REL * d2 and d2 < np.inf):
                flags[row, b] = 1
                flagged += 1
        if bits > 0:
            _pack_row(index, row, bits, codes, head)
    return flagged


def _scalar_rows_py(u, k, mids32, safe_lo, safe_hi, order, index, flags, codes, head, bits, start, stop):
    """k = 1 with up to SCALAR_ROW_MAX midpoints, vectorised over a row. pos = #{mids < x} is counted on float32
    comparisons against mids32 (each midpoint rounded down to float32: for a float32 x, x > mid exactly when
    x > mids32; NaN counts 0), the index is order[pos], and a coordinate outside its cell's proof interval
    [safe_lo[pos], safe_hi[pos]] (`numba_search.scalar_safe_cells`: inside it the sorted codeword pos is strictly
    the reference's nearest; NaN and inf are outside) is flagged for the reference. The flags are a superset
    of `_scalar_py`'s near ties; the indices after the reference are the same."""
    d = u.shape[1]
    m = mids32.shape[0]
    pos = np.empty(d, dtype=np.int32)
    flagged = 0
    for row in range(start, stop):
        for i in range(d):
            pos[i] = 0
        for j in range(m):
            e = mids32[j]
            for i in range(d):
                pos[i] += np.int32(1) if u[row, i] > e else np.int32(0)
        bad = 0
        for i in range(d):
            x = u[row, i]
            p = pos[i]
            index[row, i] = order[p]
            out = np.int32(safe_lo[p] > x) | np.int32(x > safe_hi[p]) | np.int32(x != x)
            flags[row, i] = np.int8(out)
            bad += out
        flagged += bad
        if bits > 0:
            _pack_row(index, row, bits, codes, head)
    return flagged


def _walk_py(u, k, origin, scale, lut, cells, guess, offsets, nbr, reach, table, n_real, certified, size2, cw_t,
             index, flags, codes, head, bits, start, stop):
    """Delaunay walk (`numba_search.build_delaunay`, `walk_lists`, `walk_guess`): start at the nearest
    of the codewords `guess` holds for the block's box of a coarse grid (per axis: bin floor((v -
    origin) * scale), clamped, mapped to a cell by lut); while the block x is on the far side of a
    Delaunay face of the current codeword v (a neighbour w nearer: slack g(w) - g(v) < 0, g(c) =
    ||c||^2 / 2 - x.c, so that the slack is (||x - w||^2 - ||x - v||^2) / 2), move to the nearest
    such neighbour. v's neighbours are listed by their face distance ||w - v|| / 2 ascending; with r
    = ||x - v||, a face with distance reach > r has slack >= 2 reach (reach - r), so the scan
    (WALK_CHUNK faces at a time; lists are padded to whole chunks by repeating their last entry)
    stops before the first chunk whose first face exceeds tau that way (all later faces are farther
    still): reach[c] = the face distance of chunk c's first entry, rounded down. A block deep inside
    its start cell looks at no face at all.

    Where every slack exceeds tau at a certified v, x lies inside v's Voronoi cell (a certified cell
    is the intersection of its neighbours' half-spaces), clear of every face, and every codeword
    not listed is farther than v by more than the certificate's margin: v is the reference's index,
    no tie. A slack within +-tau (near a face) switches to float64 distances: the walk goes on over
    whole lists comparing ||x - w||^2 as the other kernels do, so the best two listed distances
    decide the tie flag. Elsewhere (an uncertified or dummy codeword, a non-finite block, too many
    moves) the full search decides. tau = WALK_SLACK (1 + ||x||^2 + size2) (size2: the largest squared
    codeword norm) dwarfs the float error of a slack and the tie window.

    It stays one function: a numba nopython kernel whose block loop carries the walk's state (the current
    codeword, its distance, the best two float64 distances once near a face, the move count) from the guess
    through the face scans to the fallback; helpers would pass that state in and out by arguments, where one
    loop's locals let LLVM hold it in registers."""
    n_blocks = u.shape[1] // k
    x = np.empty(k, dtype=np.float64)
    dist = np.empty(cw_t.shape[1], dtype=np.float64)
    top = lut.shape[0] - 1
    flagged = 0
    for row in range(start, stop):
        for b in range(n_blocks):
            finite = True
            box = 0
            stride = 1
            norm2 = 0.0
            for j in range(k):
                v = np.float64(u[row, b * k + j])
                x[j] = v
                norm2 += v * v
                if not np.isfinite(v):
                    finite = False
                f = (v - origin) * scale
                box += lut[0 if not f > 0.0 else (top if f >= top else int(f))] * stride
                stride *= cells
            state = 0  # 0: full search, 1: inside a certified cell, 2: near a face (distances decide)
            cur = np.int64(guess[box, 0])
            if finite:
                tau = WALK_SLACK * (1.0 + norm2 + size2)
                g_cur = table[cur, k]
                for j in range(k):
                    g_cur -= x[j] * table[cur, j]
                for a in range(1, guess.shape[1]):  # start at the nearest candidate
                    alt = np.int64(guess[box, a])
                    g_alt = table[alt, k]
                    for j in range(k):
                        g_alt -= x[j] * table[alt, j]
                    if g_alt < g_cur:
                        cur = alt
                        g_cur = g_alt
                for _ in range(WALK_STEPS):
                    r2 = 0.0
                    for j in range(k):
                        t = x[j] - table[cur, j]
                        r2 += t * t
                    r = np.sqrt(r2)
                    low = np.inf
                    arg = -1
                    t0 = offsets[cur]
                    t1 = offsets[cur + 1]
                    while t0 < t1:  # WALK_CHUNK entries at a time (lists are padded), no branch inside
                        reach_t = np.float64(reach[t0 // WALK_CHUNK])
                        if reach_t > r and 2.0 * reach_t * (reach_t - r) > tau:
                            break  # this face and all later ones are too far to be crossed
                        for t in range(t0, t0 + WALK_CHUNK):
                            w = nbr[t]
                            g = table[w, k]
                            for j in range(k):
                                g -= x[j] * table[w, j]
                            better = g < low
                            low = g if better else low
                            arg = w if better else arg
                        t0 += WALK_CHUNK
                    slack = low - g_cur
                    if slack > tau:
                        state = 1 if certified[cur] else 0
                        break
                    if slack >= -tau:
                        state = 2 if certified[cur] else 0
                        break
                    cur = np.int64(arg)
                    g_cur = low
                    if cur >= n_real:  # a dummy: far outside the codebook
                        break
            if state == 1:
                index[row, b] = cur
                continue
            d1, i1, d2 = np.inf, -1, np.inf
            if state == 2:
                d1 = 0.0
                for j in range(k):
                    g = x[j] - table[cur, j]
                    d1 += g * g
                i1 = cur
                state = 0
                for _ in range(WALK_STEPS):
                    for t in range(offsets[cur], offsets[cur + 1]):
                        if t > offsets[cur] and nbr[t] == nbr[t - 1]:  # padding: a repeat of the list's last entry
                            continue
                        w = np.int64(nbr[t])
                        d = 0.0
                        for j in range(k):
                            g = x[j] - table[w, j]
                            d += g * g
                        d1, i1, d2 = _consider(d1, i1, d2, d, w)
                    if i1 == cur:  # no neighbour nearer: a local minimum of the walk
                        state = 2 if cur < n_real and certified[cur] else 0
                        break
                    cur = i1
            if state == 0:
                d1, i1, d2 = _brute_block(x, cw_t, dist)
            flagged += _finish(d1, i1, d2, x, index, flags, row, b)
        if bits > 0:
            _pack_row(index, row, bits, codes, head)
    return flagged


def _cluster_py(u, k, centres_t, csq32, sep, rho, offsets, flat32, sq32, pts_t, ids, cw_t, cmax, index, flags, codes, head, bits,
                start, stop):
    """Exact search over codewords grouped in clusters (`numba_search.build_clusters`: G centres, each
    codeword in the cluster of its nearest centre; codewords in cluster order, so a cluster is a
    slice [offsets[g], offsets[g + 1]) of the tables): float32 squared distances (`_scores`'s
    arithmetic) of the block x to the centres, then to the codewords of its nearest centre's cluster
    a, then of each other cluster g unless a lower bound on the distance from x to any of its
    codewords exceeds the best distance so far (both sides widened by the float32 error bound):
    ||x - mu_g|| - rho_g (rho_g: the cluster's radius) and the distance from x to the half-space
    {z : ||z - mu_g|| <= ||z - mu_a||}, which holds every codeword of cluster g, (||x - mu_g||^2 -
    ||x - mu_a||^2) / (2 ||mu_g - mu_a||) (sep[a, g]; 0 where the centres are too close for it).
    The scanned codewords whose score lies within twice the error bound of the lowest are decided in
    float64 (`_finish`'s tie flag); a skipped cluster holds none of them.

    It stays one function: a numba nopython kernel whose block loop carries the lowest score, the error bound,
    the nearest centre and the clusters visited from the centre scan through every cluster's test and scan to
    the float64 decision; helpers would pass that state in and out by arguments, where one loop's locals let LLVM
    hold it in registers."""
    n_blocks = u.shape[1] // k
    n_clusters = centres_t.shape[1]
    n = cw_t.shape[1]
    x = np.empty(k, dtype=np.float64)
    xs = np.empty(k, dtype=np.float32)
    dist = np.empty(n, dtype=np.float64)
    dc = np.empty(n_clusters, dtype=np.float32)
    scores = np.empty(n, dtype=np.float32)
    visited = np.empty(n_clusters, dtype=np.int64)
    lowest = np.empty(n_clusters, dtype=np.float32)
    csize = 0.0
    for g in range(n_clusters):
        w = 0.0
        for j in range(k):
            w += np.float64(centres_t[j, g]) ** 2
        csize = max(csize, np.sqrt(w))
    reach = max(cmax, csize)
    flagged = 0
    for row in range(start, stop):
        for b in range(n_blocks):
            norm2 = 0.0
            finite = True
            for j in range(k):
                xs[j] = u[row, b * k + j]
                x[j] = xs[j]
                norm2 += x[j] * x[j]
                if not np.isfinite(x[j]):
                    finite = False
            if not finite:
                d1, i1, d2 = _brute_block(x, cw_t, dist)
                flagged += _finish(d1, i1, d2, x, index, flags, row, b)
                continue
            # |float32 squared distance error| <= (k + 4) eps32 (||c|| + ||x||)^2 (see `_scan_py`).
            err = (k + 4) * 2.0 ** -24 * (reach + np.sqrt(norm2)) ** 2 + 1e-30
            xx = np.float32(norm2)
            _scores(xs, xx, centres_t, csq32, dc)
            a = 0
            for g in range(n_clusters):
                if dc[g] < dc[a]:
                    a = g
            # scores of cluster a first
            low = np.inf
            nv = 0
            for pass_ in range(2):
                for g in range(n_clusters):
                    if pass_ == 0 and g != a or pass_ == 1 and g == a:
                        continue
                    lo = offsets[g]
                    hi = offsets[g + 1]
                    if lo == hi:
                        continue
                    if pass_ == 1:
                        thr = np.sqrt(max(low, 0.0) + err) * (1.0 + CLUSTER_REL) + CLUSTER_ABS * (1.0 + norm2)
                        dg = np.float64(dc[g])
                        bound = np.sqrt(max(dg - err, 0.0)) - rho[g]
                        s = sep[a, g]
                        if s > 0.0:
                            bound = max(bound, (dg - np.float64(dc[a]) - 2.0 * err) / (2.0 * s))
                        if bound > thr:
                            continue
                    m32 = _range_scores(xs, xx, flat32, np.uint64(lo), np.uint64(hi - lo), sq32, scores)
                    low = min(low, np.float64(m32))
                    visited[nv] = g
                    lowest[nv] = m32
                    nv += 1
            limit = low + 2.0 * err + 1e-9
            d1, i1, d2 = np.inf, -1, np.inf
            for q in range(nv):
                if np.float64(lowest[q]) > limit:  # no codeword of this cluster passes the screen
                    continue
                g = visited[q]
                for c in range(offsets[g], offsets[g + 1]):
                    if scores[c] <= limit:
                        d = 0.0
                        for j in range(k):
                            t = x[j] - pts_t[j, c]
                            d += t * t
                        d1, i1, d2 = _consider(d1, i1, d2, d, ids[c])
            flagged += _finish(d1, i1, d2, x, index, flags, row, b)
        if bits > 0:
            _pack_row(index, row, bits, codes, head)
    return flagged


def _settle_py(x, cw_t, screened, limit, index, flags, row, block):
    """Decide block `block` of `row` from a float32 screen: the one codeword with screened value <= limit,
    else the float64 nearest of those that pass (near ties flagged by `_finish`); returns the flags added."""
    count, position = _count_below(screened, limit)
    if count == 1:  # one codeword passes the screen: the nearest, and no near tie
        index[row, block] = position
        return 0
    d1, i1, d2 = np.inf, -1, np.inf
    for c in range(cw_t.shape[1]):
        if screened[c] <= limit:
            d = 0.0
            for j in range(x.shape[0]):
                g = x[j] - cw_t[j, c]
                d += g * g
            d1, i1, d2 = _consider(d1, i1, d2, d, c)
    return _finish(d1, i1, d2, x, index, flags, row, block)


def _screen_py(xs, cw32_t, dist32):
    """float32 squared distances of xs [k] to all codewords into dist32 [N]; returns their minimum.
    Compiled with fastmath (any summation order, fused multiply-adds): the caller's slack covers
    that, and its inputs are finite."""
    k, n = cw32_t.shape
    for c in range(n):
        t = xs[0] - cw32_t[0, c]
        dist32[c] = t * t
    for j in range(1, k):
        v = xs[j]
        for c in range(n):
            t = v - cw32_t[j, c]
            dist32[c] += t * t
    return _min(dist32)


def _brute_py(u, k, cw32_t, cw_t, index, flags, codes, head, bits, start, stop):
    n_blocks = u.shape[1] // k
    n = cw_t.shape[1]
    x = np.empty(k, dtype=np.float64)
    xs = np.empty(k, dtype=np.float32)
    dist32 = np.empty(n, dtype=np.float32)
    dist = np.empty(n, dtype=np.float64)
    slack = np.float32(1.0 + (2 * k + SCREEN_ULPS) * 2.0 ** -23)
    flagged = 0
    for row in range(start, stop):
        for b in range(n_blocks):
            finite = True
            for j in range(k):
                xs[j] = u[row, b * k + j]
                x[j] = xs[j]
                if not np.isfinite(xs[j]):
                    finite = False
            if not finite:
                d1, i1, d2 = _brute_block(x, cw_t, dist)
                flagged += _finish(d1, i1, d2, x, index, flags, row, b)
                continue
            # Every codeword whose float32 distance could round from within the tie window of the
            # best: its float64 distance decides (float32 sums of k squares err by < (2k+2) eps).
            limit = _screen(xs, cw32_t, dist32) * slack + np.float32(1e-30)
            flagged += _settle(x, cw_t, dist32, np.float64(limit), index, flags, row, b)
        if bits > 0:
            _pack_row(index, row, bits, codes, head)
    return flagged


def _min_py(values):
    """min of values [N] (fastmath: vectorised; the minimum of finite floats is exact in any order)."""
    low = values[0]
    for c in range(values.shape[0]):
        low = min(low, values[c])
    return low


def _count_below_py(values, limit):
    """(how many of values [N] are <= limit, the sum of their positions) (fastmath: vectorised);
    with one such value the sum is its position."""
    count = 0
    total = 0
    for c in range(values.shape[0]):
        if values[c] <= limit:
            count += 1
            total += c
    return count, total


def _verify_py(u, k, scores, row0, cw_t, cmax, index, flags, codes, head, bits, start, stop):
    """Rows [start, stop) from float32 scores ||c||^2 - 2 x.c (a BLAS matmul; row (row - row0) *
    n_blocks + b is block b of u[row]): the codewords whose score lies within twice the float32
    error bound of the lowest are decided by float64 distances."""
    n_blocks = u.shape[1] // k
    x = np.empty(k, dtype=np.float64)
    dist = np.empty(cw_t.shape[1], dtype=np.float64)
    flagged = 0
    for row in range(start, stop):
        for b in range(n_blocks):
            r = (row - row0) * n_blocks + b
            norm2 = 0.0
            finite = True
            for j in range(k):
                x[j] = u[row, b * k + j]
                norm2 += x[j] * x[j]
                if not np.isfinite(x[j]):
                    finite = False
            if not finite:
                d1, i1, d2 = _brute_block(x, cw_t, dist)
                flagged += _finish(d1, i1, d2, x, index, flags, row, b)
                continue
            # |score error| <= (k + 2) eps32 (||c||^2 + 2 ||x|| ||c||) for any summation order.
            err = 2.0 * (k + 2) * 2.0 ** -24 * (cmax * cmax + 2.0 * np.sqrt(norm2) * cmax)
            limit = np.float64(_min(scores[r])) + 2.0 * err + 1e-9
            count, position = _count_below(scores[r], limit)
            if count == 1:  # one codeword passes the screen: the nearest, and no near tie
                index[row, b] = position
                continue
            d1, i1, d2 = np.inf, -1, np.inf
            for c in range(scores.shape[1]):
                if scores[r, c] <= limit:
                    d = 0.0
                    for j in range(k):
                        g = x[j] - cw_t[j, c]
                        d += g * g
                    d1, i1, d2 = _consider(d1, i1, d2, d, c)
            flagged += _finish(d1, i1, d2, x, index, flags, row, b)
        if bits > 0:
            _pack_row(index, row, bits, codes, head)
    return flagged


def _scores_py(xs, xx, cw32_t, sq32, scores):
    """float32 squared distances ||c||^2 - 2 x.c + ||x||^2 (xx = ||x||^2 in float32) of xs [k] to all
    codewords (cw32_t [k, N], sq32 [N]) into scores [N]. Compiled with fastmath (vectorised, fused
    multiply-adds): the caller's error bound holds for any summation order, its inputs are finite."""
    k, n = cw32_t.shape
    for c in range(n):
        scores[c] = sq32[c] + xx
    for j in range(k):
        m = np.float32(-2.0) * xs[j]
        for c in range(n):
            scores[c] += m * cw32_t[j, c]


def _range_scores_py(xs, xx, flat32, lo, size, sq32, scores):
    """`_scores` over the codewords lo .. lo + size - 1 of one cluster of a cluster-ordered table:
    flat32 holds each cluster's coordinates axis-major (axis j of codeword lo + c at k lo + j size +
    c); writes scores[lo:lo + size], returns their minimum (fastmath, as `_scores`; unsigned indices,
    so that no negative-index wraparound keeps the loops from vectorising)."""
    low = np.float32(np.inf)
    k = np.uint64(xs.shape[0])
    for c in range(size):
        scores[lo + c] = sq32[lo + c] + xx
    for j in range(k):
        m = np.float32(-2.0) * xs[j]
        base = k * lo + j * size
        for c in range(size):
            scores[lo + c] += m * flat32[base + c]
    for c in range(size):
        low = min(low, scores[lo + c])
    return low


def _bits_min_py(bits):
    """The smallest of int32 values [N] (fastmath: vectorised)."""
    low = bits[0]
    for c in range(bits.shape[0]):
        v = bits[c]
        low = v if v < low else low
    return low


def _scan_py(u, k, cw32_t, sq32, cw_t, cmax, index, flags, codes, head, bits, start, stop):
    """The full scan fused in one kernel: per block the float32 squared distances (`_scores`, no score
    matrix in memory), then `_verify_py`'s decision: the codewords whose score lies within twice the
    float32 error bound of the lowest are decided by float64 distances."""
    n_blocks = u.shape[1] // k
    n = cw_t.shape[1]
    x = np.empty(k, dtype=np.float64)
    xs = np.empty(k, dtype=np.float32)
    scores = np.empty(n, dtype=np.float32)
    score_bits = scores.view(np.int32)
    one = np.empty(1, dtype=np.float32)
    one_bits = one.view(np.int32)
    dist = np.empty(n, dtype=np.float64)
    flagged = 0
    for row in range(start, stop):
        for b in range(n_blocks):
            norm2 = 0.0
            finite = True
            for j in range(k):
                xs[j] = u[row, b * k + j]
                x[j] = xs[j]
                norm2 += x[j] * x[j]
                if not np.isfinite(x[j]):
                    finite = False
            if not finite:
                d1, i1, d2 = _brute_block(x, cw_t, dist)
                flagged += _finish(d1, i1, d2, x, index, flags, row, b)
                continue
            _scores(xs, np.float32(norm2), cw32_t, sq32, scores)
            # The smallest score by its bit pattern (ordered like the value for scores >= 0; a
            # rounded negative score sorts wrongly, but `low` is always one of the scores, so
            # low >= the true minimum and limit below still admits every near-best codeword).
            one_bits[0] = _bits_min(score_bits)
            low = one[0]
            # |score error| <= (k + 4) eps32 (||c|| + ||x||)^2 for any summation order (k + 2 terms,
            # the rounding of ||c||^2 and ||x||^2 included); twice that here.
            err = 2.0 * (k + 4) * 2.0 ** -24 * (cmax + np.sqrt(norm2)) ** 2
            limit = np.float64(low) + 2.0 * err + 1e-9
            flagged += _settle(x, cw_t, scores, np.float64(limit), index, flags, row, b)
        if bits > 0:
            _pack_row(index, row, bits, codes, head)
    return flagged


def _pack_row_py(index, row, bits, codes, head):
    """Bit-pack index[row] (`bits` each, little-endian stream, = `pack_bits`) into codes[row, head:]."""
    if bits == 8:  # one byte per index: the stream is the indices themselves
        for b in range(index.shape[1]):
            codes[row, head + b] = np.uint8(index[row, b])
        return
    if bits == 4:  # two per byte, the first in the low nibble (a lone last index: its byte's low nibble)
        half = index.shape[1] // 2
        for b in range(half):
            codes[row, head + b] = np.uint8(index[row, 2 * b] | (index[row, 2 * b + 1] << 4))
        if index.shape[1] % 2:
            codes[row, head + half] = np.uint8(index[row, 2 * half])
        return
    acc = np.uint64(0)
    filled = 0
    pos = head
    for b in range(index.shape[1]):
        acc |= np.uint64(index[row, b]) << np.uint64(filled)
        filled += bits
        while filled >= 8:
            codes[row, pos] = np.uint8(acc & np.uint64(255))
            acc >>= np.uint64(8)
            filled -= 8
            pos += 1
    if filled > 0:
        codes[row, pos] = np.uint8(acc & np.uint64(255))


def _pack_py(index, bits, codes, head, rows):
    """_pack_row for each row in rows."""
    for row in rows:
        _pack_row(index, row, bits, codes, head)
    return 0


def compile_kernels():
    """{"scalar", "grid", "tree", "walk", "brute", "verify", "pack"} numba dispatchers, compiled (or loaded from numba's
    cache) on first call; `numba_search._kernels` calls it once, under a lock."""
    global np, _consider, _finish, _brute_block, _screen, _pack_row, _min, _count_below, _scores, _bits_min
    global _settle, _range_scores, _cell, _far_block, _row_cells, _scan4, _count_bits_below, _heavy4
    import numpy

    from .._numba import njit_cached

    np = numpy
    jit = dict(nogil=True)
    _consider = njit_cached("Tuple((float64, int64, float64))(float64, int64, float64, float64, int64)",
                            inline="always", **jit)(_consider_py)
    _finish = njit_cached("int64(float64, int64, float64, float64[::1], int64[:, ::1], int8[:, ::1], "
                          "int64, int64)", inline="always", **jit)(_finish_py)
    _cell = njit_cached("int64(float32, float32[::1], float64, float64, int64)", inline="always", **jit)(_cell_py)
    _brute_block = njit_cached("Tuple((float64, int64, float64))(float64[::1], float64[:, ::1], float64[::1])",
                               **jit)(_brute_block_py)
    _min = njit_cached("float32(float32[::1])", fastmath=True, **jit)(_min_py)
    _count_below = njit_cached("Tuple((int64, int64))(float32[::1], float64)", fastmath=True, **jit)(_count_below_py)
    _settle = njit_cached("int64(float64[::1], float64[:, ::1], float32[::1], float64, int64[:, ::1], int8[:, ::1], "
                          "int64, int64)", **jit)(_settle_py)
    _screen = njit_cached("float32(float32[::1], float32[:, ::1], float32[::1])", fastmath=True,
                          **jit)(_screen_py)
    _scores = njit_cached("void(float32[::1], float32, float32[:, ::1], float32[::1], float32[::1])", fastmath=True,
                          **jit)(_scores_py)
    _range_scores = njit_cached("float32(float32[::1], float32, float32[::1], uint64, uint64, float32[::1], float32[::1])",
                                fastmath=True, **jit)(_range_scores_py)
    _bits_min = njit_cached("int32(int32[::1])", fastmath=True, **jit)(_bits_min_py)
    _pack_row = njit_cached("void(int64[:, ::1], int64, int64, uint8[:, ::1], int64)", **jit)(_pack_row_py)
    _far_block = njit_cached("int64(float64, float64, float64, float64, int64, float64[:, ::1], float32[:, ::1], "
                             "float64[::1], float32[::1], float64[::1], float32[::1], int64[:, ::1], int8[:, ::1], "
                             "int64, int64)", **jit)(_far_block_py)
    _row_cells = njit_cached("void(float32[:, ::1], int64, float32[::1], int32[::1])", fastmath=True,
                             **jit)(_row_cells_py)
    _scan4 = njit_cached("void(float32, float32, float32, float32, float32[::1], float32[::1])", fastmath=True,
                         **jit)(_scan4_py)
    _count_bits_below = njit_cached("Tuple((int64, int64))(int32[::1], int32)", fastmath=True,
                                    **jit)(_count_bits_below_py)
    _heavy4 = njit_cached("int64(float32, float32, float32, float32, float32[::1], float64[:, ::1], int64, float32[::1], "
                          "float32[::1], int64[:, ::1], int8[:, ::1], int64, int64)", **jit)(_heavy4_py)
    u = "float32[:, ::1]"
    out = "int64[:, ::1], int8[:, ::1], uint8[:, ::1], int64, int64, int64, int64"
    return {
        "grid": njit_cached(f"int64({u}, int64, float32[::1], int64, int64[::1], int32[::1], boolean[::1], "
                            f"float64[:, ::1], float64[:, ::1], {out})", **jit)(_grid_py),
        "grid2": njit_cached(f"int64({u}, int64, float32[::1], int64, int16[:, ::1], int16[::1], float64, float64, "
                             f"int64, float64, float64, int64, boolean[::1], "
                             f"float64[:, ::1], float64[:, ::1], float32[:, ::1], {out})", **jit)(_grid2_py),
        "grid4": njit_cached(f"int64({u}, int64, float32[::1], int64, int64[::1], int32[::1], boolean[::1], "
                             f"float64[:, ::1], float64[:, ::1], float32[:, ::1], float32[::1], {out})", **jit)(_grid4_py),
        "tree": njit_cached(f"int64({u}, int64, float64[:, ::1], float64[:, ::1], int64[:, ::1], "
                            f"int64[:, ::1], float64[:, ::1], int64[::1], float64[:, ::1], {out})",
                            **jit)(_tree_py),
        "scalar": njit_cached(f"int64({u}, int64, float64[::1], int64[::1], float64[:, ::1], {out})",
                              **jit)(_scalar_py),
        "scalar_rows": njit_cached(f"int64({u}, int64, float32[::1], float32[::1], float32[::1], int64[::1], {out})",
                                   **jit)(_scalar_rows_py),
        "walk": njit_cached(f"int64({u}, int64, float64, float64, int64[::1], int64, int16[:, ::1], int64[::1], "
                            f"int16[::1], "
                            f"float32[::1], float64[:, ::1], int64, boolean[::1], float64, float64[:, ::1], {out})",
                            **jit)(_walk_py),
        "cluster": njit_cached(f"int64({u}, int64, float32[:, ::1], float32[::1], float64[:, ::1], float64[::1], "
                               f"int64[::1], float32[::1], float32[::1], float64[:, ::1], int64[::1], float64[:, ::1], float64, {out})",
                               **jit)(_cluster_py),
        "brute": njit_cached(f"int64({u}, int64, float32[:, ::1], float64[:, ::1], {out})", **jit)(_brute_py),
        "scan": njit_cached(f"int64({u}, int64, float32[:, ::1], float32[::1], float64[:, ::1], float64, {out})",
                            **jit)(_scan_py),
        "verify": njit_cached(f"int64({u}, int64, float32[:, ::1], int64, float64[:, ::1], float64, {out})",
                              **jit)(_verify_py),
        "pack": njit_cached("int64(int64[:, ::1], int64, uint8[:, ::1], int64, int64[::1])", **jit)(_pack_py),
    }
