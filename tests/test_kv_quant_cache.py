"""Quantized KV caches: policies, measured bytes, and exactness against a plain fake-quantized cache."""

import pytest
import torch
from helpers import tiny_model

import attnlab
from attnlab import quant
from attnlab.accounting import kv_report
from attnlab.cache.codecs import KVPolicy
from attnlab.cache.dense import DenseCache
from attnlab.errors import ConfigError, InputError
from attnlab.generate import can_compile_on_cpu
from attnlab.kernels import cpu as cpu_kernels
from attnlab.kernels.cpu import ops as cpp_ops

MHA = {"kind": "mha", "n_kv_heads": 2}  # a token's k row: 2 heads x 16 = 32 values, one block
DECOUPLED = {"kind": "decoupled", "d_sem": 32, "d_geo": 64, "d_v": 64}  # rows: k_sem 32, k_geo 64, v 64
MLA = {"kind": "mla", "d_latent": 32, "d_rope": 8}  # rows: latent 32, k_rope 8
SLIDING = {"kind": "sliding", "window": 24}


def model_for(attention, n_layers=2):
    return tiny_model(attention, n_layers=n_layers, max_seq_len=96)


def tokens(n, batch=2, seed=1):
    return torch.randint(0, 97, (batch, n), generator=torch.Generator().manual_seed(seed))


# -- policies ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        "ksem=q4_0,kgeo=q8_0,v=q4_0,resid=128",
        "k=q8_0,v=q4_0",
        "latent=nf4,krope=fp16,resid=16",
        "k=kivi2,v=kivi4,group=64",
    ],
)
def test_policy_prints_back_identically(text):
    assert str(KVPolicy.parse(text)) == text


def test_policy_long_names_and_lookup():
    policy = KVPolicy.parse("k_sem=q4_0, k=q8_0 ,resid=8")
    assert policy.format_of("k_sem", "fp32") == "q4_0"
    assert policy.format_of("k_geo", "fp32") == "q8_0"  # k covers both key paths unless one is named
    assert policy.format_of("v", "fp32") == "fp32"
    assert policy.resid == 8 and str(policy) == "ksem=q4_0,k=q8_0,resid=8"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("k=q3_k", "unknown format"),
        ("k", "name=value"),
        ("k=q8_0,k=q4_0", "twice"),
        ("resid=-1", "whole number"),
        ("k=q8_0,group=0", "group=0"),
        ("k=q8_0,flush=0", "flush=0"),
    ],
)
def test_bad_policies_are_config_errors(text, message):
    with pytest.raises(ConfigError, match=message):
        KVPolicy.parse(text)


def test_policy_naming_a_tensor_the_model_does_not_cache():
    with pytest.raises(ConfigError, match="'ksem'.*use k, v"):
        model_for(MHA).new_cache(1, 16, policy="ksem=q4_0")


def test_block_format_needs_rows_of_32():
    with pytest.raises(ConfigError, match="k_rope row has 8 values"):
        model_for(MLA).new_cache(1, 16, policy="krope=q8_0")


# -- bytes -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("attention", "text", "per_value"),
    [
        (MHA, "k=q8_0,v=q4_0,resid=16", {"k": 34 / 32, "v": 18 / 32}),
        (DECOUPLED, "ksem=q4_0,kgeo=q8_0,v=q4_0,resid=8", {"k_sem": 18 / 32, "k_geo": 34 / 32, "v": 18 / 32}),
        (MLA, "latent=nf4,krope=fp16", {"latent": 18 / 32, "k_rope": 2}),
        (MHA, "k=fp16,v=kivi4,group=16,resid=4", {"k": 2, "v": 0.5 + 4 / 16}),
    ],
)
@pytest.mark.parametrize("max_len", [8, 64])
def test_nbytes_equals_the_analytic_figure(attention, text, per_value, max_len):
    model = model_for(attention)
    policy = KVPolicy.parse(text)
    widths = model.cfg.attention.cache_layout(model.cfg).values_per_token()  # values per token per layer, by tensor
    fp32_rows = min(policy.resid, max_len)  # the residual window, at full precision
    expected = sum(widths[name] * (per_value[name] * (max_len - fp32_rows) + 4 * fp32_rows) for name in widths)
    cache = model.new_cache(2, max_len, policy=policy)
    assert cache.nbytes() == 2 * model.cfg.n_layers * expected  # batch 2
    model(tokens(min(max_len, 20)), cache=cache)
    assert cache.nbytes() == 2 * model.cfg.n_layers * expected  # preallocated: filling does not grow it
    report = kv_report(model.cfg, "fp32", max_len, policy)
    assert report["kv_bytes"] == model.cfg.n_layers * expected
    assert report["kv_bytes_per_token"] == pytest.approx(
        model.cfg.n_layers * sum(widths[n] * per_value[n] for n in widths)
    )


# -- exactness ------------------------------------------------------------------------------------------
class FakeQuantCache(DenseCache):
    """The plain reference: a dense cache whose rows are replaced by dequantize(quantize(row)) once they
    are older than the residual window at the start of an update (`group` tokens at a time). Every token gets
    a slot (a sliding window is then only the mask)."""

    def __init__(self, layout, batch, policy, max_len, group=1):
        super().__init__(layout, batch, max_len, torch.float32)
        self.parts, self.policy, self.group, self.done = (
            {b: [(f.name, f.width) for f in fs] for b, fs in layout.buffers},
            policy,
            group,
            0,
        )

    def roundtrip(self, rows, name):
        fmt = self.policy.format_of(name, "fp32")
        if fmt == "fp32":
            return rows
        if fmt in ("fp16", "bf16"):
            return rows.to(getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[fmt])).float()
        if fmt.startswith("kivi"):
            bits, is_key = int(fmt[4:]), name.startswith("k")
            q = quant.quantize_kivi(rows, bits, self.policy.group_size, is_key)
            return quant.dequantize_kivi(q, bits, self.policy.group_size, is_key, rows.shape[-1])
        return quant.dequantize(quant.quantize(rows, fmt), fmt)

    def update(self, new, positions, write=None):
        target = self.done + max(0, (self.length - self.policy.resid - self.done) // self.group) * self.group
        if target > self.done:
            for buffer, names in self.parts.items():
                x = self.buffers[buffer][..., self.done : target, :]  # (B, H, n, d) or (B, n, d)
                lo = 0
                for name, width in names:
                    part = x[..., lo : lo + width]
                    if part.dim() == 4:  # a token's row over all KV heads
                        rows = part.transpose(1, 2).flatten(2)
                        back = self.roundtrip(rows, name).unflatten(-1, (part.shape[1], width)).transpose(1, 2)
                    else:
                        back = self.roundtrip(part, name)
                    x[..., lo : lo + width] = back
                    lo += width
            self.done = target
        return super().update(new, positions)


def fake_quant_cache(model, batch, max_len, policy, group=1):
    layers = [FakeQuantCache(block.attn.layout, batch, policy, max_len, group) for block in model.blocks]
    return attnlab.cache.ModelCache(layers)


def run(model, cache, ids, prefill):
    """Chunked prefill of `prefill` tokens, then one token at a time: the logits of every position."""
    with torch.no_grad():
        out = [model(ids[:, :prefill], cache=cache)[0]]
        out += [model(ids[:, t : t + 1], cache=cache)[0] for t in range(prefill, ids.shape[1])]
    return torch.cat(out, dim=1)


CASES = [  # attention, policy, tokens per quantized block, prefill length
    (MHA, "k=q8_0,v=q4_0,resid=8", 1, 21),
    (MHA, "k=nf4,v=q8_0", 1, 21),
    (DECOUPLED, "ksem=q4_0,kgeo=q8_0,v=q4_0,resid=8", 1, 21),
    (MLA, "latent=q4_0,krope=fp16,resid=4", 1, 21),
    (MHA, "k=kivi2,v=kivi4,group=8,resid=4", 8, 21),
    (MHA, "k=q8_0,v=q4_0,resid=4,flush=8", 8, 21),  # flush: 8 tokens quantized together
    (SLIDING, "k=q8_0,v=q4_0,resid=4", 1, 21),
    (SLIDING, "k=q4_0,v=q8_0,resid=6", 1, 40),  # a prefill chunk longer than the window
]


@pytest.mark.parametrize(
    ("attention", "text", "group", "prefill"), CASES, ids=[f"{c[0]['kind']}-{c[1]}" for c in CASES]
)
def test_quantized_decode_equals_a_cache_of_dequantized_values(attention, text, group, prefill):
    # The ring (sliding) cache sums its keys in slot order, the reference in position order: rounding
    # differences of 1e-6 in layer 1's output can flip a rounding step of layer 2's quantized keys, so the
    # sliding cases use one layer, where both caches quantize identical values.
    model, policy = model_for(attention, n_layers=1 if attention is SLIDING else 2), KVPolicy.parse(text)
    ids = tokens(60)
    got = run(model, model.new_cache(2, 64, policy=policy), ids, prefill)
    want = run(model, fake_quant_cache(model, 2, 64, policy, group), ids, prefill)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    full, _ = model(ids, use_cache=False)
    assert (got - full).abs().max() > 1e-4  # the quantization is really there


@pytest.mark.parametrize("attention", [MHA, DECOUPLED, MLA, SLIDING], ids=lambda a: a["kind"])
def test_residual_window_covering_the_sequence_equals_full_precision_exactly(attention):
    model = model_for(attention)
    fields = model.cfg.attention.cache_layout(model.cfg).values_per_token()
    text = ",".join(f"{'krope' if f == 'k_rope' else f.replace('_', '')}=q4_0" for f in fields if f != "k_rope")
    ids = tokens(40)
    got = run(model, model.new_cache(2, 40, policy=text + ",resid=40"), ids, prefill=13)
    want = run(model, model.new_cache(2, 40), ids, prefill=13)
    if attention is SLIDING:  # the ring cache orders a decode step's keys differently: same values, summed
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)  # in another order
    else:
        assert torch.equal(got, want)


def test_sliding_quantized_cache_stays_bounded_and_positions_track_the_window():
    model = model_for(SLIDING)
    cache = model.new_cache(1, 96, policy="k=q8_0,v=q8_0,resid=4")
    before = cache.nbytes()
    run(model, cache, tokens(90, batch=1), prefill=50)
    assert cache.nbytes() == before
    assert sorted(cache.layers[0].positions().tolist()) == list(range(90 - 24, 90))


def test_full_cache_is_an_input_error():
    model = model_for(MHA)
    cache = model.new_cache(1, 8, policy="k=q8_0,resid=2")
    with pytest.raises(InputError, match="max_len=8"):
        model(tokens(9, batch=1), cache=cache)


def test_flush_keeps_up_to_flush_minus_one_more_rows_at_full_precision():
    model = model_for(MHA)
    row = model.cfg.attention.cache_layout(model.cfg).values_per_token()["k"]  # 32 values per token per tensor
    cache = model.new_cache(1, 64, policy="k=q8_0,v=q8_0,resid=16,flush=16")
    expected = 2 * model.cfg.n_layers * row * (48 * 34 / 32 + (16 + 15) * 4)  # 48 stored rows, a ring of 31
    assert cache.nbytes() == expected == kv_report(model.cfg, "fp32", 64, "k=q8_0,v=q8_0,resid=16,flush=16")["kv_bytes"]
    run(model, cache, tokens(40, batch=1), prefill=5)
    assert cache.layers[0].stored == 16  # 40 - 16 = 24 tokens left the window: one block of 16 is quantized


# -- the CPU kernel path (attend_one) ----------------------------------------------------------------------------
KERNEL_CASES = [
    (MHA, "k=q8_0,v=q4_0,resid=4"),  # GQA: 4 query heads over 2 KV heads
    ({"kind": "mha"}, "k=nf4,v=fp16,flush=4"),
    ({"kind": "mha", "n_kv_heads": 1}, "k=fp16,v=bf16"),  # MQA (rows of 16: float formats), no window
    (DECOUPLED, "ksem=q4_0,kgeo=q8_0,v=q4_0,resid=8"),  # two key parts in two formats
    (MLA, "latent=q4_0,krope=fp16,resid=4"),  # absorbed: K = [latent | k_rope], V = latent
    (MLA, "latent=q8_0,krope=bf16"),
]


@pytest.mark.skipif(not cpu_kernels.available(), reason="no working C compiler for the CPU kernels")
@pytest.mark.parametrize(("attention", "text"), KERNEL_CASES, ids=[f"{a['kind']}-{t}" for a, t in KERNEL_CASES])
def test_kernel_decode_equals_the_pytorch_path(attention, text, monkeypatch):
    # One layer: both paths then store identical values (with two, sums in another order move layer 2's keys by
    # 1e-7, which can flip a bf16 rounding and shows as 1e-4 in the logits).
    model, ids = model_for(attention, n_layers=1), tokens(60)
    calls = []
    attend = cpu_kernels.attend
    monkeypatch.setattr(cpu_kernels, "attend", lambda *a, **k: calls.append(a[0]) or attend(*a, **k))
    got = run(model, model.new_cache(2, 64, policy=text), ids, prefill=21)
    assert len(calls) == 39  # every decode step read its layer's stored rows through the kernel
    assert all(keys[0][3] > 0 for keys in calls)  # stored rows, not only the window
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    want = run(model, model.new_cache(2, 64, policy=text), ids, prefill=21)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(got[:, :21], want[:, :21])  # the prompt's chunk does not use the kernels


@pytest.mark.skipif(not cpu_kernels.available(), reason="no working C compiler for the CPU kernels")
def test_kernel_greedy_tokens_equal_the_pytorch_path(monkeypatch):
    model, prompt = model_for(MHA), tokens(30, batch=1)[0]
    got = attnlab.generate(model, prompt, max_new_tokens=40, kv_policy="k=q4_0,v=q4_0,resid=8", compile=False)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    want = attnlab.generate(model, prompt, max_new_tokens=40, kv_policy="k=q4_0,v=q4_0,resid=8", compile=False)
    assert torch.equal(got, want)


def test_kernel_path_is_skipped_where_it_does_not_apply(monkeypatch):
    """KIVI formats, a bounded (sliding) cache, a gradient: attend_one declines, having stored nothing."""
    calls = []
    monkeypatch.setattr(cpu_kernels, "attend", lambda *a, **k: calls.append(a))
    for attention, text in ((MHA, "k=kivi4,v=kivi4,group=8"), (SLIDING, "k=q8_0,v=q8_0")):
        model = model_for(attention)
        run(model, model.new_cache(2, 64, policy=text), tokens(40), prefill=20)
    assert calls == []
    model = model_for(MHA)
    cache = model.new_cache(1, 64, policy="k=q8_0,v=q8_0")
    model(tokens(8, batch=1), cache=cache)
    layer = cache.layers[0]
    q = torch.randn(1, 4, 1, 16, requires_grad=True)
    new = {"k": torch.randn(1, 2, 1, 16), "v": torch.randn(1, 2, 1, 16)}
    assert layer.attend_one(q, new, torch.tensor([8]), layer.layout.read, 0.25) is None and layer.seen == 8


# -- static mode: generate's compiled step ------------------------------------------------------------------------
STATIC_CASES = [c for c in KERNEL_CASES if c[0] is not MLA or "resid" in c[1]]


@pytest.fixture(params=["python", "cpp"])
def static_operator(request, monkeypatch):
    """The static step's operator: attnlab::quantized_attend (Python) or attnlab_cpp::quantized_attend (ops.cpp,
    where it builds). Yields the exception type its errors have (C++ operators raise RuntimeError)."""
    if request.param == "python":
        monkeypatch.setattr(cpp_ops, "usable", lambda: False)
        yield InputError
    else:
        if not cpp_ops.load():
            pytest.skip("the C++ operators do not build here")
        yield RuntimeError


@pytest.mark.skipif(not cpu_kernels.available(), reason="no working C compiler for the CPU kernels")
@pytest.mark.parametrize(("attention", "text"), STATIC_CASES, ids=[f"{a['kind']}-{t}" for a, t in STATIC_CASES])
def test_static_mode_steps_equal_the_eager_kernel_steps(attention, text, static_operator):
    """The static step (forward_at, attention as the quantized_attend op, run eagerly here) computes exactly what
    the eager kernel path computes, and leaves the cache in the same state, with either operator."""
    from attnlab.generate import static_decode_step

    model, ids = model_for(attention), tokens(40)
    caches = [model.new_cache(2, 64, policy=text) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(ids[:, :21], cache=cache)
        assert all(layer.supports_static() for layer in caches[1].layers)
        caches[1].set_static(True)
        positions = torch.tensor([21])
        for t in range(21, 40):
            want = model(ids[:, t : t + 1], cache=caches[0])[0][:, -1]
            got, _ = static_decode_step(model, ids[:, t : t + 1], positions, caches[1].layers)
            positions += 1
            caches[1].seen += 1
            assert torch.equal(got, want)
    caches[1].set_static(False)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert (a.seen, a.stored) == (b.seen, b.stored) and torch.equal(a.positions(), b.positions())
        assert all(torch.equal(x, y) for n in a.store for x, y in zip(a.store[n], b.store[n], strict=True))


def test_leaving_a_mode_the_cache_is_not_in_changes_nothing():
    model = model_for(MHA)
    cache = model.new_cache(1, 64, policy="k=q8_0,v=q8_0,resid=4")
    with torch.no_grad():
        model(tokens(20, batch=1), cache=cache)
    cache.set_static(False)  # not in static mode: its counters stay
    assert [(layer.seen, layer.stored) for layer in cache.layers] == [(20, 16), (20, 16)]
    cache.set_static(True)
    cache.set_static(True)
    cache.set_static(False)
    assert [(layer.seen, layer.stored) for layer in cache.layers] == [(20, 16), (20, 16)]


def test_a_static_quantized_cache_takes_one_token_per_step():
    model = model_for(MHA)
    cache = model.new_cache(1, 64, policy="k=q8_0,v=q8_0")
    with torch.no_grad():
        model(tokens(8, batch=1), cache=cache)
        cache.set_static(True)
        with pytest.raises(InputError, match="one token per step"):
            model.forward_at(tokens(4, batch=1), torch.arange(8, 12), cache.layers)
    assert [layer.seen for layer in cache.layers] == [8, 8]  # nothing stored


def test_caches_without_a_static_mode():
    """KIVI keys (groups of tokens), a sliding window, a null key: generate decodes them eagerly."""
    null = {"kind": "bottleneck", "d_attn": 64, "null_attn": True}  # rows of 64
    for attention, text in ((MHA, "k=kivi4,v=q8_0"), (SLIDING, "k=q8_0,v=q8_0"), (null, "k=q8_0")):
        cache = model_for(attention).new_cache(1, 64, policy=text)
        assert not cache.supports_static()
        with pytest.raises(InputError, match="no static mode"):
            cache.set_static(True)


def test_copies_of_a_quantized_cache_hold_their_own_state():
    import copy

    cache = model_for(MHA).new_cache(1, 64, policy="k=q8_0,v=q8_0")
    twin = copy.deepcopy(cache)
    assert twin.layers[0].store["k"][0] is not cache.layers[0].store["k"][0]
    assert twin.layers[0].counters is not cache.layers[0].counters


def test_the_static_op_declares_every_tensor_it_writes():
    """The op takes the cache's stored blocks, residual ring and counters as arguments and declares them mutated,
    so a compiled graph cannot drop or reorder the write (no global table of caches)."""
    for op in (torch.ops.attnlab.quantized_attend, torch.ops.attnlab_cpp.quantized_attend):  # Python, C++
        schema = op.default._schema
        written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert written == ["store", "recent", "counters"]
        assert not schema.returns[0].alias_info  # a new tensor


@pytest.mark.skipif(
    not (cpu_kernels.available() and can_compile_on_cpu()),
    reason="needs the C kernels and a C++ compiler for torch.compile",
)
@pytest.mark.slow
@pytest.mark.parametrize(  # each variant compiled with one of the two operators (a cold compile takes ~20-35 s);
    ("attention", "text", "static_operator"),  # mha with a policy compiles in test_generate's regional test
    [(DECOUPLED, "ksem=q4_0,kgeo=q8_0,v=q4_0,resid=8", "python"), (MLA, "latent=q4_0", "cpp")],
    ids=["decoupled-python", "mla-cpp"], indirect=["static_operator"],
)  # fmt: skip
def test_compiled_generate_with_a_quantized_cache_gives_the_eager_tokens(attention, text, static_operator):
    from torch.profiler import profile

    name = "attnlab_cpp::quantized_attend" if static_operator is RuntimeError else "attnlab::quantized_attend"
    model, prompt = model_for(attention), tokens(30, batch=1)[0]
    run = dict(max_new_tokens=24, kv_policy=text, fused=False)  # (the fused step decodes these models by default)
    want = attnlab.generate(model, prompt, compile=False, **run)
    assert torch.equal(attnlab.generate(model, prompt, compile=True, **run), want)
    with profile() as prof:  # counts every operator's calls (the compiled step's only: compiled already)
        got = attnlab.generate(model, prompt, compile=True, **run)
    assert torch.equal(got, want)
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get(name) == 23 * model.cfg.n_layers  # every decode step went through the static op


@pytest.mark.skipif(not cpu_kernels.available(), reason="no working C compiler for the CPU kernels")
def test_a_full_static_quantized_cache_is_an_error_not_a_write_past_its_arrays(static_operator):
    from attnlab.generate import static_decode_step

    model = model_for(MHA)
    cache = model.new_cache(1, 24, policy="k=q8_0,v=q8_0,resid=2")
    ids = tokens(30, batch=1)
    with torch.no_grad():
        model(ids[:, :20], cache=cache)
        cache.set_static(True)
        positions = torch.tensor([20])
        for t in range(20, 24):  # room for 4 more
            static_decode_step(model, ids[:, t : t + 1], positions, cache.layers)
            positions += 1
        with pytest.raises(static_operator, match="KV cache is full: 25 tokens exceed its max_len=24"):
            static_decode_step(model, ids[:, 24:25], positions, cache.layers)
