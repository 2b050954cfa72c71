"""RULER's `niah_single_1` through the needle protocol (`fibquant eval needle --task ruler-niah_single_1`).

lm-eval (optional extra `fibquant[ruler]`) builds the samples with RULER's own generator and
scores them with its `string_match_all`; `fibquant.eval.needle` runs them like its passkey trials (one
float prefill shared by every cache, question and answer through the cache). lm-eval's task
function itself does not run offline here (see docs/peers-and-long-context.md), so its sample
generator is called directly.
"""
from __future__ import annotations

import random
from typing import Optional

from fibquant.eval.needle.trials import NeedleConfig, NeedleTrial, template_parts, token_ids

RULER_MIN_NEW_TOKENS = 12  # RULER's values are 7-digit numbers: SmolLM2 spends a token per digit


def ruler_trials(tokenizer, config: NeedleConfig, length: int, positions: Optional[int] = None) -> list[NeedleTrial]:
    """`config.keys_per_cell` samples of RULER's `niah_single_1` (lm-eval's own generator: the "repeat"
    noise haystack, a word key and a 7-digit value, its template and answer prefix; the global `random`
    seeded with 42 + config.seed for the call, so the same config gives the same samples),
    sized so that the chat template + RULER's input + its answer prefix + the answer fit `length` tokens.
    The prefill is the template opening and RULER's input up to its question; the question, the template's
    assistant opening and RULER's `gen_prefix` go through the cache. Depth: where the value sits in the input.
    ValueError (with the install command) when lm-eval is absent."""
    try:
        from lm_eval.tasks.ruler.niah_utils import TEMPLATE
        from lm_eval.tasks.ruler.prepare_niah import generate_samples, get_haystack
    except ImportError as exc:
        raise ValueError(f"task {config.task!r} needs lm-eval's RULER tasks: pip install 'fibquant[ruler]' "
                         f"({type(exc).__name__}: {exc})") from exc
    before, after = template_parts(tokenizer)
    new_tokens = max(config.max_new_tokens, RULER_MIN_NEW_TOKENS)
    if positions is not None and length > positions:
        raise ValueError(f"a {length}-token context does not fit the model's context of {positions} positions")
    overhead = len(token_ids(tokenizer, before)) + len(token_ids(tokenizer, after + "The special magic number for "
                                                         "some-key mentioned in the provided text is")) + new_tokens
    state = random.getstate()  # lm-eval draws keys, values and depths from the global `random`, as RULER
    random.seed(42 + config.seed)  # does after seeding it (42 by default): seed it, then restore the caller's
    try:
        samples = generate_samples(get_haystack(type_haystack="repeat"), TOKENIZER=tokenizer, max_seq_length=length,
                                   template=TEMPLATE, type_haystack="repeat", type_needle_k="words",
                                   type_needle_v="numbers", num_samples=config.keys_per_cell,
                                   tokens_to_generate=overhead, random_seed=42 + config.seed)
    finally:
        random.setstate(state)
    trials = []
    for rep, sample in enumerate(samples):
        text, key = sample["input"], sample["outputs"][0]
        cut = text.rindex("\nWhat ")
        at = text.index(key)
        trials.append(NeedleTrial(length, round(at / cut, 3), rep, key, token_ids(tokenizer, before + text[:cut]),
                                  token_ids(tokenizer, text[cut:] + after + sample["gen_prefix"]),
                                  len(token_ids(tokenizer, before + text[:at]))))
    return trials


def ruler_correct(text: str, key: str) -> bool:
    """RULER's own scoring (lm-eval `string_match_all`): the value appears in the answer."""
    from lm_eval.tasks.ruler.common_utils import string_match_all

    return string_match_all([text.strip()], [[key]]) == 1.0
