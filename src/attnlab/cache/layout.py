"""A variant's cache layout, declared once: which tensors a token leaves in the cache, how wide, which carry
RoPE, and how a decode step reads them. Every cache (dense, ring, quantized, memories), the accounting,
`attnlab info` and the KV-policy names are derived from this one declaration.

    CacheLayout.of({"k": [Field("k_sem", 4), Field("k_geo", 8, rope=True)], "v": [Field("v", 12)]},
                   kv_heads=2, route="v", read=Read("k", "v"))

A *buffer* is one stored tensor, (B, H_kv, S, width) or, with kv_heads None, (B, S, width) shared by every
head (MLA's latent); its *fields* are named slices of its last axis, in order. A KV policy names fields.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from attnlab.config import RopeScaling


@dataclass(frozen=True)
class Field:
    """One cached tensor: `width` values per KV head (per token when the layout has no head axis)."""

    name: str
    width: int
    rope: bool = False  # rotated by RoPE at its token's position (its low-frequency channels route summaries)


@dataclass(frozen=True)
class Read:
    """The one attention call a decode step makes over the cached buffers: softmax(q K^T scale) V with K the
    whole buffer `keys` and V the first `value_width` values (None: all) of buffer `values`."""

    keys: str = "k"
    values: str = "v"
    value_width: int | None = None


@dataclass(frozen=True)
class CacheLayout:
    buffers: tuple[tuple[str, tuple[Field, ...]], ...]
    kv_heads: int | None  # None: one row per token shared by every query head
    route: str  # the field whose values the exact memory bank routes on (it carries no RoPE)
    read: Read | None = None  # None: a decode step is not one attention call over the buffers (DIFF, naive MLA)
    window: int | None = None  # a sliding-window variant: it never reads more than the last `window` tokens
    null_key: bool = False  # the variant prepends a learned null key/value to what it reads
    rope_interleaved: bool = False  # RoPE pairs channels (2i, 2i+1), else (i, i + width/2)
    rope_base: float = 10000.0  # RoPE's base (a memory that re-rotates keys to their cache positions needs it)
    rope_scaling: RopeScaling | None = None  # its frequency scaling, likewise (the variant rotates with it)

    @classmethod
    def of(cls, buffers: dict[str, list[Field]], **options) -> CacheLayout:
        return cls(tuple((name, tuple(fields)) for name, fields in buffers.items()), **options)

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names) or self.route not in names:
            raise ValueError(f"cache layout: field names {names} must be unique and include route={self.route!r}")

    # -- derived ------------------------------------------------------------------------------------
    @functools.cached_property
    def fields(self) -> list[Field]:
        return [f for _, fields in self.buffers for f in fields]

    @property
    def heads(self) -> int:
        """KV heads of every buffer (1 for a layout without a head axis)."""
        return self.kv_heads or 1

    def buffer_width(self, buffer: str) -> int:
        """Values per head of one buffer (its fields side by side)."""
        return sum(f.width for f in dict(self.buffers)[buffer])

    @functools.cached_property
    def slices(self) -> dict[str, tuple[str, int, int]]:
        """field name -> (buffer, lo, hi) along the buffer's last axis (computed once: memories read it every step)."""
        out = {}
        for buffer, fields in self.buffers:
            lo = 0
            for f in fields:
                out[f.name] = (buffer, lo, lo + f.width)
                lo += f.width
        return out

    def shape(self, buffer: str, batch: int, slots: int) -> tuple[int, ...]:
        width = self.buffer_width(buffer)
        return (batch, slots, width) if self.kv_heads is None else (batch, self.kv_heads, slots, width)

    def shapes(self, batch: int, slots: int) -> dict[str, tuple[int, ...]]:
        return {name: self.shape(name, batch, slots) for name, _ in self.buffers}

    def values_per_token(self) -> dict[str, int]:
        """Elements each token stores per layer, by field (over all KV heads): the accounting's `cache_fields`."""
        return {f.name: f.width * self.heads for f in self.fields}


def low_frequency_channels(width: int, interleaved: bool = False) -> torch.Tensor:
    """(width,) bool: the channels RoPE rotates with the lower half of its frequencies.

    attnlab.ops.rope rotates pair i (of width/2) at base^(-2i/width), so a larger i turns more slowly with
    position. Half-split layout (Llama): pair i is channels i and i + width/2, so the low-frequency channels
    are [width/4, width/2) and [3 width/4, width); interleaved: 2i, 2i+1, the second half of the channels.
    With an odd number of pairs the middle one counts as low-frequency."""
    pairs = width // 2
    channel = torch.arange(width)
    pair = channel // 2 if interleaved else channel % pairs
    return pair >= pairs // 2
