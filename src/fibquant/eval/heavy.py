"""A second, higher-rate tier for a few coded tokens of a `CompressedCache` ("heavy tokens").

Calibration-free mixed precision over tokens: of the tokens a layer encodes, a fixed fraction per
KV head (the highest by a score computed from the tokens themselves: `SCORES`) is also stored by a
second, higher-rate codec. Storage of one tiered layer, per [batch, KV head]:

    base stream    every coded token's code rows, as in any `CompressedLayer`
                   uint8 [B, H, m, key code_size] and [B, H, m, value code_size]
    heavy stream   the heavy tokens' rows at the higher rate, in token order
                   uint8 [B, H, h, heavy key code_size] and [B, H, h, heavy value code_size]
    heavy index    int32 [B, H, h]: the coded-row position of each heavy row (sorted per head)

Both streams are fixed-size rows, so random access stays O(1) for the base row and O(log h) for
"is token i heavy, and where" (a binary search of the sorted index). Every byte is counted
(`used_nbytes`): the base rows of heavy tokens are kept (that keeps the base stream's random
access), the heavy rows and the 4-byte index entries come on top. Per stored vector the tier adds
`fraction * (heavy code_size + INDEX_BYTES / 2)` bytes to each role on average (the index is shared
by a token's key and value: half of it is counted on each side): `HeavySpec.extra_bytes`.

Selection is online and causal: when tokens leave the exact window (an encode batch, or a whole
prefill in `CompressedCache.from_cache`), the layer keeps the heavy count at floor(fraction *
coded tokens) per head, choosing the new heavy tokens among the tokens being encoded now (top-k
of the score per head: every head holds the same number of heavy rows). A one-pass prefill
therefore picks the global top fraction; a chunked prefill picks within each encode batch.

A `CompressedCache` gets tiered layers from the `fibquant.eval.cache_plans.HeavyTokens` plan (spec option
`@heavy=`). A read decodes the base rows and overwrites the heavy tokens' rows with their heavy decoding
(`patched_decode`); attention then runs on those floats (the "decode" path: attention on the codes
does not serve a second stream, so a tiered layer's `update` always returns floats, which the
model's attention function, fibquant's or SDPA, serves as plain tensors).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fibquant.codecs.base import Codec
from fibquant.kv.buffer import CodeBuffer, _owned
from fibquant.kv.layer import CompressedLayer

INDEX_BYTES = 4  # one int32 coded-row position per heavy token and KV head, shared by key and value


# ---------------------------------------------------------------------- scores (registered by name)
def _key_norm(keys, values, key_codec, value_codec, key_codes, value_codes) -> torch.Tensor:
    return keys.to(torch.float32).norm(dim=-1)


def _value_norm(keys, values, key_codec, value_codec, key_codes, value_codes) -> torch.Tensor:
    return values.to(torch.float32).norm(dim=-1)


def _key_error(keys, values, key_codec, value_codec, key_codes, value_codes) -> torch.Tensor:
    return (keys.to(torch.float32) - key_codec.decode(key_codes)).norm(dim=-1)


def _kv_error(keys, values, key_codec, value_codec, key_codes, value_codes) -> torch.Tensor:
    """Squared error of key and value at the base rate, each relative to its role's mean squared norm."""
    k_err = (keys.to(torch.float32) - key_codec.decode(key_codes)).pow(2).sum(-1)
    v_err = (values.to(torch.float32) - value_codec.decode(value_codes)).pow(2).sum(-1)
    k_scale = keys.to(torch.float32).pow(2).sum(-1).mean(-1, keepdim=True).clamp_min(1e-12)
    v_scale = values.to(torch.float32).pow(2).sum(-1).mean(-1, keepdim=True).clamp_min(1e-12)
    return k_err / k_scale + v_err / v_scale


# score(keys [B,H,n,D], values [B,H,n,Dv], key codec, value codec, key codes, value codes) -> [B,H,n]
SCORES: dict[str, Callable] = {}


def register_score(name: str, score: Callable) -> None:
    """Add a heavy-token score (see `SCORES`); a name already taken is a ValueError."""
    if not name or not name.replace("-", "").isalnum():
        raise ValueError(f"a score name is letters, digits and '-', got {name!r}")
    if name in SCORES:
        raise ValueError(f"heavy-token score {name!r} is already registered")
    SCORES[name] = score


register_score("knorm", _key_norm)    # largest keys: the largest absolute logit errors q . (k - k_hat)
register_score("vnorm", _value_norm)  # largest values
register_score("kerr", _key_error)    # keys the base code serves worst (absolute error)
register_score("kverr", _kv_error)    # keys and values the base codes serve worst (relative to the role)


# ---------------------------------------------------------------------- the spec
def _rate_codec(text: str, dim: int) -> Codec:
    """'fp' -> fp16 bytes (IdentityCodec); a number -> FibQuant at that many bits per coordinate (the
    spec `fibquant:b=RATE` with its defaults: norm correction on at 4 bits since that became the default)."""
    if text == "fp":
        from fibquant.codecs.identity import IdentityCodec

        return IdentityCodec(dim)
    from fibquant.codecs.registry import parse_codec_spec

    return parse_codec_spec(f"fibquant:b={text}").build(dim)


@dataclass(frozen=True)
class HeavySpec:
    """fraction of coded tokens (per layer and KV head) also stored at `key_rate` / `value_rate`
    ('fp' = fp16, or FibQuant bits per coordinate, e.g. '4'), chosen by `score` (one of SCORES)."""

    fraction: float
    score: str = "knorm"
    key_rate: str = "4"
    value_rate: str = "4"

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) \
                or not 0.0 < float(self.fraction) < 1.0:
            raise ValueError(f"heavy fraction must be a number in (0, 1), got {self.fraction!r}")
        if self.score not in SCORES:
            raise ValueError(f"heavy-token score must be one of {sorted(SCORES)}, got {self.score!r}")
        for role, rate in (("key", self.key_rate), ("value", self.value_rate)):
            if rate != "fp":
                try:
                    bits = float(rate)
                except ValueError:
                    raise ValueError(f"heavy {role} rate must be 'fp' or FibQuant bits (e.g. 4), got {rate!r}") \
                        from None
                if not 0.0 < bits <= 8.0:
                    raise ValueError(f"heavy {role} rate must be in (0, 8] bits, got {rate!r}")

    @classmethod
    def parse(cls, text: str) -> "HeavySpec":
        """'F[:SCORE[:RATE]]', RATE = 'BITS', 'fp' or 'KEY/VALUE' (e.g. '0.02:knorm:4', '0.01:kerr:fp/4')."""
        parts = text.split(":")
        if not 1 <= len(parts) <= 3 or not parts[0]:
            raise ValueError(f"@heavy={text!r}: expected FRACTION[:SCORE[:RATE]], e.g. 0.02:knorm:4")
        try:
            fraction = float(parts[0])
        except ValueError:
            raise ValueError(f"@heavy={text!r}: the fraction {parts[0]!r} is not a number") from None
        score = parts[1] if len(parts) > 1 and parts[1] else "knorm"
        rate = parts[2] if len(parts) > 2 and parts[2] else "4"
        rates = rate.split("/")
        if len(rates) > 2 or not all(rates):
            raise ValueError(f"@heavy={text!r}: the rate is BITS, fp or KEY/VALUE")
        return cls(fraction, score, rates[0], rates[-1])

    @property
    def text(self) -> str:
        rate = self.key_rate if self.key_rate == self.value_rate else f"{self.key_rate}/{self.value_rate}"
        return f"{self.fraction:g}:{self.score}:{rate}"

    def codecs(self, dim: int) -> tuple[Codec, Codec]:
        return _rate_codec(self.key_rate, dim), _rate_codec(self.value_rate, dim)

    def extra_bytes(self, dim: int) -> tuple[float, float]:
        """Average bytes per stored (key, value) vector that the tier adds: fraction x (heavy code
        size + half the index). An upper bound: the stored count is floor(fraction x coded)."""
        key, value = self.codecs(dim)
        half_index = INDEX_BYTES / 2
        return self.fraction * (key.code_size + half_index), self.fraction * (value.code_size + half_index)

    def build(self, dim: int) -> "HeavyTier":
        return HeavyTier(float(self.fraction), self.score, *self.codecs(dim))


@dataclass(frozen=True)
class HeavyTier:
    """What a `TieredLayer` needs: the fraction, the score's name and the two heavy codecs."""

    fraction: float
    score: str
    key_codec: Codec
    value_codec: Codec

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"heavy fraction must lie in (0, 1), got {self.fraction!r}")
        if self.score not in SCORES:
            raise ValueError(f"heavy-token score must be one of {sorted(SCORES)}, got {self.score!r}")
        for role, codec in (("key", self.key_codec), ("value", self.value_codec)):
            if not isinstance(codec, Codec):
                raise ValueError(f"heavy {role} codec must be a fibquant Codec, got {type(codec).__name__}")


# ---------------------------------------------------------------------- decoding
def patched_decode(codec: Codec, codes: torch.Tensor, heavy_codec: Codec, heavy_codes: torch.Tensor,
                   index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Decoded rows [B, H, m, D]: the base codes [B, H, m, cs], rows `index` [B, H, h] (int) replaced by
    the heavy codes [B, H, h, heavy cs] decoded (the reference read of a tiered layer)."""
    out = codec.decode(codes, dtype=torch.float32)
    if index.shape[-1]:
        heavy = heavy_codec.decode(heavy_codes, dtype=torch.float32)
        out.scatter_(-2, index.long().unsqueeze(-1).expand(*index.shape, out.shape[-1]), heavy)
    return out.to(dtype)


class TieredLayer(CompressedLayer):
    """A full-attention `CompressedLayer` with a heavy tier (`HeavyTier`); see the module docstring."""

    def __init__(self, key_codec: Codec, value_codec: Codec, sink_tokens: int, recent_tokens: int,
                 tier: HeavyTier, attention: str = "decode", encode_batch: int = 1):
        if not isinstance(tier, HeavyTier):
            raise ValueError(f"tier must be a HeavyTier, got {type(tier).__name__}")
        for role, base, heavy in (("key", key_codec, tier.key_codec), ("value", value_codec, tier.value_codec)):
            if base.dim != heavy.dim:
                raise ValueError(f"heavy {role} codec dim {heavy.dim} differs from the base codec's {base.dim}")
        super().__init__(key_codec, value_codec, sink_tokens, recent_tokens, attention, encode_batch, centre=False)
        self.tier = tier
        self.heavy_key_buffer: Optional[CodeBuffer] = None
        self.heavy_value_buffer: Optional[CodeBuffer] = None
        self.heavy_index: Optional[torch.Tensor] = None  # int32 [B, H, h], sorted per head

    def __repr__(self) -> str:
        return (f"TieredLayer(tokens={self.get_seq_length()}, sinks={self.num_sink}, coded={self.num_coded}, "
                f"heavy={self.num_heavy}, recent={self.num_recent})")

    @property
    def num_heavy(self) -> int:
        return 0 if self.heavy_index is None else self.heavy_index.shape[-1]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: Optional[torch.Tensor] = None):
        super().lazy_initialization(key_states, value_states)
        batch, heads = key_states.shape[:2]
        self.heavy_key_buffer = CodeBuffer(batch, heads, self.tier.key_codec.code_size, self.device)
        self.heavy_value_buffer = CodeBuffer(batch, heads, self.tier.value_codec.code_size, self.device)
        self.heavy_index = torch.empty(batch, heads, 0, dtype=torch.int32, device=self.device)

    # ----------------------------------------------------------------- storing
    def _store_codes(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        start, n = self.num_coded, keys.shape[-2]
        key_codes, value_codes = self.key_codec.encode(keys), self.value_codec.encode(values)
        self.key_buffer.append(key_codes)
        self.value_buffer.append(value_codes)
        take = min(n, math.floor(self.tier.fraction * (start + n) + 1e-9) - self.num_heavy)
        if take <= 0:
            return
        score = SCORES[self.tier.score](keys, values, self.key_codec, self.value_codec, key_codes, value_codes)
        chosen = score.topk(take, dim=-1).indices.sort(dim=-1).values  # [B, H, take], token order
        rows = chosen.unsqueeze(-1)
        heavy_keys = keys.gather(-2, rows.expand(*chosen.shape, keys.shape[-1]))
        heavy_values = values.gather(-2, rows.expand(*chosen.shape, values.shape[-1]))
        self.heavy_key_buffer.append(self.tier.key_codec.encode(heavy_keys.to(torch.float32)))
        self.heavy_value_buffer.append(self.tier.value_codec.encode(heavy_values.to(torch.float32)))
        self.heavy_index = torch.cat([self.heavy_index, (chosen + start).to(torch.int32)], dim=-1)

    # ----------------------------------------------------------------- reading
    def _coded_keys(self, dtype) -> torch.Tensor:
        return patched_decode(self.key_codec, self.key_codes, self.tier.key_codec, self.heavy_key_buffer.view(),
                              self.heavy_index, dtype)

    def _coded_values(self, dtype) -> torch.Tensor:
        return patched_decode(self.value_codec, self.value_codes, self.tier.value_codec,
                              self.heavy_value_buffer.view(), self.heavy_index, dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Float keys and values [B, H, seq_before + T, D] (the coded part patched by the heavy tier),
        whatever the cache's attention mode; then the new tokens are stored."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_states(key_states, value_states)
        keys = torch.cat([self.sink_keys.to(key_states.dtype), self._coded_keys(key_states.dtype),
                          self.recent_keys.to(key_states.dtype), key_states], dim=-2)
        values = torch.cat([self.sink_values.to(value_states.dtype), self._coded_values(value_states.dtype),
                            self.recent_values.to(value_states.dtype), value_states], dim=-2)
        self._absorb(key_states, value_states)
        return keys, values

    @property
    def keys(self) -> Optional[torch.Tensor]:
        if not self.is_initialized:
            return None
        return torch.cat([self.sink_keys, self._coded_keys(self.sink_keys.dtype), self.recent_keys], dim=-2)

    @property
    def values(self) -> Optional[torch.Tensor]:
        if not self.is_initialized:
            return None
        return torch.cat([self.sink_values, self._coded_values(self.sink_values.dtype), self.recent_values], dim=-2)

    def snapshot(self, key_states, value_states):
        raise ValueError("a tiered layer (heavy tier) has no CodedKV view: attention on codes does not serve its "
                         "second stream; its update returns floats")

    # ----------------------------------------------------------------- bytes
    def tensors(self) -> list[torch.Tensor]:
        if not self.is_initialized:
            return []
        return super().tensors() + [self.heavy_key_buffer.data, self.heavy_value_buffer.data, self.heavy_index]

    def used_nbytes(self) -> int:
        """Exact window + base rows + heavy rows + the heavy index (4 bytes per heavy token and head)."""
        if not self.is_initialized:
            return 0
        return (super().used_nbytes() + self.heavy_key_buffer.used_nbytes() + self.heavy_value_buffer.used_nbytes()
                + self.heavy_index.numel() * self.heavy_index.element_size())

    # ----------------------------------------------------------------- editing
    def set_codecs(self, key_codec: Codec, value_codec: Codec) -> None:
        for role, codec, heavy in (("key", key_codec, self.tier.key_codec),
                                   ("value", value_codec, self.tier.value_codec)):
            if isinstance(codec, Codec) and codec.dim != heavy.dim:
                raise ValueError(f"set_codecs: the {role} codec's dim differs from the heavy codec's")
        super().set_codecs(key_codec, value_codec)

    def _apply(self, fn) -> None:
        super()._apply(fn)
        if self.is_initialized:
            self.heavy_key_buffer.remap(fn)
            self.heavy_value_buffer.remap(fn)
            self.heavy_index = _owned(fn(self.heavy_index.unsqueeze(-1)).squeeze(-1))

    def crop(self, max_length: int) -> None:
        """As `CompressedLayer.crop`, except that a cut inside the coded part is a ValueError (the heads'
        heavy rows would no longer line up)."""
        if max_length < 0:
            max_length = self.get_seq_length() - abs(max_length)
        if self.num_heavy and max(max_length, 0) < self.num_sink + self.num_coded:
            raise ValueError("a tiered layer cannot crop into its coded part (heavy rows would be orphaned)")
        super().crop(max_length)
