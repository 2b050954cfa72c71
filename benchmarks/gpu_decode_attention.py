"""Per-layer decode attention on codes (the fused Triton kernel) vs bf16 SDPA, time and peak memory.

One decode step of one attention layer shaped like Llama-3-8B by default: B=1, 32 query heads on 8
KV heads (GQA), head_dim 128, Q=1 new token, M cached tokens (--contexts, default 8192 32768).
Random data: queries/keys/values are Gaussian; the coded caches are random code rows (uniform
indices, fp16 norms) read through the real shipped FibQuant d=128 codebooks, which is all the
kernels' speed and memory depend on (attention quality is measured elsewhere, on real states).

Variants, each timed as the median of --repeats after --warmup calls (CUDA events on a GPU):

    sdpa-bf16       torch.nn.functional.scaled_dot_product_attention, K/V bf16 [B, 8, M, 128],
                    enable_gqa=True (no repeated K/V)
    <codec>-fused   fibquant.kv.attention.kernels.coded_decode_attention (backend "triton"): rotate the
                    query, fused kernel -> (out, lse), un-rotate: the whole coded part of a layer
    <codec>-paged   fibquant.kv.attention.kernels.coded_decode_attention_paged (backend "triton"): the same
                    codes in vLLM-style token-major pages ([blocks, --block-size, 8, slot] bytes, slot =
                    key code + value code + pad), one scrambled block table row per request, read in
                    place (what the vLLM backend runs on CUDA); --no-paged skips it
    <codec>-ref     the torch reference of the same function (decodes every code row to float32
                    [B, 8, M, 128] first), only with --reference

Reported per row: median ms, peak-memory delta over what was allocated before the call (bytes,
torch.cuda.max_memory_allocated; None on the CPU), the KV storage bytes, and the max abs error of
the fused output against the reference (same codes). Writes gpu_decode_attention.json to --out /
$FIBQUANT_RESULTS_DIR / ./results.

On the CPU (--device cpu) the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1 is
set here before triton is imported): use tiny sizes, e.g. `--device cpu --contexts 256 --q-heads 4
--kv-heads 2 --dim 64 --repeats 1 --warmup 0`. Interpreter timings say nothing about kernel speed;
that mode is a smoke test of the script and a correctness check.

Usage: python benchmarks/gpu_decode_attention.py [--device cuda] [--contexts 8192 32768]
       [--codecs fibquant:b=4 fibquant:b=2] [--reference] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch  # noqa: E402

from fibquant.codecs.bitpack import float16_to_bytes, pack_bits  # noqa: E402
from fibquant.codecs.fibquant import FibQuantCodec  # noqa: E402
import fibquant.kv.attention.kernels as ck  # noqa: E402

CODECS = {"fibquant:b=4": 4.0, "fibquant:b=2": 2.0, "fibquant:b=3": 3.0}  # name -> FibQuantCodec.for_rate bits


def random_codes(codec: FibQuantCodec, shape: tuple[int, ...], device, gen) -> torch.Tensor:
    """Random valid code rows uint8 [*shape, code_size]: uniform indices < N, fp16 norms ~ chi(D)."""
    index = torch.randint(0, codec.n_codewords, (*shape, codec.dim // codec.k), generator=gen)
    norms = torch.randn(*shape, codec.dim, generator=gen).norm(dim=-1)
    return torch.cat([float16_to_bytes(norms), pack_bits(index, codec.config.index_bits)], dim=-1).to(device)


def paged_layout(key_codes: torch.Tensor, value_codes: torch.Tensor, block_size: int, device, gen):
    """Codes [B, Hkv, M, C] -> (pages uint8 [blocks, Hkv, block_size, slot], a token-major (LBNHC) view as
    the vLLM backend's _pages; block_tables int32 [B, ceil(M / block_size)] over a random permutation of
    the blocks; the value code's offset in a slot)."""
    batch, heads, tokens, key_size = key_codes.shape
    per_request = -(-tokens // block_size)
    both = torch.cat([key_codes, value_codes], dim=-1).permute(0, 2, 1, 3)     # [B, M, Hkv, Ck + Cv]
    slot = both.shape[-1] + both.shape[-1] % 2
    padded = torch.zeros(batch, per_request * block_size, heads, both.shape[-1], dtype=torch.uint8, device=device)
    padded[:, :tokens] = both
    tables = torch.randperm(batch * per_request, generator=gen).view(batch, per_request).to(device, torch.int32)
    buffer = torch.zeros(batch * per_request, block_size, heads, slot, dtype=torch.uint8, device=device)
    buffer[tables.flatten().long(), :, :, : both.shape[-1]] = padded.reshape(-1, block_size, heads, both.shape[-1])
    return buffer.permute(0, 2, 1, 3), tables, key_size


def measure(fn, device: torch.device, repeats: int, warmup: int) -> tuple[float, int | None]:
    """(median milliseconds, peak bytes allocated above the starting level) of fn()."""
    for _ in range(warmup):
        fn()
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), peak


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--codecs", nargs="+", default=["fibquant:b=4", "fibquant:b=2"], choices=sorted(CODECS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--query-tokens", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per page of the paged variant")
    parser.add_argument("--no-paged", action="store_true", help="skip the paged (vLLM pages) variant")
    parser.add_argument("--reference", action="store_true", help="also time the torch reference (decodes all)")
    parser.add_argument("--out", default=None, help="results folder (default $FIBQUANT_RESULTS_DIR or ./results)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA GPU (use --device cpu for the interpreter smoke test)")
    if not ck.triton_available():
        parser.error("triton is not importable: pip install 'fibquant[gpu]'")
    torch.set_num_threads(1)
    import fibquant.kv.attention.triton_kernels as coded_triton

    interpreted = coded_triton.INTERPRETED
    b, hq, hkv, d, t = args.batch, args.q_heads, args.kv_heads, args.dim, args.query_tokens
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": __import__("triton").__version__, "interpreted": interpreted,
            "batch": b, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "query_tokens": t,
            "repeats": args.repeats, "warmup": args.warmup, "block_size": args.block_size}
    print(json.dumps(info))
    if interpreted:
        print("NOTE: Triton interpreter: timings are of the Python interpreter, not of a kernel")
    gen = torch.Generator().manual_seed(0)
    scale = d ** -0.5
    rows = []
    for m in args.contexts:
        query = torch.randn(b, hq, t, d, generator=gen).to(device, torch.bfloat16)
        keys = torch.randn(b, hkv, m, d, generator=gen).to(device, torch.bfloat16)
        values = torch.randn(b, hkv, m, d, generator=gen).to(device, torch.bfloat16)

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=scale,
                                                                    enable_gqa=True)

        ms, peak = measure(sdpa, device, args.repeats, args.warmup)
        rows.append({"context": m, "variant": "sdpa-bf16", "ms": ms, "peak_delta_bytes": peak,
                     "kv_bytes": 2 * keys.numel() * keys.element_size(), "max_abs_err": None})
        print(f"M={m:6d} sdpa-bf16          {ms:9.3f} ms  peak +{peak}  kv {rows[-1]['kv_bytes']}")
        del keys, values
        for name in args.codecs:
            codec = FibQuantCodec.for_rate(d, CODECS[name])
            book = codec.rotated_codebook(device)
            key_codes = random_codes(codec, (b, hkv, m), device, gen)
            value_codes = random_codes(codec, (b, hkv, m), device, gen)
            forward = book.forward

            def fused():
                q_rot = (query.to(torch.float32) @ forward) * scale
                out, lse = ck.coded_decode_attention(q_rot, key_codes, value_codes, book.codewords, book.codewords,
                                                     book.index_bits, book.index_bits, backend="triton")
                return out @ forward.T, lse

            def reference():
                q_rot = (query.to(torch.float32) @ forward) * scale
                out, lse = ck.coded_decode_attention_reference(q_rot, key_codes, value_codes, book.codewords,
                                                               book.codewords, book.index_bits, book.index_bits)
                return out @ forward.T, lse

            got, expected = fused(), reference()
            err = float((got[0] - expected[0]).abs().max())
            kv_bytes = key_codes.numel() + value_codes.numel()
            label = f"{name}-fused(k={codec.k},N={codec.n_codewords})"
            ms, peak = measure(fused, device, args.repeats, args.warmup)
            rows.append({"context": m, "variant": f"{name}-fused", "k": codec.k, "n_codewords": codec.n_codewords,
                         "ms": ms, "peak_delta_bytes": peak, "kv_bytes": kv_bytes, "max_abs_err": err})
            print(f"M={m:6d} {label:18s} {ms:9.3f} ms  peak +{peak}  kv {kv_bytes}  max|err| {err:.2e}")
            if not args.no_paged:
                pages, tables, key_size = paged_layout(key_codes, value_codes, args.block_size, device, gen)
                lens = [m] * b

                def paged():
                    q_rot = (query.to(torch.float32) @ forward) * scale
                    out, lse = ck.coded_decode_attention_paged(q_rot, pages, tables, lens, book.codewords,
                                                               book.codewords, book.index_bits, book.index_bits,
                                                               key_size, backend="triton")
                    return out @ forward.T, lse

                err_paged = float((paged()[0] - expected[0]).abs().max())
                ms, peak = measure(paged, device, args.repeats, args.warmup)
                rows.append({"context": m, "variant": f"{name}-paged", "k": codec.k,
                             "n_codewords": codec.n_codewords, "ms": ms, "peak_delta_bytes": peak,
                             "kv_bytes": pages.numel(), "max_abs_err": err_paged})
                print(f"M={m:6d} {name + '-paged':18s} {ms:9.3f} ms  peak +{peak}  pages {pages.numel()}  "
                      f"max|err| {err_paged:.2e}")
                del pages, tables
            if args.reference:
                ms, peak = measure(reference, device, max(1, args.repeats // 5), min(args.warmup, 2))
                rows.append({"context": m, "variant": f"{name}-ref", "k": codec.k, "n_codewords": codec.n_codewords,
                             "ms": ms, "peak_delta_bytes": peak, "kv_bytes": kv_bytes, "max_abs_err": 0.0})
                print(f"M={m:6d} {name + '-ref':18s} {ms:9.3f} ms  peak +{peak}")
            del key_codes, value_codes
    out_dir = Path(args.out or os.environ.get("FIBQUANT_RESULTS_DIR") or "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_decode_attention.json"
    path.write_text(json.dumps({"info": info, "rows": rows}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
