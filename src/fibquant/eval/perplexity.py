"""Perplexity with the compressed cache in the loop (experiment 3, FibQuant paper 4.3).

Protocol: the first `tokens` tokens of one novel (no special tokens added) are cut into
non-overlapping windows of `context` tokens. Each window starts from a fresh cache and is fed
in chunks of `chunk` tokens; every chunk's queries attend to the cache as it stands, so every
token older than the exact window is read back from its codes (see kv/cache.py: a query sees
the first `sink_tokens`, the previous `recent_tokens` and its own chunk exactly, everything
else decoded). NLL is summed over every predicted token of every window (position i predicts
i+1, so context-1 predictions per window), and separately over the second half of each
window (positions >= context/2, where most of the context is compressed). The fp baseline
uses a DynamicCache with the same windows and chunking. Several windows run as one batch.

A method is any `fibquant.kv.specs` spec: keys and values may use different codecs
('fibquant:b=4/fibquant:b=2'), and a peer ('quanto-rt:b=2', 'kakeya-e8:q=2', ...; see
`fibquant.peers`) runs in a `RoundTripCache` with the same exact window, its bytes counted
from its own format.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from fibquant.codecs.registry import CodecSpec, codec_classes, is_reference, plot_style
from fibquant.eval.report import Experiment, figure, target
from fibquant.kv.accounting import cache_nbytes, cold_nbytes, cold_reads
from fibquant.kv.build import build_cache
from fibquant.kv.model import cache_kwarg, check_model_supported
from fibquant.kv.attention.switch import attention_on_codes


@dataclass(frozen=True)
class PerplexityConfig:
    text: str = "emma"
    tokens: int = 20480
    context: int = 1024
    chunk: int = 32
    sink_tokens: int = 4
    recent_tokens: int = 32
    batch_size: int = 4
    attention: str = "codes"  # "codes" (attention on the codes) or "decode" (the reference path)
    centre: bool = False      # quantise keys/values minus a per-layer, per-head mean (every spec as with @centre)

    def __post_init__(self) -> None:
        if self.attention not in ("codes", "decode"):
            raise ValueError(f"attention must be 'codes' or 'decode', got {self.attention!r}")
        for name in ("tokens", "context", "chunk", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sink_tokens < 0 or self.recent_tokens < 0:
            raise ValueError(f"exact window sizes must be >= 0, got {self.sink_tokens} and {self.recent_tokens}")
        if self.sink_tokens + self.recent_tokens >= self.context:
            raise ValueError(f"exact window {self.sink_tokens} sinks + {self.recent_tokens} recent is not smaller "
                             f"than the context of {self.context} tokens: nothing would be compressed")
        if self.tokens < self.context:
            raise ValueError(f"tokens ({self.tokens}) must be at least one context window ({self.context})")

    @property
    def windows(self) -> int:
        return self.tokens // self.context


def as_cache_spec(method):
    """A `fibquant.kv.specs.CacheSpec` from a CodecSpec, a spec string or a CacheSpec."""
    from fibquant.kv.specs import CacheSpec, from_codec_spec, parse_cache_spec

    if isinstance(method, CacheSpec):
        return method
    if isinstance(method, str):
        return parse_cache_spec(method)
    if isinstance(method, CodecSpec):
        if method.calibrated:
            raise ValueError(f"{method.spec}: calibrated methods are not supported in the perplexity loop")
        return from_codec_spec(method)
    raise ValueError(f"expected a CodecSpec, CacheSpec or spec string, got {type(method).__name__}")


def make_cache(method, model, config: PerplexityConfig, quantizers: tuple | None = None):
    """A fresh cache for `method` (CodecSpec, CacheSpec or spec string such as 'fibquant:b=4/fibquant:b=2'):
    DynamicCache for fp, CompressedCache for our codecs, RoundTripCache when a peer is involved.
    `quantizers`: the (key, value) codecs of `cache_factory`, built here when None."""
    spec = as_cache_spec(method)
    if config.centre and not spec.is_fp and not spec.uses_peer:  # peers: never centred
        spec = dataclasses.replace(spec, centre=True)
    return build_cache(spec, model, config.sink_tokens, config.recent_tokens, config.attention, quantizers=quantizers)


def cache_factory(method, model, config: PerplexityConfig):
    """A function returning a fresh cache for `method` per call; our codecs are built once here and
    shared by every cache (codebooks read and search tables built once per method, not per batch).
    Peers are rebuilt per cache, as their quantizers are not ours to share."""
    spec = as_cache_spec(method)
    quantizers = None if spec.is_fp or spec.uses_peer else spec.quantizers(model)
    return lambda: make_cache(spec, model, config, quantizers)


@torch.no_grad()
def window_stats(model, ids: torch.Tensor, caches: list, chunk: int, reference=None) -> list[dict]:
    """Per-token statistics of windows ids [B, T] fed in chunks through each of `caches` (in step:
    every cache sees the same chunk before the next one). Per cache a dict of [B, T-1] tensors
    (position i predicts i+1): "nll"; with a `reference` (an index into `caches`, or another cache
    run alongside, e.g. a DynamicCache), also "kl" = KL(p_reference || p_cache) of the next-token
    distributions (nats) and "top1" = whether both put the same token first."""
    runs = list(caches) + ([] if reference is None or isinstance(reference, int) else [reference])
    index = reference if isinstance(reference, int) or reference is None else len(runs) - 1
    stats = [{"nll": [], "kl": [], "top1": []} for _ in caches]
    length = ids.shape[1]
    for start in range(0, length, chunk):
        piece = ids[:, start: start + chunk]
        targets = ids[:, start + 1: start + chunk + 1]
        logits = [model(input_ids=piece, **cache_kwarg(model, cache), use_cache=True).logits.float()[:, : targets.shape[1]]
                  for cache in runs]
        reference_logp = None if index is None else torch.log_softmax(logits[index], dim=-1)
        for own, out in zip(logits, stats):
            out["nll"].append(torch.nn.functional.cross_entropy(own.transpose(1, 2), targets, reduction="none"))
            if reference_logp is not None:
                logp = torch.log_softmax(own, dim=-1)
                out["kl"].append((reference_logp.exp() * (reference_logp - logp)).sum(-1).clamp_min_(0.0))
                out["top1"].append(own.argmax(-1) == reference_logp.argmax(-1))
    return [{name: torch.cat(parts, dim=1) for name, parts in out.items() if parts} for out in stats]


def window_nll(model, ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    """Token NLLs [B, T-1] of windows ids [B, T] fed in chunks through `cache` (position i predicts i+1)."""
    return window_stats(model, ids, [cache], chunk)[0]["nll"]


def run_perplexity(model, tokenizer, caches: list, config: PerplexityConfig = PerplexityConfig(),
                   progress: bool = True) -> dict:
    """Perplexity (all tokens and second half), KL divergence of the next-token distribution from
    the uncompressed model's and top-1 agreement with it, of each method (CodecSpec, CacheSpec or spec
    string: keys and values may differ, peers allowed); same windows for all, run in step."""
    from fibquant.eval.kv_report import text_tokens
    from fibquant.kv.model import describe_model

    with attention_on_codes(model):
        ids = text_tokens(tokenizer, config.text, config.windows * config.context).to(model.device)
        windows = ids.reshape(config.windows, config.context)
        head_dim = check_model_supported(model)["head_dim"]
        specs = [as_cache_spec(cache) for cache in caches]
        sums = _accumulate(model, specs, list(torch.split(windows, config.batch_size)), head_dim, config, progress)
        rows = [_row(spec, total, head_dim) for spec, total in zip(specs, sums)]
        if progress:
            for row in rows:
                tqdm.write(f"{row['label']}: perplexity {row['perplexity']:.3f} "
                           f"(second half {row['perplexity_second_half']:.3f}), KL {row['kl']:.4f} nats, "
                           f"top-1 agreement {row['top1_agreement']:.3f}")
        _add_changes(rows)
        return {
            "experiment": "perplexity with the compressed cache in the loop (FibQuant paper 4.3)",
            "model": describe_model(model), "text": config.text, "tokens": config.windows * config.context,
            "context": config.context, "chunk": config.chunk, "windows": config.windows,
            "exact_window": {"sink_tokens": config.sink_tokens, "recent_tokens": config.recent_tokens},
            "attention": config.attention, "centre": config.centre,
            "kl_reference": "the uncompressed model (DynamicCache, same windows and chunks)",
            "model_dtype": str(next(model.parameters()).dtype), "rows": rows,
        }


def _accumulate(model, specs: list, batches: list, head_dim: int, config: PerplexityConfig,
                progress: bool) -> list[dict]:
    """Per spec, the sums over every batch of windows: NLL (all, second half), KL, top-1, per-window means,
    and the cache's bytes per token (of the last batch)."""
    from transformers import DynamicCache

    factories = [cache_factory(spec, model, config) for spec in specs]
    # The uncompressed model's distribution: an fp row's own cache where there is one, else a DynamicCache.
    fp_index = next((i for i, spec in enumerate(specs) if spec.is_fp), None)
    sums = [dict(nll=0.0, second=0.0, kl=0.0, top1=0.0, count=0, second_count=0, bytes=None, stored=None,
                 cold=0.0, cold_rows=0, windows=dict(nll=[], kl=[], top1=[])) for _ in specs]
    half = config.context // 2
    bar = tqdm(total=len(batches) * len(specs), desc="perplexity", disable=not progress)
    for batch in batches:
        live = [fresh() for fresh in factories]
        reference = fp_index if fp_index is not None else DynamicCache()
        for spec, cache, stats, total in zip(specs, live, window_stats(model, batch, live, config.chunk, reference),
                                             sums):
            nll = stats["nll"]
            total["nll"] += float(nll.sum())
            total["count"] += nll.numel()
            total["second"] += float(nll[:, half - 1:].sum())  # predictions of tokens at positions >= half
            total["second_count"] += nll[:, half - 1:].numel()
            total["kl"] += float(stats["kl"].double().sum())
            total["top1"] += float(stats["top1"].sum())
            # per window (a row of the batch): mean token NLL, KL and top-1, for spreads over windows
            total["windows"]["nll"] += nll.double().mean(1).tolist()
            total["windows"]["kl"] += stats["kl"].double().mean(1).tolist()
            total["windows"]["top1"] += stats["top1"].double().mean(1).tolist()
            # A RoundTripCache (peers) stores floats: its bytes are counted in the peer's format.
            format_bytes = (spec.key_bytes(head_dim), spec.value_bytes(head_dim))
            tokens = batch.shape[0] * config.context
            total["bytes"] = cache_nbytes(cache, format_bytes) / tokens
            total["stored"] = cache_nbytes(cache, format_bytes, stored=True) / tokens
            total["cold"] = cold_nbytes(cache) / tokens  # not hot: apart
            total["cold_rows"] += cold_reads(cache)["rows"]
            bar.update(1)
    bar.close()
    return sums


def _row(spec, total: dict, head_dim: int) -> dict:
    """The result row of one spec from its sums."""
    key_bytes, value_bytes = spec.key_bytes(head_dim), spec.value_bytes(head_dim)
    count = total["count"]
    return {
        "cache": spec.spec, "label": spec.label(head_dim), "family": spec.family,
        "bits_per_coordinate": spec.bits_per_coordinate(head_dim),
        "key_bytes_per_vector": key_bytes, "value_bytes_per_vector": value_bytes,
        "code_bytes_per_vector": 0.5 * (key_bytes + value_bytes), "compression_ratio": spec.codes_ratio(head_dim),
        "peer": spec.uses_peer,
        "cache_bytes_per_token": total["bytes"],
        "cache_stored_bytes_per_token": total["stored"],  # without reserved capacity: the peers' count
        # @recall: the cold tier's exact rows per token (host memory, not in the bytes above) and the
        # (layer, head, token) rows read from it per predicted token
        "cold_bytes_per_token": total["cold"], "cold_rows_read_per_token": total["cold_rows"] / count,
        "perplexity": math.exp(total["nll"] / count),
        "perplexity_second_half": math.exp(total["second"] / total["second_count"]),
        "nll": total["nll"] / count, "predicted_tokens": count,
        "kl": total["kl"] / count, "top1_agreement": total["top1"] / count,
        # one entry per window, in text order (each window predicts the same number of tokens)
        "kl_per_window": total["windows"]["kl"], "top1_per_window": total["windows"]["top1"],
        "perplexity_per_window": [math.exp(v) for v in total["windows"]["nll"]],
    }


def _add_changes(rows: list[dict]) -> None:
    """Each row's perplexity change and cache ratio against the fp row, where there is one."""
    baseline = next((r for r in rows if is_reference(r["family"])), None)
    if baseline is None:
        return
    for row in rows:
        row["perplexity_change_pct"] = 100.0 * (row["perplexity"] / baseline["perplexity"] - 1.0)
        row["second_half_change_pct"] = 100.0 * (row["perplexity_second_half"]
                                                 / baseline["perplexity_second_half"] - 1.0)
        row["cache_ratio_vs_dynamic"] = baseline["cache_bytes_per_token"] / row["cache_bytes_per_token"]


def plot_perplexity(rows: list[dict], path, title: str) -> None:
    """Perplexity against K+V compression vs fp16 (stored bytes), one line per codec family, peers and
    asymmetric K/V as labelled points, fp as a horizontal line (log y)."""
    lines = [family for family in codec_classes() if not is_reference(family)]  # registry order
    with figure(path, dpi=130, figsize=(8, 5)) as (fig, ax):
        for family in lines:
            style = plot_style(family)
            items = sorted((r for r in rows if r["family"] == family), key=lambda r: r["compression_ratio"])
            if items:
                ax.plot([r["compression_ratio"] for r in items], [r["perplexity"] for r in items],
                        color=style.color, marker=style.marker, label=style.name)
        for row in rows:
            if is_reference(row["family"]):
                ax.axhline(row["perplexity"], color=plot_style(row["family"]).color, linestyle="--",
                           label=f"{row['family']} ({row['perplexity']:.2f})")
            elif row["family"] not in lines:
                color = "C1" if row["family"] == "kv" and not row.get("peer") else "0.4"
                ax.scatter(row["compression_ratio"], row["perplexity"], color=color,
                           marker="x" if row.get("peer") else "D")
                ax.annotate(row["label"], (row["compression_ratio"], row["perplexity"]), fontsize=6, rotation=15)
        ax.set_yscale("log")
        ax.set_xlabel("key + value compression vs fp16 (stored bytes per vector, side information included)")
        ax.set_ylabel("perplexity")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)


PERPLEXITY_CACHES = (
    "fp",
    "fibquant:b=4", "fibquant:b=3.5", "fibquant:b=3", "fibquant:b=2.5", "fibquant:b=2", "fibquant:b=1",
    "fibquant:b=0.5",
    "turboquant:b=4", "turboquant:b=3", "turboquant:b=2",
    "int:b=4", "int:b=3", "int:b=2",
)

PERPLEXITY_COLUMNS = [
    ("label", "method", ""),
    ("bits_per_coordinate", "bits/coord", ".4g"),
    ("key_bytes_per_vector", "K B/vec", ".4g"),
    ("value_bytes_per_vector", "V B/vec", ".4g"),
    ("compression_ratio", "K+V vs fp16", ".2f"),
    ("cache_bytes_per_token", "cache B/token", ".0f"),
    ("cache_stored_bytes_per_token", "stored B/token", ".0f"),
    ("cache_ratio_vs_dynamic", "vs DynamicCache", ".2f"),
    ("cold_bytes_per_token", "cold B/token", ".0f"),
    ("perplexity", "perplexity", ".3f"),
    ("perplexity_change_pct", "change %", "+.2f"),
    ("perplexity_second_half", "2nd half ppl", ".3f"),
    ("second_half_change_pct", "2nd half %", "+.2f"),
    ("kl", "KL vs fp (nats)", ".4f"),
    ("top1_agreement", "top-1 = fp", ".3f"),
]


def run(config: PerplexityConfig = PerplexityConfig(), caches: list[str] | None = None,
        build_codebooks: bool = False, model_and_tokenizer=None, progress: bool = True) -> dict:
    """Run experiment 3 on `caches` (default PERPLEXITY_CACHES; unavailable ones skipped with a note)
    with the default model unless given; the payload with its targets."""
    from fibquant.kv.specs import parse_cache_specs, split_available
    from fibquant.kv.model import load_model

    model, tokenizer = model_and_tokenizer or load_model()
    head_dim = check_model_supported(model)["head_dim"]
    ready, skipped = split_available(parse_cache_specs(list(caches or PERPLEXITY_CACHES), model), head_dim, build_codebooks)
    payload = run_perplexity(model, tokenizer, ready, config, progress)
    payload["skipped"] = skipped
    payload["targets"] = perplexity_targets(payload["rows"])
    return payload


# Targets (paper 4.3): FibQuant b=4 within B4_CHANGE_PCT_TARGET % of fp's perplexity; at b=2 FibQuant's
# increase at most B2_INCREASE_RATIO_TARGET times TurboQuant's; FibQuant b=2 no worse than any peer
# storing at most its bytes per vector.
B4_CHANGE_PCT_TARGET = 1.0
B2_INCREASE_RATIO_TARGET = 1 / 3


def perplexity_checks(rows: list[dict]) -> list[dict]:
    """The targets as report `target` dicts (those whose rows are present)."""
    def find(family: str, bits: float):
        return next((r for r in rows if r["family"] == family and abs(r["bits_per_coordinate"] - bits) < 1e-9
                     and "perplexity_change_pct" in r), None)

    out = []
    fib4, fib2, turbo2 = find("fibquant", 4.0), find("fibquant", 2.0), find("turboquant", 2.0)
    if fib2 is not None:
        peers = [r for r in rows if r.get("peer") and r["code_bytes_per_vector"] <= fib2["code_bytes_per_vector"]
                 and "perplexity_change_pct" in r]
        if peers:
            best = min(peers, key=lambda r: r["perplexity_change_pct"])
            met = fib2["perplexity_change_pct"] <= best["perplexity_change_pct"]
            out.append(target("fibquant_b2_change_pct vs best peer at <= its bytes (target: FibQuant <= peer)",
                              f"{fib2['perplexity_change_pct']:+.2f} % vs {best['perplexity_change_pct']:+.2f} % "
                              f"({best['label']}, {best['code_bytes_per_vector']:.4g} B/vector): "
                              f"{'met' if met else 'missed'}", met))
    if fib4 is not None:
        change = fib4["perplexity_change_pct"]
        out.append(target(f"fibquant_b4_change_pct (target <= {B4_CHANGE_PCT_TARGET:g})", change,
                          change <= B4_CHANGE_PCT_TARGET))
    if fib2 is not None and turbo2 is not None:
        increase = turbo2["perplexity_change_pct"]
        ratio = fib2["perplexity_change_pct"] / increase if increase > 0 else float("inf")
        out.append(target(f"fibquant_b2_increase / turboquant_b2_increase (target <= {B2_INCREASE_RATIO_TARGET:.3f})",
                          ratio, ratio <= B2_INCREASE_RATIO_TARGET))
    return out


def perplexity_targets(rows: list[dict]) -> dict:
    """The targets as stored in the payload: {statement: measured}."""
    return {check["target"]: check["measured"] for check in perplexity_checks(rows)}


def perplexity_header(payload: dict) -> str:
    p, window = payload, payload["exact_window"]
    return "\n".join([f"\nmodel: {p['model']}\ntext: {p['text']}, {p['tokens']} tokens = {p['windows']} windows of "
                      f"{p['context']}, chunks of {p['chunk']}, exact window {window['sink_tokens']} sinks + "
                      f"{window['recent_tokens']} recent (model dtype {p['model_dtype']}), attention={p['attention']}, "
                      f"centre={p['centre']}\n"] + [f"skipped: {note}" for note in p.get("skipped", [])])


def plot_perplexity_payload(payload: dict, path) -> None:
    """`plot_perplexity` of the payload's rows, titled with its model, text and protocol."""
    p, window = payload, payload["exact_window"]
    plot_perplexity(p["rows"], path, f"{p['model']}\n{p['text']}, {p['tokens']} tokens, context {p['context']}, chunk "
                                     f"{p['chunk']}, exact window {window['sink_tokens']}+{window['recent_tokens']}")


EXPERIMENT = Experiment(name="perplexity", stem="perplexity", config=PerplexityConfig, run=run,
                        columns=PERPLEXITY_COLUMNS, plot=plot_perplexity_payload,
                        targets=lambda payload: perplexity_checks(payload["rows"]), header=perplexity_header)
