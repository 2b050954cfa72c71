"""`fibquant eval rate-distortion`: the rate-distortion benchmark (table, JSON and PNG under --out)."""
from __future__ import annotations

import argparse
import dataclasses

from ._common import (add_list_argument, add_out_argument, add_threads_argument, apply_threads,
                      run_experiment)


def register_eval(eval_subparsers) -> None:
    parser = eval_subparsers.add_parser(
        "rate-distortion", help="rate-distortion of FibQuant vs TurboQuant vs INT on the canonical source")
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="d=64 only (unless --dims), for_rate codebooks only, fewer vectors")
    add_list_argument(parser, "--dims", help="dimensions (default 64 128)")
    parser.add_argument("--vectors", type=int, default=None, help="fresh test vectors per dimension")
    parser.add_argument("--seed", type=int, default=0, help="codebook / rotation seed")
    parser.add_argument("--no-build", action="store_true",
                        help="use only shipped or cached codebooks (implied by --quick)")
    parser.add_argument("--max-codewords", type=int, default=None,
                        help="skip FibQuant codebooks larger than this (they take long to build)")
    add_out_argument(parser)
    add_threads_argument(parser)


def config_from_args(args: argparse.Namespace):
    """The RDConfig the arguments ask for."""
    from fibquant.eval.rate_distortion import RDConfig, quick_config

    if args.quick:
        config = quick_config(tuple(args.dims or (64,)), args.seed)
    else:
        config = RDConfig(dims=tuple(args.dims or (64, 128)), seed=args.seed)
    changes = {}
    if args.vectors is not None:
        changes["n_vectors"] = args.vectors
    if args.no_build:
        changes["build_missing"] = False
    if args.max_codewords is not None:
        changes["max_codewords"] = args.max_codewords
    return dataclasses.replace(config, **changes)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    apply_threads(args)
    run_experiment("rate-distortion", config, args.out)
    return 0
