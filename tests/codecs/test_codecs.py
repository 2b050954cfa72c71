"""All codecs through the shared Codec interface: layout, exactness, errors, MSE bounds.

The contract suite (CODECS) holds at least one codec of every family registered in
`fibquant.codecs.registry.REGISTRY` (checked by `test_contract_covers_every_registered_family`);
calibrated codecs are fitted on small synthetic data (`_calibration`).

MSE bounds (total E||u - u_hat||^2 of unit vectors drawn uniformly on S^{dim-1}, fresh samples):

| codec                         | bound  | why                                                     |
|-------------------------------|--------|---------------------------------------------------------|
| TurboQuant d=64 b=1           | 0.375  | exact Lloyd-Max value 0.3584 + sampling slack           |
| TurboQuant d=64 b=2           | 0.120  | exact 0.1145                                            |
| TurboQuant d=64 b=3           | 0.035  | exact 0.0334                                            |
| TurboQuant d=64 b=4           | 0.0097 | exact 0.00913                                           |
| FibQuant d=64 k=8 N=256 (1b)  | 0.335  | measured ~0.32; TurboQuant b=1 is 0.3584 (exact)        |
| FibQuant d=16 k=2 N=16 (2b)   | 0.120  | must beat TurboQuant d=16 b=2 (exact 0.1134): Theorem 2 |
| FibQuant d=32 k=4 N=6         | 0.62   | measured 0.58 (log2(6)/4 = 0.65 bits/coord)             |
| FibQuant-RVQ d=64 k=8 2x256   | 0.093  | measured 0.0911 (beam 16); FibQuant k=4 N=256: 0.0952   |
| FibQuant-E8 d=64 b=2          | 0.087  | measured 0.0846 (lattice probe's test vectors)          |
| FibQuant-E8 d=64 b=3          | 0.0225 | measured 0.0218                                         |
| FibQuant-E8 d=64 b=4          | 0.0060 | measured 0.0057                                         |
| INT4 d=64 (per token)         | 0.020  | measured 0.0125: step = range/15                        |
| INT3 d=64 group 16            | 0.040  | measured 0.028                                          |
| fp16 identity d=64            | 1e-6   | fp16 rounding only (measured ~4e-8 relative)            |

Calibrated codecs are bounded on held-out vectors of their calibration distribution, relative
to the error of the calibration mean: low-rank r=8 0.75 (measured 0.70), RVQ 2x16 0.90 (0.82).
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fibquant import FibQuantCodec, IntCodec, TurboQuantCodec
from fibquant.codecs import IdentityCodec, LowRankCodec, RVQCodec
from fibquant.codecs.e8shell import E8ShellCodec
from fibquant.codecs.fibrvq import FibRVQCodec
from fibquant.codebook import lloyd_max_table, nearest_codeword, nearest_codeword_reference, nearest_level
from fibquant.codecs.fibquant import choose_block
from fibquant.canonical import sample_sphere

FOR_RATE_TABLE_64 = {0.1875: (64, 4096), 0.25: (32, 256), 0.5: (16, 256), 1: (8, 256), 1.5: (8, 4096),
                     2: (4, 256), 2.5: (4, 1024), 3: (4, 4096), 3.5: (2, 128), 4: (2, 256)}


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FIBQUANT_CACHE_DIR", str(tmp_path_factory.mktemp("codebooks")))
        yield


CODECS = {
    "int4": lambda: IntCodec(64, 4),
    "int3_g16": lambda: IntCodec(64, 3, group_size=16),
    "turbo1": lambda: TurboQuantCodec(64, 1),
    "turbo2": lambda: TurboQuantCodec(64, 2),
    "turbo3": lambda: TurboQuantCodec(64, 3),
    "turbo4": lambda: TurboQuantCodec(64, 4),
    "fib_d64_rate1": lambda: FibQuantCodec.for_rate(64, 1),  # shipped k=8, N=256
    "fib_d16_k2_n16": lambda: FibQuantCodec(16, 2, 16),
    "fib_d32_k4_n6": lambda: FibQuantCodec(32, 4, 6),
    "fibrvq_d64_b2": lambda: FibRVQCodec.from_spec(64, bits=2),  # shipped k=8, 2 x 256
    "e8shell_b2": lambda: E8ShellCodec(64, 2),
    "e8shell_b3_nc": lambda: E8ShellCodec(64, 3, norm_correction=True),
    "e8shell_b4": lambda: E8ShellCodec(64, 4),
    "e8shell_b175_nc": lambda: E8ShellCodec(64, 1.75, norm_correction=True),
    "e8shell_b1": lambda: E8ShellCodec(64, 1),
    "fp16": lambda: IdentityCodec(64),
    "lowrank_r8": lambda: LowRankCodec.fit(_calibration(), 8),
    "rvq_2x16": lambda: RVQCodec.fit(_calibration(), 2, 16, max_iterations=5),
}
MSE_BOUND = {"int4": 0.020, "int3_g16": 0.040, "turbo1": 0.375, "turbo2": 0.120, "turbo3": 0.035,
             "turbo4": 0.0097, "fib_d64_rate1": 0.335, "fib_d16_k2_n16": 0.120, "fib_d32_k4_n6": 0.62,
             "fibrvq_d64_b2": 0.093, "e8shell_b2": 0.087, "e8shell_b4": 0.0060,
             "e8shell_b1": 0.322, "fp16": 1e-6}
CALIBRATED_BOUND = {"lowrank_r8": 0.75, "rvq_2x16": 0.90}  # held-out MSE / MSE of the calibration mean
# Float32 matmuls round differently for one row than for a batch: a low-rank code depends on the batch.
NOT_ROW_EXACT = {"lowrank_r8"}
_built: dict = {}


def _calibration(n=512, seed=11):
    """Synthetic calibration vectors [n, 64] with anisotropic scales (a fitted codec's training set)."""
    return _inputs(64, n, seed=seed)


def codec_for(name):
    if name not in _built:
        _built[name] = CODECS[name]()
    return _built[name]


def _inputs(dim, n=64, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen) * torch.linspace(0.1, 5, dim)  # anisotropic scales
    return x.to(dtype)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_shapes_and_dtypes(name, dtype):
    codec = codec_for(name)
    x = _inputs(codec.dim, 24, dtype=dtype).reshape(2, 3, 4, codec.dim)
    codes = codec.encode(x)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 3, 4, codec.code_size)
    out = codec.decode(codes, dtype=dtype)
    assert out.dtype == dtype and out.shape == x.shape
    assert codec.roundtrip(x).dtype == dtype
    empty = codec.encode(torch.zeros(0, codec.dim, dtype=dtype))
    assert empty.shape == (0, codec.code_size)


def test_contract_covers_every_registered_family():
    from fibquant.codecs.registry import codec_classes

    assert {codec_for(name).family for name in CODECS} == set(codec_classes())
    assert set(CALIBRATED_BOUND) == {name for name in CODECS if codec_for(name).calibrated}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.xfail(
    strict=True, reason="float32 projection: one row and a batch round differently")) if name in NOT_ROW_EXACT
    else name for name in CODECS])
def test_single_row_decode_and_byte_offset_random_access(name):
    codec = codec_for(name)
    codes = codec.encode(_inputs(codec.dim, 50, seed=1))
    batch = codec.decode(codes)
    stream = codes.reshape(-1)  # one flat byte stream: vector i at byte i * code_size
    for i in (0, 1, 17, 49):
        row = stream[i * codec.code_size:(i + 1) * codec.code_size]
        assert torch.equal(codec.decode(row), batch[i])
        assert torch.equal(codec.decode(codes[i:i + 1])[0], batch[i])
    # Encoding one row gives the same bytes as encoding the batch.
    x = _inputs(codec.dim, 50, seed=1)
    assert torch.equal(codec.encode(x[7]), codes[7])


def test_code_size_formulas():
    for (k, n) in [(2, 256), (4, 16), (8, 6), (16, 3)]:
        codec = FibQuantCodec(32, k, n)
        width = math.ceil(math.log2(n))
        assert codec.code_size == 2 + math.ceil((32 // k) * width / 8)
        assert codec.bits_per_coordinate == width / k
        assert codec.nominal_bits_per_coordinate == pytest.approx(math.log2(n) / k)
        assert codec.compression_ratio == 64 / codec.code_size
    for bits in (1, 2, 3, 4):
        codec = TurboQuantCodec(48, bits)
        assert codec.code_size == 2 + math.ceil(48 * bits / 8)
        assert codec.bits_per_coordinate == bits
    assert IntCodec(64, 3, group_size=16).code_size == 4 * 4 + math.ceil(64 * 3 / 8)
    for name in CODECS:
        codec = codec_for(name)
        assert codec.encode(_inputs(codec.dim, 2)).shape[-1] == codec.code_size


def test_for_rate_table():
    for bits, (k, n) in FOR_RATE_TABLE_64.items():
        assert choose_block(64, bits) == (k, n)
        assert math.log2(n) / k == bits
    codec = FibQuantCodec.for_rate(64, 2)
    assert (codec.k, codec.n_codewords, codec.bits_per_coordinate) == (4, 256, 2.0)
    assert choose_block(128, 0.09375) == (128, 4096)
    for bad in (0.3, 0, -1, float("nan"), 20):
        with pytest.raises(ValueError, match="bits per coordinate|no block size"):
            FibQuantCodec.for_rate(64, bad)


@pytest.mark.parametrize("name", [name for name in CODECS if name not in CALIBRATED_BOUND])
def test_zero_vector_round_trips_to_zero(name):
    codec = codec_for(name)
    x = _inputs(codec.dim, 4)
    x[2] = 0
    out = codec.roundtrip(x)
    assert torch.equal(out[2], torch.zeros(codec.dim))


@pytest.mark.parametrize("name", CODECS)
def test_bad_inputs_raise(name):
    codec = codec_for(name)
    x = _inputs(codec.dim, 3)
    for value, what in ((float("nan"), "NaN"), (float("inf"), "Inf")):
        bad = x.clone()
        bad[1, 2] = value
        with pytest.raises(ValueError, match="NaN or Inf"):
            codec.encode(bad)
    with pytest.raises(ValueError, match="last dimension"):
        codec.encode(torch.zeros(3, codec.dim + 1))
    with pytest.raises(ValueError, match="floating"):
        codec.encode(torch.zeros(3, codec.dim, dtype=torch.int32))
    codes = codec.encode(x)
    with pytest.raises(ValueError, match="code_size"):
        codec.decode(codes[:, :-1])
    with pytest.raises(ValueError, match="uint8"):
        codec.decode(codes.to(torch.int16))


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="divide"):
        FibQuantCodec(64, 3, 16)
    with pytest.raises(ValueError, match="N must be"):
        FibQuantCodec(64, 4, 1)
    for bits in (0, 5, 2.5, True):
        with pytest.raises(ValueError, match="supports bits"):
            TurboQuantCodec(64, bits)
    for bits in (1, 9):
        with pytest.raises(ValueError, match="2..8"):
            IntCodec(64, bits)
    with pytest.raises(ValueError, match="dim"):
        TurboQuantCodec(1, 2)


def test_huge_norm_is_rejected():
    with pytest.raises(ValueError, match="fp16"):
        TurboQuantCodec(64, 2).encode(torch.full((1, 64), 1e5))
    with pytest.raises(ValueError, match="fp16"):
        codec_for("fib_d16_k2_n16").encode(torch.full((1, 16), 1e5))


def test_out_of_range_index_in_code_is_rejected():
    codec = codec_for("fib_d32_k4_n6")  # 3-bit indices, only 0..5 valid
    codes = codec.encode(_inputs(32, 1))
    codes[0, 2:] = 0xFF
    with pytest.raises(ValueError, match="index"):
        codec.decode(codes)


@pytest.mark.parametrize("name", CALIBRATED_BOUND)
def test_calibrated_codec_beats_the_mean_on_held_out_vectors(name):
    codec = codec_for(name)
    train, held_out = _calibration(), _calibration(2000, seed=12)
    error = float(((codec.roundtrip(held_out) - held_out) ** 2).sum(1).mean())
    baseline = float(((held_out - train.mean(0)) ** 2).sum(1).mean())
    assert error / baseline < CALIBRATED_BOUND[name], f"{name}: relative MSE {error / baseline:.4g}"


@pytest.mark.parametrize("name", MSE_BOUND)
def test_unit_vector_mse_below_documented_bound(name):
    codec = codec_for(name)
    u = sample_sphere(1 << 14, codec.dim, seed=4242)  # fresh: not the codebooks' training samples
    mse = float(((codec.roundtrip(u) - u) ** 2).sum(1).mean())
    assert mse < MSE_BOUND[name], f"{name}: MSE {mse:.4g} above bound {MSE_BOUND[name]}"


def test_turboquant_matches_exact_table_and_scales():
    codec = TurboQuantCodec(64, 3)
    levels, exact = lloyd_max_table(64, 8)
    assert torch.equal(codec.levels, torch.from_numpy(levels).float())
    u = sample_sphere(1 << 14, 64, seed=5)
    mse = float(((codec.roundtrip(u) - u) ** 2).sum(1).mean())
    assert abs(mse - exact) < 0.05 * exact  # the codec realises the table's MSE
    # Scale equivariance: only the fp16 norm changes.
    torch.testing.assert_close(codec.roundtrip(3.0 * u[:8]), 3.0 * codec.roundtrip(u[:8]), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("k,n,chunk", [(1, 16, 64), (2, 256, 5000), (4, 100, 1 << 18), (16, 37, 50)])
def test_fast_search_matches_reference(k, n, chunk):
    gen = torch.Generator().manual_seed(k * 1000 + n)
    codewords = torch.randn(n, k, generator=gen) * 0.3
    blocks = torch.randn(1000, k, generator=gen) * 0.3
    fast = nearest_codeword(blocks, codewords, chunk_elements=chunk)
    ref = nearest_codeword_reference(blocks, codewords)
    dist = lambda idx: ((blocks.double() - codewords.double()[idx]) ** 2).sum(1)  # noqa: E731
    # Same codeword, or a tie to float32 precision.
    assert torch.all((fast == ref) | (dist(fast) - dist(ref) <= 1e-6))
    assert float((fast == ref).double().mean()) > 0.99


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(2, 40), st.integers(0, 200), st.integers(1, 4000))
def test_fast_search_property(k, n, m, chunk):
    gen = torch.Generator().manual_seed(k + 7 * n + 131 * m)
    codewords = torch.rand(n, k, generator=gen)
    blocks = torch.rand(m, k, generator=gen)
    fast = nearest_codeword(blocks, codewords, chunk_elements=chunk)
    ref = nearest_codeword_reference(blocks, codewords)
    assert fast.shape == (m,)
    d_fast = ((blocks.double() - codewords.double()[fast]) ** 2).sum(1)
    d_ref = ((blocks.double() - codewords.double()[ref]) ** 2).sum(1)
    assert torch.all(d_fast - d_ref <= 1e-6)


@pytest.mark.parametrize("dim,k,n", [(64, 2, 64), (32, 3, 50), (16, 4, 40)])
def test_grid_search_matches_reference(dim, k, n):
    from fibquant.codebook.box_grid import GRID_CELLS, GridSearch
    gen = torch.Generator().manual_seed(dim + k + n)
    codewords = torch.randn(n, k, generator=gen) * (1.0 / math.sqrt(dim))
    grid = GridSearch(codewords, dim, GRID_CELLS[k], max_candidates=16)
    blocks = torch.cat([sample_sphere(600, dim, seed=k).reshape(-1, k)[:2000],
                        torch.rand(300, k, generator=gen) * 2 - 1])  # canonical and far-out blocks
    fast = grid.search(blocks, codewords, (codewords ** 2).sum(1), chunk=500)
    ref = nearest_codeword_reference(blocks, codewords)
    d_fast = ((blocks.double() - codewords.double()[fast]) ** 2).sum(1)
    d_ref = ((blocks.double() - codewords.double()[ref]) ** 2).sum(1)
    assert torch.all(d_fast - d_ref <= 1e-9)
    assert bool(grid.heavy.any()) and grid.width <= 16  # both paths are exercised


def test_codec_grid_and_matmul_search_agree():
    codec = codec_for("fib_d16_k2_n16")
    assert codec.search_method == "grid"
    u = sample_sphere(2000, 16, seed=9)
    codec.fast_search = False  # compare the two torch searches (the numba path serves both otherwise)
    try:
        grid_codes = codec.encode(u)
        codec.search_method = "matmul"
        matmul_codes = codec.encode(u)
    finally:
        codec.search_method = "grid"
        del codec.fast_search
    assert float((grid_codes == matmul_codes).all(1).double().mean()) > 0.999


def test_scalar_search_matches_reference():
    levels = torch.from_numpy(lloyd_max_table(64, 16)[0]).float()
    values = torch.linspace(-0.6, 0.6, 5001)
    fast = nearest_level(values, 0.5 * (levels[1:] + levels[:-1]))
    ref = nearest_codeword_reference(values.unsqueeze(1), levels.unsqueeze(1))
    assert torch.equal(fast, ref)
