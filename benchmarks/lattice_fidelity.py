"""Attention fidelity of the E8 shell-code prototype (lattice_encode_speed.py) in `eval peers`' own
fidelity harness (`peers.run_fidelity_specs`), next to NexusQuant E8 and FibQuant-RVQ k = 16 in the
same run (SmolLM2-135M-Instruct, no exact window).

    PYTHONPATH=src .venv/bin/python benchmarks/lattice_fidelity.py [--bits 2 3 4] [--rotation-seeds 0 1]
        [--no-rvq] [--norm-correction]

The prototype is not a registered codec, so it enters the harness as a duck-typed cache spec whose
two sides are "peers" with a `roundtrip(states, 0)`: norm (fp16) + the codecs' Haar rotation of the
draw's seed + the numba shell search, decoded by the numba unrank (float64, rounded to float32). Its
levels are the probe's best shell code per rate (results/lattice_probe.json). Real specs (NexusQuant,
FibQuant-RVQ with r=seed) run through the harness unchanged. Rows: mean cosine over the draws, and
(1 - cosine) over NexusQuant E8's (the issue's target: <= 0.9).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lattice_encode_speed import ShellEncoder, decode_kernel, tables  # noqa: E402

from fibquant.eval.peers import PeersConfig, rotation_variant, run_fidelity_specs  # noqa: E402
from fibquant.eval.report import format_table, write_json  # noqa: E402
from fibquant.kv.model import load_model  # noqa: E402
from fibquant.kv.specs import parse_cache_spec  # noqa: E402
from fibquant.paths import results_dir  # noqa: E402
from fibquant.source import haar_rotation  # noqa: E402

TARGETS = {2: "fibrvq:b=2,k=16,nc=1", 3: "fibrvq:b=3,k=16,w=64,nc=1", 4: "fibrvq:b=4,k=16,w=64,nc=1"}


class ShellRoundTrip:
    """The prototype as a harness "peer": roundtrip(states [..., 64], 0) -> states' shape, float32."""

    def __init__(self, t: dict, bits: int, seed: int, norm_correction: bool = False):
        self.norm_correction = norm_correction
        self.enc = ShellEncoder(t, bits)
        self.rotation = haar_rotation(64, seed)
        self.enc.rotation_t = self.rotation.to(torch.float32).T.contiguous()
        self.bytes_per_vector = 2 + 8 * bits

    def roundtrip(self, states: torch.Tensor, _position: int) -> torch.Tensor:
        flat = states.reshape(-1, 64).to(torch.float32)
        codes = self.enc.encode(flat)
        index = np.zeros((len(flat) * 8, 8), np.uint8)
        index[:, :self.enc.bits] = codes[:, 2:].reshape(-1, self.enc.bits)
        points = np.empty((len(index), 8))
        decode_kernel(index.view(np.int64).ravel(), *self.enc.args, points)
        unit = torch.from_numpy(points.reshape(-1, 64)) @ self.rotation  # u = x Pi^T, so x = u Pi
        if self.norm_correction:  # store ||x|| / ||u_hat|| in the fp16 field (no extra byte)
            scale = flat.double().norm(dim=1) / unit.norm(dim=1).clamp_min(1e-300)
            norms = scale.to(torch.float16).to(torch.float64)[:, None]
        else:
            norms = torch.from_numpy(codes[:, :2].copy().view(np.float16).astype(np.float64))
        return (unit * norms).to(torch.float32).reshape(states.shape)


class Side:
    is_peer = True

    def __init__(self, quantizer):
        self.quantizer = quantizer

    def build(self, dim, role, model):
        return self.quantizer


class ShellSpec:
    is_fp = False

    def __init__(self, t, bits, seed, norm_correction=False):
        self.spec = f"e8shell-prototype:b={bits},r={seed}" + (",nc=1" if norm_correction else "")
        self.key = self.value = Side(ShellRoundTrip(t, bits, seed, norm_correction))

    def label(self, dim):
        return self.spec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--rotation-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--no-rvq", action="store_true", help="skip the FibQuant-RVQ rows (slow encode)")
    parser.add_argument("--norm-correction", action="store_true",
                        help="also the shell code storing ||x|| / ||u_hat|| as its norm (nc, zero extra bytes)")
    parser.add_argument("--probe", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    probe = json.loads(Path(args.probe or results_dir(None) / "lattice_probe.json").read_text())
    config = PeersConfig(fidelity_tokens=256, query_stride=1, sink_tokens=0, recent_tokens=0).fidelity_config()
    specs, group = [parse_cache_spec("fp")], {}
    for bits in args.bits:
        row = min((r for r in probe["rows"] if r["bits"] == bits and r["kind"] != "baseline"),
                  key=lambda r: r["mse_train"])
        t = tables(row["shells"], row["radii"])
        nexus = parse_cache_spec(f"nexus:b={bits}")
        specs.append(nexus)
        group[nexus.spec] = (bits, "NexusQuant E8")
        reals = [] if args.no_rvq else [parse_cache_spec(TARGETS[bits])]
        for seed in args.rotation_seeds:
            for nc in (False, True) if args.norm_correction else (False,):
                spec = ShellSpec(t, bits, seed, nc)
                specs.append(spec)
                group[spec.spec] = (bits, f"E8 shell code{', nc' if nc else ''} ({row['code']})")
            for real in reals:
                variant = rotation_variant(real, seed)
                specs.append(variant)
                group[variant.spec] = (bits, real.spec)
    model, tokenizer = load_model()
    start = time.perf_counter()
    part = run_fidelity_specs(model, tokenizer, specs, config)
    seconds = time.perf_counter() - start
    merged: dict = {}
    for row in part["rows"]:
        if row["cache"] in group:
            merged.setdefault(group[row["cache"]], []).append(row)
    rows = []
    for (bits, name), items in merged.items():
        rows.append({"bits": bits, "code": name, "draws": len(items),
                     "cosine": statistics.mean(r["cosine"] for r in items),
                     "per_draw": " ".join(f"{r['cosine']:.4f}" for r in items),
                     "worst_layer": min(r["cosine_worst_layer"] for r in items)})
    for row in rows:
        e8 = next(r for r in rows if r["bits"] == row["bits"] and r["code"] == "NexusQuant E8")
        row["err_vs_e8"] = (1 - row["cosine"]) / (1 - e8["cosine"])
    rows.sort(key=lambda r: (r["bits"], r["code"]))
    columns = [("bits", "bits", "d"), ("code", "code", ""), ("draws", "draws", "d"), ("cosine", "attn cosine", ".4f"),
               ("per_draw", "per draw", ""), ("err_vs_e8", "err / E8", ".3f"), ("worst_layer", "worst layer", ".4f")]
    print(format_table(rows, columns, markdown=True))
    print(f"fidelity {seconds:.0f} s")
    print(f"wrote {write_json(results_dir(args.out) / 'lattice_fidelity.json', {'rows': rows, 'part': part})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
