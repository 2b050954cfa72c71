"""Decode step of CompressedCache (attention on codes) vs DynamicCache, steps interleaved.

Usage: .venv/bin/python benchmarks/decode_step_interleaved.py [--contexts 1024 2048 4096 8192]
       [--bits 4 2] [--steps 24] [--text emma] [--out results/] [--codecs fibrvq:b=2 ...] [--repeats 1]
       [--compare e8shell:b=2/fibquant:b=2 ...]

A shorthand for the decode part of `fibquant eval decode-speed` (`fibquant.eval.decode_speed`,
whose decode steps are interleaved: every cache takes one greedy step per round, so all caches
see the same machine state): caches fp + fibquant:b=B for each --bits + the --codecs specs,
--steps rounds, 1 torch thread. --repeats N runs it N times (results/decode_speed_interleaved_<i>.json)
and prints the spread of each ratio over the runs. --compare A/B prints, per context and run, cache A's
step against cache B's of the same run: the ratio of the median steps (wall, CPU) and the paired ratio
(median over the rounds of A's step / B's step in the same round, wall and CPU).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from fibquant.cli import main as cli_main
from fibquant.eval.decode_speed.steps import paired_ratio
from fibquant.paths import results_dir

RATIOS = {"decode_vs_dynamic": "wall", "decode_cpu_vs_dynamic": "CPU", "decode_paired_vs_dynamic": "paired",
          "decode_cpu_paired_vs_dynamic": "CPU paired"}


def compare(run: dict, a: str, b: str, tokens: int) -> dict | None:
    """Cache a's decode step against cache b's in one decode-speed payload at one context: the ratios of the
    median steps (wall, CPU), the paired ratios (wall, CPU: median over the rounds of a's step / b's step of
    the same round) and the ratio of the mean steps (which include the steps that encode leaving tokens);
    None when either row is missing."""
    rows = {(r["tokens"], r["cache"]): r for r in run["rows"]}
    ra, rb = rows.get((tokens, a)), rows.get((tokens, b))
    if ra is None or rb is None:
        return None
    return {"median": ra["decode_ms_median"] / rb["decode_ms_median"],
            "cpu_median": ra["decode_cpu_ms_median"] / rb["decode_cpu_ms_median"],
            "paired": paired_ratio(ra["step_ms"], rb["step_ms"]),
            "cpu_paired": paired_ratio(ra["step_cpu_ms"], rb["step_cpu_ms"]),
            "mean": ra["decode_ms_mean"] / rb["decode_ms_mean"],
            "a_ms": ra["decode_ms_median"], "b_ms": rb["decode_ms_median"]}


def compare_lines(run: dict, pairs: list[tuple[str, str]]) -> list[str]:
    """One line per context and pair of `compare`."""
    lines = []
    for tokens in sorted({r["tokens"] for r in run["rows"]}):
        for a, b in pairs:
            c = compare(run, a, b, tokens)
            if c is None:
                lines.append(f"{tokens:>6} {a} / {b}: missing")
                continue
            cells = " ".join(f"{c[k]:.3f}" for k in ("median", "cpu_median", "paired", "cpu_paired", "mean"))
            lines.append(f"{tokens:>6} {a} / {b}: {cells}  ({c['a_ms']:.1f} / {c['b_ms']:.1f} ms)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--bits", type=float, nargs="+", default=[4.0, 2.0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--codecs", nargs="*", default=[], help="other caches of ours, e.g. fibrvq:b=2")
    parser.add_argument("--text", default="emma")
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=1, help="whole runs, one after another")
    parser.add_argument("--compare", nargs="*", default=[], metavar="A/B",
                        help="cache A's step against cache B's of the same run, e.g. e8shell:b=2/fibquant:b=2")
    args = parser.parse_args()
    pairs = [tuple(text.split("/", 1)) for text in args.compare]
    if any(len(pair) != 2 for pair in pairs):
        parser.error("--compare takes A/B pairs of cache specs")
    caches = ["fp", *(f"fibquant:b={b:g}" for b in args.bits), *args.codecs]
    out = results_dir(args.out)
    runs = []
    for index in range(args.repeats):
        stem = "decode_speed_interleaved" + (f"_{index}" if args.repeats > 1 else "")
        code = cli_main(["eval", "decode-speed", "--parts", "decode", "--threads", "1", "--no-progress",
                         "--decode-tokens", str(args.steps), "--text", args.text, "--out", str(out / stem),
                         "--contexts", *map(str, args.contexts), "--caches", *caches])
        if code:
            return code
        runs.append(json.loads((out / stem / "decode_speed.json").read_text()))
    if pairs:
        print("\nstep of A / step of B (same run): median steps wall, CPU; paired wall, CPU; mean steps wall")
        for index, run in enumerate(runs):
            for line in compare_lines(run, pairs):
                print(f"run {index} {line}")
    if args.repeats > 1:
        print(f"\nspread over {args.repeats} runs (min / median / max):")
        keys = sorted({(r["tokens"], r["cache"]) for run in runs for r in run["rows"] if r["kind"] != "dynamic"})
        for tokens, cache in keys:
            rows = [r for run in runs for r in run["rows"] if (r["tokens"], r["cache"]) == (tokens, cache)]
            cells = []
            for key, label in RATIOS.items():
                values = [r[key] for r in rows if r.get(key) is not None]
                if values:
                    cells.append(f"{label} {min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}")
            print(f"{tokens:>6} {cache:>14}  " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
