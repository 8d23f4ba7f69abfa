"""Rotary position embeddings (RoPE), Llama half-split convention or interleaved pairs."""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    """Precomputed cos/sin tables for `dim` rotated channels, looked up by absolute position.

    Half-split (Llama/HF): channel i pairs with channel i + dim/2. Interleaved (GPT-J, llama2.c, Meta's
    original Llama): channel 2i pairs with 2i + 1. Both use frequencies base^(-2i/dim).
    """

    def __init__(self, dim: int, base: float, max_seq_len: int, interleaved: bool = False):
        super().__init__()
        self.dim, self.interleaved, self.max_seq_len = dim, interleaved, max_seq_len
        # Same float32 arithmetic as transformers' Llama, so imported models match to 1e-6.
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        angles = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (S, dim/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (..., T, dim); positions: (T,) absolute positions. Returns x rotated, same shape and dtype."""
        cos = self.cos[positions].to(x.dtype)  # (T, dim/2)
        sin = self.sin[positions].to(x.dtype)
        if self.interleaved:
            pairs = x.unflatten(-1, (-1, 2))  # (..., T, dim/2, 2)
            even, odd = pairs[..., 0], pairs[..., 1]
            return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
        first, second = x.chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
