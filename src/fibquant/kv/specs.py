"""Cache specs: one string -> one KV cache (`CompressedCache.for_model`, the experiments, the CLI's --caches).

    fp                              the uncompressed DynamicCache (reference)
    fibquant:b=2                    keys and values with the same codec (any `fibquant.codecs.registry` spec
                                    of a calibration-free codec: fibquant, turboquant, int, ...)
    fibquant:b=2/fibquant:b=1       keys / values at different rates (or different codecs)
    quanto-rt:b=2, kakeya-e8:q=2 …  a peer (`fibquant.peers`), keys and values; `KEY/VALUE` works too

Options after '@' (our codecs only, any order): `@decode` runs attention through the reference
path (every code decoded to floats, `attention="decode"`) instead of on the codes; `@centre` quantises keys
and values minus a per-layer, per-head mean (`fibquant.kv.plan.Centred`); `@recall=K` / `@recall=F` keeps
the exact rows of the coded tokens in a cold store and lets each query recall its top K coded tokens (or
the fraction F of them, written with a '.') exactly (`fibquant.kv.cold.Recall`: `@recall=32`,
`@recall=0.02`, `@recall=32:disk:fp16`); the cold rows are not hot bytes (`cold_bytes`). Without options a
spec means what it always did.

The experiments register further options (`register_plan_option`), each building a `LayerPlan`:
`fibquant.eval.cache_plans` adds `@alloc=SIGNAL` (per-layer rates chosen from the cached tokens) and
`@heavy=F[:SCORE[:RATE]]` (heavy tokens at a second rate), e.g.
`fibquant:b=1.5/fibquant:b=1@centre@alloc=mse`. Importing any `fibquant.eval` module registers them; a spec
naming them before that is a ValueError saying so.

A budget (`ratio=6`, `bytes=4000`, optionally `,context=N` and `,keys=finer`; `fibquant.kv.budget`) stands
for the best shipped code whose cache on the model fits it: `parse_cache_spec(text, model)` resolves it.

Our codecs on both sides give a `CompressedCache` (codes stored, attention on the codes); a peer on
either side gives a `RoundTripCache` (`fibquant.kv.roundtrip_cache`) with the same exact window (sinks +
recent tokens), so every cache compresses the same positions and only the quantizer differs.

Bytes are counted per stored vector from each side's format (`bytes_per_vector`): our codecs'
`code_size`, the peers' fixed-rate size (see `peers.PEERS[...].bytes_note`). `context_ratio` is
the whole cache of a `tokens`-long context against fp16, the exact window counted at fp16.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

from fibquant.codecs.registry import CodecSpec, parse_codec_spec, reference_codec_spec
from fibquant.kv.budget import choose, is_budget, parse_budget
from fibquant.kv.plan import PLAIN, Centred, LayerPlan
from fibquant.peers import PeerSpec, build_peer, is_peer, parse_peer, unavailable_reason


@dataclass(frozen=True)
class Side:
    """The quantizer of one role: one of our codec specs or a peer."""

    quantizer: Union[CodecSpec, PeerSpec]

    def __post_init__(self) -> None:
        if isinstance(self.quantizer, CodecSpec) and (self.quantizer.reference or self.quantizer.calibrated):
            raise ValueError(f"{self.quantizer.spec}: a cache side needs a stand-alone codec (a calibration-free "
                             f"registered codec) or a peer; write 'fp' alone for the uncompressed cache")

    @property
    def is_peer(self) -> bool:
        return isinstance(self.quantizer, PeerSpec)

    @property
    def spec(self) -> str:
        return self.quantizer.spec

    def label(self, dim: int) -> str:
        return self.quantizer.label if self.is_peer else self.quantizer.label(dim)

    def build(self, dim: int, role: str, model=None):
        """A fibquant Codec, or a peers.PeerQuantizer."""
        return build_peer(self.quantizer, dim, role, model) if self.is_peer else self.quantizer.build(dim)

    def bytes_per_vector(self, dim: int) -> float:
        if self.is_peer:
            from fibquant.peers import PEERS

            return float(PEERS[self.quantizer.family].bytes_per_vector(self.quantizer.value, dim))
        return float(self.quantizer.build(dim).code_size)

    def bits_per_coordinate(self, dim: int) -> float:
        """Index bits per coordinate for our codecs; every stored bit per coordinate for a peer."""
        if self.is_peer:
            return 8.0 * self.bytes_per_vector(dim) / dim
        return float(self.quantizer.build(dim).bits_per_coordinate)


def _parse_side(text: str) -> Side:
    return Side(parse_peer(text) if is_peer(text) else parse_codec_spec(text))


class PlanOption:
    """A parsed `@name[=value]` option that an experiment module registered (`register_plan_option`).

    text: the option as written ('@alloc=mse'); label: its words in a cache's label (' alloc=mse');
    check(spec): ValueError when it does not fit the rest of the spec; extra_bytes(dim): the (key, value)
    bytes per stored vector it adds on average; build(plan, spec, model, key_dim): the `LayerPlan` with the
    option applied to `plan` (the plan of the options before it: `PLAIN`, or `Centred()` with @centre)."""

    text: str = ""
    label: str = ""

    def check(self, spec: "CacheSpec") -> None:
        pass

    def extra_bytes(self, dim: int) -> tuple[float, float]:
        return 0.0, 0.0

    def build(self, plan: LayerPlan, spec: "CacheSpec", model, key_dim: int) -> LayerPlan:
        raise NotImplementedError


# name -> parse(value after '=', '' for a bare '@name') -> PlanOption; filled by the experiment layer on import.
_PLAN_OPTIONS: dict[str, Callable[[str], PlanOption]] = {}
EXPERIMENT_OPTIONS = "fibquant.eval.cache_plans"  # the module that registers @alloc= and @heavy=
BUILT_IN_OPTIONS = ("centre", "decode", "recall")


def register_plan_option(name: str, parse: Callable[[str], PlanOption]) -> None:
    """Add the cache-spec option `@name[=value]`: `parse(value)` returns its `PlanOption` (ValueError on a bad
    value). Options apply in registration order; a name already taken is a ValueError."""
    if not name.isalpha() or name in BUILT_IN_OPTIONS or name in _PLAN_OPTIONS:
        raise ValueError(f"cache spec option {name!r} is taken or not a word")
    _PLAN_OPTIONS[name] = parse


@dataclass(frozen=True)
class CacheSpec:
    """fp (key = value = None) or a key side and a value side, with the options centre, decode, recall and
    the registered ones (`plans`: `PlanOption`s in registration order)."""

    key: Optional[Side] = None
    value: Optional[Side] = None
    centre: bool = False
    decode: bool = False
    recall: Optional[object] = None  # a fibquant.kv.cold.Recall
    plans: tuple = ()

    def __post_init__(self) -> None:
        if (self.key is None) != (self.value is None):
            raise ValueError("a cache spec has both a key and a value side, or neither (fp)")
        if (self.centre or self.decode or self.recall is not None or self.plans) and (self.is_fp or self.uses_peer):
            raise ValueError("cache spec options (@centre, @decode, @recall, @alloc, @heavy, ...) apply to our codecs "
                             "on both sides (a CompressedCache), not to fp or a peer")
        if self.recall is not None:
            from fibquant.kv.cold import Recall

            if not isinstance(self.recall, Recall):
                raise ValueError(f"recall must be a fibquant.kv.cold.Recall, got {type(self.recall).__name__}")
            if self.decode:
                raise ValueError("@recall works on the codes: it does not combine with @decode")
        for option in self.plans:
            if not isinstance(option, PlanOption):
                raise ValueError(f"plans holds registered cache spec options (PlanOption), got {type(option).__name__}")
            option.check(self)

    @property
    def options(self) -> str:
        return (("@centre" if self.centre else "") + "".join(option.text for option in self.plans)
                + ("@decode" if self.decode else "") + (f"@recall={self.recall.text}" if self.recall else ""))

    @property
    def is_fp(self) -> bool:
        return self.key is None

    @property
    def symmetric(self) -> bool:
        return self.is_fp or self.key.spec == self.value.spec

    @property
    def spec(self) -> str:
        if self.is_fp:
            return reference_codec_spec().spec
        return (self.key.spec if self.symmetric else f"{self.key.spec}/{self.value.spec}") + self.options

    @property
    def family(self) -> str:
        """fp, a codec family, a peer family, or 'kv' for different key and value quantizers."""
        if self.is_fp:
            return reference_codec_spec().family
        if not self.symmetric:
            return "kv"
        return self.key.quantizer.family

    @property
    def uses_peer(self) -> bool:
        return not self.is_fp and (self.key.is_peer or self.value.is_peer)

    def label(self, dim: int = 64) -> str:
        if self.is_fp:
            return reference_codec_spec().label(dim)
        text = self.key.label(dim) if self.symmetric else f"K {self.key.label(dim)} / V {self.value.label(dim)}"
        return (text + (" centred" if self.centre else "") + "".join(option.label for option in self.plans)
                + (" (decode)" if self.decode else "") + (f" recall={self.recall.text}" if self.recall else ""))

    def unavailable_reason(self) -> Optional[str]:
        for side in (self.key, self.value):
            if side is not None and side.is_peer:
                reason = unavailable_reason(side.quantizer)
                if reason is not None:
                    return reason
        return None

    # ------------------------------------------------------------------ bytes
    # Each role's bytes per vector: its side's, plus what the registered options add on average
    # (`PlanOption.extra_bytes`; per-layer rates keep each role's average at its base codec's).
    def key_bytes(self, dim: int) -> float:
        if self.is_fp:
            return 2.0 * dim
        return self.key.bytes_per_vector(dim) + sum(option.extra_bytes(dim)[0] for option in self.plans)

    def value_bytes(self, dim: int) -> float:
        if self.is_fp:
            return 2.0 * dim
        return self.value.bytes_per_vector(dim) + sum(option.extra_bytes(dim)[1] for option in self.plans)

    def cold_bytes(self, dim: int, model_bytes: int = 2) -> float:
        """Bytes per token and KV head of the cold tier (@recall): an exact key and value per coded
        token, at the Recall's dtype or the model's (`model_bytes` per coordinate); 0 without recall."""
        if self.recall is None:
            return 0.0
        size = model_bytes if self.recall.dtype is None else self.recall.dtype.itemsize
        return 2.0 * dim * size

    def bits_per_coordinate(self, dim: int) -> float:
        """Mean of the key and value sides' bits per coordinate (16 for fp)."""
        if self.is_fp:
            return 16.0
        extra = 8.0 * sum(sum(option.extra_bytes(dim)) for option in self.plans) / dim
        return 0.5 * (self.key.bits_per_coordinate(dim) + self.value.bits_per_coordinate(dim) + extra)

    def codes_ratio(self, dim: int) -> float:
        """fp16 key + value (4 * dim bytes) over the stored key + value vector bytes."""
        return 4.0 * dim / (self.key_bytes(dim) + self.value_bytes(dim))

    def context_ratio(self, dim: int, tokens: int, sink_tokens: int, recent_tokens: int) -> float:
        """fp16 bytes of a `tokens`-long context over this cache's, exact window counted at fp16."""
        if self.is_fp:
            return 1.0
        exact = min(tokens, sink_tokens + recent_tokens)
        stored = exact * 4.0 * dim + (tokens - exact) * (self.key_bytes(dim) + self.value_bytes(dim))
        return tokens * 4.0 * dim / stored

    # ------------------------------------------------------------------ caches
    def quantizers(self, model) -> tuple:
        """(key, value) for `model`: our `Codec`s or peers' `PeerQuantizer`s; (None, None) for fp.

        Each role's size is read from the model (`check_model_supported`: head_dim, or an MLA model's
        cached latent and rotary key). Build them once and pass them to `fibquant.kv.build.build_cache`
        to give many caches the same codecs (codebooks read and search tables built once)."""
        if self.is_fp:
            return None, None
        from fibquant.kv.model import check_model_supported

        info = check_model_supported(model)
        return self.key.build(info["key_dim"], "key", model), self.value.build(info["value_dim"], "value", model)

    def layer_plan(self, model, key_dim: int) -> LayerPlan:
        """The `LayerPlan` of this spec's options: `Centred()` with @centre, then each registered option's."""
        plan = Centred() if self.centre else PLAIN
        for option in self.plans:
            plan = option.build(plan, self, model, key_dim)
        return plan

    def cache_options(self, model, key_dim: int) -> dict:
        """The `CompressedCache` keyword arguments this spec sets (our codecs on both sides): layer_plan and
        recall where it has them, attention "decode" with @decode."""
        if self.is_fp or self.uses_peer:
            raise ValueError(f"{self.spec}: a CompressedCache needs our codecs on both sides (fp is a "
                             "DynamicCache, a peer a RoundTripCache: fibquant.kv.build.build_cache makes those)")
        options = {}
        plan = self.layer_plan(model, key_dim)
        if plan is not PLAIN:
            options["layer_plan"] = plan
        if self.decode:
            options["attention"] = "decode"
        if self.recall is not None:
            options["recall"] = self.recall
        return options


def _parse_options(items: list[str], text: str) -> dict:
    options: dict = {}
    plans: dict = {}
    for item in items:
        name, eq, value = item.strip().partition("=")
        value = value.strip()
        if name in options or name in plans:
            raise ValueError(f"cache spec option @{name} given twice in {text!r} (each at most once)")
        if name in ("centre", "decode") and not eq:
            options[name] = True
        elif name == "recall" and eq and value:
            from fibquant.kv.cold import Recall

            options["recall"] = Recall.parse(value)
        elif name in _PLAN_OPTIONS:
            plans[name] = _PLAN_OPTIONS[name](value)
        else:
            registered = "".join(f", @{n}" for n in _PLAN_OPTIONS)
            raise ValueError(f"bad cache spec option {item!r} in {text!r}; expected @centre, @decode, "
                             f"@recall=K|F[:disk][:fp16]{registered}. The experiments' options (@alloc=SIGNAL, "
                             f"@heavy=F[:SCORE[:RATE]]) exist once {EXPERIMENT_OPTIONS} is imported "
                             f"(`import {EXPERIMENT_OPTIONS}`; any fibquant.eval module does it)")
    options["plans"] = tuple(plans[name] for name in _PLAN_OPTIONS if name in plans)
    return options


def parse_cache_spec(text: str, model=None) -> CacheSpec:
    """'fp', 'fibquant:b=2', 'fibquant:b=2/fibquant:b=1', 'quanto-rt:b=2', '...@centre', '...@decode'
    (see the module docstring), or a budget ('ratio=6', 'bytes=4000,context=8192', `fibquant.kv.budget`),
    which needs `model`: the best shipped code whose cache on it fits."""
    text = text.strip()
    if not text:
        raise ValueError("empty cache spec")
    base, *option_items = text.split("@")
    if is_budget(base):
        if model is None:
            raise ValueError(f"cache spec {text!r} is a budget: it needs the model to choose a code for "
                             "(parse_cache_spec(text, model))")
        base = choose(model, parse_budget(base))
        text = "@".join([base, *option_items])
    if option_items:
        parsed = parse_cache_spec(base)
        return CacheSpec(parsed.key, parsed.value, **_parse_options(option_items, text))
    parts = text.split("/")
    if len(parts) == 1 and not is_peer(text) and parse_codec_spec(text).reference:
        return CacheSpec()
    if len(parts) > 2:
        raise ValueError(f"cache spec {text!r} has more than one '/': write KEY/VALUE")
    key = _parse_side(parts[0])
    value = _parse_side(parts[1]) if len(parts) == 2 else key
    return CacheSpec(key, value)


def parse_cache_specs(texts, model=None) -> list[CacheSpec]:
    """A ';'-separated string or a list of spec strings (budgets resolved for `model`)."""
    if isinstance(texts, str):
        texts = [t for t in texts.split(";") if t.strip()]
    return [parse_cache_spec(t, model) for t in texts]


def from_codec_spec(method: CodecSpec) -> CacheSpec:
    """The symmetric cache spec of a `fibquant.codecs.registry.CodecSpec` (the reference, fp, stays fp)."""
    return CacheSpec() if method.reference else CacheSpec(Side(method), Side(method))


def split_available(specs: list[CacheSpec], dim: int, build_codebooks: bool) -> tuple[list[CacheSpec], list[str]]:
    """Specs that can run now and notes on the rest (a peer package absent, a codebook not shipped)."""
    from fibquant.codecs.registry import split_ready

    ready, skipped = [], []
    for spec in specs:
        reason = spec.unavailable_reason()
        if reason is not None:
            skipped.append(f"{spec.spec} ({reason})")
            continue
        methods = [] if spec.is_fp else [s.quantizer for s in (spec.key, spec.value) if not s.is_peer]
        _, notes = split_ready(methods, dim, build_codebooks)
        if notes:
            skipped.extend(notes)
            continue
        ready.append(spec)
    return ready, skipped
