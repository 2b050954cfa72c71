"""Exact bit packing of fixed-width unsigned integers into bytes.

Bit order is little-endian within the stream: value j occupies bits
[j*bits, (j+1)*bits) of the row, and bit t of the row is bit (t % 8) of byte t // 8.
Pure torch, so it runs on whatever device the indices live on.
"""
from __future__ import annotations

import math

import torch

MAX_BITS = 32


def packed_size(count: int, bits: int) -> int:
    """Bytes needed for `count` values of `bits` bits each."""
    return math.ceil(count * bits / 8)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bit width must be an integer in 1..{MAX_BITS}, got {bits!r}")


def _checked_values(values: torch.Tensor, bits: int) -> torch.Tensor:
    _check_bits(bits)
    values = values.to(torch.int64)
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= 1 << bits):
        raise ValueError(f"values out of range for {bits}-bit packing")
    return values


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integers `values` [..., n] (each < 2**bits) into uint8 [..., packed_size(n, bits)].

    Each value is shifted to its bit offset and split over the (at most 5) bytes it touches;
    the pieces are summed into their bytes, which equals OR-ing them because no two values
    share a bit.
    """
    values = _checked_values(values, bits)
    *lead, count = values.shape
    nbytes = packed_size(count, bits)
    if 8 % bits == 0:  # 1, 2, 4, 8 bits: whole values per byte
        per_byte = 8 // bits
        padded = torch.nn.functional.pad(values, (0, nbytes * per_byte - count))
        shifts = torch.arange(0, 8, bits, device=values.device, dtype=torch.int64)
        return (padded.reshape(*lead, nbytes, per_byte) << shifts).sum(-1).to(torch.uint8)
    starts = torch.arange(count, device=values.device, dtype=torch.int64) * bits
    span = (7 + bits + 7) // 8
    byte_index = (starts // 8).unsqueeze(1) + torch.arange(span, device=values.device)
    words = values << (starts % 8)
    pieces = (words.unsqueeze(-1) >> (8 * torch.arange(span, device=values.device, dtype=torch.int64))) & 0xFF
    out = torch.zeros(*lead, nbytes + span, dtype=torch.int64, device=values.device)
    out.index_add_(-1, byte_index.reshape(-1), pieces.reshape(*lead, count * span))
    return out[..., :nbytes].to(torch.uint8)


def pack_bits_reference(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Plain bit-by-bit `pack_bits` (the spec the fast path is tested against)."""
    values = _checked_values(values, bits)
    *lead, n = values.shape
    shifts = torch.arange(bits, device=values.device, dtype=torch.int64)
    bit_stream = ((values.unsqueeze(-1) >> shifts) & 1).reshape(*lead, n * bits)
    nbytes = packed_size(n, bits)
    pad = nbytes * 8 - n * bits
    if pad:
        bit_stream = torch.nn.functional.pad(bit_stream, (0, pad))
    weights = 1 << torch.arange(8, device=values.device, dtype=torch.int64)
    return (bit_stream.reshape(*lead, nbytes, 8) * weights).sum(-1).to(torch.uint8)


def unpack_bits_reference(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Plain bit-by-bit inverse of `pack_bits` (the spec `unpack_bits` is tested against)."""
    _check_bits(bits)
    *lead, nbytes = packed.shape
    _check_packed_length(nbytes, bits, count)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64)
    bit_stream = ((packed.to(torch.int64).unsqueeze(-1) >> shifts) & 1).reshape(*lead, nbytes * 8)
    bit_stream = bit_stream[..., : count * bits].reshape(*lead, count, bits)
    weights = 1 << torch.arange(bits, device=packed.device, dtype=torch.int64)
    return (bit_stream * weights).sum(-1)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack_bits`: uint8 [..., packed_size(count, bits)] -> int64 [..., count].

    Value j starts at bit j*bits; it is read from the (at most 5) bytes that hold it, gathered
    at once for all values, so the cost is ~5 byte reads per value instead of 8 per byte plus
    `bits` per value for the bit-by-bit reference.
    """
    _check_bits(bits)
    *lead, nbytes = packed.shape
    _check_packed_length(nbytes, bits, count)
    if 8 % bits == 0:  # 1, 2, 4, 8 bits: values never straddle a byte
        shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.int64)
        values = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return values.reshape(*lead, nbytes * (8 // bits))[..., :count]
    starts = torch.arange(count, device=packed.device, dtype=torch.int64) * bits
    span = (7 + bits + 7) // 8  # bytes a value can touch, whatever its bit offset
    byte_index = (starts // 8).unsqueeze(1) + torch.arange(span, device=packed.device)
    padded = torch.nn.functional.pad(packed, (0, span))  # reads past the end see zeros
    gathered = padded.to(torch.int64)[..., byte_index.reshape(-1)].reshape(*lead, count, span)
    words = (gathered << (8 * torch.arange(span, device=packed.device, dtype=torch.int64))).sum(-1)
    return (words >> (starts % 8)) & ((1 << bits) - 1)


def _check_packed_length(nbytes: int, bits: int, count: int) -> None:
    if nbytes != packed_size(count, bits):
        raise ValueError(
            f"expected {packed_size(count, bits)} packed bytes for {count}x{bits} bits, got {nbytes}"
        )


NORM_BYTES = 2  # a code row's norm nu, stored as IEEE fp16 (`float16_to_bytes`)


def float16_to_bytes(values: torch.Tensor) -> torch.Tensor:
    """float tensor [...] -> uint8 [..., 2] holding its IEEE half-precision bytes."""
    return values.to(torch.float16).contiguous().view(torch.uint8).reshape(*values.shape, 2)


def bytes_to_float16(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] -> float32 [...] (inverse of `float16_to_bytes`)."""
    # A fresh dense copy: a row slice of an odd-length code keeps an odd stride that view() rejects.
    dense = raw.clone(memory_format=torch.contiguous_format)
    return dense.view(torch.float16).squeeze(-1).to(torch.float32)
