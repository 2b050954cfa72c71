"""Universal codebooks: construction, determinism, storage, cache, exact k = 1 Lloyd-Max."""
import math

import numpy as np
import pytest
import torch
from scipy import integrate

import fibquant.codebook as cbmod
from fibquant.codebook import (CONSTRUCTION_VERSION, CodebookSpec, build_codebook, load_codebook,
                               lloyd_max_table, read_codebook, save_codebook)
from fibquant.codebook.construct import companded_radii, initial_codebook, roberts_alphas
from fibquant.codebook.lloyd import assign
from fibquant.codebook.store import SHIPPED_DIR
from fibquant.canonical import companded_radius_law, sample_blocks

SHIPPED_BUDGET_BYTES = 4 * 1024 * 1024  # d = 64 (v2, 1.2 MB) and d = 128 (v3, 2.1 MB)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FIBQUANT_CACHE_DIR", str(tmp_path))
    return tmp_path / "codebooks"


@pytest.fixture(scope="module")
def small_codebook():
    return build_codebook(16, 2, 16, seed=1, progress=False)


def test_build_is_bit_identical_and_seeded(small_codebook):
    again = build_codebook(16, 2, 16, seed=1, progress=False)
    assert torch.equal(small_codebook.codewords, again.codewords)
    assert small_codebook.codewords.shape == (16, 2) and small_codebook.codewords.dtype == torch.float32
    other = build_codebook(16, 2, 16, seed=2, progress=False)
    assert not torch.equal(small_codebook.codewords, other.codewords)


def test_build_does_not_depend_on_thread_count(small_codebook):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = build_codebook(16, 2, 16, seed=1, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single.codewords, small_codebook.codewords)


def test_lloyd_refinement_beats_initialisation_and_scalar_product(small_codebook):
    """Trained 2-D code (2 bits/coord) beats its own initialisation and TurboQuant's 2-bit scalar
    table on fresh samples (Theorem 2: vector beats scalar at equal rate)."""
    fresh = sample_blocks(1 << 16, 16, 2, seed=777)
    _, err_trained = assign(fresh, small_codebook.codewords)
    _, err_init = assign(fresh, initial_codebook(16, 2, 16).float())
    scalar_levels, scalar_total = lloyd_max_table(16, 4)
    trained_total = float(err_trained.double().mean()) * 8
    assert trained_total < float(err_init.double().mean()) * 8
    assert trained_total < scalar_total
    assert abs(trained_total - small_codebook.total_mse) < 0.1 * trained_total  # training figure is close


def test_safetensors_round_trip(small_codebook, tmp_path):
    path = save_codebook(small_codebook, tmp_path / "cb.safetensors")
    assert path.read_bytes()[:8]  # a real file
    loaded = read_codebook(path)
    assert loaded.spec == small_codebook.spec
    assert torch.equal(loaded.codewords, small_codebook.codewords)
    assert loaded.total_mse == small_codebook.total_mse


def test_cache_key_and_reuse(cache, monkeypatch):
    spec = CodebookSpec(8, 4, 8, seed=3)
    assert spec.file_name == f"fibquant_d8_k4_n8_s3_{CONSTRUCTION_VERSION}.safetensors"
    with pytest.raises(FileNotFoundError):
        load_codebook(8, 4, 8, seed=3, build=False)
    first = load_codebook(8, 4, 8, seed=3)
    assert (cache / spec.file_name).is_file()
    monkeypatch.setattr(cbmod, "build_codebook", lambda *a, **k: pytest.fail("rebuilt despite the cache"))
    second = load_codebook(8, 4, 8, seed=3)
    assert torch.equal(first.codewords, second.codewords)
    assert [p.name for p in cache.iterdir()] == [spec.file_name]


def test_corrupt_cache_file_is_rejected(cache):
    spec = CodebookSpec(8, 4, 8, seed=4)
    from fibquant.codebook.store import write_file
    write_file(cache / spec.file_name, torch.zeros(5, 4), {})
    with pytest.raises(ValueError, match="shape"):
        load_codebook(8, 4, 8, seed=4)


@pytest.mark.parametrize("args,match", [
    ((16, 3, 8), "divide"), ((16, 0, 8), "block size"), ((16, 2, 1), "N must be"),
    ((16, 2, 1 << 17), "exceeds"), ((16, 2, 8, -1), "seed"), ((1, 1, 2), "dim must be"),
    ((16.0, 2, 8), "dim must be"),
])
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        build_codebook(*args)
    with pytest.raises(ValueError, match=match):
        load_codebook(*args)


def _marginal(t, dim):
    const = math.exp(math.lgamma(dim / 2) - 0.5 * math.log(math.pi) - math.lgamma((dim - 1) / 2))
    return const * (1 - t * t) ** ((dim - 3) / 2)


@pytest.mark.parametrize("dim,n_levels", [(16, 2), (64, 4), (64, 16), (128, 8)])
def test_scalar_table_is_a_lloyd_max_fixed_point(dim, n_levels):
    """Independent check by adaptive quadrature: each level is its cell's centroid under the exact
    Beta marginal, decision thresholds are midpoints, and the reported MSE is the integral."""
    levels, total_mse = lloyd_max_table(dim, n_levels)
    assert np.all(np.diff(levels) > 0)
    np.testing.assert_allclose(levels, -levels[::-1], atol=1e-15)
    edges = np.concatenate([[-1.0], 0.5 * (levels[1:] + levels[:-1]), [1.0]])
    mse = 0.0
    for i, level in enumerate(levels):
        mass = integrate.quad(_marginal, edges[i], edges[i + 1], args=(dim,), epsabs=1e-14)[0]
        moment = integrate.quad(lambda t: t * _marginal(t, dim), edges[i], edges[i + 1], epsabs=1e-14)[0]
        assert abs(moment / mass - level) < 1e-9, f"level {i} is not its cell's centroid"
        mse += integrate.quad(lambda t: (t - level) ** 2 * _marginal(t, dim), edges[i], edges[i + 1],
                              epsabs=1e-14)[0]
    assert abs(dim * mse - total_mse) < 1e-9


def test_k1_codebook_is_the_scalar_table():
    codebook = build_codebook(64, 1, 8)
    levels, total = lloyd_max_table(64, 8)
    assert torch.equal(codebook.codewords.flatten(), torch.from_numpy(levels).float())
    assert codebook.total_mse == total


def test_initial_codebook_construction():
    # Roberts constants: phi^{m+1} = phi + 1 and alpha_j = phi^{-j} all different.
    alphas = roberts_alphas(5)
    phi = 1 / alphas[0]
    assert abs(phi ** 6 - phi - 1) < 1e-12 and len(set(alphas.round(12))) == 5
    # k = 2 closed-form companded radii equal scipy's Beta quantile.
    p = np.linspace(0.01, 0.99, 9)
    np.testing.assert_allclose(companded_radii(64, 2, p), np.sqrt(companded_radius_law(64, 2).ppf(p)), rtol=1e-10)
    for k in (2, 3, 4, 8):
        init = initial_codebook(48, k, 64)
        assert init.shape == (64, k)
        assert float(init.norm(dim=1).max()) < 1.0
        assert torch.unique(init, dim=0).shape[0] == 64
    full = initial_codebook(16, 16, 32)
    torch.testing.assert_close(full.norm(dim=1), torch.ones(32, dtype=torch.float64))
    with pytest.raises(ValueError, match="scalar"):
        initial_codebook(16, 1, 8)


def test_shipped_codebooks_load_and_fit_the_budget():
    import re

    from fibquant.codebook.residual import ResidualSpec, load_residual

    files = sorted(SHIPPED_DIR.glob("*.safetensors"))
    assert sum(p.stat().st_size for p in files) < SHIPPED_BUDGET_BYTES
    residual = [p for p in files if p.name.startswith("fibquant-rvq_")]  # [S, N, k] stages, their own loader
    for path in residual:
        d, k, s, n, seed = map(int, re.fullmatch(r"fibquant-rvq_d(\d+)_k(\d+)_s(\d+)_n(\d+)_seed(\d+)_r\d+"
                                                 r"\.safetensors", path.name).groups())
        spec = ResidualSpec(d, k, s, n, seed)
        assert spec.file_name == path.name
        assert torch.isfinite(load_residual(spec, build=False)).all()
    for path in (p for p in files if p not in residual):
        codebook = read_codebook(path)
        assert path.name == codebook.file_name
        assert codebook.codewords.shape == (codebook.spec.n_codewords, codebook.spec.k)
        assert torch.isfinite(codebook.codewords).all()
