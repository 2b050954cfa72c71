"""Decode attention over paged codes (vLLM's KV pages) on the CPU: one call of the fused numba
kernel of `numba_paged` for a whole batch of one-token steps, each sequence's codes read in place
through its block-table row for exactly its own coded range (no gathered copy, no padding).

`paged_decode_attention` is the fast path; `paged_decode_attention_reference` (gather the codes,
decode them with the codecs, one float softmax) is its spec, and the tests hold the two together.

Per sequence b, the columns attended are

    [exact window (the caller's: sinks and recent tokens, [n] in any order) | coded positions
     [starts[b], stops[b]) of the pages | the new token]

with one softmax over all of them (and a learned sink logit per query head, if given), after
logit soft-capping tanh(s / c) * c of every score when `softcap` is given (Gemma 2): the epilogue
every one-token step shares (`numba_epilogue`, spec `reference.epilogue_weights`).

The kernel takes its arguments as small structures (`numba_paged.PagedRole`, `PagedCodes`,
`ExactParts`, `PagedEpilogue`); `run_paged_kernel` runs it on them as they are, so a caller that
keeps what is fixed for a layer (`paged_roles`, `paged_epilogue`: built once) pays per step only for
building the per-step ones (the vLLM backend's lean decode step).
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
from fibquant.kv.attention.numba_paged import ExactParts, PagedCodes, PagedEpilogue, PagedRole
from fibquant.kv.attention.reference import check_softcap, epilogue_weights, gather_paged_codes
from fibquant.kv.options import DEFAULT_OPTIONS, AttentionOptions

_KERNELS: dict = {}  # (bf16 inputs, bf16 out) -> the compiled kernel
_NO_SINKS = np.zeros(0, dtype=np.float32)
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
    return PagedPlan(keys, values, key_codec.code_size, value_codec.code_size, groups, lanes, sizes)


def paged_roles(plan: PagedPlan, key_offset: int = 0, value_offset: int | None = None,
                options: AttentionOptions = DEFAULT_OPTIONS) -> tuple[PagedRole, PagedRole]:
    """The kernel's `PagedRole` of the keys and of the values: the plan's codebooks, the codes at bytes
    `key_offset` / `value_offset` (default key_offset + key code size) of a slot, decode-then-dot as
    `options.gather_decode` asks. Fixed for a layer: build once, pass every step."""
    value_offset = key_offset + plan.key_size if value_offset is None else value_offset
    gather_keys, gather_values = options.gathers
    keys, values = plan.keys, plan.values
    return (PagedRole(keys[0], keys[2], int(key_offset), plan.key_size, keys[3], keys[4], keys[5], gather_keys),
            PagedRole(values[1], values[2], int(value_offset), plan.value_size, values[3], values[4], values[5],
                      gather_values))


def paged_epilogue(scaling: float, softcap: float | None = None, sinks: torch.Tensor | None = None,
                   q_heads: int | None = None) -> PagedEpilogue:
    """The kernel's `PagedEpilogue`: the score scale, the soft-cap c of tanh(s / c) * c (None: none) and
    the learned sink logits [Hq] (None: none; `q_heads`, when given, is checked against them). Fixed
    for a layer: build once, pass every step."""
    check_softcap(softcap)
    sinks_np = _NO_SINKS
    if sinks is not None:
        if sinks.numel() == 0 or (q_heads is not None and sinks.numel() != q_heads):
            raise ValueError(f"sinks must hold {q_heads if q_heads is not None else 'Hq'} logits, got "
                             f"{tuple(sinks.shape)}")
        sinks_np = f32(sinks.reshape(-1))
    return PagedEpilogue(np.float32(scaling), np.float32(0.0 if softcap is None else softcap), sinks_np)


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
                           softcap: float | None = None, sinks: torch.Tensor | None = None, plans=None,
                           out: torch.Tensor | None = None, exact_rows=None,
                           options: AttentionOptions = DEFAULT_OPTIONS) -> torch.Tensor:
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
    softcap      optional c > 0: every score s (coded and exact) becomes tanh(s / c) * c before the softmax
                 (Gemma 2's logit soft-capping)
    sinks        optional [Hq] learned sink logits (a softmax column with no value)
    plans        `paged_plans(...)` for these codecs and heads (computed when None; when the kernel cannot
                 serve them, e.g. FibQuant-E8 or FibQuant-RVQ codes, every sequence goes through its codecs'
                 readers: `paged_readers.paged_by_readers`)
    out          optional float32 or bfloat16 [B, Hq, Dv], any strides (e.g. a view of the layer's output)
    options      `AttentionOptions`: its `gather_decode` picks decode-then-dot or lookup tables per role

    When the query and the four exact parts are all bfloat16 the kernel reads their bits in place (no
    float32 copies); a bf16 `out` gets the float32 result rounded to nearest even, as `.to(bfloat16)`.
    Every argument is checked here (a caller stepping many times with arrays it keeps calls
    `run_paged_kernel` instead).
    """
    if query.ndim != 3 or pages.ndim != 4 or pages.dtype != torch.uint8 or query.device.type != "cpu":
        raise ValueError(f"expected CPU query [B, Hq, D] and uint8 pages [blocks, Hkv, bs, slot], got "
                         f"{tuple(query.shape)} on {query.device}, {pages.dtype} {tuple(pages.shape)}")
    batch, q_heads, dim = query.shape
    kv_heads = pages.shape[1]
    if plans is None:
        plans = paged_plans(key_codec, value_codec, q_heads, kv_heads)
        if plans is None:  # codes the paged kernel does not read: each sequence through its codecs' readers
            return paged_by_readers(query, pages, tables, starts, stops, key_codec, value_codec, exact_keys,
                                    exact_values, new_keys, new_values, scaling, key_offset=key_offset,
                                    value_offset=value_offset, softcap=softcap, sinks=sinks, out=out,
                                    exact_rows=exact_rows, options=options)
    elif plans.groups * kv_heads != q_heads:
        raise ValueError(f"plans are for {plans.groups} query heads per KV head, not {q_heads} / {kv_heads}")
    keys, values = paged_roles(plans, key_offset, value_offset, options)
    _check_pages(pages, tables, starts, stops, keys, values, batch)
    longest = max([0, *(stop - start for start, stop in zip(starts, stops))])
    parts = (exact_keys, exact_values, new_keys, new_values)
    rows_np = _checked_rows(exact_rows, parts, batch, kv_heads, dim, value_codec.dim)
    out = _checked_out(out, batch, q_heads, value_codec.dim)
    epilogue = paged_epilogue(scaling, softcap, sinks, q_heads)
    bits_in = query.dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in parts)
    bits_out = out.dtype == torch.bfloat16
    if tables.dtype != torch.int32 or (tables.shape[1] > 1 and tables.stride(1) != 1):
        tables = tables.to(torch.int32).contiguous()
    (exact_k, count), (exact_v, _), (new_k, _), (new_v, _) = (_c_part(_host(t, bits_in)) for t in parts)
    codes = PagedCodes(pages.numpy(), tables.numpy(), np.array(starts, dtype=np.int64),
                       np.array(stops, dtype=np.int64))
    exact = ExactParts(exact_k, exact_v, rows_np, count, new_k, new_v, _no_record(batch))
    bad = run_paged_kernel(paged_kernel(bits_in, bits_out), plans, _host(query, bits_in), _host(out, bits_out), keys,
                           values, codes, exact, epilogue, longest)
    if bad:
        raise ValueError(f"paged codes hold {bad} invalid index(es) or block id(s) outside the pages")
    return out


def _check_pages(pages: torch.Tensor, tables: torch.Tensor, starts: list[int], stops: list[int], keys: PagedRole,
                 values: PagedRole, batch: int) -> None:
    """ValueError unless both roles' codes fit a slot of `pages` (bytes contiguous), `tables` is
    [B, max_blocks], starts / stops hold B entries and every coded range [starts[b], stops[b]) lies
    within a table row's positions."""
    if min(keys.offset, values.offset) < 0 or max(keys.offset + keys.size,
                                                  values.offset + values.size) > pages.shape[3]:
        raise ValueError(f"codes at bytes {keys.offset}+{keys.size} / {values.offset}+{values.size} do not fit a "
                         f"slot of {pages.shape[3]} bytes")
    if pages.shape[3] > 1 and pages.stride(3) != 1:
        raise ValueError("pages must hold each slot's bytes contiguously (stride 1 in the last dimension)")
    if tables.ndim != 2 or tables.shape[0] != batch:
        raise ValueError(f"tables must be [B={batch}, max_blocks], got {tuple(tables.shape)}")
    if len(starts) != batch or len(stops) != batch:
        raise ValueError(f"starts and stops need {batch} entries, got {len(starts)} and {len(stops)}")
    capacity = tables.shape[1] * pages.shape[2]
    if batch and (min(starts) < 0 or max(stops) > capacity):
        raise ValueError(f"a coded range [start, stop) lies outside the {capacity} positions of a table row")


def _checked_out(out: torch.Tensor | None, batch: int, q_heads: int, value_dim: int) -> torch.Tensor:
    """`out` checked as `paged_decode_attention` takes it (a new float32 tensor when None)."""
    if out is None:
        return torch.empty(batch, q_heads, value_dim, dtype=torch.float32)
    if out.shape != (batch, q_heads, value_dim) or out.dtype not in (torch.float32, torch.bfloat16) \
            or out.device.type != "cpu":
        raise ValueError(f"out must be a CPU float32 or bfloat16 [B={batch}, Hq={q_heads}, {value_dim}] "
                         f"tensor, got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def _checked_rows(exact_rows, parts: tuple, batch: int, kv_heads: int, dim: int, value_dim: int) -> np.ndarray:
    """`paged_decode_attention`'s exact rows as the kernel takes them (int64 [B]; 0..B-1 when None), with
    the exact / new parts (exact_keys, exact_values, new_keys, new_values) checked against them."""
    exact_keys, exact_values, new_keys, new_values = parts
    slab = batch if exact_rows is None else exact_keys.shape[0]  # rows of the exact parts
    if exact_rows is None:
        rows = _arange(batch)
    else:
        rows = np.ascontiguousarray(exact_rows, dtype=np.int64)
        if rows.shape != (batch,) or (batch and (rows.min() < 0 or rows.max() >= slab)):
            raise ValueError(f"exact_rows must hold {batch} rows in [0, {slab}), got {exact_rows}")
    for name, tensor, width, first in zip(("exact_keys", "exact_values", "new_keys", "new_values"), parts,
                                          (dim, value_dim, dim, value_dim), (slab, slab, batch, batch)):
        if tensor.ndim != 4 or tensor.shape[0] != first or tensor.shape[1] != kv_heads or tensor.shape[3] != width:
            raise ValueError(f"{name} must be [{first}, Hkv={kv_heads}, n, {width}], got {tuple(tensor.shape)}")
    if exact_keys.shape[2] != exact_values.shape[2] or new_keys.shape[2] != new_values.shape[2]:
        raise ValueError("exact / new keys and values must hold the same number of tokens")
    return rows


def paged_kernel(bits_in: bool, bits_out: bool):
    """The compiled paged kernel for bf16-bits (True) or float32 (False) inputs / output, kept per combination."""
    kernel = _KERNELS.get((bits_in, bits_out))
    if kernel is None:
        from fibquant.kv.attention.numba_paged import compile_paged_kernel
        kernel = _KERNELS[bits_in, bits_out] = compile_paged_kernel(*("uint16" if bits else "float32"
                                                                    for bits in (bits_in, bits_out)))
    return kernel


def run_paged_kernel(kernel, plans: PagedPlan, query, out, keys: PagedRole, values: PagedRole, codes: PagedCodes,
                     exact: ExactParts, epilogue: PagedEpilogue, longest: int) -> int:
    """The paged kernel on arrays exactly as it takes them (`paged_decode_attention` checks and
    converts; a caller that keeps these arrays between calls, e.g. a serving backend per step and
    layer, saves that work): query [B, Hq, D] and out [B, Hq, Dv] (numpy, any strides), the roles
    (`paged_roles`), the codes, the exact parts and the epilogue (`paged_epilogue`) as the
    `numba_paged` structures document them; query, exact parts and out all float32 or all uint16 bf16
    bits, matching `kernel`; `longest` = max(stops - starts). The kernel itself checks what its reads
    and writes rely on (ValueError; `numba_paged._check_call`). Returns the count of invalid indices /
    block ids seen (the caller raises)."""
    lanes, sizes = plans.lanes, plans.sizes
    columns = max(longest, exact.count + exact.new_keys.shape[2])  # the coded columns, and the exact ones' exps
    args = (query, out, tuple(keys), tuple(values), tuple(codes), tuple(exact), tuple(epilogue))
    return run_split(kernel, args, query.shape[0] * codes.pages.shape[1], longest * (keys.blocks + values.blocks),
                     _MIN_WORK_PER_THREAD, "fibquant-paged",
                     per_thread=lambda t: ((*scratch(t, sizes, lanes, columns), lanes),))


def paged_decode_attention_reference(query: torch.Tensor, pages: torch.Tensor, tables: torch.Tensor,
                                     starts: list[int], stops: list[int], key_codec: Codec, value_codec: Codec,
                                     exact_keys: torch.Tensor, exact_values: torch.Tensor, new_keys: torch.Tensor,
                                     new_values: torch.Tensor, scaling: float, *, key_offset: int = 0,
                                     value_offset: int | None = None, softcap: float | None = None,
                                     sinks: torch.Tensor | None = None, exact_rows=None) -> torch.Tensor:
    """The spec of `paged_decode_attention`: gather each sequence's codes, decode them, the shared
    epilogue's weights in float (`reference.epilogue_weights`: soft-cap, one softmax with the sinks)."""
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
        weights = epilogue_weights(scores[:, None], softcap=softcap, sinks=sinks)[:, 0]
        out[b] = torch.einsum("hk,hkd->hd", weights, v)
    return out
