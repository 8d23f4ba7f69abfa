"""Differential attention (Ye et al. 2024, "Differential Transformer", arXiv 2410.05258; DIFF V1).

Per head h of width D, Q and K split into two halves of D/2 and V keeps width D (sec. 2.1):

    DiffAttn = (softmax(q1 k1^T / sqrt(D/2)) - lambda softmax(q2 k2^T / sqrt(D/2))) v           (eq. 1)
    lambda   = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init,  one scalar per layer               (eq. 2)
    lambda_init = 0.8 - 0.6 exp(-0.3 layer_index)              (layer_index 0-based, i.e. l - 1)
    head_h   = (1 - lambda_init) RMSNorm(DiffAttn_h)           (eq. 3, gain of width D shared by the heads)

as in the authors' code (microsoft/unilm Diff-Transformer/multihead_diffattn.py): q rows per head are
[q1 | q2], k rows per K/V head [k1 | k2], RoPE rotates each D/2 half, lambda vectors ~ N(0, 0.1^2). The paper
halves the head count against a baseline (each DIFF head is two attention maps): n_heads here counts DIFF
heads, so 4 DIFF heads of width 32 match the parameters of 8 baseline heads of 16 (configs/models/tiny-diff.yaml).
With GQA, DIFF head h reads k1, k2 and v of K/V head h // (n_heads / n_kv_heads). (That file's GQA path
repeats the 2 H_kv key halves for 2H query halves, so with a group of 2 head 0's q2 meets k1 and head 1's
q1 meets k2; here every stream reads its own half, which is the paper's per-head definition.)

By linearity (A1 - lambda A2) v = A1 v - lambda A2 v: two attention calls, SDPA(q1, k1, v) and
SDPA(q2, k2, v), then the subtraction. One call would need the two streams as 2H query heads over 2 H_kv
key heads [k1 | k2] and v repeated for both (the streams have different keys, so unlike CoDA they cannot
share one K/V head group): a copy of v per call. Measured on CPU (B 1, 8 heads, D 64, fp32), that copy
made a decode step at 2048 cached tokens 1.5x slower than two calls, and prefill of 256 tokens no faster,
so the streams are not stacked. The cache holds k1, k2 (D/2 each) and v (D) per K/V head. An H2O memory
counts the signal map's attention mass only (the inhibitory map's mass is subtracted, not read).
On CUDA without autograd, a fused Triton kernel (attnlab.kernels.diff_attention) computes both maps over
shared K/V tiles, the subtraction and the head norm in one pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from attnlab.attention.base import Attention, AttentionScores
from attnlab.attention.mha import MHAConfig
from attnlab.cache.attend import attend_held, read_cache
from attnlab.cache.layout import CacheLayout, Field
from attnlab.config import ModelConfig
from attnlab.kernels import fused_usable
from attnlab.ops.heads import merge_heads, split_heads
from attnlab.ops.masks import causal_mask
from attnlab.ops.norm import HeadRMSNorm, head_rms_norm
from attnlab.ops.rope import Rotary


def lambda_init(layer_index: int) -> float:
    """Eq. 2's lambda_init for a 0-based layer index (the paper's l - 1): 0.2 at layer 0, towards 0.8."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_index)


@dataclass(frozen=True)
class DiffConfig(MHAConfig):
    kind: ClassVar[str] = "diff"
    head_dim_multiple: ClassVar[int] = 4
    head_dim_reason: ClassVar[str] = "for diff: q and k split into two halves of head_dim/2, each rotated by RoPE"
    # n_kv_heads: None = n_heads; else GQA over DIFF heads. head_dim: D per DIFF head (q1, q2, k1, k2 get D/2
    # each, v gets D); None = d_model / n_heads.
    head_norm: bool = True  # eq. 3's RMSNorm; false leaves it out (a converted model starts as its source)

    def to_dict(self) -> dict:
        out = super().to_dict()
        if self.head_norm:
            del out["head_norm"]  # the default: configs (and their hashes) read as before the option
        return out

    def cache_layout(self, model: ModelConfig) -> CacheLayout:
        """k1, k2 (D/2 each, rotated) and v (D) per K/V head; two maps per step, so no single read."""
        half = self.dim(model) // 2
        fields = {"k1": [Field("k1", half, rope=True)], "k2": [Field("k2", half, rope=True)],
                  "v": [Field("v", self.dim(model))]}  # fmt: skip
        return CacheLayout.of(
            fields,
            kv_heads=self.kv_heads(model),
            route="v",
            rope_interleaved=model.rope_interleaved,
            rope_base=model.rope_base,
        )


class Differential(Attention):
    def __init__(self, model: ModelConfig, layer_index: int = 0):
        super().__init__()
        cfg: DiffConfig = model.attention
        self.layout = cfg.cache_layout(model)
        self.n_heads, self.n_kv_heads, self.head_dim = model.n_heads, cfg.kv_heads(model), cfg.dim(model)
        self.half = self.head_dim // 2
        self.layer_index, self.lambda_init = layer_index, lambda_init(layer_index)
        h, hk, d = self.n_heads, self.n_kv_heads, self.head_dim
        self.qkv = nn.Linear(model.d_model, (h + 2 * hk) * d, bias=False)  # [q | k | v], q and k rows [1 | 2] per head
        self.out = nn.Linear(h * d, model.d_model, bias=False)
        self.rotary = Rotary(self.half, model.rope_base, model.max_seq_len, model.rope_interleaved)
        # Eq. 2's re-parameterisation; 1-D, so the model's generic init keeps the authors' N(0, 0.1^2).
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.randn(self.half) * 0.1) for _ in range(4)
        )
        self.head_norm = HeadRMSNorm(d, model.norm_eps) if cfg.head_norm else None  # eq. 3: one gain shared by heads

    def lambda_full(self) -> torch.Tensor:
        """Eq. 2, a 0-d fp32 tensor."""
        dot1 = (self.lambda_q1.float() * self.lambda_k1.float()).sum()
        dot2 = (self.lambda_q2.float() * self.lambda_k2.float()).sum()
        return torch.exp(dot1) - torch.exp(dot2) + self.lambda_init

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """x (B, T, d_model) -> q1, q2 (B, H, T, D/2) and k1, k2 (B, H_kv, T, D/2), rotated; v (B, H_kv, T, D)."""
        h, hk, d, half = self.n_heads, self.n_kv_heads, self.head_dim, self.half
        q, k, v = self.qkv(x).split((h * d, hk * d, hk * d), dim=-1)
        q, k = split_heads(q, h), split_heads(k, hk)  # (B, H, T, D), (B, H_kv, T, D): rows [1 | 2] per head
        # One RoPE call for both halves of q and k: (B, 2H + 2H_kv, T, D/2), then split.
        rotated = self.rotary(torch.cat((*q.split(half, dim=-1), *k.split(half, dim=-1)), dim=1), positions)
        q1, q2, k1, k2 = rotated.split((h, h, hk, hk), dim=1)
        return {"q1": q1, "q2": q2, "k1": k1, "k2": k2, "v": split_heads(v, hk)}

    def projections(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """q1, q2 (B, H, T, D/2), k1, k2 (B, H_kv, T, D/2) before RoPE, v (B, H_kv, T, D)."""
        h, hk, d, half = self.n_heads, self.n_kv_heads, self.head_dim, self.half
        q, k, v = self.qkv(x).split((h * d, hk * d, hk * d), dim=-1)
        (q1, q2), (k1, k2) = split_heads(q, h).split(half, dim=-1), split_heads(k, hk).split(half, dim=-1)
        return {"q1": q1, "q2": q2, "k1": k1, "k2": k2, "v": split_heads(v, hk)}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache=None, write=None):
        t = self.project(x, positions)
        held = read_cache(cache, {name: t[name] for name in ("k1", "k2", "v")}, positions, write=write)
        kv = held.tensors
        lam, scale = self.lambda_full(), 1 / math.sqrt(self.half)
        if fused_usable(x, self) and held.shared_positions:
            from attnlab.kernels.diff_attention import diff_attention  # optional: needs triton

            norm = self.head_norm
            weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
            y = diff_attention(
                t["q1"],
                t["q2"],
                kv["k1"],
                kv["k2"],
                kv["v"],
                lam,
                scale,
                positions,
                held.positions,
                weight,
                eps,
            )  # (B, H, T, D), normalised when the head norm is on
        else:
            signal = attend_held(held, t["q1"], kv["k1"], kv["v"], scale)  # (B, H, T, D)
            noise = attend_held(held, t["q2"], kv["k2"], kv["v"], scale, observe=False)
            y = signal - lam.to(signal.dtype) * noise  # eq. 1
            y = y if self.head_norm is None else self.head_norm(y)  # eq. 3's RMSNorm
        y = y * (1 - self.lambda_init)  # eq. 3
        return self.out(merge_heads(y)), cache

    def scores(self, x: torch.Tensor, positions: torch.Tensor) -> AttentionScores:
        t = {name: value.float() for name, value in self.project(x, positions).items()}
        group = self.n_heads // self.n_kv_heads
        mask, scale = causal_mask(positions, positions), 1 / math.sqrt(self.half)
        maps = {}
        for stream, q, k in (("signal", t["q1"], t["k1"]), ("noise", t["q2"], t["k2"])):
            scores = q @ k.repeat_interleave(group, dim=1).transpose(-1, -2) * scale  # (B, H, T, T)
            maps[stream] = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        v = t["v"].repeat_interleave(group, dim=1)
        lam, norm = self.lambda_full(), self.head_norm

        def combine(out: dict[str, torch.Tensor]) -> torch.Tensor:  # eq. 1 and 3 on the maps' outputs
            y = out["signal"] - lam * out["noise"]
            y = y if norm is None else head_rms_norm(y, norm.weight.float(), norm.eps)
            return F.linear(merge_heads(y * (1 - self.lambda_init)), self.out.weight.float())

        return AttentionScores(maps, {"signal": v, "noise": v}, False, combine)
