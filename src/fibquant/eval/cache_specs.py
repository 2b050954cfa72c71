"""Deprecated name of `fibquant.kv.specs` (kept for one release)."""
from fibquant._moved import forward

__getattr__, __dir__ = forward(__name__, "fibquant.kv.specs")
