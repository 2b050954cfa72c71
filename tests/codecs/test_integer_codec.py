"""INT baseline: exact layout and error bounds of min-max quantization."""
import pytest
import torch

from fibquant.codecs.integer import IntCodec


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [None, 16])
def test_error_within_half_step(bits, group_size):
    codec = IntCodec(64, bits, group_size=group_size)
    x = torch.randn(200, 64)
    x_hat = codec.decode(codec.encode(x))
    group = group_size or 64
    grouped = x.reshape(200, -1, group)
    step = (grouped.amax(-1) - grouped.amin(-1)) / (2**bits - 1)
    # half a step, plus slack for the fp16 storage of min and step
    bound = step.unsqueeze(-1) * (0.5 + 2**-9 * 2**bits) + grouped.abs().amax(-1, keepdim=True) * 2**-10
    assert ((x_hat.reshape(200, -1, group) - grouped).abs() <= bound).all()


def test_code_size_and_ratio():
    codec = IntCodec(64, 4)
    assert codec.code_size == 4 + 32
    assert codec.compression_ratio == pytest.approx(128 / 36)
    assert IntCodec(64, 3, group_size=32).code_size == 2 * 4 + 24


def test_constant_and_zero_vectors():
    codec = IntCodec(8, 4)
    x = torch.stack([torch.zeros(8), torch.full((8,), 3.0)])
    assert torch.equal(codec.decode(codec.encode(x)), x)


def test_single_row_equals_batch_and_offsets():
    codec = IntCodec(32, 3)
    x = torch.randn(7, 32)
    codes = codec.encode(x)
    flat = codes.reshape(-1)
    for i in range(7):
        row = flat[i * codec.code_size : (i + 1) * codec.code_size]
        assert torch.equal(codec.decode(row), codec.decode(codes)[i])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_input_dtypes_and_leading_shape(dtype):
    codec = IntCodec(16, 8)
    x = torch.randn(2, 3, 16).to(dtype)
    codes = codec.encode(x)
    assert codes.shape == (2, 3, codec.code_size) and codes.dtype == torch.uint8
    assert codec.decode(codes, dtype=dtype).dtype == dtype
    assert torch.allclose(codec.decode(codes), x.float(), atol=0.05)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"bits": 1}, "2..8 bits"), ({"bits": 9}, "2..8 bits"), ({"bits": 4, "group_size": 5}, "group_size")],
)
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        IntCodec(16, **kwargs)


def test_bad_inputs():
    codec = IntCodec(16, 4)
    with pytest.raises(ValueError, match="last dimension"):
        codec.encode(torch.randn(3, 15))
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.encode(torch.tensor([float("nan")] + [0.0] * 15))
    with pytest.raises(ValueError, match="floating"):
        codec.encode(torch.ones(16, dtype=torch.int32))
    with pytest.raises(ValueError, match="fp16 range"):
        codec.encode(torch.full((16,), 1e6))
    with pytest.raises(ValueError, match="uint8"):
        codec.decode(torch.zeros(2, codec.code_size, dtype=torch.int32))
    with pytest.raises(ValueError, match="code_size"):
        codec.decode(torch.zeros(2, codec.code_size + 1, dtype=torch.uint8))
