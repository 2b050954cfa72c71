"""Memory measurement for benchmarks: peak process RSS or peak CUDA allocation while a block
runs. The bytes a cache holds are counted by `fibquant.kv.accounting`.
"""
from __future__ import annotations

import ctypes
import gc
import os
import sys
import threading
from typing import Optional


def _page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4096


def rss_reader():
    """(a function returning the process RSS in bytes, its name): /proc/self/statm, else psutil."""
    if os.path.exists("/proc/self/statm"):
        page = _page_size()

        def read_statm() -> int:
            with open("/proc/self/statm", "rb") as handle:
                return int(handle.read().split()[1]) * page
        return read_statm, "/proc/self/statm"
    try:
        import psutil

        process = psutil.Process()
        return (lambda: process.memory_info().rss), "psutil"
    except ImportError:
        import resource

        # Last resort: the lifetime peak (kB on Linux, bytes on macOS); deltas are then lower bounds.
        scale = 1 if sys.platform == "darwin" else 1024
        return (lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale), "getrusage maxrss"


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter VmHWM (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _read_peak_rss() -> Optional[int]:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def release_free_memory() -> None:
    """gc.collect, then hand free heap pages back to the OS (glibc malloc_trim) so RSS deltas start clean."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Peak resident memory added while the `with` block runs, over the RSS at its start.

    A daemon thread samples the RSS every `interval_s` (torch kernels release the GIL, so it
    runs during the forward passes); on Linux the kernel's own high-water mark (VmHWM, reset
    at entry through /proc/self/clear_refs) is read at exit too, which misses no spike. The
    peak is the larger of the two.
    """

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.read, self.method = rss_reader()
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._hwm = False

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.read())

    def __enter__(self) -> "PeakRSS":
        self._hwm = _reset_peak_rss()
        self.start = self.peak = self.read()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())
        if self._hwm:
            hwm = _read_peak_rss()
            if hwm is not None:
                self.peak = max(self.peak, hwm)

    @property
    def added(self) -> int:
        return max(self.peak - self.start, 0)

    @property
    def description(self) -> str:
        extra = " + kernel VmHWM (reset via /proc/self/clear_refs)" if self._hwm else ""
        return f"RSS sampled every {self.interval_s * 1000:g} ms from {self.method}{extra}"


class PeakCUDA:
    """Peak GPU memory allocated by torch while the `with` block runs, over the amount at its start."""

    def __init__(self, device):
        import torch

        self.device, self.torch = device, torch
        self.start = self.peak = 0

    def __enter__(self) -> "PeakCUDA":
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.reset_peak_memory_stats(self.device)
        self.start = self.torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        self.torch.cuda.synchronize(self.device)
        self.peak = self.torch.cuda.max_memory_allocated(self.device)

    @property
    def added(self) -> int:
        return max(self.peak - self.start, 0)

    @property
    def description(self) -> str:
        return "torch.cuda.max_memory_allocated during the loop minus memory_allocated at its start"


def _synchronize(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
