"""Long-context retrieval (passkey / needle in a haystack) on real text, each cache compressing the haystack.

Protocol, per context length L, depth d and key (all fixed by `seed`):

1. the haystack is L tokens (fewer only when L + question + answer would pass the model's
   `max_position_embeddings`: then haystack + question + answer fill the context exactly, e.g.
   8150 + 34 + 8 = 8192 on SmolLM2; a length beyond the context is a ValueError): the chat
   template's opening (system turn, start of the user turn), an instruction, and tokens of an
   Austen novel (`fibquant.load_text`, starting `rep * L` tokens in for repetition `rep`) with
   the needle sentence "The secret passkey is NNNNN. Remember it: NNNNN is the secret passkey."
   (a random 5-digit key) inserted at the sentence or paragraph boundary nearest to depth d of the novel's tokens (d = 0: first, d = 1: last);
2. one float prefill of the haystack (a `DynamicCache`) is shared by every cache under test:
   each is built from it (`CacheSpec.build(prefill=...)`: `CompressedCache.from_cache`,
   `RoundTripCache.from_cache` for peers, a copy for fp), so the haystack outside the exact
   window (sinks + recent tokens) is read only through the cache's codes;
3. the question (end of the user turn: "What is the secret passkey hidden in the text above?
   Answer with the five-digit number only.", then the assistant turn's opening and the answer
   prefix "The secret passkey is") is fed through the cache in one pass, then `max_new_tokens` greedy tokens are decoded (stopping at the end
   of turn);
4. exact match: the first run of digits in the answer equals the key.

Accuracy per length and depth and overall, and the bytes of every cache against fp16
(`CacheSpec.codes_ratio`: key + value vector bytes, side information included;
`context_ratio`: the whole haystack, exact window counted at fp16).
"""
from __future__ import annotations


import torch

from fibquant.codecs.registry import codec_classes, is_reference, reference_codec_spec
from fibquant.eval.report import Experiment
from fibquant.eval.timing import Stopwatch, timed
from fibquant.kv.build import build_cache
from fibquant.kv.model import last_logits
from fibquant.peers import peer_specs
from fibquant.eval.needle.trials import (  # noqa: F401  (the task's vocabulary, re-exported)
    ANSWER_PREFIX, INSTRUCTION, MARKER, NEEDLE, QUESTION, RATIO_TARGET, TASKS, NeedleConfig, NeedleTrial, boundaries, build_trial, extract_answer, haystack_tokens, make_key, max_positions, template_parts, token_ids)
from fibquant.kv.attention.switch import attention_on_codes

NEEDLE_CACHES = (
    "fp",
    "fibquant:b=4", "fibquant:b=3", "fibquant:b=2", "fibquant:b=1.5", "fibquant:b=1",
    "fibquant:b=3/fibquant:b=1.5", "fibquant:b=2/fibquant:b=1", "fibquant:b=2/fibquant:b=0.5",
    "fibquant:b=1.5/fibquant:b=1", "fibquant:b=1.5/fibquant:b=0.5",
    "turboquant:b=4", "turboquant:b=2",
) + peer_specs(lowest=2)  # each peer's two lowest rates


@torch.no_grad()
def prefill(model, ids: torch.Tensor):
    """A DynamicCache holding the float keys/values of ids [L] (only the last logits computed)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    last_logits(model, ids.unsqueeze(0).to(model.device), cache)
    return cache


@torch.no_grad()
def answer(model, tokenizer, cache, question_ids: torch.Tensor, max_new_tokens: int) -> str:
    """Feed the question through `cache` in one pass, then decode greedily; the answer text."""
    stops = {t for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if isinstance(t, int)}
    ids, out = question_ids.unsqueeze(0).to(model.device), []
    for _ in range(max_new_tokens):
        logits = last_logits(model, ids, cache)
        token = int(logits.argmax())
        if token in stops:
            break
        out.append(token)
        ids = torch.tensor([[token]], device=model.device)
    return tokenizer.decode(out, skip_special_tokens=True)


def run_needle(model, tokenizer, specs, config: NeedleConfig = NeedleConfig(), progress: bool = True) -> dict:
    """Every trial with every cache spec (`fibquant.kv.specs.CacheSpec`); results as a payload."""
    from tqdm.auto import tqdm

    from fibquant.kv.model import check_model_supported, describe_model

    with attention_on_codes(model):
        dim = check_model_supported(model)["head_dim"]
        positions = max_positions(model)
        ruler = config.task != "passkey"
        if ruler:  # RULER places its needles itself: one cell per sample
            from fibquant.eval.needle.ruler import RULER_MIN_NEW_TOKENS, ruler_correct, ruler_trials

            made = {length: ruler_trials(tokenizer, config, length, positions) for length in config.lengths}
            cells = [(t.length, t.depth, t.rep) for length in config.lengths for t in made[length]]
            max_new_tokens = max(config.max_new_tokens, RULER_MIN_NEW_TOKENS)
        else:
            for length in config.lengths:  # fail before any prefill when a length cannot fit
                build_trial(tokenizer, config, length, config.depths[0], 0, positions)
            cells = [(n, d, r) for n in config.lengths for r in range(config.keys_per_cell) for d in config.depths]
            max_new_tokens = config.max_new_tokens
        trials, timing = [], {"prefill_s": 0.0, "caches_s": 0.0}
        bar = tqdm(total=len(cells) * len(specs), desc="needle", disable=not progress)
        for length, depth, rep in cells:
            trial = made[length][rep] if ruler else build_trial(tokenizer, config, length, depth, rep, positions)
            seconds, source = timed(lambda: prefill(model, trial.prefill_ids))
            timing["prefill_s"] += seconds
            for spec in specs:
                bar.set_postfix_str(f"L={length} d={depth:g} {spec.spec}")
                with Stopwatch() as watch:
                    cache = build_cache(spec, model, config.sink_tokens, config.recent_tokens, config.attention, prefill=source)
                    text = answer(model, tokenizer, cache, trial.question_ids, max_new_tokens)
                timing["caches_s"] += watch.seconds
                trials.append({"cache": spec.spec, "length": length, "depth": depth, "rep": rep, "key": trial.key,
                               "needle_start": trial.needle_start, "haystack_tokens": int(trial.prefill_ids.shape[0]),
                               "answer": text,
                               "correct": ruler_correct(text, trial.key) if ruler else extract_answer(text) == trial.key})
                bar.update(1)
            del source
        bar.close()
        rows = summarise(trials, specs, config, dim)
        return {
            "experiment": "needle in a haystack (passkey retrieval) with each cache compressing the haystack",
            "model": describe_model(model), "text": config.text, "config": {
                "lengths": list(config.lengths), "depths": list(config.depths), "keys_per_cell": config.keys_per_cell,
                "seed": config.seed, "sink_tokens": config.sink_tokens, "recent_tokens": config.recent_tokens,
                "max_new_tokens": config.max_new_tokens, "attention": config.attention,
                "max_position_embeddings": positions, "task": config.task},
            "needle": "RULER niah_single_1 (lm-eval)" if ruler else NEEDLE,
            "question": "RULER's template" if ruler else QUESTION.strip(),
            "answer_prefix": "RULER's gen_prefix" if ruler else ANSWER_PREFIX, "timing": timing, "rows": rows, "trials": trials,
        }


def summarise(trials: list[dict], specs, config: NeedleConfig, dim: int) -> list[dict]:
    """One row per spec: bytes, ratios, accuracy overall / per length / per (length, depth), agreement with fp."""
    fp_specs = {spec.spec for spec in specs if spec.is_fp}
    fp = {(t["length"], t["depth"], t["rep"]): t["correct"] for t in trials if t["cache"] in fp_specs}
    rows = []
    for spec in specs:
        mine = [t for t in trials if t["cache"] == spec.spec]
        row = {"cache": spec.spec, "label": spec.label(dim), "family": spec.family,
               "key_bytes": spec.key_bytes(dim), "value_bytes": spec.value_bytes(dim),
               "bits_per_coordinate": spec.bits_per_coordinate(dim), "codes_ratio": spec.codes_ratio(dim),
               # @recall: exact key + value bytes per coded token and KV head in the cold tier, at 16 bits
               # (a bf16 / fp16 model's rows; not hot memory, not in codes_ratio)
               "cold_bytes": spec.cold_bytes(dim),
               "accuracy": sum(t["correct"] for t in mine) / max(len(mine), 1), "trials": len(mine)}
        for length in config.lengths:
            at = [t for t in mine if t["length"] == length]
            row[f"acc_{length}"] = sum(t["correct"] for t in at) / max(len(at), 1)
            row[f"ratio_{length}"] = spec.context_ratio(dim, length, config.sink_tokens, config.recent_tokens)
            if config.task == "passkey":  # RULER picks its own depths (kept per trial)
                row[f"by_depth_{length}"] = {
                    f"{d:g}": sum(t["correct"] for t in at if t["depth"] == d)
                    / max(sum(t["depth"] == d for t in at), 1) for d in config.depths}
        if fp:
            row["misses_where_fp_right"] = sum(1 for t in mine if fp.get((t["length"], t["depth"], t["rep"]))
                                               and not t["correct"])
            row["equals_fp"] = row["misses_where_fp_right"] == 0 and all(
                t["correct"] or not fp.get((t["length"], t["depth"], t["rep"])) for t in mine)
        rows.append(row)
    return rows


def needle_targets(rows: list[dict]) -> dict:
    """The retrieval target: retrieval equal to fp (every trial fp answers) at >= RATIO_TARGET x
    key+value compression; the best ratio reached by any cache and by FibQuant, as printable text."""
    matching = [r for r in rows if not is_reference(r["family"]) and r.get("equals_fp")]
    best = max(matching, key=lambda r: r["codes_ratio"], default=None)
    fib = [r for r in matching if r["cache"].startswith("fibquant")]
    best_fib = max(fib, key=lambda r: r["codes_ratio"], default=None)
    return {
        "best ratio with fp-equal retrieval (any cache)": None if best is None else
        f"{best['codes_ratio']:.2f}x ({best['label']})",
        f"best FibQuant ratio with fp-equal retrieval (target >= {RATIO_TARGET:g}x)": None if best_fib is None else
        f"{best_fib['codes_ratio']:.2f}x ({best_fib['label']}): "
        f"{'met' if best_fib['codes_ratio'] >= RATIO_TARGET else 'missed'}",
    }


def target_checks(payload: dict) -> list[dict]:
    """`payload["targets"]` as report targets (the any-cache line is informational: met None)."""
    from fibquant.eval.report import target

    out = []
    for name, value in payload["targets"].items():
        met = None
        if "target >=" in name:
            met = False if value is None else value.endswith(": met")
        out.append(target(name, value, met))
    return out


def needle_columns(lengths) -> list[tuple[str, str, str]]:
    columns = [("label", "cache", ""), ("key_bytes", "K B/vec", ".4g"), ("value_bytes", "V B/vec", ".4g"),
               ("codes_ratio", "K+V vs fp16", ".2f"), ("cold_bytes", "cold B/tok", ".4g")]
    for length in lengths:
        columns += [(f"ratio_{length}", f"ctx {length} ratio", ".2f"), (f"acc_{length}", f"acc {length}", ".2f")]
    return columns + [("accuracy", "acc", ".3f"), ("misses_where_fp_right", "misses vs fp", "d")]


def plot_needle(payload: dict, path) -> None:
    """Accuracy against K+V compression vs fp16, one point per cache (FibQuant red, peers grey)."""
    from fibquant.eval.report import figure

    with figure(path, dpi=130, figsize=(8, 5)) as (fig, ax):
        for row in payload["rows"]:
            ours = row["cache"].split("/")[0].split(":")[0] in codec_classes()  # a registered codec
            color = "C3" if row["cache"].startswith("fibquant") else ("C0" if ours else "0.5")
            ax.scatter(row["codes_ratio"], row["accuracy"], color=color, s=30)
            ax.annotate(row["label"], (row["codes_ratio"], row["accuracy"]), fontsize=6, rotation=20)
        ax.axvline(RATIO_TARGET, color="k", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("key + value compression vs fp16 (stored bytes per vector, side information included)")
        ax.set_ylabel("passkey accuracy")
        config = payload["config"]
        task = config.get("task", "passkey")
        source = payload["text"] if task == "passkey" else f"{task} (lm-eval)"
        ax.set_title(f"{payload['model']}\n{source}, lengths {config['lengths']}, depths "
                     f"{config['depths']}, {config['keys_per_cell']} keys per cell, window "
                     f"{config['sink_tokens']}+{config['recent_tokens']}", fontsize=8)
        ax.grid(True, alpha=0.3)


def run(config: NeedleConfig = NeedleConfig(), caches=None, build_codebooks: bool = False,
        model_and_tokenizer=None, progress: bool = True) -> dict:
    """Parse `caches` (default NEEDLE_CACHES; fp always first), skip unavailable ones, run every trial."""
    from fibquant.kv.specs import parse_cache_specs, split_available
    from fibquant.peers import package_versions
    from fibquant.kv.model import check_model_supported, load_model

    model, tokenizer = model_and_tokenizer or load_model()
    dim = check_model_supported(model)["head_dim"]
    specs, skipped = split_available(parse_cache_specs(list(caches or NEEDLE_CACHES), model), dim, build_codebooks)
    if not specs or not specs[0].is_fp:
        specs = [s for s in specs if not s.is_fp]
        specs.insert(0, parse_cache_specs(reference_codec_spec().spec)[0])
    payload = run_needle(model, tokenizer, specs, config, progress)
    payload["skipped"], payload["peer_versions"] = skipped, package_versions()
    payload["targets"] = needle_targets(payload["rows"])
    return payload


def needle_header(payload: dict) -> str:
    c = payload["config"]
    lines = [f"\nmodel: {payload['model']}\ntext: {payload['text']}; lengths {c['lengths']}, depths {c['depths']}, "
             f"{c['keys_per_cell']} keys per (length, depth), seed {c['seed']}; exact window {c['sink_tokens']} "
             f"sinks + {c['recent_tokens']} recent; attention {c['attention']}\n"]
    if c.get("task", "passkey") != "passkey":
        lines.append(f"task: {c['task']} (lm-eval's RULER generator: its noise haystack and template, not the novel; "
                     f"{c['keys_per_cell']} samples per length at RULER's own depths; scored by its string_match_all)")
    shortened = [] if c.get("task", "passkey") != "passkey" else sorted(
        {(t["length"], t["haystack_tokens"]) for t in payload.get("trials", [])
         if t.get("haystack_tokens", t["length"]) != t["length"]})
    lines += [f"length {n}: haystack shortened to {h} tokens so that haystack + question + answer fit the model's "
              f"{c.get('max_position_embeddings')} positions" for n, h in shortened]
    lines += [f"skipped: {note}" for note in payload.get("skipped", [])]
    return "\n".join(lines)


def needle_stem(payload: dict) -> str:
    """needle, or needle_ruler for RULER's task."""
    return "needle" if payload["config"].get("task", "passkey") == "passkey" else "needle_ruler"


EXPERIMENT = Experiment(name="needle", stem=needle_stem, config=NeedleConfig, run=run,
                        columns=lambda payload: needle_columns(payload["config"]["lengths"]),
                        plot=plot_needle, targets=target_checks, header=needle_header)


def main_needle(config: NeedleConfig = NeedleConfig(), caches=None, out_dir=None, build_codebooks: bool = False,
                model_and_tokenizer=None, progress: bool = True) -> dict:
    """Run the task, print the table and the target, write needle.json and needle.png."""
    payload = EXPERIMENT.main(config, out_dir, caches=caches, build_codebooks=build_codebooks,
                              model_and_tokenizer=model_and_tokenizer, progress=progress)
    print(f"(prefill {payload['timing']['prefill_s']:.0f} s, caches {payload['timing']['caches_s']:.0f} s)")
    return payload
