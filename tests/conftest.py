"""Session-wide fixtures shared by the test modules, and the settings of a parallel run.

`make test` runs the suite with pytest-xdist over up to four worker processes (`-n auto`); a plain
`pytest` still runs it in one process. Under xdist (a worker has PYTEST_XDIST_WORKER set):
- each worker gets an equal share of the cores as torch threads (two workers with two threads each
  on two cores oversubscribe every small kernel); the tests that exercise the threaded paths set
  their own thread counts (torch.set_num_threads(2) and back);
- the tests that load the real model (`model` marker, the longest ones) run first, so that no worker
  is still in a 40 s test when the other has emptied the queue (the order within each group is kept).

Triton's interpreter: triton picks interpreter vs compiler when `triton.language` is first imported,
and in a whole-suite process something imports it long before tests/kv/attention/test_coded_triton.py
is collected (transformers.cache_utils imports hqq, which imports torch._dynamo, which imports
triton), so that module used to skip itself in every full run. Without CUDA the kernels module is
therefore imported here, before any test module, with TRITON_INTERPRET=1 set for that import alone
(as the test module itself does when it runs alone); nothing else in the suite launches Triton kernels.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from unittest import mock

import pytest


def _xdist_workers() -> int:
    """The number of xdist workers when this process is one of them, else 0."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return 0
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def _import_interpreted_triton_kernels() -> None:
    import torch

    if torch.cuda.is_available() or "triton" in sys.modules or importlib.util.find_spec("triton") is None:
        return
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):  # for this import alone
        try:
            import fibquant.kv.attention.triton_kernels  # noqa: F401
        except Exception:  # a broken triton install: test_coded_triton.py says so when it is collected
            pass


def pytest_configure(config):
    workers = _xdist_workers()
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    if workers or not getattr(config.option, "numprocesses", None):  # not the xdist controller: it runs no test
        _import_interpreted_triton_kernels()


def pytest_collection_modifyitems(config, items):
    if _xdist_workers():
        items.sort(key=lambda item: item.get_closest_marker("model") is None)  # stable: model tests first


@pytest.fixture(scope="session")
def model_and_tokenizer():
    """The real default model (SmolLM2-135M-Instruct GGUF) and tokenizer, loaded once per session
    (once per worker under xdist: the first load of a fresh cache root writes the dense copy, and
    two workers doing so at once is safe, tests/kv/test_model_copy.py).

    Tests using it must be marked `@pytest.mark.model`. Skipped, with the install command, when
    the model package is absent.
    """
    from fibquant.kv.model import load_model

    try:
        return load_model()
    except ValueError as exc:  # the default model package is not installed
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def goal_step_wikihow():
    """The examples of BIG-bench's goal_step_wikihow task from the bigbench 1.0.0 sdist, downloaded once
    into the user cache. Skipped, with the loader's message, when the sdist cannot be downloaded: its
    only source is PyPI, and bigbench 1.0.0 is no longer listed there (only 0.0.1, without the tasks)."""
    from fibquant.data.bigbench import TaskUnavailableError, load_bigbench_task

    try:
        return load_bigbench_task("goal_step_wikihow")
    except TaskUnavailableError as exc:
        pytest.skip(f"BIG-bench goal_step_wikihow is unavailable: {exc}")
