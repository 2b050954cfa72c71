"""Peers (kakeyalattice, nexusquant-kv, transformers QuantizedCache's quanto/HQQ), the round-trip cache
with CompressedCache's exact window, and the cache specs of the in-the-loop experiments."""
from __future__ import annotations

import math

import pytest
import torch
from _kv_helpers import tiny_llama
from transformers import DynamicCache

from fibquant.kv.model import cache_kwarg
from fibquant.codecs.integer import IntCodec
from fibquant.kv.specs import CacheSpec, parse_cache_spec, parse_cache_specs, split_available
from fibquant.peers import (PEERS, PeerFamily, build_peer, native_families, one_of, parse_peer, peer_families, peer_specs,
                            unavailable_reason)
from fibquant.peers.kakeya import kakeya_bits
from fibquant.peers.nexus import nexus_block_points, nexus_bytes
from fibquant.eval.perplexity import PerplexityConfig, make_cache, window_nll
from fibquant.kv.build import build_cache
from fibquant.kv.cache import CompressedCache
from fibquant.kv.accounting import cache_nbytes
from fibquant.kv.roundtrip_cache import RoundTripCache, RoundTripLayer

DIM = 16


def _skip_unless(spec: str) -> None:
    reason = unavailable_reason(spec)
    if reason is not None:
        pytest.skip(reason)


# ----------------------------------------------------------------------------- peer specs and bytes

def test_parse_peer_and_errors():
    assert parse_peer("kakeya-e8:q=2").spec == "kakeya-e8:q=2"
    assert parse_peer(" Quanto-RT:b=4 ").value == 4
    for bad, match in (("zip:b=2", "unknown peer"), ("quanto-rt:q=2", "needs b="), ("quanto-rt:b=3", "not supported"),
                       ("kakeya-d4:q=0", "not supported"), ("nexus:b=two", "bad integer"), ("hqq-rt", "needs b=")):
        with pytest.raises(ValueError, match=match):
            parse_peer(bad)


def test_byte_counts_follow_the_documented_formats():
    # kakeyalattice: (D / block) * ceil(bits per block) + 32; its docstring's D = 128 points.
    assert kakeya_bits("e8", 38, 128) == 848 and kakeya_bits("e8", 37, 128) == 832
    assert kakeya_bits("d4", 38, 128) == 832 and kakeya_bits("d4", 152, 128) == 1088
    assert kakeya_bits("e8", 1, 64) == 8 * 13 + 32 and kakeya_bits("d4", 1, 64) == 16 * 6 + 32
    # nexusquant's relaxed E8 at 2 bits (levels 4): 5^8 / 2 even-sum integer points + 4^8 half-integer points.
    assert nexus_block_points(4) == (5 ** 8 + 1) // 2 + 4 ** 8
    assert nexus_bytes(2, 64) == (math.ceil(8 * math.log2(nexus_block_points(4))) + 16) / 8 == 20.0
    # quanto / HQQ: b bits per element + fp16 scale and zero per group of 64.
    assert PEERS["quanto-rt"].bytes_per_vector(2, 64) == 20 and PEERS["hqq-rt"].bytes_per_vector(4, 64) == 36


def test_kakeya_count_equals_the_package_own():
    _skip_unless("kakeya-e8:q=1")
    import kakeyalattice

    for q in (1, 2, 10):
        assert kakeyalattice.V15KakeyaZamirE8GPU(64, q, device="cpu").bits_per_token_per_head == kakeya_bits("e8", q, 64)
        assert kakeyalattice.V14KakeyaZamirLatticeGPU(64, q, device="cpu").bits_per_token_per_head == kakeya_bits(
            "d4", q, 64)


@pytest.mark.parametrize("spec", ["quanto-rt:b=4", "hqq-rt:b=4", "kakeya-e8:q=4", "kakeya-d4:q=4", "nexus:b=4"])
def test_peer_roundtrip_shape_dtype_and_error(spec):
    _skip_unless(spec)
    torch.manual_seed(0)
    model = tiny_llama(head_dim=64, hidden_size=256, num_attention_heads=4) if spec.startswith("nexus") else None
    x = torch.randn(1, 2, 70, 64)
    for role in ("key", "value"):
        peer = build_peer(spec, 64, role, model)
        y = peer.roundtrip(x, start=5)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert float((y - x).norm() / x.norm()) < 0.3, spec
        assert peer.roundtrip(x[..., :0, :]).shape[-2] == 0
    with pytest.raises(ValueError, match="expected"):
        peer.roundtrip(x[0])


def test_unavailable_reason_names_the_install_command(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "kakeyalattice", None)  # importing it now raises ImportError
    reason = unavailable_reason("kakeya-e8:q=2")
    assert "kakeyalattice" in reason and "fibquant[peers]" in reason
    with pytest.raises(ValueError, match="fibquant\\[peers\\]"):
        build_peer("kakeya-e8:q=2", 64)
    ready, skipped = split_available(parse_cache_specs("fp;kakeya-e8:q=2;int:b=4"), 64, build_codebooks=False)
    assert [s.spec for s in ready] == ["fp", "int:b=4"] and "kakeya-e8:q=2" in skipped[0]


# ----------------------------------------------------------------------------- RoundTripCache

def test_roundtrip_layer_window_semantics():
    """Chunked updates: returned states = archived tokens round-tripped, sinks/recent/new exact."""
    marks = []

    def rt(x, start):
        marks.append((start, x.shape[-2]))
        return x + 100.0

    layer = RoundTripLayer(rt, rt, sink_tokens=2, recent_tokens=3)
    keys = torch.randn(1, 2, 12, DIM)
    seen = 0
    for size in (4, 1, 5, 2):
        chunk = keys[..., seen: seen + size, :]
        out, _ = layer.update(chunk, chunk.clone())
        expected = keys[..., : seen + size, :].clone()
        expected[..., 2:max(seen - 3, 2), :] += 100.0  # tokens that had left the window before this update
        assert torch.equal(out, expected), size
        seen += size
    assert layer.archived == 12 - 3
    # keys then values, each token once, with its absolute start position
    assert marks == [(2, 5), (2, 5), (7, 2), (7, 2)]


def test_roundtrip_cache_equals_compressed_cache_decode_path():
    """Same window, same quantizer: RoundTripCache(INT round trip) gives CompressedCache's logits."""
    model = tiny_llama()
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    codec = IntCodec(DIM, 3)
    config = dict(sink_tokens=3, recent_tokens=5)
    coded = CompressedCache(codec, codec, attention="decode", encode_batch=1, **config)
    rt = RoundTripCache(lambda x, s: codec.roundtrip(x), lambda x, s: codec.roundtrip(x), **config)
    a = window_nll(model, ids, coded, chunk=7)
    b = window_nll(model, ids, rt, chunk=7)
    assert torch.allclose(a, b, atol=1e-5)
    # from_cache = one update with every prefill token
    source = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, **cache_kwarg(model, source), use_cache=True)
    built = RoundTripCache.from_cache(source, lambda x, s: codec.roundtrip(x), lambda x, s: codec.roundtrip(x), **config)
    assert built.get_seq_length() == 40 and built.layers[0].archived == 35
    assert torch.equal(built.layers[0].keys[..., :3, :], source.layers[0].keys[..., :3, :])
    assert not torch.equal(built.layers[0].keys[..., 3:35, :], source.layers[0].keys[..., 3:35, :])
    # format bytes: exact window in float32 + 2 * 12 code bytes per archived token, 2 layers x B=2 x H=2
    assert built.format_nbytes(12, 12) == 2 * 2 * 2 * (8 * DIM * 4 * 2 + 32 * 24)


def test_roundtrip_cache_errors():
    with pytest.raises(ValueError, match="callable"):
        RoundTripCache(None, lambda x, s: x)
    with pytest.raises(ValueError, match="sink_tokens"):
        RoundTripCache(lambda x, s: x, lambda x, s: x, sink_tokens=-1)
    with pytest.raises(ValueError, match="batch, kv_heads"):
        RoundTripCache(lambda x, s: x, lambda x, s: x).update(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), 0)


# ----------------------------------------------------------------------------- cache specs

def test_cache_spec_parsing_bytes_and_errors():
    fp = parse_cache_spec("fp")
    assert fp.is_fp and fp.codes_ratio(64) == 1.0 and fp.context_ratio(64, 1000, 4, 32) == 1.0
    sym = parse_cache_spec("int:b=4")
    assert sym.symmetric and sym.family == "int" and sym.key_bytes(64) == 36
    asym = parse_cache_spec("int:b=4/int:b=2")
    assert asym.family == "kv" and asym.spec == "int:b=4/int:b=2" and asym.label(64) == "K INT4 / V INT2"
    assert asym.codes_ratio(64) == 256 / (36 + 20) and asym.bits_per_coordinate(64) == 3.0
    # 36 exact tokens at fp16 + 964 coded ones
    assert asym.context_ratio(64, 1000, 4, 32) == pytest.approx(1000 * 256 / (36 * 256 + 964 * 56))
    peer = parse_cache_spec("quanto-rt:b=2/fibquant:b=1")
    assert peer.uses_peer and peer.key_bytes(64) == 20 and peer.value_bytes(64) == 10
    for bad, match in (("", "empty"), ("int:b=4/int:b=2/int:b=3", "more than one"), ("lowrank:r=8", "stand-alone"),
                       ("fp/int:b=2", "stand-alone"), ("zip:b=2", "unknown method family")):
        with pytest.raises(ValueError, match=match):
            parse_cache_spec(bad)
    with pytest.raises(ValueError, match="both a key and a value"):
        CacheSpec(key=sym.key)


def test_asymmetric_and_peer_caches_in_the_perplexity_loop():
    model = tiny_llama()
    config = PerplexityConfig(tokens=64, context=64, chunk=16, sink_tokens=2, recent_tokens=4, attention="decode")
    cache = make_cache("int:b=4/int:b=2", model, config)
    assert isinstance(cache, CompressedCache) and cache.key_codec.bits == 4 and cache.value_codec.bits == 2
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(2))
    window_nll(model, ids, cache, 16)
    assert cache_nbytes(cache) == cache.nbytes()


def test_peer_cache_in_the_perplexity_loop():
    _skip_unless("quanto-rt:b=4")
    model = tiny_llama(head_dim=64, hidden_size=256, num_attention_heads=4)
    config = PerplexityConfig(tokens=64, context=64, chunk=16, sink_tokens=2, recent_tokens=4)
    spec = parse_cache_spec("quanto-rt:b=4/int:b=4")
    cache = make_cache(spec, model, config)
    assert isinstance(cache, RoundTripCache)
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(3))
    nll = window_nll(model, ids, cache, 16)
    assert torch.isfinite(nll).all()
    # 6 exact tokens (float32) + 58 coded at 36 + 36 bytes, 2 layers x 2 KV heads
    assert cache_nbytes(cache, (spec.key_bytes(64), spec.value_bytes(64))) == 2 * 2 * (6 * 64 * 4 * 2 + 58 * 72)


def test_peer_row_in_the_fidelity_frontier():
    _skip_unless("kakeya-e8:q=4")
    from fibquant.eval.capture import CapturedAttention
    from fibquant.eval.fidelity import compare_frontiers, evaluate_method

    generator = torch.Generator().manual_seed(4)
    captured = CapturedAttention(torch.randn(2, 4, 40, 64, generator=generator),
                                 torch.randn(2, 2, 40, 64, generator=generator),
                                 torch.randn(2, 2, 40, 64, generator=generator), 0.125)
    positions = torch.arange(0, 40, 4)
    row = evaluate_method(parse_peer("kakeya-e8:q=4"), captured, positions, sink_tokens=1, recent_tokens=4)
    assert row["peer"] and row["code_bytes_per_vector"] == kakeya_bits("e8", 4, 64) / 8
    assert row["compression_ratio"] == 128 / row["code_bytes_per_vector"] and 0.5 < row["cosine"] < 1.0
    checks = compare_frontiers([row])["matched_ratio_checks"]
    assert checks[0]["label"] == "KakeyaLattice E8 Q=4" and checks[0]["cache"] == "kakeya-e8:q=4" and checks[0]["fibquant_best_at_ratio"] is None


def test_peer_cache_refuses_centring():
    _skip_unless("quanto-rt:b=4")
    model = tiny_llama(head_dim=64, hidden_size=256, num_attention_heads=4)
    with pytest.raises(ValueError, match="not to fp or a peer"):
        build_cache("quanto-rt:b=4@centre", model, 2, 4)


def test_native_names_are_refused_where_a_round_trip_is_meant():
    # quanto:b=B names transformers' QuantizedCache (eval decode-speed); where a round trip is meant the
    # error names its spelling, quanto-rt:b=B.
    with pytest.raises(ValueError, match="'quanto-rt'"):
        parse_peer("quanto:b=2")
    with pytest.raises(ValueError, match="'hqq-rt'"):
        parse_cache_spec("hqq:b=4")
    assert {"quanto", "hqq"} <= set(native_families()) and native_families()["hqq"] == "hqq-rt"


def test_default_peer_rows_and_styles_come_from_the_registry():
    assert set(peer_specs()) >= {"quanto-rt:b=4", "kakeya-e8:q=1", "nexus:b=2"}
    assert peer_specs(lowest=1) == tuple(f"{name}:{PEERS[name].param}={PEERS[name].defaults[-1]}" for name in PEERS)
    assert all(len(PEERS[name].style) == 2 and PEERS[name].package[1] for name in PEERS)


# ----------------------------------------------------------------------------- a new peer: one module + one line

def _halve_build(spec, dim, role, model=None):
    from fibquant.peers import PeerQuantizer

    return PeerQuantizer(spec, dim, role, lambda x, start: (x * 2 ** spec.value).round() / 2 ** spec.value)


FAMILIES = {  # this test module is the new peer's "one file"
    "toy-round": PeerFamily("b", "b in (1, 2)", one_of((1, 2)), lambda b: f"toy rounding {b}", lambda b, d: d * 1.0,
                            "one byte per coordinate", _halve_build, package=("math", "math"), style=("C3", "x"),
                            defaults=(2, 1)),
}


@pytest.fixture
def toy_peer(monkeypatch):
    from fibquant.peers import base

    monkeypatch.setattr(base, "REGISTRY", base.REGISTRY + (__name__,))  # the "one line"
    peer_families.cache_clear()
    yield
    monkeypatch.undo()
    peer_families.cache_clear()


def test_a_new_peer_is_one_module_and_one_registry_line(toy_peer):
    assert "toy-round" in PEERS and "toy-round:b=1" in peer_specs()
    spec = parse_cache_spec("toy-round:b=2")
    assert spec.uses_peer and spec.key_bytes(64) == 64.0 and spec.label() == "toy rounding 2"
    assert unavailable_reason("toy-round:b=1") is None
    model = tiny_llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    cache = build_cache(spec, model, sink_tokens=1, recent_tokens=2)
    assert isinstance(cache, RoundTripCache)
    x = torch.randn(1, 1, 5, 64)
    quantizer = build_peer("toy-round:b=1", 64)
    assert torch.equal(quantizer.roundtrip(x), (x * 2).round() / 2)


def test_a_duplicate_peer_family_is_refused(monkeypatch):
    from fibquant.peers import base

    monkeypatch.setattr(base, "REGISTRY", base.REGISTRY + ("fibquant.peers.kakeya",))
    peer_families.cache_clear()
    try:
        with pytest.raises(ValueError, match="registered twice"):
            peer_families()
    finally:
        monkeypatch.undo()
        peer_families.cache_clear()
