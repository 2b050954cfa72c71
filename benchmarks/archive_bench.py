"""Fractal archive benchmark: encode, random access, append, search and bits/symbol of the
archive (exact and float variants) against raw numpy, numpy bit packing, seekable zstd
(levels 3 and 19), a sorted-key index and a suffix array, on 1M-symbol uniform and Zipf
streams (N = 16, 256, 4096) and 1M characters of Jane Austen.

    .venv/bin/python benchmarks/archive_bench.py            # full run (a few minutes on 2 cores)
    .venv/bin/python benchmarks/archive_bench.py --quick    # 10^5 symbols, seconds

Writes results/archive/archive_bench.{json,md,png} and prints the table. Same as
`fibquant eval archive-bench`; the work is done by fibquant.eval.archive.bench.
"""
import sys

from fibquant.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "archive-bench", *sys.argv[1:]]))
