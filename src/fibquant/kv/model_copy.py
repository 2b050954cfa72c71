"""A dense safetensors copy of a GGUF model under the cache root, so that only the first load parses it.

Why: transformers reads a GGUF file three times (config, tokenizer, weights) through the pure-Python
`gguf` reader, and maps tensor names once per tensor: loading the 100 MB default model took 20 s on
a quiet 2-core machine and 50-80 s under load (2026-12-03; cProfile: `_get_field_parts` and
`get_tensor_name_map` are ~80 % of it), and every test process, CLI call and `make demo` paid it. The
copy loads in ~1 s and is the same model: every parameter and buffer, the logits and the token ids
are bitwise equal to the GGUF load in float32 and bfloat16 (tests/kv/test_model_copy.py).

Layout: `<cache root>/models/<gguf stem>-<sha256[:16] of the file>-transformers-<version>/` holding
`save_pretrained`'s files plus `complete.json` (written last: a copy without it is ignored and
rebuilt). The transformers version is in the name because another version may dequantise or name
tensors differently. `FIBQUANT_MODEL_COPY=0` turns the copy off (the GGUF is read every time).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

from fibquant.paths import cache_root

COPY_ENV = "FIBQUANT_MODEL_COPY"
MARKER = "complete.json"


def _sha256(gguf: Path) -> str:
    """The file's sha256, computed once per process for a given (path, size, mtime)."""
    stat = gguf.stat()
    return _file_sha256(str(gguf.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=None)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def copy_dir(gguf: Path) -> Optional[Path]:
    """Where the dense copy of `gguf` lives (it may not exist yet), or None when copies are off."""
    if os.environ.get(COPY_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    import transformers

    return cache_root() / "models" / f"{gguf.stem}-{_sha256(gguf)[:16]}-transformers-{transformers.__version__}"


def _marker(gguf: Path) -> dict:
    import transformers

    return {"gguf": gguf.name, "sha256": _sha256(gguf), "transformers": transformers.__version__}


def is_complete(directory: Path, gguf: Path) -> bool:
    """Whether `directory` holds a finished copy of `gguf` (its marker names the same file and version)."""
    try:
        return json.loads((directory / MARKER).read_text()) == _marker(gguf)
    except (OSError, ValueError):
        return False


# A staging folder untouched this long belongs to a writer that was killed (a copy takes seconds to a
# few minutes to write); younger ones may be another process's copy in progress.
STALE_STAGING_S = 6 * 3600


def _remove_stale_staging(directory: Path) -> None:
    """Remove the `.<name>-*` staging folders of `directory` that killed writers left (~0.5 GB each)."""
    now = time.time()
    for leftover in directory.parent.glob(f".{directory.name}-*"):
        try:
            if leftover.is_dir() and now - leftover.stat().st_mtime > STALE_STAGING_S:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:  # removed by another process meanwhile
            pass


def write_copy(directory: Path, gguf: Path, model, tokenizer) -> bool:
    """Save the dense `model` and `tokenizer` of `gguf` as `directory`, atomically (a temporary folder
    renamed into place; a process that loses the race keeps the winner's copy). Returns whether a
    complete copy is there afterwards; an unwritable cache root or a full disk only warns."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_staging(directory)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
        try:
            model.save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
            (staging / MARKER).write_text(json.dumps(_marker(gguf)))
            if directory.exists() and not is_complete(directory, gguf):
                shutil.rmtree(directory, ignore_errors=True)  # a broken copy: replaced
            try:
                os.rename(staging, directory)
            except OSError:
                if not is_complete(directory, gguf):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return True
    except OSError as exc:
        warnings.warn(f"could not write the dense model copy {directory} ({exc}); the GGUF is read each time",
                      stacklevel=3)
        return False


def discard(directory: Path, reason: str) -> None:
    """Remove a copy that failed to load, saying why (it is rebuilt from the GGUF)."""
    warnings.warn(f"the dense model copy {directory} failed to load ({reason}); rebuilding it from the GGUF",
                  stacklevel=3)
    shutil.rmtree(directory, ignore_errors=True)
