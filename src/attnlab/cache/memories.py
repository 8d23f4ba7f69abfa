"""Bounded KV memories: a fixed number of slots per layer, however long the sequence (ModelConfig.memory).

Every buffer of the variant's cache layout (cache/layout.py: k and v, DBA's [k_sem | k_geo] and v, MLA's
[latent | k_rope], DIFF's k1, k2 and v) gets W + M slots on axis -2, laid out as in CoDA-GQA-L Eq. 8:

    slots [0, W)       the recent window, a FIFO ring: the token at position p sits in slot p % W
    slots [W, W + M)   memory slots, chosen per sequence: StreamingLLM's sinks (`streaming`), H2O's heavy
                       hitters (`h2o`), or the exact landmark bank (M_e) then the summary bank (M_s) of
                       CoDA-GQA-L §3.2 (`bounded`, cache/banks.py); none for `window`

Keys are stored as the variant caches them (after RoPE). With a KV policy every slot is stored in its
field's format (`SlotStorage`), the ring and the banks alike.

When tokens leave the window:
  decode (one token)  the token at p - W is routed into the memory slots first, then p takes its ring slot
                      and the query attends over the buffers themselves (no copy; the paper's decode order)
  chunk (T > 1)       the chunk's queries attend over [ring as it was | chunk | memory as it was | columns
                      the routing made], and each query sees exactly what decoding would hold at its step:
                      the tokens that leave the window during the chunk are routed in position order, and
                      every column is visible to the queries at steps [shown, hidden) (`Routed`): a ring or
                      chunk token at p from p until p + W, or, if a bank slot takes it, until another token
                      takes that slot; a memory token until it is replaced; a summary prototype as a blend
                      made it, from that candidate's step until the next blend of its slot. H2O's evictions
                      depend on the chunk's own attention, so it decides them query by query in `resolve`.
                      Then the newest W tokens are written into the ring.

Scoring a sequence in blocks therefore equals decoding it token by token (tests/test_composition.py), for every
memory kind, with absolute positions; with `positions: cache` a block's queries share one ranking of the held
keys (the rank of the block's first token), which decoding would refine per query.

Positions and masks. Ring slots share their positions across the batch, (W,); memory slots differ per
sequence, (B, M). A memory slot carries the position of the token it holds (exact bank, sinks, heavy
hitters) or of the newest token blended into it (summary bank). Every token in memory has left the window
of the query that first sees it, so its position is below every later query's. In decoding a filled memory
slot is visible to the query and an empty one (-1) is not; the recent columns obey the window rule q - p < W,
so `window` equals sliding-window attention of the same window (ops.masks.memory_mask). Masks are
(B, 1, Tq, S); `positions()` is (B, W + M).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.cache.base import LayerCache, Write
from attnlab.cache.codecs import FORMAT_OF_DTYPE, Codec, KVPolicy
from attnlab.cache.layout import CacheLayout
from attnlab.config import MemoryConfig
from attnlab.errors import ConfigError, InputError
from attnlab.ops.attend import attention_logits
from attnlab.ops.masks import memory_mask, with_null_column
from attnlab.ops.rope import shift_rotation

NEVER = torch.iinfo(torch.long).max  # the step of an event that does not come


@dataclass
class Routed:
    """What routing a chunk's leaving tokens (E of them, at positions p) changed about what the chunk's own
    queries see, as query steps: a token routed at step p + W is seen by the query at that step on."""

    hidden: torch.Tensor  # (B, E) the step from which each leaving token is no longer seen: p + W, or the
    #                       step its memory slot is taken by another (NEVER: still held after the chunk)
    memory_hidden: torch.Tensor  # (B, M) the step from which each memory slot's token before the chunk is not
    extra: dict[str, torch.Tensor]  # (B, H, X, width) columns the routing made (summary prototypes as blended)
    extra_positions: torch.Tensor  # (B, X)
    extra_shown: torch.Tensor  # (B, X) the step each extra column is seen from (NEVER: an unused column)
    extra_hidden: torch.Tensor  # (B, X)


def tracking(*tensors: torch.Tensor) -> bool:
    """True when an update must build new tensors: autograd may have saved the old ones (training with a
    memory), and an in-place write would invalidate them."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def four(x: torch.Tensor) -> torch.Tensor:
    """A buffer with a head axis: (B, S, w) -> (B, 1, S, w); (B, H, S, w) unchanged."""
    return x[:, None] if x.dim() == 3 else x


def memory_codecs(layout: CacheLayout, policy: KVPolicy, default: str) -> dict[str, Codec]:
    """The codec of each field of a memory's slots under `policy` (unnamed fields in format `default`);
    ConfigError for a per-channel format, which quantizes several tokens together."""
    policy.check([f.name for f in layout.fields])
    codecs = {
        f.name: Codec(policy.format_of(f.name, default), f.width * layout.heads, f.name.startswith("k"),
                      policy.group_size, f.name)
        for f in layout.fields
    }  # fmt: skip
    per_channel = [name for name, codec in codecs.items() if codec.tokens_per_block > 1]
    if per_channel:
        raise ConfigError(
            f"kv policy {policy}: {', '.join(per_channel)} in a per-channel format quantizes {policy.group_size} "
            "tokens together, but a memory replaces single tokens in its slots (use a per-token format: fp16, bf16, "
            "q8_0, q4_0 or nf4)"
        )
    return codecs


class SlotStorage:
    """`slots` slots of every buffer of a layout, each read and written as (B, H, slots, width) (H = 1 for a
    layout without a head axis): full-precision tensors, or with a KV policy each field stored per token in
    its format (the codecs of attnlab.cache.codecs: rows of a token's values over all its KV heads)."""

    def __init__(self, layout: CacheLayout, batch: int, slots: int, dtype: torch.dtype, device=None,
                 policy: KVPolicy | None = None):  # fmt: skip
        self.layout, self.dtype, self.policy = layout, dtype, policy
        self.shapes = {name: (batch, layout.heads, slots, layout.buffer_width(name)) for name, _ in layout.buffers}
        self.codecs: dict[str, Codec] = {}
        if policy is not None:
            self.codecs = memory_codecs(layout, policy, FORMAT_OF_DTYPE[dtype])
            self.arrays = {name: codec.allocate(batch, slots, device) for name, codec in self.codecs.items()}
        else:
            self.tensors_ = {
                name: torch.zeros(shape, dtype=dtype, device=device) for name, shape in self.shapes.items()
            }

    @property
    def quantized(self) -> bool:
        return bool(self.codecs)

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Every slot of buffer `name`, (B, H, slots, width), in `dtype` (default: the cache's); full precision:
        the stored tensor itself when the dtype matches (no copy)."""
        dtype = dtype or self.dtype
        if not self.quantized:
            return self.tensors_[name].to(dtype)
        batch, heads, slots, width = self.shapes[name]
        out = torch.empty(batch, slots, heads, width, dtype=dtype, device=self.device)  # token-major
        for field, (buffer, lo, hi) in self.layout.slices.items():
            if buffer == name:
                self.codecs[field].decode_into(self.arrays[field], out[..., lo:hi])
        return out.transpose(1, 2)  # (B, H, slots, width)

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors().values())).device

    def write(self, name: str, index: torch.Tensor, values: torch.Tensor) -> None:
        """Slots `index` (n,) of buffer `name` take values (B, H, n, width)."""
        if not self.quantized:
            stored = self.tensors_[name]
            if tracking(values, stored):
                self.tensors_[name] = stored.index_copy(2, index, values.to(stored.dtype))
            else:
                stored.index_copy_(2, index, values.to(stored.dtype))
            return
        for field, (buffer, lo, hi) in self.layout.slices.items():
            if buffer == name:
                rows = values[..., lo:hi].detach().float().transpose(1, 2).flatten(2)  # (B, n, H * w)
                for array, encoded in zip(
                    self.arrays[field], self.codecs[field].encode(rows.contiguous()), strict=True
                ):
                    array.index_copy_(1, index, encoded)

    def write_range(self, name: str, start: int, values: torch.Tensor) -> None:
        """Slots [start, start + n) of buffer `name` take values (B, H, n, width)."""
        if not self.quantized and tracking(values, self.tensors_[name]):
            stored, end = self.tensors_[name], start + values.shape[2]
            self.tensors_[name] = torch.cat((stored[:, :, :start], values.to(stored.dtype), stored[:, :, end:]), 2)
        elif not self.quantized:
            self.tensors_[name][:, :, start : start + values.shape[2]] = values
        else:
            self.write(name, torch.arange(start, start + values.shape[2], device=values.device), values)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name (a memory state file saves these): buffer names at full precision,
        `<field>.<i>` for the arrays of a field stored in a policy's format."""
        if not self.quantized:
            return dict(self.tensors_)
        return {f"{field}.{i}": array for field, arrays in self.arrays.items() for i, array in enumerate(arrays)}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replaces the stored tensors with `tensors` (the names and shapes of `tensors()`)."""
        if not self.quantized:
            self.tensors_.update(tensors)
            return
        for name, value in tensors.items():
            field, i = name.rsplit(".", 1)
            self.arrays[field][int(i)] = value


class MemoryCache(LayerCache):
    """Recent window (ring of W slots) plus M memory slots; subclasses choose what enters the memory.

    Positions given to `update` must continue the sequence (the model passes arange(seen, seen + T))."""

    per_sequence = True
    pinned_tokens = 0  # the first tokens that go to memory slots directly, never to the ring (sinks)
    max_len: int | None = None  # set when the ring was cut to a request's length (build_cache): tokens it takes
    ring_value_init: float | None = None  # one number kept beside each ring token (gate, attention mass)

    def __init__(self, layout: CacheLayout, batch: int, recent_window: int, memory_slots: int, dtype: torch.dtype,
                 device=None, policy: KVPolicy | None = None):  # fmt: skip
        super().__init__(layout)
        self.cache_positions = False  # memory.positions == "cache": keys read at their rank among the held tokens
        self.recent_window, self.memory_slots = recent_window, memory_slots
        self.capacity = recent_window + memory_slots
        self.slots = SlotStorage(layout, batch, self.capacity, dtype, device, policy)
        self.ring_positions = torch.full((recent_window,), -1, dtype=torch.long, device=device)
        self.memory_positions = torch.full((batch, memory_slots), -1, dtype=torch.long, device=device)
        # One float per ring token, kept until it leaves the window: its write gate (bounded) or the
        # attention mass it has received (h2o); None for window and streaming.
        self.ring_values = None
        if self.ring_value_init is not None:
            self.ring_values = torch.full((batch, recent_window), self.ring_value_init, device=device)
        self.seen = 0

    def buffer(self, name: str) -> torch.Tensor:
        """Every slot of buffer `name` at full precision, (B, H, W + M, width) (H = 1 without a head axis)."""
        return self.slots.read(name)

    # ------------------------------------------------------------------ protocol

    def positions(self) -> torch.Tensor:
        """(B, W + M) position of each slot, -1 for an empty one (memory slots differ per sequence)."""
        ring = self.ring_positions.expand(self.memory_positions.shape[0], -1)
        return torch.cat((ring, self.memory_positions), dim=1)

    def nbytes(self) -> int:
        """Bytes of the stored buffers: B * (W + M) * (bytes per token of every field), whatever the length."""
        return self.slots.nbytes()

    def overhead_nbytes(self) -> int:
        """Bytes of the bookkeeping: slot positions, per-ring-token values, recency counters, scores."""
        return sum(t.nbytes for t in self.bookkeeping().values() if t is not None)

    def bookkeeping(self) -> dict[str, torch.Tensor | None]:
        """Every tensor besides the buffers that the memory carries from one update to the next."""
        return {"ring_positions": self.ring_positions, "memory_positions": self.memory_positions,
                "ring_values": self.ring_values}  # fmt: skip

    def state(self) -> dict[str, torch.Tensor]:
        """Everything the memory carries between updates, by name (a memory state file holds these)."""
        tensors = {name: t for name, t in self.bookkeeping().items() if t is not None}
        return {**self.slots.tensors(), **tensors}

    def load(self, tensors: dict[str, torch.Tensor], seen: int) -> None:
        """Restores a `state()` (same names, shapes and dtypes) after `seen` tokens."""
        stored = self.slots.tensors()
        self.slots.load({name: t for name, t in tensors.items() if name in stored})
        for name, value in tensors.items():
            if name not in stored:
                setattr(self, name, value)
        self.seen = seen

    def mask(self, q_pos, k_pos, window=None, null=False):
        """(B, 1, Tq, S) visibility of the slots `update` returned (k_pos: (B, S)); a leading always-visible
        column for a variant's null key when `null`. After a chunk, each column is visible to the queries at
        the steps the memory holds its token in decoding (`bounds`)."""
        if self.bounds is None:
            mask = memory_mask(q_pos, k_pos, k_pos.shape[-1] - self.memory_slots, self.recent_window)
        else:
            shown, hidden = (b[:, None, None, :] for b in self.bounds)  # (B, 1, 1, S)
            q = q_pos[None, None, :, None]
            mask = (shown <= q) & (q < hidden)
        return (with_null_column(mask) if null else mask), False

    def update(self, new: dict[str, torch.Tensor], positions: torch.Tensor, write: Write | None = None):
        """new: the layout's buffers, (B, H, T, width) (or (B, T, width)); positions (T,). Returns the buffers to
        attend over, seq axis S = W + M (one token) or W + T + M (a chunk), and their positions (B, S)."""
        headless = self.layout.kv_heads is None
        new = {name: four(t) for name, t in new.items()}
        first = next(iter(new.values()))
        start, length = self.seen, positions.shape[0]
        if self.max_len is not None and start + length > self.max_len:  # the cut ring would drop visible tokens
            raise InputError(f"memory cache made for max_len={self.max_len} tokens got {start + length} (make a "
                             "larger cache, or none: model.new_cache(batch) streams any length)")  # fmt: skip
        ring_values = self._chunk_ring_values(first, length, write)  # (B, T) or None; checks before any change
        self.seen += length
        pinned = max(0, min(self.pinned_tokens - start, length))
        if pinned:  # StreamingLLM sinks go to their memory slots at once and never through the ring
            self._pin({name: t[:, :, :pinned] for name, t in new.items()}, positions[:pinned])
        self.bounds = None
        if length == 1:
            if not pinned:
                self._leave_window(start, 1, new, ring_values)
                self._write_ring(new, positions, ring_values)
            held = {name: self.slots.read(name, t.dtype) for name, t in new.items()}
            if self.slots.quantized:  # the new token is read at full precision, as a quantized cache reads it
                slot = self.recent_window + start if pinned else start % self.recent_window
                index = torch.tensor([slot], device=first.device)
                held = {name: t.index_copy(2, index, new[name]) for name, t in held.items()}
            held_positions = self.positions()
            if self.cache_positions:
                held = self._at_cache_positions(held, held_positions, start)
            return self._out(held, headless), held_positions
        batch, window = first.shape[0], self.recent_window
        chunk_positions = positions.clone()
        chunk_positions[:pinned] = -1  # pinned tokens are seen through their memory slots, not twice
        held = {}
        for name, t in new.items():
            stored = self.slots.read(name, t.dtype)
            held[name] = torch.cat((stored[:, :, :window], t, stored[:, :, window:]), dim=2)
        held_positions = torch.cat((self.ring_positions.expand(batch, -1), chunk_positions.expand(batch, -1),
                                    self.memory_positions), dim=1)  # fmt: skip
        # Each column is visible to the queries at steps [shown, hidden): a ring or chunk token at p from p to
        # p + W (the window rule), a memory slot's token from before the chunk until routing replaces it.
        filled = held_positions >= 0
        shown = torch.where(filled, held_positions, NEVER)
        hidden = torch.cat((held_positions[:, : window + length] + window,
                            torch.full_like(self.memory_positions, NEVER)), dim=1)  # fmt: skip
        self.columns = held  # before any re-rotation: H2O copies its heavy hitters from here
        routed = self._leave_window(start, length, new, ring_values)
        if routed is not None:  # what the chunk's own queries see of the routing, step by step
            low = max(self.pinned_tokens, start - window)
            columns = torch.arange(low, low + routed.hidden.shape[1], device=first.device)
            columns = torch.where(columns < start, columns % window, window + columns - start)
            hidden[:, columns] = routed.hidden
            hidden[:, window + length :] = routed.memory_hidden
            held = {name: torch.cat((t, routed.extra[name].to(t.dtype)), dim=2) for name, t in held.items()}
            held_positions = torch.cat((held_positions, routed.extra_positions), dim=1)
            shown = torch.cat((shown, routed.extra_shown), dim=1)
            hidden = torch.cat((hidden, routed.extra_hidden), dim=1)
        self.bounds = shown, hidden
        if self.cache_positions:
            held = self._at_cache_positions(held, held_positions, start, window + length + self.memory_slots)
        keep = min(length - pinned, window)  # the newest W tokens of the chunk stay in the ring
        if keep:
            values = None if ring_values is None else ring_values[:, -keep:]
            self._write_ring({name: t[:, :, -keep:] for name, t in new.items()}, positions[-keep:], values)
        return self._out(held, headless), held_positions

    def _at_cache_positions(self, held: dict[str, torch.Tensor], k_pos: torch.Tensor, first: int,
                            base: int | None = None):  # fmt: skip
        """StreamingLLM's positions (Xiao et al. 2024, §3.2): the held tokens (B, H, S, width) with their RoPE
        fields re-rotated so that a key and a query are as far apart as their ranks among the held tokens (the
        sinks at 0, 1, ..., the window after them), not as their places in the stream. The queries were rotated at
        their stream positions first.. by the variant: a key at stream position p and rank c is moved by
        (c - p) - (c_q - first), c_q the rank of the chunk's first token, which leaves the chunk's own keys as
        they are. Masks still use stream positions. k_pos: (B, S), -1 for an empty slot. Columns past `base` (a
        chunk's summary prototypes as blended) are ranked as the base column of their position."""
        valid = k_pos >= 0
        base = k_pos.shape[1] if base is None else base
        rank = torch.where(valid, k_pos, NEVER)[:, :base].argsort(dim=1).argsort(dim=1)  # (B, base)
        if base < k_pos.shape[1]:
            below = (valid[:, None, :base] & (k_pos[:, None, :base] < k_pos[:, base:, None])).sum(dim=2)
            rank = torch.cat((rank, below), dim=1)
        first_rank = (valid[:, :base] & (k_pos[:, :base] < first)).sum(dim=1, keepdim=True)  # (B, 1): c_q of the
        # chunk's first token
        shift = torch.where(valid, (rank - k_pos) - (first_rank - first), 0)  # (B, S)
        out = {}
        for buffer, fields in self.layout.buffers:
            t, lo = held[buffer], 0
            if any(f.rope for f in fields):
                t = t.clone()
                for f in fields:
                    if f.rope:
                        part = t[..., lo : lo + f.width]
                        t[..., lo : lo + f.width] = shift_rotation(part, shift, self.layout.rope_base,
                                                                   self.layout.rope_interleaved,
                                                                   self.layout.rope_scaling)  # fmt: skip
                    lo += f.width
            out[buffer] = t
        return out

    @staticmethod
    def _out(held: dict[str, torch.Tensor], headless: bool) -> dict[str, torch.Tensor]:
        return {name: t[:, 0] for name, t in held.items()} if headless else held

    # ------------------------------------------------------------------ the ring

    def _chunk_ring_values(self, first: torch.Tensor, length: int, write: Write | None) -> torch.Tensor | None:
        if self.ring_values is None:
            return None
        return torch.full((first.shape[0], length), self.ring_value_init, device=first.device)

    def _leave_window(self, start: int, length: int, new: dict[str, torch.Tensor], ring_values) -> Routed | None:
        """Routes the tokens that leave the window because of tokens [start, start + length) into memory,
        oldest first: ring tokens at positions [max(first ring position, start - W), start + length - W)."""
        window = self.recent_window
        low, high = max(self.pinned_tokens, start - window), start + length - window  # [low, high)
        if high <= low:
            return None
        split = min(max(low, start), high)  # positions below `split` are in the ring, the rest in the chunk
        device = self.ring_positions.device
        from_ring = torch.arange(low, split, device=device)
        from_chunk = torch.arange(split, high, device=device) - start  # only when T > W
        slots = from_ring % window
        leaving = {
            name: torch.cat((self.slots.read(name, t.dtype)[:, :, slots], t[:, :, from_chunk]), dim=2)
            for name, t in new.items()
        }  # (B, H, E, width) each
        values = None  # (B, E)
        if self.ring_values is not None:
            values = torch.cat((self.ring_values[:, slots], ring_values[:, from_chunk]), dim=1)
        return self._route(leaving, torch.arange(low, high, device=device), values)

    def _write_ring(self, new: dict[str, torch.Tensor], positions: torch.Tensor, values) -> None:
        slots = positions % self.recent_window
        for name, t in new.items():
            self.slots.write(name, slots, t)
        if values is not None:
            if tracking(values, self.ring_values):
                self.ring_values = self.ring_values.index_copy(1, slots, values)
            else:
                self.ring_values.index_copy_(1, slots, values)
        self.ring_positions[slots] = positions

    def _write_memory(self, first: int, tensors: dict[str, torch.Tensor]) -> None:
        """Replaces memory slots [first, first + n) (relative to the memory segment) of every buffer."""
        for name, t in tensors.items():
            self.slots.write_range(name, self.recent_window + first, t)

    def _memory(self, name: str, dtype: torch.dtype, first: int = 0, count: int | None = None) -> torch.Tensor:
        """Memory slots [first, first + count) of buffer `name`, (B, H, count, width)."""
        start = self.recent_window + first
        end = self.capacity if count is None else start + count
        return self.slots.read(name, dtype)[:, :, start:end]

    # ------------------------------------------------------------------ what subclasses decide

    def _pin(self, tensors: dict[str, torch.Tensor], positions: torch.Tensor) -> None:
        raise NotImplementedError

    def _route(self, tensors: dict[str, torch.Tensor], positions: torch.Tensor, values) -> Routed | None:
        """Tokens leaving the window: buffers (B, H, E, width), positions (E,) oldest first, values (B, E) or
        None. Returns what the routing changed about the columns a chunk's queries see (None: nothing; each
        leaving token is then hidden once it leaves)."""
        return None


class WindowCache(MemoryCache):
    """`window`: the last W tokens only; equals sliding-window attention of window W."""

    def __init__(self, layout, batch, memory: MemoryConfig, dtype, device=None, policy=None):
        super().__init__(layout, batch, memory.recent_window, 0, dtype, device, policy)
        self.cache_positions = memory.positions == "cache"


class StreamingCache(MemoryCache):
    """`streaming` (StreamingLLM, Xiao et al. 2024): the first `sink_tokens` tokens, kept for good, plus
    the last W tokens. Sink tokens never enter the ring."""

    def __init__(self, layout, batch, memory: MemoryConfig, dtype, device=None, policy=None):
        super().__init__(layout, batch, memory.recent_window, memory.sink_tokens, dtype, device, policy)
        self.pinned_tokens = memory.sink_tokens
        self.cache_positions = memory.positions == "cache"

    def _pin(self, tensors, positions) -> None:
        first = int(positions[0])  # the sinks are the first tokens: sink slot i holds position i
        self._write_memory(first, tensors)
        self.memory_positions[:, first : first + positions.shape[0]] = positions


class H2OCache(MemoryCache):
    """`h2o` (Heavy-Hitter Oracle, Zhang et al. 2023): the `heavy_slots` tokens that received the most
    attention so far, plus the last W tokens.

    Scores: the attention hands `observe` its probabilities over the held slots (computed explicitly, not by
    the fused kernel, which does not return them: a (B, H, Tq, S) fp32 temporary), and each slot's mass,
    summed over query heads and queries, is added to the token it holds. A token leaving the window takes a
    heavy slot when its score beats the lowest heavy score (or a slot is free).

    A chunk's evictions depend on the chunk's own attention (the query at step q + 1 may drop a token the
    query at q made heavy), so `resolve` decides them query by query from the chunk's logits, as decoding
    would: the token leaving at each step is ranked against the heavy hitters, that query's visible columns
    follow, its softmax adds its mass; the memory's state after the chunk is written at the end.
    """

    ring_value_init = 0.0  # attention mass received so far
    wants_probs = True

    def __init__(self, layout, batch, memory: MemoryConfig, dtype, device=None, policy=None):
        super().__init__(layout, batch, memory.recent_window, memory.heavy_slots, dtype, device, policy)
        self.cache_positions = memory.positions == "cache"
        self.heavy_scores = torch.full((batch, memory.heavy_slots), float("-inf"), device=device)
        self._held_positions: torch.Tensor | None = None
        self._pending: tuple[int, torch.Tensor] | None = None  # a chunk whose evictions `resolve` decides
        self._deferring = False

    def bookkeeping(self):
        return {**super().bookkeeping(), "heavy_scores": self.heavy_scores}

    def update(self, new, positions, write=None):
        if self._pending is not None:
            raise RuntimeError("h2o: a chunk's attention was never resolved (attend through attend_held, which "
                               "calls the cache's resolve and observe)")  # fmt: skip
        chunk = positions.shape[0] > 1
        ring_values = self.ring_values.clone() if chunk else None  # the ring's masses before the chunk
        self._deferring = chunk
        held, held_positions = super().update(new, positions, write)
        self._deferring = False
        self._held_positions = held_positions
        if chunk:
            self._pending = (self.seen - positions.shape[0], ring_values)
        return held, held_positions

    def _route(self, tensors, positions, scores) -> None:
        if not self.memory_slots or self._deferring:
            return  # nothing to hold, or a chunk: `resolve` routes its tokens query by query
        batch = scores.shape[0]
        # Candidates: the heavy slots (empty ones score -inf) and the leaving tokens; keep the best M.
        all_scores = torch.cat((self.heavy_scores, scores), dim=1)  # (B, M + E)
        all_positions = torch.cat((self.memory_positions, positions.expand(batch, -1)), dim=1)
        order = self._best(all_scores)
        self.heavy_scores = all_scores.gather(1, order)
        self.memory_positions = all_positions.gather(1, order)
        kept = {}
        for name, t in tensors.items():
            candidates = torch.cat((self._memory(name, t.dtype), t), dim=2)  # (B, H, M + E, width)
            index = order[:, None, :, None].expand(-1, candidates.shape[1], -1, candidates.shape[3])
            kept[name] = candidates.gather(2, index)
        self._write_memory(0, kept)

    def _best(self, scores: torch.Tensor) -> torch.Tensor:
        """(B, M) indices of the M best of scores (B, M + E): highest first; ties keep the earlier entry (the
        sitting heavy hitter), so it is deterministic."""
        return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : self.memory_slots]

    @torch.no_grad()
    def resolve(self, q, k, scale, mask, null):
        """A chunk's evictions, query by query (decode: `mask` as built). Returns the chunk's mask (B, 1, T, S)."""
        if self._pending is None:
            return mask
        start, ring_values = self._pending
        self._pending = None
        logits = attention_logits(q, k, scale)  # (B, H, T, null + S)
        n, window, slots = int(null), self.recent_window, self.memory_slots
        k_pos = self._held_positions  # (B, S): [ring as it was | chunk | heavy hitters as they were]
        batch, length, recent = k_pos.shape[0], q.shape[2], self.recent_window + q.shape[2]
        # Every column's score: the ring's masses, nothing yet for the chunk, the heavy hitters' scores.
        score = torch.cat((ring_values, ring_values.new_zeros(batch, length), self.heavy_scores), dim=1)
        heavy = torch.arange(recent, recent + slots, device=k_pos.device).expand(batch, -1)  # (B, M) columns
        resolved = mask.clone()
        for t in range(length):
            leaving = start + t - window
            if slots and leaving >= self.pinned_tokens:  # its column: in the ring as it was, or in the chunk
                column = leaving % window if leaving < start else window + leaving - start
                all_scores = torch.cat((score.gather(1, heavy), score[:, column, None]), dim=1)
                all_columns = torch.cat((heavy, heavy.new_full((batch, 1), column)), dim=1)
                heavy = all_columns.gather(1, self._best(all_scores))
            visible = torch.zeros_like(k_pos, dtype=torch.bool).scatter_(1, heavy, True) & (k_pos >= 0)
            visible[:, :recent] |= mask[:, 0, t, n : n + recent]  # the window rule
            resolved[:, 0, t, n:] = visible
            probs = logits[:, :, t].masked_fill(~resolved[:, :, t], float("-inf")).softmax(dim=-1)  # (B, H, n + S)
            score += torch.where(visible, probs[..., n:].sum(dim=1), 0.0)
        # The memory after the chunk: the heavy hitters' tokens and scores, the ring's masses.
        self.heavy_scores = score.gather(1, heavy)
        self.memory_positions = k_pos.gather(1, heavy)
        kept = {}
        for name, t in self.columns.items():
            index = heavy[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
            kept[name] = t.gather(2, index)
        self._write_memory(0, kept)
        ring = self.ring_positions
        column = torch.where(ring < start, ring % window, window + ring - start)
        self.ring_values = torch.where(ring >= 0, score.gather(1, column.clamp(min=0).expand(batch, -1)), 0.0)
        return resolved

    @torch.no_grad()
    def observe(self, probs: torch.Tensor) -> None:
        """Adds the attention mass each held slot received: probs (B, H, 1, S) over what `update` returned. A
        chunk's masses were added by `resolve`."""
        if self.bounds is not None:
            return
        mass = probs.float().sum(dim=(1, 2))  # (B, S): the held slots are the buffer itself
        window = self.recent_window
        self.ring_values += torch.where(self.ring_positions >= 0, mass[:, :window], 0.0)
        self.heavy_scores += torch.where(self.memory_positions >= 0, mass[:, window:], 0.0)
