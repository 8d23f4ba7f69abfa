"""Bottleneck attention: Q, K, V projected to d_attn < d_model, attended per head, projected back.

A d_attn of d_model or more narrows nothing (it is mha with head_dim d_attn / n_heads) and is refused, unless
null_attn gives it the null key that only this kind has.

head_dim = d_attn / n_heads, scale 1/sqrt(d_attn / n_heads); an optional learned null key/value per
head gives every query an explicit "attend nowhere" column (the bottleneck report's null token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from attnlab.attention.mha import HeadAttention, head_layout
from attnlab.cache.layout import CacheLayout
from attnlab.config import AttentionConfig, ModelConfig, check_kv_heads


@dataclass(frozen=True)
class BottleneckConfig(AttentionConfig):
    kind: ClassVar[str] = "bottleneck"
    d_attn: int
    null_attn: bool = False
    n_kv_heads: int | None = None

    def problems(self, model: ModelConfig) -> list[str]:
        out = check_kv_heads(self.n_kv_heads, model.n_heads)
        if self.d_attn < 1 or self.d_attn % model.n_heads:
            out.append(f"attention.d_attn={self.d_attn} must be a positive multiple of n_heads={model.n_heads}")
        elif (self.d_attn // model.n_heads) % 2:
            out.append(f"attention.d_attn / n_heads = {self.d_attn // model.n_heads} must be even for RoPE")
        elif self.d_attn >= model.d_model and not self.null_attn:  # (a null key is what only a bottleneck offers)
            head_dim = "" if self.d_attn == model.d_model else f", head_dim: {self.d_attn // model.n_heads}"
            kv = f", n_kv_heads: {self.n_kv_heads}" if self.n_kv_heads is not None else ""
            out.append(f"attention.d_attn={self.d_attn} is not less than d_model={model.d_model}: Q, K and V would not "
                       f"be narrowed, so bottleneck attention would be plain mha (use attention.kind: mha{head_dim}"
                       f"{kv}, or a d_attn below {model.d_model})")  # fmt: skip
        return out

    def cache_layout(self, model: ModelConfig) -> CacheLayout:
        return head_layout(model, self.n_kv_heads or model.n_heads, self.d_attn // model.n_heads,
                           null_key=self.null_attn)  # fmt: skip


class Bottleneck(HeadAttention):
    def __init__(self, model: ModelConfig):
        cfg: BottleneckConfig = model.attention
        n_kv = cfg.n_kv_heads or model.n_heads
        super().__init__(model, model.n_heads, n_kv, cfg.d_attn // model.n_heads, null_attn=cfg.null_attn)
