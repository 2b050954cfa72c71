"""Every method and peer, one list of cache specs, on attention fidelity, perplexity and needle retrieval.

Usage: .venv/bin/python benchmarks/peers.py [--quick] [--caches 'fp;fibquant:b=2;quanto-rt:b=2'] [--threads 1]
       [--fidelity-tokens 512 --query-stride 4 --ppl-tokens 2048 --lengths 1024 2048 --keys 1]
Prints one table per metric and the targets; writes results/peers/peers.json, peers_<metric>.md/.png.
Same as `fibquant eval peers`.
"""
import sys

from fibquant.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "peers", *sys.argv[1:]]))
