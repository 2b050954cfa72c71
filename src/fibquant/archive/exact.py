"""The exact variant of the iterated map: radix packing in integer arithmetic.

In one dimension with contraction r = 1/N and vertices V(c) = c/(N-1), the iterated map
p_k = V(c_k) + r (p_{k-1} - V(c_k)) started at p_0 = 0 gives N^G p_G = sum_j c_j N^j
(0-based j): the point of a group of G symbols is an integer key whose most significant
digit is the most recent symbol. Integer arithmetic makes it lossless by construction and
identical on every platform.

Keys are bit-tight: G symbols (N^G <= 2^64) form one key of w = bitlen(N^G - 1) bits.
When whole bytes cost at most 1 % more (every power of two N, and e.g. N = 1000) keys are
stored byte-aligned in B bytes (N=16: G=2, B=1; N=256: G=1, B=1; N=4096: G=2, B=3), the
fast path; otherwise (e.g. N = 139 or 65537, where bytes would cost 12-17 % more) they are
bit-packed at w bits each, little-endian. Either way bits/symbol <= log2(N) (1 + 1/32).
A payload of n symbols is ceil(n/G) keys; the last key is zero-padded.

`encode_reference` / `decode_reference` (plain Python integers, one symbol at a time) are
the specification the vectorised paths are tested against.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .format import ArchiveError
from .payload import PayloadCoder
from .search import SuffixKeyIndex

MAX_ALPHABET = 1 << 32
BYTE_ALIGN_SLACK = 1.01  # byte-aligned keys are used when they cost at most 1 % more bits
_WORK_DTYPES = {1: np.uint8, 2: np.uint16, 3: np.uint32, 4: np.uint32}


def choose_grouping(alphabet_size: int) -> tuple[int, int, bool]:
    """(symbols per key G, bits per key w, byte_aligned); minimises stored bits per symbol."""
    options = []
    group = 1
    while alphabet_size ** group <= 1 << 64:
        options.append((group, ((alphabet_size ** group) - 1).bit_length()))
        group += 1
    best_bits = min(options, key=lambda o: (o[1] / o[0], o[0]))
    best_bytes = min(options, key=lambda o: (math.ceil(o[1] / 8) / o[0], o[0]))
    byte_cost = 8 * math.ceil(best_bytes[1] / 8) / best_bytes[0]
    if byte_cost <= BYTE_ALIGN_SLACK * best_bits[1] / best_bits[0]:
        return best_bytes[0], 8 * math.ceil(best_bytes[1] / 8), True
    return best_bits[0], best_bits[1], False


@dataclass(frozen=True)
class RadixCoder(PayloadCoder):
    """Exact radix payload coder for symbols in [0, alphabet_size) (the "exact" variant).

    encode(symbols int [n]) -> payload_size(n) bytes; decode(payload, n) -> int64 [n].
    """

    variant: ClassVar[str] = "exact"
    alphabet_size: int
    group: int = field(init=False)
    key_bits: int = field(init=False)
    byte_aligned: bool = field(init=False)

    def __post_init__(self) -> None:
        n = self.alphabet_size
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 2 <= int(n) <= MAX_ALPHABET:
            raise ValueError(f"alphabet_size must be an integer in 2..{MAX_ALPHABET}, got {n!r}")
        n = int(n)
        object.__setattr__(self, "alphabet_size", n)
        group, key_bits, aligned = choose_grouping(n)
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "key_bits", key_bits)
        object.__setattr__(self, "byte_aligned", aligned)
        bits = n.bit_length() - 1
        object.__setattr__(self, "_pow2_bits", bits if 1 << bits == n else 0)
        object.__setattr__(self, "_powers", [n ** j for j in range(group)])
        object.__setattr__(self, "_key_mask", (1 << key_bits) - 1)

    @classmethod
    def make(cls, alphabet_size: int, r: float | None = None) -> "RadixCoder":
        if r is not None and r != 1.0 / alphabet_size:
            raise ArchiveError("r is fixed to 1/N in the exact variant; pass r only with variant='float'")
        return cls(alphabet_size)

    # ------------------------------------------------------------------ sizes
    @property
    def r(self) -> float:
        """The contraction of the 1-D map whose points the keys are (see the module docstring)."""
        return 1.0 / self.alphabet_size

    @property
    def segment(self) -> int:
        """Symbols per key: the unit decoded on its own."""
        return self.group

    @property
    def segment_bytes(self) -> int:
        return self.key_bytes

    @property
    def key_bytes(self) -> int:
        """Bytes per key when byte-aligned (else the bytes a key spans at most, rounded up)."""
        return math.ceil(self.key_bits / 8)

    @property
    def bits_per_symbol(self) -> float:
        """Stored bits per symbol of a full key."""
        return self.key_bits / self.group

    def payload_size(self, count: int) -> int:
        return math.ceil(-(-count // self.group) * self.key_bits / 8)

    # --------------------------------------------------------------- reference
    def encode_reference(self, symbols) -> bytes:
        """Plain-Python specification: key = sum_j c_j N^j over each group of G symbols,
        keys of w bits concatenated little-endian."""
        stream = 0
        syms = [int(s) for s in symbols]
        groups = -(-len(syms) // self.group)
        for g in range(groups):
            key = 0
            for c in reversed(syms[g * self.group:(g + 1) * self.group]):
                key = key * self.alphabet_size + c  # Horner: the latest symbol ends up most significant
            stream |= key << (g * self.key_bits)
        return stream.to_bytes(self.payload_size(len(syms)), "little")

    def decode_reference(self, payload: bytes, count: int) -> list[int]:
        stream = int.from_bytes(bytes(payload[:self.payload_size(count)]), "little")
        out: list[int] = []
        for g in range(-(-count // self.group)):
            key = (stream >> (g * self.key_bits)) & self._key_mask
            for _ in range(self.group):
                key, c = divmod(key, self.alphabet_size)
                out.append(c)
        return out[:count]

    # -------------------------------------------------------------- vectorised
    def _keys(self, symbols: np.ndarray) -> np.ndarray:
        """int [n] -> keys [ceil(n/G)] in the narrowest unsigned dtype that holds them."""
        n = symbols.shape[0]
        groups = -(-n // self.group)
        work = _WORK_DTYPES.get(self.key_bytes, np.uint64) if self.byte_aligned else np.uint64
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
        return keys

    def encode(self, symbols: np.ndarray) -> bytes:
        """Validated int array [n] -> payload bytes (vectorised)."""
        keys = self._keys(symbols)
        if self.byte_aligned:
            return _keys_to_bytes(keys, self.key_bytes)
        bits = np.unpackbits(keys.astype("<u8").view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
        return np.packbits(bits[:, :self.key_bits].reshape(-1), bitorder="little").tobytes()

    def decode_keys(self, payload, count: int) -> np.ndarray:
        """The ceil(count/G) keys of a payload (uint)."""
        groups = -(-count // self.group)
        raw = np.frombuffer(payload, dtype=np.uint8, count=self.payload_size(count))
        if self.byte_aligned:
            return _bytes_to_keys(raw, self.key_bytes)
        bits = np.unpackbits(raw, bitorder="little")[:groups * self.key_bits].reshape(groups, self.key_bits)
        wide = np.zeros((groups, 64), dtype=np.uint8)
        wide[:, :self.key_bits] = bits
        return np.packbits(wide, axis=1, bitorder="little").view("<u8").reshape(-1)

    def decode(self, payload, count: int) -> np.ndarray:
        """payload (bytes-like, at least payload_size(count) bytes) -> int64 [count]."""
        keys = self.decode_keys(payload, count)
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

    def decode_range(self, payload, count: int, start: int, stop: int, base: int = 0) -> np.ndarray:
        """Symbols [start, stop) of the count-symbol payload at payload[base:] (int64); a short
        range decodes only the keys that hold it, a long one the whole block at once."""
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        if 4 * (stop - start) >= count:  # one vectorised pass beats per-key work
            return self.decode(memoryview(payload)[base:base + self.payload_size(count)], count)[start:stop]
        if not self.byte_aligned:
            return np.array([self.decode_at(payload, count, i, base) for i in range(start, stop)], dtype=np.int64)
        first, last = start // self.group, -(-stop // self.group)
        view = memoryview(payload)[base + first * self.key_bytes: base + last * self.key_bytes]
        try:
            symbols = self.decode(view, (last - first) * self.group)
        finally:
            view.release()
        offset = first * self.group
        return symbols[start - offset: stop - offset]

    def decode_at(self, payload, count: int, index: int, base: int = 0) -> int:
        """Symbol `index` of the payload at payload[base:]: one key read, one div/mod (the
        keys sit at fixed offsets, so `count` is not needed)."""
        g, t = divmod(index, self.group)
        if self.byte_aligned:
            start = base + g * self.key_bytes
            key = int.from_bytes(payload[start:start + self.key_bytes], "little")
        else:
            bit = g * self.key_bits
            start = base + (bit >> 3)
            stop = base + ((bit + self.key_bits + 7) >> 3)
            key = (int.from_bytes(payload[start:stop], "little") >> (bit & 7)) & self._key_mask
        if self._pow2_bits:
            return (key >> (t * self._pow2_bits)) & (self.alphabet_size - 1)
        return (key // self._powers[t]) % self.alphabet_size

    def encode_blocks(self, symbols: np.ndarray, block_symbols: int) -> list[bytes]:
        """Block payloads; when full blocks end on a byte boundary, one vectorised encode of
        the whole run is cut into fixed byte ranges."""
        keys_per_block, spare = divmod(block_symbols, self.group)
        if symbols.shape[0] < block_symbols or spare or (keys_per_block * self.key_bits) % 8:
            return super().encode_blocks(symbols, block_symbols)
        payload = self.encode(symbols)
        step = self.payload_size(block_symbols)
        return [payload[k * step:(k + 1) * step] for k in range(-(-symbols.shape[0] // block_symbols))]

    def search_index(self, symbols: np.ndarray) -> SuffixKeyIndex:
        return SuffixKeyIndex(symbols, self.alphabet_size)

    def check_payload(self, payload, count: int) -> None:
        """Length payload_size(count), every key < N^G, zero padding digits and bits."""
        if len(payload) != self.payload_size(count):
            raise ValueError("payload length does not match its symbol count")
        keys = self.decode_keys(payload, count).astype(np.uint64)
        limit = self.alphabet_size ** self.group
        if limit < 1 << 64 and keys.size and int(keys.max()) >= limit:
            raise ValueError("payload holds a key >= N^G")
        groups = keys.shape[0]
        last = count - (groups - 1) * self.group
        if groups and last < self.group and int(keys[-1]) >= self.alphabet_size ** last:
            raise ValueError("payload's padding digits are not zero")
        spare = 8 * self.payload_size(count) - groups * self.key_bits
        if spare and np.frombuffer(payload, np.uint8, count=self.payload_size(count))[-1] >> (8 - spare):
            raise ValueError("payload's padding bits are not zero")


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
