"""Learned residual vector quantization (RVQ), the calibrated baseline of the archive paper.

Stage s holds a codebook C_s [N, dim] fitted by k-means (Lloyd) on the residuals the earlier
stages leave on calibration vectors. Encoding is greedy: r_0 = x, i_s = argmin ||r_s - C_s[i]||,
r_{s+1} = r_s - C_s[i_s]; decoding sums the chosen codewords. Vectors are quantized as they
are (no norm, no rotation): the codebooks are fitted per layer/head ("per head") or on all
heads together ("pooled") by the caller.

Code of one vector: `stages` indices of ceil(log2 N) bits, bit-packed (see bitpack), nothing
else; code_size = ceil(stages * ceil(log2 N) / 8). The codebooks are shared calibration state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..codebook.lloyd import lloyd
from ..codebook.nearest import nearest_codeword
from .base import Codec, PlotStyle, SpecParam
from .bitpack import pack_bits, packed_size, unpack_bits


@dataclass(frozen=True)
class RVQConfig:
    dim: int
    stages: int
    n_codewords: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"dim must be a positive integer, got {self.dim!r}")
        if not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"stages must be a positive integer, got {self.stages!r}")
        if not isinstance(self.n_codewords, int) or not 2 <= self.n_codewords <= 1 << 16:
            raise ValueError(f"n_codewords must be an integer in 2..65536, got {self.n_codewords!r}")

    @property
    def index_bits(self) -> int:
        return math.ceil(math.log2(self.n_codewords))


class RVQCodec(Codec):
    """Residual VQ with codebooks [stages, N, dim]: float [..., dim] <-> uint8 [..., code_size].

    Spec string: "rvq:s=2,n=256" (fitted per layer and KV head by the experiments).
    """

    family = "rvq"
    calibrated = True
    spec_params = (SpecParam("s", "stages"), SpecParam("n", "n"))
    style = PlotStyle("RVQ per head (calibrated)", "C4", "v")

    def __init__(self, codebooks: torch.Tensor):
        if not isinstance(codebooks, torch.Tensor) or codebooks.ndim != 3 or not codebooks.is_floating_point():
            raise ValueError("codebooks must be a floating tensor of shape [stages, N, dim]")
        if not bool(torch.isfinite(codebooks).all()):
            raise ValueError("codebooks contain NaN or Inf")
        stages, n_codewords, dim = (int(s) for s in codebooks.shape)
        super().__init__(RVQConfig(dim, stages, n_codewords))
        self.stages, self.n_codewords = stages, n_codewords
        self.codebooks = codebooks.to(torch.float32).contiguous()

    @classmethod
    def fit(cls, samples: torch.Tensor, stages: int, n_codewords: int = 256, *, seed: int = 0,
            max_iterations: int = 25) -> "RVQCodec":
        """Fit `stages` codebooks of `n_codewords` on calibration vectors `samples` [n, dim].

        Deterministic for a given seed: initial codewords are a seeded random subset of the residuals.
        """
        if not isinstance(samples, torch.Tensor) or samples.ndim != 2 or not samples.is_floating_point():
            raise ValueError("samples must be a floating tensor of shape [n, dim]")
        RVQConfig(int(samples.shape[1]), stages, n_codewords)
        if samples.shape[0] < n_codewords:
            raise ValueError(f"need at least n_codewords={n_codewords} calibration vectors, got {samples.shape[0]}")
        if not bool(torch.isfinite(samples).all()):
            raise ValueError("calibration samples contain NaN or Inf")
        residual = samples.detach().to("cpu", torch.float32).contiguous()
        generator = torch.Generator().manual_seed(seed)
        codebooks = []
        for _ in range(stages):
            init = residual[torch.randperm(residual.shape[0], generator=generator)[:n_codewords]]
            codewords = lloyd(residual, init, max_iterations=max_iterations).codewords
            residual = residual - codewords[nearest_codeword(residual, codewords)]
            codebooks.append(codewords)
        return cls(torch.stack(codebooks))

    @classmethod
    def check_spec(cls, params: dict) -> None:
        if params.get("stages") is None or params.get("n") is None:
            raise ValueError("rvq needs s=<stages> and n=<codewords>")

    @classmethod
    def spec_label(cls, dim: int, stages: int, n: int) -> str:
        return f"RVQ {stages}x{n} per head"

    @classmethod
    def fit_spec(cls, samples: torch.Tensor, stages: int, n: int) -> "RVQCodec":
        return cls.fit(samples, stages, n)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"codebooks": self.codebooks}

    @classmethod
    def from_state(cls, config: dict, tensors: dict[str, torch.Tensor]) -> "RVQCodec":
        if set(tensors) != {"codebooks"}:
            raise ValueError(f"an RVQ codec file holds 'codebooks', got {sorted(tensors)}")
        return cls(tensors["codebooks"])

    def _codebooks_on(self, device: torch.device) -> torch.Tensor:
        """codebooks [stages, N, dim] float32 on `device`."""
        return self.device_state.get("codebooks", device, lambda d: self.codebooks.to(d))

    @property
    def code_size(self) -> int:
        return packed_size(self.stages, self.config.index_bits)

    @property
    def bits_per_coordinate(self) -> float:
        return self.stages * self.config.index_bits / self.dim

    def _encode_flat(self, x: torch.Tensor) -> torch.Tensor:
        codebooks = self._codebooks_on(x.device)
        residual = x.clone()
        indices = []
        for stage in codebooks:
            index = nearest_codeword(residual, stage)
            residual -= stage[index]
            indices.append(index)
        return pack_bits(torch.stack(indices, dim=1), self.config.index_bits)

    def _decode_flat(self, codes: torch.Tensor) -> torch.Tensor:
        indices = unpack_bits(codes, self.config.index_bits, self.stages)
        # Only a field wider than log2(N) can hold an invalid index (skip the pass otherwise).
        if self.n_codewords != 1 << self.config.index_bits and int(indices.max()) >= self.n_codewords:
            raise ValueError(f"RVQCodec.decode: code holds index >= N={self.n_codewords}")
        codebooks = self._codebooks_on(codes.device)
        out = torch.zeros(codes.shape[0], self.dim, dtype=torch.float32, device=codes.device)
        for stage, index in zip(codebooks, indices.T):
            out += stage[index]
        return out
