"""The heavy-token tier (fibquant.eval.heavy, the HeavyTokens plan): selection, storage, bytes, reads, the @heavy spec option, bad input."""
from __future__ import annotations

import math

import pytest
import torch
from _kv_helpers import tiny_llama
from transformers import DynamicCache

from fibquant.codecs.identity import IdentityCodec
from fibquant.codecs.integer import IntCodec
from fibquant.kv.attention.switch import attention_on_codes
from fibquant.kv.build import build_cache
from fibquant.kv.cache import CompressedCache
from fibquant.kv.model import cache_kwarg
from fibquant.kv.specs import parse_cache_spec
from fibquant.kv.cold import Recall
from fibquant.eval.cache_plans import HeavyOption, HeavyTokens, RateAllocation
from fibquant.eval.heavy import INDEX_BYTES, SCORES, HeavySpec, HeavyTier, TieredLayer, patched_decode, register_score

DIM = 16


def states(tokens=40, heads=2, seed=0, batch=1):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, tokens, DIM, generator=gen)
    keys[..., 10, :] *= 6.0   # two outlier keys per head: the knorm tier must pick them
    keys[..., 23, :] *= 5.0
    return keys, torch.randn(batch, heads, tokens, DIM, generator=gen)


def test_knorm_tier_keeps_the_largest_keys_at_the_high_rate_and_counts_every_byte():
    keys, values = states()
    tier = HeavyTier(0.1, "knorm", IdentityCodec(DIM), IdentityCodec(DIM))
    layer = TieredLayer(IntCodec(DIM, 2), IntCodec(DIM, 2), 2, 6, tier)
    layer.update(keys, values)
    coded = 40 - 2 - 6
    assert layer.num_coded == coded and layer.num_heavy == math.floor(0.1 * coded)  # 3 per head
    index = layer.heavy_index
    assert index.dtype == torch.int32 and bool((index[..., 1:] > index[..., :-1]).all())  # sorted per head
    for head in range(2):
        assert {8, 21} <= set(index[0, head].tolist())  # tokens 10 and 23, coded rows 8 and 21
    # read back: heavy rows exact (fp16 tier), the others the base codec's roundtrip
    got = layer.keys
    base = IntCodec(DIM, 2).roundtrip(keys[..., 2:34, :])
    rows = index[0, 0].long()
    torch.testing.assert_close(got[0, 0, 2:34][rows], keys[0, 0, 2:34][rows].half().float())
    others = [r for r in range(coded) if r not in set(rows.tolist())]
    torch.testing.assert_close(got[0, 0, 2:34][others], base[0, 0][others])
    # bytes: window floats + base rows + heavy rows + 4-byte index entries
    window = (2 + 6) * 2 * DIM * 4 * 2  # sinks + recent, keys and values, float32, 2 heads
    base_rows = coded * 2 * (IntCodec(DIM, 2).code_size * 2)
    heavy_rows = 3 * 2 * (2 * DIM * 2 + INDEX_BYTES)
    assert layer.used_nbytes() == window + base_rows + heavy_rows


def test_online_selection_keeps_floor_fraction_with_equal_counts_per_head():
    keys, values = states(tokens=90)
    tier = HeavyTier(0.05, "kerr", IdentityCodec(DIM), IntCodec(DIM, 8))
    layer = TieredLayer(IntCodec(DIM, 2), IntCodec(DIM, 2), 2, 6, tier, encode_batch=4)
    for start in range(0, 90, 7):  # chunked: selection within each encode batch
        layer.update(keys[..., start:start + 7, :], values[..., start:start + 7, :])
        assert layer.num_heavy == math.floor(0.05 * layer.num_coded + 1e-9)
        assert layer.heavy_key_buffer.used == layer.heavy_value_buffer.used == layer.num_heavy
    assert layer.num_heavy == 4
    assert layer.heavy_index.max() < layer.num_coded


def test_patched_decode_is_the_base_decode_with_heavy_rows_replaced():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 12, DIM, generator=gen)
    base, heavy = IntCodec(DIM, 2), IntCodec(DIM, 8)
    index = torch.tensor([[0, 5], [3, 11], [1, 2]], dtype=torch.int32).expand(2, 3, 2)
    rows = x.gather(-2, index.long().unsqueeze(-1).expand(2, 3, 2, DIM))
    out = patched_decode(base, base.encode(x), heavy, heavy.encode(rows), index, torch.float32)
    expected = base.roundtrip(x)
    for b in range(2):
        for h in range(3):
            for j, r in enumerate(index[b, h].tolist()):
                expected[b, h, r] = heavy.roundtrip(rows[b, h, j])
    torch.testing.assert_close(out, expected)
    empty = torch.empty(2, 3, 0, dtype=torch.int32)
    torch.testing.assert_close(patched_decode(base, base.encode(x), heavy, heavy.encode(x[..., :0, :]), empty,
                                              torch.float32), base.roundtrip(x))


def test_tiered_cache_in_a_model_matches_the_cache_it_reads_back():
    """Logits through a tiered cache equal those of a float cache holding what the tiered cache reads."""
    model = tiny_llama()
    ids = torch.randint(0, 97, (1, 50), generator=torch.Generator().manual_seed(5))
    source = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwarg(model, source), use_cache=True)
    tier = HeavyTier(0.1, "knorm", IntCodec(DIM, 8), IntCodec(DIM, 8))
    cache = CompressedCache.from_cache(source, IntCodec(DIM, 2), IntCodec(DIM, 2), 2, 6, model=model,
                                       attention="codes", layer_plan=HeavyTokens(tier))
    assert all(isinstance(layer, TieredLayer) and layer.num_heavy == 4 for layer in cache.layers)
    plain = CompressedCache.from_cache(source, IntCodec(DIM, 2), IntCodec(DIM, 2), 2, 6, model=model)
    # same base rows; tier on top: 4 heavy tokens x 2 heads x (8-bit key + value rows + index) per layer
    extra = 4 * 2 * (2 * IntCodec(DIM, 8).code_size + INDEX_BYTES) * 2
    assert cache.used_nbytes() - plain.used_nbytes() == extra
    reference = DynamicCache(config=model.config)
    for index, layer in enumerate(cache.layers):
        reference.update(layer.keys, layer.values, index)
    nxt = torch.tensor([[3, 4, 5]])
    with torch.no_grad(), attention_on_codes(model):
        got = model(input_ids=nxt, **cache_kwarg(model, cache), use_cache=True).logits
        want = model(input_ids=nxt, **cache_kwarg(model, reference), use_cache=True).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="cannot be saved: saving a heavy tier"):
        cache.save("/nonexistent", model)


def test_batch_edits_and_reset_keep_the_tier_aligned():
    keys, values = states(batch=2)
    layer = TieredLayer(IntCodec(DIM, 2), IntCodec(DIM, 2), 2, 6, HeavyTier(0.1, "vnorm", IntCodec(DIM, 8),
                                                                          IntCodec(DIM, 8)))
    layer.update(keys, values)
    before = layer.keys[1]
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.heavy_index.shape == (1, 2, 3)
    torch.testing.assert_close(layer.keys[0], before)
    with pytest.raises(ValueError, match="crop into its coded part"):
        layer.crop(10)
    layer.crop(38)  # inside the recent window: fine
    layer.reset()
    assert layer.num_heavy == 0 and layer.num_coded == 0


def test_heavy_spec_parses_counts_bytes_and_builds():
    spec = parse_cache_spec("fibquant:b=1.5/fibquant:b=1@heavy=0.02:knorm:4")
    assert spec.plans == (HeavyOption(HeavySpec(0.02, "knorm", "4", "4")),)
    assert spec.spec == "fibquant:b=1.5/fibquant:b=1@heavy=0.02:knorm:4" and "heavy=0.02" in spec.label()
    # 14 + 0.02 * (34 + 2) and 10 + 0.02 * (34 + 2) bytes per vector at d = 64
    assert spec.key_bytes(64) == pytest.approx(14.72) and spec.value_bytes(64) == pytest.approx(10.72)
    assert spec.codes_ratio(64) == pytest.approx(256 / 25.44)
    assert spec.bits_per_coordinate(64) == pytest.approx(0.5 * (1.5 + 1 + 8 * 1.44 / 64))  # index bits + tier
    fp_tier = parse_cache_spec("fibquant:b=1@heavy=0.01:kerr:fp/4")
    assert fp_tier.plans[0].heavy.key_rate == "fp" and fp_tier.plans[0].heavy.value_rate == "4"
    assert fp_tier.key_bytes(64) == pytest.approx(10 + 0.01 * 130)
    assert parse_cache_spec("fibquant:b=2@heavy=0.05").plans[0].heavy == HeavySpec(0.05)  # defaults knorm, 4 bits
    model = tiny_llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)  # head_dim 64
    cache = build_cache(spec, model)
    assert isinstance(cache.layer_plan, HeavyTokens) and cache.layer_plan.tier.key_codec.code_size == 34
    both = build_cache("fibquant:b=2@alloc=uniform@heavy=0.05", model)  # allocation over tiered layers
    assert isinstance(both.layer_plan, RateAllocation) and isinstance(both.layer_plan.inner, HeavyTokens)


@pytest.mark.parametrize("bad, match", [
    ("fibquant:b=2@heavy=0", "in \\(0, 1\\)"), ("fibquant:b=2@heavy=1.5", "in \\(0, 1\\)"),
    ("fibquant:b=2@heavy=abc", "not a number"), ("fibquant:b=2@heavy=0.1:loud", "score must be one of"),
    ("fibquant:b=2@heavy=0.1:knorm:9", "\\(0, 8\\]"), ("fibquant:b=2@heavy=0.1:knorm:x", "'fp' or FibQuant"),
    ("fibquant:b=2@heavy=0.1:knorm:4/4/4", "KEY/VALUE"), ("fibquant:b=2@heavy=0.1:a:b:c", "FRACTION"),
    ("fibquant:b=2@heavy", "needs a fraction"), ("fibquant:b=2@heavy=0.1@heavy=0.2", "at most once"),
    ("fp@heavy=0.1", "not to fp"), ("quanto-rt:b=2@heavy=0.1", "not to fp or a peer"),
    ("fibquant:b=2@centre@heavy=0.1", "@centre"),
])
def test_heavy_spec_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_cache_spec(bad)


def test_tier_bad_input():
    with pytest.raises(ValueError, match="HeavyTier"):
        TieredLayer(IntCodec(DIM, 2), IntCodec(DIM, 2), 2, 6, tier=0.1)
    with pytest.raises(ValueError, match="dim"):
        TieredLayer(IntCodec(DIM, 2), IntCodec(DIM, 2), 2, 6, HeavyTier(0.1, "knorm", IntCodec(32, 8),
                                                                      IntCodec(DIM, 8)))
    with pytest.raises(ValueError, match="Codec"):
        HeavyTier(0.1, "knorm", "fp", IntCodec(DIM, 8))
    with pytest.raises(ValueError, match="\\(0, 1\\)"):
        HeavyTier(1.0, "knorm", IntCodec(DIM, 8), IntCodec(DIM, 8))
    with pytest.raises(ValueError, match="HeavyTier"):
        HeavyTokens("0.1")
    with pytest.raises(ValueError, match="recall does not combine"):
        CompressedCache(IntCodec(DIM, 2), IntCodec(DIM, 2), attention="codes", recall=Recall(tokens=4),
                        layer_plan=HeavyTokens(HeavyTier(0.1, "knorm", IntCodec(DIM, 8), IntCodec(DIM, 8))))
    with pytest.raises(ValueError, match="full-attention layers only"):
        CompressedCache(IntCodec(DIM, 2), IntCodec(DIM, 2), layer_windows=[16, None],
                        layer_plan=HeavyTokens(HeavyTier(0.1, "knorm", IntCodec(DIM, 8), IntCodec(DIM, 8))))
    with pytest.raises(ValueError, match="already registered"):
        register_score("knorm", SCORES["knorm"])
    with pytest.raises(ValueError, match="score name"):
        register_score("a b", SCORES["knorm"])
