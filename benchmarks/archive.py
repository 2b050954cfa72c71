"""Fractal archive benchmark: encode, random access, append, search and bits/symbol of the
archive (exact and float variants) against raw numpy, numpy bit packing, seekable zstd
(levels 3 and 19), a sorted-key index and a suffix array, on 1M-symbol uniform and Zipf
streams (N = 16, 256, 4096) and 1M characters of Jane Austen.

    .venv/bin/python benchmarks/archive.py            # full run (a few minutes on 2 cores)
    .venv/bin/python benchmarks/archive.py --quick    # 10^5 symbols, seconds

Writes results/archive/archive_bench.{json,md,png} and prints the table.
"""
from __future__ import annotations

import argparse

from fibquant.eval.archive_bench import config_for, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10^5 symbols per stream, fewer lookups")
    parser.add_argument("--out", default="results/archive", help="output directory")
    args = parser.parse_args()
    run(config_for(args.quick), out_dir=args.out)


if __name__ == "__main__":
    main()
