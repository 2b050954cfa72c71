"""Shared helpers for the KV-cache tests: a tiny random Llama and a process-wide real model."""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch

REAL_PROMPT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of"
)


def tiny_llama(seed: int = 0, **overrides):
    """A randomly initialised LlamaForCausalLM with GQA (4 query heads, 2 KV heads, head_dim 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    settings = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    settings.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**settings)).eval()


@functools.lru_cache(maxsize=1)
def _load_real_model():
    from fibquant.kv.model import load_model

    return load_model()


def real_model(request):
    """The session fixture `model_and_tokenizer` when conftest provides it, else a cached load."""
    try:
        return request.getfixturevalue("model_and_tokenizer")
    except pytest.FixtureLookupError:
        return _load_real_model()


def decode_all_attention(query, kv, bias, scaling, sinks=None, softcap=None):
    """The spec of a decode step on codes: decode every code, repeat KV heads, the reference epilogue
    (`reference.epilogue_weights`: soft-cap, bias, one softmax with a sink column) over the row; bias
    additive [B|1, 1|Hq, 1, L] or None. Returns [B, T, Hq, Dv]."""
    from fibquant.kv.attention.reference import epilogue_weights

    keys, values = (t.to(torch.float32) for t in kv.materialize())
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    scores = query.to(torch.float32) @ keys.transpose(-1, -2) * scaling
    weights = epilogue_weights(scores, bias, softcap, None if sinks is None else sinks.to(torch.float32))
    return (weights @ values).transpose(1, 2)


def filled_coded_layer(key_codec, value_codec, batch, heads, past, sinks=4, recent=8, centre=False, seed=0):
    """A CompressedLayer ("codes") fed `past` random tokens (a chunk, then two single steps); with
    `centre`, states offset by a per-head mean. Returns (layer, its generator for further draws)."""
    from fibquant.kv.cache import CompressedLayer

    dim = key_codec.dim
    layer = CompressedLayer(key_codec, value_codec, sinks, recent, attention="codes", centre=centre)
    generator = torch.Generator().manual_seed(seed)
    offset = 3.0 * torch.randn(1, heads, 1, dim, generator=generator) if centre else 0.0
    for chunk in (past - 2, 1, 1):
        layer.update(torch.randn(batch, heads, chunk, dim, generator=generator) + offset,
                     torch.randn(batch, heads, chunk, dim, generator=generator) + offset)
    return layer, generator


def fast_and_torch_paths(*args, **kwargs):
    """attend_codes(*args, **kwargs) with the numba decode kernels, then with them off (the torch path)."""
    from fibquant.kv.attention import attend_codes
    from fibquant.kv.options import AttentionOptions

    fast = attend_codes(*args, **kwargs)
    slow = attend_codes(*args, **kwargs, options=AttentionOptions(numba_decode=False))
    return fast, slow


def check_sinks_and_sliding_window(query, kv, sinks, scale=0.1, window=None):
    """The numba step equals the torch path and the spec (`decode_all_attention`) with learned sink logits
    `sinks` [query heads], then with a sliding window (default: 10 tokens short of the row)."""
    fast, slow = fast_and_torch_paths(query, kv, None, scale, sinks=sinks)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast, decode_all_attention(query, kv, None, scale, sinks), rtol=1e-4, atol=1e-5)
    window = kv.length - 10 if window is None else window
    fast, slow = fast_and_torch_paths(query, kv, None, scale, window=window)
    blocked = torch.arange(kv.length) <= kv.length - 1 - window
    bias = torch.zeros(kv.length).masked_fill_(blocked, float("-inf"))[None, None, None]
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast, decode_all_attention(query, kv, bias, scale), rtol=1e-4, atol=1e-5)


def ragged_float_mask(batch, query_heads, length, generator):
    """A one-token float mask [batch, query_heads, 1, length] (batch >= 2): row 1 blocks its first 3 and
    positions 20-24, row 0 blocks length - 4 and adds a random bias elsewhere."""
    allowed = torch.ones(batch, query_heads, 1, length, dtype=torch.bool)
    allowed[1, :, :, :3] = False
    allowed[1, :, :, 20:25] = False
    allowed[0, :, :, length - 4] = False
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    mask[0] += torch.randn(mask[0].shape, generator=generator)
    return mask


def edit_manifest(path, edit) -> dict:
    """Apply `edit(manifest dict)` to a saved cache's manifest.json and re-sign its field checksums
    (a deliberate edit, e.g. making an older-format file); returns the edited dict."""
    import json
    from pathlib import Path

    from fibquant.archive.metadata import with_checksums

    file = Path(path) / "manifest.json"
    data = json.loads(file.read_text())
    data.pop("checksums", None)
    edit(data)
    data = with_checksums(data) if data.get("version", 0) >= 4 else data
    file.write_text(json.dumps(data))
    return data


@contextlib.contextmanager
def held_by_another_process(opening: str):
    """A child process runs `opening` (Python that opens a store for writing as `s`, e.g.
    "s = PersistentCache.open(path, 'a')" after its imports) and holds it until the block ends."""
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    code = f"import sys\nsys.path[:0] = [{src!r}]\n{opening}\nprint('locked', flush=True)\nsys.stdin.read()\ns.close()"
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
