"""Greedy one-token decode steps of several caches, timed in turn (interleaved). Part of the
decode-speed experiment (`fibquant.eval.decode_speed`, its "decode" part).

Why interleaved: on a shared machine the load drifts over seconds by more than the gap between
two caches' steps at short context. Timing one cache's N steps, then the next cache's, lets that
drift land between the caches; here every round steps each cache once (the order rotated by one
cache per round, so no cache always follows the same one), so all caches see the same machine
state, and a step can be compared with DynamicCache's step of the same round ("paired": the
median over the rounds of the two steps' ratio).

Each step is timed (`Clocks`: wall and CPU time) around the forward with the cache and the argmax
of its logits. Memory is not measured here: a sampler around interleaved steps would see the
other caches' freed heap reused; the experiment measures it afterwards, one cache at a time.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

from fibquant.eval.decode_speed.ttft import Clocks
from fibquant.eval.memory import _synchronize
from fibquant.kv.model import last_logits


@dataclass
class Decoding:
    """One cache decoded greedily: its cache, the next input token [1, 1], what its steps took."""

    cache: object
    token: object
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    first_logits: object = None  # float32 logits of the first step (to compare caches)

    def step(self, model) -> None:
        """One timed greedy step: forward of `token` with the cache, argmax -> the next token."""
        _synchronize(model.device)
        with Clocks() as clock:
            logits = last_logits(model, self.token, self.cache)
            self.token = logits.argmax().view(1, 1)
            _synchronize(model.device)
        self.wall_s.append(clock.seconds)
        self.cpu_s.append(clock.cpu_seconds)
        if self.first_logits is None:
            self.first_logits = logits.detach().float().clone()
        self.tokens.append(int(self.token))


def interleave(decodings: dict[str, Decoding], model, rounds: int,
               on_error: Optional[Callable[[str, Exception], bool]] = None) -> None:
    """`rounds` rounds, each stepping every cache of `decodings` once, the order rotated by one per
    round. A step that raises: `on_error(name, exc)` True drops that cache from later rounds, else
    (or with no on_error) the exception propagates."""
    order = list(decodings)
    for index in range(rounds):
        shift = index % len(order) if order else 0
        for name in order[shift:] + order[:shift]:
            try:
                decodings[name].step(model)
            except Exception as exc:
                if on_error is None or not on_error(name, exc):
                    raise
                order = [n for n in order if n != name]


def paired_ratio(steps: list[float], reference: list[float]) -> Optional[float]:
    """Median over the rounds of steps[i] / reference[i] (the two timed in the same round); None
    when no round has both (a cache dropped before its first step) or a reference step is 0."""
    pairs = [a / b for a, b in zip(steps, reference) if b > 0]
    return statistics.median(pairs) if pairs else None
