"""vLLM's OpenAI-compatible server (`vllm serve`) in a child process, with or without the FibQuant
cache: what the server tests and the server benchmark start, bounded in time and stopped by PID.

    with serving(ServerSettings(model_dir, "fibquant:b=4"), log_path) as url:
        post(url, "/v1/completions", {"model": model_dir, "prompt": "...", "max_tokens": 16})

The server runs in a session of its own, so stopping it (SIGTERM to its process group, SIGKILL after
a grace period) also ends its engine core and workers.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from fibquant.integrations.vllm.config import ENV_VAR


def vllm_command() -> Path:
    """vLLM's `vllm` command beside this interpreter (it may not exist: vLLM not installed)."""
    return Path(sys.executable).parent / "vllm"


@dataclass(frozen=True)
class ServerSettings:
    """`vllm serve MODEL_DIR` on 127.0.0.1 with the KV budget `kv_cache_bytes` (the exact window comes
    out of it with a FibQuant `cache_spec`); `env` adds variables (e.g. NUMBA_CACHE_DIR)."""

    model_dir: str
    cache_spec: str | None = None
    kv_cache_bytes: int = 2 ** 28
    max_model_len: int = 2048
    max_num_seqs: int = 16
    extra_args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)

    def command(self, port: int) -> list[str]:
        return [str(vllm_command()), "serve", self.model_dir, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", "bfloat16", "--max-model-len", str(self.max_model_len), "--enforce-eager",
                "--max-num-seqs", str(self.max_num_seqs), "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
                *self.extra_args]

    def environment(self) -> dict:
        """This process's environment with the switch as given, one OpenMP thread, no hub, and no
        VLLM_CPU_KVCACHE_SPACE (it would override the budget)."""
        env = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, "VLLM_CPU_KVCACHE_SPACE")}
        env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **self.env)
        if self.cache_spec:
            env[ENV_VAR] = self.cache_spec
        return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(log: Path, lines: int = 30) -> str:
    return "\n".join(Path(log).read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def serving(settings: ServerSettings, log: Path, start_timeout: float = 600.0):
    """The server on a free port until the block ends; yields its base URL. RuntimeError with the log's
    tail when it exits or is not answering /v1/models within `start_timeout` seconds."""
    port = free_port()
    with open(log, "w") as out:
        process = subprocess.Popen(settings.command(port), stdout=out, stderr=subprocess.STDOUT,
                                   env=settings.environment(), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while not _answers(url):
            if process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {process.returncode}:\n{log_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the vLLM server was not up in {start_timeout:g} s:\n{log_tail(log)}")
            time.sleep(1)
        yield url
    finally:
        stop(process)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5):
            return True
    except OSError:
        return False


def stop(process: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after `grace` seconds."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


def post(url: str, path: str, body: dict, timeout: float = 600.0) -> dict:
    """What `curl -s URL/PATH -H 'Content-Type: application/json' -d BODY` does: the JSON answer."""
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())
