"""A decode step of the whole model in one C call (attnlab.kernels.cpu.fused, fused.c), for the case it covers:

    problem = fused_problem(model, cache)       # None where it applies, else why not (one line)
    step = FusedDecode(model, cache)             # the cache switched to static mode (slot = position)
    logits, greedy = step(token)                 # token (1, 1) at position cache.seen -> (1, V), (1, 1); seen += 1

It covers a Llama-shaped Transformer at batch 1: attention kind mha (GQA or MHA, no window, no null key, any RoPE
table, half-split or interleaved), RMSNorm, a SwiGLU MLP, no memory; every linear layer, the LM head included, a
QuantizedLinear with 8-bit activations over packed rows (attnlab.set_activations(model, "q8") on a CPU that packs
them), a float32 nn.Linear (attnlab.load_model's default weights) or an fp16 QuantizedLinear (both with float32
activations, as their forward: each weight read once by fused.c's matvec_float); the embedding a QuantizedEmbedding
or a float32 one; the cache the plain dense float32 one, its slots filled from 0 up to `seen`, or a QuantizedCache
(attnlab.cache.quantized) whose K and V are stored per token in a format of the C kernels (fp16, bf16, q8_0, q4_0,
nf4, fp32), with any residual window and flush: the step reads the stored rows as the cache's own C step does and
writes them with its quantizer (the same bytes). Everything else (KIVI formats, ring caches, memories) decodes as
before (generate's eager or compiled step).

Its logits are the eager step's up to float32 rounding: the 8-bit matmuls are qmatmul.c's functions on the same
inputs (same integer sums, same float order), while RMSNorm, the softmax, SiLU and the float32 / fp16 matmuls sum or
round in another order, so an 8-bit code of a layer's input may round the other way where the input lies within
rounding of a half step (with float32 activations nothing amplifies the rounding).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attnlab import quant
from attnlab.attention.mha import MHA
from attnlab.cache.base import ModelCache
from attnlab.cache.codecs import KIVI_FORMATS
from attnlab.cache.dense import DenseCache
from attnlab.cache.quantized import QuantizedCache
from attnlab.errors import InputError
from attnlab.kernels import cpu as cpu_kernels
from attnlab.kernels.cpu import fused as kernel
from attnlab.kernels.cpu import qmatmul
from attnlab.model.qlinear import QuantizedEmbedding, QuantizedLinear
from attnlab.ops.mlp import SwiGLU
from attnlab.ops.norm import RMSNorm

PACKED_FORMATS = ("q4_0", "q4_1", "q8_0")  # what qmatmul.pack_q8 packs
F32 = 0  # fused.c's format of float32 rows (ggml's type id)


def _linear_problem(name: str, layer) -> str | None:
    """Why fused.c cannot multiply by `layer` (one line), or None: a float32 nn.Linear or an fp16 QuantizedLinear
    (float32 activations), or a QuantizedLinear of packed rows with 8-bit activations."""
    if type(layer) is nn.Linear:
        tensors = [layer.weight] + ([] if layer.bias is None else [layer.bias])
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors) or not layer.weight.is_contiguous():
            return f"{name} is an nn.Linear of {layer.weight.dtype} on {layer.weight.device} (contiguous float32, CPU)"
        return None
    if not isinstance(layer, QuantizedLinear):
        return f"{name} is a {type(layer).__name__}, not an nn.Linear or a QuantizedLinear"
    if layer.fmt == "fp16" and layer.blocks.device.type == "cpu":  # float32 activations, as its forward
        return _bias_problem(name, layer)
    if layer.activations != "q8" or layer.packed is None:
        return f"{name} has no packed rows for 8-bit activations (attnlab.set_activations(model, 'q8') packs them)"
    if layer.fmt not in PACKED_FORMATS:
        return f"{name} holds {layer.fmt} weights (packed: {', '.join(PACKED_FORMATS)})"
    return _bias_problem(name, layer)


def _bias_problem(name: str, layer) -> str | None:
    if layer.bias is not None and (layer.bias.dtype != torch.float32 or layer.bias.device.type != "cpu"):
        return f"{name} has a {layer.bias.dtype} bias on {layer.bias.device} (float32 on the CPU)"
    return None


def _linear_values(layer) -> list[int]:
    """fused.c's (format, weights, bias) of a layer _linear_problem accepts: float32 rows (ggml's F32, 0), fp16 rows
    (F16) or packed rows."""
    if type(layer) is nn.Linear:
        return [F32, layer.weight.data_ptr(), _pointer(layer.bias)]
    weights = layer.blocks if layer.fmt == "fp16" else layer.packed
    return [qmatmul.FORMAT_CODES[layer.fmt], weights.data_ptr(), _pointer(layer.bias)]


def _norm_problem(name: str, norm, eps: float) -> str | None:
    if type(norm) is not RMSNorm:
        return f"{name} is a {type(norm).__name__}, not an RMSNorm"
    if norm.weight.dtype != torch.float32 or norm.weight.device.type != "cpu":
        return f"{name} holds {norm.weight.dtype} on {norm.weight.device} (float32 on the CPU)"
    if norm.eps != eps:
        return f"{name} has eps {norm.eps}, the final norm {eps} (one eps for all)"
    return None


def model_problem(model) -> str | None:
    """Why `model` cannot decode through fused.c (one line), or None."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not all(hasattr(model, a) for a in ("blocks", "embed", "norm", "lm_head")):
        return f"a {type(model).__name__} is not an attnlab Transformer"
    if cfg.memory.kind != "none":
        return f"memory.kind={cfg.memory.kind} (the fused step has no memory)"
    if cfg.attention.kind != "mha":
        return f"attention.kind={cfg.attention.kind} (the fused step runs mha)"
    if cfg.d_model % 32:
        return f"d_model={cfg.d_model} is not a multiple of 32"
    eps = model.norm.eps
    problems = [_norm_problem("the final norm", model.norm, eps), _linear_problem("the LM head", model.lm_head)]
    embed = model.embed
    if isinstance(embed, QuantizedEmbedding):
        if embed.fmt not in qmatmul.FORMAT_CODES:
            problems.append(f"the embedding holds {embed.fmt}")
    elif not (isinstance(embed, nn.Embedding) and embed.weight.dtype == torch.float32 and embed.weight.is_contiguous()):
        problems.append(f"the embedding is a {type(embed).__name__} (a QuantizedEmbedding or a float32 nn.Embedding)")
    shapes = {}
    for i, block in enumerate(model.blocks):
        attn, mlp = block.attn, block.mlp
        if type(attn) is not MHA or attn.window is not None or attn.null_k is not None:
            problems.append(f"block {i}'s attention is not plain mha")
            break
        if block.memory is not None or type(mlp) is not SwiGLU:
            problems.append(f"block {i} has a memory or no SwiGLU MLP")
            break
        shape = (attn.n_heads, attn.n_kv_heads, attn.head_dim, mlp.hidden_dim)
        if shape != shapes.setdefault("block 0", shape):
            problems.append(f"block {i}'s (heads, KV heads, head_dim, hidden) {shape} differ from block 0's")
            break
        tables = (attn.rotary.cos, attn.rotary.sin)
        if attn.rotary.dim != attn.head_dim or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tables):
            problems.append(f"block {i}'s RoPE does not rotate its whole head from float32 tables")
        problems += [_norm_problem(f"block {i}'s {n}", getattr(block, n), eps) for n in ("attn_norm", "mlp_norm")]
        layers = {"attn.qkv": attn.qkv, "attn.out": attn.out, "mlp.gate_up": mlp.gate_up, "mlp.down": mlp.down}
        problems += [_linear_problem(f"block {i}'s {n}", layer) for n, layer in layers.items()]
    return next((p for p in problems if p), None)


def _quantized_problem(i: int, layer: QuantizedCache, block, seen: int) -> str | None:
    """Why a QuantizedCache cannot take fused.c's steps (one line), or None: per-token K and V rows in formats of the
    C kernels (its KernelPlan), float32 at batch 1 on the CPU, holding `seen` tokens."""
    formats = {p.name: p.codec.fmt for p in layer.parts}
    if layer.plan is None:
        grouped = ", ".join(f"{name}={fmt}" for name, fmt in formats.items() if fmt in KIVI_FORMATS)
        return f"layer {i}'s cache stores {grouped} over groups of tokens (the fused step reads per-token formats)"
    other = [f"{name}={fmt}" for name, fmt in formats.items() if fmt not in cpu_kernels.FORMAT_CODES]
    if other:
        codes = ", ".join(cpu_kernels.FORMAT_CODES)
        return f"layer {i}'s cache stores {', '.join(other)} (the fused step reads {codes})"
    d = block.attn.head_dim
    whole = [(p.name, p.buffer, p.lo, p.hi) for p in layer.parts] == [("k", "k", 0, d), ("v", "v", 0, d)]
    if not (whole and layer.kernel_reads and layer.plan.value_width == d):
        return f"layer {i}'s cache does not hold one K and one V row per token (the fused step reads mha's)"
    arrays = [a for arrays in layer.store.values() for a in arrays] + list(layer.recent.values())
    on_cpu = all(a.is_contiguous() and a.device.type == "cpu" for a in arrays)
    if layer.batch != 1 or layer.dtype != torch.float32 or not on_cpu:
        return f"layer {i}'s quantized cache is not float32 rows of batch 1 on the CPU"
    held = int(layer.counters[0]) if layer.static else layer.seen
    if held != seen:
        return f"layer {i}'s cache holds {held} tokens, the model cache says {seen}"
    return None


def cache_problem(model, cache) -> str | None:
    """Why `cache` cannot take fused.c's steps for `model` (one line), or None: a ModelCache for one sequence of plain
    dense float32 layer caches, their slots 0..seen-1 filled in order (as generate's own prefill leaves them), or of
    QuantizedCaches of per-token formats (see _quantized_problem)."""
    if not isinstance(cache, ModelCache) or len(cache.layers) != len(model.blocks):
        return "the cache is not a ModelCache of one layer cache per block"
    quantized = [type(layer) is QuantizedCache for layer in cache.layers]
    for i, (layer, block) in enumerate(zip(cache.layers, model.blocks, strict=True)):
        if quantized[i]:
            problem = _quantized_problem(i, layer, block, cache.seen)
            if problem:
                return problem
            continue
        if type(layer) is not DenseCache:
            return (f"layer {i}'s cache is a {type(layer).__name__} (the fused step writes the plain dense cache or a "
                    "QuantizedCache)")  # fmt: skip
        k, v = layer.buffers.get("k"), layer.buffers.get("v")
        shape = (1, block.attn.n_kv_heads, layer.max_len, block.attn.head_dim)
        if set(layer.buffers) != {"k", "v"} or any(
            t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu"
            for t in (k, v)
        ):
            return f"layer {i}'s cache is not float32 k and v of shape {shape} on the CPU (batch 1)"
    dense = [layer for layer, q in zip(cache.layers, quantized, strict=True) if not q]
    if not dense:
        return None
    filled = dense[0].slot_positions
    expected = torch.cat([torch.arange(cache.seen), filled.new_full((max(filled.shape[0] - cache.seen, 0),), -1)])
    if cache.seen > filled.shape[0] or any(not torch.equal(layer.slot_positions, expected) for layer in dense):
        return f"the cache's slots are not positions 0..{cache.seen - 1} in order"
    return None


def fused_problem(model, cache) -> str | None:
    """Why `model` with `cache` cannot decode through fused.c (one line), or None: the kernels off
    (ATTNLAB_CPU_KERNELS=0, attnlab.kernels.cpu.disabled()), not built, or a model or cache it does not cover."""
    problem = model_problem(model) or cache_problem(model, cache)  # first: they build nothing
    if problem is None and not kernel.available():
        return "the fused C kernel is not available (no compiler, ATTNLAB_CPU_KERNELS=0, or no AVX2 / AVX-512 VNNI)"
    return problem


def _pointer(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _quantized_row(layer: QuantizedCache, cos: torch.Tensor, sin: torch.Tensor) -> list[int]:
    """fused.c's L_K .. L_STORE_SLOTS values of a QuantizedCache (in static mode its counters are what it advances)."""
    store = {name: arrays + [None] * (2 - len(arrays)) for name, arrays in layer.store.items()}  # [quants, scales]
    fmt = {p.name: cpu_kernels.FORMAT_CODES[p.codec.fmt] for p in layer.parts}
    return [
        store["k"][0].data_ptr(), store["v"][0].data_ptr(), layer.counters.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        1, fmt["k"], _pointer(store["k"][1]), layer.recent["k"].data_ptr(),
        fmt["v"], _pointer(store["v"][1]), layer.recent["v"].data_ptr(),
        layer.plan.ring_slots, layer.plan.resid, layer.plan.flush, layer.store_slots,
    ]  # fmt: skip


class FusedDecode:
    """Decode steps of `model` through `cache` in one C call each (see the module docstring). InputError naming the
    reason where fused_problem says it does not apply. Switches the cache to static mode (slot = position), as the
    compiled step does; holds the model's and the cache's tensors the plan points into."""

    def __init__(self, model, cache: ModelCache):
        problem = fused_problem(model, cache)
        if problem:
            raise InputError(f"the fused decode step does not apply: {problem}")
        cfg, first = model.cfg, model.blocks[0].attn
        self.model, self.cache = model, cache
        self.vocab_size, self.vocab_rows = cfg.vocab_size, model.lm_head.out_features
        embed = model.embed
        embed_fmt, table = (
            (qmatmul.FORMAT_CODES[embed.fmt], embed.blocks)
            if isinstance(embed, QuantizedEmbedding)
            else (0, embed.weight)
        )
        head, hidden = model.lm_head, model.blocks[0].mlp.hidden_dim
        rope_len = min(b.attn.rotary.max_seq_len for b in model.blocks)
        header = [
            len(model.blocks), cfg.d_model, first.n_heads, first.n_kv_heads, first.head_dim, hidden,
            cache.layers[0].max_len, rope_len, int(first.rotary.interleaved), self.vocab_rows, self.vocab_size,
            embed_fmt, table.data_ptr(), table.shape[0], model.norm.weight.data_ptr(),
            *_linear_values(head),
            quant._NF4_BELOW.data_ptr(), quant._NF4_INSIDE.data_ptr(),
        ]  # fmt: skip
        assert len(header) == kernel.PLAN_HEADER
        rows, self._held = [header], [table, model.norm.weight, head]
        self._held += [quant._NF4_BELOW, quant._NF4_INSIDE]
        for block, layer in zip(model.blocks, cache.layers, strict=True):
            attn, mlp = block.attn, block.mlp
            row = [block.attn_norm.weight.data_ptr()]
            row += _linear_values(attn.qkv) + _linear_values(attn.out) + [block.mlp_norm.weight.data_ptr()]
            row += _linear_values(mlp.gate_up) + _linear_values(mlp.down)
            cos, sin = attn.rotary.cos, attn.rotary.sin
            if type(layer) is QuantizedCache:
                row += _quantized_row(layer, cos, sin)
                self._held += [layer.store, layer.recent, layer.counters]
            else:
                row += [layer.buffers["k"].data_ptr(), layer.buffers["v"].data_ptr(), layer.slot_positions.data_ptr()]
                row += [cos.data_ptr(), sin.data_ptr()] + [0] * 11  # L_QUANTIZED 0: the rest unused
                self._held += [layer.buffers, layer.slot_positions]
            assert len(row) == kernel.PLAN_LAYER
            rows.append(row)
            self._held += [block, cos, sin]
        plan = torch.tensor([value for row in rows for value in row], dtype=torch.int64)
        self.decoder = kernel.Decoder(plan, model.norm.eps, 1 / math.sqrt(first.head_dim))
        cache.set_static(True)
        self.steps = 0  # steps taken (tests check that the fused path ran)

    def __call__(self, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """token (1, 1) int64 at position cache.seen -> (logits (1, vocab_size), their argmax (1, 1)); the token's
        K and V are written into the cache and cache.seen advances by one."""
        logits = torch.empty(1, self.vocab_rows)
        best = self.decoder.step(int(token), self.cache.seen, logits[0])
        self.cache.seen += 1
        self.steps += 1
        return logits[:, : self.vocab_size], torch.tensor([[best]])
