"""memory.kind snapkv, tova, knorm (cache/presses.py): which tokens each KV head keeps, against plain references
written with loops; what later queries read; budgets large enough to keep everything equal the dense cache."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import CACHE_VARIANTS, kv_layout, tiny_model

from attnlab.cache import attend_cache
from attnlab.cache.build import build_cache
from attnlab.cache.presses import PressCache, n_kept
from attnlab.config import MemoryConfig
from attnlab.errors import ConfigError

SCALE = 1 / math.sqrt(8)
ATTENTION = CACHE_VARIANTS


def softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    e = [math.exp(x - top) for x in xs]
    return [x / sum(e) for x in e]


def reference_scores(kind, q, k, window=4, kernel=3) -> list[list[list[float]]]:
    """scores[b][kv][s] by hand, for a first chunk of S tokens (queries q (B, H, S, D) at positions 0..S-1)."""
    batch, n_heads, length, _ = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    out = []
    for b in range(batch):
        rows = []
        if kind == "tova":  # the newest query's attention, averaged over every query head, the newest token kept
            probs = [softmax([float(q[b, h, -1] @ k[b, h // group, s]) * SCALE for s in range(length)])
                     for h in range(n_heads)]  # fmt: skip
            mean = [sum(p[s] for p in probs) / n_heads for s in range(length)]
            rows = [mean[:-1] + [math.inf] for _ in range(n_kv)]
        for kv in range(n_kv):
            if kind == "knorm":
                rows.append([-float(k[b, kv, s].norm()) for s in range(length)])
            elif kind == "snapkv":
                per_head = []
                for h in range(kv * group, (kv + 1) * group):
                    attention = [softmax([float(q[b, h, i] @ k[b, kv, s]) * SCALE for s in range(i + 1)])
                                 for i in range(length - window, length)]  # fmt: skip
                    mean = [sum(a[s] for a in attention) / window for s in range(length - window)]
                    pooled = [sum(mean[j + d] for d in range(-(kernel // 2), kernel // 2 + 1)
                                  if 0 <= j + d < len(mean)) / kernel for j in range(len(mean))]  # fmt: skip
                    per_head.append(pooled)
                rows.append([sum(p[j] for p in per_head) / group for j in range(length - window)] + [math.inf] * window)
        out.append(rows)
    return out


def kept_by_hand(scores, kept) -> list[list[list[int]]]:
    return [[sorted(sorted(range(len(row)), key=lambda s: -row[s])[:kept]) for row in heads] for heads in scores]


@pytest.mark.parametrize("kind", ["knorm", "tova", "snapkv"])
def test_each_press_keeps_what_the_plain_reference_keeps(kind):
    torch.manual_seed(0)
    snapkv = {"window_size": 4, "kernel_size": 3} if kind == "snapkv" else {}
    memory = MemoryConfig(kind=kind, budget=9, **snapkv)
    q, k, v = torch.randn(2, 4, 24, 8), torch.randn(2, 2, 24, 8), torch.randn(2, 2, 24, 8)
    layout = kv_layout(2, 8)
    cache = build_cache(layout, 2, None, torch.float32, memory=memory)
    assert isinstance(cache, PressCache)
    out = attend_cache(cache, q, {"k": k, "v": v}, torch.arange(24), layout.read, SCALE)
    assert cache.positions().tolist() == kept_by_hand(reference_scores(kind, q, k), 9)
    # The chunk itself attended in full (the press drops after the chunk's attention).
    full = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            is_causal=True, scale=SCALE)  # fmt: skip
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("press_at", ["prefill", "decode"])
def test_later_queries_read_the_kept_tokens_and_the_new_ones(press_at):
    """After the prompt is pressed, a chunk's queries see each KV head's kept tokens and the chunk causally; at
    prefill nothing is dropped again, at decode the cache is pressed back to the budget after the chunk."""
    torch.manual_seed(1)
    memory = MemoryConfig(kind="knorm", budget=6, press_at=press_at)
    q, k, v = torch.randn(1, 4, 30, 8), torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    layout = kv_layout(2, 8)
    cache = build_cache(layout, 1, None, torch.float32, memory=memory)
    attend_cache(cache, q[:, :, :20], {"k": k[:, :, :20], "v": v[:, :, :20]}, torch.arange(20), layout.read, SCALE)
    kept = cache.positions()[0].tolist()  # per KV head
    out = attend_cache(cache, q[:, :, 20:], {"k": k[:, :, 20:], "v": v[:, :, 20:]}, torch.arange(20, 30),
                       layout.read, SCALE)  # fmt: skip
    for h in range(4):
        for i in range(10):
            visible = kept[h // 2] + list(range(20, 21 + i))
            probs = torch.softmax(k[0, h // 2, visible] @ q[0, h, 20 + i] * SCALE, dim=0)
            torch.testing.assert_close(out[0, h, i], probs @ v[0, h // 2, visible], rtol=1e-5, atol=1e-5)
    assert cache.positions().shape[-1] == (16 if press_at == "prefill" else 6)


def test_tova_at_decode_drops_one_token_a_step_by_the_newest_query():
    torch.manual_seed(2)
    memory = MemoryConfig(kind="tova", budget=5, press_at="decode")
    q, k, v = torch.randn(1, 2, 12, 8), torch.randn(1, 1, 12, 8), torch.randn(1, 1, 12, 8)
    layout = kv_layout(1, 8)
    cache = build_cache(layout, 1, None, torch.float32, memory=memory)
    held = []
    for t in range(12):
        part = {"k": k[:, :, t : t + 1], "v": v[:, :, t : t + 1]}
        attend_cache(cache, q[:, :, t : t + 1], part, torch.tensor([t]), layout.read, SCALE)
        held.append(t)
        if len(held) > 5:  # by hand: the newest query's attention over what is held, averaged over both heads
            probs = [softmax([float(q[0, h, t] @ k[0, 0, s]) * SCALE for s in held]) for h in range(2)]
            mean = [(a + b) / 2 for a, b in zip(*probs, strict=True)]
            held.pop(min(range(len(held) - 1), key=lambda i: mean[i]))
        assert cache.positions()[0, 0].tolist() == held


@pytest.mark.parametrize("kind", ["snapkv", "tova", "knorm"])
@pytest.mark.parametrize("name", list(ATTENTION))
def test_a_budget_that_keeps_everything_equals_the_dense_cache(kind, name):
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    memory = {"kind": kind, "budget": 64, "press_at": "decode", **({"window_size": 8} if kind == "snapkv" else {})}
    dense = tiny_model(ATTENTION[name], perturb=True)
    press = tiny_model(ATTENTION[name], memory, perturb=True)
    press.load_state_dict(dense.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(press(tokens)[0], dense(tokens)[0], rtol=1e-5, atol=1e-5)
        cache = press.new_cache(2)
        steps = torch.cat([press(tokens[:, t : t + 1], cache)[0] for t in range(40)], dim=1)
    torch.testing.assert_close(steps, dense(tokens)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(ATTENTION))
def test_every_variant_decodes_through_a_pressed_prompt(name):
    """The prompt pressed to a quarter at prefill, then decoding: what is held per KV head, finite logits that
    differ from the dense model's once the press has dropped something."""
    memory = {"kind": "snapkv", "compression_ratio": 0.75, "window_size": 4}
    press = tiny_model(ATTENTION[name], memory, perturb=True)
    dense = tiny_model(ATTENTION[name], perturb=True)
    dense.load_state_dict(press.state_dict())
    tokens = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = press.new_cache(1)
        press(tokens[:, :32], cache)
        assert all(layer.positions().shape[-1] == 8 for layer in cache.layers)  # int(32 * 0.25)
        logits = torch.cat([press(tokens[:, t : t + 1], cache)[0] for t in range(32, 40)], dim=1)
    assert torch.isfinite(logits).all()
    assert (logits - dense(tokens)[0][:, 32:]).abs().max() > 1e-3
    assert all(layer.positions().shape[-1] == 16 for layer in cache.layers)


def test_n_kept_follows_kvpress_rounding():
    ratio = MemoryConfig(kind="knorm", compression_ratio=0.9)
    assert [n_kept(n, ratio) for n in (100, 2048, 5)] == [9, 204, 1]  # int() of 9.999..., 204.8; at least 1
    assert n_kept(512, MemoryConfig(kind="knorm", compression_ratio=0.7)) == 153
    assert (
        n_kept(100, MemoryConfig(kind="knorm", budget=30)) == 30
        and n_kept(10, MemoryConfig(kind="knorm", budget=30)) == 10
    )


def test_press_options_are_checked():
    with pytest.raises(ConfigError, match="needs exactly one of memory.budget"):
        MemoryConfig(kind="snapkv")
    with pytest.raises(ConfigError, match="needs exactly one of memory.budget"):
        MemoryConfig(kind="tova", budget=8, compression_ratio=0.5)
    with pytest.raises(ConfigError, match=r"compression_ratio=1.0 must be in \[0, 1\)"):
        MemoryConfig(kind="knorm", compression_ratio=1.0)
    with pytest.raises(ConfigError, match="kernel_size=4 must be odd"):
        MemoryConfig(kind="snapkv", budget=8, kernel_size=4)
    with pytest.raises(ConfigError, match="press_at='always' is not known"):
        MemoryConfig(kind="knorm", budget=8, press_at="always")
    with pytest.raises(ConfigError, match="memory.window_size belongs to memory.kind snapkv, not tova"):
        MemoryConfig(kind="tova", budget=8, window_size=16)
    model = tiny_model(None, {"kind": "knorm", "budget": 8})
    with pytest.raises(ConfigError, match="a press stores each KV head's 16 values of k on their own"):
        model.new_cache(1, 64, policy="k=q8_0,v=q8_0")  # 16-wide heads: no q8_0 block fits one head's row


# ----------------------------------------------------------------------------- with a KV policy


@pytest.mark.parametrize("name", ["mha", "mha-gqa", "decoupled", "diff", "coda"])
@pytest.mark.parametrize("kind", ["knorm", "tova", "snapkv"])
def test_a_float_policy_stores_what_the_press_alone_stores(kind, name):
    """An fp32 policy takes the stored path (per-head rows encoded, gathered and decoded) with nothing lost: the
    logits of a sequence decoded token by token through the press equal the press's without a policy."""
    model = tiny_model(ATTENTION[name], d_model=128, n_heads=4)
    fields = [f.name for f in model.blocks[0].attn.layout.fields]
    memory = {"kind": kind, "budget": 12, "press_at": "decode", **({"window_size": 4} if kind == "snapkv" else {})}
    pressed = tiny_model(ATTENTION[name], memory=memory, d_model=128, n_heads=4)
    tokens = torch.randint(0, 97, (2, 30))
    logits = []
    for policy in (None, ",".join(f"{f}=fp32" for f in fields)):
        cache = pressed.new_cache(2, policy=policy) if policy else pressed.new_cache(2)
        with torch.no_grad():
            logits.append(torch.cat([pressed(tokens[:, t : t + 1], cache)[0] for t in range(30)], dim=1))
    assert torch.equal(logits[0], logits[1])


def test_a_press_selects_on_the_stored_keys_and_holds_their_bytes():
    """q8_0 keys: knorm keeps the smallest norms of the keys as stored (quantized, then read back), computed by hand
    from the codec; the cache holds exactly the kept tokens' q8_0 bytes."""
    from attnlab.cache.codecs import Codec

    layout = kv_layout(2, 32)
    memory = MemoryConfig(kind="knorm", budget=5)
    cache = build_cache(layout, 1, None, torch.float32, policy="k=q8_0,v=q8_0", memory=memory)
    k, v = torch.randn(1, 2, 12, 32) * torch.linspace(0.5, 2.0, 12)[:, None], torch.randn(1, 2, 12, 32)
    q = torch.randn(1, 2, 12, 32)
    attend_cache(cache, q, {"k": k, "v": v}, torch.arange(12), layout.read, SCALE)
    codec = Codec("q8_0", 32, True, 32, "k")
    stored = codec.decode(codec.encode(k.reshape(2, 12, 32)), torch.float32).view(1, 2, 12, 32)
    expected = (-stored.norm(dim=-1)).topk(5, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(cache.positions(), expected)
    assert cache.nbytes() == 2 * 2 * 5 * codec.row_bytes  # k and v, 2 heads, 5 tokens, one q8_0 row each


@pytest.mark.parametrize(
    ("policy", "fragment"),
    [("k=kivi4,v=q8_0", "quantizes 32 tokens together per channel"), ("k=q8_0,v=q8_0,resid=16", "leave resid"),
     ("k=q4_0,v=q4_0", "a press stores each KV head's 16 values of k on their own, not a multiple")],
)  # fmt: skip
def test_a_policy_a_press_cannot_store_is_refused(policy, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build_cache(kv_layout(2, 16), 1, None, torch.float32, policy=policy, memory=MemoryConfig(kind="tova", budget=4))


def test_a_byte_budget_is_the_budget_of_tokens_it_pays_for():
    """budget_bytes: the tokens per KV head that many bytes of a layer hold, at the cache's dtype or in the KV
    policy's formats; the cache then equals the same budget in tokens and never holds more bytes between steps."""
    layout = kv_layout(2, 32)  # a token: k and v, 2 heads x 32 values
    k, v, q = torch.randn(1, 2, 40, 32), torch.randn(1, 2, 40, 32), torch.randn(1, 4, 40, 32)
    for policy, per_token, tokens in ((None, 512, 10), ("k=q8_0,v=q8_0", 136, 37)):
        kept = []
        for memory in (MemoryConfig(kind="knorm", budget_bytes=5120, press_at="decode"),
                       MemoryConfig(kind="knorm", budget=tokens, press_at="decode")):  # fmt: skip
            cache = build_cache(layout, 1, None, torch.float32, policy=policy, memory=memory)
            for t in range(40):
                attend_cache(cache, q[:, :, t : t + 1], {"k": k[:, :, t : t + 1], "v": v[:, :, t : t + 1]},
                             torch.tensor([t]), layout.read, SCALE)  # fmt: skip
                assert cache.nbytes() <= max(5120, per_token * (t + 1))
            kept.append(cache.positions())
        assert torch.equal(kept[0], kept[1]) and kept[0].shape[-1] == tokens == 5120 // per_token
    with pytest.raises(ConfigError, match="budget_bytes=100 holds no token: one takes 512 bytes"):
        build_cache(layout, 1, None, torch.float32, memory=MemoryConfig(kind="tova", budget_bytes=100))
    with pytest.raises(ConfigError, match="needs exactly one of memory.budget .*memory.budget_bytes"):
        MemoryConfig(kind="tova", budget=4, budget_bytes=1024)


def test_generate_presses_the_whole_prompt_whatever_its_chunks():
    """A press at prefill compresses the first chunk once: generate's chunks of prefill_chunk tokens would leave the
    rest of a longer prompt unpressed (bench/presses.py's passkey then disagreed with kvpress). generate prefills
    such a model's prompt as one chunk: the tokens equal the one-chunk run's, and differ from a prompt pressed
    by hand in its first 16 tokens only."""
    import attnlab

    model = tiny_model(None, {"kind": "snapkv", "budget": 4, "window_size": 4}, perturb=True, init_std=0.3)
    prompt = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    chunked = attnlab.generate(model, prompt, max_new_tokens=12, prefill_chunk=16, compile=False).tolist()
    whole = attnlab.generate(model, prompt, max_new_tokens=12, prefill_chunk=40, compile=False).tolist()
    assert chunked == whole
    with torch.no_grad():  # the old behaviour, by hand: only the first chunk pressed
        cache = model.new_cache(1)
        for start in range(0, 40, 16):
            logits = model(torch.tensor([prompt[start : start + 16]]), cache)[0]
        assert all(layer.positions().shape[-1] == 4 + 24 for layer in cache.layers)
        token, first = int(logits[0, -1].argmax()), []
        for _ in range(12):
            first.append(token)
            token = int(model(torch.tensor([[token]]), cache)[0][0, -1].argmax())
    assert first != whole


def _bench_presses():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "bench" / "presses.py"
    spec = importlib.util.spec_from_file_location("bench_presses", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_presses_plot_averages_whole_window_sets_and_keeps_the_newest_row(tmp_path):
    """bench/presses.py --plot: a point is the mean over every window of its context (a context scored on fewer
    windows for one press leaves that point out), a re-run row replaces the older one, the full cache closes each
    line at share 1, and the figure is written."""
    bench = _bench_presses()

    def rec(window, press, budget, impl, nll, slots=None, stamp="2026-12-01T00:00:00"):
        r = {"benchmark": "presses", "context": 1024, "window": window, "press": press, "budget": budget,
             "impl": impl, "nll": nll, "timestamp": stamp}  # fmt: skip
        return r if slots is None else {**r, "slots": slots}

    records = [rec(w, "none", "full", "attnlab", 2.0 + w) for w in (0, 1)]
    records += [rec(0, "tova", "ratio 0.5", "attnlab", 9.0, 512), rec(1, "tova", "ratio 0.5", "attnlab", 3.5, 512)]
    records += [rec(0, "tova", "ratio 0.5", "attnlab", 2.5, 512, stamp="2026-12-02T00:00:00")]  # newer: wins
    records += [rec(0, "knorm", "128 slots", "kvpress", 4.0, 128)]  # window 1 missing: no point
    records += [rec(0, "quest (decode)", "ratio 0.5", "attnlab", 2.2, 512), rec(1, "quest (decode)", "ratio 0.5",
                "attnlab", 3.2, 512)]  # fmt: skip
    lines = bench.nll_by_budget(records)[1024]
    assert lines["tova, attnlab"] == [(0.5, 3.0, 2), (1.0, 2.5, 2)]
    assert lines["quest (decode)"] == [(0.5, pytest.approx(2.7), 2), (1.0, 2.5, 2)]
    assert "knorm, kvpress" not in lines
    assert bench.plot_nll_by_budget(records, tmp_path / "nll.png").stat().st_size > 1000
    assert bench.plot_nll_by_budget(records[2:], tmp_path / "none.png") is None  # no full cache: no windows known
