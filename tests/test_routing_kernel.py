"""The bounded memory's routing in C (attnlab.kernels.cpu.routing) against the PyTorch loops it replaces.

The exact bank's loop takes the same cosines in both: the result must be equal (slot indices, positions,
recency). The summary bank's C loop decides the slots and `summary_versions` computes the prototypes from those
decisions in closed form; the reference is `BoundedCache._summary_loop`, which does both one candidate at a time
(what runs under `attnlab.kernels.cpu.disabled()`): same slots, prototypes and gradients within float tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import kv_layout, tiny_model

from attnlab.cache import BoundedCache, Write
from attnlab.cache.banks import exact_routing_loop
from attnlab.config import MemoryConfig
from attnlab.kernels import cpu
from attnlab.kernels.cpu import routing

pytestmark = [
    pytest.mark.skipif(not cpu.available() or routing.library() is None, reason="no working C compiler"),
    pytest.mark.usefixtures("one_thread"),
]


def exact_case(seed, batch=3, count=40, slots=6, duplicates=True):
    """Cosines with ties and repeats: candidates drawn from a few directions, a bank partly full."""
    g = torch.Generator().manual_seed(seed)
    directions = F.normalize(torch.randn(5, 2, 8, generator=g), dim=-1)  # 5 directions, 2 heads
    pick = torch.randint(0, 5, (batch, count), generator=g)
    unit = directions[pick].permute(0, 2, 1, 3)  # (B, H, E, D)
    if not duplicates:
        unit = F.normalize(unit + 0.3 * torch.randn(unit.shape, generator=g), dim=-1)
    bank = directions[torch.randint(0, 5, (batch, slots), generator=g)].permute(0, 2, 1, 3)
    to_bank = torch.einsum("bhed,bhmd->bem", unit, bank) / 2
    to_candidate = torch.einsum("bhed,bhfd->bef", unit, unit) / 2
    slot_positions = torch.where(torch.rand(batch, slots, generator=g) < 0.5, -1, torch.arange(slots) * 3)
    last_used = torch.where(slot_positions >= 0, torch.randint(0, 4, (batch, slots), generator=g), -1)  # ties
    passed = torch.rand(batch, count, generator=g) < 0.8
    positions = torch.arange(100, 100 + count)
    return to_bank, to_candidate, positions, passed, slot_positions, last_used


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("taus", [(0.7, 0.9), (0.5, 0.5), (0.95, 0.99)], ids=["band", "refresh", "strict"])
def test_the_exact_loop_in_c_equals_the_pytorch_loop(seed, taus):
    case = exact_case(seed, duplicates=seed % 2 == 0)
    got = routing.exact_routing(*case, *taus)
    expected = exact_routing_loop(*case, *taus)
    for name, a, b in zip(("source", "slot_positions", "last_used", "taken"), got, expected, strict=True):
        assert torch.equal(a, b), f"{name}:\nC       {a.tolist()}\nPyTorch {b.tolist()}"
    assert (expected[3] >= 0).any() and (expected[3] < 0).any()  # the case inserts and declines


def drive(memory: MemoryConfig, chunks, heads=2, dim=16, batch=2, seed=0, dtype=torch.float32):
    """A bounded cache fed clustered keys and values chunk by chunk (so that the summary bank blends as well as
    opens); returns (the cache, each chunk's Routed columns, eta_logit, the keys) with eta_logit and keys
    requiring gradients."""
    g = torch.Generator().manual_seed(seed)
    length = sum(chunks)
    centers = torch.randn(6, heads, dim, generator=g) * 2
    which = torch.randint(0, 6, (batch, length), generator=g)
    k = (centers[which] + 0.3 * torch.randn(batch, length, heads, dim, generator=g)).permute(0, 2, 1, 3)
    v = torch.randn(batch, heads, length, dim, generator=g)
    k, gate = k.clone().requires_grad_(), torch.rand(batch, length, generator=g)
    eta_logit = torch.full((heads,), -0.5, requires_grad=True)
    cache = BoundedCache(kv_layout(heads, dim), batch, memory, dtype)
    start, extras = 0, []
    for size in chunks:
        part = slice(start, start + size)
        routed = cache.update({"k": k[:, :, part], "v": v[:, :, part]}, torch.arange(start, start + size),
                              Write(gate[:, part], torch.sigmoid(eta_logit)))  # fmt: skip
        extras.append(routed)
        start += size
    return cache, eta_logit, k


MEMORY = dict(kind="bounded", recent_window=8, exact_slots=3, summary_slots=4, tau_gate=0.3, detach_evicted=False)


@pytest.mark.parametrize("routing_kind", ["novelty", "argmax"])
@pytest.mark.parametrize("chunks", [[1] * 70, [9, 1, 30, 2, 28], [70]], ids=["decode", "mixed", "one"])
def test_the_summary_routing_in_c_equals_the_pytorch_loop(routing_kind, chunks):
    memory = MemoryConfig(**MEMORY, summary_routing=routing_kind)
    fast, fast_eta, fast_k = drive(memory, chunks)
    with cpu.disabled():
        slow, slow_eta, slow_k = drive(memory, chunks)
    assert torch.equal(fast.memory_positions, slow.memory_positions)
    assert torch.equal(fast.exact_last_used, slow.exact_last_used)
    for name in ("k", "v"):
        torch.testing.assert_close(fast.buffer(name), slow.buffer(name), atol=1e-5, rtol=1e-5)
    summary = slow.buffer("v")[:, :, -4:]
    assert (summary != 0).any() and (slow.memory_positions[:, 3:] >= 0).all()  # every prototype was opened
    loss = lambda cache: (cache.buffer("k") * torch.linspace(-1, 1, 16)).sum() + cache.buffer("v").pow(2).sum()
    fast_grads = torch.autograd.grad(loss(fast), (fast_eta, fast_k))
    slow_grads = torch.autograd.grad(loss(slow), (slow_eta, slow_k))
    assert slow_grads[0].abs().sum() > 0
    for a, b in zip(fast_grads, slow_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "attention", [{"kind": "coda", "n_kv_heads": 2, "gate_bias": 0.0}, {"kind": "mla", "d_latent": 32}]
)
def test_a_model_through_the_memory_reads_and_learns_the_same_with_the_c_routing(attention):
    memory = {**MEMORY, "summary_routing": "novelty"}
    tokens = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(2))
    results = []
    for off in (False, True):
        model = tiny_model(attention, memory, seed=0, max_seq_len=128).train()
        with cpu.disabled() if off else torch.enable_grad():
            logits, _ = model(tokens)
            F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (fast, fast_grads), (slow, slow_grads) = results
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    assert fast_grads.keys() == slow_grads.keys() and any("memory" in n for n in slow_grads)
    for name in slow_grads:
        torch.testing.assert_close(fast_grads[name], slow_grads[name], atol=1e-5, rtol=1e-4, msg=name)
