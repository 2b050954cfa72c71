"""The decode-speed report: the header, the table and the two-panel figure of a
`run_decode_speed` payload (the experiment is `fibquant.eval.decode_speed.EXPERIMENT`)."""
from __future__ import annotations

from fibquant.eval.report import figure, format_table, target

MIB = 1024 * 1024
PEER_MARKERS = {"dynamic": "s", "quanto": "D", "hqq": "v"}  # caches that are not registered codecs

DECODE_SPEED_COLUMNS = [
    ("tokens", "context", "d"),
    ("cache", "cache", ""),
    ("prefill_s", "prefill s", ".2f"),
    ("conversion_s", "of which convert s", ".3f"),
    ("decode_ms_median", "decode ms/tok", ".1f"),
    ("decode_vs_dynamic", "x dynamic", ".2f"),
    ("decode_cpu_ms_median", "CPU ms/tok", ".1f"),
    ("decode_cpu_vs_dynamic", "CPU x dyn", ".2f"),
    ("decode_paired_vs_dynamic", "paired x dyn", ".3f"),
    ("decode_cpu_paired_vs_dynamic", "CPU paired", ".3f"),
    ("decode_ms_mean", "mean ms/tok", ".1f"),
    ("decode_mean_vs_dynamic", "mean x dyn", ".2f"),
    ("cache_mib", "cache MiB", ".2f"),
    ("used_mib", "used MiB", ".2f"),
    ("bytes_vs_fp16_dynamic", "bytes / fp16 dyn", ".3f"),
    ("peak_rss_added_mib", "peak MiB added", ".1f"),
    ("tokens_match_dynamic", "tokens = dyn", ".2f"),
]
TTFT_COLUMNS = [
    ("tokens", "context", "d"),
    ("cache", "cache", ""),
    ("ttft_s", "TTFT s", ".2f"),
    ("ttft_vs_dynamic", "x dyn", ".2f"),
    ("ttft_cpu_s", "CPU s", ".2f"),
    ("ttft_cpu_vs_dynamic", "CPU x dyn", ".2f"),
    ("ttft_cpu_paired_vs_dynamic", "CPU paired", ".3f"),
    ("ttft_peak_mib", "peak MiB", ".1f"),
    ("ttft_token_matches_dynamic", "tok = dyn", ""),
]
CHUNKED_COLUMNS = [
    ("chunked_s", "chunked TTFT s", ".2f"),
    ("chunked_vs_dynamic", "x dyn", ".2f"),
    ("chunked_cpu_vs_dynamic", "CPU x dyn", ".2f"),
    ("chunked_peak_mib", "peak MiB", ".1f"),
    ("chunked_token_matches_dynamic", "tok = dyn", ""),
]
SHARED_PREFILL_COLUMNS = [
    ("prefill_s", "shared prefill + convert s", ".2f"),
    ("prefill_vs_dynamic", "x dyn", ".2f"),
]

# Targets of issue 17 (ours with attention on the codes; ratios to DynamicCache in the same run).
TARGET_CACHES = ("fibquant:b=4", "fibquant:b=2")
TTFT_TARGET, TTFT_TARGET_CONTEXTS = 1.1, (2048, 4096, 8192)
DECODE_TARGET, DECODE_TARGET_CONTEXTS = 1.0, (1024, 2048, 4096, 8192)
DECODE_LONG_TARGET, DECODE_LONG_CONTEXT, DECODE_LONG_CACHE = 0.5, 8192, "fibquant:b=2"


def _parts(payload: dict) -> tuple[str, ...]:
    return tuple(payload.get("parts") or ("decode",))


def decode_speed_header(payload: dict) -> str:
    """What ran (model, text, parts, threads, exact window), how to read the columns, fp16 reference bytes."""
    parts = _parts(payload)
    config = payload["config"]
    dyn = {r["tokens"]: r for r in payload["rows"] if r["kind"] == "dynamic" and "dynamic_fp16_bytes" in r}
    cut = [f"{c['context']} -> {c['tokens']}" for c in payload["contexts"] if c["context"] != c["tokens"]]
    load = payload.get("load_average")
    threads = payload["threads"]
    lines = [
        f"\nmodel: {payload['model']} ({payload['model_dtype']}), text: {payload['text']}, parts: {', '.join(parts)}; "
        f"timed on {threads} torch thread{'s' if threads != 1 else ''}"
        + (f" (load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f})" if load else ""),
        f"exact window of ours: {config['sink_tokens']} sinks + {config['recent_tokens']} "
        f"recent; '@decode' = attention='decode' (whole cache decoded every step), else attention on the codes",
    ]
    if "ttft" in parts or "chunked" in parts:
        lines.append(
            "TTFT s: a fresh empty cache, " + ("the whole prompt in one forward with it" if "ttft" in parts else "")
            + ("; chunked: " if "ttft" in parts and "chunked" in parts else "")
            + (f"the prompt in chunks of {config.get('chunk_tokens')} tokens" if "chunked" in parts else "")
            + f", then the argmax of the first token (median of {config.get('prefill_repeats', 1)} run(s), in "
            "rounds of one run per cache); CPU s: CPU time of the same calls (not counting waits for a core on a "
            "loaded machine); CPU paired: median over the rounds of the CPU time / DynamicCache's of the round; "
            "peak MiB: resident memory the prefill adds; tok = dyn: first token equal to DynamicCache's")
    if "decode" in parts:
        lines += [
            f"decode: {config['decode_tokens']} rounds of greedy steps from one shared DynamicCache prefill, every "
            "cache stepping once per round (interleaved: all see the same machine state); prefill s: that "
            "prefill + conversion into the cache; decode ms/tok: median step (wall); CPU ms/tok: median step CPU "
            "time; x dynamic: vs DynamicCache decode; paired x dyn / CPU paired: median over the rounds of the "
            "step / DynamicCache's step of the same round (wall / CPU time); "
            "cache MiB: bytes held (CompressedCache: code buffers with their reserved capacity), used MiB: stored "
            "tokens only; bytes / fp16 dyn: held bytes over an fp16 DynamicCache's; peak MiB added: over "
            f"{config.get('memory_steps', '?')} further steps, one cache at a time; tokens = dyn: share of greedy "
            "tokens equal to DynamicCache's, position by position",
            "fp16 DynamicCache MiB: " + ", ".join(f"{t}: {r['dynamic_fp16_bytes'] / MIB:.2f}" for t, r in dyn.items()),
        ]
    if cut:
        lines.append("contexts cut to leave room for the decoded tokens: " + ", ".join(cut))
    return "\n".join(lines) + "\n"


def _mib(row: dict, key: str):
    value = row.get(key)
    return None if value is None else value / MIB


def decode_speed_table(payload: dict, markdown: bool = False) -> str:
    """The tables (time to first token; decode), one row per context and cache, for the parts that
    ran, then fallback and skip notes."""
    parts = _parts(payload)
    rows = [dict(r, cache_mib=_mib(r, "cache_bytes"), used_mib=_mib(r, "cache_used_bytes"),
                 peak_rss_added_mib=_mib(r, "peak_rss_added_bytes"), ttft_peak_mib=_mib(r, "ttft_peak_added_bytes"),
                 chunked_peak_mib=_mib(r, "chunked_peak_added_bytes")) for r in payload["rows"]]
    blocks = []
    if "ttft" in parts or "chunked" in parts:
        columns = TTFT_COLUMNS[:2] + (TTFT_COLUMNS[2:] if "ttft" in parts else [])
        columns += CHUNKED_COLUMNS if "chunked" in parts else []
        columns += SHARED_PREFILL_COLUMNS if "decode" in parts else []
        blocks.append("time to first token\n" + format_table(rows, columns, markdown=markdown))
    if "decode" in parts:
        blocks.append("decode (shared prefill)\n" + format_table(rows, DECODE_SPEED_COLUMNS, markdown=markdown))
    text = "\n\n".join(blocks)
    fallbacks = sorted({r["cache"] for r in payload["rows"] if r["kind"] == "compressed"
                        and any(r.get(key) not in (None, r["attention"])
                                for key in ("attention_used", "ttft_attention_used", "chunked_attention_used"))})
    if fallbacks:
        text += f"\nnote: {', '.join(fallbacks)} ran with attention='decode' (the model cannot run attention on codes)"
    for item in payload.get("skipped", []):
        text += f"\nskipped {item['cache']}: {item['reason']}"
    return text


def _cpu_detail(row: dict, part: str) -> str:
    """The wall-clock ratio is judged; the CPU-time ratio (load-independent) and, for decode steps,
    the paired ratios are shown next to it."""
    cpu = row.get(f"{part}_cpu_vs_dynamic")
    what = "median step, wall clock, steps interleaved" if part == "decode" else "wall clock"
    text = what + ("" if cpu is None else f"; CPU-time ratio {cpu:.3g}")
    for key, name in ((f"{part}_paired_vs_dynamic", "paired"), (f"{part}_cpu_paired_vs_dynamic", "CPU paired")):
        if row.get(key) is not None:
            text += f"; {name} {row[key]:.3g}"
    return text


def decode_speed_targets(payload: dict) -> list:
    """Issue 17's targets, judged on the measured ratios of this run (n/a where not measured)."""
    by_key = {(r["context"], r["cache"]): r for r in payload["rows"]}
    contexts = sorted({r["context"] for r in payload["rows"]})
    parts = _parts(payload)
    out = []
    for cache in TARGET_CACHES:
        if "ttft" in parts:
            for context in (c for c in contexts if c in TTFT_TARGET_CONTEXTS):
                row = by_key.get((context, cache), {})
                ratio = row.get("ttft_vs_dynamic")
                out.append(target(f"{cache} one-shot TTFT <= {TTFT_TARGET}x DynamicCache at {context}", ratio,
                                  None if ratio is None else ratio <= TTFT_TARGET, _cpu_detail(row, "ttft")))
        if "decode" in parts:
            for context in (c for c in contexts if c in DECODE_TARGET_CONTEXTS):
                row = by_key.get((context, cache), {})
                ratio = row.get("decode_vs_dynamic")
                out.append(target(f"{cache} decode step <= {DECODE_TARGET}x DynamicCache at {context}", ratio,
                                  None if ratio is None else ratio <= DECODE_TARGET, _cpu_detail(row, "decode")))
    if "decode" in parts and DECODE_LONG_CONTEXT in contexts:
        row = by_key.get((DECODE_LONG_CONTEXT, DECODE_LONG_CACHE), {})
        ratio = row.get("decode_vs_dynamic")
        out.append(target(f"{DECODE_LONG_CACHE} decode step <= {DECODE_LONG_TARGET}x DynamicCache at "
                          f"{DECODE_LONG_CONTEXT}", ratio, None if ratio is None else ratio <= DECODE_LONG_TARGET,
                          _cpu_detail(row, "decode")))
    return out


def format_decode_speed(payload: dict) -> str:
    """Header lines + the table of `payload` (from `run_decode_speed`), as the command prints them."""
    return decode_speed_header(payload).lstrip("\n") + "\n" + decode_speed_table(payload)


def _marker(family: str) -> str:
    from fibquant.codecs.registry import plot_style

    style = plot_style(family)
    return style.marker if style is not None and style.marker else PEER_MARKERS.get(family, "o")


def plot_decode_speed(payload: dict, path) -> None:
    """Three panels vs context, one line per cache: time to first token (solid: one-shot, dotted:
    chunked), decode ms/token and cache bytes held; a panel whose part did not run says so."""
    from matplotlib import colormaps

    rows = payload["rows"]
    names = list(dict.fromkeys(r["cache"] for r in rows))
    colors = {"fp": "k"}
    palette = iter(colormaps["tab20"].colors * 2)
    panels = (("ttft", "time to first token, s (solid: one-shot, dotted: chunked)"),
              ("decode_ms_median", "decode ms / token (median, shared prefill)"),
              ("cache_bytes", "cache bytes held after decoding"))
    with figure(path, dpi=130, ncols=3, figsize=(18, 5)) as (fig, axes):
        drawn = {key: False for key, _ in panels}
        for name in names:
            items = sorted((r for r in rows if r["cache"] == name), key=lambda r: r["tokens"])
            stem = name.removesuffix("@decode")
            color = colors.setdefault(stem, next(palette))
            style = dict(color=color, marker=_marker(items[0]["family"]), markersize=4,
                         linestyle="--" if name.endswith("@decode") else "-")

            def line(ax, key, label, **extra):
                points = [(r["tokens"], r[key]) for r in items if r.get(key) is not None]
                if points:
                    ax.plot(*zip(*points), label=label, **{**style, **extra})
                return bool(points)

            ttft = line(axes[0], "ttft_s", name)
            chunked = line(axes[0], "chunked_s", None if ttft else name, linestyle=":")
            drawn["ttft"] |= ttft or chunked
            drawn["decode_ms_median"] |= line(axes[1], "decode_ms_median", name)
            drawn["cache_bytes"] |= line(axes[2], "cache_bytes", name)
        dyn = sorted((r for r in rows if r["kind"] == "dynamic" and r.get("dynamic_fp16_bytes")),
                     key=lambda r: r["tokens"])
        if dyn:
            axes[2].plot([r["tokens"] for r in dyn], [r["dynamic_fp16_bytes"] for r in dyn], color="0.5",
                         marker="s", markersize=4, linestyle=":", label="dynamic, fp16 equivalent")
        for ax, (key, ylabel) in zip(axes, panels):
            ax.set_xlabel("context tokens")
            ax.set_ylabel(ylabel)
            if not drawn[key]:
                ax.text(0.5, 0.5, "not run (--parts)", ha="center", va="center", transform=ax.transAxes)
                continue
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
        legend_ax = next((ax for ax, (key, _) in zip(reversed(axes), reversed(panels)) if drawn[key]), axes[-1])
        if any(drawn.values()):
            legend_ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.suptitle(f"{payload['model']} ({payload['model_dtype']}), {payload['text']}, "
                     f"{payload['threads']} torch thread(s); dashed: attention='decode' path", fontsize=9)
