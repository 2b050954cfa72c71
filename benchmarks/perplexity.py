"""Experiment 3 (FibQuant paper 4.3): perplexity with the compressed cache in the loop.

Usage: .venv/bin/python benchmarks/perplexity.py [--tokens 20480] [--text emma] [--context 1024]
       [--chunk 32] [--batch-size 4] [--caches 'fp;fibquant:b=4;...'] [--build-codebooks]
Prints the table and target checks; writes results/perplexity.json and .png.
Same as `fibquant eval perplexity`.
"""
import sys

from fibquant.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "perplexity", *sys.argv[1:]]))
