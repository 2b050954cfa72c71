"""`fibquant eval needle`: passkey retrieval in a long Austen haystack, each cache compressing it."""
from __future__ import annotations

import argparse

from ._common import (add_list_argument, add_out_argument, add_specs_argument, add_text_argument, add_threads_argument,
                      apply_threads, run_experiment)


def register_eval(eval_subparsers) -> None:
    from fibquant.eval.needle import TASKS, NeedleConfig

    defaults = NeedleConfig()
    parser = eval_subparsers.add_parser(
        "needle", help="long-context passkey retrieval: accuracy per length and depth, fp vs compressed caches")
    add_text_argument(parser, defaults.text, help="novel for the haystack")
    add_list_argument(parser, "--lengths", default=list(defaults.lengths),
                      help="haystack lengths in tokens, at most the model's context (8192 for SmolLM2; at the "
                           "limit the haystack is shortened to leave room for the question and answer) "
                           "(default: 1024 2048)")
    add_list_argument(parser, "--depths", type=float, default=list(defaults.depths), metavar="D",
                      help="needle depths in [0, 1] (default: 0 0.25 0.5 0.75 1)")
    parser.add_argument("--keys", type=int, default=defaults.keys_per_cell,
                        help="random keys (and haystack offsets) per (length, depth)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--sink-tokens", type=int, default=defaults.sink_tokens)
    parser.add_argument("--recent-tokens", type=int, default=defaults.recent_tokens)
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--attention", choices=("codes", "decode"), default=defaults.attention)
    parser.add_argument("--task", choices=TASKS, default=defaults.task,
                        help="passkey in the novel (default), or RULER's niah_single_1 built by lm-eval "
                             "(pip install 'fibquant[ruler]'; --keys samples per length, RULER's own depths)")
    add_specs_argument(parser,
                       help="cache specs, e.g. fp fibquant:b=2 fibquant:b=2/fibquant:b=1 quanto-rt:b=2 "
                            "(see fibquant.kv.specs; default: FibQuant, TurboQuant and every peer)")
    parser.add_argument("--build-codebooks", action="store_true",
                        help="build FibQuant codebooks that are neither shipped nor cached (can be slow)")
    parser.add_argument("--no-progress", action="store_true")
    add_out_argument(parser)
    add_threads_argument(parser)
    parser.set_defaults(func=_needle)


def _needle(args: argparse.Namespace) -> int:
    from fibquant.eval.needle import NeedleConfig

    config = NeedleConfig(text=args.text, lengths=tuple(args.lengths), depths=tuple(args.depths),
                          keys_per_cell=args.keys, seed=args.seed, sink_tokens=args.sink_tokens,
                          recent_tokens=args.recent_tokens, max_new_tokens=args.max_new_tokens,
                          attention=args.attention, task=args.task)
    apply_threads(args)
    run_experiment("needle", config, args.out, caches=args.caches, build_codebooks=args.build_codebooks,
                   progress=not args.no_progress)
    return 0
