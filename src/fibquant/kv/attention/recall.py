"""Query-aware recall: the coded part of attention with each query's top-k coded tokens read exactly.

With a cold tier (`fibquant.kv.cold`: `CompressedCache(recall=Recall(...))`, spec `@recall=K`), the coded
columns of one query block are served as follows, per KV head:

1. the coded scores s_i = q . x_hat_i of every coded token come from the code kernels, as without recall;
2. each query row (one query head at one token) picks its own top-k coded tokens by those scores (after
   the mask: a masked token is never preferred to a visible one); k = `Recall.count(coded tokens)`;
3. their exact rows are read from the cold store (`ColdStore.fetch`, counted there): each row's own k rows
   for a block of few rows (a decode step), the union of the rows' picks once per head for a larger block
   (a prefill chunk); the picked columns of a row get the exact score q . x_i and the exact value x_i,
   every other coded column keeps its coded score and coded value;
4. one softmax over the coded columns (exact-picked and coded alike) gives the part's output and its
   log-sum-exp, which `entry._attend_split` merges with the exact window by log-sum-exp: each token is
   counted once, through its exact row or through its codes, never both.

`recall_reference` is the plain torch spec of the whole attention (decoded codes, exact rows swapped in),
which the tests hold the implementation to. A one-token step on the CPU with float32 cold rows runs the
same inside the fused numba kernel (`numba_decode`, `cold_rows`); everything else runs here, through
`entry._attend_split`. Limits: no soft-capping (ValueError).
"""
from __future__ import annotations

from typing import Optional

import torch

from fibquant.kv.attention.numba_recall import row_topk
from fibquant.kv.attention.readers import read_values


def _add_bias(scores: torch.Tensor, bias: torch.Tensor, groups: int, width: int) -> None:
    """scores [B, H, G*t, M] += bias [B|1, Hq|1, t, M] (in place)."""
    batch, heads = scores.shape[:2]
    shaped = scores.view(batch, heads, groups, width, -1)
    if bias.shape[1] == 1:
        shaped += bias.unsqueeze(1)
    else:
        shaped += bias.reshape(bias.shape[0], heads, groups, width, -1)


def pick(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen bool [B, H, R, M]: each row's top-k columns, index long [B, H, u]: the union of the rows'
    picks per head in token order, padded with other columns to the longest union) of scores [B, H, R, M]."""
    top = scores.topk(k, dim=-1, sorted=False).indices
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, top, True)
    union = chosen.any(dim=-2)
    widest = int(union.sum(-1).max())
    # the union's columns first (ascending), then the others; the first `widest` columns of each head
    order = torch.argsort((~union).to(torch.int8), dim=-1, stable=True)[..., :widest]
    return chosen, order.sort(dim=-1).values


def recalled_part(rows: torch.Tensor, scores: torch.Tensor, bias: torch.Tensor, kv, groups: int,
                  width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Hq, t, Dv] normalised over the coded columns, lse [B, Hq, t]) with recall.

    rows: scaled queries [B, H, G*t, D] (float32); scores: their coded scores [B, H, G*t, M] (centring
    included, no mask; overwritten); bias: additive [B|1, Hq|1, t, M] over the coded columns; kv: the
    `CodedKV` (with `kv.cold`); the coded value sums are read through the value codec's reader
    (`readers.read_values`)."""
    batch, heads, n_rows, coded = scores.shape
    if bias.shape[-2] > 1 or bool(bias.any()):  # a decode step without a mask has a zero bias: nothing to add
        _add_bias(scores, bias, groups, width)
    else:
        bias = None
    k = kv.cold.recall.count(coded)
    if k:
        picked, exact_values = _recall(rows, scores, bias, kv.cold, k, groups, width)
    peak = scores.amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(scores.dtype).min)  # all masked: finite
    weights = scores.sub_(peak).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    lse = peak + torch.log(total)
    if k:
        columns, exact_of_row = picked
        gathered = weights.gather(-1, columns)
        exact_weights = gathered if exact_of_row is None else gathered * exact_of_row
        weights.scatter_(-1, columns, gathered - exact_weights)  # picked columns count through exact rows only
    mixed = read_values(kv.value_codec, weights, kv.value_codes)
    if kv.value_mean is not None:  # the mean is added back to coded values only
        mixed += weights.sum(dim=-1, keepdim=True) * kv.value_mean.unsqueeze(-2)
    if k:
        if exact_values.ndim == 5:  # each row its own exact rows
            mixed += (exact_weights.unsqueeze(-2) @ exact_values).squeeze(-2)
        else:
            mixed += exact_weights @ exact_values
    mixed /= torch.where(total > 0, total, torch.ones_like(total))
    value_dim = mixed.shape[-1]
    return (mixed.view(batch, heads, groups, width, value_dim).reshape(batch, heads * groups, width, value_dim),
            lse.view(batch, heads * groups, width))


def _bias_at(bias: torch.Tensor, columns: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """The additive bias [B|1, Hq|1, t, M] at `columns` (long [B, H, G*t, j]) -> [B, H, G*t, j]."""
    batch, heads, n_rows, count = columns.shape
    shaped = bias.unsqueeze(1) if bias.shape[1] == 1 else bias.view(bias.shape[0], heads, groups, width, -1)
    shaped = shaped.expand(batch, heads, groups, width, shaped.shape[-1])
    return shaped.gather(-1, columns.view(batch, heads, groups, width, count)).view(batch, heads, n_rows, count)


def _recall(rows: torch.Tensor, scores: torch.Tensor, bias: torch.Tensor, cold, k: int, groups: int, width: int):
    """Swap each row's top-k coded scores (biased, in `scores`) for exact ones (+ bias), in place. Returns
    ((columns long [B, H, R, j], exact_of_row: None when every one of a row's `columns` is now exact, else
    bool [B, H, R, j]: which are), exact values [B, H, R, k, Dv] (a row's own) or [B, H, j, Dv] (shared)).

    A block of few rows (R * k <= M, e.g. a decode step) reads each row's k rows (j = k); a larger block
    reads the union of its rows' picks once per head (j = the widest union, `pick`)."""
    batch, heads, n_rows, coded = scores.shape
    if n_rows * k <= coded:
        top = row_topk(scores, k)  # [B, H, R, k]
        keys, values = cold.fetch(top.reshape(batch, heads, n_rows * k))
        keys = keys.to(torch.float32).view(batch, heads, n_rows, k, -1)
        exact = (keys @ rows.unsqueeze(-1)).squeeze(-1)
        if bias is not None:
            exact += _bias_at(bias, top, groups, width)
        scores.scatter_(-1, top, exact)
        return (top, None), values.to(torch.float32).view(batch, heads, n_rows, k, -1)
    chosen, index = pick(scores, k)
    keys, values = (t.to(torch.float32) for t in cold.fetch(index))
    columns = index.unsqueeze(2).expand(batch, heads, n_rows, index.shape[-1])
    exact = rows @ keys.transpose(-1, -2)
    if bias is not None:
        exact += _bias_at(bias, columns, groups, width)
    exact_of_row = chosen.gather(-1, columns)
    scores.scatter_(-1, columns, torch.where(exact_of_row, exact, scores.gather(-1, columns)))
    return (columns, exact_of_row), values


def cold_rows(cold):
    """(keys, values) of a cold store as float32 numpy arrays [tokens * B * H, D] (the same memory) for the
    fused one-token kernel (`numba_decode`), or None when its rows are not float32 on the host."""
    if cold.dtype is not torch.float32 or cold.device.type != "cpu":
        return None
    return tuple(rows.data.view(-1, rows.shape[-1]).numpy() for rows in (cold.keys, cold.values))


def check_recall(softcap: Optional[float]) -> None:
    if softcap is not None:
        raise ValueError("recall does not implement logit soft-capping (e.g. Gemma 2): build the cache without "
                         "recall for this model")


def recall_reference(query: torch.Tensor, kv, scaling: float) -> torch.Tensor:
    """The spec of attention with recall, in plain torch, for a causal chunk (no mask, sinks or window):
    query [B, Hq, T, D] over `kv` (a `CodedKV` with `kv.cold`) -> [B, T, Hq, Dv] float32. Every coded key
    and value decoded; per query row the top-k coded columns by decoded score (causal mask applied) take
    their exact rows from the cold store; one softmax over all columns."""
    keys, values = (t.to(torch.float32) for t in kv.materialize())
    batch, q_heads, tokens, _ = query.shape
    groups = q_heads // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    queries = query.to(torch.float32) * scaling
    scores = queries @ keys.transpose(-1, -2)  # [B, Hq, T, L]
    length, start, coded = keys.shape[-2], kv.num_sink, kv.num_coded
    causal = torch.arange(length).view(1, length) > (length - tokens + torch.arange(tokens)).view(tokens, 1)
    scores = scores.masked_fill(causal, float("-inf"))
    k = kv.cold.recall.count(coded)
    if k:
        cold_keys, cold_values = (t.to(torch.float32)[..., :coded, :].repeat_interleave(groups, 1)
                                  for t in kv.cold.rows())
        top = scores[..., start:start + coded].topk(k, dim=-1).indices
        chosen = torch.zeros(*scores.shape[:-1], coded, dtype=torch.bool).scatter_(-1, top, True)
        exact = (queries @ cold_keys.transpose(-1, -2)).masked_fill(causal[:, start:start + coded], float("-inf"))
        scores[..., start:start + coded] = torch.where(chosen, exact, scores[..., start:start + coded])
        weights = torch.softmax(scores, dim=-1)
        coded_weights = weights[..., start:start + coded]
        out = weights[..., :start] @ values[..., :start, :] + weights[..., start + coded:] @ values[..., start + coded:, :]
        out = out + coded_weights.masked_fill(chosen, 0.0) @ values[..., start:start + coded, :] \
            + coded_weights.masked_fill(~chosen, 0.0) @ cold_values
    else:
        out = torch.softmax(scores, dim=-1) @ values
    return out.transpose(1, 2)
