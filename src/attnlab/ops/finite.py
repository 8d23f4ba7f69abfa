"""Whether a tensor holds no NaN or infinity, at the cost of one read."""

from __future__ import annotations

import torch


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in `tensor`: its float32 sum (one read, which no real weights overflow) is finite when every
    value is, at under half a copy's cost (some 25 ms over 135M parameters on one core, where isfinite().all() takes
    1 s); only a non-finite sum has the values looked at one by one."""
    return bool(torch.isfinite(tensor.sum(dtype=torch.float32))) or bool(tensor.isfinite().all())
