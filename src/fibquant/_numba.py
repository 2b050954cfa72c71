"""What the numba CPU paths share: whether numba imports, splitting a kernel's work over threads, and
a disk cache that tracks the files a kernel inlines.

Used by `fibquant.codebook.numba_search` (nearest-codeword search) and `fibquant.kv.attention.kernels`
(attention on codes); it sits below both so that neither imports the other. numba itself is imported
here only by `numba_available()` (on its first call) and by `njit_tracking` (when a kernel is compiled).

`run_split(kernel, args, units, work_per_unit, min_work_per_thread, name)` runs
`kernel(*args, start, stop)` over `units` work units: on the calling thread when there is less than
two threads' worth of work (`min_work_per_thread` each) or torch.get_num_threads() is 1, else split
into contiguous ranges over up to torch.get_num_threads() threads of a pool named `name` (one pool
per name, created on first use, grown, never shrunk; the kernels release the GIL). It returns the
sum of the kernel's integer results.

Fork: a pool's worker threads do not exist in a child made by os.fork, so the child drops every
pool (`os.register_at_fork(after_in_child=...)`) and makes a fresh one on its first split.

`njit_tracking(signature, depends_on=paths, **options)(py_func)` is `numba.njit(signature, cache=True,
**options)` whose disk cache is also keyed on the contents of `depends_on`. numba keys a cached
function on its own source file only (its content hash in numba >= 0.64, mtime and size before),
so a kernel that inlines intrinsics or calls jitted helpers of other files would silently load a
stale compiled version after those files change. Here the cache's source stamp is numba's own
stamp plus a sha256 of the dependency files (`sources_digest`): a different content makes the
saved index stale, and numba compiles and overwrites it. The hook is numba's per-function cache
object (`numba.core.caching.FunctionCache`, its `_impl_class` and the impl's `_locator`), private
API read from numba 0.68; when it is not as expected the kernel falls back to plain `cache=True`
(numba's behaviour: only the function's own file is tracked) and `tracking_cache_supported()` says
False (tests/test_numba_cache.py checks it is True with the installed numba).
"""
from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

_NUMBA_OK: Optional[bool] = None
_POOLS: dict = {}  # name -> (ThreadPoolExecutor, max_workers)
_POOL_LOCK = threading.Lock()


def numba_available() -> bool:
    """Whether numba imports (the numba CPU kernels can run)."""
    global _NUMBA_OK
    if _NUMBA_OK is None:
        try:
            import numba  # noqa: F401
            _NUMBA_OK = True
        except Exception:  # ImportError, or a numba/numpy version clash at import
            _NUMBA_OK = False
    return _NUMBA_OK


def _pool(name: str, threads: int):
    """The thread pool `name` with at least `threads` workers (grown, never shrunk)."""
    with _POOL_LOCK:
        pool, size = _POOLS.get(name, (None, 0))
        if pool is None or size < threads:
            from concurrent.futures import ThreadPoolExecutor
            if pool is not None:
                pool.shutdown(wait=False)
            pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
            _POOLS[name] = (pool, threads)
        return pool


def _forget_pools_after_fork() -> None:
    """In a forked child: the pools' threads are gone (and the lock may have been held), so start afresh."""
    global _POOL_LOCK
    _POOL_LOCK = threading.Lock()
    _POOLS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_after_fork)


def run_split(kernel, args: tuple, units: int, work_per_unit: int, min_work_per_thread: int, name: str,
              per_thread=None) -> int:
    """kernel(*args, start, stop) over `units`, split across up to torch.get_num_threads() threads of pool `name`;
    with `per_thread`, thread t's call is kernel(*args, *per_thread(t), start, stop) (e.g. its own scratch arrays)."""
    threads = min(torch.get_num_threads(), units, units * work_per_unit // min_work_per_thread)
    extra = per_thread or (lambda t: ())
    if threads <= 1:
        return int(kernel(*args, *extra(0), 0, units))
    pool = _pool(name, threads)
    bounds = [units * t // threads for t in range(threads + 1)]
    futures = [pool.submit(kernel, *args, *extra(t), bounds[t], bounds[t + 1]) for t in range(threads)]
    return sum(int(f.result()) for f in futures)


# ------------------------------------------------------------- disk cache tracking dependencies
@functools.lru_cache(maxsize=None)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    """sha256 of a file's bytes (memoised on its path, mtime and size, as numba does for its own stamp)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def sources_digest(paths: Sequence) -> str:
    """One sha256 over the contents of `paths` (in the order given; a file name and its content each)."""
    digest = hashlib.sha256()
    for path in paths:
        path = os.fspath(path)
        st = os.stat(path)
        digest.update(os.path.basename(path).encode())
        digest.update(_file_digest(path, st.st_mtime_ns, st.st_size).encode())
    return digest.hexdigest()


class _StampedLocator:
    """A numba cache locator (the one numba picked: same directory, same file names) whose source
    stamp is (numba's stamp, the dependencies' digest)."""

    def __init__(self, inner, dependencies: str):
        self._inner, self._dependencies = inner, dependencies

    def get_source_stamp(self):
        return (self._inner.get_source_stamp(), "fibquant-dependencies", self._dependencies)

    def __getattr__(self, name):  # get_cache_path, ensure_cache_path, get_disambiguator, ...
        return getattr(self._inner, name)


@functools.lru_cache(maxsize=None)
def _tracking_cache_class(dependencies: str):
    """A numba FunctionCache class whose locator stamps with `dependencies` (a digest)."""
    from numba.core.caching import CompileResultCacheImpl, FunctionCache

    class _Impl(CompileResultCacheImpl):
        def __init__(self, py_func):
            super().__init__(py_func)
            self._locator = _StampedLocator(self._locator, dependencies)

    class TrackingFunctionCache(FunctionCache):
        _impl_class = _Impl

    return TrackingFunctionCache


_TRACKING_OK: Optional[bool] = None


def tracking_cache_supported() -> bool:
    """Whether numba's private caching API is as `njit_tracking` expects (else it falls back to cache=True)."""
    global _TRACKING_OK
    if _TRACKING_OK is None:
        try:
            from numba.core import caching
            from numba.core.dispatcher import Dispatcher

            _TRACKING_OK = (callable(getattr(Dispatcher, "enable_caching", None))
                            and isinstance(getattr(caching.FunctionCache, "_impl_class", None), type)
                            and issubclass(caching.FunctionCache._impl_class, caching.CompileResultCacheImpl)
                            and isinstance(getattr(caching.CacheImpl, "locator", None), property)
                            and callable(getattr(caching, "IndexDataCacheFile", None)))
        except Exception:  # ImportError or an attribute numba renamed
            _TRACKING_OK = False
    return _TRACKING_OK


def njit_tracking(signature=None, *, depends_on: Sequence, **options) -> Callable:
    """A decorator: `numba.njit(signature, cache=True, **options)` whose disk cache is also keyed on
    the contents of the files `depends_on` (see the module docstring); with a signature the function
    is compiled (or loaded from the cache) at once and further compilation disabled, as numba does."""
    import numba

    def wrap(py_func):
        tracked = None
        if tracking_cache_supported():
            try:
                cache = _tracking_cache_class(sources_digest(depends_on))(py_func)
            except Exception:  # no writable cache location, or numba's internals moved: plain cache=True
                cache = None
            if cache is not None:
                tracked = numba.njit(**options)(py_func)
                if not hasattr(tracked, "_cache"):  # NUMBA_DISABLE_JIT: the plain function
                    return tracked
                tracked._cache = cache
        if tracked is None:
            return numba.njit(*(() if signature is None else (signature,)), cache=True, **options)(py_func)
        if signature is not None:
            import contextlib

            from numba.core import typeinfer

            register = getattr(typeinfer, "register_dispatcher", lambda d: contextlib.nullcontext())
            with register(tracked):
                for sig in signature if isinstance(signature, list) else [signature]:
                    tracked.compile(sig)
                tracked.disable_compile()
        return tracked

    return wrap
