"""`fibquant eval needle`: passkey retrieval in a long Austen haystack, each cache compressing it."""
from __future__ import annotations

import argparse

from ._threads import add_threads_argument, apply_threads


def _specs(text: str) -> list[str]:
    return [m.strip() for m in text.split(";") if m.strip()]


def register_eval(eval_subparsers) -> None:
    from fibquant.eval.needle import NeedleConfig

    defaults = NeedleConfig()
    parser = eval_subparsers.add_parser(
        "needle", help="long-context passkey retrieval: accuracy per length and depth, fp vs compressed caches")
    parser.add_argument("--text", default=defaults.text, help="novel for the haystack (default: emma)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(defaults.lengths),
                        help="haystack lengths in tokens (default: 1024 2048)")
    parser.add_argument("--depths", type=float, nargs="+", default=list(defaults.depths),
                        help="needle depths in [0, 1] (default: 0 0.25 0.5 0.75 1)")
    parser.add_argument("--keys", type=int, default=defaults.keys_per_cell,
                        help="random keys (and haystack offsets) per (length, depth)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--sink-tokens", type=int, default=defaults.sink_tokens)
    parser.add_argument("--recent-tokens", type=int, default=defaults.recent_tokens)
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--attention", choices=("codes", "decode"), default=defaults.attention)
    parser.add_argument("--caches", type=_specs, default=None,
                        help="';'-separated cache specs, e.g. 'fp;fibquant:b=2;fibquant:b=2/fibquant:b=1;quanto:b=2' "
                             "(see fibquant.eval.cache_specs; default: FibQuant, TurboQuant and every peer)")
    parser.add_argument("--build-codebooks", action="store_true",
                        help="build FibQuant codebooks that are neither shipped nor cached (can be slow)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", default=None, help="results folder (default $FIBQUANT_RESULTS_DIR or ./results)")
    add_threads_argument(parser)
    parser.set_defaults(func=_needle)


def _needle(args: argparse.Namespace) -> int:
    from fibquant.eval.needle import NeedleConfig, main_needle

    config = NeedleConfig(text=args.text, lengths=tuple(args.lengths), depths=tuple(args.depths),
                          keys_per_cell=args.keys, seed=args.seed, sink_tokens=args.sink_tokens,
                          recent_tokens=args.recent_tokens, max_new_tokens=args.max_new_tokens,
                          attention=args.attention)
    apply_threads(args)
    main_needle(config, args.caches, args.out, build_codebooks=args.build_codebooks, progress=not args.no_progress)
    return 0
