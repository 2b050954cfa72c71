"""The causal attention of a prefill chunk among its own tokens (nothing before it) through vLLM's own
CPU attention kernel: the one vLLM's bf16 backend (`CPU_ATTN`) runs for the same prompt.

Why: a first prefill chunk reads nothing coded and nothing exact before it, so its attention is plain
causal attention over its fresh keys / values. torch's `scaled_dot_product_attention` took ~24 ms per
layer for one 1,024-token SmolLM2 prompt on this CPU (one thread), vLLM's kernel ~16 ms: that was
most of the FibQuant engine's time-to-first-token gap to bf16 (docs/serving-vllm.md). The kernel
reads keys / values from head-major paged blocks, so the chunk's are first copied into a scratch
page set (`cpu_attn_reshape_and_cache`, as bf16 writes its cache: ~0.15 ms for 1,024 tokens); our
pages keep the codes.

`available` says whether the kernel serves a (dtype, head size) on this machine; `causal_attention`
is tested against SDPA (tests/integrations/test_vllm.py).
"""
from __future__ import annotations

import functools

import torch

SCRATCH_BLOCK = 128  # tokens per scratch block (a multiple of 32: vLLM's CPU kernels need one)


@functools.lru_cache(maxsize=None)
def _kernel(dtype: torch.dtype, head_size: int):
    """(vLLM's custom ops, the kernel ISA, split-KV switch) for this dtype and head size, or None when
    vLLM's CPU attention ops are not built here or do not take them."""
    try:
        from vllm import _custom_ops as ops
        from vllm import envs
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

        if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
            return None
        if dtype not in CPUAttentionBackend.supported_dtypes or \
                head_size not in CPUAttentionBackend.get_supported_head_sizes():
            return None
        isa = _get_attn_isa(dtype, SCRATCH_BLOCK, head_size, "auto")
        return ops, isa, bool(envs.VLLM_CPU_ATTN_SPLIT_KV)
    except (ImportError, AttributeError, RuntimeError, NotImplementedError):
        return None


def available(dtype: torch.dtype, head_size: int, device: torch.device | str = "cpu") -> bool:
    """Whether `causal_attention` runs vLLM's CPU kernel for CPU tensors of `dtype` with `head_size`."""
    return torch.device(device).type == "cpu" and _kernel(dtype, head_size) is not None


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of T tokens among themselves: query [T, Hq, D], key / value [T, Hk, D] (Hq a
    multiple of Hk; one dtype, CPU) -> [T, Hq, D] in that dtype (written into `out` [T, Hq, D] when
    given). Raises ValueError when `available` is False for them."""
    tokens, heads, dim = query.shape
    kv_heads = key.shape[1]
    if key.shape != (tokens, kv_heads, dim) or value.shape != key.shape or heads % kv_heads:
        raise ValueError(f"bad shapes: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if not (query.dtype == key.dtype == value.dtype) or not available(query.dtype, dim, query.device):
        raise ValueError(f"vLLM's CPU attention kernel does not take {query.dtype} / {key.dtype} / {value.dtype} "
                         f"with head size {dim} on {query.device}")
    ops, isa, split = _kernel(query.dtype, dim)
    blocks = -(-tokens // SCRATCH_BLOCK)
    # vLLM's layout: [blocks, Hk, 2 * block, D], keys in the first half of each block's rows, values in the second
    scratch = torch.empty(blocks, kv_heads, 2 * SCRATCH_BLOCK, dim, dtype=query.dtype)
    scratch[-1].zero_()  # the kernel reads the last block's unused slots too (masked: they must not be NaN)
    key_cache, value_cache = scratch.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(tokens), isa)
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    lengths = torch.tensor([tokens], dtype=torch.int32)
    plan = ops.cpu_attn_get_scheduler_metadata(1, heads, kv_heads, dim, lengths, query.dtype, starts, True, -1, isa,
                                               split)
    if out is None:
        out = torch.empty(tokens, heads, dim, dtype=query.dtype)
    ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, out, starts, lengths, scale, True, None, -1,
                                    torch.arange(blocks, dtype=torch.int32)[None], 0.0, plan, None)
    return out
