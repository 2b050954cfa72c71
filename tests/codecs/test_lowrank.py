"""LowRankCodec: PCA fit, exact reconstruction inside the subspace, fp16 code layout, errors."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fibquant.codecs.lowrank import LowRankCodec


def _subspace_data(n=500, dim=16, rank=3, seed=0, offset=0.0):
    generator = torch.Generator().manual_seed(seed)
    directions = torch.linalg.qr(torch.randn(dim, rank, generator=generator))[0].T  # [rank, dim]
    coefficients = torch.randn(n, rank, generator=generator) * torch.tensor([3.0, 2.0, 1.0][:rank])
    return coefficients @ directions + offset, directions


@pytest.mark.parametrize("center", [True, False])
def test_data_inside_subspace_is_reconstructed_to_fp16_precision(center):
    offset = 0.5 if center else 0.0  # a non-centred fit must see data through the origin
    data, _ = _subspace_data(offset=offset)
    codec = LowRankCodec.fit(data, rank=3, center=center)
    codes = codec.encode(data)
    assert codes.dtype == torch.uint8 and codes.shape == (500, 6) and codec.code_size == 6
    error = (codec.decode(codes) - data).norm(dim=-1) / data.norm(dim=-1)
    assert float(error.max()) < 2e-3  # fp16 coefficients: relative error ~ 2**-11


def test_fit_finds_the_principal_directions_and_orders_them():
    data, directions = _subspace_data(n=4000)
    codec = LowRankCodec.fit(data, rank=1)
    overlap = (codec.basis @ directions[0]).abs()
    assert float(overlap) > 0.99


@settings(max_examples=10, deadline=None)
@given(rank=st.integers(1, 8), seed=st.integers(0, 1000))
def test_more_rank_never_hurts_and_matches_the_projection_reference(rank, seed):
    generator = torch.Generator().manual_seed(seed)
    data = torch.randn(200, 8, generator=generator) @ torch.randn(8, 8, generator=generator)
    codec = LowRankCodec.fit(data, rank=rank)
    # Reference: orthogonal projection with the float basis (no fp16 rounding).
    reference = (data - codec.mean) @ codec.basis.T @ codec.basis + codec.mean
    torch.testing.assert_close(codec.roundtrip(data), reference, rtol=2e-3, atol=2e-3 * float(data.abs().max()))
    if rank < 8:
        bigger = LowRankCodec.fit(data, rank=rank + 1)
        assert float((bigger.roundtrip(data) - data).pow(2).sum()) <= float((codec.roundtrip(data) - data)
                                                                            .pow(2).sum()) * 1.001 + 1e-3


def test_rate_fields():
    codec = LowRankCodec.fit(torch.randn(100, 64), rank=8)
    assert codec.bits_per_coordinate == 2.0 and codec.compression_ratio == 8.0


def test_bad_input():
    with pytest.raises(ValueError, match="rank must be"):
        LowRankCodec.fit(torch.randn(10, 4), rank=5)
    with pytest.raises(ValueError, match="rank must be"):
        LowRankCodec.fit(torch.randn(10, 4), rank=0)
    with pytest.raises(ValueError, match=r"shape \[n, dim\]"):
        LowRankCodec.fit(torch.randn(10), rank=1)
    with pytest.raises(ValueError, match="NaN"):
        LowRankCodec.fit(torch.full((10, 4), float("nan")), rank=1)
    with pytest.raises(ValueError, match="orthonormal"):
        LowRankCodec(torch.ones(2, 4))
    codec = LowRankCodec.fit(torch.randn(10, 4), rank=2)
    with pytest.raises(ValueError, match="dim=4"):
        codec.encode(torch.randn(3, 5))
