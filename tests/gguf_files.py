"""Writing GGUF files in tests the way llama.cpp's converter does: q/k rows permuted, each matrix in a chosen
ggml type (gguf's own quantizers). Import after pytest.importorskip("gguf")."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def llama_cpp_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from (2, D/2) halves to (D/2, 2) pairs."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def add_tensors(writer, tensors: dict[str, np.ndarray], kind_of: Callable[[str, np.ndarray], Q],
                heads: tuple[int, int] | None = None) -> None:  # fmt: skip
    """Adds {GGUF name: float32 values}: each in kind_of(name, values) (F32 as is, F16 cast, a block type through
    gguf.quants.quantize); heads (n_heads, n_kv_heads): q and k rows permuted as llama's converter does."""
    for name, values in tensors.items():
        if heads is not None and ".attn_q." in name:
            values = llama_cpp_permute(values, heads[0])
        elif heads is not None and ".attn_k." in name:
            values = llama_cpp_permute(values, heads[1])
        kind = kind_of(name, values)
        if kind == Q.F32:
            writer.add_tensor(name, values)
        elif kind == Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)


def finish(writer, path):
    """Writes the header, metadata and tensors and closes the file: its path."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
