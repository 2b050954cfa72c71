"""The residual decode step (kv/attention/numba_residual.py: one lookup table per stage) against the
torch path on decoded floats and the spec (decode every code, one softmax), to float32 tolerance."""
from __future__ import annotations

import functools

import pytest
import torch
from _kv_helpers import check_sinks_and_sliding_window, ragged_float_mask, decode_all_attention, fast_and_torch_paths, filled_coded_layer

import fibquant.kv.attention.numba_residual as numba_residual
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.integer import IntCodec
from fibquant.codecs.fibrvq import FibRVQCodec
from fibquant.codecs.reader import StagesReader
from fibquant.kv.attention import attend_codes
from fibquant.kv.cache import CompressedLayer

pytest.importorskip("numba")

DIM = 64
PAIRS = {
    "rvq 2/2": lambda: (FibRVQCodec(DIM, stages=2), FibRVQCodec(DIM, stages=2)),
    "rvq 4/1": lambda: (FibRVQCodec(DIM, stages=4), FibRVQCodec(DIM, stages=1)),
    "rvq 3 / fibquant k4": lambda: (FibRVQCodec(DIM, stages=3), FibQuantCodec(DIM, 4, 256)),
    "fibquant k2 / rvq 2": lambda: (FibQuantCodec(DIM, 2, 256), FibRVQCodec(DIM, stages=2)),
    "rvq k16 4 / rvq 2": lambda: (FibRVQCodec(DIM, k=16, stages=4), FibRVQCodec(DIM, stages=2)),
}


@functools.lru_cache(maxsize=None)
def codecs_of(pair):
    """One codec pair per test session (their search tables build once; layers share codecs anyway)."""
    return PAIRS[pair]()


def layer_of(pair, batch, heads, past, centre=False, seed=0):
    return filled_coded_layer(*codecs_of(pair), batch, heads, past, centre=centre, seed=seed)


@pytest.fixture
def residual_calls(monkeypatch):
    calls = []
    original = numba_residual.attend_decode_residual
    monkeypatch.setattr(numba_residual, "attend_decode_residual", lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("groups", [1, 3, 6])  # 6 query heads per KV head: 8 lanes
@pytest.mark.parametrize("masked", [False, True])
def test_residual_step_equals_torch_path_and_spec(monkeypatch, residual_calls, pair, groups, masked):
    batch, heads = 2, 2
    layer, generator = layer_of(pair, batch, heads, past=70)
    kv, _ = layer.update(torch.randn(batch, heads, 1, DIM, generator=generator),
                         torch.randn(batch, heads, 1, DIM, generator=generator))
    query = torch.randn(batch, heads * groups, 1, DIM, generator=generator)
    mask = bias = None
    if masked:
        mask = ragged_float_mask(batch, heads * groups, kv.length, generator)
        bias = mask
    fast, slow = fast_and_torch_paths(query, kv, mask, 0.125)
    assert residual_calls, "the residual kernel did not run"
    assert fast.shape == (batch, 1, heads * groups, DIM) and fast.dtype == query.dtype
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast, decode_all_attention(query, kv, bias, 0.125), rtol=1e-4, atol=1e-5)


def test_residual_step_with_sinks_centring_and_window(monkeypatch, residual_calls):
    layer, generator = layer_of("rvq 2/2", 2, 3, past=90, centre=True)
    assert layer.key_mean is not None
    kv, _ = layer.update(torch.randn(2, 3, 1, DIM, generator=generator) + 1.0,
                         torch.randn(2, 3, 1, DIM, generator=generator) + 1.0)
    query = torch.randn(2, 9, 1, DIM, generator=generator)
    sinks = torch.randn(9, generator=generator)
    check_sinks_and_sliding_window(query, kv, sinks)
    assert len(residual_calls) == 2


def test_what_the_residual_kernel_does_not_take(monkeypatch, residual_calls):
    """Plain codecs stay on numba_decode's kernel; an INT role, N != 256, > 8 query heads per KV head
    and a prefill chunk take the torch path (still equal to the spec)."""
    assert numba_residual.residual_plan(FibQuantCodec(DIM, 4, 256))[2].shape[0] == 1
    assert numba_residual.residual_plan(IntCodec(DIM, 4)) is None
    small = FibRVQCodec(DIM, 8, 2, 16)
    small._codebook = torch.randn(2, 16, 8)  # N = 16 stages (not built: the plan only reads their shape)
    assert numba_residual.residual_plan(small) is None
    layer, generator = layer_of("rvq 2/2", 1, 1, past=30)
    kv, _ = layer.update(torch.randn(1, 1, 1, DIM, generator=generator), torch.randn(1, 1, 1, DIM, generator=generator))
    query = torch.randn(1, 9, 1, DIM, generator=generator)  # 9 query heads per KV head
    torch.testing.assert_close(attend_codes(query, kv, None, 0.125), decode_all_attention(query, kv, None, 0.125),
                               rtol=1e-4, atol=1e-5)
    assert not residual_calls
    fibquant_layer = CompressedLayer(FibQuantCodec(DIM, 4, 256), FibQuantCodec(DIM, 4, 256), 4, 8, attention="codes")
    for chunk in (20, 1):
        kv, _ = fibquant_layer.update(torch.randn(1, 1, chunk, DIM, generator=generator),
                                      torch.randn(1, 1, chunk, DIM, generator=generator))
    attend_codes(torch.randn(1, 2, 1, DIM, generator=generator), kv, None, 0.125)
    assert not residual_calls


def test_stage_layout_matches_the_codec():
    """StagesReader: decoding a code by hand from its stages and rotation gives the codec's decode."""
    codec = FibRVQCodec(DIM, stages=3)
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(3))
    codes = codec.encode(x)
    staged = codec.reader(torch.device("cpu"))
    assert isinstance(staged, StagesReader)
    index = codes[:, 2:].to(torch.int64).reshape(5, DIM // 8, 3)
    u_hat = sum(staged.stages[s][index[..., s]] for s in range(3)).reshape(5, DIM)
    norms = codes[:, :2].contiguous().view(torch.float16).to(torch.float32)
    torch.testing.assert_close(norms * (u_hat @ staged.forward.T), codec.decode(codes), rtol=1e-5, atol=1e-5)
    assert not isinstance(FibQuantCodec(DIM, 4, 256).reader(torch.device("cpu")), StagesReader)
