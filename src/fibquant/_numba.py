"""What the numba CPU paths share: whether numba imports, and splitting a kernel's work over threads.

Used by `fibquant.codebook.fast_search` (nearest-codeword search) and `fibquant.kv.attention.kernels`
(attention on codes); it sits below both so that neither imports the other. numba itself is never
imported here except by `numba_available()`, on its first call.

`run_split(kernel, args, units, work_per_unit, min_work_per_thread, name)` runs
`kernel(*args, start, stop)` over `units` work units: on the calling thread when there is less than
two threads' worth of work (`min_work_per_thread` each) or torch.get_num_threads() is 1, else split
into contiguous ranges over up to torch.get_num_threads() threads of a pool named `name` (one pool
per name, created on first use, grown, never shrunk; the kernels release the GIL). It returns the
sum of the kernel's integer results.

Fork: a pool's worker threads do not exist in a child made by os.fork, so the child drops every
pool (`os.register_at_fork(after_in_child=...)`) and makes a fresh one on its first split.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

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
