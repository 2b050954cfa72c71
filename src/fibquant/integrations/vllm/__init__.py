"""FibQuant inside vLLM: a general plugin (entry point `vllm.general_plugins`: `fibquant`).

Switch: `FIBQUANT_VLLM_CACHE=fibquant:b=4` (see `config`). With it unset, `register` does nothing
and vLLM is untouched. With it set, the FibQuant attention backend (`backend`) replaces CPU_ATTN
(the only backend vLLM's CPU platform selects) and is registered as CUSTOM for other platforms
(`attention_backend="CUSTOM"`), and the exact window's bytes come out of the worker's KV budget
(`budget`), which it logs in one line at engine start.
"""
from __future__ import annotations

from fibquant.integrations.vllm.config import ENV_VAR, VllmCacheConfig, active_config

BACKEND_PATH = "fibquant.integrations.vllm.backend.FibQuantAttentionBackend"

__all__ = ["BACKEND_PATH", "ENV_VAR", "VllmCacheConfig", "active_config", "register"]


def register() -> bool:
    """vLLM calls this in every process it starts (the server's front end first, before any model
    loads). Returns whether the backend was registered. A bad spec raises here, one line naming the
    variable; with a good one, the worker's KV budget counts the exact window (`budget`)."""
    config = active_config()
    if config is None:
        return False
    config.check_rates()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from fibquant.integrations.vllm.budget import count_window_in_budget

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    count_window_in_budget(active_config)
    return True
