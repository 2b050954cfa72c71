"""Decode attention over paged codes (vLLM's KV pages) on the CPU: one call of the fused numba
kernel of `numba_paged` for a whole batch of one-token steps, each sequence's codes read in place
through its block-table row for exactly its own coded range (no gathered copy, no padding).

`paged_decode_attention` is the fast path; `paged_decode_attention_reference` (gather the codes,
decode them with the codecs, one float softmax) is its spec, and the tests hold the two together.

Per sequence b, the columns attended are

    [exact window (the caller's: sinks and recent tokens, [n] in any order) | coded positions
     [starts[b], stops[b]) of the pages | the new token]

with one softmax over all of them (and a learned sink logit per query head, if given).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from fibquant._numba import numba_available, run_split
from fibquant.codecs.base import Codec
from fibquant.kv.attention.codebook_step import codec_plan, scratch
from fibquant.kv.attention.host_arrays import f32
from fibquant.kv.attention.kernels import _MIN_WORK_PER_THREAD
from fibquant.kv.attention.paged_readers import paged_by_readers
from fibquant.kv.attention.reference import gather_paged_codes
from fibquant.kv.options import DEFAULT_OPTIONS, AttentionOptions

_KERNELS: dict = {}  # (bf16 inputs, bf16 out) -> the compiled kernel
_DUMMY_SINKS = np.zeros(1, dtype=np.float32)
# the kernel's flag bits for decode-then-dot on keys / values (numba_paged.GATHER_KEYS / GATHER_VALUES, not
# imported here: numba_paged's import is kept lazy); `AttentionOptions.gather_decode` chooses them
_GATHER_KEYS, _GATHER_VALUES = 16, 32
_ARANGE = np.arange(0, dtype=np.int64)
_NO_RECORD = np.full(0, -1, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    """0..n-1 as int64 (the exact rows of sequences that hold their own exact parts), kept between calls."""
    global _ARANGE
    if _ARANGE.shape[0] < n:
        _ARANGE = np.arange(max(n, 2 * _ARANGE.shape[0]), dtype=np.int64)
    return _ARANGE[:n]


class PagedPlan(NamedTuple):
    """What `paged_decode_attention` needs of the codecs and head counts, computed once per layer."""
    keys: tuple          # `codebook_step.codec_plan` of the key codec (forward, forward.T, codewords, bits, blocks, mode, ...)
    values: tuple        # the same for the value codec
    key_size: int        # bytes of a key / value code
    value_size: int
    groups: int          # query heads per KV head
    lanes: int           # the kernel's query lanes (4 or 8)
    scalars: tuple       # the kernel's trailing scalar arguments (bits, blocks, modes, lanes)
    sizes: tuple         # `numba_decode.scratch_sizes` of these codecs


def paged_plans(key_codec: Codec, value_codec: Codec, q_heads: int, kv_heads: int) -> PagedPlan | None:
    """The `PagedPlan` when the paged kernel can serve these codecs and head counts (numba present,
    rotated codebooks, G = Hq/Hkv <= 8), else None."""
    if not numba_available() or q_heads % kv_heads:
        return None
    from fibquant.kv.attention.numba_decode import scratch_sizes

    keys, values = codec_plan(key_codec), codec_plan(value_codec)
    groups = q_heads // kv_heads
    if keys is None or values is None or groups > 8 or (groups > 4 and 1 in (keys[5], values[5]) and max(
            keys[3], values[3]) > 25):
        return None
    lanes = 4 if groups <= 4 else 8
    sizes = scratch_sizes(keys[2].shape[0], keys[4], keys[3], keys[5], values[2].shape[0], values[4], values[3],
                          values[5], lanes)
    return PagedPlan(keys, values, key_codec.code_size, value_codec.code_size, groups, lanes,
                     (keys[3], values[3], keys[4], values[4], keys[5], values[5], lanes), sizes)


def _host(tensor: torch.Tensor, bits: bool):
    """The numpy view a kernel reads, keeping the tensor's strides: its bf16 bits as uint16 (`bits`),
    else float32 (a copy only when the tensor is of another dtype)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    return tensor.view(torch.uint16).numpy() if bits else tensor.to(torch.float32).numpy()


def _no_record(n: int) -> np.ndarray:
    """n times -1 (no window record) as int64, kept between calls."""
    global _NO_RECORD
    if _NO_RECORD.shape[0] < n:
        _NO_RECORD = np.full(max(n, 2 * _NO_RECORD.shape[0]), -1, dtype=np.int64)
    return _NO_RECORD[:n]


def _c_part(array: np.ndarray) -> tuple[np.ndarray, int]:
    """(a C-contiguous array the kernel reads, the columns n to read) for an exact / new part [R, H, n, D]:
    the array itself when C-contiguous; the C array it is the first n columns of (the window slabs'
    `[:, :, :n]`, an in-place view, no copy) when its strides say so; else a C copy."""
    count = array.shape[2]
    if array.flags.c_contiguous:
        return array, count
    item = array.itemsize
    s0, s1, s2, s3 = array.strides
    if s3 == item and s2 == array.shape[3] * item and s2 > 0 and s1 % s2 == 0 and s1 // s2 >= count \
            and s0 == array.shape[1] * s1:
        full = np.lib.stride_tricks.as_strided(array, (array.shape[0], array.shape[1], s1 // s2, array.shape[3]),
                                               array.strides)  # writeable: numba types readonly apart
        return full, count
    return np.ascontiguousarray(array), count


def paged_decode_attention(query: torch.Tensor, pages: torch.Tensor, tables: torch.Tensor, starts: list[int],
                           stops: list[int], key_codec: Codec, value_codec: Codec, exact_keys: torch.Tensor,
                           exact_values: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor,
                           scaling: float, *, key_offset: int = 0, value_offset: int | None = None,
                           sinks: torch.Tensor | None = None, plans=None, out: torch.Tensor | None = None,
                           exact_rows=None, options: AttentionOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """One decode step of B sequences -> out [B, Hq, Dv] (float32, or `out` filled in place).

    query        [B, Hq, D] (unscaled, unrotated; any float dtype, any strides)
    pages        uint8 [num_blocks, Hkv, block_size, slot_bytes], any strides with each slot's bytes
                 contiguous; a slot holds the key code at `key_offset` and the value code at
                 `value_offset` (default key_offset + key code size)
    tables       int32 [B, max_blocks]: position p of sequence b is slot p % block_size of page tables[b, p // bs]
    starts/stops B ints: sequence b attends to its coded positions [starts[b], stops[b])
    exact_keys/values [B, Hkv, n, D|Dv] (n >= 0: e.g. sinks + recent window), new_keys/values [B, Hkv, 1, D|Dv]
    exact_rows   optional B ints: exact_keys/values are then [R, Hkv, n, D|Dv] (e.g. the caller's window
                 slabs, read in place: no gathered copy) and sequence b reads row exact_rows[b] of them
    sinks        optional [Hq] learned sink logits (a softmax column with no value)
    plans        `paged_plans(...)` for these codecs and heads (computed when None; when the kernel cannot
                 serve them, e.g. FibQuant-E8 or FibQuant-RVQ codes, every sequence goes through its codecs'
                 readers: `paged_readers.paged_by_readers`)
    out          optional float32 or bfloat16 [B, Hq, Dv], any strides (e.g. a view of the layer's output)
    options      `AttentionOptions`: its `gather_decode` picks decode-then-dot or lookup tables per role

    When the query and the four exact parts are all bfloat16 the kernel reads their bits in place (no
    float32 copies); a bf16 `out` gets the float32 result rounded to nearest even, as `.to(bfloat16)`.
    """
    if query.ndim != 3 or pages.ndim != 4 or pages.dtype != torch.uint8 or query.device.type != "cpu":
        raise ValueError(f"expected CPU query [B, Hq, D] and uint8 pages [blocks, Hkv, bs, slot], got "
                         f"{tuple(query.shape)} on {query.device}, {pages.dtype} {tuple(pages.shape)}")
    batch, q_heads, dim = query.shape
    kv_heads, block_size = pages.shape[1], pages.shape[2]
    if plans is None:
        plans = paged_plans(key_codec, value_codec, q_heads, kv_heads)
        if plans is None:  # codes the paged kernel does not read: each sequence through its codecs' readers
            return paged_by_readers(query, pages, tables, starts, stops, key_codec, value_codec, exact_keys,
                                    exact_values, new_keys, new_values, scaling, key_offset=key_offset,
                                    value_offset=value_offset, sinks=sinks, out=out, exact_rows=exact_rows,
                                    options=options)
    elif plans.groups * kv_heads != q_heads:
        raise ValueError(f"plans are for {plans.groups} query heads per KV head, not {q_heads} / {kv_heads}")
    keys, values, key_size, value_size = plans.keys, plans.values, plans.key_size, plans.value_size
    value_offset = key_offset + key_size if value_offset is None else value_offset
    if key_offset < 0 or value_offset < 0 or max(key_offset + key_size, value_offset + value_size) > pages.shape[3]:
        raise ValueError(f"codes at bytes {key_offset}+{key_size} / {value_offset}+{value_size} do not fit a slot "
                         f"of {pages.shape[3]} bytes")
    if pages.shape[3] > 1 and pages.stride(3) != 1:
        raise ValueError("pages must hold each slot's bytes contiguously (stride 1 in the last dimension)")
    if tables.ndim != 2 or tables.shape[0] != batch:
        raise ValueError(f"tables must be [B={batch}, max_blocks], got {tuple(tables.shape)}")
    if len(starts) != batch or len(stops) != batch:
        raise ValueError(f"starts and stops need {batch} entries, got {len(starts)} and {len(stops)}")
    capacity = tables.shape[1] * block_size
    if batch and (min(starts) < 0 or max(stops) > capacity):
        raise ValueError(f"a coded range [start, stop) lies outside the {capacity} positions of a table row")
    longest = max([0, *(stop - start for start, stop in zip(starts, stops))])
    value_dim = value_codec.dim
    parts = (exact_keys, exact_values, new_keys, new_values)
    slab = batch if exact_rows is None else exact_keys.shape[0]  # rows of the exact parts
    if exact_rows is None:
        rows_np = _arange(batch)
    else:
        rows_np = np.ascontiguousarray(exact_rows, dtype=np.int64)
        if rows_np.shape != (batch,) or (batch and (rows_np.min() < 0 or rows_np.max() >= slab)):
            raise ValueError(f"exact_rows must hold {batch} rows in [0, {slab}), got {exact_rows}")
    for name, tensor, width, first in zip(("exact_keys", "exact_values", "new_keys", "new_values"), parts,
                                          (dim, value_dim, dim, value_dim), (slab, slab, batch, batch)):
        if tensor.ndim != 4 or tensor.shape[0] != first or tensor.shape[1] != kv_heads or tensor.shape[3] != width:
            raise ValueError(f"{name} must be [{first}, Hkv={kv_heads}, n, {width}], got {tuple(tensor.shape)}")
    if exact_keys.shape[2] != exact_values.shape[2] or new_keys.shape[2] != new_values.shape[2]:
        raise ValueError("exact / new keys and values must hold the same number of tokens")
    if out is None:
        out = torch.empty(batch, q_heads, value_dim, dtype=torch.float32)
    elif out.shape != (batch, q_heads, value_dim) or out.dtype not in (torch.float32, torch.bfloat16) \
            or out.device.type != "cpu":
        raise ValueError(f"out must be a CPU float32 or bfloat16 [B={batch}, Hq={q_heads}, {value_dim}] tensor, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    bits_in = query.dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in parts)
    bits_out = out.dtype == torch.bfloat16
    flags, sinks_np = 0, _DUMMY_SINKS
    if sinks is not None:
        if sinks.numel() != q_heads:
            raise ValueError(f"sinks must hold {q_heads} logits, got {tuple(sinks.shape)}")
        sinks_np, flags = f32(sinks.reshape(-1)), 8
    if tables.dtype != torch.int32 or (tables.shape[1] > 1 and tables.stride(1) != 1):
        tables = tables.to(torch.int32).contiguous()
    (exact_k, count), (exact_v, _), (new_k, _), (new_v, _) = (_c_part(_host(t, bits_in)) for t in parts)
    bad = run_paged_kernel(paged_kernel(bits_in, bits_out), plans, _host(query, bits_in), scaling, pages.numpy(),
                           tables.numpy(), np.array(starts, dtype=np.int64), np.array(stops, dtype=np.int64),
                           key_offset, value_offset, exact_k, exact_v, rows_np, new_k, new_v, _host(out, bits_out),
                           longest, sinks_np, flags, exact_count=count, options=options)
    if bad:
        raise ValueError(f"paged codes hold {bad} invalid index(es) or block id(s) outside the pages")
    return out


def paged_kernel(bits_in: bool, bits_out: bool):
    """The compiled paged kernel for bf16-bits (True) or float32 (False) inputs / output, kept per combination."""
    kernel = _KERNELS.get((bits_in, bits_out))
    if kernel is None:
        from fibquant.kv.attention.numba_paged import compile_paged_kernel
        kernel = _KERNELS[bits_in, bits_out] = compile_paged_kernel(*("uint16" if bits else "float32"
                                                                    for bits in (bits_in, bits_out)))
    return kernel


def run_paged_kernel(kernel, plans: PagedPlan, query, scaling: float, pages, tables, starts, stops, key_offset: int,
                     value_offset: int, exact_keys, exact_values, exact_rows, new_keys, new_values, out,
                     longest: int, sinks=_DUMMY_SINKS, flags: int = 0, exact_count: int | None = None,
                     record_slots=None, options: AttentionOptions = DEFAULT_OPTIONS) -> int:
    """The paged kernel on numpy arrays exactly as it takes them (`paged_decode_attention` checks and
    converts; a caller that keeps these arrays between calls, e.g. a serving backend per step and
    layer, saves that work): query [B, Hq, D], pages uint8 [blocks, Hkv, bs, slot], tables int32
    [B, max_blocks], starts / stops / exact_rows int64 [B] (C arrays), exact / new parts [R|B, Hkv, n, D]
    (C arrays: `_c_part`), out [B, Hq, Dv] (query, parts and out all float32 or all uint16 bf16 bits,
    matching `kernel`); `longest` = max(stops - starts); `exact_count`: the exact columns read of each
    row (default all n: a caller passing whole window slabs reads only their first `exact_count`);
    `record_slots` int64 [B] (C array; default none): sequence b's new token (one per sequence) is
    written into column record_slots[b] >= 0 of its exact row exact_rows[b] after the kernel has read
    that row (a decode step's window record; the rows must be distinct). Returns the count of invalid
    indices / block ids seen (the caller raises)."""
    keys, values, lanes, sizes = plans.keys, plans.values, plans.lanes, plans.sizes
    batch, kv_heads = query.shape[0], pages.shape[1]
    if exact_count is not None and not 0 <= exact_count <= exact_keys.shape[2]:
        raise ValueError(f"exact_count {exact_count} outside the {exact_keys.shape[2]} exact columns")
    if record_slots is not None and (record_slots.shape != (batch,) or new_keys.shape[2] != 1
                                     or (batch and record_slots.max() >= exact_keys.shape[2])):
        raise ValueError(f"record_slots must be {batch} columns < {exact_keys.shape[2]} for one new token each")
    args = (query, np.float32(scaling), keys[0], values[1], keys[2], values[2], pages, tables,
            starts, stops, int(key_offset), plans.key_size, int(value_offset), plans.value_size, exact_keys,
            exact_values, exact_rows, exact_keys.shape[2] if exact_count is None else int(exact_count),
            _no_record(batch) if record_slots is None else record_slots, new_keys,
            new_values, sinks, out,
            flags | _gather_flags(options), *plans.scalars)
    return run_split(kernel, args, batch * kv_heads, longest * (keys[4] + values[4]), _MIN_WORK_PER_THREAD,
                     "fibquant-paged",  # token arrays: the coded columns, and the exact ones' exps (ibits)
                     per_thread=lambda t: scratch(t, sizes, lanes, max(longest, exact_keys.shape[2] + new_keys.shape[2])))


def _gather_flags(options: AttentionOptions) -> int:
    keys, values = options.gathers
    return (_GATHER_KEYS if keys else 0) | (_GATHER_VALUES if values else 0)


def paged_decode_attention_reference(query: torch.Tensor, pages: torch.Tensor, tables: torch.Tensor,
                                     starts: list[int], stops: list[int], key_codec: Codec, value_codec: Codec,
                                     exact_keys: torch.Tensor, exact_values: torch.Tensor, new_keys: torch.Tensor,
                                     new_values: torch.Tensor, scaling: float, *, key_offset: int = 0,
                                     value_offset: int | None = None, sinks: torch.Tensor | None = None,
                                     exact_rows=None) -> torch.Tensor:
    """The spec of `paged_decode_attention`: gather each sequence's codes, decode them, one float softmax."""
    batch, q_heads, dim = query.shape
    kv_heads = pages.shape[1]
    groups = q_heads // kv_heads
    key_size, value_size = key_codec.code_size, value_codec.code_size
    value_offset = key_offset + key_size if value_offset is None else value_offset
    out = torch.empty(batch, q_heads, value_codec.dim, dtype=torch.float32)
    for b in range(batch):
        key_codes, value_codes = gather_paged_codes(pages[..., key_offset:], tables, b, starts[b], max(stops[b], starts[b]),
                                                    value_offset - key_offset, key_size, value_size)
        coded_keys = key_codec.decode(key_codes[0].contiguous()).to(torch.float32)      # [Hkv, m, D]
        coded_values = value_codec.decode(value_codes[0].contiguous()).to(torch.float32)
        r = b if exact_rows is None else int(exact_rows[b])
        k = torch.cat([exact_keys[r].float(), coded_keys, new_keys[b].float()], dim=1).repeat_interleave(groups, 0)
        v = torch.cat([exact_values[r].float(), coded_values, new_values[b].float()], dim=1).repeat_interleave(groups, 0)
        scores = torch.einsum("hd,hkd->hk", query[b].float(), k) * scaling
        if sinks is not None:
            scores = torch.cat([scores, sinks.reshape(-1, 1).float()], dim=-1)
        weights = scores.softmax(-1)[:, :k.shape[1]]
        out[b] = torch.einsum("hk,hkd->hd", weights, v)
    return out
