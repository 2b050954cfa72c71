"""The codec registry (`fibquant.codecs.registry`) and the state the codec base class owns:
spec strings and labels, save/load of calibrated codecs, lazy codebooks, shared tensors, and a
new codec reaching every experiment through one registry line."""
from __future__ import annotations

import pytest
import torch
from _kv_helpers import tiny_llama

from fibquant.codecs.base import Codec, PlotStyle
from fibquant.codecs.bitpack import bytes_to_float16, float16_to_bytes, pack_bits, unpack_bits
from fibquant.codecs import registry as methods
from fibquant.codecs.registry import CodecSpec, codec_classes, load_codec, parse_codec_spec

# Spec strings and the labels results show: fixed, so that figures stay reproducible.
SPECS = {
    "fp": "fp (uncompressed)",
    "fibquant:b=2": "FibQuant b=2 (k=4,N=256)",
    "fibquant:b=0.5": "FibQuant b=0.5 (k=16,N=256)",
    "fibquant:k=64,n=4096": "FibQuant b=0.1875 (k=64,N=4096)",
    "turboquant:b=3": "TurboQuant b=3",
    "e8shell:b=2,nc=1": "FibQuant-E8 b=2 (shell code,nc)",
    "int:b=4": "INT4",
    "lowrank:r=8": "low-rank r=8",
    "rvq:s=2,n=256": "RVQ 2x256 per head",
}


@pytest.mark.parametrize("spec", SPECS)
def test_spec_strings_and_labels_are_stable(spec):
    method = parse_codec_spec(spec)
    assert method.spec == spec and method.label(64) == SPECS[spec]
    assert parse_codec_spec(method.spec) == method and hash(parse_codec_spec(spec)) == hash(method)
    assert method.calibrated == (method.family in ("lowrank", "rvq"))
    assert method.reference == (spec == "fp")


def test_keyword_construction_matches_parsing():
    assert CodecSpec("int", bits=4) == parse_codec_spec("int:b=4")
    assert CodecSpec("fibquant", k=64, n=4096) == parse_codec_spec("fibquant:k=64,n=4096")
    assert CodecSpec("rvq", stages=2, n=256).param("stages") == 2 and CodecSpec("fp").param("bits") is None
    for bad, match in (("turboquant:b=2.5", "integer"), ("fibquant:b=2,k=4", "not both"), ("fp:b=2", "no parameters"),
                       ("int:b=x", "bad number"), ("zip", "unknown method family")):
        with pytest.raises(ValueError, match=match):
            parse_codec_spec(bad)
    with pytest.raises(ValueError, match="takes no parameter"):
        CodecSpec("int", rank=3)


def test_registry_entries_are_complete():
    classes = codec_classes()
    assert list(classes) == ["fp", "fibquant", "fibrvq", "e8shell", "turboquant", "int", "lowrank", "rvq"]
    for family, cls in classes.items():
        assert cls.family == family and isinstance(cls.style, PlotStyle)
        assert len({p.key for p in cls.spec_params}) == len(cls.spec_params)
    assert [f for f, c in classes.items() if c.reference] == ["fp"]


def test_rvq_and_every_codec_are_exported():
    import fibquant
    import fibquant.codecs as codecs
    from fibquant.codecs.rvq import RVQCodec

    assert codecs.RVQCodec is RVQCodec and fibquant.RVQCodec is RVQCodec
    for cls in codec_classes().values():
        assert getattr(codecs, cls.__name__) is cls


def _fitted(family: str, dim: int = 16) -> Codec:
    """A calibrated codec fitted on 300 synthetic anisotropic vectors [300, dim]."""
    samples = torch.randn(300, dim, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.2, 3, dim)
    return parse_codec_spec({"lowrank": "lowrank:r=4", "rvq": "rvq:s=2,n=8"}[family]).fit(samples)


@pytest.mark.parametrize("family", ["lowrank", "rvq"])
def test_calibrated_codec_save_load_round_trip_is_exact(family, tmp_path):
    codec = _fitted(family)
    path = tmp_path / f"{family}.safetensors"
    codec.save(path)
    loaded = load_codec(path)
    assert type(loaded) is type(codec) and loaded.config == codec.config
    x = torch.randn(50, codec.dim, generator=torch.Generator().manual_seed(6))
    codes = codec.encode(x)
    assert torch.equal(loaded.encode(x), codes)
    assert torch.equal(loaded.decode(codes), codec.decode(codes))
    assert type(codec).load(path).config == codec.config


def test_calibration_free_codecs_save_their_config(tmp_path):
    for spec in ("fp", "turboquant:b=2", "int:b=3", "fibquant:k=2,n=16"):
        codec = parse_codec_spec(spec).build(16)
        codec.save(tmp_path / "c.safetensors")
        loaded = load_codec(tmp_path / "c.safetensors")
        assert type(loaded) is type(codec) and loaded.config == codec.config


def test_load_refuses_wrong_family_and_foreign_files(tmp_path):
    from safetensors.torch import save_file

    from fibquant.codecs import LowRankCodec, RVQCodec

    _fitted("rvq").save(tmp_path / "rvq.safetensors")
    with pytest.raises(ValueError, match="not 'lowrank'"):
        LowRankCodec.load(tmp_path / "rvq.safetensors")
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a codec file"):
        load_codec(tmp_path / "other.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="readable"):
        RVQCodec.load(tmp_path / "junk.safetensors")


def test_codebooks_load_lazily(monkeypatch):
    import fibquant.codecs.fibquant as fib_module
    import fibquant.codecs.turboquant as turbo_module

    def refuse(*args, **kwargs):
        raise AssertionError("a codebook was loaded at construction")

    monkeypatch.setattr(fib_module, "load_codebook", refuse)
    monkeypatch.setattr(turbo_module, "load_codebook", refuse)
    for codec in (turbo_module.TurboQuantCodec(64, 3), fib_module.FibQuantCodec(64, 4, 256)):
        assert codec.shared_tensors() == [] and codec.code_size > 0 and codec.bits_per_coordinate > 0
    monkeypatch.undo()
    turbo = turbo_module.TurboQuantCodec(64, 3)
    turbo.encode(torch.randn(2, 64))
    assert turbo.levels.shape == (8,) and len(turbo.shared_tensors()) >= 3  # levels, thresholds, rotation


def test_shared_tensors_count_state_per_device_and_parts():
    from fibquant.kv.headwise import HeadwiseCodec
    from fibquant.kv.accounting import codec_state_nbytes

    lowrank = _fitted("lowrank")
    state = lowrank.basis.numel() * 4 + lowrank.mean.numel() * 4
    assert codec_state_nbytes(lowrank) == state  # nothing derived yet
    lowrank.roundtrip(torch.randn(3, 16))
    assert codec_state_nbytes(lowrank) == state  # the CPU copies are the tensors themselves
    rvq = _fitted("rvq")
    heads = HeadwiseCodec([rvq, _fitted("rvq")])
    assert codec_state_nbytes(heads) == 2 * rvq.codebooks.numel() * 4


# --------------------------------------------------------------------------- a new codec, one line
class ToySignCodec(Codec):
    """A toy codec for the registry test: fp16 mean |x| + one sign bit per coordinate."""

    family = "toysign"
    style = PlotStyle("toy sign", "C9", "P")

    def __init__(self, dim: int):
        from fibquant.codecs.identity import IdentityConfig

        super().__init__(IdentityConfig(dim))

    @classmethod
    def spec_label(cls, dim: int) -> str:
        return "toy sign"

    @classmethod
    def from_spec(cls, dim: int) -> "ToySignCodec":
        return cls(dim)

    @property
    def code_size(self) -> int:
        return 2 + (self.dim + 7) // 8

    @property
    def bits_per_coordinate(self) -> float:
        return 1.0

    def _encode_flat(self, x):
        return torch.cat([float16_to_bytes(x.abs().mean(1)), pack_bits((x > 0).to(torch.int64), 1)], dim=1)

    def _decode_flat(self, codes):
        scale = bytes_to_float16(codes[:, :2])
        return (2.0 * unpack_bits(codes[:, 2:], 1, self.dim) - 1.0) * scale[:, None]


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setattr(methods, "REGISTRY", methods.REGISTRY + (f"{__name__}.ToySignCodec",))
    codec_classes.cache_clear()
    yield
    monkeypatch.undo()
    codec_classes.cache_clear()


def _legend_of(plot, monkeypatch, *args) -> list[str]:
    import matplotlib.pyplot as plt

    seen = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (seen.append(fig), real_close(fig)))
    plot(*args)
    return [t.get_text() for t in seen[0].axes[0].get_legend().get_texts()]


def test_one_registry_line_reaches_every_experiment(toy_registered, monkeypatch, tmp_path):
    from fibquant.kv.specs import parse_cache_spec
    from fibquant.eval.capture import CapturedAttention
    from fibquant.eval.fidelity import evaluate_method, plot_frontier
    from fibquant.eval.multiple_choice import CacheSetting
    from fibquant.eval.perplexity import PerplexityConfig, make_cache, plot_perplexity, window_nll

    method = parse_codec_spec("toysign")
    assert method.spec == "toysign" and isinstance(method.build(16), ToySignCodec)
    generator = torch.Generator().manual_seed(0)
    captured = CapturedAttention(*(torch.randn(2, h, 24, 16, generator=generator) for h in (4, 2, 2)), 0.25)
    rows = [evaluate_method(parse_codec_spec(s), captured, torch.arange(24)) for s in ("fp", "int:b=4", "toysign")]
    assert rows[2]["family"] == "toysign" and rows[2]["label"] == "toy sign" and 0 < rows[2]["cosine"] < 1
    assert "toy sign" in _legend_of(plot_frontier, monkeypatch, rows, tmp_path / "f.png", "t")
    config = PerplexityConfig(tokens=32, context=32, chunk=8, sink_tokens=1, recent_tokens=2, attention="decode")
    model = tiny_llama()
    cache = make_cache("toysign", model, config)
    assert isinstance(cache.key_codec, ToySignCodec)
    assert torch.isfinite(window_nll(model, torch.randint(0, 97, (1, 32)), cache, 8)).all()
    ppl_rows = [{"family": r["family"], "compression_ratio": r["compression_ratio"], "perplexity": 2.0 + i,
                 "label": r["label"], "cache": r["cache"]} for i, r in enumerate(rows)]
    assert "toy sign" in _legend_of(plot_perplexity, monkeypatch, ppl_rows, tmp_path / "p.png", "t")
    assert parse_cache_spec("toysign/int:b=4").family == "kv"
    assert CacheSetting("toysign").name(16) == "toy sign (sink 4, recent 32)"


def test_perplexity_builds_each_codec_once_per_method(monkeypatch):
    from fibquant.codecs.integer import IntCodec
    from fibquant.eval.perplexity import PerplexityConfig, cache_factory

    calls = []
    real = IntCodec.from_spec.__func__
    counted = classmethod(lambda cls, dim, **params: calls.append(params) or real(cls, dim, **params))
    monkeypatch.setattr(IntCodec, "from_spec", counted)
    config = PerplexityConfig(tokens=32, context=32, chunk=8, sink_tokens=1, recent_tokens=2, attention="decode")
    fresh = cache_factory("int:b=4/int:b=2", tiny_llama(), config)
    caches = [fresh() for _ in range(3)]
    assert len(calls) == 2  # one key and one value codec, however many caches (batches)
    assert caches[0] is not caches[1] and caches[0].key_codec is caches[2].key_codec
    assert caches[0].value_codec.bits == 2
