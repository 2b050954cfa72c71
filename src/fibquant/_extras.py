"""Optional packages of the `eval` extra (experiments, real texts, the bundled default model): imported where
used, with an error naming the extra when missing. The core imports none of them (tests/test_lean_core.py)."""
from __future__ import annotations

import importlib

EVAL_PACKAGES = ("matplotlib", "gguf", "accelerate", "rdata", "zstandard", "pydivsufsort")


def require(module: str, purpose: str):
    """`import module`, or ImportError naming what needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{purpose} needs {module!r}, part of fibquant's 'eval' extra: "
                          "pip install 'fibquant[eval]'") from exc
