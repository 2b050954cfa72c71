"""Probe: do calibration-free token scores put the needle's tokens in the top 1.5 % of a haystack?

Usage: PYTHONPATH=src .venv/bin/python benchmarks/needle_score_probe.py LENGTH SEED
(e.g. 1024 0; eager attention with output_attentions: memory grows as LENGTH^2 x 270 heads).
Per depth and score (key norm, value norm, attention received from the prefill's own later queries:
summed, mean per query, max, max from queries >= 32 tokens later), prints the fraction of the
needle's tokens (x 3 KV heads) that fall in each layer's top 1.5 %: the mean over the 30 layers and
the first / last 4 layers. Chance is 0.015.

Then the per-token surprisal scores, the same for every layer and head (one line each): surprisal
-log p(token_t | tokens < t) from the prefill's own logits, its mean and its max over a centred
window of +-k tokens (k = 4, 14: the needle sentence is ~28 tokens). The window needs k later
tokens, fewer than the 32 recent tokens the cache keeps exact, so it is known before the token is
coded. Besides the top 1.5 % (at 1k that is 14 tokens, half the needle: the ceiling is ~0.5), it
prints the fraction in the top `needle length` tokens (a tier the needle's size; ceiling 1.0).
Last, the excess surprisal (surprisal minus the entropy of that prediction) and its window mean.
"""
import sys, torch
import torch.nn.functional as F
torch.set_num_threads(1)
from fibquant.kv.model import load_model
from fibquant.eval.needle import NeedleConfig, build_trial, max_positions, NEEDLE, token_ids



def surprisal(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """-log p(ids[t] | ids[:t]) per token: logits [L, V], ids [L] -> [L] (token 0 gets 0)."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return torch.cat([logp.new_zeros(1), -logp.gather(1, ids[1:, None])[:, 0]])


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the prediction of token t (made at t - 1): logits [L, V] -> [L] (token 0 gets 0)."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return torch.cat([logp.new_zeros(1), -(logp.exp() * logp).sum(-1)])


def window(s: torch.Tensor, k: int, how: str) -> torch.Tensor:
    """Mean or max of s [L] over the centred window [t - k, t + k] (clipped at the ends) -> [L]."""
    x = s[None, None]
    if how == "max":
        return F.max_pool1d(x, 2 * k + 1, 1, k)[0, 0]
    return F.avg_pool1d(x, 2 * k + 1, 1, k, count_include_pad=False)[0, 0]


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
    surp = surprisal(out.logits[0], ids[0])
    per_token = {"surp": surp}
    for k in (4, 14):
        per_token[f"surp_mean{k}"] = window(surp, k, "mean")
        per_token[f"surp_max{k}"] = window(surp, k, "max")
    # Surprisal beyond what the model expected (a random digit after "is" is surprising but expected).
    excess = surp - entropy(out.logits[0])
    per_token["excess"] = excess
    for k in (4, 14):
        per_token[f"excess_mean{k}"] = window(excess, k, "mean")
    n = L - 32 - 4
    print(f"  per-token scores (same for every layer and head): fraction of the needle's {hi - lo} tokens in the "
          f"top 1.5 % ({max(1, int(0.015 * n))} tokens) / in the top {hi - lo}")
    for name, s in per_token.items():
        fr = []
        for top in (max(1, int(0.015 * n)), hi - lo):
            sel = s[coded].topk(top).indices + 4
            fr.append(((sel >= lo) & (sel < hi)).float().sum().item() / (hi - lo))
        sc = s[coded]
        best = (sc > s[lo:hi].max()).sum().item() + 1  # rank of the needle's best token among n
        print(f"  {name:13s} top1.5% {fr[0]:.2f}  top{hi - lo} {fr[1]:.2f}  needle's best rank {best}/{n}", flush=True)
    pieces = [tok.decode(int(t)) for t in ids[0, lo:hi]]
    print("  needle surprisal:", " ".join(f"{p!r}:{v:.1f}" for p, v in zip(pieces, surp[lo:hi].tolist())))
    top = surp[coded].topk(8).indices + 4
    print("  most surprising coded tokens:", " ".join(f"{tok.decode(ids[0, t - 2:t + 1].tolist())!r}:{surp[t]:.1f}" for t in top.tolist()))
    print(f"  haystack surprisal: median {surp[coded].median():.2f}, 98.5th percentile {surp[coded].quantile(0.985):.2f}")
    del out
