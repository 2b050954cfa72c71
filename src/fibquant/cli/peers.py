"""`fibquant eval peers`: every method and peer on attention fidelity, perplexity and needle retrieval."""
from __future__ import annotations

import argparse

from ._common import (add_list_argument, add_out_argument, add_specs_argument, add_text_argument, add_threads_argument,
                      apply_threads, run_experiment)

SIZE_FLAGS = {  # flag dest -> PeersConfig field (None: the --quick / default size)
    "fidelity_tokens": "fidelity_tokens", "query_stride": "query_stride", "ppl_tokens": "ppl_tokens",
    "context": "context", "chunk": "chunk", "batch_size": "batch_size", "lengths": "lengths", "depths": "depths",
    "keys": "keys_per_cell", "max_new_tokens": "max_new_tokens",
}


def register_eval(eval_subparsers) -> None:
    from fibquant.eval.peers import METRICS, PeersConfig

    defaults, quick = PeersConfig(), PeersConfig.quick()
    parser = eval_subparsers.add_parser(
        "peers", help="every method and peer (one cache spec list) on attention fidelity, perplexity and needle "
                      "retrieval: one table and one plot per metric, one JSON (results/peers)")
    parser.add_argument("--quick", action="store_true",
                        help=f"small sizes (fidelity {quick.fidelity_tokens} tokens, perplexity {quick.ppl_tokens} "
                             f"tokens, needle {list(quick.lengths)} tokens at depth {list(quick.depths)}): minutes")
    add_list_argument(parser, "--metrics", type=str, default=list(METRICS), metavar="METRIC",
                      help=f"which of {' '.join(METRICS)} to run (default: all)")
    add_specs_argument(parser,
                       help="cache specs, e.g. fp fibquant:b=2 fibquant:b=4/fibquant:b=2 turboquant:b=2 quanto-rt:b=2 "
                            "(default: FibQuant, K/V rates, TurboQuant, INT and every peer)")
    add_text_argument(parser, defaults.text)
    parser.add_argument("--sink-tokens", type=int, default=defaults.sink_tokens)
    parser.add_argument("--recent-tokens", type=int, default=defaults.recent_tokens)
    parser.add_argument("--fidelity-tokens", type=int, default=None,
                        help=f"attention-fidelity span (default {defaults.fidelity_tokens})")
    parser.add_argument("--query-stride", type=int, default=None,
                        help=f"score every n-th query (default {defaults.query_stride})")
    parser.add_argument("--ppl-tokens", type=int, default=None,
                        help=f"perplexity tokens (default {defaults.ppl_tokens})")
    parser.add_argument("--context", type=int, default=None, help=f"perplexity window (default {defaults.context})")
    parser.add_argument("--chunk", type=int, default=None, help=f"perplexity chunk (default {defaults.chunk})")
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"perplexity windows per batch (default {defaults.batch_size})")
    add_list_argument(parser, "--lengths", default=None,
                      help=f"needle haystack lengths (default {' '.join(map(str, defaults.lengths))})")
    add_list_argument(parser, "--depths", type=float, default=None, metavar="D",
                      help=f"needle depths (default {' '.join(f'{d:g}' for d in defaults.depths)})")
    parser.add_argument("--keys", type=int, default=None,
                        help=f"needle keys per (length, depth) (default {defaults.keys_per_cell})")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--attention", choices=("codes", "decode"), default=defaults.attention)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    add_list_argument(parser, "--rotation-seeds", default=None, metavar="SEED",
                      help="run every codec that takes a rotation seed (fibquant, fibrvq, turboquant: spec key r=) "
                           "once per seed and report the mean and sd over the draws, e.g. 0 1 2 3; peers and fp "
                           "run once (default: each codec's own rotation, once)")
    parser.add_argument("--build-codebooks", action="store_true",
                        help="build FibQuant codebooks that are neither shipped nor cached (can be slow)")
    parser.add_argument("--no-progress", action="store_true")
    add_out_argument(parser, help="results folder (default: <$FIBQUANT_RESULTS_DIR or ./results>/peers)")
    add_threads_argument(parser)
    parser.set_defaults(func=_peers)


def config_from_args(args: argparse.Namespace):
    """The PeersConfig of the parsed arguments: --quick or the defaults, then every size flag given."""
    from fibquant.eval.peers import PeersConfig

    sizes = {field: (tuple(value) if isinstance(value, list) else value)
             for dest, field in SIZE_FLAGS.items() if (value := getattr(args, dest)) is not None}
    common = dict(text=args.text, metrics=tuple(args.metrics), sink_tokens=args.sink_tokens,
                  recent_tokens=args.recent_tokens, attention=args.attention, seed=args.seed,
                  rotation_seeds=tuple(args.rotation_seeds or ()))
    return PeersConfig.quick(**common, **sizes) if args.quick else PeersConfig(**common, **sizes)


def _peers(args: argparse.Namespace) -> int:
    from fibquant.paths import results_dir

    config = config_from_args(args)
    out = args.out if args.out is not None else results_dir(None, "peers")
    apply_threads(args)
    run_experiment("peers", config, out, caches=args.caches, build_codebooks=args.build_codebooks,
                   progress=not args.no_progress)
    return 0
