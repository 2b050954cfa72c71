"""Micro-benchmark of attention on codes (fibquant.kv.attention.kernels) against dense float32 attention.

One decode step of one layer: B=1 batch, H=3 KV heads, Q=3 queries per KV head (3 query heads per
KV head x 1 token), D=64, M cached tokens. Timed all on ONE thread (torch.set_num_threads(1)),
median of --repeats; by default the variants run in turn within each repeat (machine load hits
them alike, and each finds the caches as the previous one left them, as in a decode step that
visits many layers); with --hot each runs --repeats times in a row (its data stays in cache):

    dense   torch.einsum q.K^T and p.V with K, V float32 [B, H, M, D] (what the codes replace)
    torch   coded_scores_reference + coded_weighted_sum_reference (unpack, gather, einsum)
    numba   coded_scores + coded_weighted_sum (backend="numba"), also each half alone

Codes are real encodings of Gaussian K vectors by FibQuantCodec / TurboQuantCodec. Prints a
table with the ratios to dense from the same run and writes coded_kernels.json to
--out / $FIBQUANT_RESULTS_DIR / ./results.

Usage: .venv/bin/python benchmarks/coded_kernels.py [--tokens 1024,2048,4096,8192] [--repeats 25]
       [--queries 3] [--heads 3] [--codecs fib_k2_n256,turbo_4,...]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.turboquant import TurboQuantCodec
import fibquant.kv.attention.kernels as ck

DIM = 64
CODECS = {  # name -> (factory, label)
    "fib_k2_n256": (lambda: FibQuantCodec(DIM, 2, 256), "FibQuant k=2 N=256 w=8"),
    "fib_k4_n256": (lambda: FibQuantCodec(DIM, 4, 256), "FibQuant k=4 N=256 w=8"),
    "fib_k4_n4096": (lambda: FibQuantCodec(DIM, 4, 4096), "FibQuant k=4 N=4096 w=12"),
    "fib_k4_n1024": (lambda: FibQuantCodec(DIM, 4, 1024), "FibQuant k=4 N=1024 w=10"),
    "fib_k8_n256": (lambda: FibQuantCodec(DIM, 8, 256), "FibQuant k=8 N=256 w=8"),
    "turbo_4": (lambda: TurboQuantCodec(DIM, 4), "TurboQuant k=1 N=16 w=4"),
    "turbo_2": (lambda: TurboQuantCodec(DIM, 2), "TurboQuant k=1 N=4 w=2"),
}


def codebook_of(codec) -> tuple[torch.Tensor, int]:
    if isinstance(codec, TurboQuantCodec):
        return codec.levels.reshape(-1, 1).to(torch.float32).contiguous(), codec.bits
    return codec.codebook.codewords.to(torch.float32).contiguous(), codec.config.index_bits


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def medians(fns: dict, repeats: int, hot: bool = False, warmup: int = 2) -> dict:
    """Median seconds of each callable: run in turn within every repeat, or (hot) each in a row."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in fns}
    if hot:
        for name, fn in fns.items():
            samples[name] = [timed(fn) for _ in range(repeats)]
    else:
        for _ in range(repeats):
            for name, fn in fns.items():
                samples[name].append(timed(fn))
    return {name: statistics.median(values) for name, values in samples.items()}


def scaled_error(actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor) -> float:
    """max |actual - expected| / magnitude (magnitude = the same sum over absolute values)."""
    return float(((actual - expected).abs() / magnitude.clamp_min(1e-30)).max())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,2048,4096,8192", help="comma-separated M values")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--reference-repeats", type=int, default=5, help="repeats of the (slow) torch reference")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--queries", type=int, default=3)
    parser.add_argument("--codecs", default=",".join(CODECS))
    parser.add_argument("--hot", action="store_true", help="time each variant in a row (caches warm)")
    parser.add_argument("--out", default=None, help="results folder (default $FIBQUANT_RESULTS_DIR or ./results)")
    args = parser.parse_args(argv)
    tokens = [int(x) for x in args.tokens.split(",")]
    names = [x for x in args.codecs.split(",") if x]
    unknown = [x for x in names if x not in CODECS]
    if unknown:
        parser.error(f"unknown codecs {unknown}; choose from {list(CODECS)}")
    if not ck.numba_available():
        parser.error("numba is not installed: nothing to benchmark")

    torch.set_num_threads(1)
    torch.manual_seed(0)
    b, h, q = args.batch, args.heads, args.queries
    print(f"torch.set_num_threads(1): every timing below is single-threaded "
          f"(torch {torch.__version__}, threads now {torch.get_num_threads()}); "
          f"B={b} H={h} Q={q} D={DIM}; median of {args.repeats} {'hot' if args.hot else 'interleaved'} repeats "
          f"({args.reference_repeats} for the torch reference)")
    t0 = time.perf_counter()
    ck._kernels()
    print(f"numba kernels ready in {time.perf_counter() - t0:.2f} s (compiled, or loaded from numba's cache)")

    max_m = max(tokens)
    keys = torch.randn(b, h, max_m, DIM)
    values = torch.randn(b, h, max_m, DIM)
    queries = torch.randn(b, h, q, DIM)
    codes_by_name = {}
    for name in names:
        codec = CODECS[name][0]()
        codewords, bits = codebook_of(codec)
        codes_by_name[name] = (codec.encode(keys), codewords, bits)

    rows = []
    for m in tokens:
        k_m, v_m = keys[:, :, :m].contiguous(), values[:, :, :m].contiguous()
        weights = torch.softmax(torch.randn(b, h, q, m) * 2, dim=-1)

        def dense():
            torch.einsum("bhqd,bhmd->bhqm", queries, k_m)
            torch.einsum("bhqm,bhmd->bhqd", weights, v_m)

        for name in names:
            all_codes, codewords, bits = codes_by_name[name]
            codes = all_codes[:, :, :m].contiguous()

            def scores():
                ck.coded_scores(queries, codes, codewords, bits, backend="numba")

            def weighted():
                ck.coded_weighted_sum(weights, codes, codewords, bits, backend="numba")

            def pair():
                scores()
                weighted()

            def reference():
                ck.coded_scores_reference(queries, codes, codewords, bits)
                ck.coded_weighted_sum_reference(weights, codes, codewords, bits)

            times = medians({"dense": dense, "pair": pair, "scores": scores, "weighted": weighted},
                            args.repeats, args.hot)
            times["reference"] = medians({"reference": reference}, args.reference_repeats, args.hot, 1)["reference"]
            # correctness against the reference in the same run
            s_ref = ck.coded_scores_reference(queries, codes, codewords, bits)
            o_ref = ck.coded_weighted_sum_reference(weights, codes, codewords, bits)
            s_mag = ck.coded_scores_reference(queries.abs(), codes, codewords.abs(), bits)
            o_mag = ck.coded_weighted_sum_reference(weights.abs(), codes, codewords.abs(), bits)
            error = max(scaled_error(ck.coded_scores(queries, codes, codewords, bits, backend="numba"), s_ref, s_mag),
                        scaled_error(ck.coded_weighted_sum(weights, codes, codewords, bits, backend="numba"),
                                     o_ref, o_mag))
            row = {
                "tokens": m, "codec": name, "label": CODECS[name][1], "code_size": codes.shape[-1],
                "dense_ms": 1e3 * times["dense"], "torch_reference_ms": 1e3 * times["reference"],
                "numba_scores_ms": 1e3 * times["scores"], "numba_weighted_sum_ms": 1e3 * times["weighted"],
                "numba_pair_ms": 1e3 * times["pair"],
                "numba_pair_over_dense": times["pair"] / times["dense"],
                "torch_reference_over_dense": times["reference"] / times["dense"],
                "numba_speedup_over_reference": times["reference"] / times["pair"],
                "max_scaled_error": error,
            }
            rows.append(row)
            print(f"M={m:5d} {CODECS[name][1]:26s} dense {row['dense_ms']:7.3f} ms | torch ref "
                  f"{row['torch_reference_ms']:8.2f} ms ({row['torch_reference_over_dense']:5.1f}x) | numba "
                  f"scores {row['numba_scores_ms']:6.3f} + wsum {row['numba_weighted_sum_ms']:6.3f} -> pair "
                  f"{row['numba_pair_ms']:6.3f} ms ({row['numba_pair_over_dense']:4.2f}x dense) | err {error:.1e}",
                  flush=True)

    print(f"\nSummary ({'hot' if args.hot else 'interleaved'} timings, ms, single thread; "
          f"ratio = time / dense time in the same run):")
    header = f"{'M':>5}  {'codebook':26s} {'dense':>7} {'torch ref':>9} {'ref/dense':>9} " \
             f"{'scores':>7} {'wsum':>7} {'pair':>7} {'pair/dense':>10}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['tokens']:>5}  {row['label']:26s} {row['dense_ms']:7.3f} {row['torch_reference_ms']:9.2f} "
              f"{row['torch_reference_over_dense']:9.1f} {row['numba_scores_ms']:7.3f} "
              f"{row['numba_weighted_sum_ms']:7.3f} {row['numba_pair_ms']:7.3f} {row['numba_pair_over_dense']:10.2f}")

    out_dir = Path(args.out or os.environ.get("FIBQUANT_RESULTS_DIR", "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    import numba

    meta = {
        "threads": torch.get_num_threads(), "batch": b, "kv_heads": h, "queries_per_kv_head": q, "dim": DIM,
        "repeats": args.repeats, "reference_repeats": args.reference_repeats, "statistic": "median",
        "timing": "hot (each variant in a row)" if args.hot else "interleaved (variants in turn per repeat)",
        "torch": torch.__version__, "numba": numba.__version__, "machine": platform.machine(),
        "processor": platform.processor() or platform.uname().machine, "cpu_count": os.cpu_count(),
        "dense": "torch.einsum q.K^T + p.V, float32 K/V [B,H,M,D]",
        "numba_path": "coded_scores + coded_weighted_sum, backend='numba'",
        "torch_reference": "coded_scores_reference + coded_weighted_sum_reference",
    }
    path = out_dir / ("coded_kernels_hot.json" if args.hot else "coded_kernels.json")
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
