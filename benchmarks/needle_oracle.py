"""Probe: is the loss of the needle at >= 10x in the needle's own tokens? A heavy tier (fibquant.kv.heavy)
whose score is an oracle (the needle's token rows) against the same tier chosen by a calibration-free score.

Usage: PYTHONPATH=src .venv/bin/python benchmarks/needle_oracle.py [--length 2048] [--seed 0]
       [--depths 0 0.25 0.5 0.75] [--base fibquant:b=1.5/fibquant:b=1] [--fraction 0.015]
       [--tiers 'oracle:fp;oracle:4;oracle:fp/1;oracle:1.5/fp;knorm:fp']
Prints one line per trial and cache; writes results/retrieval/needle_oracle.json (every answer).
A tier rate equal to the base rate (e.g. 'fp/1' over V1) keeps that role as it is: 'fp/1' protects
only the needle's keys, '1.5/fp' only its values. Not calibration-free (it knows where the needle is):
a diagnostic, not a cache.
"""
import argparse

import torch

from fibquant.eval.needle import (NEEDLE, NeedleConfig, answer, build_trial, extract_answer, max_positions, prefill,
                                  token_ids)
from fibquant.eval.report import write_json
from fibquant.kv import heavy
from fibquant.kv.model import load_model
from fibquant.kv.specs import parse_cache_spec

parser = argparse.ArgumentParser()
parser.add_argument("--length", type=int, default=2048)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75])
parser.add_argument("--base", default="fibquant:b=1.5/fibquant:b=1")
parser.add_argument("--fraction", type=float, default=0.015)
parser.add_argument("--tiers", default="oracle:fp;oracle:4;oracle:fp/1;oracle:1.5/fp;knorm:fp")
parser.add_argument("--sink-tokens", type=int, default=4)
parser.add_argument("--out", default="results/retrieval/needle_oracle.json")
args = parser.parse_args()
torch.set_num_threads(1)

model, tokenizer = load_model()
config = NeedleConfig(lengths=(args.length,), seed=args.seed)
span = {}


def oracle(keys, values, *codecs_and_codes):
    """1 on the needle's coded rows (ties broken by key norm), 0 elsewhere: [B, H, n]."""
    score = 1e-3 * keys.norm(dim=-1) / keys.norm(dim=-1).amax().clamp_min(1e-12)
    score[..., span["lo"]:span["hi"]] += 1.0
    return score


tier.register_score("oracle", oracle)
specs = [args.base] + [f"{args.base}@heavy={args.fraction:g}:{t}" for t in args.tiers.split(";") if t]
trials = []
for depth in args.depths:
    trial = build_trial(tokenizer, config, args.length, depth, 0, max_positions(model))
    needle = token_ids(tokenizer, " " + NEEDLE.format(key=trial.key) + " ").shape[0]
    span.update(lo=trial.needle_start - args.sink_tokens, hi=trial.needle_start - args.sink_tokens + needle)
    source = prefill(model, trial.prefill_ids)
    for text in specs:
        cache = parse_cache_spec(text).build(model, args.sink_tokens, 32, "codes", prefill=source)
        reply = answer(model, tokenizer, cache, trial.question_ids, 8)
        in_tier = None
        if "@heavy" in text:
            in_tier = sum(int(((layer.heavy_index >= span["lo"]) & (layer.heavy_index < span["hi"])).sum())
                          for layer in cache.layers) / (needle * 3 * len(cache.layers))
        row = {"depth": depth, "key": trial.key, "cache": text, "answer": reply,
               "correct": extract_answer(reply) == trial.key, "needle_tokens": needle,
               "needle_share_in_tier": in_tier}
        trials.append(row)
        print(f"L={args.length} seed={args.seed} depth={depth:g} {text}: {reply!r} "
              f"{'OK' if row['correct'] else 'MISS'}"
              + ("" if in_tier is None else f" (needle rows in the tier: {in_tier:.2f})"), flush=True)
summary = {text: f"{sum(t['correct'] for t in trials if t['cache'] == text)}/{len(args.depths)}" for text in specs}
for text, hits in summary.items():
    print(f"{hits}  {text}")
print("wrote", write_json(args.out, {"experiment": "needle oracle tier probe", "args": vars(args),
                                     "summary": summary, "trials": trials}))
