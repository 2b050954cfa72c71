"""Attention on codes: the registered transformers attention function "fibquant" and its kernels.

    switch         `attention_on_codes(model)`: the explicit, reversible switch of a model to it
    entry          `attend_codes`, `use_coded_attention`, the "fibquant" attention function
    reference      plain torch kernels: the spec every faster path is tested against
    kernels        backend choice and dispatch (reference / numba / triton), split over threads
    numba_kernels, numba_tables, intrinsics   the compiled CPU kernels
    jit            how they are compiled: numba's disk cache keyed on every kernel source
    triton_kernels the CUDA kernels (flash-decoding on codes, paged for vLLM)
    mla            attention on an MLA latent's codes (DeepSeek V3, Kimi)
"""
from fibquant.kv.attention.entry import (ATTENTION_NAME, attend_codes, register_coded_attention,
                                         unsupported_reason, use_coded_attention)

__all__ = ["ATTENTION_NAME", "attend_codes", "register_coded_attention",
           "unsupported_reason", "use_coded_attention"]
