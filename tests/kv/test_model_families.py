"""Reach: every decoder family users run, one tiny random model each, through `CompressedCache`.

`fibquant.eval.model_reach.probe` builds the family's own transformers class from a tiny config
(window 16 and sliding/full layer types where the family has them) and runs a 40-token prompt
(two prefill chunks + decode steps) on codes and on the decode path, plus a left-padded batched
`generate`. EXPECTED is the target status of each family (docs/models.md is generated from the
same probe by `benchmarks/model_reach.py`):

- "codes": no fallback warning, the model runs fibquant's attention, codes logits == decode logits
  and nothing-coded codes logits == DynamicCache logits (relative difference <= 1e-4), so does a
  DynamicCache on the model once switched to fibquant's attention, generate
  gives the decode path's tokens, every layer holds codes and a sliding layer at most its window;
- "decode fallback": served through the decode path with a warning naming `reason`;
- "refused": `for_model` raises ValueError naming `reason`, before any prefill.

The first 22 families are issue 16's list; the others (`Family.listed` False) are further families
users run, among them three the cache must refuse.

XFAIL holds the families that miss their target on the current code (strict: the test fails once
the feature lands, and the entry goes).
"""
from __future__ import annotations

import re

import pytest
from transformers.models.falcon.modeling_falcon import FalconForCausalLM
from transformers.models.gptj.modeling_gptj import GPTJForCausalLM

from fibquant.eval.model_reach import FAMILIES, LOGITS_RTOL, probe

ON_CODES = "codes"
EXPECTED = {name: (ON_CODES, None) for name in FAMILIES}


def _dispatches(model_class) -> bool:
    return model_class._can_set_attn_implementation()


# Falcon and GPT-J computed attention themselves, not through transformers' AttentionInterface, in earlier
# releases (Falcon until 5.25; both in 5.17, the lent GPU's image): no attention function can be swapped in.
for _name, _class in (("Falcon", FalconForCausalLM), ("GPT-J", GPTJForCausalLM)):
    if not _dispatches(_class):
        EXPECTED[_name] = ("decode fallback", "AttentionInterface")
# Layers that are not attention (gated delta-net, Mamba): refused by for_model, before any prefill.
EXPECTED["Qwen3-Next"] = ("refused", "layer types .*linear_attention")
EXPECTED["Jamba"] = ("refused", "layer types .*linear_attention")
EXPECTED["Mamba"] = ("refused", "no num_attention_heads")

XFAIL: dict[str, str] = {}  # family -> why it does not reach its expected status yet


def _params() -> list:
    return [pytest.param(name, marks=[pytest.mark.xfail(strict=True, reason=XFAIL[name])] if name in XFAIL else [],
                         id=name.replace(" ", "_")) for name in FAMILIES]


def test_expectations_cover_every_family():
    assert set(EXPECTED) == set(FAMILIES) and set(XFAIL) <= set(FAMILIES)
    listed = [name for name, family in FAMILIES.items() if family.listed]
    assert len(listed) == 22  # issue 16's list
    assert sum(EXPECTED[name][0] == ON_CODES and name not in XFAIL for name in listed) >= 20


@pytest.mark.parametrize("name", _params())
def test_family(name):
    result = probe(name)
    status, reason = EXPECTED[name]
    summary = f"{name}: {result['status']} at stage {result['stage']!r}: {result['reason']}"
    assert result["status"] == status, summary
    if status == ON_CODES:
        assert result["fallback_warnings"] == [] and result["warned_keys"] == [], summary
        assert result["attention"] == "codes" and result["attn_implementation"] == "fibquant", summary
        calls = result["attention_calls"]  # every attention call of the codes run got the codes
        assert calls["calls"] > 0 and calls["coded_calls"] == calls["calls"], calls
        assert result["logits_rel_codes_vs_decode"] <= LOGITS_RTOL, summary
        assert result["logits_rel_exact_vs_dynamic"] <= LOGITS_RTOL, summary
        assert result["logits_rel_switched_dynamic"] <= LOGITS_RTOL, summary  # DynamicCache after the switch
        assert result["generate_equal"] is True, summary
        assert all(coded > 0 for coded in result["coded_tokens"]), result["coded_tokens"]
        window = result["features"].get("sliding_window") or result["features"].get("attention_chunk_size")
        for kind, held in zip(result["cache_shapes"]["layers"], result["held_tokens"]):
            if "Sliding" in kind:  # transformers' own cache makes this layer a sliding one
                assert held <= window, f"a sliding layer holds {held} tokens, its window is {window}"
    elif status == "decode fallback":
        assert len(result["fallback_warnings"]) >= 1 and re.search(reason, result["reason"]), summary
        assert result["logits_rel_codes_vs_decode"] <= LOGITS_RTOL, summary
        assert result["generate_equal"] is True, summary
    else:  # refused by for_model, before the model saw a token
        assert re.search(reason, result["reason"]) and result["stage"].startswith("for_model"), summary
        assert result["cache_shapes"] is None and result["attention_calls"] is None, summary


# ----------------------------------------------------------------------------- the probe can fail
def test_probe_counts_each_familys_fallback_warning():
    """A codec without a reader of its own decodes its codes (one warning per process): the probe
    empties fibquant's once-only set, so the second probe counts it again."""
    from fibquant.codecs.integer import IntCodec

    for _ in range(2):
        result = probe("Llama", generate=False, codec=lambda dim: IntCodec(dim, 8))
        assert result["status"] == "decode fallback", result
        assert any("no reader of its own" in text for text in result["fallback_warnings"])
        assert result["logits_rel_codes_vs_decode"] <= LOGITS_RTOL


def test_probe_reports_wrong_logits(monkeypatch):
    """Attention on codes with a 5 % wrong scale: the probe sees it in both logit comparisons."""
    import fibquant.kv.attention.entry as attention

    right = attention.attend_codes

    def wrong(query, kv, mask, scaling, *args, **kwargs):
        return right(query, kv, mask, scaling * 1.05, *args, **kwargs)

    monkeypatch.setattr(attention, "attend_codes", wrong)
    result = probe("Llama", generate=False)
    assert result["status"] == "error"
    assert "codes logits differ from decode logits" in result["reason"]
    assert "differs from DynamicCache" in result["reason"]
