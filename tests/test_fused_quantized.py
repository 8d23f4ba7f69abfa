"""The fused decode step (attnlab.model.fused, fused.c) over quantized KV caches (QuantizedCache, per-token formats)
against the eager static step it replaces (the cache's own C op, attnlab::quantized_attend), as
tests/test_fused_decode.py checks it over the dense cache, with the same bounds (see that file's docstring).

What is exact. Each step is compared from the same state (the eager cache copied into the fused one first), so the
tokens that leave the residual window at that step come from the same full-precision rows in both: their stored
bytes must be equal, as must the counters and every ring row but the new token's. Only the new token's own K and V
rows come out of this step's arithmetic (float32 in another order): stored directly (resid 0) they may round to
another code where a value lies within rounding of a code's edge, so they are compared dequantized, within a code
step (STORE_BOUND of the row's largest value), and exactly at most steps.
"""

import importlib

import pytest
import torch
from helpers import tiny_model
from test_fused_decode import (
    FLIP_BOUND,
    SMOLLM_BOUND,
    SMOLLM_TIE,
    TIE,
    TINY_BOUND,
    free_running,
    quantized_tiny,
    relative_error,
    ties_watched,
    two_caches,
)

import attnlab
from attnlab.generate import static_decode_step
from attnlab.kernels.cpu import fused as fused_kernel
from attnlab.model.fused import FusedDecode, fused_problem

generate_module = importlib.import_module("attnlab.generate")
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not fused_kernel.available(), reason="no compiler for fused.c, or no AVX2 / AVX-512 VNNI"),
]
STORE_BOUND = 0.15  # a q4_0 code step is 1/8 of its block's largest value, nf4's up to 0.3 of it between codes / 2

MODELS = {  # KV rows of 32 (2 heads of 16), 64 (2 of 32, 3 query heads each) and 64 (1 of 64, 4 query heads)
    "gqa": ({"kind": "mha", "n_kv_heads": 2}, "q4_1", {}),
    "gqa3-head-dim-32": ({"kind": "mha", "n_kv_heads": 2, "head_dim": 32}, "q4_1", {"n_heads": 6}),
    "mqa4-head-dim-64": ({"kind": "mha", "n_kv_heads": 1, "head_dim": 64}, "q8_0", {}),
    "gqa-fp32-weights": ({"kind": "mha", "n_kv_heads": 2}, "fp32", {}),  # float32 activations: no 8-bit codes
}
# The prompt is 11 tokens: resid=16 stores nothing before the 6th step, then one token a step; flush=8 stores 8
# tokens at a time, flush=4 with resid 0 the new token with the 3 before it.
POLICIES = {
    "fp16": ("gqa", "k=fp16,v=fp16"),
    "q8_0-resid-8": ("gqa3-head-dim-32", "k=q8_0,v=q8_0,resid=8"),
    "q4_0": ("mqa4-head-dim-64", "k=q4_0,v=q4_0"),
    "q4_0-resid-1": ("gqa", "k=q4_0,v=q4_0,resid=1"),
    "q8_0-k-q4_0-v-resid-16": ("gqa", "k=q8_0,v=q4_0,resid=16"),
    "q4_0-k-q8_0-v-resid-4-flush-8": ("gqa3-head-dim-32", "k=q4_0,v=q8_0,resid=4,flush=8"),
    "q8_0-k-fp16-v-flush-4": ("mqa4-head-dim-64", "k=q8_0,v=fp16,flush=4"),
    "nf4-k-bf16-v-resid-3": ("gqa", "k=nf4,v=bf16,resid=3"),
    "fp32-weights-q8_0-k-q4_0-v-resid-4": ("gqa-fp32-weights", "k=q8_0,v=q4_0,resid=4"),
}


def build(name):
    attention, fmt, config = MODELS[name]
    if fmt == "fp32":
        return tiny_model(attention, seed=0, perturb=True, init_std=0.3, max_seq_len=128, **config)
    return quantized_tiny(attention, fmt, **config)


def copy_state(source, dest):
    for a, b in zip(source.layers, dest.layers, strict=True):
        for name in a.store:
            for x, y in zip(a.store[name], b.store[name], strict=True):
                y.copy_(x)
            b.recent[name].copy_(a.recent[name])
        b.counters.copy_(a.counters)


def stored_row(layer, name, slot):
    part = next(p for p in layer.parts if p.name == name)
    return part.codec.decode([a[:, slot : slot + 1] for a in layer.store[name]], torch.float32)


def compare_state(eager, mine, pos):
    """Asserts what must be exact after a step from the same state (counters, stored bytes and ring rows other than
    the new token's); returns (the new token's rows' largest relative error, whether their stored bytes are equal)."""
    error, same = 0.0, True
    for a, b in zip(eager.layers, mine.layers, strict=True):
        assert torch.equal(a.counters, b.counters)
        stored = int(a.counters[1])
        slot = pos % max(a.ring_slots, 1)
        old = [s for s in range(stored) if s != pos]  # every stored token but the new one: from the same rows
        for name in a.store:
            for x, y in zip(a.store[name], b.store[name], strict=True):
                assert torch.equal(x[:, old], y[:, old]), f"layer {name}: stored bytes differ"
                same &= torch.equal(x[:, :stored], y[:, :stored])
            keep = [s for s in range(a.ring_slots) if s != slot]
            assert torch.equal(a.recent[name][:, keep], b.recent[name][:, keep])
            if stored > pos:  # the new token was stored at once
                error = max(error, relative_error(stored_row(b, name, pos), stored_row(a, name, pos)))
            else:
                error = max(error, relative_error(b.recent[name][:, slot], a.recent[name][:, slot]))
    return error, same


def gap(logits, token) -> float:
    """How far below the best of the eager step's logits (1, V) the fused step's choice lies, of the largest |logit|."""
    return ((logits.max() - logits[0, token.item()]) / logits.abs().max()).item()


def lockstep(model, prompt, steps, policy, same_argmax=True):
    """As test_fused_decode.lockstep, over quantized caches: per step (logits error, new rows' error, whether the
    new rows' stored bytes are equal, the nearest tie of a layer's input, the fused choice's gap (`gap`))."""
    (eager, mine), logits = two_caches(model, prompt, prompt.shape[1] + steps, policy)
    eager.set_static(True)
    step = FusedDecode(model, mine)
    token, positions, errors = logits.argmax(-1, keepdim=True), torch.tensor([eager.seen]), []
    with torch.no_grad():
        for i in range(steps):
            copy_state(eager, mine)
            pos = eager.seen
            with ties_watched(model) as ties:
                want, want_token = static_decode_step(model, token, positions, eager.layers)
            positions += 1
            eager.seen += 1
            got, got_token = step(token)
            if same_argmax:
                assert torch.equal(got_token, want_token), f"step {i}: argmax {got_token} against {want_token}"
            rows, same = compare_state(eager, mine, pos)
            errors.append((relative_error(got, want), rows, same, min(ties), gap(want, got_token)))
            token = want_token
    assert step.steps == steps and mine.seen == eager.seen
    return errors


@pytest.mark.parametrize("case", POLICIES)
def test_fused_steps_over_a_quantized_cache_give_the_eager_steps_logits_and_stored_bytes(case):
    name, policy = POLICIES[case]
    model = build(name)
    prompt = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(1))
    errors = lockstep(model, prompt, steps=40, policy=policy)
    for i, (logits, rows, same, tie, _) in enumerate(errors):
        assert logits <= (FLIP_BOUND if tie < TIE else TINY_BOUND), f"step {i}: {logits, tie}"
        assert rows <= (STORE_BOUND if not same else FLIP_BOUND if tie < TIE else TINY_BOUND), f"step {i}: {rows}"
    assert sum(e[0] <= TINY_BOUND for e in errors) >= 30, errors  # most steps: no code rounded otherwise
    assert sum(e[2] for e in errors) >= 30, errors  # and the same bytes stored


@pytest.mark.parametrize(
    "case", ["q8_0-resid-8", "q4_0", "q4_0-k-q8_0-v-resid-4-flush-8", "fp32-weights-q8_0-k-q4_0-v-resid-4"]
)
def test_generate_takes_the_fused_step_over_a_quantized_cache_and_gives_the_eager_tokens(case, monkeypatch):
    name, policy = POLICIES[case]
    model = build(name)
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    made = []
    monkeypatch.setattr(generate_module, "FusedDecode", lambda *a: made.append(FusedDecode(*a)) or made[-1])
    fused = attnlab.generate(model, prompt, max_new_tokens=72, kv_policy=policy).tolist()
    assert len(made) == 1 and made[0].steps == 71
    eager = attnlab.generate(model, prompt, max_new_tokens=72, kv_policy=policy, fused=False, compile=False)
    assert fused == eager.tolist()
    assert len(set(fused)) > 3, "degenerate test model: every step picks the same few tokens"


def test_kivi_and_batched_quantized_caches_keep_the_old_path():
    model = build("gqa")
    for policy, reason in (("k=kivi4,v=q8_0", "k=kivi4 over groups of tokens"), ("v=kivi4", "v=kivi4 (the fused")):
        assert reason in fused_problem(model, model.new_cache(1, 32, policy=policy))
    assert "batch 1" in fused_problem(model, model.new_cache(2, 32, policy="k=q8_0,v=q8_0"))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["k=q8_0,v=q8_0,resid=16", "k=q4_0,v=q4_0"])
def test_smollm_fused_steps_over_a_quantized_cache_within_the_q8_bound(smollm_q8, policy):
    """SmolLM2's own weights, 64 steps each from the eager step's state: the stored bytes of the tokens leaving the
    window equal (compare_state), the logits within SMOLLM_BOUND, and the fused step's argmax the eager step's or
    within SMOLLM_TIE of it."""
    model, tokenizer = smollm_q8
    prompt = torch.tensor([tokenizer.encode("The capital of France is Paris, and the capital of Italy is")])
    errors = lockstep(model, prompt, steps=64, policy=policy, same_argmax=False)
    worst = max(e[0] for e in errors)
    assert worst <= SMOLLM_BOUND, f"largest error {worst:.3g} of the largest logit"
    assert sum(e[0] <= TINY_BOUND for e in errors) >= 3, errors
    assert max(e[4] for e in errors) <= SMOLLM_TIE, errors


@pytest.mark.slow
def test_smollm_fused_greedy_tokens_over_a_quantized_cache_leave_the_eager_ones_only_at_near_ties(smollm_q8):
    """72 greedy tokens per prompt over a q8_0 K / q4_0 V cache (every token stored at once): the same tokens up to
    the first step where the eager step's two best logits lie within SMOLLM_TIE (where either may be chosen, as
    test_fused_decode says), and generate's fused tokens are the fused step's."""
    model, tokenizer = smollm_q8
    policy = "k=q8_0,v=q4_0"
    texts = ["Write a short story about a robot who learns to paint.", "List three uses of a paperclip:",
             "def fibonacci(n):"]  # fmt: skip
    for text in texts:
        prompt = tokenizer.encode(text)
        eager, fused, logits = free_running(model, torch.tensor([prompt]), 72, policy)
        if logits is not None:
            best = logits.topk(2).values[0]
            gap = ((best[0] - best[1]) / logits.abs().max()).item()
            assert gap <= SMOLLM_TIE, f"{text!r}: tokens differ at step {len(eager) - 1}, a gap of {gap:.3g}"
        got = attnlab.generate(model, prompt, max_new_tokens=len(fused), kv_policy=policy, fused=True).tolist()
        assert got == fused
