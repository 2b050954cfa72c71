"""Where fibquant reads and writes on disk: the cache root and the results directory.

- cache root: `$FIBQUANT_CACHE_DIR`, else `~/.cache/fibquant`. Codebooks live under
  `<root>/codebooks`, texts under `<root>/text`, BIG-bench tasks under `<root>/bigbench`.
- results directory: an explicit `--out`, else `$FIBQUANT_RESULTS_DIR`, else `./results`.
  Every experiment writes its JSON, table and PNG there.

Both are read from the environment at call time (never cached), so tests can redirect them.
"""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "FIBQUANT_CACHE_DIR"
RESULTS_ENV = "FIBQUANT_RESULTS_DIR"
DEFAULT_RESULTS = "results"


def cache_root() -> Path:
    """`$FIBQUANT_CACHE_DIR` (user-expanded), else `~/.cache/fibquant`. Not created."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fibquant"


def results_root(path: str | os.PathLike | None = None) -> Path:
    """`path`, else `$FIBQUANT_RESULTS_DIR`, else `./results` (user-expanded, not created)."""
    return Path(path or os.environ.get(RESULTS_ENV) or DEFAULT_RESULTS).expanduser()


def results_dir(path: str | os.PathLike | None = None, *sub: str) -> Path:
    """`results_root(path) / sub...`, created (with parents) if missing."""
    folder = results_root(path).joinpath(*sub)
    folder.mkdir(parents=True, exist_ok=True)
    return folder
