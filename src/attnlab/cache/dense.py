"""Dense cache: preallocated buffers for up to `max_len` tokens, filled left to right."""

from __future__ import annotations

import torch

from attnlab.cache.base import BufferCache
from attnlab.cache.layout import CacheLayout
from attnlab.errors import InputError


class DenseCache(BufferCache):
    """Holds the layout's buffers, (*prefix, max_len, width), written at slots [length, length + T).

    In static mode (`set_static(True)`, for a compiled decode step) slot = position: `update` writes with
    `index_copy_` and returns the whole buffers and `slot_positions` (empty slots at -1, masked out), so
    every step has the same shapes and reads no Python-side state (`length` is recounted on leaving)."""

    def __init__(self, layout: CacheLayout, batch: int, max_len: int, dtype: torch.dtype, device=None):
        super().__init__(layout, batch, max_len, dtype, device)
        self.max_len, self.length = max_len, 0

    def positions(self) -> torch.Tensor:
        return self.slot_positions if self.static else self.slot_positions[: self.length]

    def supports_static(self) -> bool:
        return True

    def set_static(self, static: bool) -> None:
        if self.static and not static:
            self.length = int((self.slot_positions >= 0).sum())  # slots are filled left to right
        self.static = static

    def update(self, new: dict[str, torch.Tensor], positions: torch.Tensor, write=None):
        if self.static:
            # No bounds check here (it would read a tensor): the caller sizes the cache for its positions.
            for name, value in new.items():
                buffer = self.buffers[name]
                buffer.index_copy_(buffer.dim() - 2, positions, value.to(buffer.dtype))
            self.slot_positions.index_copy_(0, positions, positions)
            return self.as_compute(self.buffers, new), self.slot_positions
        start, end = self.length, self.length + positions.shape[0]
        if end > self.max_len:
            raise InputError(f"KV cache is full: {end} tokens exceed its max_len={self.max_len} (make a larger cache)")
        for name, value in new.items():
            self.buffers[name][..., start:end, :] = value
        self.slot_positions[start:end] = positions
        self.length = end
        held = {name: b[..., :end, :] for name, b in self.buffers.items()}
        return self.as_compute(held, new), self.slot_positions[:end]
