"""Saved compressed caches: exact round trip, lazy token access, resumption, errors, crash recovery."""
from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from _kv_helpers import tiny_llama
from fibquant.kv.model import cache_kwarg
from fibquant.archive import RecoveryWarning
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.integer import IntCodec
from fibquant.kv.cache import CompressedCache
from fibquant.kv.persist.store import PersistentCache, load_cache, save_cache
from fibquant.kv.persist.generate import CacheWriter, generate_persistent, resume_generate
from fibquant.kv.persist.prefix import common_prefix_length, find_prefix, prefill_with_prefix
from fibquant.kv.attention.switch import attention_on_codes

torch.set_num_threads(1)
FIELDS = ("sink_keys", "sink_values", "recent_keys", "recent_values")


@pytest.fixture(scope="module")
def model():
    # head_dim 64 so the shipped FibQuant codebooks apply; 2 layers, 2 KV heads.
    model = tiny_llama(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model.generation_config.eos_token_id = None  # random weights: generate the full length
    return model


@pytest.fixture(scope="module")
def codecs():
    return FibQuantCodec.for_rate(64, 2.0), IntCodec(64, 4)  # a CodeArchive stream and a byte stream


def _ids(n, seed=0):
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def _run(model, cache, ids):
    with attention_on_codes(model):
        with torch.no_grad():
            return model(input_ids=ids, **cache_kwarg(model, cache), use_cache=True).logits


def _assert_same_state(a: CompressedCache, b: CompressedCache):
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        for name in FIELDS:
            assert torch.equal(getattr(la, name), getattr(lb, name)), name
        assert torch.equal(la.key_codes, lb.key_codes) and torch.equal(la.value_codes, lb.value_codes)


def _prefilled(model, codecs, tokens=70, chunk=9):
    cache = CompressedCache.for_model(model, *codecs, sink_tokens=4, recent_tokens=8, encode_batch=4)
    ids = _ids(tokens)
    for s in range(0, tokens, chunk):
        _run(model, cache, ids[:, s:s + chunk])
    return cache, ids


def test_save_load_roundtrip_is_exact(model, codecs, tmp_path):
    cache, ids = _prefilled(model, codecs)
    save_cache(cache, tmp_path / "c", model, ids)
    loaded, token_ids = load_cache(tmp_path / "c", model)
    assert torch.equal(token_ids, ids[0])
    _assert_same_state(cache, loaded)
    nxt = _ids(5, seed=1)
    assert torch.equal(_run(model, cache, nxt), _run(model, loaded, nxt))  # resumed logits identical
    _assert_same_state(cache, loaded)


def test_lazy_open_token_access(model, codecs, tmp_path):
    cache, ids = _prefilled(model, codecs)
    save_cache(cache, tmp_path / "c", model, ids)
    with PersistentCache.open(tmp_path / "c") as store:  # no model: no fingerprint check
        assert store.num_tokens == cache.get_seq_length() == 70
        assert store.num_coded == cache.layers[0].num_coded > 0
        for layer_index, layer in enumerate(cache.layers):
            keys, values = store.layer_kv(layer_index)
            assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
            part, _ = store.layer_kv(layer_index, 10, 20)
            assert torch.equal(part, layer.keys[..., 10:20, :])
        for t in (0, 3, 4, 30, 69):  # sink, coded, window
            keys, values = store.kv(t)
            assert keys.shape == (2, 1, 2, 64)
            for layer_index, layer in enumerate(cache.layers):
                assert torch.equal(keys[layer_index], layer.keys[..., t, :])
                assert torch.equal(values[layer_index], layer.values[..., t, :])
        with pytest.raises(IndexError):
            store.kv(70)
        info = store.info()
        assert info["tokens"] == 70 and info["bytes"]["keys"] > 0


def test_generate_then_resume_is_identical(model, codecs, tmp_path):
    ids = _ids(20)
    with attention_on_codes(model):
        reference = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   past_key_values=CompressedCache.for_model(model, *codecs, 4, 8, encode_batch=4),
                                   max_new_tokens=50, output_scores=True, return_dict_in_generate=True)
    first = generate_persistent(model, ids, tmp_path / "g", *codecs, recent_tokens=8, encode_batch=4,
                                max_new_tokens=25, checkpoint_every=7)
    assert torch.equal(first[0], reference.sequences[0, :45])
    second = resume_generate(model, tmp_path / "g", max_new_tokens=25, output_scores=True,
                             return_dict_in_generate=True)
    assert torch.equal(second.sequences[0], reference.sequences[0])
    for a, b in zip(second.scores, reference.scores[25:]):
        assert torch.equal(a, b)
    with PersistentCache.open(tmp_path / "g") as store:
        assert torch.equal(store.token_ids(), reference.sequences[0])
        assert store.num_tokens == 69


def test_errors(model, codecs, tmp_path):
    cache, ids = _prefilled(model, codecs)
    save_cache(cache, tmp_path / "c", model, ids)
    with pytest.raises(ValueError, match="exists"):
        save_cache(cache, tmp_path / "c", model, ids)
    with pytest.raises(ValueError, match="another model"):
        PersistentCache.open(tmp_path / "c", model=tiny_llama(seed=1, hidden_size=128, num_attention_heads=4,
                                                                 num_key_value_heads=2, head_dim=64))
    with pytest.raises(ValueError, match="no saved KV cache"):
        PersistentCache.open(tmp_path / "nothing")
    with pytest.raises(ValueError, match="token ids"):
        save_cache(cache, tmp_path / "d", model, ids[:, :10])
    with pytest.raises(ValueError, match="not open for writing"):
        PersistentCache.open(tmp_path / "c").append_from(cache)
    with pytest.raises(ValueError, match="checkpoint_every"):
        CacheWriter(None, cache, checkpoint_every=0)
    # corrupt files
    for name, mutate, match in (
        ("manifest.json", lambda b: b[:-7], "corrupt manifest"),
        ("manifest.json", lambda b: b.replace(b"fibquant-kv-cache", b"something-else!!"), "not a saved"),
        ("exact.safetensors", lambda b: b[: len(b) // 2], "corrupt or truncated"),
        ("exact.safetensors", lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:], "checksum"),
        ("keys/norms.fqa", lambda b: b[:20] + b"\xff" + b[21:], "corrupt code stream"),
    ):
        bad = tmp_path / f"bad-{name.replace('/', '-')}-{match[:4]}"
        shutil.copytree(tmp_path / "c", bad)
        (bad / name).write_bytes(mutate((bad / name).read_bytes()))
        with pytest.raises(ValueError, match=match):
            PersistentCache.open(bad).to_cache()
    # a flipped byte inside a code payload is caught by the block CRC when read
    bad = tmp_path / "bad-payload"
    shutil.copytree(tmp_path / "c", bad)
    raw = bytearray((bad / "values/bytes.fqa").read_bytes())
    raw[200] ^= 0x10
    (bad / "values/bytes.fqa").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="checksum"):
        PersistentCache.open(bad).to_cache()


def test_unsupported_codec(model, tmp_path):
    from fibquant.codecs.identity import IdentityCodec

    class Unregistered(IdentityCodec):  # an "fp" codec under another family name: not in the registry
        family = "mine"

    codec = Unregistered(64)
    with pytest.raises(ValueError, match="cannot persist"):
        PersistentCache.create(tmp_path / "x", model, codec, codec)
    assert not (tmp_path / "x").exists()  # a refused codec leaves no directory


def test_crash_recovery_every_truncation(model, codecs, tmp_path):
    """A crash leaves streams sealed up to different points: every truncation of the key
    index stream opens to a consistent prefix of the original state, with a warning."""
    cache, ids = _prefilled(model, codecs, tokens=200, chunk=5)
    save_cache(cache, tmp_path / "c", model, ids)
    size = (tmp_path / "c/keys/indices.fqa").stat().st_size
    seen = set()
    for cut in range(64, size, max(1, size // 23)):
        crashed = tmp_path / f"crash{cut}"
        shutil.copytree(tmp_path / "c", crashed)
        with open(crashed / "keys/indices.fqa", "r+b") as handle:
            handle.truncate(cut)
        with pytest.warns(RecoveryWarning):
            store = PersistentCache.open(crashed, "a")
        n = store.num_tokens
        seen.add(n)
        assert 4 <= n <= 200
        loaded = store.to_cache()
        for la, lb in zip(loaded.layers, cache.layers):  # the recovered state is the original's, cut to n
            assert torch.equal(la.keys, lb.keys[..., : n, :]) and torch.equal(la.values, lb.values[..., : n, :])
        store.close()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RecoveryWarning)  # recovery was written back: a clean reopen
            with PersistentCache.open(crashed) as again:
                assert again.num_tokens == n
    assert len(seen) >= 2  # cuts before and after the first sealed block (128 tokens here)


def test_crash_during_generation_then_resume(model, codecs, tmp_path):
    ids = _ids(20)
    cache = CompressedCache.for_model(model, *codecs, 4, 8, encode_batch=4)
    store = PersistentCache.create(tmp_path / "g", model, *codecs, recent_tokens=8, encode_batch=4)
    writer = CacheWriter(store, cache, checkpoint_every=16)
    with attention_on_codes(model):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwarg(model, cache),
                       do_sample=False, max_new_tokens=60, stopping_criteria=[writer])
    shutil.copytree(tmp_path / "g", tmp_path / "crashed")  # the files as a killed process leaves them
    store.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecoveryWarning)
        with PersistentCache.open(tmp_path / "crashed") as crashed:
            n = crashed.num_tokens
            assert n >= 20 + 16  # at least the last checkpoint
            stored = crashed.token_ids()
            recovered = crashed.to_cache()
            for got, layer in zip(recovered.layers, cache.layers):  # sinks and codes as the live cache had them
                assert torch.equal(got.sink_keys, layer.sink_keys) and got.num_coded > 0
                assert torch.equal(got.key_codes, layer.key_codes[..., : got.num_coded, :])
                assert torch.equal(got.value_codes, layer.value_codes[..., : got.num_coded, :])
        out = resume_generate(model, tmp_path / "crashed", max_new_tokens=5)
    assert torch.equal(out[0, : stored.shape[0]], stored) and out.shape[1] == stored.shape[0] + 5
    with PersistentCache.open(tmp_path / "crashed") as resumed:
        assert resumed.num_tokens == stored.shape[0] + 4


def test_prefix_reuse(model, codecs, tmp_path):
    cache, ids = _prefilled(model, codecs, tokens=60, chunk=60)
    save_cache(cache, tmp_path / "caches/a", model, ids)
    save_cache(*_prefilled(model, codecs, tokens=30, chunk=30)[:1], tmp_path / "caches/b", model,
               _ids(30, seed=5))
    prompt = torch.cat([ids[0], _ids(7, seed=3)[0]])
    assert common_prefix_length(prompt, ids[0]) == 60
    path, n = find_prefix(tmp_path / "caches", prompt)
    assert path.name == "a" and n == 60
    reused, logits, stats = prefill_with_prefix(model, prompt, path)
    assert stats["reused_tokens"] == 60 and stats["computed_tokens"] == 7
    direct = _run(model, cache, prompt[None, 60:])[:, -1]
    assert torch.equal(logits, direct)  # extending a saved prompt = continuing the saved run
    diverged = torch.cat([ids[0, :40], _ids(5, seed=4)[0]])
    short, _, stats = prefill_with_prefix(model, diverged, path)
    assert stats["reused_tokens"] == 40 and short.get_seq_length() == 45
