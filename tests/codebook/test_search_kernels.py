"""The numba encode path (codebook/numba_search.py, search_kernels.py): codes bit-identical to the
reference search (the spec) and to the torch path, on random and adversarial data."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fibquant.codebook.numba_search import NumbaSearch, build_tree, choose_method, numba_available
from fibquant.codebook.nearest import nearest_codeword_reference
from fibquant.codecs.bitpack import pack_bits
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.canonical import sample_sphere

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba is not installed")

SHIPPED = [(2, 256), (2, 128), (4, 4096), (4, 1024), (4, 256), (8, 256), (16, 256), (32, 256), (64, 4096)]


def reference_index(blocks: torch.Tensor, codewords: torch.Tensor) -> torch.Tensor:
    return torch.cat([nearest_codeword_reference(blocks[i:i + 256], codewords) for i in range(0, len(blocks), 256)]
                     or [torch.empty(0, dtype=torch.int64)])


def reference_codes(codec: FibQuantCodec, x: torch.Tensor) -> torch.Tensor:
    """The spec: RotationState.normalise_rotate, the reference search, pack_bits."""
    norm_bytes, u = codec._rotation.normalise_rotate(x, "FibQuantCodec")
    index = reference_index(u.reshape(-1, codec.k), codec.codebook.codewords).reshape(len(u), -1)
    return torch.cat([norm_bytes, pack_bits(index, codec.config.index_bits)], dim=1)


def torch_codes(codec: FibQuantCodec, x: torch.Tensor) -> torch.Tensor:
    codec.fast_search = False
    try:
        return codec.encode(x)
    finally:
        codec.fast_search = True


def adversarial_rows(dim: int = 64) -> torch.Tensor:
    """Zero, huge, tiny, axis, constant, +-1 and repeated rows."""
    eye = torch.eye(dim)[:8]
    rows = [torch.zeros(3, dim), eye * 6e4, eye * 1e-30, eye, -eye, torch.full((2, dim), 0.125),
            torch.full((1, dim), -3e-41), torch.sign(torch.randn(4, dim, generator=torch.Generator().manual_seed(1))),
            torch.randn(2, dim, generator=torch.Generator().manual_seed(2)).repeat(3, 1) * 1e3]
    return torch.cat(rows)


@pytest.mark.parametrize("k,n", SHIPPED + [(1, 16)])  # (1, 16): fibquant:k=1,n=16, the scalar search
def test_shipped_codes_match_reference_and_torch_path(k, n):
    codec = FibQuantCodec(64, k, n)
    assert codec._numba_search(torch.device("cpu")) is not None
    gen = torch.Generator().manual_seed(k * n)
    x = torch.cat([torch.randn(300, 64, generator=gen) * 3, sample_sphere(200, 64, seed=k), adversarial_rows()])
    codes = codec.encode(x)
    assert torch.equal(codes, reference_codes(codec, x))
    assert torch.equal(codes, torch_codes(codec, x))
    for rows in (1, 16):  # small batches (the rotation matmul may round per batch size: compare per batch)
        assert torch.equal(codec.encode(x[:rows]), reference_codes(codec, x[:rows]))
    _, u = codec._rotation.normalise_rotate(x, "FibQuantCodec")
    assert torch.equal(codec.block_indices(u), reference_index(u.reshape(-1, k), codec.codebook.codewords)
                       .reshape(len(x), -1))


def test_codec_inputs_and_errors():
    codec = FibQuantCodec(64, 2, 256)
    x = torch.randn(40, 128)[:, ::2]  # not contiguous
    assert torch.equal(codec.encode(x), reference_codes(codec, x.contiguous()))
    y = torch.randn(5, 64, requires_grad=True)
    assert torch.equal(codec.encode(y), reference_codes(codec, y.detach()))
    assert codec.encode(torch.empty(0, 64)).shape == (0, codec.code_size)
    z = torch.randn(2, 3, 64, dtype=torch.float64)
    assert torch.equal(codec.encode(z).reshape(6, -1), reference_codes(codec, z.reshape(6, 64).float()))
    with pytest.raises(ValueError, match="fp16"):
        codec.encode(torch.full((1, 64), 1e4))
    codec.fast_search = False  # the torch path raises alike
    with pytest.raises(ValueError, match="fp16"):
        codec.encode(torch.full((1, 64), 1e4))


def random_codebook(k: int, n: int, seed: int, duplicates: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    codewords = torch.randn(n, k, generator=gen) * 0.125
    if duplicates and n >= 4:
        codewords[n // 2] = codewords[1]
        codewords[n - 1] = -codewords[0]
    return codewords


def hard_blocks(codewords: torch.Tensor, m: int, seed: int, edges: torch.Tensor | None = None) -> torch.Tensor:
    """Random, far-out and zero blocks, codewords themselves, midpoints of codeword pairs (ties),
    and blocks with coordinates exactly on grid edges."""
    n, k = codewords.shape
    gen = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, n, (m, 2), generator=gen)
    parts = [torch.randn(m, k, generator=gen) * 0.125, (torch.rand(m, k, generator=gen) * 2 - 1) * 1.4,
             torch.zeros(2, k), codewords[pairs[:, 0]], 0.5 * (codewords[pairs[:, 0]] + codewords[pairs[:, 1]])]
    if edges is not None:
        parts.append(edges[torch.randint(0, len(edges), (m, k), generator=gen)])
    return torch.cat(parts).contiguous()


@pytest.mark.parametrize("method", ["grid", "tree", "walk", "brute"])
@pytest.mark.parametrize("k,n", [(2, 64), (2, 300), (3, 50), (4, 256), (4, 40)])
def test_methods_match_reference_on_hard_blocks(method, k, n):
    if method == "grid" and (k, n) == (4, 40):
        pytest.skip("covered by (4, 256)")
    codewords = random_codebook(k, n, seed=k * 100 + n, duplicates=True)
    search = NumbaSearch(codewords, 64, method)
    blocks = hard_blocks(codewords, 400, seed=n, edges=search.edges if method == "grid" else None)
    for rows in (blocks.reshape(-1, k), blocks.reshape(-1, k)[:3]):  # matmul screen and numba scan
        u = rows.reshape(len(rows), k)  # one block per row
        assert torch.equal(search.indices(u).reshape(-1), reference_index(rows, codewords))


@pytest.mark.parametrize("n", [1, 2, 16, 31, 32, 33, 300])
@pytest.mark.parametrize("duplicates", [False, True])
def test_scalar_search_matches_reference_on_hard_blocks(n, duplicates):
    """k = 1 (`scalar`: cells between sorted midpoints, counted up to 31 midpoints, bisected beyond):
    codewords, midpoints, duplicates, zeros, non-finite and far values give the reference's index."""
    codewords = random_codebook(1, n, seed=n, duplicates=duplicates)
    search = NumbaSearch(codewords, 64)
    assert search.method == "scalar"
    blocks = torch.cat([hard_blocks(codewords, 300, seed=n + 1),
                        torch.tensor([[float("nan")], [float("inf")], [-float("inf")], [1e30], [-1e-40]])])
    assert torch.equal(search.indices(blocks).reshape(-1), reference_index(blocks, codewords))
    with pytest.raises(ValueError, match="k=1"):
        NumbaSearch(random_codebook(2, 8, seed=1), 64, "scalar")


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 32), st.integers(0, 2 ** 16), st.sampled_from([1.0, 1e-3, 1e-7]), st.booleans())
def test_scalar_safe_cells_hold_the_reference_index(n, seed, spread, duplicates):
    """`scalar_safe_cells` (the proof table of `scalar_rows`, k = 1 with N <= 32): float32 points on both ends of
    every cell's interval, one float32 step inside them and at random inside have the cell's codeword as the
    reference's index; codewords with an equal neighbour get an empty interval; the kernel's indices (flagged
    ones decided by the reference) equal the reference's on those points and on hard blocks (ties, NaN, inf)."""
    from fibquant.codebook.numba_search import scalar_safe_cells

    codewords = random_codebook(1, n, seed, duplicates=duplicates) * spread
    sorted64, order = torch.sort(codewords[:, 0].to(torch.float64), stable=True)
    lo, hi = scalar_safe_cells(sorted64)
    cells = torch.nonzero(lo <= hi).reshape(-1)
    for p in range(n):
        if p not in cells:
            assert (p > 0 and sorted64[p - 1] == sorted64[p]) or (p + 1 < n and sorted64[p + 1] == sorted64[p]) or n == 1
    gen = torch.Generator().manual_seed(seed)
    a, b = lo[cells], hi[cells]
    inside = (a.double() + torch.rand(len(cells), generator=gen, dtype=torch.float64) * (b.double() - a.double())).float()
    inside = torch.minimum(torch.maximum(inside, a), b)
    points = torch.cat([a, b, torch.nextafter(a, b), torch.nextafter(b, a), inside])
    owner = order[cells].repeat(5)
    reference = reference_index(points[:, None], codewords)
    assert torch.equal(reference, owner)
    search = NumbaSearch(codewords, 64)
    blocks = torch.cat([points[:, None], hard_blocks(codewords, 64, seed),
                        torch.tensor([[float("nan")], [float("inf")], [-float("inf")]])])
    assert torch.equal(search.indices(blocks).reshape(-1), reference_index(blocks, codewords))


def test_four_bit_packing_of_an_odd_count_equals_pack_bits():
    """`_pack_row` at 4 bits (two indices a byte) equals `pack_bits`, an odd count's last index in a low nibble."""
    from fibquant.codebook.numba_search import _kernels

    index = torch.randint(0, 16, (5, 7), generator=torch.Generator().manual_seed(3))
    codes = np.zeros((5, 2 + 4), dtype=np.uint8)
    _kernels()["pack"](index.numpy(), 4, codes, 2, np.arange(5))
    assert torch.equal(torch.from_numpy(codes[:, 2:]), pack_bits(index, 4))


@pytest.mark.parametrize("k,n", [(8, 256), (16, 37), (64, 300), (5, 2)])
def test_brute_matmul_and_scan_match_reference(k, n):
    codewords = random_codebook(k, n, seed=k + n, duplicates=True)
    search = NumbaSearch(codewords, 64, "brute")
    dim = k * (64 // k)
    on_codewords = codewords[torch.arange(dim // k) % n].reshape(1, dim)  # exact hits, duplicate ties
    u = torch.cat([sample_sphere(300, dim, seed=k), torch.zeros(1, dim), on_codewords])
    ref = reference_index(u.reshape(-1, k), codewords).reshape(len(u), -1)
    assert torch.equal(search.indices(u), ref)            # BLAS screen (many blocks)
    assert torch.equal(search.indices(u[-3:]), ref[-3:])  # numba scan (few blocks)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(2, 300), st.integers(0, 80), st.sampled_from(["grid", "tree", "walk", "brute"]),
       st.integers(0, 2 ** 16))
def test_search_property(k, n, m, method, seed):
    if k == 1 and method in ("grid", "walk"):
        method = "scalar"
    if method == "grid" and k not in (2, 3, 4):
        method = "tree"
    if method == "grid" and k == 4:
        n = min(n, 64)
    dim = 12 * k
    codewords = random_codebook(k, n, seed, duplicates=seed % 2 == 0)
    search = NumbaSearch(codewords, dim, method)
    blocks = hard_blocks(codewords, m, seed)
    u = blocks[: (len(blocks) // 12) * 12].reshape(-1, dim)
    ref = reference_index(u.reshape(-1, k), codewords).reshape(len(u), 12)
    assert torch.equal(search.indices(u), ref)


def test_grid_constants_and_far_out_blocks():
    from fibquant.codebook import box_grid, search_kernels
    assert search_kernels.GRID_OUTER == box_grid.OUTER
    codewords = random_codebook(2, 64, seed=5)
    blocks = torch.tensor([[3.0, -2.0], [1.6, 0.0], [-1.5, 1.5], [40.0, 40.0]])
    assert torch.equal(NumbaSearch(codewords, 64, "grid").indices(blocks).reshape(-1),
                       nearest_codeword_reference(blocks, codewords))


def test_non_finite_blocks_follow_the_reference():
    codewords = random_codebook(2, 64, seed=3)
    blocks = torch.tensor([[float("nan"), 0.0], [0.0, float("inf")], [-float("inf"), 1.0], [0.1, 0.2]])
    for method in ("grid", "tree", "brute"):
        assert torch.equal(NumbaSearch(codewords, 64, method).indices(blocks).reshape(-1),
                           nearest_codeword_reference(blocks, codewords))


@pytest.mark.parametrize("n", [2, 3, 100, 256, 1000, 5000])
def test_packing_matches_pack_bits(n):
    k = 2
    codewords = random_codebook(k, n, seed=n)
    search = NumbaSearch(codewords, 64)
    u = sample_sphere(50, 64, seed=n)
    bits = max(1, (n - 1).bit_length())
    norm_bytes = torch.randint(0, 256, (50, 2), dtype=torch.uint8)
    codes = search.encode(u, norm_bytes, bits)
    assert torch.equal(codes, torch.cat([norm_bytes, pack_bits(search.indices(u), bits)], dim=1))


def test_threads_give_the_same_indices():
    codewords = random_codebook(2, 256, seed=9)
    search = NumbaSearch(codewords, 64)
    u = sample_sphere(2000, 64, seed=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = search.indices(u)
        torch.set_num_threads(2)
        assert torch.equal(search.indices(u), one)
    finally:
        torch.set_num_threads(before)


def test_choose_method_and_tree():
    assert choose_method(1, 16) == choose_method(1, 256) == "scalar"
    assert [choose_method(k, n) for k, n in SHIPPED] == ["grid", "grid", "walk", "walk", "grid", "brute", "brute",
                                                          "brute", "brute"]
    points = random_codebook(3, 100, seed=1).numpy()
    lo, hi, child, bounds, pts, ids = build_tree(points, leaf=4)
    assert sorted(ids.tolist()) == list(range(100))
    assert (pts == points[ids]).all()
    leaves = child[:, 0] < 0
    assert int((bounds[leaves, 1] - bounds[leaves, 0]).sum()) == 100 and (bounds[leaves, 1] - bounds[leaves, 0]).max() <= 4
    with pytest.raises(ValueError):
        NumbaSearch(torch.randn(10, 8), 64, "grid")


@pytest.mark.parametrize("k,n", [(2, 256), (2, 128), (4, 256)])
def test_shipped_grid_on_box_corners(k, n):
    """Blocks with every coordinate on a grid edge or one float32 step beside it: box corners, where
    the pruning of the candidate lists is tightest."""
    codewords = FibQuantCodec(64, k, n).codebook.codewords
    search = NumbaSearch(codewords, 64, "grid")
    gen = torch.Generator().manual_seed(k + n)
    edge = search.edges[torch.randint(0, len(search.edges), (3000, k), generator=gen)]
    step = torch.randint(-1, 2, (3000, k), generator=gen).float()
    blocks = torch.where(step == 0, edge, torch.nextafter(edge, step * float("inf")))
    blocks = torch.cat([blocks, torch.tensor([[1.5] * k, [-1.5] * k])])
    assert torch.equal(search.indices(blocks.reshape(-1, k)).reshape(-1), reference_index(blocks, codewords))


def test_numpy_fp16_norm_bytes_match_torch():
    """The numba path rounds norms to fp16 with numpy (checked once for every float32 in
    [0, 65504]); here a sample and the edge cases."""
    from fibquant.codecs.bitpack import float16_to_bytes
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x477FE001, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([0.0, 5.96e-8, 2.98e-8, 6.1e-5, 6.1035156e-05, 1.0, 65504.0, 65503.99, 2049.0, 1e-45])
    values = torch.cat([bits.view(torch.float32), edges])
    numpy_bytes = values.numpy().astype("float16").view("uint8").reshape(-1, 2)
    assert torch.equal(torch.from_numpy(numpy_bytes), float16_to_bytes(values))


@pytest.mark.parametrize("k,n", [(2, 256), (2, 64), (4, 256), (4, 40)])
def test_specialised_grid_kernels_equal_the_generic_one(k, n):
    """grid2 / grid4 (block in registers, branch-free fold over padded lists, far and heavy blocks
    through the float32 screen, at k = 2 the sure boxes) give the generic grid kernel's indices, flags
    and codes, and after the flagged blocks go to the reference, the reference's indices (ties included)."""
    import numpy as np

    from fibquant.codebook.numba_search import _kernels
    codewords = (FibQuantCodec(64, k, n).codebook.codewords if n == 256
                 else random_codebook(k, n, seed=k + n, duplicates=True))
    search = NumbaSearch(codewords, 64, "grid")
    blocks = hard_blocks(codewords, 600, seed=k * n, edges=search.edges)
    u = torch.cat([blocks.reshape(-1, k), sample_sphere(64, 64, seed=n).reshape(-1, k)])
    u = u[: len(u) // (64 // k) * (64 // k)].reshape(-1, 64).contiguous()
    rows, n_blocks = u.shape[0], 64 // k
    bits = max(1, (n - 1).bit_length())
    outs = {}
    for name in ("grid", f"grid{k}"):
        index = np.empty((rows, n_blocks), dtype=np.int64)
        flags = np.zeros((rows, n_blocks), dtype=np.int8)
        codes = np.zeros((rows, 2 + (n_blocks * bits + 7) // 8), dtype=np.uint8)
        args = search._args if name == "grid" else search._row_kernel[1]
        flagged = _kernels()[name](u.numpy(), *args, index, flags, codes, 2, bits, 0, rows)
        outs[name] = (flagged, index, flags, codes)
    (f0, i0, g0, c0), (f1, i1, g1, c1) = outs.values()
    assert f0 == f1 and (g0 == g1).all() and (i0 == i1).all() and (c0 == c1).all()
    assert torch.equal(search.indices(u).reshape(-1), reference_index(u.reshape(-1, k), codewords))


@functools.cache
def shipped_grid4() -> tuple[torch.Tensor, NumbaSearch]:
    """The shipped k = 4, N = 256 codebook and its grid search (built once: a few seconds)."""
    codewords = FibQuantCodec(64, 4, 256).codebook.codewords
    return codewords, NumbaSearch(codewords, 64, "grid")


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2 ** 16), st.floats(0.3, 1.5))
def test_grid4_heavy_boxes_and_row_cells_match_the_reference(seed, spread):
    """grid4's two passes (a row's cells counted against the edges, then the searches) and its vectorised
    heavy-box screen: blocks spread over [-spread, spread]^4 (most in heavy outer boxes at larger spreads),
    on edges, on codewords and on midpoints of codeword pairs (exact ties), on the shipped k = 4, N = 256
    codebook: the reference's indices."""
    codewords, search = shipped_grid4()
    gen = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, 256, (64, 2), generator=gen)
    blocks = torch.cat([(torch.rand(512, 4, generator=gen) * 2 - 1) * spread,
                        search.edges[torch.randint(0, len(search.edges), (64, 4), generator=gen)],
                        codewords[pairs[:, 0]], 0.5 * (codewords[pairs[:, 0]] + codewords[pairs[:, 1]])])
    u = blocks.reshape(-1, 64).contiguous()
    assert torch.equal(search.indices(u).reshape(-1), reference_index(blocks, codewords))


@pytest.mark.parametrize("n", [256, 128, 64])
@pytest.mark.parametrize("table", ["inner", "outer"])
def test_sure_boxes_hold_the_reference_index(n, table):
    """grid2's sure boxes (`numba_search.sure_table`; the inner table over the grid's inner cells, the outer one
    over [-1, 1]^2 for blocks beyond it): at float32 blocks inside sure boxes, on their
    corners and one float32 step beside them, mapped to a box as the kernel maps them, the table's
    codeword is the reference's index; the kernel's indices equal the reference's there. Shipped
    codebooks: most boxes are sure; with duplicate codewords the boxes around a duplicate are not."""
    from fibquant.codebook.numba_search import OUTER_SURE, SURE_SPLIT

    codewords = (FibQuantCodec(64, 2, n).codebook.codewords if n != 64
                 else random_codebook(2, n, seed=7, duplicates=True))
    search = NumbaSearch(codewords, 64, "grid")
    lo, hi = float(search.edges[0]), float(search.edges[-1])
    fine = (len(search.edges) - 1) * SURE_SPLIT
    assert search.sure.shape == (fine * fine + OUTER_SURE[1] ** 2,)
    if table == "inner":
        sure = search.sure[:fine * fine].to(torch.int64)
    else:
        sure = search.sure[fine * fine:].to(torch.int64)
        lo, hi, fine = -OUTER_SURE[0], OUTER_SURE[0], OUTER_SURE[1]
    assert int(sure.max()) < n
    gen = torch.Generator().manual_seed(n)
    boxes = torch.nonzero(sure >= 0).reshape(-1)
    boxes = boxes[torch.randperm(len(boxes), generator=gen)[:60_000]]  # a random sample: the whole table is ~230k
    corner = torch.stack([boxes % fine, boxes // fine], 1).to(torch.float64)          # [m, 2] cells (i, j)
    inside = lo + (corner + torch.rand(len(boxes), 2, generator=gen, dtype=torch.float64)) * (hi - lo) / fine
    on_lattice = (lo + (corner + torch.randint(0, 2, (len(boxes), 2), generator=gen)) * (hi - lo) / fine).float()
    step = torch.randint(-1, 2, on_lattice.shape, generator=gen).float()
    beside = torch.where(step == 0, on_lattice, torch.nextafter(on_lattice, step * float("inf")))
    blocks = torch.cat([inside.float(), on_lattice, beside])
    f = (blocks.to(torch.float64) - lo) * (fine / (hi - lo))                           # the kernel's box
    mapped = ((f >= 0) & (f < fine)).all(1)
    cell = f[mapped].floor().to(torch.int64)
    table = sure[cell[:, 0] + fine * cell[:, 1]]
    reference = reference_index(blocks, codewords)
    hit = table >= 0
    assert hit.sum() > len(boxes) and torch.equal(table[hit], reference[mapped][hit])
    whole = len(blocks) // 32 * 32  # rows of 64
    assert torch.equal(search.indices(blocks[:whole].reshape(-1, 64)).reshape(-1), reference[:whole])
    if n != 64:
        assert float((sure >= 0).float().mean()) > 0.5
    else:  # codewords 1 and n // 2 coincide: no box holds either as a sure nearest
        assert not ((sure == 1) | (sure == n // 2)).any()


@pytest.mark.parametrize("n", [256, 64])
def test_sure_table_from_the_coarser_one_equals_the_direct_one(monkeypatch, n):
    """`sure_table` above SURE_DIRECT boxes per axis refines the table at half the boxes (only the boxes of unsure
    coarse boxes computed): bit for bit the table computed directly at every corner; cached per codebook."""
    from fibquant.codebook import numba_search

    codewords = (FibQuantCodec(64, 2, n).codebook.codewords if n != 64
                 else random_codebook(2, n, seed=7, duplicates=True)).to(torch.float64)
    search = NumbaSearch(codewords.float(), 64, "grid")
    lo, hi = float(search.edges[0]), float(search.edges[-1])
    fine = (len(search.edges) - 1) * 8
    assert fine > numba_search.SURE_DIRECT  # refined from the table at fine / 2
    refined = numba_search._sure_table(codewords, lo, hi, fine)
    monkeypatch.setattr(numba_search, "SURE_DIRECT", 10 ** 9)
    direct = numba_search._sure_table(codewords, lo, hi, fine)
    assert torch.equal(refined, direct) and float((direct >= 0).float().mean()) > 0.5
    assert numba_search.sure_table(codewords, lo, hi, fine) is numba_search.sure_table(codewords.clone(), lo, hi, fine)


@pytest.mark.parametrize("bits", [4, 2])
def test_norm_corrected_codes_equal_the_spec(bits):
    """Norm correction from the numba encode's indices (no unpacking, the codes corrected in place) gives
    the spec's bytes: the reference codes with `_correct_norms` over their unpacked indices."""
    codec = FibQuantCodec.for_rate(64, bits, norm_correction=True)
    adversarial = adversarial_rows()
    huge = adversarial.norm(dim=1) > 1e4  # ||x|| / ||u_hat|| may leave the fp16 range: an error on both paths
    x = torch.cat([torch.randn(700, 64, generator=torch.Generator().manual_seed(bits)) * 3 + 1, adversarial[~huge]])
    spec = codec._correct_norms(x, reference_codes(codec, x))
    assert torch.equal(codec.encode(x), spec)
    assert torch.equal(codec.encode(x[:1]), spec[:1])
    over = adversarial[huge] * 1.09  # norms ~65400: in range, corrected out of it (||u_hat|| < 1)
    with pytest.raises(ValueError, match="fp16 range"):
        codec._correct_norms(over, reference_codes(codec, over))
    with pytest.raises(ValueError, match="fp16 range"):
        codec.encode(over)
