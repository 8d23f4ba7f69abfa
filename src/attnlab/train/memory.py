"""Per-device memory of one training step, for DDP and for FSDP at N devices (`attnlab info REF --train-memory`).

Everything is counted from the model itself, built on the meta device (nothing is allocated, so a 7B shape costs
nothing to estimate):

- weights: fp32 master weights; DDP holds them all, FSDP 1/N of them plus the unsharded weights it gathers: the
  root's (embedding, final norm, LM head: gathered once per step and kept until its backward) and two blocks' (the
  one computing and the next, prefetched), in the compute dtype;
- gradients: fp32, of the trained parameters only (train.trainable); DDP keeps a second copy in its communication
  buckets; FSDP 1/N plus one block's unsharded gradients before they are reduce-scattered;
- optimizer: AdamW's two moments (Lion's one) per trained parameter, 1/N of them with FSDP;
- activations: the bytes autograd saves for the backward pass, counted by running the forward pass and the loss on
  the meta device at the per-device batch (one block's worth plus each block's input with activation
  checkpointing), plus the logits' gradient and fp32 copy that the backward pass adds on top.

With cpu_offload FSDP's shards (weights, gradients, optimizer state) live in host memory: the device holds the
gathered weights and the activations. Allocator caching and fragmentation, the communication library's buffers and
the framework itself come on top; bench/distributed.py checks the total against the measured peak on the CPU.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools

import torch
import torch.nn.functional as F

from attnlab.config import ModelConfig
from attnlab.errors import InputError
from attnlab.model.transformer import build_model

FP32 = 4


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel (PyTorch's flash and memory-efficient SDPA, on CPUs and GPUs) keeps for its
    backward pass: its inputs, its output and one fp32 log-sum-exp per query; shapes only (meta tensors)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out


@contextlib.contextmanager
def _fused_attention(active: bool = True):
    """On the meta device SDPA takes its math path, which keeps the (T x T) probabilities; a device runs the fused
    kernels, whose memory grows with T, not T^2: counted as those. PyTorch's CPU kernel needs the values as wide as
    the queries and keys (MLA's and DIFF's are not: the math path, measured), which CUDA's memory-efficient kernel
    does not: for those two the estimate is then high on GPUs."""
    plain = F.scaled_dot_product_attention
    if not active:  # a real device runs its own kernels
        yield
        return

    def sdpa(q, k, v, *args, **kwargs):
        return _FusedAttention.apply(q, k, v) if q.shape[-1] == v.shape[-1] else plain(q, k, v, *args, **kwargs)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = plain


def _trained(name: str, trainable: tuple[str, ...] | None) -> bool:
    return trainable is None or any(fnmatch.fnmatchcase(name, p) for p in trainable)


def _count_saved(cfg: ModelConfig, batch: int, seq_len: int, trainable, device: str) -> tuple[int, list[int]]:
    """(bytes autograd saves for a forward pass and loss at (batch, seq_len), those of each block call), weights
    aside, on `device` (meta: shapes only)."""
    with torch.device(device):
        model = build_model(cfg).train()
    for name, p in model.named_parameters():
        p.requires_grad_(_trained(name, trainable))
    weights = {_storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}
    per_block: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in weights:
            saved[key] = max(saved.get(key, 0), t.untyped_storage().nbytes())
        return t

    def before(*_):
        per_block.append(-sum(saved.values()))

    def after(*_):
        per_block[-1] += sum(saved.values())

    hooks = [h for b in model.blocks for h in (b.register_forward_pre_hook(before), b.register_forward_hook(after))]
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device) if device != "meta" else (
        torch.zeros(batch, seq_len, dtype=torch.long, device=device))  # fmt: skip
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _fused_attention(device == "meta"):
            logits, _ = model(tokens)
            F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens.reshape(-1))
    finally:
        for hook in hooks:
            hook.remove()
    return sum(saved.values()), per_block


CPU_COUNT_TOKENS = 1024  # a memory's activations are counted on the CPU up to this length (and 4 of its blocks),
# then extrapolated: the count runs the memory for real, about a minute for SmolLM2's width with 256-token blocks


def _cpu_saved(cfg: ModelConfig, batch: int, seq_len: int, trainable) -> int:
    """saved bytes counted on the CPU for one and two sequences through one and two blocks, scaled to the batch and
    the layers (the bytes outside the blocks and those of a block, each a part shared by the batch and a part per
    sequence)."""
    counts = {(layers, b): _count_saved(cfg.replace(n_layers=layers), b, seq_len, trainable, "cpu")[0]
              for layers in (1, 2) for b in (1, 2)}  # fmt: skip
    slope = {b: counts[2, b] - counts[1, b] for b in (1, 2)}  # a block's bytes, at 1 and 2 sequences
    base = {b: counts[1, b] - slope[b] for b in (1, 2)}  # the rest (embedding, head, loss)
    at = lambda v: v[1] + (batch - 1) * (v[2] - v[1])  # noqa: E731  (linear in the batch; masks are shared)
    return at(base) + cfg.n_layers * at(slope)


@functools.lru_cache(maxsize=64)  # the rows of one table share it
def saved_activation_bytes(
    cfg: ModelConfig, batch: int, seq_len: int, checkpointing: bool = False, trainable: tuple[str, ...] | None = None
) -> dict:
    """Bytes autograd saves for the backward pass of one forward pass and loss at (batch, seq_len), on the meta
    device: {"saved": all of them, "logits": one fp32 copy of the logits}; with `checkpointing`, each block's input
    and one block's internals instead of every block's. Frozen parameters (not matching `trainable`) need no
    gradient, so what only their gradient would need is not saved.

    A memory the meta device cannot run (bounded, streaming: they read values) is counted on the CPU instead, for
    one and two sequences through one and two blocks, which gives the bytes outside the blocks and those of a
    block, each a part shared by the batch and a part per sequence; then scaled to the layers and the batch. The
    bounded banks' writes depend on the values, and so what they save: within a few percent."""
    try:
        total, per_block = _count_saved(cfg, batch, seq_len, trainable, "meta")
    except (RuntimeError, NotImplementedError) as e:
        if "meta" not in str(e):
            raise
        if checkpointing:
            raise InputError(f"activation checkpointing does not apply to a model with memory.kind "
                             f"{cfg.memory.kind!r} (training refuses it): leave it out") from None  # fmt: skip
        counted = min(CPU_COUNT_TOKENS, 4 * cfg.memory.block_size)  # a few blocks: the memory's steady state
        if seq_len <= counted:
            saved = _cpu_saved(cfg, batch, seq_len, trainable)
        else:  # a memory reads a stream in blocks: the bytes grow in proportion past a few blocks
            short, long = (_cpu_saved(cfg, batch, n, trainable) for n in (counted // 2, counted))
            saved = long + (seq_len - counted) * (long - short) // (counted // 2)
        return {"saved": saved, "logits": batch * seq_len * cfg.vocab_size * FP32}
    if checkpointing:
        block_input = batch * seq_len * cfg.d_model * FP32
        total = total - sum(per_block) + len(per_block) * block_input + max(per_block, default=0)
    return {"saved": total, "logits": batch * seq_len * cfg.vocab_size * FP32}


def parameter_parts(cfg: ModelConfig, trainable: tuple[str, ...] | None = None) -> dict:
    """Parameter counts the estimate needs: total, trained, the root's (outside the blocks), the largest block's,
    and the largest block's trained ones (tied weights counted once)."""
    with torch.device("meta"):
        model = build_model(cfg)
    named = list(model.named_parameters())  # tied weights once
    blocks = [list(block.named_parameters(prefix=f"blocks.{i}")) for i, block in enumerate(model.blocks)]
    in_blocks = {name for block in blocks for name, _ in block}
    return {
        "total": sum(p.numel() for _, p in named),
        "trained": sum(p.numel() for name, p in named if _trained(name, trainable)),
        "root": sum(p.numel() for name, p in named if name not in in_blocks),
        "block": max((sum(p.numel() for _, p in block) for block in blocks), default=0),
        "block_trained": max((sum(p.numel() for n, p in b if _trained(n, trainable)) for b in blocks), default=0),
    }


def training_memory(
    cfg: ModelConfig,
    *,
    batch_size: int,
    seq_len: int,
    devices: int = 1,
    mode: str = "ddp",
    trainable: tuple[str, ...] | None = None,
    optimizer: str = "adamw",
    compute_bytes: int = FP32,
    checkpointing: bool = False,
    cpu_offload: bool = False,
    parts: dict | None = None,
) -> dict:
    """Bytes one device holds at the peak of a training step: {"weights", "gradients", "optimizer", "activations",
    "total", "host"} (host: what cpu_offload keeps in host memory instead). batch_size: the global batch (sequences
    per optimizer step, divided over the devices); compute_bytes: 2 for bf16 compute (gathered weights, activations).
    parts: parameter_parts(cfg, trainable), when already counted."""
    p = parts or parameter_parts(cfg, trainable)
    per_device = max(1, batch_size // devices)
    act = saved_activation_bytes(cfg, per_device, seq_len, checkpointing, trainable)
    activations = act["saved"] * compute_bytes // FP32 + 2 * act["logits"]
    moments = 2 if optimizer == "adamw" else 1
    if mode == "ddp":
        weights = FP32 * p["total"] + (compute_bytes * p["total"] if compute_bytes != FP32 else 0)  # autocast copies
        gradients = FP32 * p["trained"] * (2 if devices > 1 else 1)  # and DDP's buckets (none when alone)
        state = moments * FP32 * p["trained"]
        host = 0
    else:
        whole = {"weights": p["total"], "gradients": p["trained"], "optimizer": moments * p["trained"]}
        shards = {k: -(-FP32 * v // devices) for k, v in whole.items()}
        gathered = compute_bytes * (p["root"] + 2 * p["block"])
        weights, gradients, state = gathered, FP32 * p["block_trained"], 0
        host = sum(shards.values()) if cpu_offload else 0
        if not cpu_offload:
            weights, gradients = weights + shards["weights"], gradients + shards["gradients"]
            state = shards["optimizer"]
    total = weights + gradients + state + activations
    return {"weights": weights, "gradients": gradients, "optimizer": state, "activations": activations,
            "total": total, "host": host}  # fmt: skip


def train_memory_rows(
    cfg: ModelConfig,
    *,
    batch_size: int,
    seq_len: int,
    devices: list[int],
    trainable: tuple[str, ...] | None = None,
    optimizer: str = "adamw",
    compute_bytes: int = FP32,
    checkpointing: bool = False,
) -> list[dict]:
    """training_memory for each number of devices: one process alone, else DDP, FSDP and FSDP with cpu_offload."""
    parts = parameter_parts(cfg, trainable)
    rows = []
    for n in devices:
        modes = [("one", "ddp", False)] if n == 1 else [("ddp", "ddp", False), ("fsdp", "fsdp", False),
                                                         ("fsdp+offload", "fsdp", True)]  # fmt: skip
        for label, mode, offload in modes:
            estimate = training_memory(cfg, batch_size=batch_size, seq_len=seq_len, devices=n, mode=mode,
                                       trainable=trainable, optimizer=optimizer, compute_bytes=compute_bytes,
                                       checkpointing=checkpointing, cpu_offload=offload, parts=parts)  # fmt: skip
            rows.append({"devices": n, "mode": label, **estimate})
    return rows


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f}"


def train_memory_lines(rows: list[dict], what: str) -> list[str]:
    """The table `attnlab info --train-memory` prints (GiB per device)."""
    head = "".join(f" {name:>8}" for name in ("weights", "grads", "optim", "activ", "total"))
    lines = [f"training memory per device, GiB ({what}):", f"  {'devices':>7}  {'mode':<12}{head}"]
    for row in rows:
        parts = "".join(f" {_gib(row[k]):>8}" for k in ("weights", "gradients", "optimizer", "activations", "total"))
        host = f"  (+{_gib(row['host'])} in host memory)" if row["host"] else ""
        lines.append(f"  {row['devices']:>7}  {row['mode']:<12}{parts}{host}")
    return lines
