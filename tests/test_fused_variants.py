"""The fused decode step (attnlab.model.fused, fused.c) for decoupled (DBA) and MLA attention (its absorbed decode)
against the eager static step it replaces, as tests/test_fused_decode.py checks mha, with the same bounds (see that
file's docstring): each step compared from the same state (the eager cache copied into the fused one first), the
logits within TINY_BOUND of their largest, or FLIP_BOUND at a step where some 8-bit layer's input lies within TIE of
a rounding tie; float32 and fp16 weights (no 8-bit codes) within TINY_BOUND at every step. Over the dense float32
cache and QuantizedCaches of per-token formats (decoupled's k_sem, k_geo and v, MLA's latent and k_rope parts, each
in its own format, with residual windows and flushes). Then generate's greedy tokens, fused and eager, equal.
"""

import contextlib
import importlib
import os
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from test_fused_decode import FLIP_BOUND, TIE, TINY_BOUND, free_running, relative_error, ties_watched, two_caches
from test_fused_quantized import copy_state

import attnlab
from attnlab.cache.quantized import QuantizedCache
from attnlab.errors import InputError
from attnlab.generate import static_decode_step
from attnlab.kernels.cpu import fused as fused_kernel
from attnlab.model.fused import FusedDecode, fused_problem
from attnlab.model.qlinear import quantize_weights, set_activations

generate_module = importlib.import_module("attnlab.generate")
# The recovered KV-budget arms (BENCHMARKS.md), trained runs: absent on a clean clone (the slow test then skips)
RUNS = Path(os.environ.get("ATTNLAB_RUNS", Path(__file__).resolve().parents[1] / "runs")) / "smollm2_kv_budget"
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not fused_kernel.available(), reason="no compiler for fused.c, or no AVX2 / AVX-512 VNNI"),
]

# Tiny models (d_model 64, 4 heads unless said, 2 layers): (attention, weights, other config). Per-head widths:
# decoupled (d_sem, d_geo, d_v) / n_heads; MLA head_dim (q_nope), d_rope, v_head_dim and d_latent.
MODELS = {
    "dec-gqa": ({"kind": "decoupled", "d_sem": 64, "d_geo": 64, "d_v": 128, "n_kv_heads": 2}, "fp32", {}),
    "dec-gate-tied": ({"kind": "decoupled", "d_sem": 32, "d_geo": 64, "gate": True, "tie_qk": True}, "fp32", {}),
    # the real arms' shape: 3 query heads per KV head, 8 + 24 key values, V 32 wide
    "dec-gqa3": (
        {"kind": "decoupled", "d_sem": 48, "d_geo": 144, "d_v": 192, "n_kv_heads": 2, "gate": True},
        "fp32",
        {"n_heads": 6},
    ),
    # odd per-head widths (3 + 5 key values, V 9 wide), no RoPE; MQA with odd widths and interleaved RoPE on 6 of 9
    "dec-odd-no-rope": (
        {"kind": "decoupled", "d_sem": 12, "d_geo": 20, "d_v": 36, "n_kv_heads": 2, "gate": True, "rope": False},
        "fp32",
        {},
    ),
    "dec-mqa-odd-fp16-interleaved": (
        {"kind": "decoupled", "d_sem": 12, "d_geo": 24, "d_v": 20, "n_kv_heads": 1},
        "fp16",
        {"rope_interleaved": True},
    ),
    "dec-gqa-q8": ({"kind": "decoupled", "d_sem": 64, "d_geo": 64, "d_v": 128, "n_kv_heads": 2}, "q8_0", {}),
    "dec-tied-q4_1": ({"kind": "decoupled", "d_sem": 32, "d_geo": 64, "gate": True, "tie_qk": True}, "q4_1", {}),
    "mla": ({"kind": "mla", "d_latent": 32}, "fp32", {}),  # latent_norm (RMSNorm on the latent), head_dim 16
    "mla-no-norm-odd-interleaved": (
        {"kind": "mla", "d_latent": 24, "d_rope": 6, "head_dim": 14, "v_head_dim": 20, "latent_norm": False},
        "fp32",
        {"rope_interleaved": True},
    ),
    "mla-arm-like-fp16": (
        {"kind": "mla", "d_latent": 56, "d_rope": 8, "head_dim": 24, "v_head_dim": 16, "latent_norm": False},
        "fp16",
        {"n_heads": 4},
    ),
    # k_up and v_up q8_0 too: the absorbed step reads them dequantized
    "mla-q8": ({"kind": "mla", "d_latent": 32, "d_rope": 16, "head_dim": 24, "v_head_dim": 16}, "q8_0", {}),
}
# Dense float32 caches, then QuantizedCaches: (model, KV policy). k covers decoupled's k_sem and k_geo.
CASES = {name: (name, None) for name in MODELS} | {
    "dec-gqa-q8_0-resid-4": ("dec-gqa", "k=q8_0,v=q4_0,resid=4"),
    "dec-gate-tied-ksem-q4_0-kgeo-q8_0-v-fp16-flush-4": ("dec-gate-tied", "ksem=q4_0,kgeo=q8_0,v=fp16,flush=4"),
    "dec-gqa3-ksem-fp16-kgeo-bf16-v-q4_0": ("dec-gqa3", "ksem=fp16,kgeo=bf16,v=q4_0"),  # k rows of 16 and 48
    "dec-odd-fp16-resid-3": ("dec-odd-no-rope", "k=fp16,v=fp16,resid=3"),
    "dec-gqa-q8-k-q8_0-v-nf4-resid-8": ("dec-gqa-q8", "k=q8_0,v=nf4,resid=8"),
    "mla-latent-q8_0-krope-fp16-resid-4": ("mla", "latent=q8_0,krope=fp16,resid=4"),
    "mla-latent-q4_0": ("mla", "latent=q4_0"),  # k_rope at float32 (the cache's dtype)
    "mla-odd-fp16-resid-1": ("mla-no-norm-odd-interleaved", "latent=fp16,krope=bf16,resid=1"),
    "mla-q8-latent-q8_0-flush-8": ("mla-q8", "latent=q8_0,krope=fp16,resid=2,flush=8"),
    "mla-arm-like-latent-bf16": ("mla-arm-like-fp16", "latent=bf16,krope=fp16,resid=5"),  # a latent of 56
}


def build(name, max_seq_len=128):
    attention, weights, config = MODELS[name]
    model = tiny_model(attention, seed=0, perturb=True, init_std=0.3, max_seq_len=max_seq_len, **config)
    if weights == "fp32":
        return model
    model = quantize_weights(model, weights)
    return model if weights == "fp16" else set_activations(model, "q8")


def copy_dense(eager, mine):
    for a, b in zip(eager.layers, mine.layers, strict=True):
        b.slot_positions.copy_(a.slot_positions)
        for name, buffer in a.buffers.items():
            b.buffers[name].copy_(buffer)


def lockstep(model, prompt, steps, policy=None):
    """Eager static steps and fused steps from the same state each step (the eager cache copied into the fused one,
    the eager step's token fed to both): per step (the logits' largest error relative to their largest, the nearest
    tie of an 8-bit layer's input); asserts equal argmaxes and that the fused step ran."""
    (eager, mine), logits = two_caches(model, prompt, prompt.shape[1] + steps, policy)
    eager.set_static(True)
    step = FusedDecode(model, mine)
    token, positions, errors = logits.argmax(-1, keepdim=True), torch.tensor([eager.seen]), []
    q8 = any(getattr(layer, "activations", None) == "q8" for layer in model.modules())  # ties of 8-bit codes
    with torch.no_grad():
        for i in range(steps):
            (copy_state if policy else copy_dense)(eager, mine)
            with ties_watched(model) if q8 else contextlib.nullcontext([1.0]) as ties:
                want, want_token = static_decode_step(model, token, positions, eager.layers)
            positions += 1
            eager.seen += 1
            got, got_token = step(token)
            assert got.shape == want.shape == (1, model.cfg.vocab_size)
            assert torch.equal(got_token, want_token), f"step {i}: argmax {got_token} against {want_token}"
            errors.append((relative_error(got, want), min(ties)))
            token = want_token
    assert step.steps == steps and mine.seen == eager.seen
    return errors


@pytest.mark.parametrize("case", CASES)
def test_fused_steps_give_the_eager_steps_logits_and_greedy_tokens(case, monkeypatch):
    name, policy = CASES[case]
    model = build(name)
    float_weights = MODELS[name][1] in ("fp32", "fp16")
    prompt = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(1))
    errors = lockstep(model, prompt, steps=40, policy=policy)
    for i, (error, tie) in enumerate(errors):
        bound = FLIP_BOUND if tie < TIE and not float_weights else TINY_BOUND
        assert error <= bound, f"step {i}: {error, tie}"
    assert sum(e[0] <= TINY_BOUND for e in errors) >= 30, errors  # most steps: no code rounded otherwise
    made = []
    monkeypatch.setattr(generate_module, "FusedDecode", lambda *a: made.append(FusedDecode(*a)) or made[-1])
    tokens, options = prompt[0].tolist(), ({"kv_policy": policy} if policy else {})
    fused = attnlab.generate(model, tokens, max_new_tokens=48, **options).tolist()
    assert len(made) == 1 and made[0].steps == 47  # generate took the fused step by itself
    assert len(set(fused)) > 3, "degenerate test model: every step picks the same few tokens"
    if policy:
        assert all(type(layer) is QuantizedCache for layer in made[0].cache.layers)
    if float_weights:
        eager = attnlab.generate(model, tokens, max_new_tokens=48, fused=False, compile=False, **options).tolist()
        assert fused == eager
        return
    # 8-bit activations: free-running, a code that rounds the other way (within TIE of a tie) moves the logits by up
    # to FLIP_BOUND, so the tokens may part where the eager step's two best logits lie that close, and only there.
    eager, mine, logits = free_running(model, prompt, 48, policy)
    assert mine == fused[: len(mine)]  # generate's tokens are the fused step's (up to where the eager ones part)
    if logits is not None:
        best = logits.topk(2).values[0]
        assert (best[0] - best[1]) / logits.abs().max() <= FLIP_BOUND, f"tokens part at step {len(eager) - 1}"


@pytest.mark.parametrize("name", ["mla", "mla-arm-like-fp16", "dec-mqa-odd-fp16-interleaved", "dec-gqa"])
def test_rows_shared_between_threads_give_the_eager_logits_over_several_blocks_of_rows(name):
    """Few sub-groups of query heads (MLA's one latent head, MQA, 2 KV heads) over contexts of 150-170 rows (past
    32 value columns of a latent of 56), on 2 threads as on 1, give the eager step's logits."""
    model = build(name, max_seq_len=256)
    prompt = torch.randint(0, 97, (1, 150), generator=torch.Generator().manual_seed(2))
    for threads in (2, 1):
        torch.set_num_threads(threads)
        errors = lockstep(model, prompt, steps=20)
        assert all(error <= TINY_BOUND for error, _ in errors), (threads, errors)


def refused_cases():
    dec = {"kind": "decoupled", "d_sem": 32, "d_geo": 32}
    return {
        "null_attn": ({**dec, "null_attn": True}, {}, "null_attn"),
        "rope_semantic": ({**dec, "rope_semantic": True}, {}, "rope_semantic"),
        "absorb false": ({"kind": "mla", "d_latent": 32, "absorb": False}, {}, "absorb: false"),
        "kivi keys": (dec, {"policy": "k=kivi4,v=q8_0,group=4"}, "over groups of tokens"),
        "mla fp16 cache": ({"kind": "mla", "d_latent": 32}, {"dtype": torch.float16}, "not float32 latent"),
    }


@pytest.mark.parametrize("case", list(refused_cases()))
def test_options_it_does_not_cover_are_named_and_keep_the_old_path(case, monkeypatch):
    attention, cache_options, reason = refused_cases()[case]
    model = tiny_model(attention, seed=0, perturb=True, init_std=0.3)
    problem = fused_problem(model, model.new_cache(1, 32, **cache_options))
    assert problem is not None and reason in problem, problem
    with pytest.raises(InputError, match="the fused decode step does not apply: .*" + reason):
        FusedDecode(model, model.new_cache(1, 32, **cache_options))
    if "dtype" in cache_options:
        return
    monkeypatch.setattr(generate_module, "FusedDecode", lambda *a: pytest.fail("the fused step was taken"))
    policy = {"kv_policy": cache_options["policy"]} if "policy" in cache_options else {}
    assert attnlab.generate(model, [1, 2, 3, 4, 5], max_new_tokens=4, compile=False, **policy).shape == (4,)


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["decoupled_half", "mla_half"])
def test_recovered_kv_budget_arms_fused_steps_and_greedy_tokens_equal_the_eager_ones(arm):
    """SmolLM2-135M converted to decoupled attention at half the KV bytes (and MLA at half), trained back: float32
    weights, so 16 steps within float32 rounding of the eager step (30 layers) and 32 equal greedy tokens."""
    path = RUNS / arm / "seed0"
    if not (path / "config.json").is_file():
        pytest.skip(f"{path} not found (a trained run; set ATTNLAB_RUNS to the folder holding smollm2_kv_budget)")
    _, model, tokenizer = attnlab.load_model(path)
    assert model.cfg.attention.kind == arm.split("_")[0]
    assert fused_problem(model, model.new_cache(1, 64)) is None
    prompt = tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    errors = lockstep(model, torch.tensor([prompt]), steps=16)
    assert max(e[0] for e in errors) <= TINY_BOUND, errors
    fused = attnlab.generate(model, prompt, max_new_tokens=32, fused=True).tolist()
    assert fused == attnlab.generate(model, prompt, max_new_tokens=32, fused=False, compile=False).tolist()
