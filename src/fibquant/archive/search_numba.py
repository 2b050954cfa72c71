"""numba kernels of the row search (`search.RowIndex.find_flat`): one compiled pass per batch of
queries instead of ~20 numpy calls, so a single query costs a few microseconds plus its hits.

The kernels are plain Python functions compiled by `kernels()` on first use (numba's cache keeps
them across processes); `search.RowIndex` falls back to its numpy path when numba does not import.

    _values(indices, norms, has_norms, N, depth, out)     query rows -> table rows (chunk values, norm)
    _values_of_codes(codes, norm_bytes, N, depth, out)    the same from N = 256 codes (bytes)
    _find(sorted_keys, sorted_table, order, table, values, stride, offsets, last) -> (rows, owners)
        _plan: per query, the query code with the rarest last chunk, narrowed to the range of
        equal stored codes (lexicographic binary search); _scan: its rows checked on the other
        codes' columns
"""
from __future__ import annotations

import threading

np = None  # numpy, bound by kernels() (the jitted functions see it as a global)
_KERNELS = None
_LOCK = threading.Lock()


def _values_py(indices, norms, has_norms, alphabet, depth, out):
    """indices int64 [m, l] (and norms int64 [m]) -> out uint64 [m, W]: chunk values of D symbols
    cut from each row's end (latest chunk first, latest symbol most significant), then the norm."""
    m, l = indices.shape
    chunks = (l + depth - 1) // depth
    base = np.uint64(alphabet)
    for r in range(m):
        for c in range(chunks):
            end = l - c * depth
            start = max(0, end - depth)
            value = np.uint64(0)
            for j in range(end - 1, start - 1, -1):
                value = value * base + np.uint64(indices[r, j])
            out[r, c] = value
        if has_norms:
            out[r, chunks] = np.uint64(norms[r])
    return 0


def _bound_py(sorted_table, value, upper, lo, hi):
    """First row in [lo, hi) of the lexicographically sorted table that is > value (upper) or
    >= value (else hi)."""
    width = sorted_table.shape[1]
    while lo < hi:
        mid = (lo + hi) >> 1
        order = 0
        for w in range(width):
            a, b = sorted_table[mid, w], value[w]
            if a != b:
                order = -1 if a < b else 1
                break
        if order < 0 or (upper and order == 0):
            lo = mid + 1
        else:
            hi = mid
    return lo


def _plan_py(sorted_keys, sorted_table, values, lo, hi, pick):
    """Per query i: the query row j whose last chunk is rarest (two binary searches in the
    contiguous sorted last chunks per row), narrowed to the rows whose whole code equals it
    (lexicographic binary searches inside that cell) -> lo[i], hi[i], pick[i]; returns the
    total number of candidates."""
    q, n = values.shape[0], values.shape[1]
    total = 0
    for i in range(q):
        best = -1
        for j in range(n):
            a = np.searchsorted(sorted_keys, values[i, j, 0], side="left")
            b = np.searchsorted(sorted_keys, values[i, j, 0], side="right")
            if best < 0 or b - a < best:
                best = b - a
                lo[i], hi[i], pick[i] = a, b, j
        a = _bound(sorted_table, values[i, pick[i]], False, lo[i], hi[i])
        hi[i] = _bound(sorted_table, values[i, pick[i]], True, a, hi[i])
        lo[i] = a
        total += hi[i] - lo[i]
    return total


def _scan_py(order, table, values, stride, offsets, last, lo, hi, pick, out, owner):
    """Candidates of each query's planned cell -> first rows s of the matches (s % stride ==
    offsets[i], 0 <= s <= last, rows s + j*stride equal values[i, j] in every column), in order."""
    q, n, width = values.shape
    count = 0
    for i in range(q):
        shift = pick[i] * stride
        for t in range(lo[i], hi[i]):  # rows whose code equals query row pick[i], ascending
            s = order[t] - shift
            if s < 0 or s > last or s % stride != offsets[i]:
                continue
            ok = True
            for j in range(n):
                if j == pick[i]:
                    continue
                r = s + j * stride
                for w in range(width):
                    if table[r, w] != values[i, j, w]:
                        ok = False
                        break
                if not ok:
                    break
            if ok:
                out[count] = s
                owner[count] = i
                count += 1
    return count


def _values_of_codes_py(codes, norm_bytes, alphabet, depth, out):
    """Codes uint8 [m, norm_bytes + l] whose indices are bytes (N = 256) and whose norm is 0 or
    2 little-endian bytes -> out uint64 [m, W] as `_values` (no unpacking in Python)."""
    m = codes.shape[0]
    l = codes.shape[1] - norm_bytes
    chunks = (l + depth - 1) // depth
    base = np.uint64(alphabet)
    for r in range(m):
        for c in range(chunks):
            end = l - c * depth
            start = max(0, end - depth)
            value = np.uint64(0)
            for j in range(end - 1, start - 1, -1):
                value = value * base + np.uint64(codes[r, norm_bytes + j])
            out[r, c] = value
        if norm_bytes:
            out[r, chunks] = np.uint64(codes[r, 0]) | (np.uint64(codes[r, 1]) << np.uint64(8))
    return 0


def _find_py(sorted_keys, sorted_table, order, table, values, stride, offsets, last):
    """`_plan` then `_scan` into arrays sized by the plan -> (first rows, owning queries)."""
    q = values.shape[0]
    lo = np.empty(q, dtype=np.int64)
    hi = np.empty(q, dtype=np.int64)
    pick = np.empty(q, dtype=np.int64)
    total = _plan(sorted_keys, sorted_table, values, lo, hi, pick)
    out = np.empty(total, dtype=np.int64)
    owner = np.empty(total, dtype=np.int64)
    count = _scan(order, table, values, stride, offsets, last, lo, hi, pick, out, owner)
    return out[:count], owner[:count]


_bound = _plan = _scan = None  # jitted by kernels(), called by the jitted functions


def kernels():
    """(values, values_of_codes, find) numba dispatchers, compiled (or loaded from numba's cache)
    once; None when numba does not import."""
    global np, _KERNELS, _bound, _plan, _scan
    if _KERNELS is not None:
        return _KERNELS or None
    with _LOCK:
        if _KERNELS is None:
            from .._numba import njit_cached, numba_available

            if not numba_available():
                _KERNELS = ()
                return None
            import numpy

            np = numpy
            jit = dict(nogil=True)
            _bound = njit_cached("int64(uint64[:, ::1], uint64[::1], boolean, int64, int64)", **jit)(_bound_py)
            _plan = njit_cached("int64(uint64[::1], uint64[:, ::1], uint64[:, :, ::1], int64[::1], int64[::1], "
                                "int64[::1])", **jit)(_plan_py)
            _scan = njit_cached("int64(int64[::1], uint64[:, ::1], uint64[:, :, ::1], int64, int64[::1], int64, "
                                "int64[::1], int64[::1], int64[::1], int64[::1], int64[::1])", **jit)(_scan_py)
            _KERNELS = (
                njit_cached("int64(int64[:, ::1], int64[::1], boolean, int64, int64, uint64[:, ::1])",
                            **jit)(_values_py),
                njit_cached("int64(uint8[:, ::1], int64, int64, int64, uint64[:, ::1])", **jit)(_values_of_codes_py),
                njit_cached("Tuple((int64[::1], int64[::1]))(uint64[::1], uint64[:, ::1], int64[::1], "
                            "uint64[:, ::1], "
                            "uint64[:, :, ::1], int64, int64[::1], int64)", **jit)(_find_py),
            )
    return _KERNELS or None
