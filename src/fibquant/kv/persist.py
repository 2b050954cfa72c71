"""Save, lazily open, resume and append to a `CompressedCache` on disk (docs/persistent-cache.md).

    store = save_cache(cache, "run.fqkv", model, token_ids)      # one call: everything sealed
    store = PersistentCache.open("run.fqkv", model=model)        # reads manifest + headers only
    store.token_ids(), store.num_tokens, store.kv(t), store.layer_kv(l, a, b)
    cache = store.to_cache(model)                                # the same cache state, bit for bit
    out = generate_persistent(model, ids, "run.fqkv", codec, codec, max_new_tokens=64)
    out = resume_generate(model, "run.fqkv", max_new_tokens=64)  # continues, appending

A cache is written as it grows: `append_from(cache, ids)` appends the code rows that left
the exact window since the last call (code streams are append-only), `checkpoint(cache)`
seals every stream and atomically replaces the exact-window snapshot. Opening recovers the
longest consistent prefix after a crash (RecoveryWarning): codes present in every stream,
the snapshot's sinks and the part of its recent window that follows the codes; the token
ids beyond it are kept, so `resume_generate` recomputes the lost tokens.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fibquant.archive import Archive, RecoveryWarning
from fibquant.archive.format import ArchiveError
from fibquant.kv.cache import CompressedCache, CompressedLayer, check_model_supported
from fibquant.kv.persist_format import (FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE, SNAPSHOT_FILE, TOKENS_FILE,
                                        CodecSpec, CodeStream, model_fingerprint, open_tokens, read_snapshot,
                                        write_json_atomic, write_snapshot)

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
class _State:
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

    def cut(self, n: int) -> "_State":
        """The state of the first n tokens (codes stay codes, as `CompressedLayer.crop`)."""
        sinks = min(self.sinks, n)
        coded = min(self.coded, n - sinks)
        window = max(0, min(self.window, n - sinks - coded))
        layers = [{name: t[..., :(sinks if name.startswith("sink") else window), :].clone()
                   for name, t in layer.items()} for layer in self.layers]
        return _State(layers, coded)


class PersistentCache:
    """A saved `CompressedCache` directory; see the module docstring. Build with create/open."""

    def __init__(self, path: Path, manifest: CacheManifest, keys: CodeStream, values: CodeStream, tokens: Archive,
                 state: Optional[_State], writable: bool, durable: bool):
        self.path, self.manifest, self.writable, self.durable = path, manifest, writable, durable
        self.key_stream, self.value_stream, self.tokens = keys, values, tokens
        self._state = state
        self._coded = state.coded if state is not None else 0  # code tokens written to the streams
        self._codecs = None
        self._fast = None
        self.closed = False

    # ------------------------------------------------------------------ create / open
    @classmethod
    def create(cls, path, model, key_codec, value_codec, *, sink_tokens: int = 4, recent_tokens: int = 32,
               encode_batch: int = 16, batch: int = 1, dtype: torch.dtype = torch.float32,
               overwrite: bool = False, durable: bool = False) -> "PersistentCache":
        """An empty saved cache for `model` (fingerprinted) and the given codecs and window."""
        from fibquant.kv.model import describe_model

        info = check_model_supported(model, key_codec, value_codec)
        path = Path(path)
        if path.exists():
            if not overwrite:
                raise ValueError(f"{path} exists (pass overwrite=True to replace it)")
            import shutil
            shutil.rmtree(path)
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
            else model.config
        manifest = CacheManifest(model_fingerprint(model), CodecSpec.from_codec(key_codec),
                                 CodecSpec.from_codec(value_codec), sink_tokens, recent_tokens, encode_batch,
                                 info["layers"], batch, info["kv_heads"], str(dtype), int(config.vocab_size),
                                 describe_model(model))
        path.mkdir(parents=True)
        write_json_atomic(path / MANIFEST_FILE, manifest.to_json())
        keys = CodeStream.create(path / "keys", manifest.key_codec, key_codec.code_size)
        values = CodeStream.create(path / "values", manifest.value_codec, value_codec.code_size)
        tokens = Archive.create(path / TOKENS_FILE, manifest.vocab_size, durable=durable)
        store = cls(path, manifest, keys, values, tokens, None, True, durable)
        store._codecs = (key_codec, value_codec)
        return store

    @classmethod
    def open(cls, path, mode: str = "r", *, model=None, durable: bool = False) -> "PersistentCache":
        """Open lazily: the manifest, the archives' record headers and the small snapshot are
        read; no code is decoded. With `model`, its fingerprint must match (ValueError otherwise).
        A torn tail is recovered with a RecoveryWarning (and cut off the files in mode "a")."""
        if mode not in ("r", "a"):
            raise ValueError(f"mode must be 'r' or 'a', got {mode!r}")
        path = Path(path)
        try:
            manifest = CacheManifest.from_json(json.loads((path / MANIFEST_FILE).read_text()))
        except FileNotFoundError:
            raise ValueError(f"{path}: no saved KV cache here (missing {MANIFEST_FILE})") from None
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: corrupt {MANIFEST_FILE} ({type(exc).__name__}: {exc})") from None
        if model is not None and model_fingerprint(model) != manifest.model_fingerprint:
            raise ValueError(f"{path} was saved with another model (fingerprint {manifest.model_fingerprint[:12]}…, "
                             f"{manifest.model_name!r}); its keys/values are meaningless for this one")
        notes = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RecoveryWarning)
            try:
                keys = CodeStream.open(path / "keys", manifest.key_codec, _code_size(manifest.key_codec), "r")
                values = CodeStream.open(path / "values", manifest.value_codec, _code_size(manifest.value_codec), "r")
                tokens = open_tokens(path / TOKENS_FILE, "r")
            except ArchiveError as exc:
                raise ValueError(f"{path}: corrupt code stream ({exc})") from None
        notes += [str(w.message) for w in caught if issubclass(w.category, RecoveryWarning)]
        rows = manifest.rows_per_token
        key_rows, value_rows = keys.sealed_rows(), values.sealed_rows()
        coded = min(key_rows, value_rows) // rows
        n_tokens = len(tokens)
        for stream in (keys, values):
            stream.close()
        tokens.close()
        state = None
        if (path / SNAPSHOT_FILE).exists():
            layers, snap_coded = read_snapshot(path / SNAPSHOT_FILE, manifest.layers)
            state = _recover(_State(layers, snap_coded), coded, notes)
        elif coded:
            notes.append(f"no exact-window snapshot: {coded} coded tokens unusable without their sinks")
        if state is not None and n_tokens < state.length:
            notes.append(f"token ids end at {n_tokens}, the KV at {state.length}: cut to {n_tokens}")
            state = state.cut(n_tokens)
        coded = state.coded if state is not None else 0
        if key_rows != coded * rows or value_rows != coded * rows:
            notes.append(f"code streams hold {key_rows}/{value_rows} rows, {coded} whole tokens kept")
        if notes:
            warnings.warn(f"{path}: recovered {state.length if state else 0} tokens of KV: " + "; ".join(notes),
                          RecoveryWarning, stacklevel=2)
        open_rows = coded * rows if mode == "a" else None
        with warnings.catch_warnings():  # reported above, once
            warnings.simplefilter("ignore", RecoveryWarning)
            keys = CodeStream.open(path / "keys", manifest.key_codec, _code_size(manifest.key_codec), mode, open_rows)
            values = CodeStream.open(path / "values", manifest.value_codec, _code_size(manifest.value_codec), mode,
                                     open_rows)
            tokens = open_tokens(path / TOKENS_FILE, mode)
        store = cls(path, manifest, keys, values, tokens, state, mode == "a", durable)
        if mode == "a" and state is not None and (state.coded != _snapshot_coded(path) or notes):
            write_snapshot(path / SNAPSHOT_FILE, state.layers, state.coded)  # the recovered state, consistent
        return store

    # ------------------------------------------------------------------ reading
    @property
    def codecs(self):
        if self._codecs is None:
            self._codecs = (self.manifest.key_codec.build(), self.manifest.value_codec.build())
        return self._codecs

    @property
    def num_tokens(self) -> int:
        """Tokens whose keys/values are stored (the length of the loaded cache)."""
        return 0 if self._state is None else self._state.length

    @property
    def num_coded(self) -> int:
        return self._coded

    @property
    def num_sinks(self) -> int:
        return 0 if self._state is None else self._state.sinks

    def token_ids(self) -> torch.Tensor:
        """Every stored token id, int64 [n] (n >= num_tokens: ids not yet in the KV are kept)."""
        return torch.from_numpy(self.tokens.read())

    def _code_rows(self, stream: CodeStream, start: int, stop: int) -> torch.Tensor:
        """Codes of coded tokens [start, stop): uint8 [n, L, B, H, code_size]."""
        m = self.manifest
        rows = stream.read(start * m.rows_per_token, stop * m.rows_per_token)
        return torch.from_numpy(rows).reshape(stop - start, m.layers, m.batch, m.kv_heads, stream.code_size)

    def layer_kv(self, layer: int, start: int = 0, stop: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens [start, stop) of one layer: float [B, H, n, D] each; exact
        where the cache holds them exactly, decoded from codes (only the blocks touched) elsewhere."""
        if self._state is None:
            raise IndexError(f"{self.path}: no tokens stored")
        stop = self.num_tokens if stop is None else stop
        if not 0 <= start <= stop <= self.num_tokens or not 0 <= layer < self.manifest.layers:
            raise IndexError(f"layer {layer}, tokens [{start}, {stop}) out of range "
                             f"({self.manifest.layers} layers, {self.num_tokens} tokens)")
        exact = self._state.layers[layer]
        dtype = dtype or exact["sink_keys"].dtype
        s, c = self._state.sinks, self._state.coded
        out = []
        for role, codec, stream in (("keys", self.codecs[0], self.key_stream),
                                    ("values", self.codecs[1], self.value_stream)):
            parts = [exact[f"sink_{role}"][..., start:min(stop, s), :].to(dtype)]
            a, b = max(start, s) - s, min(stop, s + c) - s
            if a < b:
                codes = self._code_rows(stream, a, b)[:, layer].permute(1, 2, 0, 3)
                parts.append(codec.decode(codes.contiguous(), dtype=dtype))
            parts.append(exact[f"recent_{role}"][..., max(start - s - c, 0):max(stop - s - c, 0), :].to(dtype))
            out.append(torch.cat(parts, dim=-2))
        return out[0], out[1]

    def kv(self, token: int, dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one token in every layer: float [L, B, H, D] each (reads one row range)."""
        if not 0 <= token < self.num_tokens:
            raise IndexError(f"token {token} out of range for {self.num_tokens} stored tokens")
        s, c = self._state.sinks, self._state.coded
        dtype = dtype or self._state.layers[0]["sink_keys"].dtype
        if s <= token < s + c:
            rows = [(codec, self._code_rows(stream, token - s, token - s + 1)[0])
                    for codec, stream in zip(self.codecs, (self.key_stream, self.value_stream))]
            return tuple(codec.decode(r.contiguous(), dtype=dtype) for codec, r in rows)
        pairs = [self.layer_kv(layer, token, token + 1, dtype) for layer in range(self.manifest.layers)]
        return torch.stack([k[..., 0, :] for k, _ in pairs]), torch.stack([v[..., 0, :] for _, v in pairs])

    def token(self, layer: int, head: int, i, batch: int = 0,
              dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value of token `i` (an int: float [D] each; a slice with step 1: [n, D]) in one
        layer and KV head. A coded token reads exactly its own code row of each stream (one
        block of the archive, the rest of the file untouched) and decodes it; sinks and the
        window come from the snapshot read at open."""
        m = self.manifest
        if not (0 <= layer < m.layers and 0 <= head < m.kv_heads and 0 <= batch < m.batch):
            raise IndexError(f"layer {layer}, head {head}, batch row {batch} out of range "
                             f"({m.layers} layers, {m.kv_heads} KV heads, batch {m.batch})")
        if isinstance(i, slice):
            start, stop, step = i.indices(self.num_tokens)
            if step != 1:
                raise ValueError("token slices must have step 1")
            pair = self.layer_kv(layer, start, max(start, stop), dtype)
            return pair[0][batch, head], pair[1][batch, head]
        i = int(i)
        if not 0 <= i < self.num_tokens:
            raise IndexError(f"token {i} out of range for {self.num_tokens} stored tokens")
        s, c = self._state.sinks, self._state.coded
        exact = self._state.layers[layer]
        dtype = dtype or exact["sink_keys"].dtype
        if i < s:
            return exact["sink_keys"][batch, head, i].to(dtype), exact["sink_values"][batch, head, i].to(dtype)
        if i >= s + c:
            r = i - s - c
            return exact["recent_keys"][batch, head, r].to(dtype), exact["recent_values"][batch, head, r].to(dtype)
        row = (((i - s) * m.layers + layer) * m.batch + batch) * m.kv_heads + head
        out = []
        for role, codec, stream in zip((0, 1), self.codecs, (self.key_stream, self.value_stream)):
            fast = self._row_decoder(role)
            if fast is not None:
                out.append(fast(stream, row).to(dtype))
            else:
                out.append(codec.decode(torch.from_numpy(stream.read(row, row + 1)), dtype=dtype)[0])
        return out[0], out[1]

    def find(self, codes, layer: int, head: int, role: str = "keys", batch: int = 0) -> np.ndarray:
        """Every coded token t (index into the coded part, token s + t of the cache) where the
        code rows of tokens t, t+1, ..., t+n-1 in (layer, head, batch row) equal `codes`
        uint8 [n, code_size] (e.g. a paragraph's keys in one head), sorted; verified exact.

        The archive's in-place suffix search finds the first row's index symbols in the role's
        index stream; hits are kept when they fall on a row of this (layer, head), with the same
        fp16 norm, and the following n-1 rows (one token apart in the token-major stream) equal."""
        stream = {"keys": self.key_stream, "values": self.value_stream}.get(role)
        if stream is None:
            raise ValueError(f"role must be 'keys' or 'values', got {role!r}")
        if stream.layout is None:
            raise ValueError("code search needs a [norm][indices] codec stream (FibQuant, TurboQuant)")
        m, nb = self.manifest, stream.layout.n_blocks
        query = np.asarray(codes.cpu() if isinstance(codes, torch.Tensor) else codes, dtype=np.uint8)
        if query.ndim != 2 or query.shape[0] < 1 or query.shape[1] != stream.code_size:
            raise ValueError(f"codes must be uint8 [n >= 1, {stream.code_size}], got shape {query.shape}")
        if not (0 <= layer < m.layers and 0 <= head < m.kv_heads and 0 <= batch < m.batch):
            raise IndexError(f"layer {layer}, head {head}, batch row {batch} out of range")
        indices, norms = stream.layout.split(query)
        R, coded = m.rows_per_token, self._coded
        target = (layer * m.batch + batch) * m.kv_heads + head
        ends = stream.archives[0].search(indices[0])
        ends = ends[(ends + 1) % nb == 0]
        rows = (ends + 1) // nb - 1
        rows = rows[(rows % R == target) & (rows // R <= coded - query.shape[0])]
        hits = []
        for row in rows.tolist():
            if stream.archives[1][row] != norms[0]:
                continue
            t = row // R
            n = query.shape[0]
            if n > 1:  # the next n-1 tokens' rows of this (layer, head): symbols, no re-packing
                got = stream.archives[0].read((t + 1) * R * nb, (t + n) * R * nb).reshape(n - 1, R, nb)[:, target]
                got_norms = stream.archives[1].read((t + 1) * R, (t + n) * R).reshape(n - 1, R)[:, target]
                if not (np.array_equal(got, indices[1:]) and np.array_equal(got_norms, norms[1:])):
                    continue
            hits.append(t)
        return np.array(hits, dtype=np.int64)

    def _row_decoder(self, role: int):
        """For FibQuant streams: one row decoded in numpy from its block indices and fp16 norm,
        the same arithmetic as `FibQuantCodec.decode` (float64 unrotation, then float32) without
        re-packing the code or torch's per-call overhead (~10x faster for a single row)."""
        if self._fast is None:
            self._fast = [None, None]
            for r, (spec, codec) in enumerate(zip((self.manifest.key_codec, self.manifest.value_codec), self.codecs)):
                if spec.family == "fibquant":
                    codewords = codec.rotated_codebook(torch.device("cpu")).codewords.double().numpy()
                    inverse = codec._rotation.inverse_matrix(torch.device("cpu")).numpy()  # noqa: SLF001
                    self._fast[r] = _fibquant_row_decoder(codewords, inverse)
        return self._fast[role]

    def to_cache(self, model=None, attention: Optional[str] = None, device="cpu") -> CompressedCache:
        """A `CompressedCache` holding exactly the stored state (codes as codes, windows exact).

        With `model`, `CompressedCache.for_model` sets the attention up ("codes" by default)."""
        m = self.manifest
        key_codec, value_codec = self.codecs
        attention = attention or ("codes" if model is not None else "decode")
        if model is not None:
            cache = CompressedCache.for_model(model, key_codec, value_codec, m.sink_tokens, m.recent_tokens,
                                              attention, m.encode_batch)
        else:
            cache = CompressedCache(key_codec, value_codec, m.sink_tokens, m.recent_tokens, attention, m.encode_batch)
        if self._state is None or self.num_tokens == 0:
            return cache
        codes = [self._code_rows(stream, 0, self._state.coded).to(device)
                 for stream in (self.key_stream, self.value_stream)]
        for index, exact in enumerate(self._state.layers):
            cache.layers.append(CompressedLayer.from_state(
                key_codec, value_codec, m.sink_tokens, m.recent_tokens, {k: v.to(device) for k, v in exact.items()},
                codes[0][:, index].permute(1, 2, 0, 3).contiguous(), codes[1][:, index].permute(1, 2, 0, 3).contiguous(),
                cache.attention, m.encode_batch))
        return cache

    # ------------------------------------------------------------------ writing
    def _check_cache(self, cache: CompressedCache) -> list:
        m = self.manifest
        layers = cache.layers
        if not layers or not all(layer.is_initialized for layer in layers):
            return []
        if len(layers) != m.layers:
            raise ValueError(f"cache has {len(layers)} layers, the saved cache {m.layers}")
        if tuple(layers[0].sink_keys.shape[:2]) != (m.batch, m.kv_heads):
            raise ValueError(f"cache [batch, kv_heads] {tuple(layers[0].sink_keys.shape[:2])} differs from the saved "
                             f"{(m.batch, m.kv_heads)}")
        if (cache.sink_tokens, cache.recent_tokens, cache.encode_batch) != (m.sink_tokens, m.recent_tokens,
                                                                              m.encode_batch):
            raise ValueError("cache window (sink_tokens, recent_tokens, encode_batch) differs from the saved one")
        if len({layer.num_coded for layer in layers}) != 1:
            raise ValueError("layers of the cache hold different numbers of coded tokens")
        return layers

    def append_from(self, cache: CompressedCache, token_ids=None) -> None:
        """Append the code rows `cache` encoded since the last call, and new token ids [n] / [1, n]."""
        self._check_writable()
        layers = self._check_cache(cache)
        if layers:
            now = layers[0].num_coded
            if now < self._coded:
                raise ValueError(f"the cache holds {now} coded tokens, {self._coded} are already saved: "
                                 "saved code streams are append-only (was the cache cropped?)")
            if now > self._coded:
                for stream, buffer in ((self.key_stream, "key_buffer"), (self.value_stream, "value_buffer")):
                    rows = torch.stack([getattr(layer, buffer).view()[..., self._coded:now, :] for layer in layers])
                    stream.append(rows.permute(3, 0, 1, 2, 4).reshape(-1, stream.code_size))  # [n, L, B, H]
                self._coded = now
        if token_ids is not None:
            ids = torch.as_tensor(token_ids).reshape(-1)
            if ids.shape[0] > len(self.tokens):
                self.tokens.append(ids[len(self.tokens):])

    def checkpoint(self, cache: CompressedCache) -> None:
        """Seal every stream, then atomically replace the exact-window snapshot: after this a
        crash loses nothing of `cache`."""
        self._check_writable()
        layers = self._check_cache(cache)
        if not layers:
            return
        self.append_from(cache)
        self.key_stream = _reseal(self.key_stream, self.manifest.key_codec)
        self.value_stream = _reseal(self.value_stream, self.manifest.value_codec)
        self.tokens.close()
        self.tokens = Archive.open(self.path / TOKENS_FILE, "a", durable=self.durable)
        state = _State([{name: getattr(layer, name) for name in
                         ("sink_keys", "sink_values", "recent_keys", "recent_values")} for layer in layers], self._coded)
        write_snapshot(self.path / SNAPSHOT_FILE, state.layers, state.coded, durable=self.durable)
        self._state = _State([{k: v.detach().cpu().clone() for k, v in d.items()} for d in state.layers], state.coded)

    def _check_writable(self) -> None:
        if self.closed or not self.writable:
            raise ValueError(f"{self.path} is not open for writing (PersistentCache.open(path, 'a'))")

    def nbytes(self) -> dict:
        """Bytes on disk: code streams, tokens, snapshot."""
        snapshot = self.path / SNAPSHOT_FILE
        return {"keys": self.key_stream.nbytes(), "values": self.value_stream.nbytes(),
                "tokens": self.tokens.info()["file_bytes"],
                "exact": snapshot.stat().st_size if snapshot.exists() else 0}

    def info(self) -> dict:
        m = self.manifest
        return {"path": str(self.path), "model": m.model_name, "fingerprint": m.model_fingerprint[:16],
                "key_codec": asdict(m.key_codec), "value_codec": asdict(m.value_codec),
                "sink_tokens": m.sink_tokens, "recent_tokens": m.recent_tokens, "encode_batch": m.encode_batch,
                "layers": m.layers, "batch": m.batch, "kv_heads": m.kv_heads, "tokens": self.num_tokens,
                "coded_tokens": self.num_coded, "token_ids": len(self.tokens), "bytes": self.nbytes()}

    def close(self) -> None:
        if self.closed:
            return
        for stream in (self.key_stream, self.value_stream):
            stream.close()
        self.tokens.close()
        self.closed = True

    def __enter__(self) -> "PersistentCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fibquant_row_decoder(codewords: np.ndarray, inverse: np.ndarray):
    def decode(stream: CodeStream, row: int) -> torch.Tensor:
        nb = stream.layout.n_blocks
        indices = stream.archives[0].read(row * nb, row * nb + nb)
        norm = np.array(stream.archives[1].read(row, row + 1), dtype=np.uint16).view(np.float16)
        x = (codewords[indices].reshape(1, -1) @ inverse) * norm.astype(np.float64)
        return torch.from_numpy(x[0].astype(np.float32))
    return decode


def _code_size(spec: CodecSpec) -> int:
    return spec.build().code_size if spec.layout() is None else spec.layout().code_size


def _snapshot_coded(path: Path) -> Optional[int]:
    from safetensors import safe_open
    try:
        with safe_open(str(path / SNAPSHOT_FILE), framework="pt") as handle:
            return int((handle.metadata() or {})["coded"])
    except Exception:  # noqa: BLE001 - absent or unreadable: rewrite it
        return None


def _reseal(stream: CodeStream, spec: CodecSpec) -> CodeStream:
    """Close (sealing the partial last block) and reopen for appending."""
    stream.close()
    return CodeStream.open(stream.path, spec, stream.code_size, "a")


def _recover(snapshot: _State, coded: int, notes: list) -> _State:
    """Combine a snapshot (coded count m0) with m whole coded tokens present in every stream."""
    m0 = snapshot.coded
    if coded >= m0:
        drop = coded - m0
        layers = [{name: (t if name.startswith("sink") else t[..., drop:, :]) for name, t in layer.items()}
                  for layer in snapshot.layers]
        if drop:
            notes.append(f"{drop} tokens were encoded after the last checkpoint" +
                         (" (window cut)" if drop > snapshot.window else ""))
        return _State(layers, coded)
    notes.append(f"codes of {m0 - coded} tokens before the snapshot were dropped: window cut, KV ends at the codes")
    layers = [{name: (t if name.startswith("sink") else t[..., :0, :]) for name, t in layer.items()}
              for layer in snapshot.layers]
    return _State(layers, coded)


def save_cache(cache: CompressedCache, path, model, token_ids=None, *, overwrite: bool = False,
               durable: bool = False) -> PersistentCache:
    """Write `cache` (a `CompressedCache` used by `model`) and its token ids to a new directory.

    Returns the store, closed. token_ids: int [n] or [1, n] with n >= the cache length (ids
    not yet in the cache, e.g. the last generated token, are kept for `resume_generate`)."""
    layers = [layer for layer in cache.layers if layer.is_initialized]
    if not layers:
        raise ValueError("cannot save an empty cache (no layer has seen a token)")
    if getattr(cache, "centre", False) or any(getattr(layer, "key_mean", None) is not None for layer in layers):
        # The format has no place for the layers' means yet: saving would lose them silently.
        raise ValueError("saving a centred cache (centre=True) is not supported yet: the per-layer means are "
                         "not part of the saved format")
    batch = layers[0].batch_size
    if token_ids is not None:
        n = torch.as_tensor(token_ids).reshape(-1).shape[0]
        if batch != 1:
            raise ValueError("token ids can only be saved with a batch-1 cache")
        if n < cache.get_seq_length():
            raise ValueError(f"{n} token ids for a cache of {cache.get_seq_length()} tokens")
    store = PersistentCache.create(path, model, cache.key_codec, cache.value_codec, sink_tokens=cache.sink_tokens,
                                   recent_tokens=cache.recent_tokens, encode_batch=cache.encode_batch, batch=batch,
                                   dtype=layers[0].sink_keys.dtype, overwrite=overwrite, durable=durable)
    store.append_from(cache, token_ids)
    store.checkpoint(cache)
    store.close()
    return store


def load_cache(path, model, attention: Optional[str] = None) -> tuple[CompressedCache, torch.Tensor]:
    """(cache, token ids [n]) of a saved cache; the model's fingerprint must match."""
    with PersistentCache.open(path, model=model) as store:
        return store.to_cache(model, attention), store.token_ids()

