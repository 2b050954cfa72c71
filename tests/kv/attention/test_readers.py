"""Every family's reader against the codec's decode (the reader's torch methods are the spec), and the
registered fast paths (`readers.KERNELS`) against those torch methods."""
from __future__ import annotations

import pytest
import torch

from fibquant.codecs.e8shell import E8ShellCodec
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.fibrvq import FibRVQCodec
from fibquant.codecs.integer import IntCodec
from fibquant.codecs.reader import CodebookReader, DecodedReader, ShellsReader, StagesReader
from fibquant.codecs.turboquant import TurboQuantCodec
from fibquant.kv.attention.readers import kernels_of, read_scores, read_values

DIM = 64
FAMILIES = {
    "fibquant": (lambda: FibQuantCodec(DIM, 2, 256), CodebookReader),
    "fibquant 12-bit": (lambda: FibQuantCodec(DIM, 4, 4096), CodebookReader),
    "turboquant": (lambda: TurboQuantCodec(DIM, 3), CodebookReader),
    "fibrvq": (lambda: FibRVQCodec(DIM, stages=2), StagesReader),
    "e8shell": (lambda: E8ShellCodec(DIM, 2), ShellsReader),
    "int (decoded)": (lambda: IntCodec(DIM, 4), DecodedReader),
}


@pytest.mark.filterwarnings("ignore:IntCodec has no reader of its own")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reader_equals_the_decode_and_its_fast_paths(family):
    build, kind = FAMILIES[family]
    codec = build()
    generator = torch.Generator().manual_seed(0)
    codes = codec.encode(torch.randn(2, 3, 40, DIM, generator=generator))
    reader = codec.reader("cpu")
    assert type(reader) is kind
    decoded = codec.decode(codes)
    torch.testing.assert_close(reader.unrotate(reader.rows(codes)), decoded, rtol=1e-4, atol=1e-5)
    queries = torch.randn(2, 3, 5, DIM, generator=generator)
    weights = torch.rand(2, 3, 5, 40, generator=generator)
    spec_scores = reader.scores(reader.rotate(queries), codes)
    spec_values = reader.unrotate(reader.values(weights, codes))
    torch.testing.assert_close(spec_scores, queries @ decoded.transpose(-1, -2), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(spec_values, weights @ decoded, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(read_scores(codec, queries, codes), spec_scores, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(read_values(codec, weights, codes), spec_values, rtol=1e-4, atol=1e-4)
    assert (kernels_of(reader).one_token is None) == (kind is DecodedReader)


def test_a_codec_without_a_reader_warns_once(monkeypatch):
    from fibquant.kv.attention import notices

    monkeypatch.setattr(notices, "warned", set())
    codec = IntCodec(DIM, 4)
    codes = codec.encode(torch.randn(1, 1, 3, DIM))
    with pytest.warns(RuntimeWarning, match="IntCodec has no reader of its own"):
        read_scores(codec, torch.randn(1, 1, 2, DIM), codes)
