"""FibQuant inside vLLM: a general plugin (entry point `vllm.general_plugins`: `fibquant`).

Switch: `FIBQUANT_VLLM_CACHE=fibquant:b=4` (see `config`). With it unset, `register` does nothing
and vLLM is untouched. With it set, the FibQuant attention backend (`backend`) replaces CPU_ATTN
(the only backend vLLM's CPU platform selects) and is registered as CUSTOM for other platforms
(`attention_backend="CUSTOM"`).
"""
from __future__ import annotations

from fibquant.integrations.vllm.config import ENV_VAR, VllmCacheConfig, active_config

BACKEND_PATH = "fibquant.integrations.vllm.backend.FibQuantAttentionBackend"

__all__ = ["BACKEND_PATH", "ENV_VAR", "VllmCacheConfig", "active_config", "register"]


def register() -> bool:
    """vLLM calls this in every process it starts. Returns whether the backend was registered."""
    config = active_config()  # a bad spec raises here, at engine start, with the variable named
    if config is None:
        return False
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    return True
