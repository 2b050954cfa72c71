"""`fibquant demo`: the compressed KV cache on the default model and a novel, in ~10 minutes.

One table: for fp, FibQuant at three rates (one below 1 bit), TurboQuant and INT: compression
ratio of the codes vs fp16, bytes per token of the compressed cache vs DynamicCache (measured
in the same run), attention-output cosine (experiment 2 on a short span) and perplexity with
the compressed cache in the loop (experiment 3 on a few windows) with its change vs fp.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from fibquant.eval.fidelity import FidelityConfig, plot_frontier, run_fidelity
from fibquant.eval.kv_report import format_table, results_dir, write_json
from fibquant.eval.methods import parse_methods
from fibquant.eval.perplexity import PerplexityConfig, run_perplexity

DEMO_METHODS = ("fp", "fibquant:b=4", "fibquant:b=2", "fibquant:b=0.5", "turboquant:b=4", "turboquant:b=2",
                "int:b=4", "int:b=2")

DEMO_COLUMNS = [
    ("method", "method", ""),
    ("bits_per_coordinate", "bits/coord", ".3g"),
    ("compression_ratio", "codes vs fp16", ".2f"),
    ("cache_bytes_per_token", "cache B/token", ".0f"),
    ("dynamic_bytes_per_token", "DynamicCache B/token", ".0f"),
    ("cache_ratio_vs_dynamic", "cache ratio", ".2f"),
    ("cosine", "attn cosine", ".4f"),
    ("perplexity", "perplexity", ".3f"),
    ("perplexity_change_pct", "ppl change %", "+.2f"),
]


@dataclass(frozen=True)
class DemoConfig:
    text: str = "emma"
    fidelity_tokens: int = 512
    fidelity_query_stride: int = 4
    perplexity_tokens: int = 2048
    context: int = 512
    chunk: int = 32
    methods: tuple[str, ...] = DEMO_METHODS


def run_demo(config: DemoConfig = DemoConfig(), out_dir=None, model_and_tokenizer=None) -> dict:
    """Run the demo, print the table, write results/demo.json and results/demo_frontier.png."""
    from fibquant.kv.model import load_model

    start = time.perf_counter()
    methods = parse_methods(list(config.methods))
    print("loading the default model ...", flush=True)
    model, tokenizer = model_and_tokenizer or load_model()
    fidelity = run_fidelity(model, tokenizer, methods,
                            FidelityConfig(text=config.text, tokens=config.fidelity_tokens,
                                           query_stride=config.fidelity_query_stride))
    perplexity = run_perplexity(model, tokenizer, methods,
                                PerplexityConfig(text=config.text, tokens=config.perplexity_tokens,
                                                 context=config.context, chunk=config.chunk))
    fp_row = next(r for r in perplexity["rows"] if r["family"] == "fp")
    rows = []
    for fid, ppl in zip(fidelity["rows"], perplexity["rows"]):
        row = dict(ppl)
        row["cosine"] = fid["cosine"]
        row["dynamic_bytes_per_token"] = fp_row["cache_bytes_per_token"]
        rows.append(row)
    header = (f"model: {perplexity['model']}\ntext: {config.text} (Jane Austen, Debian r-cran-janeaustenr)\n"
              f"attention cosine: {config.fidelity_tokens} tokens, all layers/heads, every "
              f"{config.fidelity_query_stride}th query position, every K/V compressed (no window)\n"
              f"perplexity: {perplexity['tokens']} tokens in {perplexity['windows']} windows of {config.context}, "
              f"chunks of {config.chunk}, exact window 4 sinks + 32 recent; cache bytes measured at the end "
              f"of a window (model dtype {perplexity['model_dtype']})")
    table = format_table(rows, DEMO_COLUMNS)
    print("\n" + header + "\n\n" + table)
    out = results_dir(out_dir)
    payload = {"demo": header, "config": config.__dict__ | {"methods": list(config.methods)}, "rows": rows,
               "fidelity": fidelity, "perplexity": perplexity, "seconds": time.perf_counter() - start}
    write_json(out / "demo.json", payload)
    plot_frontier(fidelity["rows"], out / "demo_frontier.png",
                  f"{fidelity['model']}\n{config.text}, {config.fidelity_tokens} tokens: attention cosine vs compression (demo)")
    print(f"\nwrote {out / 'demo.json'} and {out / 'demo_frontier.png'} "
          f"({payload['seconds']:.0f} s)")
    return payload
