"""Per-layer codecs and rate allocation: CompressedCache with per-layer codecs / an allocate callable,
the greedy allocator (fibquant.eval.allocation), the RateAllocation plan (fibquant.eval.cache_plans) and the
cache-spec options @centre / @alloc."""
from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _kv_helpers import tiny_llama
from transformers import DynamicCache

from fibquant.kv.model import cache_kwarg
from fibquant.codecs.integer import IntCodec
from fibquant.eval.allocation import LADDER, RateAllocator, attention_weights, greedy, ladder_codec
from fibquant.eval.cache_plans import RateAllocation
from fibquant.kv.build import build_cache
from fibquant.kv.specs import parse_cache_spec
from fibquant.kv.cache import CompressedCache

DIM = 16


# ---------------------------------------------------------------------- greedy
def brute_force(errors, sizes, budget):
    best = None
    for choice in itertools.product(*[sorted(e) for e in errors]):
        if sum(sizes[r] for r in choice) <= budget:
            total = sum(e[r] for e, r in zip(errors, choice))
            if best is None or total < best[0] - 1e-12:
                best = (total, choice)
    return best


def test_greedy_is_optimal_on_convex_error_curves_and_keeps_the_budget():
    rng = random.Random(0)
    sizes = [6, 10, 14, 18, 22, 26, 30, 34]
    for _ in range(40):
        layers = rng.randint(1, 4)
        errors = []
        for _ in range(layers):
            low = rng.randint(0, 3)
            rungs = range(low, low + 3)
            # convex decreasing: energy * 2^(-2 * rung) shape
            energy = rng.uniform(0.1, 10)
            errors.append({r: energy * 4.0 ** (-r) for r in rungs})
        budget = sum(sizes[min(e) + 1] for e in errors)
        rungs = greedy(errors, sizes, budget)
        assert sum(sizes[r] for r in rungs) <= budget
        total = sum(e[r] for e, r in zip(errors, rungs))
        assert total == pytest.approx(brute_force(errors, sizes, budget)[0])


def test_greedy_rejects_a_budget_below_the_lowest_rates():
    with pytest.raises(ValueError, match="budget"):
        greedy([{2: 1.0, 3: 0.5}], [6, 10, 14, 18], 10)


# ---------------------------------------------------------------------- RateAllocator
def layer_states(scales, tokens=48, heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(s * torch.randn(1, heads, tokens, 64, generator=gen), torch.randn(1, heads, tokens, 64, generator=gen))
            for s in scales]


def test_uniform_signal_is_the_base_rate_everywhere():
    allocate = RateAllocator(64, 2.5, 3.0, "uniform", span=1)
    keys, values, info = allocate(layer_states([1, 10, 1]))
    assert [c.code_size for c in keys] == [ladder_codec(64, 2.5).code_size] * 3
    assert all(v is ladder_codec(64, 3.0) for v in values)
    assert info["key_bits"] == [2.5] * 3


def test_mse_signal_gives_the_high_energy_layer_more_bits_at_the_same_average_bytes():
    allocate = RateAllocator(64, 2.5, 3.0, "mse", span=1)
    keys, values, info = allocate(layer_states([0.1, 1.0, 10.0, 1.0]))
    assert info["key_bits"][2] > 2.5 > info["key_bits"][0]
    # d = 64: the ladder's steps are 4 bytes, so the budget is met exactly
    assert info["key_bytes_mean"] == pytest.approx(ladder_codec(64, 2.5).code_size)
    assert info["value_bytes_mean"] == pytest.approx(ladder_codec(64, 3.0).code_size)
    assert all(abs(b - 2.5) <= 0.5 for b in info["key_bits"])  # span 1: one half-bit step


def test_attn_weights_tilt_the_allocation_and_ends_rule():
    states = layer_states([1.0, 1.0, 1.0, 1.0])
    even = RateAllocator(64, 2.5, 3.0, "attn", span=1, key_weights=((1.0, 1.0),) * 4,
                         value_weights=((1.0, 1.0),) * 4)(states)[2]
    tilted = RateAllocator(64, 2.5, 3.0, "attn", span=1, key_weights=((1.0, 1.0),) * 3 + ((50.0, 50.0),),
                           value_weights=((1.0, 1.0),) * 4)(states)[2]
    assert tilted["key_bits"][3] > even["key_bits"][3] or tilted["key_bits"][3] == 3.0
    keys_only = RateAllocator(64, 2.5, 3.0, "attn-keys", span=1, key_weights=((1.0, 1.0),) * 3 + ((50.0, 50.0),),
                              value_weights=((1.0, 1.0),) * 4)(layer_states([1.0, 1.0, 1.0, 30.0]))[2]
    assert keys_only["value_bits"] == [3.0] * 4 and keys_only["key_bits"][3] == 3.0
    ends = RateAllocator(64, 2.5, 3.0, "ends", span=1, ends=1)(layer_states([1] * 8))[2]
    assert ends["key_bits"][0] == ends["key_bits"][7] == 3.0
    assert ends["key_bytes_mean"] == pytest.approx(ladder_codec(64, 2.5).code_size)


def test_attention_weights_read_a_llama():
    model = tiny_llama(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    keys, values = attention_weights(model)
    assert len(keys) == len(values) == 2 and all(len(k) == 2 for k in keys)
    assert all(w > 0 for layer in keys + values for w in layer)
    assert attention_weights(torch.nn.Linear(2, 2)) is None


def test_allocator_errors():
    with pytest.raises(ValueError, match="signal"):
        RateAllocator(64, 2.0, 2.0, "loud")
    with pytest.raises(ValueError, match="ladder"):
        RateAllocator(64, 1.25, 2.0)
    assert LADDER[0] == 0.5 and LADDER[-1] == 4.0


# ---------------------------------------------------------------------- CompressedCache per layer
def feed(model, cache, ids, chunk):
    outs = []
    for start in range(0, ids.shape[1], chunk):
        outs.append(model(input_ids=ids[:, start:start + chunk], **cache_kwarg(model, cache), use_cache=True).logits)
    return torch.cat(outs, dim=1)


class Recorder:
    """An allocate callable: layer 0 gets INT8, layer 1 INT3 (whatever the data), and it records its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, samples):
        self.calls.append([tuple(k.shape) for k, _ in samples])
        return [IntCodec(DIM, 8), IntCodec(DIM, 3)], [IntCodec(DIM, 4), IntCodec(DIM, 2)], {"fixed": True}


@pytest.mark.parametrize("chunk", [5, 64])
def test_allocate_gives_the_static_per_layer_cache(chunk):
    """Chunked (allocation when layer 0 first encodes) or one long prefill (layers wait, then encode
    their backlog): logits and stored codes equal a cache given the per-layer codecs from the start."""
    model = tiny_llama()
    ids = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(1))
    static = CompressedCache([IntCodec(DIM, 8), IntCodec(DIM, 3)], [IntCodec(DIM, 4), IntCodec(DIM, 2)],
                             sink_tokens=2, recent_tokens=6, encode_batch=3)
    recorder = Recorder()
    allocated = CompressedCache(IntCodec(DIM, 4), IntCodec(DIM, 4), sink_tokens=2, recent_tokens=6, encode_batch=3,
                                layer_plan=RateAllocation(recorder, num_layers=2))
    with torch.no_grad():
        expected, got = feed(model, static, ids, chunk), feed(model, allocated, ids, chunk)
    torch.testing.assert_close(got, expected)
    assert len(recorder.calls) == 1 and allocated.layer_plan.allocation == {"fixed": True}
    for mine, ref in zip(allocated.layers, static.layers):
        assert mine.key_codec.bits == ref.key_codec.bits and mine.resolver is None
        assert torch.equal(mine.key_codes, ref.key_codes) and torch.equal(mine.value_codes, ref.value_codes)
    assert allocated.used_nbytes() == static.used_nbytes()
    # the used bytes count each layer's own code size
    layer_bytes = [layer.key_codec.code_size + layer.value_codec.code_size for layer in static.layers]
    assert layer_bytes[0] != layer_bytes[1]


def test_from_cache_with_allocate_sees_the_tokens_after_the_sinks():
    model = tiny_llama()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    source = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwarg(model, source), use_cache=True)
    recorder = Recorder()
    cache = CompressedCache.from_cache(source, IntCodec(DIM, 4), IntCodec(DIM, 4), 3, 8,
                                       layer_plan=RateAllocation(recorder, num_layers=2))
    assert recorder.calls == [[(1, 2, 37, DIM)] * 2]
    assert cache.layers[1].key_codec.bits == 3 and cache.key_codecs[0].bits == 8
    assert cache.layers[1].num_coded == 40 - 3 - 8
    torch.testing.assert_close(cache.layers[1].keys[..., 3:29, :],
                               IntCodec(DIM, 3).roundtrip(source.layers[1].keys[..., 3:29, :]))


def test_per_layer_codec_errors():
    with pytest.raises(ValueError, match="one key and one value codec per layer"):
        CompressedCache([IntCodec(DIM, 4)] * 2, [IntCodec(DIM, 4)])
    with pytest.raises(ValueError, match="num_layers"):
        RateAllocation(Recorder(), num_layers=0)
    with pytest.raises(ValueError, match="callable"):
        RateAllocation("mse", num_layers=2)
    with pytest.raises(ValueError, match="not both"):
        CompressedCache([IntCodec(DIM, 4)], [IntCodec(DIM, 4)], layer_plan=RateAllocation(Recorder(), num_layers=1))
    with pytest.raises(ValueError, match="layer_windows has 2 entries but num_layers says 3"):
        CompressedCache(IntCodec(DIM, 4), IntCodec(DIM, 4), layer_windows=[16, None],
                        layer_plan=RateAllocation(Recorder(), num_layers=3))
    plan = RateAllocation(Recorder(), num_layers=2)
    CompressedCache(IntCodec(DIM, 4), IntCodec(DIM, 4), layer_plan=plan)
    with pytest.raises(ValueError, match="one per cache"):
        CompressedCache(IntCodec(DIM, 4), IntCodec(DIM, 4), layer_plan=plan)
    with pytest.raises(ValueError, match="LayerPlan"):
        CompressedCache(IntCodec(DIM, 4), IntCodec(DIM, 4), layer_plan=Recorder())
    with pytest.raises(ValueError, match="codecs for 1 layers"):
        model = tiny_llama()
        cache = CompressedCache([IntCodec(DIM, 4)], [IntCodec(DIM, 4)])
        model(input_ids=torch.tensor([[1, 2, 3]]), **cache_kwarg(model, cache), use_cache=True)
    with pytest.raises(ValueError, match="per-layer codecs for a model of 2 layers"):
        CompressedCache.for_model(tiny_llama(), [IntCodec(DIM, 4)] * 3, [IntCodec(DIM, 4)] * 3, attention="decode")


# ---------------------------------------------------------------------- cache specs
def test_spec_options_parse_print_and_validate():
    spec = parse_cache_spec("fibquant:b=1.5/fibquant:b=1@centre@alloc=attn")
    assert spec.centre and [option.text for option in spec.plans] == ["@alloc=attn"]
    assert spec.spec == "fibquant:b=1.5/fibquant:b=1@centre@alloc=attn"
    assert parse_cache_spec("fibquant:b=2@alloc=mse@centre").spec == "fibquant:b=2@centre@alloc=mse"
    assert "centred" in spec.label() and "alloc=attn" in spec.label()
    assert spec.key_bytes(64) == 14 and spec.codes_ratio(64) == pytest.approx(256 / 24)
    assert parse_cache_spec("fibquant:b=2").spec == "fibquant:b=2"  # no option: unchanged
    for bad, match in [("fp@centre", "not to fp"), ("quanto-rt:b=2@centre", "not to fp or a peer"),
                       ("int:b=4@alloc=mse", "FibQuant rates"), ("fibquant:b=2@alloc=loud", "signal"),
                       ("fibquant:b=2@centre@centre", "at most once"), ("fibquant:b=1.25@alloc=mse", "ladder"),
                       ("fibquant:b=2@shiny", "option"), ("fp@decode", "not to fp"),
                       ("kakeya-e8:q=2@decode", "not to fp or a peer"), ("fibquant:b=2@decode@decode", "at most once")]:
        with pytest.raises(ValueError, match=match):
            parse_cache_spec(bad)


def test_decode_option_builds_the_reference_attention_path():
    model = tiny_llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)  # head_dim 64
    spec = parse_cache_spec("fibquant:b=2@decode")
    assert spec.decode and spec.spec == "fibquant:b=2@decode" and spec.label().endswith("(decode)")
    assert spec.key_bytes(64) == parse_cache_spec("fibquant:b=2").key_bytes(64)
    assert build_cache(spec, model).attention == "decode"
    assert build_cache("fibquant:b=2", model, attention="codes").attention == "codes"


def test_spec_centre_and_uniform_alloc_build_the_caches_they_name():
    model = tiny_llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)  # head_dim 64
    ids = torch.randint(0, 97, (1, 60), generator=torch.Generator().manual_seed(3))
    source = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwarg(model, source), use_cache=True)
    plain = build_cache("fibquant:b=3/fibquant:b=2.5", model, 4, 8, "decode", prefill=source)
    uniform = build_cache("fibquant:b=3/fibquant:b=2.5@alloc=uniform", model, 4, 8, "decode",
                                                                                 prefill=source)
    assert uniform.layer_plan.allocation["key_bits"] == [3.0, 3.0]
    for a, b in zip(plain.layers, uniform.layers):
        assert torch.equal(a.key_codes, b.key_codes) and torch.equal(a.value_codes, b.value_codes)
    assert plain.used_nbytes() == uniform.used_nbytes()
    centred = build_cache("int:b=4@centre", model, 4, 8, "decode", prefill=source)
    assert centred.layer_plan.centred and centred.layers[0].key_mean is not None
    attn = build_cache("fibquant:b=3/fibquant:b=2.5@alloc=attn", model, 4, 8, "decode", prefill=source)
    assert attn.layer_plan.allocation["signal"] == "attn"
    assert attn.used_nbytes() <= plain.used_nbytes()
    assert sum(layer.key_codec.code_size for layer in attn.layers) <= 2 * ladder_codec(64, 3.0).code_size


def test_ends_takes_a_layer_count_in_the_spec():
    spec = parse_cache_spec("fibquant:b=1.5/fibquant:b=1@alloc=ends:4")
    assert spec.spec == "fibquant:b=1.5/fibquant:b=1@alloc=ends:4"
    allocator = spec.plans[0].allocator(spec, 64, centre=False)
    assert allocator.signal == "ends" and allocator.ends == 4
    keys, values, info = allocator([(torch.zeros(1, 1, 4, 64), torch.zeros(1, 1, 4, 64))] * 30)
    assert info["key_bits"][:4] == [2.0] * 4 and info["key_bits"][-4:] == [2.0] * 4
    assert info["key_bits"].count(1.0) == 8 and info["value_bits"].count(0.5) == 8
    assert info["key_bytes_mean"] == info["key_budget"] and info["value_bytes_mean"] == info["value_budget"]
    ends = parse_cache_spec("fibquant:b=2@alloc=ends")
    assert ends.plans[0].allocator(ends, 64, centre=False).ends == 2  # the default count
    for bad, match in [("fibquant:b=2@alloc=ends:0", "integer >= 1"), ("fibquant:b=2@alloc=ends:x", "integer >= 1"),
                       ("fibquant:b=2@alloc=mse:3", "only ends"), ("fibquant:b=2@alloc=loud:3", "signal")]:
        with pytest.raises(ValueError, match=match):
            parse_cache_spec(bad)


def test_experiment_options_without_their_module_name_it():
    """kv/ does not import eval/: before `fibquant.eval.cache_plans` is imported, @alloc= is an error naming it."""
    code = ("from fibquant.kv.specs import parse_cache_spec\n"
            "try:\n    parse_cache_spec('fibquant:b=2@alloc=mse')\nexcept ValueError as exc:\n    print(exc)\n"
            "import fibquant.eval.cache_plans\nprint(parse_cache_spec('fibquant:b=2@alloc=mse').spec)")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    error, spec = done.stdout.strip().splitlines()
    assert "import fibquant.eval.cache_plans" in error and spec == "fibquant:b=2@alloc=mse"


def test_a_cache_waiting_for_its_allocation_refuses_to_be_saved(tmp_path):
    model = tiny_llama()
    cache = CompressedCache.for_model(model, IntCodec(DIM, 4), IntCodec(DIM, 4), 2, 6, attention="decode",
                                      layer_plan=RateAllocation(Recorder(), num_layers=2))
    with pytest.raises(ValueError, match="cannot be saved: its per-layer codecs are not chosen yet"):
        cache.save(tmp_path / "c", model)
