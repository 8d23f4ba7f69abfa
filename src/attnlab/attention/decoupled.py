"""Decoupled Bottleneck Attention (DBA; seeds: dba-structural-regularization.md, eq. 5-10).

    score = q_sem k_sem^T / sqrt(d_sem/H) + q_geo k_geo^T / sqrt(d_geo/H)        (eq. 5)

RoPE rotates only the geometric path (eq. 6) unless `rope_semantic`; V has width d_v (eq. 7, default
d_sem + d_geo). Both paths are computed by ONE scaled_dot_product_attention call: the queries are
pre-scaled and concatenated, [q_sem/sqrt(d_sem/H) | q_geo/sqrt(d_geo/H)] . [k_sem | k_geo] equals eq. 5,
so fused kernels apply (scale=1). The cache holds k = [k_sem | k_geo] per head in one buffer (so decode
reads it without a copy) and v. d_sem, d_geo and d_v are totals over the n_heads query heads. A memory
routes its exact bank on V and its summary bank on k_geo's low-frequency RoPE channels (k_sem carries no
RoPE unless rope_semantic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from attnlab.attention.base import Attention, AttentionScores, single_map
from attnlab.cache.attend import attend_cache
from attnlab.cache.layout import CacheLayout, Field, Read
from attnlab.config import AttentionConfig, ModelConfig, check_kv_heads
from attnlab.ops.heads import merge_heads, null_parameter, split_heads
from attnlab.ops.masks import causal_mask
from attnlab.ops.rope import Rotary


@dataclass(frozen=True)
class DecoupledConfig(AttentionConfig):
    kind: ClassVar[str] = "decoupled"
    d_sem: int
    d_geo: int
    d_v: int | None = None  # None = d_sem + d_geo
    n_kv_heads: int | None = None
    gate: bool = False  # per-head g = sigmoid(gamma): q_sem * 2g, q_geo * 2(1 - g)   (eq. 9)
    tie_qk: bool = False  # semantic W_Q = W_K
    null_attn: bool = False  # learned null key/value, always visible   (eq. 10)
    rope: bool = True  # RoPE on the geometric path
    rope_semantic: bool = False  # RoPE on the semantic path too

    @property
    def value_dim(self) -> int:
        return self.d_v if self.d_v is not None else self.d_sem + self.d_geo

    def problems(self, model: ModelConfig) -> list[str]:
        heads = model.n_heads
        out = check_kv_heads(self.n_kv_heads, heads)
        # An unset d_v (d_sem + d_geo) is a multiple when both are: its problem is theirs, said once, under their names.
        given = (("d_sem", self.d_sem), ("d_geo", self.d_geo)) + ((("d_v", self.d_v),) if self.d_v is not None else ())
        for key, width in given:
            if width < 1 or width % heads:
                out.append(f"attention.{key}={width} must be a positive multiple of n_heads={heads} (per-head width)")
        if out:
            return out
        if self.rope and (self.d_geo // heads) % 2:
            out.append(f"attention.d_geo / n_heads = {self.d_geo // heads} must be even for RoPE (or set rope: false)")
        if self.rope and self.rope_semantic and (self.d_sem // heads) % 2:
            out.append(f"attention.d_sem / n_heads = {self.d_sem // heads} must be even for RoPE on the semantic path")
        if self.rope_semantic and not self.rope:
            out.append("attention.rope_semantic needs rope: true (with rope: false no path is rotated; drop one)")
        if self.tie_qk and (self.n_kv_heads or heads) != heads:
            out.append("attention.tie_qk needs n_kv_heads == n_heads (W_Q = W_K must have the same heads)")
        return out

    def cache_layout(self, model: ModelConfig) -> CacheLayout:
        heads = model.n_heads
        sem = Field("k_sem", self.d_sem // heads, rope=self.rope and self.rope_semantic)
        geo = Field("k_geo", self.d_geo // heads, rope=self.rope)
        return CacheLayout.of(
            {"k": [sem, geo], "v": [Field("v", self.value_dim // heads)]}, kv_heads=self.n_kv_heads or heads,
            route="v", read=Read("k", "v"), null_key=self.null_attn, rope_interleaved=model.rope_interleaved,
            rope_base=model.rope_base, rope_scaling=model.rope_scaling,
        )  # fmt: skip


class Decoupled(Attention):
    def __init__(self, model: ModelConfig):
        super().__init__()
        cfg: DecoupledConfig = model.attention
        self.cfg, self.layout = cfg, cfg.cache_layout(model)
        self.n_heads, self.n_kv_heads = model.n_heads, cfg.n_kv_heads or model.n_heads
        self.sem_dim, self.geo_dim = cfg.d_sem // model.n_heads, cfg.d_geo // model.n_heads  # per head
        self.v_dim = cfg.value_dim // model.n_heads
        h, hk = self.n_heads, self.n_kv_heads
        # One fused projection: [q_sem (unless tied) | q_geo | k_sem | k_geo | v].
        self.widths = ([] if cfg.tie_qk else [h * self.sem_dim]) + [
            h * self.geo_dim,
            hk * self.sem_dim,
            hk * self.geo_dim,
            hk * self.v_dim,
        ]
        self.proj = nn.Linear(model.d_model, sum(self.widths), bias=False)
        self.out = nn.Linear(h * self.v_dim, model.d_model, bias=False)
        rope_args = (model.rope_base, model.max_seq_len, model.rope_interleaved, model.rope_scaling)
        self.rotary_geo = Rotary(self.geo_dim, *rope_args) if cfg.rope else None
        self.rotary_sem = Rotary(self.sem_dim, *rope_args) if cfg.rope and cfg.rope_semantic else None
        self.gate_logit = nn.Parameter(torch.zeros(h)) if cfg.gate else None  # gamma_h = 0: g_h = 0.5
        if cfg.null_attn:
            self.null_k = null_parameter(hk, self.sem_dim + self.geo_dim, model.init_std)  # [sem | geo]
            self.null_v = null_parameter(hk, self.v_dim, model.init_std)
        else:
            self.null_k = self.null_v = None

    def queries_keys(self, x: torch.Tensor, positions: torch.Tensor):
        """x (B, T, d_model) -> q = [q_sem * w_sem | q_geo * w_geo] (B, H, T, d_sem/H + d_geo/H), pre-scaled by
        eq. 5's scales and eq. 9's gate, k = [k_sem | k_geo] (B, H_kv, T, .) and v (B, H_kv, T, d_v/H)."""
        parts = self.proj(x).split(self.widths, dim=-1)
        if self.cfg.tie_qk:
            q_geo, k_sem, k_geo, v = parts
            q_sem = k_sem  # tied semantic projection: W_Q,sem = W_K,sem
        else:
            q_sem, q_geo, k_sem, k_geo, v = parts
        q_sem, q_geo = split_heads(q_sem, self.n_heads), split_heads(q_geo, self.n_heads)  # (B, H, T, d)
        k_sem, k_geo = split_heads(k_sem, self.n_kv_heads), split_heads(k_geo, self.n_kv_heads)
        v = split_heads(v, self.n_kv_heads)  # (B, H_kv, T, d_v/H)
        if self.rotary_geo is not None:  # eq. 6
            q_geo, k_geo = self.rotary_geo(q_geo, positions), self.rotary_geo(k_geo, positions)
        if self.rotary_sem is not None:
            q_sem, k_sem = self.rotary_sem(q_sem, positions), self.rotary_sem(k_sem, positions)
        sem_scale, geo_scale = 1 / math.sqrt(self.sem_dim), 1 / math.sqrt(self.geo_dim)  # eq. 5
        if self.gate_logit is not None:  # eq. 9
            g = torch.sigmoid(self.gate_logit).to(x.dtype)[None, :, None, None]  # (1, H, 1, 1)
            q_sem, q_geo = q_sem * (2 * g * sem_scale), q_geo * (2 * (1 - g) * geo_scale)
        else:
            q_sem, q_geo = q_sem * sem_scale, q_geo * geo_scale
        q = torch.cat((q_sem, q_geo), dim=-1)  # (B, H, T, d_sem/H + d_geo/H)
        k = torch.cat((k_sem, k_geo), dim=-1)  # (B, H_kv, T, d_sem/H + d_geo/H)
        return q, k, v

    def null(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.null_k is None else (self.null_k, self.null_v)  # eq. 10: the same two-path form

    def projections(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """q_sem (absent with tie_qk: it is k_sem), q_geo, k_sem, k_geo, v."""
        names = (["q_sem"] if not self.cfg.tie_qk else []) + ["q_geo", "k_sem", "k_geo", "v"]
        heads = {"q_sem": self.n_heads, "q_geo": self.n_heads}
        parts = self.proj(x).split(self.widths, dim=-1)
        return {n: split_heads(p, heads.get(n, self.n_kv_heads)) for n, p in zip(names, parts, strict=True)}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache=None, write=None):
        q, k, v = self.queries_keys(x, positions)
        y = attend_cache(cache, q, {"k": k, "v": v}, positions, self.layout.read, 1.0, None, self.null(), write)
        return self.out(merge_heads(y)), cache  # y: (B, H, T, d_v/H)

    def scores(self, x: torch.Tensor, positions: torch.Tensor) -> AttentionScores:
        q, k, v = self.queries_keys(x, positions)
        return single_map(self, q.float(), k.float(), v.float(), causal_mask(positions, positions), self.null())
