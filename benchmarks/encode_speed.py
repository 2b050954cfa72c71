"""Micro-benchmark of FibQuantCodec.encode on the CPU: the torch path ("old": GridSearch for k = 2,
chunked matmul search otherwise, torch bit packing) against the numba path ("new":
codebook/numba_search.py, search + packing in numba; the norm and rotation are torch in both).

Batches x [n, 64] of Gaussian vectors, n in --sizes, for every shipped d = 64 codebook. Timed on ONE
torch thread (torch.set_num_threads(1); the numba path then runs single-threaded too), old and new
in turn within each repeat (machine load hits them alike), median of --repeats of (at least
--min-vectors vectors' worth of) encode calls, in microseconds per vector of this thread's CPU
time (time.thread_time: everything runs on the calling thread; on a shared machine wall time
mostly measures the neighbours; wall medians are in the JSON too). Each row also
checks whether both paths give the same codes and counts, among the first 512 vectors, those whose
code differs from the reference search's (the spec) for each path.
Writes encode_speed.json to --out / $FIBQUANT_RESULTS_DIR / ./results.

Usage: .venv/bin/python benchmarks/encode_speed.py [--sizes 1,16,512,4096] [--repeats 7]
       [--configs 2x256,4x4096,...]

Rates mode (`--vs-turboquant`): for every rate in --rates (default 1, 1.5, 2, 2.5, 3, 3.5, 4) and
every dim in --dims (default 64, 128), the codec `FibQuantCodec.for_rate(dim, bits)` picks, against
TurboQuant in the same run: encode vectors/s of batches of --batch Gaussian vectors (default 4096),
ONE torch thread (torch.set_num_threads(1); the numba search then runs on the calling thread too),
FibQuant and TurboQuant in turn within each repeat, median of --repeats of this thread's CPU time.
TurboQuant has integer rates only: a rate b is compared with TurboQuant at floor(b) and ceil(b)
(the same b when b is an integer) and the ratio is taken against the faster of the two (the
stricter figure): `ratio` from the medians, `paired` the median of the per-repeat ratios (more
robust on a loaded machine). Each row also checks the FibQuant codes of the first 512 vectors against the
reference search. Writes encode_speed_rates.json (same directory rule). With --norm-correction the
norm-corrected codec of each rate (`norm_correction=True`, spec `nc=1`) is timed in the same repeats too:
its vectors/s, its ratio to TurboQuant and `nc_time_paired` = the median over repeats of nc time / plain time.

    .venv/bin/python benchmarks/encode_speed.py --vs-turboquant [--dims 64,128] [--rates 1,1.5,...] [--norm-correction]
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

from fibquant.codebook.nearest import nearest_codeword_reference
from fibquant.codecs.bitpack import pack_bits
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.turboquant import TurboQuantCodec

DIM = 64
RATES = "1,1.5,2,2.5,3,3.5,4"
CONFIGS = ["2x256", "2x128", "4x4096", "4x1024", "4x256", "8x256", "16x256", "32x256", "64x4096"]


def per_vector_us(codec: FibQuantCodec, x: torch.Tensor, fast: bool, calls: int) -> tuple[float, float]:
    """(CPU time of this thread, wall time) per vector in microseconds."""
    codec.fast_search = fast
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        codec.encode(x)
    scale = 1e6 / calls / x.shape[0]
    return (time.thread_time() - cpu) * scale, (time.perf_counter() - wall) * scale


def reference_mismatches(codec: FibQuantCodec, x: torch.Tensor, codes: dict[str, torch.Tensor],
                         rows: int = 512) -> dict[str, int]:
    """Blocks of the first `rows` vectors whose index differs from the reference search's, per path."""
    _, u = codec._rotation.normalise_rotate(x[:rows], "FibQuantCodec")
    blocks = u.reshape(-1, codec.k)
    ref = torch.cat([nearest_codeword_reference(blocks[i:i + 256], codec.codebook.codewords)
                     for i in range(0, len(blocks), 256)])
    norm_bytes = next(iter(codes.values()))[:rows, :2]
    ref_codes = torch.cat([norm_bytes, pack_bits(ref.reshape(len(u), -1), codec.config.index_bits)], 1)
    out = {}
    for name, path_codes in codes.items():
        differ = path_codes[:rows] != ref_codes
        out[name] = int(differ.any(1).sum())  # vectors whose code differs from the reference's
    return out


def encode_seconds(codec, x: torch.Tensor, calls: int) -> float:
    """This thread's CPU seconds per encode call of x (`calls` calls)."""
    cpu = time.thread_time()
    for _ in range(calls):
        codec.encode(x)
    return (time.thread_time() - cpu) / calls


def vs_turboquant(args) -> int:
    """FibQuant (for_rate's default codec) against TurboQuant at the same bits, vectors/s, one thread."""
    torch.set_num_threads(1)
    rows = []
    print(f"Encode vectors/s, ONE torch thread (torch.set_num_threads(1)), batches of {args.batch}, "
          f"median of {args.rate_repeats} interleaved repeats (thread CPU time)")
    print(f"{'d':>4} {'bits':>5} {'k':>3} {'N':>5} {'method':>9} {'FibQuant/s':>11} {'TQ bits':>8} {'TQ/s':>11} "
          f"{'ratio':>6} {'paired':>6} {'ref':>4}"
          + (f" {'nc/s':>11} {'nc/TQ':>6} {'nc time':>7}" if args.norm_correction else ""))
    for dim in (int(d) for d in args.dims.split(",")):
        x = torch.randn(args.batch, dim, generator=torch.Generator().manual_seed(dim))
        for bits in (float(b) for b in args.rates.split(",")):
            fib = FibQuantCodec.for_rate(dim, bits, norm_correction=False)
            fib_nc = FibQuantCodec.for_rate(dim, bits, norm_correction=True) if args.norm_correction else None
            tq_bits = sorted({int(bits // 1), int(-(-bits // 1))} & {1, 2, 3, 4})
            turbo = {b: TurboQuantCodec(dim, b) for b in tq_bits}
            codes = fib.encode(x)  # builds / loads tables and kernels
            for codec in [*turbo.values(), *([fib_nc] if fib_nc else [])]:
                codec.encode(x)
            fib_s, nc_s, tq_s = [], [], {b: [] for b in tq_bits}
            for _ in range(args.rate_repeats):
                fib_s.append(encode_seconds(fib, x, args.calls))
                if fib_nc is not None:
                    nc_s.append(encode_seconds(fib_nc, x, args.calls))
                for b, codec in turbo.items():
                    tq_s[b].append(encode_seconds(codec, x, args.calls))
            fib_rate = args.batch / statistics.median(fib_s)
            tq_rate = {b: args.batch / statistics.median(v) for b, v in tq_s.items()}
            strict = max(tq_rate, key=tq_rate.get)
            # Paired: TurboQuant's time / FibQuant's in the same repeat (neighbours' load hits both alike).
            paired = statistics.median(t / f for t, f in zip(tq_s[strict], fib_s))
            fast = fib._numba_search(torch.device("cpu"))
            row = {"dim": dim, "bits": bits, "k": fib.k, "n_codewords": fib.n_codewords,
                   "method": fast.method if fast is not None else fib.search_method,
                   "fibquant_vectors_per_s": fib_rate,
                   "turboquant_vectors_per_s": {str(b): r for b, r in tq_rate.items()},
                   "turboquant_bits_compared": strict, "ratio": fib_rate / tq_rate[strict], "paired_ratio": paired,
                   "vectors_off_reference": reference_mismatches(fib, x, {"fibquant": codes})["fibquant"]}
            nc_text = ""
            if fib_nc is not None:
                nc_rate = args.batch / statistics.median(nc_s)
                row.update(nc_vectors_per_s=nc_rate, nc_ratio=nc_rate / tq_rate[strict],
                           nc_time_paired=statistics.median(n / f for f, n in zip(fib_s, nc_s)))
                nc_text = f" {nc_rate:>11.0f} {row['nc_ratio']:>6.2f} {row['nc_time_paired']:>7.3f}"
            rows.append(row)
            print(f"{dim:>4} {bits:>5g} {fib.k:>3} {fib.n_codewords:>5} {row['method']:>9} {fib_rate:>11.0f} "
                  f"{strict:>8} {tq_rate[strict]:>11.0f} {row['ratio']:>6.2f} {paired:>6.2f} "
                  f"{row['vectors_off_reference']:>4}{nc_text}",
                  flush=True)
    out_dir = Path(args.out or os.environ.get("FIBQUANT_RESULTS_DIR", "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"threads": torch.get_num_threads(), "batch": args.batch, "repeats": args.rate_repeats, "calls": args.calls,
            "statistic": "median of thread CPU time per call; vectors/s = batch / that",
            "ratio": "FibQuant / the faster TurboQuant among floor(bits), ceil(bits) (medians of the repeats)",
            "paired_ratio": "median over repeats of that TurboQuant's time / FibQuant's time in the same repeat",
            "nc_time_paired": "median over repeats of the norm-corrected codec's time / the plain codec's (--norm-correction)",
            "torch": torch.__version__, "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg()}
    path = out_dir / "encode_speed_rates.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {path}")
    return 0 if all(r["vectors_off_reference"] == 0 for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vs-turboquant", action="store_true",
                        help="for_rate's codec at every rate in --rates against TurboQuant (vectors/s, one thread)")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--rates", default=RATES)
    parser.add_argument("--norm-correction", action="store_true",
                        help="rates mode: also time each rate's norm-corrected codec (nc=1) in the same repeats")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=2, help="encode calls per timed repeat (rates mode)")
    parser.add_argument("--rate-repeats", type=int, default=11, help="repeats in rates mode")
    parser.add_argument("--sizes", default="1,16,512,4096")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="k x N pairs, e.g. 2x256,4x4096")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-vectors", type=int, default=4096, help="vectors encoded per timed repeat (at least)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.vs_turboquant:
        return vs_turboquant(args)
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    print(f"FibQuant encode, d={DIM}, ONE torch thread; CPU us per vector (median of {args.repeats})")
    for config in args.configs.split(","):
        k, n_codewords = (int(v) for v in config.split("x"))
        codec = FibQuantCodec(DIM, k, n_codewords)
        for n in sizes:
            x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(k * 7919 + n))
            codec.fast_search = False
            old_codes = codec.encode(x)
            codec.fast_search = True
            new_codes = codec.encode(x)  # also compiles / loads the kernels and builds the tables
            calls = max(1, args.min_vectors // n)
            old, new = [], []
            for _ in range(args.repeats):
                old.append(per_vector_us(codec, x, False, max(1, calls // 8) if k == 4 and n_codewords > 256 else calls))
                new.append(per_vector_us(codec, x, True, calls))
            row = {
                "k": k, "n_codewords": n_codewords, "n": n,
                "old_us_per_vector": statistics.median(t[0] for t in old),
                "new_us_per_vector": statistics.median(t[0] for t in new),
                "old_wall_us_per_vector": statistics.median(t[1] for t in old),
                "new_wall_us_per_vector": statistics.median(t[1] for t in new),
                "identical_codes": torch.equal(old_codes, new_codes),
                "vectors_off_reference": reference_mismatches(codec, x, {"old": old_codes, "new": new_codes}),
                "method": codec._numba_search(torch.device("cpu")).method,
            }
            row["speedup"] = row["old_us_per_vector"] / row["new_us_per_vector"]
            rows.append(row)
            print(f"k={k:2d} N={n_codewords:4d} n={n:5d} [{row['method']:5s}] old {row['old_us_per_vector']:9.2f} "
                  f"new {row['new_us_per_vector']:8.2f} -> {row['speedup']:6.1f}x  (wall {row['old_wall_us_per_vector']:.1f}"
                  f" / {row['new_wall_us_per_vector']:.1f})  identical={row['identical_codes']} "
                  f"off-reference old/new {row['vectors_off_reference']['old']}/{row['vectors_off_reference']['new']}",
                  flush=True)

    print("\nSummary (CPU us per vector, median, ONE torch thread; speedup = old / new in the same run):")
    header = f"{'k':>3} {'N':>5} {'method':>6} " + " ".join(f"{'n=' + str(n):>22}" for n in sizes)
    print(header)
    print("-" * len(header))
    for config in args.configs.split(","):
        k, n_codewords = (int(v) for v in config.split("x"))
        cells = [r for r in rows if r["k"] == k and r["n_codewords"] == n_codewords]
        print(f"{k:>3} {n_codewords:>5} {cells[0]['method']:>6} " + " ".join(
            f"{r['old_us_per_vector']:8.1f}->{r['new_us_per_vector']:6.2f} {r['speedup']:5.1f}x" for r in cells))

    out_dir = Path(args.out or os.environ.get("FIBQUANT_RESULTS_DIR", "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    import numba

    meta = {
        "threads": torch.get_num_threads(), "dim": DIM, "repeats": args.repeats, "statistic": "median",
        "timing": "interleaved (old, new in turn per repeat); *_us_per_vector: thread CPU time, *_wall_*: wall",
        "old_path": "torch: GridSearch (k=2) / chunked matmul search, pack_bits",
        "new_path": "numba: codebook/numba_search.py NumbaSearch.encode (grid / k-d tree / screened full scan)",
        "torch": torch.__version__, "numba": numba.__version__, "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
    }
    path = out_dir / "encode_speed.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {path}")
    return 0 if all(r["vectors_off_reference"]["new"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
