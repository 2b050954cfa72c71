"""Attention on codes: q.K^T and p.V computed straight from FibQuant / TurboQuant code rows.

A code row (see codecs/fibquant.py) is `code_size` bytes: bytes [0, 2) the vector's norm nu as
IEEE fp16 (little-endian), bytes [2, code_size) `n_blocks` indices of `w = index_bits` bits,
bit-packed little-endian (index j at bits [j*w, (j+1)*w) of that range). In the rotated domain
the row decodes to nu * concat_j codewords[idx_j], codewords float32 [N, k], D = n_blocks * k;
TurboQuant is k = 1 (codewords = its levels as [N, 1]). Everything here stays in the rotated
domain: queries arrive rotated, `coded_weighted_sum` returns rotated outputs.

    coded_scores(queries [B,H,Q,D], codes [B,H,M,C], codewords [N,k], w)       -> [B,H,Q,M]
        s[b,h,q,i] = nu[b,h,i] * sum_j <queries[b,h,q, j*k:(j+1)*k], codewords[idx[b,h,i,j]]>
    coded_weighted_sum(weights [B,H,Q,M], codes [B,H,M,C], codewords [N,k], w) -> [B,H,Q,D]
        out[b,h,q, j*k:(j+1)*k] = sum_i weights[b,h,q,i] * nu[b,h,i] * codewords[idx[b,h,i,j]]

`*_reference` (plain torch: unpack, gather, einsum; any device) are the spec. The numba kernels
(CPU, inference only: no autograd) never materialise a decoded vector. Per unit of work
(b, h, tile of L queries; L = 4, or 8 / 16 for more queries, see `_lanes`):

* scores: a lookup table of partial dot products, LUT[position, value, 0:L], is built once (from
  T[n, j, :] = <queries[tile, j*k:(j+1)*k], codewords[n]>), then each token costs one L-float
  vector load + add per position. When w in {1, 2, 4, 8} and N = 2^w (every TurboQuant and the
  N = 256 FibQuant codebooks) a position is a whole index *byte* (256 values; the entry sums the
  8/w blocks packed in that byte), so a token costs n_index_bytes lookups (TurboQuant 4 bit: 32
  instead of 64, 2 bit: 16) with constant address strides. Other widths (10, 12, ...) read each
  w-bit field with one little-endian word load + shift + mask and look up T[idx, j].
* weighted sum: the transpose. A weighted histogram Hist[position, value, 0:L] += weights[tile, i]
  * nu_i over the tokens (one L-float read-modify-write per position), then spread back to blocks
  and contracted with the codewords: out[q, j*k + c] = sum_n Hist[n, j, q] * codewords[n, c]
  (n_blocks * N * k * L multiply-adds per unit, independent of M).

The hot loops are two small LLVM intrinsics that keep the L lanes in one vector register (see
`_build_intrinsics`); everything else is plain numba (no fastmath). Both kernels accumulate in
float32, like the dense float32 attention they replace; the order of summation differs from the
reference, so results agree to float32 rounding (tests: 1e-5 of the magnitude sum
sum_d |q_d| |x_d|), not bit for bit. `codes` may be a strided view (e.g. [:, :, :M] of a
capacity buffer): it is read in place, as long as each row's bytes are contiguous.

Invalid indices (>= N, possible only when N < 2^w): `coded_scores`/`coded_weighted_sum` and the
references raise ValueError (as `FibQuantCodec.decode` does). The numba kernels never read out of
bounds: a field is clamped to N - 1 before its table lookup, and when N < 2^w every index is
checked and the count reported (then the wrapper raises).

Threads: the numba kernels are compiled without numba's own threading (`parallel=False`, nogil);
when torch.get_num_threads() > 1 and there is more than one (b, h, query-tile) unit of enough
work, the units are split over a small thread pool of at most torch.get_num_threads() threads.
So `torch.set_num_threads(1)` gives a single-threaded kernel. numba is imported on first use only;
compiled kernels are cached on disk by numba, keyed on every kernel source (`jit`), ~5 s to compile the first time.

Backends (`backend=`): "auto" picks numba for CPU tensors (torch when numba is missing), the
Triton kernels of `triton_kernels` for CUDA tensors when triton imports (`pip install
'fibquant[gpu]'`), else the torch reference with a one-time warning; "torch" is the reference on
any device; "numba" needs CPU tensors; "triton" needs CUDA tensors, or CPU tensors when
TRITON_INTERPRET=1 was set before triton was first imported (Triton's interpreter: how the tests
run it without a GPU). A config the Triton kernels cannot serve (index_bits > 25, head dim > 512)
runs the torch reference with a one-time warning, never a wrong result.

Fused decode attention (`coded_decode_attention`, flash-decoding on codes; Triton on CUDA, the
torch reference `coded_decode_attention_reference` elsewhere) returns the coded part's output
and log-sum-exp per query row; `merge_lse` merges it exactly with the exact columns' part
(`attention_with_lse`). Its paged variant (`coded_decode_attention_paged`) reads vLLM's pages in
place through the block tables (the plugin's backend on CUDA). See docs/gpu.md.

Modules: `reference` (argument checks and the torch reference), `numba_kernels` (the kernels),
`numba_tables` (their jitted helpers), `intrinsics` (the vector intrinsics),
`triton_kernels` (the GPU kernels, imported on first use); this module picks the backend and splits
the work over threads.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

from fibquant._numba import numba_available, run_split
from fibquant.kv.attention.notices import warn_once
from fibquant.kv.attention.numba_kernels import _MODE_BYTES, _MODE_FIELDS
from fibquant.kv.attention.reference import (BACKENDS, _check_backend, _validate_decode, _validate_paged, _validate_scores,
                              _validate_weighted_sum, attention_with_lse, check_softcap,
                              coded_decode_attention_paged_reference,
                              coded_decode_attention_reference, coded_scores_reference,
                              coded_weighted_sum_reference, merge_lse)

_MIN_WORK_PER_THREAD = 1 << 16  # token-positions per unit below which threads do not pay
_LUT_L2_BYTES = 512 * 1024   # 16 lanes only when the byte table stays within this (an L2's worth)

__all__ = [
    "coded_scores",
    "coded_weighted_sum",
    "coded_scores_reference",
    "coded_weighted_sum_reference",
    "coded_decode_attention",
    "coded_decode_attention_reference",
    "coded_decode_attention_paged",
    "coded_decode_attention_paged_reference",
    "attention_with_lse",
    "merge_lse",
    "numba_available",
    "triton_available",
    "BACKENDS",
]

_KERNELS = None
_KERNELS_LOCK = threading.Lock()


def _kernels():
    """(scores, weighted_sum) numba dispatchers, compiled (or loaded from numba's cache) once."""
    global _KERNELS
    if _KERNELS is None:
        with _KERNELS_LOCK:
            if _KERNELS is None:
                from fibquant.kv.attention.numba_kernels import compile_kernels

                _KERNELS = compile_kernels()
    return _KERNELS


def _run_units(kernel, args, units: int, work_per_unit: int) -> int:
    """Run `kernel(*args, start, stop)` over `units`, split across up to torch.get_num_threads() threads."""
    return run_split(kernel, args, units, work_per_unit, _MIN_WORK_PER_THREAD, "fibquant-coded")


def _numba_mode(n_codewords: int, index_bits: int) -> int:
    return _MODE_BYTES if index_bits in (1, 2, 4, 8) and n_codewords == 1 << index_bits else _MODE_FIELDS


def _lanes(n_queries: int, mode: int, index_bits: int, n_blocks: int) -> int:
    """Queries per tile: 4 (one 128-bit vector) up to 4 queries, else 8; 16 for more than 8 queries
    when the byte table (index bytes x 256 x 16 floats) stays within an L2's worth."""
    if n_queries <= 4 or (mode == _MODE_FIELDS and index_bits > 25):
        return 4
    if mode == _MODE_FIELDS or n_queries <= 8:
        return 8
    n_pos = -(-n_blocks // (8 // index_bits))
    return 16 if n_pos * 256 * 16 * 4 <= _LUT_L2_BYTES else 8


_TRITON = None  # (module or None, import error text), probed once


def _warn_once(key: str, message: str) -> None:
    warn_once(key, message, stacklevel=5)


def _triton_probe():
    global _TRITON
    if _TRITON is None:
        try:
            import fibquant.kv.attention.triton_kernels as triton_kernels
        except Exception as exc:  # ImportError, or a broken triton install
            _TRITON = (None, f"{type(exc).__name__}: {exc}")
        else:
            _TRITON = (triton_kernels, "")
    return _TRITON


def triton_available() -> bool:
    """Whether triton imports (and with it the kernels of `triton_kernels`)."""
    return _triton_probe()[0] is not None


def _select(backend: str, tensors: tuple[torch.Tensor, ...], roles: tuple[tuple[int, int], ...],
            fused: bool = False) -> str:
    """The backend that runs: "torch", "numba" or "triton". roles: (head dim, index_bits) per code role."""
    _check_backend(backend)
    if backend == "torch":
        return "torch"
    on_cpu = all(t.device.type == "cpu" for t in tensors)
    on_cuda = all(t.device.type == "cuda" for t in tensors)
    if backend == "numba":
        if fused:
            raise ValueError("backend='numba' has no fused decode attention; use 'auto', 'torch' or 'triton'")
        if not numba_available():
            raise ValueError("backend='numba' requested but numba is not importable (pip install numba)")
        if not on_cpu:
            raise ValueError("backend='numba' needs CPU tensors; got "
                             + ", ".join(str(t.device) for t in tensors))
        return "numba"
    if backend == "auto" and not on_cuda:
        return "numba" if on_cpu and numba_available() and not fused else "torch"
    module, error = _triton_probe()
    if module is None:
        if backend == "triton":
            raise ValueError(f"backend='triton' requested but triton is not importable ({error}); "
                             "pip install 'fibquant[gpu]'")
        _warn_once("no-triton", f"triton is not importable ({error}): attention on codes of CUDA tensors runs the "
                   "torch reference, which decodes every coded token (pip install 'fibquant[gpu]')")
        return "torch"
    if backend == "triton":
        reason = module.device_reason(*tensors)
        if reason is not None:
            raise ValueError(f"backend='triton': {reason}")
    for dim, index_bits in roles:
        reason = module.unsupported_reason(dim, index_bits)
        if reason is not None:
            _warn_once(f"triton-config:{reason}", f"the triton kernels cannot serve {reason}: this config runs "
                       "the torch reference (which decodes every coded token)")
            return "torch"
    return "triton"


def _run_triton(backend: str, name: str, run, fallback):
    """run() on the Triton kernels; with backend "auto" a kernel that fails to compile or launch (an
    unsupported GPU or triton build) falls back to fallback() with a one-time warning. ValueError (bad
    codes) always propagates; so does any failure under an explicit backend="triton"."""
    try:
        return run()
    except ValueError:
        raise
    except Exception as exc:
        if backend != "auto":
            raise
        _warn_once(f"triton-failed:{name}:{type(exc).__name__}",
                   f"the triton kernel for {name} failed ({type(exc).__name__}: {str(exc)[:300]}); "
                   "running the torch reference instead")
        return fallback()


def _codes_array(codes: torch.Tensor):
    """A numpy view of `codes` keeping its strides (a [:, :, :M] view of a capacity buffer is not copied)."""
    codes = codes.detach()
    if codes.shape[-1] > 1 and codes.stride(-1) != 1:  # the kernels read a row's bytes as one run
        codes = codes.contiguous()
    return codes.numpy()


# --------------------------------------------------------------------------- public API
def coded_scores(queries: torch.Tensor, codes: torch.Tensor, codewords: torch.Tensor, index_bits: int,
                 backend: str = "auto") -> torch.Tensor:
    """queries float32 [B, H, Q, D] (rotated domain), codes uint8 [B, H, M, code_size], codewords float32 [N, k]
    -> float32 [B, H, Q, M]: s[b,h,q,i] = nu[b,h,i] * sum_j <queries[b,h,q, j*k:(j+1)*k], codewords[idx[b,h,i,j]]>

    backend: "auto" (numba for CPU tensors when numba imports, else torch; triton for CUDA tensors
    when triton imports, else torch with a one-time warning), "torch" (the reference), "numba"
    (ValueError if numba is missing or a tensor is not on the CPU), "triton" (ValueError if triton
    is missing or the tensors are neither CUDA nor CPU under TRITON_INTERPRET=1). `codes` may be a strided
    view (e.g. [:, :, :M] of a capacity buffer); it is read in place. Raises ValueError for bad
    shapes/dtypes and for indices >= N (possible only when N < 2^index_bits).
    """
    n_codewords, k, n_blocks = _validate_scores(queries, codes, codewords, index_bits)
    choice = _select(backend, (queries, codes, codewords), ((n_blocks * k, index_bits),))
    if choice == "torch":
        return coded_scores_reference(queries, codes, codewords, index_bits)
    if choice == "triton":
        return _run_triton(backend, "coded_scores",
                           lambda: _triton_probe()[0].scores(queries, codes, codewords, index_bits),
                           lambda: coded_scores_reference(queries, codes, codewords, index_bits))
    n_b, n_h, n_q, _ = queries.shape
    n_tokens = codes.shape[2]
    out = torch.empty(n_b, n_h, n_q, n_tokens, dtype=torch.float32)
    if out.numel() == 0:
        return out
    mode = _numba_mode(n_codewords, index_bits)
    lanes = _lanes(n_q, mode, index_bits, n_blocks)
    units = n_b * n_h * -(-n_q // lanes)
    args = (queries.detach().contiguous().numpy(), _codes_array(codes),
            codewords.detach().contiguous().numpy(), out.numpy(), index_bits, n_blocks, mode, lanes)
    bad = _run_units(_kernels()[0], args, units, n_tokens * n_blocks)
    if bad:
        raise ValueError(f"codes hold {bad} index(es) >= N={n_codewords} (index_bits={index_bits})")
    return out


def coded_weighted_sum(weights: torch.Tensor, codes: torch.Tensor, codewords: torch.Tensor, index_bits: int,
                       backend: str = "auto", *, dim: Optional[int] = None) -> torch.Tensor:
    """weights float32 [B, H, Q, M], codes uint8 [B, H, M, code_size] -> float32 [B, H, Q, D]:
    out[b,h,q, j*k:(j+1)*k] = sum_i weights[b,h,q,i] * nu[b,h,i] * codewords[idx[b,h,i,j]]

    D = n_blocks * k with n_blocks = the number of index_bits-bit indices that fill code_size - 2
    bytes (exact for every FibQuant/TurboQuant config whose D * index_bits / k is a multiple of 8);
    pass `dim` to state D when the packing leaves an index-sized gap. backend and errors as in
    `coded_scores`. M = 0 gives zeros.
    """
    n_codewords, k, n_blocks = _validate_weighted_sum(weights, codes, codewords, index_bits, dim)
    choice = _select(backend, (weights, codes, codewords), ((n_blocks * k, index_bits),))
    if choice == "torch":
        return coded_weighted_sum_reference(weights, codes, codewords, index_bits, dim=n_blocks * k)
    if choice == "triton":
        return _run_triton(backend, "coded_weighted_sum",
                           lambda: _triton_probe()[0].weighted_sum(weights, codes, codewords, index_bits,
                                                                   n_blocks * k),
                           lambda: coded_weighted_sum_reference(weights, codes, codewords, index_bits,
                                                                dim=n_blocks * k))
    n_b, n_h, n_q, n_tokens = weights.shape
    out = torch.empty(n_b, n_h, n_q, n_blocks * k, dtype=torch.float32)
    if n_tokens == 0 or out.numel() == 0:
        return out.zero_()
    mode = _numba_mode(n_codewords, index_bits)
    lanes = _lanes(n_q, mode, index_bits, n_blocks)
    units = n_b * n_h * -(-n_q // lanes)
    args = (weights.detach().contiguous().numpy(), _codes_array(codes),
            codewords.detach().contiguous().numpy(), out.numpy(), index_bits, n_blocks, mode, lanes)
    bad = _run_units(_kernels()[1], args, units, n_tokens * n_blocks)
    if bad:
        raise ValueError(f"codes hold {bad} index(es) >= N={n_codewords} (index_bits={index_bits})")
    return out


def coded_decode_attention(queries: torch.Tensor, key_codes: torch.Tensor, value_codes: torch.Tensor,
                           key_codewords: torch.Tensor, value_codewords: torch.Tensor, key_bits: int,
                           value_bits: int, bias: Optional[torch.Tensor] = None, *, value_dim: Optional[int] = None,
                           softcap: Optional[float] = None, backend: str = "auto",
                           splits: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention of query rows over coded keys/values (flash-decoding on codes).

    queries   float32 [B, Hq, Q, D]: the queries rotated by the key codec (q @ key forward) and
              already multiplied by the softmax scaling
    key_codes, value_codes  uint8 [B, Hkv, M, Ck] / [B, Hkv, M, Cv] (Hq a multiple of Hkv; query
              head hq reads KV head hq // (Hq / Hkv), keys are never repeated); strided views
              such as [:, :, :M] of a capacity buffer are read in place
    key_codewords, value_codewords  float32 [N, k] per role; key_bits, value_bits their index widths
    bias      None or float32 additive [B|1, 1|Hq, Q, M] over the coded columns (-inf = masked)
    value_dim Dv when it differs from D (default D)
    softcap   None or c > 0: logit soft-capping (Gemma 2), each coded score s -> tanh(s / c) * c before
              the bias (ValueError for c <= 0, a non-finite or a non-number c)
    splits    context splits across programs (default: enough to fill the GPU); results do not
              depend on it beyond float32 rounding
    -> (out float32 [B, Hq, Q, Dv]: softmax over the M coded columns applied to the decoded values,
        in the value codec's rotated domain (un-rotate with `@ value_rotated.forward.T`);
        lse float32 [B, Hq, Q]: logsumexp of the coded columns' (capped) scores (+ bias))

    Rows with no visible coded column (fully masked, or M = 0) give out = 0 and lse = -inf.
    Merge with the exact columns (sinks, window, new tokens) exactly by
    `merge_lse([(out_coded_unrotated, lse_coded), attention_with_lse(q, k_exact, v_exact, bias_exact)])`.
    Centred keys (x = x_hat + mu): add q . mu to lse (a constant shift of every coded score; exact only
    without softcap, since the cap applies to the whole score); centred values: add mu to the (normalised)
    coded out before merging. With softcap, cap the exact columns alike (`attention_with_lse(softcap=)`).

    backend: "auto" (triton for CUDA tensors when it imports, else the torch reference with a
    one-time warning; the reference on the CPU: there the numba drop-ins of `coded_scores` /
    `coded_weighted_sum` are the fast path), "torch", "triton" (as in `coded_scores`).
    Raises ValueError for bad shapes/dtypes/devices and for indices >= N.
    """
    key_blocks, value_blocks, _, value_dim = _validate_decode(queries, key_codes, value_codes, key_codewords,
                                                              value_codewords, key_bits, value_bits, bias,
                                                              value_dim)
    check_softcap(softcap)
    if splits is not None and (not isinstance(splits, int) or isinstance(splits, bool) or splits < 1):
        raise ValueError(f"splits must be a positive integer or None, got {splits!r}")
    tensors = (queries, key_codes, value_codes, key_codewords, value_codewords)
    tensors += () if bias is None else (bias,)
    choice = _select(backend, tensors, ((queries.shape[-1], key_bits), (value_dim, value_bits)), fused=True)

    def reference():
        return coded_decode_attention_reference(queries, key_codes, value_codes, key_codewords, value_codewords,
                                                key_bits, value_bits, bias, value_dim=value_dim, softcap=softcap)

    if choice == "triton":
        return _run_triton(backend, "coded_decode_attention",
                           lambda: _triton_probe()[0].decode_attention(queries, key_codes, value_codes,
                                                                       key_codewords, value_codewords, key_bits,
                                                                       value_bits, bias, value_dim, softcap=softcap,
                                                                       splits=splits),
                           reference)
    return reference()


def coded_decode_attention_paged(queries: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor,
                                 context_lens, key_codewords: torch.Tensor, value_codewords: torch.Tensor,
                                 key_bits: int, value_bits: int, key_bytes: int, *, context_starts=None,
                                 value_dim: Optional[int] = None, max_context: Optional[int] = None,
                                 softcap: Optional[float] = None, backend: str = "auto", splits: Optional[int] = None
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`coded_decode_attention` over paged codes (vLLM's KV pages), read in place through block tables.

    queries       float32 [R, Hq, Q, D]: rotated by the key codec and scaled (as in `coded_decode_attention`);
                  R requests with Q query tokens each (decode: Q = 1; a prefill chunk: one request)
    pages         uint8 [num_blocks, Hkv, block_size, slot_bytes], any strides with each slot's bytes
                  contiguous (the vLLM backend's `_pages` view of token-major LBNHC pages); a slot holds
                  [key code][value code][pad], the value code at byte `key_bytes`
    block_tables  int32/int64 [R, max_blocks]: position p of request r is slot p % block_size of page
                  block_tables[r, p // block_size]; entries past a request's last position are never read
    context_lens  [R] ints or int tensor: one past the last coded position of each request
    context_starts None (0), an int or [R]: the first coded position (e.g. after exact sink tokens);
                  request r attends to its coded positions [context_starts[r], context_lens[r])
    max_context   optional bound on context_lens - context_starts (sizes the split count without a
                  device sync when the lengths are device tensors; default: exact from host lengths, else
                  max_blocks x block_size)
    -> (out float32 [R, Hq, Q, Dv] rotated by the value codec, normalised over each request's coded
        tokens; lse float32 [R, Hq, Q]); a request with no coded token: out = 0, lse = -inf.

    Every query token of a request sees all its coded positions (they are older than its exact
    tokens): no bias. softcap: as in `coded_decode_attention` (lse of the capped scores). backend as in
    `coded_decode_attention` (triton for CUDA tensors when it imports; the torch reference
    `coded_decode_attention_paged_reference`, which gathers, elsewhere).
    """
    key_size, value_size, value_dim, longest, starts, stops = _validate_paged(
        queries, pages, block_tables, context_lens, context_starts, key_codewords, value_codewords, key_bits,
        value_bits, key_bytes, value_dim)
    if max_context is not None:
        if not isinstance(max_context, int) or isinstance(max_context, bool) or max_context < 0:
            raise ValueError(f"max_context must be a non-negative integer or None, got {max_context!r}")
        longest = max_context
    check_softcap(softcap)
    if splits is not None and (not isinstance(splits, int) or isinstance(splits, bool) or splits < 1):
        raise ValueError(f"splits must be a positive integer or None, got {splits!r}")
    tensors = (queries, pages, block_tables, key_codewords, value_codewords)
    choice = _select(backend, tensors, ((queries.shape[-1], key_bits), (value_dim, value_bits)), fused=True)

    def reference():
        return coded_decode_attention_paged_reference(queries, pages, block_tables, stops, key_codewords,
                                                      value_codewords, key_bits, value_bits, key_bytes,
                                                      context_starts=starts, value_dim=value_dim, softcap=softcap)

    if choice == "triton":
        return _run_triton(backend, "coded_decode_attention_paged",
                           lambda: _triton_probe()[0].paged_decode_attention(
                               queries, pages, block_tables, starts, stops, key_codewords, value_codewords,
                               key_bits, value_bits, key_bytes, key_size, value_size, value_dim, longest,
                               softcap=softcap, splits=splits),
                           reference)
    return reference()
