"""Encode and decode speed of the registered E8 shell codec (`e8shell:b=B`, with and without nc=1) against
TurboQuant at the same bits, one thread.

    PYTHONPATH=src .venv/bin/python benchmarks/lattice_encode_speed.py [--bits 2 3 4] [--repeats 11]

Batches of --vectors Gaussian vectors (d = 64), ONE torch thread (torch.set_num_threads(1); the numba
search then runs on the calling thread too), the codecs in turn within each repeat (machine load hits them
alike), this thread's CPU time per call (time.thread_time). Per rate: vectors/s from the medians and
`ratio` = the median over repeats of TurboQuant's time / the codec's (paired: robust on a loaded machine),
with its min and max. Writes results/lattice_encode_speed.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from fibquant.codecs.registry import parse_codec_spec
from fibquant.eval.report import format_table, write_json
from fibquant.paths import results_dir


def _timed(call) -> float:
    start = time.thread_time()
    call()
    return time.thread_time() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--vectors", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x = torch.randn(args.vectors, 64, generator=torch.Generator().manual_seed(31337))
    rows = []
    for bits in args.bits:
        specs = [f"turboquant:b={bits}", f"e8shell:b={bits}", f"e8shell:b={bits},nc=1"]
        codecs = {spec: parse_codec_spec(spec).build(64) for spec in specs}
        codes = {spec: codec.encode(x) for spec, codec in codecs.items()}  # warm-up: numba compiles, tables
        enc = {spec: [] for spec in specs}
        dec = {spec: [] for spec in specs}
        for _ in range(args.repeats):
            for spec, codec in codecs.items():
                enc[spec].append(_timed(lambda: codec.encode(x)))
                dec[spec].append(_timed(lambda: codec.decode(codes[spec])))
        turbo = specs[0]
        for spec in specs:
            ratios = sorted(t / o for t, o in zip(enc[turbo], enc[spec]))
            dec_ratios = sorted(t / o for t, o in zip(dec[turbo], dec[spec]))
            rows.append({"bits": bits, "spec": spec, "bytes": codecs[spec].code_size,
                         "encode_vectors_per_s": args.vectors / statistics.median(enc[spec]),
                         "decode_vectors_per_s": args.vectors / statistics.median(dec[spec]),
                         "encode_vs_turboquant": statistics.median(ratios), "encode_ratio_min": ratios[0],
                         "encode_ratio_max": ratios[-1], "decode_vs_turboquant": statistics.median(dec_ratios)})
            print(rows[-1], flush=True)
    columns = [("bits", "bits", "d"), ("spec", "spec", ""), ("bytes", "B", "d"),
               ("encode_vectors_per_s", "encode vec/s", ".0f"), ("encode_vs_turboquant", "encode vs TQ", ".2f"),
               ("encode_ratio_min", "min", ".2f"), ("encode_ratio_max", "max", ".2f"),
               ("decode_vectors_per_s", "decode vec/s", ".0f"), ("decode_vs_turboquant", "decode vs TQ", ".2f")]
    print(format_table(rows, columns, markdown=True))
    print(f"wrote {write_json(results_dir(args.out) / 'lattice_encode_speed.json', {'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
