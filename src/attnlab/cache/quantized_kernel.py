"""The decode step of a growing quantized cache done in C (attnlab.kernels.cpu), and the same step as one
compiled-graph op, `attnlab::quantized_attend`, which takes every tensor it writes and declares it mutated.

A `KernelPlan` is the static description of one cache (its parts, their formats and widths, the residual
ring, which buffers are K and V); the state is tensors: the stored blocks and the residual ring of each part,
and `counters` = [tokens seen, tokens stored, max_len] (int64). `step` attends one token and writes it:

    out = plan.step(q, rows, store, recent, counters, scale)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from attnlab import quant
from attnlab.cache.codecs import Codec
from attnlab.errors import InputError
from attnlab.kernels import cpu as cpu_kernels
from attnlab.kernels.cpu import ops as cpp_ops


@dataclass(frozen=True)
class PlanPart:
    name: str
    buffer: str
    lo: int  # slice [lo, hi) of the buffer's per-head width
    hi: int
    fmt: str
    width: int  # values per token row (over all KV heads)
    is_key: bool
    n_arrays: int  # storage arrays of its format (Codec.allocate): 2 for block formats, else 1


@dataclass(frozen=True)
class KernelPlan:
    parts: tuple[PlanPart, ...]
    ring_slots: int  # full-precision residual slots, a ring
    resid: int  # newest tokens kept at full precision
    flush: int  # tokens quantized together (the policy's flush)
    kv_heads: int
    keys: str  # the buffer read as K (all of its parts)
    values: str  # the buffer read as V (its parts within value_width)
    value_width: int
    group: int

    def to_spec(self) -> str:
        """The plan as a string of names and numbers (no quotes: inductor's C++ wrapper writes it into a C++
        string literal unescaped); `KernelPlan.parse` reads it back."""
        parts = ";".join(":".join(str(v) for v in dataclasses.astuple(p)) for p in self.parts)
        scalars = [getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "parts"]
        return parts + "|" + ":".join(str(v) for v in scalars)

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def parse(spec: str) -> KernelPlan:
        parts_text, scalars_text = spec.split("|")
        part_types = [f.type for f in dataclasses.fields(PlanPart)]
        parts = tuple(
            PlanPart(*(_typed(v, t) for v, t in zip(text.split(":"), part_types, strict=True)))
            for text in parts_text.split(";")
        )
        fields = [f for f in dataclasses.fields(KernelPlan) if f.name != "parts"]
        values = {f.name: _typed(v, f.type) for f, v in zip(fields, scalars_text.split(":"), strict=True)}
        return KernelPlan(parts, **values)

    @functools.cached_property
    def codecs(self) -> list[Codec]:
        return [Codec(p.fmt, p.width, p.is_key, self.group, p.name) for p in self.parts]

    def ring_pieces(self, first: int, end: int) -> list[tuple[int, int, int]]:
        """Positions [first, end) as at most two runs of ring slots: (position, slot, length) each."""
        pieces, position = [], first
        while position < end:
            slot = position % self.ring_slots
            length = min(end - position, self.ring_slots - slot)
            pieces.append((position, slot, length))
            position += length
        return pieces

    def attend(
        self, q: torch.Tensor, rows: list[torch.Tensor], store: list[list[torch.Tensor]], recent: list[torch.Tensor],
        seen: int, stored: int, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        """softmax(q K^T scale) V over the stored rows [0, stored), the residual ring [stored, seen) and the new
        token's rows (one per part, (B, 1, width)), read in place. q (B, H, 1, D) -> (B, H, 1, value_width)."""
        window = self.ring_pieces(stored, seen)

        def runs(select):  # (format, arrays, first row, rows, first score column, lo, d) of every run
            for i, p in enumerate(self.parts):
                if not select(p):
                    continue
                d = p.hi - p.lo
                yield p.fmt, store[i], 0, stored, 0, p.lo, d
                for position, slot, length in window:
                    yield "fp32", [recent[i]], slot, length, position, p.lo, d
                yield "fp32", [rows[i]], 0, 1, seen, p.lo, d

        keys = list(runs(lambda p: p.buffer == self.keys))
        values = list(runs(lambda p: p.buffer == self.values and p.hi <= self.value_width))
        out = q.new_zeros(q.shape[0], q.shape[1], self.value_width)
        cpu_kernels.attend(keys, values, self.kv_heads, q[:, :, 0], scale, seen + 1, out)
        return out[:, :, None]

    def write(
        self, rows: list[torch.Tensor], store: list[list[torch.Tensor]], recent: list[torch.Tensor], start: int,
        stored: int,
    ) -> int:  # fmt: skip
        """Stores a chunk's rows (B, n, width) per part at positions start.., quantizing every token that leaves
        the residual window (slices and one quantizer call per run, no index tensors); returns the new count
        of stored tokens."""
        end = start + rows[0].shape[1]
        leave = stored + max(0, (end - self.resid - stored) // self.flush) * self.flush  # [stored, leave) leave
        if leave > stored:  # older ones from the ring, then the chunk's
            for i, codec in enumerate(self.codecs):
                for position, slot, length in self.ring_pieces(stored, min(start, leave)):
                    codec.encode_into(recent[i][:, slot : slot + length], store[i], position)
                if leave > start:
                    first = max(start, stored)
                    codec.encode_into(rows[i][:, first - start : leave - start], store[i], first)
        for position, slot, length in self.ring_pieces(max(start, leave), end):  # the rest stays at full precision
            offset = position - start
            for i in range(len(self.parts)):
                recent[i][:, slot : slot + length] = rows[i][:, offset : offset + length]
        return leave

    def step(
        self, q: torch.Tensor, rows: list[torch.Tensor], store: list[list[torch.Tensor]], recent: list[torch.Tensor],
        counters: torch.Tensor, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        """One decode step on the state tensors: attend, write the token, advance counters [seen, stored] (and
        check [max_len], the tokens the cache has room for)."""
        values = counters.numpy()  # a view: reads and writes without tensor indexing's per-call cost
        seen, stored, max_len = int(values[0]), int(values[1]), int(values[2])
        if seen + 1 > max_len:  # the C quantizer writes where it is told: check before it does
            raise InputError(f"KV cache is full: {seen + 1} tokens exceed its max_len={max_len} (make a larger cache)")
        out = self.attend(q, rows, store, recent, seen, stored, scale)
        values[1] = self.write(rows, store, recent, seen, stored)
        values[0] = seen + 1
        return out


def _typed(text: str, annotation: str):
    """A spec field back from its text (annotations are strings under `from __future__ import annotations`)."""
    if annotation == "int":
        return int(text)
    if annotation == "bool":
        return text == "True"
    return text


# Registered through torch.library's low-level API: the schema marks store, recent and counters as written
# (Tensor(a!)), so a compiled graph keeps the call and its order; the kernel is the CPU one. (custom_op's Python
# wrapper cost 27 µs more per call, 7% of a decode step at 4,096 tokens.)
torch.library.define(
    "attnlab::quantized_attend",
    "(Tensor q, Tensor[] rows, Tensor(a!)[] store, Tensor(b!)[] recent, Tensor(c!) counters, str spec, "
    "float scale) -> Tensor",
)


def quantized_attend(
    q: torch.Tensor,
    rows: list[torch.Tensor],
    store: list[torch.Tensor],
    recent: list[torch.Tensor],
    counters: torch.Tensor,
    spec: str,
    scale: float,
) -> torch.Tensor:
    """KernelPlan.parse(spec).step as one op for a compiled decode step: reads and writes the cache's stored
    blocks (`store`, each part's arrays in order, flattened), its residual ring (`recent`, one per part) and
    `counters` [seen, stored] (max_len read), all in place; returns the attention output (B, H, 1, value_width)."""
    plan = KernelPlan.parse(spec)
    grouped, i = [], 0
    for part in plan.parts:
        grouped.append(store[i : i + part.n_arrays])
        i += part.n_arrays
    return plan.step(q, rows, grouped, recent, counters, scale)


torch.library.impl("attnlab::quantized_attend", "CPU", func=quantized_attend)


@torch.library.register_fake("attnlab::quantized_attend")
def _(q, rows, store, recent, counters, spec, scale):
    return q.new_empty(q.shape[0], q.shape[1], 1, KernelPlan.parse(spec).value_width)


# The same step as a C++ operator (attnlab.kernels.cpu.ops, ops.cpp): no Python in a compiled step's call. It takes
# attnlab.quant's NF4 tables as inputs, so that they exist once.
torch.library.define(
    "attnlab_cpp::quantized_attend",
    "(Tensor q, Tensor[] rows, Tensor(a!)[] store, Tensor(b!)[] recent, Tensor(c!) counters, str spec, "
    "float scale, Tensor nf4_below, Tensor nf4_inside) -> Tensor",
)


@torch.library.register_fake("attnlab_cpp::quantized_attend")
def _(q, rows, store, recent, counters, spec, scale, nf4_below, nf4_inside):
    return q.new_empty(q.shape[0], q.shape[1], 1, KernelPlan.parse(spec).value_width)


def attend_static(q, rows, store, recent, counters, spec: str, scale: float) -> torch.Tensor:
    """`quantized_attend` through the C++ operator where it is built (attnlab.kernels.cpu.ops.usable), else the
    Python one: the same bits."""
    if cpp_ops.usable():
        return torch.ops.attnlab_cpp.quantized_attend(
            q, rows, store, recent, counters, spec, scale, quant._NF4_BELOW, quant._NF4_INSIDE
        )
    return torch.ops.attnlab.quantized_attend(q, rows, store, recent, counters, spec, scale)
