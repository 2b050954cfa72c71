"""CompressedCache.save/load, token(layer, head, i), append=True writers, in-place code search,
ranged archive reads, and per-layer / per-head codecs (kv/headwise.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from _kv_helpers import tiny_llama
from fibquant.kv.model import cache_kwarg
from fibquant.archive.exact import RadixCoder
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.integer import IntCodec
from fibquant.codecs.rvq import RVQCodec
from fibquant.kv.cache import CompressedCache, CompressedLayer
from fibquant.kv.headwise import Fp16Codec, HeadwiseCodec, LayerwiseCompressedCache
from fibquant.kv.persist.store import PersistentCache
from fibquant.kv.attention.switch import attention_on_codes

torch.set_num_threads(1)
FIELDS = ("sink_keys", "sink_values", "recent_keys", "recent_values")


@pytest.fixture(scope="module")
def model():
    model = tiny_llama(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def codec():
    return FibQuantCodec.for_rate(64, 2.0)


def _ids(n, seed=0):
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def _run(model, cache, ids):
    with attention_on_codes(model):
        with torch.no_grad():
            return model(input_ids=ids, **cache_kwarg(model, cache), use_cache=True).logits


def _prefilled(model, codec, tokens=70, chunk=9, seed=0):
    cache = CompressedCache.for_model(model, codec, codec, sink_tokens=4, recent_tokens=8, encode_batch=4)
    ids = _ids(tokens, seed)
    for s in range(0, tokens, chunk):
        _run(model, cache, ids[:, s:s + chunk])
    return cache, ids


def _same_state(a, b):
    for la, lb in zip(a.layers, b.layers, strict=True):
        for name in FIELDS:
            assert torch.equal(getattr(la, name), getattr(lb, name)), name
        assert torch.equal(la.key_codes, lb.key_codes) and torch.equal(la.value_codes, lb.value_codes)


def test_cache_save_load_methods(model, codec, tmp_path):
    cache, ids = _prefilled(model, codec)
    cache.save(tmp_path / "c", model, ids)
    loaded = CompressedCache.load(tmp_path / "c", model)
    assert torch.equal(loaded.token_ids, ids[0])
    _same_state(cache, loaded)
    nxt = _ids(3, seed=5)
    assert torch.equal(_run(model, cache, nxt), _run(model, loaded, nxt))
    other = tiny_llama(seed=3, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="another model"):
        CompressedCache.load(tmp_path / "c", other)
    assert len(CompressedCache.load(tmp_path / "c").layers) == 2  # no model: no check, decode attention


def test_token_reads_one_row(model, codec, tmp_path):
    cache, ids = _prefilled(model, codec)
    cache.save(tmp_path / "c", model, ids)
    with PersistentCache.open(tmp_path / "c") as store:
        for layer_index, layer in enumerate(cache.layers):
            keys, values = layer.keys, layer.values
            for head in range(2):
                for i in (0, 3, 4, 20, 57, 69):  # sinks, codes, window
                    k, v = store.token(layer_index, head, i)
                    assert torch.equal(k, keys[0, head, i]) and torch.equal(v, values[0, head, i])
                k, v = store.token(layer_index, head, slice(2, 65))
                assert torch.equal(k, keys[0, head, 2:65]) and torch.equal(v, values[0, head, 2:65])
        with pytest.raises(IndexError):
            store.token(0, 0, 70)
        with pytest.raises(IndexError):
            store.token(0, 2, 5)
        with pytest.raises(ValueError, match="step"):
            store.token(0, 0, slice(0, 10, 2))


def test_token_read_int_codec_falls_back(model, tmp_path):
    codec = IntCodec(64, 4)
    cache, ids = _prefilled(model, codec)
    cache.save(tmp_path / "c", model, ids)
    with PersistentCache.open(tmp_path / "c") as store:
        k, v = store.token(1, 1, 30)
        assert torch.equal(k, cache.layers[1].keys[0, 1, 30]) and torch.equal(v, cache.layers[1].values[0, 1, 30])


def test_save_append_writer_during_generate(model, codec, tmp_path):
    ids = _ids(20)
    cache = CompressedCache.for_model(model, codec, codec, sink_tokens=4, recent_tokens=8, encode_batch=4)
    _run(model, cache, ids[:, :19])  # the prompt but its last token, which generate feeds
    writer = cache.save(tmp_path / "w", model, ids[:, :19], append=True, checkpoint_every=5)
    with torch.no_grad(), attention_on_codes(model):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwarg(model, cache),
                             do_sample=False, max_new_tokens=30, stopping_criteria=[writer])
    with PersistentCache.open(tmp_path / "w") as store:  # before close: every sealed checkpoint is there
        assert store.num_coded > 0
    writer.close()
    loaded = CompressedCache.load(tmp_path / "w", model)
    _same_state(cache, loaded)
    assert torch.equal(loaded.token_ids, out[0])


def test_find_code_sequences(model, codec, tmp_path):
    cache, ids = _prefilled(model, codec, tokens=90)
    cache.save(tmp_path / "c", model, ids)
    with PersistentCache.open(tmp_path / "c") as store:
        for role, attr in (("keys", "key_codes"), ("values", "value_codes")):
            for layer_index, layer in enumerate(cache.layers):
                rows = getattr(layer, attr)[0, 1]  # head 1: [coded, code_size]
                for t, n in ((0, 1), (10, 4), (30, 20)):
                    query = rows[t:t + n]
                    found = store.find(query, layer_index, 1, role)
                    truth = [s for s in range(rows.shape[0] - n + 1) if torch.equal(rows[s:s + n], query)]
                    assert found.tolist() == truth and t in truth
        other = store.find(torch.zeros(2, 18, dtype=torch.uint8), 0, 0)
        assert other.size == 0 or all(torch.equal(cache.layers[0].key_codes[0, 0, s:s + 2],
                                                  torch.zeros(2, 18, dtype=torch.uint8)) for s in other)
        with pytest.raises(ValueError, match="codes must be"):
            store.find(np.zeros((1, 5), np.uint8), 0, 0)
        with pytest.raises(ValueError, match="role"):
            store.find(rows[:1], 0, 0, "queries")


@pytest.mark.parametrize("alphabet", [2, 3, 97, 256, 1000, 1 << 16, 49152])
def test_radix_decode_range_matches_decode(alphabet):
    codec = RadixCoder(alphabet)
    rng = np.random.default_rng(alphabet)
    symbols = rng.integers(0, alphabet, size=1000)
    payload = b"xy" + codec.encode(symbols)
    full = codec.decode(payload[2:], 1000)
    for start, stop in ((0, 0), (0, 1), (5, 21), (999, 1000), (17, 800), (0, 1000)):
        assert np.array_equal(codec.decode_range(payload, 1000, start, stop, 2), full[start:stop])


def test_archive_short_reads_match(tmp_path):
    from fibquant.archive import Archive

    rng = np.random.default_rng(0)
    symbols = rng.integers(0, 256, size=50_000)
    with Archive.create(tmp_path / "a.fqa", 256) as archive:
        archive.append(symbols)
    with Archive.open(tmp_path / "a.fqa") as archive:
        for start, stop in ((0, 16), (8190, 8210), (49_990, 50_000), (100, 9000)):
            assert np.array_equal(archive.read(start, stop), symbols[start:stop])


def test_layer_from_state_and_from_layers(model, codec):
    cache, _ = _prefilled(model, codec)
    layers = [CompressedLayer.from_state(codec, codec, 4, 8, {n: getattr(layer, n) for n in FIELDS},
                                         layer.key_codes, layer.value_codes, "decode", 4) for layer in cache.layers]
    rebuilt = CompressedCache.from_layers(layers)
    _same_state(cache, rebuilt)
    keys, values = cache.coded_rows_since(10)
    assert keys.shape == (2, 1, 2, cache.layers[0].num_coded - 10, 18)
    assert torch.equal(values[1], cache.layers[1].value_codes[..., 10:, :])
    with pytest.raises(ValueError, match="uint8"):
        CompressedLayer.from_state(codec, codec, 4, 8, {n: getattr(cache.layers[0], n) for n in FIELDS},
                                   cache.layers[0].key_codes.float(), cache.layers[0].value_codes)
    with pytest.raises(ValueError):
        CompressedCache.from_layers([])


def test_headwise_and_layerwise_codecs(model, codec):
    torch.manual_seed(0)
    samples = [torch.randn(600, 64) + h for h in range(2)]
    rvqs = [RVQCodec.fit(s, 2, 16, max_iterations=5) for s in samples]
    headwise = HeadwiseCodec(rvqs)
    x = torch.randn(1, 2, 7, 64)
    codes = headwise.encode(x)
    assert codes.shape == (1, 2, 7, rvqs[0].code_size)
    for h in range(2):
        assert torch.equal(codes[:, h], rvqs[h].encode(x[:, h]))
        assert torch.equal(headwise.decode(codes)[:, h], rvqs[h].decode(codes[:, h]))
    with pytest.raises(ValueError, match="head"):
        headwise.encode(torch.randn(3, 7, 64))
    with pytest.raises(ValueError, match="same dim"):
        HeadwiseCodec([rvqs[0], RVQCodec.fit(samples[0], 3, 16, max_iterations=2)])
    half = torch.randn(5, 64)
    assert torch.equal(Fp16Codec(64).roundtrip(half), half.half().float())
    # per-layer codecs: layer l holds codecs[l]; with one codec everywhere it is a plain CompressedCache
    key_codecs, value_codecs = [headwise, codec], [Fp16Codec(64), headwise]
    layered = LayerwiseCompressedCache(key_codecs, value_codecs, 4, 8, encode_batch=4)
    ids = _ids(40)
    _run(model, layered, ids)
    assert [layer.key_codec for layer in layered.layers] == key_codecs
    assert [layer.value_codec for layer in layered.layers] == value_codecs
    assert torch.equal(layered.layers[0].value_codes.view(torch.float16).float(),
                       layered.layers[0].values[..., 4:4 + layered.layers[0].num_coded, :])
    same = LayerwiseCompressedCache([codec, codec], [codec, codec], 4, 8, encode_batch=4)
    plain = CompressedCache(codec, codec, 4, 8, encode_batch=4)
    assert torch.equal(_run(model, same, ids), _run(model, plain, ids))
    with pytest.raises(ValueError, match="one key and one value"):
        LayerwiseCompressedCache([codec], [codec, codec])
    too_few = LayerwiseCompressedCache([codec], [codec], 4, 8)
    with pytest.raises(ValueError, match="codecs for 1 layers"):
        _run(model, too_few, ids)


def test_study_bytes_arithmetic():
    from fibquant.eval.archive.study import StudyConfig, row_bytes

    class Bank:  # codebook bytes only
        def codebook_bytes(self, depth, kind):
            return depth * 256 * 64 * 4 * (90 if kind == "head" else 1)

    info = {"layers": 30, "kv_heads": 3, "head_dim": 64}
    row = {"kind": "head", "key_depth": 4, "value_depth": 2}
    out = row_bytes(row, Bank(), StudyConfig(), info)
    assert out["code_bytes_per_token"] == 90 * 6 == 540 and out["fp16_bytes_per_token"] == 23040
    assert out["ratio_marginal"] == pytest.approx(23040 / 540)
    assert out["bytes_per_token_at_context"] == pytest.approx((988 * 540 + 36 * 23040) / 1024)
    assert out["codebook_bytes"] == 6 * 256 * 64 * 4 * 90
    with pytest.raises(ValueError, match="differ"):
        StudyConfig(calibration_text="emma")


@pytest.mark.parametrize("bits", [2.0, 3.0])
def test_token_reads_equal_the_codec_decode_cold_and_warm(model, bits, tmp_path):
    """token() of every coded (layer, head, token), on a fresh open (each block verified on first
    touch) and again warm: bitwise the codec's decode of the cache's own code rows."""
    codec = FibQuantCodec.for_rate(64, bits)
    cache, ids = _prefilled(model, codec, tokens=90)
    cache.save(tmp_path / "c", model, ids)
    with PersistentCache.open(tmp_path / "c") as store:
        assert store._row_decoders() != [None, None]  # noqa: SLF001 - the numpy row path is the one tested
        for _ in ("cold", "warm"):
            for index, layer in enumerate(cache.layers):
                keys = codec.decode(layer.key_codes[0])      # [H, coded, D]
                values = codec.decode(layer.value_codes[0])
                for head in range(2):
                    for t in range(layer.num_coded):
                        k, v = store.token(index, head, 4 + t)
                        assert k.dtype == torch.float32 and torch.equal(k, keys[head, t])
                        assert torch.equal(v, values[head, t]) and torch.equal(k, layer.keys[0, head, 4 + t])
        k, v = store.token(1, 0, 50, dtype=torch.float64)
        assert k.dtype == torch.float64 and torch.equal(k, cache.layers[1].keys[0, 0, 50].double())


def test_find_many_equals_find_and_brute_force(model, codec, tmp_path):
    cache, ids = _prefilled(model, codec, tokens=90)
    cache.save(tmp_path / "c", model, ids)
    rng = np.random.default_rng(0)
    with PersistentCache.open(tmp_path / "c") as store:
        for role, attr in (("keys", "key_codes"), ("values", "value_codes")):
            for n in (1, 3):
                picks = [(int(rng.integers(2)), int(rng.integers(2)), int(rng.integers(0, 78 - n))) for _ in range(12)]
                queries = torch.stack([getattr(cache.layers[l], attr)[0, h, t:t + n] for l, h, t in picks])
                got = store.find_many(queries, [l for l, _, _ in picks], [h for _, h, _ in picks], role)
                for (l, h, t), query, hits in zip(picks, queries, got):
                    rows = getattr(cache.layers[l], attr)[0, h]
                    truth = [s for s in range(rows.shape[0] - n + 1) if torch.equal(rows[s:s + n], query)]
                    assert hits.tolist() == truth and t in truth
                    assert store.find(query, l, h, role).tolist() == truth
        with pytest.raises(IndexError):
            store.find_many(queries, 2, 0)


def test_cache_writer_refuses_batches(model, codec, tmp_path):
    from fibquant.kv.persist.generate import CacheWriter

    cache, ids = _prefilled(model, codec, tokens=20)
    writer = cache.save(tmp_path / "w", model, ids, append=True)
    with pytest.raises(ValueError, match=r"batch-1 generation only \(got batch 2\)"):
        writer(torch.zeros(2, 21, dtype=torch.long), None)
    writer.close()  # no checkpoint of the refused batch; the store is closed, the saved cache intact
    assert writer.store.closed
    with PersistentCache.open(tmp_path / "w") as store:
        assert store.num_tokens == 20
    batch2 = CompressedCache.for_model(model, codec, codec, sink_tokens=4, recent_tokens=8, encode_batch=4)
    _run(model, batch2, _ids(40).repeat(2, 1) + torch.tensor([[0], [1]]))
    store = PersistentCache.create(tmp_path / "b2", model, codec, codec, sink_tokens=4, recent_tokens=8,
                                   encode_batch=4, batch=2)
    with pytest.raises(ValueError, match="got batch 2"):
        CacheWriter(store, batch2)
    store.append_from(batch2)  # the store itself takes B rows per (layer, head)
    store.checkpoint(batch2)
    store.close()
    with PersistentCache.open(tmp_path / "b2") as store:
        for b in range(2):
            k, v = store.token(1, 1, 20, batch=b)
            assert torch.equal(k, batch2.layers[1].keys[b, 1, 20]) and torch.equal(v, batch2.layers[1].values[b, 1, 20])


def test_append_refuses_another_codec(model, codec, tmp_path):
    cache, ids = _prefilled(model, codec, tokens=30)
    cache.save(tmp_path / "c", model, ids)
    for other, reason in ((FibQuantCodec.for_rate(64, 2.0, seed=1), "seed.: 1"),
                          (FibQuantCodec.for_rate(64, 3.0), "config"), (IntCodec(64, 4), "family")):
        live = CompressedCache.for_model(model, codec, other, sink_tokens=4, recent_tokens=8, encode_batch=4)
        _run(model, live, _ids(40))
        with PersistentCache.open(tmp_path / "c", "a") as store:
            with pytest.raises(ValueError, match=f"value codec of layer 0 is not the saved one.*{reason}"):
                store.append_from(live)
            assert store.num_coded == cache.layers[0].num_coded  # nothing appended
    equal = FibQuantCodec.for_rate(64, 2.0)  # another object with the same content: accepted
    assert equal is not codec
    live = CompressedCache.for_model(model, equal, equal, sink_tokens=4, recent_tokens=8, encode_batch=4)
    _run(model, live, _ids(40))
    with PersistentCache.open(tmp_path / "c", "a") as store:
        store.append_from(live, _ids(40))
        store.checkpoint(live)
    with PersistentCache.open(tmp_path / "c") as store:
        assert store.num_tokens == 40
        k, _ = store.token(1, 1, 30)
        assert torch.equal(k, live.layers[1].keys[0, 1, 30])


def test_durable_store_fsyncs_code_streams(model, codec, tmp_path, monkeypatch):
    import os

    cache, ids = _prefilled(model, codec, tokens=30)
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", spy)
    cache.save(tmp_path / "plain", model, ids)
    assert synced == []  # durable=False: flushed, never fsynced
    cache.save(tmp_path / "d", model, ids, durable=True)
    names = {str(p).split("/d/", 1)[1] if "/d/" in str(p) else str(p) for p in synced}
    for role in ("keys", "values"):
        for name in ("indices.fqa", "norms.fqa", "layout.json"):
            assert f"{role}/{name}" in names, names
        assert role in names  # the directory entries of its files
    assert {"tokens.fqa", "exact.safetensors.tmp", "manifest.json.tmp"} <= names
    synced.clear()
    with PersistentCache.open(tmp_path / "d", "a", durable=True) as store:
        live = store.to_cache(model)
        _run(model, live, _ids(8, seed=3))
        store.append_from(live)
        store.checkpoint(live)
    assert {"keys/indices.fqa", "values/norms.fqa", "exact.safetensors.tmp"} <= {
        str(p).split("/d/", 1)[1] for p in synced if "/d/" in str(p)}
