"""A GGUF file's header, metadata and tensor table, read in one pass with `struct` (the GGUF format:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md); the tensors' data stay memory-mapped.

gguf-py's GGUFReader builds a numpy view for every part of every value: a 49,152-token vocabulary (100,000
strings with its merges) takes it 5-10 s to read, before any weight. This reads the same file in a fraction of a
second and gives the same values (tests/test_gguf.py compares them with GGUFReader's on each file it writes): the
metadata as Python values (str, int, float, bool, or lists of them) with gguf-py's three `GGUF.*` entries, and
each tensor as gguf-py shapes it (`data` a view of the file: float types as their numpy type, block formats as
bytes, rows of `quant_shape_to_byte_shape`), so gguf's own dequantize reads it. ValueError, KeyError or
struct.error for a file that is not a whole GGUF file (attnlab.interop.gguf.open_gguf turns them into one line).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
SUPPORTED_VERSIONS = (2, 3)  # as gguf-py reads them
DEFAULT_ALIGNMENT = 32
# Tensor types read as numpy numbers; the rest are blocks of bytes.
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the table, with gguf-py ReaderTensor's fields: shape in GGUF order (ne0, the innermost,
    first), data_offset from the start of the file, data a view of its bytes."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


@dataclass(frozen=True)
class GGUFTable:
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    data_offset: int  # where the tensor data start
    alignment: int


class _Cursor:
    def __init__(self, buffer: mmap.mmap, order: str, at: int):
        self.buffer, self.order, self.at = buffer, order, at

    def take(self, fmt: str):
        """One value of struct format `fmt` (a single letter)."""
        (value,) = struct.unpack_from(self.order + fmt, self.buffer, self.at)
        self.at += struct.calcsize(self.order + fmt)
        return value

    def string(self) -> str:
        length = self.take("Q")
        if self.at + length > len(self.buffer):
            raise ValueError(f"a string of {length:,} bytes at byte {self.at:,} runs past the end of the file")
        text = self.buffer[self.at : self.at + length].decode("utf-8")
        self.at += length
        return text

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in SCALARS:  # numbers in one read
                dtype = np.dtype(self.order + SCALARS[item])
                if self.at + count * dtype.itemsize > len(self.buffer):
                    raise ValueError(f"an array of {count:,} values at byte {self.at:,} runs past the end of the file")
                values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.at).tolist()
                self.at += count * dtype.itemsize
                return values
            if item not in (STRING, ARRAY):
                raise ValueError(f"unknown value type {item} in an array at byte {self.at:,}")
            if count > len(self.buffer) - self.at:  # each item takes at least a byte
                raise ValueError(f"an array of {count:,} items at byte {self.at:,} runs past the end of the file")
            return [self.value(item) for _ in range(count)]
        if kind not in SCALARS:
            raise ValueError(f"unknown value type {kind} at byte {self.at:,}")
        return self.take(SCALARS[kind])


def read_gguf_table(path: str | Path) -> GGUFTable:
    import gguf

    with open(path, "rb") as file:
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)  # ValueError for an empty file
    if buffer[:4] != b"GGUF":
        raise ValueError("GGUF magic invalid")
    order = "<" if struct.unpack_from("<I", buffer, 4)[0] & 0xFFFF else ">"  # a big-endian file's version reads so
    cursor = _Cursor(buffer, order, 4)
    version, tensor_count, kv_count = cursor.take("I"), cursor.take("Q"), cursor.take("Q")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (versions {SUPPORTED_VERSIONS})")
    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count}
    for _ in range(kv_count):
        key = cursor.string()
        if key in metadata:
            raise KeyError(f"metadata key {key} appears twice")
        metadata[key] = cursor.value(cursor.take("I"))
    entries = []
    for _ in range(tensor_count):
        name, dims = cursor.string(), cursor.take("I")
        shape = [cursor.take("Q") for _ in range(dims)]
        entries.append((name, shape, cursor.take("I"), cursor.take("Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"general.alignment={alignment!r} is not a positive whole number")
    start = cursor.at + (-cursor.at) % alignment
    tensors = []
    for name, shape, raw_type, offset in entries:
        kind = gguf.GGMLQuantizationType(raw_type)  # ValueError for a type gguf does not know
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        count = math.prod(shape)
        n_bytes, at = count * type_size // block, start + offset
        dims = tuple(reversed(shape))
        if kind.name in FLOAT_TYPES:
            dtype = np.dtype(FLOAT_TYPES[kind.name]).newbyteorder(order)
        else:
            dtype, dims = np.dtype(np.uint8), gguf.quant_shape_to_byte_shape(dims, kind)
        if at + n_bytes <= len(buffer):
            data = np.frombuffer(buffer, dtype=dtype, count=n_bytes // dtype.itemsize, offset=at).reshape(dims)
        else:  # a truncated file: open_gguf names the tensor that runs past its end
            data = np.empty(0, dtype=dtype)
        tensors.append(GGUFTensor(name, kind, np.array(shape, dtype=np.uint64), count, n_bytes, at, data))
    return GGUFTable(metadata, tensors, start, alignment)
