"""Codebook build time and fresh-sample MSE: the current recipe (v3) against the old one (v2).

For each (d, k, N): build the current-recipe codebook from scratch (`build_codebook`, no cache),
time it, and measure E||u - u_hat||^2 of whole unit vectors on fresh samples (never training
samples; the same fresh set for both recipes). The old recipe's codebook is the shipped v2 file
where one exists (d = 64; "old s" is then the wall time in its metadata, taken on a loaded
machine; --old-rebuild times a fresh v2 build instead), else a v2 build when --old-budget allows (v2 costs about 1.5e12 / (S N
(k + 8)) iterations of S samples; estimated from its plan), else "-".

    .venv/bin/python benchmarks/codebook_build.py                    # the default table
    .venv/bin/python benchmarks/codebook_build.py --configs 128:4:4096 --threads 2
    .venv/bin/python benchmarks/codebook_build.py --for-rate --dims 80 96 256   # every (k, N) for_rate picks
    .venv/bin/python benchmarks/codebook_build.py --for-rate --standard --dims 128 \
        --save-dir src/fibquant/codebook/shipped                     # the shipped d = 128 set

Writes results/codebook_build.json (--out) with the load average at start, per row and at the end.
"build s" is wall time, "cpu s" the process's CPU time (with one thread: about the wall time the
build would take on an idle core; on a shared machine the wall time is longer).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from fibquant.codebook import CodebookSpec, build_codebook, recipe_v2, recipe_v3, save_codebook
from fibquant.codebook.lloyd import assign_exact
from fibquant.codebook.store import SHIPPED_DIR, read_file
from fibquant.canonical import sample_blocks

DEFAULT_CONFIGS = ["64:2:128", "64:2:256", "64:4:256", "64:8:256", "64:16:256", "64:32:256", "64:4:1024",
                   "64:4:4096", "64:64:4096", "128:2:256", "128:4:256", "128:8:256",
                   "256:256:4096", "96:96:4096", "80:80:4096", "256:128:4096", "96:48:4096", "80:40:4096",
                   "256:64:4096", "80:4:4096"]
RATES = [0.046875, 0.09375, 0.125, 0.1875, 0.25, 0.375, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4]
STANDARD_RATES = [0.1875, 0.25, 0.375, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4]
V2_SECONDS_PER_WORK = 1 / 1.5e9  # rough: v2 ran ~1.5e9 sample*codeword*(k+8) per second here (its shipped build times)


def fresh_mse(codewords: torch.Tensor, dim: int, k: int, vectors: int, seed: int) -> float:
    """E||u - u_hat||^2 over `vectors` fresh unit vectors of S^{dim-1} (exact nearest codewords)."""
    blocks = sample_blocks(vectors * (dim // k), dim, k, seed=seed)
    total = 0.0
    for start in range(0, blocks.shape[0], 1 << 18):
        part = blocks[start:start + (1 << 18)]
        index = assign_exact(part, codewords)
        total += float(((part - codewords[index]) ** 2).sum(-1).to(torch.float64).sum())
    return total / vectors


def v2_estimated_seconds(spec: CodebookSpec) -> float:
    work = recipe_v2.RESTARTS * sum(n * cap for n, cap in recipe_v2.phase_plan(spec))
    return work * spec.n_codewords * (spec.k + 8) * V2_SECONDS_PER_WORK


def old_codebook(spec: CodebookSpec, budget_s: float,
                 rebuild: bool = False) -> tuple[torch.Tensor | None, str, float | None, float | None]:
    """(codewords, kind, wall seconds, CPU seconds) of the v2 codebook: shipped, built or absent."""
    path = SHIPPED_DIR / spec.file_name_for(recipe_v2.VERSION)
    if path.is_file() and not rebuild:
        codewords, meta = read_file(path)
        return codewords, "shipped v2", float(meta.get("build_seconds", "nan")), None
    if spec.k > 1 and v2_estimated_seconds(spec) <= budget_s:
        start, cpu_start = time.perf_counter(), time.process_time()
        codebook = build_codebook(spec.dim, spec.k, spec.n_codewords, spec.seed, version="v2", progress=False)
        return codebook.codewords, "built v2", time.perf_counter() - start, time.process_time() - cpu_start
    return None, "-", None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", default=None, help="d:k:N triples")
    parser.add_argument("--for-rate", action="store_true", help="every (k, N) FibQuantCodec.for_rate picks for --dims")
    parser.add_argument("--standard", action="store_true",
                        help="with --for-rate: only the docstring table's rates 0.1875 ... 4")
    parser.add_argument("--dims", nargs="*", type=int, default=[64, 80, 96, 128, 256])
    parser.add_argument("--threads", type=int, default=1, help="torch (and numba search) threads")
    parser.add_argument("--vectors", type=int, default=1 << 16, help="fresh unit vectors for the MSE")
    parser.add_argument("--old-budget", type=float, default=120.0,
                        help="build the v2 recipe for comparison when its estimated time is below this (s)")
    parser.add_argument("--old-rebuild", action="store_true",
                        help="rebuild v2 (timed, wall and CPU) even where its file ships, within --old-budget")
    parser.add_argument("--out", type=Path, default=Path("results/codebook_build.json"))
    parser.add_argument("--save-dir", type=Path, default=None,
                        help="also save each built codebook there (how the shipped d = 128 files were made)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    if args.for_rate:
        from fibquant.codecs.fibquant import choose_block
        triples = []
        for dim in args.dims:
            for rate in (STANDARD_RATES if args.standard else RATES):
                try:
                    k, n = choose_block(dim, rate)
                except ValueError:
                    continue
                if (dim, k, n) not in triples and k > 1:
                    triples.append((dim, k, n))
    else:
        triples = [tuple(int(v) for v in c.split(":")) for c in (args.configs or DEFAULT_CONFIGS)]

    load_start = os.getloadavg()
    rows = []
    print(f"threads={args.threads} load average at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}")
    print(f"{'d':>4} {'k':>4} {'N':>5} {'build s':>8} {'cpu s':>7} {'starts':>6} {'plan (coarse, final)':>28} {'fresh MSE v3':>13} "
          f"{'old':>10} {'old s':>7} {'old cpu':>7} {'fresh MSE old':>13} {'v3/old':>7}")
    for dim, k, n in triples:
        spec = CodebookSpec(dim, k, n)
        start, cpu_start = time.perf_counter(), time.process_time()
        codebook = build_codebook(dim, k, n, progress=False)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        if args.save_dir is not None:
            save_codebook(codebook, args.save_dir / codebook.file_name)
        mse = fresh_mse(codebook.codewords, dim, k, args.vectors, seed=20240601)
        old, old_kind, old_seconds, old_cpu = old_codebook(spec, args.old_budget, args.old_rebuild)
        old_mse = fresh_mse(old, dim, k, args.vectors, seed=20240601) if old is not None else None
        plan = recipe_v3.plan(spec)
        row = {"dim": dim, "k": k, "n_codewords": n, "build_seconds": seconds, "build_cpu_seconds": cpu_seconds,
               "plan": plan, "starts": recipe_v3.starts(spec),
               "fresh_mse": mse, "batch_mse": codebook.total_mse, "old": old_kind,
               "old_build_seconds": old_seconds, "old_build_cpu_seconds": old_cpu, "old_fresh_mse": old_mse,
               "ratio": mse / old_mse if old_mse else None, "load_average": os.getloadavg()[0]}
        rows.append(row)
        ratio = f"{row['ratio']:.4f}" if row["ratio"] else "-"
        old_s = f"{old_seconds:.0f}" if old_seconds is not None and math.isfinite(old_seconds) else "-"
        old_m = f"{old_mse:.5g}" if old_mse is not None else "-"
        old_c = f"{old_cpu:.1f}" if old_cpu is not None else "-"
        print(f"{dim:>4} {k:>4} {n:>5} {seconds:>8.1f} {cpu_seconds:>7.1f} {len(row['starts']):>6} {str(plan):>28} {mse:>13.5g} {old_kind:>10} {old_s:>7} "
              f"{old_c:>7} {old_m:>13} {ratio:>7}", flush=True)
    payload = {"threads": args.threads, "vectors": args.vectors, "load_average_start": load_start,
               "load_average_end": os.getloadavg(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
