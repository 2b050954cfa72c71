"""Crash safety (truncation at every byte) and fuzzing of mutated archives.

The only acceptable outcomes of opening and reading a damaged file are: the original
symbols, a prefix of them ending at a sealed block (what a crash at that byte leaves),
or an ArchiveError (the documented error). Never other symbols, never another exception.
"""
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fibquant.archive import Archive, ArchiveCorruptError, ArchiveError, RecoveryWarning
from fibquant.archive.format import HEADER_SIZE

BLOCK = {"exact": 16, "float": 38}  # N = 16: float segments hold 19 symbols


def build(path, variant, n_blocks=5, extra=7):
    """A small archive of n_blocks full blocks plus a short one; returns symbols and the
    file size after each sealed block (the record boundaries)."""
    block = BLOCK[variant]
    symbols = np.random.default_rng(7).integers(0, 16, block * n_blocks + extra)
    boundaries = [HEADER_SIZE]
    with Archive.create(path, 16, variant=variant, block_symbols=block) as archive:
        for b in range(n_blocks):
            archive.append(symbols[b * block:(b + 1) * block])
            boundaries.append(path.stat().st_size)
        archive.append(symbols[n_blocks * block:])
    boundaries.append(path.stat().st_size)
    counts = [min(block * b, len(symbols)) for b in range(n_blocks + 1)] + [len(symbols)]
    return symbols, boundaries, counts


def read_all(path):
    """(symbols, warned) or raises ArchiveError; also cross-checks random access."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Archive.open(path) as archive:
            data = archive.read()
            for i in range(0, len(archive), 5):
                assert archive[i] == data[i]
    return data, any(issubclass(w.category, RecoveryWarning) for w in caught)


@pytest.mark.parametrize("variant", ["exact", "float"])
def test_truncation_at_every_byte(tmp_path, variant):
    source = tmp_path / "full.fqa"
    symbols, boundaries, counts = build(source, variant)
    raw = source.read_bytes()
    cut = tmp_path / "cut.fqa"
    for size in range(len(raw) + 1):
        cut.write_bytes(raw[:size])
        if size < HEADER_SIZE:
            with pytest.raises(ArchiveCorruptError, match="truncated"):
                Archive.open(cut)
            continue
        sealed = max(b for b in range(len(boundaries)) if boundaries[b] <= size)
        data, warned = read_all(cut)
        assert np.array_equal(data, symbols[:counts[sealed]]), size
        assert warned == (size != boundaries[sealed]), size
        if size in (boundaries[2] + 3, len(raw) - 1):  # recovery then append continues the stream
            with pytest.warns(RecoveryWarning):
                archive = Archive.open(cut, "a")
            archive.append(symbols[counts[sealed]:])
            archive.close()
            assert np.array_equal(read_all(cut)[0], symbols) and not read_all(cut)[1]


def test_zero_filled_tail_is_dropped(tmp_path):
    path = tmp_path / "a.fqa"
    symbols, _, _ = build(path, "exact")
    with open(path, "ab") as handle:
        handle.write(bytes(100))  # preallocated space a crash left unwritten
    data, warned = read_all(path)
    assert warned and np.array_equal(data, symbols)


def test_missing_middle_record_is_detected(tmp_path):
    path = tmp_path / "a.fqa"
    _, boundaries, _ = build(path, "exact")
    raw = path.read_bytes()
    path.write_bytes(raw[:boundaries[1]] + raw[boundaries[2]:])  # one whole record removed
    with pytest.raises(ArchiveCorruptError, match="missing, repeated or out of order"):
        Archive.open(path)


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=40)),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 64)),
    st.tuples(st.just("zero"), st.integers(0, 10**6), st.integers(1, 64)),
)


def mutate(raw: bytes, mutations) -> bytes:
    data = bytearray(raw)
    for kind, where, arg in mutations:
        at = where % (len(data) + 1)
        if kind == "flip" and at < len(data):
            data[at] ^= arg
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = arg
        elif kind == "delete":
            del data[at:at + arg]
        elif kind == "zero":
            data[at:at + arg] = bytes(len(data[at:at + arg]))
    return bytes(data)


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """variant -> (file bytes, symbols, symbol counts at the record boundaries)."""
    out = {}
    for variant in ("exact", "float"):
        path = tmp_path_factory.mktemp("fuzz") / f"{variant}.fqa"
        symbols, _, counts = build(path, variant)
        out[variant] = (path.read_bytes(), symbols, counts)
    return out


@pytest.mark.parametrize("variant", ["exact", "float"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(mutation, min_size=1, max_size=3))
def test_fuzzed_archives_give_correct_data_or_the_documented_error(tmp_path, originals, variant, mutations):
    raw, symbols, counts = originals[variant]
    damaged = tmp_path / "damaged.fqa"
    damaged.write_bytes(mutate(raw, mutations))
    try:
        data, _ = read_all(damaged)
    except ArchiveError:
        return
    assert len(data) in counts, len(data)  # a whole number of sealed blocks
    assert np.array_equal(data, symbols[:len(data)])
