"""Standard multi-head attention; n_kv_heads < n_heads gives GQA, n_kv_heads = 1 gives MQA.

`HeadAttention` is the shared per-head machinery (fused QKV projection, RoPE, optional null key/value,
optional sliding window with a ring cache); `bottleneck` and `sliding` reuse it with other widths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from attnlab.attention.base import merge_heads, null_parameter, prepend_null, split_heads
from attnlab.attention.core import attend
from attnlab.attention.masks import attention_mask
from attnlab.cache.dense import DenseCache
from attnlab.cache.ring import RingCache
from attnlab.config import AttentionConfig, ModelConfig, check_head_split, check_kv_heads
from attnlab.model.rope import Rotary


@dataclass(frozen=True)
class MHAConfig(AttentionConfig):
    """Also the base of the other per-head variants' configs (sliding, coda, diff): heads, KV heads, head_dim."""

    kind: ClassVar[str] = "mha"
    kv_memory: ClassVar[bool] = True
    head_dim_multiple: ClassVar[int] = 2  # head_dim must be a multiple of this ...
    head_dim_reason: ClassVar[str] = "for RoPE"  # ... because of this
    n_kv_heads: int | None = None  # None = n_heads (MHA); 1 = MQA; else GQA
    head_dim: int | None = None  # None = d_model / n_heads

    def kv_heads(self, model: ModelConfig) -> int:
        return self.n_kv_heads or model.n_heads

    def dim(self, model: ModelConfig) -> int:
        return self.head_dim or model.d_model // model.n_heads

    def problems(self, model: ModelConfig) -> list[str]:
        out = check_kv_heads(self.n_kv_heads, model.n_heads) + check_head_split(model, self.head_dim)
        multiple = self.head_dim_multiple
        if not out and self.dim(model) % multiple:
            what = "even" if multiple == 2 else f"a multiple of {multiple}"
            out.append(
                f"head_dim={self.dim(model)} must be {what} {self.head_dim_reason} "
                "(change d_model, n_heads or head_dim)"
            )
        return out

    def cache_fields(self, model: ModelConfig) -> dict[str, int]:
        width = self.kv_heads(model) * self.dim(model)
        return {"k": width, "v": width}


class HeadAttention(nn.Module):
    """Per-head softmax attention with RoPE on q/k, scale 1/sqrt(head_dim)."""

    def __init__(
        self,
        model: ModelConfig,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        null_attn: bool = False,
        window: int | None = None,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.window = n_heads, n_kv_heads, head_dim, window
        self.qkv = nn.Linear(model.d_model, (n_heads + 2 * n_kv_heads) * head_dim, bias=False)
        self.out = nn.Linear(n_heads * head_dim, model.d_model, bias=False)
        self.rotary = Rotary(head_dim, model.rope_base, model.max_seq_len, model.rope_interleaved)
        self.null_k = null_parameter(n_kv_heads, head_dim, model.init_std) if null_attn else None
        self.null_v = null_parameter(n_kv_heads, head_dim, model.init_std) if null_attn else None

    @property
    def reads_quantized_cache(self) -> bool:
        """Whether a decode step reads a quantized cache through its attend_one (no null key, no window)."""
        return self.null_k is None and self.window is None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache=None):
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split((q_width, kv_width, kv_width), dim=-1)
        # One RoPE call for q and k together: (B, H + H_kv, T, D), then split (fewer small ops per step).
        qk = self.rotary(torch.cat((split_heads(q, self.n_heads), split_heads(k, self.n_kv_heads)), dim=1), positions)
        q, k = qk.split((self.n_heads, self.n_kv_heads), dim=1)  # (B, H, T, D), (B, H_kv, T, D)
        v = split_heads(v, self.n_kv_heads)
        null = self.null_k is not None
        if not null and hasattr(cache, "attend_one"):  # a quantized cache reading its blocks in a kernel
            y = cache.attend_one(q, {"k": k, "v": v}, positions, 1 / math.sqrt(self.head_dim))
            if y is not None:
                return self.out(merge_heads(y)), cache
        k_pos = None
        if cache is not None:
            held, k_pos = cache.update({"k": k, "v": v}, positions)
            k, v = held["k"], held["v"]
        if hasattr(cache, "mask"):  # bounded memories (cache/bounded.py): slots differ per sequence
            mask, is_causal = cache.mask(positions, k_pos, null), False
        else:
            static = getattr(cache, "static", False)  # a static-shape decode step (generate's compiled step)
            mask, is_causal = attention_mask(positions, k_pos, self.window, null, static)
        if null:
            k, v = prepend_null(k, self.null_k), prepend_null(v, self.null_v)
        if hasattr(cache, "observe"):  # H2O: the cache accumulates the attention mass of each slot
            cache.observe(q, k, mask, 1 / math.sqrt(self.head_dim))
        y = attend(q, k, v, mask, scale=1 / math.sqrt(self.head_dim), is_causal=is_causal)
        return self.out(merge_heads(y)), cache

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device=None):
        if self.window is not None:
            slots = min(self.window, max_len)
            shape = (batch, self.n_kv_heads, slots, self.head_dim)
            return RingCache({"k": shape, "v": shape}, slots, dtype, max_len, device)
        shape = (batch, self.n_kv_heads, max_len, self.head_dim)
        return DenseCache({"k": shape, "v": shape}, max_len, dtype, device)


class MHA(HeadAttention):
    def __init__(self, model: ModelConfig):
        cfg: MHAConfig = model.attention
        super().__init__(model, model.n_heads, cfg.kv_heads(model), cfg.dim(model))
