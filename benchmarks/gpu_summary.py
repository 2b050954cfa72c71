"""One-screen summary of a `benchmarks/gpu_check.sh` run, with the GPU targets checked.

Reads OUT_DIR/gpu_tests.log, gpu_decode_attention.json and gpu_generate.json (whichever exist), prints
the tables and the targets, and writes OUT_DIR/gpu_summary.json. Targets (docs/gpu.md):

    decode attention at 32k tokens, batch 16: fused codes <= 1.0x bf16 SDPA at 4 bits, <= 0.6x at 2 bits
    peak memory of attention on codes: <= 5 % of the codes above them (never a float K/V of the context)

Usage: python benchmarks/gpu_summary.py OUT_DIR
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

SPEED_TARGETS = {"fibquant:b=4": 1.0, "fibquant:b=2": 0.6}  # max ms ratio to sdpa-bf16 at 32k, batch 16
TARGET_SHAPE = (32768, 16)
PEAK_TARGET = 0.05


def write_rows(path: Path, info: dict, rows: list[dict]) -> None:
    """A benchmark's {"info", "rows"} JSON at `path` (folders created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"info": info, "rows": rows}, indent=2))
    print(f"wrote {path}")


def test_counts(log: Path) -> dict:
    """Pytest's final counts ({'passed': n, 'failed': n, ...}) from its log, or {} without one."""
    if not log.exists():
        return {}
    lines = [line for line in log.read_text(errors="replace").splitlines() if re.search(r"\d+ (passed|failed)", line)]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", lines[-1])} \
        if lines else {}


def attention_targets(rows: list[dict]) -> list[dict]:
    """The speed and peak-memory targets checked on the decode-attention rows."""
    checks = []
    for name, limit in SPEED_TARGETS.items():
        row = next((r for r in rows if r["variant"] == f"{name}-fused"
                    and (r["context"], r["batch"]) == TARGET_SHAPE), None)
        if row is not None:
            checks.append({"target": f"{name} fused at 32k, B=16 <= {limit}x sdpa-bf16",
                           "value": round(row["ms_vs_sdpa"], 3), "met": row["ms_vs_sdpa"] <= limit})
    coded = [r for r in rows if r["variant"].endswith(("-fused", "-paged")) and r.get("peak_vs_kv") is not None]
    if coded:
        worst = max(coded, key=lambda r: r["peak_vs_kv"])
        checks.append({"target": f"peak above the codes <= {PEAK_TARGET:.0%} of them (worst row)",
                       "value": round(worst["peak_vs_kv"], 4), "met": worst["peak_vs_kv"] <= PEAK_TARGET,
                       "row": f"{worst['variant']} M={worst['context']} B={worst['batch']}"})
    return checks


def print_attention(rows: list[dict]) -> None:
    print(f"{'M':>7} {'B':>3} {'variant':22} {'ms':>9} {'x sdpa':>7} {'peak/kv':>8} {'max|err|':>9}")
    for r in rows:
        if r["variant"].endswith("-ref"):
            continue
        peak = "-" if r.get("peak_vs_kv") is None else f"{r['peak_vs_kv']:.3f}"
        err = "-" if r["max_abs_err"] is None else f"{r['max_abs_err']:.1e}"
        print(f"{r['context']:7d} {r['batch']:3d} {r['variant']:22} {r['ms']:9.3f} {r['ms_vs_sdpa']:7.2f} {peak:>8} "
              f"{err:>9}")


def print_generate(rows: list[dict]) -> None:
    print(f"{'cache':14} {'TTFT ms':>9} {'x fp':>6} {'decode tok/s':>13} {'x fp':>6} {'peak MiB':>9} {'cache MiB':>10}")
    for r in rows:
        print(f"{r['cache']:14} {r['ttft_ms']:9.1f} {r['ttft_vs_fp']:6.2f} {r['decode_tok_s']:13.1f} "
              f"{r['decode_vs_fp']:6.2f} {r['peak_delta_bytes'] / 2**20:9.0f} {r['cache_bytes'] / 2**20:10.1f}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "results")
    summary = {"tests": test_counts(out / "gpu_tests.log"), "targets": []}
    print(f"== GPU check summary ({out}) ==")
    info = out / "gpu_info.txt"
    if info.exists():
        print(info.read_text().strip())
    print("CUDA tests:", summary["tests"] or "no log")
    attention = out / "gpu_decode_attention.json"
    if attention.exists():
        rows = json.loads(attention.read_text())["rows"]
        print_attention(rows)
        summary["targets"] += attention_targets(rows)
    generate = out / "gpu_generate.json"
    if generate.exists():
        data = json.loads(generate.read_text())
        print(f"generate: {data['info']['layers']} layers, hidden {data['info']['hidden']}, "
              f"context {data['info']['context']}, {data['info']['decode_tokens']} decode tokens")
        print_generate(data["rows"])
        summary["generate"] = data["rows"]
    for check in summary["targets"]:
        print(f"{'MET ' if check['met'] else 'MISS'} {check['target']}: {check['value']}")
    (out / "gpu_summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
