"""Capture the real post-RoPE queries, keys and values of every attention layer on a text span.

A forward pre-hook on each attention module (Llama-family layout: q_proj/k_proj/v_proj,
`position_embeddings=(cos, sin)` passed to the module, `apply_rotary_pos_emb` in the module's
file) recomputes the projections from the hidden states the module receives and applies the
model's own rotary embedding, so queries and keys are exactly what attention uses and keys
are what a cache stores.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from fibquant.kv.model import check_model_supported


@dataclass
class CapturedAttention:
    """queries [L, Hq, T, D], keys and values [L, Hkv, T, D] (float32, CPU); `scaling` = softmax scale."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scaling: float

    @property
    def num_layers(self) -> int:
        return self.queries.shape[0]

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.queries.shape[1] // self.keys.shape[1]


def attention_modules(model) -> list[torch.nn.Module]:
    """The self-attention module of every decoder layer, in layer order."""
    modules = [m for m in model.modules() if all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj"))]
    if not modules:
        raise ValueError(f"{type(model).__name__}: no attention modules with q_proj/k_proj/v_proj found")
    return modules


@torch.no_grad()
def capture_attention(model, input_ids: torch.Tensor, layers: list[int] | None = None) -> CapturedAttention:
    """Run `model` once on `input_ids` ([T] or [1, T]) and return its attention inputs.

    layers: indices of the layers to keep (default all).
    """
    info = check_model_supported(model)
    if input_ids.ndim == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"capture_attention expects one sequence [T] or [1, T], got {tuple(input_ids.shape)}")
    modules = attention_modules(model)
    keep = list(range(len(modules))) if layers is None else list(layers)
    if any(not 0 <= i < len(modules) for i in keep):
        raise ValueError(f"layers {keep} out of range for a model with {len(modules)} layers")
    head_dim = info["head_dim"]
    store: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def make_hook(index: int, module: torch.nn.Module):
        rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb

        def hook(_module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
            shape = (*hidden.shape[:-1], -1, head_dim)
            q = module.q_proj(hidden).view(shape).transpose(1, 2)
            k = module.k_proj(hidden).view(shape).transpose(1, 2)
            v = module.v_proj(hidden).view(shape).transpose(1, 2)
            q, k = rotate(q, k, cos, sin)
            store[index] = tuple(t[0].to(torch.float32).cpu() for t in (q, k, v))

        return hook

    handles = [modules[i].register_forward_pre_hook(make_hook(i, modules[i]), with_kwargs=True) for i in keep]
    try:
        model(input_ids=input_ids.to(model.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    scaling = float(getattr(modules[0], "scaling", head_dim ** -0.5))
    q, k, v = (torch.stack([store[i][j] for i in keep]) for j in range(3))
    return CapturedAttention(q, k, v, scaling)
