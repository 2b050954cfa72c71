"""E8 shell codes (`fibquant.codebook.e8shell`): the leaders number every shell point once, the unrank is
a bijection onto the materialised E8 shells, and the numba leader search gives the exhaustive reference's
index (lowest among ties) on random blocks and on blocks full of ties (hypothesis)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fibquant.codebook.e8shell import (ShellLevels, codebook_points, exhaustive_search, orbit_size, shell_leaders,
                                       shell_size, shell_tables, sigma3, unrank)
from fibquant.codebook.e8shell_search import lattice_pass, shell_search, uses_lattice
from fibquant.codecs.e8shell import shipped_levels

# a small code with the origin, an integer-only and mixed shells and one shell at two radii
SMALL = ShellLevels((0, 1, 2, 2, 3), (0.0, 0.1, 0.2, 0.3, 0.45))


def e8_shell(m: int) -> set[tuple]:
    """Every point of E8 with squared norm 2m, enumerated independently of the leaders: the integer points
    with even coordinate sum and the half-integer ones with even sum (coordinates x 2, as integers)."""
    top = math.isqrt(2 * m)
    points = set()
    for v in itertools.product(range(-top, top + 1), repeat=8):
        if sum(c * c for c in v) == 2 * m and sum(v) % 2 == 0:
            points.add(tuple(2 * c for c in v))
    odd = [c for c in range(-2 * top - 1, 2 * top + 2) if c % 2]
    for v in itertools.product(odd, repeat=8):
        if sum(c * c for c in v) == 8 * m and (sum(v) // 2) % 2 == 0:
            points.add(v)
    return points


def test_leader_orbits_count_every_shell():
    for m in range(1, 31):
        li, lh, _ = shell_leaders(m)
        total = sum(orbit_size(v, False) for v in li) + sum(orbit_size(v, True) for v in lh)
        assert total == shell_size(m) == 240 * sigma3(m)
    with pytest.raises(ValueError, match="positive integer"):
        shell_leaders(0)


def test_unrank_numbers_the_e8_shells_once_and_search_inverts_it():
    tables = shell_tables(SMALL)
    assert tables.count == sum(shell_size(m) for m in SMALL.shells)
    book = codebook_points(SMALL)
    assert len(np.unique(np.round(book, 12), axis=0)) == tables.count
    for g, (m, r) in enumerate(zip(SMALL.shells, SMALL.radii)):
        part = book[tables.offsets[g]:tables.offsets[g] + shell_size(m)]
        if m == 0:
            assert np.array_equal(part, np.zeros((1, 8)))
            continue
        np.testing.assert_allclose((part ** 2).sum(1), r * r, rtol=1e-12)
        doubled = {tuple(v) for v in np.rint(part * 2 * math.sqrt(2 * m) / r).astype(int).tolist()}
        if m <= 2:  # the independent enumeration is 17^8 / 13^8 candidates: cheap up to m = 2
            assert doubled == e8_shell(m)
    # every point encodes to its own index (float32 blocks, as the codec feeds them)
    index, level = shell_search(book.astype(np.float32), tables)
    assert np.array_equal(index, np.arange(tables.count))
    assert np.array_equal(level, np.searchsorted(tables.offsets, index, side="right") - 1)


@pytest.mark.parametrize("levels", [SMALL, shipped_levels(64, 2), shipped_levels(64, 1.75), shipped_levels(64, 1.5),
                                    shipped_levels(64, 1), shipped_levels(128, 1.75)],
                         ids=["small", "shipped-b2", "shipped-b1.75", "shipped-b1.5", "shipped-b1", "shipped-d128-b1.75"])
def test_leader_search_equals_the_exhaustive_reference_on_random_blocks(levels):
    rng = np.random.default_rng(0)
    blocks = np.concatenate([rng.standard_normal((1500, 8)) * 0.12,       # unit-vector block scale
                             rng.standard_normal((100, 8)) * 0.5]).astype(np.float32)
    tables = shell_tables(levels)
    expected = exhaustive_search(blocks, codebook_points(levels))
    for method in ("auto", "scan", "lattice"):
        index, level = shell_search(blocks, tables, method)
        assert np.array_equal(index, expected), method
        assert np.array_equal(level, np.searchsorted(tables.offsets, expected, side="right") - 1), method
    # the lattice search settles most blocks itself (the rest go to the scan): the check above exercises it
    assert lattice_pass(blocks, tables)[2].mean() > 0.5


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=8, max_size=8), st.sampled_from([0.02, 0.05, 0.0625, 0.1]))
def test_leader_search_breaks_ties_as_the_reference(grid, step):
    """Coordinates on a coarse grid: equal |y|, zeros and sign-symmetric blocks, so exact ties between
    permutations, sign patterns, parity flips, leaders and levels."""
    y = (np.array(grid, dtype=np.float32) * np.float32(step))[None, :]
    for levels in (SMALL, shipped_levels(64, 2), shipped_levels(64, 1.75)):
        expected = exhaustive_search(y, codebook_points(levels))[0]
        for method in ("scan", "lattice"):
            index, _ = shell_search(y, shell_tables(levels), method)
            assert index[0] == expected, (grid, step, method)


def _blocks_at_every_scale(n: int, seed: int) -> np.ndarray:
    """8-blocks of rotated unit vectors (the codec's input), Gaussian blocks from tiny to large, heavy-tailed
    ones (Student t, 2 degrees of freedom: outlier channels as in real keys), zeros and one-hot blocks."""
    from fibquant.canonical import sample_sphere

    rng = np.random.default_rng(seed)
    parts = [sample_sphere(n // 8, 64, seed=seed).numpy().reshape(-1, 8)]
    for scale in (1e-5, 0.01, 0.05, 0.12, 0.3, 0.6, 2.0):
        parts.append(rng.standard_normal((n // 16, 8)) * scale)
    parts.append(rng.standard_t(2, (n // 8, 8)) * 0.08)
    parts.append(np.zeros((3, 8)))
    parts.append(np.eye(8) * 0.35)
    return np.concatenate(parts).astype(np.float32)


@pytest.mark.parametrize("bits", [3, 4])
def test_lattice_search_equals_the_leader_scan_at_3_and_4_bits(bits):
    """b >= 3: too many points to materialise, so the plain leader scan (itself equal to the exhaustive
    reference at b <= 2, above) is the reference of the lattice search, which "auto" takes at b = 4."""
    tables = shell_tables(shipped_levels(64, bits))
    assert uses_lattice(tables) == (bits == 4)
    blocks = _blocks_at_every_scale(4096, seed=bits)
    expected = shell_search(blocks, tables, "scan")
    for method in ("auto", "lattice"):
        index, level = shell_search(blocks, tables, method)
        assert np.array_equal(index, expected[0]) and np.array_equal(level, expected[1]), method
    unit = np.ascontiguousarray(blocks[:512])  # the rotated unit vectors: nearly all settled by the lattice
    assert lattice_pass(unit, tables)[2].mean() > 0.85
    assert np.array_equal(shell_search(blocks.astype(np.float64), tables, "lattice")[0],
                          shell_search(blocks.astype(np.float64), tables, "scan")[0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=8, max_size=8), st.sampled_from([0.02, 0.05, 0.0625, 0.1]))
def test_lattice_search_breaks_ties_as_the_scan_at_4_bits(grid, step):
    y = (np.array(grid, dtype=np.float32) * np.float32(step))[None, :]
    tables = shell_tables(shipped_levels(64, 4))
    assert shell_search(y, tables, "lattice")[0][0] == shell_search(y, tables, "scan")[0][0], (grid, step)


def test_unrank_rejects_out_of_range_and_levels_validate():
    tables = shell_tables(SMALL)
    with pytest.raises(ValueError, match="out of range"):
        unrank(np.array([tables.count]), tables)
    with pytest.raises(ValueError, match="ascending"):
        ShellLevels((1, 2), (0.3, 0.2))
    with pytest.raises(ValueError, match="origin"):
        ShellLevels((1, 0), (0.1, 0.0))
    with pytest.raises(ValueError, match="radius"):
        ShellLevels((2,), (0.0,))
    with pytest.raises(ValueError, match="blocks"):
        shell_search(np.zeros((3, 7), np.float32), tables)
    with pytest.raises(ValueError, match="method"):
        shell_search(np.zeros((3, 8), np.float32), tables, "exhaustive")
    with pytest.raises(ValueError, match="blocks"):
        shell_search(np.zeros((3, 8), np.int64), tables, "lattice")
    with pytest.raises(ValueError, match="materialise"):
        codebook_points(shipped_levels(64, 3))
