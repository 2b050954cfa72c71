"""End-to-end `generate` on a GPU: CompressedCache (attention on codes) vs DynamicCache, decode speed and memory.

A Llama model shaped like Llama-3.2-1B by default (16 layers, hidden 2048, 32 query heads on 8 KV heads,
head_dim 64, vocabulary 128256) with random bf16 weights (speed and memory do not depend on the weights;
the real weights cannot travel to a lent GPU). One prompt of --context random tokens, greedy decoding of
--decode-tokens tokens. Per cache:

    ttft_ms          from the call of generate to the first token's logits (prefill + the cache's encode)
    decode_tok_s     decode steps / time from the first token's logits to the last one's (a logits
                     processor synchronises the GPU and reads the clock at each token)
    peak_delta_bytes torch.cuda.max_memory_allocated during generate, above what was allocated before
                     (also apart: prefill_peak_bytes up to the first token, decode_peak_bytes after it)
    cache_bytes      the cache's storage after it (`fibquant.kv.accounting.cache_nbytes`: codes with their
                     reserved capacity + exact window; DynamicCache: its K/V tensors)

Ratios to DynamicCache in the same run. Medians of --repeats runs. Writes gpu_generate.json to --out /
$FIBQUANT_RESULTS_DIR / ./results.

Usage: python benchmarks/gpu_generate.py [--context 8192] [--decode-tokens 32]
       [--caches fp fibquant:b=4 fibquant:b=2] [--repeats 3] [--out DIR]
On the CPU (--device cpu) use a tiny shape (--layers 2 --hidden 256 --context 256) as a smoke test.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

import fibquant
from fibquant.paths import results_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_summary import write_rows  # noqa: E402
from fibquant.kv.accounting import cache_nbytes
from fibquant.kv.model import cache_kwarg


def llama_config(args) -> LlamaConfig:
    """A Llama config of the requested shape (defaults: Llama-3.2-1B)."""
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=args.q_heads,
                       num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.q_heads,
                       max_position_embeddings=max(131072, 2 * args.context), rope_theta=500000.0,
                       tie_word_embeddings=True)


def build_model(config: LlamaConfig, device: torch.device) -> LlamaForCausalLM:
    """Random bf16 weights allocated on `device` directly (no CPU copy of the model)."""
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    return model.eval()


def make_cache(spec: str, model):
    return DynamicCache() if spec == "fp" else fibquant.CompressedCache.for_model(model, spec)


class TokenClock(LogitsProcessor):
    """Reads the clock (after synchronising the device) each time generate has a token's logits; at the
    first, also the peak memory of the prefill (then resets the peak for the decode steps)."""

    def __init__(self, sync, device):
        self.sync, self.device, self.times, self.prefill_peak = sync, device, [], 0

    def __call__(self, input_ids, scores):
        self.sync()
        self.times.append(time.perf_counter())
        if len(self.times) == 1 and self.device.type == "cuda":
            self.prefill_peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return scores


def timed_generate(model, prompt, spec: str, new_tokens: int, device) -> tuple:
    """(TTFT seconds, decode seconds per token, prefill peak and decode peak bytes above the start, cache
    bytes) of one greedy generate of `new_tokens` tokens with a fresh cache."""
    cache = make_cache(spec, model)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = TokenClock(sync, device)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    with torch.no_grad(), fibquant.attention_on_codes(model):
        model.generate(prompt, **cache_kwarg(model, cache), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    decode_peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else 0
    prefill_peak = clock.prefill_peak - before if device.type == "cuda" else 0
    per_token = (clock.times[-1] - clock.times[0]) / (len(clock.times) - 1)
    return clock.times[0] - start, per_token, prefill_peak, decode_peak, cache_nbytes(cache)


def measure(model, prompt, spec: str, args, device) -> dict:
    timed_generate(model, prompt, spec, 3, device)  # warm-up: kernels compile, allocator settles
    runs = [timed_generate(model, prompt, spec, 1 + args.decode_tokens, device) for _ in range(args.repeats)]
    ttft, per_token = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    return {"cache": spec, "ttft_ms": 1e3 * ttft, "decode_tok_s": 1.0 / per_token,
            "peak_delta_bytes": max(max(r[2], r[3]) for r in runs), "prefill_peak_bytes": max(r[2] for r in runs),
            "decode_peak_bytes": max(r[3] for r in runs), "cache_bytes": runs[-1][4]}


def profile_prefill(model, prompt, spec: str, device, rows: int = 15) -> str:
    """torch.profiler tables of one prefill (generate of 1 token) with `spec`'s cache: the ops by self device
    memory and by device time, to show where TTFT and the prefill peak go."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    cache = make_cache(spec, model)
    with profile(activities=activities, profile_memory=True) as prof, torch.no_grad(), \
            fibquant.attention_on_codes(model):
        model.generate(prompt, **cache_kwarg(model, cache), max_new_tokens=1, do_sample=False, pad_token_id=0)
    by = "self_cuda_memory_usage" if device.type == "cuda" else "self_cpu_memory_usage"
    time_key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages()
    return (f"prefill profile of {spec} by {by}:\n" + table.table(sort_by=by, row_limit=rows, max_name_column_width=60)
            + f"\nby {time_key}:\n" + table.table(sort_by=time_key, row_limit=rows, max_name_column_width=60))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--caches", nargs="+", default=["fp", "fibquant:b=4", "fibquant:b=2"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--profile", default=None, metavar="SPEC",
                        help="also print torch.profiler tables of one prefill with this cache")
    parser.add_argument("--out", default=None, help="results folder (default $FIBQUANT_RESULTS_DIR or ./results)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA GPU")
    if "fp" not in args.caches:
        args.caches.insert(0, "fp")
    torch.manual_seed(0)
    model = build_model(llama_config(args), device)
    prompt = torch.randint(1, args.vocab, (1, args.context), device=device)
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "layers": args.layers, "hidden": args.hidden, "q_heads": args.q_heads,
            "kv_heads": args.kv_heads, "context": args.context, "decode_tokens": args.decode_tokens,
            "repeats": args.repeats, "weights": "random bf16"}
    print(json.dumps(info))
    rows = []
    for spec in args.caches:
        row = measure(model, prompt, spec, args, device)
        rows.append(row)
        base = rows[0]
        row["decode_vs_fp"] = row["decode_tok_s"] / base["decode_tok_s"]
        row["ttft_vs_fp"] = row["ttft_ms"] / base["ttft_ms"]
        row["peak_vs_fp"] = row["peak_delta_bytes"] / base["peak_delta_bytes"] if base["peak_delta_bytes"] else None
        row["cache_vs_fp"] = row["cache_bytes"] / base["cache_bytes"]
        print(f"{spec:14s} TTFT {row['ttft_ms']:8.1f} ms ({row['ttft_vs_fp']:.2f}x)  decode "
              f"{row['decode_tok_s']:7.1f} tok/s ({row['decode_vs_fp']:.2f}x)  peak +{row['peak_delta_bytes'] / 2**20:.0f}"
              f" MiB (prefill +{row['prefill_peak_bytes'] / 2**20:.0f}, decode +{row['decode_peak_bytes'] / 2**20:.0f})  cache {row['cache_bytes'] / 2**20:.1f} MiB ({row['cache_vs_fp']:.3f}x)")
    if args.profile:
        print(profile_prefill(model, prompt, args.profile, device))
    write_rows(results_dir(args.out) / "gpu_generate.json", info, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
