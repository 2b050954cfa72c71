"""FibQuant: normalise, Haar-rotate, vector-quantize k-blocks with a universal codebook.

Code layout of one vector (code_size bytes, vector i of a flat batch at byte i * code_size):

    bytes [0, 2)            nu = ||x|| as IEEE fp16 (little-endian); costs 16 / dim bits per coordinate
    bytes [2, code_size)    dim/k block indices, ceil(log2 N) bits each, bit-packed little-endian
                            (index j at bits [j*w, (j+1)*w) of this byte range, w = ceil(log2 N))

code_size = 2 + ceil((dim/k) * ceil(log2 N) / 8). `bits_per_coordinate` (the index stream, see
codecs/base.py) is ceil(log2 N) / k; for N not a power of two the information rate log2(N)/k is
smaller and is `nominal_bits_per_coordinate`. `stored_bits_per_coordinate` adds the norm.
A zero vector stores nu = 0 and decodes to zero. With `norm_correction=True` (spec "fibquant:b=2,nc=1")
bytes [0, 2) hold ||x|| / ||u_hat|| instead (u_hat the code's concatenated codewords), so the decoded
vector keeps the input's norm at zero extra bytes (measured in docs/codecs.md, "FibQuant-RVQ").
The constructor, `for_rate` and `FibQuantConfig` default to off (a saved config without the field, or
with False, means off). A spec string without `nc=` takes the per-rate default `default_norm_correction`:
on at 4 bits per coordinate (`NC_DEFAULT_BITS`: lower KL in the cache, needle unchanged), off below
(at 2 bits it raised KL); `nc=0` / `nc=1` always mean off / on.

`for_rate(dim, bits)` picks (k, N) with log2(N)/k = bits: among the block sizes k dividing dim
with N = 2^(bits*k) an integer power of two in [2, MAX_SEARCH_CODEWORDS], the largest k (more
bits go to joint shaping, which measured best; see docs/codecs.md). For dim = 64 and 128:

    bits   0.1875  0.25  0.375  0.5  0.75  1    1.5   2    2.5   3     3.5  4
    k      64      32    32     16   16    8    8     4    4     4     2    2
    N      4096    256   4096   256  4096  256  4096  256  1024  4096  128  256
    d=64   ship    ship  build  ship build ship build ship ship  ship  ship ship   (v2 files)
    d=128  ship    ship  ship   ship ship  ship ship  ship ship  ship  ship ship   (v3 files)

(dim = 128 also takes 0.09375: k = 128, N = 4096.) Encode speed (CPU, numba search, one thread): every
default rate from 1 to 4 bits encodes at >= 0.5x TurboQuant's rate (2.5 bits at d = 64 on the line:
0.41-0.56 across runs) except 1.5 bits (k = 8, N = 4096, a full scan: ~0.05x); no other block size
comes within 1 % of its MSE (k = 4, N = 64: +7.8 %), so for_rate keeps it (docs/codecs.md, "Encode speed at the default rates against TurboQuant").
Every other (dim, k, N), e.g. head sizes 80, 96
and 256, builds on first use with the v3 recipe (codebook/recipe_v3.py: a fixed work budget, at most
~21 CPU-seconds on one thread as measured, see docs/codecs.md) and is cached.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from ..codebook import CodebookSpec, load_codebook
from ..codebook.numba_search import NumbaSearch, numba_available
from ..codebook.box_grid import GridSearch, default_cells
from ..codebook.nearest import nearest_codeword
from .base import FP16_MAX, Codec, PlotStyle, SpecParam, _split_codes
from .bitpack import NORM_BYTES, pack_bits, packed_size, unpack_bits
from .reader import CodebookReader
from .layout import CodeLayout
from .norm_correction import corrected_norm_bytes, reference_norm_bytes
from .rotation import RotationState, check_rotation_seed, rotation_seed_of

MAX_SEARCH_CODEWORDS = 4096  # for_rate never picks more (search cost N*k per block)
MAX_GRID_CODEWORDS = 1024    # the grid-pruned search's tables cost boxes * N to build
# Index bits per coordinate at which a spec without nc= turns norm correction on. Measured (docs/codecs.md,
# docs/peers-and-long-context.md): at 4 bits KL 0.918x of plain (7/8 paired cells), needle unchanged;
# at 2 bits KL 1.100x (8/8 cells worse), so the lower rates stay off.
NC_DEFAULT_BITS = frozenset({4.0})
# Part dtypes `encode_parts` copies straight into its float32 working block (each widens to float32 exactly).
FAST_PART_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# encode_parts reuses its working arrays (inputs, quotients, rotated rows, indices: ~1.1 KB per row at dim 64)
# for calls of up to this many rows, one set per thread and (dim, blocks): a prefill's encode calls
# (`kv.layer.ENCODE_CHUNK_ROWS` vectors) then fault in no new pages per layer.
ENCODE_SCRATCH_ROWS = 8192
_SCRATCH = threading.local()


def _encode_scratch(rows: int, dim: int, blocks: int) -> tuple | None:
    """This thread's working arrays of `encode_parts` for `rows` rows of `dim` floats in `blocks` blocks:
    (inputs float32 [c, dim], quotients float32 [c, dim], rotated rows torch float32 [c, dim], indices
    int64 [c, blocks], flags int8 [c, blocks]) with capacity c >= rows, or None above ENCODE_SCRATCH_ROWS."""
    if rows > ENCODE_SCRATCH_ROWS:
        return None
    held = _SCRATCH.__dict__.setdefault("sets", {})
    arrays = held.get((dim, blocks))
    if arrays is None or arrays[0].shape[0] < rows:
        capacity = min(ENCODE_SCRATCH_ROWS, max(256, 1 << (rows - 1).bit_length()))
        arrays = held[(dim, blocks)] = (np.empty((capacity, dim), dtype=np.float32),
                                        np.empty((capacity, dim), dtype=np.float32),
                                        torch.empty(capacity, dim, dtype=torch.float32),
                                        np.empty((capacity, blocks), dtype=np.int64),
                                        np.empty((capacity, blocks), dtype=np.int8))
    return arrays


@dataclass(frozen=True)
class FibQuantConfig:
    dim: int
    k: int
    n_codewords: int
    seed: int = 0
    norm_correction: bool = False  # store ||x|| / ||u_hat|| in place of ||x|| (same 2 bytes)
    rotation_seed: int | None = None  # the seed of Pi (None: `seed`); the codebook stays `seed`'s

    def __post_init__(self) -> None:
        CodebookSpec(self.dim, self.k, self.n_codewords, self.seed)  # validates all four
        if not isinstance(self.norm_correction, bool):
            raise ValueError(f"norm_correction must be a bool, got {self.norm_correction!r}")
        check_rotation_seed(self.rotation_seed)

    @property
    def index_bits(self) -> int:
        return max(1, math.ceil(math.log2(self.n_codewords)))

    @property
    def n_blocks(self) -> int:
        return self.dim // self.k


def default_norm_correction(k: int, n_codewords: int) -> bool:
    """The norm correction a spec without `nc=` gets: on when the code's stored index rate
    ceil(log2 N) / k is in NC_DEFAULT_BITS (the same rule for `b=` and explicit `k=,n=` specs)."""
    return max(1, math.ceil(math.log2(n_codewords))) / k in NC_DEFAULT_BITS


def choose_block(dim: int, bits: float, max_codewords: int = MAX_SEARCH_CODEWORDS) -> tuple[int, int]:
    """(k, N) for `bits` per coordinate: the largest k | dim with N = 2^(bits*k) a power of two <= max."""
    if not isinstance(bits, (int, float)) or not math.isfinite(bits) or bits <= 0:
        raise ValueError(f"bits per coordinate must be a positive number, got {bits!r}")
    best = None
    for k in range(1, dim + 1):
        if dim % k:
            continue
        index_bits = bits * k
        if abs(index_bits - round(index_bits)) > 1e-9 or round(index_bits) < 1:
            continue
        n_codewords = 1 << round(index_bits)
        if n_codewords <= max_codewords:
            best = (k, n_codewords)
    if best is None:
        raise ValueError(f"no block size k dividing dim={dim} gives {bits} bits per coordinate with "
                         f"N = 2^(bits*k) <= {max_codewords} codewords")
    return best


class FibQuantCodec(Codec):
    """Universal vector quantizer: encode float [..., dim] -> uint8 [..., code_size] and back.

    Spec strings: "fibquant:b=2" (`for_rate`) or "fibquant:k=64,n=4096" (explicit block and size).
    """

    family = "fibquant"
    fibquant_code = True
    spec_params = (SpecParam("b", "bits", float), SpecParam("k", "k"), SpecParam("n", "n"), SpecParam("nc", "nc"),
                   SpecParam("r", "rotation_seed"))
    style = PlotStyle("FibQuant", "C3", "o", frontier="frontier; dots: other k, N")
    # CPU encode through the numba search (codebook/numba_search.py) when numba imports; False: the
    # torch path (`search_method`), which CUDA tensors always take. Both give the reference's codes.
    fast_search = True
    # Norm correction from the numba encode's indices through codecs/norm_correction.py's numba path
    # (the spec's bytes); False: the torch float64 spec itself.
    fast_norm_correction = True

    def __init__(self, dim: int, k: int, n_codewords: int, seed: int = 0, norm_correction: bool = False,
                 rotation_seed: int | None = None):
        super().__init__(FibQuantConfig(dim, k, n_codewords, seed, norm_correction, rotation_seed))
        self.k, self.n_codewords, self.seed, self.norm_correction = k, n_codewords, seed, norm_correction
        self.rotation_seed = rotation_seed
        self._codebook = None  # loaded (or built) on first use: constructing a codec is cheap
        self._cpu_encode = None  # (NumbaSearch, Pi^T) once built (both also held in device_state)
        self._rotation = RotationState(dim, rotation_seed_of(seed, rotation_seed), self.device_state)
        cells = default_cells(k)
        # Exact grid-pruned search for small k and N, chunked matmul search otherwise.
        self.search_method = "grid" if cells is not None and n_codewords <= MAX_GRID_CODEWORDS else "matmul"

    @classmethod
    def for_rate(cls, dim: int, bits: float, seed: int = 0, norm_correction: bool = False,
                 rotation_seed: int | None = None) -> "FibQuantCodec":
        """The codec for `bits` per coordinate (see the module table)."""
        if not isinstance(dim, int) or dim < 2:
            raise ValueError(f"dim must be an integer >= 2, got {dim!r}")
        k, n_codewords = choose_block(dim, bits)
        return cls(dim, k, n_codewords, seed, norm_correction, rotation_seed)

    @staticmethod
    def block_of(dim: int, bits: float | None = None, k: int | None = None, n: int | None = None) -> tuple[int, int]:
        """(k, N) of a spec: the explicit pair, else `choose_block(dim, bits)`."""
        return (k, n) if k is not None else choose_block(dim, bits)

    @classmethod
    def check_spec(cls, params: dict) -> None:
        explicit = params.get("k") is not None or params.get("n") is not None
        if params.get("bits") is None and (params.get("k") is None or params.get("n") is None):
            raise ValueError("fibquant needs b=<bits> or both k=<block> and n=<codewords>")
        if params.get("bits") is not None and explicit:
            raise ValueError("fibquant takes b=<bits> or k=<block>,n=<codewords>, not both")
        if params.get("nc") not in (None, 0, 1):
            raise ValueError(f"fibquant nc= (norm correction) must be 0 or 1, got {params.get('nc')}")
        check_rotation_seed(params.get("rotation_seed"))

    @classmethod
    def spec_label(cls, dim: int, bits: float | None = None, k: int | None = None, n: int | None = None,
                   nc: int | None = None, rotation_seed: int | None = None) -> str:
        k, n = cls.block_of(dim, bits, k, n)
        corrected = default_norm_correction(k, n) if nc is None else bool(nc)
        extra = (",nc" if corrected else "") + (f",r={rotation_seed}" if rotation_seed is not None else "")
        return f"FibQuant b={(n - 1).bit_length() / k:.4g} (k={k},N={n}{extra})"

    @classmethod
    def from_spec(cls, dim: int, bits: float | None = None, k: int | None = None,
                  n: int | None = None, nc: int | None = None, rotation_seed: int | None = None) -> "FibQuantCodec":
        k, n = cls.block_of(dim, bits, k, n)
        corrected = default_norm_correction(k, n) if nc is None else bool(nc)  # nc= given: as given
        return cls(dim, k, n, norm_correction=corrected, rotation_seed=rotation_seed)

    @classmethod
    def spec_unavailable(cls, dim: int, bits: float | None = None, k: int | None = None,
                         n: int | None = None, nc: int | None = None, rotation_seed: int | None = None) -> str | None:
        k, n = cls.block_of(dim, bits, k, n)
        try:
            load_codebook(dim, k, n, build=False)
        except FileNotFoundError:
            return f"codebook d={dim} k={k} N={n} neither shipped nor cached; pass --build-codebooks to build it"
        return None

    @property
    def codebook(self):
        """The universal (dim, k, N, seed) `Codebook`, shipped/cached or built on first access."""
        if self._codebook is None:
            self._codebook = load_codebook(self.dim, self.k, self.n_codewords, self.seed)
        return self._codebook

    @property
    def code_size(self) -> int:
        return NORM_BYTES + packed_size(self.config.n_blocks, self.config.index_bits)

    @property
    def bits_per_coordinate(self) -> float:
        return self.config.index_bits / self.k

    @property
    def nominal_bits_per_coordinate(self) -> float:
        return math.log2(self.n_codewords) / self.k

    def shared_tensors(self) -> list[torch.Tensor]:
        loaded = [self._codebook.codewords] if self._codebook is not None else []
        return loaded + super().shared_tensors()

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(codewords [N, k], their squared norms [N]) on `device`, float32."""
        def build(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
            codewords = self.codebook.codewords.to(device)
            return codewords, (codewords ** 2).sum(-1)

        return self.device_state.get("codewords", device, build)

    def reader(self, device: torch.device) -> CodebookReader:
        device = torch.device(device)
        return CodebookReader(self.dim, self._rotation.forward_matrix(device), self.config.index_bits,
                              self._table(device)[0], type(self).__name__)

    def _numba_search(self, device: torch.device) -> NumbaSearch | None:
        """The numba search tables for CPU tensors, or None where the torch path runs."""
        if device.type != "cpu" or not self.fast_search or not numba_available():
            return None
        return self.device_state.get("numba_search", device,
                                     lambda d: NumbaSearch(self._table(d)[0], self.dim))

    def block_indices(self, u: torch.Tensor) -> torch.Tensor:
        """Rotated unit rows u [n, dim] -> nearest-codeword indices [n, dim/k] (int64), exact: the
        reference search's (codebook/numba_search.py on the CPU with numba; on the torch path the grid
        prunes candidates provably, see codebook/box_grid.py, and the float32 matmul can differ
        from the reference at float32 near ties)."""
        fast = self._numba_search(u.device)
        if fast is not None:
            return fast.indices(u)
        codewords, sq_norms = self._table(u.device)
        blocks = u.reshape(-1, self.k)
        if self.search_method == "grid":
            grid = self.device_state.get("grid", u.device,
                                         lambda d: GridSearch(codewords, self.dim, default_cells(self.k)))
            flat = grid.search(blocks, codewords, sq_norms)
        else:
            flat = nearest_codeword(blocks, codewords, sq_norms)
        return flat.reshape(u.shape[0], self.config.n_blocks)

    def _encode_numba(self, x: torch.Tensor, fast: NumbaSearch, forward: torch.Tensor,
                      norms: torch.Tensor | None = None, scratch: tuple | None = None) -> tuple[torch.Tensor, np.ndarray]:
        """CPU encode: `RotationState.normalise_rotate`'s float32 ops (the same torch norm and
        matmul, an IEEE float32 division, IEEE fp16 rounding) with fewer torch calls, then search
        + packing in numba. Returns (codes, the block indices int64 [n, dim/k]). `norms`: x's
        norms [n] as computed here, when the caller has them (and checked their range). `scratch`
        (`_encode_scratch`): reused arrays for the quotient, the rotated rows and the indices (the same
        division and matmul written into them); the indices returned are then a view of it."""
        x = x.detach()
        if norms is None:
            norms = torch.linalg.vector_norm(x, 2, [1])                   # = x.norm(dim=1)
            if float(norms.numpy().max()) > FP16_MAX:
                raise ValueError(f"{type(self).__name__}: vector norm exceeds the fp16 range of the stored norm")
        norms_np = norms.numpy()
        safe = np.where(norms_np > 0, norms_np, np.float32(1.0))
        # numpy's float32 -> float16 rounding equals torch's (checked for every float32 in [0, FP16_MAX]).
        norm_bytes = norms_np.astype(np.float16).view(np.uint8).reshape(len(norms_np), 2)
        if scratch is None:
            u = torch.from_numpy(x.numpy() / safe[:, None]) @ forward
            return fast.encode_index(u, norm_bytes, self.config.index_bits)
        n = len(norms_np)
        quotient = np.divide(x.numpy(), safe[:, None], out=scratch[1][:n])
        u = torch.mm(torch.from_numpy(quotient), forward, out=scratch[2][:n])  # mm's out variant: the same kernel as @
        return fast.encode_index(u, norm_bytes, self.config.index_bits, scratch[3:])

    def _cpu_tables(self) -> tuple[NumbaSearch, torch.Tensor] | None:
        """(NumbaSearch, Pi^T) of the CPU numba encode, or None where it does not run."""
        if not self.fast_search:
            return None
        if self._cpu_encode is None:
            cpu = torch.device("cpu")
            fast = self._numba_search(cpu)
            if fast is None:
                return None
            self._cpu_encode = (fast, self._rotation.forward_matrix(cpu))
        return self._cpu_encode

    def encode_parts(self, parts) -> list[torch.Tensor]:
        """`Codec.encode_parts` (the same codes) with less per-call cost for float32, bfloat16 and float16 CPU
        tensors outside autograd: one copy of the parts into a contiguous float32 [n, dim] block (no stack, no
        reshape copies; a half-precision part widened in that copy, exactly as `encode`'s conversion), the
        working arrays reused across calls (`_encode_scratch`: no fresh pages per call), finiteness read
        from the norms (a NaN / inf coordinate makes its row's norm NaN / inf; such a
        call, and one over the fp16 range, goes through `Codec.encode_parts`, which raises as `encode`)."""
        parts = list(parts)
        tables = self._cpu_tables() if parts else None
        if tables is None or not all(isinstance(p, torch.Tensor) and p.dtype in FAST_PART_DTYPES and p.is_cpu
                                     and not p.requires_grad and p.ndim >= 1 and p.shape[-1] == self.dim
                                     for p in parts):
            return super().encode_parts(parts)
        counts = [p.numel() // self.dim for p in parts]
        scratch = _encode_scratch(sum(counts), self.dim, self.config.n_blocks)
        x = scratch[0][:sum(counts)] if scratch is not None else np.empty((sum(counts), self.dim), dtype=np.float32)
        at = 0
        for part, count in zip(parts, counts):
            if part.dtype == torch.float32:
                np.copyto(x[at:at + count].reshape(part.shape), part.numpy())
            else:  # bf16 / fp16 (vLLM's K and V): widened exactly, as encode's .to(float32), straight into x
                torch.from_numpy(x[at:at + count]).view(part.shape).copy_(part)
            at += count
        flat = torch.from_numpy(x)
        if len(x) == 0:
            codes = torch.empty(0, self.code_size, dtype=torch.uint8)
        else:
            norms = torch.linalg.vector_norm(flat, 2, [1])
            if not float(norms.numpy().max()) <= FP16_MAX:  # NaN / inf / too long: the checks and errors of encode
                return super().encode_parts(parts)
            codes, index = self._encode_numba(flat, *tables, norms, scratch)
            if self.norm_correction:
                codes = self._correct_norms(flat, codes, index)
        return _split_codes(codes, parts, self.code_size)

    def _encode_flat(self, x: torch.Tensor) -> torch.Tensor:
        codes, index = self._encode_plain(x)
        return self._correct_norms(x, codes, index) if self.norm_correction else codes

    def _correct_norms(self, x: torch.Tensor, codes: torch.Tensor, index: np.ndarray | None = None) -> torch.Tensor:
        """Norm correction: overwrite the stored ||x|| with ||x|| / ||u_hat|| (u_hat the decoded unit-domain
        vector of the code's indices, ||u_hat||^2 = the sum of its codewords' squared norms), so decode
        returns a vector of the input's norm. Same 2 bytes; zero vectors keep 0. `index` [n, dim/k]
        (int64, the numba encode's, whose codes the caller owns): the indices the codes hold, unpacked
        otherwise. The bytes are the spec's (`norm_correction.corrected_norms_reference`); with `index`
        and numba they come from its fast path, which falls back to the spec wherever it cannot
        prove its bytes equal (codecs/norm_correction.py)."""
        owned = index is not None
        sq_norms = self.device_state.get("sq_norms64", codes.device, lambda d: self._table(d)[1].to(torch.float64))
        if owned and self.fast_norm_correction and x.dtype == torch.float32 and x.is_contiguous() \
                and codes.device.type == "cpu" and numba_available():
            fast = corrected_norm_bytes(x.detach().numpy(), index, sq_norms.numpy())
            if fast is not None:
                codes.numpy()[:, :NORM_BYTES] = fast
                return codes
        index = torch.from_numpy(index) if owned else unpack_bits(codes[:, NORM_BYTES:], self.config.index_bits,
                                                                  self.config.n_blocks)
        try:
            norm_bytes = reference_norm_bytes(x, index, sq_norms)
        except ValueError:
            raise ValueError(f"{type(self).__name__}: corrected norm exceeds the fp16 range of the stored norm") from None
        codes = codes if owned else codes.clone()
        codes[:, :NORM_BYTES] = norm_bytes
        return codes

    def _encode_plain(self, x: torch.Tensor) -> tuple[torch.Tensor, np.ndarray | None]:
        """(codes without norm correction, the block indices int64 [n, dim/k] where the numba path ran, else None)."""
        tables = self._cpu_tables() if x.device.type == "cpu" and x.is_contiguous() else None
        if tables is not None:
            return self._encode_numba(x, *tables)
        fast = self._numba_search(x.device)
        norm_bytes, u = self._rotation.normalise_rotate(x, type(self).__name__)
        if fast is not None:
            return fast.encode_index(u, norm_bytes, self.config.index_bits)
        packed = pack_bits(self.block_indices(u), self.config.index_bits)
        return torch.cat([norm_bytes, packed], dim=1), None

    def _decode_flat(self, codes: torch.Tensor) -> torch.Tensor:
        u_hat = self.reader(codes.device).unit_rows(codes)
        return self._rotation.unrotate_scale(u_hat, codes[:, :NORM_BYTES])

    @property
    def code_layout(self) -> CodeLayout:
        """[fp16 norm][n_blocks packed indices in [0, N)]: what `CodeArchive` needs to store the codes."""
        return CodeLayout(self.n_codewords, self.config.n_blocks, NORM_BYTES)

    def __repr__(self) -> str:
        rotation = f", rotation_seed={self.rotation_seed}" if self.rotation_seed is not None else ""
        return (f"FibQuantCodec(dim={self.dim}, k={self.k}, N={self.n_codewords}, seed={self.seed}{rotation}, "
                f"bits/coord={self.bits_per_coordinate:.4g}, code_size={self.code_size}B, "
                f"ratio={self.compression_ratio:.2f}x)")
