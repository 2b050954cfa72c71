"""The decode step's fast paths (issue 17): `CodedKV.arrays` (numpy views a CPU layer keeps for the
fused kernel), the window's numpy append, the skipped re-validation of an accepted step shape, and
`Codec.check_input`'s numpy finiteness check. Each is checked against what it replaces."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.integer import IntCodec
from fibquant.kv.buffer import CodeBuffer, WindowBuffer
from fibquant.kv.cache import CompressedLayer

DIM = 64
FIELDS = ("sink_keys", "sink_values", "key_codes", "value_codes", "recent_keys", "recent_values")


def _check_arrays(view) -> None:
    """Every array of view.arrays is the same memory and the same values as its tensor field."""
    assert view.arrays is not None
    for name, array in zip(FIELDS, view.arrays):
        tensor = getattr(view, name)
        assert tuple(array.shape) == tuple(tensor.shape), name
        assert np.array_equal(array, tensor.numpy()), name
        if tensor.numel():
            assert np.shares_memory(array, tensor.numpy()), name


def test_arrays_alias_the_tensors_across_encodes_moves_and_edits():
    batch, heads = 2, 3
    generator = torch.Generator().manual_seed(0)
    layer = CompressedLayer(IntCodec(DIM, 4), IntCodec(DIM, 3), 2, 5, attention="codes", encode_batch=4)
    views = []
    layer.update(torch.randn(batch, heads, 9, DIM, generator=generator), torch.randn(batch, heads, 9, DIM,
                                                                                   generator=generator))
    for step in range(40):  # encodes every 4 steps, the window's rows move to new buffers
        if step == 20:
            layer.batch_select_indices(torch.tensor([1]))
            batch = 1
        rows = torch.randn(batch, heads, 1, DIM, generator=generator)
        view, _ = layer.update(rows, rows * 2)
        _check_arrays(view)
        views.append((view, [a.copy() for a in view.arrays]))
    for view, copies in views:  # earlier views (and their arrays) stay what they were
        _check_arrays(view)
        assert all(np.array_equal(a, c) for a, c in zip(view.arrays, copies))


def test_no_arrays_for_a_non_float32_layer():
    layer = CompressedLayer(IntCodec(DIM, 4), IntCodec(DIM, 4), 2, 5, attention="codes", encode_batch=4)
    states = torch.randn(1, 2, 12, DIM).to(torch.bfloat16)
    view, _ = layer.update(states, states)
    assert view.arrays is None
    view, _ = layer.update(states[..., :1, :], states[..., :1, :])
    assert view.arrays is None and view.recent_keys.dtype == torch.bfloat16


def test_fused_step_equal_with_and_without_arrays():
    pytest.importorskip("numba")
    from fibquant.kv.attention import attend_codes

    generator = torch.Generator().manual_seed(1)
    layer = CompressedLayer(FibQuantCodec(DIM, 2, 256), FibQuantCodec(DIM, 4, 256), 4, 8, attention="codes")
    layer.update(torch.randn(1, 3, 100, DIM, generator=generator), torch.randn(1, 3, 100, DIM, generator=generator))
    for _ in range(3):
        rows = torch.randn(1, 3, 1, DIM, generator=generator)
        view, _ = layer.update(rows, -rows)
        query = torch.randn(1, 9, 1, DIM, generator=generator)
        with_arrays = attend_codes(query, view, None, 0.125)
        converted = attend_codes(query, dataclasses.replace(view, arrays=None), None, 0.125)
        assert with_arrays.shape == (1, 1, 9, DIM)
        assert torch.equal(with_arrays, converted)  # the same kernel on the same numbers


def test_fused_step_takes_a_strided_query():
    """A query split from a fused qkv projection (GPT-2) at batch > 1: last dimension contiguous, the
    batch stride not; the fused step gives what it gives on a contiguous copy."""
    pytest.importorskip("numba")
    from fibquant.kv.attention import attend_codes

    generator = torch.Generator().manual_seed(2)
    layer = CompressedLayer(FibQuantCodec(DIM, 2, 256), FibQuantCodec(DIM, 2, 256), 4, 8, attention="codes")
    layer.update(torch.randn(2, 3, 60, DIM, generator=generator), torch.randn(2, 3, 60, DIM, generator=generator))
    rows = torch.randn(2, 3, 1, DIM, generator=generator)
    view, _ = layer.update(rows, rows)
    qkv = torch.randn(2, 1, 3 * 9 * DIM, generator=generator)
    query = qkv.split(9 * DIM, dim=-1)[0].view(2, 1, 9, DIM).transpose(1, 2)  # [B, Hq, 1, D], strided batch
    assert not query.is_contiguous() and query.stride(-1) == 1
    assert torch.equal(attend_codes(query, view, None, 0.125), attend_codes(query.contiguous(), view, None, 0.125))


def test_accepted_step_shape_skips_checks_but_changes_are_still_rejected():
    layer = CompressedLayer(IntCodec(DIM, 4), IntCodec(DIM, 4), 2, 5, attention="codes", encode_batch=4)
    layer.update(torch.randn(2, 3, 10, DIM), torch.randn(2, 3, 10, DIM))
    rows = torch.randn(2, 3, 1, DIM)
    layer.update(rows, rows)
    layer.update(rows, rows)  # the accepted shape again
    with pytest.raises(ValueError, match="head_dim"):
        layer.update(torch.randn(2, 3, 1, DIM + 1), torch.randn(2, 3, 1, DIM + 1))
    with pytest.raises(ValueError, match="floating"):
        layer.update(torch.ones(2, 3, 1, DIM, dtype=torch.int64), rows)
    with pytest.raises(ValueError, match="shape"):
        layer.update(np.zeros((2, 3, 1, DIM), dtype=np.float32), rows)
    layer.batch_select_indices(torch.tensor([0]))  # [B, H] changes: the old step shape is no longer valid
    with pytest.raises(ValueError, match="changed"):
        layer.update(rows, rows)
    layer.update(rows[:1], rows[:1])


def test_window_numpy_append_equals_the_torch_append():
    generator = torch.Generator().manual_seed(2)
    start = torch.randn(2, 3, 4, 5, generator=generator)
    fast, slow = WindowBuffer(start.clone(), 8), WindowBuffer(start.clone().double(), 8)
    assert fast.array() is not None and slow.array() is None  # float64: the torch path
    for n in (1, 1, 3, 1, 6, 1):
        rows = torch.randn(2, 3, n, 5, generator=generator)
        fast.append(rows)
        slow.append(rows)
        fast.drop_front(1)
        slow.drop_front(1)
        assert torch.equal(fast.view(), slow.view().float())
        assert np.array_equal(fast.array(), fast.view().numpy())
    broadcast = torch.randn(1, 3, 1, 5, generator=generator)  # a shape numpy would broadcast: torch's copy_
    fast.append(broadcast)
    assert torch.equal(fast.view()[..., -1:, :], broadcast.expand(2, 3, 1, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_check_input_finiteness_in_every_dtype(dtype):
    codec = IntCodec(DIM, 4)
    x = torch.randn(3, 5, DIM).to(dtype)
    codec.check_input(x)
    codec.check_input(x.transpose(0, 1))  # non-contiguous
    for value in (float("nan"), float("inf"), float("-inf")):
        bad = x.clone()
        bad[2, 4, DIM - 1] = value
        with pytest.raises(ValueError, match="NaN or Inf"):
            codec.check_input(bad)
    grad = x.to(torch.float32).requires_grad_()
    codec.check_input(grad)  # autograd tensors take torch's check


def _reference_norms(buffer) -> np.ndarray:
    """The live rows' first two bytes read as fp16 and widened by torch (the spec), [B, H, used]."""
    return buffer.view()[..., :2].contiguous().view(torch.float16)[..., 0].float().numpy()


def _assert_same_floats(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bit for bit (-0.0 and subnormals included); NaN halves give NaN (payload not compared)."""
    assert got.shape == want.shape and got.dtype == np.float32
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.int32)[~nan], want.view(np.int32)[~nan])


def test_code_buffer_norms_every_half():
    """norms_array decodes every one of the 65 536 fp16 bit patterns as torch widens it."""
    halves = np.arange(1 << 16, dtype=np.uint16).reshape(2, 4, 1 << 13).view(np.uint8).reshape(2, 4, 1 << 13, 2)
    rows = np.concatenate([halves, np.full((2, 4, 1 << 13, 3), 7, np.uint8)], axis=-1)
    buffer = CodeBuffer.from_rows(torch.from_numpy(rows))
    _assert_same_floats(buffer.norms_array(), _reference_norms(buffer))


def test_code_buffer_norms_follow_appends_growth_drops_and_edits():
    """The cached norms stay equal to the rows' through appends (in place and with growth), dropped
    front rows, truncation followed by new rows, and batch edits; earlier arrays keep their values
    (until a truncation lets new rows overwrite theirs, as for the code rows themselves)."""
    generator = torch.Generator().manual_seed(3)

    def rows(batch, n):
        return torch.randint(0, 256, (batch, 2, n, 5), dtype=torch.uint8, generator=generator)

    buffer = CodeBuffer(3, 2, 5, torch.device("cpu"))
    earlier = []
    for step in range(60):
        batch = buffer.data.shape[0]
        buffer.append(rows(batch, 1 + step % 7))
        if step % 9 == 4:
            buffer.drop_front(5)
        if step % 13 == 6:
            buffer.truncate(buffer.used - 3)
            buffer.append(rows(batch, 2))  # rows written where truncated ones were (in earlier views too)
            earlier.clear()
        if step == 30:
            buffer.remap(lambda t: t[[2, 0]])
        norms = buffer.norms_array()
        _assert_same_floats(norms, _reference_norms(buffer))
        earlier.append((norms, norms.copy()))
    for norms, copy in earlier:
        assert np.array_equal(norms, copy, equal_nan=True)


def test_no_norms_for_a_non_cpu_or_empty_buffer():
    buffer = CodeBuffer(1, 2, 5, torch.device("cpu"))
    assert buffer.norms_array().shape == (1, 2, 0)
    if torch.cuda.is_available():
        assert CodeBuffer(1, 2, 5, torch.device("cuda")).norms_array() is None
