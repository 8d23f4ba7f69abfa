"""CoDA: constrained orthogonal differential attention (seeds: coda-gqa-l.md, sec. 3.1, eq. 3-7).

One query projection; the inhibitory ("noise") query is a learned per-head rotation of the signal query:

    q_sig   = RoPE(W_q x, p)                                                    (eq. 3)
    q_noise = R(theta) q_sig,  theta: (H, D/2), one angle per head and channel pair      (eq. 4, 7)
    lambda  = sigmoid(W_lambda x + b_lambda),  one gate per token and head, b_lambda = -6     (eq. 5)
    o       = RMSNorm_h(SDPA(q_sig, K, V) - lambda SDPA(q_noise, K, V))          (eq. 6)

Choices, where the paper leaves room:
- Pairing. Eq. 7 rotates consecutive channels (2i, 2i+1), which are exactly interleaved RoPE's planes.
  R(theta) here always rotates within the model's RoPE planes: (2i, 2i+1) with `rope_interleaved: true`
  (eq. 7 as written) and (i, i + D/2) with the default half-split RoPE. R(theta) then commutes with RoPE, so
  rotating before or after RoPE is the same thing and the inhibitory scores q_noise . k stay functions of the
  relative position only. Pairing (2i, 2i+1) under half-split RoPE (as the authors' Llama adapter does)
  straddles RoPE's planes: the inhibitory scores then depend on absolute position.
- Order: RoPE first, then R(theta) (eq. 3-4); equal to the other order given the pairing above.
- theta starts at pi/2 (the authors' code): q_noise is orthogonal to q_sig (the paper's "orthogonal
  subspace"); W_lambda ~ N(0, init_std^2) and b_lambda = `gate_bias` (-6: lambda ~ 0.0025), so the layer
  starts as standard attention followed by the head norm.
- Head norm: a gain of width D per head, as sec. 3.1 says ("a learned scale vector per head"; the
  authors' code shares one across heads); no output scaling (eq. 6 has none). `head_norm: false` is the
  paper's Appendix C "identity" mode, used for its Mistral runs; only then does lambda ~ 0 give back
  standard attention exactly.
- Scale 1/sqrt(D) for both streams (SDPA's default, eq. 6).

Both streams are ONE attention call (sec. 3.1, head-stacked SDPA): the queries are interleaved per head,
[sig_0, noise_0, sig_1, noise_1, ...] (2H heads), over the same H_kv K/V heads; query head 2h + s reads K/V
head (2h + s) // (2H / H_kv) = h // (H / H_kv), so GQA folds without copying K or V. The cache is MHA's.
On CUDA without autograd, the fused Triton kernel (attnlab.kernels.diff_attention, the paper's sec. 3.4
design) computes both streams over shared K/V tiles with the gate and head norm in registers.
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
from attnlab.cache.attend import attend_cache, read_cache
from attnlab.config import ModelConfig
from attnlab.kernels import fused_usable
from attnlab.ops.heads import merge_heads, split_heads
from attnlab.ops.masks import causal_mask
from attnlab.ops.norm import HeadRMSNorm, head_rms_norm
from attnlab.ops.rope import Rotary, rotate


@dataclass(frozen=True)
class CoDAConfig(MHAConfig):
    kind: ClassVar[str] = "coda"
    head_dim_reason: ClassVar[str] = "for RoPE and the pairwise rotation"
    gate_bias: float = -6.0  # b_lambda at init (eq. 5): sigmoid(-6) ~ 0.0025, near standard attention
    head_norm: bool = True  # RMSNorm_h of eq. 6; false = the paper's "identity" head-norm mode


# Eq. 7's rotation pairs channels as the model's RoPE does, so it is RoPE's own pairwise rotation with per-head,
# per-plane angles: (2i, 2i+1) if interleaved, else (i, i + D/2).
rotate_planes = rotate


class CoDA(Attention):
    def __init__(self, model: ModelConfig):
        super().__init__()
        cfg: CoDAConfig = model.attention
        self.cfg, self.layout = cfg, cfg.cache_layout(model)  # MHA's: k and v
        self.n_heads, self.n_kv_heads, self.head_dim = model.n_heads, cfg.kv_heads(model), cfg.dim(model)
        self.interleaved = model.rope_interleaved
        h, hk, d = self.n_heads, self.n_kv_heads, self.head_dim
        self.qkv = nn.Linear(model.d_model, (h + 2 * hk) * d, bias=False)  # [q | k | v]
        self.out = nn.Linear(h * d, model.d_model, bias=False)
        self.rotary = Rotary(d, model.rope_base, model.max_seq_len, model.rope_interleaved)
        self.theta = nn.Parameter(torch.empty(h, d // 2))  # eq. 7: one angle per head and RoPE plane
        self.gate = nn.Linear(model.d_model, h)  # eq. 5: W_lambda, b_lambda
        self.head_norm = HeadRMSNorm(d, model.norm_eps, n_heads=h) if cfg.head_norm else None
        self.init_parameters()

    def init_parameters(self) -> None:
        """theta = pi/2 and b_lambda = gate_bias (also called by the model after its generic init)."""
        with torch.no_grad():
            self.theta.fill_(math.pi / 2)
            self.gate.bias.fill_(self.cfg.gate_bias)

    def queries(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Raw queries (B, H, T, D) -> [sig_0, noise_0, sig_1, noise_1, ...] (B, 2H, T, D), eq. 3-4."""
        q_sig = self.rotary(q, positions)  # eq. 3
        cos, sin = torch.cos(self.theta).to(q.dtype)[:, None], torch.sin(self.theta).to(q.dtype)[:, None]  # (H, 1, D/2)
        q_noise = rotate_planes(q_sig, cos, sin, self.interleaved)  # eq. 4
        return torch.stack((q_sig, q_noise), dim=2).flatten(1, 2)  # (B, H, 2, T, D) -> (B, 2H, T, D)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x (B, T, d_model) -> queries [sig_0, noise_0, ...] (B, 2H, T, D), k and v (B, H_kv, T, D), and the gate
        lambda (B, H, T, 1) (eq. 3-5)."""
        h, hk, d = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split((h * d, hk * d, hk * d), dim=-1)
        q = self.queries(split_heads(q, h), positions)  # (B, 2H, T, D)
        k, v = self.rotary(split_heads(k, hk), positions), split_heads(v, hk)  # (B, H_kv, T, D)
        lam = torch.sigmoid(self.gate(x)).transpose(1, 2)[..., None]  # eq. 5: (B, T, H) -> (B, H, T, 1)
        return q, k, v, lam

    def projections(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """q (the signal query; the inhibitory one is its rotation), k, v, before RoPE."""
        h, hk, d = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split((h * d, hk * d, hk * d), dim=-1)
        return {"q": split_heads(q, h), "k": split_heads(k, hk), "v": split_heads(v, hk)}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache=None, write=None):
        h, scale, norm = self.n_heads, 1 / math.sqrt(self.head_dim), self.head_norm
        q, k, v, lam = self.project(x, positions)
        if fused_usable(x, self) and (cache is None or not (cache.per_sequence or cache.selects)):
            from attnlab.kernels.diff_attention import diff_attention  # optional: needs triton

            held = read_cache(cache, {"k": k, "v": v}, positions, write=write)
            q_sig, q_noise = q.unflatten(1, (h, 2)).unbind(2)  # views, (B, H, T, D) each
            k, v = held.tensors["k"], held.tensors["v"]
            weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
            y = diff_attention(q_sig, q_noise, k, k, v, lam, scale, positions, held.positions, weight, eps)  # normed
        else:
            both = attend_cache(cache, q, {"k": k, "v": v}, positions, self.layout.read, scale, write=write)
            signal, noise = both.unflatten(1, (h, 2)).unbind(2)  # (B, H, T, D) each
            y = signal - lam * noise  # eq. 6
            if norm is not None:
                y = norm(y)
        return self.out(merge_heads(y)), cache

    def scores(self, x: torch.Tensor, positions: torch.Tensor) -> AttentionScores:
        q, k, v, lam = (t.float() for t in self.project(x, positions))
        h, group = self.n_heads, self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # per query head
        mask, scale = causal_mask(positions, positions), 1 / math.sqrt(self.head_dim)
        q_sig, q_noise = q.unflatten(1, (h, 2)).unbind(2)
        maps = {stream: (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")).softmax(dim=-1)
                for stream, q in (("signal", q_sig), ("noise", q_noise))}  # fmt: skip
        norm = self.head_norm

        def combine(out: dict[str, torch.Tensor]) -> torch.Tensor:  # eq. 6
            y = out["signal"] - lam * out["noise"]
            y = y if norm is None else head_rms_norm(y, norm.weight.float(), norm.eps)
            return F.linear(merge_heads(y), self.out.weight.float())

        return AttentionScores(maps, {"signal": v, "noise": v}, False, combine)
