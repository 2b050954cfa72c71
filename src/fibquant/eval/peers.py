"""Every method and every peer on every quality metric, from one list of cache specs (`fibquant eval peers`).

One list of `fibquant.kv.specs` specs (FibQuant at several rates, keys and values at
different rates, TurboQuant, INT and every installed peer: quanto, HQQ, KakeyaLattice E8/D4,
NexusQuant) runs through the three in-the-loop experiments, each by its own module's code:

- attention fidelity with the cache's exact window (`fibquant.eval.fidelity`: the captured real
  queries/keys/values of one span, every key and value outside a query's window replaced by its
  round trip, cosine of the attention output against the exact one); a K/V spec reconstructs
  keys and values with its two sides;
- perplexity with the cache in the loop (`fibquant.eval.perplexity.run_perplexity`, chunks and
  exact window as configured);
- passkey retrieval in an Austen haystack (`fibquant.eval.needle.run_needle`).

Every cache keeps the same exact window (sinks + recent tokens): our codecs in `CompressedCache`
(attention on the codes), a peer in `RoundTripCache`. Bytes per stored vector are the cache
spec's (`CacheSpec.key_bytes` / `value_bytes`: our codecs' `code_size`, a peer's fixed-rate size
from its own format, `fibquant.peers`). Specs that cannot run here (a peer package not
installed, a codebook neither shipped nor cached) are kept as rows with the reason and no
figures. The report is one JSON (`peers.json`), one Markdown table and one plot per metric
(`peers_<metric>.md` / `.png`, all tables also in `peers.md`, an overview in `peers.png`), under
`results/peers` by default.

Rotation draws (`PeersConfig.rotation_seeds`, `--rotation-seeds 0 1 2 3`): the Haar rotation Pi of
FibQuant, FibQuant-RVQ and TurboQuant leaves attention unchanged, yet which draw is used moves a
codec's figures by more than the gaps between methods. With seeds given, every spec whose sides
take a rotation seed (`rotation_seed`, spec key `r=`) runs once per seed (`fibquant:b=2,r=1`, ...;
the codebooks stay the same universal ones) and its row holds the mean over the draws, with
`<metric>_sd` (sample standard deviation), `<metric>_per_seed` and `rotations` (how many draws); a
peer, fp, or a spec that fixes `r=` itself runs once (`rotations` 1). The parts keep one row per
draw, each naming its `rotation_of` spec.
"""
from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from fibquant.codecs.registry import codec_classes
from fibquant.codecs.rotation import ROTATION_SEED_PARAM
from fibquant.eval.report import Experiment, figure, format_table, target
from fibquant.paths import results_dir
from fibquant.peers import PEERS, peer_specs

METRICS = ("fidelity", "perplexity", "needle")
BUDGET_RANGE = (3.5, 12.0)  # the target: FibQuant >= every peer at <= its bytes in this ratio range

PEERS_REPORT_SPECS = (
    "fp",
    "fibquant:b=4", "fibquant:b=3", "fibquant:b=2.5", "fibquant:b=2", "fibquant:b=1.5", "fibquant:b=1",
    "fibquant:b=4/fibquant:b=2", "fibquant:b=3/fibquant:b=2", "fibquant:b=3/fibquant:b=1.5",
    "fibquant:b=2/fibquant:b=1",
    "turboquant:b=4", "turboquant:b=3", "turboquant:b=2", "turboquant:b=1",
    "int:b=4", "int:b=3", "int:b=2",
) + peer_specs()  # every registered peer at its default values



@dataclass(frozen=True)
class PeersConfig:
    """Sizes of the three experiments (defaults: the real run; `PeersConfig.quick()`: minutes)."""

    text: str = "emma"
    metrics: tuple = METRICS
    sink_tokens: int = 4
    recent_tokens: int = 32
    attention: str = "codes"
    seed: int = 0
    # attention fidelity: one span of `fidelity_tokens`, every `query_stride`-th query scored
    fidelity_tokens: int = 1024
    query_stride: int = 1
    # perplexity: `ppl_tokens` cut into windows of `context`, fed in chunks of `chunk`
    ppl_tokens: int = 8192
    context: int = 1024
    chunk: int = 32
    batch_size: int = 4
    # needle: lengths x depths x keys trials
    lengths: tuple = (1024, 2048, 4096)
    depths: tuple = (0.0, 0.25, 0.5, 0.75, 1.0)
    keys_per_cell: int = 2
    max_new_tokens: int = 8
    # rotation draws of the codecs that take a rotation seed (empty: each codec's own rotation, once)
    rotation_seeds: tuple = ()

    def __post_init__(self) -> None:
        if not self.metrics or any(m not in METRICS for m in self.metrics):
            raise ValueError(f"metrics must be a non-empty subset of {METRICS}, got {self.metrics!r}")
        seeds = self.rotation_seeds
        if not isinstance(seeds, tuple) or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                                               for s in seeds):
            raise ValueError(f"rotation_seeds must be a tuple of non-negative integers, got {seeds!r}")
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"rotation_seeds must not repeat a seed, got {seeds!r}")
        for m in self.metrics:  # the experiments' own checks
            getattr(self, f"{m}_config")()

    @classmethod
    def quick(cls, **overrides) -> "PeersConfig":
        """Small sizes: a few minutes for a handful of specs on 2 cores."""
        sizes = dict(fidelity_tokens=128, query_stride=4, ppl_tokens=256, context=256, batch_size=1,
                     lengths=(256,), depths=(0.5,), keys_per_cell=1, max_new_tokens=7)
        return cls(**(sizes | overrides))

    def fidelity_config(self):
        from fibquant.eval.fidelity import FidelityConfig

        return FidelityConfig(text=self.text, tokens=self.fidelity_tokens, query_stride=self.query_stride,
                              sink_tokens=self.sink_tokens, recent_tokens=self.recent_tokens)

    def perplexity_config(self):
        from fibquant.eval.perplexity import PerplexityConfig

        return PerplexityConfig(text=self.text, tokens=self.ppl_tokens, context=self.context, chunk=self.chunk,
                                sink_tokens=self.sink_tokens, recent_tokens=self.recent_tokens,
                                batch_size=self.batch_size, attention=self.attention)

    def needle_config(self):
        from fibquant.eval.needle import NeedleConfig

        return NeedleConfig(text=self.text, lengths=tuple(self.lengths), depths=tuple(self.depths),
                            keys_per_cell=self.keys_per_cell, seed=self.seed, sink_tokens=self.sink_tokens,
                            recent_tokens=self.recent_tokens, max_new_tokens=self.max_new_tokens,
                            attention=self.attention)


# --------------------------------------------------------------------------- attention fidelity of cache specs

def side_states(side, states: torch.Tensor, role: str, model=None) -> torch.Tensor:
    """The round trip of states [L, Hkv, T, D] through one cache side (our codec shared by every head,
    `fidelity.reconstruct`; a peer through `fidelity.peer_roundtrip`)."""
    from fibquant.eval.fidelity import peer_roundtrip, reconstruct

    quantizer = side.build(states.shape[-1], role, model)  # a peer quantizer or our codec
    if side.is_peer:
        return peer_roundtrip(quantizer, states)
    return reconstruct(states, lambda layer, head: quantizer, shared=True)


def run_fidelity_specs(model, tokenizer, specs, config, progress: bool = True) -> dict:
    """Attention cosine with the exact window (`fidelity.output_cosine`) of every cache spec on one
    captured span (`config`: a `FidelityConfig`); fp reads the exact states."""
    from tqdm.auto import tqdm

    from fibquant.eval.capture import capture_attention
    from fibquant.eval.fidelity import exact_outputs, output_cosine
    from fibquant.eval.kv_report import text_tokens

    captured = capture_attention(model, text_tokens(tokenizer, config.text, config.tokens, config.offset), None)
    positions = torch.arange(0, config.tokens, config.query_stride)
    reference = exact_outputs(captured, positions)
    rows = []
    for spec in tqdm(specs, desc="attention fidelity", disable=not progress):
        if spec.is_fp:
            keys_hat, values_hat = captured.keys, captured.values
        else:
            keys_hat = side_states(spec.key, captured.keys, "key", model)
            values_hat = side_states(spec.value, captured.values, "value", model)
        cosine = output_cosine(captured, keys_hat, values_hat, positions, config.sink_tokens, config.recent_tokens,
                               reference)
        rows.append({"cache": spec.spec, "label": spec.label(captured.keys.shape[-1]),
                     "cosine": float(cosine.mean()), "cosine_worst_layer": float(cosine.mean(1).min()),
                     "cosine_per_layer": [float(c) for c in cosine.mean(1)]})
    return {"tokens": config.tokens, "offset": config.offset,
            "query_positions": f"0..{config.tokens - 1} step {config.query_stride}",
            "layers": list(range(captured.num_layers)), "rows": rows}


# --------------------------------------------------------------------------- rotation draws

SPREAD_KEYS = ("cosine", "cosine_worst_layer", "perplexity", "perplexity_change_pct", "second_half_change_pct",
               "kl", "top1_agreement", "needle_accuracy")  # the merged figures that get _sd and _per_seed


def takes_rotation_seed(side) -> bool:
    """Whether one cache side is our codec with a rotation seed it does not fix itself."""
    if side.is_peer:
        return False
    declared = {p.name for p in side.quantizer.codec_class.spec_params}
    return ROTATION_SEED_PARAM in declared and side.quantizer.param(ROTATION_SEED_PARAM) is None


def rotation_variant(spec, seed: int):
    """`spec` with every side that takes a rotation seed at rotation `seed` (a CacheSpec), or None when
    no side takes one (fp, a peer, a spec fixing r= itself): such a spec runs once."""
    from fibquant.codecs.registry import CodecSpec
    from fibquant.kv.specs import Side

    if spec.is_fp or not (takes_rotation_seed(spec.key) or takes_rotation_seed(spec.value)):
        return None

    def seeded(side):
        if not takes_rotation_seed(side):
            return side
        return Side(CodecSpec(side.quantizer.family, **side.quantizer.kwargs, **{ROTATION_SEED_PARAM: seed}))

    return dataclasses.replace(spec, key=seeded(spec.key), value=seeded(spec.value))


def expand_rotations(specs, seeds) -> tuple[list, dict]:
    """(the specs to run, {run spec string: (its row's spec string, seed or None)}): every spec that takes
    a rotation seed once per seed, every other spec (and every spec when `seeds` is empty) as given."""
    runs, origin = [], {}
    for spec in specs:
        variants = [(rotation_variant(spec, seed), seed) for seed in seeds]
        if not variants or variants[0][0] is None:
            runs.append(spec)
            origin[spec.spec] = (spec.spec, None)
            continue
        for variant, seed in variants:
            runs.append(variant)
            origin[variant.spec] = (spec.spec, seed)
    return runs, origin


def merge_rotations(part_rows: list[dict], origin: dict, fields) -> dict:
    """{row spec: merged figures} from an experiment's rows (one per run spec): each of `fields` as the
    mean over a spec's draws (a bool: all of them), with `<field>_sd` (sample sd, 0 for one draw) and
    `<field>_per_seed` for SPREAD_KEYS, and `rotations` / `rotation_seeds`. Tags each part row with
    `rotation_of` and `rotation_seed`."""
    import statistics

    grouped: dict = {}
    for row in part_rows:
        cache, seed = origin[row["cache"]]
        row["rotation_of"], row["rotation_seed"] = cache, seed
        grouped.setdefault(cache, []).append(row)
    merged = {}
    for cache, rows in grouped.items():
        out = {"rotations": len(rows), "rotation_seeds": [r["rotation_seed"] for r in rows]
               if rows[0]["rotation_seed"] is not None else []}
        for field, key in fields.items():
            values = [r.get(key) for r in rows]
            if any(v is None for v in values):
                out[field] = None
            elif all(isinstance(v, bool) for v in values):
                out[field] = all(values)
            elif len(values) == 1:
                out[field] = values[0]
            else:
                out[field] = float(statistics.fmean(values))
            if field in SPREAD_KEYS:
                ok = out[field] is not None and not isinstance(out[field], bool)
                out[f"{field}_sd"] = (statistics.stdev(values) if len(values) > 1 else 0.0) if ok else None
                out[f"{field}_per_seed"] = [float(v) for v in values] if ok else None
        merged[cache] = out
    return merged


def mean_part_rows(part_rows: list[dict], merged: dict, fields) -> list[dict]:
    """One part row per row spec (the first draw's, named by the row spec, its `fields` replaced by the
    means over the draws): what an experiment's own checks judge when rotations were drawn."""
    out, seen = [], set()
    for row in part_rows:
        cache = row["rotation_of"]
        if cache in seen:
            continue
        seen.add(cache)
        out.append(row | {"cache": cache} | {key: merged[cache][field] for field, key in fields.items()})
    return out


# --------------------------------------------------------------------------- the run

def kind_of(spec) -> str:
    """'fp', 'ours' (our codecs on both sides) or 'peer' (a peer on either side)."""
    return "fp" if spec.is_fp else "peer" if spec.uses_peer else "ours"


def group_of(spec) -> str:
    """The plot series of a spec: its family, or 'KEY/VALUE' families for different sides."""
    if spec.is_fp or spec.symmetric:
        return spec.family
    return f"{spec.key.quantizer.family}/{spec.value.quantizer.family}"


def spec_row(spec, dim: int, reason: Optional[str] = None) -> dict:
    """The bytes and names of one spec (what every table shares)."""
    key, value = spec.key_bytes(dim), spec.value_bytes(dim)
    return {"cache": spec.spec, "label": spec.label(dim), "family": spec.family, "group": group_of(spec),
            "kind": kind_of(spec), "key_bytes": key, "value_bytes": value, "bytes_per_vector": 0.5 * (key + value),
            "codes_ratio": spec.codes_ratio(dim), "bits_per_coordinate": spec.bits_per_coordinate(dim),
            "available": reason is None, "note": reason or ""}


def run(config: PeersConfig = PeersConfig(), caches=None, build_codebooks: bool = False,
        model_and_tokenizer=None, progress: bool = True) -> dict:
    """Parse `caches` (default PEERS_REPORT_SPECS; fp always first), run the configured metrics on the
    available specs with one model, merge everything into one row per spec."""
    from fibquant.kv.specs import parse_cache_specs, split_available
    from fibquant.eval.needle import needle_targets, run_needle, target_checks
    from fibquant.peers import package_versions
    from fibquant.eval.perplexity import perplexity_checks, run_perplexity
    from fibquant.eval.timing import Stopwatch
    from fibquant.kv.model import check_model_supported, describe_model, load_model

    model, tokenizer = model_and_tokenizer or load_model()
    dim = check_model_supported(model)["head_dim"]
    specs = parse_cache_specs(list(caches or PEERS_REPORT_SPECS), model)
    if not any(s.is_fp for s in specs):
        specs.insert(0, parse_cache_specs("fp")[0])
    specs = sorted(specs, key=lambda s: not s.is_fp)  # fp first: the reference of every metric
    ready, notes, rows = [], [], []
    for spec in specs:  # one at a time: each row gets its own reason
        ok, why = split_available([spec], dim, build_codebooks)
        ready += ok
        notes += why
        rows.append(spec_row(spec, dim, None if ok else "; ".join(why) or "not available here"))
    by_cache = {row["cache"]: row for row in rows}
    runs, origin = expand_rotations(ready, config.rotation_seeds)  # one run per rotation draw where seeded

    def merge(part_rows, fields) -> list[dict]:
        merged = merge_rotations(part_rows, origin, fields)
        for cache, figures in merged.items():
            by_cache[cache].update(figures)
        return mean_part_rows(part_rows, merged, fields)

    parts, timing = {}, {}
    if "fidelity" in config.metrics:
        with Stopwatch() as watch:
            part = run_fidelity_specs(model, tokenizer, runs, config.fidelity_config(), progress)
        timing["fidelity_s"] = watch.seconds
        merge(part["rows"], {"cosine": "cosine", "cosine_worst_layer": "cosine_worst_layer"})
        parts["fidelity"] = part
    if "perplexity" in config.metrics:
        with Stopwatch() as watch:
            part = run_perplexity(model, tokenizer, runs, config.perplexity_config(), progress)
        timing["perplexity_s"] = watch.seconds
        means = merge(part["rows"], {k: k for k in (
            "perplexity", "perplexity_change_pct", "perplexity_second_half", "second_half_change_pct",
            "kl", "top1_agreement", "cache_bytes_per_token", "cache_stored_bytes_per_token")})
        part["checks"] = perplexity_checks(means)
        parts["perplexity"] = part
    if "needle" in config.metrics:
        with Stopwatch() as watch:
            part = run_needle(model, tokenizer, runs, config.needle_config(), progress)
        timing["needle_s"] = watch.seconds
        fields = {"needle_accuracy": "accuracy", "needle_trials": "trials",
                  "needle_misses_vs_fp": "misses_where_fp_right", "needle_equals_fp": "equals_fp"}
        means = merge(part["rows"], fields | {f"needle_acc_{n}": f"acc_{n}" for n in config.lengths})
        part["targets"] = needle_targets(means)
        part["checks"] = target_checks(part)
        parts["needle"] = part
    payload = {
        "experiment": "every method and peer on attention fidelity, perplexity and needle retrieval, one spec list",
        "model": describe_model(model), "text": config.text, "head_dim": dim,
        "config": dataclasses.asdict(config), "peer_versions": package_versions(), "skipped": notes,
        "timing": timing, "rows": rows, "parts": parts,
    }
    payload["targets"] = {c["target"]: c["measured"] for c in peers_checks(payload)}
    return payload


# --------------------------------------------------------------------------- targets

METRIC_KEYS = {  # metric -> (row key, higher is better, axis label, table header)
    "fidelity": ("cosine", True, "attention output cosine (exact window kept)", "attn cosine"),
    "perplexity": ("perplexity", False, "perplexity (log scale)", "perplexity"),
    "needle": ("needle_accuracy", True, "passkey accuracy", "needle acc"),
}


def is_fibquant(row: dict) -> bool:
    """Our FibQuant on both sides (any rates; one-stage or residual codes: `Codec.fibquant_code`)."""
    classes = codec_classes()
    families = [part.partition(":")[0].partition("@")[0] for part in row["cache"].split("/")]
    return row["kind"] == "ours" and all(f in classes and classes[f].fibquant_code for f in families)


def budget_check(rows: list[dict], metric: str, lo: float = BUDGET_RANGE[0], hi: float = BUDGET_RANGE[1]) -> dict:
    """FibQuant (any rates, K/V included) against every peer point with lo <= K+V ratio <= hi: the best
    FibQuant value among rows with at most the peer's bytes (ratio >= the peer's) must be at least as good."""
    key, higher, _, _ = METRIC_KEYS[metric]
    fib = [r for r in rows if is_fibquant(r) and r.get(key) is not None]
    peers = [r for r in rows if r["kind"] == "peer" and r.get(key) is not None and lo <= r["codes_ratio"] <= hi]
    misses = []
    for peer in peers:
        eligible = [r[key] for r in fib if r["codes_ratio"] >= peer["codes_ratio"] - 1e-9]
        if not eligible:
            misses.append(f"{peer['label']} ({peer['codes_ratio']:.2f}x): no FibQuant point at <= its bytes")
            continue
        best = max(eligible) if higher else min(eligible)
        if (best < peer[key]) if higher else (best > peer[key]):
            misses.append(f"{peer['label']} ({peer['codes_ratio']:.2f}x) {peer[key]:.4g} vs FibQuant {best:.4g}")
    return {"peers": len(peers), "matched": len(peers) - len(misses), "misses": misses}


def peers_checks(payload: dict) -> list[dict]:
    """Per metric run: FibQuant >= every peer at <= its bytes between BUDGET_RANGE ratios; then the
    perplexity and needle experiments' own targets (as they report them)."""
    out = []
    lo, hi = BUDGET_RANGE
    for metric in payload["parts"]:
        check = budget_check(payload["rows"], metric)
        if check["peers"] == 0:
            out.append(target(f"{metric}: FibQuant >= every peer at <= its bytes ({lo:g}-{hi:g}x)",
                              "no peer point in range", None))
            continue
        met = not check["misses"]
        out.append(target(f"{metric}: FibQuant >= every peer at <= its bytes ({lo:g}-{hi:g}x)",
                          f"{check['matched']} of {check['peers']} peer points matched", met,
                          "; ".join(check["misses"])))
    for metric in ("perplexity", "needle"):  # the experiments' own checks, as they judge them
        for check in payload["parts"].get(metric, {}).get("checks", []):
            out.append(check | {"target": f"{metric}: {check['target']}"})
    return out


# --------------------------------------------------------------------------- tables

def metric_columns(payload: dict, metric: str) -> list[tuple[str, str, str]]:
    base = [("label", "method", ""), ("kind", "kind", ""), ("key_bytes", "K B/vec", ".4g"),
            ("value_bytes", "V B/vec", ".4g"), ("bytes_per_vector", "B/vec (K+V)/2", ".4g"),
            ("codes_ratio", "K+V vs fp16", ".2f")]
    seeded = bool(payload["config"].get("rotation_seeds"))
    if metric == "fidelity":
        cols = [("cosine", "attn cosine", ".4f")] + ([("cosine_sd", "sd", ".4f")] if seeded else []) + \
            [("cosine_worst_layer", "worst layer", ".4f")]
    elif metric == "perplexity":
        cols = [("cache_bytes_per_token", "cache B/token", ".0f"),
                ("cache_stored_bytes_per_token", "stored B/token", ".0f"), ("perplexity", "perplexity", ".3f"),
                ("perplexity_change_pct", "change %", "+.2f")]
        cols += [("perplexity_change_pct_sd", "sd", ".2f")] if seeded else []
        cols += [("second_half_change_pct", "2nd half %", "+.2f"), ("kl", "KL vs fp (nats)", ".4f")]
        cols += [("kl_sd", "KL sd", ".4f")] if seeded else []
        cols += [("top1_agreement", "top-1 = fp", ".3f")]
    else:
        cols = [(f"needle_acc_{n}", f"acc {n}", ".2f") for n in payload["config"]["lengths"]]
        cols += [("needle_accuracy", "acc", ".3f")] + ([("needle_accuracy_sd", "sd", ".3f")] if seeded else [])
        # a mean over draws need not be a whole number
        cols += [("needle_misses_vs_fp", "misses vs fp", ".3g" if seeded else "d")]
    if seeded:
        cols.append(("rotations", "rotations", "d"))
    return base + cols + [("note", "note", "")]


def metric_rows(payload: dict, metric: str) -> list[dict]:
    """Rows sorted by bytes (fp first), skipped specs included with their note."""
    return sorted(payload["rows"], key=lambda r: (r["kind"] != "fp", -r["bytes_per_vector"], r["cache"]))


def metric_title(payload: dict, metric: str) -> str:
    c = payload["config"]
    window = f"exact window {c['sink_tokens']} sinks + {c['recent_tokens']} recent"
    if metric == "fidelity":
        part = payload["parts"]["fidelity"]
        what = (f"attention fidelity: {c['text']} tokens {part['offset']}..{part['offset'] + part['tokens'] - 1}, "
                f"all {len(part['layers'])} layers, queries {part['query_positions']}")
    elif metric == "perplexity":
        part = payload["parts"]["perplexity"]
        what = (f"perplexity: {c['text']}, {part['tokens']} tokens = {part['windows']} windows of {part['context']}, "
                f"chunks of {part['chunk']}")
    else:
        what = (f"needle: {c['text']} haystacks of {list(c['lengths'])} tokens, depths {list(c['depths'])}, "
                f"{c['keys_per_cell']} key(s) per cell, seed {c['seed']}")
    seeds = c.get("rotation_seeds")
    draws = (f"; mean over rotation seeds {list(seeds)} for the codecs that take one (sd: sample standard "
             f"deviation over the draws), everything else once") if seeds else ""
    return f"{payload['model']}; {what}; {window}{draws}"


def metric_table(payload: dict, metric: str) -> str:
    return format_table(metric_rows(payload, metric), metric_columns(payload, metric), markdown=True)


def peers_tables(payload: dict) -> str:
    """One Markdown table per metric run, each under its heading."""
    blocks = []
    for metric in payload["parts"]:
        blocks.append(f"### {metric}\n\n{metric_title(payload, metric)}\n\n{metric_table(payload, metric)}\n")
    return "\n".join(blocks)


def peers_header(payload: dict) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in payload["peer_versions"].items() if v)
    lines = [f"\nmodel: {payload['model']}\ntext: {payload['text']}; {len(payload['rows'])} cache specs, "
             f"{sum(r['available'] for r in payload['rows'])} run; peers installed: {versions or 'none'}"]
    lines += [f"skipped: {note}" for note in payload.get("skipped", [])]
    lines.append("timing: " + ", ".join(f"{k} {v:.0f} s" for k, v in payload["timing"].items()))
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plots

def series_style(group: str, kind: str) -> dict:
    """Matplotlib keywords of one series: ours filled (the codec's style), K/V of ours filled 'P',
    peers hollow with dashed lines, anything else grey."""
    from fibquant.codecs.registry import plot_style

    style = plot_style(group)
    if kind == "ours" and style is not None:
        return {"color": style.color, "marker": style.marker or "o", "linestyle": "-", "filled": True,
                "name": style.name}
    if kind == "ours":  # different codecs or rates for keys and values
        first = plot_style(group.split("/")[0])
        color = first.color if first is not None else "C1"
        return {"color": color, "marker": "P", "linestyle": "none", "filled": True,
                "name": f"{first.name if first else group} K/V at different rates"}
    if group in PEERS:  # peers: hollow markers and dashed lines, the family's registered colour and marker
        color, marker = PEERS[group].style
        return {"color": color, "marker": marker, "linestyle": "--", "filled": False, "name": f"{group} (peer)"}
    return {"color": "0.4", "marker": "x", "linestyle": "none", "filled": True, "name": f"{group} (peer mix)"}


def draw_metric(ax, payload: dict, metric: str, annotate: bool = True) -> None:
    """One metric against K+V compression vs fp16 (bottom) and bytes per vector (top), one series per family."""
    import matplotlib.ticker

    key, _, ylabel, _ = METRIC_KEYS[metric]
    rows = [r for r in payload["rows"] if r.get(key) is not None]
    dim = payload["head_dim"]
    groups: dict = {}
    for row in rows:
        if row["kind"] != "fp":
            groups.setdefault((row["group"], row["kind"]), []).append(row)
    for (group, kind), items in groups.items():
        items = sorted(items, key=lambda r: r["codes_ratio"])
        style = series_style(group, kind)
        x, y = [r["codes_ratio"] for r in items], [r[key] for r in items]
        ax.plot(x, y, color=style["color"], linestyle=style["linestyle"], linewidth=1.2, marker=style["marker"],
                markersize=7, markerfacecolor=style["color"] if style["filled"] else "none",
                markeredgecolor=style["color"], label=style["name"])
        if annotate:
            for r in items:
                short = r["cache"].replace("fibquant:", "").replace("turboquant:", "") if kind == "ours" else \
                    r["cache"].split(":")[-1]
                ax.annotate(short, (r["codes_ratio"], r[key]), fontsize=5, color=style["color"],
                            xytext=(3, 3), textcoords="offset points")
    for row in payload["rows"]:
        if row["kind"] == "fp" and row.get(key) is not None:
            ax.axhline(row[key], color="k", linestyle=":", linewidth=1, label=f"fp ({row[key]:.4g})")
    lo, hi = BUDGET_RANGE
    ax.axvspan(lo, hi, color="0.92", zorder=0)
    ax.set_xscale("log")
    if metric == "perplexity":
        ax.set_yscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ratios = [r["codes_ratio"] for r in rows if r["kind"] != "fp"] or [1.0]
    ax.set_xticks([t for t in (1, 2, 3, 4, 6, 8, 12, 16, 32) if 0.8 * min(ratios) <= t <= 1.25 * max(ratios)])
    import numpy as np

    def swap(v):  # ratio <-> bytes per vector, both 2 * dim / the other
        return 2.0 * dim / np.maximum(np.asarray(v, dtype=float), 1e-9)
    top = ax.secondary_xaxis("top", functions=(swap, swap))
    top.set_xlabel("bytes per stored vector, (K + V) / 2", fontsize=8)
    top.xaxis.set_major_locator(matplotlib.ticker.FixedLocator([6, 8, 10, 12, 14, 16, 18, 20, 23, 26, 30, 34, 40,
                                                                48, 64, 128]))
    top.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    top.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    top.tick_params(labelsize=7)
    ax.set_xlabel("key + value compression vs fp16 (every stored byte; grey band: the 3.5-12x target range)",
                  fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def plot_metric(payload: dict, metric: str, path) -> None:
    with figure(path, dpi=130, figsize=(9, 6)) as (fig, ax):
        draw_metric(ax, payload, metric)
        ax.set_title(textwrap.fill(metric_title(payload, metric), 130), fontsize=7)
        ax.legend(fontsize=6, ncol=2)


def plot_overview(payload: dict, path) -> None:
    """All metrics side by side (no point labels), one legend."""
    metrics = list(payload["parts"])
    with figure(path, dpi=110, figsize=(6 * len(metrics), 5), ncols=len(metrics), squeeze=False) as (fig, axes):
        for ax, metric in zip(axes[0], metrics):
            draw_metric(ax, payload, metric, annotate=False)
            ax.set_title(metric, fontsize=9)
        handles, labels = axes[0][0].get_legend_handles_labels()
        axes[0][-1].legend(handles, labels, fontsize=6)
        fig.suptitle(f"{payload['model']}, {payload['text']}: every method and peer, exact window "
                     f"{payload['config']['sink_tokens']}+{payload['config']['recent_tokens']}", fontsize=9)


@dataclass(frozen=True)
class PeersExperiment(Experiment):
    """The report also writes `peers_<metric>.md` and `peers_<metric>.png` for every metric run."""

    def report(self, payload: dict, out_dir=None, echo: bool = True) -> dict[str, str]:
        paths = super().report(payload, out_dir, echo)
        folder = results_dir(out_dir)
        stem = self.stem_of(payload)
        for metric in payload["parts"]:
            table = folder / f"{stem}_{metric}.md"
            table.write_text(f"{metric_title(payload, metric)}\n\n{metric_table(payload, metric)}\n")
            png = folder / f"{stem}_{metric}.png"
            plot_metric(payload, metric, png)
            paths[f"{metric}_table"], paths[f"{metric}_png"] = str(table), str(png)
        if echo:
            print("wrote " + " and ".join(str(Path(p).name) for k, p in paths.items() if "_" in k))
        return paths


EXPERIMENT = PeersExperiment(name="peers", stem="peers", config=PeersConfig, run=run, table=peers_tables,
                             plot=plot_overview, targets=peers_checks, header=peers_header, table_suffix=".md")

