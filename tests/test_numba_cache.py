"""`fibquant._numba.njit_tracking`: numba's disk cache keyed also on the files a kernel depends on."""
from __future__ import annotations

import importlib.util
import itertools
import sys

import pytest

numba = pytest.importorskip("numba")

from fibquant import _numba  # noqa: E402

KERNEL = "helper = None  # bound by the test: a jitted function of dep.py\n\n\ndef twice_py(x):\n    return 2 * helper(x)\n"
_names = itertools.count()


def _load(path):
    """A fresh module object for `path` (as a new process would import it)."""
    spec = importlib.util.spec_from_file_location(f"_fq_numba_cache_{next(_names)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernel(tmp_path, decorate):
    """kern.twice_py with `helper` = dep.helper_py jitted (what the kernels do with intrinsics)."""
    kern, dep = _load(tmp_path / "kern.py"), _load(tmp_path / "dep.py")
    kern.helper = numba.njit(dep.helper_py)
    return decorate(kern.twice_py)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "kern.py").write_text(KERNEL)
    (tmp_path / "dep.py").write_text("def helper_py(x):\n    return x + 1\n")
    return tmp_path


def test_dependency_change_recompiles(files):
    assert _numba.tracking_cache_supported(), f"numba {numba.__version__}: its caching API moved; njit_tracking " \
                                              "falls back to plain cache=True (stale kernels possible)"
    track = _numba.njit_tracking("int64(int64)", depends_on=[files / "dep.py"], cache_dir=files / "cache")
    first = _kernel(files, track)
    assert first(5) == 12 and first.stats.cache_misses and not first.stats.cache_hits
    assert list((files / "cache").glob("*/kern.twice_py-*.nbi")), "nothing was written to the disk cache"
    assert not (files / "__pycache__").exists(), "the kernel cache was written beside the sources"
    again = _kernel(files, track)  # a new dispatcher, as in a new process: loads from disk
    assert again(5) == 12 and again.stats.cache_hits and not again.stats.cache_misses

    plain = lambda f: numba.njit("int64(int64)", cache=True)(f)
    assert _kernel(files, plain)(5) == 12  # numba's own cache=True, saved with numba's stamp

    (files / "dep.py").write_text("def helper_py(x):\n    return x + 3\n")  # kern.py itself unchanged
    # The problem njit_tracking solves: numba's own cache keys on kern.py only and loads the old code.
    assert _kernel(files, plain)(5) == 12, "numba's cache=True now tracks callees: njit_tracking may be unnecessary"
    changed = _kernel(files, track)
    assert changed(5) == 16 and changed.stats.cache_misses and not changed.stats.cache_hits
    reloaded = _kernel(files, track)
    assert reloaded(5) == 16 and reloaded.stats.cache_hits


def test_lazy_dispatcher_compiles_on_first_call(files):
    lazy = _kernel(files, _numba.njit_tracking(depends_on=[files / "dep.py"], cache_dir=files / "cache"))
    assert lazy(2) == 6 and lazy.stats.cache_misses
    assert _kernel(files, _numba.njit_tracking(depends_on=[files / "dep.py"], cache_dir=files / "cache"))(2) == 6


def test_default_cache_dir_is_per_numba_version_outside_the_sources(files, monkeypatch):
    """Two environments with different numba versions (the project's venv, vLLM's) each keep their own
    entries: a directory per numba version and interpreter under the user cache, none beside the sources."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(files / "user-cache"))
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(numba.config, "CACHE_DIR", "")
    root = _numba.kernel_cache_dir()
    assert root.parent == files / "user-cache" / "fibquant"
    assert numba.__version__ in root.name and sys.implementation.cache_tag in root.name
    kernel = _kernel(files, _numba.njit_cached("int64(int64)"))
    assert kernel(1) == 4 and kernel.stats.cache_misses
    assert list(root.glob("*/kern.twice_py-*.nbi")) and not (files / "__pycache__").exists()
    again = _kernel(files, _numba.njit_cached("int64(int64)"))
    assert again(1) == 4 and again.stats.cache_hits and not again.stats.cache_misses


def test_numba_cache_dir_set_by_the_user_wins(files, monkeypatch):
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(files / "theirs"))
    kernel = _kernel(files, _numba.njit_cached("int64(int64)", cache_dir=files / "ours"))
    assert kernel(1) == 4
    assert list((files / "theirs").glob("*/kern.twice_py-*.nbi")) and not (files / "ours").exists()


def test_unwritable_cache_dir_falls_back_to_numba_locators(files):
    blocker = files / "not-a-dir"
    blocker.write_text("a file where the cache directory would be")
    kernel = _kernel(files, _numba.njit_cached("int64(int64)", cache_dir=blocker / "cache"))
    assert kernel(1) == 4
    assert list((files / "__pycache__").glob("kern.twice_py-*.nbi"))  # numba's own: beside the sources


def test_stamp_follows_dependency_content(files):
    dep = files / "dep.py"
    stamp = lambda: _kernel(files, _numba.njit_tracking(depends_on=[dep], cache_dir=files / "cache")
                            )._cache._impl.locator.get_source_stamp()
    before = stamp()
    dep.write_text(dep.read_text() + "# a comment changes the bytes\n")
    assert stamp() != before
    assert _numba.sources_digest([dep]) != _numba.sources_digest([files / "kern.py"])


def test_falls_back_to_plain_cache(files, monkeypatch):
    """With numba's private API not as expected: numba's own cache=True, still compiled and cached."""
    monkeypatch.setattr(_numba, "_TRACKING_OK", False)
    kernel = _kernel(files, _numba.njit_tracking("int64(int64)", depends_on=[files / "dep.py"], cache_dir=files / "c"))
    assert kernel(1) == 4
    assert type(kernel._cache) is numba.core.caching.FunctionCache


def test_missing_dependency_is_an_error(files):
    with pytest.raises(FileNotFoundError):
        _numba.sources_digest([files / "absent.py"])
