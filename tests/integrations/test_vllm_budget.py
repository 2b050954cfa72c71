"""The vLLM plugin's checks before any model loads, and its KV budget split (no vLLM needed: fakes of
vLLM's worker stand in; the server path is tested end to end in test_vllm_server.py)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from fibquant.integrations.vllm import ENV_VAR, VllmCacheConfig, active_config
from fibquant.integrations.vllm.budget import count_window_in_budget, split_budget


@pytest.mark.parametrize("text", ["fibquant:b=99", "fibquant:b=0", "turboquant:b=9", "int:b=0",
                                  "fibquant:b=4/turboquant:b=7"])
def test_a_rate_no_codec_reaches_fails_before_any_model_in_one_line(monkeypatch, text):
    monkeypatch.setenv(ENV_VAR, text)
    config = active_config()  # the spec's syntax is fine: its numbers are not
    with pytest.raises(ValueError) as caught:
        config.check_rates()
    message = str(caught.value)
    assert message.startswith(f"{ENV_VAR}=") and "\n" not in message


def test_a_spec_for_some_head_dimensions_passes_and_names_the_one_it_misses():
    config = VllmCacheConfig.parse("fibquant:k=3,n=4096")  # 3 divides 96 and 192 only
    config.check_rates()
    with pytest.raises(ValueError, match=f"^{ENV_VAR}=.*head dimension 64: .*k=3") as caught:
        config.codecs(64)
    assert "\n" not in str(caught.value)
    assert config.codecs(96)[0].code_size > 0


# SmolLM2: 3 KV heads of 64, 30 layers; bf16 pages 256 bytes per token and head, 4-bit codes 68
SMOL = dict(head_dim=64, kv_heads=3, layers=30)


def test_split_takes_the_window_off_the_budget_and_counts_whole_blocks():
    config = VllmCacheConfig.parse("fibquant:b=4")
    budget = 2 ** 28
    split = split_budget(config, budget, sequences=16, block_size=128, **SMOL)
    window = config.window_bytes(64, 3, 30, 16)
    assert split.window_bytes == window and split.page_bytes == budget - window
    per_token, bf16_per_token = 30 * 3 * 68, 30 * 3 * 256
    assert split.tokens == (budget - window) // (per_token * 128) * 128
    assert split.bf16_tokens == budget // (bf16_per_token * 128) * 128
    line = split.describe()
    assert "fibquant:b=4" in line and "4.25 bits/coordinate" in line and f"{window:,}" in line
    assert f"{split.tokens:,} KV tokens" in line and f"bf16's {split.bf16_tokens:,}" in line and "\n" not in line
    with_snapshots = split_budget(config, budget, sequences=16, prefix_caching=True, **SMOL)
    assert with_snapshots.window_bytes == config.window_bytes(64, 3, 30, 16, prefix_caching=True) > window


def test_split_refuses_a_budget_the_window_does_not_fit():
    config = VllmCacheConfig.parse("fibquant:b=4")
    with pytest.raises(ValueError, match="do not fit the KV budget"):
        split_budget(config, config.window_bytes(64, 3, 30, 16), sequences=16, **SMOL)


def _worker_class():
    """A stand-in for vLLM's worker: what `worker_split` reads, and a budget of 256 MiB."""

    class Worker:
        rank = 0
        model_config = SimpleNamespace(get_head_size=lambda: 64, get_num_kv_heads=lambda parallel: 3,
                                       get_num_layers=lambda parallel: 30, dtype=torch.bfloat16)
        parallel_config = SimpleNamespace()
        scheduler_config = SimpleNamespace(max_num_seqs=16)
        cache_config = SimpleNamespace(enable_prefix_caching=True, block_size=128)

        def determine_available_memory(self) -> int:
            return 2 ** 28

    return Worker


def test_worker_budget_counts_the_window_once_and_logs_the_split(monkeypatch, caplog):
    worker = _worker_class()
    module = type("module", (), {"Worker": worker})
    monkeypatch.setattr("importlib.import_module", lambda name: module)
    config = VllmCacheConfig.parse("fibquant:b=4")
    assert count_window_in_budget(lambda: config, classes=("fake.Worker",)) == ["fake.Worker"]
    assert count_window_in_budget(lambda: config, classes=("fake.Worker",)) == []  # wrapped once per process
    with caplog.at_level(logging.INFO, logger="vllm.fibquant"):
        pages = worker().determine_available_memory()
    expected = split_budget(config, 2 ** 28, sequences=16, prefix_caching=True, block_size=128, **SMOL)
    assert pages == expected.page_bytes == 2 ** 28 - expected.window_bytes
    assert [record.getMessage() for record in caplog.records] == [expected.describe()]


def test_worker_budget_is_untouched_with_the_switch_off(monkeypatch):
    worker = _worker_class()
    module = type("module", (), {"Worker": worker})
    monkeypatch.setattr("importlib.import_module", lambda name: module)
    count_window_in_budget(lambda: None, classes=("fake.Worker",))
    assert worker().determine_available_memory() == 2 ** 28


@pytest.mark.parametrize("ratio", [4, 6, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_ratio_budget_serves_the_best_shipped_code_within_it(ratio, head_dim):
    """FIBQUANT_VLLM_CACHE=ratio=R: per head dimension, the code `choose_code` picks for one full-attention
    layer (the ratio does not depend on the layer and head counts); its pages plus the window fit the ratio."""
    from fibquant.kv.budget import Budget, cache_bytes_per_token, choose_in_layout, head_layout

    config = VllmCacheConfig.parse(f"ratio={ratio}")
    config.check_rates()
    spec = config.spec_for(head_dim)
    layout = head_layout(head_dim)
    assert spec.spec == choose_in_layout(layout, Budget(ratio=ratio), 4, 32, 16)
    key, value = config.codecs(head_dim)
    per_token = cache_bytes_per_token(layout, key.code_size, value.code_size, 4096, 4, 32, 16)
    assert 2 * head_dim * 2 / per_token >= ratio
    split = split_budget(config, 1 << 26, head_dim, 2, 4, 8)
    assert split.spec == spec.spec


@pytest.mark.parametrize("text, message", [("bytes=100", "ratio=R"), ("ratio=40", "no shipped code fits"),
                                           ("ratio=0.5", "ratio must be > 1"), ("ratio=6,keys=coarser", "keys=finer")])
def test_a_bad_budget_fails_before_any_model_in_one_line(monkeypatch, text, message):
    monkeypatch.setenv(ENV_VAR, text)
    with pytest.raises(ValueError, match=message) as caught:
        active_config().check_rates()
    assert str(caught.value).startswith(f"{ENV_VAR}=") and "\n" not in str(caught.value)
