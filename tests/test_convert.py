"""Attention conversions (attnlab.interop.convert): each against the source model's own logits or an exact identity."""

import math

import pytest
import torch
from helpers import tiny_model

from attnlab.errors import ConfigError
from attnlab.interop.convert import convert_model, pool_heads

TOKENS = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))


def source(n_kv_heads: int = 4, **attention):
    """A tiny Llama-like source (mha, 4 heads of 16), every 1-D parameter moved off its init."""
    model = tiny_model({"kind": "mha", "n_kv_heads": n_kv_heads, **attention}, perturb=True, seed=1)
    return model.cfg, model


def logits(model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, use_cache=False)[0]


def cached_logits(model, tokens=TOKENS, chunk: int = 7) -> torch.Tensor:
    """The same tokens fed through a cache `chunk` at a time."""
    cache = model.new_cache(tokens.shape[0], tokens.shape[1])
    with torch.no_grad():
        return torch.cat([model(tokens[:, s : s + chunk], cache=cache)[0] for s in range(0, tokens.shape[1], chunk)], 1)


def test_pooling_keeps_or_repeats_heads_exactly():
    rows = torch.arange(4 * 3 * 5, dtype=torch.float32).view(12, 5)  # 4 heads of 3 rows
    assert torch.equal(pool_heads(rows, 4, 4), rows)
    assert torch.equal(pool_heads(rows, 4, 2), torch.cat(((rows[0:3] + rows[3:6]) / 2, (rows[6:9] + rows[9:12]) / 2)))
    assert torch.equal(pool_heads(rows[:6], 2, 4), torch.cat((rows[0:3], rows[0:3], rows[3:6], rows[3:6])))


def test_same_attention_is_the_source_and_more_kv_heads_repeat_exactly():
    cfg, model = source(n_kv_heads=2)
    same = convert_model(cfg, model)
    assert same.fresh == [] and same.cfg == cfg
    torch.testing.assert_close(logits(same.model), logits(model), rtol=0, atol=0)
    more = convert_model(cfg, model, {"n_kv_heads": 4})
    assert more.cfg.attention.n_kv_heads == 4 and more.fresh == []
    torch.testing.assert_close(logits(more.model), logits(model), rtol=0, atol=1e-5)


@pytest.mark.parametrize("n_kv", [2, 1])
def test_mean_pooled_gqa_equals_the_source_when_its_kv_heads_are_copies(n_kv):
    """Ainslie et al.'s mean-pooling: with the source's KV heads equal within each group, pooling loses nothing."""
    cfg, model = source(n_kv_heads=4)
    d = 16
    with torch.no_grad():
        for block in model.blocks:
            k = block.attn.qkv.weight[64 : 64 + 4 * d].view(4, d, -1)
            v = block.attn.qkv.weight[64 + 4 * d :].view(4, d, -1)
            for rows in (k, v):
                rows.copy_(rows[:: 4 // n_kv].repeat_interleave(4 // n_kv, dim=0))
    conversion = convert_model(cfg, model, {"kind": "mha", "n_kv_heads": n_kv})
    assert conversion.fresh == [] and "mean-pooled" in conversion.notes[0]
    torch.testing.assert_close(logits(conversion.model), logits(model), rtol=0, atol=1e-5)
    torch.testing.assert_close(cached_logits(conversion.model), logits(conversion.model), rtol=0, atol=1e-5)


def test_mean_pooling_differs_from_the_source_when_heads_differ():
    cfg, model = source(n_kv_heads=4)
    pooled = convert_model(cfg, model, {"n_kv_heads": 1})
    assert (logits(pooled.model) - logits(model)).abs().max() > 1e-2  # the test above can fail


def test_coda_gated_off_is_the_source_and_near_transparent_at_the_papers_bias():
    cfg, model = source(n_kv_heads=2)
    off = convert_model(cfg, model, {"kind": "coda", "gate_bias": -20.0})
    assert off.cfg.attention.head_norm is False
    assert sorted({name.split("attn.")[1] for name in off.fresh}) == ["gate.bias", "gate.weight", "theta"]
    torch.testing.assert_close(logits(off.model), logits(model), rtol=0, atol=1e-4)
    torch.testing.assert_close(cached_logits(off.model), logits(off.model), rtol=0, atol=1e-4)
    paper = convert_model(cfg, model, {"kind": "coda"})  # b_lambda = -6: lambda = 0.0025 on every token
    gap = (logits(paper.model) - logits(model)).abs().max().item()
    assert 1e-4 < gap < 0.1


def test_diff_with_lambda_zero_is_the_source():
    cfg, model = source(n_kv_heads=2)
    conversion = convert_model(cfg, model, {"kind": "diff"})
    attention = conversion.cfg.attention
    assert attention.head_dim == 32 and attention.head_norm is False and conversion.fresh == []
    for block in conversion.model.blocks:
        assert abs(block.attn.lambda_full().item()) < 1e-6
    torch.testing.assert_close(logits(conversion.model), logits(model), rtol=0, atol=1e-4)
    torch.testing.assert_close(cached_logits(conversion.model), logits(conversion.model), rtol=0, atol=1e-4)


def test_a_memory_that_holds_everything_is_the_source():
    cfg, model = source(n_kv_heads=2)
    for memory in ({"kind": "window", "recent_window": 64}, {"kind": "streaming", "recent_window": 60}):
        conversion = convert_model(cfg, model, memory=memory)
        assert conversion.cfg.memory.kind == memory["kind"] and conversion.fresh == []
        torch.testing.assert_close(cached_logits(conversion.model), logits(model), rtol=0, atol=1e-5)
    bounded = convert_model(cfg, model, {"kind": "coda", "gate_bias": -20.0}, memory={"kind": "bounded"})
    assert any("memory" in name for name in bounded.fresh)  # its write gate: the weights say nothing about it
    assert cached_logits(bounded.model).isfinite().all()


def test_joint_low_rank_is_the_truncated_svd_of_the_product():
    from attnlab.interop.convert import joint_low_rank

    gen = torch.Generator().manual_seed(0)
    left, right = torch.randn(12, 5, generator=gen), torch.randn(5, 9, generator=gen)
    a, b = joint_low_rank(left, right, 8)  # above the rank: exact, zero-padded
    torch.testing.assert_close(a @ b, left @ right, rtol=0, atol=1e-5)
    a, b = joint_low_rank(left, right, 2)
    u, s, vh = torch.linalg.svd((left @ right).double())
    torch.testing.assert_close((a @ b).double(), u[:, :2] @ torch.diag(s[:2]) @ vh[:2], rtol=0, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    ("head_dim", "attention"),
    [(8, {"kind": "bottleneck", "d_attn": 32}), (None, {"kind": "decoupled", "d_sem": 4, "d_geo": 64, "d_v": 64})],
)
def test_full_rank_factorisations_are_the_source(head_dim, attention, interleaved):
    """Every RoPE pair kept and V/output at full rank: the bottleneck and decoupled conversions are the source
    (the semantic path, with nothing left to carry, starts at zero). A bottleneck's full rank is below d_model only
    for a source whose heads are narrower than d_model / n_heads (a d_attn of d_model is refused: plain mha)."""
    source = {"kind": "mha", "n_kv_heads": 2} | ({"head_dim": head_dim} if head_dim else {})
    model = tiny_model(source, perturb=True, seed=1, rope_interleaved=interleaved)
    conversion = convert_model(model.cfg, model, attention)
    assert conversion.fresh == [] and conversion.cfg.rope_scaling.type == "freq_factors"
    torch.testing.assert_close(logits(conversion.model), logits(model), rtol=0, atol=1e-4)
    torch.testing.assert_close(cached_logits(conversion.model), logits(conversion.model), rtol=0, atol=1e-4)


@pytest.mark.parametrize("interleaved", [False, True])
def test_mla_keeps_every_kv_heads_pairs_in_the_shared_rope_key_and_a_full_rank_latent_is_exact(interleaved):
    """MLA from a GQA source: k_rope holds r = 2 kept pairs of each of the 2 KV heads (d_rope 8), turning at the
    source's frequencies, and each query head's q_rope is zero outside its KV head's block, so q_rope . k_rope is
    the source's score over the kept pairs at any positions. The other channels lose RoPE (partial RoPE, as in
    MHA2MLA): with no rotation anywhere (equal positions) a full-rank latent (2 x 12 + 2 x 16 = 56) is the source
    layer, a smaller one is not; cached (absorbed) decoding equals the full forward either way."""
    model = tiny_model({"kind": "mha", "n_kv_heads": 2}, perturb=True, seed=1, rope_interleaved=interleaved)
    full = convert_model(model.cfg, model, {"kind": "mla", "d_latent": 56, "d_rope": 8}, rope_pairs="low")
    a = full.cfg.attention
    assert (a.d_rope, a.head_dim, a.v_head_dim, a.latent_norm, full.fresh) == (8, 12, 16, False, [])
    assert len(full.cfg.rope_scaling.freq_factors) == 4 and "rule low): [6, 7]" in " ".join(full.notes)
    x, positions, still = torch.randn(1, 20, 64), torch.arange(20), torch.zeros(20, dtype=torch.long)
    src, dst = model.blocks[0].attn, full.model.blocks[0].attn
    with torch.no_grad():
        q, k, _ = src.project(x, positions)
        _, q_rope, row = dst.project(x, positions)
        rows = torch.tensor([12, 13, 14, 15] if interleaved else [6, 7, 14, 15])
        want = q[..., rows] @ k.repeat_interleave(2, dim=1)[..., rows].transpose(-1, -2)
        got = q_rope @ row[:, None, :, 56:].transpose(-1, -2) / math.sqrt((12 + 8) / 16)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dst(x, still)[0], src(x, still)[0], rtol=0, atol=1e-5)
        small = convert_model(model.cfg, model, {"kind": "mla", "d_latent": 24})  # default d_rope: r = 1 per head
        assert small.cfg.attention.d_rope == 4
        assert (small.model.blocks[0].attn(x, still)[0] - src(x, still)[0]).abs().max() > 1e-3
    for conversion in (full, small):
        torch.testing.assert_close(cached_logits(conversion.model), logits(conversion.model), rtol=0, atol=1e-4)


def test_kept_pairs_turn_at_the_source_frequencies_and_the_rest_is_read_without_rotation():
    """A bottleneck of 2 of the source's 8 pairs: its attention scores are the source's over those pairs (at
    their own frequencies); a decoupled model adds the other pairs' q.k without rotation: exact for a source
    whose other pairs do not rotate (their frequencies are ~0: RoPE base huge)."""
    from attnlab.interop.convert import kept_pairs, pair_energy

    model = tiny_model({"kind": "mha", "n_kv_heads": 4}, perturb=True, seed=2)
    with torch.no_grad():  # pairs 1 and 6 (and their halves, 9 and 14) carry the most energy in every layer
        for block in model.blocks:
            rows = block.attn.qkv.weight.view(12, 16, -1)
            rows[:8, [1, 9, 6, 14]] *= 4
    assert kept_pairs(model, model.cfg, 2).tolist() == [1, 6] and pair_energy(model, model.cfg).argmax() in (1, 6)
    bottleneck = convert_model(model.cfg, model, {"kind": "bottleneck", "d_attn": 16})
    assert "RoPE pairs kept (of 8, rule energy): [1, 6]" in bottleneck.notes
    assert kept_pairs(model, model.cfg, 2, "high").tolist() == [0, 1] and kept_pairs(
        model, model.cfg, 3, "low"
    ).tolist() == [5, 6, 7]
    assert kept_pairs(model, model.cfg, 3, "uniform").tolist() == [0, 4, 7]
    src_attn, dst_attn = model.blocks[0].attn, bottleneck.model.blocks[0].attn
    x, positions = torch.randn(1, 20, 64), torch.arange(20)
    with torch.no_grad():
        q, k, _ = src_attn.project(x, positions)
        q2, k2, _ = dst_attn.project(x, positions)
    rows = torch.tensor([1, 6, 9, 14])
    want = q[..., rows] @ k[..., rows].transpose(-1, -2) / 4  # the source's 1/sqrt(16)
    got = q2 @ k2.transpose(-1, -2) / 2  # the bottleneck's 1/sqrt(4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Decoupled: the geometric path as above, the semantic path the other pairs' q.k read without rotation, which
    # at equal positions (no rotation anywhere) makes the scores the source's when its rank suffices.
    source_model = tiny_model({"kind": "mha", "n_kv_heads": 2}, perturb=True, seed=3)
    for d_sem, exact in ((48, True), (8, False)):
        decoupled = convert_model(source_model.cfg, source_model, {"kind": "decoupled", "d_sem": d_sem, "d_geo": 16})
        with torch.no_grad():
            q, k, _ = source_model.blocks[1].attn.project(x, torch.zeros(20, dtype=torch.long))
            q2, k2, _ = decoupled.model.blocks[1].attn.queries_keys(x, torch.zeros(20, dtype=torch.long))
        want = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / 4
        got = q2 @ k2.repeat_interleave(2, dim=1).transpose(-1, -2)  # the queries come scaled
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4) == exact


def test_calibrated_factorisations_fit_the_inputs_better_than_the_weights_alone():
    """Activation-aware: with inputs dominated by a few channels (as real residual streams are), factorising
    W C^1/2 loses less on those inputs than factorising W; at full rank both are exact."""
    model = tiny_model({"kind": "mha", "n_kv_heads": 2}, perturb=True, seed=4)
    with torch.no_grad():
        for block in model.blocks:
            block.attn_norm.weight[:4] *= 8  # outlier channels in every attention input
    calibration = torch.randint(0, 97, (256,), generator=torch.Generator().manual_seed(5))
    attention = {"kind": "decoupled", "d_sem": 16, "d_geo": 32, "d_v": 32}
    errors = {}
    for name, data in (("weights", None), ("calibrated", calibration)):
        conversion = convert_model(model.cfg, model, attention, calibration=data, calibration_seq_len=64)
        errors[name] = (
            (logits(conversion.model, calibration[None, :64]) - logits(model, calibration[None, :64])).pow(2).mean()
        )
        assert ("calibration tokens" in conversion.notes[-1]) == (data is not None)
    assert errors["calibrated"] < 0.7 * errors["weights"]
    full_rank = {"kind": "decoupled", "d_sem": 4, "d_geo": 64, "d_v": 64}
    full = convert_model(model.cfg, model, full_rank, calibration=calibration)
    torch.testing.assert_close(logits(full.model), logits(model), rtol=0, atol=1e-4)


def test_a_conversion_the_source_cannot_initialise_is_refused_in_one_line():
    cfg, model = source(n_kv_heads=4)
    for attention, words in (
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"kind": "coda", "head_dim": 8}, "head_dim=8 cannot be initialised from the source's head_dim 16"),
        ({"kind": "mla", "d_latent": 32, "d_rope": 6}, "d_rope=6 must be a multiple of 2 x the source's 4 KV heads"),
        ({"kind": "mla", "d_latent": 32, "head_dim": 16}, "head_dim=16 cannot be initialised from the source .an MLA"),
        ({"kind": "mla", "d_latent": 200}, "d_latent=200 is more than the source's 120 unrotated key and value"),
        ({"kind": "mla", "d_latent": 32, "latent_norm": True}, "no norm on the latent .latent_norm: false."),
        ({"kind": "bottleneck", "d_attn": 128}, "d_attn=128 is not less than d_model=64: .* plain mha"),
        ({"kind": "decoupled", "d_sem": 16, "d_geo": 32, "tie_qk": True}, "separate semantic W_Q, W_K"),
    ):
        with pytest.raises(ConfigError, match=words) as error:
            convert_model(cfg, model, attention)
        assert "\n" not in str(error.value)
    narrow_cfg, narrow = source(head_dim=8)  # heads of 8: a bottleneck below d_model can be wider than them
    with pytest.raises(ConfigError, match="d_attn / n_heads = 12 is more than the source's head_dim 8"):
        convert_model(narrow_cfg, narrow, {"kind": "bottleneck", "d_attn": 48})
    coda_cfg, coda = tiny_model({"kind": "coda"}).cfg, tiny_model({"kind": "coda"})
    with pytest.raises(ConfigError, match="a conversion of the attention starts from mha or sliding"):
        convert_model(coda_cfg, coda, {"kind": "mha"})


@pytest.mark.parametrize("attention", [{"kind": "coda", "n_kv_heads": 2}, {"kind": "mla", "d_latent": 32}])
def test_a_memory_alone_is_given_to_any_attention_with_its_weights_as_they_are(attention):
    """--memory without --attention on a model whose attention no conversion starts from (CoDA, MLA): the attention
    is kept, its weights copied; while a sequence fits in the window the logits are the source's."""
    source = tiny_model(attention, perturb=True)
    memory = {"kind": "streaming", "recent_window": 32, "sink_tokens": 4}
    conversion = convert_model(source.cfg, source, None, memory)
    assert conversion.cfg.attention == source.cfg.attention and conversion.cfg.memory.kind == "streaming"
    assert conversion.fresh == []
    tokens = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(conversion.model(tokens)[0], source(tokens)[0], rtol=1e-5, atol=1e-5)
        longer = torch.randint(0, 97, (2, 60), generator=torch.Generator().manual_seed(1))
        assert (conversion.model(longer)[0][:, 40:] - source(longer)[0][:, 40:]).abs().max() > 1e-3


def test_the_convert_command_writes_a_reference_that_loads_with_the_sources_tokenizer(tmp_path, capsys, data_dir):
    """attnlab convert REF --attention ... --out DIR: DIR is a model reference (weights, config, tokenizer) whose
    logits are the conversion's; the original's and the cold conversion's perplexity are printed."""
    from test_pretrained import random_model, save

    import attnlab
    from attnlab.cli import main

    folder = save(random_model("llama", n_kv_heads=2), tmp_path / "m")
    _, original, tokenizer = attnlab.load_model(folder)
    out = tmp_path / "coda"
    args = ["convert", str(folder), "--attention", "kind=coda,gate_bias=-20", "--out", str(out), "--seq-len", "32",
            "--eval-tokens", "96", "--data-dir", str(data_dir)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "converted: kind=coda" in printed and "attn.gate.bias, attn.gate.weight, attn.theta" in printed
    ppl = [float(line.split("perplexity ")[1].split()[0]) for line in printed.splitlines() if "perplexity" in line]
    assert len(ppl) == 2 and abs(ppl[0] - ppl[1]) < 1e-2 * ppl[0]  # gated off: the cold conversion is the source
    cfg, converted, loaded_tokenizer = attnlab.load_model(out)
    assert cfg.attention.kind == "coda" and loaded_tokenizer.encode("the cat") == tokenizer.encode("the cat")
    ids = torch.tensor([tokenizer.encode_prompt("the cat sat")])
    torch.testing.assert_close(logits(converted, ids), logits(original, ids), rtol=0, atol=1e-4)
    assert main(["generate", str(out), "the cat", "--max-new-tokens", "3"]) == 0
    assert main(args) == 2  # the folder exists: refused before any work, in one line
    assert "already exists" in capsys.readouterr().err
