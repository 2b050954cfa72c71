"""Old module names kept for one release: each is a stub whose attributes come from the new module.

    # fibquant/eval/methods.py
    from fibquant._moved import forward
    __getattr__, __dir__ = forward(__name__, "fibquant.codecs.registry")

The first attribute read warns (DeprecationWarning, naming the new module) and imports it.
"""
from __future__ import annotations

import importlib
import warnings

MOVED: dict[str, str] = {}  # old module -> new module, every stub registers itself


def forward(old: str, new: str):
    """(`__getattr__`, `__dir__`) for the stub module `old`, reading names from `new`."""
    MOVED[old] = new

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        warnings.warn(f"{old} moved to {new}; the old name is removed in the next release",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)

    def __dir__():
        return sorted(n for n in dir(importlib.import_module(new)) if not n.startswith("_"))
    return __getattr__, __dir__
