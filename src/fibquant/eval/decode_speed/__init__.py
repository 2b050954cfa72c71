"""Time to first token, decode speed and memory of KV caches on a real model and real text.

Protocol, per context length L (the first L tokens of one novel, no special tokens). Three parts,
each optional (`DecodeSpeedConfig.parts`), run in this order for every cache before the next part
(so the caches of one part are timed close together):

- "ttft", one-shot time to first token: each cache is built fresh and empty
  (`DynamicCache(config=...)`, `CompressedCache.for_model(model, codec, codec, sink_tokens,
  recent_tokens, attention=...)`, `QuantizedCache(...)`), the whole prompt goes through the model
  in one forward with that cache in the loop (last-position logits only), then the argmax of the
  first token; all of it is timed (`fibquant.eval.decode_speed.ttft`), with the peak memory the
  prefill adds; `prefill_repeats` rounds, each one fresh prefill per cache (interleaved, like the
  decode steps below);
- "chunked", the same with the prompt fed in chunks of `chunk_tokens` tokens, one forward each
  (later chunks of ours attend to the earlier ones through their codes);
- "decode", from one shared float prefill:
  1. one float prefill: the model runs once over the L tokens with a `DynamicCache`; its greedy
     next token starts every decode below;
  2. every cache under test is built from that prefill, so all start from the same state and
     the same first input token:
     - "fp": a `DynamicCache` copy (the prefill's own cache stays untouched),
     - ours (`fibquant:b=4`, `turboquant:b=2`, ...): `CompressedCache.from_cache(prefill, codec, codec,
       sink_tokens, recent_tokens, attention="codes" | "decode")`; the conversion is timed and
       reported next to the prefill time,
     - transformers' `QuantizedCache` (quanto / hqq backends): the prefill keys/values are fed
       layer by layer through its `update`, which is exactly what its own prefill would store
       (the first update of a `QuantizedLayer` quantizes all states and keeps no float residual);
  3. `decode_tokens` rounds of greedy steps, one token per forward pass with the cache (not
     `generate`), interleaved (`fibquant.eval.decode_speed.steps`): each round steps every cache
     once, so all caches see the same machine state; each step is timed (forward + argmax); the
     median is the decode ms/token, and "paired" ratios are the median over the rounds of a
     cache's step over DynamicCache's step of the same round;
  4. the cache's bytes after those steps; then, one cache at a time, the peak resident memory
     the process adds over `memory_steps` further untimed steps (over its RSS just before them,
     see `PeakRSS`).

Every ratio is against the DynamicCache measured in the same run at the same context. The
model runs in float32, so its DynamicCache is float32; `dynamic_fp16_bytes` (half of it) is
what an fp16 DynamicCache would hold, the usual reference for compression claims. The run sets
`config.threads` torch threads (default 1; the numba kernels follow torch's count) and restores
the previous count afterwards.
"""
from __future__ import annotations

from contextlib import ExitStack
import os
import platform
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Optional

from fibquant.eval.decode_speed.config import (BYTES_COUNTING, DEFAULT_CACHES, SpeedCache, DecodeSpeedConfig,
                                               _package_version, cache_bytes, load_benchmark_model,
                                               peer_unavailable_reason)
from fibquant.eval.decode_speed.steps import Decoding, interleave, paired_ratio
from fibquant.eval.decode_speed.report import (decode_speed_header, decode_speed_table, decode_speed_targets,
                                               plot_decode_speed)
from fibquant.eval.decode_speed.ttft import (codes_switch, cpu_clock_name, fresh_cache, fresh_prefill,
                                             prefill_fields, time_fresh_prefill)
from fibquant.eval.memory import PeakCUDA, PeakRSS, _synchronize, release_free_memory
from fibquant.eval.report import Experiment
from fibquant.eval.timing import Stopwatch, timed
from fibquant.kv.model import copy_dynamic_cache, last_logits

if TYPE_CHECKING:
    import torch

# The cache names, the config and the report live in decode_speed/config.py / decode_speed/report.py.
__all__ = ["BYTES_COUNTING", "DEFAULT_CACHES", "EXPERIMENT", "DecodeSpeedConfig", "cache_bytes", "context_tokens",
           "reserved_positions", "run_decode_speed", "write_decode_speed"]

# ----------------------------------------------------------------------------- model calls

def _build_cache(spec: SpeedCache, prefill, model, codec, config: DecodeSpeedConfig):
    """The cache of `spec`, built from the prefill DynamicCache (`codec`: ours' codec, built once per run)."""
    if spec.kind == "dynamic":
        return copy_dynamic_cache(prefill, model.config)
    if spec.kind == "compressed":
        from fibquant.kv.cache import CompressedCache

        return CompressedCache.from_cache(prefill, codec, codec, sink_tokens=config.sink_tokens,
                                          recent_tokens=config.recent_tokens, attention=spec.attention,
                                          model=model, recall=spec.recall_option())
    cache = fresh_cache(spec, model, codec, config)
    for index, layer in enumerate(prefill.layers):
        cache.update(layer.keys, layer.values, index)
    return cache


@dataclass
class _Prefill:
    tokens: int
    cache: object
    first_token: torch.Tensor
    seconds: float


def _prefill(model, ids: torch.Tensor) -> _Prefill:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    seconds, logits = timed(lambda: last_logits(model, ids[None], cache))
    return _Prefill(ids.shape[0], cache, logits.argmax().view(1, 1), seconds)


def _start_decoding(spec: SpeedCache, prefill: _Prefill, model, codec, config: DecodeSpeedConfig
                    ) -> tuple[float, Decoding]:
    """(conversion seconds, the cache built from the prefill, ready to step from its first token)."""
    release_free_memory()
    conversion, cache = timed(lambda: _build_cache(spec, prefill.cache, model, codec, config))
    return conversion, Decoding(cache, prefill.first_token)


def _decode_memory(decoding: Decoding, model, config: DecodeSpeedConfig):
    """Peak memory `config.memory_steps` further (untimed) steps of one cache add, alone (see PeakRSS)."""
    release_free_memory()
    monitor = PeakCUDA(model.device) if model.device.type == "cuda" else PeakRSS(config.memory_interval_s)
    with monitor:
        for _ in range(config.memory_steps):
            decoding.token = last_logits(model, decoding.token, decoding.cache).argmax().view(1, 1)
        _synchronize(model.device)
    return monitor


def _decode_row(spec: SpeedCache, prefill: _Prefill, model, conversion: float, decoding: Decoding,
                nbytes: dict, seq_length: int, monitor) -> dict:
    """The decode fields of one cache's row (times of its interleaved steps, bytes after them, memory)."""
    step_ms = [1000.0 * s for s in decoding.wall_s]
    step_cpu_ms = [1000.0 * s for s in decoding.cpu_s]
    if spec.kind == "compressed":
        cache_dtype = str(next(model.parameters()).dtype)
    else:
        cache_dtype = str(prefill.cache.layers[0].keys.dtype)
    return {
        "cache": spec.name, "label": spec.label, "kind": spec.kind, "family": spec.family, "bits": spec.bits,
        "attention": spec.attention, "attention_used": getattr(decoding.cache, "attention", None),
        "tokens": prefill.tokens, "cache_tokens_after": seq_length,
        "dynamic_prefill_s": prefill.seconds,
        "conversion_s": 0.0 if spec.kind == "dynamic" else conversion,
        "prefill_s": prefill.seconds + (0.0 if spec.kind == "dynamic" else conversion),
        "decode_ms_median": statistics.median(step_ms), "decode_ms_mean": statistics.fmean(step_ms),
        "decode_ms_min": min(step_ms), "step_ms": step_ms,
        "decode_cpu_ms_median": statistics.median(step_cpu_ms), "step_cpu_ms": step_cpu_ms,
        "cache_bytes": nbytes["held"], "cache_used_bytes": nbytes["used"],
        "bytes_parts": {k: v for k, v in nbytes.items() if k not in ("held", "used")},
        "cache_float_dtype": cache_dtype,
        "peak_rss_added_bytes": monitor.added, "rss_before_decode_bytes": monitor.start,
        "memory_method": monitor.description,
        "generated_tokens": decoding.tokens, "_first_logits": decoding.first_logits,
        # rows read from the cold tier per timed step (its reads were counted before the memory steps)
        "cold_rows_read_per_step": (nbytes["cold_rows_read"] / len(step_ms) if spec.recall and step_ms else None),
    }


def _run_decode(specs, prefill: _Prefill, model, codecs: dict, config: DecodeSpeedConfig, decode_tokens: int,
                skips: "_Skips") -> dict[str, dict]:
    """The decode part at one context: every cache built from the shared prefill, then
    `decode_tokens` interleaved rounds (`steps.interleave`), then each cache's memory alone.
    Returns {cache name: row fields}; a peer that fails is skipped (`skips`)."""
    started: dict[str, tuple[SpeedCache, float, Decoding]] = {}
    switch = ExitStack()
    try:
        switch.enter_context(codes_switch(specs, model))
        for spec in specs:
            built = skips.attempt(spec, f"building the decode cache at context {prefill.tokens}",
                                  lambda: _start_decoding(spec, prefill, model, codecs[spec.name], config))
            if built is not None:
                started[spec.name] = (spec, *built)
        by_name = {name: spec for name, (spec, _, _) in started.items()}

        def on_error(name: str, exc: Exception) -> bool:
            failed = skips.attempt(by_name[name], f"decode at context {prefill.tokens}", lambda: _raise(exc))
            del started[name]
            return failed is None  # a peer: dropped and reported; ours and DynamicCache: raise

        # Every cache runs under fibquant's attention once one of ours is among them: it serves plain-tensor
        # caches through transformers' SDPA unchanged.
        interleave({name: entry[2] for name, entry in started.items()}, model, decode_tokens, on_error)
        out = {}
        for name, (spec, conversion, decoding) in list(started.items()):
            # a peer that fails here (its bytes, or a memory step) is dropped and reported like a failed step
            measured = skips.attempt(spec, f"the memory steps at context {prefill.tokens}", lambda: (
                cache_bytes(spec, decoding.cache), decoding.cache.get_seq_length(),
                _decode_memory(decoding, model, config)))
            if measured is None:
                del started[name]
                continue
            out[name] = _decode_row(spec, prefill, model, conversion, decoding, *measured)
        return out
    finally:
        started.clear()
        switch.close()


def _run_prefills(specs, model, ids, chunk, codecs: dict, config: DecodeSpeedConfig, part: str,
                  skips: "_Skips") -> dict[str, dict]:
    """`config.prefill_repeats` rounds, each one fresh prefill per cache (the order rotated by one
    cache per round, as the decode steps), so the repeats of every cache see the same machine
    state. Returns {cache name: `prefill_fields`}; a peer that fails is skipped (`skips`)."""
    runs: dict[str, list] = {spec.name: [] for spec in specs}
    order = list(specs)
    for index in range(config.prefill_repeats):
        shift = index % len(order) if order else 0
        for spec in order[shift:] + order[:shift]:
            run = skips.attempt(spec, f"{part} at context {ids.shape[0]}", lambda: fresh_prefill(
                spec, model, ids, chunk, codecs[spec.name], config))
            if run is None:
                order.remove(spec)
                runs.pop(spec.name)
            else:
                runs[spec.name].append(run)
    return {name: prefill_fields(done, ids, chunk, part) for name, done in runs.items()}


def _raise(exc: Exception):
    raise exc


def _ratio(row: dict, ref: dict, key: str) -> Optional[float]:
    """row[key] / ref[key], None where either is missing or the reference is not positive."""
    mine, theirs = row.get(key), ref.get(key)
    return None if mine is None or theirs is None or theirs <= 0 else mine / theirs


def _add_ratios(rows: list[dict]) -> None:
    """Ratios of each row to the DynamicCache row of the same context (value / dynamic's value);
    None where a part did not run for either."""
    by_context: dict[int, dict] = {r["tokens"]: r for r in rows if r["kind"] == "dynamic"}
    for row in rows:
        ref = by_context.get(row["tokens"])
        if ref is None:
            continue
        for part in ("ttft", "chunked"):
            row[f"{part}_vs_dynamic"] = _ratio(row, ref, f"{part}_s")
            if f"{part}_s_all" in row and f"{part}_s_all" in ref:  # the prefills of one round, paired
                row[f"{part}_paired_vs_dynamic"] = paired_ratio(row[f"{part}_s_all"], ref[f"{part}_s_all"])
                row[f"{part}_cpu_paired_vs_dynamic"] = paired_ratio(row[f"{part}_cpu_s_all"], ref[f"{part}_cpu_s_all"])
            row[f"{part}_cpu_vs_dynamic"] = _ratio(row, ref, f"{part}_cpu_s")
            row[f"{part}_peak_vs_dynamic"] = _ratio(row, ref, f"{part}_peak_added_bytes")
            mine, theirs = row.get(f"{part}_token"), ref.get(f"{part}_token")
            row[f"{part}_token_matches_dynamic"] = None if mine is None or theirs is None else mine == theirs
        if row.get("decode_ms_median") is None or ref.get("decode_ms_median") is None:
            continue
        fp16 = ref["dynamic_fp16_bytes"]
        row["decode_vs_dynamic"] = row["decode_ms_median"] / ref["decode_ms_median"]
        row["decode_cpu_vs_dynamic"] = _ratio(row, ref, "decode_cpu_ms_median")
        # Each step against DynamicCache's step of the same round (steps.interleave), median over rounds.
        row["decode_paired_vs_dynamic"] = paired_ratio(row["step_ms"], ref["step_ms"])
        row["decode_cpu_paired_vs_dynamic"] = paired_ratio(row["step_cpu_ms"], ref["step_cpu_ms"])
        # The mean counts the steps that encode a batch of tokens (every encode_batch-th step).
        row["decode_mean_vs_dynamic"] = row["decode_ms_mean"] / ref["decode_ms_mean"]
        row["prefill_vs_dynamic"] = row["prefill_s"] / ref["prefill_s"]
        row["bytes_vs_dynamic"] = row["cache_bytes"] / ref["cache_bytes"]
        row["bytes_vs_fp16_dynamic"] = row["cache_bytes"] / fp16
        row["used_bytes_vs_fp16_dynamic"] = row["cache_used_bytes"] / fp16
        row["compression_vs_fp16_dynamic"] = fp16 / row["cache_bytes"]
        row["peak_rss_vs_dynamic"] = _ratio(row, ref, "peak_rss_added_bytes")
        matches = sum(a == b for a, b in zip(row["generated_tokens"], ref["generated_tokens"]))
        row["tokens_match_dynamic"] = matches / max(len(ref["generated_tokens"]), 1)
        mine, theirs = row.get("_first_logits"), ref.get("_first_logits")
        row["first_step_logits_max_abs_diff"] = (None if mine is None or theirs is None
                                                 else float((mine - theirs).abs().max()))


def reserved_positions(config: DecodeSpeedConfig) -> int:
    """Positions a run needs after the prompt: the decode part's timed and memory steps; none when
    only the prefill parts run (their first token is an argmax, not a forward at a new position)."""
    return config.decode_tokens + config.memory_steps if "decode" in config.parts else 0


def context_tokens(model, contexts, decode_tokens: int) -> list[tuple[int, int]]:
    """(requested context, prefill tokens): contexts are cut so that context + decoded tokens fit
    the model's `max_position_embeddings` (`decode_tokens`: `reserved_positions` in a run)."""
    text_config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
        else model.config
    limit = getattr(text_config, "max_position_embeddings", None)
    out = []
    for context in contexts:
        tokens = int(context)
        if limit and tokens + decode_tokens > limit:
            tokens = limit - decode_tokens
        if tokens < 2:
            raise ValueError(f"context {context}: the model's limit {limit} leaves no room for the prompt")
        out.append((int(context), tokens))
    return out


def run_decode_speed(config: DecodeSpeedConfig = DecodeSpeedConfig(), model_and_tokenizer=None,
                     token_ids: Optional[torch.Tensor] = None, progress: bool = True) -> dict:
    """Measure every cache of `config` at every context; returns the JSON-ready payload.

    model_and_tokenizer: (model, tokenizer), default `fibquant.load_model()`. token_ids: a 1-D
    tensor of token ids to use instead of tokenising `config.text` (e.g. for a random model).
    Runs on `config.threads` torch threads (restored afterwards).
    """
    import torch

    threads_before = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(int(config.threads))
    try:
        with torch.no_grad():
            return _run_decode_speed(config, model_and_tokenizer, token_ids, progress)
    finally:
        torch.set_num_threads(threads_before)


def _base_row(spec: SpeedCache, context: int, tokens: int) -> dict:
    return {"cache": spec.name, "label": spec.label, "kind": spec.kind, "family": spec.family, "bits": spec.bits,
            "attention": spec.attention, "context": context, "tokens": tokens}


class _Skips:
    """Peer (QuantizedCache) failures at run time: reported, never fatal; ours and DynamicCache raise."""

    def __init__(self, skipped: list, bar):
        self.skipped, self.bar = skipped, bar

    def attempt(self, spec: SpeedCache, where: str, fn):
        try:
            return fn()
        except Exception as exc:
            if spec.kind != "quantized":
                raise
            reason = f"{where} failed: {type(exc).__name__}: {exc}"
            self.skipped.append({"cache": spec.name, "reason": reason})
            self.bar.write(f"skipping {spec.name} ({where}): {reason}")
            return None


def _run_decode_speed(config, model_and_tokenizer, token_ids, progress) -> dict:
    import torch

    from fibquant.kv.model import check_model_supported, describe_model

    if model_and_tokenizer is None:
        print("loading the model ...", file=sys.stderr, flush=True)
        model_and_tokenizer = load_benchmark_model(config)
    model, tokenizer = model_and_tokenizer
    head_dim = check_model_supported(model)["head_dim"]
    plan = context_tokens(model, config.contexts, reserved_positions(config))
    token_ids, source = _prompt_ids(config, model, tokenizer, token_ids, max(tokens for _, tokens in plan))
    specs, skipped = _available_specs(config)
    # One codec per cache of ours, built before any clock starts (codebook and rotation are per model).
    codecs = {spec.name: spec.codec_spec().build(head_dim) if spec.kind == "compressed" else None for spec in specs}
    if config.warmup:
        _warmup(specs, model, head_dim, config, token_ids, skipped, progress, codecs)
        specs = [s for s in specs if s.name not in {x["cache"] for x in skipped}]
    watch = Stopwatch()
    rows = _measure(plan, specs, model, token_ids, codecs, config, skipped, progress)
    # A row for which no part succeeded (a failing peer) is left out; the skip says why.
    measured = [row for row in rows.values() if any(f"{p}_s" in row for p in ("ttft", "chunked"))
                or "decode_ms_median" in row]
    _add_ratios(measured)
    for row in measured:
        row.pop("_first_logits", None)
    memory_method = next((r.get("prefill_memory_method") or r.get("memory_method") for r in measured), None)
    return {
        "experiment": "time to first token (fresh cache, one-shot and chunked prefill), decode speed and memory "
                      "of KV caches (one shared float prefill per context, greedy decode)",
        "model": describe_model(model), "model_dtype": str(next(model.parameters()).dtype),
        "text": source, "head_dim": head_dim,
        "config": {**asdict(config), "contexts": list(config.contexts), "caches": list(config.caches),
                   "parts": list(config.parts)},
        "parts": list(config.parts),
        "contexts": [{"context": c, "tokens": t} for c, t in plan],
        **_environment(model),
        "protocol": _protocol(config, memory_method),
        "rows": measured, "skipped": skipped, "seconds": watch.seconds,
    }


def _prompt_ids(config, model, tokenizer, token_ids, longest: int):
    """(at least `longest` token ids on the model's device, where they come from): the caller's, the
    config's text, or random ids for a model with random weights (speed does not depend on them)."""
    import torch

    if token_ids is None and tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        token_ids = torch.randint(0, model.config.vocab_size, (longest,), generator=generator)
    if token_ids is None:
        from fibquant.eval.kv_report import text_tokens

        token_ids = text_tokens(tokenizer, config.text, longest)
        source = config.text
    else:
        if token_ids.ndim != 1 or token_ids.shape[0] < longest:
            raise ValueError(f"token_ids must be 1-D with at least {longest} ids, got {tuple(token_ids.shape)}")
        source = "token_ids given by the caller"
    return token_ids.to(model.device), source


def _available_specs(config) -> tuple[list, list[dict]]:
    """(the config's caches that can run here, a skip note for each peer whose package is absent)."""
    skipped, specs = [], []
    for spec in config.specs():
        reason = peer_unavailable_reason(spec.family) if spec.kind == "quantized" else None
        if reason is None:
            specs.append(spec)
        else:
            skipped.append({"cache": spec.name, "reason": reason})
            print(f"skipping {spec.name}: {reason}", file=sys.stderr, flush=True)
    return specs, skipped


def _measure(plan, specs, model, token_ids, codecs, config, skipped, progress) -> dict:
    """{(tokens, cache name): row} of every context of `plan`: the prefill parts (ttft, chunked), then decode
    from one shared float prefill, each part every cache in turn."""
    from tqdm.auto import tqdm

    rows: dict[tuple[int, str], dict] = {}
    parts = config.parts
    bar = tqdm(total=len(plan) * len(specs) * len(parts), desc="decode speed", disable=not progress)
    skips = _Skips(skipped, bar)
    for context, tokens in plan:
        ids = token_ids[:tokens]
        for spec in specs:
            rows[(tokens, spec.name)] = _base_row(spec, context, tokens)
        for part, chunk in (("ttft", None), ("chunked", config.chunk_tokens)):
            if part not in parts:
                continue
            bar.set_postfix_str(f"{tokens} {part}, {len(specs)} caches in turn")
            for name, fields in _run_prefills(specs, model, ids, chunk, codecs, config, part, skips).items():
                rows[(tokens, name)].update(fields)
            bar.update(len(specs))
        if "decode" in parts:
            release_free_memory()
            bar.set_postfix_str(f"{tokens} shared prefill")
            prefill = _prefill(model, ids)
            bar.set_postfix_str(f"{tokens} decode, {len(specs)} caches interleaved")
            for name, fields in _run_decode(specs, prefill, model, codecs, config, config.decode_tokens,
                                            skips).items():
                fields.update(context=context)
                if fields["kind"] == "dynamic":
                    element = prefill.cache.layers[0].keys.element_size()
                    fields["dynamic_fp16_bytes"] = fields["cache_bytes"] * 2 // element
                rows[(tokens, name)].update(fields)
            bar.update(len(specs))
            del prefill
    bar.close()
    return rows


def _environment(model) -> dict:
    """Threads, load, package versions and machine of a run."""
    import torch

    return {
        "threads": torch.get_num_threads(),
        "load_average": _load_average(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": _package_version("transformers"), "numba": _package_version("numba"),
                     "optimum-quanto": _package_version("optimum-quanto"), "hqq": _package_version("hqq"),
                     "fibquant": _package_version("fibquant")},
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "device": str(model.device),
                    "gpu": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None},
    }


def _protocol(config, memory_method) -> dict:
    """What each measured field means (the payload's "protocol")."""
    return {
        "ttft": "one-shot time to first token: an empty cache built fresh (DynamicCache(config=...), "
                "CompressedCache.for_model(model, codec, codec, sink_tokens, recent_tokens, attention), "
                "QuantizedCache(...)), the whole prompt in one forward with it (last-position logits only) "
                "and the argmax, all timed; the codec is built before the clock starts (per model); "
                f"median of {config.prefill_repeats} fresh run(s), in rounds of one run per cache (the order rotated by "
                "one cache per round); ttft_paired_vs_dynamic / ttft_cpu_paired_vs_dynamic: median over the "
                "rounds of the run / DynamicCache's run of the same round; ttft_token: the greedy first token",
        "chunked": f"the same with the prompt in chunks of {config.chunk_tokens} tokens, one forward each "
                   "(ours: later chunks attend to earlier ones through their codes); chunked_chunk_s: "
                   "seconds per forward",
        "prefill_memory": "ttft/chunked_peak_added_bytes: peak resident memory during the timed prefill minus "
                          "the amount just before it (after gc + malloc_trim; CPU: process RSS high-water "
                          "mark via PeakRSS, CUDA: torch.cuda.max_memory_allocated): the cache being built, "
                          "activations and transient buffers; the model weights are already resident"
                          f" ({memory_method})",
        "prefill": "one DynamicCache forward over the context (last-position logits only); every cache is "
                   "built from it: DynamicCache copy, CompressedCache.from_cache (timed: conversion_s; "
                   "prefill_s = dynamic_prefill_s + conversion_s), QuantizedCache fed the prefill keys/values "
                   "through update() layer by layer (what its own prefill stores; timed the same way)",
        "decode": f"greedy, one token per forward with the cache, {config.decode_tokens} rounds in which every "
                  "cache takes one step (interleaved, the order rotated by one cache per round); each step "
                  "timed (forward + argmax); decode_ms_median is the median over the steps; "
                  "decode_paired_vs_dynamic: median over the rounds of the step / DynamicCache's step of the "
                  "same round" + ("; untimed warm-up run of every cache first" if config.warmup else ""),
        "quantized_cache": f"QuantizedCache(backend, config, nbits, q_group_size={config.q_group_size}, "
                           f"residual_length={config.residual_length}); it re-quantizes everything each time "
                           f"the residual reaches residual_length tokens, which {config.decode_tokens} decode "
                           f"steps after a fresh prefill "
                           f"{'do not reach' if config.decode_tokens < config.residual_length else 'reach'}",
        "memory": f"peak_rss_added_bytes: after the timed rounds, one cache at a time, the peak resident set "
                  f"size during {config.memory_steps} further untimed steps minus the RSS just before them "
                  "(after gc + malloc_trim); cache and prefill already exist at that point, so this is the "
                  "working memory decoding adds (growth of the cache + transient buffers)",
        "ratios": "x_vs_dynamic = value / the DynamicCache value at the same context (same run); "
                  "bytes_vs_fp16_dynamic = cache bytes / (DynamicCache bytes in fp16)",
        "threads": "torch.set_num_threads(config.threads) for the whole run (numba kernels follow it)",
        "cpu_time": "*_cpu_s / decode_cpu_ms_*: CPU seconds of the same timed calls by " + cpu_clock_name()
                    + "; unlike the wall clock they do not count waiting for a core on a loaded machine",
        "bytes": BYTES_COUNTING,
    }


def _load_average() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _warmup(specs, model, head_dim, config, token_ids, skipped, progress, codecs) -> None:
    """One short untimed run of every cache and part (first-call costs: codebook loads, numba JIT,
    extension builds)."""
    tokens = min(int(token_ids.shape[0]), max(2 * (config.sink_tokens + config.recent_tokens) + 16, 64))
    if progress:
        print(f"warm-up: {len(specs)} caches on {tokens} tokens ...", file=sys.stderr, flush=True)
    ids = token_ids[:tokens]
    prefill = _prefill(model, ids) if "decode" in config.parts else None
    quiet = replace(config, prefill_repeats=1)
    for spec in specs:
        try:
            if "ttft" in config.parts:
                time_fresh_prefill(spec, model, ids, None, codecs[spec.name], quiet, "ttft")
            if "chunked" in config.parts:  # a second chunk that sees codes
                chunk = max(1, min(config.chunk_tokens, tokens // 2))
                time_fresh_prefill(spec, model, ids, chunk, codecs[spec.name], quiet, "chunked")
            if prefill is not None:
                with codes_switch([spec], model):
                    decoding = _start_decoding(spec, prefill, model, codecs[spec.name], config)[1]
                    for _ in range(2):
                        decoding.step(model)
        except Exception as exc:
            if spec.kind != "quantized":
                raise
            reason = f"failed in the warm-up: {type(exc).__name__}: {exc}"
            skipped.append({"cache": spec.name, "reason": reason})
            print(f"skipping {spec.name}: {reason}", file=sys.stderr, flush=True)


EXPERIMENT = Experiment(name="decode-speed", stem="decode_speed", config=DecodeSpeedConfig, run=run_decode_speed,
                        header=decode_speed_header, table=decode_speed_table, plot=plot_decode_speed,
                        targets=decode_speed_targets)


def write_decode_speed(payload: dict, out_dir=None, stem: str = "decode_speed") -> dict[str, str]:
    """Write `<stem>.json` and `<stem>.png` under `out_dir` (default $FIBQUANT_RESULTS_DIR or results/)."""
    return replace(EXPERIMENT, stem=stem).report(payload, out_dir, echo=False)
