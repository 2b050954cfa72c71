"""Experiment 2 (FibQuant paper 4.2): attention-output cosine vs compression ratio on real K/V.

Usage: .venv/bin/python benchmarks/fidelity.py [--tokens 1024] [--text emma]
       [--calibration-text persuasion] [--layers 0,5,10] [--query-stride 1]
       [--sink-tokens 0 --recent-tokens 0] [--caches 'fp;fibquant:k=64,n=4096;...'] [--build-codebooks]
Prints the table and target checks; writes results/attention_fidelity*.json and .png.
Same as `fibquant eval fidelity`.
"""
import sys

from fibquant.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "fidelity", *sys.argv[1:]]))
