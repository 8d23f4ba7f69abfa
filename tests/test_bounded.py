"""Bounded KV memories (cache/bounded.py): window, StreamingLLM, H2O and CoDA-GQA-L's bounded memory.

Model-level checks use a tiny model (vocab 97, d_model 64, 4 heads); the long runs (16K tokens) drive a
layer's cache directly with synthetic post-RoPE keys and values through the same `update` path the
attention uses, so they stay fast.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import kv_layout, tiny_model

import attnlab
from attnlab.accounting import kv_report
from attnlab.attention.mha import MHA
from attnlab.cache import BoundedCache, H2OCache, Write, attend_held, read_cache
from attnlab.cache.layout import low_frequency_channels
from attnlab.cli import main
from attnlab.config import MemoryConfig
from attnlab.config_io import model_config_from_dict
from attnlab.errors import ConfigError, InputError
from attnlab.ops.heads import merge_heads, split_heads
from attnlab.ops.rope import Rotary

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"
VOCAB, WINDOW = 97, 8
CHUNKS = (5, 1, 9, 3, 6, 2, 7, 1, 14)  # uneven; 48 tokens = 6 windows, chunks shorter and longer than W
BASE = {"vocab_size": VOCAB, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128, "init_std": 0.1}
MEMORIES = {
    "window": {"kind": "window", "recent_window": WINDOW},
    "streaming": {"kind": "streaming", "recent_window": WINDOW, "sink_tokens": 3},
    "h2o": {"kind": "h2o", "recent_window": WINDOW, "heavy_slots": 4},
    "bounded": {"kind": "bounded", "recent_window": WINDOW, "exact_slots": 4, "summary_slots": 3},
}
MEMORIES["bounded-ungated"] = {**MEMORIES["bounded"], "write_policy": "none"}
ATTENTIONS = {
    "gqa": {"kind": "mha", "n_kv_heads": 2},
    "mha-interleaved": {"kind": "mha"},
    "bottleneck-null": {"kind": "bottleneck", "d_attn": 32, "null_attn": True},
    "coda-gqa": {"kind": "coda", "n_kv_heads": 2, "gate_bias": 0.0},  # CoDA-GQA-L: coda + bounded memory
}


pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(memory: dict, attention: dict | None = None, seed: int = 0) -> attnlab.Transformer:
    attention = attention or ATTENTIONS["gqa"]
    interleaved = attention is ATTENTIONS["mha-interleaved"]
    return tiny_model(attention, memory, seed=seed, max_seq_len=128, rope_interleaved=interleaved)


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def run_chunks(model, toks, chunks, cache=None):
    """Logits (B, T, V) of tokens fed chunk by chunk into one cache, and the cache."""
    cache = cache or model.new_cache(toks.shape[0])
    out, start = [], 0
    for size in chunks:
        logits, cache = model(toks[:, start : start + size], cache=cache)
        out.append(logits)
        start += size
    return torch.cat(out, dim=1), cache


def synthetic(batch=2, heads=2, length=64, dim=16, seed=0, max_len=None):
    """Post-RoPE keys, values (B, H, N, D) and gates (B, N), as a layer would hand them to its cache."""
    g = torch.Generator().manual_seed(seed)
    rotary = Rotary(dim, 10000.0, max_len or length)
    k = rotary(torch.randn(batch, heads, length, dim, generator=g), torch.arange(length))
    v = torch.randn(batch, heads, length, dim, generator=g)
    return k, v, torch.rand(batch, length, generator=g)


def feed(cache, k, v, gate, chunks, eta=None, after_each=None):
    """Feeds synthetic k/v through cache.update chunk by chunk (the Block's set_write first, when bounded)."""
    start = 0
    eta = torch.full((k.shape[1],), 0.5) if eta is None else eta
    for size in chunks:
        part = slice(start, start + size)
        write = Write(gate[:, part], eta) if isinstance(cache, BoundedCache) else None
        cache.update({"k": k[:, :, part], "v": v[:, :, part]}, torch.arange(start, start + size), write)
        start += size
        if after_each:
            after_each(cache, start)


# ----------------------------------------------------------------------------- config


def test_memory_config_errors_name_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"unknown key memory\.'recent_windw' \(did you mean 'recent_window'\?\)"):
        model_config_from_dict({**BASE, "memory": {"kind": "window", "recent_windw": 4}})
    with pytest.raises(ConfigError, match=r"unknown value memory\.kind='bounde' \(did you mean 'bounded'\?\)"):
        model_config_from_dict({**BASE, "memory": {"kind": "bounde"}})
    with pytest.raises(ConfigError, match=r"memory\.tau_novel=0\.95 must be <= memory\.tau_match=0\.9"):
        MemoryConfig(kind="bounded", tau_novel=0.95)
    with pytest.raises(ConfigError, match=r"memory\.exact_slots=-1 must be >= 0") as error:
        MemoryConfig(kind="bounded", exact_slots=-1, write_policy="always", recent_window=0)
    assert len(error.value.problems) == 3  # every problem at once
    with pytest.raises(ConfigError, match=r"memory\.kind='window' has no meaning with attention\.kind='sliding'"):
        model_config_from_dict({**BASE, "attention": {"kind": "sliding", "window": 8}, "memory": {"kind": "window"}})
    with pytest.raises(ConfigError, match=r"memory\.exact_slots belongs to memory\.kind bounded, not window"):
        model_config_from_dict({**BASE, "memory": {"kind": "window", "exact_slots": 64}})
    with pytest.raises(ConfigError, match=r"memory\.detach_evicted='no' must be bool"):
        model_config_from_dict({**BASE, "memory": {"kind": "bounded", "detach_evicted": "no"}})


def test_memory_config_round_trips_and_leaves_plain_configs_unchanged():
    plain = model_config_from_dict(BASE)
    assert "memory" not in plain.to_dict()  # no memory: the same dict and config hash as before memories
    cfg = make_model(MEMORIES["bounded"]).cfg
    assert model_config_from_dict(json.loads(json.dumps(cfg.to_dict())), saved=True) == cfg  # read as saved
    assert cfg.config_hash() != plain.replace(attention=cfg.attention).config_hash()


# ----------------------------------------------------------------------------- accounting and bytes


def test_info_reports_the_papers_mistral_figures_through_the_cli(capsys):
    """CoDA-GQA-L Table 9 (bf16, per layer): standard cache 8 MiB at 2,048 tokens; W=256, M_e=64, M_s=64:
    1.5 MiB at any length."""
    reports = {}
    for seq_len in (512, 2048, 8192):
        args = ["info", str(MODELS / "mistral7b-bounded.yaml"), "--dtype", "bf16", "--seq-len", str(seq_len), "--json"]
        assert main(args) == 0
        reports[seq_len] = json.loads(capsys.readouterr().out)
    at_2k = reports[2048]
    assert at_2k["memory"]["unbounded_kv_bytes_per_layer"] == 8 * 2**20
    assert at_2k["kv_bytes_per_layer"] == 1.5 * 2**20 == 2 * 8 * (256 + 64 + 64) * 128 * 2  # Theorem 1
    assert at_2k["kv_bytes"] == 48 * 2**20  # 32 layers: "48 MB (bounded) versus 256 MB"
    assert {r["kv_bytes_per_layer"] for r in reports.values()} == {1.5 * 2**20}
    assert at_2k["params"]["memory"] == 32 * (4096 + 8)  # W_write (d_model -> 1) and eta_logit per KV head


@pytest.mark.parametrize("name", list(MEMORIES))
def test_model_cache_bytes_match_the_accounting_at_any_length(name):
    model = make_model(MEMORIES[name])
    memory = model.cfg.memory
    per_layer = 2 * 2 * memory.slots * 16 * 4  # k and v, 2 KV heads, head_dim 16, fp32
    for max_len in (16, 128):
        cache = model.new_cache(1, max_len)
        assert cache.nbytes() == model.cfg.n_layers * per_layer == kv_report(model.cfg, "fp32", max_len)["kv_bytes"]
        assert cache.layers[0].capacity == memory.slots


# ----------------------------------------------------------------------------- exact identities


@pytest.mark.parametrize("attention", list(ATTENTIONS))
@pytest.mark.parametrize("name", list(MEMORIES))
def test_memory_equals_the_dense_cache_while_the_sequence_fits_in_the_window(name, attention):
    model = make_model({**MEMORIES[name], "recent_window": 24}, ATTENTIONS[attention])
    toks = tokens(2, 24)
    plain = make_model({"kind": "none"}, ATTENTIONS[attention])
    for name_, p in plain.named_parameters():  # same seed, same weights: the memory draws no random numbers
        assert torch.equal(p, model.get_parameter(name_))
    with torch.no_grad():
        full, _ = model(toks, use_cache=False)
        dense, _ = run_chunks(plain, toks, (5, 1, 9, 3, 6))
        chunked, cache = run_chunks(model, toks, (5, 1, 9, 3, 6))
        stepped, _ = run_chunks(model, toks, [1] * 24)
    # Float rounding only (another column order in the same kernels): observed max |diff| ~2e-6.
    torch.testing.assert_close(dense, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(stepped, full, atol=1e-5, rtol=0)
    layer, sinks = cache.layers[0], MEMORIES[name].get("sink_tokens", 0)
    assert sorted(p for p in layer.ring_positions.tolist() if p >= 0) == list(range(sinks, 24))
    assert (layer.memory_positions[:, :sinks] == torch.arange(sinks)).all()  # StreamingLLM's sinks
    assert (layer.memory_positions[:, sinks:] == -1).all()  # nothing evicted: the banks are still empty


def test_window_only_equals_sliding_window_attention():
    memory_model = make_model(MEMORIES["window"])
    sliding = attnlab.build_model(
        model_config_from_dict({**BASE, "attention": {"kind": "sliding", "window": WINDOW, "n_kv_heads": 2}})
    ).eval()
    sliding.load_state_dict(memory_model.state_dict())
    toks = tokens(2, sum(CHUNKS))
    with torch.no_grad():
        reference, _ = sliding(toks, use_cache=False)
        chunked, _ = run_chunks(memory_model, toks, CHUNKS)
        stepped, _ = run_chunks(memory_model, toks, [1] * sum(CHUNKS))
    torch.testing.assert_close(chunked, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(stepped, reference, atol=1e-5, rtol=0)


def reference_attention(attn: MHA, x: torch.Tensor, visible) -> torch.Tensor:
    """Plain masked attention with explicit scores: visible(q_pos, k_pos) -> bool (T, T)."""
    length = x.shape[1]
    positions = torch.arange(length)
    q_width, kv_width = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    q, k, v = attn.qkv(x).split((q_width, kv_width, kv_width), dim=-1)
    q = attn.rotary(split_heads(q, attn.n_heads), positions)
    k = attn.rotary(split_heads(k, attn.n_kv_heads), positions).repeat_interleave(attn.n_heads // attn.n_kv_heads, 1)
    v = split_heads(v, attn.n_kv_heads).repeat_interleave(attn.n_heads // attn.n_kv_heads, 1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(attn.head_dim)
    mask = visible(positions[:, None], positions[None, :])
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return attn.out(merge_heads(weights @ v))


def test_streaming_keeps_the_sinks_and_equals_sinks_plus_window_attention():
    cfg = make_model(MEMORIES["streaming"]).cfg
    torch.manual_seed(3)
    attn = MHA(cfg).eval()
    length, sinks = sum(CHUNKS), cfg.memory.sink_tokens
    x = torch.randn(2, length, cfg.d_model)
    with torch.no_grad():
        expected = reference_attention(attn, x, lambda q, k: (k <= q) & ((k < sinks) | (q - k < WINDOW)))
        for chunks in (CHUNKS, [1] * length):
            cache, outputs, start = attn.new_cache(2, length, torch.float32, memory=cfg.memory), [], 0
            for size in chunks:
                outputs.append(attn(x[:, start : start + size], torch.arange(start, start + size), cache)[0])
                start += size
            torch.testing.assert_close(torch.cat(outputs, dim=1), expected, atol=1e-5, rtol=0)
            assert sorted(cache.positions()[0].tolist()) == list(range(sinks)) + list(range(length - WINDOW, length))


def drive_h2o(cache: H2OCache, q, k, v, chunks):
    """What every variant does with an H2O cache (attnlab.cache.attend): update, mask, attend, observe."""
    start = 0
    for size in chunks:
        positions = torch.arange(start, start + size)
        held = read_cache(cache, {"k": k[:, :, positions], "v": v[:, :, positions]}, positions)
        attend_held(held, q[:, :, positions], held.tensors["k"], held.tensors["v"], 1.0)
        start += size


@pytest.mark.parametrize("chunks", [[1] * 40, [7, 5, 1, 8, 3, 8, 8]], ids=["decode", "chunks"])
def test_h2o_keeps_the_heavy_hitters_of_a_constructed_case(chunks):
    """Every query points along one direction; tokens 5 and 17 have keys along it, so they take most of
    the attention mass from every later query, and must be the two heavy hitters kept."""
    g = torch.Generator().manual_seed(0)
    length, dim = 40, 8
    direction = F.normalize(torch.randn(dim, generator=g), dim=0)
    q = direction.expand(1, 2, length, dim) * 3.0  # (B, H, N, D), 2 query heads on 1 KV head
    k = torch.randn(1, 1, length, dim, generator=g) * 0.3
    k[:, :, [5, 17]] = direction * 3.0
    v = torch.randn(1, 1, length, dim, generator=g)
    cache = H2OCache(kv_layout(1, dim), 1, MemoryConfig(kind="h2o", recent_window=8, heavy_slots=2), torch.float32)
    drive_h2o(cache, q, k, v, chunks)
    assert sorted(cache.memory_positions[0].tolist()) == [5, 17]
    torch.testing.assert_close(cache.buffer("k")[0, 0, 8:][cache.memory_positions[0].argsort()], k[0, 0, [5, 17]])
    assert sorted(cache.ring_positions.tolist()) == list(range(32, 40))


def test_h2o_model_accumulates_attention_mass_through_the_attention_hook():
    model = make_model(MEMORIES["h2o"])
    with torch.no_grad():
        _, cache = run_chunks(model, tokens(2, 48), CHUNKS)
    for layer in cache.layers:
        assert (layer.memory_positions >= 0).all()
        assert (layer.heavy_scores > 0).all() and (layer.ring_values > 0).all()
        # Each query spreads mass 1 over the slots it sees (x 4 heads): no slot can hold more than all of it.
        assert layer.heavy_scores.max() <= 4 * 48


# ----------------------------------------------------------------------------- the bounded memory


def reference_exact_bank(v, gate, window, slots, memory: MemoryConfig):
    """The novelty-filtered LRU of §3.2 in plain Python, token by token: per step and sequence, a dict
    slot -> (position held, recency)."""
    unit = F.normalize(v, dim=-1)  # (B, H, N, D)
    history = []
    banks = [{} for _ in range(v.shape[0])]
    for t in range(v.shape[2]):
        leaving = t - window  # token t pushes this one out of the window
        for b, bank in enumerate(banks):
            if leaving < 0 or gate[b, leaving] < memory.tau_gate:
                continue
            similarity = [(unit[b, :, leaving] * unit[b, :, bank[s][0]]).sum(-1).mean().item() for s in sorted(bank)]
            best = max(similarity, default=-math.inf)
            if best < memory.tau_novel:
                free = [s for s in range(slots) if s not in bank]
                target = free[0] if free else min(bank, key=lambda s: bank[s][1])
                bank[target] = (leaving, leaving)
            elif best >= memory.tau_match:
                best_slot = sorted(bank)[similarity.index(best)]
                bank[best_slot] = (bank[best_slot][0], leaving)
        history.append([dict(bank) for bank in banks])
    return history


def exact_state(cache: BoundedCache):
    slots = cache.exact_slots
    positions, recency = cache.memory_positions[:, :slots], cache.exact_last_used
    return [{s: (positions[b, s].item(), recency[b, s].item()) for s in range(slots) if positions[b, s] >= 0}
            for b in range(positions.shape[0])]  # fmt: skip


def test_bounded_ring_and_lru_invariants_at_every_step():
    """Repeated values (12 distinct tokens in a 96-token sequence) make the bank refresh, skip and replace."""
    memory = MemoryConfig(kind="bounded", recent_window=6, exact_slots=5, summary_slots=3, tau_gate=0.3)
    k, v, gate = synthetic(length=96)
    vocabulary = torch.randint(0, 12, (2, 96), generator=torch.Generator().manual_seed(5))
    v = torch.stack([v[b, :, vocabulary[b]] for b in range(2)])  # (B, H, N, D), values from 12 tokens
    expected = reference_exact_bank(v, gate, 6, 5, memory)
    cache = BoundedCache(kv_layout(2, 16), 2, memory, torch.float32)
    counts = {"exact": [0, 0], "summary": [0, 0]}

    def check(cache, seen):
        held = cache.ring_positions.tolist()
        assert sorted(p for p in held if p >= 0) == list(range(max(0, seen - 6), seen))  # the last W tokens
        assert all(p == -1 or p % 6 == slot for slot, p in enumerate(held))  # FIFO ring: slot p % W
        torch.testing.assert_close(cache.buffer("k")[:, :, [p % 6 for p in range(max(0, seen - 6), seen)]],
                                   k[:, :, max(0, seen - 6) : seen])  # fmt: skip
        assert exact_state(cache) == expected[seen - 1]
        for b in range(2):
            exact, summary = cache.memory_positions[b, :5], cache.memory_positions[b, 5:]
            used = exact[exact >= 0]
            assert len(set(used.tolist())) == len(used)  # no token twice
            assert (used < seen - 6).all() and (summary[summary >= 0] < seen - 6).all()  # left the window
            for slot in (exact >= 0).nonzero().flatten().tolist():  # an exact copy of the token it holds
                assert torch.equal(cache.buffer("k")[b, :, 6 + slot], k[b, :, exact[slot]])
                assert torch.equal(cache.buffer("v")[b, :, 6 + slot], v[b, :, exact[slot]])
            for name, held in (("exact", exact), ("summary", summary)):
                assert (held >= 0).sum() >= counts[name][b]  # the banks never shrink
                counts[name][b] = (held >= 0).sum().item()
        summary_keys = cache.buffer("k")[:, :, 6 + 5 :]
        assert (summary_keys[..., cache.blend["k"] == 0] == 0).all()  # LF-K: high-frequency channels zero

    feed(cache, k, v, gate, [1] * 96, after_each=check)
    assert min(counts["exact"]) == 5 and min(counts["summary"]) >= 2
    replaced = [b for b in range(2) if any(expected[t][b] != expected[t - 1][b] for t in range(60, 96))]
    assert replaced  # the bank kept changing after it filled: LRU replacement and refreshes were exercised

    chunked = BoundedCache(kv_layout(2, 16), 2, memory, torch.float32)
    feed(chunked, k, v, gate, (5, 1, 9, 3, 13, 2, 20, 7, 36))
    assert exact_state(chunked) == exact_state(cache)  # the exact bank does not depend on the chunking
    torch.testing.assert_close(chunked.buffer("k")[:, :, :11], cache.buffer("k")[:, :, :11])
    torch.testing.assert_close(chunked.buffer("v")[:, :, :11], cache.buffer("v")[:, :, :11])


def test_summary_bank_is_the_sequential_ema_of_its_members():
    """Two well-separated clusters: after the first two tokens open one prototype each, every later token
    moves its cluster's prototype by eta = sigmoid(eta_logit) * g, with LF keys; chunked = one by one."""
    memory = MemoryConfig(kind="bounded", recent_window=2, exact_slots=0, summary_slots=2, tau_gate=0.0)
    g = torch.Generator().manual_seed(0)
    length, dim = 20, 8
    centers_k, centers_v = torch.zeros(2, dim), torch.randn(2, dim, generator=g) * 3
    centers_k[0, 2], centers_k[1, 3] = 3.0, 3.0  # orthogonal on the low-frequency channels (2, 3, 6, 7)
    centers_k[:, [0, 1, 4, 5]] = torch.randn(2, 4, generator=g)  # high-frequency channels: not routed on
    cluster = torch.tensor([0, 1] + [i % 2 for i in range(length - 2)])
    k = (centers_k[cluster] + 0.1 * torch.randn(length, dim, generator=g))[None, None]  # (1, 1, N, D)
    v = (centers_v[cluster] + 0.1 * torch.randn(length, dim, generator=g))[None, None]
    gate = torch.rand(1, length, generator=g)
    eta = torch.tensor([0.3])
    low = low_frequency_channels(dim)
    expected_k, expected_v = torch.zeros(2, dim), torch.zeros(2, dim)
    for position in range(length - 2):  # the tokens that left the window, oldest first
        c = cluster[position]
        rate = 1.0 if position < 2 else eta * gate[0, position]
        expected_k[c] += rate * (k[0, 0, position] * low - expected_k[c])
        expected_v[c] += rate * (v[0, 0, position] - expected_v[c])
    for chunks in ([1] * length, [3, 4, 13], [2, 18]):
        cache = BoundedCache(kv_layout(1, dim), 1, memory, torch.float32)
        feed(cache, k, v, gate, chunks, eta=eta)
        torch.testing.assert_close(cache.buffer("k")[0, 0, 2:], expected_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.buffer("v")[0, 0, 2:], expected_v, atol=1e-5, rtol=1e-5)
        assert cache.memory_positions[0].tolist() == [16, 17]  # the newest token blended into each


def test_low_frequency_channels_are_the_slowest_rope_channels():
    for interleaved in (False, True):
        rotary = Rotary(16, 10000.0, 4, interleaved)
        turned = rotary(torch.eye(16), torch.tensor([1] * 16))  # each basis channel rotated by one position
        angle = torch.acos(turned.diagonal().clamp(-1, 1))  # (16,) the angle each channel turns per position
        low = low_frequency_channels(16, interleaved)
        assert low.sum() == 8 and angle[low].max() < angle[~low].min()


@pytest.mark.slow
def test_needle_stays_in_the_exact_bank_for_16k_tokens_and_the_memory_does_not_grow():
    """CoDA-GQA-L §4.6 (W=128, M_e=32, M_s=32, needle at position 64): a haystack of 31 repeating tokens
    whose gates pass at random, the needle's gate passes; bf16 storage, as the paper's."""
    length, dim, heads = 16384, 16, 2
    memory = MemoryConfig(kind="bounded", recent_window=128, exact_slots=32, summary_slots=32)
    g = torch.Generator().manual_seed(2)
    haystack = torch.arange(length) % 31  # the haystack repeats 31 distinct tokens
    keys, values = torch.randn(2, heads, 32, dim, generator=g), torch.randn(2, heads, 32, dim, generator=g)
    token = torch.where(torch.arange(length) == 64, 31, haystack)  # token 31, at position 64, is the needle
    k = Rotary(dim, 10000.0, length)(keys[:, :, token], torch.arange(length))  # keys after RoPE
    v = values[:, :, token]
    gate = torch.rand(2, length, generator=g)  # about half of the haystack passes the gate ...
    gate[:, 64] = 1.0  # ... and the needle does
    cache = BoundedCache(kv_layout(heads, dim), 2, memory, torch.bfloat16)
    sizes = {}
    chunks = [1000] * 16 + [1] * 384  # chunked prefill, then decode steps

    def record(cache, seen):
        if seen in (1000, length):
            sizes[seen] = (cache.nbytes(), cache.overhead_nbytes())

    feed(cache, k, v, gate, chunks, after_each=record)
    expected = 2 * 2 * heads * (128 + 32 + 32) * dim * 2  # B * 2 (k, v) * H_kv * slots * head_dim * bf16
    assert sizes[1000] == sizes[length] and sizes[length][0] == expected
    # Bookkeeping, reported apart: ring positions (W) and gates (B x W), slot positions and recency (B x M).
    assert sizes[length][1] == 128 * 8 + 2 * 64 * 8 + 2 * 128 * 4 + 2 * 32 * 8
    for b in range(2):
        slot = (cache.memory_positions[b, :32] == 64).nonzero().flatten()
        assert slot.numel() == 1, "the needle left the exact bank"
        held_k, held_v = cache.buffer("k")[b, :, 128 + slot[0]].float(), cache.buffer("v")[b, :, 128 + slot[0]].float()
        assert F.cosine_similarity(held_v, v[b, :, 64], dim=-1).min() >= 0.999
        assert F.cosine_similarity(held_k, k[b, :, 64], dim=-1).min() >= 0.999
        assert (cache.memory_positions[b] >= 0).sum() >= 32  # the haystack's tokens and the summaries


# ----------------------------------------------------------------------------- model-level behaviour


def test_bounded_model_is_deterministic_with_a_seed():
    runs = []
    for _ in range(2):
        model = make_model(MEMORIES["bounded"], seed=7)
        with torch.no_grad():
            logits, cache = run_chunks(model, tokens(2, 48, seed=4), CHUNKS)
        runs.append((logits, cache))
    (a, cache_a), (b, cache_b) = runs
    assert torch.equal(a, b)
    for layer_a, layer_b in zip(cache_a.layers, cache_b.layers, strict=True):
        assert torch.equal(layer_a.positions(), layer_b.positions())
        assert torch.equal(layer_a.buffer("k"), layer_b.buffer("k")) and torch.equal(
            layer_a.buffer("v"), layer_b.buffer("v")
        )
    assert (cache_a.layers[0].memory_positions >= 0).sum() > 0  # the banks were used


def test_bounded_memory_changes_what_long_sequences_see():
    """Past the window the bounded memory is no longer the window: its banks are attended."""
    toks = tokens(1, 48)
    with torch.no_grad():
        bounded, _ = run_chunks(make_model(MEMORIES["bounded"]), toks, CHUNKS)
        window, _ = run_chunks(make_model(MEMORIES["window"]), toks, CHUNKS)
    torch.testing.assert_close(bounded[:, :WINDOW], window[:, :WINDOW], atol=1e-5, rtol=0)
    assert (bounded[:, 24:] - window[:, 24:]).abs().max() > 1e-3


@pytest.mark.parametrize("detach", [False, True])
def test_gradients_flow_through_bank_updates_unless_detached(detach):
    memory = {**MEMORIES["bounded"], "recent_window": 4, "exact_slots": 2, "summary_slots": 2,
              "tau_gate": 0.2, "detach_evicted": detach}  # fmt: skip
    model = make_model(memory).train()
    toks = tokens(2, 25)
    logits, _ = run_chunks(model, toks[:, :-1], (4, 4, 1, 6, 3, 6))
    F.cross_entropy(logits.flatten(0, 1), toks[:, 1:].flatten()).backward()
    block = model.blocks[0]
    assert block.memory.eta_logit.grad is not None and block.memory.eta_logit.grad.abs().sum() > 0
    write_grad = block.memory.write.grad
    if detach:  # the gate only decides; nothing differentiable reaches W_write
        assert write_grad is None or (write_grad == 0).all()
    else:  # eta = sigmoid(eta_logit) * g carries the gradient into the write gate
        assert write_grad is not None and write_grad.abs().sum() > 0 and torch.isfinite(write_grad).all()


def test_bounded_cache_without_its_write_gate_is_an_error():
    cache = BoundedCache(kv_layout(1, 8), 1, MemoryConfig(kind="bounded"), torch.float32)
    with pytest.raises(InputError, match="write gate"):
        cache.update({"k": torch.zeros(1, 1, 2, 8), "v": torch.zeros(1, 1, 2, 8)}, torch.arange(2))
    assert cache.seen == 0
