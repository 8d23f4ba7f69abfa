"""Rotary position embeddings (RoPE), Llama half-split convention or interleaved pairs."""

from __future__ import annotations

import torch
from torch import nn


def inverse_frequencies(dim: int, base: float) -> torch.Tensor:
    """(dim/2,) fp32: pair i turns at base^(-2i/dim) radians per position (transformers' Llama arithmetic)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (..., dim) rotated pair by pair by the angles whose cos and sin (broadcasting against (..., dim/2))
    are given: pairs (2i, 2i+1) if interleaved, else (i, i + dim/2)."""
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))  # (..., dim/2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def shift_rotation(x: torch.Tensor, shift: torch.Tensor, base: float, interleaved: bool) -> torch.Tensor:
    """x (B, H, S, dim), already rotated at some positions, rotated further by `shift` (B, S) positions (any
    integers, negative too): RoPE(p) then this equals RoPE(p + shift). Angles in float64, so a shift of
    thousands of positions keeps the rotation exact to fp32 rounding."""
    angles = shift.double()[..., None] * inverse_frequencies(x.shape[-1], base).double().to(x.device)  # (B, S, d/2)
    cos, sin = angles.cos().to(x.dtype)[:, None], angles.sin().to(x.dtype)[:, None]  # (B, 1, S, dim/2)
    return rotate(x, cos, sin, interleaved)


class Rotary(nn.Module):
    """Precomputed cos/sin tables for `dim` rotated channels, looked up by absolute position.

    Half-split (Llama/HF): channel i pairs with channel i + dim/2. Interleaved (GPT-J, llama2.c, Meta's
    original Llama): channel 2i pairs with 2i + 1. Both use frequencies base^(-2i/dim). The tables cover
    max_seq_len positions; `extend(n)` grows them (a model with a bounded memory reads streams of any length).
    """

    def __init__(self, dim: int, base: float, max_seq_len: int, interleaved: bool = False):
        super().__init__()
        self.dim, self.base, self.interleaved, self.max_seq_len = dim, base, interleaved, 0
        self.register_buffer("cos", torch.empty(0, dim // 2), persistent=False)  # (S, dim/2)
        self.register_buffer("sin", torch.empty(0, dim // 2), persistent=False)
        self.extend(max_seq_len)

    def extend(self, length: int) -> None:
        """Tables for positions 0..length-1 (never shrinks; the rows already there keep their values)."""
        if self.max_seq_len >= length:
            return
        # Same float32 arithmetic as transformers' Llama, so imported models match to 1e-6.
        angles = torch.arange(length, dtype=torch.float32)[:, None] * inverse_frequencies(self.dim, self.base)[None]
        self.cos = angles.cos().to(self.cos.device, self.cos.dtype)  # the buffers keep the module's device, dtype
        self.sin = angles.sin().to(self.sin.device, self.sin.dtype)
        self.max_seq_len = length

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (..., T, dim); positions: (T,) absolute positions. Returns x rotated, same shape and dtype."""
        return rotate(x, self.cos[positions].to(x.dtype), self.sin[positions].to(x.dtype), self.interleaved)
