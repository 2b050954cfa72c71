"""The model a saved cache belongs to, in its manifest: exact where exact, weights with a tolerance.

A saved cache's keys/values mean something only for the model that computed them, so opening
one with a model compares that model with the saved identity (docs/persistent-cache.md).

Format version 3 (`model_identity`, a dict) holds

    config       the architecture fields of CONFIG_KEYS (model type, layers, heads, sizes,
                 rope theta, ...) and of LATER_CONFIG_KEYS (rope parameters/scaling, sliding
                 window, layer types, soft-capping, ...), compared exactly; a LATER key that a
                 saved identity lacks was not recorded when it was saved and is not compared
    parameters   {name: {"shape", "dtype", "sample"}} for every named parameter: names,
                 shapes and dtypes compared exactly; "sample" is the `tensor_fingerprint`
                 (numel, rms, 8 fixed +-1 projections; `fibquant.kv.persist.fingerprint`) of
                 the strided sample flat[::max(1, numel // SAMPLE)] (SAMPLE..2 SAMPLE - 1 values,
                 all of a small tensor), compared within `weight_tolerance(dtype)` x its rms

Why not a hash of the weights: weights dequantised from GGUF, converted through another dtype
path, or computed with FMA on another CPU can differ in their last bit across machines with
the same model; a hash (the sha256 of versions 1-2, `model_sha256`) then refuses on one machine
a cache saved on another. One ulp on every float32 weight moves a projection by ~3e-7 of the
rms; another fine-tune (a tensor scaled by 1.01: 1.2e-2 to 2.2e-2) or another random init (O(1))
moves it far past the tolerance, and another layer count or width changes the exact part.

Version 1-2 manifests (and format-3 files written before this identity, which hold the same
string) keep their sha256, still compared exactly (`model_mismatch` dispatches on the type).
"""
from __future__ import annotations

import hashlib
import json
from typing import Optional, Union

import torch

from fibquant.kv.persist.fingerprint import TOLERANCE, fingerprint_label, tensor_fingerprint, tensor_mismatch

CONFIG_KEYS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
               "head_dim", "vocab_size", "rope_theta", "max_position_embeddings")
# Recorded since 2026-12-03. transformers 5 keeps the rope theta in `rope_parameters` (config.rope_theta
# is None there), so without these a model with another rope base, rope scaling (context extension)
# or sliding window, and otherwise the same weights, opened a cache computed with different positions.
LATER_CONFIG_KEYS = ("rope_parameters", "rope_scaling", "partial_rotary_factor", "sliding_window", "layer_types",
                     "attn_logit_softcapping", "query_pre_attn_scalar", "kv_lora_rank", "qk_rope_head_dim")
SAMPLE = 4096  # values sampled per parameter (at least; a tensor of fewer is read whole)


def _text_config(model):
    return model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config


def _config(model) -> dict:
    """The CONFIG_KEYS and LATER_CONFIG_KEYS fields of the model's (text) config, as JSON reads them back."""
    config = _text_config(model)
    return json.loads(json.dumps({k: getattr(config, k, None) for k in CONFIG_KEYS + LATER_CONFIG_KEYS},
                                 sort_keys=True, default=str))


def _parameters(model) -> list:
    return sorted(model.named_parameters(), key=lambda item: item[0])


def _sample(param: torch.Tensor) -> torch.Tensor:
    """The strided sample [~SAMPLE..2 SAMPLE) of a parameter, flat, in its own dtype, on the CPU."""
    flat = param.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // SAMPLE)].cpu()


def model_sha256(model) -> str:
    """sha256 of the model's architecture and a float32 strided sample of every parameter: the model
    identity of version-1/2 manifests (exact bits; still computed to check them)."""
    digest = hashlib.sha256(json.dumps({k: getattr(_text_config(model), k, None) for k in CONFIG_KEYS},
                                       sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, param in _parameters(model):
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // SAMPLE)].float().cpu().contiguous()
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def model_identity(model) -> dict:
    """{"config": {CONFIG_KEYS...}, "parameters": {name: {"shape", "dtype", "sample"}}} (version 3);
    20-80 ms for SmolLM2-135M on a loaded 2-core machine (272 parameters, 4096 or 576 values each)."""
    with torch.no_grad():
        parameters = {name: {"shape": list(param.shape), "dtype": str(param.dtype),
                             "sample": tensor_fingerprint(_sample(param))} for name, param in _parameters(model)}
    return {"config": _config(model), "parameters": parameters}


def weight_tolerance(dtype: str) -> float:
    """Relative tolerance (x rms) for weights of `dtype` ("torch.float32"): TOLERANCE, or the epsilon
    of a coarser dtype (bfloat16 7.8e-3, float16 9.8e-4); unknown or non-float dtypes: TOLERANCE.

    float32: one ulp on every weight moves a projection by ~3 eps = 4e-7 x rms, far inside. Half
    precision: the realistic last-bit difference is sparse (a float32 value rounded to half flips
    a last bit only near a tie); one ulp on 1% / 5% / 10% of bfloat16 weights moves it by
    0.4 / 0.9 / 1.04 eps (benchmarks/model_identity.py), on every weight by 2.7 eps: refused, as it cannot be told from a 1% rescale (rms alone: 1.3 eps
    in bfloat16), which is another model."""
    kind = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(kind, torch.dtype) or not kind.is_floating_point:
        return TOLERANCE
    return max(TOLERANCE, torch.finfo(kind).eps)


def _names(names) -> str:
    names = sorted(names)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def model_mismatch(saved: Union[str, dict], model) -> Optional[str]:
    """What differs between a saved model identity (a version-3 dict, or the sha256 string of
    versions 1-2) and `model`, or None: the config field(s), the parameter names, a parameter's
    shape/dtype, or the weights beyond their tolerance (the first such parameter and a count)."""
    if isinstance(saved, str):
        return None if model_sha256(model) == saved else \
            "its weights' sha256 differs (a version-1/2 file: exact bits are compared)"
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict) \
            or not isinstance(saved.get("parameters"), dict):
        return "the saved model identity is corrupt (no config/parameters)"
    config = _config(model)
    compared = (set(config) - set(LATER_CONFIG_KEYS)) | set(saved["config"])
    fields = [k for k in sorted(compared) if config.get(k) != saved["config"].get(k)]
    if fields:
        return "config " + ", ".join(f"{k} {config.get(k)!r}, saved {saved['config'].get(k)!r}" for k in fields)
    here = dict(_parameters(model))
    extra, missing = set(here) - set(saved["parameters"]), set(saved["parameters"]) - set(here)
    if extra or missing:
        return "parameters differ: " + "; ".join(
            text for text in (extra and f"{len(extra)} not in the saved model ({_names(extra)})",
                              missing and f"{len(missing)} saved ones missing here ({_names(missing)})") if text)
    differing = []
    with torch.no_grad():
        for name, param in sorted(here.items()):
            entry = saved["parameters"][name]
            if entry.get("shape") != list(param.shape) or entry.get("dtype") != str(param.dtype):
                return f"{name}: shape {list(param.shape)} {param.dtype}, saved {entry.get('shape')} {entry.get('dtype')}"
            problem = tensor_mismatch(entry.get("sample", {}), tensor_fingerprint(_sample(param)),
                                      weight_tolerance(entry["dtype"]))
            if problem is not None:
                differing.append(f"{name}{problem}")
    if differing:
        more = f" (and {len(differing) - 1} more of {len(here)} parameters)" if len(differing) > 1 else ""
        return f"weights: {differing[0]}{more}"
    return None


def identity_summary(saved: Union[str, dict]) -> str:
    """One line naming a saved model identity (`fibquant cache info`), not the whole fingerprint."""
    if isinstance(saved, str):
        return f"sha256 {saved[:16]} (version 1-2: exact)"
    parameters = saved.get("parameters", {})
    tolerances = sorted({weight_tolerance(p.get("dtype", "")) for p in parameters.values()})
    config = saved.get("config", {})
    return (f"{fingerprint_label(saved)}: {config.get('model_type')}, {config.get('num_hidden_layers')} layers, "
            f"{len(parameters)} parameters, weights within {'/'.join(f'{t:g}' for t in tolerances) or '-'} of their rms")
