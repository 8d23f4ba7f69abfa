"""Karpathy's llama2.c files: legacy ("v0") checkpoints such as stories260K.bin, and tokenizer.bin vocabularies."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from attnlab.attention.mha import MHAConfig
from attnlab.config import ModelConfig
from attnlab.errors import DataError
from attnlab.model.transformer import Transformer, build_model

LLAMA2C_HEADER = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")


@torch.no_grad()
def from_llama2c(path) -> tuple[ModelConfig, Transformer]:
    """(config, model) from a llama2.c legacy ("v0") checkpoint such as karpathy's stories260K.bin.

    Layout: 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative
    vocab_size means an untied classifier follows), then float32 [out][in] matrices: token embeddings,
    attention norms, wq, wk, wv, wo, FFN norms, w1 (gate), w2 (down), w3 (up), final norm, the RoPE
    tables (skipped: recomputed) and, when untied, the classifier. RoPE is interleaved, base 10000.
    """
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size < 28:
        raise DataError(f"{path}: too short to be a llama2.c checkpoint")
    header = dict(zip(LLAMA2C_HEADER, np.frombuffer(raw[:28].tobytes(), dtype=np.int32).tolist(), strict=True))
    tied = header["vocab_size"] > 0
    vocab, dim, hidden = abs(header["vocab_size"]), header["dim"], header["hidden_dim"]
    n_layers, n_heads, n_kv = header["n_layers"], header["n_heads"], header["n_kv_heads"]
    head_dim, kv_dim = dim // n_heads, dim // n_heads * n_kv
    weights = torch.from_numpy(np.frombuffer(raw[28:].tobytes(), dtype=np.float32).copy())
    offset = 0

    def take(*shape):
        nonlocal offset
        count = int(np.prod(shape))
        if offset + count > weights.numel():
            raise DataError(f"{path}: file ends early (header says {header}); is it a llama2.c v0 checkpoint?")
        out = weights[offset : offset + count].view(*shape)
        offset += count
        return out

    cfg = ModelConfig(
        vocab_size=vocab, d_model=dim, n_layers=n_layers, n_heads=n_heads, max_seq_len=header["seq_len"],
        attention=MHAConfig(n_kv_heads=n_kv), d_ff=hidden, tie_embeddings=tied, rope_interleaved=True,
        name=f"llama2c:{Path(path).stem}",
    )  # fmt: skip
    model = build_model(cfg)
    model.embed.weight.zero_()
    model.embed.weight[:vocab] = take(vocab, dim)
    attn_norm, wq, wk = take(n_layers, dim), take(n_layers, dim, dim), take(n_layers, kv_dim, dim)
    wv, wo, mlp_norm = take(n_layers, kv_dim, dim), take(n_layers, dim, dim), take(n_layers, dim)
    w1, w2, w3 = take(n_layers, hidden, dim), take(n_layers, dim, hidden), take(n_layers, hidden, dim)
    for i, block in enumerate(model.blocks):
        block.attn_norm.weight.copy_(attn_norm[i])
        block.attn.qkv.weight.copy_(torch.cat((wq[i], wk[i], wv[i])))
        block.attn.out.weight.copy_(wo[i])
        block.mlp_norm.weight.copy_(mlp_norm[i])
        block.mlp.gate_up.weight.copy_(torch.cat((w1[i], w3[i])))
        block.mlp.down.weight.copy_(w2[i])
    model.norm.weight.copy_(take(dim))
    take(header["seq_len"], head_dim // 2)  # freq_cis_real
    take(header["seq_len"], head_dim // 2)  # freq_cis_imag
    if not tied:
        model.lm_head.weight.zero_()
        model.lm_head.weight[:vocab] = take(vocab, dim)
    return cfg, model.eval()


def load_llama2c_vocab(path) -> list[bytes]:
    """The pieces of a llama2.c tokenizer file (tok512.bin): int32 max length, then per id a float32
    score, an int32 length and the bytes. Pieces like '<0x0A>' stand for one raw byte."""
    data = Path(path).read_bytes()
    pieces, offset = [], 4
    while offset < len(data):
        _score, length = struct.unpack_from("<fi", data, offset)
        pieces.append(data[offset + 8 : offset + 8 + length])
        offset += 8 + length
    return pieces


def decode_llama2c(pieces: list[bytes], ids) -> str:
    """Text of token ids, as llama2.c prints it (byte tokens decoded; BOS/EOS dropped)."""
    out = bytearray()
    for i in ids:
        piece = pieces[int(i)]
        if piece.startswith(b"<0x") and piece.endswith(b">") and len(piece) == 6:
            out += bytes([int(piece[3:5], 16)])
        elif int(i) > 2:
            out += piece
    return out.decode("utf-8", errors="replace").lstrip(" ")
