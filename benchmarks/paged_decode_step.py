"""The vLLM plugin's decode attention per layer step (the paged numba kernel on codes) against
dense SDPA over the same sequences' bf16 and fp32 keys/values, calls interleaved.

Usage: .venv/bin/python benchmarks/paged_decode_step.py [--batch 4] [--contexts 1024 4096]
       [--bits 4 2] [--repeats 30] [--block 128] [--dtype bfloat16|float32] [--tables] [--out results/]

--tables adds each rate once more with the option `gather_decode` off (4-bit roles read through lookup
tables / histograms instead of the default's decode-then-dot gathers), interleaved: the paired ratio.

Issue 18 asks for decode attention on codes per layer step <= bf16's. Inside vLLM the bf16 step is
vLLM's own CPU attention kernel (timed in the engine by `benchmarks/vllm_serving.py`); this script
measures the kernel alone, outside the engine, against torch's SDPA as the dense baseline. On a CPU
without a bf16 matmul path torch's bf16 SDPA is several times slower than its fp32 SDPA, so the
ratio is taken to SDPA fp32, the faster dense path (bf16 is still printed). Shapes are SmolLM2-135M's
(9 query heads, 3 KV heads, head dim 64): B sequences of `context` tokens, of which 4 sinks + 32
recent tokens are exact (the plugin's window) and the rest coded in token-major vLLM pages of
--block slots (default 128, vLLM CPU's block size), block tables shuffled. The query, the exact
window, the new token and the output are --dtype (default bfloat16, what the plugin hands the kernel
in a bf16 model; the kernel reads and writes bf16 in place). Synthetic Gaussian keys/values: the kernel's cost does not depend on
the values. One torch thread; each repeat times every variant once in turn (the order rotated by one
each repeat); ratio = median / SDPA fp32's median. Writes results/paged_decode_step.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from fibquant import FibQuantCodec
from fibquant.eval.report import write_json
from fibquant.kv.attention.paged import paged_decode_attention
from fibquant.kv.options import AttentionOptions
from fibquant.paths import results_dir

Q_HEADS, KV_HEADS, DIM, SINKS, RECENT = 9, 3, 64, 4, 32


def paged_case(batch: int, context: int, codec: FibQuantCodec, generator: torch.Generator, block: int = 128,
               dtype: torch.dtype = torch.bfloat16) -> dict:
    """Pages, tables and exact parts (`dtype`) for `batch` sequences of `context` tokens in pages of
    `block` slots (arguments of `paged_decode_attention`)."""
    coded = context - SINKS - RECENT
    blocks_per_seq = -(-context // block)
    slot = 2 * codec.code_size
    order = torch.randperm(batch * blocks_per_seq, generator=generator)
    tables = order.view(batch, blocks_per_seq).to(torch.int32)
    pages = torch.zeros(batch * blocks_per_seq, block, KV_HEADS, slot, dtype=torch.uint8).transpose(1, 2)
    for b in range(batch):
        x = torch.randn(2, context, KV_HEADS, DIM, generator=generator)
        codes = torch.cat([codec.encode(x[0]), codec.encode(x[1])], dim=-1)  # [context, Hkv, slot]
        for p in range(context):
            pages[tables[b, p // block], :, p % block] = codes[p]
    return dict(pages=pages, tables=tables, starts=[SINKS] * batch, stops=[SINKS + coded] * batch,
                key_codec=codec, value_codec=codec, key_offset=0, value_offset=codec.code_size,
                exact_keys=torch.randn(batch, KV_HEADS, SINKS + RECENT, DIM, generator=generator).to(dtype),
                exact_values=torch.randn(batch, KV_HEADS, SINKS + RECENT, DIM, generator=generator).to(dtype),
                new_keys=torch.randn(batch, KV_HEADS, 1, DIM, generator=generator).to(dtype),
                new_values=torch.randn(batch, KV_HEADS, 1, DIM, generator=generator).to(dtype),
                scaling=DIM ** -0.5, out=torch.empty(batch, Q_HEADS, DIM, dtype=dtype))


def dense_step(dtype: torch.dtype, batch: int, context: int, generator: torch.Generator):
    """A closure: SDPA of one new query per sequence over `context` + 1 dense keys/values of `dtype`."""
    query = torch.randn(batch, Q_HEADS, 1, DIM, generator=generator).to(dtype)
    keys = torch.randn(batch, KV_HEADS, context + 1, DIM, generator=generator).to(dtype)
    values = torch.randn(batch, KV_HEADS, context + 1, DIM, generator=generator).to(dtype)
    return lambda: torch.nn.functional.scaled_dot_product_attention(query, keys, values, enable_gqa=True)


def measure(batch: int, context: int, bits: list[float], repeats: int, block: int = 128,
            dtype: torch.dtype = torch.bfloat16, tables: bool = False) -> list[dict]:
    generator = torch.Generator().manual_seed(context)
    variants = {"sdpa bf16": dense_step(torch.bfloat16, batch, context, generator),
                "sdpa fp32": dense_step(torch.float32, batch, context, generator)}
    for b in bits:
        codec = FibQuantCodec.for_rate(DIM, b)
        case = paged_case(batch, context, codec, generator, block, dtype)
        query = torch.randn(batch, Q_HEADS, DIM, generator=generator).to(dtype)
        variants[f"fibquant:b={b:g} paged"] = lambda case=case, query=query: paged_decode_attention(query, **case)
        if tables:  # the kernel's gather path off (lookup tables / histograms for every role)
            variants[f"fibquant:b={b:g} paged (tables)"] = lambda case=case, query=query: paged_decode_attention(
                query, **case, options=AttentionOptions(gather_decode=False))
    times = {name: [] for name in variants}
    for name, step in variants.items():  # warm-up: numba compiles, tables allocate
        step()
    items = list(variants.items())
    for repeat in range(repeats):  # the order rotated each repeat: no variant always, or twice in a row, after another
        shift = repeat % len(items)
        for name, step in items[shift:] + items[:shift]:
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["sdpa fp32"])
    rows = [{"batch": batch, "context": context, "block": block, "dtype": str(dtype).removeprefix("torch."),
             "variant": name, "median_ms": 1e3 * statistics.median(t),
             "vs_sdpa_fp32": statistics.median(t) / base} for name, t in times.items()]
    for row in rows:  # paired per repeat: gathers / tables of the same rate
        pair = times.get(row["variant"] + " (tables)")
        if pair is not None:
            ratios = sorted(a / b for a, b in zip(times[row["variant"]], pair))
            row["vs_tables_paired"] = statistics.median(ratios)
            row["vs_tables_quartiles"] = (ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--bits", type=float, nargs="+", default=[4, 2])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--block", type=int, default=128, help="page slots (vLLM CPU: 128)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="query / exact window / new token / output dtype")
    parser.add_argument("--tables", action="store_true", help="each rate also with the gather path off (paired)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.batch < 1 or args.repeats < 1 or any(c <= SINKS + RECENT for c in args.contexts):
        parser.error(f"--batch and --repeats must be >= 1 and every context > {SINKS + RECENT}")
    if args.block < 1:
        parser.error("--block must be >= 1")
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    rows = [row for context in args.contexts
            for row in measure(args.batch, context, args.bits, args.repeats, args.block, dtype, args.tables)]
    print(f"one layer's decode attention, {args.batch} sequences, SmolLM2 shapes (9 q / 3 kv heads, d 64), "
          f"{args.block}-slot pages, {args.dtype} query / window / output, 1 thread, {args.repeats} interleaved "
          f"repeats, load {os.getloadavg()[0]:.1f}; baseline torch SDPA fp32 (not vLLM's own bf16 kernel)")
    print(f"{'context':>8} | {'variant':<31} | {'median ms':>9} | {'x SDPA fp32':>11} | paired x tables (quartiles)")
    for row in rows:
        paired = (f"{row['vs_tables_paired']:.2f} ({row['vs_tables_quartiles'][0]:.2f}-{row['vs_tables_quartiles'][1]:.2f})"
                  if "vs_tables_paired" in row else "")
        print(f"{row['context']:>8} | {row['variant']:<31} | {row['median_ms']:>9.3f} | {row['vs_sdpa_fp32']:>11.2f} | "
              f"{paired}")
    path = write_json(Path(args.out or results_dir()) / "paged_decode_step.json",
                      {"benchmark": "paged_decode_step", "threads": 1, "repeats": args.repeats,
                       "dtype": args.dtype, "load_average": os.getloadavg(),
                       "shapes": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "dim": DIM, "block": args.block,
                                  "sinks": SINKS, "recent": RECENT},
                       "baseline": "torch SDPA fp32 (vLLM's own bf16 kernel is timed in the engine by vllm_serving.py)", "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
