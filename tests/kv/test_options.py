"""`AttentionOptions`: the one object that picks attention's paths (no module switches)."""
from __future__ import annotations

import pytest
import torch

from fibquant.kv.options import DEFAULT_OPTIONS, AttentionOptions


def test_defaults_are_the_tuned_paths():
    assert DEFAULT_OPTIONS == AttentionOptions()
    assert (DEFAULT_OPTIONS.numba_decode, DEFAULT_OPTIONS.gather_decode, DEFAULT_OPTIONS.defer_codes) == (True, True, True)
    assert DEFAULT_OPTIONS.fused_backend == DEFAULT_OPTIONS.paged_coded_backend == "auto"
    assert DEFAULT_OPTIONS.gathers == (True, True)
    assert AttentionOptions(gather_decode="values").gathers == (False, True)


def test_parse_over_the_defaults():
    assert AttentionOptions.parse("") == DEFAULT_OPTIONS
    parsed = AttentionOptions.parse(" defer_codes=off, gather_decode=values ,fused_backend=Triton,numba_decode=0")
    assert parsed == AttentionOptions(defer_codes=False, gather_decode="values", fused_backend="triton",
                                      numba_decode=False)


@pytest.mark.parametrize("text, match", [("defer_codes", "NAME=VALUE"), ("no_such=1", "NAME=VALUE"),
                                         ("lean_decode=maybe", "lean_decode must be True or False"),
                                         ("gather_decode=queries", "gather_decode must be"),
                                         ("fused_backend=cuda", "fused_backend must be one of")])
def test_bad_options_raise(text, match):
    with pytest.raises(ValueError, match=match):
        AttentionOptions.parse(text)


def test_bad_values_raise_and_options_are_frozen():
    with pytest.raises(ValueError, match="numba_decode"):
        AttentionOptions(numba_decode=1)
    with pytest.raises(ValueError, match="gather_decode"):
        AttentionOptions(gather_decode=1)
    with pytest.raises(Exception):
        DEFAULT_OPTIONS.numba_decode = False


def test_cache_hands_its_options_to_every_layer_and_codedkv():
    from fibquant.codecs.fibquant import FibQuantCodec
    from fibquant.kv.cache import CompressedCache

    codec = FibQuantCodec(16, 2, 16)
    options = AttentionOptions(numba_decode=False)
    cache = CompressedCache(codec, codec, 1, 2, attention="codes", encode_batch=1, options=options,
                            layer_windows=[None, 4])
    assert cache.options is options and all(layer.options is options for layer in cache.layers)
    kv, _ = cache.update(torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 16), 0)
    assert kv.options is options
    cache.options = DEFAULT_OPTIONS
    assert all(layer.options is DEFAULT_OPTIONS for layer in cache.layers)
    with pytest.raises(ValueError, match="AttentionOptions"):
        CompressedCache(codec, codec, options={"numba_decode": False})
