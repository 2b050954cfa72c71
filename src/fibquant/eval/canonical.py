"""Deprecated name of `fibquant.eval.canonical_source` (kept for one release)."""
from fibquant._moved import forward

__getattr__, __dir__ = forward(__name__, "fibquant.eval.canonical_source")
