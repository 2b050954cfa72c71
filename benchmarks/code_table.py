"""The measured code table that `fibquant.choose_code` ships with: attention error per shipped code on the
default model (fibquant.eval.code_table), written to src/fibquant/kv/code_table.json.

    .venv/bin/python benchmarks/code_table.py [--tokens 512] [--query-stride 4] [--out PATH]

About 2-4 minutes on 2 CPU cores (one capture, ~50 codec round trips of every layer's keys and values).
"""
from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default="emma")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--query-stride", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "src" / "fibquant" / "kv" / "code_table.json")
    args = parser.parse_args()

    from fibquant.eval.code_table import write_table
    from fibquant.kv.model import load_model

    model, tokenizer = load_model()
    print(write_table(args.out, model, tokenizer, args.text, args.tokens, args.query_stride))


if __name__ == "__main__":
    main()
