"""A decode step of the whole model in one C call (attnlab.kernels.cpu.fused, fused.c), for the case it covers:

    problem = fused_problem(model, cache)       # None where it applies, else why not (one line)
    step = FusedDecode(model, cache)             # the cache switched to static mode (slot = position)
    logits, greedy = step(token)                 # token (1, 1) at position cache.seen -> (1, V), (1, 1); seen += 1

It covers a Llama-shaped Transformer at batch 1: attention kind mha (GQA or MHA, no window, no null key, any RoPE
table, half-split or interleaved), decoupled (DBA: gate on or off, tie_qk on or off, GQA, RoPE on the geometric path
or none; not rope_semantic, not null_attn; V as wide as it is) or mla (the absorbed decode, absorb: true, with or
without latent_norm; its k_up and v_up read as float32, as the eager absorbed step reads them), RMSNorm, a SwiGLU
MLP, no memory; every linear layer, the LM head included, a QuantizedLinear with 8-bit activations over packed rows
(attnlab.set_activations(model, "q8") on a CPU that packs them), a float32 nn.Linear (attnlab.load_model's default
weights) or an fp16 QuantizedLinear (both with float32 activations, as their forward: each weight read once by
fused.c's matvec_float); the embedding a QuantizedEmbedding or a float32 one; the cache the plain dense float32 one,
its slots filled from 0 up to `seen`, or a QuantizedCache (attnlab.cache.quantized) whose fields (mha's k, v;
decoupled's k_sem, k_geo, v; MLA's latent, k_rope) are stored per token in a format of the C kernels (fp16, bf16,
q8_0, q4_0, nf4, fp32), with any residual window and flush: the step reads the stored rows as the cache's own C step
does and writes them with its quantizer (the same bytes). Everything else (other attention kinds, KIVI formats, ring
caches, memories) decodes as before (generate's eager or compiled step).

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
from attnlab.attention.decoupled import Decoupled
from attnlab.attention.mha import MHA
from attnlab.attention.mla import MLA
from attnlab.cache.base import ModelCache
from attnlab.cache.codecs import KIVI_FORMATS, KVValueError
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


def _rotary(attn):
    """The Rotary a block's attention rotates its keys with (None: decoupled with rope: false)."""
    return attn.rotary_geo if type(attn) is Decoupled else attn.rotary


def attention_shape(attn) -> tuple[int, ...]:
    """fused.c's P_HEADS .. P_TIED of a block's attention (one the step covers): heads, KV heads, kind, key width kd,
    cached value width vd, a head's width into `out`, decoupled's d_sem / MLA's head_dim, the rotated width, tied."""
    if type(attn) is MHA:
        d = attn.head_dim
        return (attn.n_heads, attn.n_kv_heads, kernel.KINDS["mha"], d, d, d, 0, d, 0)
    if type(attn) is Decoupled:
        kd, rope = attn.sem_dim + attn.geo_dim, attn.geo_dim if attn.rotary_geo is not None else 0
        return (attn.n_heads, attn.n_kv_heads, kernel.KINDS["decoupled"], kd, attn.v_dim, attn.v_dim, attn.sem_dim,
                rope, int(attn.cfg.tie_qk))  # fmt: skip
    kd = attn.d_latent + attn.rope_dim
    return (attn.n_heads, 1, kernel.KINDS["mla"], kd, attn.d_latent, attn.v_dim, attn.head_dim, attn.rope_dim, 0)


def _float_weight_problem(name: str, layer) -> str | None:
    """MLA's k_up, v_up, read as float32 rows (W_uk, W_uv: its absorbed step reads their `weight`)."""
    if isinstance(layer, QuantizedLinear) and layer.blocks.device.type == "cpu":
        return None
    if type(layer) is nn.Linear and layer.weight.dtype == torch.float32 and layer.weight.device.type == "cpu":
        return None
    return f"{name} is not a float32 nn.Linear or a QuantizedLinear on the CPU"


def _attention_problem(i: int, attn, eps: float) -> list[str | None]:
    """Why fused.c cannot run block i's attention (lines), or Nones."""
    where, problems = f"block {i}'s attention", []
    if type(attn) is MHA:
        if attn.window is not None or attn.null_k is not None:
            return [f"{where} is not plain mha"]
        layers = {"qkv": attn.qkv, "out": attn.out}
    elif type(attn) is Decoupled:
        if attn.cfg.null_attn:
            return [f"{where} has null_attn (a learned null key and value: the fused step reads none)"]
        if attn.rotary_sem is not None:
            return [f"{where} has rope_semantic (the fused step rotates the geometric path only)"]
        layers = {"proj": attn.proj, "out": attn.out}
    elif type(attn) is MLA:
        if not attn.cfg.absorb:
            return [f"{where} has absorb: false (the fused step runs MLA's absorbed decode)"]
        norm = attn.kv_norm
        problems = [] if type(norm) is nn.Identity else [_norm_problem(f"{where}'s kv_norm", norm, eps)]
        problems += [_float_weight_problem(f"{where}'s {n}", getattr(attn, n)) for n in ("k_up", "v_up")]
        layers = {"q_proj": attn.q_proj, "kv_down": attn.kv_down, "out": attn.out}
    else:
        return [f"{where} is a {type(attn).__name__}"]
    rotary, rotated = _rotary(attn), attention_shape(attn)[7]
    tables = () if rotary is None else (rotary.cos, rotary.sin)
    not_float = any(t.dtype != torch.float32 or not t.is_contiguous() for t in tables)
    if not_float or (rotary is not None and rotary.dim != rotated):
        problems.append(f"block {i}'s RoPE does not rotate its {rotated} key values from float32 tables")
    return problems + [_linear_problem(f"block {i}'s attn.{n}", layer) for n, layer in layers.items()]


def model_problem(model) -> str | None:
    """Why `model` cannot decode through fused.c (one line), or None."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not all(hasattr(model, a) for a in ("blocks", "embed", "norm", "lm_head")):
        return f"a {type(model).__name__} is not an attnlab Transformer"
    if cfg.memory.kind != "none":
        return f"memory.kind={cfg.memory.kind} (the fused step has no memory)"
    if cfg.attention.kind not in kernel.KINDS:
        return f"attention.kind={cfg.attention.kind} (the fused step runs {', '.join(kernel.KINDS)})"
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
        problem = next((p for p in _attention_problem(i, attn, eps) if p), None)
        if problem:
            problems.append(problem)
            break
        if block.memory is not None or type(mlp) is not SwiGLU:
            problems.append(f"block {i} has a memory or no SwiGLU MLP")
            break
        shape = (*attention_shape(attn), mlp.hidden_dim)
        if shape != shapes.setdefault("block 0", shape):
            problems.append(f"block {i}'s attention or MLP shape {shape} differs from block 0's")
            break
        problems += [_norm_problem(f"block {i}'s {n}", getattr(block, n), eps) for n in ("attn_norm", "mlp_norm")]
        layers = {"mlp.gate_up": mlp.gate_up, "mlp.down": mlp.down}
        problems += [_linear_problem(f"block {i}'s {n}", layer) for n, layer in layers.items()]
    return next((p for p in problems if p), None)


def _cached_fields(attn) -> tuple[list[tuple[str, str, int, int]], int]:
    """The QuantizedCache parts (name, buffer, lo, hi) fused.c reads for a block's attention, and the V width."""
    _, _, kind, kd, vd, _, sem, rope, _ = attention_shape(attn)
    if kind == kernel.KINDS["mha"]:
        return [("k", "k", 0, kd), ("v", "v", 0, vd)], vd
    if kind == kernel.KINDS["decoupled"]:
        return [("k_sem", "k", 0, sem), ("k_geo", "k", sem, kd), ("v", "v", 0, vd)], vd
    return [("latent", "latent", 0, vd), ("k_rope", "latent", vd, kd)], vd


def _quantized_problem(i: int, layer: QuantizedCache, block, seen: int) -> str | None:
    """Why a QuantizedCache cannot take fused.c's steps (one line), or None: per-token rows of its attention's fields
    (_cached_fields) in formats of the C kernels (its KernelPlan), float32 at batch 1 on the CPU, holding `seen`
    tokens."""
    formats = {p.name: p.codec.fmt for p in layer.parts}
    if layer.plan is None:
        grouped = ", ".join(f"{name}={fmt}" for name, fmt in formats.items() if fmt in KIVI_FORMATS)
        return f"layer {i}'s cache stores {grouped} over groups of tokens (the fused step reads per-token formats)"
    other = [f"{name}={fmt}" for name, fmt in formats.items() if fmt not in cpu_kernels.FORMAT_CODES]
    if other:
        codes = ", ".join(cpu_kernels.FORMAT_CODES)
        return f"layer {i}'s cache stores {', '.join(other)} (the fused step reads {codes})"
    fields, value_width = _cached_fields(block.attn)
    whole = [(p.name, p.buffer, p.lo, p.hi) for p in layer.parts] == fields
    if not (whole and layer.kernel_reads and layer.plan.value_width == value_width):
        return f"layer {i}'s cache does not hold the rows the fused step reads ({', '.join(f[0] for f in fields)})"
    arrays = [a for arrays in layer.store.values() for a in arrays] + list(layer.recent.values())
    on_cpu = all(a.is_contiguous() and a.device.type == "cpu" for a in arrays)
    if layer.batch != 1 or layer.dtype != torch.float32 or not on_cpu:
        return f"layer {i}'s quantized cache is not float32 rows of batch 1 on the CPU"
    held = int(layer.counters[0]) if layer.static else layer.seen
    if held != seen:
        return f"layer {i}'s cache holds {held} tokens, the model cache says {seen}"
    return None


def _dense_shapes(attn, max_len: int) -> dict[str, tuple[int, ...]]:
    """The dense cache's buffers fused.c writes for a block's attention (batch 1)."""
    heads, kv, kind, kd, vd, *_ = attention_shape(attn)
    if kind == kernel.KINDS["mla"]:
        return {"latent": (1, max_len, kd)}
    return {"k": (1, kv, max_len, kd), "v": (1, kv, max_len, vd)}


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
        shapes = _dense_shapes(block.attn, layer.max_len)
        if set(layer.buffers) != set(shapes) or any(
            t.dtype != torch.float32 or tuple(t.shape) != shapes[n] or not t.is_contiguous() or t.device.type != "cpu"
            for n, t in layer.buffers.items()
        ):
            names, shown = " and ".join(shapes), ", ".join(str(shape) for shape in shapes.values())
            return f"layer {i}'s cache is not float32 {names} of shape {shown} on the CPU (batch 1)"
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


def _quantized_row(layer: QuantizedCache, attn) -> list[int]:
    """fused.c's L_SLOT_POSITIONS .. L_STORE_SLOTS values of a QuantizedCache (in static mode its counters are what it
    advances): its parts as K0, K1 and V (format -1: none; MLA's V is K0's latent)."""
    store = {name: arrays + [None] * (2 - len(arrays)) for name, arrays in layer.store.items()}  # [quants, scales]

    def part(p) -> list[int]:
        fmt = cpu_kernels.FORMAT_CODES[p.codec.fmt]
        ring = layer.recent[p.name].data_ptr()
        return [fmt, store[p.name][0].data_ptr(), _pointer(store[p.name][1]), ring, p.hi - p.lo]

    none = [-1, 0, 0, 0, 0]
    parts = layer.parts
    kind = attention_shape(attn)[2]
    if kind == kernel.KINDS["mha"]:
        values = part(parts[0]) + none + part(parts[1])
    elif kind == kernel.KINDS["decoupled"]:
        values = part(parts[0]) + part(parts[1]) + part(parts[2])
    else:
        values = part(parts[0]) + part(parts[1]) + none
    plan = layer.plan
    return [layer.counters.data_ptr(), 1, *values, plan.ring_slots, plan.resid, plan.flush, layer.store_slots]


def _attention_values(attn) -> tuple[list[int], list[int], list[int], list[torch.Tensor]]:
    """fused.c's values of a block's attention: L_QKV_FMT .. L_KV_BIAS, L_OUT_FMT .. L_OUT_BIAS, L_Q_SCALES .. L_UV,
    and the tensors they point into that nothing else holds (decoupled's query factors, MLA's float W_uk, W_uv)."""
    held, zeros = [], [F32, 0, 0]
    if type(attn) is MHA:
        inputs, out, extra = _linear_values(attn.qkv) + zeros, attn.out, [0, 0, 0, 0]
    elif type(attn) is Decoupled:
        sem_scale, geo_scale = 1 / math.sqrt(attn.sem_dim), 1 / math.sqrt(attn.geo_dim)  # as queries_keys does
        with torch.no_grad():
            if attn.gate_logit is not None:
                g = torch.sigmoid(attn.gate_logit).float()
                scales = torch.stack((2 * g * sem_scale, 2 * (1 - g) * geo_scale), dim=-1).contiguous()
            else:
                scales = torch.tensor([[sem_scale, geo_scale]] * attn.n_heads, dtype=torch.float32)
        held.append(scales)
        inputs, out, extra = _linear_values(attn.proj) + zeros, attn.out, [scales.data_ptr(), 0, 0, 0]
    else:
        with torch.no_grad():
            uk, uv = (getattr(attn, n).weight.detach().float().contiguous() for n in ("k_up", "v_up"))
        held += [uk, uv]
        norm = 0 if type(attn.kv_norm) is nn.Identity else attn.kv_norm.weight.data_ptr()
        inputs, out = _linear_values(attn.q_proj) + _linear_values(attn.kv_down), attn.out
        extra = [0, norm, uk.data_ptr(), uv.data_ptr()]
    return inputs, _linear_values(out), extra, held


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
        rotaries = [_rotary(b.attn) for b in model.blocks]
        max_len = cache.layers[0].max_len
        rope_len = min(max_len if r is None else r.max_seq_len for r in rotaries)
        interleaved = int(cfg.rope_interleaved if rotaries[0] is None else rotaries[0].interleaved)
        header = [
            len(model.blocks), cfg.d_model, *attention_shape(first), hidden,
            max_len, rope_len, interleaved, self.vocab_rows, self.vocab_size,
            embed_fmt, table.data_ptr(), table.shape[0], model.norm.weight.data_ptr(),
            *_linear_values(head),
            quant._NF4_BELOW.data_ptr(), quant._NF4_INSIDE.data_ptr(),
        ]  # fmt: skip
        assert len(header) == kernel.PLAN_HEADER
        rows, self._held = [header], [table, model.norm.weight, head]
        self._held += [quant._NF4_BELOW, quant._NF4_INSIDE]
        for block, layer, rotary in zip(model.blocks, cache.layers, rotaries, strict=True):
            attn, mlp = block.attn, block.mlp
            inputs, out, extra, held = _attention_values(attn)
            row = [block.attn_norm.weight.data_ptr(), *inputs, *out, block.mlp_norm.weight.data_ptr()]
            row += _linear_values(mlp.gate_up) + _linear_values(mlp.down) + extra
            tables = [] if rotary is None else [rotary.cos, rotary.sin]
            row += [t.data_ptr() for t in tables] or [0, 0]
            if type(layer) is QuantizedCache:
                row += [0, 0] + _quantized_row(layer, attn)
                self._held += [layer.store, layer.recent, layer.counters]
            else:
                k, v = (layer.buffers["latent"],) * 2 if "latent" in layer.buffers else (layer.buffers[n] for n in "kv")
                row += [k.data_ptr(), v.data_ptr(), layer.slot_positions.data_ptr()]
                row += [0] * (kernel.PLAN_LAYER - len(row))  # L_QUANTIZED 0: the rest unused
                self._held += [layer.buffers, layer.slot_positions]
            assert len(row) == kernel.PLAN_LAYER, len(row)
            rows.append(row)
            self._held += [block, *tables, *held]
        plan = torch.tensor([value for row in rows for value in row], dtype=torch.int64)
        self.decoder = kernel.Decoder(plan, model.norm.eps, _scale(first))
        cache.set_static(True)
        self.steps = 0  # steps taken (tests check that the fused path ran)
        self.refused = False  # a step was refused: the cache is partly written

    def _unstorable(self) -> KVValueError:
        """The refusal of a step fused.c could not store (status -3), from the first quantized layer whose counters
        did not advance (QuantizedCache.unstorable)."""
        for i, layer in enumerate(self.cache.layers):
            if type(layer) is QuantizedCache and int(layer.counters[0]) == self.cache.seen:
                return layer.unstorable(i)
        return KVValueError([])  # not reached: fused.c stops at the layer that could not store

    def __call__(self, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """token (1, 1) int64 at position cache.seen -> (logits (1, vocab_size), their argmax (1, 1)); the token's
        K and V are written into the cache and cache.seen advances by one.

        A K or V value a quantized cache's block format cannot store (not finite, or beyond its fp16 block scale)
        raises attnlab.cache.codecs.KVValueError (an InputError), as the eager step does, naming the layer and the
        policy. fused.c has by then written the token into the layers before that one: the cache is left partly
        written and unusable (this step then refuses every further call; start a new cache)."""
        if self.refused:
            raise InputError("this fused decode refused a step (a K or V value its cache could not store): its cache "
                             "holds that token in some layers only; start a new cache")  # fmt: skip
        logits = torch.empty(1, self.vocab_rows)
        try:
            best = self.decoder.step(int(token), self.cache.seen, logits[0])
        except kernel.Unstorable:
            self.refused = True
            raise self._unstorable() from None
        self.cache.seen += 1
        self.steps += 1
        return logits[:, : self.vocab_size], torch.tensor([[best]])


def _scale(attn) -> float:
    """The score scale of a block's attention: mha's 1/sqrt(head_dim); decoupled's 1 (its queries are pre-scaled);
    MLA's 1/sqrt(head_dim + d_rope)."""
    if type(attn) is Decoupled:
        return 1.0
    return attn.scale if type(attn) is MLA else 1 / math.sqrt(attn.head_dim)
