"""One decode step's attention on E8 shell codes alone, compact vs decomposed tables, against FibQuant (same bytes).

A `CompressedLayer` ("codes", window 4 + 32) per cache: FibQuant.for_rate(b), FibQuant-E8 b through the step's
own tables (at b <= 2 the compact ones, `codebook.e8shell_tables.compact_point_tables`) and FibQuant-E8 b forced onto
the decomposed tables (`point_tables`, the step before the compact ones; set through the step's plan cache),
keys and values of --tokens Gaussian tokens, 1 batch row, --heads KV heads with 3 query heads each (SmolLM2);
`attend_codes` for one query token, the three in turn within each of --repeats rounds, a 16 MB array summed
before every call (the layer's weights pass through the caches between two layers' attention), ONE torch
thread, this thread's CPU time per call. Leaves out the model and the encode (see decode_step_interleaved.py).

Usage: PYTHONPATH=src .venv/bin/python benchmarks/e8shell_attention_step.py [--bits 2] [--tokens 1024 4096]
       [--repeats 40]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import fibquant.kv.attention.numba_shells as numba_shells
from fibquant.codebook.e8shell_tables import point_tables
from fibquant.codecs.e8shell import E8ShellCodec
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.kv.attention import attend_codes
from fibquant.kv.cache import CompressedLayer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=float, nargs="+", default=[2.0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sweep = np.ones(4 << 20, np.float32)
    print("bits tokens | FibQuant ms | E8 step's tables ms | E8 decomposed ms | E8 / FibQuant | decomposed / FibQuant")
    for bits in args.bits:
        bits = int(bits) if bits == int(bits) else bits
        for tokens in args.tokens:
            generator = torch.Generator().manual_seed(0)
            decomposed = E8ShellCodec(64, bits)
            caches = {"fibquant": FibQuantCodec.for_rate(64, bits), "e8": E8ShellCodec(64, bits),
                      "e8 decomposed": decomposed}
            plan = numba_shells.shell_plan(decomposed)
            numba_shells._PLANS[decomposed] = (*plan[:3], point_tables(decomposed.levels), plan[4], None)
            kvs = {}
            for name, codec in caches.items():
                layer = CompressedLayer(codec, codec, 4, 32, attention="codes")
                for chunk in (tokens, 1):
                    kvs[name], _ = layer.update(torch.randn(1, args.heads, chunk, 64, generator=generator),
                                                torch.randn(1, args.heads, chunk, 64, generator=generator))
            query = torch.randn(1, 3 * args.heads, 1, 64, generator=generator)
            times = {name: [] for name in kvs}
            for round_ in range(args.repeats + 2):
                for name, kv in kvs.items():
                    sweep.sum()
                    start = time.thread_time()
                    attend_codes(query, kv, None, 0.125)
                    if round_ >= 2:  # two warm-up rounds (compiles, first tables)
                        times[name].append(time.thread_time() - start)
            ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            print(f"{bits:>4} {tokens:>6} | {ms['fibquant']:.3f} | {ms['e8']:.3f} | {ms['e8 decomposed']:.3f} | "
                  f"{ms['e8'] / ms['fibquant']:.2f} | {ms['e8 decomposed'] / ms['fibquant']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
