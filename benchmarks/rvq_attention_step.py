"""One decode step's attention on codes alone: FibQuant-RVQ (one table per stage) vs FibQuant, same bytes.

For every rate b in --rates (default 2, 3, 4) at d = 64: a `CompressedLayer` of FibQuant.for_rate(b)
and one of FibQuant-RVQ b (keys and values), --tokens coded tokens (default 1024; Gaussian keys and
values, window 4 + 32), --heads KV heads with --groups query heads each (SmolLM2-135M: 3 and 3);
`attend_codes` for one query token, the codecs in turn within each of --repeats repeats, ONE torch
thread, this thread's CPU time per call (time.thread_time). Unlike `decode_step_interleaved.py`
this leaves out the model and the encode of the token that leaves the window each step (a beam
search for FibQuant-RVQ). `vs FibQuant` = the codec's median time over FibQuant's. Writes
results/rvq_attention_step.json (fibquant.eval.report.write_json).

Usage: PYTHONPATH=src .venv/bin/python benchmarks/rvq_attention_step.py [--rates 2,3,4] [--tokens 1024]
       [--repeats 30]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.fibrvq import FibRVQCodec
from fibquant.eval.report import write_json
from fibquant.kv.attention import attend_codes
from fibquant.kv.cache import CompressedLayer
from fibquant.paths import results_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="2,3,4")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dim, rows = 64, []
    gen = torch.Generator().manual_seed(0)
    for bits in (int(b) for b in args.rates.split(",")):
        codecs = {"FibQuant": FibQuantCodec.for_rate(dim, bits), "FibQuant-RVQ": FibRVQCodec(dim, stages=bits)}
        steps = {}
        for name, codec in codecs.items():
            layer = CompressedLayer(codec, codec, 4, 32, attention="codes")
            keys = torch.randn(1, args.heads, args.tokens + 36, dim, generator=gen)
            values = torch.randn(1, args.heads, args.tokens + 36, dim, generator=gen)
            layer.update(keys, values)
            kv, _ = layer.update(torch.randn(1, args.heads, 1, dim, generator=gen),
                                 torch.randn(1, args.heads, 1, dim, generator=gen))
            query = torch.randn(1, args.heads * args.groups, 1, dim, generator=gen)
            attend_codes(query, kv, None, 0.125)  # warm-up (numba compile / load)
            steps[name] = (kv, query, codec.code_size)
        times = {name: [] for name in codecs}
        with torch.no_grad():
            for _ in range(args.repeats):
                for name, (kv, query, _) in steps.items():
                    cpu = time.thread_time()
                    attend_codes(query, kv, None, 0.125)
                    times[name].append(time.thread_time() - cpu)
        med = {n: statistics.median(v) for n, v in times.items()}
        for name in codecs:
            rows.append({"bits": bits, "codec": name, "code_size": steps[name][2], "tokens": args.tokens,
                         "attention_us": med[name] * 1e6, "vs_fibquant": med[name] / med["FibQuant"]})
            print(f"b={bits} {name:13s} {steps[name][2]:3d} B  {args.tokens} tokens  attention {med[name] * 1e6:8.1f} us"
                  f"  (vs FibQuant {med[name] / med['FibQuant']:.2f}x)", flush=True)
    path = write_json(results_dir(args.out) / "rvq_attention_step.json",
                      {"experiment": "attention on codes, one decode step: FibQuant-RVQ vs FibQuant", "dim": dim,
                       "heads": args.heads, "groups": args.groups, "repeats": args.repeats, "threads": 1,
                       "machine": platform.platform(), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
