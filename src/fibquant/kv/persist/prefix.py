"""Prefix reuse: start a prompt from a saved cache that shares its first tokens.

    path, n = find_prefix("caches/", ids)                 # the saved cache sharing the longest prefix
    cache, logits, stats = prefill_with_prefix(model, ids, path)

The saved cache is loaded (`PersistentCache.to_cache`), cut to the shared prefix
(`CompressedCache.crop`: codes stay codes; if the cut falls inside the coded part the exact
recent window is empty until new tokens arrive) and only the remaining prompt tokens are run
through the model. When the prompt extends the saved tokens the result is the cache the
original run would have had after feeding the same remaining tokens in one chunk.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

from fibquant.kv.model import cache_kwarg
from fibquant.kv.persist.store import MANIFEST_FILE, PersistentCache
from fibquant.kv.attention.switch import attention_on_codes


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two int sequences [n], [m]."""
    a, b = torch.as_tensor(a).reshape(-1), torch.as_tensor(b).reshape(-1)
    n = min(a.shape[0], b.shape[0])
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


def find_prefix(root, ids) -> tuple[Optional[Path], int]:
    """(saved cache under `root` whose stored KV shares the longest prefix with `ids`, its length).

    Every subdirectory holding a saved cache is opened lazily (manifest and token ids only);
    hidden ones (a store being built or replaced: `.NAME.tmp-PID`, `.NAME.old-PID`) are skipped.
    (None, 0) when none shares a token."""
    best, best_n = None, 0
    for path in sorted(Path(root).iterdir()):
        if path.name.startswith(".") or not (path / MANIFEST_FILE).is_file():
            continue
        with PersistentCache.open(path) as store:
            stored = store.token_ids()[: store.num_tokens]
        n = common_prefix_length(stored, ids)
        if n > best_n:
            best, best_n = path, n
    return best, best_n


@torch.no_grad()
def prefill_with_prefix(model, ids, path, attention: Optional[str] = None, chunk: Optional[int] = None):
    """Run prompt `ids` [T] (or [1, T]) on top of the saved cache at `path`.

    Returns (cache, logits of the last prompt token [1, vocab], stats) where stats holds
    reused tokens, computed tokens, load_s (open + rebuild) and prefill_s. At least one
    token is always computed (to produce logits); `chunk` feeds the rest in pieces."""
    with attention_on_codes(model):
        ids = torch.as_tensor(ids).reshape(-1)
        if ids.shape[0] == 0:
            raise ValueError("empty prompt")
        start = time.perf_counter()
        with PersistentCache.open(path, model=model) as store:
            stored = store.token_ids()[: store.num_tokens]
            reuse = min(common_prefix_length(stored, ids), ids.shape[0] - 1)
            cache = store.to_cache(model, attention)
        if cache.get_seq_length() > reuse:
            cache.crop(reuse)
        loaded = time.perf_counter()
        rest = ids[reuse:][None]
        step = rest.shape[1] if chunk is None else chunk
        for s in range(0, rest.shape[1], step):
            logits = model(input_ids=rest[:, s:s + step], **cache_kwarg(model, cache), use_cache=True).logits[:, -1]
        done = time.perf_counter()
        stats = {"reused_tokens": reuse, "computed_tokens": int(rest.shape[1]), "load_s": loaded - start,
                 "prefill_s": done - loaded, "ttft_s": done - start}
        return cache, logits, stats
