"""Experiment 4: multiple-choice acc / acc_norm on BIG-bench goal_step_wikihow, fp against
FibQuant-compressed KV caches (table on stdout, results/multiple_choice.json and .png).

    .venv/bin/python benchmarks/multiple_choice.py [--limit 200 --bits 4 2 --small-window 0 0]

Same as `fibquant eval multiple-choice`; the work is done by fibquant.eval.multiple_choice.
"""
import argparse
import sys

from fibquant.cli.realdata import add_mc_arguments, run_mc_command

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mc_arguments(parser)
    sys.exit(run_mc_command(parser.parse_args()))
