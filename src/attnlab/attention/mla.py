"""Multi-head latent attention (DeepSeek-V2, section 2.1).

K and V are compressed to a shared latent c = RMSNorm(W_dkv x) of width d_latent (latent_norm: false drops the
norm, as a conversion from a pretrained model needs); a small decoupled
key k_rope = RoPE(W_kr x) of width d_rope, shared by all heads, carries position. The cache holds only
[c | k_rope] per token. Per head h:

    score_h = (q_nope,h . (W_uk,h c) + q_rope,h . k_rope) / sqrt(head_dim + d_rope)
    out_h   = softmax(score_h) (W_uv,h c)

Naive path: expand c into per-head keys and values. Absorbed path (decode): fold W_uk,h into the query,
q_lat,h = W_uk,h^T q_nope,h, so scores are q_lat,h . c, attend over the cached latent itself (one K/V
"head" shared by all query heads) and apply W_uv,h to the attended latent afterwards. A memory routes its
exact bank on the latent and its summary bank on k_rope's low-frequency channels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from attnlab.attention.base import Attention, AttentionScores, single_map
from attnlab.cache.attend import attend_cache, attend_held, read_cache
from attnlab.cache.layout import CacheLayout, Field, Read
from attnlab.config import AttentionConfig, ModelConfig, check_head_split
from attnlab.ops.heads import merge_heads, split_heads
from attnlab.ops.masks import causal_mask
from attnlab.ops.norm import RMSNorm
from attnlab.ops.rope import Rotary


@dataclass(frozen=True)
class MLAConfig(AttentionConfig):
    kind: ClassVar[str] = "mla"
    d_latent: int
    d_rope: int | None = None  # None = head_dim / 2
    head_dim: int | None = None  # per-head width of the non-rotated q/k part; None = d_model / n_heads
    v_head_dim: int | None = None  # None = head_dim
    absorb: bool = True  # decode through the absorbed path
    latent_norm: bool = True  # RMSNorm on the latent (DeepSeek-V2's); off, the model is linear in it (conversions)

    def to_dict(self) -> dict:
        out = super().to_dict()
        if self.latent_norm:
            del out["latent_norm"]  # the default: configs (and their hashes) read as before the option
        return out

    def dims(self, model: ModelConfig) -> tuple[int, int, int]:
        head_dim = self.head_dim if self.head_dim is not None else model.d_model // model.n_heads
        d_rope = self.d_rope if self.d_rope is not None else head_dim // 2
        return head_dim, d_rope, self.v_head_dim if self.v_head_dim is not None else head_dim

    def problems(self, model: ModelConfig) -> list[str]:
        out = check_head_split(model, self.head_dim)
        if out:
            return out
        if self.d_latent < 1:
            out.append(f"attention.d_latent={self.d_latent} must be >= 1")
        elif self.d_latent > model.d_model:  # c = RMSNorm(W_dkv x) lies in a d_model-dimensional subspace (scaled)
            out.append(f"attention.d_latent={self.d_latent} is more than d_model={model.d_model}: the latent is a "
                       f"projection of the d_model-wide input, so it spans at most {model.d_model} dimensions and the "
                       f"rest of its width caches bytes that carry nothing (give a d_latent of at most "
                       f"{model.d_model})")  # fmt: skip
        if self.v_head_dim is not None and self.v_head_dim < 1:
            out.append(f"attention.v_head_dim={self.v_head_dim} must be >= 1 (or leave it out: head_dim)")
        d_rope = self.dims(model)[1]
        if d_rope < 2 or d_rope % 2:
            out.append(f"attention.d_rope={d_rope} must be even and >= 2 for RoPE")
        return out

    def cache_layout(self, model: ModelConfig) -> CacheLayout:
        """One row per token shared by every head, [latent | k_rope]; the absorbed decode reads it as K and its
        latent as V."""
        fields = [Field("latent", self.d_latent), Field("k_rope", self.dims(model)[1], rope=True)]
        read = Read("latent", "latent", self.d_latent) if self.absorb else None
        return CacheLayout.of({"latent": fields}, kv_heads=None, route="latent", read=read,
                              rope_interleaved=model.rope_interleaved, rope_base=model.rope_base,
                              rope_scaling=model.rope_scaling)  # fmt: skip


class MLA(Attention):
    def __init__(self, model: ModelConfig):
        super().__init__()
        cfg: MLAConfig = model.attention
        self.cfg, self.n_heads, self.layout = cfg, model.n_heads, cfg.cache_layout(model)
        self.head_dim, self.rope_dim, self.v_dim = cfg.dims(model)
        self.d_latent = cfg.d_latent
        h = self.n_heads
        self.q_proj = nn.Linear(model.d_model, h * (self.head_dim + self.rope_dim), bias=False)
        self.kv_down = nn.Linear(model.d_model, self.d_latent + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.d_latent, model.norm_eps) if cfg.latent_norm else nn.Identity()
        self.k_up = nn.Linear(self.d_latent, h * self.head_dim, bias=False)
        self.v_up = nn.Linear(self.d_latent, h * self.v_dim, bias=False)
        self.out = nn.Linear(h * self.v_dim, model.d_model, bias=False)
        self.rotary = Rotary(self.rope_dim, model.rope_base, model.max_seq_len, model.rope_interleaved,
                             model.rope_scaling)  # fmt: skip
        self.scale = 1 / math.sqrt(self.head_dim + self.rope_dim)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x (B, T, d_model) -> q_nope (B, H, T, head_dim), q_rope (B, H, T, d_rope) rotated, and the cached row
        [RMSNorm(latent) | RoPE(k_rope)] (B, T, d_latent + d_rope)."""
        q = split_heads(self.q_proj(x), self.n_heads)  # (B, H, T, head_dim + d_rope)
        q_nope, q_rope = q.split((self.head_dim, self.rope_dim), dim=-1)
        q_rope = self.rotary(q_rope, positions)
        latent, k_rope = self.kv_down(x).split((self.d_latent, self.rope_dim), dim=-1)  # (B, T, .)
        return q_nope, q_rope, torch.cat((self.kv_norm(latent), self.rotary(k_rope, positions)), dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache=None, write=None, absorb: bool | None = None):
        q_nope, q_rope, latent = self.project(x, positions)
        use_absorbed = self.cfg.absorb and cache is not None if absorb is None else absorb
        if use_absorbed:
            q_latent = torch.cat((self._absorb_query(q_nope), q_rope), dim=-1)  # (B, H, T, d_latent + d_rope)
            read = Read("latent", "latent", self.d_latent)  # K: [latent | k_rope], one "head" for all queries
            out_latent = attend_cache(cache, q_latent, {"latent": latent}, positions, read, self.scale, write=write)
            y = self._expand_values(out_latent)  # (B, H, T, v_dim)
        else:
            held = read_cache(cache, {"latent": latent}, positions, write=write)
            q, k, v = self._naive(q_nope, q_rope, held.tensors["latent"])
            y = attend_held(held, q, k, v, self.scale)
        return self.out(merge_heads(y)), cache

    def scores(self, x: torch.Tensor, positions: torch.Tensor) -> AttentionScores:
        q, k, v = (t.float() for t in self._naive(*self.project(x, positions)))
        return single_map(self, q * self.scale, k, v, causal_mask(positions, positions))

    def projections(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """q_nope, q_rope (per head), k_nope = W_uk RMSNorm(c) (per head), k_rope (one head shared by all), v."""
        q_nope, q_rope = split_heads(self.q_proj(x), self.n_heads).split((self.head_dim, self.rope_dim), dim=-1)
        latent, k_rope = self.kv_down(x).split((self.d_latent, self.rope_dim), dim=-1)
        c = self.kv_norm(latent)
        return {"q_nope": q_nope, "q_rope": q_rope, "k_nope": split_heads(self.k_up(c), self.n_heads),
                "k_rope": k_rope[:, None], "v": split_heads(self.v_up(c), self.n_heads)}  # fmt: skip

    def _naive(self, q_nope, q_rope, latent):
        """Per-head queries, keys and values from the latent rows (B, S, L + R): q (B, H, T, head_dim + d_rope),
        k (B, H, S, head_dim + d_rope) = [W_uk c | k_rope], v (B, H, S, v_dim) = W_uv c."""
        c, k_rope = latent.split((self.d_latent, self.rope_dim), dim=-1)
        k_nope = split_heads(self.k_up(c), self.n_heads)  # (B, H, S, head_dim)
        v = split_heads(self.v_up(c), self.n_heads)  # (B, H, S, v_dim)
        k_rope = k_rope[:, None].expand(-1, self.n_heads, -1, -1)  # shared by all heads
        return torch.cat((q_nope, q_rope), dim=-1), torch.cat((k_nope, k_rope), dim=-1), v

    def _absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope (B, H, T, head_dim) -> its scores' weights on the latent, (B, H, T, d_latent)."""
        w_uk = self.k_up.weight.view(self.n_heads, self.head_dim, self.d_latent)
        return torch.einsum("bhtd,hdl->bhtl", q_nope, w_uk)

    def _expand_values(self, out_latent: torch.Tensor) -> torch.Tensor:
        """Attention output over the latent (B, H, T, d_latent) -> over the values, (B, H, T, v_dim)."""
        w_uv = self.v_up.weight.view(self.n_heads, self.v_dim, self.d_latent)
        return torch.einsum("bhtl,hvl->bhtv", out_latent, w_uv)
