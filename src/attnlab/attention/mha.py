"""Standard multi-head attention; n_kv_heads < n_heads gives GQA, n_kv_heads = 1 gives MQA.

`HeadAttention` is the shared per-head machinery (fused QKV projection with optional q/k/v biases, RoPE with
the model's frequency scaling, optional null key/value, optional sliding window); `bottleneck` and `sliding`
reuse it with other widths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from attnlab.attention.base import Attention, AttentionScores, single_map
from attnlab.cache.attend import attend_cache
from attnlab.cache.layout import CacheLayout, Field, Read
from attnlab.config import AttentionConfig, ModelConfig, check_head_split, check_kv_heads
from attnlab.ops.heads import merge_heads, null_parameter, split_heads
from attnlab.ops.masks import causal_mask
from attnlab.ops.rope import Rotary

# The kinds whose module is a HeadAttention: they rotate with the model's rope_scaling, and those with a
# qkv_bias option (MHAConfig's) apply it. CoDA and DIFF share MHAConfig but have projections of their own.
HEAD_ATTENTION_KINDS = ("mha", "sliding", "bottleneck")


def head_layout(model: ModelConfig, n_kv_heads: int, head_dim: int, **options) -> CacheLayout:
    """k (rotated by RoPE) and v, head_dim each per KV head: the cache of every per-head variant. The layout
    declares the model's RoPE scaling only for the kinds that rotate with it (HEAD_ATTENTION_KINDS)."""
    scaling = model.rope_scaling if model.attention.kind in HEAD_ATTENTION_KINDS else None
    return CacheLayout.of(
        {"k": [Field("k", head_dim, rope=True)], "v": [Field("v", head_dim)]},
        kv_heads=n_kv_heads, route="v", read=Read("k", "v"), rope_interleaved=model.rope_interleaved,
        rope_base=model.rope_base, rope_scaling=scaling, **options,
    )  # fmt: skip


@dataclass(frozen=True)
class MHAConfig(AttentionConfig):
    """Also the base of the other per-head variants' configs (sliding, coda, diff): heads, KV heads, head_dim."""

    kind: ClassVar[str] = "mha"
    head_dim_multiple: ClassVar[int] = 2  # head_dim must be a multiple of this ...
    head_dim_reason: ClassVar[str] = "for RoPE"  # ... because of this
    n_kv_heads: int | None = None  # None = n_heads (MHA); 1 = MQA; else GQA
    head_dim: int | None = None  # None = d_model / n_heads
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2), none on the output projection

    def kv_heads(self, model: ModelConfig) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else model.n_heads

    def dim(self, model: ModelConfig) -> int:
        return self.head_dim if self.head_dim is not None else model.d_model // model.n_heads

    def problems(self, model: ModelConfig) -> list[str]:
        out = check_kv_heads(self.n_kv_heads, model.n_heads) + check_head_split(model, self.head_dim)
        multiple = self.head_dim_multiple
        if not out and self.dim(model) % multiple:
            what = "even" if multiple == 2 else f"a multiple of {multiple}"
            out.append(
                f"head_dim={self.dim(model)} must be {what} {self.head_dim_reason} "
                "(change d_model, n_heads or head_dim)"
            )
        if self.qkv_bias and self.kind not in HEAD_ATTENTION_KINDS:
            out.append(f"attention.qkv_bias is not supported by attention.kind {self.kind} (use mha or sliding)")
        return out

    def to_dict(self) -> dict:
        out = super().to_dict()
        if not self.qkv_bias:
            del out["qkv_bias"]  # the default: configs (and their hashes) read as before the option
        return out

    def cache_layout(self, model: ModelConfig) -> CacheLayout:
        return head_layout(model, self.kv_heads(model), self.dim(model))


class HeadAttention(Attention):
    """Per-head softmax attention with RoPE on q/k, scale 1/sqrt(head_dim); `qkv_bias` adds a bias to the q, k and
    v projections (their fused `qkv`), none to the output."""

    def __init__(self, model: ModelConfig, n_heads: int, n_kv_heads: int, head_dim: int, null_attn: bool = False,
                 qkv_bias: bool = False):  # fmt: skip
        super().__init__()
        self.layout = model.attention.cache_layout(model)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.window = self.layout.window
        self.qkv = torch.nn.Linear(model.d_model, (n_heads + 2 * n_kv_heads) * head_dim, bias=qkv_bias)
        self.out = torch.nn.Linear(n_heads * head_dim, model.d_model, bias=False)
        self.rotary = Rotary(head_dim, model.rope_base, model.max_seq_len, model.rope_interleaved,
                             self.layout.rope_scaling)  # fmt: skip
        self.null_k = null_parameter(n_kv_heads, head_dim, model.init_std) if null_attn else None
        self.null_v = null_parameter(n_kv_heads, head_dim, model.init_std) if null_attn else None
        self.init_parameters()

    def init_parameters(self) -> None:
        """Biases start at zero (the model's generic init leaves 1-D parameters alone)."""
        if self.qkv.bias is not None:
            with torch.no_grad():
                self.qkv.bias.zero_()

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, d_model) -> q (B, H, T, D), k and v (B, H_kv, T, D), q and k rotated."""
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split((q_width, kv_width, kv_width), dim=-1)
        # One RoPE call for q and k together: (B, H + H_kv, T, D), then split (fewer small ops per step).
        qk = self.rotary(torch.cat((split_heads(q, self.n_heads), split_heads(k, self.n_kv_heads)), dim=1), positions)
        q, k = qk.split((self.n_heads, self.n_kv_heads), dim=1)
        return q, k, split_heads(v, self.n_kv_heads)

    def null(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.null_k is None else (self.null_k, self.null_v)

    def projections(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split((q_width, kv_width, kv_width), dim=-1)
        return {
            "q": split_heads(q, self.n_heads),
            "k": split_heads(k, self.n_kv_heads),
            "v": split_heads(v, self.n_kv_heads),
        }

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache=None, write=None):
        q, k, v = self.project(x, positions)
        y = attend_cache(cache, q, {"k": k, "v": v}, positions, self.layout.read, 1 / math.sqrt(self.head_dim),
                         self.window, self.null(), write)  # fmt: skip
        return self.out(merge_heads(y)), cache

    def scores(self, x: torch.Tensor, positions: torch.Tensor) -> AttentionScores:
        q, k, v = (t.float() for t in self.project(x, positions))
        mask = causal_mask(positions, positions, self.window)
        return single_map(self, q / math.sqrt(self.head_dim), k, v, mask, self.null())


class MHA(HeadAttention):
    def __init__(self, model: ModelConfig):
        cfg: MHAConfig = model.attention
        super().__init__(model, model.n_heads, cfg.kv_heads(model), cfg.dim(model), qkv_bias=cfg.qkv_bias)
