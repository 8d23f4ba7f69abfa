"""Head reshapes and the learned null key/value (pure helpers shared by the attention variants)."""

from __future__ import annotations

import torch
from torch import nn


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, n_heads * D) -> (B, n_heads, T, D)."""
    return x.unflatten(-1, (n_heads, -1)).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H * D)."""
    return x.transpose(1, 2).flatten(2)


def null_parameter(n_heads: int, dim: int, std: float) -> nn.Parameter:
    """A learned per-head null key or value, (H, dim)."""
    return nn.Parameter(torch.randn(n_heads, dim) * std)


def prepend_null(x: torch.Tensor, null: torch.Tensor) -> torch.Tensor:
    """x: (B, H, S, D); null: (H, D) -> (B, H, 1 + S, D), the null slot first (always visible)."""
    return torch.cat((null.to(x.dtype)[None, :, None, :].expand(x.shape[0], -1, -1, -1), x), dim=2)
