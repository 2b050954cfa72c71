"""A vLLM attention backend whose KV pages hold FibQuant (or TurboQuant) codes.

Page layout: one slot per (token, KV head) of `slot_bytes` bytes = [key code][value code][pad to
even], each code the codec's fixed [fp16 norm][packed indices]. vLLM's page arithmetic stays exact
because the backend publishes the slot size through `customize_spec` (`state_content_bytes`), the
hook vLLM's own TurboQuant backend uses; the physical layout is head-major (LBHNC, as CPU_ATTN).

Exact window: every token written to the cache is stored as codes only. The tokens of the running
forward (a prefill chunk, or the one decode token) attend to each other exactly, since their
float K/V are at hand, and to every earlier token through its codes (the kernels of
`fibquant.kv.coded_kernels`, one joint softmax: `fibquant.kv.attention.attend_codes`). There are no
exact attention sinks: a page has no room for floats, and a side buffer outside the pages would
break the page arithmetic. A chunked prefill therefore compresses earlier chunks, exactly as
`CompressedCache(sink_tokens=0, recent_tokens=0)` in transformers does.

Not supported (a clear NotImplementedError at engine start): ALiBi, sliding windows, logit soft
caps, attention-sink parameters, encoder / cross attention, fp8 `kv_cache_dtype` (the codes are the
cache dtype).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from fibquant.integrations.vllm.config import active_config
from fibquant.kv.attention import attend_codes
from fibquant.kv.codes import CodedKV


def _config():
    config = active_config()
    if config is None:
        raise RuntimeError("the FibQuant vLLM backend was selected while FIBQUANT_VLLM_CACHE is unset")
    return config


class FibQuantAttentionBackend(AttentionBackend):
    """Registered over CPU_ATTN (and as CUSTOM) by `fibquant.integrations.vllm.register`."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM resolves a backend by enum name; CUSTOM is the one for out-of-tree backends

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        try:
            _config().codecs(head_size)
        except (ValueError, FileNotFoundError):
            return False
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """One slot of `slot_bytes` per (token, KV head): the page size vLLM allocates by."""
        if spec.state_content_bytes is not None:
            return spec
        return replace(spec, state_content_bytes=_config().slot_bytes(spec.head_size))

    @staticmethod
    def get_impl_cls() -> type["FibQuantAttentionImpl"]:
        return FibQuantAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["FibQuantMetadataBuilder"]:
        return FibQuantMetadataBuilder


@dataclass
class FibQuantMetadata:
    """Per-request token ranges on the host: the forward loops over requests."""

    num_actual_tokens: int
    query_start_loc: list[int]   # [num_reqs + 1]
    seq_lens: list[int]          # [num_reqs]: tokens in the cache after this forward
    block_table: torch.Tensor    # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor   # [num_actual_tokens] int64


class FibQuantMetadataBuilder(AttentionMetadataBuilder[FibQuantMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FibQuantMetadata:
        meta = common_attn_metadata
        return FibQuantMetadata(
            num_actual_tokens=meta.num_actual_tokens,
            query_start_loc=meta.query_start_loc_cpu[: meta.num_reqs + 1].tolist(),
            seq_lens=meta.seq_lens[: meta.num_reqs].cpu().tolist(),
            block_table=meta.block_table_tensor,
            slot_mapping=meta.slot_mapping,
        )


class FibQuantAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks=None) -> None:
        unsupported = {"ALiBi slopes": alibi_slopes is not None, "a sliding window": sliding_window is not None,
                       "logit soft capping": bool(logits_soft_cap), "attention-sink parameters": sinks is not None,
                       f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
                       f"kv_cache_dtype={kv_cache_dtype!r}": kv_cache_dtype != "auto"}
        refused = [name for name, hit in unsupported.items() if hit]
        if refused:
            raise NotImplementedError(f"the FibQuant vLLM backend does not support {', '.join(refused)}; "
                                      "unset FIBQUANT_VLLM_CACHE to serve this model with vLLM's own backend")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        config = _config()
        self.key_codec, self.value_codec = config.codecs(head_size)
        self.key_bytes = self.key_codec.code_size
        self.value_bytes = self.value_codec.code_size

    def _pages(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The layer's cache as bytes [num_blocks, num_kv_heads, block_size, slot_bytes]."""
        return kv_cache.view(torch.uint8)

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """Encode the forward's new K/V [N, Hk*D] and write their codes at `slot_mapping` [N]."""
        count = slot_mapping.shape[0]
        if count == 0:
            return
        pages = self._pages(kv_cache)
        block_size = pages.shape[2]
        keys = key[:count].reshape(count, self.num_kv_heads, self.head_size)
        values = value[:count].reshape(count, self.num_kv_heads, self.head_size)
        slots = slot_mapping.to(torch.long)
        valid = slots >= 0  # padded tokens carry slot -1
        if not bool(valid.all()):
            slots, keys, values = slots[valid], keys[valid], values[valid]
        codes = torch.cat([self.key_codec.encode(keys), self.value_codec.encode(values)], dim=-1)
        pages[slots // block_size, :, slots % block_size, : codes.shape[-1]] = codes

    def _context_codes(self, pages: torch.Tensor, blocks: torch.Tensor, length: int):
        """Key and value codes [1, Hk, length, code_size] of a request's first `length` tokens."""
        block_size = pages.shape[2]
        used = blocks[: -(-length // block_size)].to(torch.long)
        rows = pages[used].transpose(0, 1).reshape(self.num_kv_heads, -1, pages.shape[-1])[:, :length]
        return (rows[..., : self.key_bytes].unsqueeze(0),
                rows[..., self.key_bytes: self.key_bytes + self.value_bytes].unsqueeze(0))

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: FibQuantMetadata | None, output: torch.Tensor | None = None,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        """query [N, Hq*D] (or [N, Hq, D]), key/value [N, Hk*D] -> output [N, Hq*D]."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the FibQuant backend")
        if output is None:
            output = torch.zeros(query.shape[0], self.num_heads * self.head_size, dtype=query.dtype,
                                 device=query.device)
        if attn_metadata is None:  # profiling / warm-up run
            return output
        flat_out = output.view(output.shape[0], -1)
        pages = self._pages(kv_cache)
        heads, dim = self.num_kv_heads, self.head_size
        starts = attn_metadata.query_start_loc
        for request, total in enumerate(attn_metadata.seq_lens):
            start, stop = starts[request], starts[request + 1]
            tokens = stop - start
            if tokens <= 0:
                continue
            past = total - tokens
            if past > 0:
                key_codes, value_codes = self._context_codes(pages, attn_metadata.block_table[request], past)
            else:
                key_codes = pages.new_empty((1, heads, 0, self.key_bytes))
                value_codes = pages.new_empty((1, heads, 0, self.value_bytes))
            new_keys = key[start:stop].reshape(tokens, heads, dim).transpose(0, 1).unsqueeze(0)
            new_values = value[start:stop].reshape(tokens, heads, dim).transpose(0, 1).unsqueeze(0)
            empty = new_keys.new_empty((1, heads, 0, dim))
            coded = CodedKV(sink_keys=empty, sink_values=empty, key_codes=key_codes, value_codes=value_codes,
                            recent_keys=empty, recent_values=empty, new_keys=new_keys, new_values=new_values,
                            key_codec=self.key_codec, value_codec=self.value_codec)
            queries = query[start:stop].reshape(tokens, self.num_heads, dim).transpose(0, 1).unsqueeze(0)
            attended = attend_codes(queries, coded, None, self.scale)  # [1, T, Hq, D]
            flat_out[start:stop] = attended.reshape(tokens, -1).to(flat_out.dtype)
        return output
