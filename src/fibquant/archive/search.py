"""Suffix search over the archive's geometry.

A match of query q (length l, oldest symbol first) is a position i with
stream[i-l+1 : i+1] == q, i.e. the point p_i lies in the cell of suffix q.

`SuffixKeyIndex` (exact variant): the 1-D exact map at depth D gives every position the
integer key_i = sum_{j<D} c_{i-j} N^(D-1-j) (latest symbol most significant, D = the most
symbols a uint64 holds). The cell of a suffix of length l <= D is the key interval
[Q, Q + N^(D-l)), found with two binary searches in the sorted keys. Longer queries chain:
the candidates of the last D symbols are checked against key_{i-D}, key_{i-2D}, ... of the
earlier chunks, all by integer comparison, without decoding symbols.

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
        lo, hi = self._cell(query[-depth:] if l > depth else query)
        hits = self.order[lo:hi]
        early = self._early_slots
        if l > depth or (l > 1 and early and bisect_left(early, lo) < bisect_left(early, hi)):
            hits = hits[hits >= l - 1]  # positions whose history is shorter than the query
        if l < depth:
            return np.sort(hits) if hits.size > 1 else hits.copy()
        end, shift = l - depth, depth  # one key: the stable sort left positions ascending
        if end > 0 and hits.size <= 32:  # few candidates: chain with Python ints
            checks = []  # (distance back, digit scale, expected key // scale) per earlier chunk
            e, back = end, depth
            while e > 0:
                start = max(0, e - depth)
                scale = self._powers[depth - (e - start)]
                checks.append((back, scale, self._prefix(query[start:e]) // scale))
                e, back = start, back + depth
            item = self.keys.item
            kept = []
            for pos in hits.tolist():
                for back, scale, want in checks:
                    if item(pos - back) // scale != want:
                        break
                else:
                    kept.append(pos)
            return np.array(kept, dtype=np.int64)
        while end > 0 and hits.size:  # chain: the earlier chunks by their keys
            start = max(0, end - depth)
            chunk = query[start:end]
            earlier = self.keys[hits - shift]
            if len(chunk) == depth:
                hits = hits[earlier == np.uint64(self._prefix(chunk))]
            else:
                scale = self._powers[depth - len(chunk)]
                hits = hits[earlier // np.uint64(scale) == np.uint64(self._prefix(chunk) // scale)]
            end, shift = start, shift + depth
        return hits if hits.base is None else hits.copy()

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
        end, back = l - depth, depth
        while end > 0:  # chain: the earlier chunks by their keys
            start = max(0, end - depth)
            chunk_scale = np.uint64(self._powers[depth - (end - start)])
            expected = self._chunk_keys(queries[:, start:end])
            earlier = self.keys[np.where(keep, flat - back, 0)]
            keep &= earlier // chunk_scale == expected[owner]
            end, back = start, back + depth
        flat, owner = flat[keep], owner[keep]
        if l < depth and flat.size:  # several keys per cell: sort positions per query
            flat = np.sort(owner * self.length + flat) - owner * self.length
        counts = np.bincount(owner, minlength=q)
        edges = np.concatenate([[0], np.cumsum(counts)]).tolist()
        return [flat[a:b] for a, b in zip(edges[:-1], edges[1:])]


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
