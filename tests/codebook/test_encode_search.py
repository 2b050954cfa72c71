"""The encode search at every default rate of `FibQuantCodec.for_rate` (1 ... 4 bits, d = 64 and 128):
codes equal the plain exhaustive reference (`nearest_codeword_reference`, ties to the lowest index)
on random and adversarial inputs, in particular for the certified Delaunay walk (k = 4) on blocks
placed on and beside Voronoi faces and vertices, and on degenerate codebooks it must not certify."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fibquant.codebook import load_codebook
from fibquant.codebook.numba_search import NumbaSearch, build_delaunay, choose_method, numba_available
from fibquant.codebook.nearest import nearest_codeword_reference
from fibquant.codecs.bitpack import pack_bits
from fibquant.codecs.fibquant import FibQuantCodec, choose_block
from fibquant.canonical import sample_sphere

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba is not installed")

RATES = [1, 1.5, 2, 2.5, 3, 3.5, 4]
SHIPPED = [(dim, b) for dim in (64, 128) for b in RATES if not (dim == 64 and b == 1.5)]  # d=64 1.5 b builds


def reference_index(blocks: torch.Tensor, codewords: torch.Tensor) -> torch.Tensor:
    parts = [nearest_codeword_reference(blocks[i:i + 128], codewords) for i in range(0, len(blocks), 128)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def reference_codes(codec: FibQuantCodec, x: torch.Tensor) -> torch.Tensor:
    norm_bytes, u = codec._rotation.normalise_rotate(x, "FibQuantCodec")
    index = reference_index(u.reshape(-1, codec.k), codec.codebook.codewords).reshape(len(u), -1)
    return torch.cat([norm_bytes, pack_bits(index, codec.config.index_bits)], dim=1)


def face_blocks(search: NumbaSearch, m: int, seed: int) -> torch.Tensor:
    """Blocks on Delaunay faces (midpoints of neighbour pairs: ties up to float32 rounding), one float32
    step beside them, on Voronoi vertices (circumcentres of a codeword and its neighbours' face
    points averaged: near multi-way ties), on codewords, and far out (beyond the dummies' reach)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.from_numpy(search.table.numpy()[:search.n_codewords, :search.k])
    owner = torch.repeat_interleave(torch.arange(len(search.offsets) - 1), torch.diff(search.offsets))
    real = (owner < search.n_codewords) & (search.neighbours.long() < search.n_codewords)
    pick = torch.nonzero(real).flatten()[torch.randint(0, int(real.sum()), (m,), generator=gen)]
    v, w = table[owner[pick]], table[search.neighbours.long()[pick]]
    mid = (0.5 * (v + w)).float()
    step = torch.randint(-1, 2, mid.shape, generator=gen).float()
    beside = torch.where(step == 0, mid, torch.nextafter(mid, step * float("inf")))
    corner = (mid + 0.5 * (table[torch.randint(0, len(table), (m,), generator=gen)] - v) * 1e-3).float()
    far = torch.randn(8, search.k, generator=gen) * 3.0
    return torch.cat([mid, beside, corner, table.float()[:m], far, torch.zeros(1, search.k)]).contiguous()


@pytest.mark.parametrize("dim,bits", SHIPPED)
def test_default_rates_encode_like_the_reference(dim, bits):
    codec = FibQuantCodec.for_rate(dim, bits)
    gen = torch.Generator().manual_seed(int(bits * 10) + dim)
    x = torch.cat([torch.randn(150, dim, generator=gen), sample_sphere(100, dim, seed=dim).float(),
                   torch.zeros(1, dim), torch.eye(dim)[:3] * 100])
    assert torch.equal(codec.encode(x), reference_codes(codec, x))
    assert torch.equal(codec.encode(x[:2]), reference_codes(codec, x[:2]))  # a few blocks: other kernel paths


def test_one_and_a_half_bits_search_like_the_reference():
    """k = 8, N = 4096 (1.5 bits): the d = 128 shipped codebook through the search d = 64 uses (the
    d = 64 codebook builds on first use, too slow here; the search does not depend on the file)."""
    assert choose_block(64, 1.5) == choose_block(128, 1.5) == (8, 4096)
    codewords = load_codebook(128, 8, 4096).codewords
    search = NumbaSearch(codewords, 64)
    assert search.method == "brute"
    gen = torch.Generator().manual_seed(15)
    u = torch.cat([sample_sphere(40, 64, seed=3).float(), codewords[:8].reshape(1, 64),
                   (0.5 * (codewords[:8] + codewords[8:16])).reshape(1, 64)])
    ref = reference_index(u.reshape(-1, 8), codewords).reshape(len(u), -1)
    assert torch.equal(search.indices(u), ref)
    assert torch.equal(search.indices(u[-2:]), ref[-2:])
    del gen


@pytest.mark.parametrize("dim,n", [(64, 256), (64, 1024), (64, 4096), (128, 4096)])
def test_walk_on_faces_and_vertices_of_shipped_codebooks(dim, n):
    codewords = load_codebook(dim, 4, n).codewords
    search = NumbaSearch(codewords, dim, "walk")
    assert choose_method(4, n) == ("grid" if n <= 256 else "walk")
    assert float(search.certified.float().mean()) > 0.99  # else the walk falls back to the full search
    blocks = face_blocks(search, 1500, seed=n + dim)
    assert torch.equal(search.indices(blocks).reshape(-1), reference_index(blocks, codewords))


def test_walk_does_not_certify_degenerate_cells():
    """A 3^4 grid: every Delaunay cell is a cube with 16 cospherical corners, so no empty-sphere check
    has room to spare around the centre; duplicates make ties everywhere. Still the reference's codes."""
    axis = torch.tensor([-0.2, 0.0, 0.2])
    grid = torch.cartesian_prod(axis, axis, axis, axis)
    centre = int(((grid == 0).all(1)).nonzero())
    codewords = torch.cat([grid, grid[:5]])                   # duplicates of the first five
    offsets, nbr, pts, certified = build_delaunay(codewords.double().numpy())
    assert not certified[centre] and not certified[0] and not certified[len(grid)]
    search = NumbaSearch(codewords, 64, "walk")
    gen = torch.Generator().manual_seed(3)
    blocks = torch.cat([torch.rand(600, 4, generator=gen) * 0.6 - 0.3, grid + 0.1, grid, grid * 0.5,
                        torch.full((1, 4), 0.1)])
    assert torch.equal(search.indices(blocks).reshape(-1), reference_index(blocks, codewords))


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 4), st.integers(5, 120), st.integers(0, 2 ** 16), st.booleans())
def test_walk_property(k, n, seed, near_duplicates):
    """Random codebooks (with near-duplicate codewords: faces of tiny reach) and blocks on their faces."""
    gen = torch.Generator().manual_seed(seed)
    codewords = torch.randn(n, k, generator=gen) * 0.2
    if near_duplicates:
        codewords[n // 2] = torch.nextafter(codewords[0], torch.full((k,), 1.0))
        codewords[n - 1] = codewords[1] * (1 + 1e-6)
    search = NumbaSearch(codewords, 16, "walk")
    blocks = torch.cat([face_blocks(search, 60, seed), torch.randn(60, k, generator=gen) * 0.3])
    assert torch.equal(search.indices(blocks).reshape(-1), reference_index(blocks, codewords))
    assert np.isfinite(search.table.numpy()).all()


@pytest.mark.parametrize("dim,n", [(64, 256), (128, 4096)])
def test_scan_on_codewords_and_midpoints(dim, n):
    """k = 8 (the 1 and 1.5 bit defaults), enough blocks for the fused scan kernel: blocks on codewords
    (float32 distances ~0, may round below 0), on midpoints of pairs (ties) and one float32 step beside."""
    codewords = load_codebook(dim, 8, n).codewords
    search = NumbaSearch(codewords, dim)
    gen = torch.Generator().manual_seed(n)
    pairs = torch.randint(0, n, (200, 2), generator=gen)
    mid = 0.5 * (codewords[pairs[:, 0]] + codewords[pairs[:, 1]])
    step = torch.randint(-1, 2, mid.shape, generator=gen).float()
    blocks = torch.cat([codewords[:200], mid, torch.where(step == 0, mid, torch.nextafter(mid, step * float("inf"))),
                        codewords[:50] * 3.0, torch.zeros(2, 8)]).contiguous()
    assert len(blocks) >= 256
    assert torch.equal(search.indices(blocks).reshape(-1), reference_index(blocks, codewords))


def cluster_blocks(codewords: torch.Tensor, m: int, seed: int) -> torch.Tensor:
    """Blocks for the cluster search: on codewords, on midpoints of pairs (ties up to float32 rounding)
    and one float32 step beside them, far out, and zero."""
    gen = torch.Generator().manual_seed(seed)
    n, k = codewords.shape
    pairs = torch.randint(0, n, (m, 2), generator=gen)
    mid = 0.5 * (codewords[pairs[:, 0]] + codewords[pairs[:, 1]])
    step = torch.randint(-1, 2, mid.shape, generator=gen).float()
    beside = torch.where(step == 0, mid, torch.nextafter(mid, step * float("inf")))
    far = torch.randn(8, k, generator=gen) * 3.0
    return torch.cat([codewords[:m], mid, beside, far, torch.zeros(1, k)]).contiguous()


def test_cluster_search_like_the_reference():
    """The opt-in cluster search (k-means clusters of the codebook, ball and half-space bounds, float32
    screen, float64 decision) on the shipped k = 8, N = 4096 codebook: canonical rotated blocks, ties."""
    codewords = load_codebook(128, 8, 4096).codewords
    search = NumbaSearch(codewords, 64, "cluster")
    u = sample_sphere(60, 64, seed=7).float().reshape(-1, 8)
    blocks = torch.cat([u, cluster_blocks(codewords, 300, 4)])
    assert torch.equal(search.indices(blocks).reshape(-1), reference_index(blocks, codewords))


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 8), st.integers(2, 300), st.integers(0, 2 ** 16), st.booleans())
def test_cluster_property(k, n, seed, duplicates):
    """Random codebooks (with duplicate and near-duplicate codewords) and blocks on and beside their
    midpoints: the cluster search returns the reference's index, ties included."""
    gen = torch.Generator().manual_seed(seed)
    codewords = torch.randn(n, k, generator=gen) * 0.2
    if duplicates:
        codewords[n // 2] = codewords[0]
        codewords[n - 1] = torch.nextafter(codewords[1], torch.full((k,), 1.0))
    search = NumbaSearch(codewords, 16, "cluster")
    blocks = torch.cat([cluster_blocks(codewords, 60, seed), torch.randn(60, k, generator=gen) * 0.3])
    assert torch.equal(search.indices(blocks).reshape(-1), reference_index(blocks, codewords))
