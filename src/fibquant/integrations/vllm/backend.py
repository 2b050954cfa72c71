"""A vLLM attention backend whose KV pages hold FibQuant (or TurboQuant) codes.

Page layout: one slot per (token, KV head) of `slot_bytes` bytes = [key code][value code][pad to
even], each code the codec's fixed [fp16 norm][packed indices]. vLLM's page arithmetic stays exact
because the backend publishes the slot size through `customize_spec` (`state_content_bytes`), the
hook vLLM's own TurboQuant backend uses; the physical layout is token-major (LBNHC, as TurboQuant's).

Exact window: every token written to the cache is stored as codes. The tokens of the running
forward (a prefill chunk, or the one decode token) attend to each other exactly, since their
float K/V are at hand; the first `sink_tokens` of the sequence and its last `recent_tokens` before
the forward exactly too (a small side store outside the pages, `window.ExactWindow`, its bytes taken
off the KV budget by the engine); and every other earlier token through its codes (the kernels of
`fibquant.kv.attention`, one joint softmax). A chunked prefill therefore reads earlier chunks exactly
as `CompressedCache(sink_tokens=S, recent_tokens=R, encode_batch=1)` does in transformers.

Writes: the forward writes the codes itself (`forward_includes_kv_cache_update`), since it knows
which tokens are decodes of sequences with a whole exact window: on CPU pages those are held raw and
encoded in one batched call every `VllmCacheConfig.deferred_steps` forwards (`deferred.DeferredCodes`:
they are read exactly until they leave the recent window, so their codes may come late); every
other token is encoded at once, after the held ones, so each slot sees its writes in order. The
codes are the same as written at once (tested bitwise).

Decode requests of a step attend in one call per layer (per exact-window size: one in a steady
state). On CPU pages that is the paged numba kernel (`fibquant.kv.attention.paged`,
`AttentionOptions.paged_numba_decode`): each sequence's codes read in place through its block-table row, for exactly
its own coded range, no gathered copy, no padding, soft-capping and sink logits applied by the kernel's
shared epilogue. With the option off they take the gathered path, padded to the longest context and
masked. Prefill chunks take the gathered path; a
first chunk (nothing before it) is plain causal attention, run by vLLM's own CPU kernel (`chunk`, one
call per chunk, written straight into vLLM's output rows: `_first_chunk`).

On CUDA (when triton imports; `AttentionOptions.paged_coded_backend`) the coded tokens go through the paged fused
kernel instead (`fibquant.kv.attention.kernels.coded_decode_attention_paged`): it reads each request's
codes in place through its block-table row, for exactly its own length (no gathered copy, no
padding mask), and its (out, log-sum-exp) is merged exactly with the exact part (the window + the
forward's own tokens, `attention_with_lse`) and the learned sink logits by `merge_lse`. Logit
soft-capping keeps the gathered path (the kernel has no soft-cap). Nothing of this was measured on a GPU.

Logit soft-capping (Gemma 2) and learned attention-sink logits (gpt-oss `sinks`) apply on the codes
as in transformers (`attend_codes(softcap=, sinks=)`). Not supported (a clear NotImplementedError at
engine start): ALiBi, sliding windows (vLLM frees a sliding layer's blocks as the window moves, which
this backend does not follow yet), encoder / cross attention, fp8 `kv_cache_dtype` (the codes are
the cache dtype) and pipeline parallelism > 1 (`_engine_refusals`; tensor parallelism is served: each
worker codes its own KV heads). Prefix caching is served: shared full blocks hold their codes (no
deferred code in a full block), and the exact window of a hit comes from a boundary snapshot (`window`) or, for blocks filled in the same forward, from that
forward's own tokens (`_WindowPlan.in_forward`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import ClassVar, NamedTuple

import numpy as np
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

from fibquant.integrations.vllm import chunk
from fibquant.integrations.vllm.config import active_config
from fibquant.integrations.vllm.deferred import DeferredCodes
from fibquant.integrations.vllm.window import ExactWindow
from fibquant.codecs.reader import CodebookReader
from fibquant.kv.attention.entry import attend_codes
from fibquant.kv.attention.kernels import attention_with_lse, coded_decode_attention_paged, merge_lse, triton_available
from fibquant.kv.attention.numba_paged import ExactParts, PagedCodes, PagedEpilogue, PagedRole
from fibquant.kv.attention.paged import (
    paged_decode_attention,
    paged_epilogue,
    paged_kernel,
    paged_plans,
    paged_roles,
    run_paged_kernel,
)
from fibquant.kv.buffer import CodedKV

EXACT_ROWS_PER_BLOCK = 2048  # query rows (query heads x tokens) of the paged path's exact part scored at once

def _config():
    config = active_config()
    if config is None:
        raise RuntimeError("the FibQuant vLLM backend was selected while FIBQUANT_VLLM_CACHE is unset")
    return config


class FibQuantAttentionBackend(AttentionBackend):
    """Registered over CPU_ATTN (and as CUSTOM) by `fibquant.integrations.vllm.register`."""

    accept_output_buffer: bool = True
    # the forward writes the codes (it knows which tokens are decodes whose writes can wait: `deferred`)
    forward_includes_kv_cache_update: bool = True
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
        return (KVCacheLayout.LBNHC,)  # token-major blocks: see _context_codes

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
    # Host-side facts every layer of the forward shares, computed by the first (`_window_plan`).
    plan: "_WindowPlan | None" = None


@dataclass
class _WindowPlan:
    """What the exact window needs of one forward, the same for every layer: per request the block of
    position past - 1 (its window entry's key) and of its newest token (the key after the forward);
    the blocks whose first slot the forward writes (handed out anew: their entries are stale); and,
    per prefill chunk, where the run of earlier positions that this very forward writes begins (a
    prefix-cache hit on blocks another request fills now) and those positions' token rows."""

    block_size: int
    keys: list[int]          # [num_reqs]
    new_keys: list[int]      # [num_reqs]
    fresh_blocks: list[int]
    in_forward: dict         # request -> (first position of the run, token rows [past - first] int64)
    decode: "_DecodeStep | None" = None  # a steady decode step's facts (`_lean_decode`), else None


@dataclass
class _DecodeStep:
    """A forward of B one-token decodes (tokens = requests, in order), each with a whole-window-sized
    past of the same exact-window size and every code write deferrable: what `_lean_decode` needs,
    the same for every layer (the kernel's arrays built once per step)."""

    pasts: list[int]
    size: int                # exact columns per sequence (sinks + recent)
    starts: np.ndarray       # int64 [B]: the first coded position (the sinks' count)
    stops: np.ndarray        # int64 [B]: past - recent
    longest: int             # max(stops - starts) > 0
    tables: np.ndarray       # int32 [B, max_blocks], C order
    slots: np.ndarray        # int64 [B]: the new tokens' page slots
    # int64 [B]: the window's ring slots of the new tokens (the paged kernel's `record_slots`), when every token
    # stays in its previous token's block, the keys are distinct and every position is kept; else None
    window_slots: np.ndarray | None = None
    no_record: np.ndarray | None = None  # int64 [B] of -1: the kernel's record_slots when it records nothing


class _PagedLayer(NamedTuple):
    """The paged kernel's arguments fixed for a layer (`FibQuantAttentionImpl._paged_arguments`)."""

    keys: PagedRole
    values: PagedRole
    epilogue: PagedEpilogue


@dataclass
class _ForwardStep:
    """One layer's general forward (`FibQuantAttentionImpl.forward` off the lean path): its tensors as
    [tokens, heads, D] views and its requests sorted by `_sort_requests`."""

    plan: _WindowPlan
    pages: torch.Tensor
    starts: list[int]        # query_start_loc
    tables: torch.Tensor     # block_table
    queries: torch.Tensor    # [tokens, Hq, D]
    keys: torch.Tensor       # [tokens, Hk, D]
    values: torch.Tensor
    out: torch.Tensor        # [tokens, Hq * D]: the layer's output rows
    decodes: dict = field(default_factory=dict)  # exact columns n -> (requests, pasts, slab rows)
    decoded: list = field(default_factory=list)  # (request, past) of every decode, in order
    chunks: list = field(default_factory=list)   # (request, past, token span) of every other request
    held: list = field(default_factory=list)     # decode requests whose code writes can wait (`deferred`)


class FibQuantMetadataBuilder(AttentionMetadataBuilder[FibQuantMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:  # abstract in the base
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


def _max_num_seqs(default: int = 256) -> int:
    try:
        from vllm.config import get_current_vllm_config

        return int(get_current_vllm_config().scheduler_config.max_num_seqs or default)
    except Exception:  # outside an engine (unit tests): no scheduler config
        return default


def _engine_refusals() -> list[str]:
    """What the running engine asks for that the backend does not support (empty outside an engine)."""
    try:
        from vllm.config import get_current_vllm_config

        config = get_current_vllm_config()
    except Exception:  # outside an engine (unit tests): nothing to refuse
        return []
    refused = []
    size = int(getattr(config.parallel_config, "pipeline_parallel_size", 1) or 1)
    if size > 1:
        refused.append(f"pipeline_parallel_size={size} (only tensor parallelism is tested)")
    return refused


def _prefix_caching() -> bool:
    """Whether the running engine shares full blocks between sequences (vLLM's prefix caching; False
    outside an engine)."""
    try:
        from vllm.config import get_current_vllm_config

        return bool(getattr(get_current_vllm_config().cache_config, "enable_prefix_caching", False))
    except Exception:  # outside an engine (unit tests)
        return False


@functools.lru_cache(maxsize=None)
def _load_kernels(key_codec, value_codec, kv_heads: int, paged_numba: bool) -> None:
    """Load the numba kernels a forward runs (from the disk cache, or compiled), once per process and
    codec pair, while the engine starts: the codecs' encode (their nearest-codeword search) and the
    paged decode kernels. Otherwise a restarted server's first request pays for it (about 2 s here)."""
    sample = torch.randn((2, kv_heads, key_codec.dim), generator=torch.Generator().manual_seed(0))
    for codec in {id(key_codec): key_codec, id(value_codec): value_codec}.values():
        codec.encode(sample.to(torch.bfloat16))
    if paged_numba:  # AttentionOptions.paged_numba_decode
        paged_kernel(True, True)
        paged_kernel(False, False)


class FibQuantAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks=None) -> None:
        unsupported = {"ALiBi slopes": alibi_slopes is not None, "a sliding window": sliding_window is not None,
                       f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
                       f"kv_cache_dtype={kv_cache_dtype!r}": kv_cache_dtype != "auto"}
        refused = [name for name, hit in unsupported.items() if hit] + _engine_refusals()
        if refused:
            raise NotImplementedError(f"the FibQuant vLLM backend does not support {', '.join(refused)}; "
                                      "unset FIBQUANT_VLLM_CACHE to serve this model with vLLM's own backend")
        if sinks is not None and sinks.numel() != num_heads:
            raise NotImplementedError(f"attention-sink logits of shape {tuple(sinks.shape)} for {num_heads} heads "
                                      "(one per query head is supported)")
        self.softcap = float(logits_soft_cap) if logits_soft_cap else None
        self.logit_sinks = sinks  # learned per-head logits [Hq] (gpt-oss), not the exact first tokens
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
        # at most one entry per schedulable sequence (and as many boundary snapshots with prefix caching):
        # the bound the engine takes off the KV budget
        self.prefix_caching = _prefix_caching()
        sequences = _max_num_seqs()
        self.window = ExactWindow(config.sink_tokens, config.recent_tokens, max_entries=sequences,
                                  snapshots=sequences if self.prefix_caching else 0)
        self.options = config.options  # the paths taken (`fibquant.kv.options`; FIBQUANT_VLLM_ATTENTION)
        self.deferred = DeferredCodes(config.deferred_steps)
        self._paged_plans = paged_plans(self.key_codec, self.value_codec, self.num_heads, self.num_kv_heads)
        self._paged_layer = None  # `_paged_arguments`: built by the first lean step (after the weights are loaded)
        self._host_pages = None  # (kv_cache, its pages as a numpy view), kept while vLLM passes the same cache
        _load_kernels(self.key_codec, self.value_codec, self.num_kv_heads, self.options.paged_numba_decode)

    def _pages(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The layer's cache as bytes, logical [num_blocks, num_kv_heads, block_size, slot_bytes] (any strides)."""
        return kv_cache.view(torch.uint8)

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """Encode K/V [N, Hk*D] and write their codes at `slot_mapping` [N] now (the forward does this
        itself, deferring what it can: vLLM calls this only for backends whose forward does not)."""
        count = slot_mapping.shape[0]
        if count == 0:
            return
        self._flush(self._pages(kv_cache))
        self._write_codes(self._pages(kv_cache), key[:count].reshape(count, self.num_kv_heads, self.head_size),
                          value[:count].reshape(count, self.num_kv_heads, self.head_size), slot_mapping)

    def _flush(self, pages: torch.Tensor) -> None:
        """Write the held decode codes (`deferred`), oldest first, before any other write or code read."""
        held = self.deferred.take()
        if held is not None:
            self._write_codes(pages, *held)

    def _write_codes(self, pages: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot_mapping) -> None:
        """Encode keys / values [N, Hk, D] and write their codes at page slots `slot_mapping` [N] (int64
        tensor or array; -1 = a padded token, skipped)."""
        tokens = pages.permute(0, 2, 1, 3)                                    # [blocks, bs, Hk, slot]
        if pages.device.type == "cpu" and tokens.is_contiguous():  # token-major host pages: numpy rows per slot
            slots = slot_mapping.numpy() if isinstance(slot_mapping, torch.Tensor) else slot_mapping
            if slots.dtype != np.int64:
                slots = slots.astype(np.int64)
            if slots.min() < 0:  # padded tokens carry slot -1
                valid = slots >= 0
                slots, chosen = slots[valid], torch.from_numpy(np.flatnonzero(valid))
                keys, values = keys.index_select(0, chosen), values.index_select(0, chosen)
            if slots.shape[0] == 0:
                return
            rows = tokens.view(-1, *tokens.shape[2:]).numpy()                  # [slots, Hk, slot]
            key_codes, value_codes = self._encode_both(keys, values)
            rows[slots, :, : self.key_bytes] = key_codes.numpy()
            rows[slots, :, self.key_bytes: self.key_bytes + self.value_bytes] = value_codes.numpy()
            if self.key_bytes + self.value_bytes < rows.shape[-1]:  # the pad byte of an odd code pair
                rows[slots, :, self.key_bytes + self.value_bytes:] = 0
            return
        block_size = pages.shape[2]
        slots = torch.as_tensor(slot_mapping, device=pages.device).to(torch.long)
        valid = slots >= 0  # padded tokens carry slot -1
        if not bool(valid.all()):
            slots, keys, values = slots[valid], keys[valid], values[valid]
        codes = torch.cat(self._encode_both(keys, values), dim=-1)
        if codes.shape[-1] < pages.shape[-1]:  # the pad byte of an odd code pair: one full slot row
            codes = torch.nn.functional.pad(codes, (0, pages.shape[-1] - codes.shape[-1]))
        if codes.shape[-1] == pages.shape[-1] and tokens.is_contiguous():  # token-major pages: one row per slot
            tokens.view(-1, *tokens.shape[2:]).index_copy_(0, slots, codes)
        else:
            pages[slots // block_size, :, slots % block_size, : codes.shape[-1]] = codes

    def _encode_both(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value codes [N, Hk, code size] of keys / values [N, Hk, D]: one encode call for both
        when one codec codes both roles (per-call overhead dominates a decode step), through `encode_parts`
        (the codes of `encode(torch.cat([keys, values]))`; FibQuant widens bf16 parts straight into its
        float32 working block: no concatenated copy, no separate conversion or finiteness pass)."""
        if self.key_codec is self.value_codec:
            return tuple(self.key_codec.encode_parts([keys, values]))
        return self.key_codec.encode(keys), self.value_codec.encode(values)

    def _context_codes(self, pages: torch.Tensor, tables: torch.Tensor, stops: list[int]):
        """Key and value codes [R, Hk, max(stops), code_size] of the positions [0, stop) of the requests
        whose block-table rows are `tables` [R, max_blocks]; a shorter request's padding rows are zero
        codes (norm 0; the caller masks them too)."""
        length = max(stops)
        block_size = pages.shape[2]
        # Entries past a request's own blocks are stale ids (masked by the caller): clamp keeps them in range.
        used = tables[:, : -(-length // block_size)].to(torch.long).clamp_(0, pages.shape[0] - 1)  # [R, nb]
        # Token-major pages (LBNHC): whole blocks are one contiguous gather, and the [R, Hk, length, C]
        # result is a strided view of it that the kernels read in place (any other layout costs a reorder).
        blocks = pages.permute(0, 2, 1, 3)                                         # [B, bs, Hk, C]
        if blocks.is_contiguous():  # index_select copies whole blocks: ~20x faster than advanced indexing
            rows = blocks.reshape(blocks.shape[0], -1).index_select(0, used.flatten()).view(*used.shape, *blocks.shape[1:])
        else:
            rows = blocks[used]                                                    # [R, nb, bs, Hk, C]
        rows = rows.reshape(used.shape[0], -1, self.num_kv_heads, pages.shape[-1])[:, :length].permute(0, 2, 1, 3)
        for row, stop in enumerate(stops):  # another request's bytes (rows is a copy of the pages)
            if stop < length:
                rows[row, :, stop:] = 0
        return rows[..., : self.key_bytes], rows[..., self.key_bytes: self.key_bytes + self.value_bytes]

    def _paged(self, pages: torch.Tensor) -> bool:
        """Whether the coded tokens go through the paged Triton kernel (`paged_coded_backend`)."""
        backend = self.options.paged_coded_backend
        if backend == "off":
            return False
        if backend == "auto" and (pages.device.type != "cuda" or not triton_available()):
            return False
        return all(isinstance(codec.reader(pages.device), CodebookReader) for codec in (self.key_codec, self.value_codec))

    def _numba_paged(self, pages: torch.Tensor) -> bool:
        """Whether a batch of one-token steps goes through the paged numba kernel (`kv.attention.paged`,
        soft-capping and sink logits included): CPU pages, codecs the kernel serves, `paged_numba_decode` on."""
        return self.options.paged_numba_decode and self._paged_plans is not None and pages.device.type == "cpu"

    def _attend_paged(self, pages, tables, skip: int, stops: list[int], query, key, value,
                      window=None) -> torch.Tensor:
        """`_attend` with the coded positions [skip, stop) of each request read in place by the paged
        kernel, merged by log-sum-exp with the exact part (the window, the own tokens causally) and the
        sink logits; a soft-cap caps the coded scores in the kernel and the exact ones in torch."""
        count, tokens = query.shape[:2]
        device = pages.device
        key_book, value_book = (codec.reader(device) for codec in (self.key_codec, self.value_codec))
        q = query.transpose(1, 2).to(torch.float32) * self.scale                    # [R, Hq, T, D]
        exact = 0 if window is None else window[0].shape[2]
        coded_out, coded_lse = coded_decode_attention_paged(
            q @ key_book.forward, pages, tables, stops, key_book.codewords, value_book.codewords,
            key_book.index_bits, value_book.index_bits, self.key_bytes, context_starts=skip,
            value_dim=self.value_codec.dim, softcap=self.softcap,
            backend="auto" if self.options.paged_coded_backend == "auto" else "triton")
        coded_out = coded_out @ value_book.forward.T
        exact_keys, exact_values = key.transpose(1, 2), value.transpose(1, 2)      # [R, Hk, T, D]
        if exact:
            exact_keys = torch.cat([window[0].to(exact_keys.dtype), exact_keys], dim=2)
            exact_values = torch.cat([window[1].to(exact_values.dtype), exact_values], dim=2)
        exact_keys, exact_values = exact_keys.to(torch.float32), exact_values.to(torch.float32)
        groups = self.num_heads // self.num_kv_heads
        step = max(1, EXACT_ROWS_PER_BLOCK // groups)
        out = torch.empty(count, self.num_heads, tokens, coded_out.shape[-1], dtype=torch.float32, device=device)
        for start in range(0, tokens, step):
            rows = slice(start, min(start + step, tokens))
            bias = None
            if tokens > 1:  # own token t sees the window and own tokens <= t
                columns = torch.arange(exact + tokens, device=device)
                hidden = columns[None, :] > exact + torch.arange(rows.start, rows.stop, device=device)[:, None]
                bias = torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))[None, None]
            parts = [(coded_out[:, :, rows], coded_lse[:, :, rows]),
                     attention_with_lse(q[:, :, rows], exact_keys, exact_values, bias, softcap=self.softcap)]
            if self.logit_sinks is not None:  # a column with a logit and no value
                width = rows.stop - rows.start
                logits = self.logit_sinks.to(device=device, dtype=torch.float32).reshape(1, -1, 1)
                parts.append((out.new_zeros(count, self.num_heads, width, out.shape[-1]),
                              logits.expand(count, self.num_heads, width)))
            out[:, :, rows] = merge_lse(parts)[0]
        return out.transpose(1, 2).reshape(count, tokens, -1).to(query.dtype)

    def _first_chunk(self, query, key, value, out) -> bool:
        """A first prefill chunk (nothing coded or exact before it): query [T, Hq, D], key / value [T, Hk, D]
        attend causally among themselves through vLLM's CPU kernel (`chunk`), written straight into
        vLLM's output rows `out` [T, Hq * D] (no copy). False (nothing done) where the kernel does not
        serve them (`chunk_kernel` off, a soft-cap or sink logits, other dtypes or head sizes, a
        non-contiguous output): `_attend` then does it."""
        if not (self._chunk_kernel_serves(query, key, value) and out.dtype == query.dtype and out.is_contiguous()):
            return False
        chunk.causal_attention(query, key, value, self.scale, out=out.view(query.shape))
        return True

    def _chunk_kernel_serves(self, query, key, value) -> bool:
        """Whether vLLM's CPU kernel (`chunk`) runs a first chunk of these tensors: `chunk_kernel` on, no
        soft-cap or sink logits, one dtype, and a kernel for that dtype and head size on their device."""
        return self.options.chunk_kernel and self.softcap is None and self.logit_sinks is None \
            and query.dtype == key.dtype == value.dtype and chunk.available(query.dtype, self.head_size, query.device)

    def _attend(self, pages, tables, skip: int, stops: list[int], query, key, value, mask=None,
                window=None) -> torch.Tensor:
        """Requests with equal new-token counts T: query [R, T, Hq, D], key/value [R, T, Hk, D] ->
        [R, T, Hq*D]. Request r attends to `window` (exact keys/values [R, Hk, n, D]: its sinks and
        recent window, or None), its coded positions [skip, stops[r]) and its own tokens (causally).
        `mask` (additive float [R, 1, T, n + max(stops) - skip + T]) hides other requests' padding
        (not needed, and ignored, on the paged paths: each request reads its own range)."""
        count, tokens = query.shape[:2]
        coded = max(stops) - skip
        if coded > 0 and self._paged(pages):
            return self._attend_paged(pages, tables, skip, stops, query, key, value, window)
        options = {"softcap": self.softcap, "sinks": self.logit_sinks}
        new_keys, new_values = key.transpose(1, 2), value.transpose(1, 2)          # [R, Hk, T, D]
        if coded <= 0 and window is None:
            if self.softcap is None and self.logit_sinks is None:
                # nothing coded, nothing exact before (a first prefill chunk): plain causal attention, model dtype
                if count == 1 and self._chunk_kernel_serves(query, key, value):
                    return chunk.causal_attention(query[0], key[0], value[0], self.scale).reshape(1, tokens, -1)
                out = torch.nn.functional.scaled_dot_product_attention(
                    query.transpose(1, 2), new_keys, new_values, is_causal=tokens > 1,
                    scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
                return out.transpose(1, 2).reshape(count, tokens, -1)
            return attend_codes(query.transpose(1, 2), CodedKV.of_tensors(new_keys, new_values), None, self.scale,
                                **options).reshape(count, tokens, -1)
        if coded > 0:
            key_codes, value_codes = self._context_codes(pages, tables, stops)
            key_codes, value_codes = key_codes[:, :, skip:], value_codes[:, :, skip:]
        else:
            key_codes = torch.empty(count, self.num_kv_heads, 0, self.key_bytes, dtype=torch.uint8, device=pages.device)
            value_codes = torch.empty(count, self.num_kv_heads, 0, self.value_bytes, dtype=torch.uint8,
                                      device=pages.device)
        empty = new_keys.new_empty((count, self.num_kv_heads, 0, self.head_size))
        window_keys, window_values = window if window is not None else (empty, empty)
        kv = CodedKV(sink_keys=window_keys, sink_values=window_values, key_codes=key_codes, value_codes=value_codes,
                     recent_keys=empty, recent_values=empty, new_keys=new_keys, new_values=new_values,
                     key_codec=self.key_codec, value_codec=self.value_codec, options=self.options)
        return attend_codes(query.transpose(1, 2), kv, mask, self.scale, **options).reshape(count, tokens, -1)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: FibQuantMetadata | None, output: torch.Tensor | None = None,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        """query [N, Hq*D] (or [N, Hq, D]), key/value [N, Hk*D] -> output [N, Hq*D].

        A steady decode step takes `_lean_decode`. Otherwise: the forward's requests sorted
        (`_sort_requests`), the code writes (`_store`), each prefill chunk attended on its own
        (`_attend_chunk`), the decodes in one batched call per exact-window size (`_decode_batch`; in a
        steady state one call per layer), then the forward's new tokens recorded into the exact window
        (`_record_window`) and the held codes flushed every `deferred.steps` forwards."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the FibQuant backend")
        if output is None:
            output = torch.zeros(query.shape[0], self.num_heads * self.head_size, dtype=query.dtype,
                                 device=query.device)
        if attn_metadata is None:  # profiling / warm-up run
            return output
        plan = attn_metadata.plan or self._window_plan(attn_metadata, self._pages(kv_cache))
        if plan.decode is not None and self._lean_decode(plan, kv_cache, query, key, value, output):
            return output
        pages = self._pages(kv_cache)
        self.window.invalidate(plan.fresh_blocks)  # before any lookup: those blocks' old tokens are gone
        step = self._sort_requests(attn_metadata, plan, pages, query, key, value, output)
        if self.kv_sharing_target_layer_name is None:  # a layer sharing another's KV cache writes nothing
            self._store(pages, step.keys, step.values, attn_metadata.slot_mapping[:step.keys.shape[0]], step.starts,
                        step.held)
        recorded = [self._attend_chunk(step, *chunk) for chunk in step.chunks]
        for size, (requests, pasts, rows) in step.decodes.items():
            self._decode_batch(pages, step.tables, step.starts, requests, pasts, rows, size, step.queries, step.keys,
                               step.values, step.out)
        self._record_window(step, attn_metadata.seq_lens, recorded)
        if self.deferred.steps and len(self.deferred) >= self.deferred.steps:
            self._flush(pages)
        return output

    def _sort_requests(self, meta: FibQuantMetadata, plan: "_WindowPlan", pages, query, key, value,
                       output) -> "_ForwardStep":
        """The forward's tensors as [tokens, heads, D] views and its requests sorted: decodes grouped by
        their exact-window size (`_ForwardStep.decodes`), the decodes whose code writes can wait
        (`held`), every other request a chunk."""
        count = meta.num_actual_tokens
        step = _ForwardStep(plan, pages, meta.query_start_loc, meta.block_table,
                            query[:count].reshape(count, self.num_heads, self.head_size),
                            key[:count].reshape(count, self.num_kv_heads, self.head_size),
                            value[:count].reshape(count, self.num_kv_heads, self.head_size),
                            output.view(output.shape[0], -1))
        defer = self.deferred.steps > 0 and pages.device.type == "cpu"
        starts, block = step.starts, plan.block_size
        for request, total in enumerate(meta.seq_lens):
            start, stop = starts[request], starts[request + 1]
            if stop <= start:
                continue
            past = total - (stop - start)
            if stop - start > 1 or past == 0 or request in plan.in_forward:
                step.chunks.append((request, past, slice(start, stop)))
                continue
            row = self.window.row(plan.keys[request], past)
            group = step.decodes.setdefault(sum(self.window.counts(past)) if row >= 0 else 0, ([], [], []))
            for column, item in zip(group, (request, past, row)):
                column.append(item)
            step.decoded.append((request, past))
            # With prefix caching a block is shareable once full: the token that fills it is written
            # at once (and the held ones with it), so no full block ever waits for a code.
            if defer and row >= 0 and not (self.prefix_caching and (past + 1) % block == 0):
                step.held.append(request)
        return step

    def _attend_chunk(self, step: "_ForwardStep", request: int, past: int, span: slice) -> tuple:
        """A prefill chunk's attention written into its output rows; returns what `_record_window` records
        for it: (request, window key, first position, span, the earlier positions' keys / values or None)."""
        plan, tables, block = step.plan, step.tables, step.plan.block_size
        keys, values = step.keys, step.values
        first, rows = plan.in_forward.get(request, (past, None))
        # The window at `first`: the sequence's own entry (first = past), or, when earlier positions are
        # written by this forward (another request fills blocks this one hit), the window where that run
        # begins; the run itself is read exactly from this forward's tokens.
        key = int(tables[request, (first - 1) // block]) if 0 < first < past else plan.keys[request]
        window = self.window.lookup(key, first) if first > 0 else None
        skip, recent = self._exact_counts(window, first)
        exact = None if window is None else (window[0][None], window[1][None])
        earlier_keys = earlier_values = None
        if rows is not None:
            lines = torch.from_numpy(rows)
            earlier_keys, earlier_values = keys.index_select(0, lines), values.index_select(0, lines)
            run = (earlier_keys.transpose(0, 1)[None], earlier_values.transpose(0, 1)[None])
            exact = run if exact is None else (torch.cat([exact[0], run[0].to(exact[0].dtype)], dim=2),
                                               torch.cat([exact[1], run[1].to(exact[1].dtype)], dim=2))
        queries, flat_out = step.queries, step.out
        if not (exact is None and first == 0 and self._first_chunk(queries[span], keys[span], values[span],
                                                                   flat_out[span])):
            out = self._attend(step.pages, tables[request:request + 1], skip, [first - recent], queries[span][None],
                               keys[span][None], values[span][None], window=exact)
            flat_out[span] = out[0].to(flat_out.dtype)
        return request, key, first, span, earlier_keys, earlier_values

    def _record_window(self, step: "_ForwardStep", seq_lens: list[int], recorded: list[tuple]) -> None:
        """The forward's new tokens into the exact window, after the layer's attention: each chunk's
        (with the earlier run it read from this forward, and the boundary snapshots of prefix caching),
        then every decode's in one indexed write per role."""
        plan, block = step.plan, step.plan.block_size
        for request, key, first, span, earlier_keys, earlier_values in recorded:
            new_keys, new_values = step.keys[span], step.values[span]
            if earlier_keys is not None:
                new_keys, new_values = torch.cat([earlier_keys, new_keys]), torch.cat([earlier_values, new_values])
            total = seq_lens[request]
            boundaries = ()
            if self.window.snapshots and total > (first // block + 1) * block:
                row = step.tables[request].tolist()
                boundaries = [(p, row[p // block - 1]) for p in range((first // block + 1) * block, total, block)]
            self.window.record(key if first > 0 else None, first, new_keys, new_values, plan.new_keys[request],
                               boundaries)
        if step.decoded:
            requests = [request for request, _ in step.decoded]
            lines = _rows(requests, step.starts, step.keys.device)
            self.window.record_tokens([plan.keys[r] for r in requests], [past for _, past in step.decoded],
                                      [plan.new_keys[r] for r in requests], step.keys[lines], step.values[lines])

    def _window_plan(self, meta: FibQuantMetadata, pages: torch.Tensor) -> _WindowPlan:
        """The forward's `_WindowPlan`, built by its first layer and kept on the metadata for the others."""
        if meta.plan is not None:
            return meta.plan
        block = pages.shape[2]
        count, num_reqs = meta.num_actual_tokens, len(meta.seq_lens)
        slots = meta.slot_mapping[:count]
        slots = (slots if slots.device.type == "cpu" else slots.cpu()).numpy().astype(np.int64, copy=False)
        fresh = np.unique(slots[(slots >= 0) & (slots % block == 0)] // block).tolist()
        starts, totals = meta.query_start_loc, meta.seq_lens
        pasts = [totals[r] - (starts[r + 1] - starts[r]) for r in range(num_reqs)]
        tables = meta.block_table[:num_reqs]
        host = tables if tables.device.type == "cpu" else tables.cpu()
        index = torch.arange(num_reqs)
        keys = host[index, torch.tensor([max(p - 1, 0) // block for p in pasts])].tolist()
        new_keys = host[index, torch.tensor([max(t - 1, 0) // block for t in totals])].tolist()
        in_forward = {}
        order = None
        for r in range(num_reqs):
            past, new = pasts[r], starts[r + 1] - starts[r]
            if past == 0 or new == 0:
                continue
            if new == 1 and not self.prefix_caching:  # a decode: only a prefix-cache hit can share its past
                continue
            if order is None:
                order = np.argsort(slots, kind="stable")
                ordered = slots[order]
            # earlier positions this forward writes (another request's tokens in blocks this one hit): the
            # run ending at past - 1, found from the newest position backwards, block by block
            first, rows = past, []
            while first > 0:
                low = max((first - 1) // block * block, 0)
                positions = np.arange(low, first)
                wanted = int(host[r, (first - 1) // block]) * block + positions % block
                at = np.minimum(np.searchsorted(ordered, wanted), len(ordered) - 1)
                found = ordered[at] == wanted
                if found.all():
                    rows.append(order[at])
                    first = low
                    continue
                missing = np.flatnonzero(~found)
                keep = int(missing[-1]) + 1
                rows.append(order[at[keep:]])
                first = low + keep
                break
            if first < past:
                in_forward[r] = (first, np.concatenate(rows[::-1]).astype(np.int64))
        meta.plan = _WindowPlan(block, keys, new_keys, fresh, in_forward,
                                self._decode_step(starts, pasts, count, tables, slots, in_forward, block, keys,
                                                  new_keys))
        return meta.plan

    def _decode_step(self, starts, pasts, count, tables, slots, in_forward, block, keys, new_keys
                     ) -> _DecodeStep | None:
        """The forward's `_DecodeStep`, or None when it is not a steady decode step (any prefill chunk, a
        past shorter than the window, a prefix-cache run, a block-filling write under prefix caching,
        nothing coded, tables off the host)."""
        num_reqs = len(pasts)
        if not self.options.lean_decode or not self.deferred.steps or not self.window.size or not num_reqs or count != num_reqs \
                or starts != list(range(num_reqs + 1)) or in_forward or tables.device.type != "cpu" or slots.min() < 0:
            return None
        counts = [self.window.counts(past) for past in pasts]  # (sinks, recent) held exact per sequence
        sizes = {sinks + recent for sinks, recent in counts}
        if len(sizes) != 1 or min(pasts) <= 0 or (self.prefix_caching and any((p + 1) % block == 0 for p in pasts)):
            return None
        skip = counts[0][0]
        stops = np.array([past - recent for past, (_, recent) in zip(pasts, counts)], dtype=np.int64)
        longest = int(stops.max()) - skip
        if longest <= 0:
            return None
        host = np.ascontiguousarray(tables.numpy(), dtype=np.int32)
        window_slots = None
        if keys == new_keys and len(set(keys)) == num_reqs:
            ring = [self.window.slot(past) for past in pasts]
            window_slots = np.array(ring, dtype=np.int64) if min(ring) >= 0 else None
        return _DecodeStep(pasts, sizes.pop(), np.full(num_reqs, skip, dtype=np.int64), stops, longest, host,
                           np.array(slots[:count], dtype=np.int64), window_slots, np.full(num_reqs, -1, dtype=np.int64))

    def _lean_decode(self, plan: _WindowPlan, kv_cache, query, key, value, output) -> bool:
        """A steady decode step (`_DecodeStep`) in one paged kernel call on arrays kept between calls
        (numpy views of vLLM's tensors, no torch view per role): what the general path does for it
        (hold the codes, attend, record the window, flush every `deferred.steps`), without its
        per-request bookkeeping (soft-capping and sink logits applied by the kernel). False (nothing done
        but the window's `invalidate`, which the general path repeats harmlessly) when this layer cannot
        take it: a window entry missing, dtypes the kernel does not read in place, a non-contiguous
        output, or a layer sharing another's cache."""
        step = plan.decode
        dtype = query.dtype
        cached = self._host_pages
        if cached is None or cached[0] is not kv_cache:
            pages = self._pages(kv_cache)
            if not self._numba_paged(pages):
                return False
            cached = self._host_pages = (kv_cache, pages.numpy())
        if (self.kv_sharing_target_layer_name is not None or not self.options.paged_numba_decode
                or dtype not in (torch.bfloat16, torch.float32)
                or not (key.dtype == value.dtype == output.dtype == dtype) or not output.is_contiguous()):
            return False
        self.window.invalidate(plan.fresh_blocks)  # before any lookup: those blocks' old tokens are gone
        if self.window.dtype != dtype:
            return False
        entries = self.window.entries(plan.keys, step.pasts)
        if entries is None:
            return False
        count = len(entries)
        rows = np.array([entry[0] for entry in entries], dtype=np.int64)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_size
        bits = dtype == torch.bfloat16
        host = (lambda t: t.view(torch.uint16).numpy()) if bits else (lambda t: t.numpy())
        queries = host(query)[:count].reshape(count, heads, dim)  # a copy only for an odd layout (input)
        # the new tokens as C copies [B, Hkv, D]: the kernel's new-token parts (it reads C arrays), then held
        # for the deferred writes (vLLM reuses its buffers) and recorded into the window
        keys, values = (host(t)[:count].reshape(count, kv_heads, dim).copy() for t in (key, value))
        out = host(output)[:count].reshape(count, heads, dim)  # a view (output is contiguous): written in place
        exact_keys, exact_values = self.window.host_slab_arrays()  # whole slabs: the first step.size columns read
        # the steady case (ring slots from the step, live entries, distinct rows): the kernel records the new
        # tokens into the window rows itself, after reading them; else the general record below
        fused = step.window_slots is not None and self.window.live(entries, plan.keys)
        exact = ExactParts(exact_keys, exact_values, rows, step.size, keys[:, :, None], values[:, :, None],
                           step.window_slots if fused else step.no_record)
        layer = self._paged_layer or self._paged_arguments()
        bad = run_paged_kernel(paged_kernel(bits, bits), self._paged_plans, queries, out, layer.keys, layer.values,
                               PagedCodes(cached[1], step.tables, step.starts, step.stops), exact, layer.epilogue,
                               step.longest)
        if bad:
            raise ValueError(f"paged codes hold {bad} invalid index(es) or block id(s) outside the pages")
        # tensors only when flushed; step.slots: never written
        self.deferred.add_host(keys, values, step.slots, dtype, owned=True)
        if fused:
            self.window.advance_decode(entries, plan.keys, step.pasts)
        else:
            self.window.record_tokens(plan.keys, step.pasts, plan.new_keys, *(
                torch.from_numpy(t).view(dtype) for t in (keys, values)), host=(keys, values))
        if len(self.deferred) >= self.deferred.steps:
            self._flush(self._pages(kv_cache))
        return True

    def _paged_arguments(self) -> "_PagedLayer":
        """What the paged kernel takes that is fixed for this layer (its roles and epilogue), built once:
        on the first decode step, after vLLM has loaded the sink logits into their parameter."""
        keys, values = paged_roles(self._paged_plans, 0, self.key_bytes, self.options)
        sinks = None if self.logit_sinks is None else self.logit_sinks.detach().cpu()
        self._paged_layer = _PagedLayer(keys, values, paged_epilogue(self.scale, self.softcap, sinks, self.num_heads))
        return self._paged_layer

    def _store(self, pages, keys, values, slot_mapping: torch.Tensor, starts: list[int], held: list[int]) -> None:
        """The forward's code writes: the tokens of `held` decode requests join the deferred writes;
        every other token is encoded now, after the deferred ones (so each slot sees its writes in order)."""
        count = slot_mapping.shape[0]
        if not held:
            self._flush(pages)
            self._write_codes(pages, keys, values, slot_mapping)
            return
        lines = _rows(held, starts, keys.device)
        picks = lines if isinstance(lines, slice) else lines.numpy()
        slots = slot_mapping.numpy()
        if len(held) == count:  # a decode-only step (the steady state): nothing written now
            self.deferred.add(keys[lines], values[lines], slots[picks])
            return
        self._flush(pages)
        rest = np.ones(count, dtype=bool)
        rest[picks] = False
        chosen = torch.from_numpy(np.flatnonzero(rest))
        self._write_codes(pages, keys.index_select(0, chosen), values.index_select(0, chosen), slots[rest])
        self.deferred.add(keys[lines], values[lines], slots[picks])

    def _exact_counts(self, window, past: int) -> tuple[int, int]:
        """(first coded position, recent positions read exactly) of a request with `past` earlier tokens."""
        return (0, 0) if window is None else self.window.counts(past)

    def _decode_batch(self, pages, tables, starts, requests: list[int], pasts: list[int], rows: list[int],
                      size: int, queries, keys, values, flat_out) -> None:
        """One attention call for decode requests `requests` (with `pasts` earlier tokens) whose exact
        windows hold `size` columns each, in slab rows `rows` of the window store (so they share the
        first coded position and the recent count; size 0: no window)."""
        device = queries.device
        skip, recent = self.window.counts(pasts[0]) if size else (0, 0)
        stops = [past - recent for past in pasts]
        lines = _rows(requests, starts, device)
        table_rows = tables[requests[0]:requests[-1] + 1] if requests[-1] - requests[0] == len(requests) - 1 \
            else tables[torch.tensor(requests, device=tables.device)]
        if max(stops) > skip and self._numba_paged(pages):
            if size and queries.dtype in (torch.bfloat16, torch.float32) and self.window.dtype == queries.dtype:
                # the kernel reads each sequence's slab row in place (no gathered copy); other dtypes are
                # converted to float32 by the wrapper, so they take the gathered rows, not the whole slabs
                exact_keys, exact_values = self.window.slabs(size)
            elif size:
                exact_keys, exact_values = self.window.gather(rows, size)
                rows = None
            else:
                exact_keys = exact_values = keys.new_empty((len(requests), self.num_kv_heads, 0, self.head_size))
                rows = None
            # the kernel writes the output rows in place (in the model dtype) when they are one run
            target = flat_out[lines].view(len(requests), self.num_heads, -1) if isinstance(lines, slice) \
                and flat_out.dtype in (torch.float32, torch.bfloat16) else None
            out = paged_decode_attention(queries[lines], pages, table_rows, [skip] * len(requests), stops,
                                         self.key_codec, self.value_codec, exact_keys, exact_values,
                                         keys[lines].unsqueeze(2), values[lines].unsqueeze(2), self.scale,
                                         key_offset=0, value_offset=self.key_bytes, softcap=self.softcap,
                                         sinks=self.logit_sinks,
                                         plans=self._paged_plans, out=target, exact_rows=rows, options=self.options)
            if target is None:
                flat_out[lines] = out.reshape(len(requests), -1).to(flat_out.dtype)
            return
        window = self.window.gather(rows, size) if size else None
        longest = max(stops)
        mask = None
        # padding columns of shorter coded ranges: -inf (the paged kernels need no mask)
        if longest > skip and min(stops) < longest and not self._paged(pages):
            columns = torch.arange(size + longest - skip + 1, device=device)
            ends = size + torch.tensor(stops, device=device) - skip
            hidden = (columns[None, :] >= ends[:, None]) & (columns < size + longest - skip)
            mask = torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))[:, None, None]
        out = self._attend(pages, table_rows, skip, stops, queries[lines][:, None], keys[lines][:, None],
                           values[lines][:, None], mask, window)
        flat_out[lines] = out[:, 0].to(flat_out.dtype)


def _rows(requests: list[int], starts: list[int], device):
    """The token rows of one-token requests: a slice when contiguous (vLLM puts the decodes first: a
    view, no index copy), else an index tensor."""
    first = starts[requests[0]]
    if all(starts[r] == first + i for i, r in enumerate(requests)):
        return slice(first, first + len(requests))
    return torch.tensor([starts[r] for r in requests], device=device)
