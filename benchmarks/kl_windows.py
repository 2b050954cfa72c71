"""Per-window / per-draw KL, top-1 and perplexity from `eval peers` JSON files (issue 21).

Usage: python benchmarks/kl_windows.py results/.../peers.json [...]; PAIRS="a|b;c|d" adds paired
per-(file, draw, window) KL differences of spec a against spec b (a spec without draws counts for every
draw), pooled over every file given (e.g. two texts' runs), with the standard error of the mean
difference (sd / sqrt(n)). With more than one file the table has one row per (file, cache).
"""
import json
import math
import os
import statistics as st
import sys
from collections import defaultdict
rows = []
for path in sys.argv[1:]:
    p = json.load(open(path))
    for r in p["parts"]["perplexity"]["rows"]:
        r["_file"] = path
        rows.append(r)
many = len(sys.argv) > 2
by = defaultdict(list)  # (file or None, cache) -> rows (one per rotation draw)
for r in rows:
    by[(r["_file"] if many else None, r.get("rotation_of") or r["cache"])].append(r)
print("| cache | B/vec (K,V) | stored B/token | draws x windows | KL mean | KL sd (all windows x draws) | KL sd over draws (of window-means) | KL per window (mean over draws) | top-1 mean | top-1 sd | ppl change % (mean over draws) |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for (f, c), rs in by.items():
    kl = [v for r in rs for v in r["kl_per_window"]]
    t1 = [v for r in rs for v in r["top1_per_window"]]
    draws = [r["kl"] for r in rs]
    nw = len(rs[0]["kl_per_window"])
    perw = [st.fmean(r["kl_per_window"][i] for r in rs) for i in range(nw)]
    ppl = st.fmean(r.get("perplexity_change_pct", 0.0) for r in rs)
    name = f"{c} ({f})" if f else c
    print(f"| {name} | {rs[0]['key_bytes_per_vector']:g},{rs[0]['value_bytes_per_vector']:g} | {rs[0]['cache_stored_bytes_per_token']:.0f} | {len(rs)}x{nw} | {st.fmean(kl):.4f} | {st.stdev(kl) if len(kl)>1 else 0:.4f} | {st.stdev(draws) if len(draws)>1 else 0:.4f} | {' '.join(f'{v:.4f}' for v in perw)} | {st.fmean(t1):.3f} | {st.stdev(t1) if len(t1)>1 else 0:.3f} | {ppl:+.2f} |")
# paired per-window differences of spec a against spec b (PAIRS)

def cells(c):
    """{(file, seed, window): (kl, top1)} over every file; a spec without draws counts for every seed."""
    out = {}
    for (f, name), rs in by.items():
        if name != c:
            continue
        for r in rs:
            for i, (k, t) in enumerate(zip(r["kl_per_window"], r["top1_per_window"])):
                out[(f, r.get("rotation_seed"), i)] = (k, t)
    return out

pairs = os.environ.get("PAIRS", "")
for pair in filter(None, pairs.split(";")):
    a, b = pair.split("|")
    ca, cb = cells(a), cells(b)
    if not ca or not cb:
        sys.exit(f"PAIRS: no rows for {a if not ca else b!r}")
    keys = sorted(ca, key=str) if len(ca) >= len(cb) else sorted(cb, key=str)
    diffs = []
    for f, s, w in keys:
        x = ca.get((f, s, w)) or ca.get((f, None, w)); y = cb.get((f, s, w)) or cb.get((f, None, w))
        diffs.append(x[0] - y[0])
    wins = sum(d < 0 for d in diffs)
    sd = st.stdev(diffs) if len(diffs) > 1 else 0.0
    print(f"{a} - {b}: mean KL diff {st.fmean(diffs):+.5f} (sd {sd:.5f}, se {sd / math.sqrt(len(diffs)):.5f}, "
          f"n={len(diffs)}), ratio of means {st.fmean([v[0] for v in ca.values()]) / st.fmean([v[0] for v in cb.values()]):.3f}, "
          f"{a} lower in {wins}/{len(diffs)} cells; diffs {' '.join(f'{d:+.4f}' for d in diffs)}")
