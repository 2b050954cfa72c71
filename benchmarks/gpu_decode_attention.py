"""Per-layer decode attention on codes (the fused Triton kernel) vs bf16 SDPA, time and peak memory.

One decode step of one attention layer shaped like Llama-3-8B by default: 32 query heads on 8 KV heads
(GQA), head_dim 128, Q=1 new token, M cached tokens (--contexts, default 8192 32768) for each batch size B
(--batches, default 1).
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

Reported per row: median ms and its ratio to sdpa-bf16 at the same (M, B), peak-memory delta over what
was allocated before the call (bytes, torch.cuda.max_memory_allocated; None on the CPU) and its ratio to
the KV storage bytes, and the max abs error of the fused output against the reference (same codes).
Random data is drawn on the device. Writes gpu_decode_attention.json to --out / $FIBQUANT_RESULTS_DIR /
./results.

On the CPU (--device cpu) the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1 is
set here before triton is imported): use tiny sizes, e.g. `--device cpu --contexts 256 --q-heads 4
--kv-heads 2 --dim 64 --repeats 1 --warmup 0`. Interpreter timings say nothing about kernel speed;
that mode is a smoke test of the script and a correctness check.

Usage: python benchmarks/gpu_decode_attention.py [--device cuda] [--contexts 8192 32768] [--batches 1 16]
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
from fibquant.paths import results_dir  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_summary import write_rows  # noqa: E402

CODECS = {"fibquant:b=4": 4.0, "fibquant:b=2": 2.0, "fibquant:b=3": 3.0}  # name -> FibQuantCodec.for_rate bits


def random_codes(codec: FibQuantCodec, shape: tuple[int, ...], device, gen) -> torch.Tensor:
    """Random valid code rows uint8 [*shape, code_size]: uniform indices < N, fp16 norms ~ chi(D)."""
    index = torch.randint(0, codec.n_codewords, (*shape, codec.dim // codec.k), generator=gen, device=device)
    norms = torch.randn(*shape, codec.dim, generator=gen, device=device).norm(dim=-1)
    return torch.cat([float16_to_bytes(norms), pack_bits(index, codec.config.index_bits)], dim=-1)


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
    tables = torch.randperm(batch * per_request, generator=gen, device=device).view(batch, per_request).int()
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


def row_line(row: dict) -> str:
    peak = "-" if row["peak_delta_bytes"] is None else f"+{row['peak_delta_bytes'] / 2**20:.1f} MiB"
    err = "" if row["max_abs_err"] is None else f"  max|err| {row['max_abs_err']:.2e}"
    return (f"M={row['context']:6d} B={row['batch']:3d} {row['variant']:20s} {row['ms']:9.3f} ms "
            f"({row['ms_vs_sdpa']:.2f}x sdpa)  peak {peak}  kv {row['kv_bytes'] / 2**20:.1f} MiB{err}")


def add_row(rows: list, sdpa_ms: float, **row) -> None:
    row["ms_vs_sdpa"] = row["ms"] / sdpa_ms
    peak = row["peak_delta_bytes"]
    row["peak_vs_kv"] = None if peak is None else peak / row["kv_bytes"]
    rows.append(row)
    print(row_line(row))


def measure_shape(args, device, gen, b: int, m: int) -> list[dict]:
    """The rows of one (batch, context): sdpa-bf16, then per codec fused / paged / reference."""
    hq, hkv, d, t = args.q_heads, args.kv_heads, args.dim, args.query_tokens
    scale = d ** -0.5
    rows = []
    query = torch.randn(b, hq, t, d, generator=gen, device=device).to(torch.bfloat16)
    keys = torch.randn(b, hkv, m, d, generator=gen, device=device).to(torch.bfloat16)
    values = torch.randn(b, hkv, m, d, generator=gen, device=device).to(torch.bfloat16)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True)

    sdpa_ms, peak = measure(sdpa, device, args.repeats, args.warmup)
    add_row(rows, sdpa_ms, context=m, batch=b, variant="sdpa-bf16", ms=sdpa_ms, peak_delta_bytes=peak,
            kv_bytes=2 * keys.numel() * keys.element_size(), max_abs_err=None)
    del keys, values
    for name in args.codecs:
        codec = FibQuantCodec.for_rate(d, CODECS[name])
        book = codec.reader(device)
        key_codes = random_codes(codec, (b, hkv, m), device, gen)
        value_codes = random_codes(codec, (b, hkv, m), device, gen)
        forward = book.forward
        shape = dict(context=m, batch=b, k=codec.k, n_codewords=codec.n_codewords)

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

        expected = reference()[0]
        err = float((fused()[0] - expected).abs().max())
        kv_bytes = key_codes.numel() + value_codes.numel()
        ms, peak = measure(fused, device, args.repeats, args.warmup)
        add_row(rows, sdpa_ms, variant=f"{name}-fused", ms=ms, peak_delta_bytes=peak, kv_bytes=kv_bytes,
                max_abs_err=err, **shape)
        if not args.no_paged:
            pages, tables, key_size = paged_layout(key_codes, value_codes, args.block_size, device, gen)
            lens = [m] * b

            def paged():
                q_rot = (query.to(torch.float32) @ forward) * scale
                out, lse = ck.coded_decode_attention_paged(q_rot, pages, tables, lens, book.codewords,
                                                           book.codewords, book.index_bits, book.index_bits,
                                                           key_size, backend="triton")
                return out @ forward.T, lse

            err_paged = float((paged()[0] - expected).abs().max())
            ms, peak = measure(paged, device, args.repeats, args.warmup)
            add_row(rows, sdpa_ms, variant=f"{name}-paged", ms=ms, peak_delta_bytes=peak, kv_bytes=pages.numel(),
                    max_abs_err=err_paged, **shape)
            del pages, tables
        del expected
        if args.reference:
            ms, peak = measure(reference, device, max(1, args.repeats // 5), min(args.warmup, 2))
            add_row(rows, sdpa_ms, variant=f"{name}-ref", ms=ms, peak_delta_bytes=peak, kv_bytes=kv_bytes,
                    max_abs_err=0.0, **shape)
        del key_codes, value_codes
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--codecs", nargs="+", default=["fibquant:b=4", "fibquant:b=2"], choices=sorted(CODECS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
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
    hq, hkv, d, t = args.q_heads, args.kv_heads, args.dim, args.query_tokens
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": __import__("triton").__version__, "interpreted": interpreted,
            "batches": args.batches, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "query_tokens": t,
            "repeats": args.repeats, "warmup": args.warmup, "block_size": args.block_size}
    print(json.dumps(info))
    if interpreted:
        print("NOTE: Triton interpreter: timings are of the Python interpreter, not of a kernel")
    gen = torch.Generator(device).manual_seed(0)
    rows = []
    for m in args.contexts:
        for b in args.batches:
            rows += measure_shape(args, device, gen, b, m)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    write_rows(results_dir(args.out) / "gpu_decode_attention.json", info, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
