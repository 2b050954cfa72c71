"""Attention on codes: tested against the reference "decode then softmax" path."""
from __future__ import annotations

import contextlib

import pytest
import torch
from _kv_helpers import REAL_PROMPT, real_model, tiny_llama
from transformers import DynamicCache

from fibquant.kv.model import cache_kwarg
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.integer import IntCodec
from fibquant.codecs.turboquant import TurboQuantCodec
from fibquant.kv.attention.switch import attention_on_codes
from fibquant.kv.attention.entry import ATTENTION_NAME, attend_codes, coded_attention_forward, use_coded_attention
from fibquant.kv.cache import CodedKV, CompressedCache, CompressedLayer

DIM = 64


@pytest.fixture(autouse=True)
def fresh_one_time_warnings(monkeypatch):
    from fibquant.kv.attention import notices

    monkeypatch.setattr(notices, "warned", set())


def tiny_llama64(**overrides):
    """A random Llama with head_dim 64 (the shipped codebooks' dim), GQA 4 query / 2 KV heads."""
    settings = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    settings.update(overrides)
    return tiny_llama(**settings)


def reference_attention(query, kv: CodedKV, mask, scaling):
    """Decode every code, repeat KV heads, softmax over the full row: the spec."""
    keys, values = (t.to(torch.float32) for t in kv.materialize())
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    scores = query.to(torch.float32) @ keys.transpose(-1, -2) * scaling
    length, tokens = keys.shape[-2], query.shape[-2]
    if mask is None:
        past = length - tokens
        causal = torch.arange(length)[None, :] > past + torch.arange(tokens)[:, None]
        scores = scores.masked_fill(causal, float("-inf"))
    elif mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return (weights @ values).transpose(1, 2)


def filled_layer(key_codec, value_codec, past, batch=2, heads=2, sinks=4, recent=8, seed=0):
    layer = CompressedLayer(key_codec, value_codec, sinks, recent, attention="codes")
    generator = torch.Generator().manual_seed(seed)
    for chunk in (past - 3, 1, 1, 1):
        layer.update(torch.randn(batch, heads, chunk, DIM, generator=generator),
                     torch.randn(batch, heads, chunk, DIM, generator=generator))
    return layer


CODEC_PAIRS = {
    "fibquant k2/k4": lambda: (FibQuantCodec(DIM, 2, 256), FibQuantCodec(DIM, 4, 256)),
    "fibquant 12-bit indices": lambda: (FibQuantCodec(DIM, 4, 4096), FibQuantCodec(DIM, 4, 1024)),
    "turboquant": lambda: (TurboQuantCodec(DIM, 4), TurboQuantCodec(DIM, 2)),
    "int fallback": lambda: (IntCodec(DIM, 4), FibQuantCodec(DIM, 8, 256)),
}


@pytest.mark.parametrize("pair", sorted(CODEC_PAIRS))
@pytest.mark.parametrize("tokens", [1, 5, 37])  # 37 >= SPLIT_MIN_TOKENS: exact part through SDPA, merged by LSE
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_attend_codes_matches_decode_reference(pair, tokens, mask_kind):
    key_codec, value_codec = CODEC_PAIRS[pair]()
    layer = filled_layer(key_codec, value_codec, past=60)
    generator = torch.Generator().manual_seed(7)
    new_keys, new_values = (torch.randn(2, 2, tokens, DIM, generator=generator) for _ in range(2))
    kv, _ = layer.update(new_keys, new_values)
    assert isinstance(kv, CodedKV) and kv.num_coded == 60 - 4 - 8 and kv.length == 60 + tokens
    query = torch.randn(2, 4, tokens, DIM, generator=generator)
    length = kv.length
    mask = None
    if mask_kind != "none":
        allowed = torch.arange(length)[None, :] <= (length - tokens) + torch.arange(tokens)[:, None]
        allowed = allowed.expand(2, 1, tokens, length).clone()
        allowed[1, :, :, :3] = False  # left padding of the second row
        allowed[1, :, :, 20:23] = False  # and a masked span inside the coded part
        mask = allowed if mask_kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    with pytest.warns(RuntimeWarning, match="no reader of its own") if pair == "int fallback" else _no_warning():
        got = attend_codes(query, kv, mask, DIM ** -0.5)
    want = reference_attention(query, kv, mask, DIM ** -0.5)
    assert got.shape == (2, tokens, 4, DIM)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_fully_masked_row_gives_zeros_not_nan():
    layer = filled_layer(FibQuantCodec(DIM, 2, 256), FibQuantCodec(DIM, 2, 256), past=30)
    kv, _ = layer.update(torch.randn(2, 2, 1, DIM), torch.randn(2, 2, 1, DIM))
    mask = torch.ones(2, 1, 1, kv.length, dtype=torch.bool)
    mask[0] = False
    out = attend_codes(torch.randn(2, 4, 1, DIM), kv, mask, 0.125)
    assert torch.isfinite(out).all() and torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("past", [0, 3, 40], ids=["first-chunk", "exact-only", "coded"])
def test_prefill_split_path_equals_the_joint_softmax(monkeypatch, past):
    """A prefill chunk's SDPA + code-kernel parts merged by log-sum-exp = one softmax over the row,
    sinks and fully masked rows included."""
    import fibquant.kv.attention.entry as attention

    generator = torch.Generator().manual_seed(11)
    layer = CompressedLayer(FibQuantCodec(DIM, 2, 256), TurboQuantCodec(DIM, 3), 4, 8, attention="codes", encode_batch=4)
    if past:
        layer.update(torch.randn(2, 2, past, DIM, generator=generator), torch.randn(2, 2, past, DIM, generator=generator))
    kv, _ = layer.update(torch.randn(2, 2, 20, DIM, generator=generator), torch.randn(2, 2, 20, DIM, generator=generator))
    query = torch.randn(2, 4, 20, DIM, generator=generator)
    allowed = torch.arange(kv.length)[None, :] <= (kv.length - 20) + torch.arange(20)[:, None]
    allowed = allowed.expand(2, 1, 20, kv.length).clone()
    allowed[1, :, 2, :] = False  # a fully masked row
    sinks = torch.randn(4, generator=generator)
    for mask in (None, allowed):
        for sink in (None, sinks):
            split = attend_codes(query, kv, mask, 0.125, sinks=sink)
            with monkeypatch.context() as patch:
                patch.setattr(attention, "SPLIT_MIN_TOKENS", 10 ** 9)
                joint = attend_codes(query, kv, mask, 0.125, sinks=sink)
            assert torch.isfinite(split).all()
            torch.testing.assert_close(split, joint, rtol=1e-4, atol=1e-5)
    assert torch.equal(attend_codes(query, kv, allowed, 0.125)[1, 2], torch.zeros(4, DIM))


def test_long_chunk_is_processed_in_query_blocks(monkeypatch):
    import fibquant.kv.attention.entry as attention

    layer = filled_layer(FibQuantCodec(DIM, 4, 256), TurboQuantCodec(DIM, 3), past=40)
    kv, _ = layer.update(torch.randn(2, 2, 37, DIM), torch.randn(2, 2, 37, DIM))
    query = torch.randn(2, 4, 37, DIM)
    whole = attend_codes(query, kv, None, 0.125)
    monkeypatch.setattr(attention, "QUERY_ROWS_PER_BLOCK", 6)  # 3 tokens x 2 query heads per block
    torch.testing.assert_close(attend_codes(query, kv, None, 0.125), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(whole, reference_attention(query, kv, None, 0.125), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("codecs", ["fibquant", "turboquant"])
def test_model_logits_codes_equal_decode_path(codecs):
    """Chunked prefill + token-by-token decoding, batch 2, GQA: both paths give the same logits."""
    make = {"fibquant": lambda: (FibQuantCodec(DIM, 2, 256), FibQuantCodec(DIM, 4, 256)),
            "turboquant": lambda: (TurboQuantCodec(DIM, 4), TurboQuantCodec(DIM, 2))}[codecs]
    ids = torch.randint(0, 97, (2, 70), generator=torch.Generator().manual_seed(5))
    logits = {}
    for mode in ("decode", "codes"):
        model = tiny_llama64()
        cache = CompressedCache.for_model(model, *make(), sink_tokens=4, recent_tokens=8, attention=mode)
        assert cache.attention == mode
        with torch.no_grad(), attention_on_codes(model) if mode == "codes" else contextlib.nullcontext():
            assert (model.config._attn_implementation == ATTENTION_NAME) == (mode == "codes")
            parts = [model(ids[:, :30], **cache_kwarg(model, cache), use_cache=True).logits,
                     model(ids[:, 30:50], **cache_kwarg(model, cache), use_cache=True).logits]
            parts += [model(ids[:, t:t + 1], **cache_kwarg(model, cache), use_cache=True).logits for t in range(50, 70)]
        logits[mode] = torch.cat(parts, dim=1)
        layer = cache.layers[0]  # 4 sinks, 8..8+15 recent (encode_batch 16), the rest coded
        assert layer.num_coded == 70 - 4 - layer.num_recent and 8 <= layer.num_recent < 8 + 16
    torch.testing.assert_close(logits["codes"], logits["decode"], rtol=1e-4, atol=1e-4)


def test_generate_with_left_padding_same_tokens_on_both_paths():
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    ids[1, :6], mask[1, :6] = 0, 0  # left padding
    outputs = {}
    for mode in ("decode", "codes"):
        model = tiny_llama64()
        cache = CompressedCache.for_model(model, FibQuantCodec(DIM, 2, 256), FibQuantCodec(DIM, 2, 256),
                                          sink_tokens=2, recent_tokens=4, attention=mode)
        with attention_on_codes(model) if mode == "codes" else contextlib.nullcontext():
            outputs[mode] = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                           **cache_kwarg(model, cache), pad_token_id=0, output_scores=True,
                                           return_dict_in_generate=True)
    assert torch.equal(outputs["codes"].sequences, outputs["decode"].sequences)
    for got, want in zip(outputs["codes"].scores, outputs["decode"].scores):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fibquant_attention_serves_other_caches_as_sdpa():
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(9))
    model = tiny_llama64()
    with torch.no_grad():
        reference = model(ids, **cache_kwarg(model, DynamicCache()), use_cache=True).logits
        use_coded_attention(model)
        got = model(ids, **cache_kwarg(model, DynamicCache()), use_cache=True).logits
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


def test_codes_cache_with_another_attention_fails_clearly():
    model = tiny_llama64()  # sdpa
    cache = CompressedCache(FibQuantCodec(DIM, 2, 256), FibQuantCodec(DIM, 2, 256), attention="codes")
    with pytest.raises(AttributeError, match="attention implementation is 'fibquant'"):
        model(torch.randint(0, 97, (1, 10)), **cache_kwarg(model, cache), use_cache=True)


def test_unsupported_options_fall_back_to_decoding_with_a_warning():
    layer = filled_layer(FibQuantCodec(DIM, 2, 256), FibQuantCodec(DIM, 2, 256), past=30)
    kv, _ = layer.update(torch.randn(2, 2, 1, DIM), torch.randn(2, 2, 1, DIM))
    query = torch.randn(2, 4, 1, DIM)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training, module.is_causal = 2, False, True
    with pytest.warns(RuntimeWarning, match="does not implement"):
        got, _ = coded_attention_forward(module, query, kv, kv, None, scaling=0.125,
                                         position_bias=torch.zeros(1, 1, 1, kv.length))
    want, _ = coded_attention_forward(module, query, kv, kv, None, scaling=0.125)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # a zero bias changes nothing


def test_bad_attention_option_and_unsupported_model(monkeypatch):
    with pytest.raises(ValueError, match="attention must be one of"):
        CompressedCache(FibQuantCodec(DIM, 2, 256), FibQuantCodec(DIM, 2, 256), attention="fast")
    with pytest.raises(ValueError, match="not a transformers PreTrainedModel"):
        use_coded_attention(torch.nn.Linear(2, 2))
    model = tiny_llama64()
    monkeypatch.setattr(type(model), "_can_set_attn_implementation", classmethod(lambda cls: False))
    with pytest.warns(RuntimeWarning, match="does not dispatch attention through"):
        cache = CompressedCache.for_model(model, FibQuantCodec(DIM, 2, 256), FibQuantCodec(DIM, 2, 256))
    assert cache.attention == "decode"


def test_from_cache_equals_one_update_and_keeps_source():
    ids = torch.randint(0, 97, (2, 50), generator=torch.Generator().manual_seed(10))
    model = tiny_llama64()
    dynamic = DynamicCache()
    with torch.no_grad():
        model(ids, **cache_kwarg(model, dynamic), use_cache=True)
    keys_before = dynamic.layers[0].keys.clone()
    codecs = (FibQuantCodec(DIM, 2, 256), TurboQuantCodec(DIM, 2))
    converted = CompressedCache.from_cache(dynamic, *codecs, sink_tokens=4, recent_tokens=8)
    direct = CompressedCache(*codecs, sink_tokens=4, recent_tokens=8)
    for index, layer in enumerate(dynamic.layers):
        direct.update(layer.keys, layer.values, index)
    assert torch.equal(dynamic.layers[0].keys, keys_before)
    assert converted.get_seq_length() == 50 and len(converted.layers) == 2
    for got, want in zip(converted.layers, direct.layers):
        assert torch.equal(got.key_codes, want.key_codes) and torch.equal(got.value_codes, want.value_codes)
        assert torch.equal(got.recent_keys, want.recent_keys) and torch.equal(got.sink_values, want.sink_values)
    assert converted.used_nbytes() == direct.used_nbytes()


def test_code_buffer_grows_geometrically_not_per_token():
    layer = CompressedLayer(TurboQuantCodec(DIM, 2), TurboQuantCodec(DIM, 2), 0, 0, attention="codes")
    capacities = []
    for _ in range(1000):
        layer.update(torch.randn(1, 2, 1, DIM), torch.randn(1, 2, 1, DIM))
        if not capacities or capacities[-1] != layer.key_buffer.capacity:
            capacities.append(layer.key_buffer.capacity)
    # Capacities grow by max(capacity / 16, 64) rows: a copy per growth step, not per token.
    assert layer.num_coded == 1000 and layer.key_buffer.capacity == 1024
    assert capacities == list(range(64, 1025, 64))
    row = TurboQuantCodec(DIM, 2).code_size
    assert layer.used_nbytes() == 2 * 2 * 1000 * row
    assert layer.nbytes() == 2 * 2 * 1024 * row


@pytest.mark.model
def test_real_model_codes_path_equals_decode_path(request):
    model, tokenizer = real_model(request)
    inputs = tokenizer(REAL_PROMPT, return_tensors="pt")
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id,
                  output_scores=True, return_dict_in_generate=True)
    results = {}
    previous = model.config._attn_implementation
    try:
        for mode in ("decode", "codes"):
            cache = CompressedCache.for_model(model, FibQuantCodec.for_rate(64, 2), FibQuantCodec.for_rate(64, 2),
                                              sink_tokens=4, recent_tokens=8, attention=mode)
            with attention_on_codes(model) if mode == "codes" else contextlib.nullcontext():
                results[mode] = model.generate(**inputs, **cache_kwarg(model, cache), **kwargs)
            assert cache.layers[0].num_coded > 0
    finally:
        model.set_attn_implementation(previous)
    assert torch.equal(results["codes"].sequences, results["decode"].sequences)
    for got, want in zip(results["codes"].scores, results["decode"].scores):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_centring_codes_path_equals_decode_path_and_beats_uncentred():
    """Centred caches: the attention on codes adds q.mu and (sum p) mu exactly as decoding does,
    and keys with a large common offset (as real keys have) are reconstructed far better."""
    generator = torch.Generator().manual_seed(11)
    offset = 4.0 * torch.randn(1, 2, 1, DIM, generator=generator)  # a shared per-head mean
    keys = torch.randn(1, 2, 80, DIM, generator=generator) + offset
    values = torch.randn(1, 2, 80, DIM, generator=generator) + offset
    errors, used = {}, {}
    for centre in (False, True):
        layer = CompressedLayer(FibQuantCodec(DIM, 4, 256), FibQuantCodec(DIM, 4, 256), 4, 8,
                                attention="codes", centre=centre)
        layer.update(keys[..., :79, :], values[..., :79, :])
        assert (layer.key_mean is not None) == centre
        kv, _ = layer.update(keys[..., 79:, :], values[..., 79:, :])
        query = torch.randn(1, 4, 1, DIM, generator=generator)
        got = attend_codes(query, kv, None, DIM ** -0.5)
        torch.testing.assert_close(got, reference_attention(query, kv, None, DIM ** -0.5), rtol=1e-4, atol=1e-5)
        decoded = layer.keys[..., 4:4 + layer.num_coded, :]
        original = keys[..., 4:4 + layer.num_coded, :]
        errors[centre] = float(((decoded - original) ** 2).sum() / (original ** 2).sum())
        used[centre] = layer.used_nbytes()
    assert layer.key_mean.shape == (1, 2, DIM)
    assert used[True] - used[False] == 2 * 1 * 2 * DIM * 4  # K and V means [B, H, D] float32: side information
    assert errors[True] < 0.5 * errors[False], errors


def test_centring_batch_edits_and_reset():
    layer = CompressedLayer(TurboQuantCodec(DIM, 3), TurboQuantCodec(DIM, 3), 2, 4, attention="codes", centre=True)
    layer.update(torch.randn(3, 2, 20, DIM) + 2.0, torch.randn(3, 2, 20, DIM))
    means = layer.key_mean.clone()
    full = layer.keys
    layer.batch_select_indices(torch.tensor([2, 0]))
    torch.testing.assert_close(layer.key_mean, means[[2, 0]])
    torch.testing.assert_close(layer.keys, full[[2, 0]])
    layer.reset()
    assert layer.key_mean is None and layer.get_seq_length() == 0
    with pytest.raises(ValueError, match="layer_plan must be a fibquant.kv.plan.LayerPlan"):
        CompressedCache(TurboQuantCodec(DIM, 3), TurboQuantCodec(DIM, 3), layer_plan="centre")
    with pytest.raises(TypeError):  # centring is a plan, not a constructor switch
        CompressedCache(TurboQuantCodec(DIM, 3), TurboQuantCodec(DIM, 3), centre=True)
