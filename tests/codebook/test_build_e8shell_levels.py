"""tools/build_e8shell_levels.py: its design machinery (the vectorised leader search, shell-code MSE, Lloyd
radii) against exhaustive searches over materialised shells and codebooks (the registered codec's numba
search, index and unrank: tests/codebook/test_e8shell.py), and a rebuild of shipped rates compared with
src/fibquant/codebook/e8shell_shipped.py."""
from __future__ import annotations

import math

import numpy as np
import pytest
from _benchmarks import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("build_e8shell_levels")


def _codebook(tool, shells, radii) -> np.ndarray:
    return np.concatenate([np.zeros((1, 8)) if m == 0 else tool.shell_points(m) * (r / math.sqrt(2 * m))
                           for m, r in zip(shells, radii)])


def _nearest(y: np.ndarray, book: np.ndarray) -> np.ndarray:
    """Exhaustive squared distance of each row of y [n, 8] to the nearest row of book [N, 8] (float64)."""
    return np.maximum(((y ** 2).sum(1)[:, None] - 2 * y @ book.T + (book ** 2).sum(1)[None, :]).min(1), 0.0)


def _blocks(rng, n=600) -> np.ndarray:
    """Random blocks of unit-vector scale plus blocks with tied and zero coordinates."""
    return np.concatenate([rng.standard_normal((n, 8)) * 0.15,
                           np.round(rng.standard_normal((n // 3, 8)) * 4) / 16])


def test_leader_orbits_count_every_shell(tool):
    from fibquant.codebook.e8shell import orbit_size, sigma3

    for m in range(1, 25):
        li, lh, _ = tool.shell_leaders(m)
        total = sum(orbit_size(l, False) for l in li) + sum(orbit_size(l, True) for l in lh)
        assert total == tool.shell_size(m) == 240 * sigma3(m)
    for m in (1, 2, 3):
        points = tool.shell_points(m)
        assert len(points) == tool.shell_size(m)
        assert np.allclose((points ** 2).sum(1), 2 * m)
        doubled = np.rint(2 * points).astype(int)  # E8: all integer or all half-integer, even sum
        assert np.all((doubled % 2 == 0).all(1) | (doubled % 2 == 1).all(1))
        assert np.all((doubled.sum(1) // 2) % 2 == 0)


def test_leader_search_equals_exhaustive(tool):
    table = tool.ShellTable([1, 2, 3])
    blocks = _blocks(np.random.default_rng(0))
    cos = table.max_cos(blocks)
    for j, m in enumerate(table.shells):
        exhaustive = (blocks @ tool.shell_points(m).T).max(1) / math.sqrt(2 * m)
        np.testing.assert_allclose(cos[:, j], exhaustive, rtol=0, atol=1e-12)


def test_shell_code_mse_equals_exhaustive_and_lloyd_does_not_raise_it(tool):
    rng = np.random.default_rng(1)
    blocks = _blocks(rng)
    table = tool.ShellTable([1, 2, 3])
    column = {m: j for j, m in enumerate(table.shells)}
    norm2, cos = (blocks ** 2).sum(1), table.max_cos(blocks)
    code = tool.ShellCode([0, 1, 2, 2, 3], [0.0, 0.1, 0.2, 0.3, 0.45])
    expected = 8 * _nearest(blocks, _codebook(tool, code.shells, code.radii)).mean()
    assert code.mse(norm2, cos, column) == pytest.approx(expected, rel=1e-12)
    assert code.lloyd(norm2, cos, column).mse(norm2, cos, column) <= code.mse(norm2, cos, column) * (1 + 1e-12)


def test_rebuilding_the_smallest_rates_reproduces_the_shipped_levels(tool):
    """The tool's --check mode on 1 and 1.5 bits (d = 64 and the d = 128 refit; the full build of every
    rate takes minutes and is `python tools/build_e8shell_levels.py --check`)."""
    assert tool.main(["--bits", "1", "1.5", "--check"]) == 0


def test_differences_names_a_changed_shell_or_radius_and_a_missing_rate(tool):
    from fibquant.codebook.e8shell_shipped import SHIPPED_LEVELS

    shells, radii = SHIPPED_LEVELS[(64, 2)]
    assert tool.differences({(64, 2): (shells, radii)}, SHIPPED_LEVELS) == []
    moved = (shells, (radii[0] * (1 + 1e-4),) + tuple(radii[1:]))
    assert "radii differ" in tool.differences({(64, 2): moved}, SHIPPED_LEVELS)[0]
    assert "shells" in tool.differences({(64, 2): ((9,) + tuple(shells[1:]), radii)}, SHIPPED_LEVELS)[0]
    assert "not shipped" in tool.differences({(64, 5): (shells, radii)}, SHIPPED_LEVELS)[0]


def test_render_round_trips_the_shipped_table(tool):
    from fibquant.codebook.e8shell_shipped import SHIPPED_LEVELS

    namespace = {}
    exec(tool.render(SHIPPED_LEVELS, ["    (provenance)"]), namespace)
    assert namespace["SHIPPED_LEVELS"] == SHIPPED_LEVELS


def test_writing_needs_every_rate(tool):
    with pytest.raises(SystemExit):
        tool.main(["--bits", "1"])
    with pytest.raises(SystemExit):
        tool.main(["--bits", "0.3", "--check"])
