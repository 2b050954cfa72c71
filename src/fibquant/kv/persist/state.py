"""What a saved `CompressedCache` holds besides its code streams: the manifest, fixed for the life
of the store, and the exact part (sinks + recent window, a centred cache's means) recovered at open."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional, Union

import torch

from fibquant.codecs.layout import CodeLayout
from fibquant.kv.persist.entries import Entry, entry_from_json, entry_specs, entry_to_json
from fibquant.kv.persist.format import FORMAT_NAME, FORMAT_VERSION, READABLE_VERSIONS, SNAPSHOT_FILE, stored_layout

_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
ROLES = ("keys", "values")


@dataclass(frozen=True)
class CacheManifest:
    """Everything fixed for the life of a saved cache (manifest.json).

    key_codec / value_codec: the cache's codec entry per role (a `CodecEntry`, or a list of them,
    one per KV head). key_codecs / value_codecs: one entry per layer for a
    `LayerwiseCompressedCache`, else None. streams: {"keys"|"values": {"code_size", "layout"}}
    (None in version-1 manifests: the stream directories say). centre: the cache subtracts
    per-(layer, head) means, stored in the snapshot. model_fingerprint: the model's identity
    (`fibquant.kv.persist.model_identity`): a dict since version 3, a sha256 string before."""

    model_fingerprint: Union[str, dict]
    key_codec: Entry
    value_codec: Entry
    sink_tokens: int
    recent_tokens: int
    encode_batch: int
    layers: int
    batch: int
    kv_heads: int
    dtype: str
    vocab_size: int
    model_name: str = ""
    key_codecs: Optional[list] = None
    value_codecs: Optional[list] = None
    centre: bool = False
    streams: Optional[dict] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_fingerprint, (str, dict)):
            raise ValueError(f"manifest model_fingerprint must be a sha256 or a model identity, got "
                             f"{type(self.model_fingerprint).__name__}")
        for name in ("sink_tokens", "recent_tokens", "encode_batch", "layers", "batch", "kv_heads", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if "tokens" in name else 1):
                raise ValueError(f"manifest field {name} must be a {'non-negative' if 'tokens' in name else 'positive'}"
                                 f" integer, got {value!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"manifest dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.centre, bool):
            raise ValueError(f"manifest field centre must be true or false, got {self.centre!r}")
        if (self.key_codecs is None) != (self.value_codecs is None):
            raise ValueError("manifest gives per-layer codecs for one role only")
        for role in ("key_codecs", "value_codecs"):
            entries = getattr(self, role)
            if entries is not None and (not isinstance(entries, list) or len(entries) < self.layers):
                raise ValueError(f"manifest {role} must list a codec for each of the {self.layers} layers")
        if self.streams is not None and (not isinstance(self.streams, dict) or set(self.streams) != set(ROLES)):
            raise ValueError(f"manifest streams must describe {ROLES}, got {self.streams!r}")

    @property
    def rows_per_token(self) -> int:
        """Code rows one token adds to each stream: layers * batch * kv_heads."""
        return self.layers * self.batch * self.kv_heads

    def specs(self) -> list:
        """Every `CodecEntry` of the manifest (role codecs and per-layer codecs)."""
        entries = [self.key_codec, self.value_codec] + (self.key_codecs or []) + (self.value_codecs or [])
        return [spec for entry in entries for spec in entry_specs(entry)]

    def to_json(self) -> dict:
        data = {"format": FORMAT_NAME, "version": FORMAT_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("key_codec", "value_codec"):
                value = entry_to_json(value)
            elif f.name in ("key_codecs", "value_codecs") and value is not None:
                value = [entry_to_json(entry) for entry in value]
            data[f.name] = value
        return data

    @classmethod
    def from_json(cls, data: dict) -> "CacheManifest":
        if data.get("format") != FORMAT_NAME:
            raise ValueError(f"not a saved fibquant KV cache (format {data.get('format')!r})")
        if data.get("version") not in READABLE_VERSIONS:
            raise ValueError(f"unknown saved-cache format version {data.get('version')!r} "
                             f"(this reader knows {READABLE_VERSIONS})")
        names = {f.name for f in fields(cls)}
        body = {k: v for k, v in data.items() if k in names}
        for role in ("key_codec", "value_codec"):
            body[role] = entry_from_json(data[role])
        for role in ("key_codecs", "value_codecs"):
            if body.get(role) is not None:
                if not isinstance(body[role], list):
                    raise ValueError(f"manifest {role} must be a list")
                body[role] = [entry_from_json(entry) for entry in body[role]]
        return cls(**body)

    def stream(self, role: str, root: Path, code_size_of) -> tuple[int, Optional[CodeLayout]]:
        """(code_size, layout or None) of the `role` stream under `root`. Version 1 manifests
        have no `streams`: the directory's layout.json says (code size from `code_size_of(role)`)."""
        on_disk = stored_layout(root / role)
        if self.streams is None:
            return (on_disk.code_size if on_disk is not None else code_size_of(role)), on_disk
        code_size, layout = parse_stream_format(self.streams[role], role)
        if layout != on_disk:
            raise ValueError(f"{root / role}: the stream holds layout {on_disk}, the manifest says {layout}")
        return code_size, layout


def parse_stream_format(fmt, role: str) -> tuple[int, Optional[CodeLayout]]:
    """(code_size, layout or None) of a manifest's {"code_size", "layout"} stream format."""
    try:
        layout = CodeLayout(**fmt["layout"]) if fmt.get("layout") else None
        return int(fmt["code_size"]), layout
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"manifest stream format of {role} is corrupt ({exc})") from None


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
        return self.edit(lambda name, t: t[..., :(sinks if name.startswith("sink") else window), :].clone(), coded)

    def edit(self, fn, coded: int) -> "ExactState":
        """fn(name, tensor) applied to the sinks and windows (the means stay as they are)."""
        return ExactState([{name: (fn(name, t) if name in _WINDOW_FIELDS else t) for name, t in layer.items()}
                           for layer in self.layers], coded)

    @property
    def has_means(self) -> bool:
        return bool(self.layers) and all("key_mean" in layer for layer in self.layers)


_WINDOW_FIELDS = ("sink_keys", "sink_values", "recent_keys", "recent_values")


def recover_state(snapshot: ExactState, coded: int, notes: list) -> ExactState:
    """Combine a snapshot (coded count m0) with m whole coded tokens present in every stream."""
    m0 = snapshot.coded
    if coded >= m0:
        drop = coded - m0
        if drop:
            notes.append(f"{drop} tokens were encoded after the last checkpoint" +
                         (" (window cut)" if drop > snapshot.window else ""))
        return snapshot.edit(lambda name, t: t if name.startswith("sink") else t[..., drop:, :], coded)
    notes.append(f"codes of {m0 - coded} tokens before the snapshot were dropped: window cut, KV ends at the codes")
    return snapshot.edit(lambda name, t: t if name.startswith("sink") else t[..., :0, :], coded)


def snapshot_coded(path: Path) -> Optional[int]:
    from safetensors import safe_open
    try:
        with safe_open(str(path / SNAPSHOT_FILE), framework="pt") as handle:
            return int((handle.metadata() or {})["coded"])
    except Exception:  # noqa: BLE001 - absent or unreadable: rewrite it
        return None
