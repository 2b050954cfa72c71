"""Experiment 1: KS statistics of k-block radii of real keys/values against the Beta law,
Haar-rotated vs not (table on stdout, results/canonical_source.json and .png).

    .venv/bin/python benchmarks/canonical_source.py [--text emma --tokens 1024 --layers 0 7 15 29]

Same as `fibquant eval canonical-source`; the work is done by fibquant.eval.canonical_source.
"""
import argparse
import sys

from fibquant.cli.realdata import add_canonical_arguments, run_canonical_command

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_canonical_arguments(parser)
    sys.exit(run_canonical_command(parser.parse_args()))
