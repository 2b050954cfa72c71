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
