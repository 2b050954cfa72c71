"""`fibquant data fetch|list`, `fibquant eval canonical-source`, `fibquant eval multiple-choice`: real text and tasks.

Only argument parsing and calls into fibquant.data / fibquant.eval live here.
"""
from __future__ import annotations

import argparse
import functools
import sys

from ._common import (add_list_argument, add_model_argument, add_out_argument, add_specs_argument, add_text_argument,
                      add_threads_argument, apply_threads, run_experiment)


def _reports_unavailable_data(func):
    """Print a fetch failure (package/sdist unavailable: a RuntimeError) as one clear line, exit 1."""
    @functools.wraps(func)
    def wrapper(args) -> int:
        from fibquant.data.bigbench import TaskUnavailableError
        from fibquant.data.text import TextUnavailableError

        try:
            return func(args)
        except (TextUnavailableError, TaskUnavailableError) as exc:
            print(f"fibquant: error: {exc}", file=sys.stderr)
            return 1
    return wrapper


# --------------------------------------------------------------------------- data

def register(subparsers) -> None:
    data = subparsers.add_parser("data", help="fetch and list the real texts and BIG-bench tasks")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    fetch = data_sub.add_parser("fetch", help="download and cache texts (apt-get download) and/or BIG-bench tasks")
    fetch.add_argument("--texts", action="store_true", help="fetch all texts (the default when nothing is named)")
    fetch.add_argument("--bigbench", nargs="+", metavar="TASK", default=[],
                       help="BIG-bench tasks to fetch, e.g. goal_step_wikihow (downloads the 358 MB sdist once)")
    fetch.set_defaults(func=_fetch)
    listing = data_sub.add_parser("list", help="list the available texts and the cached BIG-bench tasks")
    listing.set_defaults(func=_list)


@_reports_unavailable_data
def _fetch(args) -> int:
    from fibquant.data.bigbench import load_bigbench_task
    from fibquant.data.text import list_texts, load_text, paragraphs

    if args.texts or not args.bigbench:
        for name in list_texts():
            text = load_text(name)
            print(f"{name:24s} {len(text):>9,d} characters {len(paragraphs(text)):>6,d} paragraphs")
    for task in args.bigbench:
        examples = load_bigbench_task(task)
        subtasks = sorted({e.subtask for e in examples})
        print(f"{task}: {len(examples)} multiple-choice examples ({', '.join(subtasks)})")
    return 0


def _list(args) -> int:
    from fibquant.data.bigbench import bigbench_cache_dir, cached_tasks
    from fibquant.data.text import CLEANING_VERSION, TEXTS, text_cache_dir

    folder = text_cache_dir()
    print(f"texts (cache {folder}):")
    for name, source in TEXTS.items():
        cached = (folder / f"{name}.{CLEANING_VERSION}.txt").is_file()
        print(f"  {name:24s} {source.title} ({source.author}), Debian {source.package} "
              f"object {source.r_object}{'  [cached]' if cached else ''}")
    tasks = cached_tasks()
    print(f"BIG-bench tasks cached in {bigbench_cache_dir()}: {', '.join(tasks) if tasks else 'none'}")
    return 0


# --------------------------------------------------------------------------- eval

def register_eval(eval_subparsers) -> None:
    canonical = eval_subparsers.add_parser(
        "canonical-source", help="the canonical source on real KV: KS test of k-block radii, rotated vs not")
    add_canonical_arguments(canonical)
    canonical.set_defaults(func=run_canonical_command)
    mc = eval_subparsers.add_parser(
        "multiple-choice", help="multiple-choice acc / acc_norm, fp vs compressed caches")
    add_mc_arguments(mc)
    mc.set_defaults(func=run_mc_command)


def _model_run_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    add_out_argument(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_threads_argument(parser)


def add_canonical_arguments(parser: argparse.ArgumentParser) -> None:
    add_text_argument(parser)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the novel to run")
    parser.add_argument("--offset", type=int, default=0, help="first token of the excerpt")
    add_list_argument(parser, "--layers", default=[0, 7, 15, 29], help="layer indices")
    add_list_argument(parser, "--block-sizes", default=[1, 2, 4, 8], metavar="K", help="block sizes k")
    _model_run_arguments(parser)


@_reports_unavailable_data
def run_canonical_command(args) -> int:
    from fibquant.eval.canonical_source import CanonicalConfig
    from fibquant.kv.model import load_model

    config = CanonicalConfig(text=args.text, tokens=args.tokens, offset=args.offset, layers=tuple(args.layers),
                             block_sizes=tuple(args.block_sizes), seed=args.seed)
    apply_threads(args)
    run_experiment("canonical-source", config, args.out, model_and_tokenizer=load_model(args.model),
                   progress=not args.no_progress)
    return 0


def add_mc_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default="goal_step_wikihow", help="BIG-bench task (or task/subtask)")
    parser.add_argument("--limit", type=int, default=200, help="examples (seeded sample; 0 = all)")
    add_list_argument(parser, "--bits", type=float, default=[4.0, 2.0], metavar="B",
                      help="FibQuant bits per coordinate for keys and values")
    add_specs_argument(parser, default=[],
                       help="extra cache codecs to compare, e.g. turboquant:b=2 int:b=4 (see fibquant.codecs.registry)")
    parser.add_argument("--sink-tokens", type=int, default=4, help="exact sink tokens of the standard window")
    parser.add_argument("--recent-tokens", type=int, default=32, help="exact recent tokens of the standard window")
    parser.add_argument("--small-window", type=int, nargs=2, default=[0, 0], metavar=("SINK", "RECENT"),
                        help="also run every rate with this small window (contexts are short)")
    parser.add_argument("--no-small-window", action="store_true", help="skip the small-window runs")
    _model_run_arguments(parser)


@_reports_unavailable_data
def run_mc_command(args) -> int:
    from fibquant.eval.multiple_choice import MultipleChoiceConfig
    from fibquant.kv.model import load_model

    if args.limit < 0:
        raise ValueError(f"--limit must be >= 0 (0 = all examples), got {args.limit}")
    config = MultipleChoiceConfig(task=args.task, limit=args.limit or None, bits=tuple(args.bits),
                                  caches=tuple(args.caches), sink_tokens=args.sink_tokens,
                                  recent_tokens=args.recent_tokens, seed=args.seed,
                                  small_window=None if args.no_small_window else tuple(args.small_window))
    apply_threads(args)
    run_experiment("multiple-choice", config, args.out, model_and_tokenizer=load_model(args.model), progress=not args.no_progress)
    return 0
