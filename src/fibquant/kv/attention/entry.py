"""Attention computed from the codes of a `CompressedCache`, plugged into transformers.

transformers calls an attention function from its registry (`AttentionInterface`) with the
keys/values that `cache.update` returned. In "codes" mode `CompressedLayer.update` returns a
`CodedKV` (exact sinks, the coded tokens as uint8 code rows, exact recent window and the
new tokens) and `coded_attention_forward`, registered as "fibquant", attends to it:

- keys: for FibQuant/TurboQuant, q . x_hat_i = nu_i * (q @ Pi^T) . u_hat_i, so each query is
  rotated once and scored against every code row by `kernels.coded_scores` (a per-query
  lookup table of block dot products), never un-rotating or decoding a key;
- values: sum_i p_i x_hat_i = (sum_i p_i nu_i u_hat_i) @ Pi: the weighted sum is accumulated
  in the rotated domain (`coded_weighted_sum`) and un-rotated once per query;
- the exact columns (sinks, recent window, the current chunk) are scored as floats; all
  scores of a query go through one softmax over the full row, so the merge of coded and
  exact parts is exact (no approximation of the normaliser);
- queries are processed in blocks so a long prefill chunk never builds a [T, L] score
  matrix larger than a few MB per head;
- a prefill chunk (>= SPLIT_MIN_TOKENS queries, no soft-capping) attends to its exact columns
  through SDPA's fused kernel, which also returns each row's log-sum-exp, and to the coded
  columns through the code kernels; the two normalised parts (and a sink logit) merge exactly by
  their log-sum-exps. A first chunk with nothing coded and nothing before it is one causal SDPA;
- the model's own attention options apply to coded and exact columns alike: its scale
  (`scaling`, e.g. Gemma's query_pre_attn_scalar), logit soft-capping (`softcap`, Gemma 2:
  tanh(s / c) * c before the mask and softmax), learned attention sinks (`s_aux`, gpt-oss: one
  extra logit per query head in the softmax, dropped afterwards) and sliding windows (the
  model's sliding mask, built over the columns a `CompressedSlidingLayer` holds).

Anything else falls back, never silently wrongly: a codec without a rotated codebook (INT,
low-rank, RVQ) has its codes decoded to floats for that role (one-time warning), except that a
one-token step on the CPU goes through the steps registered in `ONE_TOKEN_STEPS`: FibQuant-RVQ's residual
codes with one table per stage (`numba_residual`, `rotated_stages`), FibQuant-E8's shell codes decoded
block by block in the kernel (`numba_shells`, `rotated_shells`); options the
path does not implement (`position_bias`, dropout) decode the whole `CodedKV` and run SDPA on
it (one-time warning); caches other than a `CompressedCache` in "codes" mode are served by
transformers' SDPA unchanged, except with soft-capping or sinks, which SDPA cannot apply: those
run through this module's float path.
"""
from __future__ import annotations

import threading
import warnings
import weakref

import numpy as np
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fibquant._numba import run_split
from fibquant.codecs.base import Codec
from fibquant.kv.buffer import CodedKV
from fibquant.kv.options import AttentionOptions
from fibquant.kv.attention.host_arrays import code_rows, f32, rows32
from fibquant.kv.attention.numba_epilogue import Epilogue, step_arrays
from fibquant.kv.attention.kernels import (_MIN_WORK_PER_THREAD, attention_with_lse, coded_decode_attention,
                                       coded_scores, coded_weighted_sum, merge_lse, triton_available)
from fibquant.kv.attention.recall import check_recall, cold_rows, recalled_part

ATTENTION_NAME = "fibquant"
QUERY_ROWS_PER_BLOCK = 2048      # query rows (query heads x tokens) per KV head scored at once
# Chunks of at least this many query tokens (prefill) attend to their exact columns through SDPA
# and merge with the coded columns by log-sum-exp; shorter ones (decode) use one joint softmax.
SPLIT_MIN_TOKENS = 16
# One-token steps on the CPU for code families the fused kernel cannot read (no single rotated codebook),
# tried in order: (module, plans function, step function). plans(query, kv) -> plans or None (this step
# cannot serve it); step(query, kv, epilogue, plans) -> out [B, 1, Hq, Dv] (`numba_epilogue.Epilogue`: scaling,
# softcap, bias, sinks). A new family of codes registers its module here.
ONE_TOKEN_STEPS = (
    ("fibquant.kv.attention.numba_residual", "residual_decode_plans", "attend_decode_residual"),  # RVQ stages
    ("fibquant.kv.attention.numba_shells", "shell_decode_plans", "attend_decode_shells"),  # E8 shell codes
)
_UNSUPPORTED_KWARGS = ("position_bias",)
_EAGER_KWARGS = ("softcap", "s_aux")  # applied here; SDPA would ignore them
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def register_coded_attention() -> None:
    """Register "fibquant" in transformers' attention and mask registries (idempotent)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, coded_attention_forward)
    # SDPA's boolean mask (or None for a plain causal one), which coded_attention_forward reads.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


def unsupported_reason(model) -> str | None:
    """Why `model` cannot run attention on codes, or None when it can."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        return f"{type(model).__name__} is not a transformers PreTrainedModel"
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        return f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface"
    return None


def use_coded_attention(model) -> None:
    """Switch `model` to the "fibquant" attention function; raise ValueError naming what is unsupported.

    Caches other than a CompressedCache in "codes" mode keep working (they are served by SDPA).
    """
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"attention on codes is unsupported for this model: {reason}")
    register_coded_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        raise ValueError(f"attention on codes is unsupported: {type(model).__name__} kept attention "
                         f"implementation {model.config._attn_implementation!r}")


# --------------------------------------------------------------------- one codec role
def _scores_from_codes(codec: Codec, queries: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """queries float32 [B, H, Q, D] (already scaled) . decoded codes [B, H, M, C] -> [B, H, Q, M]."""
    rotated = codec.rotated_codebook(queries.device)
    if rotated is None:
        _warn_once(f"codec:{type(codec).__name__}", f"{type(codec).__name__} has no rotated codebook: its codes are "
                   "decoded to floats for attention (the 'decode' path for this role)")
        return queries @ codec.decode(codes).transpose(-1, -2)
    return coded_scores(queries @ rotated.forward, codes, rotated.codewords, rotated.index_bits)


def _values_from_codes(codec: Codec, weights: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """weights float32 [B, H, Q, M] x decoded codes [B, H, M, C] -> float32 [B, H, Q, D]."""
    rotated = codec.rotated_codebook(weights.device)
    if rotated is None:
        return weights @ codec.decode(codes)
    return coded_weighted_sum(weights, codes, rotated.codewords, rotated.index_bits) @ rotated.forward.T


# --------------------------------------------------------------------- the attention function
def _bias_block(mask: torch.Tensor | None, rows: slice, length: int, past: int, device,
                window: int | None = None) -> torch.Tensor | None:
    """Additive float32 bias [B or 1, 1 or Hq, t, L] for query tokens `rows` (None: nothing masked).

    With mask None (SDPA's skipped causal mask) query t sees columns past + t - window < c <= past + t."""
    if mask is None:
        reach = length if window is None else window
        if rows.stop - rows.start == 1 and past + rows.start >= length - 1 and length <= reach:
            return None  # one token seeing every column (a decode step)
        t = torch.arange(rows.start, rows.stop, device=device).unsqueeze(1)
        columns = torch.arange(length, device=device).unsqueeze(0)
        blocked = (columns > past + t) | (columns <= past + t - reach)
        return torch.zeros(blocked.shape, device=device).masked_fill_(blocked, float("-inf"))[None, None]
    block = mask[:, :, rows, :length]
    if block.dtype == torch.bool:
        return torch.zeros(block.shape, device=device).masked_fill_(~block, float("-inf"))
    return block.to(torch.float32)


def attend_codes(query: torch.Tensor, kv: CodedKV, attention_mask: torch.Tensor | None,
                 scaling: float, softcap: float | None = None, sinks: torch.Tensor | None = None,
                 window: int | None = None, options: AttentionOptions | None = None) -> torch.Tensor:
    """Attention of query [B, Hq, T, D] over a `CodedKV` -> [B, T, Hq, Dv] in query's dtype.

    attention_mask: None (plain causal, as SDPA's skipped mask; `window` limits it to a sliding
    window), bool [B, 1|Hq, T, L] (True = attend) or additive float of that shape. softcap: scores
    become tanh(s / softcap) * softcap before the mask. sinks: [Hq] logits, one extra softmax
    column per query head that takes weight but has no value (gpt-oss). Fully masked query rows
    give zeros. options: the paths taken (`fibquant.kv.options.AttentionOptions`; default `kv.options`,
    the cache's).
    """
    options = kv.options if options is None else options
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number, got {softcap!r}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.numel() != query.shape[1]):
        raise ValueError(f"sinks must be a tensor of {query.shape[1]} logits (one per query head), got "
                         f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
    batch, q_heads, tokens, dim = query.shape
    heads = kv.new_keys.shape[1]
    if q_heads % heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {heads} KV heads")
    if kv.cold is not None and kv.num_coded:  # recall (kv/attention/recall.py)
        check_recall(softcap)
        cold = cold_rows(kv.cold) if tokens == 1 and options.numba_decode else None
        plans = _decode_plans(query, kv) if cold is not None else None
        if plans is not None:  # the fused one-token kernel reads the cold rows itself
            epilogue = _with_step_bias(Epilogue(scaling, None, None, sinks), kv, attention_mask, window, query.device)
            return _attend_decode_numba(query, kv, epilogue, plans, cold)
        return _attend_split(query, kv, attention_mask, scaling, sinks, window, options.fused_backend)
    if tokens == 1 and options.numba_decode:
        out = _attend_one_token(query, kv, attention_mask, window, Epilogue(scaling, softcap, None, sinks))
        if out is not None:
            return out
    if softcap is None and (tokens >= SPLIT_MIN_TOKENS or _fused(kv, query.device, options.fused_backend)):
        return _attend_split(query, kv, attention_mask, scaling, sinks, window, options.fused_backend)
    groups = q_heads // heads
    length, n_sink, coded = kv.length, kv.num_sink, kv.num_coded
    past = length - tokens
    # Columns in the order [sinks, recent, new | coded] (one matmul for every exact column); the
    # mask's columns [sinks | coded | recent, new] are permuted to match.
    exact_keys, exact_values = (t.to(torch.float32) for t in kv.exact(with_sinks=True))
    n_exact = exact_keys.shape[-2]
    value_dim = exact_values.shape[-1]
    queries = query.to(torch.float32).reshape(batch, heads, groups, tokens, dim) * scaling
    step = max(1, QUERY_ROWS_PER_BLOCK // groups)
    if tokens > step:
        out = torch.empty(batch, heads, groups, tokens, value_dim, dtype=torch.float32, device=query.device)
    sink_logits = None if sinks is None else sinks.to(torch.float32).reshape(1, heads, groups, 1, 1)
    for start in range(0, tokens, step):
        rows = slice(start, min(start + step, tokens))
        width = rows.stop - rows.start
        block = queries[:, :, :, rows].reshape(batch, heads, groups * width, dim)
        scores = block @ exact_keys.transpose(-1, -2)
        if coded:
            coded_scores = _scores_from_codes(kv.key_codec, block, kv.key_codes)
            if kv.key_mean is not None:  # centred keys: q . (x_hat + mu) = q . x_hat + q . mu
                coded_scores = coded_scores + block @ kv.key_mean.unsqueeze(-1)
            scores = torch.cat([scores, coded_scores], dim=-1)
        if softcap is not None:
            scores = torch.tanh(scores / softcap).mul_(softcap)
        bias = _bias_block(attention_mask, rows, length, past, query.device, window)
        if bias is not None:
            if coded:
                bias = torch.cat([bias[..., :n_sink], bias[..., n_sink + coded:], bias[..., n_sink:n_sink + coded]],
                                 dim=-1)
            shaped = scores.view(batch, heads, groups, width, length)
            if bias.shape[1] == 1:
                shaped += bias.unsqueeze(1)
            else:
                shaped += bias.reshape(bias.shape[0], heads, groups, width, length)
        if sink_logits is None:
            weights = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a fully masked row: zeros, not NaN
        else:  # the sink column shares the normaliser, then is dropped
            sink_column = sink_logits.expand(batch, heads, groups, width, 1).reshape(batch, heads, groups * width, 1)
            weights = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
        mixed = weights[..., :n_exact] @ exact_values
        if coded:
            coded_weights = weights[..., n_exact:].contiguous()
            mixed += _values_from_codes(kv.value_codec, coded_weights, kv.value_codes)
            if kv.value_mean is not None:  # centred values: sum_i p_i mu = (sum_i p_i) mu
                mixed += coded_weights.sum(-1, keepdim=True) * kv.value_mean.unsqueeze(-2)
        if tokens == width:  # one block (every decode step): no copy into `out`
            return mixed.view(batch, heads, groups, tokens, value_dim).reshape(batch, q_heads, tokens, value_dim) \
                .transpose(1, 2).contiguous().to(query.dtype)
        out[:, :, :, rows] = mixed.view(batch, heads, groups, width, value_dim)
    return out.reshape(batch, q_heads, tokens, value_dim).transpose(1, 2).contiguous().to(query.dtype)


# --------------------------------------------------------------------- the fused one-token step (CPU)
def _attend_one_token(query: torch.Tensor, kv: CodedKV, attention_mask, window, epilogue: Epilogue):
    """A one-token step through the fused numba kernel or a registered step of `ONE_TOKEN_STEPS`; None when
    none of them serves these codes (the torch path then runs)."""
    plans = _decode_plans(query, kv)
    staged = None
    if plans is None:  # codes without one rotated codebook: the registered one-token steps
        for plans_of, step in _one_token_steps():
            staged = plans_of(query, kv)
            if staged is not None:
                break
        if staged is None:
            return None
    epilogue = _with_step_bias(epilogue, kv, attention_mask, window, query.device)
    if plans is not None:
        return _attend_decode_numba(query, kv, epilogue, plans)
    return step(query, kv, epilogue, staged)


def _with_step_bias(epilogue: Epilogue, kv: CodedKV, attention_mask, window, device) -> Epilogue:
    """`epilogue` with a one-token step's additive bias [B|1, Hq|1, 1, L] (`_bias_block`) when a mask or a
    sliding window applies."""
    if attention_mask is None and window is None:
        return epilogue
    length = kv.length
    return epilogue._replace(bias=_bias_block(attention_mask, slice(0, 1), length, length - 1, device, window))


def _one_token_steps():
    """ONE_TOKEN_STEPS' (plans, step) functions (modules imported on first use; the functions looked up
    at each call, so a module's current binding is the one run)."""
    import importlib
    for name, plans, step in ONE_TOKEN_STEPS:
        module = importlib.import_module(name)
        yield getattr(module, plans), getattr(module, step)


_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _codec_plan(codec: Codec):
    """(forward, forward.T, codewords as numpy, index_bits, n_blocks, numba mode) of a codec's rotated
    codebook on the CPU, built once per codec; None when it has none (or one the kernel cannot serve)."""
    try:
        plan = _PLANS.get(codec)
    except TypeError:  # an unhashable codec: no cache
        plan = None
    if plan is not None:
        return plan or None
    rotated = codec.rotated_codebook(torch.device("cpu"))
    plan = ()
    if rotated is not None:
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


def _decode_plans(query: torch.Tensor, kv: CodedKV):
    """(key plan, value plan, lanes, scratch sizes) when this one-token step can run the fused numba
    kernel, else None. The last answer is kept for its (key codec, value codec, query groups)."""
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
    keys, values = _codec_plan(kv.key_codec), _codec_plan(kv.value_codec)
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
_SCRATCH = threading.local()  # per thread: {(slot, sizes, lanes): [table1, lut, hist1, hist, coded, norms, ibits]}


def _scratch(slot: int, sizes: tuple, lanes: int, tokens: int) -> list:
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


def _attend_decode_numba(query: torch.Tensor, kv: CodedKV, epilogue: Epilogue, plans, cold=None) -> torch.Tensor:
    """`attend_codes` for one query token on the CPU: one call of the fused kernel (same result to
    float32 rounding; see kv/attention/numba_decode.py). Reads `kv.arrays` (numpy views the layer
    keeps) when set, else converts the tensors. cold: the cold store's float32 rows (`recall.cold_rows`)
    for recall, None without."""
    keys, values, lanes, sizes = plans
    batch, q_heads = query.shape[:2]
    key_mean, value_mean, bias_np, sinks_np, flags = step_arrays(kv, epilogue)
    value_dim = values[1].shape[0]
    out_np = np.empty((batch, 1, q_heads, value_dim), dtype=np.float32)  # the [B, T, Hq, Dv] result
    if query.dtype is torch.float32 and not query.requires_grad and query.stride(-1) == 1:
        query_np = query.numpy()[:, :, 0]
        if not query_np.flags.c_contiguous:  # e.g. GPT-2's query, split from a fused qkv, at batch > 1
            query_np = np.ascontiguousarray(query_np)
    else:
        query_np = f32(query[:, :, 0])
    arrays = kv.arrays
    key_norms = value_norms = key_mean[:0]  # bit 4 clear: not read
    if arrays is None:
        arrays = (rows32(kv.sink_keys), rows32(kv.sink_values), code_rows(kv.key_codes),
                  code_rows(kv.value_codes), rows32(kv.recent_keys), rows32(kv.recent_values))
    elif len(arrays) == 8:  # the code rows' norms, decoded once when they were stored
        arrays, (key_norms, value_norms), flags = arrays[:6], arrays[6:], flags | 16
    sink_k, sink_v, key_codes, value_codes, recent_k, recent_v = arrays
    cold_k = cold_v = np.zeros((1, 1), dtype=np.float32)
    recall_k = 0
    if cold is not None:  # recall: each query head's top-k coded tokens from the cold rows
        (cold_k, cold_v), recall_k = cold, kv.cold.recall.count(key_codes.shape[2])
        if recall_k:
            kv.cold.count_reads(batch * q_heads * recall_k)
    args = (query_np, float(epilogue.scaling), keys[0], values[1], keys[2], values[2], key_codes, value_codes,
            sink_k, sink_v, recent_k, recent_v, rows32(kv.new_keys), rows32(kv.new_values), key_mean, value_mean,
            bias_np, sinks_np, epilogue.cap, out_np[:, 0], flags, keys[3], values[3], keys[4], values[4], keys[5], values[5],
            lanes, key_norms, value_norms, cold_k, cold_v, recall_k)
    coded = key_codes.shape[2]
    bad = run_split(_KERNEL, args, batch * key_codes.shape[1], coded * (keys[4] + values[4]), _MIN_WORK_PER_THREAD,
                    "fibquant-decode", per_thread=lambda t: _scratch(t, sizes, lanes, max(coded, kv.length - coded)))
    if bad:
        raise ValueError(f"codes hold {bad} index(es) >= N (index_bits={keys[3]} / {values[3]})")
    out = torch.from_numpy(out_np)
    return out if query.dtype is torch.float32 else out.to(query.dtype)


def _exact_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
                     scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over float columns with each row's log-sum-exp: queries [B, Hq, t, D], keys/values
    [B, Hq, L, D|Dv], bias additive float32 [B|1, Hq|1, t, L] or None (then t == L, causal)
    -> (out [B, Hq, t, Dv] normalised over these columns, lse [B, Hq, t]; -inf for a row that sees
    none of them, its out 0). SDPA's fused CPU kernel where it exists, else the same in torch; also the
    torch form when autograd records a bias that requires grad (the fused kernel has no gradient for its
    mask: an MLA model's rotary scores are such a bias outside `torch.no_grad()`)."""
    if keys.shape[-2] == 0:
        shape = queries.shape[:-1]
        return (queries.new_zeros(*shape, values.shape[-1]), queries.new_full(shape, float("-inf")))
    mask_grad = bias is not None and bias.requires_grad and torch.is_grad_enabled()
    if (queries.device.type == "cpu" and not mask_grad
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            queries, keys, values, 0.0, bias is None, attn_mask=bias, scale=scaling)
        if bias is not None:  # the kernel gives lse 0 to a row with every column masked
            lse = lse.masked_fill(torch.isneginf(bias).all(-1), float("-inf"))
        return out, lse
    if bias is None:
        size = (queries.shape[-2], keys.shape[-2])
        bias = torch.zeros(size, device=queries.device).masked_fill_(
            torch.ones(size, dtype=torch.bool, device=queries.device).triu_(1), float("-inf"))
    return attention_with_lse(queries * scaling, keys, values, bias)


def _attend_split(query: torch.Tensor, kv: CodedKV, attention_mask, scaling: float, sinks, window,
                  backend: str = "auto") -> torch.Tensor:
    """`attend_codes` for a prefill chunk: exact columns through SDPA, coded ones through the code
    kernels, merged by log-sum-exp (same result as the joint softmax to float rounding)."""
    batch, q_heads, tokens, dim = query.shape
    heads = kv.new_keys.shape[1]
    groups = q_heads // heads
    length, n_sink, coded = kv.length, kv.num_sink, kv.num_coded
    past = length - tokens
    exact_keys, exact_values = kv.exact()
    if n_sink:
        exact_keys = torch.cat([kv.sink_keys.to(exact_keys.dtype), exact_keys], dim=-2)
        exact_values = torch.cat([kv.sink_values.to(exact_values.dtype), exact_values], dim=-2)
    if sinks is None and attention_mask is None and coded == 0 and exact_keys.shape[-2] == tokens and (
            window is None or window >= length):
        # a first chunk (nothing coded, nothing before it): no merge, so no log-sum-exp is needed, and
        # this is the call transformers' SDPA attention makes for a DynamicCache (GQA without repeated keys).
        # On CUDA in the model's dtype, so that SDPA picks its flash kernel: in float32 it takes the math
        # path, which holds [B, Hq, T, T] float32 scores (19 GB at 8k tokens, 32 heads; docs/gpu.md).
        dtype = query.dtype if query.device.type == "cuda" else torch.float32
        out = torch.nn.functional.scaled_dot_product_attention(
            query.to(dtype), exact_keys.to(dtype), exact_values.to(dtype), is_causal=True, scale=scaling,
            enable_gqa=groups > 1)
        return out.transpose(1, 2).contiguous().to(query.dtype)
    exact_keys, exact_values = exact_keys.to(torch.float32), exact_values.to(torch.float32)
    queries = query.to(torch.float32)
    if groups > 1 and query.device.type == "cpu":  # SDPA's CPU kernel takes one KV head per query head
        exact_keys = exact_keys.repeat_interleave(groups, dim=1)
        exact_values = exact_values.repeat_interleave(groups, dim=1)
    value_dim = exact_values.shape[-1]
    plain_causal = attention_mask is None and coded == 0 and exact_keys.shape[-2] == tokens and (
        window is None or window >= length)
    sink_logits = None if sinks is None else sinks.to(torch.float32).reshape(1, q_heads, 1)
    out = torch.empty(batch, q_heads, tokens, value_dim, dtype=torch.float32, device=query.device)
    step = tokens if plain_causal else max(1, QUERY_ROWS_PER_BLOCK // groups)
    for start in range(0, tokens, step):
        rows = slice(start, min(start + step, tokens))
        width = rows.stop - rows.start
        block = queries[:, :, rows]
        if plain_causal:
            exact_out, exact_lse = _exact_attention(block, exact_keys, exact_values, None, scaling)
            parts = [(exact_out, exact_lse)]
        else:
            bias = _bias_block(attention_mask, rows, length, past, query.device, window)
            if bias is None:
                bias = torch.zeros(1, 1, width, length, device=query.device)
            exact_bias = torch.cat([bias[..., :n_sink], bias[..., n_sink + coded:]], dim=-1) if coded else bias
            parts = [_exact_attention(block, exact_keys, exact_values, exact_bias.contiguous(), scaling)]
            if coded:
                parts.append(_coded_part(block, kv, bias[..., n_sink:n_sink + coded], scaling, groups, backend))
        if sink_logits is not None:  # a column with a logit and no value
            parts.append((out.new_zeros(batch, q_heads, width, value_dim), sink_logits.expand(batch, q_heads, width)))
        out[:, :, rows] = merge_lse(parts)[0]
    return out.transpose(1, 2).contiguous().to(query.dtype)


def _fused(kv: CodedKV, device: torch.device, backend: str) -> bool:
    """Whether the coded columns of `kv` go through the fused Triton kernel (`AttentionOptions.fused_backend`)."""
    if backend == "off" or not kv.num_coded or kv.cold is not None:
        return False
    if backend == "auto" and (device.type != "cuda" or not triton_available()):
        return False
    return all(codec.rotated_codebook(device) is not None for codec in (kv.key_codec, kv.value_codec))


def _coded_part_fused(block: torch.Tensor, kv: CodedKV, bias: torch.Tensor, scaling: float,
                      groups: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`_coded_part` through `coded_decode_attention` (one fused kernel; GQA without repeated keys)."""
    keys, values = kv.key_codec.rotated_codebook(block.device), kv.value_codec.rotated_codebook(block.device)
    scaled = block * scaling
    out, lse = coded_decode_attention(scaled @ keys.forward, kv.key_codes, kv.value_codes, keys.codewords,
                                      values.codewords, keys.index_bits, values.index_bits,
                                      bias=bias.contiguous(), value_dim=kv.value_codec.dim,
                                      backend="auto" if backend == "auto" else "triton")
    out = out @ values.forward.T
    if kv.key_mean is not None:  # every coded score shifts by q . mu of its KV head
        lse = lse + (scaled * kv.key_mean.repeat_interleave(groups, 1).unsqueeze(2)).sum(-1)
    if kv.value_mean is not None:
        out = out + kv.value_mean.repeat_interleave(groups, 1).unsqueeze(2)
    return out, lse


def _coded_part(block: torch.Tensor, kv: CodedKV, bias: torch.Tensor, scaling: float,
                groups: int, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Hq, t, Dv] normalised over the coded columns, lse [B, Hq, t]) of query block
    [B, Hq, t, D] (unscaled) with additive bias [B|1, Hq|1, t, M] over the coded columns."""
    if _fused(kv, block.device, backend):
        return _coded_part_fused(block, kv, bias, scaling, groups, backend)
    batch, q_heads, width, dim = block.shape
    heads = q_heads // groups
    rows = (block * scaling).reshape(batch, heads, groups * width, dim)
    scores = _scores_from_codes(kv.key_codec, rows, kv.key_codes)
    if kv.key_mean is not None:
        scores = scores + rows @ kv.key_mean.unsqueeze(-1)
    if kv.cold is not None:  # recall: the top-k coded columns of each query read exactly
        return recalled_part(rows, scores, bias, kv, groups, width, _values_from_codes)
    shaped = scores.view(batch, heads, groups, width, -1)
    if bias.shape[1] == 1:
        shaped += bias.unsqueeze(1)
    else:
        shaped += bias.reshape(bias.shape[0], heads, groups, width, -1)
    # exp(s - max) in place and the value sums of those unnormalised weights, divided once per row
    # (a [rows, D] division instead of [rows, M]); a row with every column masked: lse -inf, out 0.
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = scores.sub_(peak).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    lse = peak + torch.log(total)
    mixed = _values_from_codes(kv.value_codec, weights, kv.value_codes)
    if kv.value_mean is not None:
        mixed += total * kv.value_mean.unsqueeze(-2)
    mixed /= torch.where(total > 0, total, torch.ones_like(total))
    value_dim = mixed.shape[-1]
    return (mixed.view(batch, heads, groups, width, value_dim).reshape(batch, q_heads, width, value_dim),
            lse.view(batch, q_heads, width))


def coded_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs):
    """transformers attention function: on codes for a `CodedKV`, SDPA for plain tensors.

    query [B, Hq, T, D]; returns (attn_output [B, T, Hq, Dv], None) as every transformers
    attention function does. Plain tensors with soft-capping or sinks run through
    `attend_codes` (SDPA has neither).
    """
    options = {"softcap": kwargs.get("softcap"), "sinks": kwargs.get("s_aux"), "window": kwargs.get("sliding_window")}
    eager = any(kwargs.get(name) is not None for name in _EAGER_KWARGS)
    if eager and dropout:
        raise ValueError("attention dropout with soft-capping or sinks is not implemented by fibquant's attention "
                         "(training); use the model's eager attention")
    if isinstance(key, CodedKV):
        unsupported = [name for name in _UNSUPPORTED_KWARGS if kwargs.get(name) is not None]
        if dropout:
            unsupported.append("dropout")
        if not unsupported:
            scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
            custom = getattr(module, "coded_attention", None)  # e.g. kv/attention/mla.py's latent attention
            if custom is not None:
                return custom(module, query, key, attention_mask, scaling, **options), None
            return attend_codes(query, key, attention_mask, scaling, **options), None
        _warn_once(f"kwargs:{unsupported}", f"attention on codes does not implement {unsupported}: this call "
                   "decodes the coded part and runs SDPA (the 'decode' path)")
        key, value = key.materialize()
    if eager:
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        return attend_codes(query, CodedKV.of_tensors(key, value), attention_mask, scaling, **options), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)
