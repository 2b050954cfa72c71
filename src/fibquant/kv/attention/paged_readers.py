"""Decode attention over paged codes for any code family: each sequence's coded range gathered from the
pages and attended through its codecs' readers (`attend_codes`: the family's registered one-token step,
else the reader's torch methods). What `paged.paged_decode_attention` runs for codecs its numba kernel does
not read (FibQuant-E8, FibQuant-RVQ, a new family); same arguments, same columns, same result as
`paged.paged_decode_attention_reference` to float32 rounding.
"""
from __future__ import annotations

import torch

from fibquant.codecs.base import Codec
from fibquant.kv.attention.reference import gather_paged_codes
from fibquant.kv.buffer import CodedKV
from fibquant.kv.options import DEFAULT_OPTIONS, AttentionOptions


def paged_by_readers(query: torch.Tensor, pages: torch.Tensor, tables: torch.Tensor, starts: list[int],
                     stops: list[int], key_codec: Codec, value_codec: Codec, exact_keys: torch.Tensor,
                     exact_values: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor, scaling: float, *,
                     key_offset: int = 0, value_offset: int | None = None, sinks: torch.Tensor | None = None,
                     softcap: float | None = None, out: torch.Tensor | None = None, exact_rows=None,
                     options: AttentionOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """One decode step of B sequences -> out [B, Hq, Dv] (float32, or `out` filled in place); the arguments
    are `paged.paged_decode_attention`'s (shapes there)."""
    from fibquant.kv.attention.entry import attend_codes  # entry pulls in transformers: imported on use

    batch, q_heads, _ = query.shape
    key_size, value_size = key_codec.code_size, value_codec.code_size
    value_offset = key_offset + key_size if value_offset is None else value_offset
    if len(starts) != batch or len(stops) != batch:
        raise ValueError(f"starts and stops need {batch} entries, got {len(starts)} and {len(stops)}")
    if min(key_offset, value_offset) < 0 or max(key_offset + key_size, value_offset + value_size) > pages.shape[3]:
        raise ValueError(f"codes at bytes {key_offset}+{key_size} / {value_offset}+{value_size} do not fit a slot "
                         f"of {pages.shape[3]} bytes")
    if out is None:
        out = torch.empty(batch, q_heads, value_codec.dim, dtype=torch.float32)
    empty = exact_keys[:1, :, :0]
    for b in range(batch):
        key_codes, value_codes = gather_paged_codes(pages[..., key_offset:], tables, b, starts[b],
                                                    max(stops[b], starts[b]), value_offset - key_offset, key_size,
                                                    value_size)
        r = b if exact_rows is None else int(exact_rows[b])
        kv = CodedKV(exact_keys[r:r + 1], exact_values[r:r + 1], key_codes, value_codes, empty, empty[..., :0, :],
                     new_keys[b:b + 1], new_values[b:b + 1], key_codec, value_codec, options=options)
        out[b] = attend_codes(query[b:b + 1, :, None], kv, None, scaling, softcap=softcap, sinks=sinks)[0, 0]
    return out
