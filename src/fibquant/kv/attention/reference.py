"""Code-row checks and the plain torch reference of attention on codes (the spec of
`fibquant.kv.attention.kernels`; any device). Layout of a code row: see that module's docstring.

Besides the two drop-ins (`coded_scores_reference`, `coded_weighted_sum_reference`) this module
holds the spec of the fused decode attention (`coded_decode_attention_reference`, the Triton
kernel's spec), the epilogue every fast path applies to a row of scores (`epilogue_weights`: soft-capping
(`soft_cap`), bias, softmax with learned sinks), dense attention that also returns the log-sum-exp (`attention_with_lse`),
and the exact merge of attention parts over disjoint column sets (`merge_lse`).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from fibquant.codecs.bitpack import MAX_BITS, bytes_to_float16, packed_size, unpack_bits
from fibquant.codecs.bitpack import NORM_BYTES

BACKENDS = ("auto", "torch", "numba", "triton")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_codebook(codewords, index_bits) -> tuple[int, int]:
    if not isinstance(codewords, torch.Tensor):
        raise ValueError(f"codewords must be a torch.Tensor, got {type(codewords).__name__}")
    if codewords.dtype != torch.float32:
        raise ValueError(f"codewords must be float32, got dtype {codewords.dtype}")
    if codewords.ndim != 2 or codewords.shape[0] < 1 or codewords.shape[1] < 1:
        raise ValueError(f"codewords must have shape [N, k] with N, k >= 1, got {tuple(codewords.shape)}")
    if not _is_int(index_bits) or not 1 <= index_bits <= MAX_BITS:
        raise ValueError(f"index_bits must be an integer in 1..{MAX_BITS}, got {index_bits!r}")
    n_codewords, k = codewords.shape
    if n_codewords > 1 << index_bits:
        raise ValueError(f"index_bits={index_bits} cannot address N={n_codewords} codewords "
                         f"(need at least {max(1, math.ceil(math.log2(n_codewords)))})")
    return int(n_codewords), int(k)


def _check_codes(codes) -> None:
    if not isinstance(codes, torch.Tensor):
        raise ValueError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be torch.uint8, got dtype {codes.dtype}")
    if codes.ndim != 4:
        raise ValueError(f"codes must have shape [B, H, M, code_size], got {tuple(codes.shape)}")


def _check_float4(tensor, name: str, shape_doc: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got dtype {tensor.dtype}")
    if tensor.ndim != 4:
        raise ValueError(f"{name} must have shape {shape_doc}, got {tuple(tensor.shape)}")


def _check_device(tensor: torch.Tensor, codes: torch.Tensor, name: str) -> None:
    if tensor.device != codes.device:
        raise ValueError(f"{name} ({tensor.device}) and codes ({codes.device}) must be on the same device")


def _check_code_size(name: str, code_size: int, dim_name: str, dim: int, k: int, index_bits: int,
                     hint: str = "") -> None:
    """ValueError unless a code row of `dim` coordinates in k-blocks of `index_bits` is `code_size` bytes."""
    expected = NORM_BYTES + packed_size(dim // k, index_bits)
    if code_size != expected:
        raise ValueError(f"{name} have code_size={code_size} bytes, but {dim_name}={dim}, k={k}, "
                         f"index_bits={index_bits} need {expected}{hint}")


def _validate_scores(queries, codes, codewords, index_bits) -> tuple[int, int, int]:
    """-> (N, k, n_blocks)."""
    n_codewords, k = _check_codebook(codewords, index_bits)
    _check_float4(queries, "queries", "[B, H, Q, D]")
    _check_codes(codes)
    _check_device(queries, codes, "queries")
    bq, hq, _, dim = queries.shape
    bc, hc, _, code_size = codes.shape
    if (bq, hq) != (bc, hc):
        raise ValueError(f"queries [B={bq}, H={hq}, ...] and codes [B={bc}, H={hc}, ...] disagree on B/H")
    if dim % k:
        raise ValueError(f"query dim D={dim} is not a multiple of the codeword size k={k}")
    n_blocks = dim // k
    _check_code_size("codes", code_size, "D", dim, k, index_bits,
                     f" ({NORM_BYTES} norm bytes + {n_blocks} x {index_bits} bits)")
    return n_codewords, k, n_blocks


def _validate_weighted_sum(weights, codes, codewords, index_bits, dim) -> tuple[int, int, int]:
    """-> (N, k, n_blocks)."""
    n_codewords, k = _check_codebook(codewords, index_bits)
    _check_float4(weights, "weights", "[B, H, Q, M]")
    _check_codes(codes)
    _check_device(weights, codes, "weights")
    bw, hw, _, mw = weights.shape
    bc, hc, mc, code_size = codes.shape
    if (bw, hw) != (bc, hc):
        raise ValueError(f"weights [B={bw}, H={hw}, ...] and codes [B={bc}, H={hc}, ...] disagree on B/H")
    if mw != mc:
        raise ValueError(f"weights have M={mw} tokens but codes have M={mc}")
    if code_size < NORM_BYTES:
        raise ValueError(f"code_size={code_size} is smaller than the {NORM_BYTES} norm bytes")
    if dim is None:
        # The largest block count whose indices fit the index bytes (exact whenever, as for every
        # FibQuant/TurboQuant config with 8 | D*w/k, the packing has no spare index-sized slot).
        n_blocks = (code_size - NORM_BYTES) * 8 // index_bits
        if n_blocks < 1:
            raise ValueError(f"code_size={code_size} holds no {index_bits}-bit index")
    else:
        if not _is_int(dim) or dim < 1 or dim % k:
            raise ValueError(f"dim must be a positive multiple of k={k}, got {dim!r}")
        n_blocks = dim // k
    _check_code_size("codes", code_size, "D", n_blocks * k, k, index_bits)
    return n_codewords, k, n_blocks


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


# --------------------------------------------------------------------------- torch reference
def _unpack(codes: torch.Tensor, codewords: torch.Tensor, index_bits: int, n_blocks: int):
    """codes [..., C] -> (indices int64 [..., n_blocks], norms float32 [...]) with the index check."""
    index = unpack_bits(codes[..., NORM_BYTES:], index_bits, n_blocks)
    n_codewords = codewords.shape[0]
    if n_codewords != 1 << index_bits and index.numel() and int(index.max()) >= n_codewords:
        raise ValueError(f"codes hold an index >= N={n_codewords} (index_bits={index_bits})")
    return index, bytes_to_float16(codes[..., :NORM_BYTES])


def _decoded_rotated(codes, codewords, index_bits, n_blocks) -> torch.Tensor:
    """codes [B, H, M, C] -> rotated decoded vectors nu * concat_j c[idx_j], float32 [B, H, M, D]."""
    index, norms = _unpack(codes, codewords, index_bits, n_blocks)
    codewords = codewords.to(codes.device)
    units = codewords[index].reshape(*index.shape[:-1], n_blocks * codewords.shape[1])
    return units * norms.unsqueeze(-1)


def coded_scores_reference(queries: torch.Tensor, codes: torch.Tensor, codewords: torch.Tensor,
                           index_bits: int) -> torch.Tensor:
    """The spec of `coded_scores`: unpack, gather the codewords, scale by nu, einsum (any device)."""
    _, _, n_blocks = _validate_scores(queries, codes, codewords, index_bits)
    keys = _decoded_rotated(codes, codewords, index_bits, n_blocks)
    return torch.einsum("bhqd,bhmd->bhqm", queries, keys)


def coded_weighted_sum_reference(weights: torch.Tensor, codes: torch.Tensor, codewords: torch.Tensor,
                                 index_bits: int, *, dim: Optional[int] = None) -> torch.Tensor:
    """The spec of `coded_weighted_sum`: unpack, gather, scale by nu, einsum (any device)."""
    _, _, n_blocks = _validate_weighted_sum(weights, codes, codewords, index_bits, dim)
    values = _decoded_rotated(codes, codewords, index_bits, n_blocks)
    return torch.einsum("bhqm,bhmd->bhqd", weights, values)



# --------------------------------------------------------------------------- fused decode attention (spec)
def _check_bias(bias, batch: int, q_heads: int, n_q: int, n_tokens: int, device) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise ValueError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if bias.dtype != torch.float32:
        raise ValueError(f"bias must be float32 (additive, -inf = masked), got dtype {bias.dtype}")
    if bias.device != device:
        raise ValueError(f"bias ({bias.device}) and codes ({device}) must be on the same device")
    shape = tuple(bias.shape)
    if (bias.ndim != 4 or shape[0] not in (1, batch) or shape[1] not in (1, q_heads)
            or shape[2:] != (n_q, n_tokens)):
        raise ValueError(f"bias must have shape [B|1, 1|Hq, Q, M] = [{batch}|1, 1|{q_heads}, {n_q}, {n_tokens}], "
                         f"got {shape}")


def _validate_decode(queries, key_codes, value_codes, key_codewords, value_codewords, key_bits, value_bits,
                     bias, value_dim) -> tuple[int, int, int, int]:
    """Checks of `coded_decode_attention` -> (key n_blocks, value n_blocks, groups = Hq / Hkv, Dv)."""
    _check_float4(queries, "queries", "[B, Hq, Q, D]")
    _check_codes(key_codes)
    _check_codes(value_codes)
    _check_device(queries, key_codes, "queries")
    _check_device(value_codes, key_codes, "value_codes")
    _, k_key = _check_codebook(key_codewords, key_bits)
    _, k_value = _check_codebook(value_codewords, value_bits)
    batch, q_heads, n_q, dim = queries.shape
    bk, hk, mk, key_size = key_codes.shape
    bv, hv, mv, value_size = value_codes.shape
    if (bk, hk, mk) != (bv, hv, mv):
        raise ValueError(f"key_codes [B, H, M] = {(bk, hk, mk)} and value_codes {(bv, hv, mv)} disagree")
    if bk != batch:
        raise ValueError(f"queries have B={batch} but codes have B={bk}")
    if hk < 1 or q_heads % hk:
        raise ValueError(f"{q_heads} query heads are not a multiple of {hk} KV heads")
    if dim % k_key:
        raise ValueError(f"query dim D={dim} is not a multiple of the key codeword size k={k_key}")
    key_blocks = dim // k_key
    _check_code_size("key_codes", key_size, "D", dim, k_key, key_bits)
    value_dim = dim if value_dim is None else value_dim
    if not _is_int(value_dim) or value_dim < 1 or value_dim % k_value:
        raise ValueError(f"value_dim must be a positive multiple of the value codeword size k={k_value}, "
                         f"got {value_dim!r}")
    value_blocks = value_dim // k_value
    _check_code_size("value_codes", value_size, "Dv", value_dim, k_value, value_bits, " (pass value_dim when Dv != D)")
    _check_bias(bias, batch, q_heads, n_q, mk, key_codes.device)
    return key_blocks, value_blocks, q_heads // hk, value_dim


def check_softcap(softcap) -> None:
    """ValueError unless `softcap` is None or a positive finite number (the c of tanh(s / c) * c)."""
    if softcap is None:
        return
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < math.inf:
        raise ValueError(f"softcap must be a positive number (finite) or None, got {softcap!r}")


def soft_cap(scores: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """Logit soft-capping (Gemma 2): tanh(s / softcap) * softcap of scaled scores; unchanged when softcap is None.
    Every path caps its scores here or in a kernel tested against it (`numba_epilogue`, `triton_kernels`)."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def epilogue_weights(scores: torch.Tensor, bias: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
                     sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The spec of the attention epilogue every fast path shares (`numba_epilogue`): scores [..., Hq, t, L]
    (scaled) -> softmax weights of the same shape. softcap: tanh(s / softcap) * softcap first (Gemma 2,
    `soft_cap`); bias: additive, broadcast over the scores (-inf masks a column); sinks [Hq]: one more logit
    per query head in the softmax, with no value (its weight dropped). A row with every column masked: zeros."""
    scores = soft_cap(scores, softcap)
    if bias is not None:
        scores = scores + bias
    if sinks is None:
        return torch.softmax(scores, dim=-1).nan_to_num(0.0)
    column = sinks.to(scores.dtype).reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


def attention_with_lse(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       bias: Optional[torch.Tensor] = None, *,
                       softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of one column set, with its log-sum-exp (plain torch, any device, float32).

    queries [B, Hq, Q, D] (already scaled), keys [B, Hkv, L, D], values [B, Hkv, L, Dv] (GQA:
    query head hq reads KV head hq // (Hq / Hkv)), bias None or additive [B|1, 1|Hq, Q, L]
    (-inf = masked), softcap None or c > 0 -> with s = cap(q.K^T) + bias, cap = `soft_cap` (identity
    without softcap): (out [B, Hq, Q, Dv] = softmax(s) @ V, lse [B, Hq, Q] = logsumexp(s)).
    A fully masked row (or L = 0): out = 0, lse = -inf, no NaN.
    The pieces of one attention row over disjoint column sets merge exactly with `merge_lse`.
    """
    check_softcap(softcap)
    batch, q_heads, n_q, dim = queries.shape
    heads, length = keys.shape[1], keys.shape[2]
    if q_heads % max(heads, 1):
        raise ValueError(f"{q_heads} query heads are not a multiple of {heads} KV heads")
    groups = q_heads // heads
    q = queries.to(torch.float32).reshape(batch, heads, groups * n_q, dim)
    scores = soft_cap((q @ keys.to(torch.float32).transpose(-1, -2)).reshape(batch, q_heads, n_q, length), softcap)
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1) if length else scores.new_full((batch, q_heads, n_q), float("-inf"))
    finite = torch.isfinite(lse)
    weights = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(-1))
    weights = weights.reshape(batch, heads, groups * n_q, length)
    out = (weights @ values.to(torch.float32)).reshape(batch, q_heads, n_q, values.shape[-1])
    return out.masked_fill(~finite.unsqueeze(-1), 0.0), lse


def merge_lse(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of attention over disjoint column sets: parts [(out_i [..., Dv], lse_i [...]), ...]
    (each out_i normalised within its own columns, lse_i its log-sum-exp of scores) -> (out, lse) of
    attention over the union: lse = logsumexp_i lse_i, out = sum_i exp(lse_i - lse) out_i.

    Parts with lse_i = -inf (no visible column) weigh 0; a row where every part is -inf gives
    out = 0, lse = -inf (no NaN). Shapes must agree; float32 recommended (the result is float32).
    """
    parts = list(parts)
    if not parts:
        raise ValueError("merge_lse needs at least one (out, lse) part")
    for out, lse in parts:
        if not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor):
            raise ValueError("merge_lse parts must be (out, lse) tensor pairs")
        if tuple(out.shape[:-1]) != tuple(lse.shape) or tuple(lse.shape) != tuple(parts[0][1].shape) \
                or out.shape[-1] != parts[0][0].shape[-1]:
            raise ValueError(f"merge_lse parts disagree: out {tuple(out.shape)}, lse {tuple(lse.shape)} "
                             f"vs first out {tuple(parts[0][0].shape)}, lse {tuple(parts[0][1].shape)}")
    if len(parts) == 1:
        out, lse = parts[0]
        return out.to(torch.float32), lse.to(torch.float32)
    lses = torch.stack([lse.to(torch.float32) for _, lse in parts])
    total = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    scale = torch.exp(lses - safe)  # 0 where lse_i = -inf; every entry 0 on a fully masked row
    out = sum(scale[i].unsqueeze(-1) * part.to(torch.float32) for i, (part, _) in enumerate(parts))
    return out, total


def coded_decode_attention_reference(queries: torch.Tensor, key_codes: torch.Tensor, value_codes: torch.Tensor,
                                     key_codewords: torch.Tensor, value_codewords: torch.Tensor,
                                     key_bits: int, value_bits: int, bias: Optional[torch.Tensor] = None,
                                     *, value_dim: Optional[int] = None,
                                     softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec of `kernels.coded_decode_attention`: decode both code sets in the rotated
    domain, then `attention_with_lse` (any device).

    queries float32 [B, Hq, Q, D] rotated by the key codec (q @ forward) and already scaled;
    key_codes uint8 [B, Hkv, M, Ck], value_codes uint8 [B, Hkv, M, Cv]; codewords float32 [N, k]
    per role; bias None or float32 additive [B|1, 1|Hq, Q, M]; softcap None or c > 0 (scores
    tanh(s / c) * c before the bias) -> (out [B, Hq, Q, Dv] in the value codec's rotated domain,
    normalised over the M coded columns; lse [B, Hq, Q] of the capped scores + bias).
    """
    key_blocks, value_blocks, _, _ = _validate_decode(queries, key_codes, value_codes, key_codewords,
                                                      value_codewords, key_bits, value_bits, bias, value_dim)
    check_softcap(softcap)
    keys = _decoded_rotated(key_codes, key_codewords, key_bits, key_blocks)
    values = _decoded_rotated(value_codes, value_codewords, value_bits, value_blocks)
    return attention_with_lse(queries, keys, values, bias, softcap=softcap)


# --------------------------------------------------------------------------- paged (vLLM) decode attention
def _validate_paged(queries, pages, block_tables, context_lens, context_starts, key_codewords, value_codewords,
                    key_bits, value_bits, key_bytes, value_dim) -> tuple[int, int, int, int, torch.Tensor,
                                                                         torch.Tensor]:
    """Checks of `coded_decode_attention_paged` -> (key code size, value code size, Dv, max coded tokens,
    starts int32 [R], stops int32 [R] on the pages' device)."""
    _check_float4(queries, "queries", "[R, Hq, Q, D]")
    if not isinstance(pages, torch.Tensor) or pages.dtype != torch.uint8 or pages.ndim != 4:
        raise ValueError("pages must be a uint8 tensor [num_blocks, Hkv, block_size, slot_bytes], got "
                         + (f"{pages.dtype} {tuple(pages.shape)}" if isinstance(pages, torch.Tensor)
                            else type(pages).__name__))
    if pages.shape[-1] > 1 and pages.stride(-1) != 1:
        raise ValueError("pages must hold each slot's bytes contiguously (stride 1 in the last dimension)")
    _check_device(queries, pages, "queries")
    _, k_key = _check_codebook(key_codewords, key_bits)
    _, k_value = _check_codebook(value_codewords, value_bits)
    batch, q_heads, _, dim = queries.shape
    _, kv_heads, block_size, slot_bytes = pages.shape
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    if block_size < 1:
        raise ValueError("pages have block_size 0")
    if dim % k_key:
        raise ValueError(f"query dim D={dim} is not a multiple of the key codeword size k={k_key}")
    key_size = NORM_BYTES + packed_size(dim // k_key, key_bits)
    value_dim = dim if value_dim is None else value_dim
    if not _is_int(value_dim) or value_dim < 1 or value_dim % k_value:
        raise ValueError(f"value_dim must be a positive multiple of the value codeword size k={k_value}, "
                         f"got {value_dim!r}")
    value_size = NORM_BYTES + packed_size(value_dim // k_value, value_bits)
    if not _is_int(key_bytes) or key_bytes < key_size or key_bytes + value_size > slot_bytes:
        raise ValueError(f"key_bytes={key_bytes!r}: the key code ({key_size} bytes) must fit before it and the "
                         f"value code ({value_size} bytes) after it in a slot of {slot_bytes} bytes")
    if not isinstance(block_tables, torch.Tensor) or block_tables.ndim != 2 or block_tables.shape[0] != batch \
            or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be an int32/int64 tensor [R={batch}, max_blocks], got "
                         + (f"{block_tables.dtype} {tuple(block_tables.shape)}"
                            if isinstance(block_tables, torch.Tensor) else type(block_tables).__name__))
    _check_device(block_tables, pages, "block_tables")

    def positions(value, name):
        if isinstance(value, torch.Tensor):
            if value.shape != (batch,) or value.dtype.is_floating_point or value.dtype == torch.bool:
                raise ValueError(f"{name} must be an integer tensor [R={batch}], got {value.dtype} "
                                 f"{tuple(value.shape)}")
            host = value.detach().to("cpu").tolist() if value.device.type == "cpu" else None
            return value.detach().to(device=pages.device, dtype=torch.int32), host
        if _is_int(value):
            value = [value] * batch
        value = list(value)
        if len(value) != batch or not all(_is_int(v) for v in value):
            raise ValueError(f"{name} must be {batch} integers (or a tensor [R])")
        return torch.tensor(value, dtype=torch.int32, device=pages.device), value

    stops, stop_list = positions(context_lens, "context_lens")
    starts, start_list = positions(0 if context_starts is None else context_starts, "context_starts")
    capacity = block_tables.shape[1] * block_size
    if stop_list is not None and start_list is not None:
        if any(a < 0 or b > capacity for a, b in zip(start_list, stop_list)):
            raise ValueError(f"coded positions [context_starts, context_lens) must lie in [0, {capacity}) "
                             f"(max_blocks x block_size); got starts {start_list}, lens {stop_list}")
        longest = max([b - a for a, b in zip(start_list, stop_list)] + [0])
    else:  # device tensors: no sync here, the block table's capacity bounds every length
        longest = capacity
    return key_size, value_size, value_dim, longest, starts, stops


def gather_paged_codes(pages: torch.Tensor, block_tables: torch.Tensor, request: int, start: int, stop: int,
                       key_bytes: int, key_size: int, value_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value codes [1, Hkv, stop - start, C] of positions [start, stop) of one request:
    position p is slot p % block_size of page block_tables[request, p // block_size]."""
    block_size = pages.shape[2]
    positions = torch.arange(start, stop, device=pages.device)
    blocks = block_tables[request].to(torch.long)[positions // block_size]
    rows = pages[blocks, :, positions % block_size]                      # [L, Hkv, slot]
    rows = rows.permute(1, 0, 2).unsqueeze(0)
    return rows[..., :key_size], rows[..., key_bytes:key_bytes + value_size]


def coded_decode_attention_paged_reference(queries: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor,
                                           context_lens, key_codewords: torch.Tensor, value_codewords: torch.Tensor,
                                           key_bits: int, value_bits: int, key_bytes: int, *, context_starts=None,
                                           value_dim: Optional[int] = None,
                                           softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec of `kernels.coded_decode_attention_paged`: per request, gather its coded rows
    through the block table (`gather_paged_codes`), then `coded_decode_attention_reference`
    (softcap: as there)."""
    key_size, value_size, value_dim, _, starts, stops = _validate_paged(
        queries, pages, block_tables, context_lens, context_starts, key_codewords, value_codewords, key_bits,
        value_bits, key_bytes, value_dim)
    check_softcap(softcap)
    batch, q_heads, n_q, _ = queries.shape
    out = torch.zeros(batch, q_heads, n_q, value_dim, dtype=torch.float32, device=queries.device)
    lse = torch.full((batch, q_heads, n_q), float("-inf"), dtype=torch.float32, device=queries.device)
    for request, (start, stop) in enumerate(zip(starts.tolist(), stops.tolist())):
        if stop <= start:
            continue
        key_codes, value_codes = gather_paged_codes(pages, block_tables, request, start, stop, key_bytes, key_size,
                                                    value_size)
        out[request], lse[request] = (t[0] for t in coded_decode_attention_reference(
            queries[request:request + 1], key_codes, value_codes, key_codewords, value_codewords, key_bits,
            value_bits, value_dim=value_dim, softcap=softcap))
    return out, lse
