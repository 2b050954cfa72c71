"""Needle in a haystack: config checks, keys, scoring, summaries, CLI errors, one short real run."""
from __future__ import annotations

import pytest
from _kv_helpers import real_model

from fibquant.cli import main
from fibquant.kv.specs import parse_cache_specs
from fibquant.eval.needle import (NEEDLE, NeedleConfig, build_trial, extract_answer, haystack_tokens, make_key,
                                  max_positions, needle_targets, run_needle, summarise)
from fibquant.eval.needle.ruler import ruler_trials


def test_config_errors():
    for kwargs, match in (({"lengths": ()}, "lengths"), ({"lengths": (64,)}, "lengths"),
                          ({"depths": (1.5,)}, "depths"), ({"keys_per_cell": 0}, "keys_per_cell"),
                          ({"max_new_tokens": 0}, "max_new_tokens"), ({"sink_tokens": -1}, "exact window sizes"),
                          ({"lengths": (128,), "recent_tokens": 64}, "not small"), ({"attention": "x"}, "attention"),
                          ({"task": "ruler"}, "task")):
        with pytest.raises(ValueError, match=match):
            NeedleConfig(**kwargs)


def test_lengths_fit_the_model_context():
    from _kv_helpers import tiny_llama

    assert max_positions(tiny_llama()) == 512 and max_positions(object()) is None
    assert haystack_tokens(4096, 34, 8, 8192) == 4096 and haystack_tokens(8150, 34, 8, 8192) == 8150
    assert haystack_tokens(8192, 34, 8, 8192) == 8150  # a full context: haystack + question + answer = 8192
    assert haystack_tokens(8192, 34, 8, None) == 8192
    with pytest.raises(ValueError, match="does not fit the model's context of 8192 positions"):
        haystack_tokens(8193, 34, 8, 8192)


def test_ruler_task_needs_lm_eval(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    with pytest.raises(ValueError, match=r"fibquant\[ruler\]"):
        ruler_trials(None, NeedleConfig(task="ruler-niah_single_1"), 1024)


def test_keys_are_fixed_five_digit_numbers():
    keys = {make_key(0, 1024, d, r) for d in (0.0, 0.5, 1.0) for r in range(3)}
    assert all(len(k) == 5 and k.isdigit() for k in keys) and len(keys) == 9
    assert make_key(0, 1024, 0.5, 1) == make_key(0, 1024, 0.5, 1) != make_key(1, 1024, 0.5, 1)


def test_extract_answer():
    assert extract_answer(" 48213.") == "48213"
    assert extract_answer("The key is 4821 3") == "4821"
    assert extract_answer("no digits") is None


def _trials(spec, corrects):
    cells = [(1024, 0.0, 0), (1024, 1.0, 0), (2048, 0.0, 0), (2048, 1.0, 0)]
    return [{"cache": spec, "length": n, "depth": d, "rep": r, "correct": c} for (n, d, r), c in zip(cells, corrects)]


def test_summary_and_target():
    specs = parse_cache_specs("fp;int:b=4;int:b=2/int:b=2")
    config = NeedleConfig(lengths=(1024, 2048), depths=(0.0, 1.0), keys_per_cell=1)
    trials = (_trials("fp", [True, True, True, False]) + _trials("int:b=4", [True, True, True, True])
              + _trials("int:b=2", [True, False, True, False]))
    rows = {r["cache"]: r for r in summarise(trials, specs, config, 64)}
    assert rows["fp"]["accuracy"] == 0.75 and rows["fp"]["by_depth_2048"] == {"0": 1.0, "1": 0.0}
    assert rows["int:b=4"]["equals_fp"] and rows["int:b=4"]["misses_where_fp_right"] == 0
    assert not rows["int:b=2"]["equals_fp"] and rows["int:b=2"]["misses_where_fp_right"] == 1
    assert rows["int:b=2"]["acc_1024"] == 0.5 and rows["int:b=4"]["codes_ratio"] == 256 / 72
    assert rows["int:b=4"]["ratio_1024"] == pytest.approx(1024 * 256 / (36 * 256 + 988 * 72))
    assert [r["label"] for r in rows.values()] == [s.label(64) for s in specs]
    assert not any(set(r) & {"method", "spec"} for r in rows.values())
    targets = needle_targets(list(rows.values()))
    assert "INT4" in targets["best ratio with fp-equal retrieval (any cache)"]
    assert targets["best FibQuant ratio with fp-equal retrieval (target >= 10x)"] is None


def test_cli_rejects_bad_arguments(capsys):
    assert main(["eval", "needle", "--lengths", "64", "--threads", "1"]) == 2
    assert "lengths" in capsys.readouterr().err


@pytest.mark.model
def test_real_model_short_needle(request, tmp_path):
    """A 256-token haystack at depth 0.5: layout, and the uncompressed model finds the key."""
    model, tokenizer = real_model(request)
    config = NeedleConfig(lengths=(256,), depths=(0.5,), keys_per_cell=1, max_new_tokens=7)
    trial = build_trial(tokenizer, config, 256, 0.5, 0)
    assert trial.prefill_ids.shape[0] == 256
    needle_ids = tokenizer(" " + NEEDLE.format(key=trial.key), add_special_tokens=False).input_ids
    assert trial.prefill_ids[trial.needle_start: trial.needle_start + 3].tolist() == needle_ids[:3]
    payload = run_needle(model, tokenizer, parse_cache_specs("fp;int:b=8"), config, progress=False)
    fp, int8 = payload["rows"]
    assert fp["accuracy"] == 1.0 and int8["equals_fp"], payload["trials"]
    assert payload["trials"][0]["key"] in payload["trials"][0]["answer"]


@pytest.mark.model
def test_real_model_8k_haystack_fits(request):
    """--lengths 8192 on SmolLM2 (8192 positions): haystack + question + answer fill the context exactly."""
    model, tokenizer = real_model(request)
    positions = max_positions(model)
    assert positions == 8192
    config = NeedleConfig(lengths=(8192,), depths=(0.5,), keys_per_cell=1)
    trial = build_trial(tokenizer, config, 8192, 0.5, 0, positions)
    assert trial.prefill_ids.shape[0] + trial.question_ids.shape[0] + config.max_new_tokens == positions
    assert build_trial(tokenizer, config, 4096, 0.5, 0, positions).prefill_ids.shape[0] == 4096
    with pytest.raises(ValueError, match="does not fit"):
        build_trial(tokenizer, config, 8200, 0.5, 0, positions)


@pytest.mark.model
def test_real_model_ruler_niah_single_1(request):
    """RULER's niah_single_1 through lm-eval's generator (optional extra: skipped when lm-eval is absent)."""
    pytest.importorskip("lm_eval.tasks.ruler.prepare_niah", reason="lm-eval absent: pip install 'fibquant[ruler]'")
    model, tokenizer = real_model(request)
    config = NeedleConfig(lengths=(512,), keys_per_cell=1, task="ruler-niah_single_1")
    (trial,) = ruler_trials(tokenizer, config, 512, max_positions(model))
    assert len(trial.key) == 7 and trial.key.isdigit() and 0.0 <= trial.depth <= 1.0
    assert trial.prefill_ids.shape[0] + trial.question_ids.shape[0] + 12 <= 512
    payload = run_needle(model, tokenizer, parse_cache_specs("fp"), config, progress=False)
    assert payload["config"]["task"] == "ruler-niah_single_1" and payload["trials"][0]["key"] == trial.key
    assert payload["rows"][0]["accuracy"] == 1.0, payload["trials"]
