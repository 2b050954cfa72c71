"""Same text, same cache semantics, two engines: perplexity through vLLM's `prompt_logprobs` with the
FibQuant backend against transformers with `CompressedCache(sink_tokens=S, recent_tokens=R,
encode_batch=1)`.

Both feed the text in chunks of `chunk` tokens; a chunk attends to itself, the first `sink_tokens`
and the last `recent_tokens` before it exactly and to every other earlier token through its codes
(vLLM: chunked prefill with `max_num_batched_tokens=chunk`, the exact window of `window`). The
comparison is of each engine's increase over its own uncompressed run, because the engines differ
in weight precision (vLLM bf16 from the exported directory, transformers float32 from the GGUF).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from fibquant.integrations.vllm.config import DEFAULT_RECENT_TOKENS
from fibquant.integrations.vllm.engine import EngineSettings, run_task


PARITY_TEXT = "emma"
PARITY_OFFSET = 45_000  # tokens into the novel, away from the title page (`kv_report.text_tokens`)


@dataclass(frozen=True)
class ParityRow:
    spec: str
    transformers_ppl: float
    vllm_ppl: float
    transformers_increase: float  # ppl / uncompressed ppl - 1, same engine
    vllm_increase: float


def _ppl(logprobs) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def transformers_ppl(model, ids: list[int], spec: str | None, chunk: int, sink_tokens: int = 4,
                     recent_tokens: int = DEFAULT_RECENT_TOKENS) -> float:
    """Perplexity of ids[1:] with the transformers model fed in chunks (None: DynamicCache)."""
    import torch
    from transformers import DynamicCache

    from fibquant.eval.perplexity import window_nll
    from fibquant.integrations.vllm.config import VllmCacheConfig
    from fibquant.kv.cache import CompressedCache

    if spec is None:
        cache = DynamicCache(config=model.config)
    else:
        key, value = VllmCacheConfig.parse(spec).codecs(model.config.head_dim)
        cache = CompressedCache.for_model(model, key, value, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                                          encode_batch=1)
    with torch.no_grad():
        nll = window_nll(model, torch.tensor([ids]), cache, chunk)
    return math.exp(float(nll.mean()))


def vllm_ppl(model_dir: str, ids: list[int], spec: str | None, chunk: int, sink_tokens: int = 4,
             recent_tokens: int = DEFAULT_RECENT_TOKENS) -> float:
    settings = EngineSettings(model_dir, cache_spec=spec, max_model_len=max(len(ids) + 8, 64), chunk_tokens=chunk,
                              max_num_seqs=1, sink_tokens=sink_tokens, recent_tokens=recent_tokens)
    return _ppl(run_task(settings, {"task": "prompt_logprobs", "token_ids": ids})["logprobs"])


def parity(model, model_dir: str, ids: list[int], specs: list[str], chunk: int,
           sink_tokens: int = 4, recent_tokens: int = DEFAULT_RECENT_TOKENS) -> list[ParityRow]:
    base_tf, base_vllm = transformers_ppl(model, ids, None, chunk), vllm_ppl(model_dir, ids, None, chunk)
    rows = []
    for spec in specs:
        tf = transformers_ppl(model, ids, spec, chunk, sink_tokens, recent_tokens)
        vl = vllm_ppl(model_dir, ids, spec, chunk, sink_tokens, recent_tokens)
        rows.append(ParityRow(spec, tf, vl, tf / base_tf - 1.0, vl / base_vllm - 1.0))
    return rows
