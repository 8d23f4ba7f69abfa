"""Memories take streams of any length; `memory.positions: cache` gives StreamingLLM's positions (a key read at its
rank among the held tokens), so a trained model keeps its loss on a stream four times its context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config, tiny_model

import attnlab
from attnlab.config import MemoryConfig
from attnlab.errors import ConfigError
from attnlab.interop import from_llama2c

ATTENTION = {
    "mha-gqa": {"kind": "mha", "n_kv_heads": 2},
    "decoupled": {"kind": "decoupled", "d_sem": 16, "d_geo": 32},
    "mla": {"kind": "mla", "d_latent": 32},
    "diff": {"kind": "diff"},
    "coda": {"kind": "coda", "gate_bias": 0.0},
}


def model_for(attention, memory=None, n_layers=1):
    return tiny_model(attention, memory, perturb=True, n_layers=n_layers, max_seq_len=32)


@torch.no_grad()
def decode(model, tokens):
    cache = model.new_cache(tokens.shape[0])
    return torch.cat([model(tokens[:, t : t + 1], cache=cache)[0] for t in range(tokens.shape[1])], dim=1)


@pytest.mark.parametrize("name", list(ATTENTION))
def test_cache_positions_read_the_held_tokens_as_one_contiguous_sequence(name):
    """One layer (its keys depend on the token alone): at every step the streaming memory with cache positions
    gives the logits a plain model gives the held tokens read as one sequence from position 0, sinks first."""
    sinks, window, length = 3, 6, 20
    memory = MemoryConfig(kind="streaming", recent_window=window, sink_tokens=sinks, positions="cache")
    model = model_for(ATTENTION[name], memory)
    plain = model_for(ATTENTION[name])
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 97, (2, length), generator=torch.Generator().manual_seed(1))
    got = decode(model, tokens)
    for t in range(length):
        held = list(range(min(sinks, t + 1))) + list(range(max(sinks, t - window + 1), t + 1))
        want, _ = plain(tokens[:, held], use_cache=False)
        torch.testing.assert_close(got[:, t], want[:, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(ATTENTION))
def test_cache_positions_equal_absolute_ones_while_nothing_left(name):
    memory = MemoryConfig(kind="streaming", recent_window=16, sink_tokens=4, positions="cache")
    model = model_for(ATTENTION[name], memory, n_layers=2)
    absolute = model_for(ATTENTION[name], memory.__class__(kind="streaming", recent_window=16, sink_tokens=4),
                         n_layers=2)  # fmt: skip
    absolute.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(decode(model, tokens), decode(absolute, tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("positions", ["absolute", "cache"])
@pytest.mark.parametrize("kind", ["window", "streaming", "h2o", "bounded"])
def test_memories_stream_past_max_seq_len(kind, positions):
    memory = MemoryConfig(kind=kind, recent_window=8, positions=positions)
    model = model_for(ATTENTION["mha-gqa"], memory, n_layers=2)
    tokens = torch.randint(0, 97, (1, 4 * model.cfg.max_seq_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        chunked, cache = model(tokens)  # in blocks
        assert cache.seen == tokens.shape[1] and torch.isfinite(chunked).all()
        stepped = decode(model, tokens[:, :40])
    assert torch.isfinite(stepped).all()
    plain = model_for(ATTENTION["mha-gqa"], n_layers=2)
    with pytest.raises(attnlab.InputError, match="exceeds max_seq_len=32"):
        plain(tokens)


def test_positions_option_is_checked():
    with pytest.raises(ConfigError, match="memory.positions='stream' is not known"):
        MemoryConfig(kind="window", positions="stream")
    with pytest.raises(ConfigError, match="memory.positions belongs to memory.kind window or streaming"):
        MemoryConfig(positions="cache")
    assert "positions" not in MemoryConfig(kind="window").to_dict()  # the default keeps existing config hashes


def test_a_trained_model_keeps_its_loss_on_a_stream_four_times_its_context(data_dir):
    """stories260K (512 positions) reads 2,048 tokens of its own stories through a StreamingLLM memory (4 sinks +
    252 recent): with cache positions every 512-token window scores within 5% of the same window read fresh by the
    plain model; with absolute positions the last windows, at RoPE positions it never saw, are worse."""
    cfg, plain = from_llama2c(data_dir / "llama2c-stories260K" / "stories260K.bin")
    context = cfg.max_seq_len
    stories = []
    while sum(map(len, stories)) < 4 * context + 1:  # stories sampled from the model itself, BOS between them
        out = attnlab.generate(plain, [1], max_new_tokens=context - 2, temperature=1.0, seed=len(stories),
                               stop_tokens=[1], compile=False)  # fmt: skip
        stories.append([1] + out.tolist())
    stream = torch.tensor([sum(stories, [])[: 4 * context + 1]])

    def window_losses(model):
        with torch.no_grad():
            logits, _ = model(stream[:, :-1], use_cache=False)
        nll = F.cross_entropy(logits[0], stream[0, 1:], reduction="none")
        return [float(nll[i * context : (i + 1) * context].mean()) for i in range(4)]

    fresh = []
    with torch.no_grad():
        for i in range(4):
            piece = stream[:, i * context : (i + 1) * context + 1]
            fresh.append(float(F.cross_entropy(plain(piece[:, :-1], use_cache=False)[0][0], piece[0, 1:])))
    losses = {}
    for positions in ("absolute", "cache"):
        memory = MemoryConfig(kind="streaming", recent_window=252, sink_tokens=4, positions=positions)
        model = attnlab.build_model(cfg.replace(memory=memory)).eval()
        model.load_state_dict(plain.state_dict())
        losses[positions] = window_losses(model)
    assert all(abs(a / b - 1) < 0.05 for a, b in zip(losses["cache"], fresh, strict=True)), (losses, fresh)
    assert losses["absolute"][3] > losses["cache"][3] * 1.02, losses


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bounded", "h2o"])
def test_blocks_with_cache_positions_stay_near_token_by_token_reading(data_dir, kind):
    """With cache positions a block ranks the held keys once for all its queries, so blocks and token-by-token
    decoding differ; on a trained model (stories260K, 512 tokens of its own stories, 96 slots) by little: mean NLL
    within 0.03 nats in blocks of 64 (bench/memory_chunks.py measures 2,048 tokens: BENCHMARKS.md)."""
    cfg, plain = from_llama2c(data_dir / "llama2c-stories260K" / "stories260K.bin")
    out = attnlab.generate(plain, [1], max_new_tokens=511, temperature=1.0, seed=0, compile=False)
    stream = torch.tensor([[1] + out.tolist()])
    sizes = {"h2o": {"heavy_slots": 48}, "bounded": {"exact_slots": 24, "summary_slots": 24, "write_policy": "none"}}
    nll = {}
    for block in (64, 1):
        memory = MemoryConfig(kind=kind, recent_window=48, positions="cache", block=block, **sizes[kind])
        model = attnlab.build_model(cfg.replace(memory=memory)).eval()
        model.load_state_dict(plain.state_dict(), strict=False)
        with torch.no_grad():
            logits, _ = model(stream[:, :-1], use_cache=False)
        nll[block] = float(F.cross_entropy(logits[0], stream[0, 1:]))
    assert abs(nll[64] - nll[1]) < 0.03, nll


def test_generate_runs_past_max_seq_len_with_a_memory():
    memory = MemoryConfig(kind="streaming", recent_window=12, sink_tokens=2, positions="cache")
    model = model_for(ATTENTION["mha-gqa"], memory, n_layers=2)
    out = attnlab.generate(model, list(range(20)), max_new_tokens=60)  # 80 tokens through 32 positions
    assert out.shape == (60,)
    plain = model_for(ATTENTION["mha-gqa"], n_layers=2)
    assert attnlab.generate(plain, list(range(20)), max_new_tokens=60).shape == (12,)  # capped by its positions


def test_cache_positions_refuse_a_null_key():
    """A learned null key carries no RoPE: its score would follow the query's stream position, so cache positions
    cannot hold for it."""
    memory = {"kind": "streaming", "recent_window": 8, "positions": "cache"}
    for attention in ({"kind": "bottleneck", "d_attn": 32, "null_attn": True},
                      {"kind": "decoupled", "d_sem": 16, "d_geo": 32, "null_attn": True}):  # fmt: skip
        with pytest.raises(ConfigError, match="prepends a learned null key that carries no RoPE"):
            tiny_config(attention, memory)
    tiny_config({"kind": "bottleneck", "d_attn": 32, "null_attn": True}, {**memory, "positions": "absolute"})


def test_layers_share_the_rope_table_a_stream_grows():
    memory = MemoryConfig(kind="window", recent_window=8)
    model = model_for(ATTENTION["mha-gqa"], memory, n_layers=3)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 100)))  # 100 positions through a model made for 32
    tables = {block.attn.rotary.cos.data_ptr() for block in model.blocks}
    assert len(tables) == 1 and model.blocks[0].attn.rotary.max_seq_len >= 100


def test_layers_share_one_rope_table_from_construction():
    """Every layer of a model holds the same cos/sin tables (SmolLM2's 30 layers held 63 MB of copies), and the
    shared table equals one computed for a lone Rotary of another width-alike model."""
    from attnlab.ops.rope import Rotary, inverse_frequencies

    model = model_for(ATTENTION["mha-gqa"], None, n_layers=3)
    rotaries = [block.attn.rotary for block in model.blocks]
    assert len({r.cos.data_ptr() for r in rotaries}) == 1 and len({r.sin.data_ptr() for r in rotaries}) == 1
    first = rotaries[0]
    angles = torch.arange(first.max_seq_len, dtype=torch.float32)[:, None] * inverse_frequencies(first.dim, first.base)
    torch.testing.assert_close(first.cos, angles.cos(), rtol=0, atol=0)
    other = Rotary(first.dim, first.base * 2, first.max_seq_len)  # another base: its own table
    assert other.cos.data_ptr() != first.cos.data_ptr() and not torch.equal(other.cos, first.cos)
