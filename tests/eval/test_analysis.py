"""Effective rank against known spectra, hook captures against hand-computed projections, and recomputed
attention maps that must reproduce each layer's output exactly (so the maps are the ones the model used)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.attention.bottleneck import BottleneckConfig
from attnlab.attention.decoupled import DecoupledConfig
from attnlab.attention.mha import HeadAttention, MHAConfig
from attnlab.attention.mla import MLAConfig
from attnlab.attention.sliding import SlidingConfig
from attnlab.config import ModelConfig
from attnlab.data.tokenizers import ByteTokenizer
from attnlab.errors import InputError
from attnlab.eval import analysis, plots
from attnlab.eval.loading import EvalModel
from attnlab.eval.records import make_record
from attnlab.model.transformer import build_model

BATCH, SEQ, WINDOW = 2, 9, 3

VARIANTS = {
    "mha": MHAConfig(),
    "gqa": MHAConfig(n_kv_heads=2),
    "bottleneck_null": BottleneckConfig(d_attn=16, null_attn=True),
    "decoupled_gate_tied": DecoupledConfig(d_sem=8, d_geo=16, gate=True, tie_qk=True),
    "decoupled_gqa_null": DecoupledConfig(d_sem=8, d_geo=16, d_v=24, n_kv_heads=2, gate=True, null_attn=True),
    "sliding": SlidingConfig(window=WINDOW),
    "mla": MLAConfig(d_latent=12, d_rope=4),
}


def tiny_model(attention, vocab_size: int = 300, seed: int = 0):
    """Two layers (the second reads a non-trivial residual stream), parameters re-drawn with std 0.3 so the
    softmax is far from uniform and null keys and gate logits are non-zero."""
    cfg = ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, rope_base=100.0,
                      attention=attention)  # fmt: skip
    model = build_model(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


def tokens(batch: int = BATCH, length: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


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
    for center in (False, True):
        whole = analysis.effective_ranks(model, rows, center=center)
        by_row = analysis.effective_ranks(model, rows, center=center, tokens_per_forward=SEQ)  # 4 forwards
        cap = analysis.capture(model, rows)
        for i, (a, b) in enumerate(zip(whole, by_row, strict=True)):
            k = analysis.split_projections(model.blocks[i].attn, cap.linears[i])["k"]  # (4, 2, SEQ, 8)
            pooled = k.transpose(1, 2).reshape(-1, 16).double().numpy()
            pooled = pooled - pooled.mean(axis=0) if center else pooled
            assert a["k"]["erank"] == pytest.approx(reference_erank(pooled), rel=1e-6)
            for name in a:  # fp32 activations of one batch of 4 and of 4 batches of 1 differ in the last bits
                assert b[name]["erank"] == pytest.approx(a[name]["erank"], rel=1e-6)
                assert b[name]["erank_heads"] == pytest.approx(a[name]["erank_heads"], rel=1e-6)


# ---- captures ------------------------------------------------------------------------------------------


def test_hook_capture_equals_projection_by_hand():
    model = tiny_model(MHAConfig(n_kv_heads=2))
    x_tokens = tokens()
    cap = analysis.capture(model, x_tokens)
    positions = torch.arange(SEQ)
    with torch.no_grad():
        x = model.embed(x_tokens)
        for i, block in enumerate(model.blocks):
            h = block.attn_norm(x)
            w = block.attn.qkv.weight  # rows: [q (4 heads x 8) | k (2 x 8) | v (2 x 8)]
            torch.testing.assert_close(cap.linears[i]["qkv"], h @ w.T, rtol=1e-6, atol=1e-5)
            parts = analysis.split_projections(block.attn, cap.linears[i])
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
    parts = analysis.split_projections(attn, cap.linears[0])
    expected = {"q_geo": (4, 4), "k_sem": (n_kv, 2), "k_geo": (n_kv, 4), "v": (n_kv, 3)}
    if not tie_qk:
        expected["q_sem"] = (4, 2)
    assert {n: (t.shape[1], t.shape[3]) for n, t in parts.items()} == expected
    assert all(t.shape[0] == BATCH and t.shape[2] == SEQ for t in parts.values())
    # k_geo is the fourth block of the fused projection's rows (the third when q_sem is tied away)
    start = sum(attn.widths[: 2 if tie_qk else 3])
    h = cap.linears[0]["proj"][..., start : start + n_kv * 4]
    torch.testing.assert_close(analysis.split_projections(attn, cap.linears[0])["k_geo"][:, 0], h[..., :4])
    layers = analysis.effective_ranks(model, tokens())
    assert set(layers[0]) == set(expected) - {"v"}
    for name, stats in layers[1].items():
        heads, head_dim = expected[name]
        assert len(stats["erank_heads"]) == heads and stats["head_dim"] == head_dim
        assert len(stats["singular_values"]) == heads * head_dim
        assert 1.0 <= stats["erank"] <= heads * head_dim and all(1.0 <= e <= head_dim for e in stats["erank_heads"])
        x = analysis.split_projections(model.blocks[1].attn, cap.linears[1])[name]  # (B, heads, T, head_dim)
        pooled = x.transpose(1, 2).reshape(-1, heads * head_dim)  # (B*T, heads*head_dim)
        assert stats["erank"] == pytest.approx(reference_erank(pooled.double().numpy()), rel=1e-6)


def test_unsupported_attention_module_is_a_clear_error():
    class Custom(HeadAttention):
        def forward(self, x, positions, cache=None):
            return super().forward(x, positions, cache)

    model = tiny_model(MHAConfig())
    model.blocks[0].attn.__class__ = Custom
    with pytest.raises(InputError, match="Custom is not supported"):
        analysis.capture(model, tokens())


# ---- attention maps ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_recomputed_maps_reproduce_the_layer_output(name):
    model = tiny_model(VARIANTS[name])
    cap = analysis.capture(model, tokens())
    null = getattr(model.blocks[0].attn, "null_k", None) is not None
    for block, linears, actual in zip(model.blocks, cap.linears, cap.outputs, strict=True):
        probs, values = analysis.layer_attention(block.attn, linears, cap.positions)
        assert probs.shape == (BATCH, 4, SEQ, SEQ + null)
        torch.testing.assert_close(probs.sum(-1), torch.ones(BATCH, 4, SEQ), rtol=0, atol=1e-6)
        keys = probs[..., 1:] if null else probs  # (B, H, T, T): query i, key j
        query, key = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
        assert (keys[..., key > query] == 0).all()  # causal
        if name == "sliding":
            assert (keys[..., query - key >= WINDOW] == 0).all()
            assert (keys[..., (key <= query) & (query - key < WINDOW)] > 0).all()
        if null:
            assert (probs[..., 0] > 0).all()  # the null key is always visible
        torch.testing.assert_close(analysis.reproduce_output(block.attn, probs, values), actual, rtol=0, atol=1e-5)


def test_dba_gate_changes_the_maps():
    """The gate weights the two paths: with gate logits flipped in sign the maps change (so they are used)."""
    model = tiny_model(VARIANTS["decoupled_gate_tied"])
    before = analysis.attention_maps(model, tokens(1)[0]).probs
    with torch.no_grad():
        model.blocks[0].attn.gate_logit.neg_()
    after = analysis.attention_maps(model, tokens(1)[0])
    assert after.output_error < 1e-5
    assert np.abs(before[0] - after.probs[0]).max() > 1e-2


def test_attention_maps_check_their_own_output(monkeypatch):
    model = tiny_model(MHAConfig())
    maps = analysis.attention_maps(model, tokens(1)[0])
    assert maps.probs.shape == (2, 4, SEQ, SEQ) and not maps.null and maps.output_error < 1e-5
    wrong = analysis._softmax
    monkeypatch.setattr(analysis, "_softmax", lambda scores, mask: wrong(scores * 1.1, mask))  # a wrong scale
    with pytest.raises(RuntimeError, match="miss the layer outputs"):
        analysis.attention_maps(model, tokens(1)[0])


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
        assert [r["tokens"] for r in record["regions"]] == [[0, 11], [12, 17]]
        assert record["regions"][1]["text"] == "APPLE"
        np.testing.assert_allclose(
            record["regions"][1]["mass"], analysis.region_mass(probs, 12, 17, record["null"]), atol=1e-6
        )
        records.append(record)
        for plot, out in [(plots.attention_heatmaps, "heat"), (plots.attention_by_layer, "rows")]:
            assert plot(record, probs, tmp_path / f"{out}_{name}.png").stat().st_size > 5000
    assert plots.region_mass_bars(records, tmp_path / "mass.png").stat().st_size > 5000


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
        ]
    ]
    assert records[1]["kind"] == "decoupled" and set(records[1]["layers"][0]) == {"q_geo", "k_sem", "k_geo"}
    # MLA keys are W_uk applied to a d_latent = 12 latent: their pooled rank (hence erank) is at most 12
    assert all(layer["k_nope"]["heads"] * layer["k_nope"]["head_dim"] == 32 for layer in records[2]["layers"])
    assert all(layer["k_nope"]["erank"] <= 12 for layer in records[2]["layers"])
    assert sum(s > 1e-4 for s in records[2]["layers"][0]["k_nope"]["singular_values"]) == 12
    assert plots.rank_spectra(records, tmp_path / "rank.png").stat().st_size > 5000
