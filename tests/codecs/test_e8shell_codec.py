"""FibQuant-E8 (`fibquant.codecs.e8shell.E8ShellCodec`): the fast search's codes equal the exhaustive
reference's, norm correction, the code layout, spec strings and bad input (the shared contract is in
test_codecs.py)."""
from __future__ import annotations

from fibquant.kv.attention.switch import attention_on_codes

import math

import numpy as np
import pytest
import torch

from fibquant.codebook.e8shell import shell_tables, unrank
from fibquant.codecs.bitpack import bytes_to_float16, unpack_bits
from fibquant.codecs.e8shell import E8ShellCodec, shipped_levels
from fibquant.codecs.layout import CodeLayout
from fibquant.codecs.registry import parse_codec_spec


def _rows(n=200, seed=0):
    x = torch.randn(n, 64, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.1, 5, 64)
    x[min(3, n - 1)] = 0
    return x


@pytest.mark.parametrize("bits,nc", [(2, False), (2, True), (1, False), (1.5, True), (1.75, False)])
def test_encode_equals_the_exhaustive_reference(bits, nc):
    codec = E8ShellCodec(64, bits, norm_correction=nc)
    x = _rows()
    expected = codec.encode_with(x, exhaustive=True)
    assert torch.equal(codec.encode(x), expected)
    assert torch.equal(codec.encode_with(x, exhaustive=False, method="lattice"), expected)


@pytest.mark.parametrize("bits,nc", [(3, False), (3, True), (4, False), (4, True)])
def test_encode_equals_the_leader_scan_at_3_and_4_bits(bits, nc):
    """b >= 3 has too many points to materialise: the plain leader scan (equal to the exhaustive search at
    b <= 2) is the reference of `encode` (the lattice search at b = 4). Scaled channels and a zero row,
    Gaussian rows, and heavy-tailed rows (outlier channels, as in real keys)."""
    codec = E8ShellCodec(64, bits, norm_correction=nc)
    g = torch.Generator().manual_seed(bits)
    heavy = torch.from_numpy(np.random.default_rng(bits).standard_t(2.0, (300, 64))).float() * torch.rand(64, generator=g)
    for x in (_rows(), torch.randn(300, 64, generator=g), heavy):
        assert torch.equal(codec.encode(x), codec.encode_with(x, exhaustive=False, method="scan"))
    with pytest.raises(ValueError, match="method"):
        codec.encode_with(_rows(4), exhaustive=False, method="beam")


@pytest.mark.parametrize("bits,bound", [(1.75, 0.127), (2, 0.087), (3, 0.0226)])
def test_d128_levels_round_trip_within_bounds(bits, bound):
    """d = 128 (the d = 64 shells, radii refitted on the canonical source in R^128): measured MSE per unit
    vector 0.1236 / 0.0854 / 0.0221 at 1.75 / 2 / 3 bits (FibQuant 0.1331 / 0.0960 / 0.0255), fresh vectors here."""
    from fibquant.canonical import sample_sphere

    codec = E8ShellCodec(128, bits)
    u = sample_sphere(2048, 128, seed=4242)
    assert codec.code_size == 2 + int(16 * bits)
    mse = float(((codec.roundtrip(u) - u) ** 2).sum(1).mean())
    assert mse < bound, mse
    if bits <= 2:
        assert torch.equal(codec.encode(u[:100]), codec.encode_with(u[:100], exhaustive=True))


def test_rates_layout_and_shipped_levels():
    for bits, size in ((1, 10), (1.5, 14), (1.75, 16), (2, 18), (3, 26), (4, 34)):
        codec = E8ShellCodec(64, bits)
        assert codec.code_size == size and codec.bits_per_coordinate == bits
        assert codec.tables.count <= 2 ** (8 * bits) and codec.tables.count > 2 ** (8 * bits - 1)
        assert parse_codec_spec(f"e8shell:b={bits}").build(64).code_size == size
        layout = CodeLayout.from_codec(codec)
        codes = codec.encode(_rows(20)).numpy()
        index, norms = layout.split(codes)
        assert np.array_equal(layout.join(index, norms), codes)
        levels = shipped_levels(64, bits)
        assert list(levels.radii) == sorted(levels.radii)


def test_norm_correction_keeps_the_input_norm_and_the_indices():
    plain, corrected = E8ShellCodec(64, 3), E8ShellCodec(64, 3, norm_correction=True)
    x = _rows()
    a, b = plain.encode(x), corrected.encode(x)
    assert torch.equal(a[:, 2:], b[:, 2:])
    # the stored value is ||x|| / ||u_hat||, ||u_hat||^2 = the sum of the blocks' squared level radii
    index = unpack_bits(b[:, 2:], 24, 8)
    points = unrank(index.reshape(-1).numpy(), shell_tables(corrected.levels)).reshape(len(x), 64)
    u_norm = np.sqrt((points ** 2).sum(1))
    stored = bytes_to_float16(b[:, :2]).double().numpy()
    norms = x.double().norm(dim=1).numpy()
    expected = np.where(norms > 0, norms / np.maximum(u_norm, 1e-30), 0.0)  # a zero row stores 0
    np.testing.assert_allclose(stored, expected, rtol=1e-3)
    out = corrected.decode(b)
    np.testing.assert_allclose(out.norm(dim=1).numpy(), x.norm(dim=1).numpy(), rtol=2e-3)
    assert torch.equal(out[3], torch.zeros(64))


def test_rotation_draws_and_spec_strings():
    method = parse_codec_spec("e8shell:b=3,nc=1,r=2")
    codec = method.build(64)
    assert (codec.bits, codec.norm_correction, codec.rotation_seed) == (3, True, 2)
    assert method.label(64) == "FibQuant-E8 b=3 (shell code,nc,r=2)"
    x = _rows(20)
    assert not torch.equal(codec.encode(x), E8ShellCodec(64, 3, True).encode(x))
    assert parse_codec_spec("e8shell:b=1.75,nc=1").label(64) == "FibQuant-E8 b=1.75 (shell code,nc)"
    for spec, match in (("e8shell", "needs b="), ("e8shell:b=1.25", "one of"), ("e8shell:b=2,nc=2", "nc= must")):
        with pytest.raises(ValueError, match=match):
            parse_codec_spec(spec)
    assert parse_codec_spec("e8shell:b=2").unavailable_reason(256) is not None
    assert parse_codec_spec("e8shell:b=2").unavailable_reason(64) is None


def test_bad_configurations_and_codes():
    with pytest.raises(ValueError, match="dim=256"):
        E8ShellCodec(256, 2)
    with pytest.raises(ValueError, match="multiple of 8"):
        E8ShellCodec(60, 2)
    for bits in (5, 1.25, 0.5):
        with pytest.raises(ValueError, match="supports bits"):
            E8ShellCodec(64, bits)
    with pytest.raises(ValueError, match="norm_correction"):
        E8ShellCodec(64, 2, norm_correction=1)
    codec = E8ShellCodec(64, 2)  # 65 520 points in a 16-bit field: 0xFFFF is no point
    codes = codec.encode(_rows(5))
    codes[0, 2:4] = 0xFF
    with pytest.raises(ValueError, match="index"):
        codec.decode(codes)
    with pytest.raises(ValueError, match="fp16"):
        codec.encode(torch.full((1, 64), 1e5))
    assert math.isclose(codec.compression_ratio, 128 / 18)


@pytest.mark.parametrize("attention", ["decode", "codes"])
def test_compressed_cache_stores_e8shell_codes(attention, monkeypatch):
    """Through `CompressedCache` (head_dim 64): layer 0's stored codes are the codec's codes of the exact keys
    and values (layer 0 does not depend on the compression), and "codes" attention (a prefill chunk: the codes
    decoded to floats; one-token steps: kv/attention/numba_shells.py's kernel) gives the logits of "decode"
    attention."""
    import warnings

    from _kv_helpers import tiny_llama
    from transformers import DynamicCache

    from fibquant.kv.cache import CompressedCache
    from fibquant.kv.model import cache_kwarg

    import fibquant.kv.attention.numba_shells as numba_shells

    calls = []
    original = numba_shells.attend_decode_shells
    monkeypatch.setattr(numba_shells, "attend_decode_shells", lambda *a: calls.append(1) or original(*a))
    model = tiny_llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(3, 97, (1, 30), generator=torch.Generator().manual_seed(4))
    exact = DynamicCache()
    with torch.no_grad():
        model(ids, **cache_kwarg(model, exact), use_cache=True)
    codec = E8ShellCodec(64, 2, norm_correction=True)
    logits = {}
    for mode in ("decode", attention):
        cache = CompressedCache.for_model(model, codec, codec, sink_tokens=2, recent_tokens=4, encode_batch=1,
                                          attention=mode)
        with torch.no_grad(), warnings.catch_warnings(), attention_on_codes(model):
            warnings.simplefilter("error", RuntimeWarning)  # no fallback: E8 codes are read by their own reader
            model(ids[:, :20], **cache_kwarg(model, cache), use_cache=True)
            steps = [model(ids[:, 20:27], **cache_kwarg(model, cache), use_cache=True).logits]
            steps += [model(ids[:, t:t + 1], **cache_kwarg(model, cache), use_cache=True).logits for t in range(27, 30)]
            logits[mode] = torch.cat(steps, dim=1)
        layer = cache.layers[0]
        coded = range(layer.num_sink, layer.num_sink + layer.num_coded)
        assert layer.num_coded == 30 - 2 - 4
        keys, values = exact.layers[0].keys, exact.layers[0].values
        assert torch.equal(layer.key_codes, codec.encode(keys[..., coded, :]))
        assert torch.equal(layer.value_codes, codec.encode(values[..., coded, :]))
    torch.testing.assert_close(logits[attention], logits["decode"], rtol=1e-4, atol=1e-4)
    assert len(calls) == (3 * model.config.num_hidden_layers if attention == "codes" else 0)


@pytest.mark.model
def test_real_model_generates_through_e8shell_codes(request):
    """SmolLM2 with a 4-bit FibQuant-E8 (nc) cache behind a 4 + 32 exact window: the first greedy tokens are
    the uncompressed model's."""
    from _kv_helpers import REAL_PROMPT, real_model

    from fibquant.kv.cache import CompressedCache
    from fibquant.kv.model import cache_kwarg

    model, tokenizer = real_model(request)
    inputs = tokenizer(REAL_PROMPT, return_tensors="pt")
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    reference = model.generate(**inputs, **kwargs)
    codec = E8ShellCodec(64, 4, norm_correction=True)
    cache = CompressedCache.for_model(model, codec, codec, sink_tokens=4, recent_tokens=32, encode_batch=1)
    with attention_on_codes(model):
        compressed = model.generate(**inputs, **cache_kwarg(model, cache), **kwargs)
    start = inputs.input_ids.shape[1]
    assert cache.layers[0].num_coded > 0
    assert torch.equal(compressed[0, start:start + 4], reference[0, start:start + 4]), tokenizer.decode(compressed[0])


@pytest.mark.parametrize("bits", [1.5, 2, 4])
def test_code_archive_stores_e8shell_codes(bits, tmp_path):
    """`code_layout` is the [norm][packed indices] layout: `CodeArchive` gives the codes back byte for byte."""
    from fibquant.archive import CodeArchive

    codec = E8ShellCodec(64, bits)
    codes = codec.encode(_rows(50, seed=2))
    with CodeArchive.for_codec(tmp_path / "a", codec) as archive:
        archive.append(codes[:20])
        archive.append(codes[20:])
    with CodeArchive.open(tmp_path / "a") as archive:
        assert torch.equal(torch.from_numpy(archive.codes()), codes)
        assert torch.equal(archive.decode(7, codec), codec.decode(codes)[7])


def test_threads_split_gives_the_same_codes():
    """The numba search and unrank split rows over torch.get_num_threads() threads: same bytes, same floats."""
    codec = E8ShellCodec(64, 2, norm_correction=True)
    x = _rows(2000, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = codec.encode(x)
        torch.set_num_threads(2)
        two = codec.encode(x)
        assert torch.equal(one, two) and torch.equal(codec.decode(one), codec.decode(two))
    finally:
        torch.set_num_threads(threads)
