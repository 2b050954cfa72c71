"""Every archive payload coder honours one protocol (same signatures, same results)."""
import struct
import zlib

import numpy as np
import pytest

from fibquant.archive import (PAYLOAD_CODERS, Archive, ArchiveCorruptError, ArchiveError, PayloadCoder,
                              brute_force_search, make_coder)
from fibquant.archive import format as archive_format
from fibquant.archive.format import HEADER_SIZE, RECORD_HEADER_SIZE, Header

CASES = [(variant, n) for variant in sorted(PAYLOAD_CODERS) for n in (2, 16, 139, 256, 4096)]


@pytest.mark.parametrize("variant,alphabet", CASES)
def test_coder_contract(variant, alphabet):
    coder = make_coder(variant, alphabet)
    assert isinstance(coder, PayloadCoder) and coder.variant == variant and coder.alphabet_size == alphabet
    assert 0 < coder.r < 1 and coder.segment >= 1 and coder.segment_bytes >= 1
    rng = np.random.default_rng(alphabet)
    count = 8 * coder.segment + 3  # a short last segment too
    symbols = rng.integers(0, alphabet, count)
    payload = coder.encode(symbols)
    coder.check_payload(payload, count)
    assert np.array_equal(coder.decode(payload, count), symbols)
    framed = b"head" + payload + b"tail"  # payloads are read in place, at an offset in a buffer
    for start, stop in ((0, 0), (0, 1), (3, 9), (count - 1, count), (1, count - 2), (0, count)):
        assert np.array_equal(coder.decode_range(framed, count, start, stop, 4), symbols[start:stop])
    assert [coder.decode_at(framed, count, i, 4) for i in range(count)] == symbols.tolist()
    with pytest.raises(ValueError, match="length"):
        coder.check_payload(payload + b"\x00", count)


@pytest.mark.parametrize("variant,alphabet", CASES)
def test_encode_blocks_equals_encoding_each_block(variant, alphabet):
    coder = make_coder(variant, alphabet)
    block = 8 * coder.segment
    symbols = np.random.default_rng(1).integers(0, alphabet, 5 * block + coder.segment + 1)
    blocks = coder.encode_blocks(symbols, block)
    assert blocks == [coder.encode(symbols[s:s + block]) for s in range(0, symbols.shape[0], block)]


@pytest.mark.parametrize("variant", sorted(PAYLOAD_CODERS))
def test_search_index_contract(variant):
    coder = make_coder(variant, 16)
    symbols = np.random.default_rng(2).integers(0, 16, 3000)
    index = coder.search_index(symbols)
    assert index.length == symbols.shape[0]  # set by the index itself, not by its caller
    queries = np.stack([symbols[e - 3:e + 1] for e in (3, 100, 2999)])
    for query, hits in zip(queries, index.search_many(queries)):
        assert np.array_equal(hits, brute_force_search(symbols, query))
        assert np.array_equal(index.search(query.tolist()), hits)


def test_make_coder_rejects_bad_arguments():
    with pytest.raises(ArchiveError, match="variant"):
        make_coder("zip", 16)
    with pytest.raises(ArchiveError, match="r is fixed"):
        make_coder("exact", 16, 0.1)
    assert make_coder("exact", 16, 1 / 16).r == 1 / 16  # the header's r of an exact archive
    with pytest.raises(ValueError, match=r"exceeds r\*"):
        make_coder("float", 16, 0.5)


def test_exact_header_with_another_r_is_corrupt(tmp_path):
    path = tmp_path / "bad.fqa"
    path.write_bytes(Header("exact", 16, 0.25, 2, 1024).pack())  # valid checksum, impossible r
    with pytest.raises(ArchiveCorruptError, match="inconsistent archive header"):
        Archive.open(path)


def test_format_docstring_states_the_real_sizes(tmp_path):
    assert RECORD_HEADER_SIZE == struct.calcsize("<4sIIIQI") + 4 == 32
    assert f"record header ({RECORD_HEADER_SIZE} B)" in archive_format.__doc__
    assert f"header ({HEADER_SIZE} B)" in archive_format.__doc__
    with Archive.create(tmp_path / "a.fqa", 256, block_symbols=100) as archive:
        archive.append(np.arange(100) % 256)
    raw = (tmp_path / "a.fqa").read_bytes()
    assert len(raw) == HEADER_SIZE + RECORD_HEADER_SIZE + 100
    head = raw[HEADER_SIZE:HEADER_SIZE + RECORD_HEADER_SIZE]
    assert struct.unpack_from("<I", head, 28)[0] == zlib.crc32(head[:28])
