"""Suffix search over the archive's geometry.

A match of query q (length l, oldest symbol first) is a position i with
stream[i-l+1 : i+1] == q, i.e. the point p_i lies in the cell of suffix q.

`SuffixKeyIndex` (exact variant): the 1-D exact map at depth D gives every position the
integer key_i = sum_{j<D} c_{i-j} N^(D-1-j) (latest symbol most significant, D = the most
symbols a uint64 holds). The cell of a suffix of length l <= D is the key interval
[Q, Q + N^(D-l)), found with two binary searches in the sorted keys. A longer query is cut
into chunks of D symbols from its end; chunk c is a constraint key_{i-cD} // N^(D-w_c) == its
value. Candidates come from the rarest chunk's cell (all cells sized with one vectorised
binary search), then every constraint is checked on all candidates at once, by integer
comparison, without decoding symbols (`match`). The same primitive finds strided patterns,
e.g. a sequence of fixed-size code rows `stride` rows apart (`CodeArchive.find`).

`PointIndex` (float variant): the 2-D points of the last `depth` symbols in a k-d tree;
the cell of a suffix s is inside the disc of radius r^|s| around its centre, so a ball
query has recall 1 and its candidates are verified against the symbols.

Both have `length` (positions indexed), `search(query)` and `search_many(queries)`, and are
built by the payload coder of their variant (`PayloadCoder.search_index`).
`brute_force_search` is the specification both are tested against.
"""
from __future__ import annotations

from bisect import bisect_left

import numpy as np
from scipy.spatial import cKDTree

from .search_numba import kernels


def brute_force_search(symbols: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Every end position i with symbols[i-l+1 : i+1] == query (reference, O(n l))."""
    n, l = symbols.shape[0], query.shape[0]
    if l == 0 or l > n:
        return np.arange(n, dtype=np.int64) if l == 0 else np.empty(0, dtype=np.int64)
    hit = np.ones(n - l + 1, dtype=bool)
    for j in range(l):
        hit &= symbols[j:n - l + 1 + j] == query[j]
    return np.flatnonzero(hit).astype(np.int64) + (l - 1)


def key_depth(alphabet_size: int) -> int:
    depth = 1
    while alphabet_size ** (depth + 1) <= 1 << 64:
        depth += 1
    return depth


class SuffixKeyIndex:
    """Sorted depth-D suffix keys of a symbol stream (int64 [n]); 24 bytes per position."""

    def __init__(self, symbols: np.ndarray, alphabet_size: int):
        self.alphabet_size = alphabet_size
        self.length = n = symbols.shape[0]
        self.depth = depth = key_depth(alphabet_size)
        padded = np.concatenate([np.zeros(depth - 1, dtype=np.uint64), symbols.astype(np.uint64)])
        keys = np.zeros(n, dtype=np.uint64)
        base = np.uint64(alphabet_size)
        for j in range(depth):  # Horner, latest symbol first so it ends most significant
            keys *= base
            keys += padded[depth - 1 - j:depth - 1 - j + n]
        self.keys = keys
        # Positions in key order, ties by position (stable): one key's hits come out sorted.
        self.order = np.argsort(keys, kind="stable")
        self.sorted_keys = keys[self.order]
        self._powers = [alphabet_size ** e for e in range(depth + 1)]
        # Slots (in key order) of the first depth-1 positions, whose keys are zero-padded:
        # a short query may land on them and they must be checked against the query length.
        self._early_slots = sorted(np.flatnonzero(self.order < depth - 1).tolist())

    def _prefix(self, chunk) -> int:
        """Key interval start of a suffix chunk (oldest first, len <= depth)."""
        key = 0
        for c in reversed(chunk):  # latest symbol most significant
            key = key * self.alphabet_size + int(c)
        return key * self._powers[self.depth - len(chunk)]

    def _cell(self, chunk) -> tuple[int, int]:
        """[lo, hi) slots of the sorted keys inside the cell of `chunk`."""
        width = self._powers[self.depth - len(chunk)]
        low = self._prefix(chunk)
        high = low + width
        if high >= 1 << 64:  # the last cell ends at the top of the key range
            return int(self.sorted_keys.searchsorted(np.uint64(low))), self.length
        lo, hi = self.sorted_keys.searchsorted(np.array((low, high), dtype=np.uint64)).tolist()
        return lo, hi

    def search(self, query) -> np.ndarray:
        """Sorted int64 end positions of every occurrence of `query` (validated ints, list or array)."""
        query = query if type(query) is list else list(query)
        l, depth = len(query), self.depth
        if l == 0:
            return np.arange(self.length, dtype=np.int64)
        if l <= depth:  # one cell of the sorted keys
            lo, hi = self._cell(query)
            hits = self.order[lo:hi]
            early = self._early_slots
            if l > 1 and early and bisect_left(early, lo) < bisect_left(early, hi):
                hits = hits[hits >= l - 1]  # positions whose history is shorter than the query
            if l < depth:
                return np.sort(hits) if hits.size > 1 else hits.copy()
            return hits.copy()  # one key: the stable sort left its positions ascending
        # A longer query: its chunks (the last D symbols, the D before, ...) are constraints
        # on keys at fixed distances back from the end; candidates come from the rarest chunk.
        deltas, widths = self._query_constraints(l)
        return self.match(deltas, widths, self.chunk_values(np.array(query, dtype=np.int64)[None])[0], first=l - 1)

    def _query_constraints(self, l: int) -> tuple[np.ndarray, np.ndarray]:
        """(distances from the end <= 0, widths) of the chunks of a query of length l, latest first."""
        depth = self.depth
        backs = np.arange(-(-l // depth), dtype=np.int64) * depth
        return -backs, np.minimum(depth, l - backs)

    def chunk_values(self, queries: np.ndarray) -> np.ndarray:
        """`chunk_values` of queries int [q, l] at this index's depth."""
        return chunk_values(queries, self.alphabet_size, self.depth)

    # ------------------------------------------------------------- constraints
    def _cells(self, values: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[lo, hi) slots of the sorted keys whose key // scale == value (any shape, vectorised)."""
        low = values * scales
        last = low + (scales - np.uint64(1))  # the cell's largest key (low + scale may be 2^64)
        return (np.searchsorted(self.sorted_keys, low, side="left"),
                np.searchsorted(self.sorted_keys, last, side="right"))

    def match(self, deltas, widths, values, first: int = 0) -> np.ndarray:
        """Sorted positions p >= first such that, for every constraint k,
        keys[p + deltas[k]] // N^(D - widths[k]) == values[k]: the w_k symbols ending at
        p + deltas[k] <= p are the chunk values[k] (latest symbol most significant).

        The caller keeps every chunk's symbols at positions >= 0 for p >= first. Candidates come
        from the constraint with the fewest keys in its cell (two binary searches per
        constraint, vectorised), then every constraint is checked on all candidates at once
        (integer comparisons, no symbol decoded)."""
        return self.match_many(deltas, widths, np.asarray(values, dtype=np.uint64)[None], first)[0]

    def match_many(self, deltas, widths, values, first: int = 0) -> list[np.ndarray]:
        """`match` for q patterns of one shape at once (values uint64 [q, K]): one sorted array each."""
        deltas = np.asarray(deltas, dtype=np.int64)
        widths = np.asarray(widths, dtype=np.int64)
        values = np.asarray(values, dtype=np.uint64)
        q = values.shape[0]
        if q == 0 or self.length == 0:
            return [np.empty(0, dtype=np.int64) for _ in range(q)]
        scales = np.array([self._powers[self.depth - w] for w in widths.tolist()], dtype=np.uint64)
        lo, hi = self._cells(values, scales[None, :])                    # [q, K]
        pick = np.argmin(hi - lo, axis=1)                               # the rarest constraint per pattern
        flat, owner = _gather_cells(self.order, lo[np.arange(q), pick], hi[np.arange(q), pick])
        flat -= deltas[pick][owner] if owner is not None else deltas[pick[0]]
        keep = flat >= first
        flat = flat[keep]
        owner = owner[keep] if owner is not None else None
        if flat.size:
            got = self.keys[flat[:, None] + deltas[None, :]]            # [c, K]
            if (widths != self.depth).any():
                got = got // scales[None, :]
            ok = (got == (values[0][None, :] if owner is None else values[owner])).all(axis=1)
            flat = flat[ok]
            owner = owner[ok] if owner is not None else None
        # A full-width pick is one key per cell: the stable sort kept its positions ascending.
        return split_by_owner(flat, owner, q, sort=not (widths[pick] == self.depth).all())

    def _chunk_keys(self, chunks: np.ndarray) -> np.ndarray:
        """Chunks int [q, w] (oldest first, w <= depth) -> their values, latest most significant."""
        weights = np.array(self._powers[:chunks.shape[1]], dtype=np.uint64)
        return (chunks.astype(np.uint64) * weights).sum(axis=1, dtype=np.uint64)

    def search_many(self, queries: np.ndarray) -> list[np.ndarray]:
        """Batched search of equal-length queries int [q, l]: every step vectorised over queries."""
        q, l = queries.shape
        depth = self.depth
        if l == 0:
            return [self.search([]) for _ in range(q)]
        if l > depth:  # chunk constraints, candidates from each query's rarest chunk
            deltas, widths = self._query_constraints(l)
            return self.match_many(deltas, widths, self.chunk_values(queries), first=l - 1)
        width = min(l, depth)
        scale = self._powers[depth - width]
        low = self._chunk_keys(queries[:, l - width:]) * np.uint64(scale)
        bounds = np.searchsorted(self.sorted_keys, low)
        ends = np.full(q, self.length, dtype=np.int64)
        fits = low <= np.uint64((1 << 64) - 1 - scale)  # cells that do not end at 2^64
        ends[fits] = np.searchsorted(self.sorted_keys, low[fits] + np.uint64(scale))
        counts = ends - bounds
        starts_out = np.cumsum(counts) - counts
        flat = self.order[np.arange(int(counts.sum())) + np.repeat(bounds - starts_out, counts)]
        owner = np.repeat(np.arange(q), counts)
        keep = flat >= l - 1  # positions whose history is shorter than the query
        flat, owner = flat[keep], owner[keep]
        if l < depth and flat.size:  # several keys per cell: sort positions per query
            flat = np.sort(owner * self.length + flat) - owner * self.length
        counts = np.bincount(owner, minlength=q)
        edges = np.concatenate([[0], np.cumsum(counts)]).tolist()
        return [flat[a:b] for a, b in zip(edges[:-1], edges[1:])]


def chunk_values(queries: np.ndarray, alphabet_size: int, depth: int) -> np.ndarray:
    """Symbol rows int [q, l] -> uint64 [q, ceil(l/D)]: the values of their chunks of D symbols
    cut from the end (latest chunk first; in each, the latest symbol most significant, the
    oldest chunk possibly shorter), i.e. key // N^(D - width) of a position ending the chunk."""
    q, l = queries.shape
    count = -(-l // depth)
    if q * l <= 1 << 12:  # a few rows (queries): one weighted sum, fewer numpy calls
        padded = np.zeros((q, count * depth), dtype=np.uint64)  # zeros before the oldest symbol
        padded[:, count * depth - l:] = queries
        weights = np.array([alphabet_size ** j for j in range(depth)], dtype=np.uint64)
        out = (padded.reshape(q, count, depth) * weights).sum(axis=2, dtype=np.uint64)[:, ::-1].copy()
        short = l - (count - 1) * depth
        if short != depth:  # the oldest chunk sat at the top of its padded slot
            out[:, -1] //= np.uint64(alphabet_size ** (depth - short))
        return out
    out = np.zeros((q, count), dtype=np.uint64)
    base = np.uint64(alphabet_size)
    for c in range(out.shape[1]):
        end = l - c * depth
        value = out[:, c]
        for j in range(end - 1, max(0, end - depth) - 1, -1):  # Horner from the latest symbol
            value *= base
            value += queries[:, j].astype(np.uint64)
    return out


def _gather_cells(order: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """order[lo[i]:hi[i]] of every pattern i, concatenated, and the pattern of each (None for one)."""
    if lo.shape[0] == 1:
        return order[int(lo[0]):int(hi[0])].copy(), None
    counts = hi - lo
    starts = np.cumsum(counts) - counts
    owner = np.repeat(np.arange(lo.shape[0]), counts)
    return order[np.arange(int(counts.sum())) + np.repeat(lo - starts, counts)], owner


def split_by_owner(flat: np.ndarray, owner: np.ndarray | None, q: int, sort: bool = False) -> list[np.ndarray]:
    """Positions grouped by owner (None: all of pattern 0), ascending within each group unless
    `sort` -> one sorted array per pattern."""
    if owner is None:
        return [np.sort(flat) if sort else flat]
    if sort and flat.size:
        order = np.lexsort((flat, owner))
        flat, owner = flat[order], owner[order]
    edges = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=q))]).tolist()
    return [flat[a:b] for a, b in zip(edges[:-1], edges[1:])]


class RowIndex:
    """Search index of a stream of fixed-size rows (`CodeArchive`: n_blocks index symbols per
    vector, plus its norm). Per row: the values of its chunks of D index symbols (what the
    suffix keys at the row's last symbol hold: `SuffixKeyIndex`, depth D) and an extra column
    (the norm), W columns in all; the rows sorted lexicographically by (last chunk, ...,
    norm), ties by row. 24 W + 16 bytes per row (table, its columns, the sorted table, order,
    sorted last chunks): 88 B for a 16-index FibQuant code, vs 384 B for the suffix index of
    its 16 symbols.

    `find` / `find_flat` answer sequences of n codes `stride` rows apart (one interleaved
    sub-stream, `offsets` = its phase): the candidates are the stored rows equal to the rarest
    query code (the one whose last chunk is rarest; numba narrows its last-chunk cell to the
    range of equal codes with lexicographic binary searches; numpy keeps the cell), then the
    other codes' rows are compared
    (integer equality: exact, recall 1 by construction)."""

    def __init__(self, symbols: np.ndarray, row_symbols: int, alphabet_size: int, extra: np.ndarray | None = None):
        if symbols.shape[0] % row_symbols:
            raise ValueError(f"{symbols.shape[0]} symbols are not whole rows of {row_symbols}")
        self.row_symbols, self.alphabet_size = row_symbols, alphabet_size
        self.depth = key_depth(alphabet_size)
        rows = symbols.reshape(-1, row_symbols)
        self.length = rows.shape[0]
        chunks = chunk_values(rows, alphabet_size, self.depth)
        self.table = chunks if extra is None else np.concatenate(
            [chunks, np.asarray(extra, dtype=np.uint64)[:self.length, None]], axis=1)
        self.table = np.ascontiguousarray(self.table)
        self.columns = [np.ascontiguousarray(self.table[:, w]) for w in range(self.table.shape[1])]
        # Rows sorted by (last chunk, earlier chunks..., norm), ties by row: equal codes are one
        # contiguous range, their rows ascending (np.lexsort is stable; its last key is primary).
        self.order = np.lexsort(self.columns[::-1]).astype(np.int64, copy=False)
        self.sorted_table = np.ascontiguousarray(self.table[self.order])
        self.sorted_keys = np.ascontiguousarray(self.sorted_table[:, 0])

    def values(self, rows: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
        """Query rows int [m, row_symbols] (and their extra column) -> table rows uint64 [m, W]."""
        chunks = chunk_values(rows, self.alphabet_size, self.depth)
        return chunks if extra is None else np.concatenate([chunks, np.asarray(extra, np.uint64)[:, None]], axis=1)

    def find(self, indices: np.ndarray | None, norms: np.ndarray | None, n: int, stride: int = 1, offsets=None,
             stop: int | None = None, use_numba: bool = True, codes: np.ndarray | None = None, norm_bytes: int = 0):
        """Queries of n rows each, as their index symbols int64 [q*n, row_symbols] and norms
        int64 [q*n] (None without), or (numba only) as byte codes uint8 [q*n, norm_bytes +
        row_symbols] of N = 256 -> `find_flat`'s (rows, owners). With numba (the default when it
        imports): one compiled pass over the batch (`search_numba`); else numpy."""
        compiled = kernels() if use_numba else None
        if compiled is None and indices is None:
            raise ValueError("byte codes need the numba path; pass indices and norms")
        q = (indices if indices is not None else codes).shape[0] // n
        offsets = np.zeros(q, dtype=np.int64) if offsets is None else offsets
        if compiled is None:
            return self.find_flat(self.values(indices, norms).reshape(q, n, -1), stride, offsets, stop)
        values_kernel, codes_kernel, find = compiled
        values = np.empty((q * n, self.table.shape[1]), dtype=np.uint64)
        if indices is None:
            codes_kernel(codes, norm_bytes, self.alphabet_size, self.depth, values)
        else:
            values_kernel(np.ascontiguousarray(indices, dtype=np.int64),
                          np.zeros(0, np.int64) if norms is None else np.ascontiguousarray(norms, dtype=np.int64),
                          norms is not None, self.alphabet_size, self.depth, values)
        last = (self.length if stop is None else min(stop, self.length)) - 1 - (n - 1) * stride
        if last < 0:
            return np.empty(0, dtype=np.int64), (None if q == 1 else np.empty(0, dtype=np.int64))
        rows, owner = find(self.sorted_keys, self.sorted_table, self.order, self.table, values.reshape(q, n, -1),
                           stride, offsets, last)
        return rows, (owner if q > 1 else None)

    def find_flat(self, values: np.ndarray, stride: int = 1, offsets=None, stop: int | None = None):
        """values uint64 [q, n, W] (`values` of each query's rows) -> (first rows r of every match,
        with r % stride == offsets[i] and r + (n-1) stride < stop; owning query of each or None
        for q = 1), sorted by (query, row)."""
        q, n, _ = values.shape
        stop = self.length if stop is None else min(stop, self.length)
        offsets = np.zeros(q, dtype=np.int64) if offsets is None else np.asarray(offsets, dtype=np.int64)
        last = stop - 1 - (n - 1) * stride
        if q == 0 or last < 0:
            return np.empty(0, dtype=np.int64), (None if q == 1 else np.empty(0, dtype=np.int64))
        lo = np.searchsorted(self.sorted_keys, values[:, :, 0], side="left")    # [q, n]
        hi = np.searchsorted(self.sorted_keys, values[:, :, 0], side="right")
        pick = np.argmin(hi - lo, axis=1)                                       # the rarest row per query
        rows = np.arange(q)
        flat, owner = _gather_cells(self.order, lo[rows, pick], hi[rows, pick])
        if owner is None:
            flat -= int(pick[0]) * stride
            keep = (flat >= 0) & (flat <= last)
            if stride > 1:
                keep &= flat % stride == int(offsets[0])
        else:
            flat -= pick[owner] * stride
            keep = (flat >= 0) & (flat <= last)
            if stride > 1:
                keep &= flat % stride == offsets[owner]
        flat = flat[keep]
        owner = owner[keep] if owner is not None else None
        width = values.shape[2]
        if not flat.size:
            return flat, owner
        if flat.size * n * width <= 1 << 14:  # few candidates: every row and column in one comparison
            got = self.table[flat[:, None] + np.arange(n, dtype=np.int64)[None, :] * stride].reshape(flat.size, -1)
            want = values.reshape(q, -1)
            ok = (got == (want[0] if owner is None else want[owner])).all(axis=1)
            flat, owner = flat[ok], (owner[ok] if owner is not None else None)
            return _sorted(flat, owner)
        for j in range(n):  # many candidates (a common code): column by column, shrinking as they fail
            for w in range(width):
                if owner is None and j == int(pick[0]) and w == 0:
                    continue  # the cell the candidates came from
                got = self.columns[w][flat + j * stride] if j else self.columns[w][flat]
                ok = got == (values[0, j, w] if owner is None else values[owner, j, w])
                flat = flat[ok]
                owner = owner[ok] if owner is not None else None
        return _sorted(flat, owner)


def _sorted(flat: np.ndarray, owner: np.ndarray | None):
    """(rows, owners) sorted by (owner, row): a last-chunk cell spans several codes, so its rows
    come out in code order."""
    if owner is None:
        return np.sort(flat), None
    order = np.lexsort((flat, owner))
    return flat[order], owner[order]


class PointIndex:
    """k-d tree over the 2-D suffix points of the float map (float64 or float32 coordinates)."""

    def __init__(self, coder, symbols: np.ndarray, dtype=np.float64):
        self.coder = coder
        self.symbols = symbols
        self.length = symbols.shape[0]
        self.depth = coder.segment
        points = coder.suffix_points(symbols, self.depth)
        self.points = points.astype(dtype)
        # Rounding the coordinates moves each point by at most half an ulp per coordinate.
        self.slack = 4 * float(np.finfo(dtype).eps)
        self.tree = cKDTree(self.points)

    def candidates(self, query: np.ndarray) -> np.ndarray:
        """Raw geometric filter: positions whose point is in the ball of the query cell."""
        tail = query[-self.depth:]
        centre = self.coder.cell_centre(tail)
        radius = self.coder.r ** len(tail) * (1 + 1e-9) + self.slack
        return np.asarray(self.tree.query_ball_point(centre, radius), dtype=np.int64)

    def search(self, query) -> np.ndarray:
        """Sorted end positions of `query`: ball candidates, then verified on the symbols."""
        query = np.asarray(query, dtype=np.int64)
        l = query.shape[0]
        if l == 0:
            return np.arange(self.symbols.shape[0], dtype=np.int64)
        hits = np.sort(self.candidates(query))
        hits = hits[hits >= l - 1]
        for j in range(l):  # verification against the symbols (also covers l > depth)
            if not hits.size:
                break
            hits = hits[self.symbols[hits - j] == query[l - 1 - j]]
        return hits

    def search_many(self, queries: np.ndarray) -> list[np.ndarray]:
        """One sorted array of end positions per query row (int [q, l])."""
        return [self.search(row) for row in queries]
