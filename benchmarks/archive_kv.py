"""Saved-cache benchmarks: prefix-reuse TTFT, the 8k-token store targets (open, one-token read,
bytes) and code-stream search, single and batched (= `fibquant eval archive-kv`). Every part is
printed as a table next to its target, with the machine's load average.

    .venv/bin/python benchmarks/archive_kv.py --threads 1 --parts ttft,search,store --search-sizes 100000,900000
    .venv/bin/python benchmarks/archive_kv.py --threads 1 --parts study --name archive_kv_study
"""
import sys

from fibquant.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "archive-kv", *sys.argv[1:]]))
