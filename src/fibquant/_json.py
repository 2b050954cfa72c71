"""Strict JSON: NaN and +-Inf become null, so every file and line fibquant writes is valid JSON.

`json.dumps` writes float("nan") as the bare token NaN (and inf as Infinity), which JSON does
not allow (jq, JavaScript and most parsers reject it). `finite(obj)` maps every non-finite float
(Python, numpy or torch scalar) to None and numpy arrays / scalars to lists / Python numbers;
`dumps(obj, ...)` is `json.dumps(finite(obj), allow_nan=False, ...)`.
"""
from __future__ import annotations

import json
import math


def finite(value):
    """`value` with every non-finite float replaced by None (recursively through dicts, lists, tuples)."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy array or scalar, torch tensor
        return finite(value.tolist())
    return value


def dumps(value, **kwargs) -> str:
    """`json.dumps` of `finite(value)` with allow_nan=False (other kwargs passed on)."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
