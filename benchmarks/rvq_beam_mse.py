"""MSE of the FibQuant-RVQ beam search by beam width (the case for a smaller default beam, or not).

For S in --stages (default 2, 3, 4) stages of the shipped d = 64, k = 8, N = 256 codes: --blocks canonical
8-blocks (default 2^16; `source.sample_blocks`, seed --seed), encoded by `fast_beam_search` (the same
indices as the torch `beam_search`) at each beam in --beams; prints the MSE per unit vector (8 blocks)
and its ratio to beam 16's (the codec's default, and the construction's). One thread. Writes
results/rvq_beam_mse.json (fibquant.eval.report.write_json).

Usage: PYTHONPATH=src .venv/bin/python benchmarks/rvq_beam_mse.py [--stages 2,3,4] [--beams 16,8,4,2,1]
"""
from __future__ import annotations

import argparse

import torch

from fibquant.codebook.residual import ResidualSpec, block_mse, load_residual
from fibquant.codebook.residual_numba import fast_beam_search
from fibquant.eval.report import write_json
from fibquant.paths import results_dir
from fibquant.canonical import sample_blocks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--beams", default="16,8,4,2,1")
    parser.add_argument("--blocks", type=int, default=1 << 16)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x = sample_blocks(args.blocks, 64, 8, seed=args.seed)
    rows = []
    for stages in (int(s) for s in args.stages.split(",")):
        book = load_residual(ResidualSpec(64, 8, stages, 256))
        mse = {w: 8 * block_mse(x, book, fast_beam_search(x, book, w)) for w in (int(b) for b in args.beams.split(","))}
        base = mse.get(16)
        for beam, value in mse.items():
            rows.append({"stages": stages, "beam": beam, "mse_per_unit_vector": value,
                         "vs_beam16": None if base is None else value / base})
            ratio = "" if base is None else f"  ({value / base:.4f}x beam 16)"
            print(f"S={stages} beam {beam:3d}  MSE/unit vector {value:.5f}{ratio}", flush=True)
    path = write_json(results_dir(args.out) / "rvq_beam_mse.json",
                      {"experiment": "FibQuant-RVQ MSE by beam width", "blocks": args.blocks, "seed": args.seed,
                       "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
