"""The base every attention variant derives from.

    forward(x, positions, cache=None, write=None) -> (y, cache)   x: (B, T, d_model); positions: (T,) absolute
    new_cache(batch, max_len, dtype, device, policy, memory)       -> a LayerCache built from `self.layout`
    scores(x, positions) -> AttentionScores                         the variant's attention maps, recomputed
    projections(x) -> {path: (B, heads, T, dim)}                    its Q/K/V projections by path, before RoPE

With cache=None the layer attends causally within x (positions 0..T-1, training and scoring) and returns
cache=None. With a cache it stores this chunk's cached fields and attends over everything held, through
attnlab.cache.attend (so every cache kind works with every variant). `write` carries a bounded memory's
learned write gates for the chunk (the Block computes them).

A variant sets `self.layout` (its config's `cache_layout`, declared once) and holds only its own maths:
projections, scores, output. `init_parameters()` is called after the model's generic init (normal(0,
init_std) for every parameter with 2+ dims) for parameters that need their own (CoDA's rotation angles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from attnlab.cache.base import LayerCache
from attnlab.cache.build import build_cache
from attnlab.cache.layout import CacheLayout
from attnlab.ops.heads import merge_heads, prepend_null
from attnlab.ops.masks import with_null_column


@dataclass
class AttentionScores:
    """A layer's attention recomputed from its input: each softmax map (B, H, T, S) with S = T, or 1 + T with
    a null key first, and the values each map weights (B, H, S, Dv) per query head. `combine` turns the maps'
    weighted values (one (B, H, T, Dv) per map) into the layer's output, (B, T, d_model), its output
    projection included."""

    maps: dict[str, torch.Tensor]
    values: dict[str, torch.Tensor]
    null: bool
    combine: object  # callable(dict name -> (B, H, T, Dv)) -> (B, T, d_model)


class Attention(nn.Module):
    layout: CacheLayout

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device=None, policy=None,
                  memory=None) -> LayerCache:  # fmt: skip
        """This layer's cache (attnlab.cache.build_cache over the variant's layout)."""
        return build_cache(self.layout, batch, max_len, dtype, device, policy, memory)

    def init_parameters(self) -> None:
        """Parameters with an init of their own (after the model's generic init); none by default."""

    def scores(self, x: torch.Tensor, positions: torch.Tensor) -> AttentionScores:
        """The attention maps of input x (B, T, d_model) at positions (T,), recomputed in fp32 with the
        variant's own maths (eval.analysis reads them and checks them against `forward`)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its attention scores")

    def projections(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-head projection outputs of input x (B, T, d_model) by path, before RoPE: (B, heads, T, dim)
        each (eval.analysis's effective ranks)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its projections")


def single_map(attn: nn.Module, q, k, v, mask, null=None) -> AttentionScores:
    """AttentionScores of one softmax map whose output goes through `attn.out`: q (B, H, T, D) pre-scaled,
    k (B, H_kv, S, D), v (B, H_kv, S, Dv), mask (T, S) bool; null ((H_kv, D), (H_kv, Dv)) or None."""
    if null is not None:
        k, v, mask = prepend_null(k, null[0].float()), prepend_null(v, null[1].float()), with_null_column(mask)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # per query head
    probs = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf")).softmax(dim=-1)  # (B, H, T, S)

    def combine(out: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.linear(merge_heads(out["attention"]), attn.out.weight.float())

    return AttentionScores({"attention": probs}, {"attention": v}, null is not None, combine)
