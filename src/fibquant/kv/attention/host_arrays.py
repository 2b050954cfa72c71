"""numpy views of CPU tensors for the numba kernels: no copy where the tensor already has the layout
a kernel's signature asks, a float32 (or uint8) copy otherwise."""
from __future__ import annotations

import torch


def f32(tensor: torch.Tensor):
    """A float32 C-contiguous numpy view of a CPU tensor (a copy only when it is not one already)."""
    if tensor.dtype != torch.float32 or tensor.requires_grad or not tensor.is_contiguous():
        tensor = tensor.detach().to(torch.float32).contiguous()
    return tensor.numpy()


def rows32(tensor: torch.Tensor):
    """A float32 numpy view of a CPU tensor whose last dimension is contiguous (the window buffers'
    views are strided over the tokens); a copy only when it is not one already."""
    if tensor.dtype is torch.float32 and not tensor.requires_grad and tensor.is_contiguous():
        return tensor.numpy()  # the common case (a decode step's new key / value), checked cheaply
    if tensor.dtype != torch.float32 or tensor.requires_grad or (tensor.stride(-1) != 1 and tensor.shape[-1] > 1):
        tensor = tensor.detach().to(torch.float32).contiguous()
    return tensor.numpy()


def code_rows(codes: torch.Tensor):
    """A uint8 numpy view of code rows keeping their strides (a [..., :M, :] view of a capacity buffer
    is not copied); a copy only when a row's bytes are not one run."""
    if codes.requires_grad or (codes.shape[-1] > 1 and codes.stride(-1) != 1):
        codes = codes.detach().contiguous()
    return codes.numpy()
