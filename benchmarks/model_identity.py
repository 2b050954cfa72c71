"""Saved-cache model identity (kv/persist/model_identity.py) on the SmolLM2-135M architecture with
random weights: cost, manifest size, and how far one ulp on every / some weights and a tensor
scaled by 1.01 or 1.001 move the fingerprint (gap / rms) against the tolerance, per weight dtype.

    PYTHONPATH=src python benchmarks/model_identity.py        (docs/persistent-cache.md, "Model identity")
"""
import copy
import json
import os
import statistics
import time

import torch

from fibquant.kv.model import random_model
from fibquant.kv.persist.fingerprint import fingerprint_gap, tensor_fingerprint
from fibquant.kv.persist.model_identity import _sample, model_identity, model_mismatch, model_sha256, weight_tolerance

torch.set_num_threads(1)
TENSORS = ("model.embed_tokens.weight", "model.layers.5.self_attn.k_proj.weight",
           "model.layers.5.input_layernorm.weight", "model.layers.29.mlp.down_proj.weight")


def _ms(fn, repeats=7):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return f"median {statistics.median(times) * 1e3:.1f} ms (min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})"


def _max_gap(saved, model, names=None):
    """max over the parameters (or `names`) of max(|d rms|, |d proj_j|) / rms."""
    gaps = []
    for name, param in model.named_parameters():
        if names is None or name in names:
            gap, scale = fingerprint_gap(saved["parameters"][name]["sample"], tensor_fingerprint(_sample(param)))
            gaps.append(gap / scale)
    return max(gaps), min(gaps)


def _edited(model, fn):
    other = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in other.named_parameters():
            fn(name, param)
    return other


def main():
    print("load:", os.getloadavg())
    model = random_model()
    print(f"{sum(p.numel() for p in model.parameters())} parameters in {len(list(model.parameters()))} tensors")
    print("model_sha256 (version 1-2):", _ms(lambda: model_sha256(model)))
    print("model_identity:", _ms(lambda: model_identity(model)))
    identity = model_identity(model)
    print("model_mismatch (same model):", _ms(lambda: model_mismatch(identity, model)))
    text = json.dumps(identity, indent=2, sort_keys=True)
    print(f"identity in the manifest: {len(text)} bytes, json.loads", _ms(lambda: json.loads(text), 21))
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        held = random_model(dtype=dtype)
        saved, eps, tol = model_identity(held), torch.finfo(dtype).eps, weight_tolerance(str(dtype))
        print(f"\n{dtype}: tolerance {tol:g} of the rms (eps {eps:.3g})")
        for fraction in (0.01, 0.05, 0.1, 1.0):
            def ulps(name, p):
                flip = torch.rand(p.shape, generator=generator) < fraction
                p.copy_(torch.where(flip, torch.nextafter(p, torch.full_like(p, float("inf"))), p))
            shifted = _edited(held, ulps)
            gap = _max_gap(saved, shifted)[0]
            print(f"  one ulp up on {fraction:.0%} of every tensor: max gap {gap:.2e} ({gap / eps:.2f} eps): "
                  f"{'opens' if model_mismatch(saved, shifted) is None else 'refused'}")
        for factor in (1.01, 1.001):
            gaps = []
            refused = 0
            for name in TENSORS:
                tuned = _edited(held, lambda n, p: p.mul_(factor) if n == name else None)
                gaps.append(_max_gap(saved, tuned, {name})[0])
                refused += model_mismatch(saved, tuned) is not None
            print(f"  one tensor x {factor} ({len(TENSORS)} tensors tried): gap {min(gaps):.2e} - {max(gaps):.2e}, "
                  f"refused {refused}/{len(TENSORS)}")


if __name__ == "__main__":
    main()
