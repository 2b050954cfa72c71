"""The fused numba decode step (kv/attention/numba_decode.py) for residual codes: one lookup table per stage.

A residual code (FibQuant-RVQ, codecs/fibrvq.py) stores per k-block j of the rotated unit vector S
indices, one per stage: u_hat_j = C_1[i_j1] + ... + C_S[i_jS]. So for a rotated query q,

    q . u_hat = sum_j sum_s q_j . C_s[i_js]

is one lookup per stored index in a table T[i, p, lane] = q_j . C_s[i] over the code positions
p = j * S + s (the layout of the code bytes: block-major, one byte per index at N = 256), and the
value side sum_i w_i nu_i u_hat_i is the weighted histogram of each position's indices (the same
byte-wise `_hist_add` as the 8-bit FibQuant codes), contracted with the codebook of the position's
stage. Both are the single-codebook kernel's loops over P = (dim / k) * S positions; only the table
build (per stage, `_build_table`, scattered to its positions) and the contraction (per stage,
gathered) differ. A plain codec (FibQuant / TurboQuant) with 8-bit indices and N = 256 is the case
S = 1, so keys and values may mix the two.

The kernel `_decode_step_py` is `numba_decode._decode_step_py` with those two changes: each role a
`StagesRole` (its stages instead of one codebook), the codes, exact parts and epilogue the same
`numba_epilogue` structures, no recall, the scratch allocated per call. `residual_plan(codec)` says
whether a codec's codes can be read so, `attend_decode_residual` prepares the arguments (as
`codebook_step.attend_codebook_step`). Results equal `attend_codes` on the decoded floats to float32
rounding (tests/kv/attention/test_numba_residual.py).
"""
from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

import numpy as np
import torch

from fibquant.codecs.reader import CodebookReader, StagesReader
from fibquant.kv.attention.host_arrays import f32
from fibquant.kv.attention.numba_epilogue import (STEP_CODES_TYPE, STEP_EPILOGUE_TYPE, STEP_EXACT_TYPE, StepCodes,
                                                  StepEpilogue, StepExact, step_parts)

_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_KERNEL = None
_LOCK = threading.Lock()
MAX_GROUPS = 8  # query heads per KV head (the table's lanes: 4 or 8)


class StagesRole(NamedTuple):
    """One role (the keys or the values) as the residual step reads it (`residual_plan`)."""

    rotation: object  # float32 [D, D] (C): keys: the forward rotation; values: its inverse
    stages: object    # float32 [S, 256, k] (C): the codebook of each stage
    blocks: int       # k-blocks per row (D / k)


_build_table = _contract = _lut_sum = _hist_add = _norms = _query_table = None
_add_key_mean = _unrotate_add = _safe_fields = None
_exact_part_scores = _exact_part_values = _row_weights = _write_out = None  # numba_epilogue's


def _staged_table_py(stages, qmat, blocks, lanes, tmp, table1):
    """table1[i, j * S + s, t] = C_s[i] . q_t,j ([codeword, position, lane], flat; qmat[c, j * L + t] =
    q_t,j[c]): per stage the [codeword, block, lane] table of `_build_table` (tmp), copied to the
    stage's positions (L floats at a time; unsigned indices, so the copies vectorise)."""
    n_st, n_cw, k = stages.shape
    if n_st == 1:
        _build_table(stages[0], qmat, table1)
        return
    lanes_u, st_u, blocks_u = np.uint64(lanes), np.uint64(n_st), np.uint64(blocks)
    width = blocks_u * lanes_u
    row = width * st_u
    for s in range(st_u):
        _build_table(stages[s], qmat, tmp)
        for i in range(np.uint64(n_cw)):
            for j in range(blocks_u):
                src = i * width + j * lanes_u
                dst = i * row + (j * st_u + s) * lanes_u
                for t in range(lanes_u):
                    table1[dst + t] = tmp[src + t]


def _staged_contract_py(hist1, stages, blocks, lanes, tmp, acc_s, acc):
    """acc[c, j * L + t] = sum_s sum_i C_s[i, c] * hist1[i, j * S + s, t]: per stage its positions'
    histogram gathered (tmp) and contracted by `_contract` (acc_s), summed over the stages."""
    n_st, n_cw, k = stages.shape
    if n_st == 1:
        _contract(hist1, stages[0], acc)
        return
    lanes_u, st_u, blocks_u = np.uint64(lanes), np.uint64(n_st), np.uint64(blocks)
    width = blocks_u * lanes_u
    row = width * st_u
    for s in range(st_u):
        for i in range(np.uint64(n_cw)):
            for j in range(blocks_u):
                src = i * row + (j * st_u + s) * lanes_u
                dst = i * width + j * lanes_u
                for t in range(lanes_u):
                    tmp[dst + t] = hist1[src + t]
        _contract(tmp, stages[s], acc if s == 0 else acc_s)
        if s > 0:
            for c in range(np.uint64(k)):
                for x in range(width):
                    acc[c, x] += acc_s[c, x]


def _score_rows_py(table1, rows, res, nq, norms, positions, safe_bytes, lanes):
    """res[t, i] = nu_i * sum_p table1[rows[i, 2 + p], p, t] (8-bit indices, one per byte)."""
    n_tokens = rows.shape[0]
    if lanes == 4:
        if positions == 16:
            for i in range(n_tokens):
                _lut_sum(table1, rows, i, 16, 8, 1, 16, 256, safe_bytes, 4, 4, res, 0, nq, norms[i])
        elif positions == 32:
            for i in range(n_tokens):
                _lut_sum(table1, rows, i, 32, 8, 1, 32, 256, safe_bytes, 4, 4, res, 0, nq, norms[i])
        else:
            for i in range(n_tokens):
                _lut_sum(table1, rows, i, positions, 8, 1, positions, 256, safe_bytes, 4, 4, res, 0, nq, norms[i])
    else:
        for i in range(n_tokens):
            _lut_sum(table1, rows, i, positions, 8, 1, positions, 256, safe_bytes, 4, 8, res, 0, nq, norms[i])


def _hist_rows_py(hist1, rows, wts, nq, norms, positions, safe_bytes, lanes):
    """hist1[rows[i, 2 + p], p, t] += wts[t, i] * nu_i for every token i and position p."""
    n_tokens = rows.shape[0]
    if lanes == 4:
        if positions == 16:
            for i in range(n_tokens):
                _hist_add(hist1, rows, i, 16, 8, 1, 16, 256, safe_bytes, 4, 4, wts, 0, nq, norms[i])
        elif positions == 32:
            for i in range(n_tokens):
                _hist_add(hist1, rows, i, 32, 8, 1, 32, 256, safe_bytes, 4, 4, wts, 0, nq, norms[i])
        else:
            for i in range(n_tokens):
                _hist_add(hist1, rows, i, positions, 8, 1, positions, 256, safe_bytes, 4, 4, wts, 0, nq, norms[i])
    else:
        for i in range(n_tokens):
            _hist_add(hist1, rows, i, positions, 8, 1, positions, 256, safe_bytes, 4, 8, wts, 0, nq, norms[i])


def _decode_step_py(query, out, keys, values, codes, exact, epilogue, lanes, unit_start, unit_stop):
    """out[b, h*G + t] for units [unit_start, unit_stop) of (b, KV head h), as numba_decode's step, with
    keys / values `StagesRole` (stages [S, 256, k] float32; S = 1: a plain 8-bit codebook) and codes of
    2 + blocks * S bytes (index of block j, stage s at byte 2 + j * S + s); codes, exact, epilogue: the
    structures of `numba_epilogue` (`StepCodes`, `StepExact`, `StepEpilogue`), each passed as a plain tuple
    of its fields and named again here (as numba_decode's step); lanes: the tables' query lanes (4 or 8).
    Returns 0 (every byte is a valid index at N = 256). One function for numba_decode's reason:
    its per-unit loop shares the per-call buffers across its phases."""
    keys, values, codes = StagesRole(*keys), StagesRole(*values), StepCodes(*codes)
    exact, epilogue = StepExact(*exact), StepEpilogue(*epilogue)
    # every array taken out of its structure once: each access in a loop would pay numba's reference count
    key_forward, value_inverse, key_stages, value_stages = keys.rotation, values.rotation, keys.stages, values.stages
    key_blocks, value_blocks = keys.blocks, values.blocks
    key_codes, value_codes, key_norms, value_norms = codes.key_codes, codes.value_codes, codes.key_norms, codes.value_norms
    key_mean, value_mean = codes.key_mean, codes.value_mean
    has_norms, has_key_mean, has_value_mean = codes.has_norms, codes.has_key_mean, codes.has_value_mean
    sink_keys, sink_values, recent_keys, recent_values = (exact.sink_keys, exact.sink_values, exact.recent_keys,
                                                          exact.recent_values)
    new_keys, new_values = exact.new_keys, exact.new_values
    scaling, softcap, bias, sinks = epilogue.scaling, epilogue.softcap, epilogue.bias, epilogue.sinks
    has_bias, has_sinks = epilogue.has_bias, epilogue.has_sinks
    n_b, n_qh, dim = query.shape
    n_h = key_codes.shape[1]
    groups = n_qh // n_h
    n_tokens = key_codes.shape[2]
    n_sink, n_recent, n_new = sink_keys.shape[2], recent_keys.shape[2], new_keys.shape[2]
    n_exact = n_sink + n_recent + n_new
    value_dim = value_inverse.shape[0]
    ks, kn, kk = key_stages.shape
    vs, vn, vk = value_stages.shape
    k_pos, v_pos = key_blocks * ks, value_blocks * vs
    k_safe = _safe_fields(k_pos, 8, key_codes.shape[3] - 2, 4)
    v_safe = _safe_fields(v_pos, 8, value_codes.shape[3] - 2, 4)
    qmat = np.zeros((kk, key_blocks * lanes), dtype=np.float32)
    table1 = np.empty(kn * k_pos * lanes, dtype=np.float32)
    ktmp = np.empty(kn * key_blocks * lanes, dtype=np.float32)
    hist1 = np.empty(vn * v_pos * lanes, dtype=np.float32)
    vtmp = np.empty(vn * value_blocks * lanes, dtype=np.float32)
    acc = np.empty((vk, value_blocks * lanes), dtype=np.float32)
    acc_s = np.empty((vk, value_blocks * lanes), dtype=np.float32)
    coded = np.empty((lanes, max(n_tokens, 1)), dtype=np.float32)
    norms = np.empty(max(n_tokens, 1), dtype=np.float32)
    ibits = np.empty(max(n_tokens, n_exact, 1), dtype=np.int32)  # the softmax's exps: coded and exact columns

    scaled = np.empty((groups, dim), dtype=np.float32)
    rotated = np.empty(dim, dtype=np.float32)
    exact = np.empty((groups, n_exact), dtype=np.float32)
    total = np.empty(groups, dtype=np.float32)
    coded_total = np.empty(groups, dtype=np.float32)
    result = np.empty((groups, value_dim), dtype=np.float32)
    unrot = np.empty(value_dim, dtype=np.float32)
    key_row = np.empty(dim, dtype=np.float32)  # scratch of numba_epilogue's exact parts
    exact_rows = np.empty(max(n_sink, n_recent, n_new) * value_dim, dtype=np.float32)
    for unit in range(unit_start, unit_stop):
        b = unit // n_h
        h = unit % n_h
        for t in range(groups):
            for d in range(dim):
                scaled[t, d] = query[b, h * groups + t, d] * scaling
        # --- coded scores: one lookup per stored index, in the tables of its stage
        if n_tokens:
            key_rows = key_codes[b, h]
            if has_norms:
                row_norms = key_norms[b, h]
            else:
                _norms(key_rows, norms, ibits)
                row_norms = norms
            _query_table(scaled, groups, key_forward, rotated, qmat, key_blocks, kk, lanes)
            _staged_table(key_stages, qmat, key_blocks, lanes, ktmp, table1)
            _score_rows(table1, key_rows, coded, groups, row_norms, k_pos, k_safe, lanes)
            if has_key_mean:
                _add_key_mean(coded, groups, n_tokens, scaled, key_mean, b, h, dim)
        # --- the epilogue (numba_epilogue): exact scores, soft-cap, bias, one softmax with the sink logit
        _exact_part_scores(sink_keys, recent_keys, new_keys, b, h, exact, scaled, groups, key_row)
        _row_weights(coded, exact, groups, n_tokens, n_exact, n_sink, softcap, bias, has_bias, sinks, has_sinks,
                     b, h, coded_total, total, ibits)
        # --- value sums: the histogram of each position's indices, contracted with its stage
        for t in range(groups):
            for d in range(value_dim):
                result[t, d] = 0.0
        if n_tokens:
            value_rows = value_codes[b, h]
            if has_norms:
                row_norms = value_norms[b, h]
            else:
                _norms(value_rows, norms, ibits)
                row_norms = norms
            hist1[:] = 0.0
            _hist_rows(hist1, value_rows, coded, groups, row_norms, v_pos, v_safe, lanes)
            _staged_contract(hist1, value_stages, value_blocks, lanes, vtmp, acc_s, acc)
            for t in range(groups):  # un-rotate (inverse = forward.T)
                _unrotate_add(acc, t, value_blocks, vk, lanes, value_inverse, unrot, result)
                if has_value_mean:
                    for d in range(value_dim):
                        result[t, d] += coded_total[t] * value_mean[b, h, d]
        _exact_part_values(sink_values, recent_values, new_values, b, h, exact, result, groups, exact_rows)
        _write_out(result, total, out, b, h, groups)
    return 0


def _signature() -> str:
    """The kernel's one signature: each structure as a plain tuple of its fields (in their order;
    tests/kv/attention/test_numba_decode.py::test_step_signatures_match_their_structures holds the two
    together)."""
    role = "Tuple((float32[:, ::1], float32[:, :, ::1], int64))"  # `StagesRole`
    return (f"int64(float32[:, :, ::1], float32[:, :, ::1], {role}, {role}, {STEP_CODES_TYPE}, {STEP_EXACT_TYPE}, "
            f"{STEP_EPILOGUE_TYPE}, int64, int64, int64)")


def compile_residual_kernel():
    """The residual decode-step dispatcher (numba, disk-cached: `jit.kernel_jit`), after binding numba_decode's helpers."""
    global _KERNEL, _build_table, _contract, _lut_sum, _hist_add, _norms, _query_table
    global _unrotate_add, _safe_fields, _staged_table, _staged_contract
    global _score_rows, _hist_rows, _add_key_mean
    global _exact_part_scores, _exact_part_values, _row_weights, _write_out
    if _KERNEL is not None:
        return _KERNEL
    with _LOCK:
        if _KERNEL is not None:
            return _KERNEL
        import fibquant.kv.attention.numba_decode as numba_decode
        from fibquant.kv.attention.jit import kernel_jit

        numba_decode.compile_decode_kernel()  # binds its helpers (and numba_kernels')
        import fibquant.kv.attention.numba_kernels as numba_kernels

        _contract = numba_kernels._contract  # the plain contraction (numba_decode binds the clearing one)
        for name in ("_build_table", "_lut_sum", "_hist_add", "_norms", "_query_table",
                     "_unrotate_add", "_safe_fields", "_add_key_mean", "_exact_part_scores",
                     "_exact_part_values", "_row_weights", "_write_out"):
            globals()[name] = getattr(numba_decode, name)
        helper = kernel_jit(nogil=True)
        fast = kernel_jit(nogil=True, fastmath={"contract", "reassoc", "nsz"})  # float sums: any order
        _staged_table, _staged_contract = fast(_staged_table_py), fast(_staged_contract_py)
        _score_rows, _hist_rows = helper(_score_rows_py), helper(_hist_rows_py)
        _KERNEL = kernel_jit(_signature(), nogil=True)(_decode_step_py)
    return _KERNEL


_staged_table = _staged_contract = _score_rows = _hist_rows = None


def residual_plan(codec):
    """(forward, forward.T, stages [S, 256, k] as float32 numpy, blocks, (torch tensors kept alive)) for a
    codec whose codes this kernel reads: a residual codec (`StagesReader`) or one codebook (`CodebookReader`)
    with 8-bit indices and N = 256 (S = 1), codes of exactly 2 + blocks * S bytes; else None."""
    try:
        plan = _PLANS.get(codec)
    except TypeError:
        plan = None
    if plan is not None:
        return plan or None
    plan = ()
    cpu = torch.device("cpu")
    reader = codec.reader(cpu)
    forward, stages, bits = None, None, 0
    if isinstance(reader, StagesReader):
        forward, stages, bits = reader.forward, reader.stages, reader.index_bits
    elif isinstance(reader, CodebookReader) and reader.codewords.ndim == 2:
        forward, stages, bits = reader.forward, reader.codewords[None], reader.index_bits
    if stages is not None and bits == 8 and stages.shape[1] == 256 and codec.dim % stages.shape[2] == 0:
        blocks = codec.dim // stages.shape[2]
        forward = forward.detach().to(torch.float32).contiguous()
        stages = stages.detach().to(torch.float32).contiguous()
        if tuple(forward.shape) == (codec.dim, codec.dim) and codec.code_size == 2 + blocks * stages.shape[0]:
            plan = (forward.numpy(), forward.T.contiguous().numpy(), stages.numpy(), blocks, (forward, stages))
    try:
        _PLANS[codec] = plan
    except TypeError:
        pass
    return plan or None


def residual_decode_plans(query: torch.Tensor, kv):
    """(key plan, value plan) when this one-token step can run the residual kernel (at least one role
    a residual code, both readable by `residual_plan`, <= MAX_GROUPS query heads per KV head), else None."""
    if query.device.type != "cpu" or not kv.key_codes.shape[-2] or (query.requires_grad and torch.is_grad_enabled()):
        return None
    if query.shape[1] // kv.new_keys.shape[1] > MAX_GROUPS:
        return None
    from fibquant._numba import numba_available
    if not numba_available():
        return None
    keys, values = residual_plan(kv.key_codec), residual_plan(kv.value_codec)
    if keys is None or values is None or keys[2].shape[0] == values[2].shape[0] == 1:
        return None
    return keys, values


def attend_decode_residual(query: torch.Tensor, kv, epilogue, plans) -> torch.Tensor:
    """`attend_codes` for one query token on the CPU through the residual kernel (as
    `codebook_step.attend_codebook_step`; epilogue: `numba_epilogue.Epilogue`, its bias from `entry._bias_block`):
    out [B, 1, Hq, Dv] in query's dtype."""
    from fibquant._numba import run_split
    from fibquant.kv.attention.kernels import _MIN_WORK_PER_THREAD

    kernel = compile_residual_kernel()
    keys, values = plans
    batch, q_heads = query.shape[:2]
    heads = kv.new_keys.shape[1]
    coded = kv.key_codes.shape[-2]
    codes, exact, step_epilogue = step_parts(kv, epilogue)
    value_dim = values[1].shape[0]
    out = torch.empty(batch, q_heads, value_dim, dtype=torch.float32)
    lanes = 4 if q_heads // heads <= 4 else 8
    args = (f32(query.view(batch, q_heads, -1) if query.is_contiguous() else query[:, :, 0]), out.numpy(),
            (keys[0], keys[2], keys[3]), (values[1], values[2], values[3]), tuple(codes), tuple(exact),
            tuple(step_epilogue), lanes)
    work = coded * (keys[3] * keys[2].shape[0] + values[3] * values[2].shape[0])
    run_split(kernel, args, batch * heads, work, _MIN_WORK_PER_THREAD, "fibquant-decode-rvq")
    out = out.unsqueeze(1)
    return out if query.dtype == torch.float32 else out.to(query.dtype)
