"""The plugin as operators run it: `vllm serve` (vLLM's OpenAI-compatible server) on 127.0.0.1 with
FIBQUANT_VLLM_CACHE set, asked over HTTP by a plain client and by the `openai` client; its log line,
its KV budget; a bad spec stopping it before the model loads. Each server is bounded in time and
stopped by its PID. Needs vLLM's `vllm` command (`make test-vllm`); skipped without it.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from fibquant.integrations.vllm import ENV_VAR, VllmCacheConfig
from fibquant.integrations.vllm.budget import split_budget
from fibquant.integrations.vllm.server import ServerSettings, free_port, log_tail, post, serving, vllm_command

needs_server = pytest.mark.skipif(not vllm_command().exists(),
                                  reason="vLLM's `vllm` command is not installed (run `make test-vllm`)")
BUDGET = 2 ** 28
PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want " \
         "of a wife. However little known the feelings or views of such a man may be on his first entering a " \
         "neighbourhood, this truth is so well fixed in the minds of the surrounding families"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from fibquant.integrations.hf_export import export_hf

    return str(export_hf(tmp_path_factory.mktemp("smollm2-hf")))


@needs_server
@pytest.mark.model
def test_vllm_serve_answers_http_and_openai_clients_and_counts_the_window(model_dir, tmp_path):
    openai = pytest.importorskip("openai")
    log = tmp_path / "server.log"
    with serving(ServerSettings(model_dir, "fibquant:b=4", kv_cache_bytes=BUDGET), log) as url:
        completion = post(url, "/v1/completions", {"model": model_dir, "prompt": PROMPT, "max_tokens": 12,
                                                   "temperature": 0})
        assert completion["choices"][0]["text"].strip() and completion["usage"]["completion_tokens"] == 12
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        chat = client.chat.completions.create(model=model_dir, messages=[{"role": "user", "content": "Name a colour."}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].message.content.strip()
        assert [model.id for model in client.models.list()] == [model_dir]
    text = log.read_text(errors="replace")
    # the budget given on the command line: window + pages, the tokens vLLM reports are the pages'
    config = VllmCacheConfig.parse("fibquant:b=4")
    split = split_budget(config, BUDGET, 64, 3, 30, sequences=16, prefix_caching=True, block_size=128)
    assert split.describe() in text, log_tail(log)
    reported = re.search(r"KV cache size: ([\d,]+) tokens", text)
    assert reported and int(reported.group(1).replace(",", "")) == split.tokens


@needs_server
def test_a_bad_rate_stops_the_server_before_the_model_loads(tmp_path):
    """No model directory is even needed: the plugin refuses the spec while vLLM parses its arguments."""
    settings = ServerSettings(str(tmp_path / "no-model"), "fibquant:b=99")
    done = subprocess.run(settings.command(free_port()), capture_output=True, text=True, env=settings.environment(),
                          timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: {ENV_VAR}='fibquant:b=99': "), done.stderr[-3000:]
    assert "Loading weights" not in done.stdout + done.stderr
