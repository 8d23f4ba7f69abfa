"""The KV-cache contract. A cache is a value: passed into the model and returned, never module state.

Every method a cache offers is declared here, with a safe default; an attention variant never asks a cache
what it can do. A layer cache holds the buffers its variant's layout declares (cache/layout.py), with the
sequence on axis -2, and the absolute position of each slot, so masks are built from positions and stay
right after a ring buffer wraps or a memory replaces a slot.

    update(new, positions, write)  stores a chunk, returns (what the chunk's queries attend over, its positions)
    mask(q_pos, k_pos, window, null)  visibility of those slots: (mask, is_causal) for `attend`
    observe(probs)                 the attention probabilities over them, for caches that want them (H2O)
    attend_one(q, new, positions, read, scale)  one decode step done by the cache itself (a kernel), or None
    positions(), nbytes(), overhead_nbytes(), read_nbytes(), capacity
    supports_static(), set_static(static)      a static-shape mode for generate's compiled decode step

`attnlab.cache.attend` runs a query through any cache with these methods alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from attnlab.cache.layout import CacheLayout, Read
from attnlab.errors import InputError
from attnlab.ops.masks import attention_mask


@dataclass(frozen=True)
class Write:
    """The learned write parameters of a bounded memory for one chunk (the model's MemoryWrite computes
    them from the attention's input): gate (B, T) per token, or None for write_policy none (g = 1); eta the
    summary bank's EMA rate, (H_kv,) or ()."""

    gate: torch.Tensor | None
    eta: torch.Tensor


class LayerCache(ABC):
    """One layer's cache. Subclasses implement positions, nbytes and update; the rest has defaults."""

    capacity: int | None = None  # slots held at most; None = grows with the sequence (up to max_len)
    static: bool = False  # in static mode `update` returns every slot (empty ones at -1): fixed shapes
    wants_probs: bool = False  # observe() needs the attention probabilities (H2O)
    per_sequence: bool = False  # positions() is (B, S): the held tokens differ per sequence (memories)
    selects: bool = False  # `resolve` picks each query's visible slots from the queries (quest): the mask is not
    # the causal rule on positions, so kernels that build masks from positions do not apply

    def __init__(self, layout: CacheLayout):
        self.layout = layout

    @abstractmethod
    def positions(self) -> torch.Tensor:
        """(S,) int64 absolute position of each held slot (-1 for an empty slot); (B, S) when per_sequence."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of the cached tensors this cache holds, measured from them (without bookkeeping)."""

    @abstractmethod
    def update(
        self, new: dict[str, torch.Tensor], positions: torch.Tensor, write: Write | None = None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Stores `new` (the layout's buffers, seq on axis -2) at `positions` (T,); returns the buffers the
        queries at `positions` attend over (seq on axis -2) and those slots' positions, (S,) or (B, S)."""

    def overhead_nbytes(self) -> int:
        """Bytes of bookkeeping beside the cached tensors (slot positions, scores)."""
        return 0

    def read_nbytes(self) -> int:
        """Bytes of cached tensors the next decode step reads. Default: every byte held (`nbytes`)."""
        return self.nbytes()

    def mask(
        self, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None, null: bool = False
    ) -> tuple[torch.Tensor | None, bool]:
        """(mask, is_causal) for `attend` over the slots `update` returned: the causal rule on positions (and
        the variant's window), a leading always-visible column for a null key."""
        return attention_mask(q_pos, k_pos, window, null, self.static)

    def resolve(
        self, q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None, null: bool
    ) -> torch.Tensor | None:
        """The mask a chunk's queries q (B, H, T, D) attend with over the keys k (B, H_kv, S, D) (a null
        key first when `null`), given the one `mask` built from positions. A cache whose evictions depend on
        the attention itself (H2O) decides them here, query by query, so that a chunk sees what token-by-token
        decoding would, and a cache that reads only some slots per query (quest) chooses them; called only when
        `wants_probs` (before `observe`) or `selects`. Default: `mask`."""
        return mask

    def observe(self, probs: torch.Tensor) -> None:
        """probs (B, H, Tq, S): attention probabilities over the slots `update` returned (no null column).
        Called only when `wants_probs`; a cache that sets it overrides this."""
        return None

    def attend_one(
        self, q: torch.Tensor, new: dict[str, torch.Tensor], positions: torch.Tensor, read: Read, scale: float
    ) -> torch.Tensor | None:
        """A decode step done by the cache: stores `new` and returns softmax(q K^T scale) V (B, H, 1, d_v)
        as `read` says; None (having stored nothing) where it does not apply, and the caller runs `update`."""
        return None

    def supports_static(self) -> bool:
        return False

    def set_static(self, static: bool) -> None:
        if static and not self.supports_static():
            raise InputError(f"{type(self).__name__} has no static mode (check supports_static() first)")
        self.static = static


@dataclass
class ModelCache:
    """One LayerCache per layer plus the number of tokens seen (the next absolute position) and the number of
    sequences it holds (None: not recorded)."""

    layers: list[LayerCache]
    seen: int = 0
    batch: int | None = None
    made_for: tuple | None = None  # (layers, attention config, memory config) of the model that made it

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def overhead_nbytes(self) -> int:
        return sum(layer.overhead_nbytes() for layer in self.layers)

    def supports_static(self) -> bool:
        return all(layer.supports_static() for layer in self.layers)

    def set_static(self, static: bool) -> None:
        """Static mode on every layer (see LayerCache); `seen` stays the caller's to advance meanwhile."""
        for layer in self.layers:
            layer.set_static(static)

    def __len__(self) -> int:
        return self.seen


class BufferCache(LayerCache):
    """Shared storage of the dense and ring caches: the layout's buffers with `slots` positions on axis -2."""

    def __init__(self, layout: CacheLayout, batch: int, slots: int, dtype: torch.dtype, device=None):
        super().__init__(layout)
        shapes = layout.shapes(batch, slots)
        self.buffers = {name: torch.zeros(shape, dtype=dtype, device=device) for name, shape in shapes.items()}
        self.slot_positions = torch.full((slots,), -1, dtype=torch.long, device=device)

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def overhead_nbytes(self) -> int:
        return self.slot_positions.nbytes

    @staticmethod
    def as_compute(held: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Held tensors in the dtype of the incoming values (a cache may be stored narrower, e.g. fp16)."""
        return {name: held[name].to(new[name].dtype) for name in new}
