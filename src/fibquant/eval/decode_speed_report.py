"""The decode-speed report: the header, the table and the two-panel figure of a
`run_decode_speed` payload (the experiment is `fibquant.eval.decode_speed.EXPERIMENT`)."""
from __future__ import annotations

from fibquant.eval.report import figure, format_table

MIB = 1024 * 1024
PEER_MARKERS = {"dynamic": "s", "quanto": "D", "hqq": "v"}  # caches that are not registered codecs

DECODE_SPEED_COLUMNS = [
    ("tokens", "context", "d"),
    ("cache", "cache", ""),
    ("prefill_s", "prefill s", ".2f"),
    ("conversion_s", "of which convert s", ".3f"),
    ("decode_ms_median", "decode ms/tok", ".1f"),
    ("decode_vs_dynamic", "x dynamic", ".2f"),
    ("decode_ms_mean", "mean ms/tok", ".1f"),
    ("decode_mean_vs_dynamic", "mean x dyn", ".2f"),
    ("cache_mib", "cache MiB", ".2f"),
    ("used_mib", "used MiB", ".2f"),
    ("bytes_vs_fp16_dynamic", "bytes / fp16 dyn", ".3f"),
    ("peak_rss_added_mib", "peak MiB added", ".1f"),
    ("tokens_match_dynamic", "tokens = dyn", ".2f"),
]


def decode_speed_header(payload: dict) -> str:
    """What ran (model, text, steps, threads, exact window), how to read the columns, fp16 reference bytes."""
    dyn = {r["tokens"]: r for r in payload["rows"] if r["kind"] == "dynamic"}
    cut = [f"{c['context']} -> {c['tokens']}" for c in payload["contexts"] if c["context"] != c["tokens"]]
    lines = [
        f"\nmodel: {payload['model']} ({payload['model_dtype']}), text: {payload['text']}, "
        f"{payload['config']['decode_tokens']} greedy decode steps, {payload['threads']} torch threads",
        f"exact window of ours: {payload['config']['sink_tokens']} sinks + {payload['config']['recent_tokens']} "
        f"recent; '-old' = attention='decode' (whole cache decoded every step), else attention on the codes",
        "prefill s: shared DynamicCache prefill + conversion into the cache; decode ms/tok: median step; "
        "x dynamic: vs DynamicCache decode; cache MiB: bytes held (CompressedCache: code buffers with their "
        "reserved capacity), used MiB: stored tokens only; bytes / fp16 dyn: held bytes over an fp16 "
        "DynamicCache's; tokens = dyn: share of greedy tokens equal to DynamicCache's, position by position",
        "fp16 DynamicCache MiB: " + ", ".join(f"{t}: {r['dynamic_fp16_bytes'] / MIB:.2f}" for t, r in dyn.items()),
    ]
    if cut:
        lines.append("contexts cut to leave room for the decoded tokens: " + ", ".join(cut))
    return "\n".join(lines) + "\n"


def decode_speed_table(payload: dict) -> str:
    """The table (one row per context and cache), then fallback and skip notes."""
    rows = [dict(r, cache_mib=r["cache_bytes"] / MIB, used_mib=r["cache_used_bytes"] / MIB,
                 peak_rss_added_mib=r["peak_rss_added_bytes"] / MIB) for r in payload["rows"]]
    text = format_table(rows, DECODE_SPEED_COLUMNS)
    fallbacks = sorted({r["cache"] for r in payload["rows"]
                        if r["kind"] == "compressed" and r["attention_used"] != r["attention"]})
    if fallbacks:
        text += f"\nnote: {', '.join(fallbacks)} ran with attention='decode' (the model cannot run attention on codes)"
    for item in payload.get("skipped", []):
        text += f"\nskipped {item['cache']}: {item['reason']}"
    return text


def format_decode_speed(payload: dict) -> str:
    """Header lines + the table of `payload` (from `run_decode_speed`), as the command prints them."""
    return decode_speed_header(payload).lstrip("\n") + "\n" + decode_speed_table(payload)


def _marker(family: str) -> str:
    from fibquant.eval.methods import plot_style

    style = plot_style(family)
    return style.marker if style is not None and style.marker else PEER_MARKERS.get(family, "o")


def plot_decode_speed(payload: dict, path) -> None:
    """Two panels vs context: decode ms/token and cache bytes, one line per cache."""
    from matplotlib import colormaps

    rows = payload["rows"]
    names = list(dict.fromkeys(r["cache"] for r in rows))
    colors = {"dynamic": "k"}
    palette = iter(colormaps["tab20"].colors * 2)
    with figure(path, dpi=130, ncols=2, figsize=(13, 5)) as (fig, (ax_time, ax_bytes)):
        for name in names:
            items = sorted((r for r in rows if r["cache"] == name), key=lambda r: r["tokens"])
            stem = name[: -len("-old")] if name.endswith("-old") else name
            color = colors.setdefault(stem, next(palette))
            style = dict(color=color, marker=_marker(items[0]["family"]), markersize=4,
                         linestyle="--" if name.endswith("-old") else "-")
            x = [r["tokens"] for r in items]
            ax_time.plot(x, [r["decode_ms_median"] for r in items], label=name, **style)
            ax_bytes.plot(x, [r["cache_bytes"] for r in items], label=name, **style)
        dyn = sorted((r for r in rows if r["kind"] == "dynamic"), key=lambda r: r["tokens"])
        if dyn:
            ax_bytes.plot([r["tokens"] for r in dyn], [r["dynamic_fp16_bytes"] for r in dyn], color="0.5",
                          marker="s", markersize=4, linestyle=":", label="dynamic, fp16 equivalent")
        for ax, ylabel in ((ax_time, "decode ms / token (median)"),
                           (ax_bytes, "cache bytes held after decoding")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context tokens")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        ax_bytes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.suptitle(f"{payload['model']} ({payload['model_dtype']}), {payload['text']}, "
                     f"{payload['threads']} threads; dashed: attention='decode' path", fontsize=9)


def write_decode_speed(payload: dict, out_dir=None, stem: str = "decode_speed") -> dict[str, str]:
    """Write `<stem>.json` and `<stem>.png` under `out_dir` (default $FIBQUANT_RESULTS_DIR or results/)."""
    from dataclasses import replace

    from fibquant.eval.decode_speed import EXPERIMENT

    return replace(EXPERIMENT, stem=stem).report(payload, out_dir, echo=False)
