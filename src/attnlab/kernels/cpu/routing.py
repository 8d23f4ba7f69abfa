"""The bounded memory's sequential routing decisions in C (routing.c), for attnlab.cache.banks.

    source, slot_positions, last_used, taken = exact_routing(to_bank, to_candidate, positions, passed,
                                                             slot_positions, last_used, tau_novel, tau_match)
    slot, opens = summary_routing(units, keys, bank, rates, passed, used, argmax, tau_novel)

Decisions only (long and bool tensors, no gradient): the PyTorch path computes the cosines and the values. Built
and loaded as qattn.c is (attnlab.kernels.cpu.compiled); callers check `usable(...)` first and otherwise run the
PyTorch loops (attnlab.cache.banks), which these are tested against.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from attnlab.kernels import cpu

SOURCE = Path(__file__).with_name("routing.c")
_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled routing.c, or None (see attnlab.kernels.cpu.compiled; warned once)."""
    return cpu.compiled(SOURCE, load)


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.attnlab_exact_routing.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _f32, _f32]
    lib.attnlab_summary_routing.argtypes = [_i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr,
                                            ctypes.c_int, _f32, _ptr, _ptr]  # fmt: skip
    lib.attnlab_exact_routing.restype = lib.attnlab_summary_routing.restype = ctypes.c_int
    return lib


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the C routing may take these tensors: on the CPU, outside a torch.compile trace, the kernels built
    and not switched off."""
    if torch.compiler.is_compiling() or cpu.switched_off() or any(t.device.type != "cpu" for t in tensors):
        return False
    return library() is not None


def _c(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to(dtype).contiguous()


def _check(status: int) -> None:
    if status:
        raise MemoryError("attnlab's routing kernel could not allocate its scratch memory")


def exact_routing(to_bank, to_candidate, positions, passed, slot_positions, last_used, tau_novel, tau_match):
    """The exact bank's routing (banks.exact_routing) from its cosines: to_bank (B, E, M_e), to_candidate (B, E, E)
    float32; positions (E,); passed (B, E) bool; slot_positions, last_used (B, M_e) long. Returns (source,
    slot_positions, last_used, taken), as banks.exact_routing."""
    batch, count, slots = to_bank.shape
    to_bank, to_candidate = _c(to_bank, torch.float32), _c(to_candidate, torch.float32)
    positions, passed = _c(positions, torch.long), _c(passed, torch.uint8)
    slot_positions, last_used = slot_positions.to(torch.long).clone(), last_used.to(torch.long).clone()
    source = torch.empty(batch, slots, dtype=torch.long)
    taken = torch.empty(batch, count, dtype=torch.long)
    _check(library().attnlab_exact_routing(
        batch, count, slots, to_bank.data_ptr(), to_candidate.data_ptr(), positions.data_ptr(), passed.data_ptr(),
        slot_positions.data_ptr(), last_used.data_ptr(), source.data_ptr(), taken.data_ptr(), tau_novel, tau_match,
    ))  # fmt: skip
    return source, slot_positions, last_used, taken


def summary_routing(units, keys, bank, rates, passed, used, argmax: bool, tau_novel: float):
    """The summary bank's slot for each candidate, each one moving its prototype before the next is routed (the
    decisions of banks.BoundedCache._update_summary). units, keys (B, H, E, d): the candidates' LF-K channels,
    unit-normalised and as blended; bank (B, H, M_s, d): the prototypes' LF-K channels before the chunk; rates
    (B, H, E); passed (B, E) bool; used (B, M_s) bool; tau_novel summed over heads. Returns (slot (B, E) long, -1:
    none; opens (B, E) bool: it opened an empty slot)."""
    batch, heads, count, width = units.shape
    slots = bank.shape[2]
    units, keys, rates = _c(units, torch.float32), _c(keys, torch.float32), _c(rates, torch.float32)
    bank = bank.detach().to(torch.float32).clone(memory_format=torch.contiguous_format)
    passed, used = _c(passed, torch.uint8), used.detach().to(torch.uint8).clone()
    slot = torch.empty(batch, count, dtype=torch.long)
    opens = torch.empty(batch, count, dtype=torch.uint8)
    _check(library().attnlab_summary_routing(
        batch, heads, count, slots, width, units.data_ptr(), keys.data_ptr(), bank.data_ptr(), rates.data_ptr(),
        passed.data_ptr(), used.data_ptr(), int(argmax), tau_novel, slot.data_ptr(), opens.data_ptr(),
    ))  # fmt: skip
    return slot, opens.bool()
