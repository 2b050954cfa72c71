"""FibQuant-E8: normalise, Haar-rotate, code each 8-block with one index into an E8 shell code.

The same canonical source as FibQuant (nu = ||x||, u = Pi x / nu, 8-blocks of u), each block coded by the
nearest point of a calibration-free shell code (`codebook/e8shell.py`: E8 shells, each at its own radius,
at most 2^(8 b) points), found by the exact leader search. The levels (which shells, which radii) are
shipped for d = 64 and 128 (`codebook/e8shell_shipped.py`: fitted on the canonical source only, never on
model data; d = 128 keeps d = 64's shells with refitted radii); other head dimensions raise.

Code layout of one vector (code_size bytes, vector i of a flat batch at byte i * code_size):

    bytes [0, 2)            the stored norm as IEEE fp16: nu = ||x||, or with norm_correction
                            nu / ||u_hat|| (so the decoded vector has the input's norm; no extra byte;
                            ||u_hat||^2 = the sum of the blocks' level radii squared)
    bytes [2, code_size)    dim/8 indices of 8 b bits each (8 to 32), bit-packed little-endian

code_size = 2 + dim * b / 8: d = 64: 10 / 14 / 16 / 18 / 26 / 34 bytes at b = 1 / 1.5 / 1.75 / 2 / 3 / 4
(FibQuant's sizes).
`bits_per_coordinate` = b. Decode: unrank each index to its point, concatenate, apply Pi^T, scale by the
stored norm. A zero vector stores 0 and decodes to zero.

Attention on codes: no single codebook or stages (2^(8 b) points per block); its reader (`ShellsReader`)
gives the one-token decode step (kv/attention/numba_shells.py) the rotation and the decode tables (at b <= 2
every point as 8 int8, `codebook.e8shell_tables.compact_point_tables`; above, the decomposed `point_tables`),
so it reads these codes directly; prefill chunks read the rows in the rotated domain (the reader's torch
methods: queries rotated once, outputs un-rotated once).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._numba import numba_available
from ..codebook.e8shell import BLOCK, ShellLevels, codebook_points, exhaustive_search, shell_tables, unrank
from ..codebook.e8shell_search import shell_search
from ..codebook.e8shell_tables import COMPACT_MAX_POINTS, compact_point_tables, point_tables
from ..codebook.e8shell_shipped import SHIPPED_LEVELS
from .base import Codec, PlotStyle, SpecParam
from .bitpack import NORM_BYTES, pack_bits, packed_size, unpack_bits
from .reader import ShellsReader
from .layout import CodeLayout
from .norm_correction import corrected_norm_bytes, reference_norm_bytes
from .rotation import RotationState, check_rotation_seed, rotation_seed_of

SUPPORTED_BITS = (1, 1.5, 1.75, 2, 3, 4)  # 8 b index bits per 8-block: 8, 12, 14, 16, 24, 32


def _canonical_bits(bits: float) -> float:
    """2.0 -> 2 (the shipped table's and the labels' key); 1.5 stays 1.5."""
    return int(bits) if float(bits) == int(bits) else float(bits)


def shipped_levels(dim: int, bits: float) -> ShellLevels:
    """The shipped shell code for head dimension `dim` at `bits` per coordinate (ValueError if none)."""
    if (dim, bits) not in SHIPPED_LEVELS:
        supported = sorted(SHIPPED_LEVELS)
        raise ValueError(f"e8shell has levels for (dim, bits) in {supported}, not dim={dim}, bits={bits}")
    shells, radii = SHIPPED_LEVELS[dim, bits]
    return ShellLevels(tuple(shells), tuple(float(r) for r in radii))


@dataclass(frozen=True)
class E8ShellConfig:
    dim: int
    bits: float
    norm_correction: bool = False
    seed: int = 0
    rotation_seed: int | None = None  # the seed of Pi (None: `seed`); the levels do not depend on it

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < BLOCK or self.dim % BLOCK:
            raise ValueError(f"dim must be a positive multiple of {BLOCK}, got {self.dim!r}")
        if isinstance(self.bits, bool) or self.bits not in SUPPORTED_BITS:
            raise ValueError(f"E8ShellCodec supports bits in {SUPPORTED_BITS}, got {self.bits!r}")
        if not isinstance(self.norm_correction, bool):
            raise ValueError(f"norm_correction must be a bool, got {self.norm_correction!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        check_rotation_seed(self.rotation_seed)
        shipped_levels(self.dim, self.bits)  # ValueError naming the supported (dim, bits)

    @property
    def index_bits(self) -> int:
        return int(BLOCK * self.bits)

    @property
    def n_blocks(self) -> int:
        return self.dim // BLOCK


class E8ShellCodec(Codec):
    """E8 shell code per 8-block after a random rotation: float [..., dim] <-> uint8 [..., code_size].

    Spec strings: "e8shell:b=2" (b in 1, 1.5, 1.75, 2, 3, 4; d = 64 or 128), options nc=1 (norm correction) and r=<seed> (another
    rotation draw). The levels' tables are built on first use."""

    family = "e8shell"
    fibquant_code = True
    spec_params = (SpecParam("b", "bits", float), SpecParam("nc", "nc"), SpecParam("r", "rotation_seed"))
    style = PlotStyle("FibQuant-E8 (shell code, k=8)", "C5", "P")

    def __init__(self, dim: int, bits: float, norm_correction: bool = False, seed: int = 0,
                 rotation_seed: int | None = None):
        super().__init__(E8ShellConfig(dim, bits, norm_correction, seed, rotation_seed))
        self.bits, self.norm_correction, self.seed, self.rotation_seed = bits, norm_correction, seed, rotation_seed
        self.levels = shipped_levels(dim, bits)
        self._rotation = RotationState(dim, rotation_seed_of(seed, rotation_seed), self.device_state)

    # ------------------------------------------------------------------ spec strings
    @classmethod
    def check_spec(cls, params: dict) -> None:
        if params.get("bits") is None:
            raise ValueError("e8shell needs b=<bits>")
        if params["bits"] not in SUPPORTED_BITS:
            raise ValueError(f"e8shell b= must be one of {SUPPORTED_BITS}, got {params['bits']}")
        if params.get("nc") not in (None, 0, 1):
            raise ValueError(f"e8shell nc= must be 0 or 1, got {params.get('nc')}")
        check_rotation_seed(params.get("rotation_seed"))

    @classmethod
    def spec_label(cls, dim: int, bits: int, nc=None, rotation_seed=None) -> str:
        extra = (",nc" if nc else "") + (f",r={rotation_seed}" if rotation_seed is not None else "")
        return f"FibQuant-E8 b={bits:g} (shell code{extra})"

    @classmethod
    def from_spec(cls, dim: int, bits: int, nc=None, rotation_seed=None) -> "E8ShellCodec":
        return cls(dim, _canonical_bits(bits), bool(nc), rotation_seed=rotation_seed)

    @classmethod
    def spec_unavailable(cls, dim: int, bits: int, nc=None, rotation_seed=None) -> str | None:
        if (dim, _canonical_bits(bits)) not in SHIPPED_LEVELS:
            return f"e8shell ships levels for (dim, bits) in {sorted(SHIPPED_LEVELS)} only"
        return None if numba_available() else "e8shell needs numba, which does not import"

    # ------------------------------------------------------------------ rates and layout
    @property
    def code_size(self) -> int:
        return NORM_BYTES + packed_size(self.config.n_blocks, self.config.index_bits)

    @property
    def bits_per_coordinate(self) -> float:
        return float(self.bits)

    @property
    def code_layout(self) -> CodeLayout:
        """[fp16 norm][dim/8 packed indices in [0, count)]."""
        return CodeLayout(self.tables.count, self.config.n_blocks, NORM_BYTES)

    @property
    def tables(self):
        """The levels' search / unrank tables (`codebook.e8shell.ShellTables`, numpy, CPU)."""
        return shell_tables(self.levels)

    def reader(self, device: torch.device) -> ShellsReader:
        """The shell points decoded by `_unit_rows`; the one-token kernel's point tables: at <= 16 index bits
        every point as 8 int8 (<= 512 KB; one read per block), else the decomposed tables."""
        compact = self.tables.count <= COMPACT_MAX_POINTS
        tables = compact_point_tables(self.levels) if compact else point_tables(self.levels)
        return ShellsReader(self.dim, self._rotation.forward_matrix(torch.device(device)), self.config.index_bits,
                            self._unit_rows, tables, type(self).__name__)

    def _sq_radii(self) -> np.ndarray:
        return self.device_state.get("sq_radii64", torch.device("cpu"),
                                     lambda d: torch.from_numpy(self.tables.radii ** 2)).numpy()

    # ------------------------------------------------------------------ coding
    def block_indices(self, u: torch.Tensor, exhaustive: bool = False,
                      method: str = "auto") -> tuple[np.ndarray, np.ndarray]:
        """Rotated unit rows u [n, dim] float32 -> (indices, levels) int64 [n, dim/8]: `shell_search` with
        `method` (all give the same codes; "scan" is the reference at b >= 3), or with `exhaustive` the
        reference search over the materialised codebook (small codes only: b <= 2)."""
        blocks = u.detach().to("cpu").contiguous().numpy().reshape(-1, BLOCK)
        if exhaustive:
            index = exhaustive_search(blocks, codebook_points(self.levels))
            level = np.searchsorted(self.tables.offsets, index, side="right") - 1
        else:
            index, level = shell_search(blocks, self.tables, method)
        return index.reshape(u.shape[0], -1), level.reshape(u.shape[0], -1)

    def encode_with(self, x: torch.Tensor, exhaustive: bool, method: str = "auto") -> torch.Tensor:
        """`encode` with the exhaustive reference search (True: b <= 2 only, the codebook materialised) or
        `shell_search` by `method` (False; "auto" is `encode`'s, "scan" the plain leader scan: the reference
        of the faster methods at every b)."""
        self.check_input(x)
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.dim).to(torch.float32)
        if flat.shape[0] == 0:
            return torch.empty(*lead, self.code_size, dtype=torch.uint8, device=x.device)
        return self._encode_rows(flat, exhaustive, method).reshape(*lead, self.code_size)

    def _encode_rows(self, x: torch.Tensor, exhaustive: bool, method: str = "auto") -> torch.Tensor:
        norm_bytes, u = self._rotation.normalise_rotate(x, type(self).__name__)
        index, level = self.block_indices(u, exhaustive, method)
        if self.norm_correction:
            norm_bytes = self._corrected_norm_bytes(x, level).to(x.device)
        packed = pack_bits(torch.from_numpy(index).to(x.device), self.config.index_bits)
        return torch.cat([norm_bytes, packed], dim=1)

    def _corrected_norm_bytes(self, x: torch.Tensor, level: np.ndarray) -> torch.Tensor:
        """fp16 bytes [n, 2] of ||x|| / ||u_hat|| (`norm_correction.corrected_norms_reference` with the blocks'
        levels as indices and the squared radii as their squared norms; its numba path where it proves equal)."""
        x = x.detach().to("cpu", torch.float32).contiguous()
        sq = self._sq_radii()
        if numba_available():
            fast = corrected_norm_bytes(x.numpy(), level, sq)
            if fast is not None:
                return torch.from_numpy(fast)
        try:
            return reference_norm_bytes(x, torch.from_numpy(level), torch.from_numpy(sq))
        except ValueError:
            raise ValueError(f"{type(self).__name__}: corrected norm exceeds the fp16 range of the stored norm") from None

    def _encode_flat(self, x: torch.Tensor) -> torch.Tensor:
        return self._encode_rows(x, exhaustive=False)

    def _unit_rows(self, codes: torch.Tensor) -> torch.Tensor:
        """codes uint8 [n, code_size] -> the shell points u_hat float64 [n, dim] (rotated domain)."""
        n = codes.shape[0]
        index = unpack_bits(codes[:, NORM_BYTES:], self.config.index_bits, self.config.n_blocks)
        try:
            points = unrank(index.cpu().numpy().reshape(-1), self.tables)
        except ValueError:
            raise ValueError(f"{type(self).__name__}.decode: code holds index >= {self.tables.count} "
                             f"(the code's point count)") from None
        return torch.from_numpy(points).reshape(n, self.dim).to(codes.device)

    def _decode_flat(self, codes: torch.Tensor) -> torch.Tensor:
        return self._rotation.unrotate_scale(self._unit_rows(codes), codes[:, :NORM_BYTES])

    def __repr__(self) -> str:
        return (f"E8ShellCodec(dim={self.dim}, bits={self.bits}, levels={len(self.levels.shells)}, "
                f"norm_correction={self.norm_correction}, rotation_seed={self.rotation_seed}, "
                f"code_size={self.code_size}B)")
