"""Triton kernels of attention on codes (CUDA; CPU tensors under Triton's interpreter).

Imported only when the "triton" backend runs (kv/attention/kernels.py picks it for CUDA tensors when
triton imports). The spec of every function here is the plain torch reference in
kv/attention/reference.py; the code-row layout is the one of kv/attention/kernels.py's docstring:
bytes [0, 2) the fp16 norm nu (little-endian), then n_blocks indices of W bits, bit-packed
little-endian (index j at bits [j*W, (j+1)*W) of the index bytes).

Every kernel decodes *tiles* of code rows on chip, never a whole [B, H, M, D] tensor: for a tile
of BM rows it reads the W-bit field of each column's block from the row's bytes (at most
ceil((7 + W) / 8) byte loads per column, 1 when W divides 8), gathers the codeword entries
(float32 [N, k] in global memory, L1/L2 resident), scales by nu, and feeds the [BM, D] tile to
`tl.dot` (input_precision="ieee": float32 products, no TF32, so results agree with the float32
reference to float32 rounding). Codes are read in place through their strides (a [:, :, :M] view
of a capacity buffer is not copied; only a row whose bytes are not contiguous is).

    scores(queries [B,H,Q,D], codes [B,H,M,C], codewords [N,k], W)        -> [B,H,Q,M]
    weighted_sum(weights [B,H,Q,M], codes [B,H,M,C], codewords [N,k], W)  -> [B,H,Q,D]
    decode_attention(queries [B,Hq,Q,D], key_codes [B,Hkv,M,Ck], value_codes [B,Hkv,M,Cv], ..., softcap)
        -> (out [B,Hq,Q,Dv] rotated, normalised over the M coded columns; lse [B,Hq,Q])
    paged_decode_attention(queries [R,Hq,Q,D], pages [blocks,Hkv,block_size,slot], block_tables [R,nb],
                           starts [R], stops [R], ...) -> the same over vLLM-style pages, read in place

`decode_attention` is flash-decoding on codes: the query rows of one KV head (Hq / Hkv heads x Q
tokens, padded to a tile of >= 16 rows, so GQA never repeats keys) are scored against tiles of
key codes (soft-capped when `softcap` is set: tanh(s / c) * c in a form that cannot overflow, then
the bias), an online softmax runs over the tiles of one split of the context, values are
accumulated in the value codec's rotated domain; the context is split across programs
(`splits`) and the per-split (acc, max, sum) are merged exactly (`merge_lse` semantics).
Prefill chunks use the same kernel (query rows are tiled too): memory is O(rows x Dv) plus
[splits, rows, Dv] partials, never [rows, M].

Limits (the caller falls back to the torch reference): W <= 25 (a field must fit a 32-bit window
at any bit offset; every shipped codebook has W <= 12), D and Dv <= 512. Invalid indices (>= N,
possible only when N < 2^W) are clamped before the gather and counted; the wrappers then raise
ValueError, like the reference (that check costs one device sync, only when N < 2^W).

Inference only: inputs are detached. Outputs are float32.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re

import numpy as np
import torch
import triton
import triton.language as tl

MAX_TRITON_BITS = 25
MAX_TRITON_DIM = 512


def _interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter: TRITON_INTERPRET=1 was set when triton.language
    (its jitted standard library) was first imported and when this module was imported."""
    try:
        from triton import knobs

        knob = bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # older triton: the variable itself
        knob = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    try:
        from triton.runtime.interpreter import InterpretedFunction

        return knob and isinstance(tl.standard.zeros, InterpretedFunction)
    except (ImportError, AttributeError):
        return knob


INTERPRETED = _interpreting()


def _version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "3.6.0" or "2.4.0.dev0"."""
    major, minor = (re.findall(r"\d+", text) + ["0", "0"])[:2]
    return int(major), int(minor)


# Triton < 3.7's interpreter converts a scalar (a 1-element numpy array) to an int with int(array), which
# numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"): every loop whose
# bounds the kernel computes (`range(start, stop, BM)`) failed there. `_launch_scope` then converts as 3.7 does.
_INDEX_FIX = INTERPRETED and _version(triton.__version__) < (3, 7) and _version(np.__version__) >= (2, 4)


@contextlib.contextmanager
def _interpreter_index_fix():
    """During a launch, the interpreter's tensor.__index__ of triton 3.7 (int(data.squeeze())) on an older
    triton under numpy >= 2.4; the interpreter's own patches (restored after each launch) are otherwise kept."""
    if not _INDEX_FIX:
        yield
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    try:
        yield
    finally:
        interpreter._patch_lang_tensor = original


@contextlib.contextmanager
def _launch_scope():
    """Kernels built for the interpreter re-read TRITON_INTERPRET when they run (the interpreter
    re-executes their source): keep it set during a launch, so they work whatever the caller did to
    the environment after importing this module (the tests restore it); with `_interpreter_index_fix`.
    A no-op when compiled."""
    if not INTERPRETED:
        yield
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        with _interpreter_index_fix():
            yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def unsupported_reason(dim: int, index_bits: int) -> str | None:
    """Why the kernels cannot serve a code role of head dim `dim` and `index_bits`, or None."""
    if index_bits > MAX_TRITON_BITS:
        return f"index_bits={index_bits} > {MAX_TRITON_BITS}"
    if dim > MAX_TRITON_DIM:
        return f"head dim {dim} > {MAX_TRITON_DIM}"
    return None


def device_reason(*tensors: torch.Tensor) -> str | None:
    """Why the kernels cannot run on these tensors' device, or None."""
    for tensor in tensors:
        if tensor.device.type == "cuda":
            continue
        if tensor.device.type == "cpu" and INTERPRETED:
            continue
        return (f"the triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before "
                f"triton is first imported); got a tensor on {tensor.device}")
    return None


# --------------------------------------------------------------------------- jitted pieces
@triton.jit
def _decode_tile(codes_ptr, row_off, row_ok, cw_ptr, n_codewords, index_bytes, dim, bad_ptr,
                 W: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, DP: tl.constexpr,
                 BM: tl.constexpr, CHECK: tl.constexpr):
    """Rows at byte offsets row_off int64 [BM] (row_ok bool [BM]) -> float32 [BM, DP]:
    nu * concat_j codewords[idx_j], zero in masked rows and in columns >= dim."""
    cols = tl.arange(0, DP)
    col_ok = cols < dim
    bit = (cols // K) * W
    byte = bit >> 3
    shift = (bit & 7).to(tl.uint32)
    ok = row_ok[:, None] & col_ok[None, :]
    base = codes_ptr + row_off[:, None] + 2
    word = tl.zeros([BM, DP], dtype=tl.uint32)
    for t in tl.static_range(NB):
        pos = byte + t
        part = tl.load(base + pos[None, :], mask=ok & (pos < index_bytes)[None, :], other=0)
        word = word | (part.to(tl.uint32) << (8 * t))
    idx = ((word >> shift[None, :]) & ((1 << W) - 1)).to(tl.int32)
    if CHECK:
        invalid = ok & (idx >= n_codewords)
        tl.atomic_add(bad_ptr, tl.sum(tl.sum(invalid.to(tl.int32), axis=1), axis=0))
        idx = tl.minimum(idx, n_codewords - 1)
    units = tl.load(cw_ptr + idx * K + (cols % K)[None, :], mask=ok, other=0.0)
    lo = tl.load(codes_ptr + row_off, mask=row_ok, other=0).to(tl.uint16)
    hi = tl.load(codes_ptr + row_off + 1, mask=row_ok, other=0).to(tl.uint16)
    nu = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    return units * nu[:, None]


@triton.jit
def _soft_cap(s, cap):
    """tanh(s / cap) * cap (Gemma 2's logit soft-capping; spec `reference.soft_cap`) in the exp form
    tanh(x) = sign(x) (1 - e^(-2|x|)) / (1 + e^(-2|x|)): the exponent is never positive, so no overflow
    and no NaN for any finite s (|s| / cap large: exactly +-cap)."""
    e = tl.exp(-2.0 * (tl.abs(s) / cap))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(s < 0, -t, t) * cap


@triton.jit
def _scores_kernel(q_ptr, codes_ptr, cw_ptr, out_ptr, bad_ptr,
                   n_heads, n_q, n_tokens, dim, n_codewords, index_bytes,
                   sq0, sq1, sq2, sq3, sc0, sc1, sc2, so0, so1, so2, so3,
                   W: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, DP: tl.constexpr,
                   BQ: tl.constexpr, BM: tl.constexpr, CHECK: tl.constexpr):
    bh = tl.program_id(2)  # axis 0 carries the token tiles: up to 2^31 - 1 of them (axes 1, 2: 65535)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    rows = tl.program_id(1) * BQ + tl.arange(0, BQ)
    row_ok = rows < n_q
    cols = tl.arange(0, DP)
    q = tl.load(q_ptr + b * sq0 + h * sq1 + rows[:, None].to(tl.int64) * sq2 + cols[None, :] * sq3,
                mask=row_ok[:, None] & (cols < dim)[None, :], other=0.0)
    tokens = tl.program_id(0) * BM + tl.arange(0, BM)
    tok_ok = tokens < n_tokens
    row_off = b * sc0 + h * sc1 + tokens.to(tl.int64) * sc2
    keys = _decode_tile(codes_ptr, row_off, tok_ok, cw_ptr, n_codewords, index_bytes, dim, bad_ptr,
                        W, K, NB, DP, BM, CHECK)
    s = tl.dot(q, tl.trans(keys), input_precision="ieee")
    tl.store(out_ptr + b * so0 + h * so1 + rows[:, None].to(tl.int64) * so2 + tokens[None, :] * so3, s,
             mask=row_ok[:, None] & tok_ok[None, :])


@triton.jit
def _weighted_sum_kernel(w_ptr, codes_ptr, cw_ptr, out_ptr, bad_ptr,
                         n_heads, n_q, n_tokens, dim, n_codewords, index_bytes, tokens_per_split,
                         sw0, sw1, sw2, sw3, sc0, sc1, sc2, so0, so1, so2, so3,
                         W: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, DP: tl.constexpr,
                         BQ: tl.constexpr, BM: tl.constexpr, CHECK: tl.constexpr):
    """Partial sums of split program_id(2) -> out [S, B, H, Q, D] (contiguous)."""
    bh = tl.program_id(0)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    split = tl.program_id(2)
    rows = tl.program_id(1) * BQ + tl.arange(0, BQ)
    row_ok = rows < n_q
    cols = tl.arange(0, DP)
    acc = tl.zeros([BQ, DP], dtype=tl.float32)
    start = split * tokens_per_split
    stop = tl.minimum(start + tokens_per_split, n_tokens)
    for first in range(start, stop, BM):
        tokens = first + tl.arange(0, BM)
        tok_ok = tokens < stop
        w = tl.load(w_ptr + b * sw0 + h * sw1 + rows[:, None].to(tl.int64) * sw2 + tokens[None, :] * sw3,
                    mask=row_ok[:, None] & tok_ok[None, :], other=0.0)
        row_off = b * sc0 + h * sc1 + tokens.to(tl.int64) * sc2
        vals = _decode_tile(codes_ptr, row_off, tok_ok, cw_ptr, n_codewords, index_bytes, dim, bad_ptr,
                            W, K, NB, DP, BM, CHECK)
        acc += tl.dot(w, vals, input_precision="ieee")
    tl.store(out_ptr + split.to(tl.int64) * so0 + b * so1 + h * so2 + rows[:, None].to(tl.int64) * so3
             + cols[None, :], acc, mask=row_ok[:, None] & (cols < dim)[None, :])


@triton.jit
def _decode_attention_kernel(q_ptr, kc_ptr, vc_ptr, kcw_ptr, vcw_ptr, bias_ptr, acc_ptr, stat_ptr, bad_ptr,
                             n_kv_heads, groups, n_q, n_rows, n_tokens, dim, dim_v,
                             n_kcw, n_vcw, k_index_bytes, v_index_bytes, tokens_per_split, softcap,
                             sq0, sq1, sq2, sq3, skc0, skc1, skc2, svc0, svc1, svc2,
                             sb0, sb1, sb2, sb3, sa0, sa1, sa2, sa3, ss0, ss1, ss2, ss3,
                             KW: tl.constexpr, KK: tl.constexpr, KNB: tl.constexpr,
                             VW: tl.constexpr, VK: tl.constexpr, VNB: tl.constexpr,
                             DP: tl.constexpr, DVP: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
                             CHECK_K: tl.constexpr, CHECK_V: tl.constexpr,
                             BQ: tl.constexpr, BM: tl.constexpr):
    """One (batch, KV head, tile of query rows, context split): online softmax over the split's
    tiles (scores soft-capped by `softcap` first when SOFTCAP, then the bias). Query row r = g * n_q + t is query head h * groups + g, token t. Writes the unnormalised
    accumulator acc [S, B, Hkv, R, Dv] and (running max, running sum) stat [S, B, Hkv, R, 2]."""
    bh = tl.program_id(0)
    b = (bh // n_kv_heads).to(tl.int64)
    h = (bh % n_kv_heads).to(tl.int64)
    split = tl.program_id(2)
    rows = tl.program_id(1) * BQ + tl.arange(0, BQ)
    row_ok = rows < n_rows
    head_q = h * groups + (rows // n_q).to(tl.int64)
    token_q = (rows % n_q).to(tl.int64)
    cols = tl.arange(0, DP)
    q = tl.load(q_ptr + b * sq0 + head_q[:, None] * sq1 + token_q[:, None] * sq2 + cols[None, :] * sq3,
                mask=row_ok[:, None] & (cols < dim)[None, :], other=0.0)
    m_i = tl.full([BQ], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BQ], dtype=tl.float32)
    acc = tl.zeros([BQ, DVP], dtype=tl.float32)
    start = split * tokens_per_split
    stop = tl.minimum(start + tokens_per_split, n_tokens)
    for first in range(start, stop, BM):
        tokens = first + tl.arange(0, BM)
        tok_ok = tokens < stop
        keys = _decode_tile(kc_ptr, b * skc0 + h * skc1 + tokens.to(tl.int64) * skc2, tok_ok, kcw_ptr, n_kcw,
                            k_index_bytes, dim, bad_ptr, KW, KK, KNB, DP, BM, CHECK_K)
        s = tl.dot(q, tl.trans(keys), input_precision="ieee")
        if SOFTCAP:
            s = _soft_cap(s, softcap)
        if HAS_BIAS:
            s += tl.load(bias_ptr + b * sb0 + head_q[:, None] * sb1 + token_q[:, None] * sb2
                         + tokens[None, :].to(tl.int64) * sb3,
                         mask=row_ok[:, None] & tok_ok[None, :], other=0.0)
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no column seen yet: keep exp() at 0, not NaN
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vals = _decode_tile(vc_ptr, b * svc0 + h * svc1 + tokens.to(tl.int64) * svc2, tok_ok, vcw_ptr, n_vcw,
                            v_index_bytes, dim_v, bad_ptr + 1, VW, VK, VNB, DVP, BM, CHECK_V)
        acc = acc * alpha[:, None] + tl.dot(p, vals, input_precision="ieee")
        m_i = m_new
    cols_v = tl.arange(0, DVP)
    base = split.to(tl.int64) * sa0 + b * sa1 + h * sa2 + rows[:, None].to(tl.int64) * sa3
    tl.store(acc_ptr + base + cols_v[None, :], acc, mask=row_ok[:, None] & (cols_v < dim_v)[None, :])
    stat = split.to(tl.int64) * ss0 + b * ss1 + h * ss2 + rows.to(tl.int64) * ss3
    tl.store(stat_ptr + stat, m_i, mask=row_ok)
    tl.store(stat_ptr + stat + 1, l_i, mask=row_ok)


@triton.jit
def _paged_decode_attention_kernel(q_ptr, pages_ptr, table_ptr, start_ptr, stop_ptr, kcw_ptr, vcw_ptr,
                                   acc_ptr, stat_ptr, bad_ptr,
                                   n_kv_heads, groups, n_q, n_rows, n_splits, block_size, value_offset,
                                   dim, dim_v, n_kcw, n_vcw, k_index_bytes, v_index_bytes, softcap,
                                   sq0, sq1, sq2, sq3, sp0, sp1, sp2, st0, st1,
                                   sa0, sa1, sa2, sa3, ss0, ss1, ss2, ss3,
                                   KW: tl.constexpr, KK: tl.constexpr, KNB: tl.constexpr,
                                   VW: tl.constexpr, VK: tl.constexpr, VNB: tl.constexpr,
                                   DP: tl.constexpr, DVP: tl.constexpr, SOFTCAP: tl.constexpr,
                                   CHECK_K: tl.constexpr, CHECK_V: tl.constexpr,
                                   BQ: tl.constexpr, BM: tl.constexpr):
    """`_decode_attention_kernel` over vLLM-style pages: program (request b, KV head h, tile of query
    rows, split) reads the request's coded positions [start[b], stop[b]) in place, position p at
    page table[b, p // block_size], slot p % block_size (byte offset page * sp0 + h * sp1 + slot * sp2;
    key code at 0, value code at `value_offset`). The split's range is a share of the request's own
    length (a short request's extra splits see nothing: m = -inf, l = 0). Scores soft-capped when SOFTCAP."""
    bh = tl.program_id(0)
    b = (bh // n_kv_heads).to(tl.int64)
    h = (bh % n_kv_heads).to(tl.int64)
    split = tl.program_id(2)
    rows = tl.program_id(1) * BQ + tl.arange(0, BQ)
    row_ok = rows < n_rows
    head_q = h * groups + (rows // n_q).to(tl.int64)
    token_q = (rows % n_q).to(tl.int64)
    cols = tl.arange(0, DP)
    q = tl.load(q_ptr + b * sq0 + head_q[:, None] * sq1 + token_q[:, None] * sq2 + cols[None, :] * sq3,
                mask=row_ok[:, None] & (cols < dim)[None, :], other=0.0)
    m_i = tl.full([BQ], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BQ], dtype=tl.float32)
    acc = tl.zeros([BQ, DVP], dtype=tl.float32)
    first_pos = tl.load(start_ptr + b).to(tl.int32)
    last_pos = tl.load(stop_ptr + b).to(tl.int32)
    n_tokens = tl.maximum(last_pos - first_pos, 0)
    per_split = tl.cdiv(tl.cdiv(n_tokens, BM), n_splits) * BM
    start = first_pos + split * per_split
    stop = tl.minimum(start + per_split, last_pos)
    for first in range(start, stop, BM):
        tokens = first + tl.arange(0, BM)
        tok_ok = tokens < stop
        page = tl.load(table_ptr + b * st0 + (tokens // block_size).to(tl.int64) * st1, mask=tok_ok, other=0)
        row_off = page.to(tl.int64) * sp0 + h * sp1 + (tokens % block_size).to(tl.int64) * sp2
        keys = _decode_tile(pages_ptr, row_off, tok_ok, kcw_ptr, n_kcw, k_index_bytes, dim, bad_ptr,
                            KW, KK, KNB, DP, BM, CHECK_K)
        s = tl.dot(q, tl.trans(keys), input_precision="ieee")
        if SOFTCAP:
            s = _soft_cap(s, softcap)
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vals = _decode_tile(pages_ptr + value_offset, row_off, tok_ok, vcw_ptr, n_vcw, v_index_bytes, dim_v,
                            bad_ptr + 1, VW, VK, VNB, DVP, BM, CHECK_V)
        acc = acc * alpha[:, None] + tl.dot(p, vals, input_precision="ieee")
        m_i = m_new
    cols_v = tl.arange(0, DVP)
    base = split.to(tl.int64) * sa0 + b * sa1 + h * sa2 + rows[:, None].to(tl.int64) * sa3
    tl.store(acc_ptr + base + cols_v[None, :], acc, mask=row_ok[:, None] & (cols_v < dim_v)[None, :])
    stat = split.to(tl.int64) * ss0 + b * ss1 + h * ss2 + rows.to(tl.int64) * ss3
    tl.store(stat_ptr + stat, m_i, mask=row_ok)
    tl.store(stat_ptr + stat + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(acc_ptr, stat_ptr, out_ptr, lse_ptr, n_splits, n_rows, dim_v, split_acc, split_stat,
                         DVP: tl.constexpr, BR: tl.constexpr):
    """Exact merge of the splits: acc [S, rows, Dv] (unnormalised), stat [S, rows, 2] (running max m_s,
    running sum l_s) -> out [rows, Dv] = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s with m = max_s m_s,
    lse [rows] = m + log(sum_s e^(m_s - m) l_s); a row no split saw gives out = 0, lse = -inf."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, DVP)
    ok = row_ok[:, None] & (cols < dim_v)[None, :]
    peak = tl.full([BR], float("-inf"), dtype=tl.float32)
    stat_off = rows64 * 2  # int64 offsets, advanced by one split per iteration
    for _ in range(0, n_splits):
        peak = tl.maximum(peak, tl.load(stat_ptr + stat_off, mask=row_ok, other=float("-inf")))
        stat_off += split_stat
    safe = tl.where(peak == float("-inf"), 0.0, peak)
    total = tl.zeros([BR], dtype=tl.float32)
    acc = tl.zeros([BR, DVP], dtype=tl.float32)
    stat_off = rows64 * 2
    acc_off = rows64[:, None] * dim_v + cols[None, :]
    for _ in range(0, n_splits):
        m_s = tl.load(stat_ptr + stat_off, mask=row_ok, other=float("-inf"))
        l_s = tl.load(stat_ptr + stat_off + 1, mask=row_ok, other=0.0)
        scale = tl.exp(m_s - safe)  # 0 for a split that saw no column (m_s = -inf)
        total += scale * l_s
        acc += scale[:, None] * tl.load(acc_ptr + acc_off, mask=ok, other=0.0)
        stat_off += split_stat
        acc_off += split_acc
    seen = total > 0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    tl.store(out_ptr + rows64[:, None] * dim_v + cols[None, :], out, mask=ok)
    lse = tl.where(seen, safe + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + rows64, lse, mask=row_ok)


# --------------------------------------------------------------------------- host side
def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def _field_bytes(index_bits: int) -> int:
    """Bytes a W-bit field can touch: 1 when W divides 8 (fields never straddle), else ceil((7 + W) / 8)."""
    return 1 if 8 % index_bits == 0 else (7 + index_bits + 7) // 8


def _rows(codes: torch.Tensor) -> torch.Tensor:
    """codes with each row's bytes contiguous (a [:, :, :M] view stays a view)."""
    codes = codes.detach()
    if codes.shape[-1] > 1 and codes.stride(-1) != 1:
        codes = codes.contiguous()
    return codes


NUM_WARPS = 8
NUM_STAGES = 1  # no software pipelining: with the default 3 stages ptxas spills ~10 KB per thread (sm_90)


@dataclasses.dataclass(frozen=True)
class Launch:
    """How the decode-attention kernels are launched (benchmarks/gpu_tune_decode.py times the choices).

    num_warps, num_stages: Triton's launch options; block_tokens: tokens per tile (BM; None: `_tiles`);
    waves, min_splits: the context is split so that about `waves` programs per multiprocessor run, and
    into at least `min_splits` parts (CUDA only; both capped by the number of tiles).
    Defaults from the H200 sweep (docs/gpu.md): 4 warps, one stage, BM = 32 at D = 128, >= 32 splits
    were the fastest at 8k tokens x batch 1 and 32k x batch 16 (8 warps, 2 waves: 1.2-1.7x slower)."""

    num_warps: int = 4
    num_stages: int = NUM_STAGES
    block_tokens: int | None = None
    waves: int = 2
    min_splits: int = 32


def _tiles(n_rows: int, dim: int, weighted_sum: bool = False) -> tuple[int, int]:
    """(BQ query rows, BM tokens) per tile: >= 16 each (tl.dot), BM x D <= 4096 and (scores, fused)
    BQ x D <= 2048 elements, so that with 8 warps and one stage every kernel compiles for sm_90 without
    register spills (checked with ptxas at D = 64, 128, 256: benchmarks/triton_compile_check.py).
    Speed not tuned on a GPU yet."""
    padded = _pow2(dim, 16)
    bq_cap = 64 if weighted_sum else max(16, 2048 // padded)
    return min(bq_cap, _pow2(n_rows, 16)), max(16, min(64, 4096 // padded))


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _auto_splits(device: torch.device, units: int, n_tiles: int, waves: int = 2, min_splits: int = 1) -> int:
    """Context splits so that about `waves` programs per multiprocessor fill the GPU, at least `min_splits`
    (4 programs in all on the interpreter)."""
    if device.type != "cuda":
        return max(1, min(n_tiles, -(-4 // max(units, 1))))
    target = waves * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(n_tiles, max(min_splits, -(-target // max(units, 1)))))


def _cap_arg(softcap: float | None) -> float:
    """The kernels' `softcap` scalar: c, or 1.0 when there is none (then SOFTCAP=False and it is never read)."""
    return 1.0 if softcap is None else float(softcap)


def _check_bad(bad: torch.Tensor | None, n_codewords: tuple[int, ...], index_bits: tuple[int, ...]) -> None:
    if bad is None:
        return
    counts = bad.tolist()
    for count, n, w in zip(counts, n_codewords, index_bits):
        if count:
            raise ValueError(f"codes hold {count} index(es) >= N={n} (index_bits={w})")


def scores(queries: torch.Tensor, codes: torch.Tensor, codewords: torch.Tensor, index_bits: int) -> torch.Tensor:
    """coded_scores on Triton (inputs already validated by `kernels`): -> float32 [B, H, Q, M]."""
    n_b, n_h, n_q, dim = queries.shape
    n_tokens = codes.shape[2]
    out = torch.empty(n_b, n_h, n_q, n_tokens, dtype=torch.float32, device=queries.device)
    if out.numel() == 0:
        return out
    codes = _rows(codes)
    codewords = codewords.detach().to(codes.device).contiguous()
    queries = queries.detach()
    n_codewords, k = codewords.shape
    check = n_codewords != 1 << index_bits
    bad = torch.zeros(1, dtype=torch.int32, device=codes.device) if check else out  # out: never written
    bq, bm = _tiles(n_q, dim)
    grid = (triton.cdiv(n_tokens, bm), triton.cdiv(n_q, bq), n_b * n_h)
    with _launch_scope():
        _scores_kernel[grid](queries, codes, codewords, out, bad,
                             n_h, n_q, n_tokens, dim, n_codewords, codes.shape[-1] - 2,
                             *queries.stride(), *codes.stride()[:3], *out.stride(),
                             W=index_bits, K=k, NB=_field_bytes(index_bits), DP=_pow2(dim, 16),
                             BQ=bq, BM=bm, CHECK=check, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    _check_bad(bad if check else None, (n_codewords,), (index_bits,))
    return out


def weighted_sum(weights: torch.Tensor, codes: torch.Tensor, codewords: torch.Tensor, index_bits: int,
                 dim: int, splits: int | None = None) -> torch.Tensor:
    """coded_weighted_sum on Triton (inputs validated by `kernels`): -> float32 [B, H, Q, dim]."""
    n_b, n_h, n_q, n_tokens = weights.shape
    if n_tokens == 0 or n_b * n_h * n_q == 0:
        return torch.zeros(n_b, n_h, n_q, dim, dtype=torch.float32, device=weights.device)
    codes = _rows(codes)
    codewords = codewords.detach().to(codes.device).contiguous()
    weights = weights.detach()
    n_codewords, k = codewords.shape
    check = n_codewords != 1 << index_bits
    bad = torch.zeros(1, dtype=torch.int32, device=codes.device) if check else codewords  # never written
    bq, bm = _tiles(n_q, dim, weighted_sum=True)
    q_tiles, n_tiles = triton.cdiv(n_q, bq), triton.cdiv(n_tokens, bm)
    splits = _auto_splits(codes.device, n_b * n_h * q_tiles, n_tiles) if splits is None else min(splits, n_tiles)
    per_split = triton.cdiv(n_tiles, splits) * bm
    splits = triton.cdiv(n_tokens, per_split)
    partial = torch.empty(splits, n_b, n_h, n_q, dim, dtype=torch.float32, device=codes.device)
    with _launch_scope():
        _weighted_sum_kernel[(n_b * n_h, q_tiles, splits)](
            weights, codes, codewords, partial, bad, n_h, n_q, n_tokens, dim, n_codewords, codes.shape[-1] - 2,
            per_split, *weights.stride(), *codes.stride()[:3], *partial.stride()[:4],
            W=index_bits, K=k, NB=_field_bytes(index_bits), DP=_pow2(dim, 16), BQ=bq, BM=bm, CHECK=check,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    _check_bad(bad if check else None, (n_codewords,), (index_bits,))
    return partial[0] if splits == 1 else partial.sum(0)


def decode_attention(queries: torch.Tensor, key_codes: torch.Tensor, value_codes: torch.Tensor,
                     key_codewords: torch.Tensor, value_codewords: torch.Tensor, key_bits: int, value_bits: int,
                     bias: torch.Tensor | None, value_dim: int, softcap: float | None = None,
                     splits: int | None = None, launch: Launch = Launch()) -> tuple[torch.Tensor, torch.Tensor]:
    """coded_decode_attention on Triton (inputs validated by coded_kernels; softcap None or > 0)
    -> (out float32 [B, Hq, Q, Dv] rotated, normalised over the coded columns; lse float32 [B, Hq, Q])."""
    n_b, q_heads, n_q, dim = queries.shape
    kv_heads, n_tokens = key_codes.shape[1], key_codes.shape[2]
    groups = q_heads // kv_heads
    device = key_codes.device
    if n_tokens == 0 or n_b * q_heads * n_q == 0:
        return (torch.zeros(n_b, q_heads, n_q, value_dim, dtype=torch.float32, device=device),
                torch.full((n_b, q_heads, n_q), float("-inf"), dtype=torch.float32, device=device))
    key_codes, value_codes, queries = _rows(key_codes), _rows(value_codes), queries.detach()
    key_codewords = key_codewords.detach().to(device).contiguous()
    value_codewords = value_codewords.detach().to(device).contiguous()
    (n_kcw, k_key), (n_vcw, k_value) = key_codewords.shape, value_codewords.shape
    check_k, check_v = n_kcw != 1 << key_bits, n_vcw != 1 << value_bits
    n_rows = groups * n_q
    bq, bm = _tiles(n_rows, max(dim, value_dim))
    bm = launch.block_tokens or bm
    row_tiles, n_tiles = triton.cdiv(n_rows, bq), triton.cdiv(n_tokens, bm)
    splits = (_auto_splits(device, n_b * kv_heads * row_tiles, n_tiles, launch.waves, launch.min_splits) if splits is None
              else min(splits, n_tiles))
    per_split = triton.cdiv(n_tiles, splits) * bm
    splits = triton.cdiv(n_tokens, per_split)
    acc = torch.empty(splits, n_b, kv_heads, n_rows, value_dim, dtype=torch.float32, device=device)
    stat = torch.empty(splits, n_b, kv_heads, n_rows, 2, dtype=torch.float32, device=device)
    bad = torch.zeros(2, dtype=torch.int32, device=device) if check_k or check_v else stat  # never written
    if bias is not None:
        bias_arg = bias.detach().expand(n_b, bias.shape[1], n_q, n_tokens)
        bias_strides = list(bias_arg.stride())
        if bias_arg.shape[1] == 1:
            bias_strides[1] = 0
    else:
        bias_arg, bias_strides = stat, [0, 0, 0, 0]  # never read (HAS_BIAS=False)
    with _launch_scope():
        _decode_attention_kernel[(n_b * kv_heads, row_tiles, splits)](
            queries, key_codes, value_codes, key_codewords, value_codewords, bias_arg, acc, stat, bad,
            kv_heads, groups, n_q, n_rows, n_tokens, dim, value_dim, n_kcw, n_vcw,
            key_codes.shape[-1] - 2, value_codes.shape[-1] - 2, per_split, _cap_arg(softcap),
            *queries.stride(), *key_codes.stride()[:3], *value_codes.stride()[:3], *bias_strides,
            *acc.stride()[:4], *stat.stride()[:4],
            KW=key_bits, KK=k_key, KNB=_field_bytes(key_bits), VW=value_bits, VK=k_value,
            VNB=_field_bytes(value_bits), DP=_pow2(dim, 16), DVP=_pow2(value_dim, 16), HAS_BIAS=bias is not None,
            SOFTCAP=softcap is not None, CHECK_K=check_k, CHECK_V=check_v, BQ=bq, BM=bm, num_warps=launch.num_warps,
            num_stages=launch.num_stages)
    if check_k or check_v:
        _check_bad(bad, (n_kcw, n_vcw), (key_bits, value_bits))
    out, lse = _merge_splits(acc, stat, n_b, kv_heads, n_rows, value_dim)
    # rows r = g * Q + t of KV head h are query head h * G + g, token t
    return out.reshape(n_b, q_heads, n_q, value_dim), lse.reshape(n_b, q_heads, n_q)


def _merge_splits(acc: torch.Tensor, stat: torch.Tensor, n_b: int, kv_heads: int, n_rows: int,
                  value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """acc [S, B, Hkv, rows, Dv], stat [S, B, Hkv, rows, 2] -> (out [B, Hkv, rows, Dv], lse [B, Hkv, rows])."""
    device = acc.device
    out = torch.empty(n_b, kv_heads, n_rows, value_dim, dtype=torch.float32, device=device)
    lse = torch.empty(n_b, kv_heads, n_rows, dtype=torch.float32, device=device)
    total_rows = n_b * kv_heads * n_rows
    merge_rows = 16
    with _launch_scope():
        _merge_splits_kernel[(triton.cdiv(total_rows, merge_rows),)](
            acc, stat, out, lse, acc.shape[0], total_rows, value_dim, acc.stride(0), stat.stride(0),
            DVP=_pow2(value_dim, 16), BR=merge_rows, num_warps=4, num_stages=NUM_STAGES)
    return out, lse


def paged_decode_attention(queries: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor,
                           starts: torch.Tensor, stops: torch.Tensor, key_codewords: torch.Tensor,
                           value_codewords: torch.Tensor, key_bits: int, value_bits: int, key_bytes: int,
                           key_code_size: int, value_code_size: int, value_dim: int, max_tokens: int,
                           softcap: float | None = None, splits: int | None = None,
                           launch: Launch = Launch()) -> tuple[torch.Tensor, torch.Tensor]:
    """coded_decode_attention_paged on Triton (inputs validated by coded_kernels): queries [R, Hq, Q, D],
    pages uint8 [num_blocks, Hkv, block_size, slot_bytes] (any strides, a slot's bytes contiguous),
    block_tables int [R, max_blocks], starts/stops int32 [R] (coded positions [start, stop) of each request),
    max_tokens >= every stop - start (only sizes the split count)
    -> (out float32 [R, Hq, Q, Dv] rotated, normalised over each request's coded tokens; lse [R, Hq, Q])."""
    n_b, q_heads, n_q, dim = queries.shape
    kv_heads, block_size = pages.shape[1], pages.shape[2]
    groups = q_heads // kv_heads
    device = pages.device
    if max_tokens <= 0 or n_b * q_heads * n_q == 0:
        return (torch.zeros(n_b, q_heads, n_q, value_dim, dtype=torch.float32, device=device),
                torch.full((n_b, q_heads, n_q), float("-inf"), dtype=torch.float32, device=device))
    queries = queries.detach()
    key_codewords = key_codewords.detach().to(device).contiguous()
    value_codewords = value_codewords.detach().to(device).contiguous()
    (n_kcw, k_key), (n_vcw, k_value) = key_codewords.shape, value_codewords.shape
    check_k, check_v = n_kcw != 1 << key_bits, n_vcw != 1 << value_bits
    n_rows = groups * n_q
    bq, bm = _tiles(n_rows, max(dim, value_dim))
    bm = launch.block_tokens or bm
    row_tiles, n_tiles = triton.cdiv(n_rows, bq), triton.cdiv(max_tokens, bm)
    splits = (_auto_splits(device, n_b * kv_heads * row_tiles, n_tiles, launch.waves, launch.min_splits) if splits is None
              else min(splits, n_tiles))
    acc = torch.empty(splits, n_b, kv_heads, n_rows, value_dim, dtype=torch.float32, device=device)
    stat = torch.empty(splits, n_b, kv_heads, n_rows, 2, dtype=torch.float32, device=device)
    bad = torch.zeros(2, dtype=torch.int32, device=device) if check_k or check_v else stat  # never written
    with _launch_scope():
        _paged_decode_attention_kernel[(n_b * kv_heads, row_tiles, splits)](
            queries, pages.detach(), block_tables, starts, stops, key_codewords, value_codewords, acc, stat, bad,
            kv_heads, groups, n_q, n_rows, splits, block_size, key_bytes, dim, value_dim, n_kcw, n_vcw,
            key_code_size - 2, value_code_size - 2, _cap_arg(softcap),
            *queries.stride(), *pages.stride()[:3], *block_tables.stride(), *acc.stride()[:4], *stat.stride()[:4],
            KW=key_bits, KK=k_key, KNB=_field_bytes(key_bits), VW=value_bits, VK=k_value,
            VNB=_field_bytes(value_bits), DP=_pow2(dim, 16), DVP=_pow2(value_dim, 16), SOFTCAP=softcap is not None,
            CHECK_K=check_k, CHECK_V=check_v, BQ=bq, BM=bm, num_warps=launch.num_warps,
            num_stages=launch.num_stages)
    if check_k or check_v:
        _check_bad(bad, (n_kcw, n_vcw), (key_bits, value_bits))
    out, lse = _merge_splits(acc, stat, n_b, kv_heads, n_rows, value_dim)
    return out.reshape(n_b, q_heads, n_q, value_dim), lse.reshape(n_b, q_heads, n_q)
