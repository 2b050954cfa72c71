"""Same text, same cache semantics, two engines: perplexity through vLLM's `prompt_logprobs` with the
FibQuant backend against transformers with `CompressedCache(sink_tokens=S, recent_tokens=R,
encode_batch=1)`.

Both feed the text in chunks of `chunk` tokens; a chunk attends to itself, the first `sink_tokens`
and the last `recent_tokens` before it exactly and to every other earlier token through its codes
(vLLM: chunked prefill with `max_num_batched_tokens=chunk`, the exact window of `window`). The
comparison is of each engine's increase over its own uncompressed run, since the engines may differ
in weight precision (vLLM serves bf16 by default; transformers runs float32 from the GGUF).

Several spans of the text (`PARITY_OFFSETS`), each a request of its own: one 512-token span is
noisy (its perplexity increase moves by about a point under a bf16 rounding change, see
docs/serving-vllm.md), so a row holds each span's increase and the pooled one (the perplexity of
all spans' tokens together).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from fibquant.integrations.vllm.config import DEFAULT_RECENT_TOKENS
from fibquant.integrations.vllm.engine import EngineSettings, run_task


PARITY_TEXT = "emma"
PARITY_OFFSET = 45_000  # tokens into the novel, away from the title page (`kv_report.text_tokens`)
# Spans of the parity measure: PARITY_OFFSET, then every 25,000 tokens (Emma has ~230,000).
PARITY_OFFSETS = (45_000, 70_000, 95_000, 120_000)


@dataclass(frozen=True)
class ParityRow:
    """One cache spec: per span the mean token NLL of each engine with the cache and uncompressed."""

    spec: str
    transformers_nll: tuple[float, ...]
    transformers_base_nll: tuple[float, ...]
    vllm_nll: tuple[float, ...]
    vllm_base_nll: tuple[float, ...]

    @staticmethod
    def _increase(nll, base) -> float:
        """ppl / uncompressed ppl - 1 of equally long spans pooled (the mean NLL over all their tokens)."""
        return math.exp((sum(nll) - sum(base)) / len(nll)) - 1.0

    @property
    def transformers_increase(self) -> float:
        return self._increase(self.transformers_nll, self.transformers_base_nll)

    @property
    def vllm_increase(self) -> float:
        return self._increase(self.vllm_nll, self.vllm_base_nll)

    @property
    def span_increases(self) -> list[tuple[float, float]]:
        """(transformers, vLLM) increase of each span."""
        return [(math.exp(t - tb) - 1.0, math.exp(v - vb) - 1.0) for t, tb, v, vb in
                zip(self.transformers_nll, self.transformers_base_nll, self.vllm_nll, self.vllm_base_nll)]


def _mean(logprobs) -> float:
    return -sum(logprobs) / len(logprobs)


def transformers_nll(model, spans: list[list[int]], spec: str | None, chunk: int, sink_tokens: int = 4,
                     recent_tokens: int = DEFAULT_RECENT_TOKENS) -> list[float]:
    """Mean NLL of ids[1:] of each span, the transformers model fed in chunks (spec None: DynamicCache)."""
    import torch
    from transformers import DynamicCache

    from fibquant.eval.perplexity import window_nll
    from fibquant.integrations.vllm.config import VllmCacheConfig
    from fibquant.kv.attention.switch import attention_on_codes
    from fibquant.kv.cache import CompressedCache

    out = []
    for ids in spans:
        if spec is None:
            cache = DynamicCache(config=model.config)
        else:
            key, value = VllmCacheConfig.parse(spec).codecs(model.config.head_dim)
            cache = CompressedCache.for_model(model, key, value, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                                              encode_batch=1)
        with torch.no_grad(), attention_on_codes(model):
            out.append(float(window_nll(model, torch.tensor([ids]), cache, chunk).double().mean()))
    return out


def vllm_nll(model_dir: str, spans: list[list[int]], spec: str | None, chunk: int, sink_tokens: int = 4,
             recent_tokens: int = DEFAULT_RECENT_TOKENS, dtype: str = "bfloat16") -> list[float]:
    """Mean NLL of ids[1:] of each span through one vLLM engine in `dtype` (spec None: vLLM untouched)."""
    settings = EngineSettings(model_dir, cache_spec=spec, max_model_len=max(max(map(len, spans)) + 8, 64),
                              chunk_tokens=chunk, max_num_seqs=1, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                              dtype=dtype)
    return [_mean(values) for values in run_task(settings, {"task": "prompt_logprobs", "spans": spans})["logprobs"]]


def parity(model, model_dir: str, spans: list[list[int]], specs: list[str], chunk: int, sink_tokens: int = 4,
           recent_tokens: int = DEFAULT_RECENT_TOKENS, dtype: str = "bfloat16") -> list[ParityRow]:
    """A ParityRow per spec: `model` (transformers) against the exported `model_dir` served by vLLM in `dtype`."""
    base_tf, base_vllm = transformers_nll(model, spans, None, chunk), vllm_nll(model_dir, spans, None, chunk,
                                                                                dtype=dtype)
    rows = []
    for spec in specs:
        tf = transformers_nll(model, spans, spec, chunk, sink_tokens, recent_tokens)
        vl = vllm_nll(model_dir, spans, spec, chunk, sink_tokens, recent_tokens, dtype)
        rows.append(ParityRow(spec, tuple(tf), tuple(base_tf), tuple(vl), tuple(base_vllm)))
    return rows
