"""Large batches: encode and decode in chunks (same codes and vectors as one pass, bounded memory),
and decode refuses codes whose stored norm or scale is not a finite number."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fibquant.codecs.base as base
from test_codecs import CODECS, NOT_ROW_EXACT, _inputs, codec_for

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize("name", sorted(set(CODECS) - NOT_ROW_EXACT))
def test_chunked_encode_and_decode_equal_one_pass(name, monkeypatch):
    codec = codec_for(name)
    x = _inputs(codec.dim, n=50, seed=3).reshape(5, 10, codec.dim)
    codes, decoded = codec.encode(x), codec.decode(codec.encode(x))
    monkeypatch.setattr(base, "CHUNK_ROWS", 7)
    assert torch.equal(codec.encode(x), codes)
    assert torch.equal(codec.decode(codes), decoded)
    assert torch.equal(codec.decode(codes, dtype=torch.float16), decoded.to(torch.float16))


@pytest.mark.parametrize("name", sorted(CODECS))
def test_random_code_bytes_decode_to_finite_vectors_or_are_refused(name):
    codec = codec_for(name)
    codes = torch.randint(0, 256, (4096, codec.code_size), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(1))
    try:
        out = codec.decode(codes)
    except ValueError as exc:
        assert type(codec).__name__ in str(exc)
    else:
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["turbo2", "fib_d64_rate1", "int4", "fp16"])
def test_a_code_with_an_infinite_norm_is_refused(name):
    codec = codec_for(name)
    codes = codec.encode(_inputs(codec.dim, n=4)).clone()
    codes[2, :2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # fp16 +inf in the first stored half
    with pytest.raises(ValueError, match="decode to NaN/Inf"):
        codec.decode(codes)


PEAK = r"""
import resource, sys
sys.path[:0] = [{src!r}]
import torch
torch.set_num_threads(1)
from fibquant.codecs.registry import parse_codec_spec
spec, n, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
codec = parse_codec_spec(spec).build(64)
step = 1 << 14
if what == "decode":
    data = torch.cat([codec.encode(torch.randn(min(step, n - s), 64)) for s in range(0, n, step)])
else:
    data = torch.randn(n, 64)
codec.encode(torch.randn(8, 64)); codec.decode(codec.encode(torch.randn(8, 64)))
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
hwm = lambda: 1024 * int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
try:  # reset the high-water mark after the warm-up (kernel compiles, imports): only the call counts
    open("/proc/self/clear_refs", "w").write("5")
    reset = True
except OSError:
    reset = False
base, before = rss(), hwm()
out = codec.encode(data) if what == "encode" else codec.decode(data)
# without the reset, the warm-up's high-water mark stays an upper bound of the call's peak
peak = (hwm() if reset else max(before, hwm())) - base
print(peak, data.numel() * data.element_size(), out.numel() * out.element_size())
"""


@pytest.mark.parametrize("spec, what", [("turboquant:b=2", "encode"), ("turboquant:b=2", "decode"),
                                        ("int:b=4", "encode")])
def test_peak_memory_of_a_large_batch_is_bounded(spec, what):
    """One million vectors (256 MB of float32): the peak resident memory above what the process held
    before the call stays within twice the input plus the output."""
    done = subprocess.run([sys.executable, "-c", PEAK.format(src=str(SRC)), spec, str(1 << 20), what],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    peak, given, out = map(int, done.stdout.split())
    assert peak <= 2 * given + out, (peak, given, out)
