"""One decode step of a whole Llama-style block stack in one C call (fused.c): batch 1, one new token, attention
mha, decoupled or MLA (absorbed), every linear layer 8-bit activations over packed rows (qmatmul.c's functions,
#included) or float32 activations over float32 or fp16 rows, a dense float32 KV cache or a quantized one of
per-token rows (qattn.c's decoders and quantizer, #included; the attention in fused_attn.c, #included).

    status = decode(plan, eps, scale, token, pos, logits)    # -> the argmax of the logits

`plan` is an int64 tensor fused.c reads the model and the cache from (attnlab.model.fused builds it: PLAN_HEADER
values, then PLAN_LAYER per block). Built and loaded as qattn.c is (attnlab.kernels.cpu.compiled); callers check
`available()` first.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from attnlab.kernels import cpu
from attnlab.kernels.cpu import qmatmul

SOURCE = Path(__file__).with_name("fused.c")
ATTENTION = Path(__file__).with_name("fused_attn.c")  # #included by fused.c
PLAN_HEADER = 26  # fused.c's P_* values, in its order
PLAN_LAYER = 46  # fused.c's L_* values per block, in its order
PART_VALUES = 5  # fused.c's PART_* values of a quantized cache's part (3 per block)
KINDS = {"mha": 0, "decoupled": 1, "mla": 2}  # fused.c's P_KIND codes

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def build(directory: Path | None = None) -> Path:
    """fused.c built (attnlab.kernels.cpu.build), its cache key including qmatmul.c, qattn.c and fused_attn.c, which it
    #includes."""
    return cpu.build(directory, source=SOURCE, includes=(qmatmul.SOURCE, cpu.SOURCE, ATTENTION))


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled fused.c, or None (see attnlab.kernels.cpu.compiled; warned once)."""
    return cpu.compiled(SOURCE, load, builder=build)


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    function = lib.attnlab_fused_decode
    function.argtypes = [_ptr, ctypes.c_float, ctypes.c_float, _i64, _i64, _ptr, _ptr]
    function.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether fused.c is built, the kernels not switched off, and this machine multiplies packed rows fast (the
    layers it reads are packed only there: qmatmul.packed_fast)."""
    return not cpu.switched_off() and qmatmul.packed_fast() and library() is not None


class Unstorable(ValueError):
    """fused.c's status -3: a block format could not store a K or V value (attnlab.model.fused names the layer)."""


class Decoder:
    """The C function bound to one plan: `step(token, pos, logits)` -> the argmax (see fused.c). The plan's
    pointers stay valid while the caller holds the tensors they point into."""

    def __init__(self, plan: torch.Tensor, eps: float, scale: float):
        if plan.dtype != torch.int64 or not plan.is_contiguous():
            raise ValueError("the plan must be a contiguous int64 tensor")
        self.plan, self.eps, self.scale = plan, ctypes.c_float(eps), ctypes.c_float(scale)
        self._function = library().attnlab_fused_decode  # looked up once: attribute access costs a few µs
        self._argmax = ctypes.c_int64(0)
        self._argmax_pointer = ctypes.addressof(self._argmax)

    def step(self, token: int, pos: int, logits: torch.Tensor) -> int:
        """token at position pos through the plan's blocks; logits (vocab rows,) float32 written; returns the argmax
        over the first vocab_size. ValueError for a position or token outside the plan or a value a quantized cache
        cannot store; MemoryError."""
        status = self._function(self.plan.data_ptr(), self.eps, self.scale, token, pos, logits.data_ptr(),
                                self._argmax_pointer)  # fmt: skip
        if status == -1:
            raise ValueError(
                f"fused decode: position {pos} or token {token} outside the cache, RoPE table or vocabulary (or a "
                "quantized cache's counters not at that position)"
            )
        if status == -3:
            raise Unstorable(
                "fused decode: a K or V value that is not finite, or too large for the fp16 scale of its blocks, "
                "cannot be stored in the quantized cache (the model produced it: check its inputs)"
            )
        if status:
            raise MemoryError("fused decode: out of memory for its row buffers")
        return self._argmax.value
