"""Experiment 1: is the canonical source real? KS tests of k-block radii on real keys and values.

Protocol: the model reads `tokens` tokens of a novel once with a transformers DynamicCache;
the cached keys (post-RoPE, exactly what a KV cache stores) and values of the chosen layers
are taken, all KV heads and positions pooled: X [heads * tokens, head_dim]. Two versions of
the unit vectors are compared against the spherical-Beta law of Theorem 1:

    unrotated: u = x / ||x||
    rotated:   u = Pi x / ||x||   (one shared Haar-random Pi, `fibquant.canonical.haar_rotation`)

For each block size k the squared radii ||y||^2 of the d/k consecutive k-blocks of every u
are compared with Beta(k/2, (d-k)/2) by the one-sample Kolmogorov-Smirnov statistic
sup |F_empirical - F_Beta|. Blocks of one vector are dependent, so only the statistic (a
distance between distributions) is reported, not a p-value; as a finite-sample floor the same
statistic is computed on as many truly uniform unit vectors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from scipy import stats

from fibquant.kv.model import cache_kwarg
from fibquant.canonical import block_radii, canonicalize, haar_rotation, radius_law, sample_sphere
from fibquant.eval.report import Experiment


@dataclass(frozen=True)
class CanonicalConfig:
    text: str = "emma"
    tokens: int = 1024
    offset: int = 0
    layers: tuple[int, ...] = (0, 7, 15, 29)
    block_sizes: tuple[int, ...] = (1, 2, 4, 8)
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or self.tokens < 2:
            raise ValueError(f"tokens must be an integer >= 2, got {self.tokens!r}")
        if not isinstance(self.offset, int) or self.offset < 0:
            raise ValueError(f"offset must be a non-negative integer, got {self.offset!r}")
        if not self.layers or any(not isinstance(i, int) for i in self.layers):
            raise ValueError(f"layers must be a non-empty tuple of integers, got {self.layers!r}")
        if not self.block_sizes or any(not isinstance(k, int) or k < 1 for k in self.block_sizes):
            raise ValueError(f"block_sizes must be positive integers, got {self.block_sizes!r}")


@torch.no_grad()
def cached_states(model, input_ids: torch.Tensor,
                  layers: tuple[int, ...]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Run one sequence ([T] or [1, T]) with a DynamicCache; {layer: (keys, values)}, each
    [kv_heads, T, head_dim] float32 on the model's device (keys after RoPE, as cached)."""
    from transformers import DynamicCache

    if input_ids.ndim == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"cached_states expects one sequence [T] or [1, T], got {tuple(input_ids.shape)}")
    n_layers = model.config.num_hidden_layers
    bad = [i for i in layers if not -n_layers <= i < n_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range for a model with {n_layers} layers")
    cache = DynamicCache()
    device = next(model.parameters()).device
    model(input_ids=input_ids.to(device), **cache_kwarg(model, cache), use_cache=True)
    out = {}
    for i in layers:
        layer = cache.layers[i]
        out[i % n_layers] = (layer.keys[0].float(), layer.values[0].float())
    return out


def ks_statistic(radii: torch.Tensor, dim: int, k: int) -> float:
    """sup-distance between the empirical law of squared block radii and Beta(k/2, (dim-k)/2)."""
    law = radius_law(dim, k)
    return float(stats.kstest(radii.detach().double().cpu().numpy(), law.cdf).statistic)


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """x [n, d] -> x / ||x|| row-wise (zero rows stay zero)."""
    return canonicalize(x, torch.eye(x.shape[-1], dtype=x.dtype, device=x.device))[1]


def canonical_ks(states: torch.Tensor, block_sizes: tuple[int, ...], rotation: torch.Tensor) -> dict[int, dict]:
    """states [n, d] -> {k: {"unrotated": KS, "rotated": KS}} for each block size k < d."""
    x = states.double()
    unrotated = unit_rows(x)
    _, rotated = canonicalize(x, rotation.to(x.device))
    dim = x.shape[-1]
    return {k: {"unrotated": ks_statistic(block_radii(unrotated, k), dim, k),
                "rotated": ks_statistic(block_radii(rotated, k), dim, k)}
            for k in block_sizes}


def uniform_floor(n: int, dim: int, block_sizes: tuple[int, ...], seed: int) -> dict[int, float]:
    """KS statistic of n truly uniform unit vectors: what sampling noise alone gives."""
    u = sample_sphere(n, dim, seed=seed + 1, dtype=torch.float64)
    return {k: ks_statistic(block_radii(u, k), dim, k) for k in block_sizes}


def run_canonical(model, tokenizer, config: CanonicalConfig = CanonicalConfig(), progress: bool = True) -> dict:
    """The experiment; returns the JSON payload (rows: layer, kind, k, KS unrotated/rotated)."""
    from tqdm.auto import tqdm

    from fibquant.kv.model import describe_model
    from fibquant.eval.kv_report import text_tokens

    ids = text_tokens(tokenizer, config.text, config.tokens, config.offset)
    states = cached_states(model, ids, config.layers)
    dim = next(iter(states.values()))[0].shape[-1]
    for k in config.block_sizes:
        if k >= dim or dim % k:
            raise ValueError(f"block size k={k} must divide head_dim={dim} and be smaller than it")
    rotation = haar_rotation(dim, config.seed, dtype=torch.float64)
    rows = []
    jobs = [(layer, kind) for layer in sorted(states) for kind in ("keys", "values")]
    for layer, kind in tqdm(jobs, desc="KS tests", disable=not progress):
        tensor = states[layer][0 if kind == "keys" else 1]
        flat = tensor.reshape(-1, dim)
        for k, ks in canonical_ks(flat, config.block_sizes, rotation).items():
            rows.append({"layer": layer, "kind": kind, "k": k, "vectors": flat.shape[0],
                         "ks_unrotated": ks["unrotated"], "ks_rotated": ks["rotated"],
                         "improvement": ks["unrotated"] / max(ks["rotated"], 1e-12)})
    n_vectors = rows[0]["vectors"]
    floor = uniform_floor(n_vectors, dim, config.block_sizes, config.seed)
    for row in rows:
        row["ks_uniform_floor"] = floor[row["k"]]
    return {"experiment": "canonical_source", "model": describe_model(model), "text": config.text,
            "tokens": config.tokens, "offset": config.offset, "head_dim": dim, "seed": config.seed,
            "layers": sorted(states), "block_sizes": list(config.block_sizes),
            "law": "||y||^2 ~ Beta(k/2, (d-k)/2)", "rows": rows}


CANONICAL_COLUMNS = [("layer", "layer", "d"), ("kind", "kind", ""), ("k", "k", "d"),
                     ("ks_unrotated", "KS unrotated", ".4f"), ("ks_rotated", "KS rotated", ".4f"),
                     ("improvement", "unrot/rot", ".1f"), ("ks_uniform_floor", "KS uniform", ".4f")]


def plot_canonical(payload: dict, path) -> None:
    """Bars of the KS statistic, unrotated vs rotated (log scale), one panel per kind and layer."""
    from fibquant.eval.report import figure

    layers, ks_list = payload["layers"], payload["block_sizes"]
    with figure(path, nrows=2, ncols=len(layers), figsize=(3.2 * len(layers), 6), sharey=True,
                squeeze=False) as (fig, axes):
        width = 0.27
        for row_index, kind in enumerate(("keys", "values")):
            for col, layer in enumerate(layers):
                ax = axes[row_index][col]
                rows = {r["k"]: r for r in payload["rows"] if r["layer"] == layer and r["kind"] == kind}
                x = list(range(len(ks_list)))
                for shift, key, label in ((-width, "ks_unrotated", "unrotated"),
                                          (0.0, "ks_rotated", "Haar-rotated"),
                                          (width, "ks_uniform_floor", "uniform (noise floor)")):
                    ax.bar([i + shift for i in x], [rows[k][key] for k in ks_list], width, label=label)
                ax.set_yscale("log")
                ax.set_xticks(x, [f"k={k}" for k in ks_list])
                ax.set_title(f"layer {layer} {kind}", fontsize=9)
                if col == 0:
                    ax.set_ylabel("KS statistic vs Beta(k/2,(d-k)/2)")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"Canonical source on real KV: {payload['model']}, {payload['tokens']} tokens of "
                     f"{payload['text']}", fontsize=9)


def canonical_header(payload: dict) -> str:
    return (f"Canonical source: {payload['model']}, {payload['tokens']} tokens of {payload['text']!r} "
            f"(offset {payload['offset']}); KS statistic of squared k-block radii vs {payload['law']}")


def run(config: CanonicalConfig = CanonicalConfig(), model_and_tokenizer=None, progress: bool = True) -> dict:
    """`run_canonical` on `model_and_tokenizer` (default: the default model)."""
    from fibquant.kv.model import load_model

    model, tokenizer = model_and_tokenizer or load_model()
    return run_canonical(model, tokenizer, config, progress=progress)


EXPERIMENT = Experiment(name="canonical-source", stem="canonical_source", config=CanonicalConfig, run=run,
                        columns=CANONICAL_COLUMNS, plot=plot_canonical, header=canonical_header)


def save_canonical(payload: dict, out_dir) -> dict[str, str]:
    """Write canonical_source.json and canonical_source.png under out_dir; return their paths."""
    return EXPERIMENT.report(payload, out_dir, echo=False)
