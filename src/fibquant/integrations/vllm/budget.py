"""The KV budget of a FibQuant engine: the exact window's side store comes out of it, on every path.

vLLM sizes the pages from what its worker's `determine_available_memory` returns: the budget
(`--kv-cache-memory-bytes` / `kv_cache_memory_bytes`, or what the CPU worker derives from
`VLLM_CPU_KVCACHE_SPACE`). The exact window (`window.ExactWindow`) lives beside the pages, so
`count_window_in_budget` wraps that method of vLLM's worker classes (once per process, when the plugin
is on): the worker's answer minus the window's bytes at their bound (`VllmCacheConfig.window_bytes`
for the worker's KV heads, layers and `max_num_seqs`). The pages and the window then fit the budget
an operator gave, on the offline `LLM(...)` path and the OpenAI server alike; the split is logged in
one line (`BudgetSplit.describe`), with the KV tokens bf16 pages would hold in the same budget.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from fibquant.integrations.vllm.config import VllmCacheConfig

# A child of vLLM's logger: the line goes wherever the operator's vLLM log goes, at its level.
logger = logging.getLogger("vllm.fibquant")
# The classes whose `determine_available_memory` vLLM's platforms use (CPU, then CUDA's Worker).
WORKER_CLASSES = ("vllm.v1.worker.cpu_worker.CPUWorker", "vllm.v1.worker.gpu_worker.Worker")


@dataclass(frozen=True)
class BudgetSplit:
    """How one worker's KV budget is spent: the exact window's bytes, the rest for pages, the tokens
    those pages hold (whole blocks) and what bf16 pages would hold in the whole budget."""

    spec: str
    budget: int
    window_bytes: int
    page_bytes: int
    tokens: int
    bf16_tokens: int
    key_bits: float     # bits per coordinate of a key code, its norm included
    value_bits: float
    sequences: int

    def describe(self) -> str:
        bits = f"{self.key_bits:.3g}" if self.key_bits == self.value_bits else f"{self.key_bits:.3g}/{self.value_bits:.3g}"
        ratio = self.tokens / self.bf16_tokens if self.bf16_tokens else float("nan")
        return (f"FibQuant KV cache {self.spec}: {bits} bits/coordinate; budget {self.budget:,} bytes = exact window "
                f"{self.window_bytes:,} ({self.sequences} sequences) + pages {self.page_bytes:,}: {self.tokens:,} KV tokens, "
                f"{ratio:.2f}x bf16's {self.bf16_tokens:,} in the same budget")


def split_budget(config: VllmCacheConfig, budget: int, head_dim: int, kv_heads: int, layers: int, sequences: int,
                 element_bytes: int = 2, prefix_caching: bool = False, block_size: int | None = None) -> BudgetSplit:
    """The split of `budget` bytes for a worker holding `kv_heads` KV heads of `head_dim` in `layers`
    layers, serving up to `sequences` at once (vLLM's max_num_seqs). ValueError, naming the numbers,
    when the window alone does not fit."""
    window = config.window_bytes(head_dim, kv_heads, layers, sequences, element_bytes, prefix_caching)
    pages = budget - window
    if pages <= 0:
        raise ValueError(f"the exact windows of {sequences} sequences ({window:,} bytes) do not fit the KV budget of "
                         f"{budget:,} bytes: raise the budget, lower max_num_seqs or FIBQUANT_VLLM_RECENT_TOKENS")
    block = block_size or 1
    per_token = layers * kv_heads * config.slot_bytes(head_dim)
    bf16_per_token = layers * kv_heads * head_dim * 2 * element_bytes
    key, value = config.codecs(head_dim)
    return BudgetSplit(config.spec_for(head_dim).spec, budget, window, pages, pages // (per_token * block) * block,
                       budget // (bf16_per_token * block) * block, key.code_size * 8 / head_dim,
                       value.code_size * 8 / head_dim, sequences)


def worker_split(worker, budget: int, config: VllmCacheConfig) -> BudgetSplit:
    """`split_budget` for a vLLM worker: its model's head size, its own KV heads and layers (tensor /
    pipeline parallel shares), the scheduler's max_num_seqs, the model dtype and prefix caching."""
    model, parallel = worker.model_config, worker.parallel_config
    return split_budget(config, budget, model.get_head_size(), model.get_num_kv_heads(parallel),
                        model.get_num_layers(parallel), int(worker.scheduler_config.max_num_seqs),
                        model.dtype.itemsize, bool(worker.cache_config.enable_prefix_caching),
                        worker.cache_config.block_size)


def _counting(original, config_of):
    """`determine_available_memory` returning the pages' share of the worker's budget (and logging the split)."""

    @functools.wraps(original)
    def determine_available_memory(self) -> int:
        budget = original(self)
        config = config_of()
        if config is None:
            return budget
        split = worker_split(self, budget, config)
        if getattr(self, "rank", 0) == 0:
            logger.info(split.describe())
        return split.page_bytes

    determine_available_memory.fibquant_counts_window = True
    return determine_available_memory


def count_window_in_budget(config_of, classes=WORKER_CLASSES) -> list[str]:
    """Wrap `determine_available_memory` of the worker `classes` that import (once: a wrapped method is
    left as it is). `config_of()` gives the active config when a worker asks (None: the budget as is).
    Returns the class paths wrapped now."""
    import importlib

    wrapped = []
    for path in classes:
        module_name, _, name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):  # a vLLM build without that worker
            continue
        method = cls.__dict__.get("determine_available_memory")
        if method is None or getattr(method, "fibquant_counts_window", False):
            continue
        cls.determine_available_memory = _counting(method, config_of)
        wrapped.append(path)
    return wrapped
