"""Decode step on codes of a soft-capped model (Gemma 2) vs the same model with soft-capping off.

Usage: PYTHONPATH=src .venv/bin/python benchmarks/softcap_decode_step.py [--contexts 4096] [--bits 4 2]
       [--steps 30] [--softcap 50] [--out results/softcap_decode_step.json]

A tiny Gemma2Config (random weights, both layers full attention, head_dim 64, 2 query heads over 1 KV
head, 1 torch thread): two models with the same weights, one with attn_logit_softcapping = --softcap, one
with None. Each takes a prefill of N random tokens into a CompressedCache (fibquant:b=B, attention on
codes), then --steps rounds of one greedy decode step per model (interleaved, so both see the same
machine state). Reports the median step of each, wall and CPU (thread time: robust to a loaded
machine's preemption), and their ratios (the soft-capping overhead of the
decode step on codes; the target is <= 1.1x). Writes JSON.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from fibquant.eval.report import write_json
from fibquant.paths import results_dir


def tiny_gemma2(softcap: float | None, context: int):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64,
                          max_position_embeddings=context + 64, sliding_window=context + 64,
                          layer_types=["full_attention", "full_attention"], attn_logit_softcapping=softcap,
                          final_logit_softcapping=None, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config).eval()


def step_times(models: dict, context: int, bits: int, steps: int) -> dict:
    """(wall, CPU) median decode step (ms) of each model on codes after a `context`-token prefill, steps interleaved."""
    from fibquant import CompressedCache, attention_on_codes

    ids = torch.randint(3, 128, (1, context), generator=torch.Generator().manual_seed(1))
    states, times, cpu = {}, {name: [] for name in models}, {name: [] for name in models}
    for name, model in models.items():
        with torch.no_grad(), attention_on_codes(model):
            cache = CompressedCache.for_model(model, f"fibquant:b={bits}")
            out = model(ids, past_key_values=cache, use_cache=True)
            states[name] = (cache, out.logits[:, -1:].argmax(-1))
    for _ in range(steps):
        for name, model in models.items():
            cache, token = states[name]
            with torch.no_grad(), attention_on_codes(model):
                start, start_cpu = time.perf_counter(), time.thread_time()
                out = model(token, past_key_values=cache, use_cache=True)
                cpu[name].append(1e3 * (time.thread_time() - start_cpu))
                times[name].append(1e3 * (time.perf_counter() - start))
            states[name] = (cache, out.logits[:, -1:].argmax(-1))
    warm = max(1, steps // 5)  # the first steps compile / warm the kernels
    return {name: (statistics.median(times[name][warm:]), statistics.median(cpu[name][warm:])) for name in models}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096])
    parser.add_argument("--bits", type=int, nargs="+", default=[4])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--softcap", type=float, default=50.0)
    parser.add_argument("--out", default=str(results_dir() / "softcap_decode_step.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for context in args.contexts:
        models = {"softcap": tiny_gemma2(args.softcap, context), "plain": tiny_gemma2(None, context)}
        for bits in args.bits:
            ms = step_times(models, context, bits, args.steps)
            (wall, cpu), (plain_wall, plain_cpu) = ms["softcap"], ms["plain"]
            rows.append({"tokens": context, "bits": bits, "softcap_ms": wall, "plain_ms": plain_wall,
                         "softcap_cpu_ms": cpu, "plain_cpu_ms": plain_cpu, "ratio": wall / plain_wall,
                         "cpu_ratio": cpu / plain_cpu})
            print(f"{context:>6} tokens, {bits}-bit: soft-capped {wall:.2f} ms (CPU {cpu:.2f}), plain {plain_wall:.2f} ms "
                  f"(CPU {plain_cpu:.2f}), ratio {rows[-1]['ratio']:.3f} (CPU {rows[-1]['cpu_ratio']:.3f})")
    payload = {"experiment": "decode step on codes, Gemma 2 soft-capped vs soft-capping off (tiny config, 1 thread)",
               "softcap": args.softcap, "steps": args.steps, "rows": rows}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
