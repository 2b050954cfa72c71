"""Codec identity in a saved cache's manifest (docs/persistent-cache.md).

`CodecEntry` names one registered codec (`fibquant.codecs.registry` registry): its family and its
config fields (seeds included), compared exactly, and a fingerprint of the float state that
defines its decoding (codebook, rotation, learned tensors), compared with a tolerance
(`fibquant.kv.persist.fingerprint`: another CPU may compute the rotation's last bits otherwise).
A calibrated codec (RVQ, low-rank) is also written with its own `Codec.save` as
`codecs/<family>-<sha256[:16]>.safetensors` next to the manifest, whose sha256 the spec keeps
(a file's bytes are lossless: compared exactly).

A role (keys, values) is described by a *codec entry*: a `CodecEntry`, or a list of them, one
per KV head (a `HeadwiseCodec`). A `LayerwiseCompressedCache` adds one entry per layer.

Version-1 manifests wrote the parameters of the three families they supported as flat fields
(k, n_codewords, bits, group_size, seed); they are still read (`_V1_FIELDS`). Version-1 and -2
manifests identify the state by a sha256 of its float bytes (`state_sha256`, `codec_state_sha256`),
still checked for them: such a file opens where the state's bits are the same (re-saving it
writes the version-3 fingerprint).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from fibquant.codecs.base import Codec, config_matches
from fibquant.codecs.reader import CodebookReader
from fibquant.codecs.layout import CodeLayout
from fibquant.kv.persist.fingerprint import (TOLERANCE, fingerprint_label, fingerprint_mismatch,
                                             state_fingerprint as fingerprint_of)

CODEC_DIR = "codecs"
# Version-1 manifests: the config fields each family's spec named (besides dim).
_V1_FIELDS = {"fibquant": ("k", "n_codewords", "seed"), "turboquant": ("bits", "seed"), "int": ("bits", "group_size")}
_V1_NAMES = ("k", "n_codewords", "bits", "group_size", "seed")


def _registry() -> dict:
    from fibquant.codecs.registry import codec_classes

    return codec_classes()


@dataclass(frozen=True)
class CodecEntry:
    """What rebuilds a codec: family, config, a fingerprint of its decoding state (version 3; a
    sha256 of it in versions 1-2), and for a calibrated codec its safetensors file (relative to the
    cache directory) and that file's sha256."""

    family: str
    dim: int
    k: Optional[int] = None  # k .. seed: version-1 fields (see the module docstring)
    n_codewords: Optional[int] = None
    bits: Optional[int] = None
    group_size: Optional[int] = None
    seed: int = 0
    state_sha256: str = ""  # versions 1-2: codec_state_sha256 (float bytes); not written since version 3
    config: Optional[dict] = None  # version 2: asdict(codec.config)
    file: str = ""
    file_sha256: str = ""
    state_fingerprint: Optional[dict] = None  # version 3: fingerprint.state_fingerprint

    def __post_init__(self) -> None:
        if self.family not in _registry():
            raise ValueError(f"unknown codec family {self.family!r} in a saved cache (registered: "
                             f"{', '.join(_registry())})")
        if self.config is None and self.family not in _V1_FIELDS:
            raise ValueError(f"codec spec of family {self.family!r} has no config")
        if self.file and (Path(self.file).is_absolute() or ".." in Path(self.file).parts):
            raise ValueError(f"codec file {self.file!r} must lie inside the cache directory")

    @classmethod
    def from_codec(cls, codec: Codec, root: Optional[Path] = None, written: Optional[dict] = None) -> "CodecEntry":
        """The spec of a registered codec; a calibrated one is saved under `root`/codecs, once per
        content: `written` maps each codec's content key (and id) to the spec already made."""
        if written is not None and id(codec) in written:
            return written[id(codec)][1]
        registered = _registry().get(getattr(codec, "family", ""))
        if registered is None or not isinstance(codec, registered) or not is_dataclass(codec.config):
            raise ValueError(f"cannot persist a cache whose codec is {type(codec).__name__}: not a codec of a "
                             f"registered family ({', '.join(_registry())}) with a config")
        state = codec_state_sha256(codec)  # exact equality within this process, not written
        tensors = codec.state_tensors()
        # Equal content (family, config, decoding state, any other state tensors) is one spec and
        # one file, whichever objects hold it (e.g. two equal fits for two layers).
        content = (codec.family, json.dumps(asdict(codec.config), sort_keys=True, default=str), state,
                   "" if codec.calibrated or not tensors else _tensors_sha256(tensors))
        spec = written.get(content) if written is not None else None
        if spec is None:
            file = digest = ""
            if codec.calibrated or tensors:
                if root is None:
                    raise ValueError(f"{type(codec).__name__} is calibrated: its state needs a cache directory")
                file, digest = _write_codec_file(codec, root)
            spec = cls(codec.family, codec.dim, config=asdict(codec.config), file=file, file_sha256=digest,
                       state_fingerprint=fingerprint_of(codec))
        if written is not None:
            written[content] = spec
            written[id(codec)] = (codec, spec)  # the object is kept: its id cannot be reused meanwhile
        return spec

    def to_json(self) -> dict:
        data = asdict(self)
        if self.config is not None:  # version 2: the flat version-1 fields are not written
            for name in _V1_NAMES:
                data.pop(name)
        return {k: v for k, v in data.items() if v not in ("", None)}

    def codec_config(self) -> dict:
        if self.config is not None:
            return dict(self.config)
        return {"dim": self.dim, **{name: getattr(self, name) for name in _V1_FIELDS[self.family]}}

    def build(self, root: Optional[Path] = None) -> Codec:
        """The codec, checked against the saved state hash (another codebook is refused)."""
        cls = _registry()[self.family]
        config = self.codec_config()
        if self.file:
            if root is None:
                raise ValueError(f"the {self.family} codec is stored in {self.file}: the cache directory is needed")
            codec = _read_codec_file(cls, Path(root) / self.file, self.file_sha256)
            if not config_matches(codec.config, config):
                raise ValueError(f"{self.file} holds a codec with config {asdict(codec.config)}, the manifest "
                                 f"says {config}")
        elif cls.calibrated:
            raise ValueError(f"the {self.family} codec spec has no codec file: its learned state is missing")
        else:
            try:
                codec = cls.from_state(config, {})
            except TypeError as exc:
                raise ValueError(f"bad {self.family} codec config {config} in a saved cache ({exc})") from None
        problem = self.state_mismatch(codec)
        if problem is not None:
            raise ValueError(f"the {self.family} codebook/rotation/state here differs from the one the cache was "
                             f"saved with ({config}): {problem}; its codes would decode to other vectors")
        return codec

    def state_mismatch(self, codec: Codec) -> Optional[str]:
        """How `codec`'s decoding state differs from the saved one, or None: the fingerprint within
        its tolerance (version 3), else the exact sha256 of versions 1-2."""
        if self.state_fingerprint is not None:
            return fingerprint_mismatch(self.state_fingerprint, fingerprint_of(codec))
        if self.state_sha256 and codec_state_sha256(codec) != self.state_sha256:
            return "its sha256 differs (a version-1/2 file: exact bits are compared)"
        return None


Entry = Union[CodecEntry, list]  # a CodecEntry, or one CodecEntry per KV head


def codec_state_sha256(codec: Codec) -> str:
    """sha256 of what defines a codec's decoding: its registered class, dim, code size, codebook
    (a `CodebookReader`'s rotation and codewords, if any) and, for a calibrated codec, its state tensors (sorted by name). Float bytes:
    exact equality on this machine (within a save; the state identity of version-1/2 files)."""
    registered = _registry().get(codec.family)
    name = registered.__name__ if registered is not None and isinstance(codec, registered) else type(codec).__name__
    digest = hashlib.sha256(repr((name, codec.dim, codec.code_size)).encode())
    book = codec.reader(torch.device("cpu"))
    if isinstance(book, CodebookReader):  # one codebook: its rotation and codewords (as when first written)
        for tensor in (book.forward, book.codewords):
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    if codec.calibrated:
        for key, tensor in sorted(codec.state_tensors().items()):
            digest.update(key.encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _tensors_sha256(tensors: dict) -> str:
    digest = hashlib.sha256()
    for key, tensor in sorted(tensors.items()):
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def codec_mismatch(entry: "Entry", codec: Codec) -> Optional[str]:
    """Why `codec` (a role codec of a cache) is not the codec of a manifest entry, or None when
    it is: same family and config, and the same decoding state (per KV head for a per-head entry)."""
    from fibquant.kv.headwise import HeadwiseCodec

    specs = entry_specs(entry)
    codecs = list(codec.codecs) if isinstance(codec, HeadwiseCodec) else [codec]
    if isinstance(entry, list) != isinstance(codec, HeadwiseCodec) or len(specs) != len(codecs):
        return f"{len(specs)} saved codec(s) per role, the cache has {len(codecs)}"
    for head, (spec, plain) in enumerate(zip(specs, codecs)):
        where = f" (KV head {head})" if len(specs) > 1 else ""
        if getattr(plain, "family", None) != spec.family:
            return f"family {getattr(plain, 'family', type(plain).__name__)!r}, saved {spec.family!r}{where}"
        if spec.config is not None and is_dataclass(plain.config) and not config_matches(plain.config, spec.config):
            return f"config {asdict(plain.config)}, saved {spec.config}{where}"
        problem = spec.state_mismatch(plain)
        if problem is not None:
            return f"another codebook/rotation/learned state: {problem}{where}"
    return None


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_codec_file(codec: Codec, root: Path) -> tuple[str, str]:
    """Save a calibrated codec as codecs/<family>-<sha256[:16]>.safetensors; (relative name, sha256)."""
    folder = Path(root) / CODEC_DIR
    folder.mkdir(exist_ok=True)
    tmp = folder / f".{os.getpid()}.{id(codec)}.tmp"
    codec.save(tmp)
    digest = _file_sha256(tmp)
    name = f"{codec.family}-{digest[:16]}.safetensors"
    os.replace(tmp, folder / name)
    return f"{CODEC_DIR}/{name}", digest


def _read_codec_file(cls, path: Path, expected: str) -> Codec:
    try:
        digest = _file_sha256(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: codec file missing (the cache's learned codebooks are stored there)") from None
    if expected and digest != expected:
        raise ValueError(f"{path}: codec file checksum mismatch (corrupt or replaced)")
    return cls.load(path)


# ---------------------------------------------------------------------------- codec entries
def entry_from_codec(codec: Codec, root: Path, written: dict) -> Entry:
    from fibquant.kv.headwise import HeadwiseCodec

    if isinstance(codec, HeadwiseCodec):
        return [CodecEntry.from_codec(c, root, written) for c in codec.codecs]
    return CodecEntry.from_codec(codec, root, written)


def entry_to_json(entry: Entry):
    return [spec.to_json() for spec in entry] if isinstance(entry, list) else entry.to_json()


def entry_summary(entry: Entry):
    """`entry_to_json` with each state fingerprint shortened to its label and tolerance (cache info)."""
    def short(spec: CodecEntry) -> dict:
        data = spec.to_json()
        if "state_fingerprint" in data:
            data["state_fingerprint"] = f"{fingerprint_label(data['state_fingerprint'])} (within {TOLERANCE:g} of the rms)"
        return data

    return [short(spec) for spec in entry] if isinstance(entry, list) else short(entry)


def entry_from_json(data) -> Entry:
    if isinstance(data, list):
        if not data:
            raise ValueError("a per-head codec entry lists no codec")
        return [CodecEntry(**item) for item in data]
    return CodecEntry(**data)


def entry_specs(entry: Entry) -> list[CodecEntry]:
    return list(entry) if isinstance(entry, list) else [entry]


class CodecBuilder:
    """Builds the codecs of a manifest's entries once each (equal specs give one shared codec)."""

    def __init__(self, root: Optional[Path]):
        self.root, self._built = root, {}

    def spec(self, spec: CodecEntry) -> Codec:
        key = repr(sorted(spec.to_json().items()))
        if key not in self._built:
            self._built[key] = spec.build(self.root)
        return self._built[key]

    def entry(self, entry: Entry) -> Codec:
        if isinstance(entry, list):
            from fibquant.kv.headwise import HeadwiseCodec

            return HeadwiseCodec([self.spec(spec) for spec in entry])
        return self.spec(entry)


def plain_codecs(codec: Codec) -> list[Codec]:
    """The codecs a role codec is made of (the heads of a `HeadwiseCodec`, else itself)."""
    from fibquant.kv.headwise import HeadwiseCodec

    return list(codec.codecs) if isinstance(codec, HeadwiseCodec) else [codec]


def stream_format(codecs: list[Codec]) -> dict:
    """{"code_size", "layout"} of one role's code stream: every codec of the role must have one
    code size; the stream is a `CodeArchive` when they all declare the same `code_layout`."""
    plain = [c for codec in codecs for c in plain_codecs(codec)]
    sizes = sorted({codec.code_size for codec in plain})
    if len(sizes) != 1:
        raise ValueError(f"the codecs of one role have code sizes {sizes}: a saved code stream needs one")
    layouts = {getattr(codec, "code_layout", None) for codec in plain}
    layout = layouts.pop() if len(layouts) == 1 else None
    return {"code_size": sizes[0], "layout": asdict(layout) if isinstance(layout, CodeLayout) else None}
