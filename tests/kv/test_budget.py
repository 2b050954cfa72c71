"""Budget first (`fibquant.kv.budget`): the chosen code's measured cache fits and is the table's best fitting row."""
from __future__ import annotations

import pytest
import torch

import fibquant
from fibquant.kv.budget import (Budget, cache_bytes_per_token, candidates, code_table, model_layout, parse_budget,
                                reference_bytes_per_token)
from fibquant.kv.model import random_model
from fibquant.kv.specs import parse_cache_spec

CONTEXT = 4096


@pytest.fixture(scope="module")
def smollm2():
    return random_model(dtype=torch.bfloat16)  # SmolLM2-135M's architecture: the bytes do not depend on the weights


def _filled(model, spec: str, tokens: int):
    """A cache of `spec` for `model` holding `tokens` random tokens in every layer (no forward needed)."""
    cache = fibquant.CompressedCache.for_model(model, spec, attention="decode")
    info = fibquant.check_model_supported(model)
    generator = torch.Generator().manual_seed(0)
    for layer in range(info["layers"]):
        keys = torch.randn(1, info["kv_heads"], tokens, info["key_dim"], generator=generator, dtype=torch.bfloat16)
        cache.update(keys, torch.randn(keys.shape, generator=generator, dtype=torch.bfloat16), layer)
    return cache


@pytest.mark.parametrize("ratio", [4, 6, 8])
def test_ratio_fits_and_matches_the_best_row(smollm2, ratio):
    spec = fibquant.choose_code(smollm2, ratio=ratio, context=CONTEXT)
    limit = reference_bytes_per_token(model_layout(smollm2)) / ratio
    measured = _filled(smollm2, spec, CONTEXT).bytes_per_token()
    assert measured <= limit, (spec, measured, limit)
    rows = [row for row in code_table()["rows"] if "/" not in row["cache"]]
    fitting = [row for row in candidates(smollm2, Budget(ratio=ratio, context=CONTEXT)) if row["fits"]]
    best = min(fitting, key=lambda row: row["attention_error"])
    assert spec == best["cache"] and spec in {row["cache"] for row in rows}
    # nothing better in the whole table fits: every row with a lower error needs more bytes than the budget
    for row in candidates(smollm2, Budget(ratio=ratio, context=CONTEXT)):
        if row["attention_error"] < best["attention_error"]:
            assert row["bytes_per_token"] > limit


def test_formula_bounds_the_measured_cache(smollm2):
    layout = model_layout(smollm2)
    for spec in ("fibquant:b=2", "e8shell:b=3,nc=1"):
        cache = _filled(smollm2, spec, CONTEXT)
        bound = cache_bytes_per_token(layout, cache.key_codec.code_size, cache.value_codec.code_size, CONTEXT)
        assert cache.bytes_per_token() <= bound <= cache.bytes_per_token() * 1.05


def test_keys_finer_and_bytes_forms(smollm2):
    spec = fibquant.choose_code(smollm2, ratio=6, context=CONTEXT, keys_finer=True)
    key, value = parse_cache_spec(spec).key, parse_cache_spec(spec).value
    assert key.bytes_per_vector(64) > value.bytes_per_vector(64)
    per_token = reference_bytes_per_token(model_layout(smollm2)) / 6
    assert fibquant.choose_code(smollm2, bytes_per_token=per_token, context=CONTEXT) == \
        fibquant.choose_code(smollm2, ratio=6, context=CONTEXT)
    # the spec forms: parse_cache_spec with the model, for_model
    assert parse_cache_spec(f"ratio=6,context={CONTEXT}", smollm2).spec == fibquant.choose_code(
        smollm2, ratio=6, context=CONTEXT)
    assert parse_cache_spec("ratio=6,keys=finer@decode", smollm2).decode
    cache = fibquant.CompressedCache.for_model(smollm2, f"ratio=8,context={CONTEXT}")
    assert parse_cache_spec(fibquant.choose_code(smollm2, ratio=8, context=CONTEXT)).key.spec in repr(cache.key_codec) \
        or cache.key_codec.code_size == parse_cache_spec(
            fibquant.choose_code(smollm2, ratio=8, context=CONTEXT)).key.bytes_per_vector(64)


def test_longer_context_counts_the_window_less(smollm2):
    short = candidates(smollm2, Budget(ratio=6, context=128))
    long = candidates(smollm2, Budget(ratio=6, context=8192))
    assert all(s["bytes_per_token"] > l["bytes_per_token"] for s, l in zip(short, long))


@pytest.mark.parametrize("bad", ["ratio=0.5", "ratio=x", "bytes=-3", "ratio=6,bytes=4", "ratio=6,keys=coarser",
                                 "ratio=6,context=0", "ratio=6,ratio=7", "ratio=6,foo=1"])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(ValueError):
        parse_budget(bad)


def test_budget_needs_the_model_and_an_impossible_one_says_why(smollm2):
    with pytest.raises(ValueError, match="needs the model"):
        parse_cache_spec("ratio=6")
    with pytest.raises(ValueError, match="no shipped code fits"):
        fibquant.choose_code(smollm2, ratio=60, context=CONTEXT)
