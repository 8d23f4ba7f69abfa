"""RMSNorm (Zhang & Sennrich 2019), as in Llama."""

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
