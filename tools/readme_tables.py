"""Render the measured tables of README.md and docs/*.md from the committed results/*.json.

    python tools/readme_tables.py           # rewrite every marked block
    python tools/readme_tables.py --check   # exit 1 when a block differs from what the JSON renders

A block is the text between `<!-- table:NAME -->` and `<!-- /table:NAME -->`; NAME picks the renderer and
its JSON file (TABLES). tests/test_docs.py checks that the committed blocks equal the rendering.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FP16_BYTES = 2


def _cell(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def render_codes(data: dict) -> str:
    """results/codes.json -> the "Choosing a code" table (bytes per token of the whole model's codes)."""
    model = data["model"]
    per_vector = model["layers"] * model["kv_heads"]
    fp16 = 2 * model["head_dim"] * FP16_BYTES * per_vector
    lines = ["| spec | bytes / token | ratio vs fp16 | perplexity change | KL (nats) | needle 1k–2k "
             "| decode step vs DynamicCache (4k) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in data["rows"]:
        per_token = (row["key_bytes"] + row["value_bytes"]) * per_vector
        name = f"`{row['spec']}`" + (" (peer)" if row.get("peer") else "")
        change = row["ppl_change_pct"]
        lines.append(f"| {name} | {per_token:,.0f} | {fp16 / per_token:.2f}× | "
                     f"{'—' if change is None else f'{change:+.2f} %'} | {_cell(row['kl'], '.4f')} | "
                     f"{row['needle'] or '—'} | {_cell(row['decode_step'], '.2f')}{'' if row['decode_step'] is None else '×'} |")
    return "\n".join(lines)


GPU_SHAPES = ((8192, 1), (32768, 1), (32768, 16), (131072, 16))


def render_gpu(data: dict) -> str:
    """results/gpu/decode_attention.json -> per-layer decode attention on an H200, ratios to bf16 SDPA."""
    rows = {(r["context"], r["batch"], r["variant"]): r for r in data["rows"]}
    lines = ["| context × batch | bf16 SDPA | FibQuant 4-bit | 4-bit paged | FibQuant 2-bit | 2-bit paged |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for m, b in GPU_SHAPES:
        if (m, b, "sdpa-bf16") not in rows:
            continue
        cells = [f"{rows[(m, b, 'sdpa-bf16')]['ms']:.3f} ms"]
        for variant in ("fibquant:b=4-fused", "fibquant:b=4-paged", "fibquant:b=2-fused", "fibquant:b=2-paged"):
            row = rows.get((m, b, variant))
            cells.append("—" if row is None else f"{row['ms_vs_sdpa']:.1f}×")
        lines.append(f"| {m // 1024}k × {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


TABLES = {"codes": ("results/codes.json", render_codes), "gpu": ("results/gpu/decode_attention.json", render_gpu)}
MARKED = re.compile(r"(<!-- table:(?P<name>[a-z_-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)


def rendered(name: str, root: Path = ROOT) -> str | None:
    """The block NAME as its JSON renders it, or None when the JSON file is absent."""
    path, render = TABLES[name]
    source = root / path
    if not source.exists():
        return None
    return render(json.loads(source.read_text())) + "\n"


def refresh(text: str, root: Path = ROOT) -> str:
    """`text` with every marked block replaced by its rendering (blocks whose JSON is absent kept)."""
    def one(match: re.Match) -> str:
        name = match.group("name")
        if name not in TABLES:
            raise ValueError(f"unknown table block {name!r}; known: {sorted(TABLES)}")
        body = rendered(name, root)
        return match.group(0) if body is None else match.group(1) + body + match.group(4)
    return MARKED.sub(one, text)


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    stale = []
    for page in pages():
        text = page.read_text()
        new = refresh(text)
        if new != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new)
    verb = "differ from results/" if args.check else "rewritten"
    print(f"{verb}: {', '.join(map(str, stale))}" if stale else "every table block is current")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
