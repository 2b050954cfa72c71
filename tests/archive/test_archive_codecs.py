"""The two forms of the iterated map: exact radix keys and float64 anchors."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fibquant.archive.exact import RadixCoder, choose_grouping
from fibquant.archive.floatmap import FloatMapCoder, default_r, r_disc, r_star


@st.composite
def alphabet_and_stream(draw, max_n=5000, max_len=200):
    n = draw(st.one_of(st.integers(2, 20), st.sampled_from([139, 255, 256, 257, 1000, 4095, 4096, 65536, 65537]),
                       st.integers(2, max_n)))
    symbols = draw(st.lists(st.integers(0, n - 1), max_size=max_len))
    return n, np.array(symbols, dtype=np.int64)


@settings(max_examples=60, deadline=None)
@given(alphabet_and_stream())
def test_radix_vectorised_matches_reference(case):
    n, symbols = case
    coder = RadixCoder(n)
    payload = coder.encode(symbols)
    assert payload == coder.encode_reference(symbols.tolist())
    assert len(payload) == coder.payload_size(len(symbols))
    assert np.array_equal(coder.decode(payload, len(symbols)), symbols)
    assert coder.decode_reference(payload, len(symbols)) == symbols.tolist()
    assert [coder.decode_at(payload, len(symbols), i) for i in range(len(symbols))] == symbols.tolist()
    coder.check_payload(payload, len(symbols))


def test_radix_key_is_the_iterated_map_point():
    # 1-D map with r = 1/N, V(c) = c/(N-1), p_0 = 0: N^G p_G = sum_j c_j N^j exactly.
    coder = RadixCoder(10)
    symbols = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8][:coder.group]
    p = 0.0
    for c in symbols:
        v = c / 9
        p = v + (p - v) / 10
    key = int.from_bytes(coder.encode(np.array(symbols)), "little")
    assert key == sum(c * 10 ** j for j, c in enumerate(symbols))
    assert math.isclose(key / 10 ** coder.group, p, rel_tol=1e-12)


@pytest.mark.parametrize("n", [2, 3, 5, 7, 10, 16, 100, 139, 256, 1000, 4096, 10007, 65536, 65537,
                               1 << 20, (1 << 24) + 1, (1 << 31) + 1, 1 << 32])
def test_radix_is_bit_tight(n):
    coder = RadixCoder(n)
    assert math.log2(n) <= coder.bits_per_symbol <= 1.05 * math.log2(n)


def test_grouping_examples():
    assert choose_grouping(16) == (2, 8, True)  # (symbols per key, bits per key, byte-aligned)
    assert choose_grouping(256) == (1, 8, True)
    assert choose_grouping(4096) == (2, 24, True)
    assert choose_grouping(1000) == (4, 40, True)
    assert choose_grouping(139) == (8, 57, False)  # whole bytes would cost 12 % more


def test_every_alphabet_is_within_five_percent_of_log2n():
    for n in [*range(2, 5000), *range(65000, 66000), (1 << 24) + 1, (1 << 31) + 1]:
        assert RadixCoder(n).bits_per_symbol <= 1.05 * math.log2(n), n


@pytest.mark.parametrize("n", [10, 139])  # byte-aligned and bit-packed keys
def test_radix_rejects_bad_payload_keys(n):
    coder = RadixCoder(n)  # keys must stay below n^G
    assert coder.group > 1
    with pytest.raises(ValueError, match="key"):
        coder.check_payload(b"\xff" * coder.payload_size(coder.group), coder.group)
    # A payload declared to hold one symbol must have zero padding digits.
    with pytest.raises(ValueError, match="padding"):
        coder.check_payload(coder.encode(np.array([9, 9])), 1)
    coder.check_payload(coder.encode(np.array([9])), 1)


@pytest.mark.parametrize("bad", [1, 0, -3, 2.5, True, (1 << 32) + 1])
def test_radix_alphabet_validation(bad):
    with pytest.raises(ValueError, match="alphabet_size"):
        RadixCoder(bad)


# ------------------------------------------------------------------ float map
@pytest.mark.parametrize("n,expected", [(16, 0.16591), (256, 0.012124), (4096, 7.664e-4)])
def test_r_star_matches_the_closed_form_values(n, expected):
    # r*(N) = 1 / (2 (1 + sum_{j=1}^{floor(N/4)} cos(2 pi j / N))), the largest contraction with disjoint
    # cells (docs/archive-format.md); the expected values are those the fractal-archive paper quotes.
    assert r_star(n) == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 16, 100, 256, 4096, 65536])
def test_default_r_is_provably_safe(n):
    r = default_r(n)
    assert r < r_star(n) and r < r_disc(n)


def test_r_above_r_star_is_refused():
    with pytest.raises(ValueError, match=r"exceeds r\*"):
        FloatMapCoder(16, r=0.2)
    for bad in (0.0, 1.0, -0.1, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="contraction"):
            FloatMapCoder(16, r=bad)


@pytest.mark.parametrize("n,segment", [(16, 19), (256, 8), (4096, 5)])
def test_segment_length_from_precision_budget(n, segment):
    # The fractal-archive paper's ~20, ~8, ~5 symbols per float64 point, less one guard bit.
    assert FloatMapCoder(n).segment == segment


def test_anchors_match_the_recurrence():
    rng = np.random.default_rng(0)
    for n in (3, 16, 256, 4096):
        coder = FloatMapCoder(n)
        symbols = rng.integers(0, n, coder.segment * 40)
        anchors = coder.anchors(symbols)
        for s in range(40):
            ref = coder.anchor_reference(symbols[s * coder.segment:(s + 1) * coder.segment].tolist())
            assert np.allclose(anchors[s], ref, rtol=0, atol=1e-13)


@settings(max_examples=40, deadline=None)
@given(alphabet_and_stream(max_n=5000, max_len=300))
def test_float_roundtrip_and_random_access(case):
    n, symbols = case
    coder = FloatMapCoder(n)
    payload = coder.encode(symbols)
    coder.check_payload(payload, len(symbols))
    assert np.array_equal(coder.decode(payload, len(symbols)), symbols)
    assert [coder.decode_at(payload, len(symbols), i) for i in range(len(symbols))] == symbols.tolist()


def test_float_fallback_segments_are_flagged_and_exact(monkeypatch):
    # Segments longer than the precision budget cannot round-trip: they must be stored exactly.
    coder = FloatMapCoder(256)
    object.__setattr__(coder, "segment", 14)
    object.__setattr__(coder, "_weights", (1 - coder.r) * coder.r ** np.arange(13, -1, -1))
    symbols = np.random.default_rng(1).integers(0, 256, 14 * 30 + 5)
    payload = coder.encode(symbols)
    _, flags, _ = coder._layout(payload, len(symbols))
    assert flags.sum() >= 25  # 14 symbols need ~89 bits of float64 precision
    assert np.array_equal(coder.decode(payload, len(symbols)), symbols)
    assert [coder.decode_at(payload, len(symbols), i) for i in range(len(symbols))] == symbols.tolist()
