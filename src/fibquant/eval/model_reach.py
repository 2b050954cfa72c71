"""Which decoder families a `CompressedCache` serves on codes: one tiny random model per family.

`FAMILIES` holds one entry per family: its transformers config and model classes and the settings
of a tiny random config (2 layers, hidden 128, vocabulary 128, head_dim 64 where the family lets it
be set, a sliding window of 16 tokens and `layer_types` mixing sliding and full layers where the
family has them, 4 experts for mixtures of experts). `probe(family)` builds that model (seeded) and
runs the same 40-token prompt (prefilled in two chunks, then a few decode steps) through:

- first, before the model sees a token, `check_model_supported` (the per-role head sizes a cache
  needs: keys and values may differ, e.g. MLA's cached latent) and `CompressedCache.for_model`:
  a ValueError there is a refusal; the sizes are then cross-checked against what the model really
  hands `cache.update` (a `DynamicCache` run);
- a `CompressedCache.for_model(..., attention="codes")` with a FibQuant codec per role and the same
  cache with attention="decode" (on the model's own attention implementation): the codes path's
  logits must equal the decode path's (max relative difference <= LOGITS_RTOL);
- the codes path with an exact window covering the whole prompt (nothing coded) against
  transformers' own `DynamicCache(config=...)`: the cache's semantics (window, masks, sinks,
  soft-capping, scaling) must reproduce the model's;
- a plain `DynamicCache` on the model once switched to fibquant's attention against the model's own
  attention (the switch must not change what other caches compute);
- `model.generate` in a batch of 2 with left padding, codes vs decode: the same greedy tokens.

fibquant's fallbacks warn once per process (`fibquant.kv.attention.notices.warned`); the probe empties
that set before a family and puts the previous entries back after, and records every
RuntimeWarning raised meanwhile, so each family's count is its own.

The status of a family:

- "codes": served on codes (no fallback warning, every check passes);
- "decode fallback": served, but a fallback warned (the warning says which feature is missing);
- "refused": `CompressedCache.for_model` raised ValueError (before any prefill), naming the feature;
- "error": a raw exception, a ValueError after the cache was accepted, or a failed check: a bug.

`benchmarks/model_reach.py` runs every family and writes docs/models.md and results/model_reach.json.
"""
from __future__ import annotations

import contextlib
import importlib
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

LOGITS_RTOL = 1e-4          # max |codes - decode| / max |decode| over every compared logit
PROMPT_TOKENS = 40          # longer than the sliding window (16) and than sinks + recent window
FIRST_CHUNK = 24            # chunked prefill: 24 + 16 tokens
DECODE_STEPS = 4
NEW_TOKENS = 4              # generate
SINK_TOKENS, RECENT_TOKENS, ENCODE_BATCH = 2, 4, 4
BITS = 4.0                  # FibQuant rate per coordinate (d = 64: k = 2, N = 256, shipped)
VOCAB = 128
WINDOW = 16
STATUSES = ("codes", "decode fallback", "refused", "error")

# The common tiny decoder: 2 layers, hidden 128, 2 query heads over 1 KV head (GQA), head_dim 64.
# Token ids inside the tiny vocabulary; weights drawn 10x wider than transformers' default (0.02) so
# attention is peaked enough that a dropped soft-cap, sink or scale moves the logits well past
# LOGITS_RTOL (at 0.02 a dropped soft-cap of 3 moved them by 6e-5 only).
INITIALIZER_RANGE = 0.2
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=INITIALIZER_RANGE)
_BASE = dict(_TOKENS, vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256)
_HYBRID = ["sliding_attention", "full_attention"]


def _base(**overrides) -> dict:
    settings = dict(_BASE)
    settings.update(overrides)
    return {name: value for name, value in settings.items() if value is not None}


@dataclass(frozen=True)
class Family:
    """One decoder family: transformers class names and the settings of its tiny random config."""

    name: str
    config_class: str
    model_class: str
    settings: Callable[[], dict]
    note: str = ""  # what the settings choose to exercise (the doc's features column adds what the config has)
    listed: bool = True  # one of issue 16's families (False: a further family users run)

    def config(self):
        transformers = importlib.import_module("transformers")
        return getattr(transformers, self.config_class)(**self.settings())

    def build(self, seed: int = 0):
        """The tiny model, random weights (seeded), float32, eval mode, the family's default attention."""
        transformers = importlib.import_module("transformers")
        config = self.config()
        torch.manual_seed(seed)
        return getattr(transformers, self.model_class)(config).eval()


FAMILIES: dict[str, Family] = {family.name: family for family in (
    Family("Llama", "LlamaConfig", "LlamaForCausalLM", lambda: _base()),
    Family("Mistral", "MistralConfig", "MistralForCausalLM", lambda: _base(sliding_window=WINDOW)),
    Family("Mixtral", "MixtralConfig", "MixtralForCausalLM",
           lambda: _base(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)),
    Family("Qwen2", "Qwen2Config", "Qwen2ForCausalLM",
           lambda: _base(use_sliding_window=True, sliding_window=WINDOW, layer_types=_HYBRID)),
    Family("Qwen2-MoE", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
           lambda: _base(head_dim=None, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                         shared_expert_intermediate_size=64, use_sliding_window=True, sliding_window=WINDOW,
                         layer_types=_HYBRID)),
    Family("Qwen3", "Qwen3Config", "Qwen3ForCausalLM",
           lambda: _base(use_sliding_window=True, sliding_window=WINDOW, layer_types=_HYBRID)),
    Family("Qwen3-MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
           lambda: _base(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
           note="no sliding layers: transformers' Qwen3-MoE builds one full mask for every layer"),
    Family("Gemma", "GemmaConfig", "GemmaForCausalLM", lambda: _base()),
    Family("Gemma 2", "Gemma2Config", "Gemma2ForCausalLM",
           lambda: _base(sliding_window=WINDOW, layer_types=_HYBRID, query_pre_attn_scalar=32,
                         attn_logit_softcapping=3.0, final_logit_softcapping=30.0),
           note="attention soft-cap 3.0 (real models: 50) so random scores reach it"),
    Family("Gemma 3 (text)", "Gemma3TextConfig", "Gemma3ForCausalLM",
           lambda: _base(sliding_window=WINDOW, layer_types=_HYBRID, query_pre_attn_scalar=32)),
    Family("Phi-3", "Phi3Config", "Phi3ForCausalLM", lambda: _base(head_dim=None, sliding_window=WINDOW)),
    Family("GPT-2", "GPT2Config", "GPT2LMHeadModel",
           lambda: dict(_TOKENS, vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=2, n_positions=256)),
    Family("GPT-NeoX", "GPTNeoXConfig", "GPTNeoXForCausalLM",
           lambda: dict(_TOKENS, vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, max_position_embeddings=256)),
    Family("GPT-J", "GPTJConfig", "GPTJForCausalLM",
           lambda: dict(_TOKENS, vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=2, n_positions=256, rotary_dim=32)),
    Family("Falcon", "FalconConfig", "FalconForCausalLM",
           lambda: dict(_TOKENS, vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                        multi_query=True, max_position_embeddings=256)),
    Family("OLMo 2", "Olmo2Config", "Olmo2ForCausalLM", lambda: _base(head_dim=None)),
    Family("Granite", "GraniteConfig", "GraniteForCausalLM",
           lambda: _base(head_dim=None, attention_multiplier=0.05, embedding_multiplier=2.0,
                         residual_multiplier=0.5, logits_scaling=2.0)),
    Family("Cohere 2", "Cohere2Config", "Cohere2ForCausalLM",
           lambda: _base(head_dim=None, sliding_window=WINDOW, layer_types=_HYBRID)),
    Family("StableLM", "StableLmConfig", "StableLmForCausalLM", lambda: _base(head_dim=None)),
    Family("SmolLM3", "SmolLM3Config", "SmolLM3ForCausalLM", lambda: _base(no_rope_layer_interval=2),
           note="layer 2 without RoPE (NoPE)"),
    Family("gpt-oss", "GptOssConfig", "GptOssForCausalLM",
           lambda: _base(sliding_window=WINDOW, layer_types=_HYBRID, num_local_experts=4, num_experts_per_tok=2)),
    Family("DeepSeek-V3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
           lambda: _base(head_dim=None, num_key_value_heads=2, kv_lora_rank=64, q_lora_rank=None,
                         qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
                         num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                         moe_intermediate_size=64),
           note="MLA: latent rank 64, RoPE dim 64, nope 32, value 32"),
    # Further families users run (beyond issue 16's list): more layer kinds, and models with
    # layers that are not attention at all, which the cache must refuse before any prefill.
    Family("Llama 4 (text)", "Llama4TextConfig", "Llama4ForCausalLM",
           lambda: _base(attention_chunk_size=WINDOW, num_local_experts=4, num_experts_per_tok=1,
                         intermediate_size_mlp=128, interleave_moe_layer_step=1, no_rope_layers=[1, 0]),
           note="chunked attention (chunk 16) on the RoPE layer, NoPE layer 2", listed=False),
    Family("Ministral", "MinistralConfig", "MinistralForCausalLM",
           lambda: _base(sliding_window=WINDOW, layer_types=_HYBRID), listed=False),
    Family("OLMo 3", "Olmo3Config", "Olmo3ForCausalLM",
           lambda: _base(head_dim=None, sliding_window=WINDOW, layer_types=_HYBRID), listed=False),
    Family("EXAONE 4", "Exaone4Config", "Exaone4ForCausalLM",
           lambda: _base(sliding_window=WINDOW, layer_types=_HYBRID), listed=False),
    Family("GLM-4", "Glm4Config", "Glm4ForCausalLM", lambda: _base(), listed=False),
    Family("Phi-2", "PhiConfig", "PhiForCausalLM",
           lambda: _base(head_dim=None, num_key_value_heads=None, qk_layernorm=True), listed=False),
    Family("Qwen3-Next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
           lambda: _base(layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=64, shared_expert_intermediate_size=64, linear_num_value_heads=2,
                         linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32),
           note="a gated delta-net (linear attention) layer", listed=False),
    Family("Jamba", "JambaConfig", "JambaForCausalLM",
           lambda: _base(head_dim=None, attn_layer_period=2, attn_layer_offset=1, num_experts=2, expert_layer_period=2,
                         expert_layer_offset=1, mamba_d_state=8, mamba_expand=2, use_mamba_kernels=False),
           note="a Mamba layer", listed=False),
    Family("Mamba", "MambaConfig", "MambaForCausalLM",
           lambda: dict(_TOKENS, vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, state_size=8,
                        use_mambapy=True),
           note="no attention at all", listed=False),
)}


# ----------------------------------------------------------------------------- what a model has
def features(model) -> dict:
    """The attention features of `model`, read from its config and its attention modules."""
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    out: dict = {}
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        out["layer_types"] = list(layer_types)
    for name in ("sliding_window", "attention_chunk_size", "attn_logit_softcapping", "kv_lora_rank",
                 "attention_multiplier", "query_pre_attn_scalar", "alibi"):
        value = getattr(text, name, None)
        if value:
            out[name] = value
    experts = next((getattr(text, name) for name in ("num_local_experts", "num_experts", "n_routed_experts")
                    if getattr(text, name, None)), None)
    if experts:
        out["experts"] = experts
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    kv_heads = getattr(text, "num_key_value_heads", None)
    if kv_heads and heads and kv_heads != heads:
        out["query_heads_per_kv_head"] = heads // kv_heads
    scalings, sinks = set(), False
    for module in model.modules():
        if isinstance(getattr(module, "scaling", None), float) and hasattr(module, "layer_idx"):
            scalings.add(round(module.scaling, 6))
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            sinks = True
    no_rope = getattr(text, "no_rope_layers", None)
    if no_rope and not all(no_rope):
        out["layers_without_rope"] = [index for index, rope in enumerate(no_rope) if not rope]
    if scalings:
        out["query_scaling"] = sorted(scalings)
    if sinks:
        out["attention_sinks"] = True
    return out


def feature_summary(info: dict) -> str:
    """A short text of `features(...)` (and the cached head sizes) for the doc's table."""
    parts = []
    types = info.get("layer_types")
    if types:
        counts = {t: types.count(t) for t in dict.fromkeys(types)}
        parts.append(" + ".join(f"{n} {t.replace('_attention', '')}" for t, n in counts.items()))
    if "sliding_window" in info:
        parts.append(f"window {info['sliding_window']}")
    if "attention_chunk_size" in info:
        parts.append(f"chunk {info['attention_chunk_size']}")
    if "attn_logit_softcapping" in info:
        parts.append(f"soft-cap {info['attn_logit_softcapping']:g}")
    if info.get("attention_sinks"):
        parts.append("learned sinks (s_aux)")
    if "layers_without_rope" in info:
        parts.append(f"NoPE layers {info['layers_without_rope']}")
    if "kv_lora_rank" in info:
        parts.append(f"MLA (latent {info['kv_lora_rank']})")
    if "experts" in info:
        parts.append(f"MoE {info['experts']} experts")
    if "query_heads_per_kv_head" in info:
        parts.append(f"GQA {info['query_heads_per_kv_head']}:1")
    cached = info.get("cache_shapes")
    if cached:
        key, value = cached["key"], cached["value"]
        parts.append(f"cached K {key[1]}x{key[3]}, V {value[1]}x{value[3]} (heads x dim)")
    for scale in info.get("query_scaling", []):
        dims = cached["query_dim"] if cached else None
        if dims and abs(scale - dims ** -0.5) > 1e-6:
            parts.append(f"scale {scale:.4g} (not 1/sqrt({dims}))")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- running a cache
def _forward(model, ids, cache, attention_mask=None):
    from fibquant.kv.model import _forward_arguments

    argument, _ = _forward_arguments(type(model))
    kwargs = {argument: cache, "use_cache": True}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits


def _run(model, cache, ids) -> torch.Tensor:
    """Logits [T, V] of every position: prefill in two chunks, then one token per step."""
    prompt = ids[:, :PROMPT_TOKENS]
    parts = [_forward(model, prompt[:, :FIRST_CHUNK], cache), _forward(model, prompt[:, FIRST_CHUNK:], cache)]
    for step in range(DECODE_STEPS):
        token = ids[:, PROMPT_TOKENS + step:PROMPT_TOKENS + step + 1]
        parts.append(_forward(model, token, cache))
    return torch.cat(parts, dim=1)[0].to(torch.float32)


def relative_difference(got: torch.Tensor, reference: torch.Tensor) -> float:
    """max |got - reference| / max |reference| (inf when shapes differ or a value is not finite)."""
    if got.shape != reference.shape or not torch.isfinite(got).all():
        return float("inf")
    scale = reference.abs().max().clamp_min(1e-12)
    return float((got - reference).abs().max() / scale)


def cache_shapes(model, ids) -> dict:
    """Shapes of what the model hands `cache.update` per layer (a DynamicCache prefill)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    _forward(model, ids[:, :8], cache)
    layer = cache.layers[0]
    query_dims = {getattr(m, "head_dim", None) or getattr(m, "qk_head_dim", None) for m in model.modules()
                  if hasattr(m, "layer_idx") and hasattr(m, "scaling")}
    query_dims.discard(None)
    mla = getattr(model.config, "qk_nope_head_dim", None)
    query_dim = (mla + model.config.qk_rope_head_dim) if mla else \
        (min(query_dims) if query_dims else layer.keys.shape[-1])
    return {"key": list(layer.keys.shape), "value": list(layer.values.shape), "query_dim": query_dim,
            "layers": [type(layer).__name__ for layer in cache.layers]}


class _FallbackRecorder:
    """Empties fibquant's once-per-process warning set, records RuntimeWarnings, restores the set."""

    def __enter__(self):
        from fibquant.kv.attention import notices

        self._warned = notices.warned
        self._saved = set(self._warned)
        self._warned.clear()
        self._catch = warnings.catch_warnings(record=True)
        self.records = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def messages(self) -> list[str]:
        """Distinct RuntimeWarning texts recorded so far, in order."""
        texts = [str(w.message) for w in self.records if issubclass(w.category, RuntimeWarning)]
        return list(dict.fromkeys(texts))

    def keys(self) -> list[str]:
        return sorted(self._warned)

    def __exit__(self, *exc):
        self.final_keys = self.keys()
        self._catch.__exit__(*exc)
        self._warned.clear()
        self._warned.update(self._saved)
        return False


# Keyword arguments transformers passes along that do not change what attention computes.
_PLUMBING = frozenset({"position_ids", "use_cache", "output_router_logits", "output_attentions", "cache_position",
                       "return_dict"})


class _AttentionCalls:
    """Records what transformers hands fibquant's attention function (installed as a local override
    of `ALL_ATTENTION_FUNCTIONS["fibquant"]` around one run, removed after)."""

    def __init__(self):
        self.calls: list[dict] = []

    def __enter__(self):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from fibquant.kv.attention.entry import ATTENTION_NAME

        self._registry, self._name = ALL_ATTENTION_FUNCTIONS, ATTENTION_NAME
        self._had_local = ATTENTION_NAME in getattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", {})
        inner = ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] if ATTENTION_NAME in ALL_ATTENTION_FUNCTIONS else None
        if inner is None or self._had_local:
            return self

        def recording(module, query, key, value, attention_mask, *args, **kwargs):
            from fibquant.kv.buffer import CodedKV

            named = {name: value for name, value in kwargs.items()
                     if value is not None and name not in _PLUMBING and not (name == "dropout" and not value)}
            self.calls.append({"coded": isinstance(key, CodedKV), "query_dim": int(query.shape[-1]),
                               "kwargs": sorted(name for name in named if name != "scaling"),
                               "scaling": named.get("scaling")})
            return inner(module, query, key, value, attention_mask, *args, **kwargs)

        ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] = recording
        self._installed = True
        return self

    def __exit__(self, *exc):
        if getattr(self, "_installed", False):
            del self._registry[self._name]
        return False

    def summary(self) -> dict:
        """{"calls", "coded_calls", "kwargs" (names seen with a value), "scalings"}."""
        names = sorted({name for call in self.calls for name in call["kwargs"]})
        scalings = sorted({round(float(call["scaling"]), 6) for call in self.calls if call["scaling"] is not None})
        return {"calls": len(self.calls), "coded_calls": sum(call["coded"] for call in self.calls),
                "kwargs": names, "scalings": scalings}


def _error_text(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" at {frame.filename.split('site-packages/')[-1].split('src/')[-1]}:{frame.lineno}" if frame else ""
    return f"{type(exc).__name__}: {exc}{where}"


# ----------------------------------------------------------------------------- the probe
def probe(family: Family | str, seed: int = 0, bits: float = BITS, generate: bool = True,
          threads: Optional[int] = 1, codec: Optional[Callable] = None) -> dict:
    """Run one family's tiny model through the codes and decode paths; return what happened.

    Order: DynamicCache and the decode path first, on the model's own attention implementation
    (the references); then `for_model(..., attention="codes")` (which must leave the model unchanged)
    and the codes runs inside `attention_on_codes(model)` (which must restore it after).

    Keys: family, config_class, model_class, note, status (one of STATUSES), reason, stage (where it
    stopped), features, cache_shapes, fallback_warnings (texts), warned_keys, attention (the codes
    cache's mode after for_model), attn_implementation (the model's, after for_model), coded_tokens
    (per layer, codes run), logits_rel_codes_vs_decode, logits_rel_exact_vs_dynamic, generate_equal,
    seconds. threads: torch (and the numba kernels') threads during the probe, restored after
    (None: unchanged); on a small shared machine one thread is ~15x faster for these tiny models.
    codec: codec(dim) -> the codec of a role of that head size (default FibQuantCodec.for_rate(dim, bits)).
    """
    from transformers.utils import logging as hf_logging

    family = FAMILIES[family] if isinstance(family, str) else family
    started = time.perf_counter()
    result: dict = {"family": family.name, "config_class": family.config_class, "model_class": family.model_class,
                    "note": family.note, "status": None, "reason": "", "stage": "build", "features": {},
                    "cache_shapes": None, "fallback_warnings": [], "warned_keys": [], "attention": None,
                    "attn_implementation": None, "coded_tokens": None, "held_tokens": None,
                    "attention_calls": None, "logits_rel_codes_vs_decode": None,
                    "logits_rel_exact_vs_dynamic": None, "logits_rel_switched_dynamic": None,
                    "generate_equal": None}
    verbosity, threads_before = hf_logging.get_verbosity(), torch.get_num_threads()
    hf_logging.set_verbosity_error()  # the tiny configs' notes (e.g. RoPE factors) are not findings
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with _FallbackRecorder() as recorder:
            status, reason = _probe_stages(family, seed, bits, generate, result, recorder, codec)
    finally:
        hf_logging.set_verbosity(verbosity)
        torch.set_num_threads(threads_before)
    result["status"], result["reason"] = status, reason
    result["seconds"] = round(time.perf_counter() - started, 3)
    return result


def _reference_attention(model) -> str:
    """The model's own attention implementation, or "eager" where that one drops a feature of the model:
    transformers' SDPA ignores logit soft-capping, and releases before 5.18 give Gemma 2 SDPA by default."""
    own = model.config._attn_implementation
    softcap = getattr(getattr(model.config, "get_text_config", lambda: model.config)(), "attn_logit_softcapping", None)
    return "eager" if own == "sdpa" and softcap else own


class _Stop(Exception):
    """A probe stage's verdict that ends the probe: args (status, reason)."""


def _probe_stages(family: Family, seed: int, bits: float, generate: bool, result: dict,
                  recorder: "_FallbackRecorder", codec: Optional[Callable]) -> tuple[str, str]:
    """The probe's stages, filling `result`; returns (status, reason)."""
    from transformers import DynamicCache

    def finish(status: str, reason: str = "") -> tuple[str, str]:
        result["fallback_warnings"], result["warned_keys"] = recorder.messages(), recorder.keys()
        return status, reason

    try:
        model = family.build(seed)
        own_attention = _reference_attention(model)
        model.set_attn_implementation(own_attention)
        result["features"] = features(model)
    except Exception as exc:  # noqa: BLE001 - the probe reports every failure
        return finish("error", f"build: {_error_text(exc)}")
    try:
        dims, new_cache = _caches_for(model, bits, codec, own_attention, result)
    except _Stop as stop:
        return finish(*stop.args)
    except ValueError as exc:
        return finish("refused", str(exc))
    except Exception as exc:  # noqa: BLE001
        return finish("error", f"{result['stage']}: {_error_text(exc)}")
    try:
        result["stage"] = "dynamic cache reference"
        generator = torch.Generator().manual_seed(seed + 1)
        ids = torch.randint(3, VOCAB, (1, PROMPT_TOKENS + DECODE_STEPS), generator=generator)
        shapes = cache_shapes(model, ids)
        result["cache_shapes"] = result["features"]["cache_shapes"] = shapes
        dynamic_logits = _run(model, DynamicCache(config=model.config), ids)
    except Exception as exc:  # noqa: BLE001
        return finish("error", f"{result['stage']}: {_error_text(exc)}")
    if (shapes["key"][-1], shapes["value"][-1]) != dims:
        return finish("error", f"the model hands cache.update keys/values of sizes {shapes['key'][-1]}/"
                               f"{shapes['value'][-1]}, check_model_supported says {dims[0]}/{dims[1]}")
    try:
        failures = _compare_runs(model, new_cache, ids, dynamic_logits, own_attention, generate, result)
    except Exception as exc:  # noqa: BLE001
        return finish("error", f"{result['stage']}: {_error_text(exc)}")
    if failures:
        return finish("error", "; ".join(failures))
    texts = recorder.messages()
    if texts or result["attention"] != "codes":
        return finish("decode fallback", " | ".join(texts) or f"cache attention {result['attention']!r}")
    return finish("codes")


def _caches_for(model, bits: float, codec: Optional[Callable], own_attention: str, result: dict):
    """(the (key, value) sizes the model caches, new_cache(attention, recent)) after `for_model` accepted the
    model with codec objects and with a spec; raises `_Stop` on a wrong answer, ValueError on a refusal.

    Refusal comes first, before the model has seen a token: the codec sizes are the ones
    check_model_supported says the cache needs (cross-checked against a DynamicCache run after)."""
    from fibquant.codecs.fibquant import FibQuantCodec
    from fibquant.kv.cache import CompressedCache
    from fibquant.kv.model import check_model_supported

    make = codec or (lambda dim: FibQuantCodec.for_rate(dim, bits))
    result["stage"] = "check_model_supported"
    try:
        info = check_model_supported(model)
    except ValueError as exc:  # for_model (what users call) must refuse it too, with a ValueError
        result["stage"] = "for_model (codes)"
        CompressedCache.for_model(model, make(64), make(64), attention="codes")
        raise _Stop("error", f"check_model_supported refuses ({exc}) but for_model accepts the model") from None
    dims = (info.get("key_dim", info["head_dim"]), info.get("value_dim", info["head_dim"]))
    key_codec = make(dims[0])
    value_codec = key_codec if dims[1] == dims[0] else make(dims[1])
    result["codecs"] = [repr(key_codec), repr(value_codec)]

    def new_cache(attention: str, recent: int = RECENT_TOKENS):
        return CompressedCache.for_model(model, key_codec, value_codec, sink_tokens=SINK_TOKENS,
                                         recent_tokens=recent, attention=attention, encode_batch=ENCODE_BATCH)

    result["stage"] = "for_model (decode)"
    new_cache("decode")
    result["stage"] = "for_model (codes)"
    new_cache("codes")
    result["stage"] = "for_model (spec)"  # each role's size read from the model
    spec_cache = CompressedCache.for_model(model, f"fibquant:b={bits:g}")
    if (spec_cache.key_codec.dim, spec_cache.value_codec.dim) != dims:
        raise _Stop("error", f"for_model(model, spec) built codecs of {spec_cache.key_codec.dim}/"
                             f"{spec_cache.value_codec.dim} dims, the model caches {dims[0]}/{dims[1]}")
    if model.config._attn_implementation != own_attention:
        raise _Stop("error", "for_model changed the model's attention implementation")
    return dims, new_cache


def _compare_runs(model, new_cache, ids, dynamic_logits, own_attention: str, generate: bool,
                  result: dict) -> list[str]:
    """Run the decode path, the codes path, the codes path with nothing coded and a DynamicCache under the
    switch (and generate), filling `result`; the failed comparisons, as sentences."""
    from transformers import DynamicCache

    from fibquant.kv.attention.switch import attention_on_codes

    failures = []

    def compare(name: str, rel: float, what: str) -> None:
        result[name] = rel
        if not rel <= LOGITS_RTOL:
            failures.append(f"{what}: max relative difference {rel:.3g} > {LOGITS_RTOL:g}")

    result["stage"] = "decode run"
    decode_logits = _run(model, new_cache("decode"), ids)
    result["stage"] = "codes run"
    codes_cache = new_cache("codes")
    result["attention"] = codes_cache.attention
    with attention_on_codes(model), _AttentionCalls() as calls:
        result["attn_implementation"] = model.config._attn_implementation
        codes_logits = _run(model, codes_cache, ids)
    if model.config._attn_implementation != own_attention:
        failures.append("attention_on_codes did not restore the model's attention implementation")
    result["attention_calls"] = calls.summary()
    result["coded_tokens"] = [getattr(layer, "num_coded", None) for layer in codes_cache.layers]
    result["held_tokens"] = [sum(getattr(layer, name, 0) or 0 for name in ("num_sink", "num_coded", "num_recent"))
                             for layer in codes_cache.layers]
    compare("logits_rel_codes_vs_decode", relative_difference(codes_logits, decode_logits),
            "codes logits differ from decode logits")
    result["stage"] = "exact-window run"
    with attention_on_codes(model):
        exact_logits = _run(model, new_cache("codes", recent=PROMPT_TOKENS + DECODE_STEPS), ids)
    compare("logits_rel_exact_vs_dynamic", relative_difference(exact_logits, dynamic_logits),
            "codes path with nothing coded differs from DynamicCache")
    result["stage"] = "DynamicCache under fibquant's attention"
    with attention_on_codes(model) as switched:  # switched: a plain cache must still be right
        rel = (relative_difference(_run(model, DynamicCache(config=model.config), ids), dynamic_logits)
               if switched else None)
    if rel is not None:
        compare("logits_rel_switched_dynamic", rel,
                "a DynamicCache on the switched model differs from the model's own attention")
    if generate:
        result["stage"] = "generate"
        result["generate_equal"] = _generate_equal(model, new_cache)
        if not result["generate_equal"]:
            failures.append("generate (batch 2, left padding): codes and decode give different tokens")
    result["stage"] = "done"
    return failures


def _generate_equal(model, new_cache) -> bool:
    """Greedy generate, batch 2 (row 1 left-padded by 5), codes vs decode: the same tokens?"""
    from fibquant.kv.attention.switch import attention_on_codes
    from fibquant.kv.model import cache_kwarg

    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (2, PROMPT_TOKENS - 8), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    outputs = []
    for attention in ("decode", "codes"):
        cache = new_cache(attention)
        with torch.no_grad(), attention_on_codes(model) if attention == "codes" else contextlib.nullcontext():
            outputs.append(model.generate(ids, attention_mask=mask, **cache_kwarg(model, cache),
                                          max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                          eos_token_id=None))
    return bool(outputs[1].shape == (2, ids.shape[1] + NEW_TOKENS) and torch.equal(outputs[0], outputs[1]))


def probe_all(names: Optional[list[str]] = None, **kwargs) -> list[dict]:
    """`probe` of every family (or of `names`), in registry order."""
    return [probe(FAMILIES[name], **kwargs) for name in (names or list(FAMILIES))]


# ----------------------------------------------------------------------------- the reach table
def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _number(value) -> str:
    return "-" if value is None else ("inf" if value == float("inf") else f"{value:.1e}")


def render_markdown(results: list[dict], command: str, provenance: dict) -> str:
    """docs/models.md: one row per family from `probe` results (nothing in it is written by hand)."""
    def counts(rows: list[dict]) -> str:
        return ", ".join(f"{sum(r['status'] == status for r in rows)} {status}" for status in STATUSES)

    listed = [r for r in results if FAMILIES.get(r["family"], Family("", "", "", dict)).listed]
    further = [r for r in results if r not in listed]
    lines = [
        "# Model reach: which decoder families a CompressedCache serves on codes",
        "",
        f"**Generated** by `{command}` (transformers {provenance.get('transformers', '?')}, torch "
        f"{provenance.get('torch', '?')}). Do not edit by hand: rerun the command. The same probe "
        "(`fibquant.eval.model_reach.probe`) is asserted per family by `tests/kv/test_model_families.py`.",
        "",
        f"Each family is its own transformers class with a tiny random config ({len(results)} families: 2 layers, "
        f"hidden 128, vocabulary {VOCAB}, head_dim 64 where the family sets it, sliding window {WINDOW} with "
        "`layer_types` mixing sliding and full layers where the family has them, MoE with 4 experts; weights "
        f"drawn with initializer_range {INITIALIZER_RANGE}). FibQuant b={BITS:g} per role (each role's codec has "
        "the head size the model hands `cache.update`), "
        f"{SINK_TOKENS} sink tokens, {RECENT_TOKENS} recent, encode batch {ENCODE_BATCH}; a {PROMPT_TOKENS}-token "
        f"prompt prefilled in two chunks ({FIRST_CHUNK} + {PROMPT_TOKENS - FIRST_CHUNK}), then {DECODE_STEPS} "
        "decode steps.",
        "",
        "Status:",
        "",
        "- **codes**: attention runs on the codes (every attention call got a `CodedKV`, no fallback warning); "
        f"codes logits equal the decode path's and, with nothing coded, `DynamicCache`'s (max relative "
        f"difference <= {LOGITS_RTOL:g}), and so does a `DynamicCache` on the model once switched to fibquant's "
        "attention (against the model's own attention); batched left-padded `generate` gives the decode path's "
        "tokens;",
        "- **decode fallback**: served, through the decode path; the reason is fibquant's warning;",
        "- **refused**: `CompressedCache.for_model` raises ValueError naming the feature, before any prefill;",
        "- **error**: a raw exception or a failed check (a bug).",
        "",
        f"Summary: the {len(listed)} core families: {counts(listed)}; {len(further)} further families "
        f"(marked +): {counts(further)}.",
        "",
        "| family | transformers class | status | layer types / features exercised | options the attention "
        "function got | codes vs decode (max rel) | nothing coded vs DynamicCache | DynamicCache after the switch "
        "| generate | reason |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        calls = r.get("attention_calls") or {}
        options = ", ".join(calls.get("kwargs", [])) or "-"
        if calls.get("calls"):
            options += f" ({calls['coded_calls']}/{calls['calls']} calls on codes)"
        generate = {True: "same tokens", False: "differs", None: "-"}[r.get("generate_equal")]
        features_text = feature_summary(r.get("features") or {})
        if r.get("note"):
            features_text += f" ({r['note']})"
        lines.append("| " + " | ".join(_cell(c) for c in (
            r["family"] + ("" if r in listed else " +"), r["model_class"], f"**{r['status']}**",
            features_text or "-", options,
            _number(r.get("logits_rel_codes_vs_decode")), _number(r.get("logits_rel_exact_vs_dynamic")),
            _number(r.get("logits_rel_switched_dynamic")), generate, r.get("reason") or "-")) + " |")
    lines.append("")
    return "\n".join(lines)
