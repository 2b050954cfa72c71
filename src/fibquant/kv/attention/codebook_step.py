"""The fused one-token step on the CPU for codes of one codebook per role (FibQuant, TurboQuant:
`codecs.reader.CodebookReader`): one call of `numba_decode`'s kernel per layer and step (same result as
`attend_codes`' torch path to float32 rounding; see kv/attention/numba_decode.py). Registered for
`CodebookReader` in `readers.KERNELS`; the paged vLLM step (`paged`) reuses its plans and scratch.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from fibquant._numba import run_split
from fibquant.codecs.base import Codec
from fibquant.codecs.reader import CodebookReader
from fibquant.kv.attention.host_arrays import f32
from fibquant.kv.attention.kernels import _MIN_WORK_PER_THREAD
from fibquant.kv.attention.numba_epilogue import Epilogue, step_parts
from fibquant.kv.buffer import CodedKV


_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def codec_plan(codec: Codec):
    """(forward, forward.T, codewords as numpy, index_bits, n_blocks, numba mode) of a codec's
    `CodebookReader` on the CPU, built once per codec; None when it has none (or one the kernel cannot serve)."""
    try:
        plan = _PLANS.get(codec)
    except TypeError:  # an unhashable codec: no cache
        plan = None
    if plan is not None:
        return plan or None
    rotated = codec.reader(torch.device("cpu"))
    plan = ()
    if isinstance(rotated, CodebookReader):
        codewords = rotated.codewords.detach().to(torch.float32).contiguous()
        k = codewords.shape[-1]
        forward = rotated.forward.detach().to(torch.float32).contiguous()
        if codewords.ndim == 2 and codec.dim % k == 0 and tuple(forward.shape) == (codec.dim, codec.dim) \
                and (codec.dim // k) * rotated.index_bits <= 8 * (codec.code_size - 2):
            from fibquant.kv.attention.kernels import _numba_mode
            plan = (forward.numpy(), forward.T.contiguous().numpy(), codewords.numpy(), rotated.index_bits,
                    codec.dim // k, _numba_mode(codewords.shape[0], rotated.index_bits), (forward, codewords))
    try:
        _PLANS[codec] = plan
    except TypeError:
        pass
    return plan or None


def codebook_step_plans(query: torch.Tensor, kv: CodedKV):
    """(key plan, value plan, lanes, scratch sizes) when this one-token step can run the fused numba
    kernel (both roles `CodebookReader`s it serves, CPU, numba), else None. The last answer is kept for its
    (key codec, value codec, query groups)."""
    global _KERNEL, _LAST_PLANS
    if query.device.type != "cpu" or not kv.key_codes.shape[-2] or (
            query.requires_grad and torch.is_grad_enabled()):
        return None
    groups = query.shape[1] // kv.new_keys.shape[1]
    last = _LAST_PLANS
    if last is not None and last[0] is kv.key_codec and last[1] is kv.value_codec and last[2] == groups:
        return last[3]
    if _KERNEL is None:
        from fibquant._numba import numba_available
        if not numba_available():
            return None
        from fibquant.kv.attention.numba_decode import compile_decode_kernel
        _KERNEL = compile_decode_kernel()
    keys, values = codec_plan(kv.key_codec), codec_plan(kv.value_codec)
    if keys is None or values is None or groups > 8 or (groups > 4 and 1 in (keys[5], values[5]) and max(
            keys[3], values[3]) > 25):
        plans = None
    else:
        lanes = 4 if groups <= 4 else 8
        shape = (keys[2].shape[0], keys[4], keys[3], keys[5], values[2].shape[0], values[4], values[3], values[5],
                 lanes)
        from fibquant.kv.attention.numba_decode import scratch_sizes
        plans = keys, values, lanes, scratch_sizes(*shape)
    _LAST_PLANS = (kv.key_codec, kv.value_codec, groups, plans)  # holds the codecs: `is` stays meaningful
    return plans


_LAST_PLANS = None
_KERNEL = None
_NO_RECALL = (np.zeros((1, 1), dtype=np.float32), np.zeros((1, 1), dtype=np.float32), 0)  # `RecallRows` of k = 0
_SCRATCH = threading.local()  # per thread: {(slot, sizes, lanes): [table1, lut, hist1, hist, coded, norms, ibits]}


def scratch(slot: int, sizes: tuple, lanes: int, tokens: int) -> list:
    """The fused kernel's scratch arrays for worker `slot`, reused across layers and steps (no
    per-call allocation of its ~100-500 KB of tables); the token arrays grow geometrically."""
    cache = getattr(_SCRATCH, "arrays", None)
    if cache is None:
        cache = _SCRATCH.arrays = {}
    key = (slot, sizes, lanes)
    arrays = cache.get(key)
    if arrays is None:
        arrays = cache[key] = [np.empty(n, dtype=np.float32) for n in sizes] + [
            np.empty((lanes, 0), dtype=np.float32), np.empty(0, dtype=np.float32), np.empty(0, dtype=np.int32)]
    if arrays[5].shape[0] < tokens:
        capacity = max(tokens, 2 * arrays[5].shape[0], 256)
        arrays[4], arrays[5] = np.empty((lanes, capacity), dtype=np.float32), np.empty(capacity, dtype=np.float32)
        arrays[6] = np.empty(capacity, dtype=np.int32)
    return arrays


def attend_codebook_step(query: torch.Tensor, kv: CodedKV, epilogue: Epilogue, plans, cold=None) -> torch.Tensor:
    """`attend_codes` for one query token on the CPU (epilogue: scaling, soft-cap, bias, sinks): one call of
    the fused kernel (same result to
    float32 rounding; see kv/attention/numba_decode.py). Reads `kv.arrays` (numpy views the layer
    keeps) when set, else converts the tensors. cold: the cold store's float32 rows (`recall.cold_rows`)
    for recall, None without."""
    keys, values, lanes, sizes = plans
    batch, q_heads = query.shape[:2]
    codes, exact, step_epilogue = step_parts(kv, epilogue)
    value_dim = values[1].shape[0]
    out_np = np.empty((batch, 1, q_heads, value_dim), dtype=np.float32)  # the [B, T, Hq, Dv] result
    if query.dtype is torch.float32 and not query.requires_grad and query.stride(-1) == 1:
        query_np = query.numpy()[:, :, 0]
        if not query_np.flags.c_contiguous:  # e.g. GPT-2's query, split from a fused qkv, at batch > 1
            query_np = np.ascontiguousarray(query_np)
    else:
        query_np = f32(query[:, :, 0])
    key_codes = codes.key_codes
    recall = _NO_RECALL
    if cold is not None:  # recall: each query head's top-k coded tokens from the cold rows
        recall = (*cold, kv.cold.recall.count(key_codes.shape[2]))
        if recall[2]:
            kv.cold.count_reads(batch * q_heads * recall[2])
    args = (query_np, out_np[:, 0], (keys[0], keys[2], keys[3], keys[4], keys[5]),
            (values[1], values[2], values[3], values[4], values[5]), tuple(codes), tuple(exact), tuple(step_epilogue),
            recall)
    coded = key_codes.shape[2]
    bad = run_split(_KERNEL, args, batch * key_codes.shape[1], coded * (keys[4] + values[4]), _MIN_WORK_PER_THREAD,
                    "fibquant-decode", per_thread=lambda t: ((*scratch(t, sizes, lanes, max(coded, kv.length - coded)), lanes),))
    if bad:
        raise ValueError(f"codes hold {bad} index(es) >= N (index_bits={keys[3]} / {values[3]})")
    out = torch.from_numpy(out_np)
    return out if query.dtype is torch.float32 else out.to(query.dtype)
