"""Rotary position embeddings (RoPE), Llama half-split convention or interleaved pairs, with optional frequency
scaling (linear, Llama 3.1's, or llama.cpp's per-pair factors)."""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from attnlab.errors import ConfigError


def inverse_frequencies(dim: int, base: float, scaling=None) -> torch.Tensor:
    """(dim/2,) fp32: pair i turns at base^(-2i/dim) radians per position (transformers' Llama arithmetic),
    scaled by `scaling` (an attnlab.config.RopeScaling, or None for plain RoPE)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq if scaling is None else scaled_frequencies(inv_freq, scaling)


def scaled_frequencies(inv_freq: torch.Tensor, scaling) -> torch.Tensor:
    """inv_freq (dim/2,) fp32 scaled as `scaling` (attnlab.config.RopeScaling) says, in transformers' float32
    arithmetic (modeling_rope_utils: _compute_linear_scaling_rope_parameters, _compute_llama3_parameters), so
    imported models match it to the bit."""
    if scaling.type == "linear":  # position interpolation: position / factor is inv_freq / factor
        return inv_freq / scaling.factor
    if scaling.type == "freq_factors":  # llama.cpp's ggml_rope_ext: theta = position * inv_freq / freq_factors[i]
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=inv_freq.dtype)
    if scaling.type != "llama3":
        raise ValueError(f"RoPE scaling type {scaling.type!r} is not known")
    # Llama 3.1: long wavelengths (beyond the original context / low_freq_factor) slow down by `factor`, short
    # ones (below the original context / high_freq_factor) are kept, the ones between interpolate smoothly.
    factor, old_context = scaling.factor, scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (..., dim) rotated pair by pair by the angles whose cos and sin (broadcasting against (..., dim/2))
    are given: pairs (2i, 2i+1) if interleaved, else (i, i + dim/2)."""
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))  # (..., dim/2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def shift_rotation(x: torch.Tensor, shift: torch.Tensor, base: float, interleaved: bool, scaling=None) -> torch.Tensor:
    """x (B, H, S, dim), already rotated at some positions, rotated further by `shift` (B, S) positions (any
    integers, negative too): RoPE(p) then this equals RoPE(p + shift), with the same `scaling` (a RopeScaling or
    None). Angles in float64, so a shift of thousands of positions keeps the rotation exact to fp32 rounding."""
    inv_freq = inverse_frequencies(x.shape[-1], base, scaling).double().to(x.device)  # (dim/2,)
    angles = shift.double()[..., None] * inv_freq  # (B, S, dim/2)
    cos, sin = angles.cos().to(x.dtype)[:, None], angles.sin().to(x.dtype)[:, None]  # (B, 1, S, dim/2)
    return rotate(x, cos, sin, interleaved)


_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # Rotary's shared cos/sin tables


class Rotary(nn.Module):
    """Precomputed cos/sin tables for `dim` rotated channels, looked up by absolute position.

    Half-split (Llama/HF): channel i pairs with channel i + dim/2. Interleaved (GPT-J, llama2.c, Meta's
    original Llama): channel 2i pairs with 2i + 1. Both use frequencies base^(-2i/dim), scaled by `scaling` (an
    attnlab.config.RopeScaling; None for plain RoPE). The tables cover max_seq_len positions; `extend(n)` grows
    them (a model with a bounded memory reads streams of any length).
    """

    def __init__(self, dim: int, base: float, max_seq_len: int, interleaved: bool = False, scaling=None):
        super().__init__()
        self.dim, self.base, self.interleaved, self.max_seq_len = dim, base, interleaved, 0
        self.scaling = scaling
        self.register_buffer("cos", torch.empty(0, dim // 2), persistent=False)  # (S, dim/2)
        self.register_buffer("sin", torch.empty(0, dim // 2), persistent=False)
        try:
            self.extend(max_seq_len)
        except MemoryError as e:  # (commands check the tables' size first: train.budget.positions_memory_problem)
            raise ConfigError(f"model.max_seq_len={max_seq_len:,}: {e} (lower model.max_seq_len)") from None

    def extend(self, length: int) -> None:
        """Tables for positions 0..length-1 (never shrinks; the rows already there keep their values)."""
        if self.max_seq_len >= length:
            return
        # One pair of tables per (frequencies, length, device, dtype), shared by every layer that asks for it:
        # SmolLM2-135M's 30 layers held 63 MB of identical tables. Nothing writes into them.
        key = (self.dim, self.base, repr(self.scaling), length, str(self.cos.device), self.cos.dtype)
        tables = [_TABLES.get((*key, name)) for name in ("cos", "sin")]
        if any(t is None for t in tables):
            # Same float32 arithmetic as transformers' Llama, so imported models match to 1e-6.
            inv_freq = inverse_frequencies(self.dim, self.base, self.scaling)
            device, dtype = self.cos.device, self.cos.dtype  # the buffers keep the module's device and dtype
            try:
                angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None]  # (S, dim/2)
                tables = [angles.cos().to(device, dtype), angles.sin().to(device, dtype)]
            except RuntimeError as e:  # the allocator's "not enough memory" (torch.OutOfMemoryError on a GPU)
                if "memory" not in str(e).lower():
                    raise
                size = 3 * length * (self.dim // 2) * 4
                raise MemoryError(
                    f"the RoPE tables of {length:,} positions x {self.dim // 2} rotated pairs (float32 "
                    f"cos, sin and their angles, {size / 2**30:,.1f} GiB) do not fit in memory"
                ) from None
            for name, table in zip(("cos", "sin"), tables, strict=True):
                _TABLES[(*key, name)] = table
        self.cos, self.sin = tables
        self.max_seq_len = length

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (..., T, dim); positions: (T,) absolute positions. Returns x rotated, same shape and dtype."""
        return rotate(x, self.cos[positions].to(x.dtype), self.sin[positions].to(x.dtype), self.interleaved)
