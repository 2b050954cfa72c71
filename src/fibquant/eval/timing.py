"""Wall-clock timing helpers shared by the experiments (all on `time.perf_counter`).

    with Stopwatch() as watch: work()        -> watch.seconds
    seconds, result = best_of(fn, repeats)   -> the fastest of `repeats` calls and its result
    median_us(times)                         -> median of a list of seconds, in microseconds
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence


class Stopwatch:
    """Elapsed seconds since creation (or `restart()`); a context manager that stops on exit."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self._start, self._stop = time.perf_counter(), None

    def stop(self) -> float:
        self._stop = time.perf_counter()
        return self.seconds

    @property
    def seconds(self) -> float:
        """Seconds from start to stop (to now while running)."""
        end = self._stop if self._stop is not None else time.perf_counter()
        return end - self._start

    def __enter__(self) -> "Stopwatch":
        self.restart()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call of `fn()`."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def best_of(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """(fastest seconds, result of the last call) over `repeats` >= 1 calls of `fn()`."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    best, result = float("inf"), None
    for _ in range(repeats):
        seconds, result = timed(fn)
        best = min(best, seconds)
    return best, result


def median_us(times: Sequence[float]) -> float:
    """Median of `times` (seconds) in microseconds."""
    return 1e6 * float(statistics.median(times))


def rate(seconds: float, count: int) -> float:
    """count / seconds (items per second); inf for a zero duration."""
    return count / seconds if seconds > 0 else float("inf")
