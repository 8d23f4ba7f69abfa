"""Every attention variant with every cache kind: the shipped tiny models (configs/models/tiny-*.yaml) x {dense,
window, streaming, h2o, bounded} x {full precision, a q8_0 policy}, decoding 40 tokens one at a time, as a new
user would. Where a combination has no meaning, one ConfigError line says why.

While the memory holds every token (sizes chosen here so it does: the window covers the stream, or every token
that leaves it finds a slot), cached decoding equals the full forward pass of the same weights without a memory;
with a policy it equals a growing quantized cache of that policy (the same stored values). Bytes never change
while decoding and equal the accounting (`kv_report`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import tiny_model

import attnlab
from attnlab.accounting import kv_report
from attnlab.config import MemoryConfig
from attnlab.config_io import load_config
from attnlab.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"
MODELS = sorted(p.stem for p in CONFIGS.glob("tiny-*.yaml"))
LENGTH = 40
# Memories that hold all 40 tokens: a window over the whole stream; sinks + a window that meet; heavy slots for
# every token that leaves a 16-token window; an exact bank that takes every one (no gate, every token novel).
MEMORIES = {
    "dense": MemoryConfig(),
    "window": MemoryConfig(kind="window", recent_window=48),
    "streaming": MemoryConfig(kind="streaming", recent_window=32, sink_tokens=8),
    "h2o": MemoryConfig(kind="h2o", recent_window=16, heavy_slots=24),
    "bounded": MemoryConfig(kind="bounded", recent_window=16, exact_slots=24, summary_slots=0, write_policy="none",
                            tau_novel=1.0, tau_match=1.0),
}  # fmt: skip
# The q8_0 policy a researcher would write for each model: every field whose token rows are a multiple of 32
# values (q8_0's block); tiny-mqa's k and v rows hold 16 values, so its policy is refused with the reason.
Q8 = {
    "tiny-bottleneck": "k=q8_0,v=q8_0",
    "tiny-coda": "k=q8_0,v=q8_0",
    "tiny-decoupled": "kgeo=q8_0",  # k_sem rows hold 16 values and v rows 48
    "tiny-diff": "k=q8_0,v=q8_0",  # k covers k1 and k2
    "tiny-gqa2": "k=q8_0,v=q8_0",
    "tiny-mha": "k=q8_0,v=q8_0",
    "tiny-mla": "latent=q8_0",  # k_rope rows hold 8 values
    "tiny-mqa": "k=q8_0,v=q8_0",
    "tiny-sliding": "k=q8_0,v=q8_0",
}
REFUSED = {  # (model, memory, policy given) -> the reason's words
    **{("tiny-sliding", m, q): "has no meaning with attention.kind='sliding'" for m in MEMORIES if m != "dense"
       for q in (False, True)},
    **{("tiny-mqa", m, True): "row has 16 values, not a multiple of 32" for m in MEMORIES},
}  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_matrix_covers_every_shipped_tiny_model():
    assert set(MODELS) == set(Q8) and len(MODELS) * len(MEMORIES) * 2 == 90


def build(name: str, memory: MemoryConfig, n_layers: int | None = None) -> attnlab.Transformer:
    """The tiny model with `memory`, init_std 0.1 and its 1-D parameters moved off their init (so attention and
    gates show in the logits), the same weights whatever the memory (its write parameters aside)."""
    cfg = load_config(CONFIGS / f"{name}.yaml")
    return tiny_model(cfg, memory, perturb=True, init_std=0.1, n_layers=n_layers or cfg.n_layers)


def stream(model) -> torch.Tensor:
    """40 distinct tokens (a repeated token would give the exact bank an equal value to refresh, not insert)."""
    return torch.randperm(model.cfg.vocab_size, generator=torch.Generator().manual_seed(1))[:LENGTH][None]


@torch.no_grad()
def decode(model, cache, tokens) -> torch.Tensor:
    """Logits of every position, one token at a time through `cache`; its bytes never change."""
    before = cache.nbytes()
    logits = torch.cat([model(tokens[:, t : t + 1], cache=cache)[0] for t in range(tokens.shape[1])], dim=1)
    assert cache.nbytes() == before  # preallocated: bytes never grow
    return logits


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "q8_0"])
@pytest.mark.parametrize("memory", list(MEMORIES))
@pytest.mark.parametrize("name", MODELS)
def test_every_variant_with_every_cache_kind(name, memory, quantized):
    policy = Q8[name] if quantized else None
    refused = REFUSED.get((name, memory, quantized))
    if refused:
        with pytest.raises(ConfigError, match=refused.replace("(", r"\(").replace(")", r"\)")) as error:
            build(name, MEMORIES[memory]).new_cache(1, 64, policy=policy)
        assert "\n" not in str(error.value)  # one line
        return
    # With a policy, one layer: two caches that store the same values in another order sum them in another order,
    # and in a deeper model those 1e-7 differences can flip a q8_0 rounding of the next layer's keys.
    layers = 1 if quantized else None
    model = build(name, MEMORIES[memory], layers)
    tokens = stream(model)
    cache = model.new_cache(1, 64, policy=policy)
    got = decode(model, cache, tokens)
    report = kv_report(model.cfg, "fp32", 64, policy)
    assert cache.nbytes() == report["kv_bytes"]  # measured == accounting (batch 1)
    if memory != "dense":
        assert all(layer.capacity == model.cfg.memory.slots for layer in cache.layers)
    if quantized:  # the same stored values as a growing quantized cache of the policy (full precision kept 0)
        reference = build(name, MemoryConfig(), layers)
        reference.load_state_dict(model.state_dict(), strict=False)  # a bounded memory's write parameters aside
        want = decode(reference, reference.new_cache(1, 64, policy=policy), tokens)
        full, _ = reference(tokens, use_cache=False)
        assert (want - full).abs().max() > 1e-4  # the quantization is really there
    else:
        reference = build(name, MemoryConfig())
        reference.load_state_dict(model.state_dict(), strict=False)
        want, _ = reference(tokens, use_cache=False)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    if memory != "dense":  # the memory was used, not only a window over everything
        held = cache.layers[0].positions()
        assert sorted(held[held >= 0].tolist()) == list(range(LENGTH))


@pytest.mark.parametrize("name", [m for m in MODELS if m != "tiny-sliding"])
def test_the_summary_bank_blends_every_layout_on_its_rope_channels(name):
    """A bounded memory far smaller than the stream, on every layout: the summary bank's prototypes keep the
    high-frequency channels of RoPE fields at zero (LF-K) and blend the other fields in full; decoding stays
    finite, the bytes fixed and equal to the accounting."""
    memory = MemoryConfig(kind="bounded", recent_window=8, exact_slots=4, summary_slots=4, write_policy="none",
                          tau_novel=0.5, tau_match=0.9)  # fmt: skip
    model = build(name, memory)
    cache = model.new_cache(1, 64)
    logits = decode(model, cache, stream(model))
    assert torch.isfinite(logits).all() and cache.nbytes() == kv_report(model.cfg, "fp32", 64)["kv_bytes"]
    layer = cache.layers[-1]
    layout = layer.layout
    summary = slice(layer.recent_window + memory.exact_slots, layer.capacity)
    assert (layer.memory_positions[:, memory.exact_slots :] >= 0).all()  # every prototype in use
    for field, (buffer, lo, hi) in layout.slices.items():
        values = layer.buffer(buffer)[:, :, summary, lo:hi]  # (B, H, M_s, width)
        rope = next(f for f in layout.fields if f.name == field).rope
        kept = layer.blend[buffer][lo:hi].bool()
        assert kept.all() != rope  # RoPE fields keep their low-frequency channels only
        assert (values[..., ~kept] == 0).all() and (values[..., kept] != 0).any(), field


# Memories far smaller than the stream, so that tokens are evicted, replaced and blended within a block: sinks and a
# window; heavy hitters ranked again at every step; an exact bank that replaces its least recently used token and a
# summary bank whose prototypes move (gated writes, thresholds met by random tokens: inserts, refreshes and blends).
EVICTING = {
    "window": MemoryConfig(kind="window", recent_window=6),
    "streaming": MemoryConfig(kind="streaming", recent_window=6, sink_tokens=2),
    "h2o": MemoryConfig(kind="h2o", recent_window=6, heavy_slots=4),
    "bounded": MemoryConfig(kind="bounded", recent_window=6, exact_slots=3, summary_slots=3, tau_novel=0.3,
                            tau_match=0.6, tau_gate=0.45),
}  # fmt: skip
BLOCKS = (5, 1, 9, 3, 13, 2, 7)  # 40 tokens in blocks shorter and longer than the window


@pytest.mark.parametrize("memory", list(EVICTING))
@pytest.mark.parametrize("name", [m for m in MODELS if m != "tiny-sliding"])
def test_reading_in_blocks_equals_decoding_token_by_token(name, memory):
    """A block's queries see what the memory holds at their own step, as decoding does: the same logits and the
    same memory after the stream, whatever the blocks, while the memory evicts and blends within them."""
    model = build(name, EVICTING[memory])
    tokens = torch.randint(0, model.cfg.vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    stepped_cache = model.new_cache(2, 64)
    stepped = decode(model, stepped_cache, tokens)
    cache, logits, start = model.new_cache(2, 64), [], 0
    with torch.no_grad():
        for size in BLOCKS:
            logits.append(model(tokens[:, start : start + size], cache=cache)[0])
            start += size
    torch.testing.assert_close(torch.cat(logits, dim=1), stepped, atol=1e-4, rtol=0)
    for blocked, one_by_one in zip(cache.layers, stepped_cache.layers, strict=True):
        assert torch.equal(blocked.positions(), one_by_one.positions())
        for name_, tensor in one_by_one.state().items():
            torch.testing.assert_close(blocked.state()[name_], tensor, atol=1e-5, rtol=1e-5, msg=name_)
    held = stepped_cache.layers[-1].memory_positions
    evicted = set(range(LENGTH - 6)) - set(held[held >= 0].tolist())
    assert memory == "window" or evicted  # the memory was full and had to choose
