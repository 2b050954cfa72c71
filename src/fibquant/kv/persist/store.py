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

import warnings
from pathlib import Path
from typing import Optional

import torch

from fibquant.archive import Archive, RecoveryWarning
from fibquant.archive.format import ArchiveError
from fibquant.archive.writer import WriterLock, check_new_store
from fibquant.kv.cache import CompressedCache
from fibquant.kv.model import check_model_supported
from fibquant.kv.persist.entries import (CodecBuilder, codec_mismatch, entry_from_codec, entry_summary,
                                        stream_format)
from fibquant.kv.persist.format import (MANIFEST_FILE, SNAPSHOT_FILE, TOKENS_FILE, CodeStream, open_tokens,
                                        write_json_atomic, write_snapshot)
from fibquant.kv.persist.model_identity import identity_summary, model_identity, model_mismatch
from fibquant.kv.persist.read import PersistentCacheReader
from fibquant.kv.persist.state import (CacheManifest, ExactState, parse_stream_format, read_manifest,
                                       recover as _recover, snapshot_coded)


class PersistentCache(PersistentCacheReader):
    """A saved `CompressedCache` directory; see the module docstring. Build with create/open;
    the reads (`layer_kv`, `kv`, `token`, `find`, `to_cache`) are in `PersistentCacheReader`.

    A writer (create, open in mode "a") holds the store's writer lock until `close`
    (`fibquant.archive.writer`: a second writer gets StoreLockedError, readers are not blocked).
    A new store is built under a temporary name and appears at `path` with its first checkpoint
    (an overwritten one is replaced then); closed before any checkpoint, it is deleted."""

    def __init__(self, path: Path, manifest: CacheManifest, keys: CodeStream, values: CodeStream, tokens: Archive,
                 state: Optional[ExactState], writable: bool, durable: bool, *, root: Optional[Path] = None,
                 lock: Optional[WriterLock] = None):
        self.path, self.manifest, self.writable, self.durable = path, manifest, writable, durable
        self.key_stream, self.value_stream, self.tokens = keys, values, tokens
        self._state = state
        self._coded = state.coded if state is not None else 0  # code tokens written to the streams
        self._codecs = self._layer_codecs = None
        self._builder = CodecBuilder(path)
        self._fast = None
        self._codec_checks: dict = {}  # (role, layer) -> the codec object verified for it
        self._codec_hashed: dict = {}  # (id(entry), id(codec)) -> (codec, entry), compared once
        self._root = root or path  # where the files are: a new store's temporary directory until published
        self._lock = lock
        self.closed = False

    # ------------------------------------------------------------------ create / open
    @classmethod
    def create(cls, path, model, key_codec, value_codec, *, sink_tokens: int = 4, recent_tokens: int = 32,
               encode_batch: int = 16, batch: int = 1, dtype: torch.dtype = torch.float32,
               overwrite: bool = False, durable: bool = False, key_codecs=None, value_codecs=None,
               centre: bool = False) -> "PersistentCache":
        """An empty saved cache for `model` (fingerprinted) and the given codecs and window.

        key_codecs / value_codecs: one codec per layer (a `LayerwiseCompressedCache`), else None.
        Calibrated codecs are written under codecs/ (safetensors, `Codec.save`). centre: the
        cache subtracts per-(layer, head) means (`CompressedCache(layer_plan=Centred())`). The store is
        built aside and appears at `path` with its first `checkpoint` (see the class docstring)."""
        info = check_model_supported(model, key_codec, value_codec)
        if any(window is not None for window in info["windows"]):
            raise ValueError("saving caches of sliding-window / hybrid models is not supported: a sliding layer "
                             "drops the tokens that leave its window, and saved code streams are append-only")
        if (key_codecs is None) != (value_codecs is None):
            raise ValueError("pass per-layer codecs for both roles (key_codecs and value_codecs) or neither")
        path = Path(path)
        check_new_store(path, overwrite, "directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = WriterLock.acquire(path)
        root = None
        try:
            check_new_store(path, overwrite, "directory")
            root = lock.building()
            root.mkdir()
            store = cls._build(path, root, model, info, key_codec, value_codec, key_codecs, value_codecs, durable,
                               lock, (sink_tokens, recent_tokens, encode_batch, batch, dtype, centre))
        except BaseException:
            if root is not None:
                lock.discard(root)
            lock.release()
            raise
        return store

    @classmethod
    def _build(cls, path, root, model, info, key_codec, value_codec, key_codecs, value_codecs, durable, lock,
               window) -> "PersistentCache":
        """The files of a new store in `root` (its temporary directory)."""
        from fibquant.kv.model import describe_model

        sink_tokens, recent_tokens, encode_batch, batch, dtype, centre = window
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
            else model.config
        written: dict = {}
        per_layer = None if key_codecs is None else \
            [[entry_from_codec(c, root, written) for c in codecs] for codecs in (key_codecs, value_codecs)]
        streams = {role: stream_format([codec] + list(codecs or ())) for role, codec, codecs in
                   (("keys", key_codec, key_codecs), ("values", value_codec, value_codecs))}
        manifest = CacheManifest(model_identity(model), entry_from_codec(key_codec, root, written),
                                 entry_from_codec(value_codec, root, written), sink_tokens, recent_tokens,
                                 encode_batch, info["layers"], batch, info["kv_heads"], str(dtype),
                                 int(config.vocab_size), describe_model(model),
                                 *(per_layer or (None, None)), bool(centre), streams)
        write_json_atomic(root / MANIFEST_FILE, manifest.to_json(), durable=durable)
        keys, values = (CodeStream.create(root / role, *parse_stream_format(streams[role], role)[::-1],
                                          durable=durable) for role in ("keys", "values"))
        tokens = Archive.create(root / TOKENS_FILE, manifest.vocab_size, durable=durable, lock=False)
        store = cls(path, manifest, keys, values, tokens, None, True, durable, root=root, lock=lock)
        store._codecs = (key_codec, value_codec)
        store._layer_codecs = None if key_codecs is None else (list(key_codecs), list(value_codecs))
        return store

    @classmethod
    def open(cls, path, mode: str = "r", *, model=None, durable: bool = False) -> "PersistentCache":
        """Open lazily: the manifest, the archives' record headers and the small snapshot are
        read; no code is decoded. With `model`, it must be the saved model (`model_mismatch`: config,
        parameter names/shapes/dtypes exactly, weights within a tolerance; its layers and KV heads
        those of the manifest; ValueError otherwise). A torn tail is recovered with a
        RecoveryWarning; in mode "a" (the writer lock taken first) it is then cut off the files,
        only once every check has passed: a refused open changes no byte."""
        if mode not in ("r", "a"):
            raise ValueError(f"mode must be 'r' or 'a', got {mode!r}")
        path = Path(path)
        lock = WriterLock.acquire(path) if mode == "a" and path.parent.is_dir() else None
        try:
            if path.is_file():
                raise ValueError(f"{path} is a file, not a saved KV cache (a directory)")
            if not path.exists():
                raise ValueError(f"{path}: no saved KV cache here (no such directory)")
            return cls._open(path, mode, model, durable, lock)
        except BaseException:
            if lock is not None:
                lock.release()
            raise

    @classmethod
    def _open(cls, path: Path, mode: str, model, durable: bool, lock) -> "PersistentCache":
        manifest = read_manifest(path)
        builder = CodecBuilder(path)
        if model is not None:
            check_same_model(path, manifest, model, builder)
        entries = {"keys": manifest.key_codec, "values": manifest.value_codec}
        formats = {role: manifest.stream(role, path, lambda r: builder.entry(entries[r]).code_size)[::-1]
                   for role in entries}  # (layout, code_size) of each stream
        state, notes = _recover(path, manifest, formats, mode)
        if notes:
            warnings.warn(f"{path}: recovered {state.length if state else 0} tokens of KV: " + "; ".join(notes),
                          RecoveryWarning, stacklevel=3)
        # Every check has passed: only now may mode "a" cut the files back to the recovered state.
        open_rows = (state.coded if state is not None else 0) * manifest.rows_per_token if mode == "a" else None
        with warnings.catch_warnings():  # reported above, once
            warnings.simplefilter("ignore", RecoveryWarning)
            keys = CodeStream.open(path / "keys", *formats["keys"], mode, open_rows, durable=durable)
            values = CodeStream.open(path / "values", *formats["values"], mode, open_rows, durable=durable)
            tokens = open_tokens(path / TOKENS_FILE, mode, durable)
        store = cls(path, manifest, keys, values, tokens, state, mode == "a", durable, lock=lock)
        store._builder = builder
        if mode == "a" and state is not None and (state.coded != snapshot_coded(path) or notes):
            write_snapshot(path / SNAPSHOT_FILE, state.layers, state.coded)  # the recovered state, consistent
        return store

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
        self._check_codecs(layers)
        return layers

    def _check_codecs(self, layers) -> None:
        """Every layer's key/value codec must be the saved one (family, config, codebook/rotation/state
        hash): codes of another codec in the same stream would decode to other vectors. Each codec
        object is hashed once per store (then recognised by identity)."""
        m = self.manifest
        for role, (attr, entry, entries) in enumerate((("key_codec", m.key_codec, m.key_codecs),
                                                       ("value_codec", m.value_codec, m.value_codecs))):
            for index, layer in enumerate(layers):
                codec = getattr(layer, attr)
                if self._codec_checks.get((role, index)) is codec:
                    continue
                expected = entries[index] if entries is not None else entry
                seen = self._codec_hashed.get((id(expected), id(codec)))
                if seen is None or seen[0] is not codec:
                    problem = codec_mismatch(expected, codec)
                    if problem is not None:
                        raise ValueError(f"{self.path}: the cache's {('key', 'value')[role]} codec of layer {index} "
                                         f"is not the saved one ({problem}); its codes cannot be appended")
                    self._codec_hashed[(id(expected), id(codec))] = (codec, expected)
                self._codec_checks[(role, index)] = codec

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
        crash loses nothing of `cache`. A new store's first checkpoint puts it at its path."""
        self._check_writable()
        layers = self._check_cache(cache)
        if not layers:
            return
        self.append_from(cache)
        for archive in (self.key_stream, self.value_stream, self.tokens):
            archive.close()  # sealed (fsynced when durable)
        state = ExactState([{name: getattr(layer, name) for name in
                             ("sink_keys", "sink_values", "recent_keys", "recent_values", "key_mean", "value_mean")
                             if getattr(layer, name) is not None} for layer in layers], self._coded)
        write_snapshot(self._root / SNAPSHOT_FILE, state.layers, state.coded, durable=self.durable)
        if self._root != self.path:
            self._lock.publish(self._root, self.durable)
            self._root = self.path
        self.key_stream, self.value_stream = (CodeStream.open(self._root / role, stream.layout, stream.code_size,
                                                              "a", durable=self.durable)
                                              for role, stream in (("keys", self.key_stream),
                                                                   ("values", self.value_stream)))
        self.tokens = open_tokens(self._root / TOKENS_FILE, "a", self.durable)
        self._state = ExactState([{k: v.detach().cpu().clone() for k, v in d.items()} for d in state.layers],
                                 state.coded)

    def _check_writable(self) -> None:
        if self.closed or not self.writable:
            raise ValueError(f"{self.path} is not open for writing (PersistentCache.open(path, 'a'))")

    def nbytes(self) -> dict:
        """Bytes on disk: code streams, tokens, snapshot."""
        snapshot = self._root / SNAPSHOT_FILE
        return {"keys": self.key_stream.nbytes(), "values": self.value_stream.nbytes(),
                "tokens": self.tokens.info()["file_bytes"],
                "exact": snapshot.stat().st_size if snapshot.exists() else 0}

    def verify(self) -> int:
        """Check the checksum of every block of the code streams and token ids now (reads check
        only the blocks they touch; the manifest and snapshot were checked at open). ValueError
        naming the first corrupt block; returns the blocks checked."""
        try:
            return sum(archive.verify() for archive in (self.key_stream, self.value_stream, self.tokens))
        except ArchiveError as exc:
            raise ValueError(f"{self.path}: corrupt payload ({exc})") from None

    def info(self) -> dict:
        m = self.manifest
        return {"path": str(self.path), "model": m.model_name, "fingerprint": identity_summary(m.model_fingerprint),
                "key_codec": entry_summary(m.key_codec), "value_codec": entry_summary(m.value_codec),
                "per_layer_codecs": m.key_codecs is not None, "centre": m.centre,
                "sink_tokens": m.sink_tokens, "recent_tokens": m.recent_tokens, "encode_batch": m.encode_batch,
                "layers": m.layers, "batch": m.batch, "kv_heads": m.kv_heads, "tokens": self.num_tokens,
                "coded_tokens": self.num_coded, "token_ids": len(self.tokens), "bytes": self.nbytes()}

    def close(self) -> None:
        """Seal the streams and release the writer lock; a new store never checkpointed is deleted."""
        if self.closed:
            return
        self.closed = True
        try:
            for archive in (self.key_stream, self.value_stream, self.tokens):
                archive.close()
        finally:
            try:
                if self._root != self.path:
                    self._lock.discard(self._root)
            finally:
                if self._lock is not None:
                    self._lock.release()
                    self._lock = None

    def __enter__(self) -> "PersistentCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_same_model(path: Path, manifest: CacheManifest, model, builder: CodecBuilder) -> None:
    """ValueError unless `model` is the saved model (`model_mismatch`) with the manifest's layers and
    KV heads, and the saved codecs fit it: every check an append needs, made before any repair."""
    problem = model_mismatch(manifest.model_fingerprint, model)
    if problem is not None:
        raise ValueError(f"{path} was saved with another model ({manifest.model_name!r}; {problem}): its "
                         "keys/values are meaningless for this one")
    info = check_model_supported(model, builder.entry(manifest.key_codec), builder.entry(manifest.value_codec))
    if (info["layers"], info["kv_heads"]) != (manifest.layers, manifest.kv_heads):
        raise ValueError(f"{path}: the manifest says {manifest.layers} layers x {manifest.kv_heads} KV heads, the "
                         f"model has {info['layers']} x {info['kv_heads']}")


def save_cache(cache: CompressedCache, path, model, token_ids=None, *, overwrite: bool = False,
               durable: bool = False) -> PersistentCache:
    """Write `cache` (a `CompressedCache` used by `model`) and its token ids to a new directory.

    Returns the store, closed. token_ids: int [n] or [1, n] with n >= the cache length (ids
    not yet in the cache, e.g. the last generated token, are kept for `resume_generate`)."""
    refusal = cache.layer_plan.save_refusal(cache)
    if refusal is not None:
        raise ValueError(f"this cache cannot be saved: {refusal}")
    layers = [layer for layer in cache.layers if layer.is_initialized]
    if not layers:
        raise ValueError("cannot save an empty cache (no layer has seen a token)")
    batch = layers[0].batch_size
    if token_ids is not None:
        n = torch.as_tensor(token_ids).reshape(-1).shape[0]
        if batch != 1:
            raise ValueError("token ids can only be saved with a batch-1 cache")
        if n < cache.get_seq_length():
            raise ValueError(f"{n} token ids for a cache of {cache.get_seq_length()} tokens")
    store = PersistentCache.create(path, model, cache.key_codec, cache.value_codec, sink_tokens=cache.sink_tokens,
                                   recent_tokens=cache.recent_tokens, encode_batch=cache.encode_batch, batch=batch,
                                   dtype=layers[0].sink_keys.dtype, overwrite=overwrite, durable=durable,
                                   key_codecs=getattr(cache, "key_codecs", None),
                                   value_codecs=getattr(cache, "value_codecs", None),
                                   centre=any(layer.centre for layer in layers))
    store.append_from(cache, token_ids)
    store.checkpoint(cache)
    store.close()
    return store


def load_cache(path, model, attention: Optional[str] = None) -> tuple[CompressedCache, torch.Tensor]:
    """(cache, token ids [n]) of a saved cache; `model` must be the saved model (`model_mismatch`)."""
    with PersistentCache.open(path, model=model) as store:
        return store.to_cache(model, attention), store.token_ids()

