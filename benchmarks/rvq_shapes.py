"""MSE per unit vector on the canonical source of residual-code shapes against FibQuant and TurboQuant
at the same bits (table on stdout, results/rvq_shapes.json).

    PYTHONPATH=src .venv/bin/python benchmarks/rvq_shapes.py [--vectors 4096] [--specs "fibrvq:k=16,s=4,n=256" ...]

Every spec is a `fibquant.codecs.registry` spec at d = 64; its stages load (shipped / cached) or are
built and cached on first use (their build seconds are the fit's). The test vectors are uniform on
S^63 (what every rotation-based codec sees after its norm and rotation), drawn with a seed no codebook
construction uses. MSE is ||u - u_hat||^2 per unit vector (the decoded vector's norm included, so a
norm-corrected codec shows its norm error). Encode time is wall time on one thread (noisy machine).
"""
import argparse
import sys
import time

import torch

from fibquant.codecs.registry import parse_codec_spec
from fibquant.eval.report import format_table, write_json
from fibquant.paths import results_dir
from fibquant.canonical import sample_sphere

DEFAULT_SPECS = (
    "turboquant:b=2", "fibquant:b=2", "fibrvq:b=2", "fibrvq:k=16,s=4,n=256",
    "turboquant:b=3", "fibquant:b=3", "fibrvq:b=3", "fibrvq:k=8,s=2,n=4096",
    "turboquant:b=4", "fibquant:b=4", "fibrvq:b=4", "fibrvq:b=4,w=64", "fibrvq:k=4,s=2,n=256",
)
TEST_SEED = 987_654  # not a seed of any codebook construction


def measure(spec: str, vectors: torch.Tensor) -> dict:
    method = parse_codec_spec(spec)
    codec = method.build(vectors.shape[1])
    start = time.process_time()
    codec.encode(vectors[:2])  # loads or builds the codebook / stages
    load_s = time.process_time() - start
    start = time.perf_counter()
    codes = codec.encode(vectors)
    encode_s = time.perf_counter() - start
    x_hat = codec.decode(codes)
    err = ((x_hat.double() - vectors.double()) ** 2).sum(1)
    return {"spec": method.spec, "label": method.label(vectors.shape[1]), "code_size": codec.code_size,
            "bits_per_coordinate": codec.bits_per_coordinate, "mse": float(err.mean()),
            "mse_se": float(err.std() / len(err) ** 0.5), "encode_vectors_per_s": len(vectors) / encode_s,
            "load_or_build_cpu_s": load_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vectors", type=int, default=4096)
    parser.add_argument("--specs", nargs="+", default=list(DEFAULT_SPECS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    vectors = sample_sphere(args.vectors, 64, seed=TEST_SEED)
    rows = []
    for spec in args.specs:
        rows.append(measure(spec, vectors))
        print(f"{rows[-1]['label']}: MSE {rows[-1]['mse']:.5f}", flush=True)
    for row in rows:  # against FibQuant at the same bits
        ref = next((r for r in rows if r["spec"].startswith("fibquant:")
                    and r["bits_per_coordinate"] == row["bits_per_coordinate"]), None)
        row["mse_vs_fibquant"] = None if ref is None else row["mse"] / ref["mse"]
    columns = [("label", "codec", ""), ("code_size", "bytes", "d"), ("mse", "MSE / unit vector", ".5f"),
               ("mse_se", "+- se", ".5f"), ("mse_vs_fibquant", "vs FibQuant", ".3f"),
               ("encode_vectors_per_s", "encode vec/s", ".0f"), ("load_or_build_cpu_s", "load/build CPU s", ".1f")]
    print(format_table(rows, columns, markdown=True))
    path = write_json(results_dir(args.out) / "rvq_shapes.json",
                      {"experiment": "residual-code shapes on the canonical source, d = 64",
                       "vectors": args.vectors, "test_seed": TEST_SEED, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
