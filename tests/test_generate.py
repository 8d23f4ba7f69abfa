"""generate(): greedy, sampling filters, seeds, stop tokens, batches, bad input, and the compiled decode step."""

import importlib
import warnings

import pytest
import torch
from helpers import tiny_model

import attnlab
from attnlab.errors import AttnlabWarning, InputError, LengthWarning
from attnlab.generate import compiled_decode_step, prefill_last, sample

generate_module = importlib.import_module("attnlab.generate")  # the module (attnlab.generate is the function)


SIZES = {"vocab_size": 50, "d_model": 32, "max_seq_len": 48}  # 2 layers of 4 heads


@pytest.fixture(scope="module")
def model():
    return tiny_model(init_std=0.2, **SIZES)


def greedy_reference(model, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        logits, _ = model(torch.tensor([tokens]), use_cache=False)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_greedy_matches_full_recompute(model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert attnlab.generate(model, prompt, max_new_tokens=12).tolist() == greedy_reference(model, prompt, 12)


def test_chunked_prefill_gives_the_same_tokens(model):
    prompt = list(range(1, 30))
    whole = attnlab.generate(model, prompt, max_new_tokens=6)
    assert attnlab.generate(model, prompt, max_new_tokens=6, prefill_chunk=7).tolist() == whole.tolist()


def test_stops_at_stop_token_and_includes_it(model):
    prompt = [3, 1, 4]
    free = attnlab.generate(model, prompt, max_new_tokens=10).tolist()
    stop = free[3]
    first = free.index(stop)
    out = attnlab.generate(model, prompt, max_new_tokens=10, stop_tokens=[stop]).tolist()
    assert out == free[: first + 1]


def test_sampling_is_reproducible_with_a_seed(model):
    kwargs = dict(max_new_tokens=16, temperature=1.0, seed=123)
    a = attnlab.generate(model, [1, 2, 3], **kwargs)
    b = attnlab.generate(model, [1, 2, 3], **kwargs)
    c = attnlab.generate(model, [1, 2, 3], **{**kwargs, "seed": 124})
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    greedy = attnlab.generate(model, [7, 8], max_new_tokens=10).tolist()
    assert attnlab.generate(model, [7, 8], max_new_tokens=10, temperature=1.5, top_k=1, seed=0).tolist() == greedy
    assert attnlab.generate(model, [7, 8], max_new_tokens=10, temperature=1.5, top_p=1e-6, seed=0).tolist() == greedy


def test_sample_filters_keep_only_allowed_tokens():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]])  # probabilities ~ .03 .64 .23 .09 .01
    gen = torch.Generator().manual_seed(0)
    top_k = {int(sample(logits, 1.0, 2, None, gen)) for _ in range(200)}
    assert top_k == {1, 2}
    top_p = {int(sample(logits, 1.0, None, 0.8, gen)) for _ in range(200)}  # .64 + .23 reaches 0.8
    assert top_p == {1, 2}


def test_batch_generation_matches_single(model):
    prompts = torch.tensor([[1, 2, 3, 4], [9, 8, 7, 6]])
    batch = attnlab.generate(model, prompts, max_new_tokens=8)
    assert batch.shape == (2, 8)
    for row in range(2):
        assert batch[row].tolist() == attnlab.generate(model, prompts[row], max_new_tokens=8).tolist()


def test_generation_stops_at_max_seq_len_and_says_so(model):
    with pytest.warns(LengthWarning, match=r"prompt of 40 tokens leaves room for 8 new tokens of the "
                                           r"max_new_tokens=100 asked \(max_seq_len 48\): generating 8"):  # fmt: skip
        out = attnlab.generate(model, list(range(1, 41)), max_new_tokens=100)
    assert len(out) == 48 - 40


def test_a_kv_policy_that_quantizes_nothing_in_this_generation_says_so(model):
    """Probe K's k30: a residual window as long as the whole generation keeps every token in full precision, and
    generate ran the plain cache without a word (info and kv-eval said so for the same policy)."""
    prompt = list(range(1, 9))
    with pytest.warns(AttnlabWarning, match=r"kv_policy k=q4_0,v=q4_0,resid=1000 quantizes nothing in this "
                                            r"generation: its residual window \(resid=1000\) keeps all 12 tokens "
                                            r"at full precision"):  # fmt: skip
        out = attnlab.generate(model, prompt, max_new_tokens=5, kv_policy="k=q4_0,v=q4_0,resid=1000")
    assert out.tolist() == attnlab.generate(model, prompt, max_new_tokens=5).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttnlabWarning)  # a policy that quantizes some tokens: no warning
        attnlab.generate(model, prompt, max_new_tokens=5, kv_policy="k=q4_0,v=q4_0,resid=4")


def test_bad_input_is_a_clear_error(model):
    with pytest.raises(InputError, match=r"prompt of 48 tokens .* max_seq_len=48"):
        attnlab.generate(model, [1] * 48, max_new_tokens=1)
    with pytest.raises(InputError, match="prompt is empty"):
        attnlab.generate(model, [], max_new_tokens=1)
    with pytest.raises(InputError, match="temperature"):
        attnlab.generate(model, [1], temperature=-1)
    with pytest.raises(InputError, match="exceeds max_seq_len=48"):
        model(torch.zeros(1, 49, dtype=torch.long))


def test_generate_continues_a_given_cache(model):
    prompt = list(range(1, 21))
    whole = attnlab.generate(model, prompt, max_new_tokens=8).tolist()
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.tensor([prompt[:12]]), cache=cache)
    assert attnlab.generate(model, prompt[12:], max_new_tokens=8, cache=cache).tolist() == whole
    assert cache.seen == 20 + 8 - 1  # the last new token is returned, not fed
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.tensor([prompt]), cache=cache)
    with pytest.warns(LengthWarning, match="prompt of 1 token after the cache's 20 leaves room for 27 new tokens"):
        out = attnlab.generate(model, [5], max_new_tokens=100, cache=cache)  # room left: 48 - 20 - 1 positions
    assert len(out) == 48 - 21
    with pytest.raises(InputError, match=r"prompt of 28 tokens after the cache's \d+ .* max_seq_len=48"):
        attnlab.generate(model, [1] * 28, cache=cache)
    with pytest.raises(InputError, match="kv_policy"):
        attnlab.generate(model, [1], cache=model.new_cache(1), kv_policy="k=q8_0,v=q8_0")


# ----------------------------------------------------------------------------- compiled decode (torch.compile)
# Each case compiles the decode step once (seconds): keep these few and small.

COMPILED_CASES = {  # plain mha compiles in test_one_compiled_region_serves_every_layer_and_every_length
    # Grouped KV heads (gqa, mqa take mha's path with fewer KV heads) here; and 2 + 4 dims per head: attend keeps
    # SDPA under compile for heads this narrow (the others use plain ops).
    "decoupled-null-gqa": {"kind": "decoupled", "d_sem": 8, "d_geo": 16, "null_attn": True, "n_kv_heads": 2},
    "mla-absorbed": {"kind": "mla", "d_latent": 16},
}


def small_model(attention: dict):
    return tiny_model(attention, init_std=0.3, **SIZES)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPILED_CASES))
def test_compiled_decode_matches_eager_and_full_recompute(name):
    model = small_model(COMPILED_CASES[name])
    prompt = torch.randint(0, 50, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    # prefill_chunk 5: the 13-token prompt goes in as 5 + 5 + 3, then 20 single-token steps.
    compiled = attnlab.generate(model, prompt, max_new_tokens=20, prefill_chunk=5, compile=True, fused=False).tolist()
    assert model in generate_module._COMPILED  # the compiled step ran (fullgraph: no silent eager parts)
    eager = attnlab.generate(model, prompt, max_new_tokens=20, prefill_chunk=5, compile=False, fused=False).tolist()
    assert compiled == eager == greedy_reference(model, prompt, 20)
    assert len(set(compiled)) > 3, "degenerate test model: every step picks the same few tokens"

    # Logits, teacher-forced along a fixed sequence, against the full forward. The cache has the size
    # generate gave it (48 = max_seq_len), so the step compiled above is reused.
    tokens = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(3))  # (1, T)
    with torch.no_grad():
        full, _ = model(tokens, use_cache=False)  # (1, T, V)
        cache = model.new_cache(1, 48)
        logits = [prefill_last(model, tokens[:, :13], cache, chunk_size=5)]
        cache.set_static(True)
        step, positions = compiled_decode_step(model), torch.tensor([13])
        for t in range(13, 40):
            step_logits, greedy = step(model, tokens[:, t : t + 1], positions, cache.layers)
            assert torch.equal(greedy, step_logits.argmax(dim=-1, keepdim=True))
            logits.append(step_logits)
            positions += 1
    torch.testing.assert_close(torch.stack(logits, dim=1), full[:, 12:], atol=1e-4, rtol=0)


def test_sliding_window_falls_back_to_eager_decode():
    model = small_model({"kind": "sliding", "window": 6})  # a ring cache: no static mode
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]  # 8 + 12 tokens: the ring wraps
    out = attnlab.generate(model, prompt, max_new_tokens=12, compile=True, fused=False).tolist()
    assert model not in generate_module._COMPILED
    assert out == attnlab.generate(model, prompt, max_new_tokens=12, compile=False, fused=False).tolist()
    assert out == greedy_reference(model, prompt, 12)


def test_recompile_limit_falls_back_to_eager_decode(monkeypatch):
    monkeypatch.setattr(generate_module, "RECOMPILE_LIMIT", 1)  # one compiled shape for this model
    model = small_model({"kind": "mha"})
    prompts = torch.tensor([[1, 2, 3, 4], [9, 8, 7, 6]])
    first = attnlab.generate(model, prompts[0], max_new_tokens=6, compile=True, fused=False)  # compiles batch 1
    with pytest.warns(UserWarning, match="decoding eagerly"):
        batch = attnlab.generate(model, prompts, max_new_tokens=6, compile=True, fused=False)  # batch 2: a new shape
    assert batch[0].tolist() == first.tolist()
    assert batch.tolist() == attnlab.generate(model, prompts, max_new_tokens=6, compile=False, fused=False).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("kv_policy", [None, "k=q8_0,v=q4_0"])
def test_one_compiled_region_serves_every_layer_and_every_length(kv_policy):
    """Regional compilation: the 3 blocks share one graph (parameters and caches are its inputs), and a new
    prompt length and cache length compile nothing more (its sizes are symbolic; a quantized cache's room is a
    tensor its op reads, not part of the op's plan)."""
    from attnlab.kernels import cpu as cpu_kernels

    if kv_policy and not cpu_kernels.available():
        pytest.skip("no C compiler: a quantized cache has no static mode")
    model = tiny_model({"kind": "mha"}, init_std=0.3, n_layers=3, **SIZES)  # K and V rows of 32 values
    torch._dynamo.utils.counters.clear()
    first = attnlab.generate(
        model, [1, 2, 3, 4, 5], max_new_tokens=8, compile=True, fused=False, kv_policy=kv_policy
    ).tolist()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one region compiled, not one per layer
    second = attnlab.generate(
        model, list(range(1, 20)), max_new_tokens=20, compile=True, fused=False, kv_policy=kv_policy
    )
    second = second.tolist()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # other lengths: nothing compiled again
    for prompt, n, got in [([1, 2, 3, 4, 5], 8, first), (list(range(1, 20)), 20, second)]:
        eager = attnlab.generate(
            model, prompt, max_new_tokens=n, compile=False, fused=False, kv_policy=kv_policy
        ).tolist()
        assert got == eager
        if kv_policy is None:
            assert got == greedy_reference(model, prompt, n)


def test_auto_compile_waits_until_the_tokens_left_pay_for_it(monkeypatch):
    model = small_model({"kind": "mha"})
    prompt = [3, 1, 4, 1, 5]
    # A compile that never pays: a short generation stays eager and compiles nothing.
    monkeypatch.setattr(generate_module, "COMPILE_SECONDS", 1e9)
    eager = attnlab.generate(model, prompt, max_new_tokens=30, fused=False).tolist()
    assert model not in generate_module._COMPILED
    assert eager == greedy_reference(model, prompt, 30)
    # One that always pays: generate times EAGER_STEPS_TIMED + 1 eager steps, then switches to the compiled step
    # in the middle of the generation, with the same tokens.
    monkeypatch.setattr(generate_module, "COMPILE_SECONDS", 0.0)
    assert attnlab.generate(model, prompt, max_new_tokens=30, fused=False).tolist() == eager
    step = generate_module._COMPILED[model]
    assert step.compiled and not step.eager
    # Compiled already: auto uses the step from the first decode step on, whatever the cost.
    monkeypatch.setattr(generate_module, "COMPILE_SECONDS", 1e9)
    calls = []
    monkeypatch.setattr(step, "run_block", lambda *a, real=step.run_block: calls.append(1) or real(*a))
    assert attnlab.generate(model, prompt, max_new_tokens=6, fused=False).tolist() == eager[:6]
    assert len(calls) == 5 * model.cfg.n_layers  # every decode step through the compiled region


def test_compiling_pays_weighs_the_tokens_left():
    seconds = generate_module.COMPILE_SECONDS / generate_module.COMPILE_SAVES
    assert not generate_module.compiling_pays(0.01, int(seconds / 0.01) - 1)
    assert generate_module.compiling_pays(0.01, int(seconds / 0.01) + 1)
