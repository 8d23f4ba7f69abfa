"""Ring-buffer cache for sliding-window attention: `window` slots, slot = position % window."""

from __future__ import annotations

import torch

from attnlab.cache.base import BufferCache
from attnlab.cache.layout import CacheLayout
from attnlab.errors import InputError


class RingCache(BufferCache):
    def __init__(self, layout: CacheLayout, batch: int, slots: int, dtype: torch.dtype, max_len: int, device=None):
        """slots = min(window, max_len): a sequence that will never exceed max_len tokens needs no more slots
        than that."""
        super().__init__(layout, batch, slots, dtype, device)
        self.capacity, self.max_len, self.seen = slots, max_len, 0

    def positions(self) -> torch.Tensor:
        return self.slot_positions

    def _write(self, new: dict[str, torch.Tensor], positions: torch.Tensor) -> None:
        keep = min(positions.shape[0], self.capacity)  # older tokens of a long chunk fall out of the window
        slots = positions[-keep:] % self.capacity
        for name, value in new.items():
            buffer = self.buffers[name]
            buffer.index_copy_(buffer.dim() - 2, slots, value[..., -keep:, :].to(buffer.dtype))
        self.slot_positions[slots] = positions[-keep:]

    def update(self, new: dict[str, torch.Tensor], positions: torch.Tensor, write=None):
        self.seen += positions.shape[0]
        if self.seen > self.max_len:  # fewer slots than the window would then overwrite visible tokens
            raise InputError(f"ring cache made for max_len={self.max_len} tokens got {self.seen} (make a larger cache)")
        if positions.shape[0] == 1:
            # One token overwrites only the slot of position p - window, which its query no longer sees.
            self._write(new, positions)
            return self.as_compute(self.buffers, new), self.slot_positions
        # A chunk's early queries still need slots its later tokens would overwrite: attend over
        # held + new, then keep the newest `window` tokens.
        held = {name: torch.cat((self.buffers[name].to(value.dtype), value), dim=-2) for name, value in new.items()}
        held_positions = torch.cat((self.slot_positions, positions))
        self._write(new, positions)
        return held, held_positions
