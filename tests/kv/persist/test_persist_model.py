"""Saved caches on the real model (SmolLM2-135M): resumed generation identical, CLI round trip."""
from __future__ import annotations

import pytest
import torch

from _kv_helpers import REAL_PROMPT, real_model
from fibquant.kv.attention.switch import attention_on_codes
from fibquant.kv.model import cache_kwarg
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.kv.cache import CompressedCache
from fibquant.kv.persist.store import PersistentCache
from fibquant.kv.persist.generate import generate_persistent, resume_generate

pytestmark = pytest.mark.model


@pytest.fixture
def model_tok(request):
    torch.set_num_threads(1)
    return real_model(request)


def test_real_model_resume_is_identical(model_tok, tmp_path):
    model, tokenizer = model_tok
    codec = FibQuantCodec.for_rate(64, 2.0)
    ids = tokenizer(REAL_PROMPT, return_tensors="pt").input_ids
    cache = CompressedCache.for_model(model, codec, codec, 4, 32)
    with attention_on_codes(model):
        reference = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwarg(model, cache),
                                   do_sample=False, max_new_tokens=40, output_scores=True, return_dict_in_generate=True)
    first = generate_persistent(model, ids, tmp_path / "c", codec, codec, max_new_tokens=20, checkpoint_every=8)
    assert torch.equal(first[0], reference.sequences[0, : ids.shape[1] + 20])
    with PersistentCache.open(tmp_path / "c", model=model) as store:
        assert store.num_coded > 0 and store.num_tokens == ids.shape[1] + 19
    second = resume_generate(model, tmp_path / "c", max_new_tokens=20, output_scores=True,
                             return_dict_in_generate=True)
    assert torch.equal(second.sequences[0], reference.sequences[0])
    for a, b in zip(second.scores, reference.scores[20:]):
        assert torch.equal(a, b)  # resumed logits identical


def test_cli_cache_save_info_generate(model_tok, tmp_path, capsys):
    from fibquant.cli import main

    out = tmp_path / "cli.fqkv"
    assert main(["cache", "save", str(out), "--prompt", REAL_PROMPT, "--max-new-tokens", "6", "--threads", "1"]) == 0
    assert main(["cache", "info", str(out)]) == 0
    text = capsys.readouterr().out
    assert '"tokens"' in text and "fibquant" in text
    assert main(["cache", "generate", str(out), "--max-new-tokens", "4", "--threads", "1"]) == 0
    with PersistentCache.open(out) as store:
        assert len(store.tokens) == len(tokenizer_ids(model_tok[1])) + 10
    assert main(["cache", "info", str(tmp_path / "missing")]) == 2  # a clear error, no traceback
    assert "no saved KV cache" in capsys.readouterr().err


def tokenizer_ids(tokenizer):
    return tokenizer(REAL_PROMPT).input_ids


def test_real_model_calibrated_per_head_roundtrip(model_tok, tmp_path):
    """Per-(layer, KV head) RVQ keys and low-rank values on SmolLM2: save/load gives the same
    decoded K/V and the same next-token logits, bit for bit."""
    from fibquant.codecs.lowrank import LowRankCodec
    from fibquant.codecs.rvq import RVQCodec
    from fibquant.kv.headwise import HeadwiseCodec, LayerwiseCompressedCache

    model, tokenizer = model_tok
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    g = torch.Generator().manual_seed(0)
    samples = [torch.randn(64, 64, generator=g) for _ in range(heads)]
    key_codecs = [HeadwiseCodec([RVQCodec.fit(s, 2, 16, seed=l, max_iterations=2) for s in samples])
                  for l in range(layers)]
    value_codecs = [HeadwiseCodec([LowRankCodec.fit(s * (l + 1), 8) for s in samples]) for l in range(layers)]
    cache = LayerwiseCompressedCache(key_codecs, value_codecs, 4, 16, encode_batch=4)
    ids = tokenizer(REAL_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        model(input_ids=ids, **cache_kwarg(model, cache), use_cache=True)
    cache.save(tmp_path / "c", model, ids)
    loaded = CompressedCache.load(tmp_path / "c", model, attention="decode")
    assert len(list((tmp_path / "c/codecs").iterdir())) == 2 * layers * heads
    for a, b in zip(cache.layers, loaded.layers, strict=True):
        assert a.num_coded > 0 and torch.equal(a.key_codes, b.key_codes)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    nxt = tokenizer(" and then", return_tensors="pt").input_ids
    with torch.no_grad():
        live = model(input_ids=nxt, **cache_kwarg(model, cache), use_cache=True).logits
        resumed = model(input_ids=nxt, **cache_kwarg(model, loaded), use_cache=True).logits
    assert torch.equal(live, resumed)
