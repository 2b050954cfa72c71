"""Small shared pieces of the KV experiments: tokenised text spans, tables, JSON, results dir."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

RESULTS_ENV = "FIBQUANT_RESULTS_DIR"


def results_dir(path: str | os.PathLike | None = None) -> Path:
    """`path`, else $FIBQUANT_RESULTS_DIR, else ./results (created)."""
    folder = Path(path or os.environ.get(RESULTS_ENV, "results"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def text_tokens(tokenizer, text_name: str, count: int, offset: int = 0) -> torch.Tensor:
    """Token ids [count] of the novel `text_name`, starting `offset` tokens in.

    Raises ValueError when the book is shorter than offset + count tokens.
    """
    from fibquant.data.text import load_text

    if count < 1 or offset < 0:
        raise ValueError(f"need count >= 1 and offset >= 0, got count={count}, offset={offset}")
    text = load_text(text_name)
    # Tokenise only as much text as needed (about 4 characters per token, generous margin).
    budget = (offset + count) * 8 + 1000
    ids = tokenizer(text[:budget], return_tensors="pt", add_special_tokens=False).input_ids[0]
    if ids.shape[0] < offset + count and budget < len(text):
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    if ids.shape[0] < offset + count:
        raise ValueError(f"text {text_name!r} has {ids.shape[0]} tokens, fewer than offset {offset} + {count}")
    return ids[offset: offset + count]


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table. columns: (key, header, format spec like '.3f' or '' for str)."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        line = []
        for key, _, spec in columns:
            value = row.get(key)
            line.append("-" if value is None else format(value, spec) if spec else str(value))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    rendered = [" | ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths)))
                for r in cells]
    rendered.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(rendered)


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=float))
    return path


def save_report(payload: dict, out_dir, stem: str, plot) -> dict[str, str]:
    """Write `<stem>.json` and `<stem>.png` (drawn by `plot(payload, path)`) under `out_dir`."""
    folder = results_dir(out_dir)
    json_path = write_json(folder / f"{stem}.json", payload)
    png_path = folder / f"{stem}.png"
    plot(payload, png_path)
    return {"json": str(json_path), "png": str(png_path)}
