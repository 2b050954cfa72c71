"""`--threads N` for every command that runs torch work: one default, one place that applies it.

torch's own default (one thread per core) is often many times slower than a few threads on a
shared machine, so the CLI picks half the cores, at most 8, unless told otherwise.
"""
from __future__ import annotations

import argparse
import os
import sys


def default_threads() -> int:
    """max(1, min(8, cores // 2)): the thread count a command uses when --threads is not given."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """Add `--threads N` (default None: `default_threads()` when applied)."""
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help=f"torch CPU threads (default: half the cores, at most 8; {default_threads()} here)")


def apply_threads(args: argparse.Namespace) -> int:
    """Set torch's intra-op thread count from `args.threads` (or the default), say so on stderr.

    Raises ValueError for a count below 1. Returns the count set.
    """
    threads = getattr(args, "threads", None)
    threads = default_threads() if threads is None else threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)
    print(f"threads: {threads}", file=sys.stderr, flush=True)
    return threads
