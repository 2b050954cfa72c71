"""The cold tier (fibquant.kv.cold) and query-aware recall (fibquant.kv.attention.recall): the store's round
trip, access and growth, memory and disk; recall against its plain torch reference and exact attention;
no double counting; accounting; the @recall spec option; generate; bad input."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from _kv_helpers import tiny_llama
from transformers import DynamicCache

from fibquant.codecs.registry import parse_codec_spec
from fibquant.kv.attention.entry import attend_codes
from fibquant.kv.attention.recall import pick, recall_reference
from fibquant.kv.attention.switch import attention_on_codes
from fibquant.kv.build import build_cache
from fibquant.kv.cache import CompressedCache
from fibquant.kv.plan import Centred
from fibquant.kv.cold import ColdStore, Recall
from fibquant.kv.model import cache_kwarg
from fibquant.kv.specs import parse_cache_spec

DIM = 64


def _rows(tokens, batch=2, heads=3, dim=DIM, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, tokens, dim, generator=gen), torch.randn(batch, heads, tokens, dim + 8,
                                                                              generator=gen)


# ---------------------------------------------------------------------- the cold store
@pytest.mark.parametrize("disk", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cold_store_round_trip_growth_and_random_access(tmp_path, disk, dtype):
    keys, values = _rows(300)
    store = ColdStore(2, 3, DIM, DIM + 8, dtype, torch.device("cpu"), str(tmp_path / "layer") if disk else None)
    capacities = []
    for start in range(0, 300, 37):  # appends of uneven sizes: the store grows
        store.append(keys[..., start:start + 37, :], values[..., start:start + 37, :])
        capacities.append(store.capacity)
    assert store.used == 300 and capacities[-1] >= 300 and len(set(capacities)) > 1
    stored_keys, stored_values = store.rows()
    torch.testing.assert_close(stored_keys, keys.to(dtype), rtol=0, atol=0)  # exact in the store's dtype
    torch.testing.assert_close(stored_values, values.to(dtype), rtol=0, atol=0)
    index = torch.tensor([[[5, 299, 0], [17, 17, 150]], [[1, 2, 3], [298, 4, 100]], [[7, 8, 9], [0, 0, 0]]])
    index = index.permute(1, 0, 2)  # [B=2, H=3, u=3]
    got_k, got_v = store.fetch(index)
    for b in range(2):
        for h in range(3):
            for j, t in enumerate(index[b, h].tolist()):
                assert torch.equal(got_k[b, h, j], keys[b, h, t].to(dtype))
                assert torch.equal(got_v[b, h, j], values[b, h, t].to(dtype))
    assert store.rows_read == index.numel() and store.reads == 1
    assert store.used_nbytes() == 300 * 2 * 3 * (DIM + DIM + 8) * torch.empty(0, dtype=dtype).element_size()
    if disk:
        assert (tmp_path / "layer.keys").stat().st_size == store.capacity * 2 * 3 * DIM * got_k.element_size()
    store.truncate(10)
    assert store.used == 10
    with pytest.raises(ValueError, match="holds 10 tokens"):
        store.fetch(torch.full((2, 3, 1), 10))
    store.close()
    assert not (tmp_path / "layer.keys").exists()


def test_cold_store_fetch_costs_the_same_at_any_length():
    """O(1) access: fetching 32 rows reads 32 rows whether 1k or 64k tokens are stored (same rows_read;
    the gather touches only them), and the wall time does not grow with the length."""
    import time

    times = {}
    for tokens in (1024, 65536):
        store = ColdStore(1, 2, 16, 16, torch.float16, torch.device("cpu"))
        keys = torch.randn(1, 2, tokens, 16)
        store.append(keys, keys)
        index = torch.randint(0, tokens, (1, 2, 32))
        start = time.perf_counter()
        for _ in range(200):
            store.fetch(index)
        times[tokens] = time.perf_counter() - start
        assert store.rows_read == 200 * 64
    assert times[65536] < 5 * times[1024] + 0.05


def test_cold_store_rejects_rows_of_another_shape():
    store = ColdStore(1, 2, 8, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"\[B, H\]"):
        store.append(torch.zeros(1, 3, 4, 8), torch.zeros(1, 3, 4, 8))


# ---------------------------------------------------------------------- the Recall option
def test_recall_counts_and_spec_text():
    assert Recall(tokens=32).count(1000) == 32 and Recall(tokens=32).count(10) == 10
    assert Recall(fraction=0.05).count(1000) == 50 and Recall(fraction=0.05).count(3) == 1
    assert Recall(tokens=0).count(100) == 0
    for text in ("32", "0.02", "64:disk:fp16", "1.0", "8:bf16"):
        assert Recall.parse(Recall.parse(text).text) == Recall.parse(text)
    assert Recall.parse("64:disk:fp16") == Recall(tokens=64, store="disk", dtype=torch.float16)
    assert Recall.parse("0.5").fraction == 0.5 and Recall.parse("1.0").fraction == 1.0


@pytest.mark.parametrize("kwargs, message", [
    ({"tokens": -1}, "integer >= 0"), ({"fraction": 0.0}, r"in \(0, 1\]"), ({"fraction": 1.5}, r"in \(0, 1\]"),
    ({"tokens": 2, "fraction": 0.1}, "exactly one"), ({}, "exactly one"), ({"tokens": 2.5}, "integer"),
    ({"tokens": 4, "store": "ssd"}, "store must be"), ({"tokens": 4, "dtype": torch.int8}, "dtype must be"),
])
def test_recall_rejects_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Recall(**kwargs)


@pytest.mark.parametrize("text, message", [
    ("abc", "expected K"), ("-3", "integer >= 0"), ("1.5", r"in \(0, 1\]"), ("4:disk:disk", "at most one"),
    ("4:tape", "at most one"),
])
def test_recall_spec_rejects_bad_text(text, message):
    with pytest.raises(ValueError, match=message):
        parse_cache_spec(f"fibquant:b=2@recall={text}")


def test_recall_spec_option_and_bad_combinations():
    spec = parse_cache_spec("fibquant:b=1.5/fibquant:b=1@recall=32")
    assert spec.recall == Recall(tokens=32) and spec.spec == "fibquant:b=1.5/fibquant:b=1@recall=32"
    assert parse_cache_spec(spec.spec) == spec and "recall=32" in spec.label(64)
    assert spec.key_bytes(64) == parse_cache_spec("fibquant:b=1.5").key_bytes(64)  # hot bytes unchanged
    assert spec.cold_bytes(64) == 2 * 64 * 2 and parse_cache_spec("fibquant:b=2").cold_bytes(64) == 0
    assert parse_cache_spec("fibquant:b=2@recall=8:fp32").cold_bytes(64) == 2 * 64 * 4
    for text in ("fibquant:b=2@recall=8@decode", "fibquant:b=2@recall=8@heavy=0.02", "fp@recall=8",
                 "fibquant:b=2@recall=8@recall=4"):
        with pytest.raises(ValueError):
            parse_cache_spec(text)


def test_cache_rejects_recall_off_codes_or_with_a_tier():
    codec = parse_codec_spec("fibquant:b=2").build(DIM)
    with pytest.raises(ValueError, match="attention on the codes"):
        CompressedCache(codec, codec, attention="decode", recall=Recall(tokens=4))
    with pytest.raises(ValueError, match="must be a fibquant.kv.cold.Recall"):
        CompressedCache(codec, codec, attention="codes", recall=32)


# ---------------------------------------------------------------------- attention with recall
def _coded_kv(recall, tokens=1, past=200, groups=3, centre=False, seed=1):
    """A filled layer's CodedKV for `tokens` new tokens, their queries, and the exact data."""
    codec = parse_codec_spec("fibquant:b=2").build(DIM)
    cache = CompressedCache(codec, codec, sink_tokens=4, recent_tokens=8, attention="codes", encode_batch=4,
                            layer_plan=Centred() if centre else None, recall=recall)
    gen = torch.Generator().manual_seed(seed)
    old_k, old_v = torch.randn(1, 2, past, DIM, generator=gen), torch.randn(1, 2, past, DIM, generator=gen)
    cache.update(old_k, old_v, 0)
    new_k, new_v = torch.randn(1, 2, tokens, DIM, generator=gen), torch.randn(1, 2, tokens, DIM, generator=gen)
    kv, _ = cache.layers[0].update(new_k, new_v)
    query = torch.randn(1, 2 * groups, tokens, DIM, generator=gen)
    return cache, kv, query, torch.cat([old_k, new_k], 2), torch.cat([old_v, new_v], 2)


@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("recall", [Recall(tokens=7), Recall(fraction=0.1), Recall(tokens=0)])
def test_recall_equals_its_reference(tokens, recall):
    """Attention with exactly each row's top-k coded columns replaced by their exact rows (the plain torch
    spec) equals the implementation: decode steps, short chunks and split prefill chunks."""
    _, kv, query, _, _ = _coded_kv(recall, tokens)
    assert kv.num_coded > 100
    torch.testing.assert_close(attend_codes(query, kv, None, DIM ** -0.5),
                               recall_reference(query, kv, DIM ** -0.5), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 20])
def test_recall_of_every_coded_token_is_exact_attention(tokens):
    """k = all coded tokens: every column exact, so the result is attention over the uncoded cache
    (centred codes too: the mean is added to coded values only)."""
    _, kv, query, keys, values = _coded_kv(Recall(fraction=1.0), tokens, centre=True)
    groups = query.shape[1] // keys.shape[1]
    length = keys.shape[-2]
    mask = torch.ones(tokens, length, dtype=torch.bool).tril(length - tokens)
    exact = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1), attn_mask=mask,
        scale=DIM ** -0.5).transpose(1, 2)
    torch.testing.assert_close(attend_codes(query, kv, None, DIM ** -0.5), exact, rtol=1e-4, atol=1e-5)
    plain = attend_codes(query, dataclasses.replace(kv, cold=None), None, DIM ** -0.5)
    assert (plain - exact).abs().max() > 1e-3  # the codes alone are not exact: recall did the work


def test_recall_counts_no_token_twice():
    """The weights of one row sum to one over [window, coded-with-recall]: with every value row = 1 the
    output is exactly 1, and a row's picked columns are exactly its top-k (chosen once per row)."""
    _, kv, query, _, _ = _coded_kv(Recall(tokens=9), tokens=3)
    # every exact value (window and cold rows) 1, the coded values 1 + their decoding error: the output of a
    # row is 1 + sum over its coded, unpicked columns of p_i * error_i, so picked columns count once, exactly
    flat = dataclasses.replace(kv, sink_values=torch.ones_like(kv.sink_values),
                               recent_values=torch.ones_like(kv.recent_values), new_values=torch.ones_like(kv.new_values))
    kv.cold.values.data[:] = 1.0
    torch.testing.assert_close(attend_codes(query, flat, None, DIM ** -0.5),
                               recall_reference(query, flat, DIM ** -0.5), rtol=1e-4, atol=1e-5)
    everything = dataclasses.replace(flat, cold=_coded_kv(Recall(fraction=1.0), tokens=3)[1].cold)
    everything.cold.values.data[:] = 1.0
    torch.testing.assert_close(attend_codes(query, everything, None, DIM ** -0.5), torch.ones(1, 3, 6, DIM))
    scores = torch.randn(2, 3, 4, 50)
    chosen, index = pick(scores, 9)
    assert bool((chosen.sum(-1) == 9).all())
    assert torch.equal(chosen.nonzero()[:, -1].view(2, 3, 4, 9).sort(-1).values,
                       scores.topk(9, -1).indices.sort(-1).values)
    union = chosen.any(-2)
    for b in range(2):
        for h in range(3):
            assert set(union[b, h].nonzero().view(-1).tolist()) <= set(index[b, h].tolist())


def test_recall_with_softcap_is_refused():
    _, kv, query, _, _ = _coded_kv(Recall(tokens=4))
    with pytest.raises(ValueError, match="soft-capping"):
        attend_codes(query, kv, None, DIM ** -0.5, softcap=30.0)


# ---------------------------------------------------------------------- accounting and the model
def test_accounting_keeps_cold_bytes_apart_and_counts_reads():
    cache, kv, query, _, _ = _coded_kv(Recall(tokens=6), tokens=1, groups=2)
    layer = cache.layers[0]
    plain, _, _, _, _ = _coded_kv(None, tokens=1, groups=2)
    assert cache.used_nbytes() == plain.used_nbytes() and cache.nbytes() == plain.nbytes()  # hot: unchanged
    assert cache.cold_nbytes() == layer.num_coded * 2 * (DIM + DIM) * 4  # float32 rows, 2 heads
    assert cache.cold_bytes_per_token() == pytest.approx(cache.cold_nbytes() / cache.get_seq_length())
    assert plain.cold_nbytes() == 0 and plain.cold_reads() == {"rows": 0, "bytes": 0, "calls": 0}
    attend_codes(query, kv, None, DIM ** -0.5)
    reads = cache.cold_reads()
    assert reads["calls"] == 1 and 6 <= reads["rows"] / 2 <= 12  # per head: the union of 2 query heads' top-6
    assert reads["bytes"] == reads["rows"] * 2 * DIM * 4


def test_generate_with_recall_and_the_spec_through_build_cache():
    model = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (1, 90), generator=torch.Generator().manual_seed(0))
    plain_spec, recall_spec, all_spec = ("fibquant:b=2", "fibquant:b=2@recall=8", "fibquant:b=2@recall=1.0")
    outputs = {}
    with attention_on_codes(model), torch.no_grad():
        for text in (plain_spec, recall_spec, all_spec):
            cache = build_cache(text, model, sink_tokens=4, recent_tokens=8)
            outputs[text] = model.generate(ids, **cache_kwarg(model, cache), max_new_tokens=6, do_sample=False)
            if text != plain_spec:
                assert cache.cold_reads()["calls"] == 5 * model.config.num_hidden_layers  # 5 steps after the prefill
                assert cache.cold_nbytes() > 0
        exact = model.generate(ids, **cache_kwarg(model, DynamicCache(config=model.config)), max_new_tokens=6,
                               do_sample=False)
        # k = every coded token: the logits of exact attention (float rounding aside)
        full = build_cache(all_spec, model, sink_tokens=4, recent_tokens=8)
        logits = model(ids, **cache_kwarg(model, full)).logits
        reference = model(ids, **cache_kwarg(model, DynamicCache(config=model.config))).logits
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    assert torch.equal(outputs[all_spec], exact)


def test_recall_on_disk_through_a_model_and_batch_edits(tmp_path):
    model = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 60), generator=torch.Generator().manual_seed(1))
    recall = Recall(tokens=5, store="disk", directory=str(tmp_path), dtype=torch.float16)
    with attention_on_codes(model), torch.no_grad():
        cache = CompressedCache.for_model(model, "fibquant:b=2", sink_tokens=4, recent_tokens=8, recall=recall)
        model(ids, **cache_kwarg(model, cache))
        layer = cache.layers[0]
        assert layer.cold.dtype == torch.float16 and len(list(tmp_path.iterdir())) == 2 * len(cache.layers)
        keys, _ = layer.cold.rows()
        cache.batch_select_indices(torch.tensor([1]))
        assert torch.equal(layer.cold.rows()[0], keys[1:])
        cache.crop(30)
        assert layer.cold.used == layer.num_coded == 30 - 4
    with pytest.raises(ValueError, match="sets recall already"):
        CompressedCache.for_model(model, "fibquant:b=2@recall=4", recall=recall)
    assert math.isfinite(cache.cold_bytes_per_token())


@pytest.mark.parametrize("k", [1, 7, 32, 50])
def test_row_topk_picks_the_columns_of_torch_topk(k):
    from fibquant.kv.attention.numba_recall import row_topk

    scores = torch.randn(2, 3, 4, 50, generator=torch.Generator().manual_seed(k))
    scores[0, 0, 0, 10:] = float("-inf")  # fewer visible columns than k: the masked ones fill the rest
    got = row_topk(scores, k)
    assert got.shape == (2, 3, 4, k)
    assert torch.equal(got.sort(-1).values[1:], scores.topk(k, -1).indices.sort(-1).values[1:])
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, got, True)
    assert bool((chosen.sum(-1) == k).all())  # k distinct columns per row
    assert torch.equal(scores.masked_fill(~chosen, float("inf")).amin(-1),
                       scores.topk(k, -1).values[..., -1])  # the k-th largest is the smallest picked


@pytest.mark.parametrize("recall", [Recall(tokens=7), Recall(fraction=1.0), Recall(tokens=0)])
@pytest.mark.parametrize("centre", [False, True])
def test_fused_one_token_recall_equals_the_torch_path(monkeypatch, recall, centre):
    """A decode step with recall through the fused numba kernel (numba_decode) equals the torch split path
    and the reference, with a padding mask too; the rows it reads are counted."""
    from _kv_helpers import fast_and_torch_paths

    pytest.importorskip("numba", reason="numba absent: the fused one-token kernel does not run")
    cache, kv, query, _, _ = _coded_kv(recall, tokens=1, centre=centre)
    before = kv.cold.rows_read
    fast, slow = fast_and_torch_paths(query, kv, None, DIM ** -0.5)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast, recall_reference(query, kv, DIM ** -0.5), rtol=1e-4, atol=1e-5)
    k = recall.count(kv.num_coded)
    # the fused step reads k rows per query head (6), the torch path as many again (per-row reads) or the union
    assert kv.cold.rows_read - before >= 6 * k and (k or kv.cold.rows_read == before)
    mask = torch.ones(1, 1, 1, kv.length, dtype=torch.bool)
    mask[..., 4:40] = False  # the first coded tokens hidden: never recalled
    fast, slow = fast_and_torch_paths(query, kv, mask, DIM ** -0.5)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    per_head = torch.rand(1, 6, 1, kv.length, generator=torch.Generator().manual_seed(3)) > 0.3
    per_head[..., -1] = True  # every head sees its own token
    fast, slow = fast_and_torch_paths(query, kv, per_head, DIM ** -0.5)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    additive = torch.randn(1, 6, 1, kv.length, generator=torch.Generator().manual_seed(4))  # a float bias
    fast, slow = fast_and_torch_paths(query, kv, additive, DIM ** -0.5)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)


def test_prefill_chunk_recall_with_a_per_head_mask_matches_decode_steps():
    """A chunk's union reads under a per-head float mask equal the same rows attended one token at a time
    (each token as its own one-row block, read per row)."""
    _, kv, query, _, _ = _coded_kv(Recall(tokens=8), tokens=12)
    additive = torch.randn(1, 6, 12, kv.length, generator=torch.Generator().manual_seed(5))
    causal = torch.ones(12, kv.length, dtype=torch.bool).tril(kv.length - 12)
    bias = additive.masked_fill(~causal, float("-inf"))
    whole = attend_codes(query, kv, bias, DIM ** -0.5)
    assert kv.cold.recall.count(kv.num_coded) * 12 * 3 > kv.num_coded  # the chunk takes the union reads
    for t in range(12):
        step = dataclasses.replace(kv, new_keys=kv.new_keys[..., :t + 1, :], new_values=kv.new_values[..., :t + 1, :])
        one = attend_codes(query[:, :, t:t + 1], step, bias[:, :, t:t + 1, :kv.length - 11 + t], DIM ** -0.5)
        torch.testing.assert_close(one[:, 0], whole[:, t], rtol=1e-4, atol=1e-5)


def test_decode_speed_names_a_recall_cache_and_refuses_other_options():
    from fibquant.eval.decode_speed.config import parse_cache_name

    spec = parse_cache_name("fibquant:b=2@recall=32")
    assert spec.name == "fibquant:b=2@recall=32" and spec.recall_option() == Recall(tokens=32)
    assert spec.codec_spec().spec == "fibquant:b=2" and "recall=32" in spec.label
    assert parse_cache_name("fibquant:b=2").recall_option() is None
    with pytest.raises(ValueError, match="cannot be timed here"):
        parse_cache_name("fibquant:b=2@recall=32@centre")
