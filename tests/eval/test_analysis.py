"""Effective rank against known spectra, captures against hand-computed projections, and attention maps from
every variant's own scores() that must reproduce each layer's output (so the maps are the ones the model used),
checked against plain einsum references written here."""

from __future__ import annotations

import math
import os
from pathlib import Path

import helpers
import numpy as np
import pytest
import torch

from attnlab.attention.bottleneck import BottleneckConfig
from attnlab.attention.coda import CoDAConfig
from attnlab.attention.decoupled import DecoupledConfig
from attnlab.attention.differential import DiffConfig
from attnlab.attention.mha import MHA, MHAConfig
from attnlab.attention.mla import MLAConfig
from attnlab.attention.registry import REGISTRY
from attnlab.attention.sliding import SlidingConfig
from attnlab.data.tokenizers import ByteTokenizer
from attnlab.errors import DataError, InputError
from attnlab.eval import analysis, plots
from attnlab.eval.loading import EvalModel
from attnlab.eval.records import make_record

BATCH, SEQ, WINDOW = 2, 9, 3


pytestmark = pytest.mark.usefixtures("one_thread")


VARIANTS = {
    "mha": MHAConfig(),
    "gqa": MHAConfig(n_kv_heads=2),
    "bottleneck_null": BottleneckConfig(d_attn=16, null_attn=True),
    "decoupled_gate_tied": DecoupledConfig(d_sem=8, d_geo=16, gate=True, tie_qk=True),
    "decoupled_gqa_null": DecoupledConfig(d_sem=8, d_geo=16, d_v=24, n_kv_heads=2, gate=True, null_attn=True),
    "sliding": SlidingConfig(window=WINDOW),
    "mla": MLAConfig(d_latent=12, d_rope=4),
    "diff_gqa": DiffConfig(n_kv_heads=2),
    "coda_gqa": CoDAConfig(n_kv_heads=2, gate_bias=0.0),
}


def tiny_model(attention, vocab_size: int = 300, seed: int = 0):
    """Two layers (the second reads a non-trivial residual stream), parameters re-drawn with std 0.3 so the
    softmax is far from uniform and null keys and gate logits are non-zero."""
    model = helpers.tiny_model(attention, vocab_size=vocab_size, d_model=32, max_seq_len=32, rope_base=100.0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model.requires_grad_(False)  # tests call the layers' hooks directly, outside no_grad


def tokens(batch: int = BATCH, length: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


# Every registered kind at the attention contract suite's sizes (vocab 97, d_model 64, 4 heads of 16, 2 layers,
# init_std 0.1, 1-D parameters moved off their init): each kind's hard cases (GQA, null key, DBA gate, CoDA's
# gate open at bias 0 so the inhibitory stream counts).
KINDS = {
    "mha": MHAConfig(),
    "mha-gqa": MHAConfig(n_kv_heads=2),
    "bottleneck-null": BottleneckConfig(d_attn=32, null_attn=True),
    "decoupled-gqa-gate-null": DecoupledConfig(d_sem=16, d_geo=32, n_kv_heads=2, gate=True, null_attn=True),
    "decoupled-tied-rope-semantic": DecoupledConfig(d_sem=16, d_geo=32, tie_qk=True, rope_semantic=True),
    "sliding-gqa": SlidingConfig(window=4, n_kv_heads=2),
    "mla": MLAConfig(d_latent=32, d_rope=4),
    "diff": DiffConfig(),
    "diff-gqa": DiffConfig(n_kv_heads=2),
    "coda-gate-open": CoDAConfig(gate_bias=0.0),
    "coda-gate-open-gqa-no-head-norm": CoDAConfig(n_kv_heads=2, gate_bias=0.0, head_norm=False),
}
# Per kind: the effective-rank paths (all projections but v) as (heads, head_dim).
RANK_PATHS = {
    "mha": {"q": (4, 16), "k": (4, 16)},
    "mha-gqa": {"q": (4, 16), "k": (2, 16)},
    "bottleneck-null": {"q": (4, 8), "k": (4, 8)},
    "decoupled-gqa-gate-null": {"q_sem": (4, 4), "q_geo": (4, 8), "k_sem": (2, 4), "k_geo": (2, 8)},
    "decoupled-tied-rope-semantic": {"q_geo": (4, 8), "k_sem": (4, 4), "k_geo": (4, 8)},
    "sliding-gqa": {"q": (4, 16), "k": (2, 16)},
    "mla": {"q_nope": (4, 16), "q_rope": (4, 4), "k_nope": (4, 16), "k_rope": (1, 4)},
    "diff": {"q1": (4, 8), "q2": (4, 8), "k1": (4, 8), "k2": (4, 8)},
    "diff-gqa": {"q1": (4, 8), "q2": (4, 8), "k1": (2, 8), "k2": (2, 8)},
    "coda-gate-open": {"q": (4, 16), "k": (4, 16)},
    "coda-gate-open-gqa-no-head-norm": {"q": (4, 16), "k": (2, 16)},
}
KIND_SEQ = 12


def kind_model(name: str, seed: int = 0):
    return helpers.tiny_model(KINDS[name], seed=seed, perturb=True).requires_grad_(False)


def kind_tokens(batch: int = 1, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 97, (batch, KIND_SEQ), generator=torch.Generator().manual_seed(seed))


def test_kinds_cover_every_registered_variant():
    assert {cfg.kind for cfg in KINDS.values()} == set(REGISTRY)
    assert set(RANK_PATHS) == set(KINDS)


# ---- effective rank ------------------------------------------------------------------------------------


def with_spectrum(s, rows: int = 40, seed: int = 0) -> torch.Tensor:
    """A (rows, len(s)) matrix U diag(s) V^T with random orthonormal U, V: its singular values are s."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, len(s), generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(len(s), len(s), generator=gen, dtype=torch.float64))
    return u @ torch.diag(torch.tensor(s, dtype=torch.float64)) @ v.T


def reference_erank(x: np.ndarray) -> float:
    s = np.linalg.svd(x, compute_uv=False)
    p = s[s > 1e-12 * s.max()] / s.sum()
    return float(np.exp(-np.sum(p * np.log(p))))


def test_rank_one_matrix_has_effective_rank_one():
    x = torch.randn(30, 1, dtype=torch.float64) @ torch.randn(1, 12, dtype=torch.float64)
    s = analysis.singular_values(x)
    s[1:] = 0  # round-off singular values of a rank-1 product are ~1e-16, not exactly 0
    assert analysis.effective_rank(s) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_k_equal_singular_values_give_rank_k(k):
    x = with_spectrum([2.5] * k + [0.0] * (8 - k))
    assert analysis.effective_rank(analysis.singular_values(x)) == pytest.approx(k, rel=1e-9)


def test_known_entropy_case_and_plain_reference():
    # s = (3, 1): p = (3/4, 1/4), H = -(3/4 ln 3/4 + 1/4 ln 1/4), erank = exp(H) ~= 1.7548
    x = with_spectrum([3.0, 1.0])
    expected = math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    assert analysis.effective_rank(analysis.singular_values(x)) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(1.7548, abs=1e-4)
    y = torch.randn(50, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert analysis.effective_rank(analysis.singular_values(y)) == pytest.approx(reference_erank(y.numpy()), rel=1e-9)
    assert analysis.effective_rank(torch.zeros(4)) == 0.0


def test_centering_removes_a_constant_offset():
    x = with_spectrum([1.0, 1.0, 1.0], rows=60)
    x = x - x.mean(dim=0)  # zero-mean columns
    shifted = x + 100.0  # a huge shared mean direction dominates the uncentred spectrum
    assert analysis.effective_rank(analysis.singular_values(shifted)) < 1.5
    centred = analysis.effective_rank(analysis.singular_values(shifted, center=True))
    assert centred == pytest.approx(analysis.effective_rank(analysis.singular_values(x)), rel=1e-9)


def test_gram_route_equals_svd_and_chunking_does_not_matter():
    """effective_ranks accumulates X^T X over chunks: its spectrum must equal the SVD of the stacked X."""
    x = with_spectrum([10.0, 3.0, 1.0, 0.1, 0.01], rows=64) + 0.5
    for center in (False, True):
        torch.testing.assert_close(
            analysis.gram_singular_values(x.T @ x, x.sum(0), 64, center),
            analysis.singular_values(x, center),
            rtol=1e-6, atol=1e-9,
        )  # fmt: skip
    model = tiny_model(MHAConfig(n_kv_heads=2))
    rows = tokens(4)
    cap = analysis.capture(model, rows)
    for center in (False, True):
        whole = analysis.effective_ranks(model, rows, center=center)
        by_row = analysis.effective_ranks(model, rows, center=center, tokens_per_forward=SEQ)  # 4 forwards
        for i, (a, b) in enumerate(zip(whole, by_row, strict=True)):
            k = model.blocks[i].attn.projections(cap.inputs[i])["k"]  # (4, 2, SEQ, 8)
            pooled = k.transpose(1, 2).reshape(-1, 16).double().numpy()
            pooled = pooled - pooled.mean(axis=0) if center else pooled
            assert a["k"]["erank"] == pytest.approx(reference_erank(pooled), rel=1e-6)
            for name in a:  # fp32 activations of one batch of 4 and of 4 batches of 1 differ in the last bits
                assert b[name]["erank"] == pytest.approx(a[name]["erank"], rel=1e-6)
                assert b[name]["erank_heads"] == pytest.approx(a[name]["erank_heads"], rel=1e-6)


def heads_of(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, T, heads * D) -> (B, heads, T, D)."""
    return x.reshape(x.shape[0], x.shape[1], heads, -1).transpose(1, 2)


def hand_projections(attn, kind: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each variant's per-head projections before RoPE, (B, heads, T, dim) float64, from its weights by hand."""
    x = x.double()
    h = 4
    if kind in ("mha", "bottleneck", "sliding", "coda", "diff"):  # one fused [q | k | v] Linear
        hk = attn.n_kv_heads
        d = attn.head_dim
        w = attn.qkv.weight.double()
        q, k, v = x @ w[: h * d].T, x @ w[h * d : (h + hk) * d].T, x @ w[(h + hk) * d :].T
        q, k, v = heads_of(q, h), heads_of(k, hk), heads_of(v, hk)
        if kind == "diff":  # each head's rows are [half 1 | half 2]
            return {"q1": q[..., : d // 2], "q2": q[..., d // 2 :], "k1": k[..., : d // 2], "k2": k[..., d // 2 :],
                    "v": v}  # fmt: skip
        return {"q": q, "k": k, "v": v}
    if kind == "decoupled":  # rows [q_sem (unless tied) | q_geo | k_sem | k_geo | v], per head 4, 8, 4, 8, v_dim
        hk, tied = attn.n_kv_heads, attn.cfg.tie_qk
        names = (["q_sem"] if not tied else []) + ["q_geo", "k_sem", "k_geo", "v"]
        widths = {"q_sem": (h, 4), "q_geo": (h, 8), "k_sem": (hk, 4), "k_geo": (hk, 8), "v": (hk, attn.v_dim)}
        out, start, w = {}, 0, attn.proj.weight.double()
        for name in names:
            heads, dim = widths[name]
            out[name] = heads_of(x @ w[start : start + heads * dim].T, heads)
            start += heads * dim
        assert start == w.shape[0]
        return out
    if kind == "mla":  # q rows per head [nope 16 | rope 4]; kv_down rows [latent | k_rope]
        q = heads_of(x @ attn.q_proj.weight.double().T, h)
        down = x @ attn.kv_down.weight.double().T
        latent, k_rope = down[..., : attn.d_latent], down[..., attn.d_latent :]
        c = latent / (latent.pow(2).mean(-1, keepdim=True) + attn.kv_norm.eps).sqrt() * attn.kv_norm.weight.double()
        return {"q_nope": q[..., :16], "q_rope": q[..., 16:], "k_nope": heads_of(c @ attn.k_up.weight.double().T, h),
                "k_rope": k_rope[:, None], "v": heads_of(c @ attn.v_up.weight.double().T, h)}  # fmt: skip
    raise AssertionError(f"no hand projections for kind {kind!r}: add them here")


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_projections_equal_its_weights_by_hand(name):
    model = kind_model(name)
    cap = analysis.capture(model, kind_tokens(2))
    for block, x in zip(model.blocks, cap.inputs, strict=True):
        got, expected = block.attn.projections(x), hand_projections(block.attn, KINDS[name].kind, x)
        assert list(got) == list(expected)
        for path, value in expected.items():
            torch.testing.assert_close(got[path].double(), value, rtol=1e-5, atol=1e-5, msg=f"{name}: {path}")


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_effective_ranks_have_its_paths(name):
    model = kind_model(name)
    rows = kind_tokens(3)
    layers = analysis.effective_ranks(model, rows)
    cap = analysis.capture(model, rows)
    assert len(layers) == 2
    for block, x, layer in zip(model.blocks, cap.inputs, layers, strict=True):
        assert {path: (s["heads"], s["head_dim"]) for path, s in layer.items()} == RANK_PATHS[name]
        by_hand = hand_projections(block.attn, KINDS[name].kind, x)
        for path, stats in layer.items():
            heads, head_dim = RANK_PATHS[name][path]
            assert len(stats["erank_heads"]) == heads and len(stats["singular_values"]) == heads * head_dim
            assert by_hand[path].shape == (3, heads, KIND_SEQ, head_dim)
            pooled = by_hand[path].transpose(1, 2).reshape(-1, heads * head_dim).numpy()  # (B*T, heads*head_dim)
            assert stats["erank"] == pytest.approx(reference_erank(pooled), rel=1e-5)
            last = by_hand[path][:, -1].reshape(-1, head_dim).numpy()  # the last head alone
            assert stats["erank_heads"][-1] == pytest.approx(reference_erank(last), rel=1e-5)


# ---- captures ------------------------------------------------------------------------------------------


def test_hook_capture_equals_projection_by_hand():
    model = tiny_model(MHAConfig(n_kv_heads=2))
    x_tokens = tokens()
    cap = analysis.capture(model, x_tokens)
    positions = torch.arange(SEQ)
    assert cap.positions.tolist() == list(range(SEQ))
    with torch.no_grad():
        x = model.embed(x_tokens)
        for i, block in enumerate(model.blocks):
            h = block.attn_norm(x)
            torch.testing.assert_close(cap.inputs[i], h)  # the attention's input: after attn_norm
            w = block.attn.qkv.weight  # rows: [q (4 heads x 8) | k (2 x 8) | v (2 x 8)]
            parts = block.attn.projections(cap.inputs[i])
            torch.testing.assert_close(parts["q"][:, 1], h @ w[8:16].T, rtol=1e-6, atol=1e-5)  # query head 1
            torch.testing.assert_close(parts["k"][:, 1], h @ w[40:48].T, rtol=1e-6, atol=1e-5)  # kv head 1
            torch.testing.assert_close(parts["v"][:, 0], h @ w[48:56].T, rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(cap.outputs[i], block.attn(h, positions)[0], rtol=1e-6, atol=1e-5)
            x = block(x, positions)[0]


@pytest.mark.parametrize("tie_qk", [False, True])
def test_dba_sem_geo_split_shapes_and_ranks(tie_qk):
    n_kv = 4 if tie_qk else 2
    model = tiny_model(DecoupledConfig(d_sem=8, d_geo=16, d_v=12, n_kv_heads=n_kv, tie_qk=tie_qk))
    cap = analysis.capture(model, tokens())
    attn = model.blocks[0].attn
    parts = attn.projections(cap.inputs[0])
    expected = {"q_geo": (4, 4), "k_sem": (n_kv, 2), "k_geo": (n_kv, 4), "v": (n_kv, 3)}
    if not tie_qk:
        expected["q_sem"] = (4, 2)
    assert {n: (t.shape[1], t.shape[3]) for n, t in parts.items()} == expected
    assert all(t.shape[0] == BATCH and t.shape[2] == SEQ for t in parts.values())
    # k_geo is the fourth block of the fused projection's rows (the third when q_sem is tied away)
    start = sum(attn.widths[: 2 if tie_qk else 3])
    h = attn.proj(cap.inputs[0])[..., start : start + n_kv * 4]
    torch.testing.assert_close(parts["k_geo"][:, 0], h[..., :4])
    layers = analysis.effective_ranks(model, tokens())
    assert set(layers[0]) == set(expected) - {"v"}
    for name, stats in layers[1].items():
        heads, head_dim = expected[name]
        assert len(stats["erank_heads"]) == heads and stats["head_dim"] == head_dim
        assert len(stats["singular_values"]) == heads * head_dim
        assert 1.0 <= stats["erank"] <= heads * head_dim and all(1.0 <= e <= head_dim for e in stats["erank_heads"])
        x = model.blocks[1].attn.projections(cap.inputs[1])[name]  # (B, heads, T, head_dim)
        pooled = x.transpose(1, 2).reshape(-1, heads * head_dim)  # (B*T, heads*head_dim)
        assert stats["erank"] == pytest.approx(reference_erank(pooled.double().numpy()), rel=1e-6)


def test_a_module_without_the_attention_hooks_is_a_clear_error():
    class Plain(torch.nn.Module):
        def forward(self, x, positions, cache=None, write=None):
            return x, cache

    model = tiny_model(MHAConfig())
    model.blocks[0].attn = Plain()
    with pytest.raises(InputError, match="Plain does not derive from attnlab.attention.base.Attention"):
        analysis.capture(model, tokens())


def test_a_variant_whose_scores_disagree_with_its_forward_is_caught():
    """A subclass that changes forward's maths but not scores(): the output check names it and the layer."""

    class Hotter(MHA):
        def forward(self, x, positions, cache=None, write=None):
            return super().forward(x * 1.1, positions, cache, write)

    model = tiny_model(MHAConfig())
    analysis.attention_maps(model, tokens(1)[0])  # the plain model passes
    model.blocks[1].attn.__class__ = Hotter
    with pytest.raises(RuntimeError, match=r"at layer 1: Hotter\.scores\(\) disagrees with its forward\(\)"):
        analysis.attention_maps(model, tokens(1)[0])


# ---- attention maps ------------------------------------------------------------------------------------


def map_names(kind: str) -> list[str]:
    return ["signal", "noise"] if kind in ("diff", "coda") else ["attention"]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_recomputed_maps_reproduce_the_layer_output(name):
    """Each layer's scores() on a batch of 2: probabilities, causal (and windowed), null column always visible,
    and combine(maps @ values) equal to the captured output of that layer."""
    model = tiny_model(VARIANTS[name])
    cap = analysis.capture(model, tokens())
    null = getattr(VARIANTS[name], "null_attn", False)
    for block, x, actual in zip(model.blocks, cap.inputs, cap.outputs, strict=True):
        scores = block.attn.scores(x, cap.positions)
        assert list(scores.maps) == map_names(VARIANTS[name].kind) and scores.null == null
        for probs in scores.maps.values():
            assert probs.shape == (BATCH, 4, SEQ, SEQ + null) and probs.dtype == torch.float32
            torch.testing.assert_close(probs.sum(-1), torch.ones(BATCH, 4, SEQ), rtol=0, atol=1e-6)
            keys = probs[..., 1:] if null else probs  # (B, H, T, T): query i, key j
            query, key = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
            assert (keys[..., key > query] == 0).all()  # causal
            if name == "sliding":
                assert (keys[..., query - key >= WINDOW] == 0).all()
                assert (keys[..., (key <= query) & (query - key < WINDOW)] > 0).all()
            if null:
                assert (probs[..., 0] > 0).all()  # the null key is always visible
        torch.testing.assert_close(analysis.reproduce_output(scores), actual, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_attention_maps_are_causal_probabilities_that_reproduce_the_forward(name):
    cfg = KINDS[name]
    maps = analysis.attention_maps(kind_model(name), kind_tokens()[0])
    names = map_names(cfg.kind)
    assert list(maps.maps) == names and maps.probs is maps.maps[names[0]]
    assert maps.output_error < 1e-4
    null = getattr(cfg, "null_attn", False)
    assert maps.null == null
    query, key = np.arange(KIND_SEQ)[:, None], np.arange(KIND_SEQ)[None, :]
    for probs in maps.maps.values():
        assert probs.shape == (2, 4, KIND_SEQ, KIND_SEQ + null) and probs.dtype == np.float32
        assert (probs >= 0).all()
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=0, atol=1e-5)
        keys = probs[..., 1:] if null else probs
        assert (keys[..., key > query] == 0).all()  # zero above the diagonal
        assert (keys[..., key == query] > 0).all()  # every token sees itself
        if getattr(cfg, "window", None):
            assert (keys[..., query - key >= cfg.window] == 0).all()
        if null:
            assert (probs[..., 0] > 0).all()
    if len(names) == 2:  # two genuinely different maps (the noise query or keys differ)
        assert np.abs(maps.maps["signal"] - maps.maps["noise"]).max() > 1e-2


def sharpen(probs: torch.Tensor) -> torch.Tensor:
    """A different map with the same support: still causal probabilities (zeros stay zero, rows sum to 1)."""
    return (probs.log() * 1.5).softmax(dim=-1)


@pytest.mark.parametrize("name, map_name", [(n, m) for n, cfg in KINDS.items() for m in map_names(cfg.kind)])
def test_a_wrong_map_fails_the_output_check(monkeypatch, name, map_name):
    """If one map of one layer were not the one the forward used, attention_maps must refuse to return it:
    so for diff and coda the noise map is checked too, through the variant's combine()."""
    model = kind_model(name)
    attn = model.blocks[1].attn
    right = attn.scores

    def wrong(x, positions):
        scores = right(x, positions)
        scores.maps[map_name] = sharpen(scores.maps[map_name])
        return scores

    assert analysis.attention_maps(model, kind_tokens()[0]).output_error < 1e-4
    monkeypatch.setattr(attn, "scores", wrong)
    with pytest.raises(RuntimeError, match=rf"miss the layer outputs .* at layer 1: {type(attn).__name__}\.scores"):
        analysis.attention_maps(model, kind_tokens()[0])
    assert analysis.attention_maps(model, kind_tokens()[0], rtol=1.0).output_error > 1e-3  # a real miss


def test_dba_gate_changes_the_maps():
    """The gate weights the two paths: with gate logits flipped in sign the maps change (so they are used)."""
    model = tiny_model(VARIANTS["decoupled_gate_tied"])
    before = analysis.attention_maps(model, tokens(1)[0]).probs
    with torch.no_grad():
        model.blocks[0].attn.gate_logit.neg_()
    after = analysis.attention_maps(model, tokens(1)[0])
    assert after.output_error < 1e-5
    assert np.abs(before[0] - after.probs[0]).max() > 1e-2


def test_bf16_maps_pass_at_the_low_precision_tolerance():
    model = kind_model("diff-gqa").to(torch.bfloat16)
    maps = analysis.attention_maps(model, kind_tokens()[0])
    assert maps.probs.dtype == np.float32 and 0 < maps.output_error < 3e-2
    with pytest.raises(RuntimeError, match="miss the layer outputs"):
        analysis.attention_maps(model, kind_tokens()[0], rtol=1e-6)  # bf16 is not exact: the tolerance applies


# ---- plain references: explicit scores, einsum, softmax -------------------------------------------------


def rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Half-split RoPE at positions 0..T-1 (x: (..., T, D)): channel i rotates with channel i + D/2 by
    position * base^(-2i/D)."""
    dim, length = x.shape[-1], x.shape[-2]
    angles = torch.arange(length, dtype=torch.float64)[:, None] * base ** (-torch.arange(0, dim, 2).double() / dim)
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat((first * angles.cos() - second * angles.sin(), second * angles.cos() + first * angles.sin()), -1)


def reference_map(terms, window: int | None = None, null_keys=None) -> torch.Tensor:
    """softmax over keys of sum_i weight_i * q_i . k_i, causal (and windowed), a null column first if null_keys.
    terms: [(q (B, H, T, d), k (B, H_kv, T, d), weight: float or (H,))]; null_keys: per term (H_kv, d)."""
    heads, length = terms[0][0].shape[1], terms[0][0].shape[2]
    scores = 0.0
    null_scores = 0.0
    for i, (q, k, weight) in enumerate(terms):
        kv_head = torch.arange(heads) // (heads // k.shape[1])  # query head h reads K/V head h // group
        weight = torch.as_tensor(weight, dtype=torch.float64).reshape(-1, 1, 1)  # (H or 1, 1, 1)
        scores = scores + weight * torch.einsum("bhtd,bhsd->bhts", q, k[:, kv_head])
        if null_keys is not None:
            null_scores = null_scores + weight[:, 0] * torch.einsum("bhtd,hd->bht", q, null_keys[i].double()[kv_head])
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    visible = key <= query
    if window is not None:
        visible &= query - key < window
    scores = scores.masked_fill(~visible, float("-inf"))
    if null_keys is not None:
        scores = torch.cat((null_scores[..., None], scores), dim=-1)
    return scores.softmax(dim=-1)


def reference_maps(attn, cfg, x: torch.Tensor, base: float) -> dict[str, torch.Tensor]:
    """Each variant's maps from its definition (module docstrings and papers), float64."""
    p = hand_projections(attn, cfg.kind, x)
    if cfg.kind in ("mha", "bottleneck", "sliding"):
        d = p["q"].shape[-1]
        null = None if attn.null_k is None else [attn.null_k]
        return {"attention": reference_map([(rope(p["q"], base), rope(p["k"], base), 1 / math.sqrt(d))],
                                           getattr(cfg, "window", None), null)}  # fmt: skip
    if cfg.kind == "decoupled":  # DBA eq. 5 and 9: 2g q_sem.k_sem / sqrt(d_sem/H) + 2(1-g) q_geo.k_geo / sqrt(d_geo/H)
        g = torch.sigmoid(attn.gate_logit.double()) if cfg.gate else torch.full((4,), 0.5, dtype=torch.float64)
        q_sem, k_sem = p.get("q_sem", p["k_sem"]), p["k_sem"]
        if cfg.rope_semantic:
            q_sem, k_sem = rope(q_sem, base), rope(k_sem, base)
        terms = [(q_sem, k_sem, 2 * g / math.sqrt(4)), (rope(p["q_geo"], base), rope(p["k_geo"], base),
                                                         2 * (1 - g) / math.sqrt(8))]  # fmt: skip
        null = None if attn.null_k is None else list(attn.null_k.split((4, 8), dim=-1))  # [sem | geo]
        return {"attention": reference_map(terms, None, null)}
    if cfg.kind == "mla":  # (q_nope . W_uk c + q_rope . k_rope) / sqrt(head_dim + d_rope)
        scale = 1 / math.sqrt(16 + 4)
        terms = [(p["q_nope"], p["k_nope"], scale), (rope(p["q_rope"], base), rope(p["k_rope"], base), scale)]
        return {"attention": reference_map(terms)}
    if cfg.kind == "diff":  # two maps of the D/2 halves, each half rotated on its own, scale 1/sqrt(D/2)
        scale = 1 / math.sqrt(p["q1"].shape[-1])
        return {stream: reference_map([(rope(p[f"q{i}"], base), rope(p[f"k{i}"], base), scale)])
                for i, stream in ((1, "signal"), (2, "noise"))}  # fmt: skip
    if cfg.kind == "coda":  # noise query = the signal query rotated by theta in RoPE's planes (i, i + D/2)
        q, k = rope(p["q"], base), rope(p["k"], base)
        d = q.shape[-1]
        cos, sin = attn.theta.double().cos()[:, None], attn.theta.double().sin()[:, None]  # (H, 1, D/2)
        first, second = q[..., : d // 2], q[..., d // 2 :]
        q_noise = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        return {"signal": reference_map([(q, k, 1 / math.sqrt(d))]),
                "noise": reference_map([(q_noise, k, 1 / math.sqrt(d))])}  # fmt: skip
    raise AssertionError(f"no reference maps for kind {cfg.kind!r}: add them here")


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_maps_equal_a_plain_einsum_reference(name):
    model = kind_model(name)
    if KINDS[name].kind == "coda":
        with torch.no_grad():
            for block in model.blocks:  # angles off their pi/2 init, different per head and plane
                block.attn.theta.add_(torch.randn(block.attn.theta.shape, generator=torch.Generator().manual_seed(5)))
    x_tokens = kind_tokens()
    maps = analysis.attention_maps(model, x_tokens[0])
    cap = analysis.capture(model, x_tokens)
    for i, (block, x) in enumerate(zip(model.blocks, cap.inputs, strict=True)):
        expected = reference_maps(block.attn, KINDS[name], x, model.cfg.rope_base)
        assert list(expected) == list(maps.maps)
        for stream, probs in expected.items():
            np.testing.assert_allclose(maps.maps[stream][i], probs[0].numpy(), rtol=0, atol=2e-6,
                                       err_msg=f"{name}: layer {i} {stream}")  # fmt: skip


def test_mha_reference_output_equals_the_forward():
    """Plain MHA end to end: the reference maps times V through W_o are the layer output (GQA, null key)."""
    for attention in (MHAConfig(n_kv_heads=2), BottleneckConfig(d_attn=16, null_attn=True)):
        model = tiny_model(attention)
        cap = analysis.capture(model, tokens())
        for block, x, actual in zip(model.blocks, cap.inputs, cap.outputs, strict=True):
            attn = block.attn
            probs = reference_maps(attn, attention, x, model.cfg.rope_base)["attention"]  # (B, H, T, S)
            v = hand_projections(attn, attention.kind, x)["v"]  # (B, H_kv, T, D)
            if attn.null_k is not None:
                v = torch.cat((attn.null_v.double()[None, :, None].expand(v.shape[0], -1, 1, -1), v), dim=2)
            v = v[:, torch.arange(4) // (4 // v.shape[1])]  # per query head
            heads = torch.einsum("bhts,bhsd->bthd", probs, v).flatten(2)  # (B, T, H * D)
            torch.testing.assert_close(heads @ attn.out.weight.double().T, actual.double(), rtol=0, atol=1e-5)


# ---- regions -------------------------------------------------------------------------------------------


def test_region_mass_on_a_hand_made_matrix():
    probs = np.array([
        [1.0, 0.0, 0.0, 0.0],
        [0.5, 0.5, 0.0, 0.0],
        [0.1, 0.6, 0.3, 0.0],
        [0.2, 0.2, 0.4, 0.2],
    ])  # fmt: skip
    # region = tokens 1..2 ([1, 3)); the only query after it is 3: 0.2 + 0.4
    assert analysis.region_mass(probs, 1, 3) == pytest.approx(0.6)
    # region = token 1; queries 2 and 3: (0.6 + 0.2) / 2
    assert analysis.region_mass(probs, 1, 2) == pytest.approx(0.4)
    with_null = np.concatenate([np.full((4, 1), 0.5), probs / 2], axis=1)  # null column first
    assert analysis.region_mass(with_null, 1, 2, null=True) == pytest.approx(0.2)
    stacked = np.stack([probs, with_null[:, 1:]])  # (layers, T, T): mass per leading index
    np.testing.assert_allclose(analysis.region_mass(stacked, 1, 2), [0.4, 0.2])
    with pytest.raises(InputError, match="at least one token after"):
        analysis.region_mass(probs, 2, 4)


def test_character_region_to_tokens():
    byte = ByteTokenizer()
    text = "ah é!"  # é is two bytes (tokens 3 and 4)
    ids = byte.encode(text)
    assert analysis.char_region_to_tokens(byte, text, ids, 3, 4) == (3, 5)
    assert analysis.char_region_to_tokens(byte, text, ids, 0, 2) == (0, 2)
    assert analysis.char_region_to_tokens(byte, text, ids, 4, 5) == (5, 6)
    with pytest.raises(InputError, match="outside the prompt"):
        analysis.char_region_to_tokens(byte, text, ids, 2, 9)


# ---- records and plots ---------------------------------------------------------------------------------


def eval_model(attention, name: str) -> EvalModel:
    model = tiny_model(attention)
    return EvalModel(name, Path(name), model.cfg, model, ByteTokenizer(), {})


def test_attention_maps_record_and_plots(tmp_path):
    prompt = "noise noise APPLE then?"
    records = []
    for name, attention in [("mha", MHAConfig()), ("dba", VARIANTS["decoupled_gqa_null"])]:
        model = eval_model(attention, name)
        record = analysis.run_attention_maps(
            model, prompt, tmp_path / f"{name}.npz", regions={"noise": (0, 11), "target": (12, 17)}
        )
        probs = analysis.load_maps(record, tmp_path)
        assert probs.shape == (2, 4, len(prompt), len(prompt) + (name == "dba"))
        assert record["map_names"] == ["attention"] and "noise_mass" not in record["regions"][0]
        with pytest.raises(DataError, match="no map 'noise'"):
            analysis.load_maps(record, tmp_path, "noise")
        assert [r["tokens"] for r in record["regions"]] == [[0, 11], [12, 17]]
        assert record["regions"][1]["text"] == "APPLE"
        np.testing.assert_allclose(
            record["regions"][1]["mass"], analysis.region_mass(probs, 12, 17, record["null"]), atol=1e-6
        )
        records.append(record)
        for plot, out in [(plots.attention_heatmaps, "heat"), (plots.attention_by_layer, "rows")]:
            assert plot(record, probs, tmp_path / f"{out}_{name}.png").stat().st_size > 5000
    assert plots.region_mass_bars(records, tmp_path / "mass.png").stat().st_size > 5000


@pytest.mark.parametrize("name", ["diff_gqa", "coda_gqa"])
def test_two_map_record_saves_signal_as_probs_and_the_noise_map(tmp_path, name):
    prompt = "noise noise APPLE then?"
    model = eval_model(VARIANTS[name], name)
    maps = analysis.attention_maps(model.model, torch.tensor(ByteTokenizer().encode(prompt)))
    record = analysis.run_attention_maps(model, prompt, tmp_path / "maps.npz", regions={"target": (12, 17)})
    assert record["map_names"] == ["signal", "noise"] and record["null"] is False
    probs, noise = analysis.load_maps(record, tmp_path), analysis.load_maps(record, tmp_path, "noise")
    np.testing.assert_array_equal(probs, maps.maps["signal"])
    np.testing.assert_array_equal(noise, maps.maps["noise"])
    region = record["regions"][0]
    np.testing.assert_allclose(region["mass"], analysis.region_mass(probs, 12, 17), atol=1e-6)
    np.testing.assert_allclose(region["noise_mass"], analysis.region_mass(noise, 12, 17), atol=1e-6)
    assert region["mass"] != region["noise_mass"]
    assert plots.attention_heatmaps(record, probs, tmp_path / "heat.png").stat().st_size > 5000
    assert plots.region_mass_bars([record], tmp_path / "mass.png").stat().st_size > 5000


def test_save_maps_is_atomic_and_shareable(tmp_path):
    probs = np.random.default_rng(0).random((2, 3, 4, 4))
    path = tmp_path / "sub" / "maps.npz"
    previous = os.umask(0o022)
    try:
        assert analysis.save_maps(path, probs, noise=probs / 2) == path
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == 0o644  # readable by others, like the records beside it
    assert [p.name for p in path.parent.iterdir()] == ["maps.npz"]  # no temporary left behind
    with np.load(path) as data:
        assert sorted(data.files) == ["noise", "probs"] and data["probs"].dtype == np.float32
        np.testing.assert_allclose(data["noise"], probs / 2, rtol=1e-6)
    with pytest.raises(DataError, match="maps file named by the record is missing"):
        analysis.load_maps({"maps_file": "gone.npz"}, tmp_path)


def test_rank_spectra_plot(tmp_path):
    records = [
        make_record(
            "effective_rank",
            eval_model(attention, name),
            tokens=BATCH * SEQ,
            center=False,
            layers=analysis.effective_ranks(eval_model(attention, name).model, tokens()),
        )  # fmt: skip
        for name, attention in [
            ("mha", MHAConfig()),
            ("dba", VARIANTS["decoupled_gate_tied"]),
            ("mla", VARIANTS["mla"]),
            ("diff", VARIANTS["diff_gqa"]),
        ]
    ]
    assert records[1]["kind"] == "decoupled" and set(records[1]["layers"][0]) == {"q_geo", "k_sem", "k_geo"}
    # MLA keys are W_uk applied to a d_latent = 12 latent: their pooled rank (hence erank) is at most 12
    assert all(layer["k_nope"]["heads"] * layer["k_nope"]["head_dim"] == 32 for layer in records[2]["layers"])
    assert all(layer["k_nope"]["erank"] <= 12 for layer in records[2]["layers"])
    assert sum(s > 1e-4 for s in records[2]["layers"][0]["k_nope"]["singular_values"]) == 12
    assert set(records[3]["layers"][0]) == {"q1", "q2", "k1", "k2"}
    assert plots.rank_spectra(records, tmp_path / "rank.png").stat().st_size > 5000
