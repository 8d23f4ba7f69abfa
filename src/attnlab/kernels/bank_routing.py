"""Fused exact-bank routing (Triton): the sequential novelty-filtered LRU of CoDA-GQA-L §3.2 in one kernel.

The exact landmark bank (attnlab.cache.banks.BoundedCache) takes the candidates of a chunk (tokens that left
the recent window and passed their write gate) one at a time, in position order:

    s_m = mean over KV heads of cos(v, v_m), for each held slot m      (Eq. 10: value routing)
    max s <  tau_novel   the candidate takes the first free slot, else the least recently used one
    max s >= tau_match   the best slot's recency becomes the candidate's position
    otherwise            nothing

Each insertion changes what the next candidate sees (the slot now holds the candidate, its recency moved),
so the loop is sequential; the PyTorch path (bounded.exact_routing) runs it in Python, about 15 small
launches per candidate. Here one program per sequence runs the whole loop (the paper's grid (B,), §3.4).
The decisions are per sequence, not per KV head: s averages over the heads, so a program per (sequence,
KV head) would have to exchange partial sums after every candidate; the heads are folded into the
feature axis instead (H_kv x head_dim features per vector).

What it writes: per slot, the index of the candidate it now holds (-1: it kept its token), its position
and its recency; per candidate, the slot it took (a chunk's queries see each token while a slot holds it).
Not the keys and values: a slot may be claimed several times in one chunk and only its
last claimant is copied, which the per-slot index gives directly; the copy is then one gather that the
caller shares with the PyTorch path (cast to the cache dtype, autograd-safe writes), and the kernel, whose
outputs are integers, stays a pure decision.

State in registers for the whole loop: source, position and recency of each slot (BLOCK_M each). What a
slot holds is read through its source: the candidate's unit vector when source >= 0, else the bank's, so
nothing is written before the end and no barrier is needed. Per candidate it reads M_e x H_kv x head_dim
floats in tiles of BLOCK_M x BLOCK_F (for the paper's Mistral shape, 64 x 8 x 128 fp32 = 256 KiB, from L2).

Deterministic, and equal to the PyTorch path: the inputs are the same unit vectors (F.normalize in the
caller), and every tie goes to the lowest slot index, as torch.max / argmax / argmin pick it (best match,
first free slot, LRU victim). The cosines are summed in another order than torch's einsum, so a cosine
within an ulp or so of a threshold, or of another slot's cosine, could decide differently; exact ties
(equal vectors, equal recency) decide the same way in both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bank_routing_kernel(
    UNIT, BANK, POS, PASSED, SLOT_POS, LAST_USED, SOURCE_OUT, SLOT_POS_OUT, LAST_USED_OUT, TAKEN_OUT,
    sub, suh, sue, sud, sbb, sbh, sbm, sbd, spb, spe, ssb, ssm, slb, slm, sob, som, stb, ste,
    count, slots, n_kv_heads, head_dim, tau_novel, tau_match,
    BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    slot = tl.arange(0, BLOCK_M)
    real = slot < slots
    slot_pos = tl.load(SLOT_POS + b * ssb + slot * ssm, mask=real, other=-1)  # padding slots stay empty (-1)
    last_used = tl.load(LAST_USED + b * slb + slot * slm, mask=real, other=-1)
    source = tl.full([BLOCK_M], -1, tl.int64)  # candidate now held by each slot, -1: the bank's own token
    features = n_kv_heads * head_dim
    unit_base = UNIT + b * sub
    bank_base = BANK + b * sbb

    for j in range(count):  # sequential by nature: each insertion changes the next candidate's view
        if tl.load(PASSED + b * spb + j * spe) != 0:  # gated out for this sequence: no change at all
            used = slot_pos >= 0
            from_candidate = source >= 0
            held = tl.where(from_candidate, source, 0)
            acc = tl.zeros([BLOCK_M, BLOCK_F], tl.float32)
            for start in range(0, features, BLOCK_F):  # the heads folded into the feature axis
                f = start + tl.arange(0, BLOCK_F)
                f_ok = f < features
                h = f // head_dim
                d = f % head_dim
                cand = tl.load(unit_base + h * suh + j * sue + d * sud, mask=f_ok, other=0.0).to(tl.float32)
                mine = (used & from_candidate)[:, None] & f_ok[None, :]
                old = (used & ~from_candidate)[:, None] & f_ok[None, :]
                from_chunk = tl.load(
                    unit_base + h[None, :] * suh + held[:, None] * sue + d[None, :] * sud, mask=mine, other=0.0
                )
                from_bank = tl.load(
                    bank_base + h[None, :] * sbh + slot[:, None] * sbm + d[None, :] * sbd, mask=old, other=0.0
                )
                vector = tl.where(from_candidate[:, None], from_chunk, from_bank).to(tl.float32)
                acc += vector * cand[None, :]
            similarity = tl.sum(acc, axis=1) / n_kv_heads  # (BLOCK_M,) mean over KV heads of the cosines
            similarity = tl.where(used, similarity, float("-inf"))
            best = tl.max(similarity, axis=0)
            best_slot = tl.min(tl.where(used & (similarity == best), slot, BLOCK_M), axis=0)  # first of ties
            first_free = tl.min(tl.where(real & ~used, slot, BLOCK_M), axis=0)
            oldest = tl.min(tl.where(used, last_used, 9223372036854775807), axis=0)
            least_recent = tl.min(tl.where(used & (last_used == oldest), slot, BLOCK_M), axis=0)  # first of ties
            victim = tl.where(first_free < BLOCK_M, first_free, least_recent)
            novel = best < tau_novel
            hit = best >= tau_match
            inserted = tl.where(novel, victim, -1)  # the slot the candidate takes, -1: none
            touched = tl.where(novel, victim, tl.where(hit, best_slot, -1))  # the slot whose recency moves
            position = tl.load(POS + j)
            source = tl.where(slot == inserted, j, source)
            slot_pos = tl.where(slot == inserted, position, slot_pos)
            last_used = tl.where(slot == touched, position, last_used)
            tl.store(TAKEN_OUT + b * stb + j * ste, inserted)

    out = b * sob + slot * som
    tl.store(SOURCE_OUT + out, source, mask=real)
    tl.store(SLOT_POS_OUT + out, slot_pos, mask=real)
    tl.store(LAST_USED_OUT + out, last_used, mask=real)


def bank_routing(
    unit: torch.Tensor,
    bank_unit: torch.Tensor,
    positions: torch.Tensor,
    passed: torch.Tensor,
    slot_positions: torch.Tensor,
    last_used: torch.Tensor,
    tau_novel: float,
    tau_match: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact bank's routing of a chunk's candidates, in one kernel; same contract as bounded.exact_routing.

    unit: (B, H_kv, E, D) the candidates' values, unit-normalised per head, in position order; bank_unit:
    (B, H_kv, M_e, D) the bank's values, likewise; positions: (E,) long; passed: (B, E) bool, whether each
    sequence writes each candidate; slot_positions, last_used: (B, M_e) long, -1 for an empty slot. Any
    strides. Returns (source, slot_positions, last_used), each (B, M_e) long: the candidate each slot now
    holds (-1: it kept its token), the position it holds and its recency, and taken (B, E) long: the slot each
    candidate took (-1: none).
    """
    batch, n_kv_heads, count, head_dim = unit.shape
    slots = bank_unit.shape[2]
    source = torch.empty(batch, slots, dtype=torch.long, device=unit.device)
    new_positions, new_last_used = torch.empty_like(source), torch.empty_like(source)
    taken = torch.full((batch, count), -1, dtype=torch.long, device=unit.device)  # stays -1 where gated out
    passed = passed.to(torch.int8)
    block_m = max(16, triton.next_power_of_2(slots))
    block_f = min(max(16, triton.next_power_of_2(n_kv_heads * head_dim)), max(16, 4096 // block_m))
    _bank_routing_kernel[(batch,)](
        unit, bank_unit, positions.contiguous(), passed, slot_positions, last_used,
        source, new_positions, new_last_used, taken,
        *unit.stride(), *bank_unit.stride(), *passed.stride(), *slot_positions.stride(), *last_used.stride(),
        *source.stride(), *taken.stride(),
        count, slots, n_kv_heads, head_dim, float(tau_novel), float(tau_match),
        BLOCK_M=block_m, BLOCK_F=block_f,
    )  # fmt: skip
    return source, new_positions, new_last_used, taken
