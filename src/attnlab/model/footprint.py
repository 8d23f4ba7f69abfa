"""A model's parameters against this machine's memory, refused before they are allocated: a model far too large
would otherwise end in the allocator's traceback, or be killed by the kernel's out-of-memory killer while it is
initialised, without a word (its RoPE tables: ops.rope; a training batch: train.budget)."""

from __future__ import annotations

import os

import torch


def ram_bytes() -> int | None:
    """Bytes of this machine's RAM; None when the system does not say."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return total if total > 0 else None


def device_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes, where) of the memory tensors made on `device` take: a CUDA device's own ("cuda:0"), else "RAM"."""
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory, f"{device.type}:{index}"
    return ram_bytes(), "RAM"


def _size(n: int) -> str:
    if n >= 2**40:
        return f"{n / 2**40:,.1f} TiB"
    if n >= 2**30:
        return f"{n / 2**30:,.0f} GiB"
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n:,} bytes"


def parameters_memory_problem(parts: dict[str, int], dtype: torch.dtype, device: torch.device) -> str | None:
    """Why parameters of `parts` (where they are -> how many) cannot be allocated in `dtype` on `device` (this
    machine's RAM, or a CUDA device's memory), or None (also when the system does not say its memory)."""
    total = sum(parts.values())
    need = total * dtype.itemsize
    have, where = device_memory(device)
    if have is None or need <= have:
        return None
    shown = ", ".join(f"{count:,} {part}" for part, count in parts.items() if count)
    held = f"this machine's {_size(have)} of RAM" if where == "RAM" else f"the {_size(have)} of {where}"
    return (f"the model's {total:,} parameters ({shown}) need {_size(need)} in {str(dtype).removeprefix('torch.')}, "
            f"more than {held}: make the model smaller (d_model, n_layers, vocab_size)")  # fmt: skip
