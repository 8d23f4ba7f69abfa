"""memory.kind quest (cache/sparse.py): Quest's page selection with a recent window and sinks, against a plain
reference written with loops; exact identities (every page chosen = the dense cache); chunked = token by token."""

from __future__ import annotations

import pytest
import torch
from helpers import CACHE_VARIANTS, kv_layout, tiny_config, tiny_model

from attnlab.accounting import kv_report
from attnlab.cache import attend_cache
from attnlab.cache.build import build_cache
from attnlab.cache.sparse import QuestCache
from attnlab.config import MemoryConfig
from attnlab.errors import ConfigError
from attnlab.kernels import cpu
from attnlab.kernels.cpu import quest as quest_kernel

ATTENTION = CACHE_VARIANTS


def reference(q, k, v, memory: MemoryConfig, scale: float) -> torch.Tensor:
    """Quest by hand: for each sequence, KV head and query position t, the candidate pages (a token older than
    the window, not all sinks) ranked by the sum over the group's query heads of sum_c max(q_c min_c, q_c max_c),
    the best `pages` of them (ties: the earlier page), then softmax over the window, the sinks and those pages."""
    batch, n_heads, length, _ = q.shape
    n_kv, size, window, sinks = k.shape[1], memory.page_size, memory.recent_window, memory.sink_tokens
    group = n_heads // n_kv
    out = torch.zeros(batch, n_heads, length, v.shape[-1])
    for b in range(batch):
        for kv in range(n_kv):
            heads = range(kv * group, (kv + 1) * group)
            for t in range(length):
                candidates = [j for j in range(length // size) if j * size <= t - window and (j + 1) * size > sinks]

                def bound(j, t=t, b=b, kv=kv, heads=heads):
                    page = k[b, kv, j * size : (j + 1) * size]  # (P, D)
                    low, high = page.min(dim=0).values, page.max(dim=0).values
                    return sum(float(torch.maximum(q[b, h, t] * low, q[b, h, t] * high).sum()) for h in heads)

                chosen = sorted(candidates, key=lambda j: (-bound(j), j))[: memory.pages]
                visible = [s for s in range(t + 1) if t - s < window or s < sinks or s // size in chosen]
                for h in heads:
                    scores = (k[b, kv, visible] @ q[b, h, t]) * scale
                    out[b, h, t] = scores.softmax(dim=0) @ v[b, kv, visible]
    return out


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("chunks", [[40], [1] * 40, [5, 13, 1, 21]], ids=["one chunk", "token by token", "uneven"])
def test_quest_equals_the_plain_reference(sinks, chunks):
    torch.manual_seed(0)
    memory = MemoryConfig(kind="quest", recent_window=8, page_size=4, pages=2, sink_tokens=sinks)
    q, k, v = torch.randn(2, 4, 40, 8), torch.randn(2, 2, 40, 8), torch.randn(2, 2, 40, 8)
    layout = kv_layout(2, 8)
    cache = build_cache(layout, 2, None, torch.float32, memory=memory)
    assert isinstance(cache, QuestCache)
    outs, start = [], 0
    for n in chunks:
        positions = torch.arange(start, start + n)
        part = {"k": k[:, :, start : start + n], "v": v[:, :, start : start + n]}
        outs.append(attend_cache(cache, q[:, :, start : start + n], part, positions, layout.read, 0.35))
        start += n
    torch.testing.assert_close(torch.cat(outs, dim=2), reference(q, k, v, memory, 0.35), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(quest_kernel.library() is None, reason="no working C compiler")
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_the_c_decode_step_equals_the_pytorch_step(kv_heads):
    """quest.c against QuestCache's PyTorch step (gathers and SDPA): a prompt of 200 tokens, then 24 decode steps
    over 25 pages of which 3 are read, groups of 3 or 6 query heads, 4 sinks, a window of 16."""
    memory = MemoryConfig(kind="quest", recent_window=16, page_size=8, pages=3, sink_tokens=4)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 224, 16, generator=g) for h in (6, kv_heads, kv_heads))
    layout, outs = kv_layout(kv_heads, 16), []
    for off in (False, True):
        cache, out = build_cache(layout, 2, None, torch.float32, memory=memory), []
        with cpu.disabled() if off else torch.no_grad():
            attend_cache(cache, q[:, :, :200], {"k": k[:, :, :200], "v": v[:, :, :200]}, torch.arange(200),
                         layout.read, 0.25)  # fmt: skip
            for t in range(200, 224):
                new = {"k": k[:, :, t : t + 1], "v": v[:, :, t : t + 1]}
                assert quest_kernel.usable(q) != off
                out.append(attend_cache(cache, q[:, :, t : t + 1], new, torch.tensor([t]), layout.read, 0.25))
        outs.append(torch.cat(out, dim=2))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(ATTENTION))
def test_every_page_chosen_equals_the_dense_cache(name):
    """pages covering every page: each query reads every earlier token, so the logits are the dense model's."""
    memory = {"kind": "quest", "recent_window": 8, "page_size": 4, "pages": 16, "sink_tokens": 0}
    tokens = torch.randint(0, 97, (2, 60), generator=torch.Generator().manual_seed(1))
    dense = tiny_model(ATTENTION[name], perturb=True)
    quest = tiny_model(ATTENTION[name], memory, perturb=True)
    quest.load_state_dict(dense.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(quest(tokens)[0], dense(tokens)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(ATTENTION))
def test_quest_chunked_equals_token_by_token(name):
    """A sequence scored in blocks (one mask per query) equals decoding it one token at a time (the gathered
    decode step where the variant has one, else the masks), with real sparsity: 2 of up to 14 pages."""
    memory = {"kind": "quest", "recent_window": 8, "page_size": 4, "pages": 2, "sink_tokens": 1}
    model = tiny_model(ATTENTION[name], memory, perturb=True)
    tokens = torch.randint(0, 97, (2, 60), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = model(tokens)[0]
        cache = model.new_cache(2)
        steps = torch.cat([model(tokens[:, t : t + 1], cache)[0] for t in range(60)], dim=1)
        dense = tiny_model(ATTENTION[name], perturb=True)
        dense.load_state_dict(model.state_dict())
        full = dense(tokens)[0]
    torch.testing.assert_close(steps, whole, rtol=1e-4, atol=1e-4)
    assert (whole[:, 12:] - full[:, 12:]).abs().max() > 1e-3  # the selection matters: it is not the dense model
    torch.testing.assert_close(whole[:, :12], full[:, :12], rtol=1e-5, atol=1e-5)  # window + sinks cover these


def test_a_stream_grows_the_cache_and_reads_a_bounded_number_of_tokens():
    memory = MemoryConfig(kind="quest", recent_window=16, page_size=8, pages=4, sink_tokens=4)
    model = tiny_model(None, memory, perturb=True)
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 300)), cache)  # past max_seq_len 64 and the first 256 slots
    layer = cache.layers[0]
    assert layer.length == 300 and layer.complete_pages == 300 // 8
    per_token = 2 * 4 * 16 * 4  # k and v, 4 heads of 16, fp32
    assert layer.read_nbytes() == (4 * 8 + 16 + 4) * per_token + 2 * (301 // 8) * 4 * 16 * 4
    assert layer.nbytes() >= 300 * per_token > layer.read_nbytes()


def test_accounting_holds_every_token_and_reads_at_most_read_slots():
    cfg = tiny_config(None, {"kind": "quest", "recent_window": 16, "page_size": 8, "pages": 4})
    info = kv_report(cfg, "fp32", seq_len=64)
    dense = kv_report(tiny_config(None), "fp32", seq_len=64)
    assert info["kv_bytes_per_layer"] == dense["kv_bytes_per_layer"]
    assert info["memory"]["read_slots"] == 4 * 8 + 16 + 4


def test_quest_options_are_checked():
    with pytest.raises(ConfigError, match=r"page_size=6 must divide memory.recent_window=16: .*use recent_window 18"):
        MemoryConfig(kind="quest", recent_window=16, page_size=6)
    with pytest.raises(ConfigError, match="memory.pages=0 must be >= 1"):
        MemoryConfig(kind="quest", pages=0)
    with pytest.raises(ConfigError, match="memory.page_size belongs to memory.kind quest, not streaming"):
        MemoryConfig(kind="streaming", page_size=4)
    model = tiny_model(None, {"kind": "quest", "recent_window": 16, "page_size": 8})
    with pytest.raises(ConfigError, match="kv policy resid=8 keeps the newest tokens"):
        model.new_cache(1, 64, policy="k=q8_0,v=q8_0,resid=8")
    with pytest.raises(ConfigError, match="quantizes 32 tokens together, but a memory replaces single tokens"):
        model.new_cache(1, 64, policy="k=kivi4,v=q8_0")


# ----------------------------------------------------------------------------- with a KV policy

QUEST = {"kind": "quest", "recent_window": 8, "page_size": 4, "pages": 2, "sink_tokens": 2}


@pytest.mark.parametrize("name", list(CACHE_VARIANTS))
def test_quest_through_a_policy_decodes_as_it_reads_in_blocks(name):
    """A float policy takes the stored path with nothing lost (it equals quest alone); with q8_0 (where a head's
    row fits its blocks) a sequence read in one block still equals decoding it token by token."""
    model = tiny_model(CACHE_VARIANTS[name], QUEST, d_model=128, n_heads=4)
    fields = [f.name for f in model.blocks[0].attn.layout.fields]
    tokens = torch.randint(0, 97, (2, 36), generator=torch.Generator().manual_seed(0))

    def logits(policy, stepwise):
        cache = model.new_cache(2, policy=policy) if policy else model.new_cache(2)
        with torch.no_grad():
            if stepwise:
                return torch.cat([model(tokens[:, t : t + 1], cache)[0] for t in range(36)], dim=1)
            return model(tokens, cache)[0]

    alone = logits(None, True)
    torch.testing.assert_close(logits(",".join(f"{f}=fp32" for f in fields), True), alone, rtol=0, atol=1e-5)
    if name in ("mha", "mha-gqa", "coda"):  # rows of 32 values per head: q8_0 fits
        q8 = ",".join(f"{f}=q8_0" for f in fields)
        stepwise = logits(q8, True)
        # A key computed in a block can differ from the token's own by an ulp, which may round one q8_0 value to its
        # neighbour (seen on some CPUs): the block read must sit far closer to the token-by-token read than q8_0 sits
        # to fp32 (a path that skipped or re-quantized the stored rows would not).
        gap, q8_error = (logits(q8, False) - stepwise).abs(), (stepwise - alone).abs()
        assert q8_error.max() > 1e-3  # the keys and values were read as stored
        assert gap.max() < q8_error.max() / 100 and gap.mean() < q8_error.mean() / 100, (gap.max(), q8_error.max())


def test_quest_bounds_its_pages_on_the_stored_keys_and_holds_their_bytes():
    from attnlab.cache.codecs import Codec
    from attnlab.cache.sparse import key_extremes

    layout = kv_layout(2, 32)
    memory = MemoryConfig(kind="quest", recent_window=8, page_size=4, pages=1)
    cache = build_cache(layout, 1, 16, torch.float32, policy="k=q8_0,v=q4_0", memory=memory)
    k, v, q = torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32)
    attend_cache(cache, q, {"k": k, "v": v}, torch.arange(16), layout.read, 0.2)
    codec = Codec("q8_0", 64, True, 32, "k")  # a token's row over both KV heads
    stored = codec.decode(codec.encode(k.transpose(1, 2).reshape(1, 16, 64)), torch.float32)
    low, high = key_extremes(stored.view(1, 16, 2, 32).transpose(1, 2), 4, 4)
    assert torch.equal(cache.key_min[:, :, :4], low) and torch.equal(cache.key_max[:, :, :4], high)
    v_codec = Codec("q4_0", 64, False, 32, "v")
    assert cache.nbytes() == 16 * (codec.row_bytes + v_codec.row_bytes)


def test_dense_prefill_attends_the_prompt_in_full_and_selects_only_when_decoding():
    """Quest's own setting: the prompt's queries read every earlier token (the dense model's logits); the decode
    steps after it select (they differ from the dense model's), unless the pages cover everything (then equal)."""
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    plain = tiny_model(CACHE_VARIANTS["mha-gqa"], perturb=True)

    def run(model):
        cache = model.new_cache(2)
        with torch.no_grad():
            prompt = model(tokens[:, :32], cache)[0]
            return prompt, torch.cat([model(tokens[:, t : t + 1], cache)[0] for t in range(32, 40)], dim=1)

    full_prompt, full_steps = run(plain)
    for pages, selects in ((2, True), (100, False)):
        memory = {**QUEST, "pages": pages, "dense_prefill": True}
        prompt, steps = run(tiny_model(CACHE_VARIANTS["mha-gqa"], memory, perturb=True))
        torch.testing.assert_close(prompt, full_prompt, rtol=0, atol=1e-5)
        assert ((steps - full_steps).abs().max() > 1e-3) == selects
        if not selects:
            torch.testing.assert_close(steps, full_steps, rtol=0, atol=1e-5)
    selected, _ = run(tiny_model(CACHE_VARIANTS["mha-gqa"], QUEST, perturb=True))
    assert (selected - full_prompt).abs().max() > 1e-3  # without it the prompt's queries select too
