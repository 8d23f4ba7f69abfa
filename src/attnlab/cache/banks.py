"""CoDA-GQA-L's bounded memory (§3.2-3.3): a recent window plus an exact landmark bank and a summary bank, for
every variant's cache layout (cache/layout.py), and its learned write parameters (`MemoryWrite`).

The window and the slot bookkeeping are cache/memories.py's; this file decides what enters the banks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.cache.base import Write
from attnlab.cache.layout import CacheLayout, low_frequency_channels
from attnlab.cache.memories import MemoryCache
from attnlab.config import MemoryConfig
from attnlab.errors import InputError
from attnlab.kernels import kernel_usable


def exact_routing(unit, bank_unit, positions, passed, slot_positions, last_used, tau_novel, tau_match):
    """The exact bank's routing of a chunk's candidates (§3.2): which slot each novel one takes, which
    slots a match refreshes. The PyTorch path, and the reference of attnlab.kernels.bank_routing.

    unit: (B, H_kv, E, D) the candidates' values, unit-normalised per head, in position order; bank_unit:
    (B, H_kv, M_e, D) the bank's, likewise; positions: (E,); passed: (B, E) bool; slot_positions, last_used:
    (B, M_e) long, -1 for an empty slot. Returns (source, slot_positions, last_used), each (B, M_e) long: the
    candidate each slot now holds (-1: it kept its token), the position it holds and its recency. Ties go to
    the lowest slot (best match, first free slot, LRU victim), as torch.max / argmax / argmin pick them.
    """
    batch, heads, slots = unit.shape[0], unit.shape[1], bank_unit.shape[2]
    to_bank = torch.einsum("bhed,bhmd->bem", unit, bank_unit) / heads  # (B, E, M_e) cosines averaged over heads
    to_candidate = torch.einsum("bhed,bhfd->bef", unit, unit) / heads  # (B, E, E)
    slot_positions, last_used = slot_positions.clone(), last_used.clone()
    source = torch.full((batch, slots), -1, dtype=torch.long, device=unit.device)  # candidate now in a slot
    rows = torch.arange(batch, device=unit.device)
    never = torch.iinfo(torch.long).max
    for j in range(unit.shape[2]):  # sequential by nature: each insertion changes the next one's LRU victim
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
    return source, slot_positions, last_used


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
                 LRU order makes this sequential: a Python loop over the chunk's candidates only (tokens that
                 passed the gate), each insertion visible to the next candidate, as the paper's routing kernel
                 does (on CUDA without autograd, that one Triton kernel: attnlab.kernels.bank_routing); the
                 exact bank thus ends the same whether the tokens came in chunks or one by one.
    summary bank LF-K routing: s = cosine of the low-frequency RoPE channels of its keys (`low_frequency_channels`
                 of every field that carries RoPE: k, DBA's k_geo, MLA's k_rope, DIFF's k1 and k2) with each
                 prototype's, averaged over KV heads. A candidate with s < tau_novel opens a free slot (eta = 1:
                 a copy); every other one moves its best-matching prototype by eta = sigmoid(eta_logit) * g
                 (Eq. 9). RoPE fields are blended on their low-frequency channels only and their high-frequency
                 channels stay zero, so keys rotated to different positions do not interfere; fields without
                 RoPE (values, DBA's semantic keys, MLA's latent) are blended in full. Vectorised over a chunk:
                 routing against the bank as it stood before the chunk (fills first, then blends), and the
                 blends applied as the exact closed form of the sequential EMA: per slot, m <- prod(1 - eta_l) m
                 + sum_l eta_l prod_{l' > l}(1 - eta_l') t_l.

    detach_evicted (default) stops gradients at the bank writes; false lets them flow through the bank
    updates into the projections, the write gate and eta_logit (phase-2 training, §3.6).
    """

    ring_value_init = 1.0  # the write gate; overwritten by the chunk's Write

    def __init__(self, layout: CacheLayout, batch, memory: MemoryConfig, dtype, device=None, policy=None):
        slots = memory.exact_slots + memory.summary_slots
        super().__init__(layout, batch, memory.recent_window, slots, dtype, device, policy)
        self.memory, self.cache_positions = memory, memory.positions == "cache"
        self.exact_slots, self.summary_slots = memory.exact_slots, memory.summary_slots
        # Per buffer, (width,) masks: `blend` keeps what a summary prototype holds (1 = blended, 0 = kept at
        # zero: the high-frequency channels of RoPE fields); `lf` marks the channels LF-K routing reads.
        self.blend, self.lf = {}, {}
        has_rope = any(f.rope for f in layout.fields)
        route_buffer = layout.slices[layout.route][0]
        for buffer, fields in layout.buffers:
            blend, lf = [], []
            for f in fields:
                low = low_frequency_channels(f.width, layout.rope_interleaved).float()
                blend.append(low if f.rope else torch.ones(f.width))
                # Without any RoPE field, summaries route on the key buffers in full.
                lf.append(low if f.rope else torch.full((f.width,), float(not has_rope and buffer != route_buffer)))
            self.blend[buffer] = torch.cat(blend).to(device)
            self.lf[buffer] = torch.cat(lf).to(device)
        if not any(bool(m.any()) for m in self.lf.values()):  # one buffer holding everything, no RoPE
            self.lf = {name: torch.ones_like(m) for name, m in self.lf.items()}
        # LRU recency of each exact slot: the position of the token that last inserted or refreshed it.
        self.exact_last_used = torch.full((batch, memory.exact_slots), -1, dtype=torch.long, device=device)
        self._eta: torch.Tensor | None = None

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

    def _route(self, tensors, positions, gate) -> None:
        if self.memory.detach_evicted:
            tensors, gate = {name: t.detach() for name, t in tensors.items()}, gate.detach()
        passed = gate >= self.memory.tau_gate  # (B, E)
        candidates = passed.any(dim=0).nonzero().squeeze(1)  # tokens some sequence writes
        if candidates.numel() == 0:
            return
        tensors = {name: t[:, :, candidates].float() for name, t in tensors.items()}
        positions, gate, passed = positions[candidates], gate[:, candidates], passed[:, candidates]
        if self.exact_slots:
            self._update_exact(tensors, positions, passed)
        if self.summary_slots:
            self._update_summary(tensors, positions, gate, passed)

    def _update_exact(self, tensors, positions, passed) -> None:
        """Novelty-filtered LRU over the routing field's cosine (§3.2, Eq. 10). tensors: (B, H, E, width) fp32."""
        slots = self.exact_slots
        buffer, lo, hi = self.layout.slices[self.layout.route]
        route, bank_route = tensors[buffer][..., lo:hi], self._memory(buffer, torch.float32, 0, slots)[..., lo:hi]
        # Cosines in fp32 (ties in bf16 would make routing order-dependent), from unit vectors per head.
        routing = (F.normalize(route, dim=-1), F.normalize(bank_route, dim=-1), positions, passed,
                   self.memory_positions[:, :slots], self.exact_last_used, self.memory.tau_novel,
                   self.memory.tau_match)  # fmt: skip
        if kernel_usable(route, bank_route):  # CUDA without autograd: the whole loop in one launch (§3.4)
            from attnlab.kernels.bank_routing import bank_routing  # optional: needs triton

            source, slot_positions, last_used = bank_routing(*routing)
        else:
            source, slot_positions, last_used = exact_routing(*routing)
        taken = (source >= 0)[:, None, :, None]  # (B, 1, M_e, 1)
        written = {}
        for name, t in tensors.items():
            bank = self._memory(name, torch.float32, 0, slots)
            index = source.clamp(min=0)[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
            written[name] = torch.where(taken, t.gather(2, index), bank)
        self._write_memory(0, written)
        self.memory_positions = torch.cat((slot_positions, self.memory_positions[:, slots:]), dim=1)
        self.exact_last_used = last_used

    def _update_summary(self, tensors, positions, gate, passed) -> None:
        """EMA prototypes with LF-K routing (§3.2 Eq. 9, §3.3). tensors: (B, H, E, width) fp32; gate (B, E)."""
        slots, first = self.summary_slots, self.exact_slots
        heads = next(iter(tensors.values())).shape[1]
        tensors = {name: t * self.blend[name].to(t.dtype) for name, t in tensors.items()}  # HF channels stay 0
        bank = {name: self._memory(name, torch.float32, first, slots) for name in tensors}
        slot_positions = self.memory_positions[:, first:]
        used = slot_positions >= 0

        def routing_keys(buffers):  # (B, H, n, sum of routed channels), the LF-K vectors
            return torch.cat([t * self.lf[name].to(t.dtype) for name, t in buffers.items()], dim=-1)

        unit = F.normalize(routing_keys(tensors), dim=-1)

        def route(bank_buffers, used):
            similarity = torch.einsum("bhed,bhmd->bem", unit, F.normalize(routing_keys(bank_buffers), dim=-1)) / heads
            return similarity.masked_fill(~used[:, None, :], float("-inf")).max(dim=2)  # (B, E) twice

        # 1. Novel candidates open the free slots, lowest slot first, in position order (eta = 1).
        best, _ = route(bank, used)
        novel = passed & (best < self.memory.tau_novel)
        rank = novel.long().cumsum(dim=1) - 1  # (B, E): this candidate's turn among the novel ones
        free_slots = torch.sort((used).long(), dim=1, stable=True).indices  # free slots first, ascending
        opens = novel & (rank < (~used).sum(dim=1, keepdim=True))
        open_slot = free_slots.gather(1, rank.clamp(0, slots - 1))  # (B, E)
        fill = F.one_hot(open_slot, slots).float() * opens[..., None]  # (B, E, M_s)
        filled = fill.sum(dim=1)[:, None, :, None] > 0  # (B, 1, M_s, 1)
        bank = {name: torch.where(filled, torch.einsum("bem,bhed->bhmd", fill, tensors[name]), b)
                for name, b in bank.items()}  # fmt: skip
        opened_positions = torch.where(opens, positions, -1)
        slot_positions = slot_positions.scatter_reduce(1, open_slot, opened_positions, "amax")
        # 2. Every other candidate moves its best-matching prototype (after the fills) by eta = sigma * g.
        blends = passed & ~opens
        if blends.any():
            _, best_slot = route(bank, slot_positions >= 0)
            assign = F.one_hot(best_slot, slots).float() * blends[..., None]  # (B, E, M_s)
            eta = self._eta.float().reshape(1, -1, 1).expand(1, heads, 1) * gate[:, None, :]  # (B, H, E)
            log_keep = torch.log1p(-eta.clamp(max=1 - 1e-6))[..., None] * assign[:, None]  # (B, H, E, M_s)
            later = log_keep.flip(2).cumsum(2).flip(2) - log_keep  # sum over later candidates, same slot
            weight = eta * ((later * assign[:, None]).sum(-1)).exp()  # (B, H, E): eta_l prod_{l'>l}(1 - eta_l')
            keep = log_keep.sum(2).exp()[..., None]  # (B, H, M_s, 1): prod_l (1 - eta_l)
            bank = {name: keep * b + torch.einsum("bhe,bem,bhed->bhmd", weight, assign, tensors[name])
                    for name, b in bank.items()}  # fmt: skip
            blended_positions = torch.where(blends, positions, -1)
            slot_positions = slot_positions.scatter_reduce(1, best_slot, blended_positions, "amax")
        self._write_memory(first, bank)
        self.memory_positions = torch.cat((self.memory_positions[:, :first], slot_positions), dim=1)


class MemoryWrite(nn.Module):
    """The learned parts of the bounded memory, held by the Block (the cache stays a value, §3.6 trains them):

    write     W_write (d_model,): g = sigmoid(W_write x), one gate per token shared by its KV heads (a
              bank slot holds the whole token), as in §3.2; None for write_policy none (g = 1)
    eta_logit the summary bank's EMA rate, one per KV head: eta = sigmoid(eta_logit) * g (Eq. 9)

    Both are vectors, left at zero by the model's init (g = 0.5 for every token, eta = 0.25), and draw no
    random numbers, so a model with a memory has the same other weights as one without at the same seed.
    """

    def __init__(self, d_model: int, n_kv_heads: int, memory: MemoryConfig):
        super().__init__()
        self.write = nn.Parameter(torch.zeros(d_model)) if memory.write_policy == "gated" else None
        self.eta_logit = nn.Parameter(torch.zeros(n_kv_heads))

    def forward(self, x: torch.Tensor) -> Write:
        """x: (B, T, d_model), the attention's input -> its Write: gate (B, T) or None, eta rate (H_kv,)."""
        gate = torch.sigmoid(x @ self.write.to(x.dtype)) if self.write is not None else None
        return Write(gate, torch.sigmoid(self.eta_logit))
