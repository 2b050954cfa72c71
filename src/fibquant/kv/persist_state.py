"""What a saved `CompressedCache` holds besides its code streams: the manifest, fixed for the life
of the store, and the exact part (sinks + recent window) recovered at open."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

import torch

from fibquant.kv.persist_format import FORMAT_NAME, FORMAT_VERSION, SNAPSHOT_FILE, CodecSpec

_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


@dataclass(frozen=True)
class CacheManifest:
    """Everything fixed for the life of a saved cache (manifest.json)."""

    model_fingerprint: str
    key_codec: CodecSpec
    value_codec: CodecSpec
    sink_tokens: int
    recent_tokens: int
    encode_batch: int
    layers: int
    batch: int
    kv_heads: int
    dtype: str
    vocab_size: int
    model_name: str = ""

    def __post_init__(self) -> None:
        for name in ("sink_tokens", "recent_tokens", "encode_batch", "layers", "batch", "kv_heads", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if "tokens" in name else 1):
                raise ValueError(f"manifest field {name} must be a {'non-negative' if 'tokens' in name else 'positive'}"
                                 f" integer, got {value!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"manifest dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def rows_per_token(self) -> int:
        """Code rows one token adds to each stream: layers * batch * kv_heads."""
        return self.layers * self.batch * self.kv_heads

    def to_json(self) -> dict:
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> "CacheManifest":
        if data.get("format") != FORMAT_NAME:
            raise ValueError(f"not a saved fibquant KV cache (format {data.get('format')!r})")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"unknown saved-cache format version {data.get('version')!r} "
                             f"(this reader knows {FORMAT_VERSION})")
        names = {f.name for f in fields(cls)}
        body = {k: v for k, v in data.items() if k in names}
        body["key_codec"], body["value_codec"] = CodecSpec(**data["key_codec"]), CodecSpec(**data["value_codec"])
        return cls(**body)


@dataclass
class ExactState:
    """The recovered exact part: per-layer sinks/window tensors, and the coded token count."""

    layers: list[dict[str, torch.Tensor]]
    coded: int

    @property
    def sinks(self) -> int:
        return self.layers[0]["sink_keys"].shape[-2] if self.layers else 0

    @property
    def window(self) -> int:
        return self.layers[0]["recent_keys"].shape[-2] if self.layers else 0

    @property
    def length(self) -> int:
        return self.sinks + self.coded + self.window

    def cut(self, n: int) -> "ExactState":
        """The state of the first n tokens (codes stay codes, as `CompressedLayer.crop`)."""
        sinks = min(self.sinks, n)
        coded = min(self.coded, n - sinks)
        window = max(0, min(self.window, n - sinks - coded))
        layers = [{name: t[..., :(sinks if name.startswith("sink") else window), :].clone()
                   for name, t in layer.items()} for layer in self.layers]
        return ExactState(layers, coded)


def recover_state(snapshot: ExactState, coded: int, notes: list) -> ExactState:
    """Combine a snapshot (coded count m0) with m whole coded tokens present in every stream."""
    m0 = snapshot.coded
    if coded >= m0:
        drop = coded - m0
        layers = [{name: (t if name.startswith("sink") else t[..., drop:, :]) for name, t in layer.items()}
                  for layer in snapshot.layers]
        if drop:
            notes.append(f"{drop} tokens were encoded after the last checkpoint" +
                         (" (window cut)" if drop > snapshot.window else ""))
        return ExactState(layers, coded)
    notes.append(f"codes of {m0 - coded} tokens before the snapshot were dropped: window cut, KV ends at the codes")
    layers = [{name: (t if name.startswith("sink") else t[..., :0, :]) for name, t in layer.items()}
              for layer in snapshot.layers]
    return ExactState(layers, coded)


def stream_code_size(spec: CodecSpec) -> int:
    return spec.build().code_size if spec.layout() is None else spec.layout().code_size


def snapshot_coded(path: Path) -> Optional[int]:
    from safetensors import safe_open
    try:
        with safe_open(str(path / SNAPSHOT_FILE), framework="pt") as handle:
            return int((handle.metadata() or {})["coded"])
    except Exception:  # noqa: BLE001 - absent or unreadable: rewrite it
        return None
