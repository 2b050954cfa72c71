"""Model reach: probe every decoder family (fibquant.eval.model_reach) and write the reach table
docs/models.md plus results/model_reach.json (every probe's full result).

    .venv/bin/python benchmarks/model_reach.py [--families Llama "Gemma 2" ...] [--doc docs/models.md] [--out DIR]

Takes ~15-30 s on 2 CPU cores (one tiny random model per family, one torch thread).
"""
from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python benchmarks/model_reach.py"


def _commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src/fibquant"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return commit + (" + uncommitted changes under src/fibquant" if dirty else "")


def main(argv=None) -> int:
    import torch
    import transformers

    from fibquant.eval.model_reach import FAMILIES, probe_all, render_markdown
    from fibquant.eval.report import write_json
    from fibquant.paths import results_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), help="only these (default: every family)")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "models.md"), help="where the table goes ('' = nowhere)")
    parser.add_argument("--out", default=None, help="results directory (default: results/ or $FIBQUANT_RESULTS_DIR)")
    args = parser.parse_args(argv)

    results = probe_all(args.families)
    provenance = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  "transformers": transformers.__version__, "torch": torch.__version__, "commit": _commit()}
    for r in results:
        print(f"{r['family']:16s} {r['status']:16s} codes-vs-decode {r['logits_rel_codes_vs_decode']} "
              f"{r['seconds']:.1f} s  {r['reason'][:160]}")
    path = write_json(results_dir(args.out) / "model_reach.json", {"provenance": provenance, "results": results})
    print(f"wrote {path}")
    if args.doc and not args.families:
        Path(args.doc).write_text(render_markdown(results, COMMAND, provenance))
        print(f"wrote {args.doc}")
    return 1 if any(r["status"] == "error" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
