"""FibQuant-RVQ (universal residual codes in k = 8) and FibQuant's norm correction.

Bounds (measured on canonical blocks / unit vectors, docs/codecs.md "FibQuant-RVQ"):

| check                                              | bound | measured                          |
|----------------------------------------------------|-------|-----------------------------------|
| beam 16 MSE / exhaustive MSE, shipped 2 x 256      | 1.02  | 1.005 (the same sum on 96 % of blocks) |
| beam >= N^(S-1) against exhaustive (small stages)  | equal | equal                             |
| shipped stages' fresh MSE (160 vectors) / build MSE | 1.06 | 0.99-1.03               |
| decoded norm / input norm with norm correction     | 2^-10 | fp16 rounding of the stored norm  |
"""
from __future__ import annotations

import pytest
import torch

from fibquant.codebook import residual as R
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.registry import parse_codec_spec
from fibquant.codecs.fibrvq import FibRVQCodec
from fibquant.canonical import sample_blocks, sample_sphere


def _random_stages(stages=3, n=8, k=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.5 ** j for j in range(stages)])[:, None, None]
    return (torch.randn(stages, n, k, generator=gen) * scale).to(torch.float32)


def test_full_beam_is_the_exhaustive_search():
    stages = _random_stages(3, 8, 4)
    x = torch.randn(400, 4, generator=torch.Generator().manual_seed(1))
    reference = R.exhaustive_search(x, stages)
    beam = R.beam_search(x, stages, beam=8 ** 2)  # keeps every partial sum
    assert torch.equal(beam, reference)
    # A narrower beam is never better than the exhaustive search, and not much worse here.
    narrow = R.beam_search(x, stages, beam=2)
    assert R.block_mse(x, stages, narrow) >= R.block_mse(x, stages, reference) - 1e-12


def test_exhaustive_search_prefers_the_lowest_flat_index_on_ties():
    stages = torch.zeros(2, 4, 2)
    stages[0, 1] = stages[0, 3] = torch.tensor([1.0, 0.0])
    x = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    assert R.exhaustive_search(x, stages).tolist() == [[1, 0], [0, 0]]


def test_beam_on_shipped_stages_within_documented_bound_of_exhaustive():
    codec = FibRVQCodec.from_spec(64, bits=2)
    stages = codec.codebook
    x = sample_blocks(192, 64, 8, seed=77)
    reference = R.exhaustive_search(x, stages)
    beam = R.beam_search(x, stages, codec.beam)
    ratio = R.block_mse(x, stages, beam) / R.block_mse(x, stages, reference)
    assert 1.0 - 1e-9 <= ratio <= 1.02, ratio
    # The codec's exhaustive path is the same search.
    u = sample_sphere(8, 64, seed=78)
    exact = codec.encode_with(u, exhaustive=True)
    assert ((codec.decode(exact) - u) ** 2).sum(1).mean() <= ((codec.roundtrip(u) - u) ** 2).sum(1).mean() + 1e-7


def test_exhaustive_search_refuses_huge_products():
    with pytest.raises(ValueError, match="exhaustive"):
        R.exhaustive_search(torch.zeros(1, 8), torch.zeros(3, 256, 8))


@pytest.mark.parametrize("bits,size", [(1, 10), (2, 18), (3, 26), (4, 34)])
def test_rate_accounting(bits, size):
    codec = FibRVQCodec.from_spec(64, bits=bits)
    assert codec.code_size == size  # 2-byte norm + (64/8) * bits * 8 index bits
    assert codec.bits_per_coordinate == bits
    assert codec.stored_bits_per_coordinate == pytest.approx(bits + 0.25)
    layout = codec.code_layout
    assert layout.code_size == size and layout.n_blocks == 8 * bits and layout.n_codewords == 256
    assert parse_codec_spec(f"fibrvq:b={bits}").build(64).code_size == size


def test_round_trip_shapes_and_unpacked_layout():
    codec = FibRVQCodec(64, stages=2)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2)) * 3
    codes = codec.encode(x)
    assert codes.shape == (3, 5, 18) and codes.dtype == torch.uint8
    out = codec.decode(codes)
    assert out.shape == x.shape
    rel = ((out - x) ** 2).sum(-1) / (x ** 2).sum(-1)
    assert float(rel.mean()) < 0.12
    # Bytes 2.. are the block-major indices: block j, stage s at position 2 j + s.
    u = (x.reshape(-1, 64) / x.reshape(-1, 64).norm(dim=1, keepdim=True)) @ codec._rotation.forward_matrix(
        torch.device("cpu"))
    index = codec.block_indices(u)
    assert torch.equal(codes.reshape(-1, 18)[:, 2:], index.reshape(-1, 16).to(torch.uint8))


def test_bad_specs_and_configs():
    for text, match in (("fibrvq:b=5", "b= must be"), ("fibrvq:b=2,s=2", "not both"), ("fibrvq:k=8,s=2", "needs"),
                        ("fibrvq:b=2,k=12", "multiple of 8"), ("fibrvq:b=3,k=24", "<= 8 stages"),
                        ("fibrvq:b=2,nc=2", "nc="), ("fibrvq:b=2.5", "integer")):
        with pytest.raises(ValueError, match=match):
            parse_codec_spec(text)
    with pytest.raises(ValueError, match="divide"):
        FibRVQCodec(64, k=6)
    # b= with k=: b * k / 8 stages of 256 (the same bytes as b= alone)
    for text, shape in (("fibrvq:b=2,k=8", (8, 2)), ("fibrvq:b=2,k=16", (16, 4)), ("fibrvq:b=4,k=16", (16, 8))):
        codec = parse_codec_spec(text).build(64)
        assert (codec.k, codec.stages, codec.n_codewords) == (*shape, 256)
        assert codec.code_size == parse_codec_spec(text.split(",")[0]).build(64).code_size
    with pytest.raises(ValueError, match="beam"):
        FibRVQCodec(64, beam=0)
    with pytest.raises(ValueError, match="stages"):
        FibRVQCodec(64, stages=0)
    with pytest.raises(ValueError, match="norm_correction"):
        FibRVQCodec(64, norm_correction=1)
    with pytest.raises(ValueError, match="beam"):
        R.beam_search(torch.zeros(2, 8), torch.zeros(2, 4, 8), 0)
    with pytest.raises(ValueError, match="blocks"):
        R.beam_search(torch.zeros(2, 4), torch.zeros(2, 4, 8), 2)
    with pytest.raises(ValueError, match="fp16"):
        FibRVQCodec(64).encode(torch.full((1, 64), 1e5))


def test_missing_codebook_is_reported_not_built(tmp_path, monkeypatch):
    monkeypatch.setenv("FIBQUANT_CACHE_DIR", str(tmp_path))
    method = parse_codec_spec("fibrvq:k=4,s=2,n=16")
    assert "neither shipped nor cached" in method.unavailable_reason(32)
    with pytest.raises(FileNotFoundError):
        R.load_residual(R.ResidualSpec(32, 4, 2, 16), build=False)


@pytest.mark.parametrize("codec", [FibQuantCodec.for_rate(64, 2, norm_correction=True),
                                   FibRVQCodec(64, stages=2, norm_correction=True)],
                         ids=["fibquant", "fibrvq"])
def test_norm_correction_keeps_the_norm_at_zero_extra_bytes(codec):
    plain = type(codec)(**{**codec.config.__dict__, "norm_correction": False})
    codec.fast_search = plain.fast_search = False  # the torch search (no numba compile): the same codes
    assert codec.code_size == plain.code_size
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.2, 4, 64)
    x[5] = 0
    codes, plain_codes = codec.encode(x), plain.encode(x)
    assert torch.equal(codes[:, 2:], plain_codes[:, 2:])  # same indices, only the stored norm differs
    out = codec.decode(codes)
    assert torch.equal(out[5], torch.zeros(64))
    keep = torch.arange(200) != 5
    ratio = out[keep].norm(dim=1) / x[keep].norm(dim=1)
    assert float((ratio - 1).abs().max()) < 2 ** -10
    assert float((plain.decode(plain_codes)[keep].norm(dim=1) / x[keep].norm(dim=1)).mean()) < 0.99  # it shrinks


def test_norm_correction_spec_strings():
    codec = parse_codec_spec("fibquant:b=2,nc=1").build(64)
    assert codec.norm_correction and codec.code_size == 18 and "nc" in parse_codec_spec("fibquant:b=2,nc=1").label(64)
    assert not parse_codec_spec("fibquant:b=2").build(64).norm_correction
    with pytest.raises(ValueError, match="nc="):
        parse_codec_spec("fibquant:b=2,nc=3")
    assert parse_codec_spec("fibrvq:b=3,nc=1,w=4").build(64).beam == 4


@pytest.mark.parametrize("dim", [64, 128])
def test_norm_correction_default_is_per_rate_and_only_where_nc_is_not_given(dim):
    # A spec without nc= takes the per-rate default (on at 4 bits only); nc=0 / nc=1 mean what they said.
    built = {text: parse_codec_spec(text).build(dim) for text in
             ("fibquant:b=4", "fibquant:k=2,n=256", "fibquant:b=4,nc=0", "fibquant:b=4,nc=1")}
    assert built["fibquant:b=4"].norm_correction and built["fibquant:k=2,n=256"].norm_correction
    assert not built["fibquant:b=4,nc=0"].norm_correction and built["fibquant:b=4,nc=1"].norm_correction
    for bits in (1, 1.5, 2, 2.5, 3, 3.5):
        assert not parse_codec_spec(f"fibquant:b={bits}").build(dim).norm_correction, bits
    assert parse_codec_spec("fibquant:b=2,nc=1").build(dim).norm_correction
    # Labels say what runs.
    assert "nc" in parse_codec_spec("fibquant:b=4").label(dim) and "nc" not in parse_codec_spec("fibquant:b=4,nc=0").label(dim)
    assert "nc" not in parse_codec_spec("fibquant:b=2").label(dim)
    # The Python constructors and the config keep their off default (saved configs keep their meaning).
    assert not FibQuantCodec.for_rate(dim, 4).norm_correction and not FibQuantCodec(dim, 2, 256).norm_correction
    x = torch.randn(64, dim, generator=torch.Generator().manual_seed(5))
    assert torch.equal(built["fibquant:b=4"].encode(x), built["fibquant:b=4,nc=1"].encode(x))
    assert torch.equal(built["fibquant:b=4,nc=0"].encode(x), FibQuantCodec.for_rate(dim, 4).encode(x))
    assert not torch.equal(built["fibquant:b=4"].encode(x), built["fibquant:b=4,nc=0"].encode(x))


def test_a_4bit_fibquant_file_saved_without_norm_correction_keeps_it_off(tmp_path):
    from fibquant.codecs.registry import load_codec

    plain = FibQuantCodec.for_rate(64, 4)  # what "fibquant:b=4" built before its default changed
    plain.save(tmp_path / "b4.safetensors")
    loaded = load_codec(tmp_path / "b4.safetensors")
    assert not loaded.norm_correction
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(6))
    assert torch.equal(loaded.encode(x), plain.encode(x))


def test_save_load_round_trip(tmp_path):
    from fibquant.codecs.registry import load_codec

    codec = FibRVQCodec(64, stages=2, beam=8, norm_correction=True)
    codec.save(tmp_path / "c.safetensors")
    again = load_codec(tmp_path / "c.safetensors")
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(4))
    assert isinstance(again, FibRVQCodec) and again.config == codec.config
    assert torch.equal(again.encode(x), codec.encode(x))


def test_build_recipe_is_deterministic_and_stages_help():
    spec = R.ResidualSpec(16, 4, 2, 8, seed=3)
    first, meta = R.build_residual(spec, batch=2048, iterations=3)
    second, _ = R.build_residual(spec, batch=2048, iterations=3)
    assert torch.equal(first, second) and first.shape == (2, 8, 4)
    x = sample_blocks(4096, 16, 4, seed=5)
    one = R.block_mse(x, first[:1], R.exhaustive_search(x, first[:1]))
    two = R.block_mse(x, first, R.exhaustive_search(x, first))
    assert two < 0.8 * one
    assert meta["recipe"] == R.RECIPE and float(meta["total_mse"]) > 0


@pytest.mark.parametrize("k,stages", [(8, 2), (8, 3), (8, 4), (16, 4), (16, 6), (16, 8)])
def test_shipped_stages_match_their_build_record(k, stages):
    from fibquant.codebook import store

    spec = R.ResidualSpec(64, k, stages, 256)
    path = store.SHIPPED_DIR / spec.file_name
    book, meta = store.read_file(path)
    assert book.shape == (stages, 256, k) and meta["recipe"] == R.RECIPE
    u = sample_sphere(160, 64, seed=4343)
    codec = FibRVQCodec(64, k=k, stages=stages)  # beam 16, the construction's
    fresh = float(((codec.roundtrip(u) - u) ** 2).sum(1).mean())
    assert fresh < 1.06 * float(meta["total_mse"]), (fresh, meta["total_mse"])


def test_compressed_cache_round_trip_with_decode_fallback():
    from _kv_helpers import tiny_llama
    from transformers import DynamicCache

    from fibquant.kv.cache import CompressedCache
    from fibquant.kv.model import cache_kwarg

    model = tiny_llama(head_dim=64)
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(6))
    codec = FibRVQCodec(64, stages=2)
    cache, dynamic = CompressedCache(codec, codec, sink_tokens=2, recent_tokens=4), DynamicCache()
    with torch.no_grad():
        model(ids, **cache_kwarg(model, dynamic), use_cache=True)
        model(ids, **cache_kwarg(model, cache), use_cache=True)
        logits = model(ids[:, -1:], **cache_kwarg(model, cache), use_cache=True).logits
    assert torch.isfinite(logits).all()
    layer = cache.layers[0]
    assert layer.key_codes.shape[-1] == codec.code_size
    exact_keys = dynamic.layers[0].keys
    coded = range(layer.num_sink, layer.num_sink + layer.num_coded)
    assert len(coded) > 0
    got = layer.keys[..., coded, :]
    torch.testing.assert_close(got, codec.roundtrip(exact_keys[..., coded, :]), rtol=0, atol=1e-5)


def test_a_fibquant_file_saved_before_norm_correction_still_loads(tmp_path):
    import json

    from safetensors.torch import save_file

    from fibquant.codecs.base import FORMAT_NAME, config_matches
    from fibquant.codecs.registry import load_codec

    old = {"dim": 64, "k": 4, "n_codewords": 256, "seed": 0}  # the config before the field existed
    save_file({}, str(tmp_path / "old.safetensors"),
              metadata={"format": FORMAT_NAME, "family": "fibquant", "config": json.dumps(old)})
    codec = load_codec(tmp_path / "old.safetensors")
    assert isinstance(codec, FibQuantCodec) and not codec.norm_correction
    assert config_matches(codec.config, old) and not config_matches(codec.config, {**old, "norm_correction": True})
    assert not config_matches(codec.config, {"dim": 64})  # a field without a default must be there
