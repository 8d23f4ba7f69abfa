"""Ring-buffer cache for sliding-window attention: `window` slots, slot = position % window."""

from __future__ import annotations

import torch

from attnlab.cache.base import BufferCache


class RingCache(BufferCache):
    def __init__(self, shapes: dict[str, tuple[int, ...]], window: int, dtype: torch.dtype, device=None):
        """shapes: name -> buffer shape with `window` at axis -2."""
        super().__init__(shapes, window, dtype, device)
        self.capacity = window

    def positions(self) -> torch.Tensor:
        return self.slot_positions

    def _write(self, new: dict[str, torch.Tensor], positions: torch.Tensor) -> None:
        keep = min(positions.shape[0], self.capacity)  # older tokens of a long chunk fall out of the window
        slots = positions[-keep:] % self.capacity
        for name, value in new.items():
            buffer = self.buffers[name]
            buffer.index_copy_(buffer.dim() - 2, slots, value[..., -keep:, :].to(buffer.dtype))
        self.slot_positions[slots] = positions[-keep:]

    def update(self, new: dict[str, torch.Tensor], positions: torch.Tensor):
        if positions.shape[0] == 1:
            # One token overwrites only the slot of position p - window, which its query no longer sees.
            self._write(new, positions)
            return dict(self.buffers), self.slot_positions
        # A chunk's early queries still need slots its later tokens would overwrite: attend over
        # held + new, then keep the newest `window` tokens.
        held = {name: torch.cat((self.buffers[name], value), dim=-2) for name, value in new.items()}
        held_positions = torch.cat((self.slot_positions, positions))
        self._write(new, positions)
        return held, held_positions
