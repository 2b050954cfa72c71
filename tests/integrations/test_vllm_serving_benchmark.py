"""benchmarks/vllm_serving.py's KV-pressure ceiling and batch sweep, and the engine's step summary,
without starting an engine (no vLLM needed)."""
from __future__ import annotations

import json
import math

import pytest
from _benchmarks import load_benchmark

from fibquant.integrations.vllm.engine import step_summary

# SmolLM2-135M's attention shape (its config.json): 30 layers, 9 query heads, 3 KV heads of 64.
SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("vllm_serving")


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    return str(tmp_path)


def test_bf16_bytes_per_token_match_vllms_capacity(bench, model_dir):
    per_token = bench.kv_bytes_per_token(model_dir)
    assert per_token == 2 * 30 * 3 * 64 * 2
    assert bench.kv_bytes_per_token(model_dir, "float32") == 2 * per_token
    # vLLM CPU reported 46,592 bf16 tokens (364 blocks of 128) in 1 GiB for this model.
    assert (2 ** 30 // per_token) // bench.CPU_BLOCK * bench.CPU_BLOCK == 46_592


@pytest.mark.parametrize("sequences, max_model_len", [(32, 656), (32, 2128), (1, 1), (5, 128)])
def test_unbounded_budget_holds_every_sequence_at_its_longest(bench, sequences, max_model_len):
    per_token = 23_040
    gib = bench.unbounded_kv_gib(sequences, max_model_len, per_token)
    blocks = int(gib * 2 ** 30 // per_token) // bench.CPU_BLOCK
    assert blocks >= sequences * math.ceil(max_model_len / bench.CPU_BLOCK)
    assert blocks == sequences * (math.ceil(max_model_len / bench.CPU_BLOCK) + 1)  # one spare block each, no more


def test_unbounded_budget_refuses_empty_workloads(bench):
    with pytest.raises(ValueError, match=">= 1"):
        bench.unbounded_kv_gib(0, 656, 23_040)


PRESSURE = ["--skip-equal-batch", "--pressure-prompts", "32", "--pressure-prompt-tokens", "512", "--max-tokens", "128",
            "--pressure-kv-gib", "0.25", "--caches", "bf16", "fibquant:b=4"]


def test_ceiling_row_is_bf16_with_room_for_the_whole_burst(bench, model_dir):
    plan = bench.pressure_plan(bench.parse_args(PRESSURE + ["--ceiling"]), model_dir)
    assert [label for label, _ in plan] == ["bf16", bench.UNBOUNDED, "fibquant:b=4"]
    (_, bf16), (_, ceiling), (_, coded) = plan
    assert ceiling.cache_spec is None and ceiling.kv_cache_dtype == "auto"
    assert ceiling.max_num_seqs == bf16.max_num_seqs == 32 and ceiling.max_model_len == bf16.max_model_len
    assert bf16.kv_cache_gib == coded.kv_cache_gib == 0.25
    holds = ceiling.kv_cache_gib * 2 ** 30 / bench.kv_bytes_per_token(model_dir)
    assert holds >= 32 * (512 + 128) and ceiling.kv_cache_gib > bf16.kv_cache_gib
    assert bench.UNBOUNDED not in [label for label, _ in bench.pressure_plan(bench.parse_args(PRESSURE), model_dir)]


def test_batch_sweep_runs_bf16_at_each_max_num_seqs_with_ample_kv(bench, model_dir):
    args = bench.parse_args(PRESSURE + ["--ceiling", "--batch-sweep", "8", "16", "32"])
    sweep = bench.sweep_plan(args, model_dir)
    ceiling = dict(bench.pressure_plan(args, model_dir))[bench.UNBOUNDED]
    assert [n for n, _ in sweep] == [8, 16, 32]
    assert all(s.max_num_seqs == n and s.cache_spec is None and s.kv_cache_gib == ceiling.kv_cache_gib
               for n, s in sweep)


@pytest.mark.parametrize("argv, message", [(["--ceiling"], "need the pressure workload"),
                                           (["--pressure-prompts", "4", "--batch-sweep", "0"], ">= 1")])
def test_ceiling_and_sweep_refuse_bad_arguments(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_step_summary_counts_decode_only_steps_by_batch():
    steps = [[4, 2048, 1.0, 0.9],  # prefill chunks
             [4, 4, 0.1, 0.08], [4, 4, 0.2, 0.09], [2, 2, 0.05, 0.04],
             [3, 515, 0.5, 0.4]]   # two decodes beside a prompt chunk: not decode-only
    summary = step_summary(steps)
    assert summary["steps"] == 5 and summary["max_batch"] == 4
    assert summary["decode_steps"] == 3 and summary["decode_tokens"] == 10
    assert summary["decode_s"] == pytest.approx(0.35) and summary["decode_cpu_s"] == pytest.approx(0.21)
    assert summary["decode_by_batch"] == {"4": [2, pytest.approx(0.3), pytest.approx(0.17)], "2": [1, 0.05, 0.04]}
    assert step_summary([])["max_batch"] == 0


def test_throughput_warms_up_every_timed_shape_first():
    """`_throughput` (the same code for bf16 and every FibQuant cache: it is never told which) runs each
    shape it times, one prompt and the whole batch, once untimed before any timed call."""
    pytest.importorskip("vllm", reason="vLLM is not installed (run `make test-vllm`)")
    from types import SimpleNamespace

    from fibquant.integrations.vllm import engine

    calls = []

    class Engine:
        def generate(self, prompts, params, use_tqdm=True):
            calls.append((len(prompts), params.max_tokens))
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * params.max_tokens)]) for _ in prompts]

    result = engine._throughput(Engine(), {"prompt_token_ids": [[1, 2, 3]] * 4, "max_tokens": 64})
    assert calls == [(1, 4), (4, 4), (1, 1), (4, 1), (4, 64)]  # warm-up: one prompt, the batch; then timed
    assert result["generated"] == 4 * 64
