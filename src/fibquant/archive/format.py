"""On-disk layout of a fractal archive, and the errors its reader raises.

    file   = header (64 B) , record*
    header = magic "FQARCHV\\0" (8) | version u16 | variant u16 | alphabet_size u64 |
             r f64 | segment u32 | block_symbols u32 | zero padding (24) | crc32 of bytes 0..59 u32
    record = record header (32 B) , payload
    record header = magic "FQSG" | n_symbols u32 | payload_len u32 | flags u32 |
                    first symbol index u64 | crc32(payload) u32 | crc32 of the 28 bytes before u32

All integers little-endian. A record (a sealed block of up to block_symbols symbols) is
written with one write call; the chain of record headers is the offset index, rebuilt on
open by reading only the headers (O(blocks)). The first-symbol field chains the records:
a record removed, repeated or moved is detected. Recovery rule (see docs/archive-format.md):
a tail that a crash can leave behind (an incomplete record header, a record whose payload
runs past the end of the file, or trailing zero bytes) is dropped with a `RecoveryWarning`;
anything else that fails a check is an `ArchiveCorruptError`.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

MAGIC = b"FQARCHV\x00"
VERSION = 1
HEADER_SIZE = 64
RECORD_MAGIC = b"FQSG"
RECORD_HEADER_SIZE = 32
VARIANTS = {"exact": 0, "float": 1}
VARIANT_NAMES = {v: k for k, v in VARIANTS.items()}
FLAG_NONE = 0

_HEADER = struct.Struct("<8sHHQdII")
_RECORD = struct.Struct("<4sIIIQI")


class ArchiveError(ValueError):
    """Base of every error the archive raises for bad files or bad input."""


class ArchiveCorruptError(ArchiveError):
    """The file fails a magic, checksum or consistency check (flipped byte, foreign file)."""


class ArchiveVersionError(ArchiveError):
    """The file is an archive of a format version this reader does not know."""


class RecoveryWarning(UserWarning):
    """An unsealed tail (left by a crash during a write) was dropped on open."""


@dataclass(frozen=True)
class Header:
    variant: str
    alphabet_size: int
    r: float
    segment: int
    block_symbols: int

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {self.variant!r}")
        if not isinstance(self.block_symbols, int) or not 1 <= self.block_symbols < 1 << 31:
            raise ValueError(f"block_symbols must be a positive integer, got {self.block_symbols!r}")
        if not isinstance(self.segment, int) or self.segment < 1 or self.block_symbols % self.segment:
            raise ValueError(f"block_symbols={self.block_symbols} must be a multiple of segment={self.segment}")

    def pack(self) -> bytes:
        body = _HEADER.pack(MAGIC, VERSION, VARIANTS[self.variant], self.alphabet_size, self.r,
                            self.segment, self.block_symbols)
        body += bytes(HEADER_SIZE - 4 - len(body))
        return body + struct.pack("<I", zlib.crc32(body))


def unpack_header(raw: bytes) -> Header:
    """Parse and check the file header; raises ArchiveCorruptError / ArchiveVersionError."""
    if len(raw) < len(MAGIC) or raw[:len(MAGIC)] != MAGIC:
        if MAGIC.startswith(bytes(raw[:len(MAGIC)])) and len(raw) < HEADER_SIZE:
            raise ArchiveCorruptError(f"truncated archive header ({len(raw)} of {HEADER_SIZE} bytes)")
        raise ArchiveCorruptError("not a fibquant archive (bad magic)")
    if len(raw) >= 10:
        version = struct.unpack_from("<H", raw, 8)[0]
        if version != VERSION:
            raise ArchiveVersionError(f"unknown archive format version {version} (this reader knows {VERSION})")
    if len(raw) < HEADER_SIZE:
        raise ArchiveCorruptError(f"truncated archive header ({len(raw)} of {HEADER_SIZE} bytes)")
    body, crc = raw[:HEADER_SIZE - 4], struct.unpack_from("<I", raw, HEADER_SIZE - 4)[0]
    if zlib.crc32(body) != crc or any(body[_HEADER.size:]):
        raise ArchiveCorruptError("archive header checksum mismatch")
    _, _, variant, alphabet_size, r, segment, block_symbols = _HEADER.unpack_from(body)
    if variant not in VARIANT_NAMES:
        raise ArchiveCorruptError(f"unknown variant code {variant}")
    try:
        return Header(VARIANT_NAMES[variant], alphabet_size, r, segment, block_symbols)
    except ValueError as exc:
        raise ArchiveCorruptError(f"inconsistent archive header: {exc}") from None


def pack_record(first: int, n_symbols: int, payload: bytes, flags: int = FLAG_NONE) -> bytes:
    head = _RECORD.pack(RECORD_MAGIC, n_symbols, len(payload), flags, first, zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head)) + payload


@dataclass
class BlockIndex:
    """Where the sealed blocks are: payload offsets, lengths, symbol counts, crcs."""

    offsets: list[int]
    lengths: list[int]
    counts: list[int]
    crcs: list[int]
    end: int  # file offset just past the last sealed record
    dropped_tail: int  # bytes of unsealed tail found after `end`


def scan_records(buf, size: int, block_symbols: int) -> BlockIndex:
    """Walk the record headers of buf[HEADER_SIZE:size]; apply the recovery rule."""
    index = BlockIndex([], [], [], [], HEADER_SIZE, 0)
    pos = HEADER_SIZE
    total = 0
    while pos < size:
        remaining = size - pos
        if remaining < RECORD_HEADER_SIZE:
            shown = min(remaining, len(RECORD_MAGIC))
            if buf[pos:pos + shown] == RECORD_MAGIC[:shown] or not any(buf[pos:size]):
                break  # a torn record header
            raise ArchiveCorruptError(f"garbage after the last record at offset {pos}")
        head = buf[pos:pos + RECORD_HEADER_SIZE]
        magic, n_symbols, length, flags, first, crc = _RECORD.unpack_from(head)
        header_ok = zlib.crc32(head[:_RECORD.size]) == struct.unpack_from("<I", head, _RECORD.size)[0] \
            and magic == RECORD_MAGIC
        if not header_ok:
            if not any(buf[pos:size]):
                break  # zero-filled tail: space allocated but never written
            raise ArchiveCorruptError(f"record header checksum mismatch at offset {pos}")
        if flags != FLAG_NONE or not 1 <= n_symbols <= block_symbols:
            raise ArchiveCorruptError(f"record at offset {pos} has invalid fields")
        if first != total:
            raise ArchiveCorruptError(f"record at offset {pos} starts at symbol {first}, expected {total} "
                                      f"(a record is missing, repeated or out of order)")
        if length > remaining - RECORD_HEADER_SIZE:
            break  # a torn payload: the header made it to disk, the payload did not
        index.offsets.append(pos + RECORD_HEADER_SIZE)
        index.lengths.append(length)
        index.counts.append(n_symbols)
        index.crcs.append(crc)
        total += n_symbols
        pos += RECORD_HEADER_SIZE + length
    index.end = pos
    index.dropped_tail = size - pos
    return index
