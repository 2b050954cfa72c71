"""The causal attention of a prefill chunk among its own tokens (nothing before it) through vLLM's own
CPU attention kernel: the one vLLM's bf16 backend (`CPU_ATTN`) runs for the same prompt.

Why: a first prefill chunk reads nothing coded and nothing exact before it, so its attention is plain
causal attention over its fresh keys / values. torch's `scaled_dot_product_attention` took ~24 ms per
layer for one 1,024-token SmolLM2 prompt on this CPU (one thread), vLLM's kernel ~16 ms: that was
most of the FibQuant engine's time-to-first-token gap to bf16 (docs/serving-vllm.md). The kernel
reads keys / values from head-major paged blocks, so the chunk's are first copied into a scratch
page set (`cpu_attn_reshape_and_cache`, as bf16 writes its cache: ~0.1 ms for 1,024 tokens); our
pages keep the codes. The scratch is kept between calls (per thread, dtype and shape; grown, never
shrunk), and the output is written where the caller says (`out`: vLLM's own output rows): together
3.97 -> 3.71 ms per 1,024-token bf16 chunk (SmolLM2 heads, one thread, paired; a fresh 0.8 MB scratch per
call and a copy of the result into the rows before).

The kernel's "amx" code path needs the process's AMX tile permission (Linux `arch_prctl`), which
oneDNN requests on its first bf16 matmul: inside an engine the model's layers have done so, a bare
process has not and dies of SIGILL. `_kernel` asks for it (`torch.cpu._init_amx`) and takes vLLM's
"vec" path where it is refused.

`available` says whether the kernel serves a (dtype, head size) on this machine; `causal_attention`
is tested against SDPA (tests/integrations/test_vllm.py).
"""
from __future__ import annotations

import functools
import threading

import torch

SCRATCH_BLOCK = 128  # tokens per scratch block (a multiple of 32: vLLM's CPU kernels need one)
_SCRATCH = threading.local()  # (dtype, kv heads, head size) -> the scratch page set [blocks, Hk, 2 * block, D]


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
        if isa == "amx" and not torch.cpu._init_amx():  # no AMX tile permission: AMX code would be SIGILL
            isa = "vec"
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
    given: contiguous, as vLLM's output rows are). Raises ValueError when `available` is False for them or
    `out` does not fit."""
    tokens, heads, dim = query.shape
    kv_heads = key.shape[1]
    if key.shape != (tokens, kv_heads, dim) or value.shape != key.shape or heads % kv_heads:
        raise ValueError(f"bad shapes: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if not (query.dtype == key.dtype == value.dtype) or not available(query.dtype, dim, query.device):
        raise ValueError(f"vLLM's CPU attention kernel does not take {query.dtype} / {key.dtype} / {value.dtype} "
                         f"with head size {dim} on {query.device}")
    ops, isa, split = _kernel(query.dtype, dim)
    if out is None:
        out = torch.empty(tokens, heads, dim, dtype=query.dtype)
    elif out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(query.shape)} {query.dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if tokens == 0:
        return out
    blocks = -(-tokens // SCRATCH_BLOCK)
    key_cache, value_cache = _scratch(query.dtype, kv_heads, dim, blocks)
    if tokens % SCRATCH_BLOCK:
        # the kernel reads the last block's unused slots too (masked: they must not be NaN, as a reused or
        # fresh scratch may hold); whole block: the kernel's in-block layout is its own (ISA-dependent)
        key_cache[blocks - 1].zero_()
        value_cache[blocks - 1].zero_()
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(tokens), isa)
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    lengths = torch.tensor([tokens], dtype=torch.int32)
    plan = ops.cpu_attn_get_scheduler_metadata(1, heads, kv_heads, dim, lengths, query.dtype, starts, True, -1, isa,
                                               split)
    ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, out, starts, lengths, scale, True, None, -1,
                                    torch.arange(blocks, dtype=torch.int32)[None], 0.0, plan, None)
    return out


def _scratch(dtype: torch.dtype, kv_heads: int, dim: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's scratch pages for at least `blocks` blocks in vLLM's layout [blocks, Hk, 2 * block, D]
    (keys in the first half of each block's rows, values in the second), as (key cache, value cache) views."""
    held = _SCRATCH.__dict__.setdefault("sets", {})
    scratch = held.get((dtype, kv_heads, dim))
    if scratch is None or scratch.shape[0] < blocks:
        scratch = held[(dtype, kv_heads, dim)] = torch.empty(blocks, kv_heads, 2 * SCRATCH_BLOCK, dim, dtype=dtype)
    return scratch.chunk(2, dim=2)
