"""Sliding-window / hybrid layers, soft-capping, learned sinks and MLA in `CompressedCache`
(tiny random models of the families' own transformers classes; seconds each)."""
from __future__ import annotations

import contextlib

import warnings

import pytest
import torch
from transformers import DynamicCache

from fibquant.kv.model import cache_kwarg
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.kv.attention.entry import attend_codes, coded_attention_forward
from fibquant.kv.cache import CodeBuffer, CodedKV, CompressedCache, CompressedSlidingLayer
from fibquant.kv.attention.switch import attention_on_codes

DIM = 64


@pytest.fixture(autouse=True)
def fresh_one_time_warnings(monkeypatch):
    from fibquant.kv.attention import notices

    monkeypatch.setattr(notices, "warned", set())


def _gemma3(window=64, layers=("sliding_attention", "sliding_attention", "full_attention"), seed=0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=len(layers),
                              num_attention_heads=4, num_key_value_heads=2, head_dim=DIM, sliding_window=window,
                              layer_types=list(layers), query_pre_attn_scalar=48, max_position_embeddings=1024)
    return Gemma3ForCausalLM(config).eval()


def _gemma2(seed=0):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    return Gemma2ForCausalLM(Gemma2Config(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=DIM, sliding_window=16,
                                          attn_logit_softcapping=5.0)).eval()


def _gpt_oss(seed=0):
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=DIM, sliding_window=16,
                                           num_local_experts=4, num_experts_per_tok=2)).eval()
    with torch.no_grad():  # zero-initialised sinks would test nothing
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def _deepseek_v3(seed=0):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(vocab_size=128, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=128,
                              q_lora_rank=None, qk_rope_head_dim=DIM, qk_nope_head_dim=32, v_head_dim=32,
                              n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                              topk_group=1)
    return DeepseekV3ForCausalLM(config).eval()


def _int8(dim=DIM):
    return FibQuantCodec(dim, 1, 256)  # 8 bits per coordinate


def _run(model, cache, ids, chunks, steps, codes: bool = True):
    """Logits [B, sum(chunks) + steps, V]: prefill in `chunks`, then `steps` single tokens (teacher-forced);
    inside `attention_on_codes(model)` unless `codes` is False (the model's own attention)."""
    with attention_on_codes(model) if codes else contextlib.nullcontext():
        out, start = [], 0
        with torch.no_grad():
            for chunk in list(chunks) + [1] * steps:
                out.append(model(input_ids=ids[:, start:start + chunk], **cache_kwarg(model, cache), use_cache=True).logits)
                start += chunk
        return torch.cat(out, dim=1)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _ids(n, batch=1, seed=1):
    return torch.randint(0, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- storage
def test_code_buffer_drops_from_the_front_within_max_rows():
    buffer = CodeBuffer(1, 2, 3, torch.device("cpu"), max_rows=5)
    rows = torch.arange(2 * 9 * 3, dtype=torch.uint8).reshape(1, 2, 9, 3)
    buffer.append(rows[..., :4, :])
    buffer.drop_front(3)
    buffer.append(rows[..., 4:8, :])  # 1 + 4 live rows: the gap is closed, capacity stays <= 5
    assert buffer.used == 5 and buffer.capacity <= 5
    assert torch.equal(buffer.view(), rows[..., 3:8, :])
    with pytest.raises(ValueError, match="exceed max_rows=5"):
        buffer.append(rows[..., 8:9, :])
    buffer.truncate(2)
    assert torch.equal(buffer.view(), rows[..., 3:5, :])


def test_gemma3_sliding_layers_hold_at_most_the_window_and_match_dynamic_cache():
    """The issue's target: window 64, prompt 300, 32 decode steps."""
    window, model = 64, _gemma3(64)
    ids = _ids(332)
    codes = CompressedCache.for_model(model, _int8(), _int8(), sink_tokens=4, recent_tokens=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback on this path
        on_codes = _run(model, codes, ids, [300], 32)
    decoded = _run(model, CompressedCache.for_model(model, _int8(), _int8(), 4, 32, attention="decode"), ids, [300], 32)
    dynamic = _run(model, DynamicCache(config=model.config), ids, [300], 32)
    assert _rel(on_codes, decoded) <= 1e-4
    assert _rel(on_codes, dynamic) <= 1e-2
    sliding, full = codes.layers[0], codes.layers[2]
    assert isinstance(sliding, CompressedSlidingLayer) and not isinstance(full, CompressedSlidingLayer)
    assert codes.is_sliding == [True, True, False]
    assert sliding.get_seq_length() == full.get_seq_length() == 332
    code_size = _int8().code_size
    for layer in codes.layers[:2]:
        assert layer.num_coded + layer.num_recent == window - 1 and layer.num_coded > 0
        held = layer.num_coded * code_size * 2 + layer.num_recent * DIM * 4 * 2  # K + V, float32 window
        assert layer.used_nbytes() == 2 * held  # 2 KV heads, batch 1
        assert layer.key_buffer.capacity <= window - 1 and layer.value_buffer.capacity <= window - 1
    assert full.num_coded + full.num_recent + full.num_sink == 332
    reference = DynamicCache(config=model.config)
    _run(model, reference, ids, [300], 32)
    # the mask sizes transformers reads agree with its own cache's
    assert [codes.get_mask_sizes(5, i) for i in range(3)] == [reference.get_mask_sizes(5, i) for i in range(3)]


@pytest.mark.parametrize("chunks", [[100], [7, 30, 50, 13]], ids=["one-shot", "chunked"])
def test_exact_window_equals_dynamic_cache_at_every_step(chunks):
    """With every kept token exact, masks and positions alone decide: logits equal DynamicCache's."""
    model = _gemma3(16, ("sliding_attention", "full_attention"))
    ids = _ids(sum(chunks) + 12)
    exact = CompressedCache.for_model(model, _int8(), _int8(), sink_tokens=4, recent_tokens=1000, sliding_exact=True)
    got = _run(model, exact, ids, chunks, 12)
    want = _run(model, DynamicCache(config=model.config), ids, chunks, 12)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert exact.layers[0].num_recent == 15 and exact.layers[0].num_coded == 0


def test_generate_with_left_padding_matches_dynamic_cache():
    model = _gemma3(16, ("sliding_attention", "full_attention"))
    model.generation_config.eos_token_id = None
    ids = _ids(40, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding of the second row
    settings = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, output_scores=True,
                    return_dict_in_generate=True)
    exact = CompressedCache.for_model(model, _int8(), _int8(), sink_tokens=4, recent_tokens=1000, sliding_exact=True)
    with attention_on_codes(model):
        got = model.generate(ids, **cache_kwarg(model, exact), **settings)
    want = model.generate(ids, past_key_values=DynamicCache(config=model.config), **settings)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=1e-4, atol=1e-4)
    coded = CompressedCache.for_model(model, _int8(), _int8(), sink_tokens=2, recent_tokens=4, encode_batch=4)
    with attention_on_codes(model):
        on_codes = model.generate(ids, **cache_kwarg(model, coded), **settings)
    decoded = model.generate(ids, past_key_values=CompressedCache.for_model(
        model, _int8(), _int8(), 2, 4, attention="decode", encode_batch=4), **settings)
    torch.testing.assert_close(torch.stack(on_codes.scores), torch.stack(decoded.scores), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("build", [_gemma2, _gpt_oss], ids=["gemma2-softcap", "gpt-oss-sinks"])
def test_softcap_and_sinks_on_codes_equal_the_decode_path(build):
    model = build()
    ids = _ids(60)
    codec = FibQuantCodec.for_rate(DIM, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        on_codes = _run(model, CompressedCache.for_model(model, codec, codec, 4, 4, encode_batch=4), ids, [30, 10], 8)
    decoded = _run(model, CompressedCache.for_model(model, codec, codec, 4, 4, attention="decode", encode_batch=4),
                   ids, [30, 10], 8)
    assert _rel(on_codes, decoded) <= 1e-4
    near = _run(model, CompressedCache.for_model(model, _int8(), _int8(), 4, 4, encode_batch=4), ids, [30, 10], 8)
    assert _rel(near, _run(model, DynamicCache(config=model.config), ids, [30, 10], 8)) <= 2e-2


@pytest.mark.parametrize("build", [_gemma2, _gpt_oss], ids=["gemma2-softcap", "gpt-oss-sinks"])
def test_fibquant_attention_applies_softcap_and_sinks_to_plain_tensors(build):
    """Other caches under the "fibquant" attention function: equal to the model's own eager attention."""
    model = build()
    ids = _ids(30)
    model.set_attn_implementation("eager")
    want = _run(model, DynamicCache(config=model.config), ids, [20], 4, codes=False)
    with attention_on_codes(model):
        assert model.config._attn_implementation == "fibquant"
        got = _run(model, DynamicCache(config=model.config), ids, [20], 4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _reference(query, keys, values, mask, scaling, softcap=None, sinks=None):
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    scores = query @ keys.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    else:
        weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return (weights @ values).transpose(1, 2)


def test_attend_codes_softcap_sinks_and_window_against_the_float_reference():
    layer = CompressedSlidingLayer(FibQuantCodec(DIM, 2, 256), FibQuantCodec(DIM, 4, 256), 24, 4, "codes", 4)
    generator = torch.Generator().manual_seed(3)
    for chunk in (30, 5, 1):
        kv, _ = layer.update(torch.randn(2, 2, chunk, DIM, generator=generator),
                             torch.randn(2, 2, chunk, DIM, generator=generator))
    assert kv.num_coded > 0 and kv.length == 23 + 1
    query = torch.randn(2, 4, 1, DIM, generator=generator)
    mask = torch.ones(2, 1, 1, kv.length, dtype=torch.bool)
    mask[1, :, :, :5] = False  # e.g. padding
    keys, values = kv.materialize()
    sinks = torch.randn(4, generator=generator)
    for softcap, sink in ((None, None), (3.0, None), (None, sinks), (3.0, sinks)):
        got = attend_codes(query, kv, mask, 0.125, softcap=softcap, sinks=sink)
        want = _reference(query, keys, values, mask, 0.125, softcap, sink)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    fully_masked = torch.zeros_like(mask)
    assert torch.equal(attend_codes(query, kv, fully_masked, 0.125, sinks=sinks), torch.zeros(2, 1, 4, DIM))
    with pytest.raises(ValueError, match="softcap must be a positive"):
        attend_codes(query, kv, mask, 0.125, softcap=0.0)
    with pytest.raises(ValueError, match="sinks must be a tensor of 4 logits"):
        attend_codes(query, kv, mask, 0.125, sinks=torch.zeros(3))


def test_window_without_a_mask_limits_the_causal_reach():
    generator = torch.Generator().manual_seed(4)
    keys, values = torch.randn(1, 2, 20, DIM, generator=generator), torch.randn(1, 2, 20, DIM, generator=generator)
    query = torch.randn(1, 4, 6, DIM, generator=generator)
    got = attend_codes(query, CodedKV.of_tensors(keys, values), None, 0.125, window=5)
    rows, columns = torch.arange(14, 20)[:, None], torch.arange(20)[None, :]
    mask = ((columns <= rows) & (columns > rows - 5))[None, None]
    torch.testing.assert_close(got, _reference(query, keys, values, mask, 0.125), rtol=1e-5, atol=1e-6)


def test_training_dropout_with_sinks_is_refused():
    module = torch.nn.Module()
    keys = torch.randn(1, 2, 4, DIM)
    with pytest.raises(ValueError, match="dropout with soft-capping or sinks"):
        coded_attention_forward(module, torch.randn(1, 4, 1, DIM), keys, keys, None, dropout=0.1,
                                s_aux=torch.zeros(4))


# --------------------------------------------------------------------------- MLA
def test_mla_attends_on_its_latent_codes_with_a_codec_per_role():
    """DeepSeek-V3: the cache codes the latent (128 dims) and the rotary key (64 dims); attention on
    those codes (up-projections absorbed) equals decoding them, and the latent stays one head."""
    ids = _ids(50)
    latent, rope = FibQuantCodec.for_rate(128, 4), FibQuantCodec.for_rate(DIM, 4)
    logits = {}
    for mode in ("codes", "decode"):
        model = _deepseek_v3()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            cache = CompressedCache.for_model(model, latent, rope, 4, 8, attention=mode, encode_batch=4)
        assert cache.attention == mode
        logits[mode] = _run(model, cache, ids, [30], 20)
        layer = cache.layers[0]
        assert layer.key_codes.shape[1:] == (1, layer.num_coded, latent.code_size) and layer.num_coded > 0
        assert layer.value_codes.shape[-1] == rope.code_size
    assert _rel(logits["codes"], logits["decode"]) <= 1e-4
    model = _deepseek_v3()
    near = _run(model, CompressedCache.for_model(model, _int8(128), _int8(), 4, 8, encode_batch=4), ids, [30], 20)
    plain = _run(model, DynamicCache(config=model.config), ids, [30], 20)  # still served, by SDPA, after the switch
    assert _rel(near, plain) <= 1e-2
    with pytest.raises(ValueError, match="cached value latent dim 64 differs from the value codec dim 128"):
        CompressedCache.for_model(model, latent, latent)


def test_mla_modules_of_an_unknown_form_fall_back_to_decoding():
    model = _deepseek_v3()
    for module in model.modules():
        if hasattr(module, "kv_b_proj"):
            module.kv_b_proj = torch.nn.Identity()  # not the absorbed form attend_latent knows
    with pytest.warns(RuntimeWarning, match="not the form fibquant's latent attention knows"):
        cache = CompressedCache.for_model(model, _int8(128), _int8())
    assert cache.attention == "decode"


# --------------------------------------------------------------------------- bad input
def test_unservable_layer_types_are_refused_before_any_prefill():
    model = _gemma3(16, ("sliding_attention", "full_attention"))
    model.config.layer_types = ["sliding_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"layer types \['linear_attention'\]"):
        CompressedCache.for_model(model, _int8(), _int8())


def test_codec_dim_must_match_each_role():
    model = _gemma3(16, ("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="head_dim 64 differs from the key codec dim 128"):
        CompressedCache.for_model(model, FibQuantCodec(128, 1, 256), _int8())
    with pytest.raises(ValueError, match="layer_windows has 2 entries but per-layer codecs says 3"):
        CompressedCache([_int8()] * 3, [_int8()] * 3, layer_windows=[16, None])
    with pytest.raises(ValueError, match=r"layer_windows\[0\] must be None"):
        CompressedCache(_int8(), _int8(), layer_windows=[1, None])


def test_from_cache_keeps_sliding_layers_and_positions():
    model = _gemma3(16, ("sliding_attention", "full_attention"))
    ids = _ids(50)
    dynamic = DynamicCache(config=model.config)
    _run(model, dynamic, ids, [40], 0)
    converted = CompressedCache.from_cache(dynamic, _int8(), _int8(), 4, 1000, model=model, sliding_exact=False)
    assert converted.is_sliding == [True, False] and converted.get_seq_length() == 40
    assert converted.layers[0].num_recent + converted.layers[0].num_coded == 15
    got = _run(model, converted, ids[:, 40:], [], 10)
    want = _run(model, dynamic, ids[:, 40:], [], 10)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="pass model= so this cache slides that layer too"):
        CompressedCache.from_cache(dynamic, _int8(), _int8())
    with pytest.raises(ValueError, match="sliding-window / hybrid models is not supported"):
        converted.save("/nonexistent/never-written", model)
