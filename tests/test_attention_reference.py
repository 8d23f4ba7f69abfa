"""Each attention variant's maths against a plain reference written here with explicit einsum scores.

The references never call scaled_dot_product_attention nor the modules' own submodules: they read the
weights out of a layer (fused projections split by rows) and recompute the output from x in fp32.
Weights are re-drawn with a larger std than the init so the softmax is far from uniform and a wrong
scale, mask or rotation shows up well above the tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.attention.bottleneck import Bottleneck, BottleneckConfig
from attnlab.attention.coda import CoDA, CoDAConfig
from attnlab.attention.decoupled import Decoupled, DecoupledConfig
from attnlab.attention.differential import DiffConfig, Differential
from attnlab.attention.mha import MHA, MHAConfig
from attnlab.attention.mla import MLA, MLAConfig
from attnlab.attention.sliding import Sliding, SlidingConfig
from attnlab.config import ModelConfig
from attnlab.model.transformer import build_model
from attnlab.ops.rope import Rotary

D_MODEL, N_HEADS, BATCH, SEQ = 32, 4, 2, 7
ROPE_BASE = 100.0  # small base: even the slowest frequency turns visibly within SEQ positions
ATOL = 1e-5


def model_config(attention, **overrides) -> ModelConfig:
    base = dict(vocab_size=50, d_model=D_MODEL, n_layers=1, n_heads=N_HEADS, max_seq_len=32, rope_base=ROPE_BASE)
    return ModelConfig(attention=attention, **{**base, **overrides})


def randomize_(module: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    """Re-draws every parameter from N(0, std^2) (null tokens and gate logits included); RMSNorm gains from
    N(1, std^2), so they are not all ones yet keep the activations' scale."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            offset = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(offset + torch.randn(p.shape, generator=gen) * std)
    return module


def inputs(seed: int = 1, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randn(batch, seq, D_MODEL, generator=torch.Generator().manual_seed(seed))  # (B, T, d_model)


# ----------------------------------------------------------------------------- reference maths


def rope_cos_sin(dim: int, positions: torch.Tensor, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of angle pos * base^(-2i/dim), i = 0 .. dim/2 - 1; each (T, dim/2). Computed in fp64."""
    theta = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (dim/2,)
    angles = positions.double()[:, None] * theta[None, :]  # (T, dim/2)
    return angles.cos().float(), angles.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF Llama's rotate_half: [x1, x2] -> [-x2, x1]."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_half(x: torch.Tensor, positions: torch.Tensor, base: float = ROPE_BASE) -> torch.Tensor:
    """HF Llama: x * cos + rotate_half(x) * sin with cos/sin repeated over both halves. x: (..., T, dim)."""
    cos, sin = rope_cos_sin(x.shape[-1], positions, base)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # (T, dim)
    return x * cos + rotate_half(x) * sin


def rope_complex(x: torch.Tensor, positions: torch.Tensor, base: float = ROPE_BASE) -> torch.Tensor:
    """Meta's Llama / llama2.c: pairs (x[2i], x[2i+1]) as complex numbers times exp(i * pos * theta_i)."""
    theta = base ** (-torch.arange(0, x.shape[-1], 2, dtype=torch.float64) / x.shape[-1])  # (dim/2,)
    freqs_cis = torch.polar(torch.ones(()), (positions.double()[:, None] * theta).float())  # (T, dim/2) complex
    x_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (..., T, dim/2)
    return torch.view_as_real(x_complex * freqs_cis).flatten(-2)  # (..., T, dim)


def rope(x: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return rope_complex(x, positions) if interleaved else rope_half(x, positions)


def heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, n_heads * D) -> (B, n_heads, T, D)."""
    batch, seq, _ = x.shape
    return x.reshape(batch, seq, n_heads, -1).permute(0, 2, 1, 3)


def merge(y: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H * D)."""
    batch, n_heads, seq, dim = y.shape
    return y.permute(0, 2, 1, 3).reshape(batch, seq, n_heads * dim)


def per_query_head(kv: torch.Tensor, n_heads: int) -> torch.Tensor:
    """GQA: query head h reads K/V head h // (H / H_kv). (..., H_kv, ...) on dim 1 -> H on dim 1."""
    group = n_heads // kv.shape[1]
    return kv[:, torch.arange(n_heads) // group]


def band_mask(seq: int, window: int | None = None) -> torch.Tensor:
    """(T, T) bool, True = visible: key k visible to query q iff 0 <= q - k (< window)."""
    pos = torch.arange(seq)
    diff = pos[:, None] - pos[None, :]  # q - k
    return (diff >= 0) & (diff < window) if window is not None else diff >= 0


def softmax_attend(scores: torch.Tensor, mask: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """scores: (B, H, T, S) already scaled; mask: (T, S) bool; v: (B, H, S, Dv) -> (B, H, T, Dv)."""
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhts,bhsd->bhtd", probs, v)


def reference_head_attention(
    layer, x: torch.Tensor, positions: torch.Tensor, window: int | None = None, interleaved: bool = False
) -> torch.Tensor:
    """MHA / GQA / MQA / bottleneck / sliding: softmax(RoPE(q) RoPE(k)^T / sqrt(head_dim) + mask) v,
    with an optional null key/value column in front of the keys (always visible, not rotated)."""
    n_heads, n_kv, dim = layer.n_heads, layer.n_kv_heads, layer.head_dim
    w_q, w_k, w_v = layer.qkv.weight.split((n_heads * dim, n_kv * dim, n_kv * dim), dim=0)
    q = rope(heads(x @ w_q.T, n_heads), positions, interleaved)  # (B, H, T, D)
    k = rope(heads(x @ w_k.T, n_kv), positions, interleaved)  # (B, H_kv, T, D)
    v = heads(x @ w_v.T, n_kv)  # (B, H_kv, T, D)
    k, v = per_query_head(k, n_heads), per_query_head(v, n_heads)  # (B, H, T, D)
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(dim)  # (B, H, T, T)
    mask = band_mask(x.shape[1], window)
    if layer.null_k is not None:
        null_k = layer.null_k[torch.arange(n_heads) // (n_heads // n_kv)]  # (H, D)
        null_v = layer.null_v[torch.arange(n_heads) // (n_heads // n_kv)]  # (H, D)
        null_scores = torch.einsum("bhtd,hd->bht", q, null_k) / math.sqrt(dim)  # (B, H, T)
        scores = torch.cat((null_scores[..., None], scores), dim=-1)  # (B, H, T, 1 + T)
        mask = torch.cat((torch.ones(x.shape[1], 1, dtype=torch.bool), mask), dim=1)  # (T, 1 + T)
        v = torch.cat((null_v[None, :, None, :].expand(x.shape[0], -1, -1, -1), v), dim=2)  # (B, H, 1 + T, D)
    y = softmax_attend(scores, mask, v)  # (B, H, T, D)
    return merge(y) @ layer.out.weight.T  # (B, T, d_model)


def reference_decoupled(
    layer: Decoupled, x: torch.Tensor, positions: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """DBA, seed eq. 5-10, two explicit score terms:
    score = 2g q_sem k_sem^T / sqrt(d_sem/H) + 2(1-g) q_geo k_geo^T / sqrt(d_geo/H), g = 0.5 without a gate."""
    cfg = layer.cfg
    n_heads, n_kv = layer.n_heads, layer.n_kv_heads
    sem, geo = cfg.d_sem // n_heads, cfg.d_geo // n_heads  # per-head widths
    weights = layer.proj.weight.split(layer.widths, dim=0)
    if cfg.tie_qk:
        w_q_geo, w_k_sem, w_k_geo, w_v = weights
        w_q_sem = w_k_sem  # seed 3.5: W_Q,sem = W_K,sem
    else:
        w_q_sem, w_q_geo, w_k_sem, w_k_geo, w_v = weights
    q_sem, q_geo = heads(x @ w_q_sem.T, n_heads), heads(x @ w_q_geo.T, n_heads)  # (B, H, T, sem|geo)
    k_sem, k_geo = heads(x @ w_k_sem.T, n_kv), heads(x @ w_k_geo.T, n_kv)  # (B, H_kv, T, sem|geo)
    v = heads(x @ w_v.T, n_kv)  # (B, H_kv, T, d_v/H), eq. 7
    if cfg.rope:  # eq. 6: RoPE on the geometric path only
        q_geo, k_geo = rope(q_geo, positions, interleaved), rope(k_geo, positions, interleaved)
        if cfg.rope_semantic:
            q_sem, k_sem = rope(q_sem, positions, interleaved), rope(k_sem, positions, interleaved)
    k_sem, k_geo, v = (per_query_head(t, n_heads) for t in (k_sem, k_geo, v))  # (B, H, T, .)
    # Eq. 9: the gate rescales the queries, q_sem by 2g and q_geo by 2(1 - g), so it reaches every score.
    g = torch.sigmoid(layer.gate_logit) if cfg.gate else torch.full((n_heads,), 0.5)  # (H,)
    q_sem = q_sem * (2 * g)[None, :, None, None]  # (B, H, T, sem)
    q_geo = q_geo * (2 * (1 - g))[None, :, None, None]  # (B, H, T, geo)
    sem_scores = torch.einsum("bhtd,bhsd->bhts", q_sem, k_sem) / math.sqrt(cfg.d_sem / n_heads)  # (B, H, T, T)
    geo_scores = torch.einsum("bhtd,bhsd->bhts", q_geo, k_geo) / math.sqrt(cfg.d_geo / n_heads)  # (B, H, T, T)
    scores = sem_scores + geo_scores  # eq. 5
    mask = band_mask(x.shape[1])
    if cfg.null_attn:  # eq. 10: the null key has a semantic and a geometric part, no RoPE
        null_k = layer.null_k[torch.arange(n_heads) // (n_heads // n_kv)]  # (H, sem + geo)
        null_v = layer.null_v[torch.arange(n_heads) // (n_heads // n_kv)]  # (H, d_v/H)
        null_sem, null_geo = null_k.split((sem, geo), dim=-1)  # (H, sem), (H, geo)
        null_sem_scores = torch.einsum("bhtd,hd->bht", q_sem, null_sem) / math.sqrt(cfg.d_sem / n_heads)  # (B, H, T)
        null_geo_scores = torch.einsum("bhtd,hd->bht", q_geo, null_geo) / math.sqrt(cfg.d_geo / n_heads)  # (B, H, T)
        null_scores = null_sem_scores + null_geo_scores  # eq. 10
        scores = torch.cat((null_scores[..., None], scores), dim=-1)  # (B, H, T, 1 + T)
        mask = torch.cat((torch.ones(x.shape[1], 1, dtype=torch.bool), mask), dim=1)  # (T, 1 + T)
        v = torch.cat((null_v[None, :, None, :].expand(x.shape[0], -1, -1, -1), v), dim=2)  # (B, H, 1 + T, d_v/H)
    y = softmax_attend(scores, mask, v)  # (B, H, T, d_v/H), eq. 8
    return merge(y) @ layer.out.weight.T


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def reference_mla(
    layer: MLA, x: torch.Tensor, positions: torch.Tensor, interleaved: bool = False, eps: float = 1e-5
) -> torch.Tensor:
    """DeepSeek-V2 MLA (section 2.1), naive form: c = RMSNorm(W_dkv x)[:d_latent], k_rope = RoPE(shared part),
    k_h = [W_uk,h c ; k_rope], v_h = W_uv,h c, q_h = [q_nope,h ; RoPE(q_rope,h)], scale 1/sqrt(head_dim + d_rope)."""
    n_heads, dim, rope_dim, v_dim, latent = layer.n_heads, layer.head_dim, layer.rope_dim, layer.v_dim, layer.d_latent
    q = heads(x @ layer.q_proj.weight.T, n_heads)  # (B, H, T, head_dim + d_rope)
    q_nope, q_rope = q[..., :dim], rope(q[..., dim:], positions, interleaved)
    down = x @ layer.kv_down.weight.T  # (B, T, d_latent + d_rope)
    c = rms_norm(down[..., :latent], layer.kv_norm.weight, eps)  # (B, T, d_latent)
    k_rope = rope(down[..., latent:], positions, interleaved)  # (B, T, d_rope), one key shared by every head
    k_nope = heads(c @ layer.k_up.weight.T, n_heads)  # (B, H, T, head_dim)
    v = heads(c @ layer.v_up.weight.T, n_heads)  # (B, H, T, v_dim)
    assert v.shape[-1] == v_dim
    scores = torch.einsum("bhtd,bhsd->bhts", q_nope, k_nope) + torch.einsum("bhtr,bsr->bhts", q_rope, k_rope)
    y = softmax_attend(scores / math.sqrt(dim + rope_dim), band_mask(x.shape[1]), v)  # (B, H, T, v_dim)
    return merge(y) @ layer.out.weight.T


def reference_diff(
    layer: Differential, x: torch.Tensor, positions: torch.Tensor, layer_index: int, interleaved=False, eps=1e-5
) -> torch.Tensor:
    """Differential Transformer (Ye et al. 2024) eq. 1-3 per DIFF head h of width D, as two explicit attention
    maps: q rows [q1 | q2] and k rows [k1 | k2] (D/2 each, RoPE on each half), v of width D, K/V head
    h // (H / H_kv); (softmax(q1 k1^T / sqrt(D/2)) - lambda softmax(q2 k2^T / sqrt(D/2))) v, lambda =
    exp(lq1.lk1) - exp(lq2.lk2) + lambda_init, lambda_init = 0.8 - 0.6 exp(-0.3 layer_index);
    head = (1 - lambda_init) RMSNorm(head) with one gain shared by the heads."""
    n_heads, n_kv, dim = layer.n_heads, layer.n_kv_heads, layer.head_dim
    half = dim // 2
    w_q, w_k, w_v = layer.qkv.weight.split((n_heads * dim, n_kv * dim, n_kv * dim), dim=0)
    q, k = heads(x @ w_q.T, n_heads), heads(x @ w_k.T, n_kv)  # (B, H, T, D), (B, H_kv, T, D)
    v = per_query_head(heads(x @ w_v.T, n_kv), n_heads)  # (B, H, T, D)
    mask = band_mask(x.shape[1])
    probs = []
    for part in (slice(0, half), slice(half, dim)):  # stream 1, stream 2
        q_s = rope(q[..., part], positions, interleaved)  # (B, H, T, D/2)
        k_s = per_query_head(rope(k[..., part], positions, interleaved), n_heads)  # (B, H, T, D/2)
        scores = torch.einsum("bhtd,bhsd->bhts", q_s, k_s) / math.sqrt(half)
        probs.append(scores.masked_fill(~mask, float("-inf")).softmax(dim=-1))  # (B, H, T, T)
    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_index)
    lam = torch.exp(layer.lambda_q1 @ layer.lambda_k1) - torch.exp(layer.lambda_q2 @ layer.lambda_k2) + lambda_init
    y = torch.einsum("bhts,bhsd->bhtd", probs[0] - lam * probs[1], v)  # eq. 1: (B, H, T, D)
    y = (1 - lambda_init) * rms_norm(y, layer.head_norm.weight, eps)  # eq. 3
    return merge(y) @ layer.out.weight.T


def givens_matrices(theta: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """theta (H, D/2) -> (H, D, D) orthogonal matrices rotating channel pair i by theta[h, i] (eq. 7); the
    pairs are RoPE's planes: (2i, 2i+1) interleaved, (i, i + D/2) half-split."""
    n_heads, n_pairs = theta.shape
    dim = 2 * n_pairs
    rot = torch.zeros(n_heads, dim, dim)
    for i in range(n_pairs):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + n_pairs)
        cos, sin = torch.cos(theta[:, i]), torch.sin(theta[:, i])
        rot[:, a, a], rot[:, a, b], rot[:, b, a], rot[:, b, b] = cos, -sin, sin, cos
    return rot


def reference_coda(
    layer: CoDA, x: torch.Tensor, positions: torch.Tensor, interleaved: bool = False, eps: float = 1e-5
) -> torch.Tensor:
    """CoDA (seed coda-gqa-l.md eq. 3-7): q_sig = RoPE(W_q x); q_noise = R(theta) q_sig with R an explicit
    (D, D) Givens matrix per head; lambda = sigmoid(W_lambda x + b) per token and head; per head
    RMSNorm_h(softmax(q_sig k^T / sqrt(D)) v - lambda softmax(q_noise k^T / sqrt(D)) v), gain (H, D)."""
    n_heads, n_kv, dim = layer.n_heads, layer.n_kv_heads, layer.head_dim
    w_q, w_k, w_v = layer.qkv.weight.split((n_heads * dim, n_kv * dim, n_kv * dim), dim=0)
    q_sig = rope(heads(x @ w_q.T, n_heads), positions, interleaved)  # eq. 3: (B, H, T, D)
    q_noise = torch.einsum("hde,bhte->bhtd", givens_matrices(layer.theta, interleaved), q_sig)  # eq. 4
    k = per_query_head(rope(heads(x @ w_k.T, n_kv), positions, interleaved), n_heads)  # (B, H, T, D)
    v = per_query_head(heads(x @ w_v.T, n_kv), n_heads)
    mask = band_mask(x.shape[1])
    signal = softmax_attend(torch.einsum("bhtd,bhsd->bhts", q_sig, k) / math.sqrt(dim), mask, v)
    noise = softmax_attend(torch.einsum("bhtd,bhsd->bhts", q_noise, k) / math.sqrt(dim), mask, v)
    lam = torch.sigmoid(x @ layer.gate.weight.T + layer.gate.bias).permute(0, 2, 1)[..., None]  # eq. 5: (B, H, T, 1)
    y = signal - lam * noise  # eq. 6
    if layer.head_norm is not None:
        y = rms_norm(y, layer.head_norm.weight[:, None, :], eps)  # (H, 1, D): one gain per head
    return merge(y) @ layer.out.weight.T


def reference_attention(
    layer, x: torch.Tensor, positions: torch.Tensor, cfg: ModelConfig, layer_index: int = 0
) -> torch.Tensor:
    """The reference for whichever variant `layer` is (RoPE convention and eps from the model config)."""
    if isinstance(layer, Differential):
        return reference_diff(layer, x, positions, layer_index, cfg.rope_interleaved, cfg.norm_eps)
    if isinstance(layer, CoDA):
        return reference_coda(layer, x, positions, cfg.rope_interleaved, cfg.norm_eps)
    if isinstance(layer, Decoupled):
        return reference_decoupled(layer, x, positions, cfg.rope_interleaved)
    if isinstance(layer, MLA):
        return reference_mla(layer, x, positions, cfg.rope_interleaved, cfg.norm_eps)
    return reference_head_attention(layer, x, positions, layer.window, cfg.rope_interleaved)


# ----------------------------------------------------------------------------- MHA / GQA / MQA


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize(
    "start, interleaved", [(0, False), (5, False), (5, True)], ids=["pos0", "pos5", "pos5_interleaved"]
)
def test_mha_matches_reference(n_kv_heads, start, interleaved):
    """Eq. 1-2 with RoPE: per head softmax(RoPE(q) RoPE(k)^T / sqrt(head_dim) + causal) v, GQA/MQA sharing K/V;
    positions may start anywhere (RoPE reads them, the causal mask is by index), either RoPE convention."""
    layer = randomize_(MHA(model_config(MHAConfig(n_kv_heads=n_kv_heads), rope_interleaved=interleaved)))
    n_kv, head_dim = n_kv_heads or N_HEADS, D_MODEL // N_HEADS
    assert layer.qkv.weight.shape == ((N_HEADS + 2 * n_kv) * head_dim, D_MODEL)  # [q | k | v] rows
    x, positions = inputs(), torch.arange(start, start + SEQ)
    y, cache = layer(x, positions)
    assert cache is None
    expected = reference_head_attention(layer, x, positions, interleaved=interleaved)
    torch.testing.assert_close(y, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_kv_heads", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("window", [None, 3], ids=["causal", "window3"])
def test_gqa_equals_mha_with_repeated_kv_weights(n_kv_heads, window):
    """GQA identity: repeating each K/V head's weights for its group of query heads gives an MHA layer with
    the same output (query head h reads K/V head h // (H / H_kv)); with a window the masked path is used."""

    def build(n_kv):
        if window is None:
            return MHA(model_config(MHAConfig(n_kv_heads=n_kv)))
        return Sliding(model_config(SlidingConfig(n_kv_heads=n_kv, window=window)))

    gqa, mha = randomize_(build(n_kv_heads)), build(None)
    dim, group = gqa.head_dim, N_HEADS // n_kv_heads
    w_q, w_k, w_v = gqa.qkv.weight.split((N_HEADS * dim, n_kv_heads * dim, n_kv_heads * dim), dim=0)

    def repeat(w):  # (H_kv * D, d_model) -> (H * D, d_model), each K/V head's rows once per query head
        return w.reshape(n_kv_heads, dim, D_MODEL).repeat_interleave(group, dim=0).reshape(-1, D_MODEL)

    with torch.no_grad():
        mha.qkv.weight.copy_(torch.cat((w_q, repeat(w_k), repeat(w_v)), dim=0))  # (3 * H * D, d_model)
        mha.out.weight.copy_(gqa.out.weight)
    x, positions = inputs(), torch.arange(SEQ)
    torch.testing.assert_close(mha(x, positions)[0], gqa(x, positions)[0], atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- bottleneck


@pytest.mark.parametrize("n_kv_heads", [None, 2])
@pytest.mark.parametrize("null_attn", [False, True], ids=["no_null", "null"])
def test_bottleneck_matches_reference(null_attn, n_kv_heads):
    """Eq. 3-4: Q, K, V projected to d_attn < d_model, head_dim = d_attn/H, scale 1/sqrt(d_attn/H); the null
    token is an explicit extra column: scores against [null_k ; K] (null always visible), values [null_v ; V]."""
    d_attn = 16
    layer = randomize_(
        Bottleneck(model_config(BottleneckConfig(d_attn=d_attn, null_attn=null_attn, n_kv_heads=n_kv_heads)))
    )
    n_kv = n_kv_heads or N_HEADS
    assert layer.head_dim == d_attn // N_HEADS
    assert layer.qkv.weight.shape == ((N_HEADS + 2 * n_kv) * d_attn // N_HEADS, D_MODEL)
    assert layer.out.weight.shape == (D_MODEL, d_attn)
    x, positions = inputs(), torch.arange(SEQ)
    y, _ = layer(x, positions)
    torch.testing.assert_close(y, reference_head_attention(layer, x, positions), atol=ATOL, rtol=0)


def test_bottleneck_null_token_changes_the_output():
    """Control for the null column: the same weights without the null token give a different output."""
    config = model_config(BottleneckConfig(d_attn=16, null_attn=True))
    with_null = randomize_(Bottleneck(config))
    without = Bottleneck(model_config(BottleneckConfig(d_attn=16)))
    without.load_state_dict({k: v for k, v in with_null.state_dict().items() if not k.startswith("null_")})
    x, positions = inputs(), torch.arange(SEQ)
    assert (with_null(x, positions)[0] - without(x, positions)[0]).abs().max() > 1e-2


# ----------------------------------------------------------------------------- decoupled (DBA)

DBA_CASES = {
    "plain": dict(),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "d_v": dict(d_v=16),
    "gate": dict(gate=True),
    "tie_qk": dict(tie_qk=True),
    "null": dict(null_attn=True),
    "null_gqa": dict(null_attn=True, n_kv_heads=2),
    "no_rope": dict(rope=False),
    "rope_semantic": dict(rope_semantic=True),
    "all": dict(gate=True, null_attn=True, n_kv_heads=2, d_v=48),
    "tied_gated_null": dict(gate=True, tie_qk=True, null_attn=True, rope_semantic=True),
}


@pytest.mark.parametrize("options", DBA_CASES.values(), ids=DBA_CASES.keys())
def test_decoupled_matches_reference(options):
    """Seed eq. 5-10: two explicit score terms with their own scales (d_sem/H = 2, d_geo/H = 6), RoPE only on
    the geometric path (eq. 6), V of width d_v (eq. 7), gate 2g / 2(1-g) (eq. 9), null key [sem | geo] (eq. 10)."""
    layer = randomize_(Decoupled(model_config(DecoupledConfig(d_sem=8, d_geo=24, **options))))
    n_kv, d_v = options.get("n_kv_heads", N_HEADS), options.get("d_v", 8 + 24)  # eq. 7: d_v = d_sem + d_geo
    q_sem_rows = [] if options.get("tie_qk") else [8]
    assert layer.widths == q_sem_rows + [24, n_kv * 2, n_kv * 6, n_kv * d_v // N_HEADS]  # [q_sem|q_geo|k_sem|k_geo|v]
    assert layer.out.weight.shape == (D_MODEL, d_v)
    if layer.gate_logit is not None:
        with torch.no_grad():  # g = sigmoid(gamma) well away from 0.5, so 2g and 2(1 - g) are not both 1
            layer.gate_logit.copy_(torch.tensor([1.5, -0.8, 2.5, -2.0]))
    x, positions = inputs(), torch.arange(SEQ)
    y, _ = layer(x, positions)
    torch.testing.assert_close(y, reference_decoupled(layer, x, positions), atol=ATOL, rtol=0)


def test_decoupled_tie_qk_equals_untied_with_copied_key_weights():
    """Seed 3.5 identity: a tied layer (no q_sem rows in the fused projection) equals an untied layer whose
    q_sem rows are a copy of its k_sem rows."""
    tied = randomize_(Decoupled(model_config(DecoupledConfig(d_sem=8, d_geo=24, tie_qk=True))))
    untied = Decoupled(model_config(DecoupledConfig(d_sem=8, d_geo=24)))
    assert untied.widths[1:] == tied.widths  # untied: [q_sem | q_geo | k_sem | k_geo | v]
    w_q_geo, w_k_sem, w_k_geo, w_v = tied.proj.weight.split(tied.widths, dim=0)
    with torch.no_grad():
        untied.proj.weight.copy_(torch.cat((w_k_sem, w_q_geo, w_k_sem, w_k_geo, w_v), dim=0))
        untied.out.weight.copy_(tied.out.weight)
    x, positions = inputs(), torch.arange(SEQ)
    torch.testing.assert_close(tied(x, positions)[0], untied(x, positions)[0], atol=ATOL, rtol=0)


def test_decoupled_gate_and_rope_placement_matter():
    """Controls for eq. 6 and eq. 9: the same weights without the gate, or the reference with RoPE on both
    paths, are far from the layer, so the matching test above cannot pass by accident."""
    layer = randomize_(Decoupled(model_config(DecoupledConfig(d_sem=8, d_geo=24, gate=True))))
    with torch.no_grad():
        layer.gate_logit.copy_(torch.tensor([1.5, -0.8, 2.5, -2.0]))
    x, positions = inputs(), torch.arange(SEQ)
    y, _ = layer(x, positions)
    ungated = Decoupled(model_config(DecoupledConfig(d_sem=8, d_geo=24)))
    ungated.load_state_dict({k: v for k, v in layer.state_dict().items() if k != "gate_logit"})
    assert (y - ungated(x, positions)[0]).abs().max() > 1e-2
    rope_both = Decoupled(model_config(DecoupledConfig(d_sem=8, d_geo=24, gate=True, rope_semantic=True)))
    rope_both.load_state_dict(layer.state_dict())
    assert (y - reference_decoupled(rope_both, x, positions)).abs().max() > 1e-2


# ----------------------------------------------------------------------------- sliding window


@pytest.mark.parametrize("window", [SEQ, SEQ + 5])
def test_sliding_window_covering_the_sequence_equals_full_causal(window):
    """A window >= T hides nothing: the same weights in an MHA layer give the same output."""
    sliding = randomize_(Sliding(model_config(SlidingConfig(n_kv_heads=2, window=window))))
    mha = MHA(model_config(MHAConfig(n_kv_heads=2)))
    mha.load_state_dict(sliding.state_dict())
    x, positions = inputs(), torch.arange(SEQ)
    torch.testing.assert_close(sliding(x, positions)[0], mha(x, positions)[0], atol=ATOL, rtol=0)


def test_sliding_model_with_long_window_equals_mha_model():
    """Whole model: a sliding model whose window covers the sequence has the logits of the MHA model."""
    sliding = randomize_(build_model(model_config(SlidingConfig(window=SEQ), n_layers=2)))
    mha = build_model(model_config(MHAConfig(), n_layers=2))
    mha.load_state_dict(sliding.state_dict())
    tokens = torch.randint(0, 50, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(sliding(tokens, use_cache=False)[0], mha(tokens, use_cache=False)[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_kv_heads", [None, 2])
@pytest.mark.parametrize("window", [1, 3, SEQ - 1])
def test_sliding_window_matches_band_reference(window, n_kv_heads):
    """A window < T is the band mask 0 <= q - k < window (own position included); window 1 sees only itself."""
    layer = randomize_(Sliding(model_config(SlidingConfig(n_kv_heads=n_kv_heads, window=window))))
    x, positions = inputs(), torch.arange(SEQ)
    y, _ = layer(x, positions)
    torch.testing.assert_close(y, reference_head_attention(layer, x, positions, window=window), atol=ATOL, rtol=0)
    full = reference_head_attention(layer, x, positions, window=None)
    assert (y[:, window:] - full[:, window:]).abs().max() > 1e-2  # the band really hides something


# ----------------------------------------------------------------------------- MLA

MLA_CASES = {  # options, expected (head_dim, d_rope, v_head_dim)
    "default": (dict(d_latent=12), (8, 4, 8)),  # head_dim = d_model/H, d_rope = head_dim/2, v_head_dim = head_dim
    "custom": (dict(d_latent=10, head_dim=6, d_rope=2, v_head_dim=4), (6, 2, 4)),
}


@pytest.mark.parametrize("options, dims", MLA_CASES.values(), ids=MLA_CASES.keys())
@pytest.mark.parametrize("absorb", [False, True], ids=["naive", "absorbed"])
def test_mla_matches_deepseek_v2_reference(options, dims, absorb):
    """DeepSeek-V2 section 2.1 (naive form): latent = RMSNorm(W_dkv x)[:d_latent], shared k_rope = RoPE(W_kr x),
    k_h = [W_uk,h c ; k_rope], v_h = W_uv,h c, scale 1/sqrt(head_dim + d_rope); both paths, no cache."""
    layer = randomize_(MLA(model_config(MLAConfig(**options))))
    (head_dim, d_rope, v_dim), d_latent = dims, options["d_latent"]
    assert layer.q_proj.weight.shape == (N_HEADS * (head_dim + d_rope), D_MODEL)  # per head [q_nope | q_rope]
    assert layer.kv_down.weight.shape == (d_latent + d_rope, D_MODEL)  # [latent | k_rope]
    assert layer.k_up.weight.shape == (N_HEADS * head_dim, d_latent)
    assert layer.v_up.weight.shape == (N_HEADS * v_dim, d_latent)
    x, positions = inputs(), torch.arange(SEQ)
    y, _ = layer(x, positions, None, absorb=absorb)
    torch.testing.assert_close(y, reference_mla(layer, x, positions), atol=ATOL, rtol=0)


@pytest.mark.parametrize("options, dims", MLA_CASES.values(), ids=MLA_CASES.keys())
def test_mla_absorbed_equals_naive_with_cache(options, dims):
    """Absorbing W_uk into the query and W_uv after attention over the cached latent gives the naive output,
    chunk by chunk through a cache (3 tokens, then 1, then 3), and both equal the full forward."""
    layer = randomize_(MLA(model_config(MLAConfig(**options))))
    x = inputs()
    full, _ = layer(x, torch.arange(SEQ), None, absorb=False)
    caches = {absorb: layer.new_cache(BATCH, 16, torch.float32) for absorb in (False, True)}
    start = 0
    for size in (3, 1, 3):
        positions = torch.arange(start, start + size)
        chunk = x[:, start : start + size]
        naive, _ = layer(chunk, positions, caches[False], absorb=False)
        absorbed, _ = layer(chunk, positions, caches[True], absorb=True)
        torch.testing.assert_close(absorbed, naive, atol=ATOL, rtol=0)
        torch.testing.assert_close(naive, full[:, start : start + size], atol=ATOL, rtol=0)
        start += size


# ----------------------------------------------------------------------------- differential (DIFF V1)


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("layer_index", [0, 5])
@pytest.mark.parametrize(
    "start, interleaved", [(0, False), (5, False), (5, True)], ids=["pos0", "pos5", "pos5_interleaved"]
)
def test_diff_matches_reference(n_kv_heads, layer_index, start, interleaved):
    """Ye et al. eq. 1-3: the difference of two explicit softmax maps over a shared v, lambda from its
    re-parameterisation and the layer's depth, head RMSNorm times (1 - lambda_init)."""
    config = model_config(DiffConfig(n_kv_heads=n_kv_heads), rope_interleaved=interleaved)
    layer = randomize_(Differential(config, layer_index=layer_index))
    n_kv, head_dim = n_kv_heads or N_HEADS, D_MODEL // N_HEADS
    assert layer.qkv.weight.shape == ((N_HEADS + 2 * n_kv) * head_dim, D_MODEL)  # q, k, v all of width D per head
    assert layer.lambda_q1.shape == (head_dim // 2,)
    x, positions = inputs(), torch.arange(start, start + SEQ)
    y, _ = layer(x, positions)
    expected = reference_diff(layer, x, positions, layer_index, interleaved)
    torch.testing.assert_close(y, expected, atol=ATOL, rtol=0)
    wrong_depth = reference_diff(layer, x, positions, layer_index + 1, interleaved)  # control: depth matters
    assert (y - wrong_depth).abs().max() > 1e-3


# ----------------------------------------------------------------------------- CoDA


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("head_norm", [True, False], ids=["head_norm", "identity"])
@pytest.mark.parametrize(
    "start, interleaved", [(0, False), (5, False), (5, True)], ids=["pos0", "pos5", "pos5_interleaved"]
)
def test_coda_matches_reference(n_kv_heads, head_norm, start, interleaved):
    """Seed eq. 3-7 with explicit Givens matrices, any angles (not just the pi/2 init), per-token gates
    between 0.1 and 0.7 (not near 1, where signal - lambda noise can nearly cancel and the head norm would
    magnify fp32 rounding past the tolerance)."""
    config = model_config(CoDAConfig(n_kv_heads=n_kv_heads, head_norm=head_norm), rope_interleaved=interleaved)
    layer = randomize_(CoDA(config))
    with torch.no_grad():
        layer.theta.uniform_(-math.pi, math.pi, generator=torch.Generator().manual_seed(7))
        layer.gate.weight.mul_(0.3)
        layer.gate.bias.fill_(-1.0)
    assert layer.theta.shape == (N_HEADS, D_MODEL // N_HEADS // 2)
    assert layer.gate.weight.shape == (N_HEADS, D_MODEL)  # D -> H cancellation gate (sec. 3.1)
    x, positions = inputs(), torch.arange(start, start + SEQ)
    y, _ = layer(x, positions)
    torch.testing.assert_close(y, reference_coda(layer, x, positions, interleaved), atol=ATOL, rtol=0)
    other_pairs = reference_coda(layer, x, positions, not interleaved)  # control: the pairing is seen
    assert (y - other_pairs).abs().max() > 1e-3


# ----------------------------------------------------------------------------- RoPE


def rope_input(dim: int = 8, seq: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(BATCH, 3, seq, dim, generator=torch.Generator().manual_seed(4))  # (B, H, T, dim)
    return x, torch.tensor([0, 3, 1, 17, 30, 9])[:seq]  # positions in any order, not just 0..T-1


def test_rope_half_split_equals_hf_rotate_half():
    """Half-split RoPE (HF Llama): x * cos + rotate_half(x) * sin, angles pos * base^(-2i/d)."""
    x, positions = rope_input()
    rotary = Rotary(8, ROPE_BASE, max_seq_len=32)
    torch.testing.assert_close(rotary(x, positions), rope_half(x, positions), atol=1e-5, rtol=0)


def test_rope_interleaved_equals_complex_multiplication():
    """Interleaved RoPE (Meta's Llama, llama2.c): (x[2i] + i x[2i+1]) * exp(i pos theta_i)."""
    x, positions = rope_input()
    rotary = Rotary(8, ROPE_BASE, max_seq_len=32, interleaved=True)
    torch.testing.assert_close(rotary(x, positions), rope_complex(x, positions), atol=1e-5, rtol=0)
    assert not torch.allclose(rotary(x, positions), rope_half(x, positions), atol=1e-3)  # the conventions differ


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope_preserves_norms(interleaved):
    """RoPE is a rotation: every vector keeps its length, and position 0 is the identity."""
    x, positions = rope_input()
    rotary = Rotary(8, ROPE_BASE, max_seq_len=32, interleaved=interleaved)
    rotated = rotary(x, positions)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(rotary(x, torch.zeros(6, dtype=torch.long)), x, atol=0, rtol=0)
    assert not torch.allclose(rotated, x, atol=1e-3)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope_scores_depend_only_on_position_difference(interleaved):
    """<RoPE(q, m), RoPE(k, n)> is a function of m - n: shifting both positions leaves the score unchanged,
    while changing the difference changes it."""
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 8, generator=gen), torch.randn(1, 8, generator=gen)  # (T=1, dim)
    rotary = Rotary(8, ROPE_BASE, max_seq_len=64, interleaved=interleaved)

    def score(m: int, n: int) -> torch.Tensor:
        return (rotary(q, torch.tensor([m])) * rotary(k, torch.tensor([n]))).sum()

    for m, n in [(5, 2), (9, 9), (1, 7)]:
        for shift in (1, 13, 40):
            torch.testing.assert_close(score(m + shift, n + shift), score(m, n), atol=1e-5, rtol=0)
    assert (score(5, 2) - score(6, 2)).abs() > 1e-2


# ----------------------------------------------------------------------------- whole model

MODEL_CASES = {  # attention config, rope_interleaved
    "gqa": (MHAConfig(n_kv_heads=2), False),
    "bottleneck_null": (BottleneckConfig(d_attn=16, null_attn=True), False),
    "decoupled": (DecoupledConfig(d_sem=8, d_geo=24, gate=True, null_attn=True, n_kv_heads=2), False),
    "decoupled_interleaved": (DecoupledConfig(d_sem=8, d_geo=24, rope_semantic=True), True),
    "sliding": (SlidingConfig(window=3), False),
    "mla": (MLAConfig(d_latent=12), False),
    "mla_interleaved": (MLAConfig(d_latent=12), True),
    "diff_gqa": (DiffConfig(n_kv_heads=2), False),  # two layers: lambda_init 0.2, then 0.356
    "coda_gqa": (CoDAConfig(n_kv_heads=2), False),
    "coda_interleaved": (CoDAConfig(), True),
}


@pytest.mark.parametrize("tie_embeddings", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("attention, interleaved", MODEL_CASES.values(), ids=MODEL_CASES.keys())
def test_model_logits_match_plain_loop(attention, interleaved, tie_embeddings):
    """Pre-norm decoder: x = embed(tokens); per layer x += attn(RMSNorm(x)); x += down(silu(gate) * up)(RMSNorm(x));
    logits = lm_head(RMSNorm(x)) cut from padded_vocab_size (64) to vocab_size (50)."""
    cfg = model_config(attention, n_layers=2, d_ff=48, tie_embeddings=tie_embeddings, rope_interleaved=interleaved)
    model = randomize_(build_model(cfg)).eval()
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(6))
    logits, _ = model(tokens, use_cache=False)

    positions = torch.arange(SEQ)
    x = model.embed.weight[tokens]  # (B, T, d_model)
    for i, block in enumerate(model.blocks):
        x = x + reference_attention(block.attn, rms_norm(x, block.attn_norm.weight, cfg.norm_eps), positions, cfg, i)
        h = rms_norm(x, block.mlp_norm.weight, cfg.norm_eps)
        w_gate, w_up = block.mlp.gate_up.weight.split(cfg.hidden_dim, dim=0)  # (d_ff, d_model) each
        x = x + (torch.nn.functional.silu(h @ w_gate.T) * (h @ w_up.T)) @ block.mlp.down.weight.T
    lm_head = model.embed.weight if tie_embeddings else model.lm_head.weight  # (padded_vocab_size, d_model)
    assert lm_head.shape[0] == 64
    expected = (rms_norm(x, model.norm.weight, cfg.norm_eps) @ lm_head.T)[..., : cfg.vocab_size]  # (B, T, vocab)
    assert logits.shape == (BATCH, SEQ, cfg.vocab_size)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
