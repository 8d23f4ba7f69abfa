"""The bounded memory's options where the authors' code (coda-gqa-l 1.3.1, which produced the CoDA-GQA-L
paper's numbers) departs from the paper's text, and `memory.preset: reference` that sets the code's values.

Without the package: the config (presets fill what is left out, dicts and hashes of existing configs
unchanged, every bad value refused), the write parameters' init, and exact identities (the reference's per-token
options keep block reading equal to decoding; the block summary update against a plain reference).

With the package (`pip install coda-gqa-l==1.3.1 --no-deps`, in the `test` extra; skipped when absent): its
constructor defaults are the preset; after weight transfer the same slots are chosen, step by step, on a long
synthetic stream decoded token by token (exact bank: which token each slot holds and its LRU time; summary bank:
its prototypes), and every option the preset sets is needed for that; chunked, its top-k candidates and block
summary update are matched too; and three of the places where attnlab keeps its own behaviour because the code
is defective (README, "The reference preset") are shown on the package itself.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import kv_layout, tiny_config, tiny_model

from attnlab.attention.registry import REGISTRY
from attnlab.cache import BoundedCache, Write
from attnlab.cache.banks import MemoryWrite, offered
from attnlab.config import MEMORY_PRESETS, MemoryConfig
from attnlab.config_io import model_config_from_dict
from attnlab.errors import ConfigError
from attnlab.memory import load_state, save_state

pytestmark = pytest.mark.usefixtures("one_thread")

H, H_KV, HEAD_DIM, D_MODEL = 4, 2, 16, 64
REFERENCE = {"kind": "bounded", "preset": "reference"}
# What a bounded memory's dict held before these options existed: its hash must not move.
OLD_KEYS = ["kind", "recent_window", "sink_tokens", "heavy_slots", "exact_slots", "summary_slots", "tau_gate",
            "tau_novel", "tau_match", "write_policy", "detach_evicted"]  # fmt: skip


# ----------------------------------------------------------------------------- the config


def test_the_reference_preset_fills_what_is_left_out_and_written_options_win():
    cfg = MemoryConfig(**REFERENCE)
    assert {key: getattr(cfg, key) for key in MEMORY_PRESETS["reference"]} == MEMORY_PRESETS["reference"]
    assert (cfg.tau_gate, cfg.summary_gate, cfg.write_bias, cfg.eta_logit_init) == (0.10, 0.05, -2.0, -3.0)
    # Written beside the preset, a value wins, null included (null is a value: every candidate, no bias).
    mixed = MemoryConfig(**REFERENCE, tau_gate=0.5, exact_candidates=None, write_bias=None)
    assert (mixed.tau_gate, mixed.exact_candidates, mixed.write_bias, mixed.summary_candidates) == (0.5, None, None, 64)
    for memory in (cfg, mixed):  # the dict says what runs, and reads back as the same config (JSON, hashable)
        assert MemoryConfig(**json.loads(json.dumps(memory.to_dict()))) == memory
        assert hash(memory) == hash(MemoryConfig(**memory.to_dict()))
    assert MemoryConfig(**REFERENCE, write_policy="none").write_bias is None  # no gate to bias
    default = MemoryConfig(kind="bounded")
    assert default.summary_gate == default.tau_gate == 0.5 and default.write_bias is None
    assert list(default.to_dict()) == OLD_KEYS  # configs written before keep their dict and hash
    assert list(MemoryConfig(kind="window").to_dict()) == OLD_KEYS
    cfg = model_config_from_dict({**tiny_config().to_dict(), "memory": {**REFERENCE, "recent_window": 16}})
    assert cfg.memory == MemoryConfig(**REFERENCE, recent_window=16)
    assert model_config_from_dict(json.loads(json.dumps(cfg.to_dict())), saved=True).config_hash() == cfg.config_hash()


def test_bad_preset_options_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"unknown value memory\.preset='refrence' \(did you mean 'reference'\?\)"):
        MemoryConfig(kind="bounded", preset="refrence")
    with pytest.raises(ConfigError, match=r"memory\.preset belongs to memory\.kind bounded, not window"):
        MemoryConfig(kind="window", preset="reference")
    with pytest.raises(ConfigError, match=r"memory\.summary_update belongs to memory\.kind bounded, not h2o"):
        MemoryConfig(kind="h2o", summary_update="block")
    with pytest.raises(ConfigError) as error:
        MemoryConfig(kind="bounded", exact_candidates=0, summary_candidates=-3, tau_gate_summary=1.5,
                     exact_refresh="always", summary_routing="best", summary_update="batch", write_policy="none",
                     write_bias=-2.0)  # fmt: skip
    assert error.value.problems == [
        "memory.tau_gate_summary=1.5 must be in [0, 1]",
        "memory.exact_candidates=0 must be >= 1 (or null: every token leaving the window; no exact bank at all is "
        "exact_slots: 0)",
        "memory.summary_candidates=-3 must be >= 1 (or null: every token leaving the window; no summary bank at all "
        "is summary_slots: 0)",
        "memory.exact_refresh='always' is not known (use 'tau_match' or 'tau_novel')",
        "memory.summary_routing='best' is not known (use 'novelty' or 'argmax')",
        "memory.summary_update='batch' is not known (use 'sequential' or 'block')",
        "memory.write_bias=-2.0 needs memory.write_policy: gated (with write_policy 'none' there is no write gate "
        "to bias)",
    ]
    with pytest.raises(ConfigError, match=r"memory\.summary_energy_scale='yes' must be bool"):
        model_config_from_dict({**tiny_config().to_dict(), "memory": {**REFERENCE, "summary_energy_scale": "yes"}})


def test_the_write_parameters_start_as_the_preset_says():
    plain = tiny_model({"kind": "mha", "n_kv_heads": 2}, {"kind": "bounded"}).blocks[0].memory
    assert [name for name, _ in plain.named_parameters()] == ["write", "eta_logit"]  # as before the options
    assert (plain.eta_logit == 0).all()
    model = tiny_model({"kind": "mha", "n_kv_heads": 2}, REFERENCE)
    memory = model.blocks[0].memory
    assert (
        (memory.write == 0).all() and memory.write_bias.tolist() == [-2.0] and memory.eta_logit.tolist() == [-3.0] * 2
    )
    x = torch.randn(2, 5, D_MODEL)
    torch.testing.assert_close(memory(x).gate, torch.full((2, 5), 1 / (1 + math.exp(2.0))))  # 0.12 everywhere
    torch.testing.assert_close(memory(x).eta, torch.full((2,), 1 / (1 + math.exp(3.0))))


def test_a_reference_memory_state_file_reloads_and_continues_exactly(tmp_path):
    model = tiny_model({"kind": "coda", "n_kv_heads": 2}, {**REFERENCE, "recent_window": 8, "exact_slots": 4,
                       "summary_slots": 4, "exact_candidates": 3, "summary_candidates": 5}, perturb=True)  # fmt: skip
    toks = torch.randint(0, 97, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, original = model(toks[:, :40], use_cache=True)
        header = save_state(tmp_path / "s.safetensors", model, original)
        loaded, read = load_state(tmp_path / "s.safetensors", model)
        assert read == header and read["memory"]["preset"] == "reference"
        for piece in (toks[:, 40:52], *toks[:, 52:].split(1, dim=1)):
            assert torch.equal(model(piece, cache=original)[0], model(piece, cache=loaded)[0])
    assert (original.layers[0].memory_positions >= 0).sum() > 4  # both banks in use


# ----------------------------------------------------------------------------- identities without the package


def test_offered_takes_the_largest_gates_of_a_block_ties_to_the_older_token():
    gate = torch.tensor([[0.2, 0.9, 0.2, 0.5, 0.05, 0.2], [0.3, 0.3, 0.3, 0.3, 0.3, 0.3]])
    assert offered(gate, 0.1, 3).tolist() == [[True, True, False, True, False, False], [True] * 3 + [False] * 3]
    assert offered(gate, 0.1, None).tolist() == [[True, True, True, True, False, True], [True] * 6]
    assert offered(gate, 0.25, 6).tolist() == [[False, True, False, True, False, False], [True] * 6]


@pytest.mark.parametrize("attention", [{"kind": "coda", "n_kv_heads": 2}, {"kind": "mla", "d_latent": 32}])
def test_the_references_per_token_options_keep_reading_in_blocks_equal_to_decoding(attention):
    """Per-bank gates, a gate bias, refreshes by any known token, argmax summary routing and the energy scale
    all act token by token: with the block options (top-k candidates, block summary update) off, a sequence
    read in uneven chunks gives the logits of decoding it token by token."""
    memory = {**REFERENCE, "recent_window": 8, "exact_slots": 4, "summary_slots": 3, "exact_candidates": None,
              "summary_candidates": None, "summary_update": "sequential", "tau_gate": 0.4, "tau_gate_summary": 0.2,
              "write_bias": 0.0}  # fmt: skip
    model = tiny_model(attention, memory, max_seq_len=128, perturb=True)
    toks = torch.randint(0, 97, (2, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        chunked, cache = [], model.new_cache(2)
        for start, size in zip((0, 5, 6, 15, 18, 31, 33, 47), (5, 1, 9, 3, 13, 2, 14, 13), strict=True):
            logits, cache = model(toks[:, start : start + size], cache=cache)
            chunked.append(logits)
        stepped, steps = [], model.new_cache(2)
        for t in range(60):
            logits, steps = model(toks[:, t : t + 1], cache=steps)
            stepped.append(logits)
    torch.testing.assert_close(torch.cat(chunked, 1), torch.cat(stepped, 1), atol=1e-4, rtol=0)
    for a, b in zip(cache.layers, steps.layers, strict=True):
        assert torch.equal(a.memory_positions, b.memory_positions)
        assert (a.memory_positions[:, 4:] >= 0).any()  # the summary bank was written


def test_the_block_summary_update_is_one_gate_weighted_ema_step_per_slot():
    """summary_update block with argmax routing on two clusters (orthogonal on the low-frequency channels, the
    first cluster's direction scoring above an empty slot's 0, the second's below): per chunk, each slot moves
    once by eta = sigmoid(eta_logit) (1 when it opens) towards the gate-weighted mean of what the chunk routed to
    it against the prototypes as they were before the chunk; low-frequency key channels stored x sqrt(2)."""
    memory = MemoryConfig(**REFERENCE, recent_window=2, exact_slots=0, summary_slots=3, tau_gate_summary=0.0)
    g = torch.Generator().manual_seed(0)
    dim, length = 8, 26
    cluster = torch.tensor([i % 2 for i in range(length)])
    centers_k = torch.zeros(2, dim)
    centers_k[0, [2, 3]], centers_k[1, [2, 3]] = torch.tensor([3.0, 0.0]), torch.tensor([-3.0, 0.5])  # LF: 2, 3, 6, 7
    k = (centers_k[cluster] + 0.1 * torch.randn(length, dim, generator=g))[None, None]  # (1, 1, N, D)
    v = torch.randn(1, 1, length, dim, generator=g)
    gate = torch.rand(1, length, generator=g)
    eta = torch.tensor([0.3])
    cache = BoundedCache(kv_layout(1, dim), 1, memory, torch.float32)
    low = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1.0]) * math.sqrt(2)  # what a prototype stores of a key
    expected_k, expected_v, used = torch.zeros(3, dim), torch.zeros(3, dim), [False] * 3
    start = 0
    for size in (6, 8, 12):
        left = range(max(0, start - 2), start + size - 2)  # the tokens that leave the window in this chunk
        before = F.normalize(expected_k * low, dim=-1)
        slots = [int((before @ F.normalize(k[0, 0, p] * low, dim=-1)).argmax()) for p in left]
        for slot in set(slots):
            members = [p for p, s in zip(left, slots, strict=True) if s == slot]
            weights = gate[0, members] / gate[0, members].sum()
            rate = 1.0 if not used[slot] else eta
            expected_k[slot] += rate * ((weights[:, None] * k[0, 0, members] * low).sum(0) - expected_k[slot])
            expected_v[slot] += rate * ((weights[:, None] * v[0, 0, members]).sum(0) - expected_v[slot])
            used[slot] = True
        cache.update({"k": k[:, :, start : start + size], "v": v[:, :, start : start + size]},
                     torch.arange(start, start + size), Write(gate[:, start : start + size], eta))  # fmt: skip
        start += size
        torch.testing.assert_close(cache.buffer("k")[0, 0, 2:], expected_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.buffer("v")[0, 0, 2:], expected_v, atol=1e-5, rtol=1e-5)
    assert used == [True, True, False]  # both clusters were routed: the first to slot 0, the second opened slot 1


# ----------------------------------------------------------------------------- against the package


@pytest.fixture(scope="module")
def coda_gqa_l():
    return pytest.importorskip("coda_gqa_l", reason="the authors' package: pip install coda-gqa-l==1.3.1 --no-deps")


def pair(package, window, exact, summary, length, interleaved=True, seed=0, **memory):
    """attnlab's CoDA attention, write parameters and config beside the package's CoDAGQALandmarkPerf2 of the
    same shape, with every weight moved off its init (random, per-head lambda biases, a shared head-norm gain,
    gates spread around both thresholds, per-head EMA logits) and transferred."""
    memory = {**REFERENCE, "recent_window": window, "exact_slots": exact, "summary_slots": summary, **memory}
    cfg = tiny_config({"kind": "coda", "n_kv_heads": H_KV}, memory, rope_interleaved=interleaved, norm_eps=1e-6,
                      max_seq_len=length)  # fmt: skip
    torch.manual_seed(seed)
    attn = REGISTRY["coda"].build(cfg, 0).eval()
    write = MemoryWrite(cfg.d_model, attn.layout.heads, cfg.memory)
    theirs = package.CoDAGQALandmarkPerf2(
        embed_dim=D_MODEL, num_heads=H, num_kv_heads=H_KV, window=window, num_landmarks_exact=exact,
        num_landmarks_summary=summary, rope_interleaved=interleaved,
    ).eval()  # fmt: skip
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in (attn.qkv.weight, attn.out.weight, attn.gate.weight):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        attn.theta.add_(torch.randn(attn.theta.shape, generator=g) * 0.3)
        attn.gate.bias.copy_(torch.randn(H, generator=g) - 1)
        gain = 1 + 0.2 * torch.randn(HEAD_DIM, generator=g)
        attn.head_norm.weight.copy_(gain.expand(H, HEAD_DIM))  # the package shares one gain across heads
        write.write.copy_(torch.randn(D_MODEL, generator=g) * 0.25)
        write.eta_logit.copy_(torch.tensor([-3.0, -1.0]))
        q, k, v = attn.qkv.weight.split((H * HEAD_DIM, H_KV * HEAD_DIM, H_KV * HEAD_DIM))
        theirs.q_proj.weight.copy_(q), theirs.k_proj.weight.copy_(k), theirs.v_proj.weight.copy_(v)
        theirs.theta.copy_(attn.theta), theirs.o_proj.weight.copy_(attn.out.weight)
        theirs.lambda_proj.weight.copy_(attn.gate.weight), theirs.lambda_proj.bias.copy_(attn.gate.bias)
        theirs.head_norm.weight.copy_(gain)
        theirs.write_proj.weight.copy_(write.write[None]), theirs.write_proj.bias.copy_(write.write_bias)
        theirs.summary_eta_logit.copy_(write.eta_logit)
    return attn, write, theirs, cfg


def stream(length, batch=2, vocabulary=24, noise=0.5, seed=3):
    """(B, N, d_model) inputs: `vocabulary` token embeddings plus noise, so that values of the same token have
    cosines around tau_novel and tau_match (exact-bank hits, medium matches and near misses); ids (B, N)."""
    g = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(vocabulary, D_MODEL, generator=g)
    ids = torch.randint(0, vocabulary, (batch, length), generator=g)
    return embeddings[ids] + noise * torch.randn(batch, length, D_MODEL, generator=g), ids


def held_positions(slot_v, all_v):
    """The stream position of the token each slot holds, found by its value: slot_v (B, H, M, D) against
    all_v (B, H, N, D) -> (B, M), -1 where no token matches within 1e-5."""
    distance = (slot_v[:, :, :, None] - all_v[:, :, None]).abs().amax(dim=(1, 4))  # (B, M, N)
    best, position = distance.min(dim=2)
    return torch.where(best < 1e-5, position, -1)


def banks(cache: BoundedCache):
    """attnlab's banks as the package lays them out: used (B, M_e + M_s), k and v (B, H, M_e + M_s, D)."""
    window = cache.recent_window  # (copies: buffer() may return the stored tensor, which the next step changes)
    return (
        cache.memory_positions >= 0,
        cache.buffer("k")[:, :, window:].clone(),
        cache.buffer("v")[:, :, window:].clone(),
    )


def decode(attn, write, x, cache):
    """attnlab decoding x (B, N, d_model) token by token: outputs (B, N, d_model), the banks after every step."""
    outputs, states = [], []
    with torch.no_grad():
        for t in range(x.shape[1]):
            y, cache = attn(x[:, t : t + 1], torch.tensor([t]), cache, write(x[:, t : t + 1]))
            outputs.append(y)
            states.append((*banks(cache), cache.memory_positions.clone(), cache.exact_last_used.clone()))
    return torch.cat(outputs, dim=1), states


WINDOW, EXACT, SUMMARY, LENGTH = 16, 8, 8, 480


@pytest.fixture(scope="module")
def decoded(coda_gqa_l):
    """The package decoding a 480-token stream (30 windows) token by token: its outputs and banks per step."""
    attn, write, theirs, cfg = pair(coda_gqa_l, WINDOW, EXACT, SUMMARY, LENGTH)
    x, ids = stream(LENGTH)
    state = theirs.init_state(batch_size=2, device=torch.device("cpu"), dtype=torch.float32, mem_init="zeros")
    outputs, states = [], []
    with torch.no_grad():
        all_v = theirs.v_proj(x).unflatten(-1, (H_KV, HEAD_DIM)).transpose(1, 2)  # (B, H_kv, N, D)
        for t in range(LENGTH):
            y, state = theirs.step(x[:, t : t + 1], state)
            outputs.append(y)
            states.append((state.allowed[:, WINDOW:].clone(), state.k_buf[:, :, WINDOW:].clone(),
                           state.v_buf[:, :, WINDOW:].clone(), state.mem_last_exact.clone()))  # fmt: skip
    return {"outputs": torch.cat(outputs, dim=1), "states": states, "x": x, "ids": ids, "all_v": all_v}


def test_the_preset_is_the_packages_defaults(coda_gqa_l):
    cfg = MemoryConfig(**REFERENCE)
    theirs = coda_gqa_l.CoDAGQALandmarkPerf2(embed_dim=D_MODEL, num_heads=H, num_kv_heads=H_KV, window=16,
                                             num_landmarks_exact=8, num_landmarks_summary=8)  # fmt: skip
    assert (theirs.write_gate_threshold_exact, theirs.write_gate_threshold_summary) == (cfg.tau_gate, cfg.summary_gate)
    assert (theirs.exact_novelty_threshold, theirs.exact_match_threshold) == (cfg.tau_novel, cfg.tau_match)
    assert (theirs.exact_candidates_per_block, theirs.summary_candidates_per_block) == (
        cfg.exact_candidates,
        cfg.summary_candidates,
    )
    assert theirs.write_policy == cfg.write_policy and theirs.detach_evicted == cfg.detach_evicted
    assert not theirs.exact_refresh_on_hit and theirs.summary_overwrite_on_insert  # a hit only touches; eta = 1
    assert (theirs.write_proj.weight == 0).all() and theirs.write_proj.bias.tolist() == [cfg.write_bias]
    assert theirs.summary_eta_logit.tolist() == [cfg.eta_logit_init] * H_KV
    cache = BoundedCache(kv_layout(H_KV, HEAD_DIM, interleaved=True), 1, cfg, torch.float32)
    assert cache.stored["k"].max().item() == pytest.approx(theirs.energy_scale)  # sqrt(2)
    assert (cache.lf["k"].nonzero().flatten() == torch.arange(theirs.lf_start, HEAD_DIM)).all()  # the LF band
    ours = MemoryWrite(D_MODEL, H_KV, cfg)
    x = torch.randn(3, 7, D_MODEL)
    torch.testing.assert_close(ours(x).gate, theirs._write_gate(x))


def test_decoding_chooses_the_packages_slots_at_every_step(coda_gqa_l, decoded):
    """Token by token over 30 windows: the exact bank holds the same token in the same slot with the same LRU
    time, the summary bank the same prototypes in the same slots, and the outputs agree, at every step."""
    attn, write, _, cfg = pair(coda_gqa_l, WINDOW, EXACT, SUMMARY, LENGTH)
    x, all_v = decoded["x"], decoded["all_v"]
    outputs, states = decode(attn, write, x, attn.new_cache(2, LENGTH, torch.float32, memory=cfg.memory))
    replaced = refreshed = 0
    for t, (ours, theirs) in enumerate(zip(states, decoded["states"], strict=True)):
        (used, k, v, positions, last_used), (their_used, their_k, their_v, their_last_used) = ours, theirs
        assert torch.equal(used, their_used), f"step {t}: the banks fill different slots"
        exact = used[:, :EXACT]
        their_positions = held_positions(their_v[:, :, :EXACT], all_v)
        assert torch.equal(torch.where(exact, their_positions, -1), positions[:, :EXACT]), f"step {t}: exact bank"
        assert torch.equal(torch.where(exact, their_last_used, -1), torch.where(exact, last_used, -1)), f"step {t}: LRU"
        torch.testing.assert_close(k, their_k * used[:, None, :, None], atol=1e-6, rtol=1e-6)  # empty slots: ours 0
        torch.testing.assert_close(v, their_v * used[:, None, :, None], atol=1e-6, rtol=1e-6)
        if t:
            before = states[t - 1][3][:, :EXACT]
            replaced += int(((before >= 0) & (before != positions[:, :EXACT])).sum())
            refreshed += int(((states[t - 1][4] != last_used) & (before == positions[:, :EXACT])).sum())
    torch.testing.assert_close(outputs, decoded["outputs"], atol=1e-4, rtol=1e-4)
    # The stream exercised the banks: LRU replacements, refreshes, a full summary bank's prototypes moving.
    assert replaced > 50 and refreshed > 50 and bool(states[-1][0][:, EXACT:].sum(1).ge(3).all())
    assert (states[-1][3][:, :EXACT] >= 0).all()


@pytest.mark.parametrize(
    "change",
    [{"tau_gate": 0.5}, {"tau_gate_summary": None}, {"exact_refresh": "tau_match"}, {"summary_routing": "novelty"},
     {"summary_energy_scale": False}],
    ids=lambda change: next(iter(change)),
)  # fmt: skip
def test_each_option_of_the_preset_is_needed_to_match_the_package(coda_gqa_l, decoded, change):
    attn, write, _, cfg = pair(coda_gqa_l, WINDOW, EXACT, SUMMARY, LENGTH, **change)
    _, states = decode(attn, write, decoded["x"], attn.new_cache(2, LENGTH, torch.float32, memory=cfg.memory))
    assert any(
        not torch.equal(ours[0], theirs[0]) or not torch.allclose(ours[2], theirs[2] * ours[0][:, None, :, None])
        for ours, theirs in zip(states, decoded["states"], strict=True)
    )


def chunked(attn, write, theirs, cfg, x, block):
    """Both read x in blocks of `block` tokens; yields (block end, attnlab's cache, the package's state)."""
    state = theirs.init_state(batch_size=x.shape[0], device=torch.device("cpu"), dtype=torch.float32, mem_init="zeros")
    cache = attn.new_cache(x.shape[0], x.shape[1], torch.float32, memory=cfg.memory)
    with torch.no_grad():
        for start in range(0, x.shape[1], block):
            part = x[:, start : start + block]
            _, cache = attn(part, torch.arange(start, start + part.shape[1]), cache, write(part))
            _, state = theirs.prefill_chunked(part, state, block_size=block)
            yield start + part.shape[1], cache, state


def exact_blocks(package, **change):
    """Blocks of 40 tokens (about 40 leave a 16-token window each), every token new, 12 exact slots, no summary
    bank: per block, each side's exact bank as sorted (position held, LRU time) pairs per sequence (slot order
    aside: the package assigns its LRU victims in topk's unsorted order)."""
    attn, write, theirs, cfg = pair(package, 16, 12, 0, 240, **change)
    x = torch.randn(2, 240, D_MODEL, generator=torch.Generator().manual_seed(5))  # no token twice: all novel
    all_v = theirs.v_proj(x).unflatten(-1, (H_KV, HEAD_DIM)).transpose(1, 2).detach()
    for end, cache, state in chunked(attn, write, theirs, cfg, x, 40):
        their_positions = torch.where(state.allowed[:, 16:], held_positions(state.v_buf[:, :, 16:], all_v), -1)
        their_last_used = torch.where(their_positions >= 0, state.mem_last_exact, -1)
        sides = ((cache.memory_positions, cache.exact_last_used), (their_positions, their_last_used))
        yield end, *[[sorted(zip(p.tolist(), t.tolist(), strict=True)) for p, t in zip(*side, strict=True)]
                     for side in sides]  # fmt: skip


def summary_blocks(package, **change):
    """Blocks of 40 tokens, 6 summary slots, at most 12 summary candidates a block (the package's
    summary_candidates_per_block set to match), no exact bank: per block, each side's (used, k, v)."""
    attn, write, theirs, cfg = pair(package, 16, 0, 6, 320, **{"summary_candidates": 12, **change})
    theirs.summary_candidates_per_block = 12
    x = torch.randn(2, 320, D_MODEL, generator=torch.Generator().manual_seed(5))
    for end, cache, state in chunked(attn, write, theirs, cfg, x, 40):
        used = state.allowed[:, 16:]
        yield end, banks(cache), (used, state.k_buf[:, :, 16:] * used[:, None, :, None],
                                  state.v_buf[:, :, 16:] * used[:, None, :, None])  # fmt: skip


def test_chunked_the_exact_bank_takes_the_packages_top_candidates(coda_gqa_l):
    """The exact bank is offered the 8 tokens of a block with the largest gates (that pass 0.10) and holds the
    package's tokens with its LRU times after every block. (Summary bank off: see README on why.)"""
    for end, ours, theirs in exact_blocks(coda_gqa_l):
        assert ours == theirs, f"after {end} tokens"
    assert all(position >= 0 for bank in ours for position, _ in bank)  # full, and replaced since (8 a block)


def test_chunked_the_summary_bank_is_the_packages_block_update(coda_gqa_l):
    """The same slots hold the same prototypes after every block."""
    for end, (used, k, v), (their_used, their_k, their_v) in summary_blocks(coda_gqa_l):
        assert torch.equal(used, their_used), f"after {end} tokens"
        torch.testing.assert_close(k, their_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, their_v, atol=1e-5, rtol=1e-5)
    assert int(used.sum(1).min()) >= 4  # several prototypes, opened and moved block after block


@pytest.mark.parametrize(
    "bank, change",
    [("exact", {"exact_candidates": None}), ("exact", {"exact_candidates": 7}), ("exact", {"tau_gate": 0.2}),
     ("summary", {"summary_candidates": None}), ("summary", {"summary_update": "sequential"}),
     ("summary", {"summary_routing": "novelty"})],
    ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}={v}" for k, v in x.items()),
)  # fmt: skip
def test_each_block_option_of_the_preset_is_needed_to_match_the_package(coda_gqa_l, bank, change):
    if bank == "exact":
        assert any(ours != theirs for _, ours, theirs in exact_blocks(coda_gqa_l, **change))
    else:
        assert any(not torch.equal(ours[0], theirs[0]) or not torch.allclose(ours[1], theirs[1], atol=1e-5)
                   for _, ours, theirs in summary_blocks(coda_gqa_l, **change))  # fmt: skip


# ----------------------------------------------------------------------------- where attnlab keeps its own behaviour


def test_the_packages_block_queries_see_more_than_the_window(coda_gqa_l):
    """Defect (1): in the package's chunked prefill a block's queries see the whole ring before the block (up to
    W + block - 1 recent tokens), so its chunked outputs differ from its own decoding; attnlab's chunked outputs
    equal the package's decoding (banks off: only the window rule is compared)."""
    attn, write, theirs, cfg = pair(coda_gqa_l, 8, 0, 0, 64)
    x, _ = stream(64)
    state = theirs.init_state(batch_size=2, device=torch.device("cpu"), dtype=torch.float32, mem_init="zeros")
    with torch.no_grad():
        their_steps = torch.cat([theirs.step(x[:, t : t + 1], state)[0] for t in range(64)], dim=1)
        fresh = theirs.init_state(batch_size=2, device=torch.device("cpu"), dtype=torch.float32, mem_init="zeros")
        their_chunks, _ = theirs.prefill_chunked(x, fresh, block_size=16)
        cache = attn.new_cache(2, 64, torch.float32, memory=cfg.memory)
        ours = torch.cat([attn(x[:, s : s + 16], torch.arange(s, s + 16), cache, write(x[:, s : s + 16]))[0]
                          for s in range(0, 64, 16)], dim=1)  # fmt: skip
    torch.testing.assert_close(ours, their_steps, atol=1e-4, rtol=1e-4)
    # Within the first window they agree; from the W-th query of a block on, the block sees more than W tokens.
    torch.testing.assert_close(their_chunks[:, :8], their_steps[:, :8], atol=1e-4, rtol=1e-4)
    assert (their_chunks[:, 8:16] - their_steps[:, 8:16]).abs().amax(dim=-1).min() > 1e-3


def test_the_package_inserts_a_token_twice_from_one_block(coda_gqa_l):
    """Defect (2): the package routes a block's candidates against the bank as it was before the block, so the
    same token leaving the window twice in one block takes two exact slots; attnlab routes them in turn (as its
    decoding and the package's own decoding do) and the second is a match."""
    attn, write, theirs, cfg = pair(coda_gqa_l, 4, 4, 0, 16, exact_candidates=None, tau_gate=0.0)
    theirs.exact_candidates_per_block, theirs.write_gate_threshold_exact = 16, 0.0
    x = torch.randn(1, 16, D_MODEL, generator=torch.Generator().manual_seed(0))
    x[:, 2] = x[:, 0]  # token 0 again at position 2; both leave the window during the first block
    _, cache, state = next(chunked(attn, write, theirs, cfg, x, 8))  # the first block: tokens 0-3 leave
    all_v = theirs.v_proj(x).unflatten(-1, (H_KV, HEAD_DIM)).transpose(1, 2).detach()
    their_positions = held_positions(state.v_buf[:, :, 4:], all_v)[0]  # (the first match of each value)
    assert state.allowed[0, 4:].all() and their_positions.tolist().count(0) == 2  # token 0 in two slots
    assert sorted(cache.memory_positions[0].tolist()) == [-1, 0, 1, 3]  # attnlab: once; a slot stays free


def test_the_packages_summary_band_under_half_split_rope_holds_high_frequencies(coda_gqa_l):
    """Defect (3): the package's low-frequency band is channels [D/2, D) whatever the RoPE layout. Under
    half-split RoPE (its Llama adapter's) those are the second channels of every rotary pair, the fastest
    included: a summary prototype keeps half of each pair, high frequencies too. attnlab keeps the low-frequency
    pairs whole, in either layout (cache.layout.low_frequency_channels)."""
    _, _, theirs, cfg = pair(coda_gqa_l, 4, 0, 2, 32, interleaved=False)
    state = theirs.init_state(batch_size=1, device=torch.device("cpu"), dtype=torch.float32, mem_init="zeros")
    with torch.no_grad():
        theirs.prefill_chunked(stream(32, batch=1)[0], state, block_size=8)
    prototype = state.k_buf[0, :, 4]  # (H_kv, D)
    half = HEAD_DIM // 2
    assert (prototype[:, :half] == 0).all() and (prototype[:, half] != 0).all()  # pair 0 (fastest) split in two
    ours = BoundedCache(kv_layout(H_KV, HEAD_DIM, interleaved=False), 1, cfg.memory, torch.float32)
    pairs = [(i, i + half) for i in range(half)]
    assert [bool(ours.blend["k"][a]) for a, _ in pairs] == [bool(ours.blend["k"][b]) for _, b in pairs]
    assert ours.blend["k"].nonzero().flatten().tolist() == [4, 5, 6, 7, 12, 13, 14, 15]  # pairs 4-7, whole
