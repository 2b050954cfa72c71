"""End-to-end `generate` on a GPU: CompressedCache (attention on codes) vs DynamicCache, decode speed and memory.

A Llama model shaped like Llama-3.2-1B by default (16 layers, hidden 2048, 32 query heads on 8 KV heads,
head_dim 64, vocabulary 128256) with random bf16 weights (speed and memory do not depend on the weights;
the real weights cannot travel to a lent GPU). One prompt of --context random tokens, greedy decoding of
--decode-tokens tokens. Per cache:

    ttft_ms          from the call of generate to the first token's logits (prefill + the cache's encode)
    decode_tok_s     decode steps / time from the first token's logits to the last one's (a logits
                     processor synchronises the GPU and reads the clock at each token)
    peak_delta_bytes torch.cuda.max_memory_allocated during generate, above what was allocated before
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
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

from fibquant.kv.accounting import cache_nbytes
from fibquant.kv.specs import parse_cache_spec


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
    return DynamicCache() if spec == "fp" else parse_cache_spec(spec).build(model)


class TokenClock(LogitsProcessor):
    """Reads the clock (after synchronising the device) each time generate has a token's logits."""

    def __init__(self, sync):
        self.sync, self.times = sync, []

    def __call__(self, input_ids, scores):
        self.sync()
        self.times.append(time.perf_counter())
        return scores


def timed_generate(model, prompt, spec: str, new_tokens: int, device) -> tuple[float, float, int, int]:
    """(TTFT seconds, decode seconds per token, peak bytes above the start, cache bytes) of one greedy
    generate of `new_tokens` tokens with a fresh cache."""
    cache = make_cache(spec, model)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = TokenClock(sync)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(prompt, past_key_values=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else 0
    per_token = (clock.times[-1] - clock.times[0]) / (len(clock.times) - 1)
    return clock.times[0] - start, per_token, peak, cache_nbytes(cache)


def measure(model, prompt, spec: str, args, device) -> dict:
    timed_generate(model, prompt, spec, 3, device)  # warm-up: kernels compile, allocator settles
    runs = [timed_generate(model, prompt, spec, 1 + args.decode_tokens, device) for _ in range(args.repeats)]
    ttft, per_token = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    return {"cache": spec, "ttft_ms": 1e3 * ttft, "decode_tok_s": 1.0 / per_token,
            "peak_delta_bytes": max(r[2] for r in runs), "cache_bytes": runs[-1][3]}


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
              f" MiB  cache {row['cache_bytes'] / 2**20:.1f} MiB ({row['cache_vs_fp']:.3f}x)")
    out_dir = Path(args.out or os.environ.get("FIBQUANT_RESULTS_DIR") or "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_generate.json"
    path.write_text(json.dumps({"info": info, "rows": rows}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
