"""Rate-distortion benchmark: FibQuant vs TurboQuant vs INT on the canonical source.

    python benchmarks/rate_distortion.py [--quick] [--dims 64 128] [--out results/]

Same as `fibquant eval rate-distortion`. Prints the table and its targets at d = 64 (MSE vs TurboQuant,
sub-one-bit MSE, encode/decode throughput; see fibquant.eval.rate_distortion), writes
results/rate_distortion.json and results/rate_distortion.png.
"""
import argparse
import sys

from fibquant.cli.eval_rd import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
