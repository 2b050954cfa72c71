"""The numba beam search of residual codebooks (codebook/residual_numba.py): indices EQUAL to the torch
beam search of the same width (codebook/residual.py's `beam_search`, the spec), ties included."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fibquant._numba import numba_available
from fibquant.codebook import residual as R
from fibquant.codebook.residual_numba import fast_beam_search
from fibquant.codecs.fibrvq import FibRVQCodec
from fibquant.canonical import sample_blocks, sample_sphere

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba is not installed")


@pytest.mark.parametrize("stages,beam", [(1, 16), (2, 16), (2, 1), (3, 4), (4, 2)])
def test_shipped_stages_equal_the_torch_beam(stages, beam):
    book = R.load_residual(R.ResidualSpec(64, 8, stages, 256))
    x = sample_blocks(384, 64, 8, seed=100 + stages)
    assert torch.equal(fast_beam_search(x, book, beam), R.beam_search(x, book, beam))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(2, 12), st.integers(1, 6), st.integers(1, 20), st.integers(0, 2 ** 31 - 1),
       st.sampled_from(["gauss", "grid", "dup"]))
def test_random_and_tied_stages_equal_the_torch_beam(stages, n, k, beam, seed, kind):
    gen = torch.Generator().manual_seed(seed)
    if kind == "grid":  # small integers: exact ties between sums everywhere
        book = torch.randint(-2, 3, (stages, n, k), generator=gen).to(torch.float32)
        x = torch.randint(-3, 4, (40, k), generator=gen).to(torch.float32)
    else:
        book = torch.randn(stages, n, k, generator=gen) * torch.tensor([0.5 ** j for j in range(stages)])[:, None, None]
        x = torch.randn(40, k, generator=gen)
        if kind == "dup":  # duplicated codewords, blocks on codewords and on sums, zero blocks
            book[:, n // 2] = book[:, 0]
            x[:5] = book[0, 0]
            x[5:10] = book[:, 0].sum(0)
            x[10:12] = 0.0
            x[12:14] = book[0, torch.randint(0, n, (2,), generator=gen)]
    _assert_equal_or_tied(x, book, fast_beam_search(x, book, beam), R.beam_search(x, book, beam))


def _assert_equal_or_tied(x, book, fast, reference):
    """The fast search leaves near-ties to the reference, run on the flagged rows alone; on an exact tie
    (duplicated codewords) the reference's batched float64 matmul can round the tied paths apart
    differently in that smaller batch than in the whole one (seen: stages=3, n=9, k=5, beam=3,
    seed=112, 'dup'). Such rows may pick the other tied path, never a worse one: their errors must agree."""
    differ = (fast != reference).any(1)
    if differ.any():
        def errors(indices):
            return ((x[differ].double() - R.reconstruct(indices[differ], book.double())) ** 2).sum(-1)

        torch.testing.assert_close(errors(fast), errors(reference), rtol=1e-12, atol=1e-12)


def test_exact_ties_break_as_the_reference_does():
    book = torch.zeros(2, 4, 2)
    book[0, 1] = book[0, 3] = torch.tensor([1.0, 0.0])  # two equal first-stage codewords
    x = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.5, 0.0]])
    for beam in (1, 2, 3):
        assert torch.equal(fast_beam_search(x, book, beam), R.beam_search(x, book, beam))


def test_non_finite_blocks_are_left_to_the_reference():
    book = R.load_residual(R.ResidualSpec(64, 8, 2, 256))
    x = sample_blocks(16, 64, 8, seed=5)
    x[3, 2] = float("nan")
    x[7, 0] = float("inf")
    got, want = fast_beam_search(x, book, 4), R.beam_search(x, book, 4)
    assert torch.equal(got, want)


def test_threads_give_the_same_indices():
    book = R.load_residual(R.ResidualSpec(64, 8, 2, 256))
    x = sample_blocks(4096, 64, 8, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fast_beam_search(x, book, 4)
        torch.set_num_threads(2)
        two = fast_beam_search(x, book, 4)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_empty_input_and_bad_arguments():
    book = torch.randn(2, 4, 3)
    assert fast_beam_search(torch.zeros(0, 3), book, 2).shape == (0, 2)
    with pytest.raises(ValueError, match="beam"):
        fast_beam_search(torch.zeros(2, 3), book, 0)
    with pytest.raises(ValueError, match="beam"):
        fast_beam_search(torch.zeros(2, 3), book, True)
    with pytest.raises(ValueError, match="blocks"):
        fast_beam_search(torch.zeros(2, 4), book, 2)
    with pytest.raises(ValueError, match="stages"):
        fast_beam_search(torch.zeros(2, 3), torch.zeros(4, 3), 2)


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_codec_codes_equal_the_torch_path(bits):
    codec = FibRVQCodec.from_spec(64, bits=bits)
    x = sample_sphere(64, 64, seed=31) * 3.0
    fast = codec.encode(x)
    codec.fast_search = False
    try:
        slow = codec.encode(x)
    finally:
        codec.fast_search = True
    assert torch.equal(fast, slow)


def test_prebuilt_tables_give_the_same_indices_and_are_checked():
    from fibquant.codebook.residual_numba import beam_tables

    book = R.load_residual(R.ResidualSpec(64, 8, 2, 256))
    x = sample_blocks(64, 64, 8, seed=12)
    tables = beam_tables(book)
    assert torch.equal(fast_beam_search(x, book, 16, tables), R.beam_search(x, book, 16))
    with pytest.raises(ValueError, match="tables"):
        fast_beam_search(x, book, 16, beam_tables(R.load_residual(R.ResidualSpec(64, 8, 3, 256))))
