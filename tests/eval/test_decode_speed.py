"""fibquant.eval.decode_speed: structure of the payload, table and files; ratio consistency."""
from __future__ import annotations

import json
import re
import math
import statistics

import pytest
import torch

from _kv_helpers import real_model, tiny_llama
import fibquant.eval.decode_speed as decode_speed
from fibquant.eval.decode_speed import EXPERIMENT, context_tokens, reserved_positions, run_decode_speed, write_decode_speed
from fibquant.eval.decode_speed.config import DEFAULT_CACHES, DecodeSpeedConfig, our_families, parse_cache_name
from fibquant.eval.decode_speed.report import TTFT_TARGET, decode_speed_targets, format_decode_speed
from fibquant.eval.memory import PeakRSS
from fibquant.eval.report import get_experiment
from fibquant.kv.accounting import quantized_cache_nbytes


def _tiny():
    # head_dim 64, so the shipped d = 64 FibQuant codebooks apply.
    return tiny_llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)


def _check_payload(payload: dict, caches: list[str], tokens: int, decode_tokens: int) -> None:
    rows = {r["cache"]: r for r in payload["rows"]}
    assert list(rows) == caches
    dyn = rows["fp"]
    assert dyn["kind"] == "dynamic" and dyn["conversion_s"] == 0.0
    assert dyn["dynamic_fp16_bytes"] * 2 == dyn["cache_bytes"]  # float32 model: fp16 is half
    for row in rows.values():
        assert row["tokens"] == tokens and row["cache_tokens_after"] == tokens + decode_tokens
        assert len(row["step_ms"]) == decode_tokens == len(row["generated_tokens"])
        assert row["decode_ms_median"] > 0 and row["cache_bytes"] > 0 and row["peak_rss_added_bytes"] >= 0
        assert row["decode_cpu_ms_median"] > 0 and len(row["step_cpu_ms"]) == decode_tokens
        assert math.isclose(row["prefill_s"], row["dynamic_prefill_s"] + row["conversion_s"])
        assert row["dynamic_prefill_s"] == dyn["dynamic_prefill_s"]  # one shared prefill
        assert math.isclose(row["decode_vs_dynamic"], row["decode_ms_median"] / dyn["decode_ms_median"])
        assert math.isclose(row["bytes_vs_dynamic"], row["cache_bytes"] / dyn["cache_bytes"])
        assert math.isclose(row["bytes_vs_fp16_dynamic"], 2 * row["bytes_vs_dynamic"])
        assert math.isclose(row["compression_vs_fp16_dynamic"] * row["bytes_vs_fp16_dynamic"], 1.0)
        assert 0.0 <= row["tokens_match_dynamic"] <= 1.0
        # paired: the median over the rounds of this cache's step / DynamicCache's step of the same round
        assert math.isclose(row["decode_paired_vs_dynamic"],
                            statistics.median(a / b for a, b in zip(row["step_ms"], dyn["step_ms"])))
        assert math.isclose(row["decode_cpu_paired_vs_dynamic"],
                            statistics.median(a / b for a, b in zip(row["step_cpu_ms"], dyn["step_cpu_ms"])))
    assert dyn["decode_vs_dynamic"] == 1.0 and dyn["tokens_match_dynamic"] == 1.0
    assert dyn["first_step_logits_max_abs_diff"] == 0.0
    assert json.loads(json.dumps(payload, default=float))["rows"][0]["cache"] == "fp"
    for key in ("model", "text", "threads", "versions", "protocol", "config", "skipped"):
        assert key in payload
    assert {"torch", "transformers"} <= set(payload["versions"])


def test_cache_names_parse_and_reject():
    assert parse_cache_name("fibquant:b=4").attention == "codes"
    old = parse_cache_name("turboquant:b=2@decode")
    assert (old.name, old.kind, old.family, old.bits, old.attention) == (
        "turboquant:b=2@decode", "compressed", "turboquant", 2, "decode")
    quantized = parse_cache_name("hqq:b=2")
    assert (quantized.kind, quantized.family, quantized.bits, quantized.name) == ("quantized", "hqq", 2, "hqq:b=2")
    assert parse_cache_name("fp").kind == "dynamic"
    for name in DEFAULT_CACHES:
        parse_cache_name(name)
    for bad in ("fibquant", "quanto:b=3", "hqq:b=4@decode", "fp@decode", "fp4", "lowrank:r=4", "fibquant:b=9",
                "fibquant:b=4/fibquant:b=2", "kakeya-e8:q=2", "fibquant:b=2@centre", "fibquant:k=4,n=256"):
        with pytest.raises(ValueError):
            parse_cache_name(bad)


@pytest.mark.parametrize("old", ["dynamic", "fibquant4", "int4-old", "quanto2"])
def test_earlier_cache_names_are_refused(old):
    with pytest.raises(ValueError):
        parse_cache_name(old)


def test_our_caches_come_from_the_codec_registry():
    # Registered codecs built from a bit count are ours; calibrated ones and the fp reference are not.
    assert our_families() == ("fibquant", "fibrvq", "e8shell", "turboquant", "int")
    spec = parse_cache_name("int:b=4@decode")
    assert (spec.kind, spec.family, spec.bits, spec.attention) == ("compressed", "int", 4, "decode")
    assert spec.label == "INT 4b (decode)" and parse_cache_name("fibquant:b=4").label == "FibQuant 4b (codes)"
    assert spec.codec_spec().spec == "int:b=4"
    with pytest.raises(ValueError, match="not one of our compressed caches"):
        parse_cache_name("hqq:b=4").codec_spec()
    with pytest.raises(ValueError):
        DecodeSpeedConfig(decode_tokens=0)


def test_contexts_leave_room_for_decoded_tokens():
    model = _tiny()  # max_position_embeddings 512
    assert context_tokens(model, (64, 512), 8) == [(64, 64), (512, 504)]


def test_prefill_parts_alone_keep_the_requested_context():
    # Only the decode part steps past the prompt: a TTFT-only run measures the context asked for.
    model = _tiny()  # max_position_embeddings 512
    ttft = DecodeSpeedConfig(contexts=(512,), parts=("ttft", "chunked"), decode_tokens=4, memory_steps=3)
    both = DecodeSpeedConfig(contexts=(512,), parts=("ttft", "decode"), decode_tokens=4, memory_steps=3)
    assert reserved_positions(ttft) == 0 and reserved_positions(both) == 7
    assert context_tokens(model, ttft.contexts, reserved_positions(ttft)) == [(512, 512)]
    assert context_tokens(model, both.contexts, reserved_positions(both)) == [(512, 505)]
    ids = torch.randint(0, model.config.vocab_size, (512,), generator=torch.Generator().manual_seed(3))
    config = DecodeSpeedConfig(contexts=(512,), caches=("fp",), parts=("ttft",), warmup=False)
    payload = run_decode_speed(config, (model, None), token_ids=ids, progress=False)
    assert payload["contexts"] == [{"context": 512, "tokens": 512}]
    assert payload["rows"][0]["tokens"] == payload["rows"][0]["ttft_cache_tokens"] == 512


def test_a_peer_failing_in_the_memory_steps_is_reported_and_the_run_goes_on(monkeypatch):
    pytest.importorskip("optimum.quanto", reason="transformers' QuantizedCache peer needs optimum-quanto")
    torch.set_num_threads(1)
    model = _tiny()
    ids = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(4))
    measure = decode_speed._decode_memory
    measured = []

    def break_the_peer(decoding, model, config):
        # the peer's cache raises inside the model's forward from now on (after its timed steps)
        if type(decoding.cache).__name__ == "QuantizedCache":
            def update(*args, **kwargs):
                raise RuntimeError("quantizer exploded")
            decoding.cache.update = update
        measured.append(type(decoding.cache).__name__)
        return measure(decoding, model, config)

    monkeypatch.setattr(decode_speed, "_decode_memory", break_the_peer)
    config = DecodeSpeedConfig(contexts=(64,), decode_tokens=2, memory_steps=2, parts=("decode",), warmup=False,
                               caches=("fp", "quanto:b=4", "fibquant:b=4"))
    payload = run_decode_speed(config, (model, None), token_ids=ids, progress=False)
    assert measured == ["DynamicCache", "QuantizedCache", "CompressedCache"]  # the caches after it still ran
    assert [r["cache"] for r in payload["rows"]] == ["fp", "fibquant:b=4"]
    assert all(r["peak_rss_added_bytes"] >= 0 and r["decode_ms_median"] > 0 for r in payload["rows"])
    (skip,) = payload["skipped"]
    assert skip["cache"] == "quanto:b=4"
    assert "memory steps" in skip["reason"] and "RuntimeError: quantizer exploded" in skip["reason"]
    assert "skipped quanto:b=4" in EXPERIMENT.table_text(payload)


def test_peak_rss_sees_an_allocation():
    import mmap

    import numpy as np

    # A fresh anonymous mapping: new pages for certain (a torch tensor may reuse heap pages an
    # earlier test left resident, which raises no RSS; it failed so once in a fresh-clone run).
    with PeakRSS(0.001) as monitor:
        region = mmap.mmap(-1, 64 * 1024 * 1024)
        pages = np.frombuffer(region, dtype=np.uint8)
        pages[:] = 1  # touch every page
        del pages
        region.close()
    assert monitor.added >= 32 * 1024 * 1024


def test_decode_speed_on_a_tiny_model(tmp_path, capsys):
    torch.set_num_threads(1)
    model = _tiny()
    ids = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    config = DecodeSpeedConfig(contexts=(64,), decode_tokens=2, caches=("fp", "fibquant:b=4", "fibquant:b=4@decode"))
    payload = run_decode_speed(config, (model, None), token_ids=ids, progress=False)
    assert not payload["skipped"], payload["skipped"]
    _check_payload(payload, ["fp", "fibquant:b=4", "fibquant:b=4@decode"], 64, 2)
    rows = {r["cache"]: r for r in payload["rows"]}
    for name in ("fibquant:b=4", "fibquant:b=4@decode"):
        row = rows[name]
        assert row["cache_used_bytes"] <= row["cache_bytes"] < rows["fp"]["cache_bytes"]
        assert row["conversion_s"] > 0
    assert rows["fibquant:b=4"]["attention_used"] == "codes" and rows["fibquant:b=4@decode"]["attention_used"] == "decode"
    # The model's attention implementation is restored after the attention-on-codes run.
    assert model.config._attn_implementation != "fibquant"
    for row in rows.values():  # the default parts include both TTFTs next to the shared-prefill figures
        assert row["ttft_s"] > 0 and row["chunked_s"] > 0 and row["ttft_cache_tokens"] == 64
    table = format_decode_speed(payload)
    assert "fibquant:b=4@decode" in table and "decode ms/tok" in table and "fp16 DynamicCache MiB" in table
    assert "TTFT s" in table and "chunked TTFT s" in table and "timed on 1 torch thread" in table
    assert "interleaved" in table and "paired x dyn" in table
    paths = write_decode_speed(payload, tmp_path)
    saved = json.loads(open(paths["json"]).read())
    assert [r["cache"] for r in saved["rows"]] == ["fp", "fibquant:b=4", "fibquant:b=4@decode"]
    assert (tmp_path / "decode_speed.png").stat().st_size > 0
    # The registered experiment prints the same header and table, and writes the same files.
    EXPERIMENT.report(payload, tmp_path / "report")
    assert table in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["decode_speed.json", "decode_speed.png"]
    assert get_experiment("decode-speed") is EXPERIMENT


def test_ttft_parts_alone_on_a_tiny_model(tmp_path):
    torch.set_num_threads(2)
    model = _tiny()
    ids = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(2))
    config = DecodeSpeedConfig(contexts=(64,), caches=("fp", "fibquant:b=4"), parts=("ttft", "chunked"),
                               chunk_tokens=24, prefill_repeats=2)
    payload = run_decode_speed(config, (model, None), token_ids=ids, progress=False)
    assert torch.get_num_threads() == 2 and payload["threads"] == 1  # ran on config.threads, then restored
    rows = {r["cache"]: r for r in payload["rows"]}
    assert list(rows) == ["fp", "fibquant:b=4"] and payload["parts"] == ["ttft", "chunked"]
    dyn = rows["fp"]
    for row in rows.values():
        assert "decode_ms_median" not in row and "prefill_s" not in row  # the decode part did not run
        assert len(row["ttft_s_all"]) == 2 and all(t > 0 for t in row["ttft_s_all"])
        assert row["ttft_s"] == statistics.median(row["ttft_s_all"])
        assert len(row["ttft_chunk_s"]) == 1 and row["ttft_chunk_s"][0] <= row["ttft_s_all"][-1]
        # chunks of 24, 24 and 16 tokens, each a timed forward inside the total
        assert len(row["chunked_chunk_s"]) == 3 and all(t > 0 for t in row["chunked_chunk_s"])
        assert sum(row["chunked_chunk_s"]) <= row["chunked_s_all"][-1]
        assert row["ttft_cache_tokens"] == row["chunked_cache_tokens"] == 64
        assert row["ttft_peak_added_bytes"] >= 0 and row["ttft_cache_bytes"] > 0
        for part in ("ttft", "chunked"):
            assert math.isclose(row[f"{part}_vs_dynamic"], row[f"{part}_s"] / dyn[f"{part}_s"])
            assert 0 < row[f"{part}_cpu_s"] and len(row[f"{part}_cpu_s_all"]) == 2
            assert math.isclose(row[f"{part}_cpu_vs_dynamic"], row[f"{part}_cpu_s"] / dyn[f"{part}_cpu_s"])
            # the repeats run in rounds (one prefill per cache each): paired ratio per round, median
            assert math.isclose(row[f"{part}_cpu_paired_vs_dynamic"], statistics.median(
                a / b for a, b in zip(row[f"{part}_cpu_s_all"], dyn[f"{part}_cpu_s_all"])))
    assert rows["fibquant:b=4"]["ttft_attention_used"] == "codes"
    assert rows["fibquant:b=4"]["ttft_cache_bytes"] < dyn["ttft_cache_bytes"]
    # A one-shot prefill is exact for the prompt itself, so the first token is DynamicCache's.
    assert rows["fibquant:b=4"]["ttft_token_matches_dynamic"] is True
    assert model.config._attn_implementation != "fibquant"
    table = EXPERIMENT.table_text(payload)
    assert "TTFT s" in table and "chunked TTFT s" in table and "CPU x dyn" in table and "decode ms/tok" not in table
    paths = EXPERIMENT.report(payload, tmp_path, echo=False)
    assert json.loads(open(paths["json"]).read())["rows"][1]["ttft_s"] == rows["fibquant:b=4"]["ttft_s"]
    assert (tmp_path / "decode_speed.png").stat().st_size > 0
    # Targets judge the measured ratios at the contexts (none here: 64 tokens).
    assert decode_speed_targets(payload) == []
    moved = dict(payload, rows=[dict(r, context=2048) for r in payload["rows"]])
    judged = {t["target"]: t for t in decode_speed_targets(moved)}
    mine = judged[f"fibquant:b=4 one-shot TTFT <= {TTFT_TARGET}x DynamicCache at 2048"]
    assert mine["measured"] == rows["fibquant:b=4"]["ttft_vs_dynamic"]
    assert mine["met"] == (rows["fibquant:b=4"]["ttft_vs_dynamic"] <= TTFT_TARGET)


def test_parts_and_threads_are_checked(capsys):
    from fibquant.cli import main

    with pytest.raises(ValueError, match="parts"):
        DecodeSpeedConfig(parts=("ttft", "prefill"))
    with pytest.raises(ValueError, match="chunk_tokens"):
        DecodeSpeedConfig(chunk_tokens=0)
    assert DecodeSpeedConfig(parts=("TTFT", "ttft")).parts == ("ttft",)
    assert main(["eval", "decode-speed", "--parts", "ttft,bogus", "--threads", "1"]) == 2
    assert "parts must be" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_quantized_cache_from_prefill_and_its_bytes(backend):
    pytest.importorskip("optimum.quanto" if backend == "quanto" else "hqq.core.quantize")
    torch.set_num_threads(1)
    model = _tiny()
    ids = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1))
    config = DecodeSpeedConfig(contexts=(64,), decode_tokens=2, caches=("fp", f"{backend}:b=4"), warmup=False)
    payload = run_decode_speed(config, (model, None), token_ids=ids, progress=False)
    assert not payload["skipped"], payload["skipped"]
    _check_payload(payload, ["fp", f"{backend}:b=4"], 64, 2)
    row = payload["rows"][1]
    # 4-bit codes (32 B per 64-dim vector) + float32 group scale/zero (8 B) for 64 tokens, 2 float residual tokens.
    layers, heads, dim = model.config.num_hidden_layers, model.config.num_key_value_heads, 64
    assert row["bytes_parts"]["residual"] == layers * 2 * heads * 2 * dim * 4
    assert row["bytes_parts"]["quantized"] == layers * 2 * heads * 64 * (32 + 8)


def test_quantized_cache_bytes_counts_storage_once():
    class Layer:
        def __init__(self, t):
            self._quantized_keys = (t, {"scale": t[:1], "zero": torch.zeros(4)})
            self._quantized_values = None
            self.keys = self.values = torch.zeros(2, 8)

    class Cache:
        layers = [Layer(torch.zeros(16, dtype=torch.uint8))]

    parts = quantized_cache_nbytes(Cache())
    assert parts == {"quantized": 16 + 16, "residual": 64, "total": 96}


@pytest.mark.model
def test_decode_speed_on_the_real_model(request, tmp_path):
    torch.set_num_threads(1)
    config = DecodeSpeedConfig(contexts=(128,), decode_tokens=2, caches=("fp", "fibquant:b=2"))
    payload = run_decode_speed(config, real_model(request), progress=False)
    _check_payload(payload, ["fp", "fibquant:b=2"], 128, 2)
    assert payload["text"] == "emma" and "SmolLM2" in payload["model"]
    assert payload["rows"][1]["bytes_vs_fp16_dynamic"] < 1.0  # float32 exact window of 36 of 130 tokens
