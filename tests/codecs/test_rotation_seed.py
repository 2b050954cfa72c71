"""`rotation_seed` (spec key r=) of the rotation-based codecs: another Haar draw, nothing else changed."""
from __future__ import annotations

import pytest
import torch

from fibquant.codecs.base import config_matches
from fibquant.codecs.registry import load_codec, parse_codec_spec
from fibquant.canonical import haar_rotation

FAMILIES = ("fibquant:b=2", "turboquant:b=2", "fibrvq:b=2", "e8shell:b=2,nc=1")


@pytest.mark.parametrize("spec", FAMILIES)
def test_rotation_seed_changes_only_the_rotation(spec, tmp_path):
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    plain, zero, other = (parse_codec_spec(s).build(64) for s in (spec, spec + ",r=0", spec + ",r=3"))
    assert torch.equal(plain.encode(x), zero.encode(x))  # r = seed: the rotation every codec always had
    assert not torch.equal(plain.encode(x), other.encode(x))
    assert other.code_size == plain.code_size and other.bits_per_coordinate == plain.bits_per_coordinate
    # the same codebook: rotating the input by Pi_3^T Pi_0 turns one codec into the other exactly
    pi0, pi3 = haar_rotation(64, 0, dtype=torch.float64), haar_rotation(64, 3, dtype=torch.float64)
    moved = (x.double() @ pi3.T @ pi0).float()  # Pi_0 moved = Pi_3 x
    mse_plain = ((plain.decode(plain.encode(moved)) - moved) ** 2).sum()
    mse_other = ((other.decode(other.encode(x)) - x) ** 2).sum()
    assert float(mse_other) == pytest.approx(float(mse_plain), rel=1e-3)
    assert parse_codec_spec(spec + ",r=3").spec == spec + ",r=3" and "r=3" in parse_codec_spec(spec + ",r=3").label(64)
    # saved and loaded with the field; a config saved before the field existed reads as None
    path = tmp_path / "codec.safetensors"
    other.save(path)
    assert torch.equal(load_codec(path).encode(x), other.encode(x))
    old = {k: v for k, v in vars(plain.config).items() if k != "rotation_seed"}
    assert config_matches(plain.config, old) and not config_matches(other.config, old)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_rotation_seed_rejects_bad_values(bad):
    from fibquant.codecs.e8shell import E8ShellCodec
    from fibquant.codecs.fibquant import FibQuantCodec
    from fibquant.codecs.fibrvq import FibRVQCodec
    from fibquant.codecs.turboquant import TurboQuantCodec

    for build in (lambda: FibQuantCodec(64, 4, 256, rotation_seed=bad), lambda: TurboQuantCodec(64, 2, rotation_seed=bad),
                  lambda: FibRVQCodec(64, rotation_seed=bad), lambda: E8ShellCodec(64, 2, rotation_seed=bad)):
        with pytest.raises(ValueError, match="rotation_seed"):
            build()
    if not isinstance(bad, str):
        with pytest.raises(ValueError):
            parse_codec_spec(f"fibquant:b=2,r={bad}")
