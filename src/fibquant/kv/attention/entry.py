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
  their log-sum-exps. A first chunk with nothing coded and nothing before it is one causal SDPA.
  When the fused Triton kernel serves the codes (`_fused`: CUDA, or `fused_backend="triton"`) every
  chunk, decode steps included, takes this split, soft-capped ones too: the kernel caps the coded
  scores, the exact part is capped in torch (`attention_with_lse`; SDPA cannot cap). Elsewhere a
  soft-capped chunk keeps the one-softmax path (CPU decode steps: the fused numba step);
- the model's own attention options apply to coded and exact columns alike: its scale
  (`scaling`, e.g. Gemma's query_pre_attn_scalar), logit soft-capping (`softcap`, Gemma 2:
  tanh(s / c) * c before the mask and softmax), learned attention sinks (`s_aux`, gpt-oss: one
  extra logit per query head in the softmax, dropped afterwards) and sliding windows (the
  model's sliding mask, built over the columns a `CompressedSlidingLayer` holds).

Every codec is read through its `CodeReader` (`codecs.reader`; `readers` picks the registered fast path:
lookup tables for one codebook, a fused one-token step per family on the CPU: one codebook
(`codebook_step`), FibQuant-RVQ's stages (`numba_residual`), FibQuant-E8's shells (`numba_shells`), all
finishing in the shared epilogue). A codec with no reader of its own (INT, low-rank, RVQ) has its codes
decoded to floats for that role (one-time warning). Anything else falls back, never silently wrongly: options the
path does not implement (`position_bias`, dropout) decode the whole `CodedKV` and run SDPA on
it (one-time warning); caches other than a `CompressedCache` in "codes" mode are served by
transformers' SDPA unchanged, except with soft-capping or sinks, which SDPA cannot apply: those
run through this module's float path.
"""
from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fibquant.kv.buffer import CodedKV
from fibquant.kv.options import AttentionOptions
from fibquant.codecs.reader import CodebookReader
import fibquant.kv.attention.codebook_step as codebook_step
from fibquant.kv.attention.numba_epilogue import Epilogue
from fibquant.kv.attention.kernels import attention_with_lse, coded_decode_attention, merge_lse, triton_available
from fibquant.kv.attention.notices import warn_once
from fibquant.kv.attention.readers import one_token_steps, read_scores, read_values
from fibquant.kv.attention.reference import check_softcap, epilogue_weights, soft_cap
from fibquant.kv.attention.recall import check_recall, cold_rows, recalled_part

ATTENTION_NAME = "fibquant"
QUERY_ROWS_PER_BLOCK = 2048      # query rows (query heads x tokens) per KV head scored at once
# Chunks of at least this many query tokens (prefill) attend to their exact columns through SDPA
# and merge with the coded columns by log-sum-exp; shorter ones (decode) use one joint softmax.
SPLIT_MIN_TOKENS = 16
_UNSUPPORTED_KWARGS = ("position_bias",)
_EAGER_KWARGS = ("softcap", "s_aux")  # applied here; SDPA would ignore them
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
    check_softcap(softcap)
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
        plans = codebook_step.codebook_step_plans(query, kv) if cold is not None else None
        if plans is not None:  # the fused one-token kernel reads the cold rows itself
            epilogue = _with_step_bias(Epilogue(scaling, None, None, sinks), kv, attention_mask, window, query.device)
            return codebook_step.attend_codebook_step(query, kv, epilogue, plans, cold)
        return _attend_split(query, kv, attention_mask, scaling, sinks, window, options.fused_backend)
    if tokens == 1 and options.numba_decode:
        out = _attend_one_token(query, kv, attention_mask, window, Epilogue(scaling, softcap, None, sinks))
        if out is not None:
            return out
    if (softcap is None and tokens >= SPLIT_MIN_TOKENS) or _fused(kv, query.device, options.fused_backend, softcap):
        return _attend_split(query, kv, attention_mask, scaling, sinks, window, options.fused_backend, softcap)
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
    for start in range(0, tokens, step):
        rows = slice(start, min(start + step, tokens))
        width = rows.stop - rows.start
        block = queries[:, :, :, rows].reshape(batch, heads, groups * width, dim)
        scores = block @ exact_keys.transpose(-1, -2)
        if coded:
            coded_scores = read_scores(kv.key_codec, block, kv.key_codes)
            if kv.key_mean is not None:  # centred keys: q . (x_hat + mu) = q . x_hat + q . mu
                coded_scores = coded_scores + block @ kv.key_mean.unsqueeze(-1)
            scores = torch.cat([scores, coded_scores], dim=-1)
        bias = _bias_block(attention_mask, rows, length, past, query.device, window)
        if bias is not None and coded:
            bias = torch.cat([bias[..., :n_sink], bias[..., n_sink + coded:], bias[..., n_sink:n_sink + coded]], dim=-1)
        # the one epilogue (soft-cap, bias, softmax with the sink logit; a fully masked row: zeros), per query head
        weights = epilogue_weights(scores.view(batch, q_heads, width, -1), bias, softcap, sinks) \
            .view(batch, heads, groups * width, -1)
        mixed = weights[..., :n_exact] @ exact_values
        if coded:
            coded_weights = weights[..., n_exact:].contiguous()
            mixed += read_values(kv.value_codec, coded_weights, kv.value_codes)
            if kv.value_mean is not None:  # centred values: sum_i p_i mu = (sum_i p_i) mu
                mixed += coded_weights.sum(-1, keepdim=True) * kv.value_mean.unsqueeze(-2)
        if tokens == width:  # one block (every decode step): no copy into `out`
            return mixed.view(batch, heads, groups, tokens, value_dim).reshape(batch, q_heads, tokens, value_dim) \
                .transpose(1, 2).contiguous().to(query.dtype)
        out[:, :, :, rows] = mixed.view(batch, heads, groups, width, value_dim)
    return out.reshape(batch, q_heads, tokens, value_dim).transpose(1, 2).contiguous().to(query.dtype)


# --------------------------------------------------------------------- the fused one-token step (CPU)
def _attend_one_token(query: torch.Tensor, kv: CodedKV, attention_mask, window, epilogue: Epilogue):
    """A one-token step through the first registered step of the key or value reader (`readers.one_token_steps`)
    that serves these codes; None when none does (the torch path then runs)."""
    for plans_of, step in one_token_steps(kv.key_codec, kv.value_codec):
        plans = plans_of(query, kv)
        if plans is not None:
            return step(query, kv, _with_step_bias(epilogue, kv, attention_mask, window, query.device), plans)
    return None


def _with_step_bias(epilogue: Epilogue, kv: CodedKV, attention_mask, window, device) -> Epilogue:
    """`epilogue` with a one-token step's additive bias [B|1, Hq|1, 1, L] (`_bias_block`) when a mask or a
    sliding window applies."""
    if attention_mask is None and window is None:
        return epilogue
    length = kv.length
    return epilogue._replace(bias=_bias_block(attention_mask, slice(0, 1), length, length - 1, device, window))


def _exact_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
                     scaling: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over float columns with each row's log-sum-exp: queries [B, Hq, t, D], keys/values
    [B, Hq, L, D|Dv], bias additive float32 [B|1, Hq|1, t, L] or None (then t == L, causal), softcap
    None or c (scores tanh(s / c) * c before the bias) -> (out [B, Hq, t, Dv] normalised over these
    columns, lse [B, Hq, t]; -inf for a row that sees none of them, its out 0). SDPA's fused CPU kernel
    where it exists, else the same in torch (`attention_with_lse`); also the torch form with soft-capping
    (SDPA cannot cap) and when autograd records a bias that requires grad (the fused kernel has no gradient
    for its mask: an MLA model's rotary scores are such a bias outside `torch.no_grad()`)."""
    if keys.shape[-2] == 0:
        shape = queries.shape[:-1]
        return (queries.new_zeros(*shape, values.shape[-1]), queries.new_full(shape, float("-inf")))
    mask_grad = bias is not None and bias.requires_grad and torch.is_grad_enabled()
    if (queries.device.type == "cpu" and not mask_grad and softcap is None
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
    return attention_with_lse(queries * scaling, keys, values, bias, softcap=softcap)


def _attend_split(query: torch.Tensor, kv: CodedKV, attention_mask, scaling: float, sinks, window,
                  backend: str = "auto", softcap: float | None = None) -> torch.Tensor:
    """`attend_codes` for a prefill chunk (and, with the fused kernel, any chunk): exact columns through
    SDPA (soft-capped: `attention_with_lse`), coded ones through the code kernels, merged by log-sum-exp
    (same result as the joint softmax to float rounding)."""
    batch, q_heads, tokens, dim = query.shape
    heads = kv.new_keys.shape[1]
    groups = q_heads // heads
    length, n_sink, coded = kv.length, kv.num_sink, kv.num_coded
    past = length - tokens
    exact_keys, exact_values = kv.exact()
    if n_sink:
        exact_keys = torch.cat([kv.sink_keys.to(exact_keys.dtype), exact_keys], dim=-2)
        exact_values = torch.cat([kv.sink_values.to(exact_values.dtype), exact_values], dim=-2)
    if sinks is None and softcap is None and attention_mask is None and coded == 0 and exact_keys.shape[-2] == tokens \
            and (window is None or window >= length):
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
            exact_out, exact_lse = _exact_attention(block, exact_keys, exact_values, None, scaling, softcap)
            parts = [(exact_out, exact_lse)]
        else:
            bias = _bias_block(attention_mask, rows, length, past, query.device, window)
            if bias is None:
                bias = torch.zeros(1, 1, width, length, device=query.device)
            exact_bias = torch.cat([bias[..., :n_sink], bias[..., n_sink + coded:]], dim=-1) if coded else bias
            parts = [_exact_attention(block, exact_keys, exact_values, exact_bias.contiguous(), scaling, softcap)]
            if coded:
                parts.append(_coded_part(block, kv, bias[..., n_sink:n_sink + coded], scaling, groups, backend,
                                         softcap))
        if sink_logits is not None:  # a column with a logit and no value
            parts.append((out.new_zeros(batch, q_heads, width, value_dim), sink_logits.expand(batch, q_heads, width)))
        out[:, :, rows] = merge_lse(parts)[0]
    return out.transpose(1, 2).contiguous().to(query.dtype)


def _fused(kv: CodedKV, device: torch.device, backend: str, softcap: float | None = None) -> bool:
    """Whether the coded columns of `kv` go through the fused Triton kernel (`AttentionOptions.fused_backend`).
    Not for centred keys with soft-capping: the kernel scores q . x_hat and the key mean's q . mu is added to
    the log-sum-exp afterwards, exact only when no cap applies to the whole score q . (x_hat + mu)."""
    if backend == "off" or not kv.num_coded or kv.cold is not None:
        return False
    if softcap is not None and kv.key_mean is not None:
        return False
    if backend == "auto" and (device.type != "cuda" or not triton_available()):
        return False
    return all(isinstance(codec.reader(device), CodebookReader) for codec in (kv.key_codec, kv.value_codec))


def _coded_part_fused(block: torch.Tensor, kv: CodedKV, bias: torch.Tensor, scaling: float,
                      groups: int, backend: str, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`_coded_part` through `coded_decode_attention` (one fused kernel; GQA without repeated keys; soft-capping
    in the kernel, never with centred keys: `_fused`)."""
    keys, values = kv.key_codec.reader(block.device), kv.value_codec.reader(block.device)
    scaled = block * scaling
    out, lse = coded_decode_attention(scaled @ keys.forward, kv.key_codes, kv.value_codes, keys.codewords,
                                      values.codewords, keys.index_bits, values.index_bits,
                                      bias=bias.contiguous(), value_dim=kv.value_codec.dim, softcap=softcap,
                                      backend="auto" if backend == "auto" else "triton")
    out = out @ values.forward.T
    if kv.key_mean is not None:  # every coded score shifts by q . mu of its KV head
        lse = lse + (scaled * kv.key_mean.repeat_interleave(groups, 1).unsqueeze(2)).sum(-1)
    if kv.value_mean is not None:
        out = out + kv.value_mean.repeat_interleave(groups, 1).unsqueeze(2)
    return out, lse


def _coded_part(block: torch.Tensor, kv: CodedKV, bias: torch.Tensor, scaling: float,
                groups: int, backend: str = "auto", softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Hq, t, Dv] normalised over the coded columns, lse [B, Hq, t]) of query block
    [B, Hq, t, D] (unscaled) with additive bias [B|1, Hq|1, t, M] over the coded columns, the scores
    soft-capped first when softcap is set."""
    if _fused(kv, block.device, backend, softcap):
        return _coded_part_fused(block, kv, bias, scaling, groups, backend, softcap)
    batch, q_heads, width, dim = block.shape
    heads = q_heads // groups
    rows = (block * scaling).reshape(batch, heads, groups * width, dim)
    scores = read_scores(kv.key_codec, rows, kv.key_codes)
    if kv.key_mean is not None:
        scores = scores + rows @ kv.key_mean.unsqueeze(-1)
    if kv.cold is not None:  # recall: the top-k coded columns of each query read exactly (never soft-capped)
        return recalled_part(rows, scores, bias, kv, groups, width)
    scores = soft_cap(scores, softcap)
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
    mixed = read_values(kv.value_codec, weights, kv.value_codes)
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
        warn_once(f"kwargs:{unsupported}", f"attention on codes does not implement {unsupported}: this call "
                   "decodes the coded part and runs SDPA (the 'decode' path)")
        key, value = key.materialize()
    if eager:
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        return attend_codes(query, CodedKV.of_tensors(key, value), attention_mask, scaling, **options), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)
