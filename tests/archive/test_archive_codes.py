"""Archiving FibQuant code streams: byte-exact codes back, vector i decoded by position."""
import math

import numpy as np
import pytest
import torch

from fibquant.archive import Archive, ArchiveError, CodeArchive, CodeLayout
from fibquant.codecs.bitpack import float16_to_bytes, pack_bits


def synthetic_codes(layout: CodeLayout, n: int, seed: int = 0) -> np.ndarray:
    """Codes in the FibQuant layout built from random indices and norms (no codec needed)."""
    gen = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, layout.n_codewords, (n, layout.n_blocks), generator=gen)
    norms = float16_to_bytes(torch.rand(n, generator=gen) * 100)
    return torch.cat([norms, pack_bits(indices, layout.index_bits)], dim=1).numpy()


@pytest.mark.parametrize("n_codewords,n_blocks", [(2, 64), (5, 3), (256, 16), (1000, 7), (4096, 1), (4096, 32)])
def test_synthetic_code_stream_roundtrip(tmp_path, n_codewords, n_blocks):
    layout = CodeLayout(n_codewords, n_blocks)
    codes = synthetic_codes(layout, 300)
    with CodeArchive.create(tmp_path / "codes", layout) as archive:
        archive.append(codes[:100])
        archive.append(torch.from_numpy(codes[100:]))
        assert len(archive) == 300
    with CodeArchive.open(tmp_path / "codes") as archive:
        assert np.array_equal(archive.codes(), codes)
        for i in (0, 17, 299, -1):
            assert np.array_equal(archive.code(i), codes[i])
        assert np.array_equal(archive.codes(40, 77), codes[40:77])
        stored_bits = 8 * (archive.indices.info()["file_bytes"]) / (300 * n_blocks)
    # The index stream costs ~log2 N bits per index (vs ceil(log2 N) in the packed codes).
    assert stored_bits <= 1.05 * max(1.0, math.log2(n_codewords)) + 8 * 200 / (300 * n_blocks)


def test_layout_validation():
    layout = CodeLayout(16, 4)
    with pytest.raises(ValueError, match="shape"):
        layout.split(np.zeros((3, 5), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        layout.split(np.zeros((3, 4), dtype=np.int64))
    bad = np.zeros((1, CodeLayout(5, 2).code_size), dtype=np.uint8)
    bad[0, 2] = 0b111  # index 7 >= 5
    with pytest.raises(ValueError, match="n_codewords"):
        CodeLayout(5, 2).split(bad)
    with pytest.raises(ValueError, match="n_blocks"):
        CodeLayout(16, 0)
    with pytest.raises(ValueError, match="norm"):
        CodeLayout(16, 4, norm_bytes=4)


def test_out_of_step_archives_are_reported(tmp_path):
    layout = CodeLayout(16, 4)
    with CodeArchive.create(tmp_path / "codes", layout) as archive:
        archive.append(synthetic_codes(layout, 10))
    with Archive.open(tmp_path / "codes" / "norms.fqa", "a") as norms:
        norms.append([1])
    with pytest.raises(ArchiveError, match="interrupted"):
        CodeArchive.open(tmp_path / "codes")
    with pytest.raises(ArchiveError, match="not a code archive"):
        CodeArchive.open(tmp_path / "nothing")


def test_fibquant_codes_roundtrip(tmp_path):
    from fibquant.codecs.fibquant import FibQuantCodec

    codec = FibQuantCodec(6, 2, 5)  # small codebook: built in seconds, N not a power of two
    x = torch.randn(200, 6, generator=torch.Generator().manual_seed(0))
    codes = codec.encode(x)
    layout = CodeLayout.from_codec(codec)
    assert layout.code_size == codec.code_size and layout.n_codewords == 5 and layout.n_blocks == 3
    with CodeArchive.create(tmp_path / "fq", layout) as archive:
        archive.append(codes)
    with CodeArchive.open(tmp_path / "fq") as archive:
        assert torch.equal(torch.from_numpy(archive.codes()), codes)
        decoded = codec.decode(codes)
        for i in (0, 99, 199):
            assert torch.equal(archive.decode(i, codec), decoded[i])


def test_turboquant_codes_roundtrip_and_search(tmp_path):
    from fibquant.archive import brute_force_search
    from fibquant.codecs.turboquant import TurboQuantCodec

    codec = TurboQuantCodec(16, 3)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(120, 16, generator=gen)
    x[60:80] = x[:20]  # repeated vectors: their codes must be found again by search
    codes = codec.encode(x)
    assert codec.code_layout == CodeLayout(8, 16) and CodeLayout.from_codec(codec).code_size == codec.code_size
    with CodeArchive.for_codec(tmp_path / "tq", codec) as archive:
        archive.append(codes[:50])
        archive.append(codes[50:])
    with CodeArchive.open(tmp_path / "tq") as archive:
        assert archive.layout == codec.code_layout
        assert torch.equal(torch.from_numpy(archive.codes()), codes)
        decoded = codec.decode(codes)
        for i in (0, 61, 119):
            assert torch.equal(archive.decode(i, codec), decoded[i])
        # Search the index stream for vector 5's levels: its end positions, aligned to whole
        # vectors, are exactly the vectors whose levels equal vector 5's.
        indices, _ = archive.layout.split(codes)
        stream = indices.reshape(-1)
        hits = archive.indices.search(indices[5])
        assert np.array_equal(hits, brute_force_search(stream, indices[5]))
        aligned = hits[(hits + 1) % 16 == 0] // 16
        expected = np.flatnonzero((indices == indices[5]).all(axis=1))
        assert np.array_equal(aligned, expected) and {5, 65} <= set(aligned.tolist())


def test_codec_layout_is_required_and_checked(tmp_path):
    from fibquant.codecs.integer import IntCodec
    from fibquant.codecs.turboquant import TurboQuantCodec

    with pytest.raises(ValueError, match="code_layout"):
        CodeArchive.for_codec(tmp_path / "int", IntCodec(16, 4))  # [scales][levels]: not this layout
    with pytest.raises(ArchiveError, match="CodeLayout"):
        CodeArchive.create(tmp_path / "x", TurboQuantCodec(16, 3))
    with CodeArchive.for_codec(tmp_path / "tq", TurboQuantCodec(16, 3)) as archive:
        archive.append(TurboQuantCodec(16, 3).encode(torch.ones(2, 16)))
        with pytest.raises(ArchiveError, match="layout"):
            archive.decode(0, TurboQuantCodec(16, 2))  # 2-bit levels cannot read 3-bit codes


def test_codes_without_a_norm_roundtrip(tmp_path):
    # Residual VQ codes are packed stage indices only: a layout with norm_bytes = 0.
    from fibquant.codecs.rvq import RVQCodec

    codec = RVQCodec(torch.randn(3, 10, 8, generator=torch.Generator().manual_seed(2)))
    codes = codec.encode(torch.randn(90, 8, generator=torch.Generator().manual_seed(3)))
    layout = CodeLayout(10, 3, norm_bytes=0)
    assert layout.code_size == codec.code_size
    with CodeArchive.create(tmp_path / "rvq", layout) as archive:
        archive.append(codes)
    assert not (tmp_path / "rvq" / "norms.fqa").exists()
    with CodeArchive.open(tmp_path / "rvq") as archive:
        assert len(archive) == 90 and archive.norms is None
        assert torch.equal(torch.from_numpy(archive.codes()), codes)
        assert np.array_equal(archive.code(-1), codes[-1].numpy())
    with Archive.open(tmp_path / "rvq" / "indices.fqa", "a") as indices:
        indices.append([1])  # a vector cut short by a crash
    with pytest.raises(ArchiveError, match="interrupted"):
        CodeArchive.open(tmp_path / "rvq")
