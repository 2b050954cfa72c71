"""Random access into a saved cache: the read half of `fibquant.kv.persist.store.PersistentCache`."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from fibquant.archive.codes import as_codes
from fibquant.kv.cache import CompressedCache, CompressedLayer
from fibquant.kv.buffer import _decode_centred
from fibquant.kv.persist.format import MEAN_FIELDS, CodeStream
from fibquant.kv.plan import Centred


class PersistentCacheReader:
    """Reads of a saved cache, for `PersistentCache` (which sets `path`, `manifest`, `key_stream`,
    `value_stream`, `tokens`, `_state`, `_coded`, `_codecs`, `_layer_codecs`, `_builder` and `_fast`)."""

    @property
    def codecs(self):
        """(key codec, value codec) of the cache (layer 0's for per-layer codecs)."""
        if self._codecs is None:
            m = self.manifest
            self._codecs = (self._builder.entry(m.key_codec), self._builder.entry(m.value_codec))
        return self._codecs

    @property
    def layer_codecs(self) -> tuple[list, list]:
        """(key codecs, value codecs) by layer: the per-layer lists of a `LayerwiseCompressedCache`,
        else the role codec repeated."""
        if self._layer_codecs is None:
            m = self.manifest
            if m.key_codecs is None:
                self._layer_codecs = ([self.codecs[0]] * m.layers, [self.codecs[1]] * m.layers)
            else:
                self._layer_codecs = tuple([self._builder.entry(e) for e in entries]
                                           for entries in (m.key_codecs, m.value_codecs))
        return self._layer_codecs

    def _decode(self, role: int, layer: int, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Codes uint8 [B, H, n, code_size] of one layer -> [B, H, n, D], read as the cache reads them
        (the layer's codec; a centred cache's mean added)."""
        mean = self._state.layers[layer].get(MEAN_FIELDS[role])
        return _decode_centred(self.layer_codecs[role][layer], codes, mean, dtype)

    def _uniform(self) -> bool:
        """One plain codec per role for every layer and head, no means: rows of all layers decode at once."""
        from fibquant.kv.headwise import HeadwiseCodec

        return self.manifest.key_codecs is None and not self.manifest.centre and \
            not any(isinstance(codec, HeadwiseCodec) for codec in self.codecs)

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
        for index, (role, stream) in enumerate((("keys", self.key_stream), ("values", self.value_stream))):
            parts = [exact[f"sink_{role}"][..., start:min(stop, s), :].to(dtype)]
            a, b = max(start, s) - s, min(stop, s + c) - s
            if a < b:
                codes = self._code_rows(stream, a, b)[:, layer].permute(1, 2, 0, 3)
                parts.append(self._decode(index, layer, codes.contiguous(), dtype))
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
            rows = [self._code_rows(stream, token - s, token - s + 1)[0] for stream in (self.key_stream,
                                                                                      self.value_stream)]
            if self._uniform():
                return tuple(codec.decode(r.contiguous(), dtype=dtype) for codec, r in zip(self.codecs, rows))
            return tuple(torch.stack([self._decode(role, layer, r[layer][:, :, None, :].contiguous(), dtype)[:, :, 0]
                                      for layer in range(self.manifest.layers)]) for role, r in enumerate(rows))
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
        state = self._state
        exact = state.layers[layer] if state is not None else None
        sink_keys = exact["sink_keys"] if exact is not None else None
        s, c = (sink_keys.shape[-2], state.coded) if exact is not None else (0, 0)
        if exact is None or not 0 <= i < s + c + exact["recent_keys"].shape[-2]:
            raise IndexError(f"token {i} out of range for {self.num_tokens} stored tokens")
        dtype = dtype or sink_keys.dtype
        if i < s:
            return sink_keys[batch, head, i].to(dtype), exact["sink_values"][batch, head, i].to(dtype)
        if i >= s + c:
            r = i - s - c
            return exact["recent_keys"][batch, head, r].to(dtype), exact["recent_values"][batch, head, r].to(dtype)
        row = (((i - s) * m.layers + layer) * m.batch + batch) * m.kv_heads + head
        fast = self._fast if self._fast is not None else self._row_decoders()
        if fast[0] is not None and fast[1] is not None:  # FibQuant both roles: numpy, one row each
            k, v = fast[0](self.key_stream, row), fast[1](self.value_stream, row)
            return (k, v) if dtype == torch.float32 else (k.to(dtype), v.to(dtype))
        out = []
        for role, stream in enumerate((self.key_stream, self.value_stream)):
            if fast[role] is not None:
                x = fast[role](stream, row)
            else:
                codec = self.layer_codecs[role][layer]
                codec = codec.codecs[head] if hasattr(codec, "codecs") else codec  # a HeadwiseCodec
                x = codec.decode(torch.from_numpy(stream.read(row, row + 1)))[0]
            mean = exact.get(MEAN_FIELDS[role])
            out.append((x if mean is None else x + mean[batch, head]).to(dtype))
        return out[0], out[1]

    def find(self, codes, layer: int, head: int, role: str = "keys", batch: int = 0) -> np.ndarray:
        """Every coded token t (index into the coded part, token s + t of the cache) where the
        code rows of tokens t, t+1, ..., t+n-1 in (layer, head, batch row) equal `codes`
        uint8 [n, code_size] (e.g. a paragraph's keys in one head), sorted; verified exact.

        In place, through the archive (`CodeArchive.find`): in the token-major stream the n rows
        are `rows_per_token` rows apart, so the query is n codes at that stride and phase
        (layer, batch row, head); the index stream's suffix keys check every code's index
        symbols, candidates come from the rarest chunk, and the fp16 norms are compared."""
        stream, m = self._search_stream(role), self.manifest
        query = as_codes(codes)
        if query.ndim != 2 or query.shape[0] < 1 or query.shape[1] != stream.code_size:
            raise ValueError(f"codes must be uint8 [n >= 1, {stream.code_size}], got shape {query.shape}")
        if not (0 <= layer < m.layers and 0 <= head < m.kv_heads and 0 <= batch < m.batch):
            raise IndexError(f"layer {layer}, head {head}, batch row {batch} out of range "
                             f"({m.layers} layers, {m.kv_heads} KV heads, batch {m.batch})")
        R = m.rows_per_token
        return stream.find(query, R, (layer * m.batch + batch) * m.kv_heads + head, self._coded * R) // R

    def _search_stream(self, role: str) -> CodeStream:
        stream = {"keys": self.key_stream, "values": self.value_stream}.get(role)
        if stream is None:
            raise ValueError(f"role must be 'keys' or 'values', got {role!r}")
        if stream.layout is None:
            raise ValueError("code search needs a [norm][indices] codec stream (FibQuant, TurboQuant)")
        return stream

    def find_many(self, codes, layers, heads, role: str = "keys", batch: int = 0) -> list[np.ndarray]:
        """`find` for q sequences of n codes at once, uint8 [q, n, code_size]; layers / heads: one
        int or one per query. One compiled pass over the batch; one sorted array per query."""
        stream, m = self._search_stream(role), self.manifest
        query = as_codes(codes)
        if query.ndim != 3 or query.shape[1] < 1 or query.shape[2] != stream.code_size:
            raise ValueError(f"codes must be uint8 [n >= 1, {stream.code_size}] per query, got shape "
                             f"{query.shape[1:] if query.ndim == 3 else query.shape}")
        q = query.shape[0]
        layers = np.broadcast_to(np.asarray(layers, dtype=np.int64), (q,))
        heads = np.broadcast_to(np.asarray(heads, dtype=np.int64), (q,))
        if q and not ((layers >= 0).all() and (layers < m.layers).all() and (heads >= 0).all()
                      and (heads < m.kv_heads).all() and 0 <= batch < m.batch):
            raise IndexError(f"layer, head or batch row out of range ({m.layers} layers, {m.kv_heads} KV heads, "
                             f"batch {m.batch})")
        R = m.rows_per_token
        offsets = (layers * m.batch + batch) * m.kv_heads + heads
        found = stream.find_many(query, R, offsets, self._coded * R)
        return [rows // R for rows in found]

    def _row_decoders(self) -> list:
        """Per role, for a FibQuant stream of one codec (no per-layer codecs, no means): a numpy
        decoder of one row (see `_fibquant_row_decoder`), else None."""
        from fibquant.codecs.fibquant import FibQuantCodec

        fast = [None, None]
        for role, (codec, stream) in enumerate(zip(self.codecs, (self.key_stream, self.value_stream))):
            if self.manifest.key_codecs is None and not self.manifest.centre and type(codec) is FibQuantCodec \
                    and stream.layout is not None and stream.layout.norm_bytes == 2:
                codewords = codec.reader(torch.device("cpu")).codewords.double().numpy()
                inverse = codec._rotation.inverse_matrix(torch.device("cpu")).numpy()  # noqa: SLF001
                fast[role] = _fibquant_row_decoder(codewords, inverse, stream.layout.n_blocks)
        self._fast = fast
        return fast

    def to_cache(self, model=None, attention: Optional[str] = None, device="cpu") -> CompressedCache:
        """A `CompressedCache` holding exactly the stored state (codes as codes, windows exact,
        a centred cache's means); a `LayerwiseCompressedCache` for per-layer codecs.

        With `model`, the attention is chosen as `CompressedCache.for_model` does ("codes" by default: run the
        model inside `fibquant.attention_on_codes(model)`)."""
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available here (torch {torch.__version__}); "
                             "load on 'cpu'")
        m = self.manifest
        key_codec, value_codec = self.codecs
        attention = attention or ("codes" if model is not None else "decode")
        plan = Centred() if m.centre else None
        if m.key_codecs is not None:
            from fibquant.kv.headwise import LayerwiseCompressedCache
            from fibquant.kv.model import check_model_supported

            if model is not None:
                from fibquant.kv.attention.switch import codes_or_decode

                info = check_model_supported(model, key_codec, value_codec)
                if attention == "codes":
                    attention = codes_or_decode(model, info["latent"])[0]
            cache = LayerwiseCompressedCache(*self.layer_codecs, m.sink_tokens, m.recent_tokens, attention,
                                             m.encode_batch, layer_plan=plan)
        elif model is not None:
            cache = CompressedCache.for_model(model, key_codec, value_codec, m.sink_tokens, m.recent_tokens,
                                              attention, m.encode_batch, layer_plan=plan)
        else:
            cache = CompressedCache(key_codec, value_codec, m.sink_tokens, m.recent_tokens, attention, m.encode_batch,
                                    layer_plan=plan)
        if self._state is None or self.num_tokens == 0:
            return cache
        codes = [self._code_rows(stream, 0, self._state.coded).to(device)
                 for stream in (self.key_stream, self.value_stream)]
        for index, exact in enumerate(self._state.layers):
            layer = CompressedLayer.from_state(
                self.layer_codecs[0][index], self.layer_codecs[1][index], m.sink_tokens, m.recent_tokens,
                {k: v.to(device) for k, v in exact.items()}, codes[0][:, index].permute(1, 2, 0, 3).contiguous(),
                codes[1][:, index].permute(1, 2, 0, 3).contiguous(), cache.attention, m.encode_batch)
            layer.centre = m.centre
            if "key_mean" in exact:
                layer.key_mean, layer.value_mean = (exact[n].to(device).clone() for n in MEAN_FIELDS)
            cache.layers.append(layer)
        return cache


# Every fp16 bit pattern as float64 (exact): a stored norm symbol -> its value by one lookup.
_FP16_VALUES = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64)


def _fibquant_row_decoder(codewords: np.ndarray, inverse: np.ndarray, n_blocks: int):
    """Row -> float32 [D] tensor with `FibQuantCodec.decode`'s arithmetic: codewords (float64)
    gathered by the row's block indices, times the inverse rotation (float64), times the fp16
    norm, rounded to float32. The indices and the norm are read in place (`Archive.view`: for
    N = 256 and the 2^16 norm alphabet, views of the mapped block payloads), nothing is re-packed."""
    values = _FP16_VALUES

    def decode(stream: CodeStream, row: int) -> torch.Tensor:
        indices, norms = stream.archives
        block = indices.view(row * n_blocks, n_blocks)
        norm = values[int(norms.view(row, 1)[0])]
        x = (codewords[block].reshape(-1) @ inverse) * norm
        return torch.from_numpy(x.astype(np.float32))
    return decode
