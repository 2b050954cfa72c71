"""Decode speed and memory of KV caches: DynamicCache vs CompressedCache (FibQuant / TurboQuant,
attention on codes and the decode path) vs transformers' QuantizedCache (quanto / hqq).

Usage: .venv/bin/python benchmarks/decode_speed.py [--contexts 1024 2048 4096 8192] [--decode-tokens 32]
       [--caches dynamic fibquant4 fibquant4-old quanto4 ...] [--threads N] [--out results/]
Prints the table; writes results/decode_speed.json and .png. Same as `fibquant eval speed`;
the work is done by fibquant.eval.decode_speed.
"""
import sys

from fibquant.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "speed", *sys.argv[1:]]))
