"""Codebook construction versions: the v3 recipe (fast path against the reference, determinism,
budget, quality against v2), the lookup that keeps the shipped v2 files, and the shipped d = 128 set."""
import hashlib
import math

import pytest
import torch

from fibquant.codebook import (CONSTRUCTION_VERSION, LEGACY_VERSIONS, CodebookSpec, build_codebook,
                               find_codebook_file, load_codebook, read_codebook, recipe_v2, recipe_v3,
                               save_codebook)
from fibquant.codebook.numba_search import numba_available
from fibquant.codebook.lloyd import assign_exact, assign_reference
from fibquant.codebook.nearest import nearest_codeword_reference
from fibquant.codebook.store import SHIPPED_DIR, read_file
from fibquant.canonical import sample_blocks

# The shipped d = 64 codebooks, bit for bit: every measured d = 64 figure depends on them.
SHIPPED_V2_SHA256 = {
    "fibquant_d64_k16_n256_s0_v2.safetensors": "6b867b5cb9e36e5ae6ed54ef614c4dea83d83de3e04b530f87307c3c856951c3",
    "fibquant_d64_k2_n128_s0_v2.safetensors": "78a5e8296f7fd7740dce8028a4d8b0e371142c2fbb14652f56394f739065302b",
    "fibquant_d64_k2_n256_s0_v2.safetensors": "570fc56dfeeb7668d987ce5a5dfd01520a90af69b868084d2c5a9a1281a21f14",
    "fibquant_d64_k32_n256_s0_v2.safetensors": "56c4e7ce23211ab90b8c604ba643475a9a8efceec1ef25e40127d0b9564ba785",
    "fibquant_d64_k4_n1024_s0_v2.safetensors": "5fba1283eb68e4ea71424822208ffb59cf44f44d7625d5fa4063805d83ebbdae",
    "fibquant_d64_k4_n256_s0_v2.safetensors": "a42574de8b2e4e431a2f02250aeef7ff6db93b73daff83e260c4e619ae18549e",
    "fibquant_d64_k4_n4096_s0_v2.safetensors": "b0c8410d4a194c514047055b9d0ebe10886f06164cb41a4708456e1782a93f41",
    "fibquant_d64_k64_n4096_s0_v2.safetensors": "1e6a4f49f31e320b361da1d2abab37a81b1dfb2d84fa1e4866430d74e90b23e0",
    "fibquant_d64_k8_n256_s0_v2.safetensors": "419c03e41b5104abff52ab823f5c9d05d1c54c5278b974ba5d8e96dc31855363",
}
STANDARD_RATES = (0.1875, 0.25, 0.375, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4)  # the for_rate docstring table
needs_numba = pytest.mark.skipif(not numba_available(), reason="numba not importable")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FIBQUANT_CACHE_DIR", str(tmp_path))
    return tmp_path / "codebooks"


def fresh_mse(codewords, dim, k, vectors=1 << 14, seed=4242):
    blocks = sample_blocks(vectors * (dim // k), dim, k, seed=seed)
    index = assign_reference(blocks, codewords)
    return float(((blocks - codewords[index]) ** 2).sum(-1).double().sum()) / vectors


def test_versions():
    assert CONSTRUCTION_VERSION == "v3" and LEGACY_VERSIONS == ("v2",)
    spec = CodebookSpec(64, 4, 256)
    assert spec.file_name == "fibquant_d64_k4_n256_s0_v3.safetensors"
    assert spec.file_name_for("v2") == "fibquant_d64_k4_n256_s0_v2.safetensors"
    assert spec.derived_seed("x", "v2") != spec.derived_seed("x", "v3") == spec.derived_seed("x")
    with pytest.raises(ValueError, match="version"):
        build_codebook(8, 2, 4, version="v9")


def test_shipped_d64_files_are_unchanged_and_still_load():
    """Every shipped d = 64 file is byte-for-byte the v2 file and is what load_codebook returns."""
    shipped = {p.name for p in SHIPPED_DIR.glob("fibquant_d64_*.safetensors")}
    assert shipped == set(SHIPPED_V2_SHA256)
    for name, digest in SHIPPED_V2_SHA256.items():
        path = SHIPPED_DIR / name
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, name
        spec = read_codebook(path).spec
        loaded = load_codebook(spec.dim, spec.k, spec.n_codewords, build=False)
        assert loaded.version == "v2" and find_codebook_file(spec) == path
        assert torch.equal(loaded.codewords, read_file(path)[0])


def test_a_cached_legacy_file_is_used_before_building(cache, monkeypatch):
    """A v2 file in the cache (built by an earlier version) keeps serving its key."""
    import fibquant.codebook as cbmod
    legacy = build_codebook(8, 2, 8, seed=5, version="v2", progress=False)
    assert legacy.version == "v2"
    path = save_codebook(legacy)
    assert path.name == "fibquant_d8_k2_n8_s5_v2.safetensors"
    monkeypatch.setattr(cbmod, "build_codebook", lambda *a, **k: pytest.fail("built despite a cached v2 file"))
    loaded = load_codebook(8, 2, 8, seed=5)
    assert loaded.version == "v2" and torch.equal(loaded.codewords, legacy.codewords)


def test_a_new_key_builds_and_caches_v3(cache):
    codebook = load_codebook(8, 4, 16, seed=6)
    assert codebook.version == "v3"
    assert (cache / "fibquant_d8_k4_n16_s6_v3.safetensors").is_file()
    again = read_codebook(cache / "fibquant_d8_k4_n16_s6_v3.safetensors")
    assert again.version == "v3" and torch.equal(again.codewords, codebook.codewords)


@needs_numba
@pytest.mark.parametrize("k,n", [(1, 16), (2, 16), (3, 40), (4, 64), (8, 64), (16, 32)])
def test_exact_assignment_is_the_reference(k, n):
    """The numba assignment (tree for k <= 4, screened full scan above) returns the reference's
    index, exact ties (duplicated codewords) included."""
    codewords = sample_blocks(n, 48, k, seed=11)
    codewords[n // 2] = codewords[n // 3]  # an exact tie: the lower index must win
    samples = torch.cat([sample_blocks(5000, 48, k, seed=12), codewords[n // 3:n // 3 + 1].expand(7, k)])
    expected = nearest_codeword_reference(samples, codewords)
    assert torch.equal(assign_exact(samples, codewords, use_numba=True), expected)
    assert torch.equal(assign_reference(samples, codewords), expected)


@needs_numba
@pytest.mark.parametrize("dim,k,n", [(16, 2, 16), (16, 4, 32), (32, 8, 32)])
def test_v3_fast_path_equals_the_reference_path(dim, k, n, monkeypatch):
    """The v3 build with the numba assignment is bit-identical to the same build with the plain
    reference assignment (the plan is shrunk so that the reference path stays cheap)."""
    monkeypatch.setattr(recipe_v3, "MAX_COARSE_ITERATIONS", 6)
    monkeypatch.setattr(recipe_v3, "MAX_FINAL_PER_CODEWORD", 128)
    spec = CodebookSpec(dim, k, n, seed=3)
    fast, fast_mse = recipe_v3.build_vector(spec, False, use_numba=True)
    slow, slow_mse = recipe_v3.build_vector(spec, False, use_numba=False)
    assert torch.equal(fast, slow) and fast_mse == slow_mse


@pytest.mark.parametrize("dim,k,n", [(16, 2, 16), (32, 8, 64)])
def test_v3_is_bit_identical_across_runs_and_thread_counts(dim, k, n):
    threads = torch.get_num_threads()
    first = build_codebook(dim, k, n, seed=1, progress=False)
    try:
        torch.set_num_threads(1)
        single = build_codebook(dim, k, n, seed=1, progress=False)
        torch.set_num_threads(2)
        double = build_codebook(dim, k, n, seed=1, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(first.codewords, single.codewords) and torch.equal(first.codewords, double.codewords)
    assert first.total_mse == single.total_mse
    assert not torch.equal(first.codewords, build_codebook(dim, k, n, seed=2, progress=False).codewords)


def test_v2_recipe_is_still_deterministic():
    a = build_codebook(16, 2, 8, seed=1, version="v2", progress=False)
    b = build_codebook(16, 2, 8, seed=1, version="v2", progress=False)
    assert a.version == "v2" and torch.equal(a.codewords, b.codewords)


@pytest.mark.parametrize("dim,k,n", [(32, 2, 32), (32, 4, 32), (32, 8, 32)])
def test_v3_is_no_worse_than_v2_on_fresh_samples(dim, k, n):
    """On samples neither recipe trained on, v3's MSE is at most v2's (0.2 % slack for the
    estimate's noise on 2^14 vectors; the benchmark measures the shipped rates on 2^16)."""
    new = build_codebook(dim, k, n, progress=False)
    old = build_codebook(dim, k, n, version="v2", progress=False)
    assert fresh_mse(new.codewords, dim, k) <= fresh_mse(old.codewords, dim, k) * 1.002


@pytest.mark.parametrize("dim", [64, 80, 96, 128, 256])
def test_v3_plan_fits_the_budget_for_every_for_rate_block(dim):
    """Every (k, N <= 4096) a rate can pick for this dim plans at most ~WORK multiply-add equivalents
    (the minimum batch of 16 N per final iteration may exceed it slightly at the largest k N)."""
    for k in (k for k in range(2, dim + 1) if dim % k == 0):
        for bits in range(1, 13):
            spec = CodebookSpec(dim, k, 1 << bits)
            (coarse, coarse_it), (final, final_it) = recipe_v3.plan(spec)
            assert recipe_v3.MIN_COARSE_ITERATIONS <= coarse_it <= recipe_v3.MAX_COARSE_ITERATIONS
            assert final_it == recipe_v3.FINAL_ITERATIONS and final >= recipe_v3.MIN_BATCH
            work = (coarse * coarse_it + final * final_it) * recipe_v3.sample_cost(k, 1 << bits)
            assert work <= 1.4 * recipe_v3.WORK, (k, 1 << bits, work)


def test_progress_bar(capsys):
    build_codebook(16, 4, 16, seed=9, progress=True)
    assert "codebook d=16 k=4 N=16" in capsys.readouterr().err
    build_codebook(16, 4, 16, seed=9, progress=False)
    assert "codebook d=16" not in capsys.readouterr().err


def test_shipped_d128_set_is_complete_and_v3():
    """The d = 128 codebooks of every standard rate ship, as v3 files."""
    from fibquant.codecs.fibquant import choose_block
    for bits in STANDARD_RATES:
        k, n = choose_block(128, bits)
        spec = CodebookSpec(128, k, n)
        path = find_codebook_file(spec)
        assert path is not None and path.parent == SHIPPED_DIR and path.name == spec.file_name, bits
        codebook = read_codebook(path)
        assert codebook.version == "v3" and math.isfinite(codebook.total_mse)


def test_shipped_d128_file_is_what_the_recipe_builds():
    """Rebuilding a shipped d = 128 codebook (the cheapest, k = 2, N = 128) gives the file's codewords."""
    spec = CodebookSpec(128, 2, 128)
    shipped = read_file(SHIPPED_DIR / spec.file_name)[0]
    assert torch.equal(build_codebook(128, 2, 128, progress=False).codewords, shipped)
