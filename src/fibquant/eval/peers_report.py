"""Deprecated name of `fibquant.eval.peers` (kept for one release)."""
from fibquant._moved import forward

__getattr__, __dir__ = forward(__name__, "fibquant.eval.peers")
