"""A quest decode step in C (quest.c): page bounds, top-K pages and attention over the chosen rows in one call,
for attnlab.cache.sparse.QuestCache with fp32 buffers (no KV policy).

    out = attend(q, keys, values, value_width, key_min, key_max, pages, t, memory, scale)   # (B, H, 1, dv)

Built and loaded as qattn.c is (attnlab.kernels.cpu.compiled); callers check `usable(...)` first and otherwise run
the PyTorch path (QuestCache.attend_one), which this is tested against.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from attnlab.kernels import cpu

SOURCE = Path(__file__).with_name("quest.c")
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled quest.c, or None (see attnlab.kernels.cpu.compiled; warned once)."""
    return cpu.compiled(SOURCE, load)


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    strided = [_ptr, _i64, _i64, _i64]  # a buffer and its strides per sequence, KV head and row
    shape, extremes = [_i64] * 5, [_ptr, _ptr, _i64, _i64]
    lib.attnlab_quest_attend.argtypes = [*shape, _ptr, *strided, *strided, *extremes, *[_i64] * 6, ctypes.c_float, _ptr]
    lib.attnlab_quest_attend.restype = ctypes.c_int
    return lib


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernel may take these tensors: fp32 on the CPU, nothing needing a gradient, outside a
    torch.compile trace, the kernels built and not switched off."""
    if torch.compiler.is_compiling() or cpu.switched_off():
        return False
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return library() is not None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t (B, H_kv, n, width) with each row's values contiguous (a copy only where they are not)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def attend(q, keys, values, value_width, key_min, key_max, pages, t, memory, scale) -> torch.Tensor:
    """One query per head, q (B, H, 1, dk), over keys (B, H_kv, S, dk) and the first value_width values of values
    (B, H_kv, S, width) held for positions 0..t, reading the window, the sinks and the `memory.pages` candidate pages
    of largest bound among the first `pages` complete pages (key_min, key_max (B, H_kv, >= pages, dk)). Returns
    (B, H, 1, value_width) float32."""
    batch, heads, _, dk = q.shape
    kv_heads = keys.shape[1]
    keys, values = _rows(keys), _rows(values)
    key_min, key_max = key_min.contiguous(), key_max.contiguous()
    flat_q = q[:, :, 0].contiguous()
    out = torch.empty(batch, heads, value_width, dtype=torch.float32)
    failed = library().attnlab_quest_attend(
        batch, kv_heads, heads // kv_heads, dk, value_width, flat_q.data_ptr(),
        keys.data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2),
        values.data_ptr(), values.stride(0), values.stride(1), values.stride(2),
        key_min.data_ptr(), key_max.data_ptr(), key_min.stride(0), key_min.stride(1),
        pages, t, memory.page_size, memory.recent_window, memory.sink_tokens, memory.pages, scale, out.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError("attnlab's quest kernel could not allocate its scratch memory")
    return out[:, :, None]
