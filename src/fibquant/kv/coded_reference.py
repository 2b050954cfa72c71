"""Code-row checks and the plain torch reference of attention on codes (the spec of
`fibquant.kv.coded_kernels`; any device). Layout of a code row: see that module's docstring."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..codecs.bitpack import MAX_BITS, bytes_to_float16, packed_size, unpack_bits
from ..codecs.rotation import NORM_BYTES

BACKENDS = ("auto", "torch", "numba")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_codebook(codewords, index_bits) -> tuple[int, int]:
    if not isinstance(codewords, torch.Tensor):
        raise ValueError(f"codewords must be a torch.Tensor, got {type(codewords).__name__}")
    if codewords.dtype != torch.float32:
        raise ValueError(f"codewords must be float32, got dtype {codewords.dtype}")
    if codewords.ndim != 2 or codewords.shape[0] < 1 or codewords.shape[1] < 1:
        raise ValueError(f"codewords must have shape [N, k] with N, k >= 1, got {tuple(codewords.shape)}")
    if not _is_int(index_bits) or not 1 <= index_bits <= MAX_BITS:
        raise ValueError(f"index_bits must be an integer in 1..{MAX_BITS}, got {index_bits!r}")
    n_codewords, k = codewords.shape
    if n_codewords > 1 << index_bits:
        raise ValueError(f"index_bits={index_bits} cannot address N={n_codewords} codewords "
                         f"(need at least {max(1, math.ceil(math.log2(n_codewords)))})")
    return int(n_codewords), int(k)


def _check_codes(codes) -> None:
    if not isinstance(codes, torch.Tensor):
        raise ValueError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be torch.uint8, got dtype {codes.dtype}")
    if codes.ndim != 4:
        raise ValueError(f"codes must have shape [B, H, M, code_size], got {tuple(codes.shape)}")


def _check_float4(tensor, name: str, shape_doc: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got dtype {tensor.dtype}")
    if tensor.ndim != 4:
        raise ValueError(f"{name} must have shape {shape_doc}, got {tuple(tensor.shape)}")


def _check_device(tensor: torch.Tensor, codes: torch.Tensor, name: str) -> None:
    if tensor.device != codes.device:
        raise ValueError(f"{name} ({tensor.device}) and codes ({codes.device}) must be on the same device")


def _validate_scores(queries, codes, codewords, index_bits) -> tuple[int, int, int]:
    """-> (N, k, n_blocks)."""
    n_codewords, k = _check_codebook(codewords, index_bits)
    _check_float4(queries, "queries", "[B, H, Q, D]")
    _check_codes(codes)
    _check_device(queries, codes, "queries")
    bq, hq, _, dim = queries.shape
    bc, hc, _, code_size = codes.shape
    if (bq, hq) != (bc, hc):
        raise ValueError(f"queries [B={bq}, H={hq}, ...] and codes [B={bc}, H={hc}, ...] disagree on B/H")
    if dim % k:
        raise ValueError(f"query dim D={dim} is not a multiple of the codeword size k={k}")
    n_blocks = dim // k
    expected = NORM_BYTES + packed_size(n_blocks, index_bits)
    if code_size != expected:
        raise ValueError(f"codes have code_size={code_size} bytes, but D={dim}, k={k}, index_bits={index_bits} "
                         f"need {expected} ({NORM_BYTES} norm bytes + {n_blocks} x {index_bits} bits)")
    return n_codewords, k, n_blocks


def _validate_weighted_sum(weights, codes, codewords, index_bits, dim) -> tuple[int, int, int]:
    """-> (N, k, n_blocks)."""
    n_codewords, k = _check_codebook(codewords, index_bits)
    _check_float4(weights, "weights", "[B, H, Q, M]")
    _check_codes(codes)
    _check_device(weights, codes, "weights")
    bw, hw, _, mw = weights.shape
    bc, hc, mc, code_size = codes.shape
    if (bw, hw) != (bc, hc):
        raise ValueError(f"weights [B={bw}, H={hw}, ...] and codes [B={bc}, H={hc}, ...] disagree on B/H")
    if mw != mc:
        raise ValueError(f"weights have M={mw} tokens but codes have M={mc}")
    if code_size < NORM_BYTES:
        raise ValueError(f"code_size={code_size} is smaller than the {NORM_BYTES} norm bytes")
    if dim is None:
        # The largest block count whose indices fit the index bytes (exact whenever, as for every
        # FibQuant/TurboQuant config with 8 | D*w/k, the packing has no spare index-sized slot).
        n_blocks = (code_size - NORM_BYTES) * 8 // index_bits
        if n_blocks < 1:
            raise ValueError(f"code_size={code_size} holds no {index_bits}-bit index")
    else:
        if not _is_int(dim) or dim < 1 or dim % k:
            raise ValueError(f"dim must be a positive multiple of k={k}, got {dim!r}")
        n_blocks = dim // k
    expected = NORM_BYTES + packed_size(n_blocks, index_bits)
    if code_size != expected:
        raise ValueError(f"codes have code_size={code_size} bytes, but D={n_blocks * k}, k={k}, "
                         f"index_bits={index_bits} need {expected}")
    return n_codewords, k, n_blocks


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


# --------------------------------------------------------------------------- torch reference
def _unpack(codes: torch.Tensor, codewords: torch.Tensor, index_bits: int, n_blocks: int):
    """codes [..., C] -> (indices int64 [..., n_blocks], norms float32 [...]) with the index check."""
    index = unpack_bits(codes[..., NORM_BYTES:], index_bits, n_blocks)
    n_codewords = codewords.shape[0]
    if n_codewords != 1 << index_bits and index.numel() and int(index.max()) >= n_codewords:
        raise ValueError(f"codes hold an index >= N={n_codewords} (index_bits={index_bits})")
    return index, bytes_to_float16(codes[..., :NORM_BYTES])


def _decoded_rotated(codes, codewords, index_bits, n_blocks) -> torch.Tensor:
    """codes [B, H, M, C] -> rotated decoded vectors nu * concat_j c[idx_j], float32 [B, H, M, D]."""
    index, norms = _unpack(codes, codewords, index_bits, n_blocks)
    codewords = codewords.to(codes.device)
    units = codewords[index].reshape(*index.shape[:-1], n_blocks * codewords.shape[1])
    return units * norms.unsqueeze(-1)


def coded_scores_reference(queries: torch.Tensor, codes: torch.Tensor, codewords: torch.Tensor,
                           index_bits: int) -> torch.Tensor:
    """The spec of `coded_scores`: unpack, gather the codewords, scale by nu, einsum (any device)."""
    _, _, n_blocks = _validate_scores(queries, codes, codewords, index_bits)
    keys = _decoded_rotated(codes, codewords, index_bits, n_blocks)
    return torch.einsum("bhqd,bhmd->bhqm", queries, keys)


def coded_weighted_sum_reference(weights: torch.Tensor, codes: torch.Tensor, codewords: torch.Tensor,
                                 index_bits: int, *, dim: Optional[int] = None) -> torch.Tensor:
    """The spec of `coded_weighted_sum`: unpack, gather, scale by nu, einsum (any device)."""
    _, _, n_blocks = _validate_weighted_sum(weights, codes, codewords, index_bits, dim)
    values = _decoded_rotated(codes, codewords, index_bits, n_blocks)
    return torch.einsum("bhqm,bhmd->bhqd", weights, values)

