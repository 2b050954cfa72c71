"""Archive files: exact round trips, append/reopen, random access, slices and bad input."""
import struct

import numpy as np
import pytest
import torch

import fibquant
from fibquant.archive import Archive, ArchiveCorruptError, ArchiveError, ArchiveVersionError
from fibquant.archive.format import HEADER_SIZE

VARIANTS = ["exact", "float"]


def stream(n, alphabet, seed=0):
    return np.random.default_rng(seed).integers(0, alphabet, n)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("alphabet", [2, 16, 256, 1000, 4096])
def test_roundtrip_append_reopen(tmp_path, variant, alphabet):
    path = tmp_path / "a.fqa"
    symbols = stream(3000, alphabet)
    with Archive.create(path, alphabet, variant=variant, block_symbols=None) as archive:
        archive.append(symbols[:10])
        for s in symbols[10:500].tolist():  # one at a time
            archive.append(s)
        archive.append(symbols[500:2000])
        assert len(archive) == 2000
        assert np.array_equal(archive.read(), symbols[:2000])  # sealed blocks + pending tail
    with Archive.open(path, "a") as archive:
        assert np.array_equal(archive[:], symbols[:2000])
        archive.append(torch.from_numpy(symbols[2000:]))
    with Archive.open(path) as archive:
        assert len(archive) == 3000 and archive.variant == variant
        assert np.array_equal(archive.read(), symbols)
        for i in np.random.default_rng(1).integers(0, 3000, 300).tolist():
            assert archive[i] == symbols[i]
        assert archive[-1] == symbols[-1]
        assert np.array_equal(archive[17:1234], symbols[17:1234])
        assert np.array_equal(archive[2999:5:-7], symbols[2999:5:-7])
        assert np.array_equal(archive[::3], symbols[::3])
        assert archive[10:5].shape == (0,)


def test_small_blocks_and_short_blocks_in_the_middle(tmp_path):
    path = tmp_path / "a.fqa"
    symbols = stream(700, 16, seed=3)
    with Archive.create(path, 16, block_symbols=64) as archive:
        archive.append(symbols[:100])  # closes with a short block
    for start, stop in ((100, 333), (333, 334), (334, 700)):
        with Archive.open(path, "a") as archive:
            archive.append(symbols[start:stop])
    with Archive.open(path) as archive:
        assert archive.info()["blocks"] > 700 // 64
        assert [archive[i] for i in range(700)] == symbols.tolist()
        assert np.array_equal(archive.read(50, 650), symbols[50:650])


def test_random_access_reads_during_append(tmp_path):
    symbols = stream(20000, 256, seed=4)
    with Archive.create(tmp_path / "a.fqa", 256, block_symbols=512) as archive:
        for chunk in np.array_split(symbols, 13):
            archive.append(chunk)
            n = len(archive)
            assert archive[n - 1] == symbols[n - 1] and archive[n // 2] == symbols[n // 2]


def test_public_name_and_info(tmp_path):
    with fibquant.Archive.create(tmp_path / "a.fqa", 4096) as archive:
        archive.append(stream(50000, 4096))
    with Archive.open(tmp_path / "a.fqa") as archive:
        info = archive.info()
    assert info["variant"] == "exact" and info["symbols"] == 50000
    assert 12 <= info["bits_per_symbol"] <= 1.05 * 12  # headers and CRCs included
    assert info["file_bytes"] == (tmp_path / "a.fqa").stat().st_size


def test_context_returns_the_symbols_ending_at_a_position(tmp_path):
    symbols = stream(5000, 16, seed=5)
    with Archive.create(tmp_path / "a.fqa", 16) as archive:
        archive.append(symbols)
        assert np.array_equal(archive.context(1000, 12), symbols[989:1001])
        assert np.array_equal(archive.context(3, 12), symbols[:4])
        with pytest.raises(IndexError):
            archive.context(5000, 3)
        with pytest.raises(ArchiveError, match="length"):
            archive.context(10, -1)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("bad, message", [
    (16, r"\[0, 16\)"), (-1, r"\[0, 16\)"), ([1, 2, 99], r"\[0, 16\)"),
    (np.array([1.0, 2.0]), "integer dtype"), (2.0, "integer dtype"), (True, "bool"),
    (np.array([[1, 2]]), "1-D"), ("ab", "integer dtype"), (torch.tensor([0.5]), "integer dtype"),
])
def test_bad_symbols_are_refused(tmp_path, bad, message):
    with Archive.create(tmp_path / "a.fqa", 16) as archive:
        archive.append([1, 2, 3])
        with pytest.raises(ArchiveError, match=message):
            archive.append(bad)
        assert archive.read().tolist() == [1, 2, 3]  # nothing half-appended
        with pytest.raises(ArchiveError):
            archive.search(bad if np.ndim(bad) else [bad])


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="alphabet_size"):
        Archive.create(tmp_path / "a.fqa", 1)
    with pytest.raises(ArchiveError, match="variant"):
        Archive.create(tmp_path / "a.fqa", 16, variant="zip")
    with pytest.raises(ArchiveError, match="r is fixed"):
        Archive.create(tmp_path / "a.fqa", 16, r=0.1)
    with pytest.raises(ValueError, match=r"exceeds r\*"):
        Archive.create(tmp_path / "a.fqa", 16, variant="float", r=0.3)
    with pytest.raises(ValueError, match="multiple of segment"):
        Archive.create(tmp_path / "b.fqa", 16, block_symbols=33)
    with pytest.raises(ArchiveError, match="folder .* does not exist"):
        Archive.create(tmp_path / "no" / "such" / "dir.fqa", 16)
    Archive.create(tmp_path / "c.fqa", 16).close()
    with pytest.raises(ArchiveError, match="exists"):
        Archive.create(tmp_path / "c.fqa", 16)
    with pytest.raises(ArchiveError, match="mode"):
        Archive.open(tmp_path / "c.fqa", "w")
    with Archive.open(tmp_path / "c.fqa") as archive:
        with pytest.raises(ArchiveError, match="read-only"):
            archive.append(1)
        with pytest.raises(IndexError):
            archive[0]
        with pytest.raises(TypeError):
            archive[1.0]
    with pytest.raises(ArchiveError, match="closed"):
        archive.append([1])


def test_unknown_version_is_refused(tmp_path):
    path = tmp_path / "a.fqa"
    with Archive.create(path, 16) as archive:
        archive.append([1, 2, 3])
    raw = bytearray(path.read_bytes())
    struct.pack_into("<H", raw, 8, 7)
    path.write_bytes(bytes(raw))
    with pytest.raises(ArchiveVersionError, match="version 7"):
        Archive.open(path)


def test_foreign_and_truncated_files(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ArchiveCorruptError, match="magic"):
        Archive.open(path)
    with Archive.create(tmp_path / "a.fqa", 16) as archive:
        archive.append([1])
    path.write_bytes((tmp_path / "a.fqa").read_bytes()[:HEADER_SIZE - 5])
    with pytest.raises(ArchiveCorruptError, match="truncated"):
        Archive.open(path)


@pytest.mark.parametrize("variant", VARIANTS)
def test_flipped_payload_byte_is_detected_on_read(tmp_path, variant):
    path = tmp_path / "a.fqa"
    symbols = stream(4000, 256, seed=6)
    with Archive.create(path, 256, variant=variant, block_symbols=1024 if variant == "exact" else 1024) as a:
        a.append(symbols)
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 10] ^= 0x40  # inside the last block's payload
    path.write_bytes(bytes(raw))
    with Archive.open(path) as archive:
        assert archive[0] == symbols[0]  # other blocks still read
        with pytest.raises(ArchiveCorruptError, match="checksum"):
            archive[len(symbols) - 1]
        with pytest.raises(ArchiveCorruptError, match="checksum"):
            archive.read()


@pytest.mark.parametrize("alphabet", [16, 256, 4096])
def test_float_and_exact_variants_agree_and_exact_is_smaller(tmp_path, alphabet):
    symbols = stream(20000, alphabet, seed=9)
    sizes = {}
    for variant in VARIANTS:
        with Archive.create(tmp_path / f"{variant}.fqa", alphabet, variant=variant) as archive:
            archive.append(symbols)
        sizes[variant] = (tmp_path / f"{variant}.fqa").stat().st_size
        with Archive.open(tmp_path / f"{variant}.fqa") as archive:
            assert np.array_equal(archive.read(), symbols)
            assert np.array_equal(archive.search(symbols[500:504]), archive.search(symbols[500:504].tolist()))
    assert sizes["exact"] * 1.6 < sizes["float"]  # the measured reason exact is the default


def test_durable_mode_fsyncs_and_reads_back(tmp_path, monkeypatch):
    import os

    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd) or real_fsync(fd))
    with Archive.create(tmp_path / "a.fqa", 16, block_symbols=64, durable=True) as archive:
        assert len(calls) == 1  # the header
        archive.append(stream(200, 16))
        assert len(calls) == 2  # the three full blocks, written with one write call
    assert len(calls) == 3  # the short last block, sealed by close()
    with Archive.open(tmp_path / "a.fqa") as archive:
        assert np.array_equal(archive.read(), stream(200, 16))


def test_a_failed_write_leaves_no_phantom_blocks(tmp_path):
    symbols = stream(300, 16, seed=10)
    archive = Archive.create(tmp_path / "a.fqa", 16, block_symbols=64)
    archive.append(symbols[:50])
    real_write = archive._handle.write

    def disk_full(data):
        raise OSError(28, "No space left on device")
    archive._handle.write = disk_full
    with pytest.raises(OSError):
        archive.append(symbols[50:300])
    assert len(archive) == 50 and np.array_equal(archive.read(), symbols[:50])
    archive._handle.write = real_write
    archive.append(symbols[50:300])
    archive.close()
    with Archive.open(tmp_path / "a.fqa") as reopened:
        assert np.array_equal(reopened.read(), symbols)


@pytest.mark.parametrize("alphabet", [2, 16, 256, 1000, 1 << 16, 1 << 32])
def test_view_equals_read(tmp_path, alphabet):
    symbols = stream(3000, alphabet, seed=11)
    with Archive.create(tmp_path / "a.fqa", alphabet, block_symbols=256) as archive:
        archive.append(symbols[:2900])  # sealed blocks + a pending tail
        rng = np.random.default_rng(1)
        for _ in range(300):
            start = int(rng.integers(0, 2900))
            count = int(rng.integers(1, 40))
            count = min(count, 2900 - start)
            got = archive.view(start, count)
            assert np.array_equal(got.astype(np.int64), symbols[start:start + count]), (start, count)
        if alphabet in (256, 1 << 16, 1 << 32):  # byte-aligned one-symbol keys: a view of the map
            assert archive.view(10, 5).dtype.kind == "u" and not archive.view(10, 5).flags.writeable
        archive.append(symbols[2900:])  # blocks appended after the map was made are viewed too
        assert np.array_equal(archive.view(2990, 10).astype(np.int64), symbols[2990:])


def test_view_verifies_the_block_on_first_touch(tmp_path):
    symbols = stream(1000, 256, seed=12)
    with Archive.create(tmp_path / "a.fqa", 256, block_symbols=256) as archive:
        archive.append(symbols)
    raw = bytearray((tmp_path / "a.fqa").read_bytes())
    raw[HEADER_SIZE + 32 + 5] ^= 0xFF  # a payload byte of block 0
    (tmp_path / "a.fqa").write_bytes(bytes(raw))
    with Archive.open(tmp_path / "a.fqa") as archive:
        assert np.array_equal(archive.view(300, 4), symbols[300:304])  # another block: fine
        with pytest.raises(ArchiveCorruptError, match="checksum"):
            archive.view(3, 2)


@pytest.mark.parametrize("alphabet", [16, 256, 1000])
def test_truncate_cuts_back_to_a_prefix(tmp_path, alphabet):
    symbols = stream(1000, alphabet, seed=13)
    for n in (0, 1, 63, 64, 65, 500, 999, 1000, 1200):
        path = tmp_path / f"a{n}.fqa"
        with Archive.create(path, alphabet, block_symbols=64) as archive:
            archive.append(symbols[:990])
            archive.truncate(min(n, 990))  # pending symbols are cut without touching the file
            assert len(archive) == min(n, 990)
            archive.append(symbols[min(n, 990):])  # a cut archive keeps appending
        with Archive.open(path) as archive:
            assert np.array_equal(archive.read(), symbols)
        with Archive.open(path, "a") as archive:
            archive.truncate(n)
            assert len(archive) == min(n, 1000) and archive.info()["sealed_symbols"] == min(n, 1000)
            assert np.array_equal(archive.read(), symbols[:n])
            assert np.array_equal(archive.search(symbols[:3]) if n >= 3 else symbols[:0],
                                  np.flatnonzero([np.array_equal(symbols[:n][i - 2:i + 1], symbols[:3])
                                                  for i in range(n)]) if n >= 3 else symbols[:0])
            archive.append(symbols[n:1000])
        with Archive.open(path) as archive:  # sealed, recovered without a warning
            assert np.array_equal(archive.read(), symbols)
    with Archive.open(tmp_path / "a0.fqa") as archive:
        with pytest.raises(ArchiveError, match="read-only"):
            archive.truncate(3)
    with Archive.open(tmp_path / "a0.fqa", "a") as archive:
        with pytest.raises(ArchiveError, match="non-negative"):
            archive.truncate(-1)


def test_truncate_fsyncs_when_durable(tmp_path, monkeypatch):
    import os

    with Archive.create(tmp_path / "a.fqa", 16, block_symbols=64) as archive:
        archive.append(stream(300, 16))
    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd) or real_fsync(fd))
    with Archive.open(tmp_path / "a.fqa", "a", durable=True) as archive:
        archive.truncate(100)
        assert len(calls) == 2  # the cut, then the re-sealed leading symbols of the cut record


def test_info_of_an_empty_archive_states_no_rate(tmp_path):
    Archive.create(tmp_path / "e.fqa", 16).close()
    with Archive.open(tmp_path / "e.fqa") as archive:
        info = archive.info()
    assert info["symbols"] == 0 and info["bits_per_symbol"] is None
