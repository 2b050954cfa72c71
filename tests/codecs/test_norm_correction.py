"""Norm correction's fast path (codecs/norm_correction.py, numba) gives the spec's bytes
(`corrected_norms_reference`, torch float64) or declines, and `encode_parts` gives `encode`'s codes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fibquant.codebook.numba_search import numba_available
from fibquant.codecs import norm_correction
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.registry import parse_codec_spec
from fibquant.canonical import sample_sphere

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba is not installed")


def rows(dim: int, seed: int) -> torch.Tensor:
    """Gaussian rows at several scales, sphere points, zero rows, tiny and axis rows, heavy-tailed rows."""
    gen = torch.Generator().manual_seed(seed)
    eye = torch.eye(dim)[:4]
    return torch.cat([torch.randn(2000, dim, generator=gen) * 3 + 1, torch.randn(500, dim, generator=gen) * 1e-3,
                      sample_sphere(300, dim, seed=seed), torch.zeros(3, dim), eye * 1e-30, eye * 100, -eye,
                      torch.randn(300, dim, generator=gen) ** 3])


def encoded(codec: FibQuantCodec, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x as float32 numpy, the numba encode's indices, the codewords' squared norms in float64)."""
    codec.encode(x[:1])
    _, index = codec._encode_numba(x, *codec._cpu_tables())
    sq = codec.device_state.get("sq_norms64", torch.device("cpu"), lambda d: codec._table(d)[1].to(torch.float64))
    return x.numpy(), index, sq.numpy()


CODECS = [(64, 4), (64, 2), (64, 3), (128, 4), (128, 2)]


@pytest.mark.parametrize("dim,bits", CODECS)
def test_fast_bytes_equal_the_spec(dim, bits):
    codec = FibQuantCodec.for_rate(dim, bits, norm_correction=True)
    x, index, sq = encoded(codec, rows(dim, dim + bits))
    fast = norm_correction.corrected_norm_bytes(x, index, sq)
    assert fast is not None  # no row of these lies within 1e-12 of an fp16 rounding boundary
    spec = norm_correction.reference_norm_bytes(torch.from_numpy(x), torch.from_numpy(index), torch.from_numpy(sq))
    assert np.array_equal(fast, spec.numpy())
    assert (fast[:, 1] != 0).sum() > len(x) // 2  # not all zeros


@pytest.mark.parametrize("dim,bits", CODECS)
def test_encode_with_the_fast_path_equals_encode_with_the_spec(dim, bits, monkeypatch):
    codec = FibQuantCodec.for_rate(dim, bits, norm_correction=True)
    x = rows(dim, 7 * bits)
    codes = codec.encode(x)
    monkeypatch.setattr(codec, "fast_norm_correction", False)
    assert torch.equal(codes, codec.encode(x))
    plain = FibQuantCodec.for_rate(dim, bits).encode(x)  # only the norm bytes differ from the plain codes
    assert torch.equal(codes[:, 2:], plain[:, 2:]) and not torch.equal(codes[:, :2], plain[:, :2])


def test_undecided_rows_make_the_call_take_the_spec(monkeypatch):
    codec = FibQuantCodec.for_rate(64, 4, norm_correction=True)
    x = rows(64, 3)
    codes = codec.encode(x)
    arrays = encoded(codec, x)
    # an interval wide enough to straddle a rounding boundary for most rows: the fast path declines
    monkeypatch.setattr(norm_correction, "REL", 1e-3)
    assert norm_correction.corrected_norm_bytes(*arrays) is None
    assert torch.equal(codec.encode(x), codes)
    monkeypatch.setattr(norm_correction, "REL", 1e-12)
    assert norm_correction.corrected_norm_bytes(*arrays) is not None


def test_clamp_and_range_end_make_the_fast_path_decline():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).numpy()
    index = np.zeros((8, 32), dtype=np.int64)
    assert norm_correction.corrected_norm_bytes(x, index, np.zeros(4)) is None          # ||u_hat|| = 0: the clamp
    assert norm_correction.corrected_norm_bytes(x, index, np.full(4, 1e-62)) is None    # within 2x of it
    assert norm_correction.corrected_norm_bytes(x * 1e4, index, np.full(4, 1e-3)) is None  # > 65504
    near = norm_correction.corrected_norm_bytes(x, index, np.full(4, 1e-3))
    assert near is not None and np.array_equal(
        near, norm_correction.reference_norm_bytes(torch.from_numpy(x), torch.from_numpy(index),
                                                   torch.full((4,), 1e-3, dtype=torch.float64)).numpy())
    long_rows = np.ones((2, norm_correction.MAX_TERMS + 1), dtype=np.float32)
    assert norm_correction.corrected_norm_bytes(long_rows, np.zeros((2, 1), dtype=np.int64), np.ones(1)) is None


@pytest.mark.parametrize("spec", ["fibquant:b=4", "fibquant:b=2", "fibquant:b=3", "turboquant:b=2", "int:b=4"])
def test_encode_parts_equals_encode_of_the_rows_concatenated(spec):
    codec = parse_codec_spec(spec).build(64)
    gen = torch.Generator().manual_seed(1)
    window = torch.randn(1, 3, 40, 64, generator=gen)
    keys, values = window[..., 5:21, :], torch.randn(1, 3, 40, 64, generator=gen)[..., :16, :]  # strided views
    parts = codec.encode_parts([keys, values])
    both = codec.encode(torch.stack([keys, values]))
    assert [p.shape for p in parts] == [(1, 3, 16, codec.code_size)] * 2
    assert torch.equal(parts[0], both[0]) and torch.equal(parts[1], both[1])
    one, = codec.encode_parts([keys])
    assert torch.equal(one, codec.encode(keys))
    empty = codec.encode_parts([keys[..., :0, :], values])
    assert empty[0].shape == (1, 3, 0, codec.code_size) and torch.equal(empty[1], codec.encode(values))
    assert codec.encode_parts([]) == []
    halves = codec.encode_parts([keys.to(torch.float64), values])  # not float32: the generic path, same codes
    assert torch.equal(halves[0], both[0]) and torch.equal(halves[1], both[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", ["fibquant:b=4", "fibquant:b=2", "fibquant:b=3"])
def test_half_precision_parts_give_the_codes_of_encode(spec, dtype):
    """bf16 / fp16 parts (vLLM's K and V: [N, Hk, D] views with row strides) widen straight into the float32
    working block: the codes of `encode` of the parts concatenated, as the vLLM backend used to call it,
    and of the float32 parts; a non-finite half-precision value is rejected as `encode` rejects it."""
    codec = parse_codec_spec(spec).build(64)
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(37, 3 * 3 * 64, generator=gen).to(dtype)  # one fused row per token, as a projection gives
    keys, values = qkv[:, 192:384].view(37, 3, 64), qkv[:, 384:].view(37, 3, 64)
    parts = codec.encode_parts([keys, values])
    both = codec.encode(torch.cat([keys, values]))
    assert torch.equal(parts[0], both[:37]) and torch.equal(parts[1], both[37:])
    widened = codec.encode_parts([keys.float(), values.float()])
    assert torch.equal(parts[0], widened[0]) and torch.equal(parts[1], widened[1])
    mixed = codec.encode_parts([keys, values.float()])
    assert torch.equal(mixed[0], both[:37]) and torch.equal(mixed[1], both[37:])
    bad = values.clone()
    bad[3, 1, 5] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.encode_parts([keys, bad])


def test_encode_parts_rejects_what_encode_rejects():
    codec = parse_codec_spec("fibquant:b=4").build(64)
    good = torch.randn(2, 64)
    bad = good.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.encode_parts([good, bad])
    bad[1, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.encode_parts([bad, good])
    with pytest.raises(ValueError, match="fp16 range"):
        codec.encode_parts([good, good * 1e5])
    with pytest.raises(ValueError, match="last dimension"):
        codec.encode_parts([good, torch.randn(2, 32)])


@pytest.mark.parametrize("spec", ["fibquant:b=4", "fibquant:b=2"])
def test_encode_parts_reuses_its_working_arrays_and_keeps_the_codes(spec):
    """Calls of many sizes (below, at and above ENCODE_SCRATCH_ROWS) through the reused arrays give
    `encode`'s codes, and the codes of one call are not overwritten by the next."""
    import fibquant.codecs.fibquant as fibquant_module

    codec = parse_codec_spec(spec).build(64)
    gen = torch.Generator().manual_seed(5)
    kept = []
    for rows in (1, 17, 300, 4097, fibquant_module.ENCODE_SCRATCH_ROWS + 5, 33):
        keys, values = torch.randn(2, rows, 64, generator=gen) * 2
        parts = codec.encode_parts([keys, values[: max(1, rows // 2)]])
        expected = codec.encode(torch.cat([keys, values[: max(1, rows // 2)]]))
        assert torch.equal(torch.cat(parts), expected)
        kept.append((parts, expected))
    assert all(torch.equal(torch.cat(parts), expected) for parts, expected in kept)
    assert (64, codec.config.n_blocks) in fibquant_module._SCRATCH.sets
