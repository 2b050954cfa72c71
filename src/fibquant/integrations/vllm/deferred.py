"""Deferred code writes of the vLLM backend: decode tokens whose codes nobody reads yet, held raw
and encoded in one batched call every `steps` forwards.

Why it is safe. A decode token of a sequence whose exact window (`window.ExactWindow`) is whole
is read exactly (the new token, then a recent-window column) until it leaves the recent window,
R forwards later; only then does the sequence read it through its page codes. So its code may be
written up to R forwards late, and `steps` <= R. Every other write (a prefill chunk's tokens, the
decodes of a sequence without a whole window) is immediate, and the held writes go first
(`take` before any immediate write): each page slot then sees its writes in the order vLLM made
them, so a freed block that vLLM hands to another sequence never gets a stale code written over
its new one. A sequence without a whole window reads its own codes up to its newest token; it
never has held writes, since its decode tokens are immediate, and a forward holding one flushes
the held writes before its attention.

Why: one encode call per layer and decode step costs far more in per-call overhead (torch and
numpy dispatch, cold caches after the attention kernel) than its search for the few new vectors;
batching `steps` steps divides that overhead by `steps`. The codes written are the same
(`Codec.encode` is row-independent).

Memory, counted against the KV budget with the window (`VllmCacheConfig.window_bytes`): at most
`steps` tokens per live sequence, keys and values in the model dtype.
"""
from __future__ import annotations

import numpy as np
import torch


class DeferredCodes:
    def __init__(self, steps: int) -> None:
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self.steps = steps
        self._held: list[tuple[torch.Tensor, torch.Tensor, np.ndarray]] = []

    def __len__(self) -> int:
        """Forwards held (each one add)."""
        return len(self._held)

    def add(self, keys: torch.Tensor, values: torch.Tensor, slots: np.ndarray) -> bool:
        """Hold one forward's decode tokens: keys / values [N, Hk, D] (copied: vLLM reuses its buffers),
        page slots int64 [N]. Returns True when `steps` forwards are held (the caller takes them)."""
        self._held.append((keys.clone(), values.clone(), np.array(slots, dtype=np.int64), None))
        return len(self._held) >= self.steps

    def add_host(self, keys: np.ndarray, values: np.ndarray, slots: np.ndarray, dtype: torch.dtype,
                 owned: bool = False) -> bool:
        """`add` for keys / values as numpy views [N, Hk, D] of tensors of `dtype` (bf16 as its uint16
        bits), copied here as numpy arrays (a fraction of a torch clone's cost per step; `owned`: the
        caller's own copies, held as they are, never written again) and turned into tensors of `dtype`
        once, when taken; slots int64 [N], owned by the caller and never written."""
        self._held.append((keys, values, slots, dtype) if owned else (keys.copy(), values.copy(), slots, dtype))
        return len(self._held) >= self.steps

    def take(self) -> tuple[torch.Tensor, torch.Tensor, np.ndarray] | None:
        """Every held token, oldest first (keys, values [M, Hk, D], slots [M]), emptying the store; None if empty."""
        if not self._held:
            return None
        held, self._held = self._held, []
        dtype = held[0][3]
        if dtype is not None and all(h[3] is dtype for h in held):  # all numpy (`add_host`): one conversion
            keys, values = (_tensor(np.concatenate([h[i] for h in held]), dtype) for i in (0, 1))
        else:
            keys = torch.cat([h[0] if h[3] is None else _tensor(h[0], h[3]) for h in held])
            values = torch.cat([h[1] if h[3] is None else _tensor(h[1], h[3]) for h in held])
        slots = held[0][2] if len(held) == 1 else np.concatenate([h[2] for h in held])
        if len(held) == 1:
            return keys, values, slots
        # A slot held twice (a finished sequence's last block handed to a growing decode): the newer write wins.
        _, last = np.unique(slots[::-1], return_index=True)
        if len(last) < len(slots):
            keep = torch.from_numpy(np.sort(len(slots) - 1 - last))
            keys, values, slots = keys.index_select(0, keep), values.index_select(0, keep), slots[keep.numpy()]
        return keys, values, slots


def _tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of `dtype` whose host form `array` is (bf16 from its uint16 bits; no copy)."""
    tensor = torch.from_numpy(array)
    return tensor.view(dtype) if tensor.dtype != dtype else tensor
