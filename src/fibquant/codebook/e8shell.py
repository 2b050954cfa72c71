"""E8 shell codes in 8 dimensions: levels, leaders, the exact leader search, index and unrank.

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

The reference search (`exhaustive_search`) is the spec: over the materialised codebook (`codebook_points`,
small level sets only), the lowest index among the points whose squared distance is within TIE of the
smallest. The leader scan (`shell_search(..., "scan")`, numba) gives the same index without materialising
anything, and is the reference of the lattice search below where the codebook is too large (b >= 3):
per 8-block y, |y| sorted once (stable: tied values keep their position order, so the rank is the lowest
among equal inner products); levels visited outward from the radius nearest ||y|| while (||y|| - r)^2 can
still reach the best distance (no point of a level is nearer than that); per level the largest inner
product over its leaders (8 multiply-adds each; a half leader whose parity forbids sign(y) loses
2 min|y| min(leader), the cheapest flip); ties (within TIE) go to the lower leader, then the lower level,
and a parity flip with several equally cheap positions to the one giving the smallest sign word.
The lattice search (`shell_search(..., "lattice")`, the default for codes of many leaders per level: b = 4)
visits lattice points, not leaders: with d = ||y||^2 + r^2 - 2 r ||y|| cos(y, s) for a point s of level g's
shell, an incumbent (Conway-Sloane's nearest E8 point to sqrt(2 m) y / ||y||) bounds the levels that can
win and the cosine each needs, all such s lie in one ball around the block's direction, and that ball's E8
points are enumerated (a few per block). Their leaders get the scan's exact inner products, and the block
is settled only where the scan's sequential tie rules are known to pick the same (lowest level, then lowest
leader among exact ties, nothing else within 1e-9); the few other blocks go to the scan.

Attention on codes decodes blocks through `point_tables` (`ShellPointTables`, `point_py`: the index's orbit
record, its composition's slot word, its sign row; no search, no division) or, for codes of at most 2^16
points, `compact_point_tables` (`CompactPointTables`: every point as 8 int8, the doubled coordinates, times the
level's scale, `compact_point_py`; and as a word naming its two 4-d halves, which the step scores through
per-query tables); both decoders give exactly `unrank`'s points rounded to float32 (`decode_points`).
"""
from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .._numba import njit_cached, numba_available, run_split

BLOCK = 8               # the code's block length (E8 is 8-dimensional)
TIE = 1e-10             # squared distances within TIE of the smallest are ties (lowest index wins)
_TIE_IP = 1e-11         # the same for a level's inner products (2 r / ||s|| <= 1 for unit-vector blocks)
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


@lru_cache(maxsize=16)
def lattice_tables(tables: ShellTables) -> tuple[np.ndarray, ...]:
    """The lattice search's tables, cached per tables object: keys int64 [L] (each doubled leader packed 5 bits
    per value, position 0 most significant), lv_mid int64 [G] (each level's first half leader), m8 int64 [G]
    (8 m per level), ml_ptr int64 [M + 2] and ml_lv int64 [G] (the levels of shell m, M the largest shell),
    sroot float64 [G] (sqrt(2 m)), inv_r float64 [G] (1 / r; 0 at the origin), inv_norm float64 [M + 1]
    (1 / sqrt(8 m), the doubled shell's inverse norm; 0 at m = 0)."""
    if int(tables.lead2.max(initial=0)) > 31:
        raise ValueError("a doubled leader value does not fit the 5-bit leader key (shells m <= 127 only)")
    keys = np.zeros(len(tables.lead2), np.int64)
    for k in range(BLOCK):
        keys = (keys << 5) | tables.lead2[:, k]
    lv_mid = np.array([lo + int((~tables.half[lo:hi]).sum()) for lo, hi in zip(tables.lv_lo, tables.lv_hi)], np.int64)
    m8 = np.array([int((tables.lead2[lo] ** 2).sum()) if hi > lo else 0 for lo, hi in zip(tables.lv_lo, tables.lv_hi)],
                  np.int64)
    shells = m8 // 8
    order = np.argsort(shells, kind="stable")
    ml_ptr = np.searchsorted(shells[order], np.arange(int(shells.max()) + 2), side="left").astype(np.int64)
    sroot = np.sqrt(m8 / 4.0)
    inv_r = np.where(m8 > 0, 1.0 / np.where(m8 > 0, tables.radii, 1.0), 0.0)
    inv_norm = 1.0 / np.sqrt(np.maximum(8.0 * np.arange(int(shells.max()) + 1), 1.0))
    inv_norm[0] = 0.0
    return (np.ascontiguousarray(keys), lv_mid, m8, np.ascontiguousarray(ml_ptr),
            np.ascontiguousarray(order.astype(np.int64)), sroot, inv_r, inv_norm)


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


def _search_py(y_all, radii, scale, lv_lo, lv_hi, offsets, lead2, leadf, half, parity, orbit_off, mult, nsign,
               index, level, start, stop):
    """Blocks [start, stop) of y_all [n, 8] (float32 or float64) -> index [n], level [n] (int64)."""
    n_lv = radii.shape[0]
    a = np.empty(8)
    p = np.empty(8, np.int64)
    y = np.empty(8)
    w = np.empty(8, np.int64)
    for b in range(start, stop):
        rho2, rho, negpar = _read_block(y_all, b, y)
        _sort_abs(y, a, p)
        hi = np.searchsorted(radii, rho)
        lo = hi - 1
        best = np.inf
        best_lv = n_lv
        best_j = -1
        while True:
            dlo = (rho - radii[lo]) ** 2 if lo >= 0 else np.inf
            dhi = (rho - radii[hi]) ** 2 if hi < n_lv else np.inf
            if min(dlo, dhi) > best + 1e-10:  # TIE: a tied level further out is still visited
                break
            if dlo <= dhi:
                g = lo
                lo -= 1
            else:
                g = hi
                hi += 1
            if lv_hi[g] == lv_lo[g]:
                d = rho2
                jb = -1
            else:
                top = -np.inf
                jb = -1
                for j in range(lv_lo[g], lv_hi[g]):
                    ip = 0.0
                    for k in range(8):
                        ip += a[k] * leadf[j, k]
                    if half[j] and parity[j] != negpar:
                        ip -= 2.0 * a[7] * leadf[j, 7]
                    if ip > top + 1e-11:  # _TIE_IP: the lower leader keeps a tie
                        top = ip
                        jb = j
                r = radii[g]
                d = rho2 - 2.0 * r * top * scale[g] + r * r
            if d < best - 1e-10 or (d <= best + 1e-10 and g < best_lv):
                best = d
                best_lv = g
                best_j = jb
        level[b] = best_lv
        if best_j < 0:
            index[b] = offsets[best_lv]
            continue
        j = best_j
        index[b] = offsets[best_lv] + orbit_off[j] + _point_index(y, a, p, negpar, j, lead2, half, parity, mult, nsign,
                                                                  w)
    return 0


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


_LATTICE_RHO = (1e-3, 1e3)  # block norms the lattice search takes (its tie margins stay >> _TIE_IP)
_R2_CAP = 3.0               # a larger enumeration ball: the block goes to the leader search
_CANDIDATES = 64            # lattice points kept per block (more: the leader search)
_LATTICE_MIN_LEADERS = 50   # leaders per level from which `shell_search` takes the lattice search
_SURVIVE_D = 1e-8           # candidates within this of the smallest cheap d get the scan's exact d
_NEAR_D = 1e-9              # exact d (and inner products) this close to the best must tie ...
_TIE_D = 1e-12              # ... within this (exact ties), else the block goes to the leader search


def _lattice_search_py(y_all, radii, scale, lv_lo, lv_hi, offsets, lead2, leadf, half, parity, orbit_off, mult,
                       nsign, keys, lv_mid, m8, ml_ptr, ml_lv, sroot, inv_r, inv_norm, index, level, done, start,
                       stop):
    """Blocks [start, stop) of y_all [n, 8] -> index [n], level [n] and done[b] = 1 where the lattice search
    settles the block (0: left to the leader search). keys int64 [L] (each doubled leader packed 5 bits per
    value, position 0 most significant), lv_mid int64 [G] (each level's first half leader), m8 int64 [G]
    (8 m per level), ml_ptr int64 [M + 2] / ml_lv int64 [G] (the levels of shell m: ml_lv[ml_ptr[m]:ml_ptr[m + 1]]),
    sroot float64 [G] (sqrt(2 m)), inv_r float64 [G] (1 / r, 0 at the origin), inv_norm float64 [M + 1] (1 / sqrt(8 m)).

    A level's points are r_g s / |s| for s on E8's shell m_g, and d = rho^2 + r^2 - 2 r rho cos(y, s). An
    incumbent D (the E8 point nearest to z = sqrt(2 m) y / rho, m the shell of the level nearest in radius:
    Conway-Sloane, each D8 coset rounded and its parity fixed) bounds the levels that can matter
    ((rho - r)^2 <= D) and per level the cosine they need; every s meeting one of those lies in one ball
    around z (|s - z|^2 = |s|^2 + |z|^2 - 2 |s| |z| cos), whose E8 points are enumerated (both D8 cosets, a
    depth-first walk over the coordinates the ball lets leave their nearest value, carrying |s|^2, <y, s>
    and the parity). The candidates' leaders then get the scan's exact inner products and d: the block is
    settled when the best d's and inner products tie exactly (_TIE_D) or are apart by more than _NEAR_D
    (then the scan's sequential tie rules pick the lowest level, then the lowest leader, as here); anything
    else is left to the leader search."""
    n_lv = radii.shape[0]
    max_m = ml_ptr.shape[0] - 2
    a = np.empty(8)
    p = np.empty(8, np.int64)
    y = np.empty(8)
    w = np.empty(8, np.int64)
    base2 = np.empty((2, 8), np.int64)
    step = np.empty((2, 8), np.int64)
    dsq1 = np.empty((2, 8), np.int64)
    dsq2 = np.empty((2, 8), np.int64)
    dip1 = np.empty((2, 8))
    up1 = np.empty((2, 8))
    up2 = np.empty((2, 8))
    cnear = np.empty(2)
    cpar = np.empty(2, np.int64)
    csq = np.empty(2, np.int64)
    cip = np.empty(2)
    inc_d = np.empty(2)
    inc_sq = np.empty(2, np.int64)
    inc_ip = np.empty(2)
    pmov = np.zeros(9, np.int64)
    psq = np.zeros(9, np.int64)
    pip = np.zeros(9)
    el = np.empty(8, np.int64)
    opt = np.zeros(9, np.int64)
    part = np.zeros(9)
    srt = np.empty(8, np.int64)
    cand_g = np.empty(_CANDIDATES, np.int64)
    cand_d = np.empty(_CANDIDATES)
    cand_s = np.empty((_CANDIDATES, 8), np.int64)
    cand_j = np.empty(_CANDIDATES, np.int64)
    cand_top = np.empty(_CANDIDATES)
    for b in range(start, stop):
        done[b] = 0
        rho2, rho, negpar = _read_block(y_all, b, y)
        if not (_LATTICE_RHO[0] <= rho <= _LATTICE_RHO[1]):
            continue
        _sort_abs(y, a, p)
        # the incumbent: the E8 point nearest to sqrt(2 m) y / rho, m the shell of the level nearest in radius
        hi = np.searchsorted(radii, rho)
        g0 = hi if hi < n_lv else n_lv - 1
        if hi > 0 and (hi == n_lv or rho - radii[hi - 1] < radii[hi] - rho):
            g0 = hi - 1
        if m8[g0] == 0:
            if g0 + 1 >= n_lv:
                continue
            g0 += 1
        # both D8 cosets around z = sqrt(2 m) y / rho: each coordinate's nearest value (doubled), the extra
        # squared distance of its second and third nearest, and what they change in |s|^2 and <y, s>
        t = sroot[g0]
        for shift in range(2):
            near = 0.0
            par = 0
            bsq = 0
            bip = 0.0
            cheap = 0
            for i in range(8):
                v = y[i] * (t / rho) - 0.5 * shift
                n0 = np.floor(v + 0.5)
                f = v - n0
                nb = np.int64(n0)
                par += nb
                st = 1 if f >= 0 else -1
                af = abs(f)
                near += af * af
                up1[shift, i] = 1.0 - 2.0 * af
                up2[shift, i] = 1.0 + 2.0 * af
                cheap = i if up1[shift, i] < up1[shift, cheap] else cheap
                v2 = 2 * nb + shift
                base2[shift, i] = v2
                step[shift, i] = 2 * st
                bsq += v2 * v2
                bip += y[i] * v2
                dsq1[shift, i] = 4 * st * v2 + 4   # (v2 + 2 st)^2 - v2^2
                dsq2[shift, i] = -4 * st * v2 + 4  # (v2 - 2 st)^2 - v2^2
                dip1[shift, i] = 2.0 * st * y[i]
            cnear[shift] = near
            cpar[shift] = par
            csq[shift] = bsq
            cip[shift] = bip
            # the coset's nearest E8 point (Conway-Sloane): an odd integer sum moves the cheapest coordinate
            odd = par & 1
            inc_d[shift] = near + (up1[shift, cheap] if odd else 0.0)
            inc_sq[shift] = bsq + (dsq1[shift, cheap] if odd else 0)
            inc_ip[shift] = bip + (dip1[shift, cheap] if odd else 0.0)
        c = 0 if inc_d[0] <= inc_d[1] else 1
        sq = inc_sq[c]
        ip = inc_ip[c]
        big = np.inf
        if m8[0] == 0:
            big = rho2
        m = sq >> 3
        if 0 < m <= max_m:
            for q in range(ml_ptr[m], ml_ptr[m + 1]):
                r = radii[ml_lv[q]]
                big = min(big, rho2 - 2.0 * r * ip * inv_norm[m] + r * r)
        if big == np.inf:
            continue
        bound = big * (1.0 + 1e-9) + 1e-12
        # the levels that can matter, and the ball holding every point any of them needs
        gl = hi - 1
        while gl >= 0 and (rho - radii[gl]) ** 2 <= bound:
            gl -= 1
        gl += 1
        gh = hi
        while gh < n_lv and (rho - radii[gh]) ** 2 <= bound:
            gh += 1
        gh -= 1
        ok = True
        half_rho = 0.5 / rho
        ball = 0.0
        for g in range(gl, gh + 1):
            if m8[g] == 0:
                continue
            r = radii[g]
            kappa = ((rho2 - bound) * inv_r[g] + r) * half_rho  # the cosine level g needs
            if kappa <= 0.0:
                ok = False
                break
            sr = sroot[g]  # its points s have |s| = sr and cos(y, s) >= kappa: |s - z|^2 <= this
            ball = max(ball, sr * sr + t * t - 2.0 * t * sr * kappa)
        if not ok:
            continue
        ball += 1e-9
        if ball > _R2_CAP:
            continue
        # enumerate E8 (D8 and D8 + 1/2, doubled coordinates) in the ball around t y / rho
        nc = 0
        if m8[0] == 0 and gl == 0:  # the origin level: d = rho^2 (the scan's)
            cand_g[0] = 0
            cand_d[0] = rho2
            nc = 1
        for shift in range(2):
            extra = ball - cnear[shift]  # what the ball leaves over the nearest values' squared distance
            if extra < 0.0:
                continue
            up1c, up2c, base2c, stepc = up1[shift], up2[shift], base2[shift], step[shift]
            dsq1c, dsq2c, dip1c = dsq1[shift], dsq2[shift], dip1[shift]
            ne = 0
            for i in range(8):  # only these coordinates can leave their nearest value
                if up1c[i] <= extra:
                    el[ne] = i
                    ne += 1
            # depth-first over those coordinates' values; the path carries the extra squared distance, the
            # number of moved coordinates (each changes the integer sum by one), |s|^2 and <y, s>
            k = 0
            opt[0] = 0
            part[0] = 0.0
            pmov[0] = cpar[shift]
            psq[0] = csq[shift]
            pip[0] = cip[shift]
            while True:
                if k == ne:  # a point of the ball's coset of Z^8, in E8 when its integer parts sum to even
                    m = psq[ne] >> 3
                    if pmov[ne] & 1 == 0 and 0 < m <= max_m:
                        ip = pip[ne]
                        for q in range(ml_ptr[m], ml_ptr[m + 1]):
                            g = ml_lv[q]
                            if g < gl or g > gh:
                                continue
                            r = radii[g]
                            dd = rho2 - 2.0 * r * ip * inv_norm[m] + r * r
                            if dd > bound:
                                continue
                            if nc == _CANDIDATES:
                                ok = False
                                break
                            cand_g[nc] = g
                            cand_d[nc] = dd
                            for i in range(8):
                                cand_s[nc, i] = base2c[i]
                            for e in range(ne):
                                o = opt[e]
                                if o:
                                    i = el[e]
                                    cand_s[nc, i] += stepc[i] if o == 1 else -stepc[i]
                            nc += 1
                        if not ok:
                            break
                    k -= 1
                    if k < 0:
                        break
                    opt[k] += 1
                    continue
                o = opt[k]
                i = el[k]
                c = part[k] + (0.0 if o == 0 else (up1c[i] if o == 1 else up2c[i]))
                if o > 2 or c > extra:  # the options cost more and more: none left at this depth
                    k -= 1
                    if k < 0:
                        break
                    opt[k] += 1
                    continue
                part[k + 1] = c
                pmov[k + 1] = pmov[k] + (o != 0)
                psq[k + 1] = psq[k] + (0 if o == 0 else (dsq1c[i] if o == 1 else dsq2c[i]))
                pip[k + 1] = pip[k] + (0.0 if o == 0 else (dip1c[i] if o == 1 else -dip1c[i]))
                k += 1
                if k < ne:
                    opt[k] = 0
            if not ok:
                break
        if not ok or nc == 0:
            continue
        # the scan's exact d for the candidates near the smallest
        dmin = np.inf
        for q in range(nc):
            dmin = min(dmin, cand_d[q])
        dstar = np.inf
        for q in range(nc):
            cand_j[q] = -2  # not near
            if cand_d[q] > dmin + _SURVIVE_D:
                continue
            g = cand_g[q]
            if m8[g] == 0:
                cand_j[q] = -1
                cand_top[q] = 0.0
                cand_d[q] = rho2
                dstar = min(dstar, rho2)
                continue
            for i in range(8):  # the candidate's leader: |s| sorted descending, as a key
                srt[i] = abs(cand_s[q, i])
            _sort8(srt)
            key = 0
            for i in range(8):
                key = (key << 5) | srt[i]
            lo_j, hi_j = (lv_lo[g], lv_mid[g]) if srt[0] % 2 == 0 else (lv_mid[g], lv_hi[g])
            while hi_j - lo_j > 1:  # keys descend within the integer and within the half leaders
                mid = (lo_j + hi_j) >> 1
                up = keys[mid] >= key
                lo_j = mid if up else lo_j
                hi_j = hi_j if up else mid
            if lo_j >= lv_hi[g] or keys[lo_j] != key:
                ok = False
                break
            j = lo_j
            top = 0.0  # the scan's inner product of that leader: the same operations
            for k in range(8):
                top += a[k] * leadf[j, k]
            if half[j] and parity[j] != negpar:
                top -= 2.0 * a[7] * leadf[j, 7]
            r = radii[g]
            cand_j[q] = j
            cand_top[q] = top
            cand_d[q] = rho2 - 2.0 * r * top * scale[g] + r * r
            dstar = min(dstar, cand_d[q])
        if not ok:
            continue
        # settled only without near-ties: the lowest level among exact ties, inside it the lowest leader
        win = n_lv
        for q in range(nc):
            if cand_j[q] == -2 or cand_d[q] > dstar + _NEAR_D:
                continue
            if cand_d[q] > dstar + _TIE_D:
                ok = False
                break
            win = min(win, cand_g[q])
        if not ok:
            continue
        best_j = -1
        if m8[win] != 0:
            top = -np.inf
            for q in range(nc):
                if cand_j[q] >= 0 and cand_g[q] == win:
                    top = max(top, cand_top[q])
            best_j = lv_hi[win]
            for q in range(nc):
                if cand_j[q] < 0 or cand_g[q] != win or cand_top[q] < top - _NEAR_D:
                    continue
                if cand_top[q] < top - _TIE_D:
                    ok = False
                    break
                best_j = min(best_j, cand_j[q])
            if not ok:
                continue
        level[b] = win
        if best_j < 0:
            index[b] = offsets[win]
        else:
            j = best_j
            index[b] = offsets[win] + orbit_off[j] + _point_index(y, a, p, negpar, j, lead2, half, parity, mult,
                                                                  nsign, w)
        done[b] = 1
    return 0


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
    global _KERNELS
    if _KERNELS is None:
        with _LOCK:
            if _KERNELS is None:
                if not numba_available():
                    raise RuntimeError("E8 shell codes need numba (a fibquant dependency), which does not import")
                global _distinct, _point_index, _sort8, _sort_abs, _read_block
                _distinct = njit_cached(nogil=True)(_distinct_py)
                _sort8 = njit_cached(nogil=True)(_sort8_py)
                _sort_abs = njit_cached(nogil=True)(_sort_abs_py)
                _read_block = njit_cached(nogil=True)(_read_block_py)
                _point_index = njit_cached(nogil=True)(_point_index_py)
                _KERNELS = (njit_cached(nogil=True)(_search_py),
                            njit_cached(nogil=True)(_unrank_py),
                            njit_cached(nogil=True)(_lattice_search_py))
    return _KERNELS


def uses_lattice(tables: ShellTables) -> bool:
    """Whether `shell_search` takes the lattice search for this code: levels of many leaders (b = 4: 119 on
    average), where scanning them costs more than enumerating E8 near the block (b <= 3: 4 to 14 leaders)."""
    levels = int((tables.lv_hi > tables.lv_lo).sum())
    return levels > 0 and len(tables.lead2) / levels >= _LATTICE_MIN_LEADERS


SEARCH_METHODS = ("auto", "scan", "lattice")


def shell_search(blocks: np.ndarray, tables: ShellTables, method: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """blocks float32/float64 [n, 8] (finite) -> (index int64 [n], level int64 [n]): the nearest point of
    the code, the lowest index among ties (= `exhaustive_search`'s). Every method gives the same codes:
    "scan" (the lattice search's reference) scores every leader of each visited level (`_search_py`);
    "lattice" enumerates E8 near the block (`_lattice_search_py`) and hands the blocks it does not settle
    (near-ties, blocks far from unit scale or beyond the outer levels) to "scan"; "auto" is "lattice" for
    codes of many leaders per level (`uses_lattice`: b = 4), else "scan"."""
    if method not in SEARCH_METHODS:
        raise ValueError(f"method must be one of {SEARCH_METHODS}, got {method!r}")
    blocks = np.ascontiguousarray(blocks)
    if blocks.ndim != 2 or blocks.shape[1] != BLOCK or blocks.dtype not in (np.float32, np.float64):
        raise ValueError(f"blocks must be float32/float64 [n, {BLOCK}], got {blocks.dtype} {blocks.shape}")
    if method == "auto":
        method = "lattice" if uses_lattice(tables) else "scan"
    if method == "scan":
        return _scan(blocks, tables)
    index, level, done = lattice_pass(blocks, tables)
    rest = np.flatnonzero(done == 0)
    if rest.size:
        index[rest], level[rest] = _scan(np.ascontiguousarray(blocks[rest]), tables)
    return index, level


def _scan(blocks: np.ndarray, tables: ShellTables) -> tuple[np.ndarray, np.ndarray]:
    n = blocks.shape[0]
    index, level = np.empty(n, np.int64), np.empty(n, np.int64)
    run_split(_kernels()[0], (blocks, *tables.args(), index, level), n, 64, _MIN_BLOCKS_PER_THREAD, "fibquant-e8shell")
    return index, level


def lattice_pass(blocks: np.ndarray, tables: ShellTables) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The lattice search alone: blocks [n, 8] (contiguous float32/float64) -> (index int64 [n], level int64
    [n], done uint8 [n]); index and level hold the code where done = 1, garbage where 0."""
    n = blocks.shape[0]
    index, level, done = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.uint8)
    run_split(_kernels()[2], (blocks, *tables.args(), *lattice_tables(tables), index, level, done), n, 64,
              _MIN_BLOCKS_PER_THREAD, "fibquant-e8shell")
    return index, level, done


def unrank(index: np.ndarray, tables: ShellTables) -> np.ndarray:
    """index int64 [n] -> points float64 [n, 8] (ValueError for an index outside [0, count))."""
    index = np.ascontiguousarray(index, dtype=np.int64)
    if index.ndim != 1:
        raise ValueError(f"index must be 1-d, got shape {index.shape}")
    if index.size and (int(index.min()) < 0 or int(index.max()) >= tables.count):
        raise ValueError(f"E8 shell index out of range [0, {tables.count})")
    out = np.empty((index.shape[0], BLOCK))
    kernel = _kernels()[1]
    run_split(kernel, (index, *tables.args(), out), index.shape[0], 16, _MIN_BLOCKS_PER_THREAD, "fibquant-e8shell")
    return out


# --------------------------------------------------------------------------- decomposed decode tables
@dataclass(frozen=True, eq=False)
class ShellPointTables:
    """An index's point without searching the levels or unranking a permutation (what attention on codes
    decodes with: `point_py`), built from the numbering above. The code's orbits (the origin if it is a
    level, then every leader of every level) are numbered J = 0..; an index of orbit J is
    start[J] + rank * 2^sh[J] + sign, and rank's multiset permutation depends only on the leader's
    multiplicities (its composition of 8), so one table of slot words per composition serves every leader.
    Sized for a decode step that finds them cold (the model's weights pass through the caches between two
    layers): one 64-byte record per orbit, a small bucket table.

    orbits int64 [J, 8], one cache line per orbit: start, the next orbit's start (count after the last),
    sh | comp_off << 8 | (row + 1) << 40, and in words 3..6 (columns 6..13 of the float32 view `orbit_vals`)
    the leader's distinct values, largest first, times the level's scale r_g / ||s||, rounded once from
    float64 (exactly unrank's values rounded to float32). sh: log2 of the orbit's sign patterns (0 at the
    origin); comp_off: the first entry of its composition in comps; row: its row of signs (256 + parity for
    a half leader, 255 for an integer leader without zeros, -1 with zeros: the row is then the non-zero
    positions ~lastmask). bucket int16 [ceil(count / 2^bshift)]: the last orbit starting at or before
    q * 2^bshift. comps uint32 [E]: bits 21 - 3 k .. 23 - 3 k the slot (distinct value) at position k, ranks in
    lexicographic order; bits 24..31 lastmask, the positions holding the last slot. signs uint8 [258, 256]:
    rows 0..255 the sign bits spread over the set bits of the row number in position order; rows 256 + p
    bits 0..6 as stored, bit 7 the parity p's last sign."""

    orbits: np.ndarray
    orbit_vals: np.ndarray
    bucket: np.ndarray
    bshift: int
    comps: np.ndarray
    signs: np.ndarray
    count: int

    def args(self) -> tuple:
        return self.bucket, self.bshift, self.orbits, self.orbit_vals, self.comps, self.signs

    @property
    def starts(self) -> np.ndarray:
        """int64 [J + 1]: each orbit's first index, then count."""
        return np.append(self.orbits[:, 0], self.count)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.orbits, self.bucket, self.comps, self.signs))


_PERMUTATIONS = None
# log2 of the orbit lookup's buckets: 8 KB of int16, few orbits per bucket (at 4 bits ~2.6 on average)
BUCKET_BITS = 12


def _composition_words(counts: tuple[int, ...]) -> np.ndarray:
    """The slot words (ShellPointTables.comps) of every arrangement of a multiset with these slot
    multiplicities, in lexicographic order of the slot sequence (rank 0: the leader itself)."""
    global _PERMUTATIONS
    if _PERMUTATIONS is None:
        import itertools
        _PERMUTATIONS = np.array(list(itertools.permutations(range(BLOCK))), dtype=np.int64)
    base = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    slots = base[_PERMUTATIONS]                                        # [8!, 8]
    key = np.unique((slots << (3 * (BLOCK - 1 - np.arange(BLOCK)))).sum(1))  # position 0 most significant
    last = len(counts) - 1
    slots = (key[:, None] >> (3 * (BLOCK - 1 - np.arange(BLOCK)))) & 7
    lastmask = ((slots == last) << np.arange(BLOCK)).sum(1)
    return (key | (lastmask << 24)).astype(np.uint32)


def _sign_rows() -> np.ndarray:
    signs = np.zeros((258, 256), np.uint8)
    for mask in range(256):
        positions = [k for k in range(BLOCK) if mask >> k & 1]
        for s in range(256):
            signs[mask, s] = sum(1 << k for c, k in enumerate(positions) if s >> c & 1)
    for parity in (0, 1):
        for s in range(128):
            last = (parity - bin(s).count("1")) % 2
            signs[256 + parity, s] = s | (last << 7)
    return signs


@lru_cache(maxsize=16)
def point_tables(levels: ShellLevels) -> ShellPointTables:
    """The decomposed decode tables of `levels` (cached per levels)."""
    t = shell_tables(levels)
    start, sh, comp_off, row, vals = [], [], [], [], []
    comps: list[np.ndarray] = [np.array([0xFF << 24], np.uint32)]  # entry 0: the origin (slot 0 everywhere)
    comp_at: dict[tuple, int] = {}
    for g in range(len(levels.shells)):
        s_g = t.radii[g] * t.scale[g]  # unrank's float64 scale of the level
        if t.lv_hi[g] == t.lv_lo[g]:  # the origin
            start.append(int(t.offsets[g]))
            sh.append(0)
            comp_off.append(0)
            row.append(255)
            vals.append(np.zeros(BLOCK, np.float32))
            continue
        for j in range(t.lv_lo[g], t.lv_hi[g]):
            leader = t.lead2[j]
            distinct, counts = np.unique(-leader, return_counts=True)  # largest value first
            counts = tuple(int(c) for c in counts)
            if counts not in comp_at:
                comp_at[counts] = sum(len(c) for c in comps)
                comps.append(_composition_words(counts))
            start.append(int(t.offsets[g] + t.orbit_off[j]))
            sh.append(int(t.nsign[j]).bit_length() - 1)
            comp_off.append(comp_at[counts])
            row.append(256 + int(t.parity[j]) if t.half[j] else (-1 if leader[-1] == 0 else 255))
            v = np.zeros(BLOCK, np.float32)
            v[:len(distinct)] = (-distinct).astype(np.float64) * s_g
            vals.append(v)
    start.append(t.count)
    bshift = max(0, (t.count - 1).bit_length() - BUCKET_BITS)
    starts = np.array(start, np.int64)
    bucket = (np.searchsorted(starts, np.arange(((t.count - 1) >> bshift) + 1, dtype=np.int64) << bshift,
                              side="right") - 1).astype(np.int16)
    n = len(sh)
    raw = np.zeros(n * 8 + 8, np.int64)  # 64-byte aligned records
    at = (-raw.ctypes.data // 8) % 8
    orbits = raw[at:at + n * 8].reshape(n, 8)
    orbits[:, 0], orbits[:, 1] = starts[:-1], starts[1:]
    orbits[:, 2] = np.array(sh, np.int64) | (np.array(comp_off, np.int64) << 8) | ((np.array(row, np.int64) + 1) << 40)
    orbit_vals = orbits.view(np.float32)
    orbit_vals[:, 6:14] = np.stack(vals)
    return ShellPointTables(orbits, orbit_vals, np.ascontiguousarray(bucket), bshift,
                            np.ascontiguousarray(np.concatenate(comps), dtype=np.uint32),
                            np.ascontiguousarray(_sign_rows(), dtype=np.uint8), t.count)


def point_py(idx, bucket, bshift, orbits, orbit_vals, comps, signs, out, o):
    """out[o:o + 8] = the point of index idx (int64 in [0, count)) as float32, through `ShellPointTables`:
    exactly `unrank`'s float64 point rounded to float32 (compiled here and inlined by the attention kernel)."""
    j = np.int64(bucket[idx >> bshift])
    while orbits[j, 1] <= idx:
        j += 1
    rest = idx - orbits[j, 0]
    packed = orbits[j, 2]
    sh = packed & 255
    word = np.int64(comps[((packed >> 8) & 0xFFFFFFFF) + (rest >> sh)])
    r = ((packed >> 40) & 1023) - 1
    if r < 0:
        r = ~(word >> 24) & 255
    mask = np.int64(signs[r, rest & ((np.int64(1) << sh) - 1)])
    for k in range(8):  # the sign as a float factor: no branch on a random bit
        out[o + k] = orbit_vals[j, 6 + ((word >> (21 - 3 * k)) & 7)] * np.float32(1 - 2 * ((mask >> k) & 1))


def _decode_points_py(index, bucket, bshift, orbits, orbit_vals, comps, signs, out, lo, hi):
    for b in range(lo, hi):
        _point(index[b], bucket, bshift, orbits, orbit_vals, comps, signs, out, b * 8)
    return 0


_point = None
_DECODE_POINTS = None


def decode_points(index: np.ndarray, tables) -> np.ndarray:
    """index int64 [n] (each in [0, count)) -> float32 [n, 8] through the decomposed tables (`point_py`,
    tables a `ShellPointTables`) or the compact ones (`compact_point_py`, a `CompactPointTables`): equal to
    unrank(index).astype(float32) (ValueError for an index outside [0, count) or other tables)."""
    global _point, _DECODE_POINTS, _compact_point, _DECODE_COMPACT
    if not isinstance(tables, (ShellPointTables, CompactPointTables)):
        raise ValueError(f"tables must be ShellPointTables or CompactPointTables, got {type(tables).__name__}")
    index = np.ascontiguousarray(index, dtype=np.int64)
    if index.ndim != 1:
        raise ValueError(f"index must be 1-d, got shape {index.shape}")
    if index.size and (int(index.min()) < 0 or int(index.max()) >= tables.count):
        raise ValueError(f"E8 shell index out of range [0, {tables.count})")
    if _DECODE_POINTS is None:
        _kernels()
        with _LOCK:
            _point = njit_cached(nogil=True)(point_py)
            _DECODE_POINTS = njit_cached(nogil=True)(_decode_points_py)
            _compact_point = njit_cached(nogil=True)(compact_point_py)
            _DECODE_COMPACT = njit_cached(nogil=True)(_decode_compact_py)
    out = np.empty(index.shape[0] * BLOCK, np.float32)
    kernel = _DECODE_COMPACT if isinstance(tables, CompactPointTables) else _DECODE_POINTS
    kernel(index, *tables.args(), out, 0, index.shape[0])
    return out.reshape(-1, BLOCK)


# --------------------------------------------------------------------------- compact point tables (<= 16-bit indices)
COMPACT_MAX_POINTS = 1 << 16  # indices of at most 16 bits (b <= 2): 8 B per point, <= 512 KB
HALF_LIMIT = 1 << 11          # distinct 4-d halves (up to sign) a compact word can name (11 bits each)
BAD_WORD_BIT = 1 << 31        # set in the words of indices beyond the code's points


@dataclass(frozen=True, eq=False)
class CompactPointTables:
    """Every point of a code of at most COMPACT_MAX_POINTS points (b <= 2) as 8 signed bytes, and as one 32-bit
    word naming its two 4-d halves (what attention on codes reads at b <= 2, instead of the decomposed tables'
    four dependent reads per block). An E8 point has integer or half-integer coordinates, so twice the point
    of the unit-free shell fits in int8 (|2 x| <= 2 sqrt(2 m)); the level's float64 scale
    s_g = r_g / (2 sqrt(2 m)) (unrank's) turns it into unrank's float64 point, rounded once to float32
    (`compact_point_py`, `decode_points`).

    points int8 [count, 8]: 2 x the point before the level's scaling (the origin: zeros); offsets int64 [G]:
    each level's first index (ascending, offsets[0] = 0); scales float64 [G]: s_g (0 at the origin).
    The same points as two 4-d halves (what the attention step reads: per-query score tables over the halves,
    FibQuant-style, instead of decoding each block): halves float32 [H, 4] the distinct doubled halves up to
    sign (the first non-zero coordinate positive; H = 25 / 85 / 205 / 541 at b = 1 / 1.5 / 1.75 / 2, at most
    HALF_LIMIT), words uint32 [2^ceil(log2 count)] one word per index: first half | its sign << 11 | second
    half << 12 | its sign << 23 | level << 24 (sign bit 1: negated), so points[i] = concat(+-halves[w & 2047],
    +-halves[w >> 12 & 2047]) with w = words[i]; the indices from count up (no point) hold index 0's word with
    bit 31 set (BAD_WORD_BIT: a step reads any index of the code's bits without a bounds check and counts them).
    scales32 float32 [G]: s_g rounded to float32."""

    points: np.ndarray
    offsets: np.ndarray
    scales: np.ndarray
    halves: np.ndarray
    words: np.ndarray
    scales32: np.ndarray
    count: int

    def args(self) -> tuple:
        return self.points, self.offsets, self.scales

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.points, self.offsets, self.scales, self.halves, self.words, self.scales32))


@lru_cache(maxsize=16)
def compact_point_tables(levels: ShellLevels) -> CompactPointTables:
    """The compact decode tables of `levels` (cached per levels); ValueError for a code of more than
    COMPACT_MAX_POINTS points (b > 2: use `point_tables`)."""
    t = shell_tables(levels)
    if t.count > COMPACT_MAX_POINTS:
        raise ValueError(f"compact point tables hold at most {COMPACT_MAX_POINTS} points (16-bit indices), "
                         f"this code has {t.count}: use point_tables")
    if int(np.abs(t.lead2).max(initial=0)) > 127:
        raise ValueError("a doubled leader coordinate does not fit in int8")
    points = np.zeros((t.count, BLOCK), np.int8)
    for g in range(len(levels.shells)):
        for j in range(t.lv_lo[g], t.lv_hi[g]):  # every orbit of the level, in index order (module docstring)
            perms = _orbit_permutations(t.lead2[j])                             # [P, 8], rank order
            nsign = int(t.nsign[j])
            if t.half[j]:  # sign bits of positions 0..6, the 8th sign by the leader's parity
                bits = (np.arange(nsign)[:, None] >> np.arange(BLOCK - 1)) & 1
                bits = np.concatenate([bits, (int(t.parity[j]) - bits.sum(1, keepdims=True)) % 2], axis=1)
                signs = np.broadcast_to(1 - 2 * bits, (len(perms), nsign, BLOCK))
            else:          # one bit per non-zero coordinate, in position order
                nz = int((t.lead2[j] != 0).sum())
                bits = (np.arange(nsign)[:, None] >> np.arange(nz)) & 1             # [S, nz]
                at = np.nonzero(perms)[1].reshape(len(perms), nz)                   # non-zero positions per rank
                signs = np.ones((len(perms), nsign, BLOCK), np.int64)
                signs[np.arange(len(perms))[:, None, None], np.arange(nsign)[None, :, None], at[:, None, :]] = \
                    (1 - 2 * bits)[None]
            start = int(t.offsets[g] + t.orbit_off[j])
            points[start:start + len(perms) * nsign] = (perms[:, None, :] * signs).reshape(-1, BLOCK)
    scales = np.ascontiguousarray(t.radii * t.scale, dtype=np.float64)  # unrank's s_g (float64, same product)
    quarter = points.reshape(-1, BLOCK // 2).astype(np.int64)
    lead = quarter[np.arange(len(quarter)), np.argmax(quarter != 0, axis=1)]
    neg = (lead < 0).astype(np.int64)                     # the half is stored negated (the zero half: not)
    halves, inverse = np.unique(quarter * (1 - 2 * neg)[:, None], axis=0, return_inverse=True)
    if len(halves) > HALF_LIMIT or len(levels.shells) > 127:
        raise ValueError(f"{len(halves)} distinct 4-d halves / {len(levels.shells)} levels: more than a 32-bit "
                         f"word per point names ({HALF_LIMIT} / 127)")
    pairs = (inverse.reshape(-1) | (neg << 11)).reshape(t.count, 2)
    level = np.searchsorted(t.offsets, np.arange(t.count), side="right") - 1
    words = np.empty(1 << max(0, (t.count - 1).bit_length()), np.uint32)
    words[:t.count] = pairs[:, 0] | (pairs[:, 1] << 12) | (level << 24)
    words[t.count:] = words[0] | BAD_WORD_BIT
    return CompactPointTables(points, np.ascontiguousarray(t.offsets, dtype=np.int64), scales,
                              np.ascontiguousarray(halves, dtype=np.float32), words, scales.astype(np.float32),
                              t.count)


def _orbit_permutations(leader: np.ndarray) -> np.ndarray:
    """int64 [P, 8]: the distinct arrangements of a leader's values (int64 [8]) in lexicographic order, larger
    values first (rank 0: the leader itself): the numbering's multiset-permutation rank."""
    global _PERMUTATIONS
    if _PERMUTATIONS is None:
        import itertools
        _PERMUTATIONS = np.array(list(itertools.permutations(range(BLOCK))), dtype=np.int64)
    return _arrangements(tuple(int(v) for v in leader)).copy()


@lru_cache(maxsize=256)
def _arrangements(leader: tuple[int, ...]) -> np.ndarray:
    shift = 8 * (BLOCK - 1 - np.arange(BLOCK))  # one byte per position (values 0..127), position 0 on top
    keys = np.unique((np.array(leader, np.int64)[_PERMUTATIONS] << shift).sum(1))[::-1]
    return (keys[:, None] >> shift) & 255


def compact_point_py(idx, points, offsets, scales, out, o):
    """out[o:o + 8] = the point of index idx (int64 in [0, count)) as float32 through `CompactPointTables`:
    the int8 doubled coordinates times the level's float64 scale, rounded once (= unrank's point rounded to
    float32; compiled here and inlined by the attention kernel)."""
    g = 0
    for lv in range(1, offsets.shape[0]):  # the level: offsets ascending, a few compares, no branch
        g += np.int64(idx >= offsets[lv])
    s = scales[g]
    for k in range(8):
        out[o + k] = np.float32(np.float64(points[idx, k]) * s)


def _decode_compact_py(index, points, offsets, scales, out, lo, hi):
    for b in range(lo, hi):
        _compact_point(index[b], points, offsets, scales, out, b * 8)
    return 0


_compact_point = None
_DECODE_COMPACT = None


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
