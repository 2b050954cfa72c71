"""One-time warnings of attention on codes: each fallback (a codec read by decoding, a Triton config the
kernels cannot serve, an option a path does not implement) warns once per process and key, never silently.

`warned` holds the keys already warned about; a caller that reports fallbacks itself (the model-reach
probe) or a test that checks a warning empties it."""
from __future__ import annotations

import warnings

warned: set[str] = set()


def warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    """A RuntimeWarning with `message`, the first time `key` is seen."""
    if key not in warned:
        warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
