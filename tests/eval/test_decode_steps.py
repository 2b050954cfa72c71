"""fibquant.eval.decode_speed.steps: interleaved greedy steps of several caches."""
from __future__ import annotations

import pytest
import torch

from _kv_helpers import tiny_llama
from fibquant.eval.decode_speed.steps import Decoding, interleave, paired_ratio


class _Recorder:
    """A stand-in model: records which cache each forward ran with, returns fixed logits."""

    device = torch.device("cpu")

    def __init__(self, fail: str | None = None):
        self.calls, self.fail = [], fail

    def __call__(self, input_ids, past_key_values=None, **kwargs):
        self.calls.append(past_key_values)
        if past_key_values == self.fail:
            raise RuntimeError("boom")
        logits = torch.zeros(1, input_ids.shape[1], 8)
        logits[..., len(self.calls) % 8] = 1.0
        return type("Out", (), {"logits": logits})()


def _decodings(names):
    return {name: Decoding(name, torch.zeros(1, 1, dtype=torch.long)) for name in names}


def test_every_round_steps_each_cache_once_in_rotated_order(monkeypatch):
    model = _Recorder()
    monkeypatch.setattr("fibquant.eval.decode_speed.steps.last_logits",
                        lambda m, ids, cache: m(ids, past_key_values=cache).logits[0, -1])
    decodings = _decodings(["a", "b", "c"])
    interleave(decodings, model, rounds=4)
    assert model.calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    for d in decodings.values():
        assert len(d.wall_s) == len(d.cpu_s) == len(d.tokens) == 4 and min(d.wall_s) >= 0
        assert d.first_logits is not None and d.token.shape == (1, 1)


def test_a_failing_cache_is_dropped_or_raises(monkeypatch):
    monkeypatch.setattr("fibquant.eval.decode_speed.steps.last_logits",
                        lambda m, ids, cache: m(ids, past_key_values=cache).logits[0, -1])
    decodings = _decodings(["a", "b"])
    dropped = []
    interleave(decodings, _Recorder(fail="b"), rounds=3, on_error=lambda name, exc: dropped.append(name) or True)
    assert dropped == ["b"] and len(decodings["a"].wall_s) == 3 and decodings["b"].wall_s == []
    with pytest.raises(RuntimeError, match="boom"):
        interleave(_decodings(["a", "b"]), _Recorder(fail="b"), rounds=1)


def test_paired_ratio():
    assert paired_ratio([2.0, 3.0, 10.0], [1.0, 3.0, 4.0]) == 2.0
    assert paired_ratio([1.0, 1.0], [1.0]) == 1.0  # rounds without a reference step are left out
    assert paired_ratio([], [1.0]) is None


def test_interleaved_steps_on_a_real_cache_equal_steps_alone():
    # Interleaving only changes when each step runs: every cache's greedy tokens equal its own run alone.
    from transformers import DynamicCache

    from fibquant.kv.model import last_logits

    torch.manual_seed(0)
    model = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (1, 12))

    def started():
        cache = DynamicCache(config=model.config)
        return Decoding(cache, last_logits(model, ids, cache).argmax().view(1, 1))

    with torch.no_grad():
        alone = started()
        for _ in range(5):
            alone.step(model)
        together = {"x": started(), "y": started()}
        interleave(together, model, rounds=5)
    assert together["x"].tokens == together["y"].tokens == alone.tokens


def test_interleaved_benchmark_compares_two_caches_of_a_run():
    """benchmarks/decode_step_interleaved.py --compare A/B: median, paired (per round) and mean ratios."""
    from _benchmarks import load_benchmark

    bench = load_benchmark("decode_step_interleaved")

    def row(cache, tokens, steps):
        median = sorted(steps)[len(steps) // 2]
        return {"cache": cache, "tokens": tokens, "step_ms": steps, "step_cpu_ms": [s / 2 for s in steps],
                "decode_ms_median": median, "decode_cpu_ms_median": median / 2,
                "decode_ms_mean": sum(steps) / len(steps)}

    run = {"rows": [row("fibquant:b=2", 1024, [10.0, 20.0, 10.0]), row("e8shell:b=2", 1024, [12.0, 20.0, 40.0])]}
    got = bench.compare(run, "e8shell:b=2", "fibquant:b=2", 1024)
    assert got["paired"] == 1.2 and got["cpu_paired"] == 1.2  # rounds: 1.2, 1.0, 4.0
    assert got["median"] == 2.0 and got["mean"] == pytest.approx(72.0 / 40.0)
    assert bench.compare(run, "e8shell:b=3", "fibquant:b=2", 1024) is None
    lines = bench.compare_lines(run, [("e8shell:b=2", "fibquant:b=2"), ("x", "fibquant:b=2")])
    assert lines[0].startswith("  1024 e8shell:b=2 / fibquant:b=2: 2.000 2.000 1.200 1.200 1.800")
    assert "missing" in lines[1]
