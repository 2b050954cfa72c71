"""`fibquant eval peers --rotation-seeds`: codecs that take a rotation seed run once per draw, rows hold
the mean and sd over the draws, everything else runs once."""
from __future__ import annotations

import statistics

import pytest
from _kv_helpers import real_model

from fibquant.cli import build_parser
from fibquant.eval.peers import (PeersConfig, expand_rotations, merge_rotations, metric_table, metric_title,
                                 rotation_variant, run)
from fibquant.kv.specs import parse_cache_spec, parse_cache_specs


def test_expand_rotations_seeds_only_codecs_that_take_one():
    specs = parse_cache_specs(["fp", "fibquant:b=2", "fibrvq:b=2,nc=1/int:b=4", "int:b=4", "kakeya-e8:q=2",
                               "fibquant:b=2,r=5", "turboquant:b=2@decode"])
    runs, origin = expand_rotations(specs, (0, 3))
    assert [s.spec for s in runs] == [
        "fp", "fibquant:b=2,r=0", "fibquant:b=2,r=3", "fibrvq:b=2,nc=1,r=0/int:b=4", "fibrvq:b=2,nc=1,r=3/int:b=4",
        "int:b=4", "kakeya-e8:q=2", "fibquant:b=2,r=5", "turboquant:b=2,r=0@decode", "turboquant:b=2,r=3@decode"]
    assert origin["fibquant:b=2,r=3"] == ("fibquant:b=2", 3) and origin["int:b=4"] == ("int:b=4", None)
    assert origin["turboquant:b=2,r=0@decode"] == ("turboquant:b=2@decode", 0)
    assert rotation_variant(parse_cache_spec("fibquant:b=2"), 2).key.quantizer.build(64).rotation_seed == 2
    assert expand_rotations(specs, ())[0] == specs  # no seeds: every spec as given


def test_merge_rotations_means_and_spread():
    specs = parse_cache_specs(["fibquant:b=2", "int:b=4"])
    runs, origin = expand_rotations(specs, (0, 1, 2))
    cosines = {"fibquant:b=2,r=0": 0.80, "fibquant:b=2,r=1": 0.86, "fibquant:b=2,r=2": 0.83, "int:b=4": 0.9}
    rows = [{"cache": s.spec, "cosine": cosines[s.spec], "ok": True} for s in runs]
    merged = merge_rotations(rows, origin, {"cosine": "cosine", "flag": "ok"})
    fib = merged["fibquant:b=2"]
    assert fib["cosine"] == pytest.approx(0.83) and fib["rotations"] == 3 and fib["rotation_seeds"] == [0, 1, 2]
    assert fib["cosine_sd"] == pytest.approx(statistics.stdev([0.80, 0.86, 0.83]))
    assert fib["cosine_per_seed"] == [0.80, 0.86, 0.83] and fib["flag"] is True
    assert merged["int:b=4"] == {"rotations": 1, "rotation_seeds": [], "cosine": 0.9, "cosine_sd": 0.0,
                                 "cosine_per_seed": [0.9], "flag": True}
    assert rows[1]["rotation_of"] == "fibquant:b=2" and rows[1]["rotation_seed"] == 1


def test_rotation_seeds_config_and_cli():
    from fibquant.cli.peers import config_from_args

    for bad in ((1, 1), (-1,), (0.5,), [0, 1]):
        with pytest.raises(ValueError, match="rotation_seeds"):
            PeersConfig(rotation_seeds=bad)
    args = build_parser().parse_args(["eval", "peers", "--quick", "--rotation-seeds", "0", "1,2"])
    assert config_from_args(args).rotation_seeds == (0, 1, 2)
    assert config_from_args(build_parser().parse_args(["eval", "peers"])).rotation_seeds == ()


@pytest.mark.model
def test_fidelity_over_rotations(request):
    """On the real model (64 tokens): a seeded row is the mean of its draws, draw r=0 is the codec's own
    rotation, a codec without a rotation seed runs once; the table shows the sd and the draw count."""
    model, tokenizer = real_model(request)
    config = PeersConfig.quick(metrics=("fidelity",), fidelity_tokens=64, query_stride=8, sink_tokens=0,
                               recent_tokens=0)
    specs = ["fp", "fibquant:b=2", "int:b=4"]
    seeded = run(config.__class__(**{**vars(config), "rotation_seeds": (0, 1)}), caches=specs,
                 model_and_tokenizer=(model, tokenizer), progress=False)
    plain = run(config, caches=specs[:2], model_and_tokenizer=(model, tokenizer), progress=False)
    rows = {r["cache"]: r for r in seeded["rows"]}
    part = {r["cache"]: r for r in seeded["parts"]["fidelity"]["rows"]}
    assert set(part) == {"fp", "fibquant:b=2,r=0", "fibquant:b=2,r=1", "int:b=4"}
    draws = [part["fibquant:b=2,r=0"]["cosine"], part["fibquant:b=2,r=1"]["cosine"]]
    assert draws[0] != draws[1]
    assert rows["fibquant:b=2"]["cosine"] == pytest.approx(statistics.fmean(draws))
    assert rows["fibquant:b=2"]["cosine_sd"] == pytest.approx(statistics.stdev(draws))
    assert draws[0] == pytest.approx(next(r for r in plain["rows"] if r["cache"] == "fibquant:b=2")["cosine"])
    assert rows["int:b=4"]["rotations"] == 1 and rows["int:b=4"]["cosine_sd"] == 0.0
    assert rows["fp"]["cosine"] == pytest.approx(1.0, abs=1e-5)
    table = metric_table(seeded, "fidelity")
    assert "| sd |" in table and "rotations" in table
    assert "rotation seeds [0, 1]" in metric_title(seeded, "fidelity")
