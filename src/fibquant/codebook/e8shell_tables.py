"""The decode tables of E8 shell codes that attention on codes reads (numba).

Attention on codes decodes blocks through `point_tables` (`ShellPointTables`, `point_py`: the index's orbit
record, its composition's slot word, its sign row; no search, no division) or, for codes of at most 2^16
points, `compact_point_tables` (`CompactPointTables`: every point as 8 int8, the doubled coordinates, times the
level's scale, `compact_point_py`; and as a word naming its two 4-d halves, which the step scores through
per-query tables); both decoders give exactly `unrank`'s points rounded to float32 (`decode_points`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .._numba import numba_available
from .e8shell import BLOCK, ShellLevels, shell_tables

_LOCK = threading.Lock()


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
        if not numba_available():
            raise RuntimeError("E8 shell codes need numba (a fibquant dependency), which does not import")
        import numba
        with _LOCK:
            _point = numba.njit(nogil=True, cache=True)(point_py)
            _DECODE_POINTS = numba.njit(nogil=True, cache=True)(_decode_points_py)
            _compact_point = numba.njit(nogil=True, cache=True)(compact_point_py)
            _DECODE_COMPACT = numba.njit(nogil=True, cache=True)(_decode_compact_py)
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
