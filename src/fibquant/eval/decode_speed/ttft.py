"""Time to first token of one cache built fresh: the prompt run through the model with that cache
in the loop, in one forward ("ttft") or in chunks ("chunked"). Part of the decode-speed experiment
(`fibquant.eval.decode_speed`), which calls `time_fresh_prefill` per cache, context and part.

What is timed, per repeat: building the empty cache (`DynamicCache(config=...)`,
`CompressedCache.for_model(model, codec, codec, ...)`, `QuantizedCache(backend, config, ...)`),
every prefill forward (last-position logits only) and the argmax of the first generated token,
with `torch.cuda.synchronize` on a GPU. The codec (codebook, rotation) is built before the clock
starts: it is per model, not per request. Memory: the peak resident memory (CPU: process RSS
high-water mark, `PeakRSS`; CUDA: `torch.cuda.max_memory_allocated`) during those calls minus
the amount just before (after gc + malloc_trim), i.e. what the prefill adds: the cache it builds,
the activations and every transient buffer (e.g. score blocks); the model weights are already
resident and not counted.

CPU time (`Clocks`, next to the wall clock): on a shared machine the wall clock also counts the
time the process waits for a core; the CPU time of the work does not. With 1 torch thread it is
`time.thread_time()` of the calling thread (torch's and numba's kernels then run on it, and the
memory sampler's thread is left out); with more threads `time.process_time()` (every thread of the
process, the sampler's ~1 % included). On an idle machine the two agree within a few percent.
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

from fibquant.eval.decode_speed.config import SpeedCache, DecodeSpeedConfig, cache_bytes
from fibquant.eval.memory import PeakCUDA, PeakRSS, _synchronize, release_free_memory
from fibquant.eval.timing import Stopwatch
from fibquant.kv.model import last_logits


class Clocks:
    """`with Clocks() as c:` -> c.seconds (wall, perf_counter) and c.cpu_seconds (see the module docstring)."""

    def __enter__(self) -> "Clocks":
        import torch

        self._cpu = time.thread_time if torch.get_num_threads() == 1 else time.process_time
        self._wall0, self._cpu0 = time.perf_counter(), self._cpu()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._wall0
        self.cpu_seconds = self._cpu() - self._cpu0


def cpu_clock_name() -> str:
    import torch

    return ("time.thread_time (1 thread: the calling thread runs every kernel)" if torch.get_num_threads() == 1
            else "time.process_time (all threads of the process)")


def fresh_cache(spec: SpeedCache, model, codec, config: DecodeSpeedConfig):
    """An empty cache of `spec` for `model`, as a user would build it before `generate`."""
    if spec.kind == "dynamic":
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    if spec.kind == "compressed":
        from fibquant.kv.cache import CompressedCache

        return CompressedCache.for_model(model, codec, codec, sink_tokens=config.sink_tokens,
                                         recent_tokens=config.recent_tokens, attention=spec.attention,
                                         recall=spec.recall_option())
    from transformers import QuantizedCache

    return QuantizedCache(spec.family, model.config, nbits=spec.bits, q_group_size=config.q_group_size,
                          residual_length=config.residual_length)


def _one_prefill(spec, model, ids, chunk: Optional[int], codec, config) -> dict:
    """One timed fresh prefill (chunk None: the whole prompt in one forward)."""
    release_free_memory()
    monitor = PeakCUDA(model.device) if model.device.type == "cuda" else PeakRSS(config.memory_interval_s)
    tokens = int(ids.shape[0])
    step = tokens if chunk is None else chunk
    chunk_s = []
    with monitor:
        _synchronize(model.device)
        with Clocks() as total:
            cache = fresh_cache(spec, model, codec, config)
            for start in range(0, tokens, step):
                with Stopwatch() as piece:
                    logits = last_logits(model, ids[None, start:start + step], cache)
                    if start + step >= tokens:
                        token = int(logits.argmax())
                    _synchronize(model.device)
                chunk_s.append(piece.seconds)
    nbytes = cache_bytes(spec, cache)
    out = {"seconds": total.seconds, "cpu_seconds": total.cpu_seconds, "chunk_s": chunk_s, "token": token, "peak_added": monitor.added,
           "cache_bytes": nbytes["held"], "cache_tokens": cache.get_seq_length(),
           "attention_used": getattr(cache, "attention", None), "memory_method": monitor.description}
    del cache
    return out


def fresh_prefill(spec: SpeedCache, model, ids, chunk: Optional[int], codec, config: DecodeSpeedConfig) -> dict:
    """One timed fresh prefill of `ids` [T] with `spec`'s cache (chunk None: one forward); ours run inside
    `attention_on_codes(model)`, which restores the model's attention implementation afterwards."""
    with codes_switch([spec], model):
        return _one_prefill(spec, model, ids, chunk, codec, config)


def codes_switch(specs, model):
    """`attention_on_codes(model)` when one of `specs` is ours (the other caches run under it as SDPA serves
    them), else a context that changes nothing."""
    from contextlib import nullcontext

    from fibquant.kv.attention.switch import attention_on_codes

    return attention_on_codes(model) if any(spec.kind == "compressed" for spec in specs) else nullcontext()


def prefill_fields(runs: list[dict], ids, chunk: Optional[int], prefix: str) -> dict:
    """The row fields of one cache's fresh prefills `runs` (from `fresh_prefill`):
    `<prefix>_s` (median wall seconds), `<prefix>_s_all`, `<prefix>_cpu_s` (median CPU seconds),
    `<prefix>_cpu_s_all`, `<prefix>_chunk_s` (per forward, last run), `<prefix>_token` (the greedy
    first token), `<prefix>_peak_added_bytes` (largest over runs), `<prefix>_cache_bytes`,
    `<prefix>_chunk_tokens`, ..."""
    last = runs[-1]
    return {
        f"{prefix}_s": statistics.median(r["seconds"] for r in runs),
        f"{prefix}_s_all": [r["seconds"] for r in runs],
        f"{prefix}_cpu_s": statistics.median(r["cpu_seconds"] for r in runs),
        f"{prefix}_cpu_s_all": [r["cpu_seconds"] for r in runs],
        f"{prefix}_chunk_s": last["chunk_s"],
        f"{prefix}_chunk_tokens": int(ids.shape[0]) if chunk is None else chunk,
        f"{prefix}_token": last["token"],
        f"{prefix}_peak_added_bytes": max(r["peak_added"] for r in runs),
        f"{prefix}_cache_bytes": last["cache_bytes"],
        f"{prefix}_cache_tokens": last["cache_tokens"],
        f"{prefix}_attention_used": last["attention_used"],
        "prefill_memory_method": last["memory_method"],
    }


def time_fresh_prefill(spec: SpeedCache, model, ids, chunk: Optional[int], codec, config: DecodeSpeedConfig,
                       prefix: str) -> dict:
    """`config.prefill_repeats` fresh prefills of `ids` [T] with `spec`'s cache, one after another;
    their row fields (`prefill_fields`). The experiment itself interleaves the repeats of all
    caches (`fibquant.eval.decode_speed`); this is one cache alone (e.g. the warm-up)."""
    runs = [fresh_prefill(spec, model, ids, chunk, codec, config) for _ in range(config.prefill_repeats)]
    return prefill_fields(runs, ids, chunk, prefix)
