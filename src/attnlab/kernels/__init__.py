"""Fused GPU kernels (Triton). Each is optional: a layer uses one only on CUDA, when triton is importable
and nothing needs a gradient (the kernels are forward-only), and otherwise runs its PyTorch path, which
the kernel is tested against. attnlab.kernels.cpu holds the C kernels of quantized KV caches (CPU)."""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import nn


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def fused_usable(x: torch.Tensor, module: nn.Module) -> bool:
    """Whether a forward-only fused kernel may replace `module`'s PyTorch path on input x."""
    return kernel_usable(x, *module.parameters())


def kernel_usable(*tensors: torch.Tensor) -> bool:
    """Whether a forward-only fused kernel may take these tensors: all on CUDA, triton importable, and none
    needing a gradient."""
    if not all(t.is_cuda for t in tensors) or not triton_available():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
