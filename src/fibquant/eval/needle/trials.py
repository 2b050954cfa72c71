"""The needle task's trials: the passkey text, the config, and the haystacks built from real text.

Shared by the passkey experiment (`fibquant.eval.needle`) and RULER's niah (`needle.ruler`).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Optional

import torch

NEEDLE = "The secret passkey is {key}. Remember it: {key} is the secret passkey."
INSTRUCTION = "Read the following text. A secret passkey is hidden in it; remember it.\n\n"
QUESTION = "\n\nWhat is the secret passkey hidden in the text above? Answer with the five-digit number only."
ANSWER_PREFIX = "The secret passkey is"  # starts the assistant turn, so the key comes first
MARKER = "\x00NEEDLE-CONTENT\x00"
TASKS = ("passkey", "ruler-niah_single_1")  # ours; RULER's niah_single_1 built by lm-eval (optional extra)
RATIO_TARGET = 10.0  # the retrieval target: fp-equal answers at >= this key+value compression vs fp16


@dataclass(frozen=True)
class NeedleConfig:
    text: str = "emma"
    lengths: tuple = (1024, 2048)
    depths: tuple = (0.0, 0.25, 0.5, 0.75, 1.0)
    keys_per_cell: int = 2
    seed: int = 0
    sink_tokens: int = 4
    recent_tokens: int = 32
    max_new_tokens: int = 8
    attention: str = "codes"
    task: str = "passkey"  # or "ruler-niah_single_1" (needs lm-eval: pip install 'fibquant[ruler]')

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if not self.lengths or any(not isinstance(n, int) or isinstance(n, bool) or n < 128 for n in self.lengths):
            raise ValueError(f"lengths must be integers >= 128 tokens, got {self.lengths!r}")
        if not self.depths or any(not 0.0 <= float(d) <= 1.0 for d in self.depths):
            raise ValueError(f"depths must lie in [0, 1], got {self.depths!r}")
        for name in ("keys_per_cell", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.sink_tokens < 0 or self.recent_tokens < 0:
            raise ValueError(f"exact window sizes must be >= 0, got {self.sink_tokens} and {self.recent_tokens}")
        if self.sink_tokens + self.recent_tokens >= min(self.lengths) // 2:
            raise ValueError(f"exact window {self.sink_tokens} + {self.recent_tokens} is not small against the "
                             f"shortest haystack ({min(self.lengths)} tokens): little would be compressed")
        if self.attention not in ("codes", "decode"):
            raise ValueError(f"attention must be 'codes' or 'decode', got {self.attention!r}")


@dataclass(frozen=True)
class NeedleTrial:
    """One haystack: prefill ids [L] (template opening + instruction + novel with the needle),
    question ids [Q] (question + assistant opening), the key, and where the needle starts."""

    length: int
    depth: float
    rep: int
    key: str
    prefill_ids: torch.Tensor
    question_ids: torch.Tensor
    needle_start: int


def make_key(seed: int, length: int, depth: float, rep: int) -> str:
    """The 5-digit key of one trial (a fixed function of its coordinates)."""
    return str(random.Random(f"needle-{seed}-{length}-{depth:.6f}-{rep}").randint(10000, 99999))


def template_parts(tokenizer) -> tuple[str, str]:
    """(text before, text after) the user message in the chat template with the generation prompt;
    a tokenizer without a chat template gets ('', '\\n')."""
    if not getattr(tokenizer, "chat_template", None):
        return "", "\n"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False,
                                             add_generation_prompt=True)
    before, found, after = rendered.partition(MARKER)
    if not found:
        raise ValueError("the chat template does not reproduce the user message verbatim")
    return before, after


def boundaries(tokenizer, ids: torch.Tensor) -> list[int]:
    """Positions i (0..len) where a sentence or paragraph ends just before token i."""
    out = [0]
    for i, token in enumerate(ids.tolist(), start=1):
        piece = tokenizer.decode([token])
        if "\n" in piece or piece.rstrip().endswith((".", "!", "?", '."', '!"', '?"')):
            out.append(i)
    if out[-1] != len(ids):
        out.append(len(ids))
    return out


def token_ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]


def max_positions(model) -> Optional[int]:
    """The model's trained context (`max_position_embeddings` of its text config), None if it has none."""
    config = getattr(model, "config", model)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def haystack_tokens(length: int, question_tokens: int, max_new_tokens: int, positions: Optional[int]) -> int:
    """Tokens of the haystack of a `length`-token cell: `length`, shortened when haystack + question +
    answer would pass the model's `positions` (so `--lengths 8192` on an 8192-position model is a full
    context: haystack 8192 - question - answer tokens); ValueError when `length` itself does not fit."""
    if positions is None or length + question_tokens + max_new_tokens <= positions:
        return length
    if length > positions:
        raise ValueError(f"a {length}-token haystack does not fit the model's context of {positions} positions "
                         f"(max_position_embeddings); the longest length is {positions}, whose haystack is then "
                         f"shortened to {positions - question_tokens - max_new_tokens} tokens to leave room for the "
                         f"{question_tokens}-token question and {max_new_tokens} answer tokens")
    return positions - question_tokens - max_new_tokens


def build_trial(tokenizer, config: NeedleConfig, length: int, depth: float, rep: int,
                positions: Optional[int] = None) -> NeedleTrial:
    """The haystack of (length, depth, rep); ValueError when the novel is too short or (`positions`: the
    model's context) when the length does not fit (see `haystack_tokens`; shortened when only the question
    and answer overflow)."""
    from fibquant.eval.kv_report import text_tokens

    before, after = template_parts(tokenizer)
    key = make_key(config.seed, length, depth, rep)
    prefix = token_ids(tokenizer, before + INSTRUCTION)
    needle = token_ids(tokenizer, " " + NEEDLE.format(key=key) + " ")
    question = token_ids(tokenizer, QUESTION + after + ANSWER_PREFIX)
    body_length = haystack_tokens(length, question.shape[0], config.max_new_tokens, positions) \
        - prefix.shape[0] - needle.shape[0]
    if body_length < 16:
        raise ValueError(f"a {length}-token haystack leaves no room for the novel after the template and needle")
    body = text_tokens(tokenizer, config.text, body_length, offset=rep * length)
    cuts = boundaries(tokenizer, body)
    cut = min(cuts, key=lambda c: (abs(c - depth * body_length), c))
    prefill = torch.cat([prefix, body[:cut], needle, body[cut:]])
    return NeedleTrial(length, float(depth), rep, key, prefill, question, prefix.shape[0] + cut)


def extract_answer(text: str) -> Optional[str]:
    """The first run of digits in a generated answer (None when there is none)."""
    match = re.search(r"\d+", text)
    return match.group(0) if match else None
