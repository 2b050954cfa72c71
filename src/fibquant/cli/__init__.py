"""Command-line interface: parses arguments and calls the public API, nothing more.

Each command group lives in its own module exposing `register(subparsers)` (top-level
commands) and/or `register_eval(eval_subparsers)` (under `fibquant eval`). A parser sets
`func` to a callable taking the parsed namespace and returning an exit code. Arguments
shared by several commands (`--caches`, `--out`, `--text`, `--model`, `--threads`) are
defined once in `_common`; experiments run through `_common.run_experiment`.
"""
from __future__ import annotations

import argparse
import importlib
import sys


# Modules contributing commands; each owns its own arguments.
_COMMAND_MODULES = (
    "fibquant.cli.codebook",   # fibquant codebook build|info
    "fibquant.cli.eval_rd",    # fibquant eval rate-distortion
    "fibquant.cli.kv",         # fibquant demo, fibquant eval fidelity|perplexity
    "fibquant.cli.realdata",   # fibquant eval canonical-source|mc, fibquant data fetch
    "fibquant.cli.archive",    # fibquant archive pack|get|search|info, fibquant eval archive-bench
    "fibquant.cli.speed",      # fibquant eval decode-speed
    "fibquant.cli.cache",      # fibquant cache save|info|generate, fibquant eval archive-kv
    "fibquant.cli.needle",     # fibquant eval needle
    "fibquant.cli.peers",      # fibquant eval peers
    "fibquant.cli.model",      # fibquant model export-hf
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fibquant",
        description="Compress, evaluate, store and search transformer KV caches (FibQuant and baselines).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    eval_parser = sub.add_parser("eval", help="run an evaluation / benchmark")
    eval_sub = eval_parser.add_subparsers(dest="experiment", required=True)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            raise ImportError(f"fibquant command module {name} cannot be imported: {exc}") from exc
        registers = [getattr(module, f, None) for f in ("register", "register_eval")]
        if not any(registers):
            raise TypeError(f"fibquant command module {name} defines neither register nor register_eval")
        if registers[0]:
            registers[0](sub)
        if registers[1]:
            registers[1](eval_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # bad input: a clear message, no traceback
        print(f"fibquant: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
