"""Multi-head latent attention (DeepSeek-V2, section 2.1).

K and V are compressed to a shared latent c = RMSNorm(W_dkv x) of width d_latent; a small decoupled
key k_rope = RoPE(W_kr x) of width d_rope, shared by all heads, carries position. The cache holds only
[c | k_rope] per token. Per head h:

    score_h = (q_nope,h . (W_uk,h c) + q_rope,h . k_rope) / sqrt(head_dim + d_rope)
    out_h   = softmax(score_h) (W_uv,h c)

Naive path: expand c into per-head keys and values. Absorbed path (decode): fold W_uk,h into the query,
q_lat,h = W_uk,h^T q_nope,h, so scores are q_lat,h . c, attend over the cached latent itself (one K/V
"head" shared by all query heads) and apply W_uv,h to the attended latent afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from attnlab.attention.base import merge_heads, split_heads
from attnlab.attention.core import attend
from attnlab.attention.masks import attention_mask
from attnlab.cache.dense import DenseCache
from attnlab.config import AttentionConfig, ModelConfig, check_head_split
from attnlab.model.norm import RMSNorm
from attnlab.model.rope import Rotary


@dataclass(frozen=True)
class MLAConfig(AttentionConfig):
    kind: ClassVar[str] = "mla"
    d_latent: int
    d_rope: int | None = None  # None = head_dim / 2
    head_dim: int | None = None  # per-head width of the non-rotated q/k part; None = d_model / n_heads
    v_head_dim: int | None = None  # None = head_dim
    absorb: bool = True  # decode through the absorbed path

    def dims(self, model: ModelConfig) -> tuple[int, int, int]:
        head_dim = self.head_dim or model.d_model // model.n_heads
        return head_dim, self.d_rope if self.d_rope is not None else head_dim // 2, self.v_head_dim or head_dim

    def problems(self, model: ModelConfig) -> list[str]:
        out = check_head_split(model, self.head_dim)
        if out:
            return out
        if self.d_latent < 1:
            out.append(f"attention.d_latent={self.d_latent} must be >= 1")
        d_rope = self.dims(model)[1]
        if d_rope < 2 or d_rope % 2:
            out.append(f"attention.d_rope={d_rope} must be even and >= 2 for RoPE")
        return out

    def cache_fields(self, model: ModelConfig) -> dict[str, int]:
        return {"latent": self.d_latent, "k_rope": self.dims(model)[1]}


class MLA(nn.Module):
    def __init__(self, model: ModelConfig):
        super().__init__()
        cfg: MLAConfig = model.attention
        self.cfg, self.n_heads = cfg, model.n_heads
        self.head_dim, self.rope_dim, self.v_dim = cfg.dims(model)
        self.d_latent = cfg.d_latent
        h = self.n_heads
        self.q_proj = nn.Linear(model.d_model, h * (self.head_dim + self.rope_dim), bias=False)
        self.kv_down = nn.Linear(model.d_model, self.d_latent + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.d_latent, model.norm_eps)
        self.k_up = nn.Linear(self.d_latent, h * self.head_dim, bias=False)
        self.v_up = nn.Linear(self.d_latent, h * self.v_dim, bias=False)
        self.out = nn.Linear(h * self.v_dim, model.d_model, bias=False)
        self.rotary = Rotary(self.rope_dim, model.rope_base, model.max_seq_len, model.rope_interleaved)
        self.scale = 1 / math.sqrt(self.head_dim + self.rope_dim)

    @property
    def reads_quantized_cache(self) -> bool:
        """Whether a decode step reads a quantized cache through its attend_one (the absorbed path)."""
        return self.cfg.absorb

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache=None, absorb: bool | None = None):
        q = split_heads(self.q_proj(x), self.n_heads)  # (B, H, T, head_dim + d_rope)
        q_nope, q_rope = q.split((self.head_dim, self.rope_dim), dim=-1)
        q_rope = self.rotary(q_rope, positions)
        latent, k_rope = self.kv_down(x).split((self.d_latent, self.rope_dim), dim=-1)  # (B, T, .)
        latent = torch.cat((self.kv_norm(latent), self.rotary(k_rope, positions)), dim=-1)  # (B, T, L + R)
        use_absorbed = self.cfg.absorb and cache is not None if absorb is None else absorb
        if use_absorbed and hasattr(cache, "attend_one"):  # a quantized cache reading its blocks in a kernel
            q_latent = torch.cat((self._absorb_query(q_nope), q_rope), dim=-1)
            y = cache.attend_one(q_latent, {"latent": latent}, positions, self.scale, "latent", "latent", self.d_latent)
            if y is not None:
                return self.out(merge_heads(self._expand_values(y))), cache
        k_pos = None
        if cache is not None:
            held, k_pos = cache.update({"latent": latent}, positions)
            latent = held["latent"]  # (B, S, L + R)
        mask, is_causal = attention_mask(positions, k_pos, static=getattr(cache, "static", False))
        if use_absorbed:
            y = self._absorbed(q_nope, q_rope, latent, mask, is_causal)
        else:
            y = self._naive(q_nope, q_rope, latent, mask, is_causal)
        return self.out(merge_heads(y)), cache

    def _naive(self, q_nope, q_rope, latent, mask, is_causal):
        c, k_rope = latent.split((self.d_latent, self.rope_dim), dim=-1)
        k_nope = split_heads(self.k_up(c), self.n_heads)  # (B, H, S, head_dim)
        v = split_heads(self.v_up(c), self.n_heads)  # (B, H, S, v_dim)
        k_rope = k_rope[:, None].expand(-1, self.n_heads, -1, -1)  # shared by all heads
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope), dim=-1)
        return attend(q, k, v, mask, scale=self.scale, is_causal=is_causal)

    def _absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope (B, H, T, head_dim) -> its scores' weights on the latent, (B, H, T, d_latent)."""
        w_uk = self.k_up.weight.view(self.n_heads, self.head_dim, self.d_latent)
        return torch.einsum("bhtd,hdl->bhtl", q_nope, w_uk)

    def _expand_values(self, out_latent: torch.Tensor) -> torch.Tensor:
        """Attention output over the latent (B, H, T, d_latent) -> over the values, (B, H, T, v_dim)."""
        w_uv = self.v_up.weight.view(self.n_heads, self.v_dim, self.d_latent)
        return torch.einsum("bhtl,hvl->bhtv", out_latent, w_uv)

    def _absorbed(self, q_nope, q_rope, latent, mask, is_causal):
        q = torch.cat((self._absorb_query(q_nope), q_rope), dim=-1)  # (B, H, T, d_latent + d_rope)
        k = latent[:, None]  # (B, 1, S, d_latent + d_rope): one K "head" for all queries
        v = latent[:, None, :, : self.d_latent]  # (B, 1, S, d_latent): a view, no copy
        out_latent = attend(q, k, v, mask, scale=self.scale, is_causal=is_causal)  # (B, H, T, d_latent)
        return self._expand_values(out_latent)

    def cache_parts(self) -> dict[str, list[tuple[str, int]]]:
        """The named tensors inside the cache buffer: the latent and the RoPE key, along the last axis."""
        return {"latent": [("latent", self.d_latent), ("k_rope", self.rope_dim)]}

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device=None):
        return DenseCache({"latent": (batch, max_len, self.d_latent + self.rope_dim)}, max_len, dtype, device)
