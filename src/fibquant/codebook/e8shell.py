"""E8 shell codes in 8 dimensions: levels, leaders, the index (numbering and unrank) and the reference search.

A shell code is a list of levels (m_g, r_g): level g holds the E8 shell of squared norm 2 m_g (240 sigma_3(m)
points; m = 0: the origin) rescaled to radius r_g. E8 = D8 u (D8 + 1/2); its shell 2m is the union of a
few orbits of "leader" vectors (non-negative, non-increasing) under coordinate permutations and sign
changes: every sign change of the non-zero coordinates for the integer leaders, an even or odd number of
minus signs (the leader's parity) for the half-integer ones.

Numbering (what a code stores, 0 <= index < count): levels in ascending radius (the order given, which
`ShellLevels` checks), each level's points after the earlier levels' (`offsets`); inside a level its
leaders in `shell_leaders` order (integer leaders, then half-integer ones), each leader's orbit after the
earlier leaders' (`orbit_off`); inside an orbit index = rank * n_signs + sign, rank the multiset-permutation
rank of the point's absolute values (lexicographic, larger leader values first: rank 0 = the leader itself)
and sign the sign bits (integer leaders: one bit per non-zero coordinate in position order, 1 = minus; half
leaders: bits of positions 0..6, the 8th sign fixed by the parity).

The reference search (`exhaustive_search`) is the spec of every encoder: over the materialised codebook
(`codebook_points`, small level sets only), the lowest index among the points whose squared distance is
within TIE of the smallest. The encoders (the leader scan and the lattice search) live in `e8shell_search`,
the decode tables attention on codes reads in `e8shell_tables`.
"""
from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .._numba import numba_available, run_split

BLOCK = 8               # the code's block length (E8 is 8-dimensional)
TIE = 1e-10             # squared distances within TIE of the smallest are ties (lowest index wins)
_MIN_BLOCKS_PER_THREAD = 4096
_KERNELS = None
_LOCK = threading.Lock()


# --------------------------------------------------------------------------- E8 shells
def sigma3(m: int) -> int:
    return sum(d ** 3 for d in range(1, m + 1) if m % d == 0)


def shell_size(m: int) -> int:
    """Points of E8 with squared norm 2m (240 sigma_3(m)); 1 (the origin) for m = 0."""
    return 1 if m == 0 else 240 * sigma3(m)


@lru_cache(maxsize=None)
def shell_leaders(m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Leaders of E8's shell 2m (m >= 1): (integer leaders [Li, 8], half-integer leaders [Lh, 8], their
    parities [Lh]), each leader non-negative and non-increasing, in descending lexicographic order. A
    half-integer point is in E8 iff its number of minus signs has the leader's parity (sum even)."""
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
        raise ValueError(f"shell index m must be a positive integer, got {m!r}")
    m = int(m)
    ints: list[tuple] = []

    def rec_int(prefix, rem, top, left):
        if left == 0:
            if rem == 0:
                ints.append(tuple(prefix))
            return
        for v in range(min(top, math.isqrt(rem)), -1, -1):
            if v * v * left < rem:
                break
            rec_int(prefix + [v], rem - v * v, v, left - 1)

    odds: list[tuple] = []  # odd o_i with sum o_i^2 = 8m: the half leader is o / 2

    def rec_half(prefix, rem, top, left):
        if left == 0:
            if rem == 0:
                odds.append(tuple(prefix))
            return
        v = min(top, math.isqrt(max(rem - (left - 1), 0)))
        v -= 1 - v % 2
        while v >= 1:
            if v * v * left < rem:
                break
            rec_half(prefix + [v], rem - v * v, v, left - 1)
            v -= 2

    rec_int([], 2 * m, math.isqrt(2 * m), BLOCK)
    rec_half([], 8 * m, math.isqrt(8 * m), BLOCK)
    li = np.array(ints, dtype=np.float64).reshape(-1, BLOCK)
    lh = np.array(odds, dtype=np.float64).reshape(-1, BLOCK) / 2
    parity = np.array([(sum(o) // 2) % 2 for o in odds], dtype=np.int64)  # sum o = 0 mod 4: even
    for array in (li, lh, parity):
        array.setflags(write=False)
    return li, lh, parity


def orbit_size(leader: np.ndarray, half: bool) -> int:
    """Points in the orbit of `leader` [8] under permutations and the allowed sign changes."""
    count = math.factorial(BLOCK)
    for v in Counter(np.asarray(leader).tolist()).values():
        count //= math.factorial(v)
    return count * (2 ** (BLOCK - 1) if half else 2 ** int((np.asarray(leader) != 0).sum()))


# --------------------------------------------------------------------------- levels and tables
@dataclass(frozen=True)
class ShellLevels:
    """A shell code: shells (m_g) and radii (r_g), one per level, radii ascending (the index order).

    m = 0 is the origin (radius 0, first level only). count = the number of points, all distinct."""

    shells: tuple[int, ...]
    radii: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.shells) != len(self.radii) or not self.shells:
            raise ValueError("ShellLevels needs as many radii as shells, at least one level")
        for g, (m, r) in enumerate(zip(self.shells, self.radii)):
            if isinstance(m, bool) or not isinstance(m, int) or m < 0:
                raise ValueError(f"level {g}: shell must be a non-negative integer, got {m!r}")
            if not isinstance(r, float) or not math.isfinite(r) or r < 0 or (r == 0) != (m == 0):
                raise ValueError(f"level {g}: radius must be a finite float, 0 exactly for the origin, got {r!r}")
            if m == 0 and g != 0:
                raise ValueError("the origin (m = 0) can only be the first level")
        if any(b <= a for a, b in zip(self.radii, self.radii[1:])):
            raise ValueError(f"radii must be strictly ascending, got {self.radii}")

    @property
    def count(self) -> int:
        return sum(shell_size(m) for m in self.shells)


@dataclass(frozen=True, eq=False)
class ShellTables:
    """Flat arrays the kernels read (numbering in the module docstring); L leaders over all levels.

    radii, scale float64 [G] (scale = 1 / (2 sqrt(2m)): doubled leaders to the unit shell; 0 at the origin);
    lv_lo, lv_hi int64 [G] (each level's leader range); offsets int64 [G] (first index of each level);
    lead2 int64 [L, 8] (leaders x 2, integers; leadf: the same as float64, what the search multiplies);
    half bool [L]; parity, orbit_off, mult, nsign int64 [L]."""

    radii: np.ndarray
    scale: np.ndarray
    lv_lo: np.ndarray
    lv_hi: np.ndarray
    offsets: np.ndarray
    lead2: np.ndarray
    leadf: np.ndarray
    half: np.ndarray
    parity: np.ndarray
    orbit_off: np.ndarray
    mult: np.ndarray
    nsign: np.ndarray
    count: int

    def args(self) -> tuple:
        return (self.radii, self.scale, self.lv_lo, self.lv_hi, self.offsets, self.lead2, self.leadf, self.half,
                self.parity, self.orbit_off, self.mult, self.nsign)


@lru_cache(maxsize=16)
def shell_tables(levels: ShellLevels) -> ShellTables:
    """The kernels' arrays of `levels` (cached per levels)."""
    lead2, half, parity, orbit_off, mult, nsign = [], [], [], [], [], []
    lv_lo, lv_hi, offsets, scale = [], [], [], []
    offset = 0
    for m in levels.shells:
        lv_lo.append(len(lead2))
        offsets.append(offset)
        if m == 0:
            lv_hi.append(len(lead2))
            scale.append(0.0)
            offset += 1
            continue
        li, lh, par = shell_leaders(m)
        inner = 0
        for leader, is_half, p in [(lv, False, 0) for lv in li] + [(lv, True, int(q)) for lv, q in zip(lh, par)]:
            perms = orbit_size(leader, is_half) // (2 ** (BLOCK - 1) if is_half else 2 ** int((leader != 0).sum()))
            lead2.append(np.rint(2 * leader).astype(np.int64))
            half.append(is_half)
            parity.append(p)
            orbit_off.append(inner)
            mult.append(perms)
            nsign.append(2 ** (BLOCK - 1) if is_half else 2 ** int((leader != 0).sum()))
            inner += perms * nsign[-1]
        if inner != shell_size(m):
            raise AssertionError(f"shell {m}: orbits hold {inner} points, expected {shell_size(m)}")
        lv_hi.append(len(lead2))
        scale.append(1.0 / (2.0 * math.sqrt(2.0 * m)))
        offset += inner

    def arr(values, dtype):
        return np.ascontiguousarray(np.array(values, dtype=dtype))

    lead2 = arr(lead2, np.int64).reshape(-1, BLOCK)
    return ShellTables(arr(levels.radii, np.float64), arr(scale, np.float64), arr(lv_lo, np.int64),
                       arr(lv_hi, np.int64), arr(offsets, np.int64), lead2, arr(lead2, np.float64),
                       arr(half, np.bool_), arr(parity, np.int64), arr(orbit_off, np.int64), arr(mult, np.int64),
                       arr(nsign, np.int64), offset)


# --------------------------------------------------------------------------- kernels (numba)
def _distinct_py(leader2, vals, cnt):
    """The distinct values of a (non-increasing) leader [8] into vals, their multiplicities into cnt
    (both int64 [8]); returns how many."""
    for k in range(8):
        cnt[k] = 0
    nd = 0
    for k in range(8):
        if nd == 0 or vals[nd - 1] != leader2[k]:
            vals[nd] = leader2[k]
            nd += 1
        cnt[nd - 1] += 1
    return nd


_distinct = None  # the compiled _distinct_py, bound by _kernels() before the kernels that call it compile


def _point_index_py(y, a, p, negpar, j, lead2, half, parity, mult, nsign, w):
    """The position inside leader j's orbit of its point nearest to block y [8] (a, p: |y| sorted descending
    and the positions; negpar: the parity of y's minus signs): rank * nsign[j] + sign (the numbering in the
    module docstring; of equally cheap parity flips, the one giving the smallest sign word). w: int64 [8]
    scratch."""
    for k in range(8):
        w[p[k]] = lead2[j, k]
    # multiset-permutation rank of w (larger values first): position i adds the arrangements of the rest with a
    # larger value there, total * (# larger) / (8 - i), total = the arrangements of positions i.. (exact
    # divisions by 1..8: a shift and a multiply by the odd part's inverse mod 2^64; counts without branches)
    rank = 0
    total = mult[j]
    for i in range(8):
        larger = 0
        equal = 0
        wi = w[i]
        for k in range(i, 8):
            larger += w[k] > wi
            equal += w[k] == wi
        sh = _EXACT_SHIFT[8 - i]
        inv = _EXACT_INV[8 - i]
        rank += ((total * larger) >> sh) * inv
        total = ((total * equal) >> sh) * inv
    sign = 0
    if half[j]:
        flip = -1
        if parity[j] != negpar:
            # flip one of the equally cheap positions (|y| = min |y| and the leader's smallest value there,
            # any |y| = 0): the one giving the smallest sign word (bits of positions 0..6)
            neg_hi = -1
            pos_lo = 7
            has7 = False
            for k in range(8):
                if a[k] == a[7] and (a[7] == 0.0 or lead2[j, k] == lead2[j, 7]):
                    i = p[k]
                    if i == 7:
                        has7 = True
                    elif y[i] < 0:
                        neg_hi = max(neg_hi, i)
                    else:
                        pos_lo = min(pos_lo, i)
            if neg_hi >= 0:
                flip = neg_hi        # clears the highest such bit
            elif has7:
                flip = 7             # the 8th sign is not stored: the word stays
            else:
                flip = pos_lo        # sets the lowest bit
        for i in range(7):
            s = 1 if y[i] < 0 else 0
            if i == flip:
                s ^= 1
            sign |= s << i
    else:  # one bit per non-zero coordinate, in position order
        bit = 0
        for i in range(8):
            nz = np.int64(w[i] != 0)
            sign |= (nz & np.int64(y[i] < 0)) << bit
            bit += nz
    return rank * nsign[j] + sign


_point_index = None  # the compiled _point_index_py, bound by _kernels()
# x // q for q in 1..8 and x a multiple of q: (x >> e) * inv mod 2^64, q = 2^e o, inv * o = 1 mod 2^64
_EXACT_SHIFT = np.array([0, 0, 1, 0, 2, 0, 1, 0, 3], np.int64)
_EXACT_INV = np.array([0, 1, 1, -6148914691236517205, 1, -3689348814741910323, -6148914691236517205,
                       7905747460161236407, 1], np.int64)

def _sort8_py(v):
    """v int64 [8] sorted descending in place by a 19-comparator network (no data-dependent branches)."""
    for i, j in ((0, 2), (1, 3), (4, 6), (5, 7), (0, 4), (1, 5), (2, 6), (3, 7), (0, 1), (2, 3), (4, 5), (6, 7),
                 (2, 4), (3, 5), (1, 4), (3, 6), (1, 2), (3, 4), (5, 6)):
        hi = max(v[i], v[j])
        v[j] = min(v[i], v[j])
        v[i] = hi


_sort8 = None  # the compiled _sort8_py, bound by _kernels()


def _sort_abs_py(y, a, p):
    """a [8] = |y| sorted descending (stable: equal values keep their order), p [8] their positions in y."""
    for i in range(8):
        v = abs(y[i])
        j = i
        while j > 0 and a[j - 1] < v:
            a[j] = a[j - 1]
            p[j] = p[j - 1]
            j -= 1
        a[j] = v
        p[j] = i


_sort_abs = None  # the compiled _sort_abs_py, bound by _kernels()


def _read_block_py(y_all, b, y):
    """y [8] = block b of y_all [n, 8]; returns (its squared norm, its norm, the parity of its count of
    negative entries)."""
    rho2 = 0.0
    neg = 0
    for i in range(8):
        y[i] = y_all[b, i]
        rho2 += y[i] * y[i]
        if y[i] < 0:
            neg += 1
    return rho2, math.sqrt(rho2), neg & 1


_read_block = None  # the compiled _read_block_py, bound by _kernels()

def _unrank_py(index, radii, scale, lv_lo, lv_hi, offsets, lead2, leadf, half, parity, orbit_off, mult, nsign,
               out, start, stop):
    """index [n] (each in [0, count)) -> the points out [n, 8] float64 (the inverse of the numbering)."""
    w = np.empty(8, np.int64)
    cnt = np.zeros(8, np.int64)
    vals = np.empty(8, np.int64)
    for b in range(start, stop):
        idx = index[b]
        g = np.searchsorted(offsets, idx, side="right") - 1
        if lv_hi[g] == lv_lo[g]:
            for i in range(8):
                out[b, i] = 0.0
            continue
        rest = idx - offsets[g]
        j = lv_lo[g] + np.searchsorted(orbit_off[lv_lo[g]:lv_hi[g]], rest, side="right") - 1  # its leader
        rest -= orbit_off[j]
        rank = rest // nsign[j]
        sign = rest % nsign[j]
        nd = _distinct(lead2[j], vals, cnt)
        total = mult[j]
        for i in range(8):
            rem = 8 - i
            for t in range(nd):
                if cnt[t] == 0:
                    continue
                block = total * cnt[t] // rem
                if rank < block:
                    w[i] = vals[t]
                    total = block
                    cnt[t] -= 1
                    break
                rank -= block
        s_g = radii[g] * scale[g]
        if half[j]:
            negs = 0
            for i in range(7):
                s = (sign >> i) & 1
                negs += s
                out[b, i] = -w[i] * s_g if s else w[i] * s_g
            last = (parity[j] - negs) % 2
            out[b, 7] = -w[7] * s_g if last else w[7] * s_g
        else:
            bit = 0
            for i in range(8):
                v = w[i] * s_g
                if w[i] != 0:
                    if (sign >> bit) & 1:
                        v = -v
                    bit += 1
                out[b, i] = v
    return 0

def _kernels():
    """The compiled unrank, after compiling the block helpers shared with the encoders of `e8shell_search`
    (bound as this module's globals: `_distinct`, `_point_index`, `_sort8`, `_sort_abs`, `_read_block`)."""
    global _KERNELS, _distinct, _point_index, _sort8, _sort_abs, _read_block
    if _KERNELS is None:
        with _LOCK:
            if _KERNELS is None:
                if not numba_available():
                    raise RuntimeError("E8 shell codes need numba (a fibquant dependency), which does not import")
                import numba

                _distinct = numba.njit(nogil=True, cache=True)(_distinct_py)
                _sort8 = numba.njit(nogil=True, cache=True)(_sort8_py)
                _sort_abs = numba.njit(nogil=True, cache=True)(_sort_abs_py)
                _read_block = numba.njit(nogil=True, cache=True)(_read_block_py)
                _point_index = numba.njit(nogil=True, cache=True)(_point_index_py)
                _KERNELS = numba.njit(nogil=True, cache=True)(_unrank_py)
    return _KERNELS


def unrank(index: np.ndarray, tables: ShellTables) -> np.ndarray:
    """index int64 [n] -> points float64 [n, 8] (ValueError for an index outside [0, count))."""
    index = np.ascontiguousarray(index, dtype=np.int64)
    if index.ndim != 1:
        raise ValueError(f"index must be 1-d, got shape {index.shape}")
    if index.size and (int(index.min()) < 0 or int(index.max()) >= tables.count):
        raise ValueError(f"E8 shell index out of range [0, {tables.count})")
    out = np.empty((index.shape[0], BLOCK))
    kernel = _kernels()
    run_split(kernel, (index, *tables.args(), out), index.shape[0], 16, _MIN_BLOCKS_PER_THREAD, "fibquant-e8shell")
    return out

# --------------------------------------------------------------------------- the reference
def codebook_points(levels: ShellLevels, limit: int = 1 << 20) -> np.ndarray:
    """Every point of the code in index order, float64 [count, 8] (small codes: count <= limit)."""
    tables = shell_tables(levels)
    if tables.count > limit:
        raise ValueError(f"{tables.count} points: too many to materialise (limit {limit})")
    return unrank(np.arange(tables.count, dtype=np.int64), tables)


def exhaustive_search(blocks: np.ndarray, points: np.ndarray, chunk: int = 256) -> np.ndarray:
    """The spec: blocks [n, 8] -> int64 [n], per block the lowest index among the points [N, 8] whose
    squared distance (float64) is within TIE of the smallest."""
    y = np.asarray(blocks, dtype=np.float64)
    out = np.empty(len(y), np.int64)
    for at in range(0, len(y), chunk):
        d = ((y[at:at + chunk, None, :] - points[None, :, :]) ** 2).sum(-1)
        near = d <= d.min(1, keepdims=True) + TIE
        out[at:at + chunk] = near.argmax(1)
    return out
