"""Attention-fidelity experiment: capture, attention reference, window mixing, frontier logic, errors."""
from __future__ import annotations

import pytest
import torch
from _kv_helpers import real_model, tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from fibquant.kv.model import cache_kwarg
from fibquant.codecs.integer import IntCodec
from fibquant.eval.capture import CapturedAttention, attention_modules, capture_attention
from fibquant.eval.fidelity import (CalibrationBank, FidelityConfig, causal_attention, compare_frontiers,
                                    evaluate_method, exact_window_mask, output_cosine, pareto_front, run_fidelity)
from fibquant.codecs.registry import CodecSpec, parse_codec_spec


def loop_attention(q, k, v, k_hat, v_hat, scaling, positions, sinks, recent):
    """Spec: one query at a time, exact K/V inside its window, compressed elsewhere."""
    group = q.shape[0] // k.shape[0]
    out = torch.zeros_like(q)
    for head in range(q.shape[0]):
        for row, p in enumerate(positions.tolist()):
            keys = torch.stack([k[head // group, j] if (j < sinks or p - j < recent) else k_hat[head // group, j]
                                for j in range(p + 1)])
            values = torch.stack([v[head // group, j] if (j < sinks or p - j < recent) else v_hat[head // group, j]
                                  for j in range(p + 1)])
            weights = torch.softmax(keys @ q[head, row] * scaling, dim=0)
            out[head, row] = weights @ values
    return out


@settings(max_examples=15, deadline=None)
@given(tokens=st.integers(2, 12), sinks=st.integers(0, 3), recent=st.integers(0, 4), stride=st.integers(1, 3))
def test_causal_attention_matches_per_query_loop(tokens, sinks, recent, stride):
    generator = torch.Generator().manual_seed(tokens * 31 + sinks * 7 + recent)
    k, v, k_hat, v_hat = (torch.randn(2, tokens, 8, generator=generator, dtype=torch.float64) for _ in range(4))
    positions = torch.arange(0, tokens, stride)
    q = torch.randn(4, positions.shape[0], 8, generator=generator, dtype=torch.float64)
    got = causal_attention(q, k, v, 0.3, positions, k_hat, v_hat, exact_window_mask(positions, tokens, sinks, recent))
    torch.testing.assert_close(got, loop_attention(q, k, v, k_hat, v_hat, 0.3, positions, sinks, recent))
    plain = causal_attention(q, k, v, 0.3, positions)
    torch.testing.assert_close(plain, loop_attention(q, k, v, k, v, 0.3, positions, 0, 0))


def test_capture_reproduces_the_model_attention():
    model = tiny_llama()
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(0))
    captured = capture_attention(model, ids)
    assert captured.queries.shape == (2, 4, 20, 16) and captured.keys.shape == (2, 2, 20, 16)
    cache = DynamicCache()
    outputs = {}
    module = attention_modules(model)[1]

    def keep_output(_module, _args, out):
        outputs["attn"] = out[0]

    handle = module.register_forward_hook(keep_output)
    with torch.no_grad():
        model(ids, **cache_kwarg(model, cache), use_cache=True)
    handle.remove()
    torch.testing.assert_close(captured.keys[1], cache.layers[1].keys[0])  # post-RoPE keys, as cached
    torch.testing.assert_close(captured.values[1], cache.layers[1].values[0])
    positions = torch.arange(20)
    attn = causal_attention(captured.queries[1], captured.keys[1], captured.values[1], captured.scaling, positions)
    with torch.no_grad():
        recomputed = module.o_proj(attn.transpose(0, 1).reshape(1, 20, -1))
    torch.testing.assert_close(recomputed, outputs["attn"], rtol=1e-4, atol=1e-5)


def _random_capture(tokens=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return CapturedAttention(torch.randn(2, 4, tokens, 16, generator=generator),
                             torch.randn(2, 2, tokens, 16, generator=generator),
                             torch.randn(2, 2, tokens, 16, generator=generator), 0.25)


def test_cosine_is_one_for_fp_and_improves_with_bits_and_window():
    captured = _random_capture()
    positions = torch.arange(32)
    assert evaluate_method(CodecSpec("fp"), captured, positions)["cosine"] == pytest.approx(1.0, abs=1e-6)
    cosines = [evaluate_method(CodecSpec("int", bits=b), captured, positions)["cosine"] for b in (2, 4, 8)]
    assert cosines[0] < cosines[1] < cosines[2] <= 1.0 + 1e-6
    codec = IntCodec(16, 2)
    k_hat, v_hat = codec.roundtrip(captured.keys), codec.roundtrip(captured.values)
    no_window = output_cosine(captured, k_hat, v_hat, positions).mean()
    window = output_cosine(captured, k_hat, v_hat, positions, sink_tokens=2, recent_tokens=8).mean()
    full = output_cosine(captured, k_hat, v_hat, positions, sink_tokens=0, recent_tokens=32).mean()
    assert no_window < window < 1.0 and float(full) == pytest.approx(1.0, abs=1e-6)
    row = evaluate_method(CodecSpec("int", bits=4), captured, positions)
    assert row["compression_ratio"] == pytest.approx(32 / IntCodec(16, 4).code_size)


def test_calibrated_rvq_per_head_improves_with_stages():
    captured, calibration = _random_capture(tokens=64, seed=0), _random_capture(tokens=64, seed=1)
    bank = CalibrationBank(calibration)
    positions = torch.arange(64)
    rows = [evaluate_method(CodecSpec("rvq", stages=s, n=8), captured, positions, bank=bank) for s in (1, 3)]
    assert rows[0]["code_bytes_per_vector"] == 1 and rows[1]["code_bytes_per_vector"] == 2  # 3 and 9 bits
    assert rows[0]["cosine"] < rows[1]["cosine"] < 1.0
    assert bank.codec("key", CodecSpec("rvq", stages=3, n=8), 1, 1) is bank.codec("key", CodecSpec("rvq", stages=3, n=8), 1, 1)


def test_rows_name_the_cache_as_the_speed_rows_do():
    """A row carries `cache` (the spec string of --caches) and `label` (the human name), as `eval speed`'s."""
    row = evaluate_method(parse_codec_spec("int:b=4"), _random_capture(), torch.arange(4))
    assert row["cache"] == "int:b=4" and row["label"] == parse_codec_spec("int:b=4").label(16)
    assert not set(row) & {"method", "spec"}


def test_frontier_logic():
    rows = [{"cache": "a", "label": "a", "family": "fibquant", "compression_ratio": 4.0, "cosine": 0.99},
            {"cache": "b", "label": "b", "family": "fibquant", "compression_ratio": 8.0, "cosine": 0.95},
            {"cache": "c", "label": "c", "family": "fibquant", "compression_ratio": 6.0, "cosine": 0.90},
            {"cache": "t", "label": "t", "family": "turboquant", "compression_ratio": 7.0, "cosine": 0.93},
            {"cache": "i", "label": "i", "family": "int", "compression_ratio": 3.0, "cosine": 0.995}]
    assert [r["label"] for r in pareto_front(rows[:3])] == ["a", "b"]
    checks = {c["cache"]: c for c in compare_frontiers(rows)["matched_ratio_checks"]}
    assert checks["t"]["fibquant_best_at_ratio"] == 0.95 and checks["t"]["fibquant_above"]
    assert checks["i"]["fibquant_best_at_ratio"] == 0.99 and not checks["i"]["fibquant_above"]


def test_method_specs_and_bad_input():
    assert parse_codec_spec("fibquant:k=64,n=4096") == CodecSpec("fibquant", k=64, n=4096)
    assert parse_codec_spec("turboquant:b=3").spec == "turboquant:b=3"
    assert parse_codec_spec("lowrank:r=8").label() == "low-rank r=8"
    assert parse_codec_spec("rvq:s=2,n=256") == CodecSpec("rvq", stages=2, n=256)
    assert parse_codec_spec("rvq:s=2,n=256").calibrated
    with pytest.raises(ValueError, match="needs s="):
        parse_codec_spec("rvq:n=256")
    with pytest.raises(ValueError, match="unknown method family"):
        parse_codec_spec("pq:b=2")
    with pytest.raises(ValueError, match="bad method parameter"):
        parse_codec_spec("int:bits=4")
    with pytest.raises(ValueError, match="needs r="):
        parse_codec_spec("lowrank")
    with pytest.raises(ValueError, match="must differ"):
        FidelityConfig(text="emma", calibration_text="emma")
    with pytest.raises(ValueError, match="covers the whole"):
        FidelityConfig(tokens=32, sink_tokens=4, recent_tokens=28)
    with pytest.raises(ValueError, match="needs a calibration"):
        evaluate_method(CodecSpec("lowrank", rank=2), _random_capture(), torch.arange(4))
    with pytest.raises(ValueError, match="one sequence"):
        capture_attention(tiny_llama(), torch.zeros(2, 5, dtype=torch.long))


@pytest.mark.model
def test_fidelity_on_real_model_short(request):
    model, tokenizer = real_model(request)
    methods = [CodecSpec("fp"), CodecSpec("int", bits=8), CodecSpec("int", bits=2), CodecSpec("lowrank", rank=8)]
    result = run_fidelity(model, tokenizer, methods, FidelityConfig(tokens=96, layers=(0, 15)), progress=False)
    cosine = {r["cache"]: r["cosine"] for r in result["rows"]}
    assert cosine["fp"] == pytest.approx(1.0, abs=1e-5)
    assert cosine["int:b=8"] > 0.999 and cosine["int:b=2"] < cosine["int:b=8"]
    assert 0.0 < cosine["lowrank:r=8"] < 1.0
    assert result["layers"] == [0, 15] and result["text"] == "emma"


def test_reconstruct_with_centring_is_mean_shifted_round_trip():
    from fibquant.codecs.fibquant import FibQuantCodec
    from fibquant.eval.fidelity import reconstruct

    generator = torch.Generator().manual_seed(3)
    states = torch.randn(2, 3, 40, 64, generator=generator) + 5.0 * torch.randn(2, 3, 1, 64, generator=generator)
    codec = FibQuantCodec(64, 4, 256)
    centred = reconstruct(states, lambda layer, head: codec, shared=True, centre_from=4)
    mean = states[:, :, 4:].mean(dim=2, keepdim=True)
    torch.testing.assert_close(centred, codec.roundtrip(states - mean) + mean)
    plain = reconstruct(states, lambda layer, head: codec, shared=True)
    assert ((centred - states) ** 2).sum() < 0.5 * ((plain - states) ** 2).sum()


def _fidelity_payload(sinks: int, recent: int) -> dict:
    rows = [{"cache": m, "label": m, "family": f, "compression_ratio": r, "cosine": c, "bits_per_coordinate": 16 / r,
             "code_bytes_per_vector": 128 / r, "cosine_worst_layer": c - 0.01}
            for m, f, r, c in (("fp", "fp", 1.0, 1.0), ("a", "fibquant", 4.0, 0.99), ("b", "fibquant", 8.0, 0.95),
                               ("t", "turboquant", 7.0, 0.93), ("i", "int", 3.0, 0.995))]
    payload = {"model": "toy", "text": "emma", "calibration_text": "persuasion", "tokens": 32, "offset": 0,
               "layers": [0], "query_positions": "0..31 step 1",
               "exact_window": {"sink_tokens": sinks, "recent_tokens": recent}, "rows": rows,
               "skipped": ["quanto:b=2 (optimum-quanto is not installed)"]}
    payload["targets"] = compare_frontiers(rows)
    return payload


def test_fidelity_report_names_the_window_and_judges_each_matched_ratio(tmp_path, capsys):
    import json
    from pathlib import Path

    from fibquant.eval.fidelity import EXPERIMENT, fidelity_targets

    payload = _fidelity_payload(2, 4)
    assert [(t["target"], t["met"]) for t in fidelity_targets(payload)] == [
        ("FibQuant best attention cosine at >= 5x", None), ("FibQuant best attention cosine at >= 34x", None),
        ("FibQuant above t at 7.00x", True), ("FibQuant above i at 3.00x", False)]
    paths = EXPERIMENT.report(payload, tmp_path)
    assert Path(paths["json"]).name == "attention_fidelity_window2+4.json"
    assert json.loads(Path(paths["json"]).read_text()) == payload
    assert Path(paths["png"]).name == "attention_fidelity_window2+4.png" and Path(paths["png"]).stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "exact window per query: 2 sinks + 4 recent" in out and "skipped: quanto:b=2" in out
    assert out.index("\na ") < out.index("\nb ") < out.index("\nfp ") < out.index("\ni ") < out.index("\nt ")
    assert "[met] FibQuant above t at 7.00x" in out
    assert "[MISSED] FibQuant above i at 3.00x: measured 0.99 (i: 0.9950)" in out
    assert EXPERIMENT.stem_of(_fidelity_payload(0, 0)) == "attention_fidelity"


def test_fidelity_command_runs_the_registered_experiment(monkeypatch):
    from fibquant.cli import build_parser, kv

    calls = []
    monkeypatch.setattr(kv, "run_experiment", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(kv, "apply_threads", lambda args: None)
    args = build_parser().parse_args(["eval", "fidelity", "--tokens", "64", "--layers", "0,15", "--sink-tokens", "2",
                                      "--caches", "fp int:b=4"])
    assert args.func(args) == 0
    (name, config, out), resources = calls[0]
    assert name == "fidelity" and out is None and resources == {"caches": ["fp", "int:b=4"], "build_codebooks": False}
    assert config == FidelityConfig(tokens=64, layers=(0, 15), sink_tokens=2)
