"""The plugin as operators run it: `vllm serve` (vLLM's OpenAI-compatible server) on 127.0.0.1 with
FIBQUANT_VLLM_CACHE set, asked over HTTP by a plain client and by the `openai` client; its log line,
its KV budget; a bad spec stopping it before the model loads. Each server is bounded in time and
stopped by its PID. Needs vLLM's `vllm` command (`make test-vllm`); skipped without it.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fibquant.integrations.vllm import ENV_VAR, VllmCacheConfig
from fibquant.integrations.vllm.budget import split_budget

VLLM = Path(sys.executable).parent / "vllm"
needs_server = pytest.mark.skipif(not VLLM.exists(), reason="vLLM's `vllm` command is not installed (run `make test-vllm`)")
START_S = 600  # a cold start on a busy 2-core machine: imports, weights, numba kernels loaded
BUDGET = 2 ** 28
PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want " \
         "of a wife. However little known the feelings or views of such a man may be on his first entering a " \
         "neighbourhood, this truth is so well fixed in the minds of the surrounding families"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(model_dir: str, port: int, *extra: str) -> list[str]:
    return [str(VLLM), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--max-model-len", "2048", "--enforce-eager", "--max-num-seqs", "16",
            "--kv-cache-memory-bytes", str(BUDGET), *extra]


def server_env(spec: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, "VLLM_CPU_KVCACHE_SPACE")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    if spec:
        env[ENV_VAR] = spec
    return env


@contextlib.contextmanager
def serving(model_dir: str, spec: str | None, log: Path, *extra: str):
    """A server on a free port of 127.0.0.1 until the block ends (then SIGTERM to its PID, SIGKILL after
    60 s); yields (base URL, the process). Fails with the log's tail when it exits or is not up in START_S."""
    port = _free_port()
    with open(log, "w") as out:
        process = subprocess.Popen(server_command(model_dir, port, *extra), stdout=out, stderr=subprocess.STDOUT,
                                   env=server_env(spec), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited with {process.returncode}:\n{_tail(log)}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/v1/models", timeout=5):
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not up in {START_S} s:\n{_tail(log)}")
            time.sleep(2)
        yield url, process
    finally:
        stop(process)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it was started in a session of its own: its engine core
    and workers too), SIGKILL after 60 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def post(url: str, path: str, body: dict, timeout: float = 300) -> dict:
    """What `curl -s URL/PATH -H 'Content-Type: application/json' -d BODY` does."""
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from fibquant.integrations.hf_export import export_hf

    return str(export_hf(tmp_path_factory.mktemp("smollm2-hf")))


@needs_server
@pytest.mark.model
def test_vllm_serve_answers_http_and_openai_clients_and_counts_the_window(model_dir, tmp_path):
    openai = pytest.importorskip("openai")
    log = tmp_path / "server.log"
    with serving(model_dir, "fibquant:b=4", log) as (url, _):
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
    assert split.describe() in text, _tail(log)
    reported = re.search(r"KV cache size: ([\d,]+) tokens", text)
    assert reported and int(reported.group(1).replace(",", "")) == split.tokens


@needs_server
def test_a_bad_rate_stops_the_server_before_the_model_loads(tmp_path):
    """No model directory is even needed: the plugin refuses the spec while vLLM parses its arguments."""
    done = subprocess.run(server_command(str(tmp_path / "no-model"), _free_port()), capture_output=True, text=True,
                          env=server_env("fibquant:b=99"), timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: {ENV_VAR}='fibquant:b=99': "), done.stderr[-3000:]
    assert "Loading weights" not in done.stdout + done.stderr
