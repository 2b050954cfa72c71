"""The exact variant of the iterated map: radix packing in integer arithmetic.

In one dimension with contraction r = 1/N and vertices V(c) = c/(N-1), the iterated map
p_k = V(c_k) + r (p_{k-1} - V(c_k)) started at p_0 = 0 gives N^L p_L = sum_j c_j N^j
(0-based j): the point of a group of L symbols is an integer key whose most significant
digit is the most recent symbol. Integer arithmetic makes it lossless by construction and
identical on every platform.

Keys are bit-tight up to byte rounding: G symbols form one key stored little-endian in B
bytes, with (G, B) chosen to minimise B/G subject to N^G <= 2^64 (N=16: G=2, B=1;
N=256: G=1, B=1; N=4096: G=2, B=3). A block payload of n symbols is ceil(n/G) keys; the
last key is zero-padded.

`encode_reference` / `decode_reference` (plain Python integers, one symbol at a time) are
the specification the vectorised paths are tested against.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MAX_ALPHABET = 1 << 32
_WORK_DTYPES = {1: np.uint8, 2: np.uint16, 3: np.uint32, 4: np.uint32}


def choose_grouping(alphabet_size: int) -> tuple[int, int]:
    """(symbols per key G, bytes per key B) minimising bytes per symbol; ties -> smaller G."""
    best: tuple[float, int, int] | None = None
    group = 1
    while alphabet_size ** group <= 1 << 64:
        key_bytes = math.ceil(((alphabet_size ** group) - 1).bit_length() / 8)
        cost = key_bytes / group
        if best is None or cost < best[0] - 1e-12:
            best = (cost, group, key_bytes)
        group += 1
    assert best is not None
    return best[1], best[2]


@dataclass(frozen=True)
class RadixCodec:
    """Exact radix codec for symbols in [0, alphabet_size).

    encode(symbols int [n]) -> bytes of ceil(n/G)*B; decode(payload, n) -> int64 [n].
    """

    alphabet_size: int
    group: int = field(init=False)
    key_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        n = self.alphabet_size
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 2 <= int(n) <= MAX_ALPHABET:
            raise ValueError(f"alphabet_size must be an integer in 2..{MAX_ALPHABET}, got {n!r}")
        object.__setattr__(self, "alphabet_size", int(n))
        group, key_bytes = choose_grouping(int(n))
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "key_bytes", key_bytes)
        bits = int(n).bit_length() - 1
        object.__setattr__(self, "_pow2_bits", bits if 1 << bits == n else 0)
        object.__setattr__(self, "_powers", [int(n) ** j for j in range(group)])

    # ------------------------------------------------------------------ sizes
    @property
    def bits_per_symbol(self) -> float:
        """Stored bits per symbol of a full key."""
        return 8.0 * self.key_bytes / self.group

    def payload_size(self, count: int) -> int:
        return -(-count // self.group) * self.key_bytes

    # --------------------------------------------------------------- reference
    def encode_reference(self, symbols) -> bytes:
        """Plain-Python specification: key = sum_j c_j N^j over each group of G symbols."""
        out = bytearray()
        syms = [int(s) for s in symbols]
        for start in range(0, len(syms), self.group):
            key = 0
            for c in reversed(syms[start:start + self.group]):
                key = key * self.alphabet_size + c  # Horner: the latest symbol ends up most significant
            out += key.to_bytes(self.key_bytes, "little")
        return bytes(out)

    def decode_reference(self, payload: bytes, count: int) -> list[int]:
        out: list[int] = []
        for g in range(-(-count // self.group)):
            key = int.from_bytes(payload[g * self.key_bytes:(g + 1) * self.key_bytes], "little")
            for _ in range(self.group):
                key, c = divmod(key, self.alphabet_size)
                out.append(c)
        return out[:count]

    # -------------------------------------------------------------- vectorised
    def encode(self, symbols: np.ndarray) -> bytes:
        """Validated int array [n] -> payload bytes (vectorised)."""
        n = symbols.shape[0]
        groups = -(-n // self.group)
        width = self.key_bytes
        work = _WORK_DTYPES.get(width, np.uint64)
        if groups * self.group != n:
            padded = np.zeros(groups * self.group, dtype=work)
            padded[:n] = symbols
        else:
            padded = symbols.astype(work, copy=False)
        table = padded.reshape(groups, self.group)
        keys = table[:, self.group - 1].astype(work)
        shift = self._pow2_bits
        for j in range(self.group - 2, -1, -1):
            if shift:
                keys = (keys << work(shift)) | table[:, j]
            else:
                keys = keys * work(self.alphabet_size) + table[:, j]
        return _keys_to_bytes(keys, width)

    def decode(self, payload, count: int) -> np.ndarray:
        """payload (bytes-like, at least payload_size(count) bytes) -> int64 [count]."""
        groups = -(-count // self.group)
        raw = np.frombuffer(payload, dtype=np.uint8, count=groups * self.key_bytes)
        keys = _bytes_to_keys(raw, self.key_bytes)
        if self.group == 1:
            return keys[:count].astype(np.int64)
        if self._pow2_bits:
            shifts = np.arange(self.group, dtype=keys.dtype) * keys.dtype.type(self._pow2_bits)
            digits = (keys[:, None] >> shifts) & keys.dtype.type(self.alphabet_size - 1)
        else:
            keys = keys.astype(np.uint64)
            powers = np.array(self._powers, dtype=np.uint64)
            digits = (keys[:, None] // powers) % np.uint64(self.alphabet_size)
        return digits.reshape(-1)[:count].astype(np.int64)

    def decode_at(self, payload, index: int, base: int = 0) -> int:
        """Symbol `index` of the payload at payload[base:]: one key read, one div/mod."""
        g, t = divmod(index, self.group)
        start = base + g * self.key_bytes
        key = int.from_bytes(payload[start:start + self.key_bytes], "little")
        if self._pow2_bits:
            return (key >> (t * self._pow2_bits)) & (self.alphabet_size - 1)
        return (key // self._powers[t]) % self.alphabet_size

    def check_payload(self, payload, count: int) -> None:
        """Every key of a payload must be < N^G (else the bytes are not a valid encoding)."""
        groups = -(-count // self.group)
        raw = np.frombuffer(payload, dtype=np.uint8, count=groups * self.key_bytes)
        keys = _bytes_to_keys(raw, self.key_bytes).astype(np.uint64)
        limit = self.alphabet_size ** self.group
        if limit < 1 << 64 and keys.size and int(keys.max()) >= limit:
            raise ValueError("payload holds a key >= N^G")
        last = count - (groups - 1) * self.group
        if groups and last < self.group and int(keys[-1]) >= self.alphabet_size ** last:
            raise ValueError("payload's padding digits are not zero")


def _keys_to_bytes(keys: np.ndarray, width: int) -> bytes:
    if width in (1, 2, 4, 8):
        return keys.astype(f"<u{width}", copy=False).tobytes()
    full = 8 if width > 4 else 4
    wide = keys.astype(f"<u{full}", copy=False)
    return np.ascontiguousarray(wide.view(np.uint8).reshape(keys.shape[0], full)[:, :width]).tobytes()


def _bytes_to_keys(raw: np.ndarray, width: int) -> np.ndarray:
    if width in (1, 2, 4, 8):
        return raw.view(f"<u{width}")
    full = 8 if width > 4 else 4
    wide = np.zeros((raw.shape[0] // width, full), dtype=np.uint8)
    wide[:, :width] = raw.reshape(-1, width)
    return wide.view(f"<u{full}").reshape(-1)
