"""The model identity of saved caches (kv/persist/model_identity.py): a model whose every weight is one
ulp off opens the cache, another fine-tune, architecture or dtype is refused, naming what differs."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from _kv_helpers import edit_manifest, tiny_llama
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.integer import IntCodec
from fibquant.kv.cache import CompressedCache
from fibquant.kv.model import cache_kwarg
from fibquant.kv.persist.fingerprint import TOLERANCE, tensor_fingerprint, tensor_mismatch
from fibquant.kv.persist.model_identity import (identity_summary, model_identity, model_mismatch, model_sha256,
                                                weight_tolerance)
from fibquant.kv.persist.format import FORMAT_VERSION
from fibquant.kv.persist.store import PersistentCache

torch.set_num_threads(1)
ARCH = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
WEIGHT = "model.layers.1.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def model():
    return tiny_llama(**ARCH)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """A cache of 40 tokens saved with `model` (FibQuant keys, INT values), and its state."""
    path = tmp_path_factory.mktemp("identity") / "c"
    cache = CompressedCache(FibQuantCodec(64, 4, 256), IntCodec(64, 4), 4, 8, encode_batch=4)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, **cache_kwarg(model, cache), use_cache=True)
    cache.save(path, model, ids)
    return path, cache


def _edited(model, fn):
    """A copy of `model` with fn(name, parameter) applied to every parameter in place."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in other.named_parameters():
            fn(name, param)
    return other


def _one_ulp(direction):
    return lambda name, p: p.copy_(torch.nextafter(p, torch.full_like(p, direction)))


@pytest.mark.parametrize("direction", [float("inf"), float("-inf")], ids=["up", "down"])
def test_every_weight_one_ulp_off_still_opens(model, saved, direction):
    path, cache = saved
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["version"] == FORMAT_VERSION and manifest["model_fingerprint"] == model_identity(model)
    shifted = _edited(model, _one_ulp(direction))
    assert all(not torch.equal(a, b) for a, b in zip(model.parameters(), shifted.parameters()))
    assert model_sha256(shifted) != model_sha256(model)  # the version-1/2 hash would refuse it
    loaded = CompressedCache.load(path, shifted)
    for la, lb in zip(cache.layers, loaded.layers, strict=True):
        assert torch.equal(la.key_codes, lb.key_codes) and torch.equal(la.recent_keys, lb.recent_keys)
    with PersistentCache.open(path, "a", model=shifted):
        pass


def test_another_fine_tune_is_refused_naming_the_parameter(model, saved):
    path, _ = saved
    tuned = _edited(model, lambda name, p: p.mul_(1.01) if name == WEIGHT else None)
    with pytest.raises(ValueError, match=rf"another model .*weights: {WEIGHT} differs by \d\.\d\de-02 of its rms"):
        CompressedCache.load(path, tuned)
    # Two changed parameters: the first is named, the other counted.
    tuned = _edited(model, lambda name, p: p.add_(1e-3 * torch.randn_like(p)) if "mlp" in name else None)
    with pytest.raises(ValueError, match=r"weights: model\.layers\.0\.mlp\.down_proj\.weight differs by .* \(and 5 more"):
        PersistentCache.open(path, model=tuned)
    with pytest.raises(ValueError, match=r"another model"):  # another random init of the same architecture
        PersistentCache.open(path, model=tiny_llama(seed=1, **ARCH))


def test_other_architecture_or_dtype_is_refused(model, saved):
    path, _ = saved
    with pytest.raises(ValueError, match="config num_hidden_layers 3, saved 2"):
        PersistentCache.open(path, model=tiny_llama(num_hidden_layers=3, **ARCH))
    with pytest.raises(ValueError, match=r"parameters differ: 1 saved ones missing here \(lm_head\.weight\)"):
        PersistentCache.open(path, model=tiny_llama(tie_word_embeddings=True, **ARCH))
    with pytest.raises(ValueError, match=r"lm_head\.weight: shape \[97, 128\] torch\.float64, "
                                         r"saved \[97, 128\] torch\.float32"):
        PersistentCache.open(path, model=copy.deepcopy(model).double())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: shape \[128, 64\] "
                                         r"torch\.float32, saved \[128, 96\]"):  # another MLP width
        PersistentCache.open(path, model=tiny_llama(intermediate_size=64, **ARCH))


def test_version_2_manifest_keeps_its_exact_hash(model, saved, tmp_path):
    """A version-1/2 manifest (or a format-3 one written before the identity) holds a sha256 string:
    it opens with the same bits and is refused, saying so, when every weight is one ulp off."""
    import shutil

    shutil.copytree(saved[0], tmp_path / "c")
    edit_manifest(tmp_path / "c", lambda m: m.update(model_fingerprint=model_sha256(model)))
    assert CompressedCache.load(tmp_path / "c", model).get_seq_length() == 40
    with pytest.raises(ValueError, match="version-1/2 file: exact bits"):
        CompressedCache.load(tmp_path / "c", _edited(model, _one_ulp(float("inf"))))
    with PersistentCache.open(tmp_path / "c") as store:
        assert store.info()["fingerprint"] == f"sha256 {model_sha256(model)[:16]} (version 1-2: exact)"
    edit_manifest(tmp_path / "c", lambda m: m.update(model_fingerprint=3))
    with pytest.raises(ValueError, match="model_fingerprint must be"):
        PersistentCache.open(tmp_path / "c")


def test_half_precision_tolerance_covers_sparse_last_bits_not_a_rescale():
    """bfloat16 weights: one ulp on 1% of them (a float32 computation rounded differently near ties)
    matches; a tensor scaled by 1.01 (~1.3 bfloat16 ulps) does not."""
    bf16 = tiny_llama(**ARCH).to(torch.bfloat16)
    assert weight_tolerance("torch.bfloat16") == torch.finfo(torch.bfloat16).eps > weight_tolerance("torch.float16") \
        > weight_tolerance("torch.float32") == TOLERANCE
    saved = model_identity(bf16)
    generator = torch.Generator().manual_seed(0)

    def sparse_ulps(name, p):
        flip = torch.rand(p.shape, generator=generator) < 0.01
        p.copy_(torch.where(flip, torch.nextafter(p, torch.full_like(p, float("inf"))), p))

    assert model_mismatch(saved, _edited(bf16, sparse_ulps)) is None
    tuned = _edited(bf16, lambda name, p: p.mul_(1.01) if name == WEIGHT else None)
    assert f"{WEIGHT} differs by" in model_mismatch(saved, tuned)


def test_all_zero_parameter_one_subnormal_off_matches():
    zero = torch.zeros(300)
    assert tensor_mismatch(tensor_fingerprint(zero), tensor_fingerprint(torch.nextafter(zero, torch.ones(300)))) is None
    assert tensor_mismatch(tensor_fingerprint(zero), tensor_fingerprint(torch.full((300,), 1e-6))) is not None


def test_cache_info_prints_short_labels(saved, capsys):
    from fibquant.cli import main

    path, _ = saved
    assert main(["cache", "info", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fingerprint"] == identity_summary(json.loads((path / "manifest.json").read_text())["model_fingerprint"])
    assert info["fingerprint"].endswith("llama, 2 layers, 21 parameters, weights within 0.0001 of their rms")
    assert info["key_codec"]["state_fingerprint"].endswith("(within 0.0001 of the rms)")
    assert info["key_codec"]["config"]["k"] == 4 and "proj" not in json.dumps(info)


def _with_config(model, **changes):
    """A copy of `model` (same weights) whose config differs in `changes`."""
    other = copy.deepcopy(model)
    for key, value in changes.items():
        setattr(other.config, key, value)
    return other


def test_another_rope_base_or_window_with_the_same_weights_is_refused(model, saved):
    """transformers 5 keeps the rope theta in `rope_parameters` (`rope_theta` is None): a model with the
    same weights and another rope base, rope scaling or sliding window computed other keys."""
    path, _ = saved
    rope = dict(model.config.rope_parameters, rope_theta=500000.0)
    with pytest.raises(ValueError, match="config rope_parameters .*500000"):
        CompressedCache.load(path, _with_config(model, rope_parameters=rope))
    with pytest.raises(ValueError, match="config sliding_window 16, saved None"):
        PersistentCache.open(path, model=_with_config(model, sliding_window=16))


def test_identity_saved_before_the_later_config_keys_still_opens(model, saved, tmp_path):
    """A format-3 identity written before LATER_CONFIG_KEYS were recorded lacks them: not compared."""
    import shutil

    from fibquant.kv.persist.model_identity import LATER_CONFIG_KEYS

    shutil.copytree(saved[0], tmp_path / "c")
    edit_manifest(tmp_path / "c", lambda m: [m["model_fingerprint"]["config"].pop(key) for key in LATER_CONFIG_KEYS])
    rope = dict(model.config.rope_parameters, rope_theta=500000.0)
    assert CompressedCache.load(tmp_path / "c", _with_config(model, rope_parameters=rope)).get_seq_length() == 40
    with pytest.raises(ValueError, match="config num_hidden_layers 3, saved 2"):  # the original keys still count
        PersistentCache.open(tmp_path / "c", model=tiny_llama(num_hidden_layers=3, **ARCH))
