"""Budget first: pick the cache budget, get the best shipped code that fits it (`choose_code`).

A budget is a compression ratio against a 16-bit cache (`ratio=6`: at most 1/6 of the bytes per token of
an fp16/bf16 `DynamicCache`) or bytes per token (`bytes=4000`: every layer, keys and values), each at a
stated context length (default 4096 tokens), because the exact window (sinks, recent tokens and up to
`encode_batch - 1` tokens waiting for their batched encode) weighs more at short contexts; the window
is counted at the model's own element size, sliding layers at their window. The same budget is a cache
spec form: `ratio=R[,context=N][,keys=finer]` or `bytes=B[,context=N][,keys=finer]`, accepted
wherever a cache spec is (`parse_cache_spec(text, model)`, `CompressedCache.for_model`, the CLI's
`--caches`, the vLLM switch `FIBQUANT_VLLM_CACHE`).

"Best" is read from the measured code table shipped with the package (`code_table.json`, written by
`benchmarks/code_table.py`, `fibquant.eval.code_table`): per code (each role, or keys one rung finer than
values), its attention error on the default model's real keys and values. Among the rows whose codes are
shipped at the model's key and value sizes and whose cache fits the budget, the lowest attention error
wins (ties: fewer bytes). `keys_finer=True` chooses among the rows with keys one rung finer than values,
else among the rows with one code on both roles. The ranking is measured at head size 64 (SmolLM2); on
other head sizes the bytes are the model's own and the ranking is the table's.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

TABLE_PATH = Path(__file__).with_name("code_table.json")
DEFAULT_CONTEXT = 4096
REFERENCE_ELEMENT_BYTES = 2  # the ratio is against a 16-bit cache
BUDGET_FORMS = ("ratio", "bytes")


@dataclass(frozen=True)
class Budget:
    """A cache budget: `ratio` against a 16-bit cache or `bytes_per_token`, at `context` tokens."""

    ratio: Optional[float] = None
    bytes_per_token: Optional[float] = None
    context: int = DEFAULT_CONTEXT
    keys_finer: bool = False

    def __post_init__(self) -> None:
        if (self.ratio is None) == (self.bytes_per_token is None):
            raise ValueError("a budget is a ratio or bytes per token (one of them)")
        for name in ("ratio", "bytes_per_token"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.ratio is not None and self.ratio <= 1:
            raise ValueError(f"ratio must be > 1 (a cache smaller than 16-bit), got {self.ratio!r}")
        if isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 1:
            raise ValueError(f"context must be a positive integer (tokens), got {self.context!r}")
        if not isinstance(self.keys_finer, bool):
            raise ValueError(f"keys_finer must be True or False, got {self.keys_finer!r}")

    @property
    def spec(self) -> str:
        head = f"ratio={self.ratio:g}" if self.ratio is not None else f"bytes={self.bytes_per_token:g}"
        return head + f",context={self.context}" + (",keys=finer" if self.keys_finer else "")


def is_budget(text: str) -> bool:
    """Whether a cache spec text is a budget form (`ratio=...` or `bytes=...`)."""
    return text.strip().partition("=")[0].strip() in BUDGET_FORMS


def parse_budget(text: str) -> Budget:
    """`ratio=R[,context=N][,keys=finer]` or `bytes=B[,context=N][,keys=finer]` -> Budget."""
    fields: dict = {}
    for item in text.strip().split(","):
        name, eq, value = (part.strip() for part in item.partition("="))
        if not eq or name in fields or name not in ("ratio", "bytes", "context", "keys"):
            raise ValueError(f"budget spec {text!r}: expected ratio=R or bytes=B, then optionally context=N and "
                             f"keys=finer, each once (got {item.strip()!r})")
        fields[name] = value
    if fields.get("keys", "finer") != "finer":
        raise ValueError(f"budget spec {text!r}: keys=finer is the only keys option")
    try:
        number = {name: float(fields[name]) for name in ("ratio", "bytes") if name in fields}
        context = int(fields.get("context", DEFAULT_CONTEXT))
    except ValueError:
        raise ValueError(f"budget spec {text!r}: ratio, bytes and context take numbers") from None
    return Budget(number.get("ratio"), number.get("bytes"), context, "keys" in fields)


@functools.lru_cache(maxsize=1)
def code_table() -> dict:
    """The shipped measured table (`code_table.json`): {"rows": [{"cache", "key_bytes", "value_bytes",
    "attention_error"}, ...], provenance...}."""
    return json.loads(TABLE_PATH.read_text())


@functools.lru_cache(maxsize=None)
def _code_size(spec: str, dim: int) -> Optional[int]:
    """Bytes of one vector of `spec` at `dim`, None when the code is not shipped (or cannot be) at that size."""
    from fibquant.codecs.registry import parse_codec_spec

    method = parse_codec_spec(spec)
    try:
        if method.unavailable_reason(dim) is not None:
            return None
        return int(method.build(dim).code_size)
    except ValueError:  # e.g. a block size that does not divide dim
        return None


def _sides(cache: str) -> tuple[str, str]:
    key, _, value = cache.partition("/")
    return key, value or key


def model_layout(model) -> dict:
    """What the budget counts of `model` (or its config): per layer (held-token cap or None for full
    attention), cached heads, key / value sizes and the element bytes of the exact window."""
    import torch

    from fibquant.kv.model import check_model_supported

    info = check_model_supported(model)
    dtype = getattr(model, "dtype", None)
    element = torch.tensor([], dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 2
    return {"windows": info["windows"], "heads": info["kv_heads"], "key_dim": info["key_dim"],
            "value_dim": info["value_dim"], "element_bytes": element}


def cache_bytes_per_token(layout: dict, key_bytes: float, value_bytes: float, context: int, sink_tokens: int = 4,
                          recent_tokens: int = 32, encode_batch: int = 16) -> float:
    """Bytes per token of a `context`-long cache: every layer, keys and values, exact window at its bound
    (sinks + recent + encode_batch - 1 tokens) at the model's element size, sliding layers at their window."""
    exact_bytes = (layout["key_dim"] + layout["value_dim"]) * layout["element_bytes"]
    total = 0.0
    for window in layout["windows"]:
        held = context if window is None else min(context, window)
        exact = min(held, sink_tokens + recent_tokens + encode_batch - 1)
        total += exact * exact_bytes + (held - exact) * (key_bytes + value_bytes)
    return layout["heads"] * total / context


def reference_bytes_per_token(layout: dict) -> float:
    """Bytes per token of a 16-bit uncompressed cache of every layer (what `ratio` divides)."""
    return len(layout["windows"]) * layout["heads"] * (layout["key_dim"] + layout["value_dim"]) * REFERENCE_ELEMENT_BYTES


def head_layout(head_dim: int) -> dict:
    """The layout of one full-attention layer with one KV head of `head_dim` in a 16-bit dtype: what a ratio
    budget needs where the model is not known yet (a ratio does not depend on the layer and head counts when
    every layer is full attention; the vLLM switch)."""
    return {"windows": [None], "heads": 1, "key_dim": head_dim, "value_dim": head_dim,
            "element_bytes": REFERENCE_ELEMENT_BYTES}


def candidates(model, budget: Budget, sink_tokens: int = 4, recent_tokens: int = 32,
               encode_batch: int = 16) -> list[dict]:
    """The table's rows of the budget's kind (keys finer or one code) shipped at the model's sizes, each with
    its `bytes_per_token` on this model at the budget's context and whether it `fits`."""
    return layout_candidates(model_layout(model), budget, sink_tokens, recent_tokens, encode_batch)


def layout_candidates(layout: dict, budget: Budget, sink_tokens: int = 4, recent_tokens: int = 32,
                      encode_batch: int = 16) -> list[dict]:
    """`candidates` for a `model_layout` / `head_layout` dict."""
    limit = budget.bytes_per_token or reference_bytes_per_token(layout) / budget.ratio
    rows = []
    for row in code_table()["rows"]:
        key, value = _sides(row["cache"])
        if (key != value) != budget.keys_finer:
            continue
        sizes = _code_size(key, layout["key_dim"]), _code_size(value, layout["value_dim"])
        if None in sizes:
            continue
        per_token = cache_bytes_per_token(layout, *sizes, budget.context, sink_tokens, recent_tokens, encode_batch)
        rows.append(dict(row, bytes_per_token=per_token, fits=per_token <= limit))
    return rows


def choose_code(model, ratio: Optional[float] = None, bytes_per_token: Optional[float] = None,
                context: int = DEFAULT_CONTEXT, keys_finer: bool = False, sink_tokens: int = 4,
                recent_tokens: int = 32, encode_batch: int = 16) -> str:
    """The cache spec of the best shipped code whose cache on `model` fits the budget (see the module
    docstring); ValueError naming the smallest cache there is when none fits."""
    return choose(model, Budget(ratio, bytes_per_token, context, keys_finer), sink_tokens, recent_tokens,
                  encode_batch)


def choose(model, budget: Budget, sink_tokens: int = 4, recent_tokens: int = 32, encode_batch: int = 16) -> str:
    """`choose_code` for a `Budget`."""
    return choose_in_layout(model_layout(model), budget, sink_tokens, recent_tokens, encode_batch)


def choose_in_layout(layout: dict, budget: Budget, sink_tokens: int = 4, recent_tokens: int = 32,
                     encode_batch: int = 16) -> str:
    """`choose` for a `model_layout` / `head_layout` dict."""
    rows = layout_candidates(layout, budget, sink_tokens, recent_tokens, encode_batch)
    fitting = [row for row in rows if row["fits"]]
    if not fitting:
        smallest = min((row["bytes_per_token"] for row in rows), default=None)
        there = f"the smallest shipped code takes {smallest:.0f} bytes per token" if smallest else "no shipped code"
        raise ValueError(f"no shipped code fits the budget {budget.spec} on this model ({there} at context "
                         f"{budget.context}, window {sink_tokens}+{recent_tokens} counted)")
    return min(fitting, key=lambda row: (row["attention_error"], row["bytes_per_token"]))["cache"]
