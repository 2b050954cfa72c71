"""Perplexity parity of the vLLM plugin with the transformers cache, span by span
(`fibquant.integrations.vllm.parity`: 4 sinks + 32 recent exact in both engines, chunks of 32).

Each engine runs on its own (they need different venvs; the transformers side needs no vLLM), writing
the mean token NLL per span and cache to a JSON file; --compare reads two such files and prints the
per-span and pooled increases and their differences in points.

Usage:
    PYTHONPATH=src python benchmarks/vllm_parity.py --engine transformers --dtype float32 --out tf.json
    OMP_NUM_THREADS=1 PYTHONPATH=src .venv-vllm/bin/python benchmarks/vllm_parity.py --engine vllm \
        --dtype float32 --out vllm32.json
    python benchmarks/vllm_parity.py --compare tf.json vllm32.json
Options: --offsets 45000 70000 ... (default PARITY_OFFSETS), --tokens 512, --chunk 32, --sinks 4,
--recent 32, --specs fibquant:b=4 fibquant:b=2, --threads 1.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time

BASE = "uncompressed"


def _measure(args) -> dict:
    import torch

    from fibquant.eval.kv_report import text_tokens
    from fibquant.integrations.vllm import parity
    from fibquant.kv.model import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(dtype=torch.float32 if args.engine == "vllm" else getattr(torch, args.dtype))
    spans = [text_tokens(tokenizer, parity.PARITY_TEXT, args.tokens, offset).tolist() for offset in args.offsets]
    out = {"engine": args.engine, "dtype": args.dtype,
           "offsets": args.offsets, "tokens": args.tokens, "chunk": args.chunk, "sinks": args.sinks,
           "recent": args.recent, "nll": {}}
    start = time.time()
    if args.engine == "transformers":
        for spec in [None, *args.specs]:
            out["nll"][spec or BASE] = parity.transformers_nll(model, spans, spec, args.chunk, args.sinks, args.recent)
    else:
        from fibquant.integrations.hf_export import export_hf

        del model
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = str(export_hf(tmp + "/model", dtype=args.dtype))
            for spec in [None, *args.specs]:
                out["nll"][spec or BASE] = parity.vllm_nll(model_dir, spans, spec, args.chunk, args.sinks, args.recent,
                                                           args.dtype)
    out["seconds"] = time.time() - start
    return out


def _increase(nll: list[float], base: list[float]) -> float:
    return math.exp((sum(nll) - sum(base)) / len(nll)) - 1.0


def _label(run: dict) -> str:
    window = (run.get("sinks", 4), run.get("recent", 32))  # older files: the default window
    return f"{run['engine']} {run['dtype']}" + ("" if window == (4, 32) else f" ({window[0]}+{window[1]} exact)")


def _compare(first: dict, second: dict) -> str:
    if first["offsets"] != second["offsets"] or first["tokens"] != second["tokens"]:
        raise ValueError("the two runs measured different spans")
    label = [_label(run) for run in (first, second)]
    lines = [f"| cache | span (offset) | {label[0]} | {label[1]} | difference (points) |",
             "| --- | --- | ---: | ---: | ---: |"]
    for spec in first["nll"]:
        if spec == BASE or spec not in second["nll"]:
            continue
        diffs = []
        for i, offset in enumerate(first["offsets"]):
            a = _increase([first["nll"][spec][i]], [first["nll"][BASE][i]])
            b = _increase([second["nll"][spec][i]], [second["nll"][BASE][i]])
            diffs.append(100 * (b - a))
            lines.append(f"| {spec} | {offset:,} | {100 * a:+.3f} % | {100 * b:+.3f} % | {diffs[-1]:+.3f} |")
        a, b = (_increase(run["nll"][spec], run["nll"][BASE]) for run in (first, second))
        mean = sum(diffs) / len(diffs)
        spread = math.sqrt(sum((d - mean) ** 2 for d in diffs) / max(len(diffs) - 1, 1))
        lines.append(f"| {spec} | pooled ({len(diffs)} spans) | {100 * a:+.3f} % | {100 * b:+.3f} % | "
                     f"**{100 * (b - a):+.3f}** (per-span mean {mean:+.3f}, sd {spread:.3f}) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from fibquant.integrations.vllm.parity import PARITY_OFFSETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["transformers", "vllm"])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"],
                        help="the model's dtype (default: bfloat16 in vLLM, float32 in transformers)")
    parser.add_argument("--offsets", type=int, nargs="+", default=list(PARITY_OFFSETS))
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--sinks", type=int, default=4, help="exact first tokens")
    parser.add_argument("--recent", type=int, default=32, help="exact recent tokens")
    parser.add_argument("--specs", nargs="+", default=["fibquant:b=4", "fibquant:b=2"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs=2, metavar="JSON")
    args = parser.parse_args(argv)
    if args.compare:
        runs = []
        for path in args.compare:
            with open(path) as handle:
                runs.append(json.load(handle))
        print(_compare(*runs))
        return
    if not args.engine or not args.out:
        parser.error("--engine and --out are needed (or --compare A B)")
    args.dtype = args.dtype or ("bfloat16" if args.engine == "vllm" else "float32")
    result = _measure(args)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "nll"}))


if __name__ == "__main__":
    main()
