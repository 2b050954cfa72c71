"""Calibrated low-rank projection (the PCA baseline).

Fitted on calibration vectors (per layer and head in the experiments): x is stored as its
`rank` coefficients c = B (x - mu) in fp16, with B the top principal directions ([rank, dim],
orthonormal rows) and mu the calibration mean (zero when not centred). Decode: B^T c + mu.
code_size = 2 * rank bytes. The basis and mean are calibration state shared by all tokens
of that layer/head; they are not part of the per-vector code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import FP16_MAX, Codec, PlotStyle, SpecParam
from .bitpack import bytes_to_float16, float16_to_bytes


@dataclass(frozen=True)
class LowRankConfig:
    dim: int
    rank: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"dim must be a positive integer, got {self.dim!r}")
        if not isinstance(self.rank, int) or not 1 <= self.rank <= self.dim:
            raise ValueError(f"rank must be an integer in 1..dim={self.dim}, got {self.rank!r}")


class LowRankCodec(Codec):
    """Projection onto a fitted rank-`rank` subspace, coefficients in fp16.

    basis: [rank, dim] with orthonormal rows; mean: [dim] or None (no centring).
    encode: float [..., dim] -> uint8 [..., 2*rank]; decode: the reverse.
    Spec string: "lowrank:r=8" (fitted per layer and KV head by the experiments).
    """

    family = "lowrank"
    calibrated = True
    spec_params = (SpecParam("r", "rank"),)
    style = PlotStyle("low-rank (calibrated)", "C7", "D")

    def __init__(self, basis: torch.Tensor, mean: torch.Tensor | None = None):
        if not isinstance(basis, torch.Tensor) or basis.ndim != 2 or not basis.is_floating_point():
            raise ValueError("basis must be a floating tensor of shape [rank, dim]")
        super().__init__(LowRankConfig(int(basis.shape[1]), int(basis.shape[0])))
        self.rank = self.config.rank
        gram = basis.to(torch.float64) @ basis.to(torch.float64).T
        if not torch.allclose(gram, torch.eye(self.rank, dtype=torch.float64, device=basis.device), atol=1e-4):
            raise ValueError("basis rows must be orthonormal")
        self.basis = basis.to(torch.float32).contiguous()
        if mean is not None and (mean.shape != (self.dim,) or not mean.is_floating_point()):
            raise ValueError(f"mean must be a floating tensor of shape [{self.dim}], got {tuple(mean.shape)}")
        self.mean = None if mean is None else mean.to(device=self.basis.device, dtype=torch.float32).contiguous()

    @classmethod
    def fit(cls, samples: torch.Tensor, rank: int, center: bool = True) -> "LowRankCodec":
        """PCA on calibration vectors `samples` [n, dim]: top-`rank` principal directions."""
        if not isinstance(samples, torch.Tensor) or samples.ndim != 2 or not samples.is_floating_point():
            raise ValueError("samples must be a floating tensor of shape [n, dim]")
        LowRankConfig(int(samples.shape[1]), rank)
        if samples.shape[0] < 2:
            raise ValueError(f"need at least 2 calibration vectors, got {samples.shape[0]}")
        if not bool(torch.isfinite(samples).all()):
            raise ValueError("calibration samples contain NaN or Inf")
        data = samples.to(torch.float64)
        mean = data.mean(0) if center else None
        centred = data - mean if center else data
        # Right singular vectors = eigenvectors of the (uncentred or centred) second moment.
        _, _, vh = torch.linalg.svd(centred, full_matrices=False)
        basis = vh[:rank]
        if basis.shape[0] < rank:  # fewer samples than rank: complete with an orthonormal extension
            full = torch.linalg.qr(torch.cat([basis.T, torch.eye(data.shape[1], dtype=torch.float64,
                                                                  device=data.device)], dim=1))[0]
            basis = full[:, :rank].T
        return cls(basis.to(torch.float32), None if mean is None else mean.to(torch.float32))

    @classmethod
    def check_spec(cls, params: dict) -> None:
        if params.get("rank") is None:
            raise ValueError("lowrank needs r=<rank>")

    @classmethod
    def spec_label(cls, dim: int, rank: int) -> str:
        return f"low-rank r={rank}"

    @classmethod
    def fit_spec(cls, samples: torch.Tensor, rank: int) -> "LowRankCodec":
        return cls.fit(samples, rank)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"basis": self.basis} if self.mean is None else {"basis": self.basis, "mean": self.mean}

    @classmethod
    def from_state(cls, config: dict, tensors: dict[str, torch.Tensor]) -> "LowRankCodec":
        if "basis" not in tensors or set(tensors) - {"basis", "mean"}:
            raise ValueError(f"a low-rank codec file holds 'basis' and optionally 'mean', got {sorted(tensors)}")
        return cls(tensors["basis"], tensors.get("mean"))

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(basis [rank, dim], mean [dim] or None) on `device`."""
        return self.device_state.get("basis", device, lambda d: (
            self.basis.to(d), None if self.mean is None else self.mean.to(d)))

    @property
    def code_size(self) -> int:
        return 2 * self.rank

    @property
    def bits_per_coordinate(self) -> float:
        return 16.0 * self.rank / self.dim

    def _encode_flat(self, x: torch.Tensor) -> torch.Tensor:
        basis, mean = self._on(x.device)
        centred = x - mean if mean is not None else x
        coefficients = centred @ basis.T
        if float(coefficients.abs().max()) > FP16_MAX:
            raise ValueError("LowRankCodec: projection coefficients exceed the fp16 range")
        return float16_to_bytes(coefficients).reshape(x.shape[0], self.code_size)

    def _decode_flat(self, codes: torch.Tensor) -> torch.Tensor:
        basis, mean = self._on(codes.device)
        coefficients = bytes_to_float16(codes.reshape(codes.shape[0], self.rank, 2))
        out = coefficients @ basis
        return out + mean if mean is not None else out
