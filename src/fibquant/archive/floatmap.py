"""The float variant: the paper's 2-D iterated map with float64 anchor points.

A regular N-gon has vertex V(c) = exp(2 pi i c / N) per symbol, and a segment of L symbols
c_0..c_{L-1} maps to the anchor point

    p_L = sum_j (1 - r) r^(L-1-j) V(c_j)          (p_0 = 0, closed form of
    p_k = V(c_k) + r (p_{k-1} - V(c_k)))

computed for all segments at once with one matrix product. Decoding walks backward from
the anchor: c = the vertex whose angular cell holds p, then p <- (p - (1-r) V(c)) / r.

Safety of r. Cells are disjoint (the map is invertible) for r <= r*(N) =
1 / (2 (1 + sum_{j=1}^{floor(N/4)} cos(2 pi j / N))); below the disc bound
sin(pi/N) / (1 + sin(pi/N)) the cells' bounding discs are disjoint too, which makes the
angular decision rule exact and ball queries exact. The default is just below both.

Precision. Each backward step multiplies the error by 1/r, so one float64 point resolves
about (53 - guard) / log2(1/r) symbols: L = 19 for N=16, 8 for N=256, 5 for N=4096.
Every segment is decoded at write time with exactly the reader's IEEE operations
(subtract, multiply, divide: correctly rounded everywhere; no FMA) and must round-trip with
every angular decision at least `DECISION_MARGIN` of a cell away from a boundary (so an
atan2 that differs by a few ulps on another platform cannot flip it); a segment that fails
is stored in the exact radix form and flagged.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .exact import RadixCoder
from .payload import PayloadCoder
from .search import PointIndex

MANTISSA_BITS = 53
GUARD_BITS = 1  # measured: 0 fallbacks in 2e5 uniform symbols for N = 16, 256, 4096
DECISION_MARGIN = 1e-6  # in units of one angular cell
DEFAULT_R_FACTOR = 0.999  # strictly below the disc bound, so cells keep a gap


def r_star(alphabet_size: int) -> float:
    """Largest contraction with disjoint symbol cells."""
    n = alphabet_size
    return 1.0 / (2.0 * (1.0 + sum(math.cos(2 * math.pi * j / n) for j in range(1, n // 4 + 1))))


def r_disc(alphabet_size: int) -> float:
    """Largest contraction with disjoint bounding discs (exact ball queries)."""
    s = math.sin(math.pi / alphabet_size)
    return s / (1.0 + s)


def default_r(alphabet_size: int) -> float:
    return DEFAULT_R_FACTOR * min(r_star(alphabet_size), r_disc(alphabet_size))


def segment_length(r: float) -> int:
    """Symbols one float64 anchor resolves with GUARD_BITS to spare."""
    return max(1, int((MANTISSA_BITS - GUARD_BITS) / math.log2(1.0 / r)))


@dataclass(frozen=True)
class FloatMapCoder(PayloadCoder):
    """Float64 iterated-map payload coder with verified segments and an exact fallback
    (the "float" variant).

    encode(symbols int [n]) -> payload bytes; decode(payload, n) -> int64 [n].
    Payload: anchors float64 [n_seg, 2] | fallback bitmap | exact bytes of flagged segments.
    """

    variant: ClassVar[str] = "float"
    segment_bytes: ClassVar[int] = 16  # one anchor, two float64 (fallback segments cost extra)
    alphabet_size: int
    r: float | None = None
    segment: int = field(init=False)

    def __post_init__(self) -> None:
        n = self.alphabet_size
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 2 <= int(n) <= 1 << 20:
            raise ValueError(f"float variant needs alphabet_size in 2..{1 << 20}, got {n!r}")
        n = int(n)
        object.__setattr__(self, "alphabet_size", n)
        r = default_r(n) if self.r is None else self.r
        if isinstance(r, bool) or not isinstance(r, (float, int)) or not math.isfinite(r) or not 0 < r < 1:
            raise ValueError(f"contraction r must be a float in (0, 1), got {self.r!r}")
        if r > r_star(n):
            raise ValueError(
                f"contraction r={r:g} exceeds r*(N)={r_star(n):.6g} for N={n}: symbol cells would "
                f"overlap and the map would not be invertible")
        object.__setattr__(self, "r", float(r))
        object.__setattr__(self, "segment", segment_length(float(r)))
        angles = 2 * np.pi * np.arange(n) / n
        # (1 - r) V(c): the exact float64 values both the vectorised and scalar paths use.
        ax, ay = (1 - r) * np.cos(angles), (1 - r) * np.sin(angles)
        object.__setattr__(self, "_ax", ax)
        object.__setattr__(self, "_ay", ay)
        object.__setattr__(self, "_ax_list", ax.tolist())
        object.__setattr__(self, "_ay_list", ay.tolist())
        object.__setattr__(self, "_weights", (1 - r) * float(r) ** np.arange(self.segment - 1, -1, -1))
        object.__setattr__(self, "_fallback", RadixCoder(n))

    @property
    def exact_segment_bytes(self) -> int:
        return self._fallback.payload_size(self.segment)

    # --------------------------------------------------------------- reference
    def anchor_reference(self, symbols) -> tuple[float, float]:
        """The recurrence itself, one symbol at a time (specification of `anchors`)."""
        x = y = 0.0
        for c in symbols:
            vx, vy = math.cos(2 * math.pi * c / self.alphabet_size), math.sin(2 * math.pi * c / self.alphabet_size)
            x, y = vx + self.r * (x - vx), vy + self.r * (y - vy)
        return x, y

    # -------------------------------------------------------------- vectorised
    def anchors(self, symbols: np.ndarray) -> np.ndarray:
        """int [n_seg * L] -> float64 [n_seg, 2] anchor points (closed form, one matmul)."""
        table = symbols.reshape(-1, self.segment)
        x = self._ax[table] @ (self._weights / (1 - self.r))
        y = self._ay[table] @ (self._weights / (1 - self.r))
        return np.stack([x, y], axis=1)

    def walk_back(self, anchors: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Decode `steps` symbols backward from anchors [m, 2].

        Returns (symbols int64 [m, steps] in forward order, margin ok bool [m])."""
        m = anchors.shape[0]
        x, y = anchors[:, 0].copy(), anchors[:, 1].copy()
        out = np.empty((m, steps), dtype=np.int64)
        ok = np.ones(m, dtype=bool)
        scale = self.alphabet_size / (2 * np.pi)
        for k in range(steps - 1, -1, -1):
            t = np.arctan2(y, x) * scale
            nearest = np.rint(t)
            ok &= np.abs(t - nearest) < 0.5 - DECISION_MARGIN
            c = nearest.astype(np.int64) % self.alphabet_size
            out[:, k] = c
            x = (x - self._ax[c]) / self.r
            y = (y - self._ay[c]) / self.r
        return out, ok

    def encode(self, symbols: np.ndarray) -> bytes:
        """Validated int array [n] -> payload (anchors, fallback bitmap, fallback segments)."""
        n = symbols.shape[0]
        seg = self.segment
        n_seg = -(-n // seg)
        full = n // seg
        parts_anchor = np.zeros((n_seg, 2), dtype=np.float64)
        bad = np.zeros(n_seg, dtype=bool)
        if full:
            body = symbols[:full * seg]
            parts_anchor[:full] = self.anchors(body)
            decoded, ok = self.walk_back(parts_anchor[:full], seg)
            bad[:full] = ~ok | np.any(decoded != body.reshape(full, seg), axis=1)
        if n_seg > full:  # a short last segment: its own anchor from p_0 = 0
            tail = symbols[full * seg:]
            w = self._weights[seg - tail.shape[0]:] / (1 - self.r)
            parts_anchor[full] = [self._ax[tail] @ w, self._ay[tail] @ w]
            decoded, ok = self.walk_back(parts_anchor[full:], tail.shape[0])
            bad[full] = not ok[0] or bool(np.any(decoded[0] != tail))
        chunks = [parts_anchor.astype("<f8").tobytes(), np.packbits(bad, bitorder="little").tobytes()]
        for s in np.flatnonzero(bad):
            chunk = symbols[s * seg:(s + 1) * seg]
            parts_anchor[s] = 0.0
            chunks.append(self._fallback.encode(chunk))
        chunks[0] = parts_anchor.astype("<f8").tobytes()  # flagged anchors zeroed: no stale data
        return b"".join(chunks)

    def _layout(self, payload, count: int) -> tuple[int, np.ndarray, int]:
        n_seg = -(-count // self.segment)
        bitmap_at = 16 * n_seg
        bitmap = np.unpackbits(np.frombuffer(payload, np.uint8, count=(n_seg + 7) // 8, offset=bitmap_at),
                               bitorder="little")[:n_seg].astype(bool)
        return n_seg, bitmap, bitmap_at + (n_seg + 7) // 8

    def check_payload(self, payload, count: int) -> None:
        """The payload's length must be what its fallback bitmap implies."""
        n_seg = -(-count // self.segment)
        bitmap_at, bitmap_bytes = 16 * n_seg, (n_seg + 7) // 8
        if len(payload) < bitmap_at + bitmap_bytes:
            raise ValueError("float payload shorter than its anchors and bitmap")
        flags = int.from_bytes(payload[bitmap_at:bitmap_at + bitmap_bytes], "little")
        if flags >> n_seg:
            raise ValueError("float payload bitmap has bits beyond its last segment")
        if len(payload) != bitmap_at + bitmap_bytes + flags.bit_count() * self.exact_segment_bytes:
            raise ValueError("payload length does not match its fallback bitmap")

    def decode(self, payload, count: int) -> np.ndarray:
        seg = self.segment
        n_seg, bitmap, fb_at = self._layout(payload, count)
        anchors = np.frombuffer(payload, "<f8", count=2 * n_seg).reshape(n_seg, 2)
        out = np.empty(n_seg * seg, dtype=np.int64)
        full = count // seg
        if full:
            out[:full * seg] = self.walk_back(anchors[:full], seg)[0].reshape(-1)
        if n_seg > full:
            tail_len = count - full * seg
            out[full * seg:full * seg + tail_len] = self.walk_back(anchors[full:], tail_len)[0][0]
        seg_bytes = self.exact_segment_bytes
        for rank, s in enumerate(np.flatnonzero(bitmap)):
            length = min(seg, count - s * seg)
            start = fb_at + rank * seg_bytes
            out[s * seg:s * seg + length] = self._fallback.decode(payload[start:start + seg_bytes], length)
        return out[:count]

    def decode_at(self, payload, count: int, index: int, base: int = 0) -> int:
        """One symbol of the payload at payload[base:]: walk back from its segment's anchor
        (Python floats, the same IEEE operations as `walk_back`)."""
        seg = self.segment
        s, t = divmod(index, seg)
        n_seg = -(-count // seg)
        bitmap_at = base + 16 * n_seg
        flags = int.from_bytes(payload[bitmap_at:bitmap_at + s // 8 + 1], "little")
        if flags >> s & 1:
            rank = (flags & ((1 << s) - 1)).bit_count()
            start = bitmap_at + (n_seg + 7) // 8 + rank * self.exact_segment_bytes
            return self._fallback.decode_at(payload, seg, t, start)
        x, y = struct.unpack_from("<dd", payload, base + 16 * s)
        length = min(seg, count - s * seg)
        ax, ay, r = self._ax_list, self._ay_list, self.r
        scale = self.alphabet_size / (2 * math.pi)
        n = self.alphabet_size
        for _ in range(length - 1 - t):
            c = int(round(math.atan2(y, x) * scale)) % n
            x = (x - ax[c]) / r
            y = (y - ay[c]) / r
        return int(round(math.atan2(y, x) * scale)) % n

    def search_index(self, symbols: np.ndarray) -> PointIndex:
        return PointIndex(self, symbols)

    # ------------------------------------------------------------ geometry
    def suffix_points(self, symbols: np.ndarray, depth: int) -> np.ndarray:
        """Point of the last `depth` symbols at every position: float64 [n, 2].

        Position i gets sum_{j<depth} (1-r) r^j V(c_{i-j}) (missing history counts as the
        centre, 0); points sharing a suffix of length s lie in the disc of radius r^s
        around `cell_centre(suffix)`."""
        n = symbols.shape[0]
        x = np.zeros(n)
        y = np.zeros(n)
        for j in range(depth):
            w = self.r ** j
            x[j:] += w * self._ax[symbols[:n - j]]
            y[j:] += w * self._ay[symbols[:n - j]]
        return np.stack([x, y], axis=1)

    def cell_centre(self, suffix) -> tuple[float, float]:
        """Centre of the cell of all points whose latest symbols are `suffix` (oldest first)."""
        x = y = 0.0
        for j, c in enumerate(reversed(list(suffix))):
            x += self.r ** j * self._ax_list[int(c)]
            y += self.r ** j * self._ay_list[int(c)]
        return x, y
