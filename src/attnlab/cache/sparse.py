"""Dynamic sparse attention (memory.kind quest): every token is kept, each query reads only some of them.

Quest (Tang et al. 2024, "Query-Aware Sparsity for Efficient Long-Context LLM Inference") with the Longformer
pattern (Beltagy et al. 2020: a local window plus global tokens). The keys are cut into pages of P tokens at
fixed positions (page j holds positions [jP, (j+1)P)); each complete page keeps the per-channel minimum and
maximum of its keys. For a query q, the score q.k of any key in page j is at most

    U_j(q) = sum_c max(q_c min_jc, q_c max_jc) = relu(q) . max_j + min(q, 0) . min_j      (Quest §3.2)

A query at position t reads:
  - the recent window, positions (t - W, t] (W a multiple of P, so the newest page is always read whole);
  - the first `sink_tokens` positions (global tokens);
  - the K pages with the largest bound among the *candidates*: pages holding a token older than the window
    (jP <= t - W) that are not all sinks. A chosen page that straddles the window's start adds its older
    tokens; nothing is read twice.

With GQA the selection is made per KV head, on the sum of the bounds of its group's query heads, so a group
reads one set of pages (the bytes a step reads are per KV head). When K covers every candidate page a query
reads every earlier token: the cache then equals the dense cache (tests/test_sparse.py).

The same rule applies to a chunk's queries one by one (masks), so a sequence scored in blocks equals token-by-
token decoding. A decode step of a variant whose step is one attention call (layout.read) gathers only the
chosen rows (`attend_one`): it reads K*P + W + sinks tokens and the page bounds, not the whole cache.

`dense_prefill: true` (Quest's own setting) lets a chunk of several tokens, a prompt, attend in full: only decode
steps select.

With a KV policy each field is stored per token in its format, one row over every KV head (as QuantizedCache
stores it); the page bounds come from the keys as stored, and a decode step decodes only the rows it gathers
(each KV head's rows, decoded for every head, the head's own values kept).
"""

from __future__ import annotations

import torch

from attnlab.cache.base import LayerCache, Write
from attnlab.cache.codecs import FORMAT_OF_DTYPE, KVPolicy
from attnlab.cache.layout import CacheLayout, Read
from attnlab.cache.memories import four, memory_codecs
from attnlab.config import MemoryConfig
from attnlab.errors import InputError
from attnlab.kernels.cpu import quest as quest_kernel
from attnlab.ops.attend import attend

INITIAL_SLOTS = 256  # a cache starts here and doubles (up to its max_len, if given): a request is not a promise


def page_bounds(q: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of q.k over each page, summed over each KV head's group of query heads.

    q (B, H, T, D); key_min, key_max (B, H_kv, n, D) per page. Returns (B, H_kv, T, n) in fp32."""
    batch, n_heads, length, dim = q.shape
    n_kv, pages = key_min.shape[1], key_min.shape[2]
    grouped = q.float().reshape(batch, n_kv, (n_heads // n_kv) * length, dim)  # (B, H_kv, G*T, D)
    bound = grouped.clamp(min=0) @ key_max.float().transpose(-1, -2)
    bound = bound + grouped.clamp(max=0) @ key_min.float().transpose(-1, -2)  # (B, H_kv, G*T, n)
    return bound.reshape(batch, n_kv, n_heads // n_kv, length, pages).sum(dim=2)


def top_pages(bound: torch.Tensor, q_pos: torch.Tensor, memory: MemoryConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages each query reads besides its window and the sinks: (index (B, H_kv, T, k), valid (B, H_kv, T, k)),
    k = min(pages, n), valid False where fewer candidates than k exist. bound (B, H_kv, T, n) from `page_bounds`;
    q_pos (T,) the queries' positions. Ties go to the earlier page (a stable sort)."""
    size, window, sinks = memory.page_size, memory.recent_window, memory.sink_tokens
    start = torch.arange(bound.shape[-1], device=bound.device) * size  # (n,) each page's first position
    candidate = (start[None, :] <= q_pos[:, None] - window) & (start[None, :] + size > sinks)  # (T, n)
    ranked = bound.masked_fill(~candidate, float("-inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., : memory.pages]
    return order, candidate.expand_as(bound).gather(-1, order)


def chosen_pages(bound: torch.Tensor, q_pos: torch.Tensor, memory: MemoryConfig) -> torch.Tensor:
    """(B, H_kv, T, n) bool: the pages each query reads besides its window and the sinks (`top_pages` as a mask)."""
    order, valid = top_pages(bound, q_pos, memory)
    return torch.zeros_like(bound, dtype=torch.bool).scatter_(-1, order, valid)


def key_extremes(keys: torch.Tensor, pages: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel min and max of the first `pages` pages of keys (B, H_kv, S, D): (B, H_kv, pages, D) each."""
    paged = keys[:, :, : pages * size].unflatten(2, (pages, size))  # (B, H_kv, pages, P, D)
    return paged.amin(dim=3), paged.amax(dim=3)


class QuestCache(LayerCache):
    """Every token of the layout's buffers (slot = position), plus the min/max of each complete page of the keys
    that a decode step reads (`read.keys`); starts at INITIAL_SLOTS and grows by doubling, up to max_len if given
    (generate asks for prompt + max_new_tokens, which may be far more than it will hold, or than memory has)."""

    selects = True

    def __init__(self, layout: CacheLayout, batch: int, memory: MemoryConfig, dtype: torch.dtype, device=None,
                 max_len: int | None = None, policy: KVPolicy | None = None):  # fmt: skip
        super().__init__(layout)
        self.memory, self.max_len, self.length = memory, max_len, 0
        self.policy = policy  # (named by a refusal: attnlab.cache.codecs.KVValueError)
        slots = INITIAL_SLOTS if max_len is None else min(max_len, INITIAL_SLOTS)
        self.buffers = {name: torch.zeros(shape, dtype=dtype, device=device)
                        for name, shape in layout.shapes(batch, slots).items()}  # fmt: skip
        # With a KV policy each field is stored per token in its format, one row over all KV heads (as the other
        # quantized caches store it): (B, slots, ...) arrays; what a step reads is decoded from them.
        self.codecs = memory_codecs(layout, policy, FORMAT_OF_DTYPE[dtype]) if policy is not None else None
        self.arrays = {}
        if self.codecs is not None:
            self.arrays = {name: codec.allocate(batch, slots, device) for name, codec in self.codecs.items()}
            self.buffers = {name: b[..., :0, :] for name, b in self.buffers.items()}  # their shapes and dtype only
        self.keys = layout.read.keys if layout.read is not None else None  # the buffer whose pages are bounded
        self.complete_pages = 0
        self.key_min = self.key_max = None  # (B, H_kv, pages, width): filled as pages complete
        if self.keys is not None:
            shape = four(self.buffers[self.keys]).shape
            extremes = (shape[0], shape[1], -(-slots // memory.page_size), shape[3])
            self.key_min = torch.zeros(extremes, dtype=dtype, device=device)
            self.key_max = torch.zeros(extremes, dtype=dtype, device=device)
        self._q_pos: torch.Tensor | None = None

    # ------------------------------------------------------------------ protocol

    def positions(self) -> torch.Tensor:
        return torch.arange(self.length, device=next(iter(self.buffers.values())).device)

    def nbytes(self) -> int:
        if self.codecs is not None:
            return sum(a.nbytes for arrays in self.arrays.values() for a in arrays)
        return sum(b.nbytes for b in self.buffers.values())

    def overhead_nbytes(self) -> int:
        return 0 if self.key_min is None else self.key_min.nbytes + self.key_max.nbytes

    def read_nbytes(self) -> int:
        """Bytes the next decode step reads: at most K pages, the window and the sinks of every buffer, plus the
        bounds of every complete page."""
        tokens = min(self.length + 1, self.memory.read_slots)
        per_token = (sum(b[..., :1, :].nbytes for b in self.buffers.values()) if self.codecs is None
                     else sum(codec.row_bytes for codec in self.codecs.values()))  # fmt: skip
        pages = (self.length + 1) // self.memory.page_size
        bounds = 0 if self.key_min is None else 2 * self.key_min[:, :, :pages].nbytes
        return tokens * per_token + bounds

    def update(self, new: dict[str, torch.Tensor], positions: torch.Tensor, write: Write | None = None):
        self._store(new, positions)
        self._q_pos = positions
        held = {name: self._read(name, 0, self.length).to(new[name].dtype) for name in self.buffers}
        if self.layout.kv_heads is None:
            held = {name: b[:, 0] for name, b in held.items()}
        return held, self.positions()

    def resolve(self, q, k, scale, mask, null):
        """The mask of each query: causal, and within its window, the sinks or its chosen pages. q (B, H, T, D),
        k (B, H_kv, null + S, D) the keys it is scored against (bounds from these: any variant's keys)."""
        q_pos, self._q_pos = self._q_pos, None
        if self.memory.dense_prefill and q_pos.shape[0] > 1:  # Quest's setting: only decode steps select
            return mask
        k = k[:, :, int(null) :]
        size = self.memory.page_size
        pages = k.shape[2] // size
        key_min, key_max = key_extremes(k, pages, size)
        chosen = chosen_pages(page_bounds(q, key_min, key_max), q_pos, self.memory)  # (B, H_kv, T, n)
        k_pos = torch.arange(k.shape[2], device=k.device)
        query = q_pos[:, None]
        visible = ((query - k_pos[None, :]) < self.memory.recent_window) | (k_pos[None, :] < self.memory.sink_tokens)
        visible = visible & (k_pos[None, :] <= query)  # (T, S)
        by_page = chosen.repeat_interleave(size, dim=-1)  # (B, H_kv, T, n * P)
        pad = k.shape[2] - by_page.shape[-1]  # the newest, incomplete page: always in the window
        by_page = torch.nn.functional.pad(by_page, (0, pad))
        visible = visible | (by_page & (k_pos <= query))
        if null:
            visible = torch.cat((visible.new_ones(*visible.shape[:-1], 1), visible), dim=-1)
        return visible

    def attend_one(self, q: torch.Tensor, new: dict[str, torch.Tensor], positions: torch.Tensor, read: Read,
                   scale: float) -> torch.Tensor | None:  # fmt: skip
        """A decode step reading only the chosen rows: the window, the sinks and the chosen pages' tokens that
        are neither, gathered per KV head."""
        if positions.shape[0] != 1 or self.key_min is None:
            return None
        self._store(new, positions)
        t, memory = self.length - 1, self.memory
        size, window, sinks = memory.page_size, memory.recent_window, memory.sink_tokens
        device, dtype = q.device, q.dtype
        if t < window + sinks or self.complete_pages <= memory.pages:  # every earlier token is read anyway
            k, v = self._read(read.keys, 0, t + 1).to(dtype), self._read(read.values, 0, t + 1).to(dtype)
            return attend(q, k, v[..., : read.value_width], None, scale)
        if self.codecs is None and quest_kernel.usable(q, self.buffers[read.keys], self.key_min):
            keys, values = four(self.buffers[read.keys]), four(self.buffers[read.values])
            width = read.value_width or values.shape[-1]
            return quest_kernel.attend(q, keys, values, width, self.key_min, self.key_max, self.complete_pages, t,
                                       memory, scale)  # fmt: skip
        bound = page_bounds(q, self.key_min[:, :, : self.complete_pages], self.key_max[:, :, : self.complete_pages])
        order, picked = (t[:, :, 0] for t in top_pages(bound, positions, memory))  # (B, H_kv, K) each
        offsets = torch.arange(size, device=device)
        page_rows = (order[..., None] * size + offsets).flatten(-2)  # (B, H_kv, K*P)
        # A chosen page's tokens that are sinks or in the window are read through those instead.
        page_ok = picked.repeat_interleave(size, dim=-1) & (page_rows >= sinks) & (page_rows <= t - window)
        recent = torch.arange(t - window + 1, t + 1, device=device)  # (W,), all >= sinks here
        rows = torch.cat((page_rows, recent.expand(*page_rows.shape[:2], -1),
                          torch.arange(sinks, device=device).expand(*page_rows.shape[:2], -1)), dim=-1)  # fmt: skip
        ok = torch.cat((page_ok, page_ok.new_ones(*page_ok.shape[:2], window + sinks)), dim=-1)  # (B, H_kv, N)
        k, v = self._gather(read.keys, rows).to(dtype), self._gather(read.values, rows).to(dtype)
        return attend(q, k, v[..., : read.value_width], ok[:, :, None, :], scale)

    # ------------------------------------------------------------------ storage

    def _fields(self, buffer: str):
        return [(f.name, *self.layout.slices[f.name][1:]) for f in dict(self.layout.buffers)[buffer]]

    def _decoded(self, buffer: str, pick) -> torch.Tensor:
        """A buffer's rows as stored, decoded: `pick(array)` selects rows on axis 1 of each storage array (a slice or
        a gather); -> (B, n, H, width) token-major."""
        parts = []
        for name, lo, hi in self._fields(buffer):
            rows = self.codecs[name].decode([pick(a) for a in self.arrays[name]], self.buffers[buffer].dtype)
            parts.append(rows.unflatten(-1, (self.layout.heads, hi - lo)))
        return torch.cat(parts, dim=-1)

    def _read(self, buffer: str, lo: int, hi: int) -> torch.Tensor:
        """Tokens [lo, hi) of a buffer as held, (B, H_kv, n, width) (H_kv = 1 without a head axis)."""
        if self.codecs is None:
            return four(self.buffers[buffer])[:, :, lo:hi]
        return self._decoded(buffer, lambda a: a[:, lo:hi]).transpose(1, 2)

    def _gather(self, buffer: str, rows: torch.Tensor) -> torch.Tensor:
        """The tokens `rows` (B, H_kv, N) of each KV head, (B, H_kv, N, width): only those rows are read (with a
        policy, decoded for every head and the head's own values kept)."""
        if self.codecs is None:
            held = four(self.buffers[buffer])
            return held.gather(2, rows[..., None].expand(-1, -1, -1, held.shape[-1]))
        batch, heads, count = rows.shape
        flat = rows.flatten(1)  # (B, H_kv * N)
        pick = lambda a: a.gather(1, flat.view(*flat.shape, *[1] * (a.dim() - 2)).expand(-1, -1, *a.shape[2:]))  # noqa: E731
        decoded = self._decoded(buffer, pick).view(batch, heads, count, heads, -1)  # every head of every row
        own = torch.arange(heads, device=rows.device)
        return decoded[:, own, :, own].transpose(0, 1)  # (B, H_kv, N, width): row h's head h

    def _encode(self, buffer: str, value: torch.Tensor, start: int) -> None:
        """value (B, H_kv, T, width) of one buffer into its fields' storage arrays at slots start.."""
        batch, heads, length, _ = value.shape
        for name, lo, hi in self._fields(buffer):
            rows = value[..., lo:hi].detach().transpose(1, 2).reshape(batch, length, heads * (hi - lo))
            for array, encoded in zip(self.arrays[name], self.codecs[name].encode(rows.contiguous()), strict=True):
                array[:, start : start + length] = encoded

    def _store(self, new: dict[str, torch.Tensor], positions: torch.Tensor) -> None:
        start, end = self.length, self.length + positions.shape[0]
        if int(positions[0]) != start:
            raise InputError(f"quest cache: a chunk at position {int(positions[0])} does not continue the "
                             f"{start} tokens held (positions must follow on)")  # fmt: skip
        if self.max_len is not None and end > self.max_len:
            raise InputError(f"KV cache is full: {end} tokens exceed its max_len={self.max_len} (make a larger cache)")
        capacity = next(iter(self.buffers.values())).shape[-2] if self.codecs is None else self.capacity_slots()
        if end > capacity:
            self._grow(max(end, 2 * capacity) if self.max_len is None else min(max(end, 2 * capacity), self.max_len))
        for name, value in new.items():
            if self.codecs is None:
                self.buffers[name][..., start:end, :] = value
            else:
                self._encode(name, four(value), start)
        self.length = end
        pages = end // self.memory.page_size
        if self.key_min is not None and pages > self.complete_pages:
            lo = self.complete_pages * self.memory.page_size
            keys = self._read(self.keys, lo, pages * self.memory.page_size)  # as stored
            low, high = key_extremes(keys, pages - self.complete_pages, self.memory.page_size)
            self.key_min[:, :, self.complete_pages : pages] = low
            self.key_max[:, :, self.complete_pages : pages] = high
            self.complete_pages = pages

    def capacity_slots(self) -> int:
        """Tokens the storage holds before it grows again (with a policy)."""
        name = next(iter(self.arrays))
        return self.arrays[name][0].shape[1] * self.codecs[name].tokens_per_block

    def _grow(self, slots: int) -> None:
        for name, b in self.buffers.items() if self.codecs is None else ():
            grown = b.new_zeros(*b.shape[:-2], slots, b.shape[-1])
            grown[..., : b.shape[-2], :] = b
            self.buffers[name] = grown
        for name, arrays in self.arrays.items():
            self.arrays[name] = [torch.cat((a, a.new_zeros(a.shape[0], slots - a.shape[1], *a.shape[2:])), dim=1)
                                 for a in arrays]  # fmt: skip
        if self.key_min is not None:
            pages = -(-slots // self.memory.page_size)
            for attr in ("key_min", "key_max"):
                b = getattr(self, attr)
                grown = b.new_zeros(*b.shape[:2], pages, b.shape[-1])
                grown[:, :, : b.shape[2]] = b
                setattr(self, attr, grown)
