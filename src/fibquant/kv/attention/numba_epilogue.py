"""The epilogue of every numba decode step, written once: what happens to a query's row of scores once a
code family's reader has scored its coded columns.

A one-token step on codes (`numba_decode` for one rotated codebook, `numba_residual` for residual
stages, `numba_shells` for E8 shell codes, `numba_paged` for vLLM's paged blocks) differs only in how it
reads code rows: the per-query tables, the coded scores, the coded value sums. The rest is this module,
per unit (batch row b, KV head h) and its G query heads:

1. `_exact_part_scores`: the exact columns [sinks, recent window, new tokens] as float dot products
   with the scaled query (float32 or bf16 bits, any strides);
2. `_row_weights`: soft-capping tanh(s / c) * c of every coded and exact score (Gemma 2; `_softcap`,
   a vectorised tanh), the additive bias (padding, sliding window) over the columns in their true
   order [sinks | coded | recent, new], then one softmax over the row and a learned sink logit
   (gpt-oss: a column with weight and no value), unnormalised (`_softmax_row`), with the coded and total
   sums;
3. `_exact_part_values`: the exact columns' weighted value sums;
4. `_write_out`: out = sums / total (a fully masked row gives zeros).

Its spec is `reference.epilogue_weights` (soft-cap, bias, softmax with a sink column), which the torch
path of `attend_codes` runs; tests/kv/attention/test_epilogue.py holds the two together. Soft-capping
reaches the kernels as one float32 argument, 0 for none. The functions are bound (compiled) by
`bind_epilogue`, which each step module calls before compiling its kernel.

The three one-token steps on a `CodedKV` (`numba_decode`, `numba_residual`, `numba_shells`) take its parts
as the same structures, built here by `step_parts`: `StepCodes` (the code rows, their decoded norms, the
centring means), `StepExact` (the exact columns) and `StepEpilogue` (the options above, each optional array
with a boolean saying it is present), beside a role structure of their own family per keys and values.
Each reaches its kernel as a plain tuple of its fields (`*_TYPE`: their types in a kernel signature).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

np = None
_as_f32 = None  # intrinsics._build_bf16: float32 as is, uint16 read as bf16 bits
_row_max = _exp_sum = _softcap = _softmax_row = _add_bias = None
_exact_scores = _exact_values = _exact_part_scores = _exact_part_values = _row_weights = _write_out = None


class Epilogue(NamedTuple):
    """The model's attention options a one-token step applies (the Python side of the epilogue).

    scaling: the score scale; softcap: c of tanh(s / c) * c, or None; bias: additive float32
    [B|1, Hq|1, 1, L] over the columns [sinks | coded | recent, new] or None; sinks: [Hq] learned sink
    logits or None."""
    scaling: float
    softcap: Optional[float] = None
    bias: object = None
    sinks: object = None

    @property
    def cap(self) -> float:
        """softcap as the kernels take it: a float, 0.0 for none."""
        return 0.0 if self.softcap is None else float(self.softcap)


def _exact_scores_py(keys, b, h, count, start, scores, query, groups, row):
    """scores[t, start + e] = query[t] . keys[b, h, e] for the first `count` keys e of one exact part
    (float32 or bf16 bits, any strides; numba_paged compiles it for C arrays, where the conversion is
    one contiguous, vectorised pass): each key row converted once into the float32 scratch `row`
    [>= D], then G dot products over contiguous arrays (compiled with reassociation, so LLVM vectorises
    the sums; a loop over e innermost would read the keys with stride D and stay scalar: ~2x slower)."""
    dim = query.shape[1]
    for e in range(count):
        for d in range(dim):
            row[d] = _as_f32(keys[b, h, e, d])
        for t in range(groups):
            s = np.float32(0.0)
            for d in range(dim):
                s += query[t, d] * row[d]
            scores[t, start + e] = s


def _exact_values_py(values, b, h, count, start, weights, result, groups, rows):
    """result[t] += sum_e weights[t, start + e] * values[b, h, e] for the first `count` values e of one
    exact part (float32 or bf16 bits, any strides; C arrays in numba_paged), e ascending, over the part
    first converted into the contiguous float32 scratch `rows` [>= count * Dv], so the axpys vectorise."""
    dim = values.shape[3]
    for e in range(count):
        for d in range(dim):
            rows[e * dim + d] = _as_f32(values[b, h, e, d])
    for e in range(count):
        for t in range(groups):
            w = weights[t, start + e]
            if w != 0.0:
                o = e * dim
                for d in range(dim):
                    result[t, d] += w * rows[o + d]


def _exact_part_scores_py(sink_keys, recent_keys, new_keys, b, h, exact, scaled, groups, key_row):
    """The exact scores of one unit, columns [sinks, recent, new] (`_exact_scores` per part)."""
    n_sink, n_recent = sink_keys.shape[2], recent_keys.shape[2]
    _exact_scores(sink_keys, b, h, n_sink, 0, exact, scaled, groups, key_row)
    _exact_scores(recent_keys, b, h, n_recent, n_sink, exact, scaled, groups, key_row)
    _exact_scores(new_keys, b, h, new_keys.shape[2], n_sink + n_recent, exact, scaled, groups, key_row)


def _exact_part_values_py(sink_values, recent_values, new_values, b, h, exact, result, groups, rows):
    """The exact value sums of one unit, columns [sinks, recent, new] (`_exact_values` per part)."""
    n_sink, n_recent = sink_values.shape[2], recent_values.shape[2]
    _exact_values(sink_values, b, h, n_sink, 0, exact, result, groups, rows)
    _exact_values(recent_values, b, h, n_recent, n_sink, exact, result, groups, rows)
    _exact_values(new_values, b, h, new_values.shape[2], n_sink + n_recent, exact, result, groups, rows)


# Cephes' expf: exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 split in two for
# an exact product), exp(r) by a degree-7 polynomial on |r| <= ln 2 / 2: about 1 ulp from libm's
# expf. Written as straight-line float / int arithmetic over an array, so LLVM vectorises it
# (numba calls the scalar libm expf otherwise: ~20 cycles per score, the largest per-token cost).
_EXP_LOG2E = 1.44269504088896341
_EXP_C1 = 0.693359375
_EXP_C2 = -2.12194440e-4
_EXP_LO = -87.33654  # below: 0 (exp underflows; -inf, a masked column, gives exactly 0)
_TANH_HI = 9.0  # tanh(9) = 1 - 3e-8: 1 in float32


def _row_max_py(row, n, top):
    """max(top, row[0..n)) (no NaN among the scores). Four independent running maxima: LLVM does not
    vectorise this reduction, so one chain would wait on each compare (~4x slower at 8000 columns)."""
    m0 = top
    m1 = top
    m2 = top
    m3 = top
    i = 0
    while i + 4 <= n:
        m0 = max(m0, row[i])
        m1 = max(m1, row[i + 1])
        m2 = max(m2, row[i + 2])
        m3 = max(m3, row[i + 3])
        i += 4
    while i < n:
        m0 = max(m0, row[i])
        i += 1
    return max(max(m0, m1), max(m2, m3))


def _exp_sum_py(row, n, top, bits):
    """row[i] = exp(row[i] - top) in place for i < n; returns their sum. bits: int32 scratch [>= n]."""
    for i in range(n):
        x = row[i] - top
        keep = x >= np.float32(_EXP_LO)
        x = x if keep else np.float32(0.0)
        k = np.floor(x * np.float32(_EXP_LOG2E) + np.float32(0.5))
        r = x - k * np.float32(_EXP_C1)
        r = r - k * np.float32(_EXP_C2)
        z = r * r
        p = ((((np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)) * r + np.float32(8.3334519073e-3))
              * r + np.float32(4.1665795894e-2)) * r + np.float32(1.6666665459e-1)) * r + np.float32(5.0000001201e-1)
        row[i] = (p * z + r + np.float32(1.0)) if keep else np.float32(0.0)
        bits[i] = (np.int32(k) + np.int32(127)) << np.int32(23)
    scale = bits[:n].view(np.float32)
    s = np.float32(0.0)
    for i in range(n):
        e = row[i] * scale[i]
        row[i] = e
        s += e
    return s


def _softcap_py(row, n, cap, bits):
    """row[i] = tanh(row[i] / cap) * cap in place for i < n (finite scores). tanh |x| = (1 - e) / (1 + e)
    with e = exp(-2 |x|) by `_exp_sum`'s polynomial (|x| clipped at 9, where tanh is 1 in float32), the
    sign of x carried in the sign bit of the power of two: vectorised like `_exp_sum` (libm's tanhf is
    ~20 cycles per score, as much as scoring a code row). Error: a few float32 ulps of 1, times cap."""
    inv = np.float32(1.0) / cap
    for i in range(n):
        x = row[i] * inv
        y = np.float32(-2.0) * min(abs(x), np.float32(_TANH_HI))
        k = np.floor(y * np.float32(_EXP_LOG2E) + np.float32(0.5))
        r = y - k * np.float32(_EXP_C1)
        r = r - k * np.float32(_EXP_C2)
        z = r * r
        p = ((((np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)) * r + np.float32(8.3334519073e-3))
              * r + np.float32(4.1665795894e-2)) * r + np.float32(1.6666665459e-1)) * r + np.float32(5.0000001201e-1)
        row[i] = p * z + r + np.float32(1.0)
        sign = np.int32(-2147483648) if x < np.float32(0.0) else np.int32(0)
        bits[i] = ((np.int32(k) + np.int32(127)) << np.int32(23)) | sign
    scale = bits[:n].view(np.float32)
    for i in range(n):
        e = row[i] * scale[i]  # +-exp(-2 |x|), the sign of x
        m = abs(e)
        t = (np.float32(1.0) - m) / (np.float32(1.0) + m) * cap
        row[i] = t if e >= np.float32(0.0) else -t


def _softmax_row_py(coded_row, n_tokens, exact_row, n_exact, sink_logit, ibits):
    """One softmax over a row's coded and exact columns and a sink logit (-inf for none), in place,
    unnormalised (both exps vectorised: `_exp_sum`); returns (sum of the coded weights, sum of all
    weights). Every column masked: zeros."""
    top = _row_max(coded_row, n_tokens, np.float32(-np.inf))
    top = _row_max(exact_row, n_exact, top)
    if sink_logit > top:
        top = sink_logit
    if top == -np.inf:
        top = np.float32(0.0)
    coded_sum = _exp_sum(coded_row, n_tokens, top, ibits)
    s = coded_sum + _exp_sum(exact_row, n_exact, top, ibits)
    if sink_logit != -np.inf:
        s += np.float32(np.exp(sink_logit - top))
    return coded_sum, s


def _add_bias_py(coded, exact, groups, n_sink, n_tokens, n_exact, bias, b, h):
    """Add the step's bias [B|1, Hq|1, L] to the scores; its columns are [sinks | coded | recent, new]."""
    bb = b if bias.shape[0] > 1 else 0
    for t in range(groups):
        hb = h * groups + t if bias.shape[1] > 1 else 0
        for e in range(n_sink):
            exact[t, e] += bias[bb, hb, e]
        for i in range(n_tokens):
            coded[t, i] += bias[bb, hb, n_sink + i]
        for e in range(n_sink, n_exact):
            exact[t, e] += bias[bb, hb, n_tokens + e]


def _row_weights_py(coded, exact, groups, n_tokens, n_exact, n_sink, softcap, bias, has_bias, sinks, has_sinks,
                    b, h, coded_total, total, ibits):
    """Scores of one unit's G rows -> unnormalised weights in place: soft-capping (softcap > 0), the
    bias (has_bias), one softmax with the sink logit (has_sinks); coded_total[t] / total[t] their sums."""
    if softcap > 0:
        for t in range(groups):
            _softcap(coded[t], n_tokens, softcap, ibits)
            _softcap(exact[t], n_exact, softcap, ibits)
    if has_bias:
        _add_bias(coded, exact, groups, n_sink, n_tokens, n_exact, bias, b, h)
    for t in range(groups):
        sink_logit = np.float32(sinks[h * groups + t]) if has_sinks else np.float32(-np.inf)
        coded_total[t], total[t] = _softmax_row(coded[t], n_tokens, exact[t], n_exact, sink_logit, ibits)


def _write_out_py(result, total, out, b, h, groups):
    """out[b, h * G + t] = result[t] / total[t] (0 for a row with every column masked)."""
    for t in range(groups):
        scale = np.float32(1.0) / total[t] if total[t] > 0 else np.float32(0.0)
        for d in range(result.shape[1]):
            out[b, h * groups + t, d] = result[t, d] * scale


def bind_epilogue():
    """Compile (numba, disk-cached: `jit.kernel_jit`) and bind this module's helpers, once."""
    global np, _as_f32, _row_max, _exp_sum, _softcap, _softmax_row, _add_bias
    global _exact_scores, _exact_values, _exact_part_scores, _exact_part_values, _row_weights, _write_out
    if _write_out is not None:
        return
    import numpy

    from fibquant.kv.attention.intrinsics import _build_bf16
    from fibquant.kv.attention.jit import kernel_jit

    np = numpy
    _as_f32 = _build_bf16()[0]
    helper = kernel_jit(nogil=True)
    # reassociation for the exact dot products (no 'nnan' / 'ninf': exact keys may hold any float)
    _exact_scores = kernel_jit(nogil=True, fastmath={"reassoc", "nsz", "contract"})(_exact_scores_py)
    _exact_values = helper(_exact_values_py)
    _exact_part_scores, _exact_part_values = helper(_exact_part_scores_py), helper(_exact_part_values_py)
    # Reassociation (and no NaN among the scores, for the max) lets LLVM vectorise these reductions;
    # no 'ninf': masked scores are -inf.
    _row_max = kernel_jit(nogil=True, fastmath={"nnan", "nsz", "reassoc"})(_row_max_py)
    _exp_sum = kernel_jit(nogil=True, fastmath={"nsz", "reassoc", "contract"})(_exp_sum_py)
    _softcap = kernel_jit(nogil=True, fastmath={"nsz", "reassoc", "contract"})(_softcap_py)
    _softmax_row, _add_bias = helper(_softmax_row_py), helper(_add_bias_py)
    _row_weights = helper(_row_weights_py)  # binds the helpers above: compiled after them
    _write_out = helper(_write_out_py)


class StepCodes(NamedTuple):
    """The coded columns of a `CodedKV` as the one-token steps read them (`step_parts`)."""

    key_codes: object    # uint8 [B, H, M, C] code rows ([fp16 norm][packed indices]), each row's bytes contiguous
    value_codes: object  # uint8 [B, H, M, Cv]
    key_norms: object    # float32 [B, H, M]: the rows' fp16 norms already decoded (`CodeBuffer.norms_array`),
    value_norms: object  # read when has_norms (else empty, and the kernel decodes the norms itself)
    key_mean: object     # float32 [B, H, D] (C): added back to the decoded keys (centring), read when has_key_mean
    value_mean: object   # float32 [B, H, Dv] (C): read when has_value_mean
    has_norms: bool
    has_key_mean: bool
    has_value_mean: bool


class StepExact(NamedTuple):
    """The exact columns of a `CodedKV` as the one-token steps read them: [B, H, n, D] float32 each, any
    strides with the last dimension contiguous (views of the window buffers). Their columns are
    [sinks | coded | recent, new] (`_exact_part_scores`). numba_paged's `ExactParts` is another layout
    (window rows picked per sequence, the new token recorded into them)."""

    sink_keys: object
    sink_values: object
    recent_keys: object
    recent_values: object
    new_keys: object
    new_values: object


class StepEpilogue(NamedTuple):
    """An `Epilogue` as the one-token steps' kernels read it: each option a float32 value or array, with a
    boolean saying whether the array is present (absent: a small dummy, never read)."""

    scaling: float   # the score scale
    softcap: float   # c of tanh(s / c) * c, 0 for none
    bias: object     # float32 [B|1, Hq|1, L] (C): additive, over the columns [sinks | coded | recent, new]
    sinks: object    # float32 [Hq] (C): learned sink logits
    has_bias: bool
    has_sinks: bool


_DUMMY3 = _DUMMY1 = None


def step_parts(kv, epilogue: Epilogue) -> tuple[StepCodes, StepExact, StepEpilogue]:
    """(codes, exact parts, epilogue) of a `CodedKV` and an `Epilogue` as the step kernels read them: numpy
    views, the layer's own (`CodedKV.arrays`, with the rows' decoded norms when it keeps them) where set,
    else the tensors converted; a small dummy for each absent array."""
    global _DUMMY3, _DUMMY1
    import numpy

    from fibquant.kv.attention.host_arrays import code_rows, f32, rows32

    if _DUMMY3 is None:
        _DUMMY3, _DUMMY1 = numpy.zeros((1, 1, 1), dtype=numpy.float32), numpy.zeros(1, dtype=numpy.float32)
    arrays = kv.arrays
    if arrays is None:
        arrays = (rows32(kv.sink_keys), rows32(kv.sink_values), code_rows(kv.key_codes), code_rows(kv.value_codes),
                  rows32(kv.recent_keys), rows32(kv.recent_values))
    has_norms = len(arrays) == 8  # the code rows' norms, decoded once when they were stored
    key_norms, value_norms = arrays[6:] if has_norms else (_DUMMY3, _DUMMY3)
    key_mean = _DUMMY3 if kv.key_mean is None else f32(kv.key_mean)
    value_mean = _DUMMY3 if kv.value_mean is None else f32(kv.value_mean)
    codes = StepCodes(arrays[2], arrays[3], key_norms, value_norms, key_mean, value_mean, has_norms,
                      kv.key_mean is not None, kv.value_mean is not None)
    exact = StepExact(arrays[0], arrays[1], arrays[4], arrays[5], rows32(kv.new_keys), rows32(kv.new_values))
    bias = _DUMMY3 if epilogue.bias is None else f32(epilogue.bias[:, :, 0])
    sinks = _DUMMY1 if epilogue.sinks is None else f32(epilogue.sinks.reshape(-1))
    return codes, exact, StepEpilogue(float(epilogue.scaling), epilogue.cap, bias, sinks, epilogue.bias is not None,
                                      epilogue.sinks is not None)


# the groups' types in a kernel signature (fields in their order; the kernels' tests hold the two together)
_F3 = "float32[:, :, :]"
STEP_CODES_TYPE = f"Tuple((uint8[:, :, :, :], uint8[:, :, :, :], {_F3}, {_F3}, float32[:, :, ::1], float32[:, :, ::1], " \
                  "boolean, boolean, boolean))"
STEP_EXACT_TYPE = "Tuple((" + ", ".join(["float32[:, :, :, :]"] * 6) + "))"
STEP_EPILOGUE_TYPE = "Tuple((float32, float32, float32[:, :, ::1], float32[::1], boolean, boolean))"
