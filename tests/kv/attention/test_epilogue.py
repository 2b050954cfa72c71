"""The shared epilogue of the numba decode steps (kv/attention/numba_epilogue.py) against its spec
(`reference.epilogue_weights`), and soft-capping through every one-token step family against the spec."""
from __future__ import annotations

import pytest
import torch
from _kv_helpers import decode_all_attention, fast_and_torch_paths, filled_coded_layer, ragged_float_mask

from fibquant.codecs.e8shell import E8ShellCodec
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.fibrvq import FibRVQCodec
from fibquant.codecs.turboquant import TurboQuantCodec
from fibquant.kv.attention import numba_epilogue
from fibquant.kv.attention.reference import epilogue_weights

np = pytest.importorskip("numpy")
pytest.importorskip("numba")

DIM = 64


@pytest.fixture(scope="module")
def bound():
    numba_epilogue.bind_epilogue()
    return numba_epilogue


@pytest.mark.parametrize("cap", [50.0, 3.0, 0.5])
def test_vectorised_softcap_equals_tanh(bound, cap):
    x = np.concatenate([np.linspace(-40 * cap, 40 * cap, 100001, dtype=np.float32),
                        np.array([0.0, -0.0, 1e-30, -1e-30, 3e38, -3e38], dtype=np.float32)])
    row = x.copy()
    bound._softcap(row, row.size, np.float32(cap), np.empty(row.size, np.int32))
    expected = np.tanh(x.astype(np.float64) / cap) * cap
    assert np.max(np.abs(row - expected)) <= 4e-7 * cap
    visible = np.abs(expected) > 1e-6 * cap  # below: 0 within the bound above
    assert np.all(np.sign(row[visible]) == np.sign(expected[visible])) and np.all(np.abs(row) <= cap)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_row_weights_equal_the_reference_epilogue(bound, softcap, with_bias, with_sinks):
    """`_row_weights` on one unit (G rows of coded and exact scores) = `epilogue_weights` on the row in its
    true column order [sinks | coded | recent, new], normalised by the returned totals."""
    generator = torch.Generator().manual_seed(1)
    groups, n_tokens, n_sink, n_exact, heads, h, b = 3, 37, 4, 11, 2, 1, 1
    coded = torch.randn(groups, n_tokens, generator=generator) * 4
    exact = torch.randn(groups, n_exact, generator=generator) * 4
    length = n_tokens + n_exact
    bias = torch.zeros(2, heads * groups, length)
    if with_bias:
        bias = torch.randn(2, heads * groups, length, generator=generator)
        bias[b, h * groups, 5:9] = float("-inf")  # coded columns masked
        bias[b, h * groups + 2] = float("-inf")  # a whole row masked: zeros
    sinks = torch.randn(heads * groups, generator=generator)
    coded_np, exact_np = coded.numpy().copy(), exact.numpy().copy()
    coded_total, total = np.empty(groups, np.float32), np.empty(groups, np.float32)
    bound._row_weights(coded_np, exact_np, groups, n_tokens, n_exact, n_sink, np.float32(softcap), bias.numpy(),
                       with_bias, sinks.numpy(), with_sinks, b, h, coded_total, total, np.empty(length, np.int32))
    got = np.concatenate([exact_np[:, :n_sink], coded_np, exact_np[:, n_sink:]], axis=1)
    got = got / np.where(total > 0, total, 1)[:, None]
    scores = torch.cat([exact[:, :n_sink], coded, exact[:, n_sink:]], dim=1)
    want = epilogue_weights(scores[:, None], bias[b, h * groups:(h + 1) * groups, None] if with_bias else None,
                            softcap or None, sinks[h * groups:(h + 1) * groups] if with_sinks else None)[:, 0]
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.from_numpy(coded_total), torch.from_numpy(coded_np.sum(1)), rtol=1e-5, atol=1e-6)


FAMILIES = {  # one pair of codecs per one-token step: the fused kernel, residual stages, E8 shells
    "fused (fibquant / turboquant)": (lambda: (FibQuantCodec(DIM, 2, 256), TurboQuantCodec(DIM, 4)),
                                      "fibquant.kv.attention.codebook_step", "attend_codebook_step"),
    "residual (fibrvq)": (lambda: (FibRVQCodec(DIM, stages=2), FibQuantCodec(DIM, 4, 256)),
                          "fibquant.kv.attention.numba_residual", "attend_decode_residual"),
    "shells (e8shell)": (lambda: (E8ShellCodec(DIM, 2), E8ShellCodec(DIM, 4)),
                         "fibquant.kv.attention.numba_shells", "attend_decode_shells"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_softcap_runs_through_every_one_token_step(monkeypatch, family):
    """Soft-capped decode steps (Gemma 2) stay in the numba steps: equal to the torch path and the spec,
    with a ragged mask and sinks too."""
    import importlib

    codecs, module, name = FAMILIES[family]
    module = importlib.import_module(module) if isinstance(module, str) else module
    calls, original = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or original(*a))
    batch, heads, groups = 2, 2, 3
    layer, generator = filled_coded_layer(*codecs(), batch, heads, 60)
    kv, _ = layer.update(torch.randn(batch, heads, 1, DIM, generator=generator),
                         torch.randn(batch, heads, 1, DIM, generator=generator))
    query = torch.randn(batch, heads * groups, 1, DIM, generator=generator) * 3
    mask = ragged_float_mask(batch, heads * groups, kv.length, generator)
    sinks = torch.randn(heads * groups, generator=generator)
    for cap, bias, sink in ((2.0, None, None), (0.7, mask, sinks)):
        fast, slow = fast_and_torch_paths(query, kv, bias, 0.125, softcap=cap, sinks=sink)
        torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fast, decode_all_attention(query, kv, bias, 0.125, sink, cap), rtol=1e-4,
                                   atol=1e-5)
    assert len(calls) == 2


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_token_steps_with_more_exact_than_coded_columns_keep_the_heap_whole(family):
    """More exact columns (4 sinks + 32 recent + the new token) than coded ones: the softmax's vectorised exps
    of the exact row once wrote past a scratch sized for the coded tokens and corrupted the heap (glibc then
    aborts the process). Run in a child process, 20 steps, each equal to the torch path."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = f"""
import torch
import test_epilogue as t
from _kv_helpers import fast_and_torch_paths, filled_coded_layer
codecs, module, name = t.FAMILIES[{family!r}]
layer, generator = filled_coded_layer(*codecs(), 1, 2, 40, sinks=4, recent=32)
for _ in range(20):
    kv, _ = layer.update(torch.randn(1, 2, 1, t.DIM, generator=generator), torch.randn(1, 2, 1, t.DIM, generator=generator))
    assert 0 < kv.num_coded < kv.length - kv.num_coded, (kv.num_coded, kv.length)
    fast, slow = fast_and_torch_paths(torch.randn(1, 6, 1, t.DIM, generator=generator), kv, None, 0.125)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
print("ok")
"""
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parents[1]), str(here.parents[2] / "src")]),
               MALLOC_CHECK_="3", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
