"""Attention on codes (kv/attention/kernels.py): numba kernels == torch reference == decode-then-attend."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fibquant import _numba
from fibquant.codecs.bitpack import bytes_to_float16, pack_bits, packed_size, unpack_bits
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.turboquant import TurboQuantCodec
import fibquant.kv.attention.kernels as ck
from fibquant.kv.attention.kernels import (
    coded_scores,
    coded_scores_reference,
    coded_weighted_sum,
    coded_weighted_sum_reference,
    numba_available,
)

DIM = 64
RTOL = 1e-5  # of the magnitude sum_d |q_d| |x_d| (float32 sums in different orders)

needs_numba = pytest.mark.skipif(not numba_available(), reason="numba is not installed")

# name -> (codec factory, bits per index); every codebook below is shipped or exact (k = 1).
CODECS = {
    "fib_k2_n256": (lambda: FibQuantCodec(DIM, 2, 256), 8),
    "fib_k4_n256": (lambda: FibQuantCodec(DIM, 4, 256), 8),
    "fib_k4_n4096": (lambda: FibQuantCodec(DIM, 4, 4096), 12),
    "fib_k4_n1024": (lambda: FibQuantCodec(DIM, 4, 1024), 10),
    "fib_k8_n256": (lambda: FibQuantCodec(DIM, 8, 256), 8),
    "fib_k2_n128": (lambda: FibQuantCodec(DIM, 2, 128), 7),
    "turbo_4": (lambda: TurboQuantCodec(DIM, 4), 4),
    "turbo_3": (lambda: TurboQuantCodec(DIM, 3), 3),
    "turbo_2": (lambda: TurboQuantCodec(DIM, 2), 2),
    "turbo_1": (lambda: TurboQuantCodec(DIM, 1), 1),
}

_CACHE: dict = {}


def codec_setup(name):
    """(codec, codewords [N, k] float32, index_bits), built once per session."""
    if name not in _CACHE:
        factory, bits = CODECS[name]
        codec = factory()
        if isinstance(codec, TurboQuantCodec):
            codewords = codec.levels.reshape(-1, 1).to(torch.float32).contiguous()
            assert bits == codec.bits
        else:
            codewords = codec.codebook.codewords.to(torch.float32).contiguous()
            assert bits == codec.config.index_bits
        assert codec.code_size == 2 + packed_size(DIM // codewords.shape[1], bits)
        _CACHE[name] = (codec, codewords, bits)
    return _CACHE[name]


def encoded(codec, shape, seed, zero_rows=()):
    """Really encoded random vectors [*shape, DIM] with norms spread over 1e-3..1e2 (+ zero rows)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, DIM, generator=gen)
    x = x * torch.exp(torch.empty(*shape, 1).uniform_(-7.0, 4.6, generator=gen))
    flat = x.reshape(-1, DIM)
    for row in zero_rows:
        flat[row] = 0.0
    return codec.encode(flat.reshape(*shape, DIM))


def decoded_rotated(codes, codewords, bits):
    """Independent spelling of the rotated decode: nu * concat_j codewords[idx_j] in float64."""
    n_codewords, k = codewords.shape
    n_blocks = (codes.shape[-1] - 2) * 8 // bits
    index = unpack_bits(codes[..., 2:], bits, n_blocks)
    nu = bytes_to_float16(codes[..., :2]).to(torch.float64)
    units = codewords.to(torch.float64)[index].reshape(*index.shape[:-1], n_blocks * k)
    return units * nu.unsqueeze(-1)


def assert_scaled_close(actual, expected, magnitude, rtol=RTOL):
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == torch.float32
    err = (actual.to(torch.float64) - expected.to(torch.float64)).abs()
    bound = rtol * magnitude.to(torch.float64) + 1e-30
    worst = float((err / bound).max()) if err.numel() else 0.0
    assert worst <= 1.0, f"error {worst:.3g} x tolerance"


def score_magnitude(queries, codes, codewords, bits):
    return torch.einsum("bhqd,bhmd->bhqm", queries.abs().to(torch.float64),
                        decoded_rotated(codes, codewords, bits).abs())


def sum_magnitude(weights, codes, codewords, bits):
    return torch.einsum("bhqm,bhmd->bhqd", weights.abs().to(torch.float64),
                        decoded_rotated(codes, codewords, bits).abs())


def random_inputs(codes, q, seed):
    b, h, m, _ = codes.shape
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(b, h, q, DIM, generator=gen)
    weights = torch.softmax(torch.randn(b, h, q, m, generator=gen) * 3, dim=-1) if m else torch.zeros(b, h, q, 0)
    return queries, weights


# --------------------------------------------------------------------------- the reference is the spec
@pytest.mark.parametrize("name", ["fib_k2_n256", "fib_k4_n4096", "fib_k8_n256", "turbo_4", "turbo_3"])
def test_reference_matches_codec_decode(name):
    """coded_scores = (rotated codec.decode) @ q and coded_weighted_sum = w @ (rotated codec.decode)."""
    codec, codewords, bits = codec_setup(name)
    codes = encoded(codec, (2, 2, 19), seed=1, zero_rows=(3,))
    queries, weights = random_inputs(codes, 3, seed=2)
    rotate = codec._rotation.forward_matrix(torch.device("cpu")).to(torch.float64)  # Pi^T: u = x @ Pi^T
    rotated = codec.decode(codes, dtype=torch.float64) @ rotate
    scores = torch.einsum("bhqd,bhmd->bhqm", queries.to(torch.float64), rotated)
    sums = torch.einsum("bhqm,bhmd->bhqd", weights.to(torch.float64), rotated)
    # decode rounds to float32 in the original domain; the rotation round trip costs ~1e-7.
    mag_s = score_magnitude(queries, codes, codewords, bits)
    mag_w = sum_magnitude(weights, codes, codewords, bits)
    for backend in ("torch",) + (("numba",) if numba_available() else ()):
        assert_scaled_close(coded_scores(queries, codes, codewords, bits, backend=backend), scores, mag_s, 1e-4)
        assert_scaled_close(coded_weighted_sum(weights, codes, codewords, bits, backend=backend), sums, mag_w, 1e-4)
    assert_scaled_close(coded_scores_reference(queries, codes, codewords, bits),
                        torch.einsum("bhqd,bhmd->bhqm", queries.to(torch.float64),
                                     decoded_rotated(codes, codewords, bits)), mag_s)


# --------------------------------------------------------------------------- numba == reference
@needs_numba
@pytest.mark.parametrize("name", list(CODECS))
def test_numba_matches_reference_every_codebook(name):
    codec, codewords, bits = codec_setup(name)
    codes = encoded(codec, (2, 3, 45), seed=3, zero_rows=(0, 7, 100))
    for q in (1, 3, 6, 13):  # 4-lane tiles, one 8-lane tile, 16 lanes (bytes) or 8 + 8 (fields)
        queries, weights = random_inputs(codes, q, seed=4 + q)
        scores = coded_scores(queries, codes, codewords, bits, backend="numba")
        assert_scaled_close(scores, coded_scores_reference(queries, codes, codewords, bits),
                            score_magnitude(queries, codes, codewords, bits))
        sums = coded_weighted_sum(weights, codes, codewords, bits, backend="numba")
        assert_scaled_close(sums, coded_weighted_sum_reference(weights, codes, codewords, bits),
                            sum_magnitude(weights, codes, codewords, bits))


@needs_numba
def test_zero_norm_rows_contribute_exactly_zero():
    codec, codewords, bits = codec_setup("fib_k4_n256")
    codes = codec.encode(torch.zeros(1, 2, 5, DIM))
    queries, weights = random_inputs(codes, 3, seed=0)
    assert torch.equal(coded_scores(queries, codes, codewords, bits), torch.zeros(1, 2, 3, 5))
    assert torch.equal(coded_weighted_sum(weights, codes, codewords, bits), torch.zeros(1, 2, 3, DIM))


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_no_tokens(backend):
    _, codewords, bits = codec_setup("turbo_4")
    codes = torch.zeros(2, 3, 0, 2 + packed_size(DIM, bits), dtype=torch.uint8)
    queries = torch.randn(2, 3, 4, DIM)
    scores = coded_scores(queries, codes, codewords, bits, backend=backend)
    assert scores.shape == (2, 3, 4, 0) and scores.dtype == torch.float32
    sums = coded_weighted_sum(torch.zeros(2, 3, 4, 0), codes, codewords, bits, backend=backend)
    assert torch.equal(sums, torch.zeros(2, 3, 4, DIM))
    assert coded_scores(queries[:, :, :0], codes, codewords, bits, backend=backend).shape == (2, 3, 0, 0)


@needs_numba
@pytest.mark.parametrize("name", ["fib_k2_n256", "fib_k4_n1024", "turbo_2"])
def test_capacity_buffer_view_is_read_in_place(name):
    codec, codewords, bits = codec_setup(name)
    buffer = torch.zeros(2, 2, 64, codec.code_size, dtype=torch.uint8)
    buffer[:, :, :29] = encoded(codec, (2, 2, 29), seed=5)
    view = buffer[:, :, :29]
    assert not view.is_contiguous()
    assert np.shares_memory(ck._codes_array(view), buffer.numpy())  # no copy of the buffer
    queries, weights = random_inputs(view, 3, seed=6)
    dense = view.contiguous()
    assert torch.equal(coded_scores(queries, view, codewords, bits), coded_scores(queries, dense, codewords, bits))
    assert torch.equal(coded_weighted_sum(weights, view, codewords, bits),
                       coded_weighted_sum(weights, dense, codewords, bits))
    # A view whose bytes are not contiguous within a row is copied, still right.
    odd = torch.zeros(2, 2, 29, codec.code_size, 2, dtype=torch.uint8)
    odd[..., 0] = dense
    strided = odd[..., 0]
    assert strided.stride(-1) == 2
    assert torch.equal(coded_scores(queries, strided, codewords, bits), coded_scores(queries, dense, codewords, bits))


@needs_numba
def test_threads_split_units_without_changing_results(monkeypatch):
    codec, codewords, bits = codec_setup("fib_k4_n1024")
    codes = encoded(codec, (2, 3, 40), seed=7)
    queries, weights = random_inputs(codes, 6, seed=8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = (coded_scores(queries, codes, codewords, bits), coded_weighted_sum(weights, codes, codewords, bits))
        torch.set_num_threads(3)
        monkeypatch.setattr(ck, "_MIN_WORK_PER_THREAD", 1)
        multi = (coded_scores(queries, codes, codewords, bits), coded_weighted_sum(weights, codes, codewords, bits))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single[0], multi[0]) and torch.equal(single[1], multi[1])


# --------------------------------------------------------------------------- arbitrary codes and codebooks
def random_codes(gen, shape, n_blocks, bits, n_codewords):
    """Random valid codes: any finite fp16 norm (subnormals, negative, zero) and indices < N."""
    half = torch.randint(0, 1 << 16, shape, generator=gen, dtype=torch.int32).to(torch.int16)
    norms = half.view(torch.float16)
    norms = torch.where(torch.isfinite(norms), norms, torch.zeros_like(norms))
    norms[..., :1] = 0.0
    norm_bytes = norms.contiguous().view(torch.uint8).reshape(*shape, 2)
    index = torch.randint(0, n_codewords, (*shape, n_blocks), generator=gen)
    return torch.cat([norm_bytes, pack_bits(index, bits)], dim=-1)


@needs_numba
@settings(max_examples=40, deadline=None)
@given(
    k=st.sampled_from([1, 2, 3, 4, 8]),
    n_blocks=st.integers(1, 20),
    bits_and_n=st.sampled_from([(1, 2), (2, 4), (2, 3), (3, 8), (4, 16), (5, 32), (7, 128), (8, 256),
                                (8, 200), (9, 512), (10, 1024), (11, 2000), (12, 4096), (27, 5), (32, 3)]),
    b=st.integers(1, 2), h=st.integers(1, 3), q=st.integers(1, 9), m=st.integers(0, 40),
    seed=st.integers(0, 2**31),
)
def test_numba_matches_reference_on_random_codes(k, n_blocks, bits_and_n, b, h, q, m, seed):
    bits, n_codewords = bits_and_n
    gen = torch.Generator().manual_seed(seed)
    codewords = torch.randn(n_codewords, k, generator=gen)
    codes = random_codes(gen, (b, h, m), n_blocks, bits, n_codewords)
    dim = n_blocks * k
    queries = torch.randn(b, h, q, dim, generator=gen)
    weights = torch.randn(b, h, q, m, generator=gen)
    # n_blocks is inferred from code_size unless the packing leaves an index-sized gap: pass dim.
    scores = coded_scores(queries, codes, codewords, bits, backend="numba")
    sums = coded_weighted_sum(weights, codes, codewords, bits, backend="numba", dim=dim)
    expected_s = coded_scores_reference(queries, codes, codewords, bits)
    expected_w = coded_weighted_sum_reference(weights, codes, codewords, bits, dim=dim)
    index = unpack_bits(codes[..., 2:], bits, n_blocks)
    nu = bytes_to_float16(codes[..., :2]).to(torch.float64)
    units = codewords.to(torch.float64)[index].reshape(b, h, m, dim).abs() * nu.abs().unsqueeze(-1)
    mag_s = torch.einsum("bhqd,bhmd->bhqm", queries.abs().to(torch.float64), units)
    mag_w = torch.einsum("bhqm,bhmd->bhqd", weights.abs().to(torch.float64), units)
    assert_scaled_close(scores, expected_s, mag_s)
    assert_scaled_close(sums, expected_w, mag_w)


@needs_numba
@pytest.mark.parametrize("bits,n_codewords,k", [(8, 200, 2), (2, 3, 1), (12, 3000, 4), (27, 5, 1)])
def test_index_beyond_codebook_raises(bits, n_codewords, k):
    gen = torch.Generator().manual_seed(0)
    codewords = torch.randn(n_codewords, k, generator=gen)
    n_blocks = 6
    index = torch.randint(0, n_codewords, (1, 2, 9, n_blocks), generator=gen)
    index[0, 1, 4, 5] = (1 << bits) - 1  # >= N
    codes = torch.cat([torch.full((1, 2, 9, 2), 60, dtype=torch.uint8), pack_bits(index, bits)], dim=-1)
    queries = torch.randn(1, 2, 3, n_blocks * k)
    weights = torch.rand(1, 2, 3, 9)
    for backend in ("numba", "torch"):
        with pytest.raises(ValueError, match="index"):
            coded_scores(queries, codes, codewords, bits, backend=backend)
        with pytest.raises(ValueError, match="index"):
            coded_weighted_sum(weights, codes, codewords, bits, backend=backend, dim=n_blocks * k)


# --------------------------------------------------------------------------- bad inputs
def test_bad_inputs_raise_clear_errors():
    _, codewords, bits = codec_setup("fib_k4_n256")
    code_size = 2 + packed_size(16, bits)
    codes = torch.zeros(1, 2, 5, code_size, dtype=torch.uint8)
    queries = torch.randn(1, 2, 3, DIM)
    weights = torch.rand(1, 2, 3, 5)
    cases = [
        (lambda: coded_scores(queries[0], codes, codewords, bits), "queries must have shape"),
        (lambda: coded_scores(queries, codes[0], codewords, bits), "codes must have shape"),
        (lambda: coded_scores(queries.double(), codes, codewords, bits), "queries must be float32"),
        (lambda: coded_scores(queries, codes.to(torch.int16), codewords, bits), "torch.uint8"),
        (lambda: coded_scores(queries, codes, codewords.double(), bits), "codewords must be float32"),
        (lambda: coded_scores(queries, codes, codewords[0], bits), r"codewords must have shape \[N, k\]"),
        (lambda: coded_scores(queries, codes, codewords, 7), "cannot address"),
        (lambda: coded_scores(queries, codes, codewords, 0), "index_bits"),
        (lambda: coded_scores(queries, codes, codewords, True), "index_bits"),
        (lambda: coded_scores(queries, codes, codewords, 9), "code_size"),
        (lambda: coded_scores(queries[:, :1], codes, codewords, bits), "disagree on B/H"),
        (lambda: coded_scores(queries[..., :62], codes, codewords, bits), "not a multiple"),
        (lambda: coded_scores(queries[..., :60], codes, codewords, bits), "code_size"),
        (lambda: coded_scores(queries, codes[..., :-1], codewords, bits), "code_size"),
        (lambda: coded_scores(queries, codes, codewords, bits, backend="gpu"), "backend"),
        (lambda: coded_weighted_sum(weights[:, :, :, :4], codes, codewords, bits), "M=4"),
        (lambda: coded_weighted_sum(weights[:1, :1], codes, codewords, bits), "disagree on B/H"),
        (lambda: coded_weighted_sum(weights.double(), codes, codewords, bits), "weights must be float32"),
        (lambda: coded_weighted_sum(weights[0], codes, codewords, bits), "weights must have shape"),
        (lambda: coded_weighted_sum(weights, codes, codewords, bits, dim=60), "code_size"),
        (lambda: coded_weighted_sum(weights, codes, codewords, bits, dim=62), "multiple of k"),
        (lambda: coded_weighted_sum(weights, codes[..., :1], codewords, bits), "code_size"),
        (lambda: coded_weighted_sum(weights, codes, codewords, bits, backend="fast"), "backend"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_numba_backend_refuses_non_cpu_tensors_and_missing_numba(monkeypatch):
    _, codewords, bits = codec_setup("turbo_2")
    codes = torch.zeros(1, 1, 3, 2 + packed_size(DIM, bits), dtype=torch.uint8, device="meta")
    queries = torch.zeros(1, 1, 2, DIM, device="meta")
    with pytest.raises(ValueError, match="CPU"):
        coded_scores(queries, codes, codewords, bits, backend="numba")
    monkeypatch.setattr(_numba, "_NUMBA_OK", False)  # numba_available() is shared (fibquant._numba)
    cpu_codes = torch.zeros(1, 1, 3, 2 + packed_size(DIM, bits), dtype=torch.uint8)
    with pytest.raises(ValueError, match="numba"):
        coded_scores(torch.zeros(1, 1, 2, DIM), cpu_codes, codewords, bits, backend="numba")
    # auto falls back to the torch reference
    assert torch.equal(coded_scores(torch.ones(1, 1, 2, DIM), cpu_codes, codewords, bits), torch.zeros(1, 1, 2, 3))


def test_import_does_not_load_numba():
    code = ("import sys, fibquant, fibquant.kv.attention.kernels; "
            "assert 'numba' not in sys.modules, 'numba imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_thread_pool_is_remade_in_a_forked_child():
    """A pool made before os.fork has no threads in the child: the child drops it, makes a new one and splits."""
    code = textwrap.dedent("""
        import os, signal, time, torch
        from fibquant import _numba
        torch.set_num_threads(2)

        def kernel(out, start, stop):
            time.sleep(0.02)  # both workers take a share, and are idle in the pool by the fork
            out.extend(range(start, stop))
            return stop - start

        def split():
            out = []
            return _numba.run_split(kernel, (out,), 8, 1, 1, "fibquant-test") == 8 and sorted(out) == list(range(8))

        assert split() and _numba._POOLS["fibquant-test"][1] == 2
        parent_pool = _numba._POOLS["fibquant-test"][0]
        time.sleep(0.1)
        pid = os.fork()
        if pid == 0:
            signal.alarm(30)  # a child stuck on the parent's dead pool is killed, not left behind
            os._exit(0 if split() and _numba._POOLS["fibquant-test"][0] is not parent_pool else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "the forked child could not split work"
        assert split() and _numba._POOLS["fibquant-test"][0] is parent_pool
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@needs_numba
def test_fp16_norms_decode_exactly():
    """Every kind of fp16 norm (zero, -0, subnormals, normals, the largest) is decoded exactly."""
    halves = torch.tensor([0.0, -0.0, 2.0**-24, 3 * 2.0**-24, 1023 * 2.0**-24, 2.0**-14, 0.333, 1.0, -2.5,
                           1000.0, 65504.0], dtype=torch.float16)
    m = halves.numel()
    codewords = torch.ones(2, 1)  # every block decodes to 1: s = nu * sum(q) with q = 1 / 8
    codes = torch.cat([halves.view(torch.uint8).reshape(1, 1, m, 2), torch.zeros(1, 1, m, 1, dtype=torch.uint8)],
                      dim=-1)
    queries = torch.full((1, 1, 1, 8), 0.125)
    scores = coded_scores(queries, codes, codewords, 1, backend="numba")
    assert torch.equal(scores[0, 0, 0], halves.to(torch.float32))
    sums = coded_weighted_sum(torch.ones(1, 1, 1, m), codes, codewords, 1, backend="numba")
    assert torch.allclose(sums[0, 0, 0], halves.to(torch.float32).sum().expand(8))
