"""Per-layer rate allocation for a `CompressedCache`, calibration-free: decided from the tokens being cached.

A `RateAllocator` is the `allocate` callable of the `fibquant.eval.cache_plans.RateAllocation` plan: it gets,
per layer, the exact keys and values after the sinks ([B, H, n, D]: a prefill, or what every layer holds
when the first tokens leave the window) and returns one key codec and one value codec per layer.

Each role has its own byte budget: the average code size over layers is at most that of the role's
base codec (`fibquant:b=1.5` keys: 14 bytes per vector on average), so the cache stores no more than
the uniform cache it replaces (the bytes actually chosen are in `info`, and the cache's `used_nbytes`
counts them layer by layer). The rates come from a ladder of FibQuant rates in half-bit steps
(`LADDER`: 0.5 .. 4 bits; at d = 64 one step is 4 bytes, so the budget is met exactly), at most `span`
steps away from the base rate.

Signals (`signal=`):

    uniform   every layer at the base rate (the "off" switch: the same cache as without allocation)
    mse       greedy marginal allocation on the measured squared error of the layer's own tokens:
              each layer's sample (at most `sample_tokens` tokens, strided; minus its mean when the
              cache centres) is encoded at every candidate rate, and steps go one by one to the layer
              whose total squared error drops most per byte (optimal for convex error curves)
    attn      as mse, each KV head's squared error weighted by what it does in attention, estimated
              from the model's weights (no data): keys by the expected squared norm of the queries
              that read them (E|q|^2 = E|k|^2 * ||W_Q G||^2 / ||W_K G||^2 over the head's query group,
              G the input RMSNorm gain: the same normalised input feeds both projections), so the
              expected squared logit error is weighted; values by ||W_O||^2 over the head's slice (the
              squared error the output projection adds to the residual stream). Needs the model
              (`CacheSpec.build` passes it); falls back to mse weights of 1 where a layer has no
              q/k/o projections it can read.
    attn-keys as attn for the keys; the values stay at their base rate everywhere
    ends      the first and last `ends` layers one step up, as many middle layers one step down
              (a fixed, data-free rule)

Measured on SmolLM2-135M / Emma (docs/quality-improvements.md): no signal beat the uniform rates on
needle retrieval or perplexity; "attn" (which starves the early layers' values) was much worse.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from fibquant.codecs.fibquant import FibQuantCodec

LADDER = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)
SIGNALS = ("uniform", "mse", "attn", "attn-keys", "ends")


@lru_cache(maxsize=None)
def ladder_codec(dim: int, bits: float) -> FibQuantCodec:
    """The FibQuant codec of one rung, one instance per (dim, bits): codebooks and search tables built once."""
    return FibQuantCodec.for_rate(dim, bits)


def rung_of(bits: float) -> int:
    for index, rung in enumerate(LADDER):
        if abs(rung - bits) < 1e-9:
            return index
    raise ValueError(f"allocation: base rate {bits:g} bits is not on the ladder {LADDER}")


@dataclass(frozen=True)
class RateAllocator:
    """allocate(samples) -> (key codecs, value codecs, info) for `RateAllocation(allocate, num_layers)`.

    key_bits / value_bits: the base rates (the budget per role); signal: one of SIGNALS; centre:
    measure errors on the tokens minus their mean (as a centring cache codes them); span: most
    ladder steps from the base rate; ends: layers at each end for signal "ends"."""

    dim: int
    key_bits: float
    value_bits: float
    signal: str = "mse"
    centre: bool = False
    span: int = 2
    sample_tokens: int = 256
    ends: int = 2
    # Signal "attn" (`attention_weights`): per layer and KV head, ||W_Q G||^2 / ||W_K G||^2 (times the
    # sample's E|k|^2 at allocation: the key error weight E|q|^2) and ||W_O||^2 (the value error weight).
    key_weights: Optional[tuple] = None
    value_weights: Optional[tuple] = None

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise ValueError(f"allocation signal must be one of {SIGNALS}, got {self.signal!r}")
        rung_of(self.key_bits), rung_of(self.value_bits)
        if self.span < 0 or self.sample_tokens < 1 or self.ends < 0:
            raise ValueError("span and ends must be >= 0 and sample_tokens >= 1")

    def rungs(self, bits: float) -> list[int]:
        base = rung_of(bits)
        return list(range(max(0, base - self.span), min(len(LADDER) - 1, base + self.span) + 1))

    def __call__(self, samples: list[tuple[torch.Tensor, torch.Tensor]]):
        layers = len(samples)
        key_weights = self.key_weights
        if key_weights is not None and len(key_weights) == layers:
            key_weights = tuple(tuple(float(r * e) for r, e in zip(ratios, k.detach().float().pow(2).sum(-1)
                                                                    .mean(dim=(0, 2)).cpu()))
                                for ratios, (k, _) in zip(key_weights, samples))
        key_rungs = self._allocate([s[0] for s in samples], self.key_bits, key_weights)
        value_rungs = (self._allocate([s[1] for s in samples], self.value_bits, self.value_weights)
                       if self.signal != "attn-keys" else [rung_of(self.value_bits)] * layers)
        keys = [ladder_codec(self.dim, LADDER[r]) for r in key_rungs]
        values = [ladder_codec(self.dim, LADDER[r]) for r in value_rungs]
        info = {"signal": self.signal, "centre": self.centre,
                "key_bits": [LADDER[r] for r in key_rungs], "value_bits": [LADDER[r] for r in value_rungs],
                "key_bytes_mean": sum(c.code_size for c in keys) / layers,
                "value_bytes_mean": sum(c.code_size for c in values) / layers,
                "key_budget": ladder_codec(self.dim, self.key_bits).code_size,
                "value_budget": ladder_codec(self.dim, self.value_bits).code_size}
        return keys, values, info

    # ------------------------------------------------------------------ one role
    def _allocate(self, states: list[torch.Tensor], bits: float, weights: Optional[tuple]) -> list[int]:
        layers, base = len(states), rung_of(bits)
        if self.signal == "uniform" or layers == 0:
            return [base] * layers
        candidates = self.rungs(bits)
        if self.signal == "ends":
            return self._ends(layers, base, candidates)
        if self.signal not in ("attn", "attn-keys") or weights is None or len(weights) != layers:
            weights = [None] * layers
        errors = [self.errors(x, candidates, w) for x, w in zip(states, weights)]
        return greedy([{r: e for r, e in zip(candidates, layer)} for layer in errors],
                      [ladder_codec(self.dim, LADDER[r]).code_size for r in range(len(LADDER))],
                      layers * ladder_codec(self.dim, bits).code_size)

    def _ends(self, layers: int, base: int, candidates: list[int]) -> list[int]:
        out = [base] * layers
        if base + 1 not in candidates or base - 1 not in candidates:
            return out
        count = min(self.ends, layers // 4)
        up = list(range(count)) + list(range(layers - count, layers))
        middle = sorted(set(range(layers)) - set(up), key=lambda i: abs(i - (layers - 1) / 2))[:len(up)]
        for i in up:
            out[i] = base + 1
        for i in middle:
            out[i] = base - 1
        return out

    def sample(self, x: torch.Tensor) -> torch.Tensor:
        """At most `sample_tokens` tokens of x [B, H, n, D] (strided), minus their mean when centring:
        [H, B * m, D]."""
        x = x.detach().to(torch.float32)
        n = x.shape[-2]
        step = max(1, -(-n // self.sample_tokens))
        x = x[..., ::step, :]
        if self.centre:
            x = x - x.mean(dim=-2, keepdim=True)
        return x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1]).contiguous()

    def errors(self, x: torch.Tensor, candidates: list[int], weights=None) -> list[float]:
        """Squared error of the layer's sample at each candidate rung, summed over heads with
        `weights` (one per KV head; 1 when None)."""
        heads = self.sample(x)
        w = torch.ones(heads.shape[0]) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
        if w.numel() != heads.shape[0]:
            raise ValueError(f"{w.numel()} head weights for {heads.shape[0]} KV heads")
        out = []
        for rung in candidates:
            codec = ladder_codec(self.dim, LADDER[rung])
            per_head = ((codec.roundtrip(heads) - heads) ** 2).sum(dim=(1, 2))
            out.append(float((per_head * w).sum()))
        return out


def attention_weights(model):
    """(key ratios, value weights) per layer and KV head for signal "attn", from the weights of a
    Llama-style model (q_proj / k_proj / o_proj and the input RMSNorm gain of each decoder layer);
    None when the model does not have them. Key ratio: ||W_Q G||^2 over the head's query group /
    ||W_K G||^2 (times E|k|^2 it estimates E|q|^2 summed over the group); value weight: ||W_O||_F^2
    over the group's columns."""
    from fibquant.kv.model import check_model_supported

    try:
        info = check_model_supported(model)
        layers = model.model.layers
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
            else model.config
        heads, kv_heads, dim = config.num_attention_heads, info["kv_heads"], info["head_dim"]
    except (AttributeError, ValueError):
        return None
    group = heads // kv_heads
    keys, values = [], []
    with torch.no_grad():
        for layer in layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "o_proj")):
                return None
            norm = getattr(layer, "input_layernorm", None)
            gain = norm.weight.float() if norm is not None and getattr(norm, "weight", None) is not None else 1.0
            wq = (attn.q_proj.weight.float() * gain).reshape(kv_heads, group * dim, -1).pow(2).sum(dim=(1, 2))
            wk = (attn.k_proj.weight.float() * gain).reshape(kv_heads, dim, -1).pow(2).sum(dim=(1, 2))
            wo = attn.o_proj.weight.float().reshape(-1, kv_heads, group * dim).pow(2).sum(dim=(0, 2))
            keys.append(tuple(float(x) for x in wq.cpu() / wk.cpu()))
            values.append(tuple(float(x) for x in wo.cpu()))
    return tuple(keys), tuple(values)


def greedy(errors: list[dict[int, float]], sizes: list[int], budget: int) -> list[int]:
    """Rungs per layer: start at each layer's lowest candidate, then repeatedly take the one-step
    upgrade with the largest error drop per byte that fits in `budget` (total bytes over layers)."""
    rungs = [min(e) for e in errors]
    spent = sum(sizes[r] for r in rungs)
    if spent > budget:
        raise ValueError(f"allocation: the lowest rates already need {spent} bytes, budget {budget}")
    while True:
        best, best_gain = None, 0.0
        for layer, (rung, table) in enumerate(zip(rungs, errors)):
            if rung + 1 not in table:
                continue
            cost = sizes[rung + 1] - sizes[rung]
            if spent + cost > budget:
                continue
            gain = (table[rung] - table[rung + 1]) / cost
            if best is None or gain > best_gain:
                best, best_gain = layer, gain
        if best is None:
            return rungs
        spent += sizes[rungs[best] + 1] - sizes[rungs[best]]
        rungs[best] += 1
