"""The pure attend functions shared by every variant."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with grouped K/V heads.

    q: (B, H, Tq, D); k: (B, H_kv, Tk, D); v: (B, H_kv, Tk, Dv); H a multiple of H_kv (query head h
    reads K/V head h // (H / H_kv)). mask: (Tq, Tk) bool, True = attend, (B, 1, Tq, Tk) when the slots
    differ per sequence (bounded memories), or None. is_causal: top-left aligned causal mask, used only
    without a cache (Tq == Tk). Returns (B, H, Tq, Dv).
    """
    batch, n_heads, tq, _ = q.shape
    n_kv = k.shape[1]
    if tq == 1 and q.shape[-1] >= 8 and torch.compiler.is_compiling():
        # A compiled decode step. Below 8 dims per head, inductor's loops lose to the SDPA kernel
        # (1088 cached keys, 1 thread: 430 vs 274 µs per step at 4 dims; 256 vs 303 at 8; 257 vs 338 at 16).
        return attend_one_query(q, k, v, mask, scale)
    if n_heads == n_kv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    if is_causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    # Fold each K/V head's group of query heads into the query axis so K/V are read once, not copied
    # per query head: (B, H, Tq, D) -> (B, H_kv, G*Tq, D). The mask depends only on the query position.
    group = n_heads // n_kv
    q = q.reshape(batch, n_kv, group * tq, q.shape[-1])
    if mask is not None:
        mask = mask.repeat(*([1] * (mask.dim() - 2)), group, 1)  # (..., G*Tq, Tk)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(batch, n_heads, tq, v.shape[-1])


def attend_one_query(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, scale: float | None = None
) -> torch.Tensor:
    """`attend` for one query per sequence (a decode step) as plain broadcasts and sums: same shapes and
    maths. Under torch.compile, inductor fuses these into a few loops; the SDPA CPU kernel it would
    otherwise call costs about 16 µs of fixed overhead per call, more than the arithmetic."""
    batch, n_heads, tq, dim = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    scale = 1 / dim**0.5 if scale is None else scale
    q = q.reshape(batch, n_kv, group * tq, dim)  # (B, H_kv, G*Tq, D): query heads grouped by K/V head
    scores = (q[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1) * scale  # (B, H_kv, G*Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask.repeat(group, 1), float("-inf"))
    probs = scores.float().softmax(dim=-1).to(v.dtype)
    out = (probs[..., None] * v[:, :, None, :, :]).sum(-2)  # (B, H_kv, G*Tq, Dv)
    return out.reshape(batch, n_heads, tq, v.shape[-1])


def attend_with_probs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` computed explicitly, also returning the probabilities: (out (B, H, Tq, Dv), probs (B, H, Tq, Tk)
    in fp32). Same shapes and mask forms as `attend` (no is_causal: give the mask)."""
    batch, n_heads, tq, _ = q.shape
    scores = grouped_logits(q, k, scale)  # (B, H_kv, G, Tq, Tk)
    if mask is not None:
        mask = mask[:, :, None] if mask.dim() == 4 else mask  # (B, 1, 1, Tq, Tk) or (Tq, Tk)
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("bhgts,bhsd->bhgtd", probs, v.float()).to(v.dtype)
    return out.reshape(batch, n_heads, tq, v.shape[-1]), probs.reshape(batch, n_heads, tq, -1)


def grouped_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q k^T * scale in fp32, query heads grouped by K/V head: q (B, H, Tq, D), k (B, H_kv, Tk, D) ->
    (B, H_kv, H / H_kv, Tq, Tk)."""
    batch, n_heads, tq, dim = q.shape
    q = q.reshape(batch, k.shape[1], n_heads // k.shape[1], tq, dim).float()
    return torch.einsum("bhgtd,bhsd->bhgts", q, k.float()) * scale


def attention_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q k^T * scale in fp32 with grouped K/V heads: (B, H, Tq, Tk), before any mask."""
    scores = grouped_logits(q, k, scale)
    return scores.reshape(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
