"""Probe: do calibration-free token scores put the needle's tokens in the top 1.5 % of a haystack?

Usage: PYTHONPATH=src .venv/bin/python benchmarks/needle_score_probe.py LENGTH SEED
(e.g. 1024 0; eager attention with output_attentions: memory grows as LENGTH^2 x 270 heads).
Per depth and score (key norm, value norm, attention received from the prefill's own later queries:
summed, mean per query, max, max from queries >= 32 tokens later), prints the fraction of the
needle's tokens (x 3 KV heads) that fall in each layer's top 1.5 %: the mean over the 30 layers and
the first / last 4 layers. Chance is 0.015.
"""
import sys, torch
torch.set_num_threads(1)
from fibquant.kv.model import load_model
from fibquant.eval.needle import NeedleConfig, build_trial, max_positions, NEEDLE, token_ids

model, tok = load_model()
model.set_attn_implementation("eager")
length, seed = int(sys.argv[1]), int(sys.argv[2])
cfg = NeedleConfig(lengths=(length,), seed=seed)
for depth in (0.0, 0.25, 0.5, 0.75):
    trial = build_trial(tok, cfg, length, depth, 0, max_positions(model))
    nl = token_ids(tok, " " + NEEDLE.format(key=trial.key) + " ").shape[0]
    lo, hi = trial.needle_start, trial.needle_start + nl
    ids = trial.prefill_ids.unsqueeze(0)
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True, use_cache=True)
    L = ids.shape[1]
    coded = slice(4, L - 32)
    res = {}
    for name in ("knorm", "vnorm", "acc", "mean", "max", "max_far"):
        res[name] = []
    for li, att in enumerate(out.attentions):  # [1, Hq, L, L]
        a = att[0].reshape(3, 3, L, L)  # kv head, group
        k = out.past_key_values.layers[li].keys[0]; v = out.past_key_values.layers[li].values[0]
        count = torch.arange(L, 0, -1).float()
        far = a.clone()
        idx = torch.arange(L)
        far[..., (idx[:, None] - idx[None, :]) < 32] = 0  # attention from queries >= 32 tokens later
        scores = {"knorm": k.norm(dim=-1), "vnorm": v.norm(dim=-1),
                  "acc": a.sum(dim=(1, 2)), "mean": a.sum(dim=(1, 2)) / count,
                  "max": a.amax(dim=(1, 2)), "max_far": far.amax(dim=(1, 2))}
        for name, s in scores.items():
            s = s[:, coded]
            n = s.shape[-1]; top = max(1, int(0.015 * n))
            sel = s.topk(top, dim=-1).indices + 4
            frac = ((sel >= lo) & (sel < hi)).float().sum().item() / (3 * nl)
            res[name].append(frac)
    print(f"L={L} d={depth} needle {lo}-{hi}: fraction of needle tokens in the top 1.5% (mean over layers; first and last 4 layers)")
    for name, fr in res.items():
        print(f"  {name:8s} mean {sum(fr)/len(fr):.2f}  first4 {[round(x,2) for x in fr[:4]]} last4 {[round(x,2) for x in fr[-4:]]}", flush=True)
    del out
