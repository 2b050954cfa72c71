"""Saved-cache benchmarks: prefix-reuse TTFT and code-stream search (= `fibquant eval archive-kv`).

    .venv/bin/python benchmarks/archive_kv.py --threads 1 [--prefix-tokens 1024 --suffix-tokens 16]
"""
import sys

from fibquant.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "archive-kv", *sys.argv[1:]]))
