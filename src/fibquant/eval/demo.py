"""`fibquant demo`: the compressed KV cache on the default model and a novel, in a few minutes on 2 cores (2.4 min measured).

One table: for fp, FibQuant at three rates (one below 1 bit), TurboQuant and INT: compression
ratio of the codes vs fp16, bytes per token of the compressed cache vs DynamicCache (measured
in the same run), attention-output cosine (the fidelity experiment, `fibquant eval fidelity`,
on a short span) and perplexity with the compressed cache in the loop (the perplexity
experiment, `fibquant eval perplexity`, on a few windows) with its change vs fp.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from fibquant.eval.fidelity import FidelityConfig, plot_frontier, run_fidelity
from fibquant.codecs.registry import is_reference, parse_codec_specs
from fibquant.eval.perplexity import PerplexityConfig, run_perplexity
from fibquant.eval.report import Experiment
from fibquant.eval.timing import Stopwatch

DEMO_CACHES = ("fp", "fibquant:b=4", "fibquant:b=2", "fibquant:b=0.5", "turboquant:b=4", "turboquant:b=2",
                "int:b=4", "int:b=2")

DEMO_COLUMNS = [
    ("label", "method", ""),
    ("bits_per_coordinate", "bits/coord", ".3g"),
    ("compression_ratio", "codes vs fp16", ".2f"),
    ("cache_bytes_per_token", "cache B/token", ".0f"),
    ("cache_stored_bytes_per_token", "stored B/token", ".0f"),
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
    sink_tokens: int = 4      # exact window of the perplexity runs
    recent_tokens: int = 32
    caches: tuple[str, ...] = DEMO_CACHES


def describe_text(name: str) -> str:
    """'emma (Jane Austen, Debian r-cran-janeaustenr)': the text, its author and where it comes from."""
    from fibquant.data.text import resolve_text_name

    source = resolve_text_name(name)
    return f"{name} ({source.author}, Debian {source.package})"


def demo_header(config: DemoConfig, perplexity: dict) -> str:
    """What the demo ran: model, text, fidelity span and the perplexity protocol with its exact window."""
    window = perplexity.get("exact_window", {"sink_tokens": config.sink_tokens,
                                             "recent_tokens": config.recent_tokens})
    return (f"model: {perplexity['model']}\ntext: {describe_text(config.text)}\n"
            f"attention cosine: {config.fidelity_tokens} tokens, all layers/heads, every "
            f"{config.fidelity_query_stride}th query position, every K/V compressed (no window)\n"
            f"perplexity: {perplexity['tokens']} tokens in {perplexity['windows']} windows of {config.context}, "
            f"chunks of {config.chunk}, exact window {window['sink_tokens']} sinks + {window['recent_tokens']} "
            f"recent; cache bytes measured at the end of a window (model dtype {perplexity['model_dtype']}): 'cache' in "
            f"memory incl. the code buffers' growth reserve, 'stored' the window and code rows alone")


def merge_rows(fidelity: dict, perplexity: dict) -> list[dict]:
    """One row per method: the perplexity row plus its attention cosine and DynamicCache bytes."""
    fp_row = next(r for r in perplexity["rows"] if is_reference(r["family"]))
    rows = []
    for fid, ppl in zip(fidelity["rows"], perplexity["rows"]):
        row = dict(ppl)
        row["cosine"] = fid["cosine"]
        row["dynamic_bytes_per_token"] = fp_row["cache_bytes_per_token"]
        rows.append(row)
    return rows


def run(config: DemoConfig = DemoConfig(), model_and_tokenizer=None) -> dict:
    """The fidelity and perplexity experiments on the demo's caches; one payload with both."""
    from fibquant.kv.model import load_model

    watch = Stopwatch()
    specs = parse_codec_specs(list(config.caches))
    if model_and_tokenizer is None:
        print("loading the default model ...", flush=True)
    model, tokenizer = model_and_tokenizer or load_model()
    fidelity = run_fidelity(model, tokenizer, specs,
                            FidelityConfig(text=config.text, tokens=config.fidelity_tokens,
                                           query_stride=config.fidelity_query_stride))
    perplexity = run_perplexity(model, tokenizer, specs,
                                PerplexityConfig(text=config.text, tokens=config.perplexity_tokens,
                                                 context=config.context, chunk=config.chunk,
                                                 sink_tokens=config.sink_tokens,
                                                 recent_tokens=config.recent_tokens))
    return {"demo": demo_header(config, perplexity), "config": asdict(config) | {"caches": list(config.caches)},
            "rows": merge_rows(fidelity, perplexity), "fidelity": fidelity, "perplexity": perplexity,
            "seconds": watch.seconds}


def plot_demo(payload: dict, path) -> None:
    """The fidelity frontier (attention cosine vs compression) of the demo's caches."""
    fidelity, config = payload["fidelity"], payload["config"]
    plot_frontier(fidelity["rows"], path, f"{fidelity['model']}\n{config['text']}, {config['fidelity_tokens']} "
                                          f"tokens: attention cosine vs compression (demo)")


EXPERIMENT = Experiment(name="demo", stem="demo", config=DemoConfig, run=run, columns=DEMO_COLUMNS,
                        plot=plot_demo, header=lambda payload: "\n" + payload["demo"] + "\n",
                        plot_suffix="_frontier.png")


def run_demo(config: DemoConfig = DemoConfig(), out_dir=None, model_and_tokenizer=None) -> dict:
    """Run the demo, print the table, write demo.json and demo_frontier.png under the results directory."""
    payload = EXPERIMENT.main(config, out_dir, model_and_tokenizer=model_and_tokenizer)
    print(f"({payload['seconds']:.0f} s)")
    return payload
