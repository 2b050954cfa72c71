"""The fused numba decode step (kv/attention/numba_decode.py) against the torch path and the spec."""
from __future__ import annotations

import pytest
import torch
from _kv_helpers import decode_all_attention, fast_and_torch_paths, filled_coded_layer

from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.integer import IntCodec
from fibquant.codecs.turboquant import TurboQuantCodec
from fibquant.kv.attention import codebook_step, notices
from fibquant.kv.attention import attend_codes, numba_epilogue
from fibquant.kv.cache import CompressedLayer

pytest.importorskip("numba")

DIM = 64
PAIRS = {
    "fibquant k2/k4 (8-bit indices)": lambda: (FibQuantCodec(DIM, 2, 256), FibQuantCodec(DIM, 4, 256)),
    "fibquant 12/10-bit indices": lambda: (FibQuantCodec(DIM, 4, 4096), FibQuantCodec(DIM, 4, 1024)),
    "turboquant 4/2 (byte tables)": lambda: (TurboQuantCodec(DIM, 4), TurboQuantCodec(DIM, 2)),
    "turboquant 3 (3-bit fields)": lambda: (TurboQuantCodec(DIM, 3), FibQuantCodec(DIM, 8, 256)),
}


def layer_of(pair, batch, heads, past, sinks=4, recent=8, centre=False, seed=0):
    return filled_coded_layer(*PAIRS[pair](), batch, heads, past, sinks, recent, centre, seed)


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts calls of the fused kernel path (and checks it ran where expected)."""
    calls = []
    original = codebook_step.attend_codebook_step
    monkeypatch.setattr(codebook_step, "attend_codebook_step", lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("groups", [1, 3, 6])  # 6 query heads per KV head: 8 lanes
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float-per-head"])
def test_fused_step_equals_torch_path_and_spec(monkeypatch, fused_calls, pair, groups, mask_kind):
    batch, heads = 2, 2
    layer, generator = layer_of(pair, batch, heads, past=70)
    kv, _ = layer.update(torch.randn(batch, heads, 1, DIM, generator=generator),
                         torch.randn(batch, heads, 1, DIM, generator=generator))
    query = torch.randn(batch, heads * groups, 1, DIM, generator=generator)
    length = kv.length
    mask = bias = None
    if mask_kind != "none":
        allowed = torch.ones(batch, 1 if mask_kind == "bool" else heads * groups, 1, length, dtype=torch.bool)
        allowed[1, :, :, :3] = False        # left padding
        allowed[1, :, :, 20:25] = False     # a span inside the coded part
        allowed[0, :, :, length - 4] = False  # one column of the recent window
        if mask_kind == "bool":
            mask = allowed
        else:
            mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
            mask[0] += torch.randn(mask[0].shape, generator=generator)  # a finite bias too
        bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf")) if mask_kind == "bool" else mask
    fast, slow = fast_and_torch_paths(query, kv, mask, 0.125)
    assert fused_calls, "the fused path did not run"
    assert fast.shape == (batch, 1, heads * groups, DIM) and fast.dtype == query.dtype
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast, decode_all_attention(query, kv, bias, 0.125), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pair", ["fibquant k2/k4 (8-bit indices)", "turboquant 4/2 (byte tables)"])
def test_fused_step_with_sinks_centring_and_window(monkeypatch, fused_calls, pair):
    layer, generator = layer_of(pair, 2, 3, past=90, centre=True)
    assert layer.key_mean is not None
    kv, _ = layer.update(torch.randn(2, 3, 1, DIM, generator=generator) + 1.0,
                         torch.randn(2, 3, 1, DIM, generator=generator) + 1.0)
    query = torch.randn(2, 9, 1, DIM, generator=generator)
    sinks = torch.randn(9, generator=generator)
    fast, slow = fast_and_torch_paths(query, kv, None, 0.1, sinks=sinks)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast, decode_all_attention(query, kv, None, 0.1, sinks), rtol=1e-4, atol=1e-5)
    # a sliding window (mask None): the oldest columns blocked
    window = kv.length - 10
    fast, slow = fast_and_torch_paths(query, kv, None, 0.1, window=window)
    blocked = torch.arange(kv.length) <= kv.length - 1 - window
    bias = torch.zeros(kv.length).masked_fill_(blocked, float("-inf"))[None, None, None]
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast, decode_all_attention(query, kv, bias, 0.1), rtol=1e-4, atol=1e-5)
    assert len(fused_calls) == 2


def test_fused_step_fully_masked_row_and_dtype(monkeypatch, fused_calls):
    layer, generator = layer_of("fibquant k2/k4 (8-bit indices)", 2, 2, past=40)
    kv, _ = layer.update(torch.randn(2, 2, 1, DIM, generator=generator), torch.randn(2, 2, 1, DIM, generator=generator))
    mask = torch.ones(2, 1, 1, kv.length, dtype=torch.bool)
    mask[0] = False
    out = attend_codes(torch.randn(2, 4, 1, DIM, generator=generator), kv, mask, 0.125)
    assert fused_calls and torch.isfinite(out).all() and torch.equal(out[0], torch.zeros_like(out[0]))
    query = torch.randn(2, 4, 1, DIM, generator=generator).to(torch.bfloat16)
    fast, slow = fast_and_torch_paths(query, kv, None, 0.125)
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast, slow, rtol=1e-2, atol=1e-2)


def test_fused_step_falls_back_cleanly(monkeypatch, fused_calls):
    """an INT codec (no reader of its own), many query heads per KV head and autograd take the torch
    path; the results still match the spec."""
    monkeypatch.setattr(notices, "warned", set())
    layer, generator = layer_of("fibquant k2/k4 (8-bit indices)", 1, 2, past=40)
    kv, _ = layer.update(torch.randn(1, 2, 1, DIM, generator=generator), torch.randn(1, 2, 1, DIM, generator=generator))
    query = torch.randn(1, 4, 1, DIM, generator=generator)
    wide = torch.randn(1, 18, 1, DIM, generator=generator)  # 9 query heads per KV head
    torch.testing.assert_close(attend_codes(wide, kv, None, 0.125), decode_all_attention(wide, kv, None, 0.125), rtol=1e-4, atol=1e-5)
    attend_codes(query.clone().requires_grad_(True), kv, None, 0.125)
    assert not fused_calls
    int_layer = CompressedLayer(IntCodec(DIM, 4), FibQuantCodec(DIM, 2, 256), 2, 4, attention="codes")
    int_layer.update(torch.randn(1, 2, 30, DIM), torch.randn(1, 2, 30, DIM))
    kv, _ = int_layer.update(torch.randn(1, 2, 1, DIM), torch.randn(1, 2, 1, DIM))
    with pytest.warns(RuntimeWarning, match="no reader of its own"):
        out = attend_codes(query, kv, None, 0.125)
    assert not fused_calls
    torch.testing.assert_close(out, decode_all_attention(query, kv, None, 0.125), rtol=1e-4, atol=1e-5)


def test_fused_step_split_over_threads(monkeypatch, fused_calls):
    """With 2 torch threads and enough work the (batch, KV head) units run on two workers, each
    with its own scratch tables: same result as one thread."""
    layer, generator = layer_of("fibquant k2/k4 (8-bit indices)", 2, 2, past=800)
    kv, _ = layer.update(torch.randn(2, 2, 1, DIM, generator=generator), torch.randn(2, 2, 1, DIM, generator=generator))
    query = torch.randn(2, 6, 1, DIM, generator=generator)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = attend_codes(query, kv, None, 0.125)
        torch.set_num_threads(2)
        split = attend_codes(query, kv, None, 0.125)
    finally:
        torch.set_num_threads(previous)
    assert len(fused_calls) == 2
    torch.testing.assert_close(split, single, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(split, decode_all_attention(query, kv, None, 0.125), rtol=1e-4, atol=1e-5)


def _helpers():
    from fibquant.kv.attention import numba_decode, numba_kernels
    from fibquant.kv.attention.kernels import _kernels

    _kernels()
    numba_decode.compile_decode_kernel()
    return numba_decode, numba_kernels


def test_branch_free_norms_equal_the_plain_fp16_decoder_bit_for_bit():
    import numpy as np

    numba_decode, numba_kernels = _helpers()
    halves = np.arange(1 << 16, dtype=np.uint16)
    rows = np.zeros((halves.size, 4), dtype=np.uint8)
    rows[:, :2] = halves.view(np.uint8).reshape(-1, 2)
    fast, plain = np.empty(halves.size, np.float32), np.empty(halves.size, np.float32)
    numba_decode._norms(rows, fast, np.empty(halves.size, np.int32))
    numba_kernels._decode_norms(rows, plain)
    nan = np.isnan(plain)
    assert np.array_equal(nan, np.isnan(fast)) and nan.sum() == 2046
    assert np.array_equal(fast[~nan].view(np.uint32), plain[~nan].view(np.uint32))  # -0.0 too
    assert np.array_equal(fast[~nan], halves.view(np.float16)[~nan].astype(np.float32))


def test_vectorised_exp_is_within_a_few_ulp_and_masked_columns_give_zero():
    import numpy as np

    numba_decode, _ = _helpers()
    x = np.concatenate([np.linspace(-90.0, 0.0, 200001, dtype=np.float32),
                        np.array([-np.inf, -1e30, 0.0], dtype=np.float32)])
    row, top = x + np.float32(3.5), np.float32(3.5)
    total = numba_epilogue._exp_sum(row, row.size, top, np.empty(row.size, np.int32))
    expected = np.exp(x.astype(np.float64))
    assert np.all(row[-3:-1] == 0.0) and row[-1] == 1.0
    assert np.all(row[x < -87.34] == 0.0)
    keep = x >= -87.0
    assert np.max(np.abs(row[keep] - expected[keep]) / expected[keep]) < 4e-7
    assert abs(total - row.astype(np.float64).sum()) <= 1e-5 * total
    assert numba_epilogue._row_max(row, row.size, np.float32(-np.inf)) == 1.0


def test_row_max_equals_numpy_for_every_tail_length_and_masked_rows():
    import numpy as np

    numba_decode, _ = _helpers()
    generator = np.random.default_rng(3)
    for n in range(0, 11):
        row = generator.standard_normal(n + 3).astype(np.float32)  # columns past n are not read
        row[n:] = np.float32(1e9)
        if n:
            row[generator.integers(0, n)] = -np.inf
        for top in (np.float32(-np.inf), np.float32(0.25)):
            expected = max(float(top), float(row[:n].max())) if n else float(top)
            assert numba_epilogue._row_max(row, n, top) == expected
    masked = np.full(9, -np.inf, dtype=np.float32)
    assert numba_epilogue._row_max(masked, 9, np.float32(-np.inf)) == -np.inf


@pytest.mark.parametrize("module,roles", [("numba_decode", ("CodebookRole", "RecallRows", "StepScratch")),
                                          ("numba_residual", ("StagesRole",)), ("numba_shells", ("ShellRole",))])
def test_step_signatures_match_their_structures(module, roles):
    """Each one-token step's compiled signature lays out each structure's fields in their order (its
    `_signature`): query, out, the key and value roles, `numba_epilogue`'s codes, exact parts and epilogue,
    then the step's own structures (a plain int: the residual step's lanes), unit_start, unit_stop."""
    import importlib

    from numba.core import sigutils

    step = importlib.import_module(f"fibquant.kv.attention.{module}")
    args, _ = sigutils.normalize_signature(step._signature())
    role = getattr(step, roles[0])
    structures = (role, role, numba_epilogue.StepCodes, numba_epilogue.StepExact, numba_epilogue.StepEpilogue,
                  *(getattr(step, name) for name in roles[1:]))
    assert len(args) == 2 + len(structures) + 2 + (module == "numba_residual")
    for arg, structure in zip(args[2:], structures):
        assert len(arg) == len(structure._fields), structure.__name__
