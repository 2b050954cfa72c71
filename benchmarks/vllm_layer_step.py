"""One decode layer step of the vLLM plugin (its attention backend's whole `forward`: code writes,
exact window, paged kernel) against vLLM's own CPU bf16 attention (`cpu_attn_reshape_and_cache` +
`cpu_attention_with_kv_cache`, what `CPU_ATTN` runs) in one process, calls interleaved.

Usage: OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_layer_step.py [--batch 4]
       [--context 1024] [--steps 200] [--caches fibquant:b=4 fibquant:b=2] [--immediate]
       [--gather on off values keys] [--out results/]

--immediate adds each cache once more with its codes written every forward (no deferred writes),
to show what the batched encode of `integrations/vllm/deferred.py` saves. --gather runs each cache
once per setting of the attention option `gather_decode` (on: decode-then-dot gathers for both
4-bit roles; keys / values: for that role only; off: lookup tables / histograms everywhere; default:
the module's own setting only); with "off" among them each other setting gets its paired ratio to it.

Issue 18's target "decode attention on codes per layer step <= bf16's" is timed inside the engine
by `benchmarks/vllm_serving.py` (caches one after another, each its own engine); this script
times the same per-layer work outside the engine with every cache stepping in turn, so the
machine's load falls on all of them alike. Shapes are SmolLM2-135M's (9 query heads, 3 KV heads,
head dim 64), vLLM's CPU block size 128, B sequences prefilled to `context` tokens (one forward
each, untimed), then `steps` decode steps, each timed per cache: the new token's write and the
attention over context + step tokens (the plugin's 4 + 32 exact window, its deferred code writes
flushed every 16 steps inside the timed forwards); each step's metadata (vLLM's scheduler metadata,
the plugin's metadata object and its window plan) is built before the timed call, as the engine
builds it once per step for all layers. Synthetic Gaussian bf16 keys/values/queries,
the same for every cache; the order of the caches rotated by one each step. One torch thread; ratio = median / bf16's median. Writes
results/vllm_layer_step.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from fibquant.eval.report import format_table, write_json
from fibquant.paths import results_dir

Q_HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 128


class _Case:
    def __init__(self, batch: int, context: int, steps: int, seed: int) -> None:
        self.batch, self.context = batch, context
        per_seq = -(-(context + steps + 1) // BLOCK)
        self.blocks = batch * per_seq + 1
        generator = torch.Generator().manual_seed(seed)
        self.tables = torch.randperm(self.blocks, generator=generator)[: batch * per_seq].view(batch, per_seq)
        self.tables = self.tables.to(torch.int32)
        self.generator = generator

    def slots(self, positions: list[int]) -> torch.Tensor:
        return torch.tensor([int(self.tables[b, p // BLOCK]) * BLOCK + p % BLOCK for b, p in enumerate(positions)])

    def tokens(self, n: int):
        return tuple(torch.randn(n, heads * DIM, generator=self.generator).bfloat16()
                     for heads in (Q_HEADS, KV_HEADS, KV_HEADS))


class DenseBf16:
    """vLLM's CPU attention on bf16 pages [blocks, Hkv, block, 2 * D] (its kernels, called directly)."""

    name = "bf16 (vLLM CPU_ATTN)"

    def __init__(self, case: _Case) -> None:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.ops, self.case = ops, case
        self.isa = _get_attn_isa(torch.bfloat16, BLOCK, DIM, "auto")
        cache = torch.zeros(case.blocks, KV_HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16)
        self.key_cache, self.value_cache = cache.view(case.blocks, KV_HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)

    def prepare(self, query, key, value, slots, starts: list[int], lengths: list[int]):
        """The layer call (timed) with this step's metadata built beforehand (once per step for every
        layer in the engine, so not part of a layer's cost)."""
        ops, n = self.ops, query.shape[0]
        query, key, value = (t.view(n, -1, DIM) for t in (query, key, value))
        start_loc, seq_lens = torch.tensor(starts, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(lengths), num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, seq_lens=seq_lens,
            dtype=torch.bfloat16, query_start_loc=start_loc, causal=True, sliding_window_size=-1, isa=self.isa,
            enable_kv_split=False)
        tables = self.case.tables[: len(lengths)]

        def call() -> torch.Tensor:
            ops.cpu_attn_reshape_and_cache(key, value, self.key_cache, self.value_cache, slots, self.isa)
            out = torch.empty(n, Q_HEADS, DIM, dtype=torch.bfloat16)
            ops.cpu_attention_with_kv_cache(query=query, key_cache=self.key_cache, value_cache=self.value_cache,
                                            output=out, query_start_loc=start_loc, seq_lens=seq_lens,
                                            scale=DIM ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
                                            block_table=tables, softcap=0, scheduler_metadata=metadata, s_aux=None)
            return out.view(n, -1)

        return call


_GATHER = {"on": True, "off": False, "keys": "keys", "values": "values"}  # --gather -> AttentionOptions.gather_decode


class Plugin:
    """The FibQuant backend's forward (writes included) on token-major coded pages."""

    def __init__(self, case: _Case, spec: str, defer: bool = True, gather=None) -> None:
        from fibquant.integrations.vllm import backend
        from fibquant.integrations.vllm.config import ATTENTION_ENV_VAR, ENV_VAR, active_config

        os.environ[ENV_VAR] = spec
        self.name = spec + ("" if defer else " (immediate writes)") + ("" if gather is None else f" (gather {gather})")
        self.case, self.meta, self.gather = case, backend.FibQuantMetadata, gather
        options = [f"defer_codes={defer}"] + ([] if gather is None else [f"gather_decode={_GATHER[gather]}"])
        os.environ[ATTENTION_ENV_VAR] = ",".join(options)  # read once, by the impl's constructor
        try:
            self.impl = backend.FibQuantAttentionImpl(Q_HEADS, DIM, DIM ** -0.5, KV_HEADS)
        finally:
            del os.environ[ATTENTION_ENV_VAR]
        slot = active_config().slot_bytes(DIM)
        self.cache = torch.zeros(case.blocks, BLOCK, KV_HEADS, slot // 2, dtype=torch.bfloat16).transpose(1, 2)

    def prepare(self, query, key, value, slots, starts: list[int], lengths: list[int]):
        n = query.shape[0]
        meta = self.meta(n, starts, lengths, self.case.tables[: len(lengths)], slots)
        # The forward's window plan is built by the engine's first layer and kept on the metadata for
        # the other layers (30 in SmolLM2), like vLLM's scheduler metadata: built here, untimed.
        self.impl._window_plan(meta, self.impl._pages(self.cache))
        return lambda: self.impl.forward(None, query, key, value, self.cache, meta,
                                         torch.empty(n, Q_HEADS * DIM, dtype=torch.bfloat16))


def measure(args) -> list[dict]:
    torch.set_num_threads(1)
    case = _Case(args.batch, args.context, args.steps, seed=0)
    runners = [DenseBf16(case)] + [Plugin(case, spec, defer, gather) for spec in args.caches
                                   for defer in ((True, False) if args.immediate else (True,))
                                   for gather in (args.gather or (None,))]
    for b in range(args.batch):  # prefill, one forward per sequence (untimed)
        query, key, value = case.tokens(args.context)
        slots = torch.tensor([int(case.tables[b, p // BLOCK]) * BLOCK + p % BLOCK for p in range(args.context)])
        for runner in runners:
            if isinstance(runner, DenseBf16):
                runner.ops.cpu_attn_reshape_and_cache(key.view(-1, KV_HEADS, DIM), value.view(-1, KV_HEADS, DIM),
                                                      runner.key_cache, runner.value_cache, slots, runner.isa)
            else:
                meta = runner.meta(args.context, [0, args.context], [args.context], case.tables[b:b + 1], slots)
                runner.impl.forward(None, query, key, value, runner.cache, meta,
                                    torch.empty(args.context, Q_HEADS * DIM, dtype=torch.bfloat16))
    times = {runner.name: [] for runner in runners}
    errors = {runner.name: 0.0 for runner in runners}
    starts = list(range(args.batch + 1))
    for step in range(args.steps):
        positions = [args.context + step] * args.batch
        query, key, value = case.tokens(args.batch)
        slots = case.slots(positions)
        lengths = [p + 1 for p in positions]
        outs = {}
        shift = step % len(runners)  # the order rotated each step: no cache always, or twice in a row, after another
        for runner in runners[shift:] + runners[:shift]:
            call = runner.prepare(query, key, value, slots, starts, lengths)
            start = time.perf_counter()
            outs[runner.name] = call()
            times[runner.name].append(time.perf_counter() - start)
        reference = outs[runners[0].name].float()
        for name, out in outs.items():  # how far each cache's attention output is from bf16's
            errors[name] = max(errors[name], float((out.float() - reference).norm() / reference.norm()))
    warm = slice(min(16, args.steps // 4), None)
    base = statistics.median(times[runners[0].name][warm])
    rows = [{"cache": name, "ms_per_layer_step": 1e3 * statistics.median(values[warm]),
             "x_bf16": statistics.median(values[warm]) / base, "max_rel_err_vs_bf16": errors[name],
             "batch": args.batch, "context": args.context, "steps": args.steps}
            for name, values in times.items()]
    for row, runner in zip(rows, runners):  # per step: this cache / bf16, and / the same cache with gathers off
        name = row["cache"]
        row["x_bf16_paired"] = statistics.median(a / b for a, b in zip(times[name][warm], times[runners[0].name][warm]))
        off = name.replace(f"(gather {getattr(runner, 'gather', None)})", "(gather off)")
        if off != name and off in times:
            row["x_tables_paired"] = statistics.median(a / b for a, b in zip(times[name][warm], times[off][warm]))
    return rows


COLUMNS = [("cache", "cache", ""), ("ms_per_layer_step", "ms / layer step", ".3f"), ("x_bf16", "x bf16", ".2f"),
           ("x_bf16_paired", "x bf16 (paired per step)", ".2f"), ("x_tables_paired", "x gather off (paired)", ".2f"),
           ("max_rel_err_vs_bf16", "max rel. err vs bf16", ".3f")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--caches", nargs="+", default=["fibquant:b=4", "fibquant:b=2"])
    parser.add_argument("--immediate", action="store_true",
                        help="also each cache with every forward's codes written at once (option defer_codes off)")
    parser.add_argument("--gather", nargs="+", choices=sorted(_GATHER), default=None,
                        help="run each cache once per gather_decode option (default: the tuned one)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.batch < 1 or args.context < 1 or args.steps < 4:
        parser.error("--batch and --context must be >= 1 and --steps >= 4")
    print(f"decode layer step: {args.batch} sequences x {args.context}+ tokens, SmolLM2 shapes, "
          f"{args.steps} steps interleaved, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    rows = measure(args)
    print(format_table(rows, COLUMNS))
    path = results_dir(args.out) / "vllm_layer_step.json"
    write_json(path, {"settings": vars(args), "load_average": os.getloadavg(), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
