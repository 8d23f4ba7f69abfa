"""CoDA-GQA-L's bounded memory (§3.2-3.3): a recent window plus an exact landmark bank and a summary bank, for
every variant's cache layout (cache/layout.py), and its learned write parameters (`MemoryWrite`).

The window and the slot bookkeeping are cache/memories.py's; this file decides what enters the banks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.cache.base import Write
from attnlab.cache.layout import CacheLayout, low_frequency_channels
from attnlab.cache.memories import NEVER, MemoryCache, Routed
from attnlab.config import MemoryConfig
from attnlab.errors import InputError
from attnlab.kernels import kernel_usable
from attnlab.kernels.cpu import routing


def exact_routing(unit, bank_unit, positions, passed, slot_positions, last_used, tau_novel, tau_match):
    """The exact bank's routing of a chunk's candidates (§3.2): which slot each novel one takes, which
    slots a match refreshes. The PyTorch path, and the reference of attnlab.kernels.bank_routing.

    unit: (B, H_kv, E, D) the candidates' values, unit-normalised per head, in position order; bank_unit:
    (B, H_kv, M_e, D) the bank's, likewise; positions: (E,); passed: (B, E) bool; slot_positions, last_used:
    (B, M_e) long, -1 for an empty slot. Returns (source, slot_positions, last_used, target): each of the first
    three (B, M_e) long, the candidate each slot now holds (-1: it kept its token), the position it holds and
    its recency; target (B, E) long, the slot each candidate took (-1: none). Ties go to the lowest slot (best
    match, first free slot, LRU victim), as torch.max / argmax / argmin pick them.
    """
    heads = unit.shape[1]
    to_bank = torch.einsum("bhed,bhmd->bem", unit, bank_unit) / heads  # (B, E, M_e) cosines averaged over heads
    to_candidate = torch.einsum("bhed,bhfd->bef", unit, unit) / heads  # (B, E, E)
    routed = (to_bank, to_candidate, positions, passed, slot_positions, last_used, tau_novel, tau_match)
    if routing.usable(unit, bank_unit):  # the same loop in C, on the same cosines
        return routing.exact_routing(*routed)
    return exact_routing_loop(*routed)


def exact_routing_loop(to_bank, to_candidate, positions, passed, slot_positions, last_used, tau_novel, tau_match):
    """exact_routing's loop in PyTorch (where the C one is not built), from the cosines: to_bank (B, E, M_e) of each
    candidate with each slot's token before the chunk, averaged over heads; to_candidate (B, E, E) among them."""
    (batch, count, slots), device = to_bank.shape, to_bank.device
    slot_positions, last_used = slot_positions.clone(), last_used.clone()
    source = torch.full((batch, slots), -1, dtype=torch.long, device=device)  # candidate now in a slot
    taken = torch.full((batch, count), -1, dtype=torch.long, device=device)  # slot of each candidate
    rows = torch.arange(batch, device=device)
    never = torch.iinfo(torch.long).max
    for j in range(count):  # sequential by nature: each insertion changes the next one's LRU victim
        used = slot_positions >= 0
        similarity = torch.where(source >= 0, to_candidate[:, j].gather(1, source.clamp(min=0)), to_bank[:, j])
        best, best_slot = similarity.masked_fill(~used, float("-inf")).max(dim=1)
        novel = passed[:, j] & (best < tau_novel)
        hit = passed[:, j] & (best >= tau_match)
        free = (~used).any(dim=1)
        victim = torch.where(free, (~used).long().argmax(dim=1), last_used.masked_fill(~used, never).argmin(dim=1))
        target = torch.where(novel, victim, best_slot)
        position = positions[j]
        source[rows, target] = torch.where(novel, j, source[rows, target])
        slot_positions[rows, target] = torch.where(novel, position, slot_positions[rows, target])
        last_used[rows, target] = torch.where(novel | hit, position, last_used[rows, target])
        taken[:, j] = torch.where(novel, target, -1)
    return source, slot_positions, last_used, taken


def offered(gate: torch.Tensor, tau: float, limit: int | None) -> torch.Tensor:
    """(B, E) the tokens of a block offered to a bank: gate (B, E) >= tau and, with a limit, among the `limit`
    largest gates of the block (ties: the older token), as the authors' code takes its top-k candidates."""
    passed = gate >= tau
    if limit is not None and limit < gate.shape[1]:
        top = torch.sort(gate, dim=1, descending=True, stable=True).indices[:, :limit]
        passed &= torch.zeros_like(passed).scatter_(1, top, True)
    return passed


def summary_slot(similarity: torch.Tensor, used: torch.Tensor, routing: str, tau_novel: float):
    """Where a summary candidate goes. similarity (..., M_s): its LF-K cosines summed over heads (whatever an
    empty slot holds); used (..., M_s). Returns (slot (...), opens (...): the slot is empty, eta = 1).

    novelty (attnlab): the best held prototype, or the first free slot when the best is below tau_novel;
    argmax (the authors' code): the best of every slot, an empty one (a zero prototype) scoring 0."""
    if routing == "argmax":
        slot = similarity.masked_fill(~used, 0.0).argmax(dim=-1)
        return slot, ~used.gather(-1, slot[..., None]).squeeze(-1)
    best, best_slot = similarity.masked_fill(~used, float("-inf")).max(dim=-1)
    free = ~used
    opens = (best < tau_novel) & free.any(dim=-1)  # a copy in the first free slot
    return torch.where(opens, free.long().argmax(dim=-1), best_slot), opens


def summary_versions(columns, bank, slot, opens, rates):
    """The summary prototypes that a chunk's candidates leave, given where each went: each slot's EMA
    b <- b + eta_j (x_j - b) over its candidates in closed form, v_j = c_j b_0 + sum over earlier candidates i on
    the same slot (and i = j) of eta_i prod_(i < k <= j) (1 - eta_k) x_i, the products from cumulative sums of
    log(1 - eta) in float64. Differentiable in the columns, the bank and the rates.

    columns, bank: {buffer: (B, H, E, width)}, {buffer: (B, H, M_s, width)} fp32; slot (B, E) long, -1: the
    candidate changed no slot; opens (B, E) bool: it opened an empty one (eta = 1, a copy); rates (B, H, E).
    Returns (versions {buffer: (B, H, E, width)}: the prototype as candidate j left it, zero where it changed
    none; bank {buffer: (B, H, M_s, width)}: the prototypes after the chunk)."""
    count, slots = slot.shape[1], next(iter(bank.values())).shape[2]
    acts = slot >= 0
    member = F.one_hot(slot.clamp(min=0), slots).bool() & acts[..., None]  # (B, E, M_s)
    blended = (acts & ~opens)[:, None, :]  # (B, 1, E): moves a held prototype by eta (an opening replaces it)
    eta = torch.where(opens[:, None, :], 1.0, torch.where(acts[:, None, :], rates, 0.0))  # (B, H, E)
    decay = torch.log1p(-torch.where(blended, rates, 0.0).double().clamp(max=1 - 1e-12))  # log(1 - eta), 0 at openings
    log_kept = torch.cumsum(decay[..., None] * member[:, None].double(), dim=2)  # (B, H, E, M_s)
    mine = log_kept.gather(3, slot.clamp(min=0)[:, None, :, None].expand(-1, decay.shape[1], -1, 1))[..., 0]
    same = (slot[:, :, None] == slot[:, None, :]) & acts[:, :, None] & acts[:, None, :]  # (B, E_j, E_i)
    earlier = torch.ones(count, count, dtype=torch.bool, device=slot.device).tril()  # i <= j
    exponent = (mine[..., :, None] - mine[..., None, :]).masked_fill(~(same & earlier)[:, None], float("-inf"))
    weights = (torch.exp(exponent) * eta[:, :, None, :]).float()  # (B, H, E_j, E_i)
    opened = torch.cumsum(member & opens[..., None], dim=1).gather(2, slot.clamp(min=0)[..., None])[..., 0] > 0
    start = torch.where((acts & ~opened)[:, None], torch.exp(mine), 0.0).float()  # (B, H, E): c_j
    index = slot.clamp(min=0)[:, None, :, None]
    last = torch.where(member, torch.arange(count, device=slot.device)[:, None], -1).amax(dim=1)  # (B, M_s)
    versions, after = {}, {}
    for name, x in columns.items():
        held = bank[name].gather(2, index.expand(-1, x.shape[1], -1, x.shape[3]))  # (B, H, E, width): b_0
        v = torch.einsum("bhji,bhiw->bhjw", weights, x) + start[..., None] * held
        versions[name] = v * acts[:, None, :, None]
        take = last.clamp(min=0)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
        after[name] = torch.where((last >= 0)[:, None, :, None], versions[name].gather(2, take), bank[name])
    return versions, after


def reigns(claims: torch.Tensor, steps: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """When each claim on a slot ends. claims: (B, E) the slot each of E events claims in turn (-1: none);
    steps: (E,) when each happens. Returns (until (B, E): the step of the next claim on the same slot, NEVER if
    none; first (B, M): the step of the first claim on each slot, NEVER if none)."""
    count = claims.shape[1]
    later = torch.ones(count, count, dtype=torch.bool, device=claims.device).triu(1)  # [j, j']: j' after j
    same = (claims[:, :, None] == claims[:, None, :]) & (claims[:, None, :] >= 0) & later
    never = torch.full((), NEVER, device=claims.device)
    until = torch.where(same, steps, never).amin(dim=2)
    on_slot = claims[:, :, None] == torch.arange(slots, device=claims.device)  # (B, E, M)
    first = torch.where(on_slot, steps[:, None], never).amin(dim=1)
    return until, first


class BoundedCache(MemoryCache):
    """`bounded`: CoDA-GQA-L's recent window + exact landmark bank (M_e) + summary bank (M_s), §3.2-3.3.

    A token leaving the window is a candidate when its write gate g = sigmoid(W_write x), taken when it
    entered the window, is >= tau_gate (write_policy none: every token, g = 1). For each candidate, in
    position order:

    exact bank   value routing: s = cosine of its routing field (the layout's `route`: V, or MLA's latent)
                 with each held slot's, averaged over KV heads (values carry no RoPE, so equal tokens match at
                 any distance). s < tau_novel: the token takes a free slot, else the least recently used one
                 (the whole token, its position kept). s >= tau_match: the best slot's recency is refreshed. In
                 between: nothing (close enough not to be new, not close enough to count as the same). The
                 LRU order makes this sequential: a loop over the chunk's candidates only (tokens that passed
                 the gate), each insertion visible to the next candidate, as the paper's routing kernel does (on
                 CUDA without autograd, that one Triton kernel: attnlab.kernels.bank_routing; on the CPU, C:
                 attnlab.kernels.cpu.routing; else PyTorch); the exact bank thus ends the same whether the
                 tokens came in chunks or one by one.
    summary bank LF-K routing: s = cosine of the low-frequency RoPE channels of its keys (`low_frequency_channels`
                 of every field that carries RoPE: k, DBA's k_geo, MLA's k_rope, DIFF's k1 and k2) with each
                 prototype's, averaged over KV heads. A candidate with s < tau_novel opens a free slot (eta = 1:
                 a copy); every other one moves its best-matching prototype by eta = sigmoid(eta_logit) * g
                 (Eq. 9). RoPE fields are blended on their low-frequency channels only and their high-frequency
                 channels stay zero, so keys rotated to different positions do not interfere; fields without
                 RoPE (values, DBA's semantic keys, MLA's latent) are blended in full. One candidate after
                 another, as decoding routes them (a loop over the chunk's candidates, like the exact bank's; in
                 C on the CPU, the prototypes then computed from its decisions at once: summary_versions).

    A chunk reads the memory as decoding would: each of its queries sees every token and prototype the memory
    holds at that query's own step. A bank token is the column of the ring or chunk token it copies, seen
    until another candidate takes its slot; each prototype a chunk's candidate opens or moves is one more
    column, seen from that candidate's step until the next change of its slot (Routed, MemoryCache.mask).

    detach_evicted (default) stops gradients at the bank writes; false lets them flow through the bank
    updates into the projections, the write gate and eta_logit (phase-2 training, §3.6).

    The options on which the authors' code departs from the paper's text (MemoryConfig; `preset: reference`
    sets the code's values): per-bank gate thresholds (tau_gate, tau_gate_summary) and at most
    exact_candidates / summary_candidates tokens of a block offered to each bank (the largest gates; ties go to
    the older token); exact_refresh tau_novel (every token that is not new refreshes its best slot);
    summary_routing argmax (the best of all M_s slots, an empty one scoring 0: landing on it opens it);
    summary_energy_scale (the low-frequency channels of RoPE fields stored x sqrt(width / low-frequency
    width)); summary_update block (a chunk's candidates routed against the bank before the chunk, their
    gate-weighted mean per slot blended once with eta = sigmoid(eta_logit), seen from the next chunk on; a
    decoding step stays sequential, eta = sigmoid(eta_logit) * g, as the code's decode path).
    """

    ring_value_init = 1.0  # the write gate; overwritten by the chunk's Write

    def __init__(self, layout: CacheLayout, batch, memory: MemoryConfig, dtype, device=None, policy=None):
        slots = memory.exact_slots + memory.summary_slots
        super().__init__(layout, batch, memory.recent_window, slots, dtype, device, policy)
        self.memory, self.cache_positions = memory, memory.positions == "cache"
        self.exact_slots, self.summary_slots = memory.exact_slots, memory.summary_slots
        # Per buffer, (width,) masks: `blend` keeps what a summary prototype holds (1 = blended, 0 = kept at
        # zero: the high-frequency channels of RoPE fields); `stored` is blend times the energy scale of RoPE
        # fields' low-frequency channels (summary_energy_scale; else blend); `lf` marks the channels LF-K
        # routing reads.
        self.blend, self.stored, self.lf = {}, {}, {}
        has_rope = any(f.rope for f in layout.fields)
        route_buffer = layout.slices[layout.route][0]
        for buffer, fields in layout.buffers:
            blend, stored, lf = [], [], []
            for f in fields:
                low = low_frequency_channels(f.width, layout.rope_interleaved).float()
                blend.append(low if f.rope else torch.ones(f.width))
                # The code's energy calibration: sqrt(D / D_lf) keeps a key's norm with half its channels zero.
                scale = math.sqrt(f.width / low.sum().item()) if f.rope and memory.summary_energy_scale else 1.0
                stored.append(blend[-1] * scale)
                # Without any RoPE field, summaries route on the key buffers in full.
                lf.append(low if f.rope else torch.full((f.width,), float(not has_rope and buffer != route_buffer)))
            self.blend[buffer] = torch.cat(blend).to(device)
            self.stored[buffer] = torch.cat(stored).to(device)
            self.lf[buffer] = torch.cat(lf).to(device)
        if not any(bool(m.any()) for m in self.lf.values()):  # one buffer holding everything, no RoPE
            self.lf = {name: torch.ones_like(m) for name, m in self.lf.items()}
        # LRU recency of each exact slot: the position of the token that last inserted or refreshed it.
        self.exact_last_used = torch.full((batch, memory.exact_slots), -1, dtype=torch.long, device=device)
        self._eta: torch.Tensor | None = None
        self._decoding = False  # this update is one token (summary_update block keeps decoding sequential)

    def update(self, new, positions, write=None):
        self._decoding = positions.shape[0] == 1
        return super().update(new, positions, write)

    def bookkeeping(self):
        return {**super().bookkeeping(), "exact_last_used": self.exact_last_used}

    def _chunk_ring_values(self, first: torch.Tensor, length: int, write: Write | None) -> torch.Tensor:
        if write is None:
            raise InputError("the bounded memory needs its write gates: pass write=Write(gate, eta) to update "
                             "(attnlab's Block does; build the model with this memory config)")  # fmt: skip
        self._eta = write.eta
        if write.gate is None:
            return super()._chunk_ring_values(first, length, write)
        if write.gate.shape != (first.shape[0], length):
            raise InputError(f"write gate of shape {tuple(write.gate.shape)} for a chunk of {length} tokens "
                             f"(expected {(first.shape[0], length)})")  # fmt: skip
        return write.gate.float()

    def _route(self, tensors, positions, gate) -> Routed:
        if self.memory.detach_evicted:
            tensors, gate = {name: t.detach() for name, t in tensors.items()}, gate.detach()
        batch, window = gate.shape[0], self.recent_window
        hidden = (positions + window).expand(batch, -1).clone()  # (B, E): seen until they leave the window
        memory_hidden = torch.full_like(self.memory_positions, NEVER)
        extra = {name: t[:, :, :0] for name, t in tensors.items()}
        extra_positions = extra_shown = extra_hidden = torch.empty(batch, 0, dtype=torch.long, device=gate.device)
        memory = self.memory
        # (B, E) each: the tokens offered to each bank (a bank of no slots is offered none)
        to_exact = offered(gate, memory.tau_gate, memory.exact_candidates) & (self.exact_slots > 0)
        to_summary = offered(gate, memory.summary_gate, memory.summary_candidates) & (self.summary_slots > 0)
        candidates = (to_exact | to_summary).any(dim=0).nonzero().squeeze(1)  # tokens some sequence writes
        if candidates.numel():
            tensors = {name: t[:, :, candidates].float() for name, t in tensors.items()}
            positions, gate = positions[candidates], gate[:, candidates]
            to_exact, to_summary = to_exact[:, candidates], to_summary[:, candidates]
            steps = positions + window  # a candidate is routed when the query at p + W arrives
            if self.exact_slots:
                taken = self._update_exact(tensors, positions, to_exact)
                until, first = reigns(taken, steps, self.exact_slots)
                hidden[:, candidates] = torch.where(taken >= 0, until, steps)
                memory_hidden[:, : self.exact_slots] = first
            if self.summary_slots and memory.summary_update == "block" and not self._decoding:
                self._update_summary_block(tensors, positions, gate, to_summary)  # seen from the next chunk
            elif self.summary_slots:
                extra, changed, extra_positions = self._update_summary(tensors, positions, gate, to_summary)
                extra_hidden, first = reigns(changed, steps, self.summary_slots)
                memory_hidden[:, self.exact_slots :] = first
                extra_shown = torch.where(changed >= 0, steps, NEVER)
        return Routed(hidden, memory_hidden, extra, extra_positions, extra_shown, extra_hidden)

    def _update_exact(self, tensors, positions, passed) -> torch.Tensor:
        """Novelty-filtered LRU over the routing field's cosine (§3.2, Eq. 10). tensors: (B, H, E, width) fp32.
        Returns the slot each candidate took, (B, E) (-1: none)."""
        slots = self.exact_slots
        buffer, lo, hi = self.layout.slices[self.layout.route]
        route, bank_route = tensors[buffer][..., lo:hi], self._memory(buffer, torch.float32, 0, slots)[..., lo:hi]
        # Cosines in fp32 (ties in bf16 would make routing order-dependent), from unit vectors per head.
        # exact_refresh tau_novel (the code): every token that is not new refreshes its match, as if tau_match
        # were tau_novel.
        tau_match = self.memory.tau_novel if self.memory.exact_refresh == "tau_novel" else self.memory.tau_match
        routing = (F.normalize(route, dim=-1), F.normalize(bank_route, dim=-1), positions, passed,
                   self.memory_positions[:, :slots], self.exact_last_used, self.memory.tau_novel,
                   tau_match)  # fmt: skip
        if kernel_usable(route, bank_route):  # CUDA without autograd: the whole loop in one launch (§3.4)
            from attnlab.kernels.bank_routing import bank_routing  # optional: needs triton

            source, slot_positions, last_used, taken = bank_routing(*routing)
        else:
            source, slot_positions, last_used, taken = exact_routing(*routing)
        held = (source >= 0)[:, None, :, None]  # (B, 1, M_e, 1)
        written = {}
        for name, t in tensors.items():
            bank = self._memory(name, torch.float32, 0, slots)
            index = source.clamp(min=0)[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
            written[name] = torch.where(held, t.gather(2, index), bank)
        self._write_memory(0, written)
        self.memory_positions = torch.cat((slot_positions, self.memory_positions[:, slots:]), dim=1)
        self.exact_last_used = last_used
        return taken

    def _update_summary(self, tensors, positions, gate, passed):
        """EMA prototypes with LF-K routing (§3.2 Eq. 9, §3.3), one candidate after another as decoding routes
        them. tensors: (B, H, E, width) fp32; gate (B, E). Returns (versions, changed, version_positions): each
        buffer's prototype as candidate j left it, (B, H, E, width); the slot candidate j opened or moved, (B, E)
        (-1: none); the position that prototype then carries (the newest blended into it), (B, E).

        Where the C routing is built, it decides the slots (routing.c: the sequential loop) and the prototypes are
        computed at once from those decisions (summary_versions: each slot's EMA in closed form, differentiable);
        else one PyTorch loop does both (_summary_loop), the reference."""
        slots, first = self.summary_slots, self.exact_slots
        heads = next(iter(tensors.values())).shape[1]
        tensors = {name: t * self.stored[name].to(t.dtype) for name, t in tensors.items()}  # HF channels stay 0
        bank = {name: self._memory(name, torch.float32, first, slots) for name in tensors}
        slot_positions = self.memory_positions[:, first:]
        # Per candidate, its rate eta = sigma(eta_logit) * g per KV head, (B, H, E).
        rates = self._eta.float().reshape(1, -1, 1).expand(1, heads, 1) * gate[:, None, :]
        tau_novel = self.memory.tau_novel * heads  # the cosines are summed over heads, not averaged
        if routing.usable(gate, *tensors.values()):
            lf = {name: m != 0 for name, m in self.lf.items()}
            keys = torch.cat([t[..., lf[name]] for name, t in tensors.items()], dim=-1)  # (B, H, E, LF-K width)
            bank_keys = torch.cat([t[..., lf[name]] for name, t in bank.items()], dim=-1)
            changed, opens = routing.summary_routing(F.normalize(keys, dim=-1), keys, bank_keys, rates, passed,
                                                     slot_positions >= 0, self.memory.summary_routing == "argmax",
                                                     tau_novel)  # fmt: skip
            versions, bank = summary_versions(tensors, bank, changed, opens, rates)
        else:
            versions, bank, changed = self._summary_loop(tensors, bank, slot_positions >= 0, rates, passed, tau_novel)
        acts = changed >= 0
        newest = torch.where(F.one_hot(changed.clamp(min=0), slots).bool() & acts[..., None], positions[:, None], -1)
        slot_positions = slot_positions.maximum(newest.amax(dim=1))  # (B, M_s): the newest token blended in
        self._write_memory(first, bank)
        self.memory_positions = torch.cat((self.memory_positions[:, :first], slot_positions), dim=1)
        return versions, changed, torch.where(acts, positions, -1)

    def _summary_loop(self, tensors, bank, used, rates, passed, tau_novel):
        """_update_summary in PyTorch, one candidate after another. tensors: (B, H, E, width) as blended; bank:
        (B, H, M_s, width) before the chunk; used (B, M_s); rates (B, H, E). Returns (versions, bank, changed)."""
        slots = used.shape[1]
        lf = {name: m.to(torch.float32) for name, m in self.lf.items()}

        def routing_keys(buffers):  # (B, H, n, sum of routed channels): the LF-K vectors
            return torch.cat([t * lf[name] for name, t in buffers.items()], dim=-1)

        units = F.normalize(routing_keys(tensors), dim=-1).unbind(2)  # (B, H, d) each
        columns = {name: t.unbind(2) for name, t in tensors.items()}  # (B, H, width) each
        rates = rates.unbind(2)  # (B, H) each
        prototypes = F.normalize(routing_keys(bank), dim=-1)  # (B, H, M_s, d), kept up to date below
        index = torch.arange(slots, device=used.device)
        versions = {name: [] for name in tensors}
        changed = []
        for j in range(len(units)):  # sequential: each change moves the next one's match
            acts = passed[:, j]  # every candidate that passed its gate opens a prototype or moves one
            similarity = torch.einsum("bhd,bhmd->bm", units[j], prototypes)
            slot, opens = summary_slot(similarity, used, self.memory.summary_routing, tau_novel)  # (B,) each
            opens = opens & acts
            eta = torch.where(opens[:, None], 1.0, rates[j])  # (B, H): a copy into an empty slot
            hit = (index == slot[:, None]) & acts[:, None]  # (B, M_s): the slot this candidate changes
            weight = hit[:, None, :, None] * eta[:, :, None, None]  # (B, H, M_s, 1)
            made = {}
            for name, column in columns.items():
                bank[name] = bank[name] + weight * (column[j][:, :, None] - bank[name])  # empty slots hold 0
                made[name] = (bank[name] * hit[:, None, :, None]).sum(dim=2)  # (B, H, width): the new prototype
                versions[name].append(made[name])
            made_unit = F.normalize(routing_keys({name: t[:, :, None] for name, t in made.items()}), dim=-1)
            prototypes = torch.where(hit[:, None, :, None], made_unit, prototypes)
            used = used | hit
            changed.append(torch.where(acts, slot, -1))
        versions = {name: torch.stack(v, dim=2) for name, v in versions.items()}
        return versions, bank, torch.stack(changed, dim=1)

    def _update_summary_block(self, tensors, positions, gate, passed) -> None:
        """summary_update block (the authors' _summary_update_block_hard): a chunk's candidates are routed
        against the prototypes as they were before the chunk; each slot that receives some moves once, by
        eta = sigmoid(eta_logit) (1 into an empty slot), towards their mean weighted by their gates. tensors:
        (B, H, E, width) fp32; gate, passed (B, E)."""
        slots, first = self.summary_slots, self.exact_slots
        heads = next(iter(tensors.values())).shape[1]
        tensors = {name: t * self.stored[name].to(t.dtype) for name, t in tensors.items()}  # HF channels stay 0
        bank = {name: self._memory(name, torch.float32, first, slots) for name in tensors}
        slot_positions = self.memory_positions[:, first:]
        used = slot_positions >= 0  # (B, M_s)
        lf = {name: m.to(torch.float32) for name, m in self.lf.items()}

        def routing_keys(buffers):  # (B, H, n, sum of routed channels): the LF-K vectors
            return torch.cat([t * lf[name] for name, t in buffers.items()], dim=-1)

        units, prototypes = F.normalize(routing_keys(tensors), dim=-1), F.normalize(routing_keys(bank), dim=-1)
        similarity = torch.einsum("bhed,bhmd->bem", units, prototypes)  # (B, E, M_s), summed over heads
        slot, _ = summary_slot(similarity, used[:, None].expand_as(similarity), self.memory.summary_routing,
                               self.memory.tau_novel * heads)  # fmt: skip
        weight = torch.where(passed, gate, 0.0)  # (B, E): the code weighs each candidate by its gate
        member = F.one_hot(slot, slots).to(weight.dtype) * passed[..., None]  # (B, E, M_s)
        count = torch.einsum("be,bem->bm", weight, member)  # (B, M_s)
        moved = count > 0
        eta = self._eta.float().reshape(1, -1, 1, 1).expand(1, heads, 1, 1)  # (1, H, 1, 1), not times g
        eta = torch.where((moved & ~used)[:, None, :, None], 1.0, eta)  # (B, H, M_s, 1)
        for name, t in tensors.items():
            mean = torch.einsum("bhew,be,bem->bhmw", t, weight, member) / count.clamp(min=1e-6)[:, None, :, None]
            bank[name] = torch.where(moved[:, None, :, None], bank[name] + eta * (mean - bank[name]), bank[name])
        newest = torch.where(member.bool(), positions[None, :, None], -1).amax(dim=1)  # (B, M_s)
        self._write_memory(first, bank)
        slot_positions = torch.where(moved, slot_positions.maximum(newest), slot_positions)
        self.memory_positions = torch.cat((self.memory_positions[:, :first], slot_positions), dim=1)


class MemoryWrite(nn.Module):
    """The learned parts of the bounded memory, held by the Block (the cache stays a value, §3.6 trains them):

    write      W_write (d_model,): g = sigmoid(W_write x), one gate per token shared by its KV heads (a
               bank slot holds the whole token), as in §3.2; None for write_policy none (g = 1)
    write_bias b_write (1,), with memory.write_bias only: g = sigmoid(W_write x + b_write), b_write starting at
               memory.write_bias (the authors' code: -2, g = 0.12 for every token at init)
    eta_logit  the summary bank's EMA rate, one per KV head: eta = sigmoid(eta_logit) * g (Eq. 9), starting at
               memory.eta_logit_init (0: eta = 0.5 * g; the authors' code: -3)

    All are vectors the model's init leaves as built here (W_write = 0: g = 0.5 for every token without a bias),
    and draw no random numbers, so a model with a memory has the same other weights as one without at the
    same seed.
    """

    def __init__(self, d_model: int, n_kv_heads: int, memory: MemoryConfig):
        super().__init__()
        gated = memory.write_policy == "gated"
        self.write = nn.Parameter(torch.zeros(d_model)) if gated else None
        biased = gated and memory.write_bias is not None
        self.write_bias = nn.Parameter(torch.full((1,), float(memory.write_bias))) if biased else None
        self.eta_logit = nn.Parameter(torch.full((n_kv_heads,), float(memory.eta_logit_init)))

    def forward(self, x: torch.Tensor) -> Write:
        """x: (B, T, d_model), the attention's input -> its Write: gate (B, T) or None, eta rate (H_kv,)."""
        gate = None
        if self.write is not None:
            logit = x @ self.write.to(x.dtype)  # (B, T)
            gate = torch.sigmoid(logit if self.write_bias is None else logit + self.write_bias.to(x.dtype))
        return Write(gate, torch.sigmoid(self.eta_logit))
