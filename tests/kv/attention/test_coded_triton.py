"""Triton kernels of attention on codes (kv/attention/triton_kernels.py) == the torch reference (kv/attention/reference.py).

Without a GPU the kernels run on CPU tensors in Triton's interpreter: TRITON_INTERPRET=1 is set
only while this module imports fibquant.kv.attention.triton_kernels (triton reads it when `triton.language` is
first imported and when a kernel is decorated; triton_kernels keeps it set during its own launches),
then restored, so the other test modules in the same pytest process see the environment they had.
With a CUDA GPU the same tests run the compiled kernels on CUDA tensors.
Interpreter cases are kept small (the file runs in under a minute on two cores).
Skipped with a reason when triton is not installed (pip install 'fibquant[gpu]').
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install 'fibquant[gpu]')", allow_module_level=True)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

if not CUDA and "triton" not in sys.modules:
    # Triton decides interpreter vs compiler when `triton.language` (its standard library of jitted
    # functions) is imported and when each kernel is decorated: set the variable for that import only.
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import fibquant.kv.attention.triton_kernels as coded_triton
    finally:
        if _saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = _saved
else:
    import fibquant.kv.attention.triton_kernels as coded_triton

if not CUDA and not coded_triton.INTERPRETED:
    pytest.skip("triton was imported in this process without TRITON_INTERPRET=1 before this module, and there is "
                "no CUDA GPU to run the compiled kernels on", allow_module_level=True)

from fibquant.codecs.bitpack import float16_to_bytes, pack_bits  # noqa: E402
from fibquant.codecs.fibquant import FibQuantCodec  # noqa: E402
from fibquant.codecs.turboquant import TurboQuantCodec  # noqa: E402
import fibquant.kv.attention.kernels as ck  # noqa: E402
from fibquant.kv.attention import notices  # noqa: E402
from fibquant.kv.attention.kernels import (attention_with_lse, coded_decode_attention,  # noqa: E402
                                       coded_decode_attention_paged, coded_decode_attention_paged_reference,
                                       coded_decode_attention_reference, coded_scores, coded_scores_reference,
                                       coded_weighted_sum, coded_weighted_sum_reference, merge_lse)
from fibquant.kv.attention.reference import _decoded_rotated  # noqa: E402
from fibquant.kv.options import AttentionOptions  # noqa: E402

SCORE_ATOL = 1e-4   # max abs error of scores (norms <= 2, unit-scale codewords, Gaussian queries)
OUT_RTOL = 1e-4     # max abs error of outputs relative to the largest output magnitude

# (D, k, index_bits, N): every TurboQuant width 1..4, FibQuant 8/10/12-bit and k = 1/2/4/8, N < 2^w.
CONFIGS = [
    (64, 1, 1, 2), (64, 1, 2, 4), (64, 1, 3, 8), (64, 1, 4, 16),
    (64, 2, 8, 256), (64, 4, 10, 1024), (64, 4, 12, 4096), (64, 8, 8, 256),
    (64, 2, 7, 100), (64, 4, 12, 3000), (128, 4, 8, 256), (96, 4, 11, 2048), (64, 16, 8, 256),
]


def random_codes(shape, dim, k, bits, n_codewords, seed, device=DEVICE, zero_rows=True):
    """Valid code rows uint8 [*shape, 2 + ceil(dim/k * bits / 8)] (random indices < N, fp16 norms in [0, 2],
    the first row of each head a zero norm) and codewords float32 [N, k]."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, n_codewords, (*shape, dim // k), generator=gen)
    norms = torch.rand(*shape, generator=gen) * 2
    if zero_rows and shape[-1]:
        norms[..., 0] = 0.0
    codes = torch.cat([float16_to_bytes(norms), pack_bits(index, bits)], dim=-1)
    codewords = torch.randn(n_codewords, k, generator=gen) / k ** 0.5
    return codes.to(device), codewords.to(device)


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def assert_out_close(actual, expected, rtol=OUT_RTOL):
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    assert not torch.isnan(actual).any()
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    err = float((actual - expected).abs().max()) if expected.numel() else 0.0
    assert err <= rtol * max(scale, 1e-30), (err, scale)


def assert_lse_close(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected))
    finite = torch.isfinite(expected)
    assert torch.isfinite(actual[finite]).all()
    if finite.any():
        assert float((actual[finite] - expected[finite]).abs().max()) <= SCORE_ATOL


# --------------------------------------------------------------------------- drop-ins
@pytest.mark.parametrize("dim,k,bits,n_codewords", CONFIGS)
def test_scores_and_weighted_sum_match_reference(dim, k, bits, n_codewords):
    codes, codewords = random_codes((2, 2, 70), dim, k, bits, n_codewords, seed=bits * 7 + k)
    queries = randn(2, 2, 5, dim, seed=1)
    weights = torch.softmax(randn(2, 2, 5, 70, seed=2) * 3, dim=-1)
    scores = coded_scores(queries, codes, codewords, bits, backend="triton")
    expected = coded_scores_reference(queries, codes, codewords, bits)
    assert scores.shape == expected.shape == (2, 2, 5, 70)
    assert float((scores - expected).abs().max()) <= SCORE_ATOL
    assert_out_close(coded_weighted_sum(weights, codes, codewords, bits, backend="triton"),
                     coded_weighted_sum_reference(weights, codes, codewords, bits))


def test_real_codecs_match_reference():
    """FibQuant k=4 N=256 (shipped d=64 codebook) and TurboQuant 3-bit on real encodings."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 80, 64, generator=gen) * torch.exp(torch.randn(1, 2, 80, 1, generator=gen))
    for codec in (FibQuantCodec(64, 4, 256), TurboQuantCodec(64, 3)):
        codes = codec.encode(x).to(DEVICE)
        book = codec.reader(DEVICE)
        queries = randn(1, 2, 3, 64, seed=4)
        scores = coded_scores(queries, codes, book.codewords, book.index_bits, backend="triton")
        expected = coded_scores_reference(queries, codes, book.codewords, book.index_bits)
        assert_out_close(scores, expected)
        weights = torch.softmax(expected, dim=-1)
        assert_out_close(coded_weighted_sum(weights, codes, book.codewords, book.index_bits, backend="triton"),
                         coded_weighted_sum_reference(weights, codes, book.codewords, book.index_bits))


def test_weighted_sum_splits_and_many_queries():
    codes, codewords = random_codes((1, 2, 200), 64, 2, 8, 256, seed=5)
    weights = torch.rand(1, 2, 20, 200, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    expected = coded_weighted_sum_reference(weights, codes, codewords, 8)
    for splits in (1, 2, 4):
        assert_out_close(coded_triton.weighted_sum(weights, codes, codewords, 8, 64, splits=splits), expected)


def test_capacity_buffer_view_is_read_in_place():
    codes, codewords = random_codes((2, 2, 45), 64, 4, 10, 1024, seed=7)
    buffer = torch.zeros(2, 2, 96, codes.shape[-1], dtype=torch.uint8, device=DEVICE)
    buffer[:, :, :45] = codes
    view = buffer[:, :, :45]
    assert not view.is_contiguous()
    assert coded_triton._rows(view).data_ptr() == buffer.data_ptr()  # no copy
    queries = randn(2, 2, 3, 64, seed=8)
    weights = torch.softmax(randn(2, 2, 3, 45, seed=9), dim=-1)
    assert torch.equal(coded_scores(queries, view, codewords, 10, backend="triton"),
                       coded_scores(queries, codes, codewords, 10, backend="triton"))
    assert torch.equal(coded_weighted_sum(weights, view, codewords, 10, backend="triton"),
                       coded_weighted_sum(weights, codes, codewords, 10, backend="triton"))
    odd = torch.zeros(*codes.shape, 2, dtype=torch.uint8, device=DEVICE)
    odd[..., 0] = codes
    strided = odd[..., 0]  # a row's bytes are not contiguous: copied, still right
    assert strided.stride(-1) == 2
    assert torch.equal(coded_scores(queries, strided, codewords, 10, backend="triton"),
                       coded_scores(queries, codes, codewords, 10, backend="triton"))


def test_invalid_index_raises():
    codes, codewords = random_codes((1, 1, 10), 64, 4, 12, 4096, seed=10)
    queries = randn(1, 1, 2, 64, seed=11)
    small = codewords[:3000].contiguous()
    with pytest.raises(ValueError, match="index"):
        coded_scores(queries, codes, small, 12, backend="triton")
    with pytest.raises(ValueError, match="index"):
        coded_weighted_sum(torch.ones(1, 1, 2, 10, device=DEVICE), codes, small, 12, backend="triton")
    with pytest.raises(ValueError, match="index"):
        coded_decode_attention(queries, codes, codes, small, codewords, 12, 12, backend="triton")


def test_no_tokens_and_no_queries():
    codes, codewords = random_codes((2, 2, 0), 64, 2, 8, 256, seed=12)
    queries = randn(2, 4, 3, 64, seed=13)
    assert coded_scores(queries[:, :2], codes, codewords, 8, backend="triton").shape == (2, 2, 3, 0)
    assert torch.equal(coded_weighted_sum(torch.zeros(2, 2, 3, 0, device=DEVICE), codes, codewords, 8,
                                          backend="triton"), torch.zeros(2, 2, 3, 64, device=DEVICE))
    out, lse = coded_decode_attention(queries, codes, codes, codewords, codewords, 8, 8, backend="triton")
    assert torch.equal(out, torch.zeros(2, 4, 3, 64, device=DEVICE))
    assert torch.isneginf(lse).all() and lse.shape == (2, 4, 3)


# --------------------------------------------------------------------------- fused decode attention
def _decode_inputs(batch=2, kv_heads=2, groups=2, n_q=1, tokens=150, seed=20):
    key_codes, key_codewords = random_codes((batch, kv_heads, tokens), 64, 4, 8, 256, seed=seed)
    value_codes, value_codewords = random_codes((batch, kv_heads, tokens), 64, 1, 3, 8, seed=seed + 1)
    queries = randn(batch, kv_heads * groups, n_q, 64, seed=seed + 2) * 0.5
    return queries, key_codes, value_codes, key_codewords, value_codewords


def _padding_bias(batch, heads, n_q, tokens, seed):
    """Batch row 0 pads its last 40 columns, query row 1 of batch 1 sees nothing (if it exists)."""
    bias = torch.zeros(batch, heads, n_q, tokens)
    bias[0, :, :, tokens - 40:] = float("-inf")
    if batch > 1 and n_q > 1:
        bias[1, :, 1] = float("-inf")
    bias += torch.rand(bias.shape, generator=torch.Generator().manual_seed(seed))  # finite ALiBi-like part
    return bias.to(DEVICE)


@pytest.mark.parametrize("n_q,bias_heads,splits", [(1, None, 1), (1, 1, 3), (3, 1, None), (3, 4, 2)])
def test_decode_attention_matches_reference(n_q, bias_heads, splits):
    """GQA (4 query heads on 2 KV heads), batch 2, key FibQuant-like k=4/8-bit, value TurboQuant-like 3-bit."""
    queries, key_codes, value_codes, key_cw, value_cw = _decode_inputs(n_q=n_q)
    bias = None if bias_heads is None else _padding_bias(2, bias_heads, n_q, 150, seed=21)
    out, lse = coded_decode_attention(queries, key_codes, value_codes, key_cw, value_cw, 8, 3, bias,
                                      backend="triton", splits=splits)
    expected_out, expected_lse = coded_decode_attention_reference(queries, key_codes, value_codes, key_cw,
                                                                  value_cw, 8, 3, bias)
    assert out.shape == (2, 4, n_q, 64) and lse.shape == (2, 4, n_q)
    assert_out_close(out, expected_out)
    assert_lse_close(lse, expected_lse)
    if bias_heads is not None and n_q > 1:  # the fully masked rows
        assert torch.isneginf(lse[1, :, 1]).all()
        assert torch.equal(out[1, :, 1], torch.zeros_like(out[1, :, 1]))


def test_decode_attention_prefill_chunk_bounded_rows():
    """A prefill-shaped call: 40 query tokens x 2 groups = 80 rows (two row tiles) with a causal bias."""
    queries, key_codes, value_codes, key_cw, value_cw = _decode_inputs(batch=1, n_q=40, tokens=120, seed=30)
    causal = torch.arange(120)[None, :] > torch.arange(80, 120)[:, None]
    bias = torch.zeros(1, 1, 40, 120).masked_fill_(causal, float("-inf")).to(DEVICE)
    out, lse = coded_decode_attention(queries, key_codes, value_codes, key_cw, value_cw, 8, 3, bias,
                                      backend="triton")
    expected_out, expected_lse = coded_decode_attention_reference(queries, key_codes, value_codes, key_cw,
                                                                  value_cw, 8, 3, bias)
    assert_out_close(out, expected_out)
    assert_lse_close(lse, expected_lse)


@pytest.mark.parametrize("k,bits,n_codewords", [(1, 1, 2), (2, 10, 1024), (4, 12, 4096), (8, 8, 256)])
def test_decode_attention_widths(k, bits, n_codewords):
    key_codes, key_cw = random_codes((1, 1, 70), 64, k, bits, n_codewords, seed=40 + k)
    value_codes, value_cw = random_codes((1, 1, 70), 64, k, bits, n_codewords, seed=41 + k)
    queries = randn(1, 4, 1, 64, seed=42)
    out, lse = coded_decode_attention(queries, key_codes, value_codes, key_cw, value_cw, bits, bits,
                                      backend="triton", splits=2)
    expected_out, expected_lse = coded_decode_attention_reference(queries, key_codes, value_codes, key_cw,
                                                                  value_cw, bits, bits)
    assert_out_close(out, expected_out)
    assert_lse_close(lse, expected_lse)


def test_decode_attention_value_dim_differs_from_key_dim():
    key_codes, key_cw = random_codes((2, 1, 40), 64, 4, 8, 256, seed=45)
    value_codes, value_cw = random_codes((2, 1, 40), 32, 2, 10, 1024, seed=46)
    queries = randn(2, 2, 2, 64, seed=47)
    out, lse = coded_decode_attention(queries, key_codes, value_codes, key_cw, value_cw, 8, 10, value_dim=32,
                                      backend="triton")
    expected_out, expected_lse = coded_decode_attention_reference(queries, key_codes, value_codes, key_cw,
                                                                  value_cw, 8, 10, value_dim=32)
    assert out.shape == (2, 2, 2, 32)
    assert_out_close(out, expected_out)
    assert_lse_close(lse, expected_lse)
    with pytest.raises(ValueError, match="value_dim"):
        coded_decode_attention(queries, key_codes, value_codes, key_cw, value_cw, 8, 10, backend="triton")


def test_decode_attention_merged_with_exact_columns_equals_full_attention():
    """coded part (Triton) + exact part (attention_with_lse) through merge_lse == one softmax over all columns."""
    queries, key_codes, value_codes, key_cw, value_cw = _decode_inputs(batch=2, n_q=2, tokens=90, seed=50)
    exact_keys, exact_values = randn(2, 2, 7, 64, seed=51), randn(2, 2, 7, 64, seed=52)
    coded_bias = _padding_bias(2, 1, 2, 90, seed=53)
    exact_bias = torch.zeros(2, 1, 2, 7, device=DEVICE)
    exact_bias[1, :, 1] = float("-inf")  # row (1, 1) sees nothing at all: zeros, lse -inf
    coded = coded_decode_attention(queries, key_codes, value_codes, key_cw, value_cw, 8, 3, coded_bias,
                                   backend="triton")
    out, lse = merge_lse([coded, attention_with_lse(queries, exact_keys, exact_values, exact_bias)])
    keys = torch.cat([_decoded_rotated(key_codes, key_cw, 8, 16), exact_keys], dim=2)
    values = torch.cat([_decoded_rotated(value_codes, value_cw, 3, 64), exact_values], dim=2)
    full_bias = torch.cat([coded_bias, exact_bias], dim=-1)
    groups = 2
    scores = queries @ keys.repeat_interleave(groups, dim=1).transpose(-1, -2) + full_bias
    dense = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ values.repeat_interleave(groups, dim=1)
    assert_out_close(out, dense)
    assert torch.isneginf(lse[1, :, 1]).all() and torch.equal(out[1, :, 1], torch.zeros_like(out[1, :, 1]))
    finite = torch.isfinite(lse)
    assert float((lse[finite] - torch.logsumexp(scores, -1)[finite]).abs().max()) <= SCORE_ATOL


# --------------------------------------------------------------------------- soft-capping (Gemma 2)
@pytest.mark.parametrize("n_q,bias_heads,splits,softcap", [(1, None, 1, 0.7), (3, 4, 2, 2.5), (3, 1, None, 50.0)])
def test_decode_attention_softcap_matches_reference(n_q, bias_heads, splits, softcap):
    """Scores tanh(s / c) * c before the bias, in the kernel == the reference (lse of the capped scores)."""
    queries, key_codes, value_codes, key_cw, value_cw = _decode_inputs(n_q=n_q, seed=55)
    queries = queries * 4  # scores of several units, so that a cap of 0.7 / 2.5 bites
    bias = None if bias_heads is None else _padding_bias(2, bias_heads, n_q, 150, seed=56)
    out, lse = coded_decode_attention(queries, key_codes, value_codes, key_cw, value_cw, 8, 3, bias,
                                      softcap=softcap, backend="triton", splits=splits)
    expected_out, expected_lse = coded_decode_attention_reference(queries, key_codes, value_codes, key_cw,
                                                                  value_cw, 8, 3, bias, softcap=softcap)
    assert_out_close(out, expected_out)
    assert_lse_close(lse, expected_lse)
    scores = queries @ _decoded_rotated(key_codes, key_cw, 8, 16).repeat_interleave(2, dim=1).transpose(-1, -2)
    capped = torch.tanh(scores / softcap) * softcap + (0.0 if bias is None else bias)
    finite = torch.isfinite(expected_lse)
    assert float((lse[finite] - torch.logsumexp(capped, -1)[finite]).abs().max()) <= SCORE_ATOL
    if softcap < 10:  # the cap changes the result (the test would pass with it ignored otherwise)
        plain_out, _ = coded_decode_attention_reference(queries, key_codes, value_codes, key_cw, value_cw, 8, 3,
                                                        bias)
        assert float((plain_out - expected_out).abs().max()) > 100 * OUT_RTOL * float(expected_out.abs().max())


def test_decode_attention_softcap_is_safe_for_huge_scores():
    """|s| / c up to ~1e5: the capped scores saturate at +-c, no overflow, no NaN (the exp form of tanh)."""
    queries, key_codes, value_codes, key_cw, value_cw = _decode_inputs(batch=1, n_q=2, tokens=40, seed=57)
    queries = queries * 1e4
    out, lse = coded_decode_attention(queries, key_codes, value_codes, key_cw, value_cw, 8, 3, softcap=1.5,
                                      backend="triton")
    expected_out, expected_lse = coded_decode_attention_reference(queries, key_codes, value_codes, key_cw,
                                                                  value_cw, 8, 3, softcap=1.5)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert float(lse.max()) <= 1.5 + math.log(40) + SCORE_ATOL
    assert_out_close(out, expected_out)
    assert_lse_close(lse, expected_lse)


def test_decode_attention_softcap_merged_with_capped_exact_columns_equals_full_attention():
    """coded part (Triton, capped) + exact part (attention_with_lse, capped) through merge_lse == one capped
    softmax over all columns: how kv/attention/entry.py serves a soft-capped model with the fused kernel."""
    queries, key_codes, value_codes, key_cw, value_cw = _decode_inputs(batch=1, n_q=2, tokens=60, seed=58)
    queries = queries * 4
    exact_keys, exact_values = randn(1, 2, 5, 64, seed=59), randn(1, 2, 5, 64, seed=60)
    exact_bias = torch.zeros(1, 1, 2, 5, device=DEVICE)
    exact_bias[..., 1, 4] = float("-inf")
    coded = coded_decode_attention(queries, key_codes, value_codes, key_cw, value_cw, 8, 3, softcap=2.0,
                                   backend="triton")
    out, _ = merge_lse([coded, attention_with_lse(queries, exact_keys, exact_values, exact_bias, softcap=2.0)])
    keys = torch.cat([_decoded_rotated(key_codes, key_cw, 8, 16), exact_keys], dim=2).repeat_interleave(2, dim=1)
    values = torch.cat([_decoded_rotated(value_codes, value_cw, 3, 64), exact_values], dim=2)
    scores = torch.tanh(queries @ keys.transpose(-1, -2) / 2.0) * 2.0
    scores = scores + torch.cat([torch.zeros(1, 1, 2, 60, device=DEVICE), exact_bias], dim=-1)
    assert_out_close(out, torch.softmax(scores, dim=-1) @ values.repeat_interleave(2, dim=1))


@pytest.mark.parametrize("softcap", [0, 0.0, -1.0, float("inf"), float("nan"), True, "3"])
def test_softcap_must_be_positive(softcap):
    queries, key_codes, value_codes, key_cw, value_cw = _decode_inputs(batch=1, tokens=10, seed=71)
    for fn in (coded_decode_attention, coded_decode_attention_reference):
        with pytest.raises(ValueError, match="softcap must be a positive number"):
            fn(queries, key_codes, value_codes, key_cw, value_cw, 8, 3, softcap=softcap)
    with pytest.raises(ValueError, match="softcap must be a positive number"):
        attention_with_lse(queries, queries, queries, softcap=softcap)
    key_size, value_size = key_codes.shape[-1], value_codes.shape[-1]
    pages = torch.zeros(1, 2, 10, key_size + value_size, dtype=torch.uint8, device=DEVICE)  # one block of 10
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    for fn in (coded_decode_attention_paged, coded_decode_attention_paged_reference):
        with pytest.raises(ValueError, match="softcap must be a positive number"):
            fn(queries, pages, table, [10], key_cw, value_cw, 8, 3, key_size, softcap=softcap)


def _fused_attend(query, kv, scaling):
    """How kv/attention/entry.py can use the fused kernel (a sketch for wiring, no mask: a decode step or
    a causal chunk): query [B, Hq, T, D] over a CodedKV -> [B, Hq, T, Dv] float32."""
    batch, q_heads, tokens, _ = query.shape
    q = query.to(torch.float32) * scaling
    key_book, value_book = kv.key_codec.reader(q.device), kv.value_codec.reader(q.device)
    coded_out, coded_lse = coded_decode_attention(q @ key_book.forward, kv.key_codes, kv.value_codes,
                                                  key_book.codewords, value_book.codewords,
                                                  key_book.index_bits, value_book.index_bits, backend="triton")
    coded_out = coded_out @ value_book.forward.T
    groups = q_heads // kv.key_codes.shape[1]
    if kv.key_mean is not None:  # centred keys: every coded score shifts by q . mu
        coded_lse = coded_lse + (q * kv.key_mean.repeat_interleave(groups, 1).unsqueeze(2)).sum(-1)
    if kv.value_mean is not None:
        coded_out = coded_out + kv.value_mean.repeat_interleave(groups, 1).unsqueeze(2)
    exact_keys, exact_values = (t.to(torch.float32) for t in kv.exact())
    past = exact_keys.shape[2] - tokens  # query t sees exact columns <= past + t
    columns, rows = torch.arange(exact_keys.shape[2], device=q.device), torch.arange(tokens, device=q.device)
    blocked = columns[None, :] > past + rows[:, None]
    causal = torch.zeros(blocked.shape, device=q.device).masked_fill_(blocked, float("-inf"))[None, None]
    parts = [(coded_out, coded_lse),
             attention_with_lse(q, kv.sink_keys.to(torch.float32), kv.sink_values.to(torch.float32)),
             attention_with_lse(q, exact_keys, exact_values, causal)]
    return merge_lse(parts)[0]


@pytest.mark.parametrize("tokens", [1, 3])
def test_fused_path_reproduces_attend_codes(tokens):
    """attend_codes (kv/attention/entry.py: numba / torch drop-ins, one softmax) == fused coded part + exact parts
    merged by merge_lse, on a real CompressedLayer (FibQuant keys k=2, TurboQuant 2-bit values, GQA 4/2)."""
    from fibquant.kv.attention.entry import attend_codes
    from fibquant.kv.cache import CompressedLayer

    gen = torch.Generator().manual_seed(90)
    layer = CompressedLayer(FibQuantCodec(64, 2, 256), TurboQuantCodec(64, 2), 4, 8, attention="codes")
    layer.update(*(torch.randn(2, 2, 60, 64, generator=gen).to(DEVICE) for _ in range(2)))
    kv, _ = layer.update(*(torch.randn(2, 2, tokens, 64, generator=gen).to(DEVICE) for _ in range(2)))
    assert kv.num_coded > 0
    query = torch.randn(2, 4, tokens, 64, generator=gen).to(DEVICE)
    expected = attend_codes(query, kv, None, 64 ** -0.5).transpose(1, 2)  # -> [B, Hq, T, Dv]
    assert_out_close(_fused_attend(query, kv, 64 ** -0.5), expected)


# --------------------------------------------------------------------------- paged (vLLM pages)
def _paged_inputs(lens, starts, key_cfg, value_cfg, token_major=True, kv_heads=2, groups=2, n_q=1, block=8,
                  n_blocks=14, seed=100):
    """Dense per-request codes [1, Hkv, L_r, C] scattered into pages over a scrambled block table.
    -> (queries, pages [num_blocks, Hkv, block, slot] view, tables int32 [R, max_blocks], key codes per
    request, value codes per request, key codewords, value codewords, key_bytes)."""
    dim = 64
    (k_k, k_bits, k_n), (v_k, v_bits, v_n) = key_cfg, value_cfg
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block) for n in lens) + 1
    order = torch.randperm(n_blocks, generator=gen)
    tables = torch.full((len(lens), max_blocks), n_blocks + 50, dtype=torch.int32)  # stale ids past the end
    used = 0
    for r, n in enumerate(lens):
        count = -(-n // block)
        tables[r, :count] = order[used:used + count].to(torch.int32)
        used += count
    assert used <= n_blocks
    key_codes, key_cw = random_codes((len(lens), kv_heads, max(lens)), dim, k_k, k_bits, k_n, seed=seed + 1)
    value_codes, value_cw = random_codes((len(lens), kv_heads, max(lens)), dim, v_k, v_bits, v_n, seed=seed + 2)
    key_size, value_size = key_codes.shape[-1], value_codes.shape[-1]
    key_bytes = key_size + 1  # a gap before the value code: the offset is honoured, not assumed
    slot = key_bytes + value_size + 1
    # garbage everywhere a request does not own: a read outside its slots shows in the result
    noise = torch.randint(0, 256, (n_blocks, block, kv_heads, slot), generator=gen, dtype=torch.uint8)
    if token_major:   # vLLM's LBNHC pages: [blocks, block, Hkv, slot] viewed as [blocks, Hkv, block, slot]
        pages = noise.to(DEVICE).permute(0, 2, 1, 3)
    else:
        pages = noise.permute(0, 2, 1, 3).contiguous().to(DEVICE)
    for r, n in enumerate(lens):
        for p in range(n):
            page, row = int(tables[r, p // block]), p % block
            pages[page, :, row, :key_size] = key_codes[r, :, p]
            pages[page, :, row, key_bytes:key_bytes + value_size] = value_codes[r, :, p]
    queries = randn(len(lens), kv_heads * groups, n_q, dim, seed=seed + 3) * 0.5
    return queries, pages, tables.to(DEVICE), key_codes, value_codes, key_cw, value_cw, key_bytes


@pytest.mark.parametrize("key_cfg,value_cfg,token_major,n_q,splits", [
    ((4, 8, 256), (1, 3, 8), True, 1, None),      # FibQuant-like 8-bit keys, TurboQuant-like 3-bit values
    ((4, 12, 3000), (2, 8, 256), True, 2, 3),      # 12-bit indices (N < 2^12: index checks on)
    ((2, 8, 256), (4, 12, 4096), False, 1, 1),     # head-major pages, one split
])
def test_paged_decode_attention_matches_reference(key_cfg, value_cfg, token_major, n_q, splits):
    """Four requests (37, 0, 5, 20 earlier tokens; the first 3 and 2 of two of them exact sinks, not
    read) on scattered blocks of one page pool, GQA 4/2: == the dense reference on each request's codes,
    and == the paged torch reference; the request with no coded token gives out 0, lse -inf."""
    lens, starts = [37, 0, 5, 20], [3, 0, 0, 2]
    queries, pages, tables, key_codes, value_codes, key_cw, value_cw, key_bytes = _paged_inputs(
        lens, starts, key_cfg, value_cfg, token_major, n_q=n_q)
    k_bits, v_bits = key_cfg[1], value_cfg[1]
    out, lse = coded_decode_attention_paged(queries, pages, tables, lens, key_cw, value_cw, k_bits, v_bits,
                                            key_bytes, context_starts=starts, backend="triton", splits=splits)
    assert out.shape == (4, 4, n_q, 64) and lse.shape == (4, 4, n_q)
    ref_out, ref_lse = coded_decode_attention_paged_reference(queries, pages, tables, lens, key_cw, value_cw,
                                                              k_bits, v_bits, key_bytes, context_starts=starts)
    assert_out_close(out, ref_out)
    assert_lse_close(lse, ref_lse)
    for r, (start, stop) in enumerate(zip(starts, lens)):
        if stop == start:
            assert torch.isneginf(lse[r]).all() and torch.equal(out[r], torch.zeros_like(out[r]))
            continue
        dense_out, dense_lse = coded_decode_attention_reference(
            queries[r:r + 1], key_codes[r:r + 1, :, start:stop], value_codes[r:r + 1, :, start:stop], key_cw,
            value_cw, k_bits, v_bits)
        assert_out_close(out[r:r + 1], dense_out)
        assert_lse_close(lse[r:r + 1], dense_lse)


def test_paged_decode_attention_device_lengths_and_errors():
    """Lengths as int tensors (no host copy: splits sized by max_context), a prefill-shaped call
    (Q = 5 tokens of one request), and argument errors."""
    queries, pages, tables, key_codes, value_codes, key_cw, value_cw, key_bytes = _paged_inputs(
        [30], [0], (4, 8, 256), (4, 8, 256), n_q=5, seed=110)
    lens = torch.tensor([30], dtype=torch.int32, device=DEVICE)
    out, lse = coded_decode_attention_paged(queries, pages, tables, lens, key_cw, value_cw, 8, 8, key_bytes,
                                            max_context=30, backend="triton")
    dense_out, dense_lse = coded_decode_attention_reference(queries, key_codes, value_codes, key_cw, value_cw, 8, 8)
    assert_out_close(out, dense_out)
    assert_lse_close(lse, dense_lse)
    with pytest.raises(ValueError, match="key_bytes"):
        coded_decode_attention_paged(queries, pages, tables, [30], key_cw, value_cw, 8, 8, pages.shape[-1] - 3)
    with pytest.raises(ValueError, match="context_lens"):
        coded_decode_attention_paged(queries, pages, tables, [30, 2], key_cw, value_cw, 8, 8, key_bytes)
    with pytest.raises(ValueError, match="must lie in"):
        coded_decode_attention_paged(queries, pages, tables, [tables.shape[1] * 8 + 1], key_cw, value_cw, 8, 8,
                                     key_bytes)
    with pytest.raises(ValueError, match="block_tables"):
        coded_decode_attention_paged(queries, pages, tables.float(), [30], key_cw, value_cw, 8, 8, key_bytes)
    with pytest.raises(ValueError, match="index"):
        coded_decode_attention_paged(queries, pages, tables, [30], key_cw[:200].contiguous(), value_cw, 8, 8,
                                     key_bytes, backend="triton")


@pytest.mark.parametrize("n_q,splits", [(1, None), (2, 2)])
def test_paged_decode_attention_softcap_matches_reference(n_q, splits):
    """Soft-capping on pages: == the paged reference and the dense capped reference per request."""
    lens, starts = [37, 0, 20], [3, 0, 2]
    queries, pages, tables, key_codes, value_codes, key_cw, value_cw, key_bytes = _paged_inputs(
        lens, starts, (4, 8, 256), (1, 3, 8), n_q=n_q, seed=120)
    queries = queries * 4
    out, lse = coded_decode_attention_paged(queries, pages, tables, lens, key_cw, value_cw, 8, 3, key_bytes,
                                            context_starts=starts, softcap=1.5, backend="triton", splits=splits)
    ref_out, ref_lse = coded_decode_attention_paged_reference(queries, pages, tables, lens, key_cw, value_cw, 8, 3,
                                                              key_bytes, context_starts=starts, softcap=1.5)
    assert_out_close(out, ref_out)
    assert_lse_close(lse, ref_lse)
    assert torch.isneginf(lse[1]).all() and torch.equal(out[1], torch.zeros_like(out[1]))
    for r in (0, 2):
        dense_out, dense_lse = coded_decode_attention_reference(
            queries[r:r + 1], key_codes[r:r + 1, :, starts[r]:lens[r]], value_codes[r:r + 1, :, starts[r]:lens[r]],
            key_cw, value_cw, 8, 3, softcap=1.5)
        assert_out_close(out[r:r + 1], dense_out)
        assert_lse_close(lse[r:r + 1], dense_lse)
    plain_out, _ = coded_decode_attention_paged_reference(queries, pages, tables, lens, key_cw, value_cw, 8, 3,
                                                          key_bytes, context_starts=starts)
    assert float((plain_out - ref_out).abs().max()) > 100 * OUT_RTOL * float(ref_out.abs().max())  # the cap bites


# --------------------------------------------------------------------------- dispatch and errors
def test_dispatch_cpu_auto_keeps_numba_and_triton_is_explicit(monkeypatch):
    codes, codewords = random_codes((1, 1, 20), 64, 2, 8, 256, seed=60, device="cpu")
    queries = torch.randn(1, 1, 2, 64)
    calls = []
    monkeypatch.setattr(coded_triton, "scores", lambda *a: calls.append("triton") or coded_scores_reference(*a))
    coded_scores(queries, codes, codewords, 8)  # auto on CPU: numba (or torch without numba), never triton
    assert calls == []
    if coded_triton.INTERPRETED:
        coded_scores(queries, codes, codewords, 8, backend="triton")
        assert calls == ["triton"]
    assert "triton" in ck.BACKENDS


def test_auto_dispatch_of_cuda_tensors(monkeypatch):
    """CUDA tensors (stand-ins: only .device is read) -> triton when it imports and serves the config,
    else the torch reference with a one-time warning; an explicit backend='triton' without triton raises."""
    from types import SimpleNamespace

    cuda = (SimpleNamespace(device=torch.device("cuda")),) * 2
    assert ck._select("auto", cuda, ((128, 8),)) == "triton"
    assert ck._select("auto", cuda, ((128, 8), (64, 3)), fused=True) == "triton"
    notices.warned.discard("triton-config:head dim 1024 > 512")
    with pytest.warns(RuntimeWarning, match="cannot serve"):
        assert ck._select("auto", cuda, ((1024, 8),)) == "torch"
    assert ck._select("auto", (SimpleNamespace(device=torch.device("cpu")),), ((64, 8),), fused=True) == "torch"
    monkeypatch.setattr(ck, "_TRITON", (None, "ModuleNotFoundError: no triton"))
    notices.warned.discard("no-triton")
    with pytest.warns(RuntimeWarning, match="not importable"):
        assert ck._select("auto", cuda, ((128, 8),)) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ck._select("auto", cuda, ((128, 8),)) == "torch"  # warned once only
    with pytest.raises(ValueError, match="not importable"):
        ck._select("triton", cuda, ((128, 8),))


def test_auto_falls_back_when_a_kernel_fails_but_explicit_triton_raises(monkeypatch):
    codes, codewords = random_codes((1, 1, 12), 64, 2, 8, 256, seed=63)
    queries = randn(1, 1, 2, 64, seed=64)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image for this GPU")

    monkeypatch.setattr(coded_triton, "scores", broken)
    monkeypatch.setattr(ck, "_select", lambda *args, **kwargs: "triton")  # as for CUDA tensors under "auto"
    notices.warned.discard("triton-failed:coded_scores:RuntimeError")
    with pytest.warns(RuntimeWarning, match="no kernel image"):
        scores = coded_scores(queries, codes, codewords, 8)
    assert torch.equal(scores, coded_scores_reference(queries, codes, codewords, 8))
    with pytest.raises(RuntimeError, match="no kernel image"):
        coded_scores(queries, codes, codewords, 8, backend="triton")


def test_unservable_config_falls_back_with_one_warning():
    codes, codewords = random_codes((1, 1, 9), 64, 2, 26, 4, seed=61)  # 26-bit fields: beyond a 32-bit window
    queries = randn(1, 1, 2, 64, seed=62)
    notices.warned.discard("triton-config:index_bits=26 > 25")
    with pytest.warns(RuntimeWarning, match="cannot serve"):
        scores = coded_scores(queries, codes, codewords, 26, backend="triton")
    assert torch.equal(scores, coded_scores_reference(queries, codes, codewords, 26))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        coded_scores(queries, codes, codewords, 26, backend="triton")  # one-time: no second warning


def test_bad_inputs_raise_value_error():
    queries, key_codes, value_codes, key_cw, value_cw = _decode_inputs(batch=1, tokens=10, seed=70)
    with pytest.raises(ValueError, match="numba"):
        coded_decode_attention(queries, key_codes, value_codes, key_cw, value_cw, 8, 3, backend="numba")
    with pytest.raises(ValueError, match="bias"):
        coded_decode_attention(queries, key_codes, value_codes, key_cw, value_cw, 8, 3,
                               torch.zeros(1, 3, 1, 10, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="multiple"):
        coded_decode_attention(queries[:, :3], key_codes, value_codes, key_cw, value_cw, 8, 3, backend="triton")
    with pytest.raises(ValueError, match="code_size"):
        coded_decode_attention(queries, key_codes, value_codes, key_cw, value_cw, 8, 4, backend="triton")
    with pytest.raises(ValueError, match="same device"):
        coded_decode_attention(queries.to("meta"), key_codes, value_codes, key_cw, value_cw, 8, 3,
                               backend="triton")
    with pytest.raises(ValueError, match="splits"):
        coded_decode_attention(queries, key_codes, value_codes, key_cw, value_cw, 8, 3, splits=0)


def test_merge_lse_is_exact_and_handles_empty_parts():
    scores = torch.randn(2, 3, 4, 30)
    scores[0, 0, 0, :10] = float("-inf")   # part 0 of this row is fully masked
    scores[1, 2, 3] = float("-inf")        # this row is fully masked everywhere
    values = torch.randn(2, 3, 30, 8)
    parts = []
    for cols in (slice(0, 10), slice(10, 25), slice(25, 30)):
        # zero queries and keys: each part's scores are exactly its bias, the columns of `scores`
        parts.append(attention_with_lse(torch.zeros(2, 3, 4, 1), torch.zeros(2, 3, cols.stop - cols.start, 1),
                                        values[:, :, cols], scores[..., cols]))
    out, lse = merge_lse(parts)
    expected = torch.softmax(scores, -1).nan_to_num(0.0) @ values
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert torch.isneginf(lse[1, 2, 3]) and torch.equal(out[1, 2, 3], torch.zeros(8))
    finite = torch.isfinite(lse)
    torch.testing.assert_close(lse[finite], torch.logsumexp(scores, -1)[finite])
    with pytest.raises(ValueError):
        merge_lse([])
    with pytest.raises(ValueError):
        merge_lse([(out, lse), (out[..., :4], lse)])


# --------------------------------------------------------------------------- lowering for a real GPU
def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia import compiler as nvidia
    except ImportError:
        return False
    return (Path(nvidia.__file__).parent / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _ptxas_available(), reason="triton's NVIDIA backend (with its ptxas) is not installed")
def test_fused_kernel_compiles_for_sm90(tmp_path):
    """The interpreter cannot see lowering errors: compile the fused decode kernel at the Llama-8B decode
    shape (D=128, 8-bit k=2 indices) and the default `Launch` to an sm_90 cubin, in a process without the
    interpreter. (Spills are reported, not refused: at 4 warps ptxas spills, yet on an H200 4 warps ran
    1.2-1.7x faster than 8 warps without spills; docs/gpu.md.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "triton_compile_check.py"
    result = subprocess.run([sys.executable, str(script), "--quick", "--dims", "128",
                             "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "triton_compile_check.json").read_text())
    assert report["rows"] and all("error" not in row and row["reg"] > 0 for row in report["rows"])


# --------------------------------------------------------------------------- CUDA only
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (peak-memory check of the compiled kernel)")
def test_decode_at_8k_allocates_no_full_context_float_kv():
    """One decode token at 8k context, Llama-8B-shaped layer: the fused kernel's peak allocation stays far
    below one float32 K (or V) tensor of the whole context, which the reference builds."""
    tokens, kv_heads, q_heads, dim = 8192, 8, 32, 128
    key_codes, key_cw = random_codes((1, kv_heads, tokens), dim, 2, 8, 256, seed=80)   # 4 bit/coordinate
    value_codes, value_cw = random_codes((1, kv_heads, tokens), dim, 4, 8, 256, seed=81)  # 2 bit/coordinate
    queries = randn(1, q_heads, 1, dim, seed=82) * dim ** -0.5
    coded_decode_attention(queries, key_codes, value_codes, key_cw, value_cw, 8, 8)  # compile outside the window
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out, lse = coded_decode_attention(queries, key_codes, value_codes, key_cw, value_cw, 8, 8)
    torch.cuda.synchronize()
    delta = torch.cuda.max_memory_allocated() - before
    full_kv = kv_heads * tokens * dim * 4
    assert delta < full_kv / 8, (delta, full_kv)
    expected_out, expected_lse = coded_decode_attention_reference(queries, key_codes, value_codes, key_cw,
                                                                  value_cw, 8, 8)
    assert_out_close(out, expected_out)
    assert_lse_close(lse, expected_lse)


@pytest.mark.parametrize("tokens", [1, 18])
def test_attend_codes_wired_to_the_fused_kernel(monkeypatch, tokens):
    """kv/attention/entry.py with fused_backend="triton" (what CUDA tensors get under "auto"): the
    coded columns go through coded_decode_attention, merged with the exact ones by log-sum-exp; equal
    to the numba / torch path with a padding mask, a fully masked row, sinks and centred codes."""
    import fibquant.kv.attention.entry as attention
    from fibquant.kv.cache import CompressedLayer

    gen = torch.Generator().manual_seed(91)
    layer = CompressedLayer(FibQuantCodec(64, 2, 256), TurboQuantCodec(64, 2), 4, 8, attention="codes",
                            encode_batch=4, centre=True)
    layer.update(*(torch.randn(2, 2, 40, 64, generator=gen).to(DEVICE) for _ in range(2)))
    kv, _ = layer.update(*(torch.randn(2, 2, tokens, 64, generator=gen).to(DEVICE) for _ in range(2)))
    assert kv.num_coded > 0 and kv.key_mean is not None
    query = torch.randn(2, 4, tokens, 64, generator=gen).to(DEVICE)
    allowed = torch.arange(kv.length)[None, :] <= (kv.length - tokens) + torch.arange(tokens)[:, None]
    allowed = allowed.expand(2, 1, tokens, kv.length).clone().to(DEVICE)
    allowed[1, :, :, :6] = False
    allowed[1, :, 0, :] = False
    sinks = torch.randn(4, generator=gen).to(DEVICE)
    expected = attention.attend_codes(query, kv, allowed, 0.125, sinks=sinks,
                                      options=AttentionOptions(fused_backend="off"))
    calls = []
    real = attention.coded_decode_attention
    monkeypatch.setattr(attention, "coded_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    # CUDA tensors never take the one-token numba step (CPU only): so that CPU tensors in the interpreter
    # take the CUDA path too, it is off for this call (`expected` above came through it for tokens=1).
    got = attention.attend_codes(query, kv, allowed, 0.125, sinks=sinks,
                                 options=AttentionOptions(fused_backend="triton", numba_decode=False))
    assert calls and torch.isfinite(got).all()
    assert_out_close(got, expected)


@pytest.mark.parametrize("tokens", [1, 18])
def test_attend_codes_softcap_on_the_fused_kernel(monkeypatch, tokens):
    """A soft-capped model (Gemma 2) with fused_backend="triton": the coded columns go through
    coded_decode_attention with softcap, the exact ones are capped in torch, merged by log-sum-exp; equal
    to attend_codes with the fused backend off (numba / torch, one capped softmax), with a padding mask, a
    fully masked row and sinks. Centred keys with soft-capping keep the torch path (the key mean's score
    shift cannot be added after the cap)."""
    import fibquant.kv.attention.entry as attention
    from fibquant.kv.cache import CompressedLayer

    calls = []
    real = attention.coded_decode_attention
    monkeypatch.setattr(attention, "coded_decode_attention",
                        lambda *a, **k: calls.append(k.get("softcap")) or real(*a, **k))
    for centre in (False, True):
        gen = torch.Generator().manual_seed(92)
        layer = CompressedLayer(FibQuantCodec(64, 2, 256), TurboQuantCodec(64, 2), 4, 8, attention="codes",
                                encode_batch=4, centre=centre)
        layer.update(*(torch.randn(2, 2, 40, 64, generator=gen).to(DEVICE) for _ in range(2)))
        kv, _ = layer.update(*(torch.randn(2, 2, tokens, 64, generator=gen).to(DEVICE) for _ in range(2)))
        assert kv.num_coded > 0 and (kv.key_mean is not None) == centre
        query = torch.randn(2, 4, tokens, 64, generator=gen).to(DEVICE) * 3
        allowed = torch.arange(kv.length)[None, :] <= (kv.length - tokens) + torch.arange(tokens)[:, None]
        allowed = allowed.expand(2, 1, tokens, kv.length).clone().to(DEVICE)
        allowed[1, :, :, :6] = False
        allowed[1, :, 0, :] = False
        sinks = torch.randn(4, generator=gen).to(DEVICE)
        expected = attention.attend_codes(query, kv, allowed, 0.125, softcap=1.0, sinks=sinks,
                                          options=AttentionOptions(fused_backend="off"))
        uncapped = attention.attend_codes(query, kv, allowed, 0.125, sinks=sinks,
                                          options=AttentionOptions(fused_backend="off"))
        assert float((uncapped - expected).abs().max()) > 0.01  # the cap changes the result
        calls.clear()
        got = attention.attend_codes(query, kv, allowed, 0.125, softcap=1.0, sinks=sinks,
                                     options=AttentionOptions(fused_backend="triton", numba_decode=False))
        assert calls == ([] if centre else [1.0] * len(calls)) and (centre or calls)
        assert torch.isfinite(got).all()
        assert_out_close(got, expected)
