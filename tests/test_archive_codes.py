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
