"""Saved caches with calibrated codecs (per layer / per head, safetensors codec files), centred
caches (their means in the snapshot), and files of format version 1."""
from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from _kv_helpers import edit_manifest, tiny_llama
from fibquant.kv.model import cache_kwarg
from fibquant.archive import RecoveryWarning
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.identity import IdentityCodec
from fibquant.codecs.integer import IntCodec
from fibquant.codecs.lowrank import LowRankCodec
from fibquant.codecs.rvq import RVQCodec
from fibquant.kv.cache import CompressedCache
from fibquant.kv.headwise import Fp16Codec, HeadwiseCodec, LayerwiseCompressedCache
from fibquant.kv.plan import Centred
from fibquant.kv.persist.store import PersistentCache
from fibquant.kv.persist.format import FORMAT_VERSION, SNAPSHOT_FILE, read_snapshot, write_snapshot
from fibquant.kv.persist.generate import generate_persistent, resume_generate
from fibquant.kv.attention.switch import attention_on_codes

torch.set_num_threads(1)
FIELDS = ("sink_keys", "sink_values", "recent_keys", "recent_values")
DATA = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.fixture(scope="module")
def model():
    model = tiny_llama(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model.generation_config.eos_token_id = None
    return model


def _ids(n, seed=0):
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def _run(model, cache, ids):
    with attention_on_codes(model):
        with torch.no_grad():
            return model(input_ids=ids, **cache_kwarg(model, cache), use_cache=True).logits


def _fill(model, cache, tokens=70, chunk=9):
    ids = _ids(tokens)
    for s in range(0, tokens, chunk):
        _run(model, cache, ids[:, s:s + chunk])
    return ids


def _same(a, b):
    """Bitwise-equal state: windows, codes, means and the decoded keys/values of every layer."""
    for la, lb in zip(a.layers, b.layers, strict=True):
        for name in FIELDS:
            assert torch.equal(getattr(la, name), getattr(lb, name)), name
        assert torch.equal(la.key_codes, lb.key_codes) and torch.equal(la.value_codes, lb.value_codes)
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
        for name in ("key_mean", "value_mean"):
            ma, mb = getattr(la, name), getattr(lb, name)
            assert (ma is None and mb is None) or torch.equal(ma, mb), name


def _fits(seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = [torch.randn(128, 64, generator=g) for _ in range(4)]
    rvq = [RVQCodec.fit(s, 2, 16, max_iterations=4) for s in samples]
    lowrank = [LowRankCodec.fit(s, 64) for s in samples[:2]]  # rank 64: 128 B codes, as fp16
    return rvq, lowrank


def _layerwise():
    rvq, lowrank = _fits()
    keys = [HeadwiseCodec(rvq[:2]), rvq[2]]  # per-head RVQ in layer 0, one RVQ for layer 1
    values = [Fp16Codec(64), HeadwiseCodec(lowrank)]
    return LayerwiseCompressedCache(keys, values, 4, 8, encode_batch=4)


def test_calibrated_per_layer_per_head_roundtrip(model, tmp_path):
    cache = _layerwise()
    ids = _fill(model, cache)
    cache.save(tmp_path / "c", model, ids)
    files = sorted(p.name for p in (tmp_path / "c/codecs").iterdir())
    assert len(files) == 5 and sum(f.startswith("rvq-") for f in files) == 3  # 3 RVQ + 2 low-rank, once each
    manifest = json.loads((tmp_path / "c/manifest.json").read_text())
    assert manifest["version"] == FORMAT_VERSION and manifest["streams"]["keys"]["layout"] is None
    loaded = CompressedCache.load(tmp_path / "c", model, attention="decode")
    assert isinstance(loaded, LayerwiseCompressedCache)
    assert isinstance(loaded.layers[0].key_codec, HeadwiseCodec) and type(loaded.layers[0].value_codec) is IdentityCodec
    for a, b in zip(cache.key_codecs[0].codecs, loaded.layers[0].key_codec.codecs):
        assert torch.equal(a.codebooks, b.codebooks)
    _same(cache, loaded)  # decoded K/V bitwise identical
    with PersistentCache.open(tmp_path / "c") as store:
        layer = cache.layers[0]
        for i in (0, 5, 20, 40, 69):  # sink, coded, window
            for head in range(2):
                for index, live in enumerate(cache.layers):
                    k, v = store.token(index, head, i)
                    assert torch.equal(k, live.keys[0, head, i])
                    if index == 0:
                        assert torch.equal(v, live.values[0, head, i])
                    else:  # LowRankCodec: one row's matmul rounds differently from a batch's (<= 1e-6)
                        assert torch.allclose(v, live.values[0, head, i], rtol=0, atol=1e-5)
        keys, values = store.kv(20)
        assert torch.equal(keys[1], cache.layers[1].keys[..., 20, :])
        assert torch.equal(values[0], layer.values[..., 20, :])
        assert torch.equal(store.layer_kv(0)[0], layer.keys)
    nxt = _ids(6, seed=1)
    assert torch.equal(_run(model, cache, nxt), _run(model, loaded, nxt))  # next-token logits identical
    _same(cache, loaded)


def test_calibrated_role_codec_in_a_plain_cache(model, tmp_path):
    rvq, lowrank = _fits(1)
    cache = CompressedCache(HeadwiseCodec(rvq[:2]), lowrank[0], 4, 8, encode_batch=4)
    ids = _fill(model, cache)
    cache.save(tmp_path / "c", model, ids)
    loaded = CompressedCache.load(tmp_path / "c", model, attention="decode")
    assert type(loaded) is CompressedCache and isinstance(loaded.key_codec, HeadwiseCodec)
    _same(cache, loaded)
    nxt = _ids(3, seed=2)
    assert torch.equal(_run(model, cache, nxt), _run(model, loaded, nxt))


def test_codec_file_errors(model, tmp_path):
    cache = _layerwise()
    ids = _fill(model, cache, tokens=30)
    cache.save(tmp_path / "c", model, ids)
    victim = sorted((tmp_path / "c/codecs").iterdir())[0]
    for name, mutate, match in (
            ("flip", lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 1])), "checksum"),
            ("gone", lambda p: p.unlink(), "missing")):
        bad = tmp_path / name
        shutil.copytree(tmp_path / "c", bad)
        mutate(bad / "codecs" / victim.name)
        with pytest.raises(ValueError, match=match):
            CompressedCache.load(bad, model)
    manifest = json.loads((tmp_path / "c/manifest.json").read_text())
    for name, edit, match in (("family", lambda m: m["value_codec"].update(family="nope"), "unknown codec family"),
                              ("escape", lambda m: m["key_codecs"][1].update(file="../x.safetensors"), "inside"),
                              ("config", lambda m: m["key_codecs"][1]["config"].update(stages=3), "config")):
        bad = tmp_path / f"m-{name}"
        shutil.copytree(tmp_path / "c", bad)
        edit_manifest(bad, edit)
        with pytest.raises(ValueError, match=match):
            CompressedCache.load(bad, model)


def test_code_sizes_must_agree_per_role(model, tmp_path):
    rvq, _ = _fits()
    cache = LayerwiseCompressedCache([rvq[0], IntCodec(64, 4)], [rvq[1], rvq[1]], 4, 8, encode_batch=4)
    _fill(model, cache, tokens=20)
    with pytest.raises(ValueError, match="code sizes"):
        cache.save(tmp_path / "c", model)
    assert not (tmp_path / "c").exists()


def test_fp16_codec_is_the_identity_codec_saturating():
    x = torch.randn(50, 64) * 300
    assert torch.equal(Fp16Codec(64).encode(x), IdentityCodec(64).encode(x))  # the same bytes
    big = torch.full((1, 64), 1e6)
    assert torch.isinf(Fp16Codec(64).roundtrip(big)).all()
    with pytest.raises(ValueError, match="fp16 range"):
        IdentityCodec(64).encode(big)


@pytest.fixture(scope="module")
def centred_codecs():
    return FibQuantCodec.for_rate(64, 2.0), IntCodec(64, 4)


def test_centred_cache_roundtrip(model, centred_codecs, tmp_path):
    cache = CompressedCache.for_model(model, *centred_codecs, 4, 8, encode_batch=4, layer_plan=Centred())
    ids = _fill(model, cache)
    assert cache.layers[0].key_mean is not None
    cache.save(tmp_path / "c", model, ids)
    loaded = CompressedCache.load(tmp_path / "c", model)
    assert loaded.layer_plan.centred and all(layer.centre for layer in loaded.layers)
    _same(cache, loaded)
    assert loaded.layers[1].value_mean.dtype == torch.float32
    with PersistentCache.open(tmp_path / "c") as store:  # lazy reads add the means as the cache does
        for layer_index, layer in enumerate(cache.layers):
            assert torch.equal(store.layer_kv(layer_index)[0], layer.keys)
            assert torch.equal(store.layer_kv(layer_index, 10, 50)[1], layer.values[..., 10:50, :])
        for i in (2, 30, 60):
            k, v = store.token(1, 1, i)
            assert torch.equal(k, cache.layers[1].keys[0, 1, i]) and torch.equal(v, cache.layers[1].values[0, 1, i])
        keys, _ = store.kv(30)
        assert torch.equal(keys[1], cache.layers[1].keys[..., 30, :])
    nxt = _ids(7, seed=3)
    assert torch.equal(_run(model, cache, nxt), _run(model, loaded, nxt))  # resumed logits identical
    _same(cache, loaded)


def test_centred_generate_then_resume_is_identical(model, centred_codecs, tmp_path):
    ids = _ids(20)
    with attention_on_codes(model):
        reference = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   past_key_values=CompressedCache.for_model(model, *centred_codecs, 4, 8,
                                                                             encode_batch=4, layer_plan=Centred()),
                                   max_new_tokens=30, output_scores=True, return_dict_in_generate=True)
    first = generate_persistent(model, ids, tmp_path / "g", *centred_codecs, recent_tokens=8, encode_batch=4,
                                max_new_tokens=15, checkpoint_every=5, layer_plan=Centred())
    assert torch.equal(first[0], reference.sequences[0, :35])
    second = resume_generate(model, tmp_path / "g", max_new_tokens=15, output_scores=True,
                             return_dict_in_generate=True)
    assert torch.equal(second.sequences[0], reference.sequences[0])
    for a, b in zip(second.scores, reference.scores[15:]):
        assert torch.equal(a, b)


def test_centred_codes_without_means_are_dropped(model, centred_codecs, tmp_path):
    """A crash after the first codes were appended but before a checkpoint saved the means."""
    cache = CompressedCache.for_model(model, *centred_codecs, 4, 8, encode_batch=4, layer_plan=Centred())
    ids = _fill(model, cache, tokens=40)
    cache.save(tmp_path / "c", model, ids)
    layers, coded = read_snapshot(tmp_path / "c" / SNAPSHOT_FILE, 2)
    assert coded > 0 and "key_mean" in layers[0]
    stale = [{name: layer[name][..., :0, :] if name.startswith("recent") else layer[name] for name in FIELDS}
             for layer in layers]
    write_snapshot(tmp_path / "c" / SNAPSHOT_FILE, stale, 0)
    with pytest.warns(RecoveryWarning, match="without the layers' means"):
        store = PersistentCache.open(tmp_path / "c", "a")
    with store:
        assert store.num_coded == 0 and store.num_tokens == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecoveryWarning)  # mode "a" left it clean
        with PersistentCache.open(tmp_path / "c") as store:
            assert store.num_tokens == 4


def _sha(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _sums(t):
    t = t.double()
    return [t.sum().item(), t.abs().sum().item(), t.norm().item()]


def test_version_1_files_still_open(model, tmp_path):
    """tests/fixtures/persist_v1.fqkv was written by format version 1 (FibQuant keys in a CodeArchive,
    INT values in a byte stream). What it stores losslessly (code rows, exact window) must read back
    bit for bit; decoded floats and logits depend on the CPU's vector instructions, so they are
    compared with a tolerance: to sums recorded in persist_v1_expected.json and to a float
    DynamicCache recomputed from the decoded keys/values."""
    shutil.copytree(DATA / "persist_v1.fqkv", tmp_path / "v1")
    expected = json.loads((DATA / "persist_v1_expected.json").read_text())
    assert json.loads((tmp_path / "v1/manifest.json").read_text())["version"] == 1
    cache = CompressedCache.load(tmp_path / "v1", model)
    assert [_sha(layer.key_codes) for layer in cache.layers] == expected["key_codes"]
    assert [_sha(layer.value_codes) for layer in cache.layers] == expected["value_codes"]
    assert [[_sha(getattr(layer, name)) for name in ("sink_keys", "sink_values", "recent_keys", "recent_values")]
            for layer in cache.layers] == expected["exact"]
    for role in ("keys", "values"):
        for layer, sums in zip(cache.layers, expected[role]):
            assert _sums(getattr(layer, role)) == pytest.approx(sums, rel=1e-5, abs=1e-4), role
    reference = DynamicCache()
    for index, layer in enumerate(cache.layers):
        reference.update(layer.keys.clone(), layer.values.clone(), index)
    next_ids = torch.tensor([expected["next_ids"]])
    logits = _run(model, cache, next_ids)
    torch.testing.assert_close(logits, _run(model, reference, next_ids), rtol=1e-4, atol=1e-4)
    assert _sums(logits) == pytest.approx(expected["next_logits"], rel=1e-4, abs=1e-3)
    with PersistentCache.open(tmp_path / "v1", "a") as store:  # appending keeps the version-1 files valid
        store.append_from(cache, torch.cat([store.token_ids(), torch.tensor(expected["next_ids"])]))
        store.checkpoint(cache)
        info = store.info()
    assert info["key_codec"]["family"] == "fibquant" and info["tokens"] == 45
    assert json.loads((tmp_path / "v1/manifest.json").read_text())["version"] == 1
    assert CompressedCache.load(tmp_path / "v1", model).get_seq_length() == 45


def test_learned_codecs_are_deduplicated_by_content(model, tmp_path, monkeypatch):
    import copy

    import fibquant.kv.persist.entries as persist_codecs

    rvq, _ = _fits(4)
    twin = copy.deepcopy(rvq[0])  # another object, the same fit
    assert twin is not rvq[0] and torch.equal(twin.codebooks, rvq[0].codebooks)
    written = []
    real_write = persist_codecs._write_codec_file
    monkeypatch.setattr(persist_codecs, "_write_codec_file",
                        lambda codec, root: written.append(codec) or real_write(codec, root))
    cache = LayerwiseCompressedCache([rvq[0], twin], [HeadwiseCodec([twin, rvq[0]]), rvq[1]], 4, 8, encode_batch=4)
    ids = _fill(model, cache, tokens=30)
    cache.save(tmp_path / "c", model, ids)
    assert len(written) == 2  # rvq[0] (= twin) and rvq[1], each once
    assert len(list((tmp_path / "c/codecs").iterdir())) == 2
    manifest = json.loads((tmp_path / "c/manifest.json").read_text())
    assert manifest["key_codecs"][0] == manifest["key_codecs"][1] == manifest["value_codecs"][0][0]
    loaded = CompressedCache.load(tmp_path / "c", model, attention="decode")
    first = loaded.layers[0].key_codec
    assert loaded.layers[1].key_codec is first and loaded.layers[0].value_codec.codecs[1] is first  # built once
    _same(cache, loaded)
    # Appending from a cache whose codec has the same config but another learned state is refused.
    other, _ = _fits(5)
    live = LayerwiseCompressedCache([other[0], twin], [HeadwiseCodec([twin, rvq[0]]), rvq[1]], 4, 8, encode_batch=4)
    _fill(model, live, tokens=40)
    with PersistentCache.open(tmp_path / "c", "a") as store:
        with pytest.raises(ValueError, match="key codec of layer 0 is not the saved one .another codebook/rotation"):
            store.append_from(live)


# --------------------------------------------------------------- codec state across machines (format 3)
def _fibquant_saved(model, path, key_codec=None):
    cache = CompressedCache(key_codec or FibQuantCodec(64, 4, 256), IntCodec(64, 4), 4, 8, encode_batch=4)
    cache.save(path, model, _fill(model, cache, tokens=40))
    return cache


def _rotation_one_ulp_up(monkeypatch):
    """Another CPU's rotation: every entry of the float32 Pi^T one ulp up (another BLAS/LAPACK path)."""
    from fibquant.codecs.rotation import RotationState

    real = RotationState.forward_matrix
    monkeypatch.setattr(RotationState, "forward_matrix",
                        lambda self, device: torch.nextafter(real(self, device), torch.tensor(float("inf"))))


def test_last_bit_rotation_difference_still_opens(model, tmp_path, monkeypatch):
    from fibquant.kv.persist.entries import codec_state_sha256

    cache = _fibquant_saved(model, tmp_path / "c")
    manifest = json.loads((tmp_path / "c/manifest.json").read_text())
    assert manifest["version"] == FORMAT_VERSION and "state_sha256" not in manifest["key_codec"]
    saved_hash = codec_state_sha256(FibQuantCodec(64, 4, 256))
    _rotation_one_ulp_up(monkeypatch)
    assert codec_state_sha256(FibQuantCodec(64, 4, 256)) != saved_hash  # a float hash would refuse it
    loaded = CompressedCache.load(tmp_path / "c", model)
    for la, lb in zip(cache.layers, loaded.layers, strict=True):
        assert torch.equal(la.key_codes, lb.key_codes) and torch.equal(la.value_codes, lb.value_codes)
        torch.testing.assert_close(la.keys, lb.keys)
    with PersistentCache.open(tmp_path / "c", "a") as store:  # appending from such a cache is accepted too
        _run(model, loaded, _ids(8, seed=3))
        store.append_from(loaded)


def test_other_codec_state_is_refused(model, tmp_path, monkeypatch):
    import fibquant.codecs.fibquant as fibquant_module
    import fibquant.codecs.rotation as rotation_module

    _fibquant_saved(model, tmp_path / "c")
    manifest_path = tmp_path / "c/manifest.json"
    manifest = json.loads(manifest_path.read_text())
    # The rotation of another seed where this one computes the same config's: refused.
    real_haar = rotation_module.haar_rotation
    with monkeypatch.context() as patch:
        patch.setattr(rotation_module, "haar_rotation", lambda dim, seed, **kw: real_haar(dim, seed + 1, **kw))
        with pytest.raises(ValueError, match="fibquant codebook/rotation/state here differs.*rotation differs by"):
            CompressedCache.load(tmp_path / "c", model)
    # Another codebook for the same (d, k, N, seed) (another build or recipe): one codeword moved.
    real_load = fibquant_module.load_codebook

    def moved(*args, **kwargs):
        book = real_load(*args, **kwargs)
        codewords = book.codewords.clone()
        codewords[0] = -codewords[0]
        return type(book)(book.spec, codewords, book.total_mse, book.build_seconds, book.version)

    with monkeypatch.context() as patch:
        patch.setattr(fibquant_module, "load_codebook", moved)
        with pytest.raises(ValueError, match="codewords differs by"):
            CompressedCache.load(tmp_path / "c", model)
    # A manifest naming another rotation seed than the state it was saved with: refused.
    edit_manifest(tmp_path / "c", lambda m: m["key_codec"]["config"].update(rotation_seed=1))
    with pytest.raises(ValueError, match="rotation differs by"):
        CompressedCache.load(tmp_path / "c", model)
    manifest_path.write_text(json.dumps(manifest))
    # Appending from a cache of another seed's rotation: its config differs, refused before any state.
    other = CompressedCache(FibQuantCodec(64, 4, 256, rotation_seed=1), IntCodec(64, 4), 4, 8, encode_batch=4)
    _fill(model, other, tokens=40)
    with PersistentCache.open(tmp_path / "c", "a") as store:
        with pytest.raises(ValueError, match="is not the saved one .config"):
            store.append_from(other)
    assert CompressedCache.load(tmp_path / "c", model).get_seq_length() == 40


def test_version_2_state_hash_still_checked(model, tmp_path, monkeypatch):
    """A version-2 manifest (sha256 of the float state, no fingerprint) opens where the bits agree and
    is refused with a clear message where they do not (it holds nothing to compare with a tolerance)."""
    from fibquant.kv.persist.entries import codec_state_sha256

    _fibquant_saved(model, tmp_path / "c")
    def version_2(manifest):
        manifest["version"] = 2
        for role, codec in (("key_codec", FibQuantCodec(64, 4, 256)), ("value_codec", IntCodec(64, 4))):
            del manifest[role]["state_fingerprint"]
            manifest[role]["state_sha256"] = codec_state_sha256(codec)
    edit_manifest(tmp_path / "c", version_2)
    assert CompressedCache.load(tmp_path / "c", model).get_seq_length() == 40
    _rotation_one_ulp_up(monkeypatch)
    with pytest.raises(ValueError, match="version-1/2 file: exact bits"):
        CompressedCache.load(tmp_path / "c", model)
