"""CompressedCache: the transformers Cache contract, window semantics, memory accounting, errors."""
from __future__ import annotations

import pytest
import torch
from _kv_helpers import REAL_PROMPT, real_model, tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LlamaConfig

from fibquant.kv.attention.switch import attention_on_codes
from fibquant.kv.model import cache_kwarg
from fibquant.codecs.integer import IntCodec
from fibquant.kv.cache import CompressedCache, CompressedLayer
from fibquant.kv.accounting import cache_nbytes, dynamic_cache_bytes_per_token, dynamic_cache_nbytes
from fibquant.kv.model import check_model_supported

DIM = 16


def reference_view(keys: torch.Tensor, archived: range, codec) -> torch.Tensor:
    """What an update must return: tokens in `archived` codec round-tripped, all others exact.

    keys: [B, H, n, D], all tokens so far (including the new ones, which are never archived).
    """
    out = keys.clone()
    if len(archived):
        out[..., archived, :] = codec.roundtrip(keys[..., archived, :])
    return out


class WindowModel:
    """The window rules in plain integers: the spec of which tokens are stored as codes."""

    def __init__(self, sinks: int, recent: int, encode_batch: int):
        self.sinks, self.recent, self.encode_batch = sinks, recent, encode_batch
        self.n_sink = self.n_coded = self.n_recent = 0

    def archived(self) -> range:
        return range(self.n_sink, self.n_sink + self.n_coded)

    def add(self, tokens: int) -> None:
        to_sink = min(self.sinks - self.n_sink, tokens)
        self.n_sink += to_sink
        self.n_recent += tokens - to_sink
        overflow = self.n_recent - self.recent
        if overflow >= self.encode_batch:
            self.n_coded += overflow
            self.n_recent = self.recent


@settings(max_examples=30, deadline=None)
@given(chunks=st.lists(st.integers(1, 9), min_size=1, max_size=8), sinks=st.integers(0, 5),
       recent=st.integers(0, 6), batch=st.integers(1, 2), encode_batch=st.integers(1, 4), one_codec=st.booleans())
def test_update_matches_window_reference(chunks, sinks, recent, batch, encode_batch, one_codec):
    # one_codec: the same codec object for keys and values, which the layer encodes in one call
    key_codec = IntCodec(DIM, 3)
    value_codec = key_codec if one_codec else IntCodec(DIM, 2)
    layer = CompressedLayer(key_codec, value_codec, sinks, recent, encode_batch=encode_batch)
    spec = WindowModel(sinks, recent, encode_batch)
    generator = torch.Generator().manual_seed(len(chunks) * 100 + sinks * 10 + recent)
    total = sum(chunks)
    keys = torch.randn(batch, 2, total, DIM, generator=generator)
    values = torch.randn(batch, 2, total, DIM, generator=generator)
    past = 0
    for size in chunks:
        new = slice(past, past + size)
        got_keys, got_values = layer.update(keys[..., new, :], values[..., new, :])
        assert got_keys.shape == (batch, 2, past + size, DIM)
        torch.testing.assert_close(got_keys, reference_view(keys[..., : past + size, :], spec.archived(), key_codec),
                                   rtol=0, atol=0)
        torch.testing.assert_close(got_values,
                                   reference_view(values[..., : past + size, :], spec.archived(), value_codec),
                                   rtol=0, atol=0)
        past += size
        spec.add(size)
        assert layer.get_seq_length() == past
        assert (layer.num_sink, layer.num_coded, layer.num_recent) == (spec.n_sink, spec.n_coded, spec.n_recent)
        assert layer.num_recent < recent + encode_batch


def _filled_layer(tokens=40, sinks=4, recent=8, batch=2, heads=3):
    layer = CompressedLayer(IntCodec(DIM, 4), IntCodec(DIM, 3), sinks, recent)
    torch.manual_seed(1)
    for chunk in (tokens - 5, 1, 1, 1, 1, 1):
        layer.update(torch.randn(batch, heads, chunk, DIM), torch.randn(batch, heads, chunk, DIM))
    return layer


def test_only_codes_outside_window_and_exact_accounting():
    layer = _filled_layer(tokens=40, sinks=4, recent=8, batch=2, heads=3)
    assert (layer.num_sink, layer.num_coded, layer.num_recent) == (4, 28, 8)
    assert layer.key_codes.dtype == torch.uint8 and layer.value_codes.dtype == torch.uint8
    # No float tensor anywhere on the layer covers more than the exact window.
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert value.shape[-2] <= 8, f"{name} holds {value.shape[-2]} float tokens"
    held = layer.tensors()
    assert layer.nbytes() == sum(t.numel() * t.element_size() for t in held)
    float_bytes = 2 * 3 * (4 + 8) * DIM * 4 * 2  # batch*heads*(sinks+recent)*dim*fp32*(K and V)
    code_row_bytes = IntCodec(DIM, 4).code_size + IntCodec(DIM, 3).code_size
    assert layer.used_nbytes() == float_bytes + 2 * 3 * 28 * code_row_bytes
    # 28 rows arrived as 23 (prefill overflow) then one per step: capacity max(64, 23) = 64 rows reserved.
    assert layer.key_buffer.capacity == layer.value_buffer.capacity == 64
    # The recent window's buffers: 8 rows live, recent + max(encode_batch, 16) = 24 reserved (rows are
    # written in place; the live ones move to a new buffer at most once every 16 steps).
    assert layer._recent_k.capacity == layer._recent_v.capacity == 24
    window_reserve = 2 * 3 * (24 - 8) * DIM * 4 * 2
    assert layer.nbytes() == float_bytes + window_reserve + 2 * 3 * 64 * code_row_bytes


def test_cache_nbytes_sums_layers_and_beats_dynamic_cache():
    model = tiny_llama()
    ids = torch.randint(0, 97, (2, 120), generator=torch.Generator().manual_seed(0))
    cache = CompressedCache(IntCodec(DIM, 4), IntCodec(DIM, 4), sink_tokens=4, recent_tokens=8)
    dynamic = DynamicCache()
    with torch.no_grad():
        model(ids, **cache_kwarg(model, cache), use_cache=True)
        model(ids, **cache_kwarg(model, dynamic), use_cache=True)
    assert len(cache.layers) == 2 and cache.get_seq_length() == 120
    assert cache.nbytes() == sum(layer.nbytes() for layer in cache.layers)
    assert cache.bytes_per_token() == pytest.approx(cache.used_nbytes() / (2 * 120))
    assert dynamic_cache_nbytes(dynamic) == 2 * 2 * 2 * 120 * DIM * 4 * 2  # layers*B*H*T*D*fp32*(K,V)
    assert dynamic_cache_bytes_per_token(dynamic) == pytest.approx(2 * 2 * DIM * 4 * 2)
    window_bytes = (4 + 8) * DIM * 4 * 2  # exact tokens * dim * fp32 * (K and V), per layer/batch/head
    code_bytes = (120 - 12) * 2 * IntCodec(DIM, 4).code_size
    assert cache.used_nbytes() == 2 * 2 * 2 * (window_bytes + code_bytes)
    assert cache.nbytes() == cache.used_nbytes()  # one prefill reserves exactly what it encodes
    assert cache.nbytes() < dynamic_cache_nbytes(dynamic) / 3
    assert cache_nbytes(cache) == cache.nbytes() and cache_nbytes(dynamic) == dynamic_cache_nbytes(dynamic)
    assert cache_nbytes(cache, stored=True) == cache.used_nbytes() <= cache.nbytes()
    assert cache_nbytes(dynamic, stored=True) == dynamic_cache_nbytes(dynamic)


def test_cache_nbytes_counts_a_roundtrip_cache_in_its_format():
    from fibquant.kv.roundtrip_cache import RoundTripCache

    cache = RoundTripCache(lambda x, start: x, lambda x, start: x, sink_tokens=2, recent_tokens=3)
    cache.update(torch.zeros(1, 2, 10, DIM), torch.zeros(1, 2, 10, DIM), 0)
    with pytest.raises(ValueError, match="format_bytes"):
        cache_nbytes(cache)
    assert cache_nbytes(cache, (6, 6)) == cache.format_nbytes(6, 6) == 2 * (5 * DIM * 4 * 2 + 5 * 12)


def test_prefill_then_decode_matches_dynamic_cache_when_window_covers_everything():
    model = tiny_llama()
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(2))
    exact = CompressedCache(IntCodec(DIM, 2), IntCodec(DIM, 2), sink_tokens=0, recent_tokens=64)
    with torch.no_grad():
        reference = model(ids).logits
        parts = [model(ids[:, :20], **cache_kwarg(model, exact), use_cache=True).logits]
        parts += [model(ids[:, t:t + 1], **cache_kwarg(model, exact), use_cache=True).logits for t in range(20, 30)]
    torch.testing.assert_close(torch.cat(parts, dim=1), reference, rtol=1e-4, atol=1e-4)
    assert exact.layers[0].num_coded == 0


def test_generate_with_compressed_cache_batch_and_gqa():
    model = tiny_llama()
    ids = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    cache = CompressedCache(IntCodec(DIM, 8), IntCodec(DIM, 8), sink_tokens=2, recent_tokens=4, encode_batch=1)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **cache_kwarg(model, cache),
                         pad_token_id=0)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == reference.shape == (2, 32)
    assert torch.equal(out, reference)  # INT8 on a random tiny model: greedy tokens unchanged
    layer = cache.layers[0]
    assert cache.get_seq_length() == 31 and (layer.num_sink, layer.num_recent) == (2, 4)
    assert layer.key_codes.shape[:2] == (2, 2)  # batch 2, 2 KV heads (GQA: 4 query heads)


def test_crop_and_batch_edits():
    layer = _filled_layer(tokens=40, sinks=4, recent=8, batch=3, heads=2)
    full_keys = layer.keys
    assert full_keys.shape == (3, 2, 40, DIM)
    picked = torch.tensor([2, 0])
    layer.batch_select_indices(picked)
    torch.testing.assert_close(layer.keys, full_keys[picked], rtol=0, atol=0)
    layer.reorder_cache(torch.tensor([1, 0]))
    torch.testing.assert_close(layer.keys, full_keys[torch.tensor([0, 2])], rtol=0, atol=0)
    layer.batch_repeat_interleave(2)
    assert layer.keys.shape[0] == 4
    kept = layer.keys[..., :30, :]
    layer.crop(30)
    assert (layer.num_sink, layer.num_coded, layer.num_recent) == (4, 26, 0)
    torch.testing.assert_close(layer.keys, kept, rtol=0, atol=0)
    layer.crop(-28)
    assert layer.get_seq_length() == 2 and layer.num_coded == 0
    assert layer.nbytes() == sum(t.numel() * t.element_size() for t in layer.tensors())
    layer.reset()
    assert layer.get_seq_length() == 0


def test_cache_level_crop_and_mask_sizes():
    model = tiny_llama()
    ids = torch.randint(0, 97, (1, 50), generator=torch.Generator().manual_seed(4))
    cache = CompressedCache(IntCodec(DIM, 8), IntCodec(DIM, 8), sink_tokens=4, recent_tokens=8)
    with torch.no_grad():
        model(ids, **cache_kwarg(model, cache), use_cache=True)
    assert cache.get_mask_sizes(3, 0) == (53, 0)
    cache.crop(-5)  # transformers 5: crop takes the number of tokens to drop, negative
    assert cache.get_seq_length() == 45
    with torch.no_grad():
        logits = model(ids[:, 45:], **cache_kwarg(model, cache), use_cache=True).logits
    assert logits.shape == (1, 5, 97) and torch.isfinite(logits).all()
    assert cache.layers[0].keys.shape == (1, 2, 50, DIM)  # decoded on request


def test_bad_input_errors():
    with pytest.raises(ValueError, match="sink_tokens"):
        CompressedCache(IntCodec(DIM, 4), IntCodec(DIM, 4), sink_tokens=-1)
    with pytest.raises(ValueError, match="recent_tokens"):
        CompressedCache(IntCodec(DIM, 4), IntCodec(DIM, 4), recent_tokens=-3)
    with pytest.raises(ValueError, match="key_codec"):
        CompressedCache("int4", IntCodec(DIM, 4))
    cache = CompressedCache(IntCodec(32, 4), IntCodec(DIM, 4))
    with pytest.raises(ValueError, match=r"head_dim 16 .* key codec dim 32"):
        cache.update(torch.randn(1, 2, 5, DIM), torch.randn(1, 2, 5, DIM), 0)
    cache = CompressedCache(IntCodec(DIM, 4), IntCodec(DIM, 4))
    with pytest.raises(ValueError, match="batch, kv_heads, tokens, head_dim"):
        cache.update(torch.randn(2, 5, DIM), torch.randn(2, 5, DIM), 0)
    model = tiny_llama()
    with pytest.raises(ValueError, match="head_dim 16 differs from the value codec dim 32"):
        CompressedCache.for_model(model, IntCodec(DIM, 4), IntCodec(32, 4))
    sliding = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    sliding.layer_types = ["sliding_attention", "linear_attention"]
    sliding.sliding_window = 16
    with pytest.raises(ValueError, match=r"layer types \['linear_attention'\]"):
        check_model_supported(sliding)
    sliding.layer_types = ["sliding_attention", "full_attention"]
    assert check_model_supported(sliding)["windows"] == [16, None]
    sliding.sliding_window = 1
    with pytest.raises(ValueError, match="layer 0 is 'sliding_attention' with window 1"):
        check_model_supported(sliding)
    assert check_model_supported(model) == {"layers": 2, "kv_heads": 2, "head_dim": DIM, "key_dim": DIM,
                                             "value_dim": DIM, "layer_types": ["full_attention"] * 2,
                                             "windows": [None, None], "latent": False}


@pytest.mark.model
def test_int8_greedy_generate_equals_uncompressed_on_real_model(request):
    model, tokenizer = real_model(request)
    inputs = tokenizer(REAL_PROMPT, return_tensors="pt")
    assert inputs.input_ids.shape[1] > 36  # the prompt is longer than the exact window
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    reference = model.generate(**inputs, **kwargs)
    cache = CompressedCache.for_model(model, IntCodec(64, 8), IntCodec(64, 8), sink_tokens=4, recent_tokens=32,
                                      encode_batch=1)
    with attention_on_codes(model):
        compressed = model.generate(**inputs, **cache_kwarg(model, cache), **kwargs)
    assert torch.equal(compressed, reference), tokenizer.decode(compressed[0]) + " | " + tokenizer.decode(reference[0])
    assert cache.layers[0].num_coded > 0
    assert len(cache.layers) == 30


def test_shared_state_counts_codebook_and_rotation_once():
    from fibquant.codecs.fibquant import FibQuantCodec
    from fibquant.kv.accounting import codec_state_nbytes

    codec = FibQuantCodec(64, 4, 256)
    codec.decode(codec.encode(torch.randn(3, 64)))
    codebook = 256 * 4 * 4 + 256 * 4             # codewords + their squared norms, float32
    rotation = 64 * 64 * 4 + 64 * 64 * 8         # Pi^T float32 (encode) + Pi float64 (decode)
    fast = codec._numba_search(torch.device("cpu"))  # the numba search's tables (CPU encode), if any
    search = 0 if fast is None else fast.table_nbytes()
    assert codec_state_nbytes(codec) == codebook + rotation + search
    cache = CompressedCache(codec, codec)
    assert cache.shared_nbytes() == codebook + rotation + search  # one codec for keys and values: counted once


def test_cache_kwarg_passes_the_cache_without_a_deprecation_warning():
    """forward and generate get the cache by the name the installed transformers accepts
    (`cache` from 5.24 on, which warns on `past_key_values=`): no deprecation warning."""
    import inspect
    import warnings

    from fibquant.kv.model import cache_kwarg

    model = tiny_llama()
    params = inspect.signature(type(model).forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    assert cache_kwarg(model, 1) == cache_kwarg(model.forward, 1) == cache_kwarg(model.generate, 1) == {name: 1}
    ids = torch.randint(3, 97, (1, 12), generator=torch.Generator().manual_seed(5))

    def new_cache():
        return CompressedCache(IntCodec(DIM, 8), IntCodec(DIM, 8), sink_tokens=2, recent_tokens=4)

    def deprecations(caught):
        return [str(w.message) for w in caught
                if issubclass(w.category, (FutureWarning, DeprecationWarning)) and "past_key_values" in str(w.message)]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=ids, **cache_kwarg(model, new_cache()), use_cache=True)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                             pad_token_id=0, **cache_kwarg(model.generate, new_cache()))
    assert out.shape == (1, 15)
    assert deprecations(caught) == []
    if name == "cache":  # the check above sees the warning where there is one
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(input_ids=ids, past_key_values=new_cache(), use_cache=True)
        assert deprecations(caught)


def test_window_buffer_writes_in_place_and_keeps_earlier_views():
    from fibquant.kv.buffer import WindowBuffer

    rows = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    window = WindowBuffer(rows, min_capacity=8)
    assert window.data is rows and (window.used, window.capacity) == (4, 4)
    window.append(torch.full((2, 3, 1, 5), -1.0))  # full: the rows move to a new buffer first
    assert window.data is not rows and window.capacity == 8 and torch.equal(rows, torch.arange(120.).reshape(2, 3, 4, 5))
    storage = window.data.data_ptr()
    before = window.view()
    kept = before.clone()
    for step in range(3):  # in place, past the earlier view
        window.append(torch.full((2, 3, 1, 5), float(step)))
    assert window.data.data_ptr() == storage and window.used == 8
    assert torch.equal(before, kept)
    window.drop_front(5)
    assert torch.equal(window.view(), torch.cat([torch.full((2, 3, 1, 5), float(s)) for s in range(3)], dim=-2))
    last = window.view()
    window.append(torch.full((2, 3, 2, 5), 7.0))  # 3 + 2 > the 0 rows left after stop: moved, capacity >= 8
    assert window.data.data_ptr() != storage and window.capacity == 8 and window.used == 5
    assert torch.equal(last, torch.cat([torch.full((2, 3, 1, 5), float(s)) for s in range(3)], dim=-2))  # still valid
    assert torch.equal(window.view()[..., 3:, :], torch.full((2, 3, 2, 5), 7.0))
    window.truncate(1)
    assert window.used == 1 and torch.equal(window.view(), torch.zeros(2, 3, 1, 5))
    big = WindowBuffer(torch.zeros(1, 1, 0, 2))
    big.append(torch.ones(1, 1, 80, 2))  # no minimum: used + used / 8 reserved
    assert big.capacity == 90 and big.used == 80


@pytest.mark.parametrize("edit", ["select", "reorder", "repeat", "crop"])
def test_steps_across_window_moves_and_edits_equal_a_fresh_layer(edit):
    """Many one-token steps (encodes every 4, the window's rows moving to new buffers) with a batch
    edit in the middle give exactly what a layer fed the edited tokens from the start holds; the views
    an update returned stay what they were."""
    batch, heads, total = 3, 2, 60
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(batch, heads, total, DIM, generator=generator)
    values = torch.randn(batch, heads, total, DIM, generator=generator)
    index = {"select": torch.tensor([2, 0]), "reorder": torch.tensor([1, 2, 0]),
             "repeat": torch.tensor([0, 0, 1, 1, 2, 2]), "crop": torch.arange(batch)}[edit]

    def make():
        return CompressedLayer(IntCodec(DIM, 4), IntCodec(DIM, 3), 2, 5, attention="codes", encode_batch=4)

    layer, views = make(), []
    layer.update(keys[..., :12, :], values[..., :12, :])
    for t in range(12, 30):
        view, _ = layer.update(keys[..., t:t + 1, :], values[..., t:t + 1, :])
        assert view.length == t + 1
        assert view.num_sink + view.num_coded + view.recent_keys.shape[-2] == t  # every stored token, codes too
        views.append((view, view.recent_keys.clone(), view.key_codes.clone()))
    cut = 30
    if edit == "select":
        layer.batch_select_indices(index)
    elif edit == "reorder":
        layer.reorder_cache(index)
    elif edit == "repeat":
        layer.batch_repeat_interleave(2)
    else:
        layer.crop(-3)  # drops 3 recent (exact) tokens: they come back below
        cut = 27
    for t in range(cut, total):
        view, _ = layer.update(keys[index, :, t:t + 1, :], values[index, :, t:t + 1, :])
        assert view.num_sink + view.num_coded + view.recent_keys.shape[-2] == t
        views.append((view, view.recent_keys.clone(), view.key_codes.clone()))
    if edit == "crop":  # only exact tokens were cut, and tokens 27.. came again: the sequence is 0..59
        assert layer.get_seq_length() == total
        coded = range(layer.num_sink, layer.num_sink + layer.num_coded)
        assert torch.equal(layer.keys, reference_view(keys, coded, layer.key_codec))
        assert torch.equal(layer.values, reference_view(values, coded, layer.value_codec))
    else:
        fresh = make()
        fresh.update(keys[index, :, :12, :], values[index, :, :12, :])
        for t in range(12, total):
            fresh.update(keys[index, :, t:t + 1, :], values[index, :, t:t + 1, :])
        assert (layer.num_sink, layer.num_coded, layer.num_recent) == (fresh.num_sink, fresh.num_coded,
                                                                       fresh.num_recent)
        assert torch.equal(layer.keys, fresh.keys) and torch.equal(layer.values, fresh.values)
    for view, recent, codes in views:
        assert torch.equal(view.recent_keys, recent) and torch.equal(view.key_codes, codes)
    assert layer.nbytes() == sum(t.untyped_storage().nbytes() for t in layer.tensors())


@pytest.mark.parametrize("one_codec", [True, False])
def test_one_shot_prefill_encodes_in_bounded_pieces_and_keeps_no_prompt_floats(monkeypatch, one_codec):
    # A one-shot prefill encodes every token that leaves the window; its working memory (float copies,
    # search buffers) must not scale with the prompt: at most ENCODE_CHUNK_ROWS vectors per encode call,
    # the same codes as one call over all of them, and no float of the prompt kept past the window.
    import fibquant.kv.layer as layer_module

    monkeypatch.setattr(layer_module, "ENCODE_CHUNK_ROWS", 64)
    key_codec = IntCodec(DIM, 4)
    value_codec = key_codec if one_codec else IntCodec(DIM, 3)
    calls = []
    for codec in {id(c): c for c in (key_codec, value_codec)}.values():
        encode = codec.encode

        def recording(x, encode=encode):
            calls.append(x.numel() // DIM)
            return encode(x)
        monkeypatch.setattr(codec, "encode", recording)
    layer = CompressedLayer(key_codec, value_codec, sink_tokens=4, recent_tokens=8, attention="codes")
    batch, heads, tokens = 2, 3, 300
    generator = torch.Generator().manual_seed(5)
    # the model's layout: [B, T, H, D] transposed to [B, H, T, D] (not contiguous)
    keys = torch.randn(batch, tokens, heads, DIM, generator=generator).transpose(1, 2)
    values = torch.randn(batch, tokens, heads, DIM, generator=generator).transpose(1, 2)
    layer.update(keys, values)
    leaving = tokens - 4 - 8
    assert layer.num_coded == leaving and max(calls) <= 64
    assert sum(calls) == 2 * batch * heads * leaving
    # rows are encoded one by one: the pieces give the codes of one call over everything
    calls.clear()
    assert torch.equal(layer.key_codes, key_codec.encode(keys[..., 4:4 + leaving, :]))
    assert torch.equal(layer.value_codes, value_codec.encode(values[..., 4:4 + leaving, :]))
    prompt = {keys.untyped_storage().data_ptr(), values.untyped_storage().data_ptr()}
    for tensor in layer.tensors():
        assert tensor.untyped_storage().data_ptr() not in prompt  # nothing keeps the prompt's floats alive
        if tensor.is_floating_point():
            assert tensor.shape[-2] <= 8 + 16  # sinks, or the window with its reserve
    torch.testing.assert_close(layer.recent_keys, keys[..., -8:, :], rtol=0, atol=0)
    torch.testing.assert_close(layer.sink_values, values[..., :4, :], rtol=0, atol=0)


def test_a_first_chunk_attends_to_its_own_keys_without_a_copy():
    from fibquant.kv.buffer import CodedKV

    layer = CompressedLayer(IntCodec(DIM, 4), IntCodec(DIM, 4), sink_tokens=4, recent_tokens=8, attention="codes")
    keys, values = torch.randn(1, 2, 30, DIM), torch.randn(1, 2, 30, DIM)
    view, _ = layer.update(keys, values)
    assert isinstance(view, CodedKV)
    exact_keys, exact_values = view.exact(with_sinks=True)
    assert exact_keys is keys and exact_values is values  # the whole prompt once, not a concatenated copy
    view, _ = layer.update(keys[..., :1, :], values[..., :1, :])  # later: sinks + window + the new token
    exact_keys, _ = view.exact(with_sinks=True)
    assert exact_keys.shape[-2] == 4 + 8 + 1
    torch.testing.assert_close(exact_keys[..., -1:, :], keys[..., :1, :], rtol=0, atol=0)
