"""Writing GGUF files in tests the way llama.cpp's converter does (q/k rows permuted, each matrix in a chosen
ggml type through gguf's own quantizers), and a tiny llama model written so (`write_gguf`). Import after
pytest.importorskip("gguf")."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
from helpers import gguf_name, tiny_model

from attnlab.interop.hf import hf_targets

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


def add_hparams(writer, layers: int, context: int | None, width: int, ffn: int, heads: tuple[int, int],
                rope_base: float, eps: float, vocab: int) -> None:  # fmt: skip
    """The `<arch>.*` keys of a llama-like model (context None: left out); heads (n_heads, n_kv_heads)."""
    writer.add_block_count(layers)
    if context is not None:
        writer.add_context_length(context)
    writer.add_embedding_length(width)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads[0])
    writer.add_head_count_kv(heads[1])
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_vocab_size(vocab)


def add_hf_hparams(writer, cfg) -> None:
    """add_hparams from a transformers config."""
    add_hparams(writer, cfg.num_hidden_layers, cfg.max_position_embeddings, cfg.hidden_size, cfg.intermediate_size,
                (cfg.num_attention_heads, cfg.num_key_value_heads), cfg.rope_parameters["rope_theta"],
                cfg.rms_norm_eps, cfg.vocab_size)  # fmt: skip


def finish(writer, path):
    """Writes the header, metadata and tensors and closes the file: its path."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


TOKENS = ["<|endoftext|>"] + [chr(c) for c in range(33, 127)] + ["ab", "cd"]  # 97: the tiny model's vocabulary


def small_model(**config):
    return tiny_model(d_model=64, n_heads=2, n_layers=1, max_seq_len=64, **config)


def write_gguf(path, *, tokens=TOKENS, types=None, merges=("a b", "c d"), context=True, poison=None, quant=Q.F32,
               extra=None):  # fmt: skip
    """The tiny model as a llama GGUF file with a byte-level BPE tokenizer of `tokens` (the first and any "<|...|>"
    ones control tokens; None: no tokenizer.ggml.tokens key) and `merges` (None: no tokenizer.ggml.merges key);
    context=False leaves out llama.context_length; poison=(GGUF part, value) writes that value into the first row of
    the first block's tensor of that part; extra(writer) adds metadata keys of a test's own. Matrices in `quant`."""
    model = small_model()
    cfg = model.cfg
    writer = gguf.GGUFWriter(str(path), "llama")
    add_hparams(writer, cfg.n_layers, cfg.max_seq_len if context else None, cfg.d_model, cfg.hidden_dim,
                (cfg.n_heads, cfg.n_heads), cfg.rope_base, cfg.norm_eps, cfg.vocab_size)  # fmt: skip
    if extra is not None:
        extra(writer)
    writer.add_tokenizer_model("gpt2")
    if tokens is not None:
        writer.add_token_list(list(tokens))
        writer.add_token_types(types or [3 if t.startswith("<|") else 1 for t in tokens])
    if merges is not None:
        writer.add_token_merges(list(merges))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    tensors = {gguf_name(hf): tensor.detach().float().numpy().copy() for hf, tensor in hf_targets(model).items()}
    if poison is not None:
        part, value = poison
        tensors[f"blk.0.{part}.weight"][0, :] = value
    kind_of = lambda name, values: Q.F32 if values.ndim == 1 else quant  # noqa: E731
    with np.errstate(invalid="ignore"):  # gguf's quantizer on a poisoned row
        add_tensors(writer, tensors, kind_of, heads=(cfg.n_heads, cfg.n_heads))
    return finish(writer, path)
