"""Launch choices of the fused decode-attention kernel on a GPU: time each, check each against the reference.

For Llama-8B-shaped layers (32 query heads on 8 KV heads, head_dim 128, one query token) at a few
(context, batch) shapes and FibQuant 4 and 2 bits, times `triton_kernels.decode_attention` (and the paged
kernel with --paged) under every `Launch` of the grid (num_warps x num_stages x block_tokens x waves),
with its ratio to bf16 SDPA of the same shape, and the max abs error against the torch reference. A launch
that fails to compile is reported, not fatal. Random data drawn on the device (as gpu_decode_attention.py).
Writes gpu_tune_decode.json to --out / $FIBQUANT_RESULTS_DIR / ./results and prints the best launch per
shape.

Usage: python benchmarks/gpu_tune_decode.py [--shapes 32768x16 8192x1 131072x1] [--repeats 10]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode_attention import CODECS, measure, random_codes  # noqa: E402

import fibquant.kv.attention.kernels as ck  # noqa: E402
from fibquant.codecs.fibquant import FibQuantCodec  # noqa: E402


def launches(args):
    from fibquant.kv.attention.triton_kernels import Launch

    for warps, stages, tokens, waves in itertools.product(args.warps, args.stages, args.block_tokens, args.waves):
        yield Launch(num_warps=warps, num_stages=stages, block_tokens=tokens, waves=waves)


def tune_shape(args, m: int, b: int, gen) -> list[dict]:
    import fibquant.kv.attention.triton_kernels as tk

    device, hq, hkv, d = torch.device("cuda"), 32, 8, 128
    query = torch.randn(b, hq, 1, d, generator=gen, device=device)
    keys = torch.randn(b, hkv, m, d, generator=gen, device=device, dtype=torch.bfloat16)
    sdpa_ms, _ = measure(lambda: torch.nn.functional.scaled_dot_product_attention(
        query.to(torch.bfloat16), keys, keys, enable_gqa=True), device, args.repeats, 3)
    del keys
    rows = []
    for name in args.codecs:
        codec = FibQuantCodec.for_rate(d, CODECS[name])
        book = codec.reader(device)
        kc, vc = random_codes(codec, (b, hkv, m), device, gen), random_codes(codec, (b, hkv, m), device, gen)
        call = (query, kc, vc, book.codewords, book.codewords, book.index_bits, book.index_bits)
        expected = ck.coded_decode_attention_reference(*call)[0]
        for launch in launches(args):
            row = {"context": m, "batch": b, "codec": name, "sdpa_ms": sdpa_ms, **vars(launch)}
            try:
                def fused():
                    return tk.decode_attention(*call, None, d, launch=launch)
                row["max_abs_err"] = float((fused()[0] - expected).abs().max())
                row["ms"], row["peak_delta_bytes"] = measure(fused, device, args.repeats, 2)
                row["ms_vs_sdpa"] = row["ms"] / sdpa_ms
                print(f"M={m:6d} B={b:2d} {name} {launch}: {row['ms']:.3f} ms ({row['ms_vs_sdpa']:.2f}x sdpa) "
                      f"err {row['max_abs_err']:.1e}", flush=True)
            except Exception as error:  # a launch that does not compile or run: report it, go on
                row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                print(f"M={m:6d} B={b:2d} {name} {launch}: {row['error']}", flush=True)
            rows.append(row)
        del kc, vc, expected
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["32768x16", "8192x1", "131072x1"], help="CONTEXTxBATCH")
    parser.add_argument("--codecs", nargs="+", default=["fibquant:b=4", "fibquant:b=2"], choices=sorted(CODECS))
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--block-tokens", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--waves", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not ck.triton_available():
        parser.error("needs a CUDA GPU and triton")
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    for shape in args.shapes:
        m, b = (int(x) for x in shape.split("x"))
        rows += tune_shape(args, m, b, gen)
    print("best launch per shape (max abs err <= 1e-4):")
    for (m, b, name), group in itertools.groupby(rows, key=lambda r: (r["context"], r["batch"], r["codec"])):
        ok = [r for r in group if "ms" in r and r["max_abs_err"] <= 1e-4]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            print(f"  M={m} B={b} {name}: {best['ms']:.3f} ms = {best['ms_vs_sdpa']:.2f}x sdpa with warps "
                  f"{best['num_warps']} stages {best['num_stages']} BM {best['block_tokens']} waves {best['waves']}")
    out = Path(args.out or os.environ.get("FIBQUANT_RESULTS_DIR") or "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_tune_decode.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
