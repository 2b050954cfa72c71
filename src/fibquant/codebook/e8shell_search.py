"""The encoders of E8 shell codes: the exact leader scan and the lattice search (numba).

The reference search (`e8shell.exhaustive_search`) is the spec: over the materialised codebook (`codebook_points`,
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
"""
from __future__ import annotations

import threading
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from .._numba import njit_cached, run_split
from . import e8shell
from .e8shell import _MIN_BLOCKS_PER_THREAD, BLOCK, TIE, ShellTables

_TIE_IP = 1e-11         # the same for a level's inner products (2 r / ||s|| <= 1 for unit-vector blocks)
_KERNELS = None
_LOCK = threading.Lock()
# e8shell's compiled block helpers, bound by _kernels() before the kernels that call them compile
_distinct = _point_index = _sort8 = _sort_abs = _read_block = None


class ShellArrays(NamedTuple):
    """`ShellTables.args()` as one kernel argument (numba passes a named tuple of arrays as one struct)."""

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


class LatticeTables(NamedTuple):
    """The lattice search's own tables: keys int64 [L] (each doubled leader packed 5 bits per value, position 0
    most significant), lv_mid int64 [G] (each level's first half leader), m8 int64 [G] (8 m per level), ml_ptr
    int64 [M + 2] and ml_lv int64 [G] (the levels of shell m: ml_lv[ml_ptr[m]:ml_ptr[m + 1]], M the largest
    shell), sroot float64 [G] (sqrt(2 m)), inv_r float64 [G] (1 / r; 0 at the origin), inv_norm float64 [M + 1]
    (1 / sqrt(8 m), the doubled shell's inverse norm; 0 at m = 0)."""

    keys: np.ndarray
    lv_mid: np.ndarray
    m8: np.ndarray
    ml_ptr: np.ndarray
    ml_lv: np.ndarray
    sroot: np.ndarray
    inv_r: np.ndarray
    inv_norm: np.ndarray


@lru_cache(maxsize=16)
def lattice_tables(tables: ShellTables) -> LatticeTables:
    """The lattice search's tables (`LatticeTables`), cached per tables object."""
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
    return LatticeTables(np.ascontiguousarray(keys), lv_mid, m8, np.ascontiguousarray(ml_ptr),
                         np.ascontiguousarray(order.astype(np.int64)), sroot, inv_r, inv_norm)

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

_LATTICE_RHO = (1e-3, 1e3)  # block norms the lattice search takes (its tie margins stay >> _TIE_IP)
_R2_CAP = 3.0               # a larger enumeration ball: the block goes to the leader search
_CANDIDATES = 64            # lattice points kept per block (more: the leader search)
_LATTICE_MIN_LEADERS = 50   # leaders per level from which `shell_search` takes the lattice search
_SURVIVE_D = 1e-8           # candidates within this of the smallest cheap d get the scan's exact d
_NEAR_D = 1e-9              # exact d (and inner products) this close to the best must tie ...
_TIE_D = 1e-12              # ... within this (exact ties), else the block goes to the leader search


def _lattice_search_py(y_all, shell, lattice, index, level, done, start, stop):
    """Blocks [start, stop) of y_all [n, 8] -> index [n], level [n] and done[b] = 1 where the lattice search
    settles the block (0: left to the leader search). shell: the code's `ShellArrays`; lattice: its
    `LatticeTables` (`lattice_tables`).

    A level's points are r_g s / |s| for s on E8's shell m_g, and d = rho^2 + r^2 - 2 r rho cos(y, s). An
    incumbent D (the E8 point nearest to z = sqrt(2 m) y / rho, m the shell of the level nearest in radius:
    Conway-Sloane, each D8 coset rounded and its parity fixed) bounds the levels that can matter
    ((rho - r)^2 <= D) and per level the cosine they need; every s meeting one of those lies in one ball
    around z (|s - z|^2 = |s|^2 + |z|^2 - 2 |s| |z| cos), whose E8 points are enumerated (both D8 cosets, a
    depth-first walk over the coordinates the ball lets leave their nearest value, carrying |s|^2, <y, s>
    and the parity). The candidates' leaders then get the scan's exact inner products and d: the block is
    settled when the best d's and inner products tie exactly (_TIE_D) or are apart by more than _NEAR_D
    (then the scan's sequential tie rules pick the lowest level, then the lowest leader, as here); anything
    else is left to the leader search.

    It stays one function: a numba nopython kernel whose block loop carries the incumbent, the level bounds,
    the ball's depth-first walk (its stack of coordinates, |s|^2, <y, s> and parity) and the best and
    second-best candidates from one phase to the next; split into helpers, each phase would pass that state in
    and out by arguments, and keeping it in one loop's locals is what lets LLVM hold it in registers."""
    radii, scale, lv_lo, lv_hi, offsets, lead2, leadf, half, parity, orbit_off, mult, nsign = shell
    keys, lv_mid, m8, ml_ptr, ml_lv, sroot, inv_r, inv_norm = lattice
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

def _kernels():
    """(scan kernel, lattice kernel), compiled once; `e8shell._kernels` first compiles the block helpers, bound
    here as this module's globals (numba resolves a kernel's callees among its module's globals)."""
    global _KERNELS, _distinct, _point_index, _sort8, _sort_abs, _read_block
    if _KERNELS is None:
        with _LOCK:
            if _KERNELS is None:
                e8shell._kernels()
                _distinct, _point_index = e8shell._distinct, e8shell._point_index
                _sort8, _sort_abs, _read_block = e8shell._sort8, e8shell._sort_abs, e8shell._read_block
                _KERNELS = (njit_cached(nogil=True)(_search_py),
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
    run_split(_kernels()[1], (blocks, ShellArrays(*tables.args()), lattice_tables(tables), index, level, done), n, 64,
              _MIN_BLOCKS_PER_THREAD, "fibquant-e8shell")
    return index, level, done
