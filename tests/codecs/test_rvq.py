"""Residual VQ baseline: determinism, more stages -> less error, layout and bad input."""
import pytest
import torch

from fibquant.codecs.rvq import RVQCodec


def _correlated(n: int, dim: int = 16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=gen) * torch.linspace(2.0, 0.1, dim)
    return torch.randn(n, dim, generator=gen) @ mix


@pytest.fixture(scope="module")
def data():
    return _correlated(2000, seed=0), _correlated(500, seed=1)


def test_fit_is_deterministic(data):
    train, _ = data
    a = RVQCodec.fit(train, stages=2, n_codewords=32, seed=3)
    b = RVQCodec.fit(train, stages=2, n_codewords=32, seed=3)
    assert torch.equal(a.codebooks, b.codebooks)


def test_each_stage_reduces_held_out_error(data):
    train, test = data
    codec = RVQCodec.fit(train, stages=3, n_codewords=32)
    errors = []
    for stages in (1, 2, 3):
        partial = RVQCodec(codec.codebooks[:stages])
        errors.append(float(((partial.decode(partial.encode(test)) - test) ** 2).sum(-1).mean()))
    energy = float((test ** 2).sum(-1).mean())
    assert errors[0] < 0.8 * energy  # 5 bits for 16 dims already removes a fifth of the energy
    assert errors[2] < errors[1] < errors[0]


def test_greedy_encoding_matches_reference(data):
    train, test = data
    codec = RVQCodec.fit(train, stages=2, n_codewords=16)
    residual = test[:50].clone()
    expected = torch.zeros_like(residual)
    for stage in codec.codebooks:
        index = ((residual.unsqueeze(1) - stage.unsqueeze(0)) ** 2).sum(-1).argmin(1)
        expected += stage[index]
        residual -= stage[index]
    assert torch.allclose(codec.decode(codec.encode(test[:50])), expected, atol=1e-5)


def test_layout_and_single_row_decode(data):
    train, test = data
    codec = RVQCodec.fit(train, stages=3, n_codewords=32)
    assert codec.code_size == 2  # 3 stages x 5 bits = 15 bits
    assert codec.bits_per_coordinate == pytest.approx(15 / 16)
    codes = codec.encode(test[:5])
    batch = codec.decode(codes)
    for i in range(5):
        assert torch.equal(codec.decode(codes[i]), batch[i])


def test_bad_input(data):
    train, _ = data
    with pytest.raises(ValueError, match="at least n_codewords"):
        RVQCodec.fit(train[:10], stages=1, n_codewords=32)
    with pytest.raises(ValueError, match="stages"):
        RVQCodec.fit(train, stages=0)
    with pytest.raises(ValueError, match="NaN"):
        RVQCodec.fit(torch.full((64, 16), float("nan")), stages=1, n_codewords=4)
    with pytest.raises(ValueError, match="shape"):
        RVQCodec(torch.zeros(4, 16))
    codec = RVQCodec.fit(train, stages=1, n_codewords=20)  # 5-bit indices, only 20 used
    with pytest.raises(ValueError, match="index >= N"):
        codec.decode(torch.tensor([31], dtype=torch.uint8))
