"""`for_model` leaves the model unchanged; `attention_on_codes` switches it and restores it; MLA defects."""
from __future__ import annotations

import pytest
import torch

import fibquant
from fibquant.eval.model_reach import FAMILIES
from fibquant.kv.model import cache_kwarg


def _ids(tokens: int = 40):
    return torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["Llama", "DeepSeek-V3"])
def test_for_model_changes_nothing_and_the_cache_refuses_to_run_outside_the_switch(family):
    model = FAMILIES[family].build()
    own = model.config._attn_implementation
    expand = [m.expand_kv for m in model.modules() if hasattr(m, "kv_b_proj")]
    cache = fibquant.CompressedCache.for_model(model, "fibquant:b=4", sink_tokens=2, recent_tokens=4, encode_batch=4)
    assert model.config._attn_implementation == own and cache.attention == "codes"
    assert [m.expand_kv for m in model.modules() if hasattr(m, "kv_b_proj")] == expand
    with pytest.raises(fibquant.AttentionNotOnCodes, match="attention_on_codes"):
        model(input_ids=_ids(), **cache_kwarg(model, cache))
    assert cache.get_seq_length() == 0  # refused before storing anything
    with fibquant.attention_on_codes(model) as switched:
        assert switched and model.config._attn_implementation == "fibquant"
        with torch.no_grad():
            model(input_ids=_ids(), **cache_kwarg(model, cache))
    assert model.config._attn_implementation == own and cache.layers[0].num_coded > 0
    assert all("expand_kv" not in vars(m) for m in model.modules() if hasattr(m, "kv_b_proj"))


def test_the_switch_restores_on_an_exception_and_nests():
    model = FAMILIES["Llama"].build()
    own = model.config._attn_implementation
    with pytest.raises(KeyError):
        with fibquant.attention_on_codes(model):
            raise KeyError("boom")
    assert model.config._attn_implementation == own
    with fibquant.attention_on_codes(model):
        with fibquant.attention_on_codes(model):
            pass
        assert model.config._attn_implementation == "fibquant"
    assert model.config._attn_implementation == own


def test_mla_spec_path_reads_each_role_size():
    """DeepSeek-V3: latent and rotary key differ in size; a spec builds each role's codec at its own size."""
    model = FAMILIES["DeepSeek-V3"].build()
    model.config.qk_rope_head_dim = 64
    info = fibquant.check_model_supported(model)
    cache = fibquant.parse_cache_spec("int:b=4")
    key, value = cache.quantizers(model)
    assert (key.dim, value.dim) == (info["key_dim"], info["value_dim"])
    with pytest.raises(ValueError, match="pass a value codec"):
        config = type(model.config)(**{**model.config.to_dict(), "kv_lora_rank": 32})
        fibquant.CompressedCache.for_model(config, fibquant.IntCodec(32, 4))


def test_mla_forward_with_grad_on_codes():
    """An MLA forward with a compressed cache outside torch.no_grad() runs (the fused kernel has no mask
    gradient: the torch form serves it) and gives the no_grad forward's logits."""
    model = FAMILIES["DeepSeek-V3"].build()
    logits = []
    for grad in (True, False):
        cache = fibquant.CompressedCache.for_model(model, "fibquant:b=4", sink_tokens=2, recent_tokens=4,
                                                   encode_batch=4)
        with fibquant.attention_on_codes(model), torch.set_grad_enabled(grad):
            model(input_ids=_ids(), **cache_kwarg(model, cache))
            logits.append(model(input_ids=_ids(24), **cache_kwarg(model, cache)).logits.detach())
    assert cache.layers[0].num_coded > 0
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
