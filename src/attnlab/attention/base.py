"""The protocol every attention variant implements, and small shared helpers.

    forward(x, positions, cache) -> (y, cache)   x: (B, T, d_model); positions: (T,) absolute
    new_cache(batch, max_len, dtype, device)      -> a LayerCache (attnlab.cache)

With cache=None the layer attends causally within x (positions 0..T-1, training and scoring) and
returns cache=None. With a cache it stores this chunk's keys/values and attends over everything held.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from attnlab.cache.base import LayerCache


class Attention(Protocol):
    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: LayerCache | None = None
    ) -> tuple[torch.Tensor, LayerCache | None]: ...

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device=None) -> LayerCache: ...


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
