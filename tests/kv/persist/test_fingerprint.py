"""The codec-state fingerprint of saved caches (kv/persist/fingerprint.py): tolerant to last-bit
differences of the floats, not to another state."""
from __future__ import annotations

import math

import pytest
import torch

from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.integer import IntCodec
from fibquant.codecs.turboquant import TurboQuantCodec
from fibquant.kv.persist.fingerprint import (PROJECTIONS, TOLERANCE, _signs, fingerprint_mismatch, state_fingerprint,
                                             tensor_fingerprint)


def test_signs_are_fixed_and_balanced():
    s = _signs(4096, 3)
    assert set(s.tolist()) == {-1.0, 1.0} and abs(s.mean()) < 0.05
    assert (s == _signs(4096, 3)).all() and (s != _signs(4096, 4)).any()
    # Pinned: a saved fingerprint must mean the same in every later version.
    assert _signs(8, 0).tolist() == _signs(16, 0)[:8].tolist()
    assert tensor_fingerprint(torch.arange(4, dtype=torch.float32))["proj"] == pytest.approx(
        [sum(v * x for v, x in zip(_signs(4, j).tolist(), range(4))) / 2 for j in range(PROJECTIONS)])


@pytest.mark.parametrize("codec", [FibQuantCodec(64, 2, 256), TurboQuantCodec(64, 3)], ids=["fibquant", "turboquant"])
def test_ulp_noise_matches_and_other_state_does_not(codec):
    here = state_fingerprint(codec)
    assert fingerprint_mismatch(here, here) is None
    book = codec.reader(torch.device("cpu"))
    for name, tensor in (("rotation", book.forward), ("codewords", book.codewords)):
        for direction in (math.inf, -math.inf):  # every entry one float32 ulp off
            noisy = {**here, "tensors": {**here["tensors"],
                                         name: tensor_fingerprint(torch.nextafter(tensor, torch.tensor(direction)))}}
            assert fingerprint_mismatch(here, noisy) is None
        bumped = tensor.clone().reshape(-1)
        bumped[0] += 20 * TOLERANCE * float(tensor.pow(2).mean().sqrt()) * math.sqrt(tensor.numel())
        moved = {**here, "tensors": {**here["tensors"], name: tensor_fingerprint(bumped)}}
        assert name in fingerprint_mismatch(here, moved)


def test_other_codecs_differ():
    base = state_fingerprint(FibQuantCodec(64, 2, 256))
    assert "rotation differs" in fingerprint_mismatch(base, state_fingerprint(FibQuantCodec(64, 2, 256, rotation_seed=1)))
    assert "code size" in fingerprint_mismatch(base, state_fingerprint(FibQuantCodec(64, 4, 256)))
    turbo = TurboQuantCodec(64, 2)
    here = state_fingerprint(turbo)
    assert "rotation differs" in fingerprint_mismatch(here, state_fingerprint(TurboQuantCodec(64, 2, seed=1)))
    codewords = turbo.reader(torch.device("cpu")).codewords
    assert "codewords differs" in fingerprint_mismatch(here, _with(here, "codewords", codewords * 1.01))
    assert "codewords: " in fingerprint_mismatch(here, _with(here, "codewords", codewords[:-1]))
    assert fingerprint_mismatch(state_fingerprint(IntCodec(64, 4)), state_fingerprint(IntCodec(64, 4))) is None


def _with(fingerprint, name, tensor):
    return {**fingerprint, "tensors": {**fingerprint["tensors"], name: tensor_fingerprint(tensor)}}


def test_integer_state_is_exact_and_nan_is_refused():
    a = {"code_size": 4, "tensors": {"x": tensor_fingerprint(torch.arange(10))}}
    b = {"code_size": 4, "tensors": {"x": tensor_fingerprint(torch.arange(10).flip(0))}}
    assert fingerprint_mismatch(a, a) is None and "other integer values" in fingerprint_mismatch(a, b)
    nan = {"code_size": 4, "tensors": {"x": tensor_fingerprint(torch.full((3,), float("nan")))}}
    assert fingerprint_mismatch(nan, nan) is not None
