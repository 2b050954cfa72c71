"""How the CPU attention kernels are compiled: numba with a disk cache keyed on every kernel source.

The kernels of `numba_kernels`, `numba_decode`, `numba_residual` and `numba_paged` inline the
vector intrinsics of `intrinsics` and call jitted helpers bound from each other (`numba_tables`,
`numba_decode`). numba's own disk cache (cache=True) tracks a function's own file only, so after a
change to any of those files a kernel elsewhere could load a stale compiled version. `kernel_jit`
keys every one of them on the contents of all of `KERNEL_SOURCES` (`fibquant._numba.njit_tracking`):
a change to any kernel source recompiles every kernel once (the scores kernel alone: 40 s on the
loaded 2-core machine, 2026-12-03), never a stale one. A new kernel file joins `KERNEL_SOURCES`; a kernel
inlining code from outside this folder keys on that file too (`numba_shells`: codebook/e8shell_tables.py's block
decoder, `njit_tracking(depends_on=...)`).
"""
from __future__ import annotations

from pathlib import Path

from fibquant._numba import njit_tracking

_HERE = Path(__file__).resolve().parent
# The files whose code ends up in a compiled attention kernel (this one included: it decides the key).
KERNEL_SOURCES = tuple(_HERE / name for name in ("intrinsics.py", "numba_tables.py", "numba_kernels.py",
                                                 "numba_decode.py", "numba_residual.py", "numba_paged.py",
                                                 "numba_shells.py", "numba_epilogue.py", "numba_recall.py", "jit.py"))


def kernel_jit(signature=None, **options):
    """`numba.njit(signature, cache=True, **options)`, its disk cache keyed on `KERNEL_SOURCES` too."""
    return njit_tracking(signature, depends_on=KERNEL_SOURCES, **options)
