"""FibQuant-RVQ: normalise, Haar-rotate, residual-quantize k-blocks (k = 8) with universal stages.

The same canonical source as FibQuant (norm nu = ||x||, u = Pi x / nu, k-blocks of u), coded by a
calibration-free residual code of S stages of N codewords in R^k (`codebook/residual.py`: fitted on
the canonical source only), searched with a beam. At k = 8, N = 256 every stage costs 1 bit per
coordinate: "fibrvq:b=2" is 2 stages (65 536 sums per 8-block), b = 3 three, b = 4 four.

Code layout of one vector (code_size bytes, vector i of a flat batch at byte i * code_size):

    bytes [0, 2)            the stored norm as IEEE fp16: nu = ||x||, or with norm_correction
                            nu / ||u_hat|| (so the decoded vector has the input's norm; no extra byte)
    bytes [2, code_size)    (dim/k) * S indices of ceil(log2 N) bits, block-major (block j, stage s at
                            position j * S + s), bit-packed little-endian

code_size = 2 + ceil((dim/k) * S * ceil(log2 N) / 8): d = 64, b = 2: 18 bytes (FibQuant b = 2's size).
`bits_per_coordinate` = S * ceil(log2 N) / k. Decode: sum the S codewords of each block, concatenate,
apply Pi^T, scale by the stored norm. A zero vector stores 0 and decodes to zero.

Attention on codes: its reader (`StagesReader`) holds the stages: q . (c_1 + c_2) = q . c_1 + q . c_2, so
a one-token decode step on the CPU reads its codes with one lookup table per stage
(kv/attention/numba_residual.py, N = 256). Other paths (prefill chunks, CUDA, N != 256) read the rows in
the rotated domain through the reader's torch methods.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codebook.residual import MAX_STAGES, ResidualSpec, beam_search, exhaustive_search, index_bits, load_residual
from ..codebook.residual_numba import beam_tables, fast_beam_search
from .base import FP16_MAX, Codec, PlotStyle, SpecParam
from .bitpack import NORM_BYTES, float16_to_bytes, pack_bits, packed_size, unpack_bits
from .reader import StagesReader
from .layout import CodeLayout
from .rotation import RotationState, check_rotation_seed, rotation_seed_of

DEFAULT_K = 8
DEFAULT_N = 256
DEFAULT_BEAM = 16
RATE_STAGES = {1: 1, 2: 2, 3: 3, 4: 4}  # b -> stages at k = 8, N = 256


@dataclass(frozen=True)
class FibRVQConfig:
    dim: int
    k: int = DEFAULT_K
    stages: int = 2
    n_codewords: int = DEFAULT_N
    beam: int = DEFAULT_BEAM
    norm_correction: bool = False
    seed: int = 0
    rotation_seed: int | None = None  # the seed of Pi (None: `seed`); the stages stay `seed`'s

    def __post_init__(self) -> None:
        ResidualSpec(self.dim, self.k, self.stages, self.n_codewords, self.seed)  # validates those
        if isinstance(self.beam, bool) or not isinstance(self.beam, int) or self.beam < 1:
            raise ValueError(f"beam must be a positive integer, got {self.beam!r}")
        if not isinstance(self.norm_correction, bool):
            raise ValueError(f"norm_correction must be a bool, got {self.norm_correction!r}")
        check_rotation_seed(self.rotation_seed)

    @property
    def spec(self) -> ResidualSpec:
        return ResidualSpec(self.dim, self.k, self.stages, self.n_codewords, self.seed)

    @property
    def index_bits(self) -> int:
        return index_bits(self.n_codewords)

    @property
    def n_blocks(self) -> int:
        return self.dim // self.k


class FibRVQCodec(Codec):
    """Universal residual vector quantizer: float [..., dim] <-> uint8 [..., code_size].

    Spec strings: "fibrvq:b=2" (k = 8, N = 256, b stages), "fibrvq:b=2,k=16" (b * k / 8 stages of 256),
    "fibrvq:k=8,s=3,n=256", options
    w=<beam> (default 16), nc=1 (norm correction) and r=<seed> (another rotation draw)."""

    family = "fibrvq"
    fibquant_code = True
    spec_params = (SpecParam("b", "bits"), SpecParam("k", "k"), SpecParam("s", "stages"), SpecParam("n", "n"),
                   SpecParam("w", "beam"), SpecParam("nc", "nc"), SpecParam("r", "rotation_seed"))
    style = PlotStyle("FibQuant-RVQ (k=8)", "C1", "D")

    def __init__(self, dim: int, k: int = DEFAULT_K, stages: int = 2, n_codewords: int = DEFAULT_N,
                 beam: int = DEFAULT_BEAM, norm_correction: bool = False, seed: int = 0,
                 rotation_seed: int | None = None):
        super().__init__(FibRVQConfig(dim, k, stages, n_codewords, beam, norm_correction, seed,
                                                rotation_seed))
        self.k, self.stages, self.n_codewords, self.beam = k, stages, n_codewords, beam
        self.norm_correction, self.seed, self.rotation_seed = norm_correction, seed, rotation_seed
        self.fast_search = True  # the numba beam search (same codes as the torch one); False: torch's
        self._codebook: torch.Tensor | None = None
        self._rotation = RotationState(dim, rotation_seed_of(seed, rotation_seed), self.device_state)

    # ------------------------------------------------------------------ spec strings
    @staticmethod
    def _shape_of(dim: int, bits=None, k=None, stages=None, n=None) -> tuple[int, int, int]:
        if bits is not None:  # b= alone: k = 8; b= with k=: b * k / 8 stages of 256
            block = DEFAULT_K if k is None else k
            return block, RATE_STAGES[bits] * block // DEFAULT_K, DEFAULT_N
        return k, stages, n

    @classmethod
    def check_spec(cls, params: dict) -> None:
        explicit = [params.get(name) for name in ("k", "stages", "n")]
        if params.get("bits") is not None:
            if params.get("stages") is not None or params.get("n") is not None:
                raise ValueError("fibrvq takes b=<bits> (optionally with k=<block>) or k=,s=,n=, not both")
            if params["bits"] not in RATE_STAGES:
                raise ValueError(f"fibrvq b= must be one of {tuple(RATE_STAGES)}, got {params['bits']}")
            block = params.get("k")
            if block is not None and (block < 1 or block % DEFAULT_K
                                      or RATE_STAGES[params["bits"]] * block // DEFAULT_K > MAX_STAGES):
                raise ValueError(f"fibrvq b= with k= needs k a multiple of {DEFAULT_K} with b * k / {DEFAULT_K} "
                                 f"<= {MAX_STAGES} stages of {DEFAULT_N}, got b={params['bits']}, k={block}")
        elif any(v is None for v in explicit):
            raise ValueError("fibrvq needs b=<bits> or all of k=<block>, s=<stages>, n=<codewords per stage>")
        if params.get("nc") not in (None, 0, 1):
            raise ValueError(f"fibrvq nc= must be 0 or 1, got {params.get('nc')}")
        check_rotation_seed(params.get("rotation_seed"))

    @classmethod
    def spec_label(cls, dim: int, bits=None, k=None, stages=None, n=None, beam=None, nc=None,
                   rotation_seed=None) -> str:
        k, stages, n = cls._shape_of(dim, bits, k, stages, n)
        rate = stages * index_bits(n) / k
        extra = (f",w={beam}" if beam is not None else "") + (",nc" if nc else "")
        extra += f",r={rotation_seed}" if rotation_seed is not None else ""
        return f"FibQuant-RVQ b={rate:.4g} (k={k},{stages}x{n}{extra})"

    @classmethod
    def from_spec(cls, dim: int, bits=None, k=None, stages=None, n=None, beam=None,
                  nc=None, rotation_seed=None) -> "FibRVQCodec":
        k, stages, n = cls._shape_of(dim, bits, k, stages, n)
        return cls(dim, k, stages, n, DEFAULT_BEAM if beam is None else beam, bool(nc), rotation_seed=rotation_seed)

    @classmethod
    def spec_unavailable(cls, dim: int, bits=None, k=None, stages=None, n=None, beam=None, nc=None,
                         rotation_seed=None) -> str | None:
        k, stages, n = cls._shape_of(dim, bits, k, stages, n)
        spec = ResidualSpec(dim, k, stages, n)
        try:
            load_residual(spec, build=False)
        except FileNotFoundError:
            return f"residual codebook {spec.file_name} neither shipped nor cached; pass --build-codebooks to build it"
        return None

    # ------------------------------------------------------------------ state
    @property
    def codebook(self) -> torch.Tensor:
        """The stages [S, N, k] float32 on the CPU (shipped/cached, or built on first access)."""
        if self._codebook is None:
            self._codebook = load_residual(self.config.spec)
        return self._codebook

    def _stages(self, device: torch.device) -> torch.Tensor:
        return self.device_state.get("stages", device, lambda d: self.codebook.to(d))

    def reader(self, device: torch.device) -> StagesReader:
        device = torch.device(device)
        return StagesReader(self.dim, self._rotation.forward_matrix(device), self.config.index_bits,
                            self._stages(device), type(self).__name__)

    def shared_tensors(self) -> list[torch.Tensor]:
        loaded = [self._codebook] if self._codebook is not None else []
        return loaded + super().shared_tensors()

    @property
    def code_size(self) -> int:
        return NORM_BYTES + packed_size(self.config.n_blocks * self.stages, self.config.index_bits)

    @property
    def bits_per_coordinate(self) -> float:
        return self.stages * self.config.index_bits / self.k

    @property
    def code_layout(self) -> CodeLayout:
        """[fp16 norm][(dim/k) * S packed indices in [0, N)]."""
        return CodeLayout(self.n_codewords, self.config.n_blocks * self.stages, NORM_BYTES)

    # ------------------------------------------------------------------ coding
    def block_indices(self, u: torch.Tensor, exhaustive: bool = False) -> torch.Tensor:
        """Rotated unit rows u [n, dim] -> indices [n, dim/k, S] (int64): the beam search (numba's
        `fast_beam_search` when `numba_search`, else torch's `beam_search`: the same indices), or with
        `exhaustive` the reference search over all N^S sums (small N^S only)."""
        blocks = u.reshape(-1, self.k)
        stages = self._stages(u.device)
        if exhaustive:
            idx = exhaustive_search(blocks.cpu(), stages.cpu()).to(u.device)
        elif self.fast_search and u.device.type == "cpu":
            tables = self.device_state.get("beam_tables", u.device, lambda d: beam_tables(stages))
            idx = fast_beam_search(blocks, stages, self.beam, tables)
        else:
            idx = beam_search(blocks, stages, self.beam)
        return idx.reshape(u.shape[0], self.config.n_blocks, self.stages)

    def _unit_reconstruction(self, index: torch.Tensor, device: torch.device) -> torch.Tensor:
        """indices [n, dim/k, S] -> u_hat [n, dim] float32."""
        return self.reader(device).stage_sum(index)

    def encode_with(self, x: torch.Tensor, exhaustive: bool) -> torch.Tensor:
        """`encode` with the beam (False) or the exhaustive reference search (True)."""
        self.check_input(x)
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.dim).to(torch.float32)
        return self._encode_rows(flat, exhaustive).reshape(*lead, self.code_size)

    def _encode_rows(self, x: torch.Tensor, exhaustive: bool) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.empty(0, self.code_size, dtype=torch.uint8, device=x.device)
        norm_bytes, u = self._rotation.normalise_rotate(x, type(self).__name__)
        index = self.block_indices(u, exhaustive)
        if self.norm_correction:
            norms = x.to(torch.float64).norm(dim=1)
            u_norm = self._unit_reconstruction(index, x.device).to(torch.float64).norm(dim=1)
            stored = torch.where(norms > 0, norms / u_norm.clamp_min(1e-30), torch.zeros_like(norms))
            if float(stored.max()) > FP16_MAX:
                raise ValueError(f"{type(self).__name__}: corrected norm exceeds the fp16 range")
            norm_bytes = float16_to_bytes(stored.to(torch.float32))
        packed = pack_bits(index.reshape(x.shape[0], -1), self.config.index_bits)
        return torch.cat([norm_bytes, packed], dim=1)

    def _encode_flat(self, x: torch.Tensor) -> torch.Tensor:
        return self._encode_rows(x, exhaustive=False)

    def _decode_flat(self, codes: torch.Tensor) -> torch.Tensor:
        u_hat = self.reader(codes.device).unit_rows(codes)
        return self._rotation.unrotate_scale(u_hat, codes[:, :NORM_BYTES])

    def __repr__(self) -> str:
        return (f"FibRVQCodec(dim={self.dim}, k={self.k}, stages={self.stages}, N={self.n_codewords}, "
                f"beam={self.beam}, norm_correction={self.norm_correction}, rotation_seed={self.rotation_seed}, "
                f"code_size={self.code_size}B)")

