"""Sliding-window attention: each query sees the last `window` positions (its own included), with a
ring-buffer cache of `window` slots, so decode memory stays fixed however long the sequence grows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from attnlab.attention.mha import HeadAttention, MHAConfig, head_layout
from attnlab.cache.layout import CacheLayout
from attnlab.config import ModelConfig


@dataclass(frozen=True)
class SlidingConfig(MHAConfig):
    kind: ClassVar[str] = "sliding"
    window: int = 256

    def problems(self, model: ModelConfig) -> list[str]:
        out = super().problems(model)
        if self.window < 1:
            out.append(f"attention.window={self.window} must be >= 1")
        elif self.window >= model.max_seq_len:  # a model without a memory reads at most max_seq_len tokens
            out.append(f"attention.window={self.window} is not less than max_seq_len={model.max_seq_len}: every token "
                       f"would see all earlier ones, so sliding attention would be plain mha (use attention.kind: "
                       f"mha, or a window below {model.max_seq_len})")  # fmt: skip
        return out

    def cache_layout(self, model: ModelConfig) -> CacheLayout:
        return head_layout(model, self.kv_heads(model), self.dim(model), window=self.window)


class Sliding(HeadAttention):
    def __init__(self, model: ModelConfig):
        cfg: SlidingConfig = model.attention
        super().__init__(model, model.n_heads, cfg.kv_heads(model), cfg.dim(model), qkv_bias=cfg.qkv_bias)
