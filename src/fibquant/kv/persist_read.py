"""Random access into a saved cache: the read half of `fibquant.kv.persist.PersistentCache`."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from fibquant.kv.cache import CompressedCache, CompressedLayer
from fibquant.kv.codes import _decode_centred
from fibquant.kv.persist_format import MEAN_FIELDS, CodeStream


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
        from fibquant.kv.layered import HeadwiseCodec

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
        for role, stream in enumerate((self.key_stream, self.value_stream)):
            fast = self._row_decoder(role)
            if fast is not None:
                x = fast(stream, row)
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
        has_norms = norms is not None
        for row in rows.tolist():
            if has_norms and stream.archives[1][row] != norms[0]:
                continue
            t = row // R
            n = query.shape[0]
            if n > 1:  # the next n-1 tokens' rows of this (layer, head): symbols, no re-packing
                got = stream.archives[0].read((t + 1) * R * nb, (t + n) * R * nb).reshape(n - 1, R, nb)[:, target]
                same = np.array_equal(got, indices[1:])
                if same and has_norms:
                    got_norms = stream.archives[1].read((t + 1) * R, (t + n) * R).reshape(n - 1, R)[:, target]
                    same = np.array_equal(got_norms, norms[1:])
                if not same:
                    continue
            hits.append(t)
        return np.array(hits, dtype=np.int64)

    def _row_decoder(self, role: int):
        """For FibQuant streams: one row decoded in numpy from its block indices and fp16 norm,
        the same arithmetic as `FibQuantCodec.decode` (float64 unrotation, then float32) without
        re-packing the code or torch's per-call overhead (~10x faster for a single row)."""
        from fibquant.codecs.fibquant import FibQuantCodec

        if self._fast is None:
            self._fast = [None, None]
            for r, codec in enumerate(self.codecs):
                if self.manifest.key_codecs is None and type(codec) is FibQuantCodec:
                    codewords = codec.rotated_codebook(torch.device("cpu")).codewords.double().numpy()
                    inverse = codec._rotation.inverse_matrix(torch.device("cpu")).numpy()  # noqa: SLF001
                    self._fast[r] = _fibquant_row_decoder(codewords, inverse)
        return self._fast[role]

    def to_cache(self, model=None, attention: Optional[str] = None, device="cpu") -> CompressedCache:
        """A `CompressedCache` holding exactly the stored state (codes as codes, windows exact,
        a centred cache's means); a `LayerwiseCompressedCache` for per-layer codecs.

        With `model`, the attention is set up as `CompressedCache.for_model` does ("codes" by default)."""
        m = self.manifest
        key_codec, value_codec = self.codecs
        attention = attention or ("codes" if model is not None else "decode")
        if m.key_codecs is not None:
            from fibquant.kv.layered import LayerwiseCompressedCache
            from fibquant.kv.model import check_model_supported

            if model is not None:
                from fibquant.kv.attention import try_use_coded_attention

                check_model_supported(model, key_codec, value_codec)
                if attention == "codes" and not try_use_coded_attention(model):
                    attention = "decode"
            cache = LayerwiseCompressedCache(*self.layer_codecs, m.sink_tokens, m.recent_tokens, attention,
                                             m.encode_batch)
            cache.centre = m.centre
        elif model is not None:
            cache = CompressedCache.for_model(model, key_codec, value_codec, m.sink_tokens, m.recent_tokens,
                                              attention, m.encode_batch, m.centre)
        else:
            cache = CompressedCache(key_codec, value_codec, m.sink_tokens, m.recent_tokens, attention, m.encode_batch,
                                    m.centre)
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


def _fibquant_row_decoder(codewords: np.ndarray, inverse: np.ndarray):
    def decode(stream: CodeStream, row: int) -> torch.Tensor:
        nb = stream.layout.n_blocks
        indices = stream.archives[0].read(row * nb, row * nb + nb)
        norm = np.array(stream.archives[1].read(row, row + 1), dtype=np.uint16).view(np.float16)
        x = (codewords[indices].reshape(1, -1) @ inverse) * norm.astype(np.float64)
        return torch.from_numpy(x[0].astype(np.float32))
    return decode

