"""The fused exact-bank routing kernel (attnlab.kernels.bank_routing) against the PyTorch path.

Runs on a GPU when there is one, else under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors); skipped
only when triton is not importable. The reference is `attnlab.cache.banks.exact_routing`, the loop the
bounded cache runs without the kernel; results must be equal, not close (they are slot indices, positions
and recency counters). Cases: decode (one candidate) and chunks (many, some gated out), banks empty, partly
full (free slots scattered) and full, duplicates that must refresh rather than insert, the band between
tau_novel and tau_match, ties in the best match and in the LRU victim, 1, 2 and 4 KV heads, several
sequences deciding differently, and the cache itself with the kernel wired in.
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Triton decorates its own language functions when it is first imported, so the interpreter must be
    # chosen before anything imports triton: here, at collection (as tests/test_diff_kernel.py does).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import kv_layout  # noqa: E402

import attnlab.cache.banks as bounded_module  # noqa: E402
from attnlab.cache import Write  # noqa: E402
from attnlab.cache.banks import BoundedCache, exact_routing  # noqa: E402
from attnlab.config import MemoryConfig  # noqa: E402
from attnlab.kernels import kernel_usable  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TAU_NOVEL, TAU_MATCH = 0.70, 0.90
HEADS = [1, 2, 4]


@pytest.fixture(scope="module")
def kernel():
    """The kernel's wrapper: compiled on a GPU, else run by Triton's interpreter on CPU tensors."""
    triton = pytest.importorskip("triton")
    if DEVICE == "cpu" and not triton.knobs.runtime.interpret:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1")
    return importlib.import_module("attnlab.kernels.bank_routing").bank_routing


def both(kernel, *args):
    """(kernel's result, reference's result), each (source, slot_positions, last_used, taken) on the CPU."""
    args = [a.to(DEVICE) if torch.is_tensor(a) else a for a in args]
    got = [t.cpu() for t in kernel(*args)]
    expected = [t.cpu() for t in exact_routing(*args)]
    return got, expected


def assert_equal(got, expected):
    for name, a, b in zip(("source", "slot_positions", "last_used", "taken"), got, expected, strict=True):
        assert torch.equal(a, b), f"{name}:\nkernel    {a.tolist()}\nreference {b.tolist()}"


# ----------------------------------------------------------------------------- random cases


def blend(base: torch.Tensor, other: torch.Tensor, cosine: float) -> torch.Tensor:
    """A unit vector at cosine `cosine` to the unit vector `base` (per head, over the last dim)."""
    away = F.normalize(other - (other * base).sum(-1, keepdim=True) * base, dim=-1)
    return cosine * base + math.sqrt(1 - cosine**2) * away


def random_case(batch, heads, count, slots, fill, dim=32, seed=0):
    """Unit candidate values (B, H, E, D) drawn from a pool of token "types" per sequence, so that copies of
    bank entries and of earlier candidates (refresh), near copies (cos 0.95: refresh), cos-0.8 blends (the
    band: nothing) and fresh vectors (insert) all occur; a bank filled from the same pool; random gates."""
    gen = torch.Generator().manual_seed(seed)
    pool = F.normalize(torch.randn(batch, heads, slots + 6, dim, generator=gen), dim=-1)  # (B, H, P, D)

    def fresh(n):
        return F.normalize(torch.randn(batch, heads, n, dim, generator=gen), dim=-1)

    kind = torch.multinomial(torch.tensor([0.4, 0.15, 0.15, 0.3]), batch * count, True, generator=gen)
    kind = kind.view(batch, count)
    picks = torch.randint(0, pool.shape[2], (batch, count), generator=gen)
    picked = torch.stack([pool[b][:, picks[b]] for b in range(batch)])  # (B, H, E, D)
    candidates = torch.where((kind == 0)[:, None, :, None], picked, fresh(count))
    candidates = torch.where((kind == 1)[:, None, :, None], blend(picked, fresh(count), 0.95), candidates)
    candidates = torch.where((kind == 2)[:, None, :, None], blend(picked, fresh(count), 0.8), candidates)

    filled = {"empty": 0, "partial": slots // 2, "full": slots}[fill]
    slot_positions = torch.full((batch, slots), -1, dtype=torch.long)
    last_used = torch.full((batch, slots), -1, dtype=torch.long)
    bank = fresh(slots)
    for b in range(batch):  # each sequence its own filled slots (scattered), tokens and recency
        chosen = torch.randperm(slots, generator=gen)[:filled]
        slot_positions[b, chosen] = torch.randperm(40, generator=gen)[:filled]
        last_used[b, chosen] = slot_positions[b, chosen] + torch.randint(0, 6, (filled,), generator=gen)  # ties
        bank[b][:, chosen] = pool[b][:, torch.randperm(pool.shape[2], generator=gen)[:filled]]
    scale = torch.rand(batch, heads, count, 1, generator=gen) + 0.5  # the cache normalises raw values
    unit, bank_unit = F.normalize(candidates * scale, dim=-1), F.normalize(bank, dim=-1)
    positions = torch.arange(50, 50 + count)
    passed = torch.rand(batch, count, generator=gen) > 0.25
    check_margins(unit, bank_unit)
    return unit, bank_unit, positions, passed, slot_positions, last_used, TAU_NOVEL, TAU_MATCH


def check_margins(unit, bank_unit):
    """Every cosine the routing may see is well away from both thresholds, so the kernel's summation order
    (not torch's einsum's) cannot flip a decision: the test is exact, not lucky."""
    heads = unit.shape[1]
    cosines = torch.cat((torch.einsum("bhed,bhmd->bem", unit, bank_unit),
                         torch.einsum("bhed,bhfd->bef", unit, unit)), dim=2) / heads  # fmt: skip
    for tau in (TAU_NOVEL, TAU_MATCH):
        assert (cosines - tau).abs().min() > 1e-4


def outcomes(before_positions, before_last_used, source, slot_positions, last_used):
    """How many inserts, replacements (an insert over a held token) and refreshes the routing made."""
    inserted = source >= 0
    replaced = inserted & (before_positions >= 0)
    refreshed = (last_used != before_last_used) & ~inserted | inserted & (last_used != slot_positions)
    return int(inserted.sum()), int(replaced.sum()), int(refreshed.sum())


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("fill", ["empty", "partial", "full"])
def test_chunk_matches_the_torch_path(kernel, fill, heads):
    """40 candidates, 3 sequences with their own banks and gates."""
    case = random_case(3, heads, 40, 6, fill, seed=heads)
    got, expected = both(kernel, *case)
    assert_equal(got, expected)
    inserted, replaced, refreshed = outcomes(case[4], case[5], *expected[:3])
    assert inserted and refreshed and (replaced or fill == "empty")  # the case exercises every branch
    assert len({tuple(row) for row in expected[1].tolist()}) == 3  # the sequences decided differently


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("fill", ["empty", "partial", "full"])
def test_decode_matches_the_torch_path(kernel, fill, heads):
    """One candidate per step, as in decode: many independent single-candidate routings over 8 sequences."""
    totals = torch.zeros(3, dtype=torch.long)
    for seed in range(4):
        case = random_case(8, heads, 1, 5, fill, seed=10 * seed + heads)
        got, expected = both(kernel, *case)
        assert_equal(got, expected)
        totals += torch.tensor(outcomes(case[4], case[5], *expected[:3]))
    inserted, replaced, refreshed = totals.tolist()
    assert inserted and (refreshed if fill != "empty" else True) and (replaced if fill == "full" else True)


def test_large_bank_spans_several_tiles(kernel):
    """40 slots (padded to 64 rows) and 2 x 48 features (two feature tiles, the second partial)."""
    case = random_case(2, 2, 120, 40, "partial", dim=48, seed=7)
    got, expected = both(kernel, *case)
    assert_equal(got, expected)
    inserted, replaced, refreshed = outcomes(case[4], case[5], *expected[:3])
    assert inserted and replaced and refreshed


# ----------------------------------------------------------------------------- constructed cases


def basis(heads, index, dim=16):
    """(H, D) the unit vector e_index in every head: exact cosines 0 and 1 between distinct indices."""
    return F.one_hot(torch.tensor(index), dim).float().expand(heads, dim)


@pytest.mark.parametrize("heads", HEADS)
def test_ties_go_to_the_lowest_slot(kernel, heads):
    """Three sequences, one candidate each, every tie exact: a match with two equal slots refreshes the lower
    one; two slots equally least recently used lose the lower one; the first free slot is the lowest."""

    def bank_of(*tokens):
        return torch.stack([basis(heads, i) for i in tokens], dim=1)  # (H, 4, D)

    bank = torch.stack([bank_of(0, 1, 0, 2), bank_of(0, 1, 2, 3), bank_of(0, 0, 1, 0)])  # slots 0, 2 alike in seq 0
    bank[2, :, [1, 3]] = 0  # sequence 2: slots 1 and 3 empty
    candidates = torch.stack([basis(heads, 0), basis(heads, 9), basis(heads, 9)])[:, :, None]  # (B, H, 1, D)
    slot_positions = torch.tensor([[10, 11, 12, 13], [10, 11, 12, 13], [3, -1, 4, -1]])
    last_used = torch.tensor([[10, 11, 12, 13], [15, 12, 17, 12], [3, -1, 4, -1]])
    args = (candidates, F.normalize(bank, dim=-1), torch.tensor([20]), torch.ones(3, 1, dtype=torch.bool),
            slot_positions, last_used, TAU_NOVEL, TAU_MATCH)  # fmt: skip
    got, expected = both(kernel, *args)
    assert_equal(got, expected)
    assert expected[0].tolist() == [[-1, -1, -1, -1], [-1, 0, -1, -1], [-1, 0, -1, -1]]
    assert expected[1].tolist() == [[10, 11, 12, 13], [10, 20, 12, 13], [3, 20, 4, -1]]
    assert expected[2].tolist() == [[20, 11, 12, 13], [15, 20, 17, 12], [3, 20, 4, -1]]


@pytest.mark.parametrize("heads", HEADS)
def test_a_chunk_sees_its_own_insertions_and_the_band_changes_nothing(kernel, heads):
    """One sequence, bank [A, B, -, -] (used at 5 and 6), candidates in order:
    20 cosine 0.95 to B: refreshes B
    21 mean cosine 0.8 to A (per head 1.0 and 0.6 when H > 1: the mean decides, not the best head): nothing
    22 cosine 0.5 to A: novel, takes slot 2
    23 gated out: nothing
    24 a copy of 22 (value scaled): refreshes slot 2, which now holds candidate 22, not the bank's old token
    25 new: takes slot 3, the bank is full
    26 new: replaces the least recently used, A (slot 0; B was refreshed at 20, A not at 21)
    27 a copy of 26: refreshes slot 0
    28 a copy of A, now gone (cosine 0.5 to 22): novel again, replaces B
    """
    a, b = basis(heads, 0), basis(heads, 1)
    half = torch.tensor([1.0 if h % 2 == 0 else 0.6 for h in range(heads)] if heads > 1 else [0.8])[:, None]
    band = half * a + (1 - half**2).sqrt() * basis(heads, 5)  # per-head cosine `half` to A
    near_b = 0.95 * b + math.sqrt(1 - 0.95**2) * basis(heads, 6)
    novel = 0.5 * a + math.sqrt(0.75) * basis(heads, 7)
    new_1, new_2 = basis(heads, 8), basis(heads, 9)
    candidates = torch.stack([near_b, band, novel, basis(heads, 10), 3 * novel, new_1, new_2, new_2, a], dim=1)
    bank = torch.stack([a, b, torch.zeros_like(a), torch.zeros_like(a)], dim=1)
    passed = torch.ones(1, 9, dtype=torch.bool)
    passed[0, 3] = False
    args = (F.normalize(candidates, dim=-1)[None], F.normalize(bank, dim=-1)[None], torch.arange(20, 29), passed,
            torch.tensor([[5, 6, -1, -1]]), torch.tensor([[5, 6, -1, -1]]), TAU_NOVEL, TAU_MATCH)  # fmt: skip
    got, expected = both(kernel, *args)
    assert_equal(got, expected)
    assert expected[0].tolist() == [[6, 8, 2, 5]]
    assert expected[1].tolist() == [[26, 28, 22, 25]]
    assert expected[2].tolist() == [[27, 28, 24, 25]]


# ----------------------------------------------------------------------------- wired into the cache


def test_cache_uses_the_kernel_and_matches_its_torch_path(kernel, monkeypatch):
    """BoundedCache with the kernel (forced here; on its own only on CUDA without autograd) ends every step
    with the same exact bank, keys and values as with its PyTorch loop, fed token by token and in chunks.
    Values repeat (12 distinct tokens in 96), so the bank inserts, refreshes and replaces."""
    memory = MemoryConfig(kind="bounded", recent_window=6, exact_slots=5, summary_slots=3, tau_gate=0.3)
    gen = torch.Generator().manual_seed(3)
    batch, heads, length, dim = 2, 2, 96, 16
    k = torch.randn(batch, heads, length, dim, generator=gen)
    tokens = torch.randn(batch, heads, 12, dim, generator=gen)
    vocabulary = torch.randint(0, 12, (batch, length), generator=gen)
    v = torch.stack([tokens[b][:, vocabulary[b]] for b in range(batch)])  # (B, H, N, D)
    gate = torch.rand(batch, length, generator=gen)
    eta = torch.full((heads,), 0.5)

    def run(chunks, fused):
        monkeypatch.setattr(bounded_module, "kernel_usable", lambda *tensors: fused)
        cache = BoundedCache(kv_layout(heads, dim), batch, memory, torch.float32, DEVICE)
        states, start = [], 0
        for size in chunks:
            part = slice(start, start + size)
            cache.update({"k": k[:, :, part].to(DEVICE), "v": v[:, :, part].to(DEVICE)},
                         torch.arange(start, start + size, device=DEVICE), Write(gate[:, part].to(DEVICE),
                         eta.to(DEVICE)))  # fmt: skip
            start += size
            states.append(
                [
                    t.clone().cpu()
                    for t in (cache.memory_positions, cache.exact_last_used, cache.buffer("k"), cache.buffer("v"))
                ]
            )
        return states

    calls = []

    def counted(*args):
        calls.append(args[0].shape[2])
        return kernel(*args)

    monkeypatch.setattr("attnlab.kernels.bank_routing.bank_routing", counted)
    for chunks in ([1] * length, [5, 1, 9, 3, 13, 2, 20, 7, 36]):
        plain = run(chunks, fused=False)
        assert not calls
        fused = run(chunks, fused=True)
        if len(chunks) == length:  # decode: at most one token leaves the window per step
            assert set(calls) == {1}
        else:
            assert max(calls) > 1
        calls.clear()
        for step, (a, b) in enumerate(zip(fused, plain, strict=True)):
            for name, x, y in zip(("memory_positions", "exact_last_used", "k", "v"), a, b, strict=True):
                assert torch.equal(x, y), f"{name} differs after chunk {step}"
    final = plain[-1][0][:, : memory.exact_slots]
    assert (final >= 0).all() and (plain[-1][1] != final).any()  # the bank filled and refreshed


def test_kernel_is_used_only_on_cuda_without_autograd():
    x = torch.randn(2, 3)
    assert not kernel_usable(x)  # CPU
    if torch.cuda.is_available():
        x = x.cuda()
        assert not kernel_usable(x, x.clone().requires_grad_())  # a gradient to track
        with torch.no_grad():
            assert kernel_usable(x, x.clone().requires_grad_()) is (importlib.util.find_spec("triton") is not None)
