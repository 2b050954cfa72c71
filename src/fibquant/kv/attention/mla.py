"""Attention on the codes of an MLA latent (DeepSeek V3 / Kimi as transformers 5 runs them).

transformers' `DeepseekV3Attention` hands `cache.update` the latent c [B, 1, T, kv_lora_rank] (key
slot) and the shared rotary key k_rot [B, 1, T, qk_rope_head_dim] (value slot), then expands them
with `kv_b_proj` into per-head keys and values (`expand_kv`) before its attention function. So a
`CompressedCache` codes the latent itself; to attend on those codes the up-projections are
absorbed instead (as DeepSeek's own inference does):

    q . k_i   = q_nope . (W_UK c_i) + q_rope . r_i = (W_UK^T q_nope) . c_i + q_rope . r_i
    sum p_i v_i = W_UV (sum_i p_i c_i)

so each head's query is moved into the latent space once, scored against the latent codes (and the
rotary key codes), the weights sum latent codes, and W_UV maps the result back once per query.

`enable(model)` switches every such attention module of `model` (found by its `expand_kv` and
`kv_b_proj`): its `expand_kv` passes a `CodedKV` through unexpanded (plain tensors as before, so
other caches are unaffected) and fibquant's attention function serves it with `attend_latent`;
`disable` undoes it (`fibquant.kv.attention.switch.attention_on_codes` calls both).
"""
from __future__ import annotations

import torch

from fibquant.kv.attention.entry import _bias_block, attend_codes
from fibquant.kv.attention.readers import read_scores
from fibquant.kv.buffer import CodedKV

_ATTRIBUTES = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_heads", "kv_lora_rank")


def _mla_modules(model) -> list:
    return [module for module in model.modules() if callable(getattr(module, "expand_kv", None))
            and isinstance(getattr(module, "kv_b_proj", None), torch.nn.Linear)
            and all(isinstance(getattr(module, name, None), int) for name in _ATTRIBUTES)]


def enable(model) -> list:
    """Let fibquant's attention function attend on the latent codes of every MLA module of `model`; returns
    the modules it switched (`disable` puts them back), empty when the model has none in the form this module
    knows or they already read codes."""
    switched = []
    for module in _mla_modules(model):
        if reads_codes(module):
            continue
        expand = module.expand_kv
        module.expand_kv = (lambda latent, rotary, expand=expand:
                            (latent, rotary) if isinstance(latent, CodedKV) else expand(latent, rotary))
        module.coded_attention = attend_latent
        switched.append(module)
    return switched


def disable(modules) -> None:
    """Undo `enable` on the modules it returned."""
    for module in modules:
        del module.expand_kv  # the instance attribute: the class's own expand_kv again
        del module.coded_attention


def latent_modules(model) -> list:
    """The MLA attention modules of `model` in the form this module knows (empty: none)."""
    return _mla_modules(model)


def reads_codes(module) -> bool:
    """Whether `module` passes a coded latent to fibquant's attention (between `enable` and `disable`)."""
    return getattr(module, "coded_attention", None) is attend_latent


def attend_latent(module, query: torch.Tensor, kv: CodedKV, attention_mask, scaling: float, **options) -> torch.Tensor:
    """MLA attention of query [B, H, T, nope + rope] over the coded latent -> [B, T, H, v_head_dim].

    kv: the layer's `CodedKV` (key role: latent [.., rank], value role: rotary key [.., rope]);
    attention_mask as for `attend_codes`."""
    if options.get("softcap") is not None or options.get("sinks") is not None:
        raise ValueError("MLA attention on codes has no soft-capping or sinks")
    nope, rope, value_dim = module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim
    heads, rank = module.num_heads, module.kv_lora_rank
    weight = module.kv_b_proj.weight.to(torch.float32).view(heads, nope + value_dim, rank)
    up_keys, up_values = weight[:, :nope], weight[:, nope:]
    batch, _, tokens, _ = query.shape
    queries = query.to(torch.float32)
    latent_queries = torch.einsum("bhtn,hnr->bhtr", queries[..., :nope], up_keys)
    rotary = (queries[..., nope:] * scaling).reshape(batch, 1, heads * tokens, rope)
    exact_rotary = torch.cat([kv.recent_values, kv.new_values], dim=-2).to(torch.float32)
    parts = [rotary @ kv.sink_values.to(torch.float32).transpose(-1, -2)]
    if kv.num_coded:
        coded = read_scores(kv.value_codec, rotary, kv.value_codes)
        if kv.value_mean is not None:  # centred rotary keys
            coded = coded + rotary @ kv.value_mean.unsqueeze(-1)
        parts.append(coded)
    parts.append(rotary @ exact_rotary.transpose(-1, -2))
    length = kv.length
    bias = torch.cat(parts, dim=-1).view(batch, heads, tokens, length)
    mask = _bias_block(attention_mask, slice(0, tokens), length, length - tokens, query.device)
    if mask is not None:
        bias = bias + mask
    latent = CodedKV(kv.sink_keys, kv.sink_keys, kv.key_codes, kv.key_codes, kv.recent_keys, kv.recent_keys,
                     kv.new_keys, kv.new_keys, kv.key_codec, kv.key_codec, kv.key_mean, kv.key_mean,
                     options=kv.options)
    mixed = attend_codes(latent_queries, latent, bias, scaling)  # [B, T, H, rank] = sum_i p_i c_i
    return torch.einsum("bthr,hvr->bthv", mixed.to(torch.float32), up_values).to(query.dtype)
