"""fibquant.eval.multiple_choice: lm-eval scoring rules with fake scorers, the cache-in-the-loop
protocol on a tiny random Llama (offline), and 3 real goal_step_wikihow questions (model)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _kv_helpers import tiny_llama

from fibquant.codecs.integer import IntCodec
from fibquant.data.bigbench import MultipleChoiceExample
from fibquant.eval.multiple_choice import (CacheScorer, CacheSetting, ScoredOptions, default_settings,
                                           evaluate_multiple_choice, predictions, run_multiple_choice,
                                           save_multiple_choice, select_examples, split_context)
from fibquant.kv.cache import CompressedCache


def _example(options, correct, text="Q: ", subtask="toy"):
    scores = tuple(1.0 if i == correct else 0.0 for i in range(len(options)))
    return MultipleChoiceExample(text, tuple(options), scores, subtask)


def test_acc_and_acc_norm_follow_lm_eval():
    # summed log-likelihood prefers the short option; per-character it prefers the long one
    assert predictions([-4.0, -9.0], ["ab", "abcdefghij"]) == (0, 1)
    assert predictions([-3.0, -3.0], ["x", "y"]) == (0, 0)  # ties: first index
    with pytest.raises(ValueError, match="one log-likelihood per option"):
        predictions([-1.0], ["a", "b"])


def test_split_context_moves_trailing_spaces_to_the_continuation():
    assert split_context(_example(["blue", "red"], 0, "The sky is ")) == ("The sky is", [" blue", " red"])
    assert split_context(_example(["A", "B"], 0, "Pick one:")) == ("Pick one:", [" A", " B"])


def test_select_examples_is_a_seeded_subset_in_task_order():
    pool = [_example(["a", "b"], i % 2, f"q{i} ") for i in range(50)]
    chosen = select_examples(pool, 10, seed=3)
    assert len(chosen) == 10 and chosen == select_examples(pool, 10, seed=3)
    assert [pool.index(e) for e in chosen] == sorted(pool.index(e) for e in chosen)
    assert chosen != select_examples(pool, 10, seed=4)
    assert select_examples(pool, None) == pool and select_examples(pool, 99) == pool
    with pytest.raises(ValueError, match="positive integer"):
        select_examples(pool, 0)


class LengthScorer:
    """Fake model: every character costs 1 nat, except that `favourite` is free."""

    def __init__(self, favourite: str):
        self.favourite = favourite

    def __call__(self, context, continuations):
        logliks = tuple(0.0 if c.strip() == self.favourite else -float(len(c)) for c in continuations)
        return ScoredOptions(logliks, context_tokens=len(context), context_tokens_compressed=1)


def test_evaluate_counts_hits_per_subtask():
    examples = [_example(["yes", "no"], 0, subtask="a"), _example(["yes", "no"], 1, subtask="a"),
                _example(["maybe", "no"], 0, subtask="b"), _example(["no", "yes"], 1, subtask="b")]
    result = evaluate_multiple_choice(examples, LengthScorer("yes"), progress=False)
    # acc: "yes" is free wherever offered, else the shorter continuation wins (" no" over " maybe");
    # acc_norm divides by the option's characters: " maybe" -6/5 beats " no" -3/2.
    assert result.predictions == [0, 0, 1, 1]
    assert result.predictions_norm == [0, 0, 0, 1]
    assert (result.correct, result.correct_norm, result.n) == (2, 3, 4)
    assert result.to_dict()["by_subtask"] == {"a": {"n": 2, "acc": 0.5, "acc_norm": 0.5},
                                              "b": {"n": 2, "acc": 0.5, "acc_norm": 1.0}}
    assert result.context_tokens_compressed == 4
    assert result.agreement(result) == 1.0 and result.agreement(result, normalised=True) == 1.0
    with pytest.raises(ValueError, match="no examples"):
        evaluate_multiple_choice([], LengthScorer("yes"), progress=False)


def test_cache_setting_validation():
    with pytest.raises(ValueError, match="unknown method family 'zip'"):
        CacheSetting("zip:b=2")
    with pytest.raises(ValueError, match="calibrated methods"):
        CacheSetting("lowrank:r=8")
    with pytest.raises(ValueError, match="recent_tokens must be a non-negative"):
        CacheSetting("fibquant:b=2", recent_tokens=-3)
    settings = default_settings(bits=(4, 2), small_window=(0, 4), caches=["turboquant:b=2"])
    assert [(s.method, s.sink_tokens, s.recent_tokens) for s in settings] == [
        ("fp", 4, 32), ("fibquant:b=4", 4, 32), ("fibquant:b=2", 4, 32), ("turboquant:b=2", 4, 32),
        ("fibquant:b=4", 0, 4), ("fibquant:b=2", 0, 4), ("turboquant:b=2", 0, 4)]
    assert settings[0].name() == "fp"
    assert settings[-1].name() == "TurboQuant b=2 (sink 0, recent 4)"
    assert settings[0].cache_factory(64) is None


class CharTokenizer:
    """Tiny tokenizer for the random model: one token per character."""

    pad_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        class Encoded:
            input_ids = [1 + (ord(c) % 90) for c in text]
        return Encoded()


def _one_pass_logliks(model, tokenizer, context, continuations):
    """The spec: score each option by one full forward pass over context + option, no cache."""
    out = []
    for continuation in continuations:
        ctx, opt = tokenizer(context).input_ids, tokenizer(continuation).input_ids
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ctx + opt])).logits[0].float(), -1)
        out.append(sum(float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(opt)))
    return out


def test_cache_scorer_matches_a_full_pass_and_reads_codes_back():
    model, tokenizer = tiny_llama(), CharTokenizer()
    context, continuations = "the cat sat on the", [" mat", " hat of a king", " x"]
    reference = _one_pass_logliks(model, tokenizer, context, continuations)
    exact = CacheScorer(model, tokenizer)(context, continuations)
    assert exact.context_tokens == len(context) and exact.context_tokens_compressed == 0
    assert exact.logliks == pytest.approx(reference, abs=1e-4)

    head_dim = model.config.hidden_size // model.config.num_attention_heads
    for bits, tolerance in ((8, 0.05), (2, None)):
        codec = IntCodec(head_dim, bits)
        scored = CacheScorer(model, tokenizer, lambda: CompressedCache(codec, codec, 2, 3, encode_batch=1))(context, continuations)
        # all context tokens but the last are prefilled; 2 sinks + 3 recent stay exact
        assert scored.context_tokens_compressed == len(context) - 1 - 5
        if tolerance is not None:  # 8-bit codes: close to exact
            assert scored.logliks == pytest.approx(reference, abs=tolerance)
        else:  # 2-bit codes: the scores must move, proving the codes are what attention read
            assert max(abs(a - b) for a, b in zip(scored.logliks, reference)) > 1e-3


def test_run_multiple_choice_on_the_tiny_model(tmp_path):
    model, tokenizer = tiny_llama(), CharTokenizer()
    examples = [_example(["aa", "bbb", "c"], i % 3, f"question {i} is ") for i in range(6)]
    settings = [CacheSetting("fp"), CacheSetting("int:b=4", sink_tokens=0, recent_tokens=0)]
    payload = run_multiple_choice(model, tokenizer, task="toy", limit=4, settings=settings, progress=False,
                                  examples=examples)
    fp, small = payload["rows"]
    assert payload["n_examples"] == 4 and payload["pool_size"] == 6
    assert payload["chance_accuracy"] == pytest.approx(1 / 3)
    assert fp["cache"] == fp["label"] == "fp" and not set(fp) & {"name", "method", "spec"}
    assert fp["agreement_with_fp"] == 1.0 and fp["mean_compressed_tokens"] == 0
    assert small["mean_compressed_tokens"] == pytest.approx(small["mean_context_tokens"] - 1)
    assert small["n"] == fp["n"] == 4
    assert small["code_bytes"] == IntCodec(16, 4).code_size and fp["ratio_vs_fp16"] == 1.0
    paths = save_multiple_choice(payload, tmp_path)
    assert json.loads(Path(paths["json"]).read_text())["rows"][1]["cache"] == "int:b=4"
    assert Path(paths["png"]).stat().st_size > 10_000
    if fp["acc"]:
        assert small["acc_ratio"] == pytest.approx(small["acc"] / fp["acc"])


@pytest.mark.model
def test_real_goal_step_wikihow_three_questions(model_and_tokenizer, goal_step_wikihow):
    model, tokenizer = model_and_tokenizer
    settings = [CacheSetting("fp"), CacheSetting("fibquant:b=4", sink_tokens=0, recent_tokens=4)]
    payload = run_multiple_choice(model, tokenizer, limit=3, settings=settings, progress=False)
    fp, compressed = payload["rows"]
    assert payload["n_examples"] == 3 and payload["pool_size"] == 7053
    assert "SmolLM2" in payload["model"]
    assert fp["mean_context_tokens"] > 10
    assert compressed["mean_compressed_tokens"] == pytest.approx(fp["mean_context_tokens"] - 1 - 4)
    assert compressed["agreement_with_fp"] >= 2 / 3  # 4-bit FibQuant barely moves the choices


def test_mc_experiment_runs_from_its_config_and_reports(tmp_path, capsys):
    from fibquant.eval.multiple_choice import EXPERIMENT, MultipleChoiceConfig

    examples = [_example(["aa", "bbb", "c"], i % 3, f"question {i} is ") for i in range(5)]
    config = MultipleChoiceConfig(task="toy", limit=3, bits=(), caches=("int:b=4",), sink_tokens=0,
                                  recent_tokens=0, small_window=None)
    payload = EXPERIMENT.main(config, tmp_path, model_and_tokenizer=(tiny_llama(), CharTokenizer()),
                              progress=False, examples=examples)
    assert [r["cache"] for r in payload["rows"]] == ["fp", "int:b=4"] and payload["n_examples"] == 3
    out = capsys.readouterr().out
    assert "Multiple choice: BIG-bench toy (HellaSwag substitute), 3 of 5 examples (seed 0)" in out
    assert "INT4 (sink 0, recent 0)" in out and "coded tok: mean context tokens" in out
    written = json.loads((tmp_path / "multiple_choice.json").read_text())  # acc ratios may be NaN: not ==
    assert written.keys() == payload.keys()
    assert [r["label"] for r in written["rows"]] == ["fp", "INT4 (sink 0, recent 0)"]
    assert (tmp_path / "multiple_choice.png").stat().st_size > 10_000


def test_mc_command_builds_the_config(monkeypatch):
    import fibquant.kv.model
    from fibquant.cli import build_parser, realdata
    from fibquant.eval.multiple_choice import MultipleChoiceConfig

    calls = []
    monkeypatch.setattr(realdata, "run_experiment", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(realdata, "apply_threads", lambda args: None)
    monkeypatch.setattr(fibquant.kv.model, "load_model", lambda name=None: ("model", "tokenizer"))
    args = build_parser().parse_args(["eval", "multiple-choice", "--limit", "0", "--bits", "4", "--caches", "int:b=4",
                                      "--no-small-window", "--no-progress"])
    assert args.func(args) == 0
    (name, config, out), resources = calls[0]
    assert name == "multiple-choice" and resources == {"model_and_tokenizer": ("model", "tokenizer"), "progress": False}
    assert config == MultipleChoiceConfig(limit=None, bits=(4.0,), caches=("int:b=4",), small_window=None)
    args = build_parser().parse_args(["eval", "multiple-choice", "--limit", "-1"])
    with pytest.raises(ValueError, match="--limit must be >= 0"):
        args.func(args)
