"""Encode and decode speed of FibQuant-RVQ (k = 8 residual codes) against TurboQuant and FibQuant, same bits.

For every rate b in --rates (default 2, 3, 4) at d = --dim (64): TurboQuant b, FibQuant.for_rate(b)
and FibQuant-RVQ b at each beam in --beams (default 16, the codec's, and 4), all at the same
code_size. Batches of --batch Gaussian vectors, ONE torch thread (torch.set_num_threads(1)), every
codec in turn within each of --repeats repeats (machine load hits them alike); this thread's CPU
time per call (time.thread_time); vectors/s from the medians, `vs TQ` = TurboQuant's median time
over the codec's (encode), `vs FibQuant` = FibQuant's median decode time over the codec's.
Writes results/encode_speed_rvq.json (fibquant.eval.report.write_json).

Usage: PYTHONPATH=src .venv/bin/python benchmarks/encode_speed_rvq.py [--rates 2,3,4] [--beams 16,4]
       [--batch 1024] [--repeats 5]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.fibrvq import FibRVQCodec
from fibquant.codecs.turboquant import TurboQuantCodec
from fibquant.eval.report import write_json
from fibquant.paths import results_dir


def seconds(fn, calls: int = 1) -> float:
    cpu = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - cpu) / calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rates", default="1,2,3,4")
    parser.add_argument("--beams", default="16,4")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(0))
    rows = []
    for bits in (int(b) for b in args.rates.split(",")):
        codecs = {"TurboQuant": TurboQuantCodec(args.dim, bits), "FibQuant": FibQuantCodec.for_rate(args.dim, bits)}
        for beam in (int(w) for w in args.beams.split(",")):
            codecs[f"FibQuant-RVQ w={beam}"] = FibRVQCodec(args.dim, stages=bits, beam=beam)
        codes = {name: c.encode(x) for name, c in codecs.items()}  # warm-up (tables, numba compile)
        for c, code in zip(codecs.values(), codes.values()):
            c.decode(code)
        enc = {name: [] for name in codecs}
        dec = {name: [] for name in codecs}
        for _ in range(args.repeats):
            for name, c in codecs.items():
                enc[name].append(seconds(lambda: c.encode(x)))
                dec[name].append(seconds(lambda: c.decode(codes[name]), 3))
        med_e = {n: statistics.median(v) for n, v in enc.items()}
        med_d = {n: statistics.median(v) for n, v in dec.items()}
        for name, c in codecs.items():
            rows.append({"bits": bits, "codec": name, "code_size": c.code_size,
                         "encode_vps": args.batch / med_e[name], "decode_vps": args.batch / med_d[name],
                         "encode_vs_turboquant": med_e["TurboQuant"] / med_e[name],
                         "decode_vs_fibquant": med_d["FibQuant"] / med_d[name]})
            r = rows[-1]
            print(f"b={bits} {name:22s} {c.code_size:3d} B  encode {r['encode_vps'] / 1e3:8.1f}k/s "
                  f"(vs TQ {r['encode_vs_turboquant']:.3f})  decode {r['decode_vps'] / 1e3:8.1f}k/s "
                  f"(vs FibQuant {r['decode_vs_fibquant']:.2f})", flush=True)
    path = write_json(results_dir(args.out) / "encode_speed_rvq.json",
                      {"experiment": "FibQuant-RVQ encode/decode speed vs TurboQuant and FibQuant", "dim": args.dim,
                       "batch": args.batch, "repeats": args.repeats, "threads": 1,
                       "machine": platform.platform(), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
