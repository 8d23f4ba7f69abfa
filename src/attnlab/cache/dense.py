"""Dense cache: preallocated buffers for up to `max_len` tokens, filled left to right."""

from __future__ import annotations

import torch

from attnlab.cache.base import BufferCache
from attnlab.errors import InputError


class DenseCache(BufferCache):
    """Holds named tensors of shape (*prefix, max_len, dim), written at slots [length, length + T)."""

    capacity = None  # grows with the sequence (within max_len)

    def __init__(self, shapes: dict[str, tuple[int, ...]], max_len: int, dtype: torch.dtype, device=None):
        super().__init__(shapes, max_len, dtype, device)
        self.max_len, self.length = max_len, 0

    def positions(self) -> torch.Tensor:
        return self.slot_positions[: self.length]

    def update(self, new: dict[str, torch.Tensor], positions: torch.Tensor):
        start, end = self.length, self.length + positions.shape[0]
        if end > self.max_len:
            raise InputError(f"KV cache is full: {end} tokens exceed its max_len={self.max_len} (make a larger cache)")
        for name, value in new.items():
            self.buffers[name][..., start:end, :] = value
        self.slot_positions[start:end] = positions
        self.length = end
        held = {name: b[..., :end, :] for name, b in self.buffers.items()}
        return self.as_compute(held, new), self.slot_positions[:end]
