"""Bit packing is lossless: exact equality, every width, every length."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fibquant.codecs.bitpack import (
    bytes_to_float16,
    float16_to_bytes,
    pack_bits,
    pack_bits_reference,
    packed_size,
    unpack_bits,
    unpack_bits_reference,
)


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 32), count=st.integers(0, 40), rows=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_roundtrip_is_exact(bits, count, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 2**bits, (rows, count), generator=gen, dtype=torch.int64)
    packed = pack_bits(values, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (rows, packed_size(count, bits))
    assert torch.equal(unpack_bits(packed, bits, count), values)
    assert torch.equal(unpack_bits_reference(packed, bits, count), values)
    assert torch.equal(pack_bits_reference(values, bits), packed)


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 32), count=st.integers(0, 40), seed=st.integers(0, 2**31))
def test_fast_unpack_equals_reference_on_any_bytes(bits, count, seed):
    # arbitrary bytes, including nonzero padding bits that no value owns
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (3, packed_size(count, bits)), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_bits(packed, bits, count), unpack_bits_reference(packed, bits, count))


def test_layout_is_little_endian_bit_stream():
    # 3-bit values 5 (101) and 6 (110): stream bits 1,0,1,0,1,1 -> byte 0b00110101
    assert pack_bits(torch.tensor([5, 6]), 3).tolist() == [0b110101]
    # 12-bit value 0xABC spans two bytes: low byte first
    assert pack_bits(torch.tensor([0xABC]), 12).tolist() == [0xBC, 0x0A]


def test_sizes_are_tight():
    assert packed_size(64, 1) == 8
    assert packed_size(32, 12) == 48
    assert packed_size(5, 3) == 2


def test_rows_pack_independently():
    values = torch.randint(0, 2**7, (10, 9))
    packed = pack_bits(values, 7)
    for i in range(10):
        assert torch.equal(pack_bits(values[i : i + 1], 7), packed[i : i + 1])


@pytest.mark.parametrize("bits", [0, 33, 2.5])
def test_bad_width(bits):
    with pytest.raises(ValueError, match="bit width"):
        pack_bits(torch.zeros(3, dtype=torch.int64), bits)


def test_out_of_range_values():
    for pack in (pack_bits, pack_bits_reference):
        with pytest.raises(ValueError, match="out of range"):
            pack(torch.tensor([8]), 3)
        with pytest.raises(ValueError, match="out of range"):
            pack(torch.tensor([-1]), 3)


def test_wrong_packed_length():
    for unpack in (unpack_bits, unpack_bits_reference):
        with pytest.raises(ValueError, match="packed bytes"):
            unpack(torch.zeros(3, dtype=torch.uint8), 4, 8)


def test_float16_bytes_roundtrip():
    x = torch.tensor([0.0, 1.5, -2.25, 65504.0, 6.1e-5])
    raw = float16_to_bytes(x)
    assert raw.shape == (5, 2) and raw.dtype == torch.uint8
    assert torch.equal(bytes_to_float16(raw), x.to(torch.float16).to(torch.float32))


def test_float16_bytes_from_an_odd_length_row_slice():
    codes = float16_to_bytes(torch.tensor([1.0, 2.0, 3.0])).reshape(1, 6)
    odd_rows = torch.cat([codes, torch.zeros(1, 1, dtype=torch.uint8)], dim=1).repeat(2, 1)  # stride 7
    assert bytes_to_float16(odd_rows[:, 2:4]).tolist() == [2.0, 2.0]
