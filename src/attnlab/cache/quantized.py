"""Quantized KV caches: each cached field in its policy's format (attnlab.cache.codecs), plus a
full-precision residual window of the newest tokens. Two modes:

    QuantizedCache      grows with the sequence (stored slot = position); a decode step can run in C
                        (cache/quantized_kernel.py), and in static mode as one op of a compiled step
    QuantizedRingCache  a sliding-window variant's ring: `window` slots, positions tracked per slot

Each field is stored per token as one row over its KV heads (llama.cpp's layout: a token's row of width
H_kv * d is cut into blocks of 32), so per-head widths below 32 still quantize. A token is quantized once,
from its full-precision values, when it leaves the residual window; group formats (KIVI keys: each channel
over `group` tokens) quantize `group` tokens at a time, so up to group - 1 extra tokens wait at full
precision. A chunk's queries attend over what the cache held before the chunk (as stored: dequantized blocks
and the residual window) plus the chunk's own keys at full precision; a single decode step therefore sees
exactly the stored values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab import quant
from attnlab.cache.base import LayerCache
from attnlab.cache.codecs import Codec, KVPolicy, KVValueError, default_format
from attnlab.cache.layout import CacheLayout, Read
from attnlab.cache.quantized_kernel import KernelPlan, PlanPart, attend_static
from attnlab.errors import ConfigError, InputError
from attnlab.kernels import cpu as cpu_kernels


def slot_counts(slots: int, resid: int, tokens_per_block: int) -> tuple[int, int]:
    """(full-precision residual slots, quantized token slots) of a cache holding `slots` tokens, neither more
    than `slots`. Tokens leave the residual window a whole block (flush, KIVI group) at a time, so only whole
    blocks of the oldest slots - resid tokens are ever quantized: a block longer than that (e.g. flush=10**9)
    never leaves, and its tokens stay in the full-precision ring, as a resid longer than the cache keeps them."""
    ring = min(slots, resid + tokens_per_block - 1)
    stored = max(slots - resid, 0) // tokens_per_block * tokens_per_block
    return ring, stored


@dataclass
class Part:
    """One cached field: a slice [lo, hi) of the last axis of a layout buffer."""

    buffer: str
    name: str
    lo: int
    hi: int
    codec: Codec


class QuantizedCache(LayerCache):
    """A growing layer cache storing each field in its policy's format, with a full-precision residual window.

    Storage, per field: `store` uint8 blocks of the tokens that left the window and `recent` full-precision
    rows of the newest tokens (a ring of resid + group - 1)."""

    def __init__(self, layout: CacheLayout, policy: KVPolicy, batch: int, slots: int, max_len: int,
                 dtype: torch.dtype, device=None):  # fmt: skip
        super().__init__(layout)
        self.policy, self.dtype, self.max_len, self.batch = policy, dtype, max_len, batch
        default = default_format(dtype, policy)
        policy.check([f.name for f in layout.fields])
        self.parts: list[Part] = []
        for field, (buffer, lo, hi) in layout.slices.items():
            codec = Codec(policy.format_of(field, default), layout.heads * (hi - lo), field.startswith("k"),
                          policy.group_size, field)  # fmt: skip
            self.parts.append(Part(buffer, field, lo, hi, codec))
        self.tokens_per_block = policy.step(p.codec for p in self.parts)
        if self.capacity is not None and self.tokens_per_block > 1 and (slots - policy.resid) % self.tokens_per_block:
            raise ConfigError(
                f"kv policy: a bounded cache of {slots} slots minus resid={policy.resid} must be a multiple of "
                f"{self.tokens_per_block} tokens, the group/flush size (change resid, group or flush)"
            )
        self.ring_slots, self.store_slots = slot_counts(slots, policy.resid, self.tokens_per_block)
        self.store = {
            p.name: p.codec.allocate(batch, self.store_slots // p.codec.tokens_per_block, device) for p in self.parts
        }
        self.recent = {
            p.name: torch.zeros(batch, self.ring_slots, p.codec.width, dtype=dtype, device=device) for p in self.parts
        }
        self.seen = 0  # tokens written
        self.stored = 0  # tokens [0, stored) have left the residual window (quantized or dropped)
        # [seen, stored, max_len] while in static mode: the op reads the room left from here, not from its plan,
        # so caches of every length share one plan (one compiled graph)
        self.counters = torch.tensor([0, 0, max_len], dtype=torch.long, device=device)
        self.plan = self._plan()
        self.plan_spec = None if self.plan is None else self.plan.to_spec()  # the static op's description of it
        # A decode step is one read of K and V (no null key): the kernel path applies.
        self.kernel_reads = self.plan is not None and layout.read is not None and not layout.null_key

    def _plan(self) -> KernelPlan | None:
        """The plan of this cache's writes and kernel reads (cache/quantized_kernel.py), for per-token formats."""
        if any(p.codec.tokens_per_block != 1 for p in self.parts):  # KIVI keys: blocks of tokens
            return None
        read = self.layout.read or Read("", "", 0)
        parts = tuple(
            PlanPart(p.name, p.buffer, p.lo, p.hi, p.codec.fmt, p.codec.width, p.name.startswith("k"),
                     len(self.store[p.name]))
            for p in self.parts
        )  # fmt: skip
        value_width = read.value_width if read.value_width is not None else self.layout.buffer_width(read.values)
        return KernelPlan(parts, max(self.ring_slots, 1), self.policy.resid, self.tokens_per_block, self.layout.heads,
                          read.keys, read.values, value_width, self.policy.group_size)  # fmt: skip

    # -- protocol -------------------------------------------------------------------------------------
    def positions(self) -> torch.Tensor:
        """Absolute positions of the held tokens (stored slot = position)."""
        seen = int(self.counters[0]) if self.static else self.seen
        return torch.arange(seen, device=self.counters.device)

    def nbytes(self) -> int:
        stored = sum(t.nbytes for arrays in self.store.values() for t in arrays)
        return stored + sum(t.nbytes for t in self.recent.values())

    def update(self, new: dict[str, torch.Tensor], positions: torch.Tensor, write=None):
        if self.static:
            raise InputError("a quantized cache in static mode decodes through attend_one only (leave static mode)")
        start, count = self.seen, positions.shape[0]
        self.check_room(count)
        held_positions, n_stored, recent = self.held()
        n_held = held_positions.shape[0]
        n_recent = n_held - n_stored
        out = {}
        for buffer, value in new.items():
            # What the queries attend over: (B, H, S, d) (or (B, S, d)), S = stored + recent + new tokens.
            four = value.dim() == 4
            seq_axis = 2 if four else 1
            shape = list(value.shape)
            shape[seq_axis] = n_held + count
            held = value.new_empty(shape)
            for p in self.parts:
                if p.buffer != buffer:
                    continue
                dest = held[..., p.lo : p.hi]
                dest = dest.transpose(1, 2) if four else dest  # (B, S, H, d) or (B, S, d): token-major view
                if n_stored:
                    blocks = self.stored_blocks(p, n_stored)
                    p.codec.decode_into(blocks, dest[:, :n_stored])
                if n_recent:
                    rows = self.recent[p.name] if recent is None else self.recent[p.name][:, recent]
                    dest[:, n_stored:n_held].copy_(rows.view(dest[:, n_stored:n_held].shape))
            held.narrow(seq_axis, n_held, count).copy_(value)
            out[buffer] = held
        self.write({p.name: self.to_rows(new[p.buffer][..., p.lo : p.hi]) for p in self.parts}, start)
        return out, torch.cat((held_positions, positions))

    def stored_blocks(self, part: Part, n_stored: int) -> list[torch.Tensor]:
        """The storage arrays of the first n_stored tokens of a part (in slot order)."""
        return [t[:, : n_stored // part.codec.tokens_per_block] for t in self.store[part.name]]

    def held(self) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """(positions of what the cache holds, stored first; how many are stored slots; which ring slots hold
        the rest, None = the whole ring in slot order). Here in position order, only filled slots (a single
        query then needs no mask)."""
        positions = torch.arange(self.seen, device=self.counters.device)  # stored slot = position
        return positions, self.stored, positions[self.stored :] % max(self.ring_slots, 1)

    # -- the kernel path ------------------------------------------------------------------------------
    def supports_static(self) -> bool:
        """Whether generate's compiled decode step can run on this cache: the layout's attention is one read
        of K and V (no null key), every field is per token in a format of the C kernels, float32 on the CPU.
        In static mode attend_one is one op (`attnlab::quantized_attend`) that takes the cache's tensors."""
        return (
            self.kernel_reads
            and self.dtype == torch.float32
            and self.counters.device.type == "cpu"
            and all(p.codec.fmt in cpu_kernels.FORMAT_CODES for p in self.parts)
            and all(t.device.type == "cpu" for t in self.recent.values())
            and cpu_kernels.available()
        )

    def set_static(self, static: bool) -> None:
        """Entering static mode hands the counters to the `counters` tensor (the op advances it); leaving takes
        them back."""
        was = self.static
        super().set_static(static)
        if static and not was:
            self.counters[0], self.counters[1] = self.seen, self.stored
        elif was and not static:
            self.seen, self.stored = self.counters[:2].tolist()

    def attend_one(self, q, new, positions, read: Read, scale):
        """One decode step with the attention read straight from the stored blocks (the C kernels of
        attnlab.kernels.cpu): stores `new` as `update` does and returns softmax(q K^T scale) V over what the cache
        held plus the new token, (B, H, 1, d_v), the same as `update` then `attend` up to the order of the sums;
        no full-precision copy of the held tokens is made.

        None, having stored nothing, where the kernels do not apply or bring nothing: not one token, nothing
        quantized yet, no compiler, not float32 on the CPU, a gradient needed, or a KIVI format; the caller
        then runs `update`."""
        if self.static:  # inside generate's compiled step: one op over the cache's own tensors
            if positions.shape[0] != 1:
                raise InputError(
                    f"a quantized cache in static mode takes one token per step, not {positions.shape[0]}: feed the "
                    "prompt before set_static(True)"
                )
            rows = self.new_rows(new)
            store = [array for p in self.parts for array in self.store[p.name]]
            recent = [self.recent[p.name] for p in self.parts]
            return attend_static(q, rows, store, recent, self.counters, self.plan_spec, scale)
        if (
            not self.kernel_reads
            or positions.shape[0] != 1
            or self.dtype != torch.float32
            or q.dtype != torch.float32
            or q.device.type != "cpu"
            or (torch.is_grad_enabled() and q.requires_grad)
            or any(p.codec.fmt not in cpu_kernels.FORMAT_CODES for p in self.parts)
            or not cpu_kernels.available()
        ):
            return None
        if self.stored == 0:  # all held at full precision: `update` and `attend` are exactly the plain cache's maths
            return None
        self.check_room(1)
        rows = self.new_rows(new)
        store = [self.store[p.name] for p in self.parts]
        recent = [self.recent[p.name] for p in self.parts]
        out = self.plan.attend(q, rows, store, recent, self.seen, self.stored, scale)
        self.stored = self.plan.write(rows, store, recent, self.seen, self.stored)
        self.seen += 1
        return out

    def unstorable(self, index: int) -> KVValueError:
        """The refusal of a static or fused step (the C quantizer's status) that could not store a token at position
        counters[0] (this layer's counters not advanced), as layer `index`: the tensor and its values are named where
        the refused rows were the residual ring's (the eager step's words then), else every block-format tensor may
        hold them (the new token's rows are not kept)."""
        pos, stored, plan = int(self.counters[0]), int(self.counters[1]), self.plan
        limits = {**quant._MAX_ABS, "fp16": quant.FP16_MAX}  # fp16: a finite value beyond it becomes inf
        parts = [p for p in self.parts if p.codec.fmt in limits]
        leave = stored + max(0, (pos + 1 - plan.resid - stored) // plan.flush) * plan.flush
        slots = torch.arange(stored, min(leave, pos)) % plan.ring_slots  # the ring rows that were leaving
        for p in parts:
            rows, limit = self.recent[p.name][:, slots], limits[p.codec.fmt]
            finite = torch.isfinite(rows)
            bad = 0 if p.codec.fmt == "fp16" else int((~finite).sum())  # fp16 stores NaN and inf as they are
            peak = rows[finite].abs().max().item() if finite.any() and not bad else 0.0
            beyond = peak >= quant.FP16_OVERFLOW if p.codec.fmt == "fp16" else peak > limit
            if bad or beyond:
                return KVValueError([(p.name, p.codec.fmt, limit)], bad, peak, index, self.policy)
        return KVValueError([(p.name, p.codec.fmt, limits[p.codec.fmt]) for p in parts], layer=index,
                            policy=self.policy)  # fmt: skip

    def check_room(self, count: int) -> None:
        if self.seen + count > self.max_len:
            raise InputError(
                f"KV cache is full: {self.seen + count} tokens exceed its max_len={self.max_len} (make a larger cache)"
            )

    def new_rows(self, new: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The new token's row of every part, contiguous, in part order."""
        return [self.to_rows(new[p.buffer][..., p.lo : p.hi]).contiguous() for p in self.parts]

    @staticmethod
    def to_rows(x: torch.Tensor) -> torch.Tensor:
        """A token's values over all KV heads: (B, H, T, d) -> (B, T, H * d); (B, T, d) unchanged."""
        return x.transpose(1, 2).flatten(2) if x.dim() == 4 else x

    # -- writing --------------------------------------------------------------------------------------
    def write(self, rows: dict[str, torch.Tensor], start: int) -> None:
        """Stores the chunk's rows (positions start..), quantizing every token that leaves the window."""
        if self.plan is not None:  # per-token formats: slices, one quantizer call per run of rows
            ordered = [rows[p.name] for p in self.parts]
            store, recent = [self.store[p.name] for p in self.parts], [self.recent[p.name] for p in self.parts]
            self.stored = self.plan.write(ordered, store, recent, start, self.stored)
            self.seen = start + ordered[0].shape[1]
            return
        count, step = next(iter(rows.values())).shape[1], self.tokens_per_block
        end = start + count
        self.seen = end
        leave = self.stored + max(0, (end - self.policy.resid - self.stored) // step) * step  # new `stored`
        device = self.counters.device
        if leave > self.stored:
            # Tokens [stored, leave) leave the window: older ones from `recent`, the rest from this chunk.
            keep_from = self.first_kept(leave)
            keep_from -= (keep_from - self.stored) % step  # whole blocks
            from_recent = torch.arange(keep_from, max(keep_from, min(start, leave)), device=device)
            for p in self.parts:
                pieces = []
                if from_recent.numel():
                    pieces.append(self.recent[p.name].index_select(1, from_recent % self.ring_slots))
                if leave > start:
                    pieces.append(rows[p.name][:, max(keep_from, start) - start : leave - start])
                block_rows = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
                encoded = p.codec.encode(block_rows)  # arrays of (B, n_blocks, ...)
                first = keep_from // p.codec.tokens_per_block
                index = torch.arange(first, first + encoded[0].shape[1], device=block_rows.device)
                index %= self.store[p.name][0].shape[1]
                for array, values in zip(self.store[p.name], encoded, strict=True):
                    array.index_copy_(1, index, values)
            self.track_stored(keep_from, leave, start)
            self.stored = leave
        # Tokens [max(start, leave), end) stay at full precision in the ring.
        first = max(start, leave)
        if end > first:
            index = torch.arange(first, end, device=device) % self.ring_slots
            for p in self.parts:
                self.recent[p.name].index_copy_(1, index, rows[p.name][:, first - start :].to(self.dtype))
            self.track_recent(index, first, end)

    def first_kept(self, leave: int) -> int:
        """The oldest token of those leaving the window that the store keeps (a growing store keeps all)."""
        return self.stored

    def track_stored(self, keep_from: int, leave: int, start: int) -> None:
        """Bookkeeping of tokens [keep_from, leave) written to the store (a ring tracks slot positions)."""

    def track_recent(self, index: torch.Tensor, first: int, end: int) -> None:
        """Bookkeeping of tokens [first, end) written to residual slots `index`."""


class QuantizedRingCache(QuantizedCache):
    """A sliding-window variant's quantized cache: at most `slots` tokens, stored and residual slots both
    rings, every slot's position tracked (empty ones at -1). Always dequantizes (no kernel, no static mode)."""

    def __init__(self, layout: CacheLayout, policy: KVPolicy, batch: int, slots: int, max_len: int,
                 dtype: torch.dtype, device=None):  # fmt: skip
        self.capacity = slots
        super().__init__(layout, policy, batch, slots, max_len, dtype, device)
        self.plan, self.kernel_reads = None, False
        self.store_positions = torch.full((self.store_slots,), -1, dtype=torch.long, device=device)
        self.recent_positions = torch.full((self.ring_slots,), -1, dtype=torch.long, device=device)

    def positions(self) -> torch.Tensor:
        held = torch.cat((self.store_positions, self.recent_positions))
        return held[held >= 0]

    def overhead_nbytes(self) -> int:
        return self.store_positions.nbytes + self.recent_positions.nbytes

    def stored_blocks(self, part: Part, n_stored: int) -> list[torch.Tensor]:
        return self.store[part.name]

    def held(self):
        """Every slot in slot order, as the ring cache does, empty slots at position -1."""
        if self.seen == 0:
            return self.store_positions[:0], 0, None
        return torch.cat((self.store_positions, self.recent_positions)), self.store_slots, None

    def first_kept(self, leave: int) -> int:
        return max(self.stored, leave - self.store_slots)

    def track_stored(self, keep_from: int, leave: int, start: int) -> None:
        held = torch.arange(keep_from, leave, device=self.store_positions.device)
        self.store_positions[held % self.store_slots] = held
        left = torch.arange(self.stored, max(self.stored, min(start, leave)), device=held.device)  # left the ring
        self.recent_positions[left % self.ring_slots] = -1

    def track_recent(self, index: torch.Tensor, first: int, end: int) -> None:
        self.recent_positions[index] = torch.arange(first, end, device=index.device)
