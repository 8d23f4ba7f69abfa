"""Feed-forward blocks: SwiGLU (Llama) and GELU (GPT-2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up share one fused matmul."""

    def __init__(self, d_model: int, hidden_dim: int):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.gate_up = nn.Linear(d_model, 2 * hidden_dim, bias=False)
        self.down = nn.Linear(hidden_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.hidden_dim, dim=-1)
        return self.down(F.silu(gate) * up)


class GELUMLP(nn.Module):
    def __init__(self, d_model: int, hidden_dim: int):
        super().__init__()
        self.up = nn.Linear(d_model, hidden_dim, bias=False)
        self.down = nn.Linear(hidden_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


def build_mlp(kind: str, d_model: int, hidden_dim: int) -> nn.Module:
    return {"swiglu": SwiGLU, "gelu": GELUMLP}[kind](d_model, hidden_dim)
