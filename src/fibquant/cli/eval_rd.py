"""`fibquant eval rd`: the rate-distortion benchmark (table, JSON and PNG under --out)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ._threads import add_threads_argument, apply_threads


def register_eval(eval_subparsers) -> None:
    parser = eval_subparsers.add_parser(
        "rd", help="rate-distortion of FibQuant vs TurboQuant vs INT on the canonical source")
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="d=64 only (unless --dims), for_rate codebooks only, fewer vectors")
    parser.add_argument("--dims", type=int, nargs="+", default=None, help="dimensions (default 64 128)")
    parser.add_argument("--vectors", type=int, default=None, help="fresh test vectors per dimension")
    parser.add_argument("--seed", type=int, default=0, help="codebook / rotation seed")
    parser.add_argument("--no-build", action="store_true",
                        help="use only shipped or cached codebooks (implied by --quick)")
    parser.add_argument("--max-codewords", type=int, default=None,
                        help="skip FibQuant codebooks larger than this (they take long to build)")
    parser.add_argument("--out", type=Path, default=Path("results"), help="output folder")
    add_threads_argument(parser)


def run(args: argparse.Namespace) -> int:
    from ..eval.rate_distortion import (RDConfig, format_report, quick_config, run_rate_distortion,
                                        write_outputs)

    if args.quick:
        config = quick_config(tuple(args.dims or (64,)), args.seed)
    else:
        config = RDConfig(dims=tuple(args.dims or (64, 128)), seed=args.seed)
    if args.vectors is not None:
        config = RDConfig(**{**config.__dict__, "n_vectors": args.vectors})
    if args.no_build:
        config = RDConfig(**{**config.__dict__, "build_missing": False})
    if args.max_codewords is not None:
        config = RDConfig(**{**config.__dict__, "max_codewords": args.max_codewords})
    apply_threads(args)
    report = run_rate_distortion(config)
    print(format_report(report))
    json_path, png_path = write_outputs(report, args.out)
    print(f"wrote {json_path} and {png_path}")
    return 0
