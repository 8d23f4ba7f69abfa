"""RMSNorm (Zhang & Sennrich 2019), as in Llama, and the head-wise RMSNorm of attention outputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as Llama does, so low-precision activations do not lose the mean square.
        if x.dtype == torch.float32:  # one fused call, no casts (this is on the decode hot path)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


class HeadRMSNorm(nn.Module):
    """Head-wise RMSNorm of an attention output (B, H, T, D): gain (D,) shared by the heads, or (H, D) with
    n_heads given. Held as `self.head_norm`, its parameter name ends in `norm.weight`, so the model's generic
    init (normal(0, init_std) for 2-D parameters) leaves an (H, D) gain at 1."""

    def __init__(self, dim: int, eps: float, n_heads: int | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim) if n_heads is None else torch.ones(n_heads, dim))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return head_rms_norm(y, self.weight, self.eps)


def head_rms_norm(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head's output over its own width. y: (B, H, T, D); weight: (D,) shared by the heads
    or (H, D) one gain per head. Normalised in fp32 (as the model's RMSNorm), returned in y's dtype."""
    gain = weight[:, None, :] if weight.dim() == 2 else weight  # (H, 1, D) broadcasts over B and T
    if y.dtype == torch.float32:
        return F.rms_norm(y, (y.shape[-1],), eps=eps) * gain
    return F.rms_norm(y.float(), (y.shape[-1],), eps=eps).to(y.dtype) * gain.to(y.dtype)
