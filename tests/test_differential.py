"""Exact identities of the two differential variants, `diff` (Ye et al. 2024) and `coda` (seed coda-gqa-l.md).

Their maths against plain einsum references is in test_attention_reference.py and their cache/causality/
gradient contract in test_attention_contract.py; here: each layer equals a composition of plain SDPA calls
(for CoDA, its one stacked call equals two separate calls), without and with a cache; GQA equals MHA with
repeated K/V weights; a closed CoDA gate gives standard attention followed by the head norm; the rotation
commutes with RoPE; the inits survive the model's generic init; each layer gets its own depth; and
configuration errors name the key.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.attention.coda import CoDA, CoDAConfig, rotate_planes
from attnlab.attention.differential import DiffConfig, Differential
from attnlab.attention.mha import MHA, MHAConfig
from attnlab.config import ModelConfig
from attnlab.errors import ConfigError
from attnlab.model.transformer import build_model
from attnlab.ops.heads import merge_heads, split_heads
from attnlab.ops.rope import Rotary

D_MODEL, N_HEADS, BATCH, SEQ = 32, 4, 2, 9
HEAD_DIM = D_MODEL // N_HEADS
ATOL = 1e-5
CHUNKS = (4, 1, 3, 1)  # a prefill, single-token steps and a chunk, through a cache


def model_config(attention, **overrides) -> ModelConfig:
    base = dict(vocab_size=50, d_model=D_MODEL, n_layers=1, n_heads=N_HEADS, max_seq_len=32, rope_base=100.0)
    return ModelConfig(attention=attention, **{**base, **overrides})


def randomize_(module: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    """Every parameter from N(0, std^2), norm gains from N(1, std^2); CoDA's gates then sit between ~0.1 and
    ~0.7 and its angles anywhere, so both streams carry weight."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + torch.randn(p.shape, generator=gen) * std)
        if isinstance(module, CoDA):
            module.theta.uniform_(-math.pi, math.pi, generator=gen)
            module.gate.weight.mul_(0.3)
            module.gate.bias.fill_(-1.0)
    return module


def inputs(seed: int = 1) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(seed))  # (B, T, d_model)


def run(layer, x: torch.Tensor, chunks=None) -> torch.Tensor:
    """The layer's output over x (B, T, d_model): one forward without a cache, or chunk by chunk through one."""
    if chunks is None:
        return layer(x, torch.arange(x.shape[1]))[0]
    cache, out, start = layer.new_cache(x.shape[0], 32, x.dtype), [], 0
    for size in chunks:
        y, cache = layer(x[:, start : start + size], torch.arange(start, start + size), cache)
        out.append(y)
        start += size
    return torch.cat(out, dim=1)


def sdpa(q, k, v, q_start: int, scale: float) -> torch.Tensor:
    """One plain SDPA call with GQA broadcast; queries at positions q_start.., keys at 0..S-1."""
    mask = torch.arange(k.shape[2])[None, :] <= torch.arange(q_start, q_start + q.shape[2])[:, None]  # (T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def repeat_kv_rows(weight: torch.Tensor, n_kv: int, dim: int, group: int) -> torch.Tensor:
    """(H_kv * dim, d_model) -> (H * dim, d_model): each K/V head's rows once per query head of its group."""
    return weight.reshape(n_kv, dim, -1).repeat_interleave(group, dim=0).reshape(-1, weight.shape[-1])


# ----------------------------------------------------------------------------- layer depth


def test_each_layer_gets_its_index_and_lambda_init():
    """The model hands Block i index i; diff's lambda_init = 0.8 - 0.6 exp(-0.3 i) (Ye et al. eq. 2, l = i + 1)."""
    model = build_model(model_config(DiffConfig(), n_layers=4))
    assert [block.attn.layer_index for block in model.blocks] == [0, 1, 2, 3]
    expected = [0.2, 0.8 - 0.6 * math.exp(-0.3), 0.8 - 0.6 * math.exp(-0.6), 0.8 - 0.6 * math.exp(-0.9)]
    assert [block.attn.lambda_init for block in model.blocks] == pytest.approx(expected, abs=1e-12)
    lam = model.blocks[2].attn.lambda_full()
    with torch.no_grad():
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            getattr(model.blocks[2].attn, name).zero_()
    assert model.blocks[2].attn.lambda_full().item() == pytest.approx(expected[2], abs=1e-6)  # exp(0) - exp(0) + init
    assert lam.item() != pytest.approx(expected[2], abs=1e-6)  # the N(0, 0.1^2) vectors move it off lambda_init


# ----------------------------------------------------------------------------- diff


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("chunks", [None, CHUNKS], ids=["full", "cached"])
def test_diff_equals_two_plain_sdpa_calls(n_kv_heads, chunks):
    """Without and with a cache, the layer is SDPA(q1, k1, v) - lambda SDPA(q2, k2, v) over its own projections,
    then (1 - lambda_init) RMSNorm and W_o."""
    layer = randomize_(Differential(model_config(DiffConfig(n_kv_heads=n_kv_heads)), layer_index=2))
    x = inputs()
    t = layer.project(x, torch.arange(SEQ))  # q1, q2 (B, H, T, D/2); k1, k2 (B, H_kv, T, D/2); v (B, H_kv, T, D)
    assert t["q1"].shape == (BATCH, N_HEADS, SEQ, HEAD_DIM // 2) and t["v"].shape[-1] == HEAD_DIM
    scale = 1 / math.sqrt(HEAD_DIM // 2)
    y = sdpa(t["q1"], t["k1"], t["v"], 0, scale) - layer.lambda_full() * sdpa(t["q2"], t["k2"], t["v"], 0, scale)
    y = (1 - layer.lambda_init) * layer.head_norm(y)  # (B, H, T, D)
    expected = merge_heads(y) @ layer.out.weight.T
    torch.testing.assert_close(run(layer, x, chunks), expected, atol=ATOL, rtol=0)


LAYERS = {  # kind -> a layer of that kind with n_kv_heads (None = one per query head)
    "diff": lambda n_kv_heads=None: Differential(model_config(DiffConfig(n_kv_heads=n_kv_heads)), layer_index=1),
    "coda": lambda n_kv_heads=None: CoDA(model_config(CoDAConfig(n_kv_heads=n_kv_heads))),
}


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("n_kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_gqa_equals_mha_with_repeated_kv_weights(kind, n_kv_heads):
    """DIFF head h reads k1, k2 and v of K/V head h // (H / H_kv); CoDA's query heads 2h (signal) and 2h + 1
    (noise) both read K/V head h // (H / H_kv): repeating those rows gives the MHA layer."""
    gqa = randomize_(LAYERS[kind](n_kv_heads))
    mha = LAYERS[kind]()
    width, group = n_kv_heads * HEAD_DIM, N_HEADS // n_kv_heads
    w_q, w_k, w_v = gqa.qkv.weight.split((N_HEADS * HEAD_DIM, width, width), dim=0)
    state = dict(gqa.state_dict())
    state["qkv.weight"] = torch.cat(
        (w_q, repeat_kv_rows(w_k, n_kv_heads, HEAD_DIM, group), repeat_kv_rows(w_v, n_kv_heads, HEAD_DIM, group))
    )
    mha.load_state_dict(state)
    x = inputs()
    torch.testing.assert_close(run(mha, x), run(gqa, x), atol=ATOL, rtol=0)
    torch.testing.assert_close(run(mha, x, CHUNKS), run(gqa, x, CHUNKS), atol=ATOL, rtol=0)


def test_diff_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="head_dim=6 must be a multiple of 4"):
        model_config(DiffConfig(head_dim=6))
    with pytest.raises(ConfigError, match="n_kv_heads=3 must divide n_heads=4"):
        model_config(DiffConfig(n_kv_heads=3))
    with pytest.raises(ConfigError, match="d_model=30 must be divisible by n_heads=4"):
        model_config(DiffConfig(), d_model=30)


# ----------------------------------------------------------------------------- coda


def coda_queries(layer: CoDA, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q_sig = RoPE(W_q x) and q_noise = R(theta) q_sig, each (B, H, T, D), computed apart (eq. 3-4)."""
    q = split_heads(x @ layer.qkv.weight[: N_HEADS * HEAD_DIM].T, N_HEADS)
    q_sig = layer.rotary(q, torch.arange(x.shape[1]))
    q_noise = rotate_planes(q_sig, torch.cos(layer.theta)[:, None], torch.sin(layer.theta)[:, None], layer.interleaved)
    return q_sig, q_noise


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("chunks", [None, CHUNKS], ids=["full", "cached"])
def test_coda_stacked_call_equals_two_separate_calls(n_kv_heads, chunks):
    """Seed sec. 3.1 head-stacked SDPA: one call over [sig_0, noise_0, sig_1, ...] equals two SDPA calls."""
    layer = randomize_(CoDA(model_config(CoDAConfig(n_kv_heads=n_kv_heads))))
    x = inputs()
    n_kv = n_kv_heads or N_HEADS
    q_sig, q_noise = coda_queries(layer, x)
    _, w_k, w_v = layer.qkv.weight.split((N_HEADS * HEAD_DIM, n_kv * HEAD_DIM, n_kv * HEAD_DIM), dim=0)
    k = layer.rotary(split_heads(x @ w_k.T, n_kv), torch.arange(SEQ))  # (B, H_kv, T, D)
    v = split_heads(x @ w_v.T, n_kv)
    lam = torch.sigmoid(layer.gate(x)).transpose(1, 2)[..., None]  # (B, H, T, 1)
    scale = 1 / math.sqrt(HEAD_DIM)
    y = layer.head_norm(sdpa(q_sig, k, v, 0, scale) - lam * sdpa(q_noise, k, v, 0, scale))
    expected = merge_heads(y) @ layer.out.weight.T
    torch.testing.assert_close(run(layer, x, chunks), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_kv_heads", [None, 2])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_coda_closed_gate_is_standard_attention_then_head_norm(n_kv_heads, interleaved):
    """lambda = sigmoid(-30) ~ 1e-13: the layer is an MHA/GQA layer with the same q/k/v weights whose per-head
    output goes through the head RMSNorm before W_o; with `head_norm: false` it is that MHA layer exactly."""
    cfg = dict(n_kv_heads=n_kv_heads, gate_bias=-30.0)
    coda = randomize_(CoDA(model_config(CoDAConfig(**cfg), rope_interleaved=interleaved)))
    with torch.no_grad():
        coda.gate.weight.zero_()
        coda.gate.bias.fill_(-30.0)
    mha = MHA(model_config(MHAConfig(n_kv_heads=n_kv_heads), rope_interleaved=interleaved))
    with torch.no_grad():
        mha.qkv.weight.copy_(coda.qkv.weight)
        mha.out.weight.copy_(torch.eye(D_MODEL))  # W_o = I: the MHA layer returns its merged heads
    x = inputs()
    heads = split_heads(run(mha, x), N_HEADS)  # (B, H, T, D), standard attention
    normed = heads / heads.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * coda.head_norm.weight[:, None, :]
    torch.testing.assert_close(run(coda, x), merge_heads(normed) @ coda.out.weight.T, atol=ATOL, rtol=0)

    identity = CoDA(model_config(CoDAConfig(**cfg, head_norm=False), rope_interleaved=interleaved))
    identity.load_state_dict({k: v for k, v in coda.state_dict().items() if not k.startswith("head_norm")})
    with torch.no_grad():
        mha.out.weight.copy_(coda.out.weight)
    torch.testing.assert_close(run(identity, x), run(mha, x), atol=ATOL, rtol=0)
    torch.testing.assert_close(run(identity, x, CHUNKS), run(mha, x, CHUNKS), atol=ATOL, rtol=0)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_coda_rotation_commutes_with_rope_and_keeps_scores_relative(interleaved):
    """R(theta) rotates within RoPE's planes, so R RoPE(q) = RoPE(R q) (before or after RoPE is the same) and
    the inhibitory score <R RoPE(q, m), RoPE(k, n)> depends on m - n only. Control: the other pairing (eq. 7's
    (2i, 2i+1) under half-split RoPE, or the reverse) breaks both."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(N_HEADS, 1, HEAD_DIM, generator=gen), torch.randn(N_HEADS, 1, HEAD_DIM, generator=gen)
    theta = torch.rand(N_HEADS, HEAD_DIM // 2, generator=gen) * 2 * math.pi  # (H, D/2)
    cos, sin = torch.cos(theta)[:, None], torch.sin(theta)[:, None]  # (H, 1, D/2)
    rotary = Rotary(HEAD_DIM, 100.0, 64, interleaved)

    def rope(x, pos):
        return rotary(x, torch.tensor([pos]))

    for pairing, holds in ((interleaved, True), (not interleaved, False)):

        def score(m: int, n: int, pairing: bool = pairing) -> torch.Tensor:
            return (rotate_planes(rope(q, m), cos, sin, pairing) * rope(k, n)).sum(-1)  # (H, 1)

        before = rotate_planes(rope(q, 5), cos, sin, pairing)
        after = rope(rotate_planes(q, cos, sin, pairing), 5)
        shifted = [(score(m + s, n + s) - score(m, n)).abs().max().item() for m, n in [(5, 2), (7, 7)] for s in (3, 20)]
        if holds:
            torch.testing.assert_close(before, after, atol=1e-5, rtol=0)
            assert max(shifted) < 1e-5
        else:
            assert (before - after).abs().max() > 1e-2
            assert max(shifted) > 1e-2


def test_coda_init_survives_the_model_init():
    """theta = pi/2 and b_lambda = -6 after the model's generic init (which redraws every 2-D parameter);
    at theta = pi/2 each head's noise query is orthogonal to its signal query, with the same norm."""
    model = build_model(model_config(CoDAConfig(n_kv_heads=2), n_layers=2))
    for block in model.blocks:
        layer = block.attn
        assert torch.equal(layer.theta, torch.full((N_HEADS, HEAD_DIM // 2), math.pi / 2))
        assert torch.equal(layer.gate.bias, torch.full((N_HEADS,), -6.0))
        assert torch.equal(layer.head_norm.weight, torch.ones(N_HEADS, HEAD_DIM))
        assert 0 < layer.gate.weight.abs().max() < 0.2  # the generic N(0, 0.02^2) init
    q_sig, q_noise = coda_queries(model.blocks[0].attn, inputs())
    torch.testing.assert_close((q_sig * q_noise).sum(-1), torch.zeros(BATCH, N_HEADS, SEQ), atol=1e-6, rtol=0)
    torch.testing.assert_close(q_noise.norm(dim=-1), q_sig.norm(dim=-1), atol=1e-6, rtol=0)
    lam = torch.sigmoid(model.blocks[0].attn.gate(inputs()))
    assert 0.001 < lam.min() and lam.max() < 0.01  # near-transparent start, sigmoid(-6) ~ 0.0025


def test_coda_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="head_dim=9 must be even"):
        model_config(CoDAConfig(head_dim=9))
    with pytest.raises(ConfigError, match="n_kv_heads=3 must divide n_heads=4"):
        model_config(CoDAConfig(n_kv_heads=3))
