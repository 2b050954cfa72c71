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
                                       shell_search, shell_size, shell_tables, sigma3, unrank)
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
    index, _ = shell_search(blocks, tables)
    expected = exhaustive_search(blocks, codebook_points(levels))
    assert np.array_equal(index, expected)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=8, max_size=8), st.sampled_from([0.02, 0.05, 0.0625, 0.1]))
def test_leader_search_breaks_ties_as_the_reference(grid, step):
    """Coordinates on a coarse grid: equal |y|, zeros and sign-symmetric blocks, so exact ties between
    permutations, sign patterns, parity flips, leaders and levels."""
    y = (np.array(grid, dtype=np.float32) * np.float32(step))[None, :]
    for levels in (SMALL, shipped_levels(64, 2), shipped_levels(64, 1.75)):
        index, _ = shell_search(y, shell_tables(levels))
        assert index[0] == exhaustive_search(y, codebook_points(levels))[0], (grid, step)


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
    with pytest.raises(ValueError, match="materialise"):
        codebook_points(shipped_levels(64, 3))
