"""A new code family is one module plus one registry line: this module defines a toy family (a rotated
sign code with a reader of its own), registers it with one line and runs it through transformers'
attention on codes and through the paged decode step, read by its reader, never decoded."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
from _kv_helpers import tiny_llama

import fibquant.codecs.registry as registry
from fibquant.canonical import haar_rotation
from fibquant.codecs.base import Codec, PlotStyle
from fibquant.codecs.bitpack import NORM_BYTES, bytes_to_float16, float16_to_bytes, pack_bits, unpack_bits
from fibquant.codecs.reader import CodeReader
from fibquant.codecs.registry import codec_classes, parse_codec_spec

DIM = 64


# ------------------------------------------------------------------ the family: one module
@dataclass(frozen=True)
class ToyRotConfig:
    dim: int


class ToySignReader(CodeReader):
    """Rows nu * sign(u) / sqrt(D) in the rotated domain (a torch reader: no registered kernel)."""

    calls: list = []  # what attention asked of the reader (decoding asks only for rows)

    def scores(self, rotated: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        ToySignReader.calls.append("scores")
        return super().scores(rotated, codes)

    def values(self, weights: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        ToySignReader.calls.append("values")
        return super().values(weights, codes)

    def rows(self, codes: torch.Tensor) -> torch.Tensor:
        lead = codes.shape[:-1]
        flat = codes.reshape(-1, codes.shape[-1])
        signs = 2.0 * unpack_bits(flat[:, NORM_BYTES:], 1, self.dim).to(torch.float32) - 1.0
        norms = bytes_to_float16(flat[:, :NORM_BYTES])
        return (signs * (norms / self.dim ** 0.5).unsqueeze(1)).reshape(*lead, self.dim)


class ToyRotCodec(Codec):
    """One sign bit per rotated coordinate and the fp16 norm (a toy; 1 bit per coordinate)."""

    family = "toyrot"
    style = PlotStyle("toy rotated sign", "C8", "X")

    def __init__(self, dim: int):
        super().__init__(ToyRotConfig(dim))

    @classmethod
    def spec_label(cls, dim: int) -> str:
        return "toy rotated sign"

    @classmethod
    def from_spec(cls, dim: int) -> "ToyRotCodec":
        return cls(dim)

    @property
    def code_size(self) -> int:
        return NORM_BYTES + self.dim // 8

    @property
    def bits_per_coordinate(self) -> float:
        return 1.0

    def _forward(self, device) -> torch.Tensor:
        return self.device_state.get("forward", device, lambda d: haar_rotation(self.dim, 7, device=d).T
                                     .to(torch.float32).contiguous())

    def reader(self, device) -> ToySignReader:
        return ToySignReader(self.dim, self._forward(torch.device(device)))

    def _encode_flat(self, x):
        u = x @ self._forward(x.device)
        return torch.cat([float16_to_bytes(x.norm(dim=1)), pack_bits((u > 0).to(torch.int64), 1)], dim=1)

    def _decode_flat(self, codes):
        reader = self.reader(codes.device)
        return reader.unrotate(reader.rows(codes))


# ------------------------------------------------------------------ one registry line
@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setattr(registry, "REGISTRY", registry.REGISTRY + (f"{__name__}.ToyRotCodec",))
    codec_classes.cache_clear()
    ToySignReader.calls.clear()
    yield
    monkeypatch.undo()
    codec_classes.cache_clear()


def test_reader_rows_are_the_rotated_decode(toy_registered):
    codec = parse_codec_spec("toyrot").build(DIM)
    codes = codec.encode(torch.randn(3, 5, DIM, generator=torch.Generator().manual_seed(0)))
    reader = codec.reader("cpu")
    torch.testing.assert_close(reader.rows(codes) @ reader.forward.T, codec.decode(codes), rtol=1e-5, atol=1e-5)


def test_toy_family_runs_through_transformers_on_codes(toy_registered):
    """Greedy logits with attention on the toy codes equal those of the decode path (codes decoded to floats,
    SDPA), prefill and decode steps alike; the reader served every coded column, with no fallback warning."""
    from fibquant.kv.attention.switch import attention_on_codes
    from fibquant.kv.cache import CompressedCache

    model = tiny_llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    codec = parse_codec_spec("toyrot").build(DIM)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    logits = {}
    for mode in ("decode", "codes"):
        cache = CompressedCache.for_model(model, codec, codec, sink_tokens=2, recent_tokens=4, attention=mode)
        with torch.no_grad(), warnings.catch_warnings(), attention_on_codes(model):
            warnings.simplefilter("error", RuntimeWarning)
            steps = [model(ids[:, :32], past_key_values=cache, use_cache=True).logits[:, -1]]
            steps += [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits[:, -1] for t in range(32, 40)]
        logits[mode] = torch.cat(steps)
        if mode == "decode":
            assert not ToySignReader.calls
    assert {"scores", "values"} <= set(ToySignReader.calls)  # attention on codes read the toy codes by the reader
    torch.testing.assert_close(logits["codes"], logits["decode"], rtol=1e-4, atol=1e-4)


def test_toy_family_runs_through_the_paged_step(toy_registered):
    """The paged decode step (vLLM's pages) serves the toy codes through their reader: equal to its spec."""
    from fibquant.kv.attention.paged import paged_decode_attention, paged_decode_attention_reference

    codec = parse_codec_spec("toyrot").build(DIM)
    generator = torch.Generator().manual_seed(2)
    kv_heads, block, slot = 2, 8, 2 * codec.code_size
    pages = torch.zeros(6, kv_heads, block, slot, dtype=torch.uint8)
    tables = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)
    for b, length in enumerate((20, 13)):
        codes = torch.cat([codec.encode(torch.randn(length, kv_heads, DIM, generator=generator)) for _ in range(2)], -1)
        for p in range(length):
            pages[tables[b, p // block], :, p % block] = codes[p]
    case = dict(query=torch.randn(2, 4, DIM, generator=generator), pages=pages, tables=tables, starts=[2, 0],
                stops=[20, 13], key_codec=codec, value_codec=codec,
                exact_keys=torch.randn(2, kv_heads, 3, DIM, generator=generator),
                exact_values=torch.randn(2, kv_heads, 3, DIM, generator=generator),
                new_keys=torch.randn(2, kv_heads, 1, DIM, generator=generator),
                new_values=torch.randn(2, kv_heads, 1, DIM, generator=generator), scaling=DIM ** -0.5)
    want = paged_decode_attention_reference(**case)
    ToySignReader.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = paged_decode_attention(**case, sinks=None)
    assert {"scores", "values"} <= set(ToySignReader.calls)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
