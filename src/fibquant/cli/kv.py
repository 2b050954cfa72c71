"""`fibquant demo`, `fibquant eval fidelity`, `fibquant eval perplexity`: argument parsing only."""
from __future__ import annotations

import argparse

from ._common import (add_list_argument, add_out_argument, add_specs_argument, add_text_argument,
                      add_threads_argument, apply_threads, run_experiment)

METHODS_HELP = "codec specs, e.g. fp fibquant:k=64,n=4096 turboquant:b=2 (see fibquant.codecs.registry)"


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="compressed KV cache on the default model and a novel (a few minutes on 2 cores)")
    add_text_argument(parser, help="novel to run on (fibquant data list)")
    parser.add_argument("--sink-tokens", type=int, default=4, help="exact sinks of the perplexity runs")
    parser.add_argument("--recent-tokens", type=int, default=32, help="exact recent tokens of the perplexity runs")
    add_out_argument(parser)
    add_threads_argument(parser)
    parser.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from fibquant.eval.demo import DemoConfig

    config = DemoConfig(text=args.text, sink_tokens=args.sink_tokens, recent_tokens=args.recent_tokens)
    apply_threads(args)
    run_experiment("demo", config, args.out)
    return 0


def register_eval(eval_subparsers) -> None:
    fidelity = eval_subparsers.add_parser("fidelity", help="attention-output fidelity frontier (paper 4.2)")
    add_text_argument(fidelity)
    fidelity.add_argument("--calibration-text", default="persuasion", help="novel for the calibrated fits (low-rank, RVQ)")
    fidelity.add_argument("--tokens", type=int, default=1024)
    add_list_argument(fidelity, "--layers", help="layer indices (default: all)")
    fidelity.add_argument("--query-stride", type=int, default=1)
    fidelity.add_argument("--sink-tokens", type=int, default=0, help="exact sinks per query (default 0)")
    fidelity.add_argument("--recent-tokens", type=int, default=0, help="exact recent tokens per query (default 0)")
    fidelity.add_argument("--centre", action="store_true",
                          help="calibration-free codecs quantise keys/values minus their (layer, head) mean")
    add_specs_argument(fidelity, help=METHODS_HELP)
    fidelity.add_argument("--build-codebooks", action="store_true",
                          help="build FibQuant codebooks that are neither shipped nor cached (can be slow)")
    add_out_argument(fidelity)
    add_threads_argument(fidelity)
    fidelity.set_defaults(func=_fidelity)

    perplexity = eval_subparsers.add_parser("perplexity", help="perplexity with the compressed cache (paper 4.3)")
    add_text_argument(perplexity)
    perplexity.add_argument("--tokens", type=int, default=20480)
    perplexity.add_argument("--context", type=int, default=1024)
    perplexity.add_argument("--chunk", type=int, default=32)
    perplexity.add_argument("--batch-size", type=int, default=4)
    add_specs_argument(perplexity, help=METHODS_HELP)
    perplexity.add_argument("--build-codebooks", action="store_true")
    perplexity.add_argument("--attention", choices=("codes", "decode"), default="codes",
                            help="attention on the codes (default) or decode the cache every step (reference)")
    perplexity.add_argument("--centre", action="store_true",
                            help="quantise keys/values minus a per-layer, per-head mean fixed at the first encode")
    add_out_argument(perplexity)
    add_threads_argument(perplexity)
    perplexity.set_defaults(func=_perplexity)


def _fidelity(args: argparse.Namespace) -> int:
    from fibquant.eval.fidelity import FidelityConfig

    layers = None if args.layers is None else tuple(args.layers)
    config = FidelityConfig(text=args.text, calibration_text=args.calibration_text, tokens=args.tokens,
                            layers=layers, query_stride=args.query_stride, sink_tokens=args.sink_tokens,
                            recent_tokens=args.recent_tokens, centre=args.centre)
    apply_threads(args)
    run_experiment("fidelity", config, args.out, caches=args.caches, build_codebooks=args.build_codebooks)
    return 0


def _perplexity(args: argparse.Namespace) -> int:
    from fibquant.eval.perplexity import PerplexityConfig

    config = PerplexityConfig(text=args.text, tokens=args.tokens, context=args.context, chunk=args.chunk,
                              batch_size=args.batch_size, attention=args.attention, centre=args.centre)
    apply_threads(args)
    run_experiment("perplexity", config, args.out, caches=args.caches, build_codebooks=args.build_codebooks)
    return 0
