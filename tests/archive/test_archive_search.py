"""Suffix search: recall 1.00 (and exact results) against brute force, both variants."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fibquant.archive import Archive, brute_force_search
from fibquant.archive.floatmap import FloatMapCoder
from fibquant.archive.search import PointIndex, SuffixKeyIndex, key_depth


def test_brute_force_reference():
    s = np.array([1, 2, 1, 2, 1, 3])
    assert brute_force_search(s, np.array([1, 2])).tolist() == [1, 3]
    assert brute_force_search(s, np.array([2, 1])).tolist() == [2, 4]
    assert brute_force_search(s, np.array([1, 3])).tolist() == [5]
    assert brute_force_search(s, np.array([3, 3])).tolist() == []
    assert brute_force_search(s, np.arange(7)).tolist() == []


@st.composite
def stream_and_queries(draw):
    n = draw(st.sampled_from([2, 3, 4, 16, 255, 256, 4096]))
    # Few distinct symbols so that long repeats (and long matching queries) occur.
    used = draw(st.integers(1, min(n, 4)))
    palette = draw(st.lists(st.integers(0, n - 1), min_size=used, max_size=used))
    body = draw(st.lists(st.sampled_from(palette), min_size=1, max_size=400))
    queries = draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 80)), min_size=1, max_size=8))
    return n, np.array(body, dtype=np.int64), queries


@settings(max_examples=60, deadline=None)
@given(stream_and_queries())
def test_key_index_equals_brute_force(case):
    n, symbols, queries = case
    index = SuffixKeyIndex(symbols, n)
    by_length: dict[int, list] = {}
    for where, length in queries:
        end = where % len(symbols)
        query = symbols[max(0, end - length + 1):end + 1]  # present in the stream
        expected = brute_force_search(symbols, query)
        assert expected.size  # recall is measured on queries that occur
        assert np.array_equal(index.search(query), expected)
        absent = query.copy()
        absent[0] = (absent[0] + 1) % n
        assert np.array_equal(index.search(absent), brute_force_search(symbols, absent))
        by_length.setdefault(len(query), []).append(query)
    for length, group in by_length.items():
        for query, got in zip(group, index.search_many(np.stack(group))):
            assert np.array_equal(got, brute_force_search(symbols, query))


def test_key_depth_fills_a_uint64():
    assert key_depth(16) == 16 and key_depth(256) == 8 and key_depth(4096) == 5 and key_depth(2) == 64


@pytest.mark.parametrize("variant", ["exact", "float"])
@pytest.mark.parametrize("alphabet", [16, 256, 4096])
def test_archive_search_recall_is_one(tmp_path, variant, alphabet):
    rng = np.random.default_rng(alphabet)
    symbols = rng.integers(0, alphabet, 20000)
    symbols[15000:15300] = symbols[1000:1300]  # a long repeat: long queries match twice
    with Archive.create(tmp_path / "a.fqa", alphabet, variant=variant) as archive:
        archive.append(symbols)
        for length in (1, 2, 3, 5, 9, 17, 40, 300):
            for end in [1299, *rng.integers(length, len(symbols), 5).tolist()]:
                query = symbols[end - length + 1:end + 1]
                expected = brute_force_search(symbols, query)
                got = archive.search(query)
                assert np.array_equal(got, expected), (length, end)
                for position in got[:3].tolist():
                    assert np.array_equal(archive.context(position, length), query)
        archive.append(symbols[:50])  # the index follows appends
        both = np.concatenate([symbols, symbols[:50]])
        assert np.array_equal(archive.search(symbols[:4]), brute_force_search(both, symbols[:4]))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("alphabet", [16, 256])
def test_geometric_filter_has_full_recall(dtype, alphabet):
    coder = FloatMapCoder(alphabet)
    symbols = np.random.default_rng(3).integers(0, alphabet, 5000)
    index = PointIndex(coder, symbols, dtype=dtype)
    for length in (1, 2, 3, 4):
        for end in range(length + 10, 5000, 397):
            query = symbols[end - length + 1:end + 1]
            candidates = set(index.candidates(query).tolist())
            expected = brute_force_search(symbols, query)
            assert set(expected.tolist()) <= candidates  # recall 1.00 of the raw filter
            assert np.array_equal(index.search(query), expected)


def test_float64_filter_is_precise_for_short_suffixes():
    # Disjoint bounding discs: with float64 points the ball holds only true matches
    # (plus the first positions, whose missing history maps to the centre).
    coder = FloatMapCoder(16)
    symbols = np.random.default_rng(4).integers(0, 16, 5000)
    index = PointIndex(coder, symbols)
    for end in range(40, 5000, 211):
        query = symbols[end - 2:end + 1]
        candidates = index.candidates(query)
        candidates = candidates[candidates >= 2]
        assert np.array_equal(np.sort(candidates), brute_force_search(symbols, query))


def test_empty_query_matches_everywhere(tmp_path):
    with Archive.create(tmp_path / "a.fqa", 16) as archive:
        archive.append([1, 2, 3])
        assert archive.search([]).tolist() == [0, 1, 2]


def test_points_of_any_variant_lie_in_their_suffix_cells(tmp_path):
    symbols = np.random.default_rng(8).integers(0, 16, 3000)
    coder = FloatMapCoder(16)
    with Archive.create(tmp_path / "a.fqa", 16) as archive:  # exact archive, 2-D points on demand
        archive.append(symbols)
        points = archive.points(1000, 1100)
        assert np.allclose(points, coder.suffix_points(symbols, coder.segment)[1000:1100], atol=1e-15)
        for offset, point in enumerate(points):
            end = 1000 + offset
            centre = np.array(coder.cell_centre(symbols[end - 2:end + 1]))
            assert np.linalg.norm(point - centre) <= coder.r ** 3


def _brute_rows(codes: np.ndarray, query: np.ndarray, stride: int, offset: int, stop: int) -> list[int]:
    """Rows r = offset (mod stride), r + (n-1) stride < stop, whose rows r, r + stride, ... equal query."""
    n = query.shape[0]
    return [r for r in range(offset, stop - (n - 1) * stride, stride)
            if all(np.array_equal(codes[r + j * stride], query[j]) for j in range(n))]


@st.composite
def code_streams(draw):
    from fibquant.archive import CodeLayout

    n_codewords = draw(st.sampled_from([2, 16, 256, 4096]))
    n_blocks = draw(st.sampled_from([1, 3, 5, 8, 16, 20]))
    layout = CodeLayout(n_codewords, n_blocks, draw(st.sampled_from([0, 2])))
    palette = draw(st.integers(1, 4))  # few distinct codes: long repeats and many hits
    rows = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**16))
    stride = draw(st.sampled_from([1, 2, 3, 7]))
    n = draw(st.integers(1, 6))
    return layout, palette, rows, seed, stride, n


@settings(max_examples=40, deadline=None)
@given(code_streams())
def test_code_find_equals_brute_force(tmp_path_factory, case):
    """CodeArchive.find / find_many (numba and numpy paths): every strided code sequence, exactly."""
    from fibquant.archive import CodeArchive

    layout, palette, rows, seed, stride, n = case
    rng = np.random.default_rng(seed)
    table_indices = rng.integers(0, layout.n_codewords, (palette, layout.n_blocks))
    table_norms = rng.integers(0, 3, palette) if layout.norm_bytes else None
    pick = rng.integers(0, palette, rows)
    codes = layout.join(table_indices[pick], None if table_norms is None else table_norms[pick])
    path = tmp_path_factory.mktemp("codes") / "c"
    with CodeArchive.create(path, layout) as archive:
        archive.append(codes)
        queries, offsets, expected = [], [], []
        for _ in range(5):
            offset = int(rng.integers(stride))
            start = offset + stride * int(rng.integers(0, max(1, (rows - offset) // stride)))
            query = codes[start:start + n * stride:stride]
            if query.shape[0] < n:  # past the end: a sequence that may not occur
                query = codes[rng.integers(0, rows, n)]
            if rng.random() < 0.3:
                query = query.copy()
                query[-1, -1] ^= 1  # a code that may not be stored
            queries.append(query)
            offsets.append(offset)
            expected.append(_brute_rows(codes, query, stride, offset, rows))
            assert archive.find(query, stride, offset).tolist() == expected[-1]
            stop = rows // 2
            assert archive.find(query, stride, offset, stop=stop).tolist() == \
                _brute_rows(codes, query, stride, offset, stop)
        batch = np.stack(queries)
        for use_numba in (True, False):
            got = archive.find_many(batch, stride, offsets, use_numba=use_numba)
            assert [g.tolist() for g in got] == expected


def test_code_find_follows_appends_and_refuses_bad_queries(tmp_path):
    from fibquant.archive import ArchiveError, CodeArchive, CodeLayout

    layout = CodeLayout(256, 16, 2)
    codes = layout.join(np.random.default_rng(0).integers(0, 256, (50, 16)), np.arange(50))
    with CodeArchive.create(tmp_path / "c", layout) as archive:
        archive.append(codes[:40])
        assert archive.find(codes[45:46]).tolist() == []
        archive.append(codes[40:])  # the row index is rebuilt after appends
        assert archive.find(codes[45:47]).tolist() == [45]
        assert archive.find_many(np.zeros((0, 2, 18), np.uint8)) == []
        with pytest.raises(ArchiveError, match="uint8"):
            archive.find(codes[:1].astype(np.int64))
        with pytest.raises(ArchiveError, match="queries must be"):
            archive.find_many(codes[:2])
        with pytest.raises(ArchiveError, match="stride"):
            archive.find(codes[:1], stride=0)
        with pytest.raises(ArchiveError, match="offsets"):
            archive.find(codes[:1], stride=2, offset=2)
