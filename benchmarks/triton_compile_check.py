"""Compile the Triton kernels of attention on codes for a real GPU target without a GPU.

Triton lowers each kernel (kv/attention/triton_kernels.py) at the tile sizes and options the wrappers use to
PTX and, with the ptxas shipped in the triton wheel, to a cubin for --arch (default sm_90, H100 /
H200); the cubin's resource usage (registers, stack = spilled bytes, shared memory) is read with the
wheel's cuobjdump. This catches what Triton's interpreter cannot: kernels that do not lower for the
GPU, and register spills. It says nothing about speed.

Must run with TRITON_INTERPRET unset (compiled kernels). Prints one line per kernel and writes
triton_compile_check.json to --out / $FIBQUANT_RESULTS_DIR / ./results. Exit status 1 when a kernel
fails to compile (or, with --no-spills, spills).

Usage: python benchmarks/triton_compile_check.py [--arch 90] [--dims 64 128] [--quick] [--no-spills]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("unset TRITON_INTERPRET: this script compiles the kernels for a GPU target")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import fibquant.kv.attention.triton_kernels as ct  # noqa: E402

POINTERS = {
    "_decode_attention_kernel": dict(q_ptr="*fp32", kc_ptr="*u8", vc_ptr="*u8", kcw_ptr="*fp32", vcw_ptr="*fp32",
                                     bias_ptr="*fp32", acc_ptr="*fp32", stat_ptr="*fp32", bad_ptr="*i32",
                                     softcap="fp32"),
    "_scores_kernel": dict(q_ptr="*fp32", codes_ptr="*u8", cw_ptr="*fp32", out_ptr="*fp32", bad_ptr="*i32"),
    "_weighted_sum_kernel": dict(w_ptr="*fp32", codes_ptr="*u8", cw_ptr="*fp32", out_ptr="*fp32", bad_ptr="*i32"),
    "_merge_splits_kernel": dict(acc_ptr="*fp32", stat_ptr="*fp32", out_ptr="*fp32", lse_ptr="*fp32"),
}


def cases(dims: list[int], quick: bool) -> list[tuple[str, dict, int]]:
    """(kernel name, constexprs, num_warps) at the wrappers' tile sizes: decode (4 query rows), prefill
    (2048 rows), widths 8 (k=2) and 12 (k=4) with index checks and soft-capping, and the drop-ins."""
    out = []
    for dim in dims:
        dp = ct._pow2(dim, 16)
        for rows, bits, k, bias, check, cap in ([(4, 8, 2, False, False, False)] if quick else
                                                [(4, 8, 2, False, False, False), (4, 12, 4, True, True, True),
                                                 (2048, 8, 2, True, False, False)]):
            bq, bm = ct._tiles(rows, dim)
            nb = ct._field_bytes(bits)
            out.append(("_decode_attention_kernel",
                        dict(KW=bits, KK=k, KNB=nb, VW=bits, VK=k, VNB=nb, DP=dp, DVP=dp, HAS_BIAS=bias,
                             SOFTCAP=cap, CHECK_K=check, CHECK_V=check, BQ=bq, BM=bm), ct.Launch().num_warps))
        if quick:
            continue
        out.append(("_merge_splits_kernel", dict(DVP=dp, BR=16), 4))
        for name, weighted in (("_scores_kernel", False), ("_weighted_sum_kernel", True)):
            for rows in (4, 2048):
                bq, bm = ct._tiles(rows, dim, weighted_sum=weighted)
                out.append((name, dict(W=10, K=4, NB=ct._field_bytes(10), DP=dp, BQ=bq, BM=bm, CHECK=True),
                            ct.NUM_WARPS))
    return out


def resource_usage(cubin: bytes) -> dict:
    """REG / STACK / SHARED of the cubin's kernel, from the wheel's cuobjdump (empty when absent)."""
    from triton.backends.nvidia import compiler as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    if not tool.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", handle.name], capture_output=True,
                              text=True, check=False).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {key.lower(): int(value) for key, value in found.items()}


def compile_one(name: str, constexprs: dict, num_warps: int, arch: int) -> dict:
    fn = getattr(ct, name)
    signature = {arg: ("constexpr" if arg in constexprs else POINTERS[name].get(arg, "i32")) for arg in fn.arg_names}
    start = time.perf_counter()
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps, "num_stages": ct.NUM_STAGES})
    return {"seconds": round(time.perf_counter() - start, 2), **resource_usage(kernel.asm["cubin"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100/H200)")
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--quick", action="store_true", help="only the fused decode kernel at decode shape")
    parser.add_argument("--no-spills", action="store_true", help="exit 1 when a kernel spills (stack > 0)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning
    rows, failed, spilled = [], 0, 0
    for name, constexprs, num_warps in cases(args.dims, args.quick):
        row = {"kernel": name, "constexprs": constexprs, "num_warps": num_warps, "arch": args.arch}
        try:
            row.update(compile_one(name, constexprs, num_warps, args.arch))
        except Exception as exc:  # a lowering or ptxas error: report it, go on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            failed += 1
        spilled += bool(row.get("stack"))
        rows.append(row)
        shown = {k: v for k, v in constexprs.items() if k in ("KW", "KK", "W", "K", "DP", "BQ", "BM", "HAS_BIAS", "SOFTCAP")}
        print(f"{name:26s} {shown} -> " + (row.get("error") or
              f"regs {row.get('reg')} stack {row.get('stack')} shared {row.get('shared')} ({row['seconds']} s)"))
    out_dir = Path(args.out or os.environ.get("FIBQUANT_RESULTS_DIR") or "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "triton_compile_check.json").write_text(json.dumps(
        {"triton": triton.__version__, "arch": args.arch, "rows": rows}, indent=2))
    print(f"{len(rows)} kernels, {failed} failed, {spilled} spilling; wrote {out_dir / 'triton_compile_check.json'}")
    return 1 if failed or (args.no_spills and spilled) else 0


if __name__ == "__main__":
    sys.exit(main())
