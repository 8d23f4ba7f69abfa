"""Fused differential attention forward (Triton): both softmax streams in one pass over shared K/V tiles.

    y = softmax(q1 k1^T * scale + mask) v - lambda softmax(q2 k2^T * scale + mask) v,   then optionally
    y = RMSNorm(y) * gain  over each head's width

with mask(i, j) = 0 <= k_pos[j] <= q_pos[i] (as attnlab.ops.masks.causal_mask, no window). It serves
`diff` (k1 != k2, one lambda per layer; Ye et al. eq. 1-3) and fits CoDA's shape too (k1 = k2, a lambda per
token and head; seed coda-gqa-l.md sec. 3.4): the kernel the CoDA paper describes, written from its text.

One program handles BLOCK_M rows of one (batch, K/V head): the rows are the G = H / H_kv query heads of
that K/V head times the T queries (GQA folded into the row axis, so decode with T = 1 still fills a tile and
every K/V tile is read once for the whole group). For each tile of BLOCK_N keys it loads k1, k2 and v once
and updates two online softmaxes (running max m, sum l, accumulator acc per stream); tiles whose keys are
all in the future of every row are skipped. The epilogue divides, subtracts, normalises in registers and
writes one (B, H, T, Dv) result. Forward only: layers use it on CUDA without autograd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _diff_attention_kernel(
    Q1, Q2, K1, K2, V, LAM, QPOS, KPOS, W, OUT,
    sq1b, sq1h, sq1t, sq1d, sq2b, sq2h, sq2t, sq2d,
    sk1b, sk1h, sk1s, sk1d, sk2b, sk2h, sk2s, sk2d,
    svb, svh, svs, svd,
    slb, slh, slt,
    swh, swd,
    sob, soh, sot, sod,
    n_kv_heads, group, seq_q, seq_k, dim_qk, dim_v, scale, eps,
    LAM_PER_ROW: tl.constexpr, HAS_NORM: tl.constexpr, SHARED_K: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // n_kv_heads
    g = pid_bg % n_kv_heads

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row i = (query head g*G + i // T, query t = i % T)
    row_ok = rows < group * seq_q
    h = g * group + rows // seq_q
    t = rows % seq_q
    d_qk = tl.arange(0, BLOCK_DQK)
    d_v = tl.arange(0, BLOCK_DV)
    qk_ok = d_qk < dim_qk
    v_ok = d_v < dim_v

    q_mask = row_ok[:, None] & qk_ok[None, :]
    q1 = tl.load(Q1 + b * sq1b + h[:, None] * sq1h + t[:, None] * sq1t + d_qk[None, :] * sq1d, mask=q_mask, other=0.0)
    q2 = tl.load(Q2 + b * sq2b + h[:, None] * sq2h + t[:, None] * sq2t + d_qk[None, :] * sq2d, mask=q_mask, other=0.0)
    q_pos = tl.load(QPOS + t, mask=row_ok, other=-1)  # padding rows see nothing
    q_max = tl.max(q_pos, axis=0)

    m1 = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked tile keeps exp() at 0, never NaN
    m2 = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    l2 = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    k1_base = K1 + b * sk1b + g * sk1h
    k2_base = K2 + b * sk2b + g * sk2h
    v_base = V + b * svb + g * svh
    for start in range(0, seq_k, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_k
        k_pos = tl.load(KPOS + cols, mask=col_ok, other=-1)  # -1: an empty slot, never visible
        first = tl.min(tl.where(k_pos >= 0, k_pos, 2147483647), axis=0)
        if first <= q_max:  # else every key of the tile lies after every row's query
            visible = (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos[:, None])  # (BLOCK_M, BLOCK_N)
            k_mask = col_ok[:, None] & qk_ok[None, :]
            k1 = tl.load(k1_base + cols[:, None] * sk1s + d_qk[None, :] * sk1d, mask=k_mask, other=0.0)
            if SHARED_K:  # CoDA: both streams score the same keys
                k2 = k1
            else:
                k2 = tl.load(k2_base + cols[:, None] * sk2s + d_qk[None, :] * sk2d, mask=k_mask, other=0.0)
            v_mask = col_ok[:, None] & v_ok[None, :]
            v = tl.load(v_base + cols[:, None] * svs + d_v[None, :] * svd, mask=v_mask, other=0.0)
            if FP32_DOT:
                s1 = tl.dot(q1, tl.trans(k1), input_precision="ieee")
                s2 = tl.dot(q2, tl.trans(k2), input_precision="ieee")
            else:
                s1 = tl.dot(q1, tl.trans(k1))
                s2 = tl.dot(q2, tl.trans(k2))
            s1 = tl.where(visible, s1 * scale, float("-inf"))
            s2 = tl.where(visible, s2 * scale, float("-inf"))

            new1 = tl.maximum(m1, tl.max(s1, axis=1))  # stream 1: online softmax
            alpha1 = tl.exp(m1 - new1)
            p1 = tl.exp(s1 - new1[:, None])
            l1 = l1 * alpha1 + tl.sum(p1, axis=1)
            new2 = tl.maximum(m2, tl.max(s2, axis=1))  # stream 2, same K/V tile
            alpha2 = tl.exp(m2 - new2)
            p2 = tl.exp(s2 - new2[:, None])
            l2 = l2 * alpha2 + tl.sum(p2, axis=1)
            if FP32_DOT:
                acc1 = acc1 * alpha1[:, None] + tl.dot(p1, v, input_precision="ieee")
                acc2 = acc2 * alpha2[:, None] + tl.dot(p2, v, input_precision="ieee")
            else:
                acc1 = acc1 * alpha1[:, None] + tl.dot(p1.to(v.dtype), v)
                acc2 = acc2 * alpha2[:, None] + tl.dot(p2.to(v.dtype), v)
            m1, m2 = new1, new2

    if LAM_PER_ROW:
        lam = tl.load(LAM + b * slb + h * slh + t * slt, mask=row_ok, other=0.0).to(tl.float32)
    else:
        lam = tl.load(LAM).to(tl.float32) + tl.zeros([BLOCK_M], tl.float32)
    l1 = tl.where(l1 > 0, l1, 1.0)  # a row with no visible key (padding) outputs 0
    l2 = tl.where(l2 > 0, l2, 1.0)
    y = acc1 / l1[:, None] - lam[:, None] * (acc2 / l2[:, None])  # (BLOCK_M, BLOCK_DV), padded columns 0
    if HAS_NORM:
        mean_square = tl.sum(y * y, axis=1) / dim_v
        y = y / tl.sqrt(mean_square + eps)[:, None]
        w = tl.load(W + h[:, None] * swh + d_v[None, :] * swd, mask=row_ok[:, None] & v_ok[None, :], other=0.0)
        y = y * w.to(tl.float32)
    out = OUT + b * sob + h[:, None] * soh + t[:, None] * sot + d_v[None, :] * sod
    tl.store(out, y.to(OUT.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])


def diff_attention(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    scale: float,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """softmax(q1 k1^T s) v - lam softmax(q2 k2^T s) v, then RMSNorm over Dv times norm_weight (if given).

    q1, q2: (B, H, T, Dqk); k1, k2: (B, H_kv, S, Dqk); v: (B, H_kv, S, Dv); any strides, H a multiple of H_kv
    (query head h reads K/V head h // (H / H_kv)). lam: a 0-d tensor, or (B, H, T) / (B, H, T, 1) per row.
    q_pos: (T,), k_pos: (S,) absolute positions (-1 = empty slot). norm_weight: (Dv,) or (H, Dv).
    Passing the same tensor as k1 and k2 (CoDA) loads each key tile once.
    Returns (B, H, T, Dv) in q1's dtype; accumulates in fp32.
    """
    batch, n_heads, seq_q, dim_qk = q1.shape
    n_kv_heads, seq_k, dim_v = k1.shape[1], k1.shape[2], v.shape[-1]
    group = n_heads // n_kv_heads
    out = torch.empty(batch, n_heads, seq_q, dim_v, dtype=q1.dtype, device=q1.device)
    per_row = lam.dim() > 0
    lam = lam.reshape(batch, n_heads, seq_q) if per_row else lam.float().reshape(1)
    lam_strides = lam.stride() if per_row else (0, 0, 0)
    if norm_weight is None:
        weight, w_strides = out, (0, 0)  # never read
    elif norm_weight.dim() == 1:
        weight, w_strides = norm_weight, (0, norm_weight.stride(0))
    else:
        weight, w_strides = norm_weight, norm_weight.stride()
    rows = group * seq_q
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = 32 if max(dim_qk, dim_v) > 64 else 64
    grid = (triton.cdiv(rows, block_m), batch * n_kv_heads)
    _diff_attention_kernel[grid](
        q1, q2, k1, k2, v, lam, q_pos.contiguous(), k_pos.contiguous(), weight, out,
        *q1.stride(), *q2.stride(), *k1.stride(), *k2.stride(), *v.stride(), *lam_strides, *w_strides, *out.stride(),
        n_kv_heads, group, seq_q, seq_k, dim_qk, dim_v, float(scale), float(eps),
        LAM_PER_ROW=per_row, HAS_NORM=norm_weight is not None, SHARED_K=k2 is k1, FP32_DOT=q1.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_DQK=max(16, triton.next_power_of_2(dim_qk)), BLOCK_DV=max(16, triton.next_power_of_2(dim_v)),
    )  # fmt: skip
    return out
