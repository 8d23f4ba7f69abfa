"""A batch (or a model.max_seq_len) far too large for this machine, refused before anything runs instead of killed
by the kernel's out-of-memory killer minutes later without a word, or ending in the allocator's traceback.

The estimate is a floor, so that no batch that fits is refused: measured on this project's models in fp32, one
training step keeps ~35 floats per token for each d_model x layer (activations and their gradients) and ~3 per
vocabulary entry (logits, their fp32 copy and gradient); the floor counts 16 and 2. A batch is refused only when
even the floor exceeds the machine's whole memory (RAM plus every visible GPU's).
"""

from __future__ import annotations

import os

import torch

from attnlab.model.footprint import _size, ram_bytes

FLOATS_PER_WIDTH = 16  # per token, per d_model x layer (measured ~35)
FLOATS_PER_VOCAB = 2  # per token, per vocabulary entry (measured ~3)
BYTES_PER_FLOAT = 4


def machine_memory() -> int | None:
    """Bytes of RAM plus those of every visible CUDA device; None when the system does not say."""
    total = ram_bytes()
    if total is None:
        return None
    if torch.cuda.is_available():
        total += sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return total if total > 0 else None


def _processes() -> int:
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def step_memory_floor(d_model: int, n_layers: int, batch_size: int, seq_len: int, vocab_size: int | None) -> int:
    """A floor on the bytes one training step of one process holds (vocab_size None: not counted)."""
    tokens = max(1, batch_size // _processes()) * seq_len
    return tokens * (FLOATS_PER_WIDTH * d_model * n_layers + FLOATS_PER_VOCAB * (vocab_size or 0)) * BYTES_PER_FLOAT


def batch_memory_problem(model_cfg, train_cfg, vocab_size: int | None = None) -> str | None:
    """Why a step of train.batch_size x train.seq_len tokens cannot fit this machine, or None (vocab_size: the
    vocabulary when known; model_cfg: a ModelConfig)."""
    need = step_memory_floor(model_cfg.d_model, model_cfg.n_layers, train_cfg.batch_size, train_cfg.seq_len,
                             vocab_size)  # fmt: skip
    have = machine_memory()
    if have is None or need <= have:
        return None
    tokens = train_cfg.batch_size * train_cfg.seq_len
    return (
        f"train.batch_size={train_cfg.batch_size} x train.seq_len={train_cfg.seq_len} ({tokens:,} tokens a step) "
        f"needs at least {_size(need)} for one training step (a low estimate from d_model, n_layers"
        f"{' and the vocabulary' if vocab_size else ''}), more than this machine's {_size(have)} of memory: lower "
        "train.batch_size or train.seq_len (raise train.grad_accum to keep the tokens per update)"
    )


def rope_table_bytes(model_cfg) -> tuple[int, int]:
    """(bytes per position, rotated pairs) of the RoPE tables a model of `model_cfg` builds for its max_seq_len
    positions: float32 cos and sin for each width of rotated channels its attention declares (the cache layout's
    rope fields; layers and fields alike share one table, ops.rope.Rotary), and the angles table the widest is
    computed from."""
    widths = {f.width for f in model_cfg.attention.cache_layout(model_cfg).fields if f.rope}
    pairs = [width // 2 for width in widths]
    return (2 * sum(pairs) + max(pairs, default=0)) * BYTES_PER_FLOAT, sum(pairs)


def positions_memory_problem(model_cfg) -> str | None:
    """Why the per-position tables of model.max_seq_len positions (RoPE's cos and sin, built with the model) cannot
    fit this machine's memory, or None."""
    per_position, pairs = rope_table_bytes(model_cfg)
    need, have = model_cfg.max_seq_len * per_position, machine_memory()
    if have is None or not per_position or need <= have:
        return None
    return (
        f"model.max_seq_len={model_cfg.max_seq_len:,} needs at least {_size(need)} for its RoPE tables (float32 cos "
        f"and sin of every position x {pairs} rotated pairs, and the angles they are computed from), more than "
        f"this machine's {_size(have)} of memory: lower model.max_seq_len (at most {have // per_position:,} fit)"
    )
