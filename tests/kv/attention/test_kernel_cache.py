"""The attention kernels' disk cache follows every kernel source (kv/attention/jit.py), intrinsics included."""
from __future__ import annotations

import os

import re
from pathlib import Path

import pytest

numba = pytest.importorskip("numba")

import fibquant._numba as fq_numba  # noqa: E402
import fibquant.kv.attention.jit as jit  # noqa: E402

ATTENTION = Path(jit.__file__).parent


def test_every_kernel_file_is_a_source_and_caches_through_kernel_jit():
    files = {p.name for p in ATTENTION.glob("numba_*.py")} | {"intrinsics.py"}
    assert files <= {p.name for p in jit.KERNEL_SOURCES}
    for name in files:
        text = (ATTENTION / name).read_text()
        assert not re.search(r"cache\s*=\s*True", text), f"{name}: a plain numba cache=True ignores the other sources"


def _stamp(kernel) -> object:
    return kernel._cache._impl.locator.get_source_stamp()


def test_intrinsics_change_changes_the_kernel_stamp(monkeypatch):
    """A different intrinsics.py makes the saved kernels stale (checked on the stamp: nothing recompiles)."""
    import fibquant.kv.attention.numba_decode as numba_decode

    assert fq_numba.tracking_cache_supported()
    lazy = lambda: jit.kernel_jit(nogil=True)(numba_decode._decode_step_py)  # no signature: not compiled
    before = _stamp(lazy())
    assert before == _stamp(lazy())
    assert before[-1] == fq_numba.sources_digest(jit.KERNEL_SOURCES)
    digest = fq_numba._file_digest
    monkeypatch.setattr(fq_numba, "_file_digest", lambda path, *st: (
        "edited" if path.endswith("intrinsics.py") else digest(path, *st)))
    after = _stamp(lazy())
    assert after != before and after[0] == before[0]  # numba's own stamp (numba_decode.py) is unchanged


def test_kernel_compiles_caches_and_loads():
    """The real scores kernel through kernel_jit: compiled (or loaded) once, then loaded from disk."""
    from fibquant.kv.attention.kernels import _kernels
    import fibquant.kv.attention.numba_kernels as numba_kernels

    scores, _ = _kernels()
    assert scores.signatures and isinstance(scores._cache, fq_numba._tracking_cache_class(
        fq_numba.sources_digest(jit.KERNEL_SOURCES), os.fspath(fq_numba.kernel_cache_dir())))
    assert list(Path(scores.stats.cache_path).glob("numba_kernels._scores_py-*.nbi"))
    fresh = jit.kernel_jit(numba_kernels.SIGNATURE, nogil=True)(numba_kernels._scores_py)  # as a new process
    assert fresh.stats.cache_hits and not fresh.stats.cache_misses
