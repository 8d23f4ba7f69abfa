"""Linear layers and embeddings whose weights stay in a GGUF file's format, multiplied as they are stored.

    model = quantize_weights(model, "q4_0")        # every nn.Linear, the embedding and the LM head, in place
    cfg, model, tok = load_model("SmolLM2-135M-Instruct.Q4_1.gguf", weights="native")   # the file's own blocks

Formats (FORMATS): fp16 (ggml's F16) and ggml's block formats q8_0, q4_0, q4_1 (attnlab.quant: byte for byte what
llama.cpp writes and reads). A layer holds its weight W (out_features, in_features) as one uint8 buffer, `blocks`
(out_features, row bytes), ggml's rows, so a checkpoint (safetensors) stores plain bytes; each format has its own
bytes per block, so a state dict of another format fails load_state_dict's shape check.

By default the activations stay float32: y is a float32 matmul over the dequantized W, summed in another order.
`set_activations(model, "q8")` (an opt-in, llama.cpp's arithmetic: not exact) makes every layer whose weights have
codes (q8_0, q4_0, q4_1; fp16 layers keep float32) quantize its input first, each block of 32 values to 8-bit codes
and a float32 scale (quantize_activations); the few rows of decoding then take integer dot products (qmatmul.c's
attnlab_qmatmul_q8) and many rows a float32 GEMM over those values, so a token's result does not depend on how
many came with it (up to the order of the sums). Where the CPU has AVX-512 VNNI or AVX2, set_activations also keeps
a second copy of each such layer's rows interleaved 16 at a time (`packed`, qmatmul.pack_q8: one vector instruction
multiplies 4 codes of 16 rows, or of 8 with AVX2), which the few rows of decoding read instead: 2-3x faster per
matrix, for the weights' bytes once more in memory (not saved: a state dict holds `blocks` alone). On the CPU
in float32 (no gradient) the forward is one op, `attnlab::qlinear`, which runs the C kernels
(attnlab.kernels.cpu.qmatmul) or, without a compiler, dequantizes W and calls F.linear; a compiled decode step
(attnlab.generate) keeps it as one call. For the few rows of decoding the same kernel runs as a C++ operator,
`attnlab_cpp::qlinear` (attnlab.kernels.cpu.ops: the same bits, without Python's cost per call), where it builds.
Elsewhere (CUDA, bf16, a gradient through x) W is dequantized to x's dtype and F.linear runs.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from attnlab import quant
from attnlab.errors import AttnlabWarning, InputError, given
from attnlab.kernels.cpu import ops as cpp_ops
from attnlab.kernels.cpu import qmatmul

FORMATS = ("fp16", *quant.WEIGHT_FORMATS)
ACTIVATIONS = ("fp32", "q8")  # what a QuantizedLinear's input is multiplied as (set_activations)
Q8 = ":q8"  # the ops' fmt suffix for 8-bit activations: "q4_1:q8"
Q8P = ":q8p"  # the same with the rows packed (qmatmul.pack_q8): "q4_1:q8p"


def row_bytes(fmt: str, in_features: int) -> int:
    """Bytes of one row of `in_features` weights in `fmt` (ggml's layout)."""
    return qmatmul.row_bytes(fmt, in_features)


def check_format(fmt: str, in_features: int, where: str = "") -> None:
    """InputError unless `fmt` is a weight format and rows of `in_features` split into its blocks."""
    if fmt not in FORMATS:
        raise InputError(f"unknown weight format {fmt!r} (valid: {', '.join(FORMATS)})")
    if fmt != "fp16" and in_features % quant.BLOCK:
        raise InputError(
            f"{where or 'a layer'} has in_features={in_features}, not a multiple of {quant.BLOCK}: {fmt} stores "
            f"rows in blocks of {quant.BLOCK} (use fp16, or keep this layer in float)"
        )


def _check_blocks(blocks: torch.Tensor, fmt: str, in_features: int) -> None:
    check_format(fmt, in_features)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(fmt, in_features):
        raise InputError(f"blocks of shape {tuple(blocks.shape)} and dtype {blocks.dtype}: {fmt} rows of "
                         f"{in_features} weights take {row_bytes(fmt, in_features)} bytes (uint8, 2-D)")  # fmt: skip


def dequantize_blocks(blocks: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """Rows of W in `fmt`, blocks (n, row bytes) uint8 -> float32 (n, in_features): ggml's values (PyTorch)."""
    if fmt == "fp16":
        return blocks.contiguous().view(torch.float16).float()
    return quant.dequantize(blocks, fmt)


def encode(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """float weight (n, in_features) -> its rows in `fmt`, (n, row bytes) uint8."""
    check_format(fmt, weight.shape[-1])
    weight = weight.detach()
    if fmt == "fp16":
        return weight.to(torch.float16).contiguous().view(torch.uint8)  # round to nearest even, as torch's .half()
    return quant.quantize(weight, fmt)


# --- the ops: one node each in a compiled graph (the C kernels are not traceable) ------------------------------

torch.library.define("attnlab::qlinear", "(Tensor x, Tensor blocks, Tensor? bias, str fmt) -> Tensor")
torch.library.define("attnlab::qdequantize", "(Tensor blocks, str fmt, int in_features) -> Tensor")


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x (..., k), k a multiple of 32, as 8-bit activations: each block of 32 values becomes codes q = round(x / d)
    (halves away from zero) with d = max|x| / 127, as ggml's Q8_0 (quant's encoder), but the scale d stays float32
    (ggml rounds it to fp16); returns q * d in x's dtype. The codes are qmatmul.c's (attnlab_quantize_q8)."""
    codes, d = quant.q8_0_codes(x.float().reshape(-1, quant.BLOCK))
    return codes.mul_(d).reshape(x.shape).to(x.dtype)


def _qlinear(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """x (..., in_features) float32 -> x W^T + bias (..., out_features), W the rows `blocks` in `fmt` (with the
    suffix Q8: x quantized first, see the module docstring)."""
    packed = fmt.endswith(Q8P)
    fmt, q8 = fmt.removesuffix(Q8P).removesuffix(Q8), packed or fmt.endswith(Q8)
    if packed:  # only the kernel reads packed rows (QuantizedLinear.forward sends only decoding's few rows so)
        return qmatmul.matmul(fmt, blocks, x, None if bias is None else bias.float(), activations="q8", packed=True)
    if x.shape[-1] % quant.BLOCK == 0 and qmatmul.available():
        return qmatmul.matmul(
            fmt, blocks, x, None if bias is None else bias.float(), activations="q8" if q8 else "fp32"
        )
    return F.linear(quantize_activations(x) if q8 else x, dequantize_blocks(blocks, fmt, x.shape[-1]), bias)


def _qdequantize(blocks: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    if in_features % quant.BLOCK == 0 and qmatmul.available():
        return qmatmul.dequantize(fmt, blocks.contiguous(), in_features)
    return dequantize_blocks(blocks, fmt, in_features)


torch.library.impl("attnlab::qlinear", "CPU", func=_qlinear)
torch.library.impl("attnlab::qdequantize", "CPU", func=_qdequantize)


@torch.library.register_fake("attnlab::qlinear")
def _(x, blocks, bias, fmt):
    return x.new_empty(*x.shape[:-1], blocks.shape[0])


# The same kernel as a C++ operator (attnlab.kernels.cpu.ops, ops.cpp), for the few rows of decoding.
torch.library.define("attnlab_cpp::qlinear", "(Tensor x, Tensor blocks, Tensor? bias, str fmt) -> Tensor")


@torch.library.register_fake("attnlab_cpp::qlinear")
def _(x, blocks, bias, fmt):
    return x.new_empty(*x.shape[:-1], blocks.shape[0])


@torch.library.register_fake("attnlab::qdequantize")
def _(blocks, fmt, in_features):
    return blocks.new_empty(blocks.shape[0], in_features, dtype=torch.float32)


def _kernel_usable(x: torch.Tensor) -> bool:
    """Whether the op may take x: float32 on the CPU, and no gradient to carry through it."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and not (torch.is_grad_enabled() and x.requires_grad)


class QuantizedLinear(nn.Module):
    """y = x W^T + bias, x (..., in_features) -> (..., out_features), W kept in `fmt` (see the module docstring).

    Buffers: `blocks` (out_features, row_bytes(fmt, in_features)) uint8, ggml's rows; `bias` (out_features,) or
    None. Build one with `from_weight` (quantizes) or `from_blocks` (a GGUF tensor's bytes as they are)."""

    def __init__(self, in_features: int, out_features: int, fmt: str, bias: bool = False, device=None):
        super().__init__()
        check_format(fmt, in_features)
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        blocks = torch.zeros(out_features, row_bytes(fmt, in_features), dtype=torch.uint8, device=device)
        self.register_buffer("blocks", blocks)
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self.register_buffer("packed", None, persistent=False)  # set_activations("q8"): blocks packed for decoding

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, fmt: str, in_features: int, bias: torch.Tensor | None = None):
        """A layer holding `blocks` (out_features, row bytes) uint8 (not copied) and `bias` (not copied)."""
        _check_blocks(blocks, fmt, in_features)
        layer = cls(in_features, blocks.shape[0], fmt, device="meta")
        layer.blocks = blocks.contiguous()
        layer.bias = bias
        return layer

    @classmethod
    def from_weight(cls, weight: torch.Tensor, fmt: str, bias: torch.Tensor | None = None):
        """weight (out_features, in_features) float, quantized to `fmt` (ggml's rounding); bias kept as it is."""
        return cls.from_blocks(encode(weight, fmt), fmt, weight.shape[1], None if bias is None else bias.detach())

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str):
        return cls.from_weight(linear.weight, fmt, linear.bias)

    activations = "fp32"  # or "q8" (set_activations): what x is multiplied as

    def pack(self) -> None:
        """Keeps `packed`, the rows interleaved for the 8-bit kernel (qmatmul.pack_q8), when this CPU multiplies them
        fast and the layer's shape allows (q8_0, q4_0 or q4_1; out_features a multiple of 16); else none."""
        fits = self.fmt != "fp16" and self.out_features % 16 == 0 and self.in_features % quant.BLOCK == 0
        cpu = self.blocks.device.type == "cpu"
        self.packed = (
            qmatmul.pack_q8(self.fmt, self.blocks, self.in_features) if fits and cpu and qmatmul.packed_fast() else None
        )

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        if self.packed is not None:  # new blocks: packed again, never stale
            self.pack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q8 = self.activations == "q8" and self.fmt != "fp16"
        if _kernel_usable(x):
            fmt = self.fmt + Q8 if q8 else self.fmt
            decoding = x.numel() < qmatmul.GEMM_MIN_ROWS * self.in_features
            if decoding and q8 and self.packed is not None:
                op = torch.ops.attnlab_cpp.qlinear if cpp_ops.usable() else torch.ops.attnlab.qlinear
                return op(x, self.packed, self.bias, self.fmt + Q8P)
            if decoding and self.in_features % quant.BLOCK == 0 and cpp_ops.usable():  # (fp16 takes any width)
                return torch.ops.attnlab_cpp.qlinear(x, self.blocks, self.bias, fmt)
            return torch.ops.attnlab.qlinear(x, self.blocks, self.bias, fmt)
        x = quantize_activations(x) if q8 else x
        return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W (out_features, in_features) in `dtype`: ggml's dequantized values."""
        if self.blocks.device.type == "cpu":
            return torch.ops.attnlab.qdequantize(self.blocks, self.fmt, self.in_features).to(dtype)
        return dequantize_blocks(self.blocks, self.fmt, self.in_features).to(dtype)

    @property
    def weight(self) -> torch.Tensor:
        """W dequantized, float32: a new tensor on each access (writing into it changes nothing), for code that
        reads a linear layer's weight directly (attention maps, MLA's absorbed decode)."""
        return self.dequantize()

    @property
    def nbytes(self) -> int:
        """Bytes held: the blocks, the bias, and the packed copy of the rows when there is one (`pack`: memory held,
        not read per token: a decoding step reads the packed rows instead of the blocks)."""
        packed = 0 if self.packed is None else self.packed.nbytes
        return self.blocks.nbytes + packed + (0 if self.bias is None else self.bias.nbytes)

    def extra_repr(self) -> str:
        q8 = ", activations=q8" if self.activations == "q8" and self.fmt != "fp16" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, " + (
            f"bias={self.bias is not None}{q8}"
        )


class QuantizedEmbedding(nn.Module):
    """tokens (...) int64 -> rows (..., embedding_dim) float32 of a table kept in `fmt`: only the looked-up rows are
    dequantized. `blocks` (num_embeddings, row bytes) uint8; `tied(head)` shares an LM head's."""

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: str, device=None):
        super().__init__()
        check_format(fmt, embedding_dim)
        self.num_embeddings, self.embedding_dim, self.fmt = num_embeddings, embedding_dim, fmt
        blocks = torch.zeros(num_embeddings, row_bytes(fmt, embedding_dim), dtype=torch.uint8, device=device)
        self.register_buffer("blocks", blocks)

    @classmethod
    def tied(cls, head: QuantizedLinear) -> QuantizedEmbedding:
        """The embedding whose table is `head`'s W (tied embeddings): the same blocks tensor."""
        embedding = cls(head.out_features, head.in_features, head.fmt, device="meta")
        embedding.blocks = head.blocks
        return embedding

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, fmt: str, embedding_dim: int) -> QuantizedEmbedding:
        """An embedding whose table is `blocks` (num_embeddings, row bytes) uint8 (not copied)."""
        _check_blocks(blocks, fmt, embedding_dim)
        embedding = cls(blocks.shape[0], embedding_dim, fmt, device="meta")
        embedding.blocks = blocks.contiguous()
        return embedding

    @classmethod
    def from_weight(cls, weight: torch.Tensor, fmt: str) -> QuantizedEmbedding:
        """weight (num_embeddings, embedding_dim) float, quantized to `fmt`."""
        return cls.from_blocks(encode(weight, fmt), fmt, weight.shape[1])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, tokens.reshape(-1))  # (N, row bytes); index_select checks the ids
        if rows.device.type == "cpu":
            values = torch.ops.attnlab.qdequantize(rows, self.fmt, self.embedding_dim)
        else:
            values = dequantize_blocks(rows, self.fmt, self.embedding_dim)
        return values.view(*tokens.shape, self.embedding_dim)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fmt={self.fmt}"


@torch.no_grad()
def quantize_weights(model: nn.Module, fmt: str) -> nn.Module:
    """Replaces, in place, every nn.Linear of `model` (an attnlab Transformer, or any module) by a QuantizedLinear
    holding its weight in `fmt` (fp16, q8_0, q4_0 or q4_1), and the Transformer's embedding by a QuantizedEmbedding
    (one table with the LM head when they are tied). Norms, biases and other parameters stay as they are. Returns
    the model (in eval mode: quantized weights are not trained).

    A layer whose in_features is not a multiple of 32 cannot be split into blocks: it stays in float, and an
    AttnlabWarning names every such layer (fp16 takes any width).

    Layers quantized already (an earlier call, or load_model(..., weights="native")) are not quantized again: in
    `fmt` they stay as they are (float layers still get quantized), and in another format the call is refused
    (InputError naming them; requantizing would round their rounded values, not the float weights: load the model
    again in float and quantize that)."""
    check_model("quantize_weights", model)
    check_format(fmt, quant.BLOCK)
    refuse_other_formats(model, fmt)
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    kept = []
    if isinstance(embed, nn.Embedding):
        if embed.embedding_dim % quant.BLOCK and fmt != "fp16":
            kept.append(f"embed (embedding_dim={embed.embedding_dim})")
        elif isinstance(head, nn.Linear) and head.weight is embed.weight:  # tied: one table, quantized once
            model.lm_head = QuantizedLinear.from_linear(head, fmt)
            model.embed = QuantizedEmbedding.tied(model.lm_head)
        else:
            model.embed = QuantizedEmbedding.from_weight(embed.weight, fmt)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            if child.in_features % quant.BLOCK and fmt != "fp16":
                kept.append(f"{name + '.' if name else ''}{child_name} (in_features={child.in_features})")
                continue
            setattr(module, child_name, QuantizedLinear.from_linear(child, fmt))
    if kept:  # one entry per kind of layer: blocks.*.attn.k_up (in_features=168) x 30, not 30 entries
        kinds = Counter(re.sub(r"\.\d+\.", ".*.", name) for name in kept)
        shown = ", ".join(kind + (f" x {count}" if count > 1 else "") for kind, count in kinds.items())
        warnings.warn(f"quantize_weights({fmt!r}): kept in float, in_features not a multiple of {quant.BLOCK}: "
                      f"{shown}", AttnlabWarning, stacklevel=3)  # fmt: skip
    return model.eval()


def check_model(function: str, model) -> None:
    """InputError unless `model` is a torch module (a model loaded or built: not its path, nor load_model's tuple)."""
    if not isinstance(model, nn.Module):
        raise InputError(f"{function} takes a model (an attnlab Transformer or any torch module), got {given(model)} "
                         "(attnlab.load_model(ref) returns (cfg, model, tokenizer): give its model)")  # fmt: skip


def refuse_other_formats(model: nn.Module, fmt: str) -> None:
    """InputError when `model` holds layers quantized to another format than `fmt` (quantize_weights)."""
    held: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)) and module.fmt != fmt:
            held.setdefault(module.fmt, []).append(name or "the model")
    if not held:
        return
    what = "; ".join(f"{f} ({len(names)} layer{'s' if len(names) > 1 else ''}, e.g. {names[0]})"
                     for f, names in held.items())  # fmt: skip
    raise InputError(f"quantize_weights(model, {fmt!r}): the model's layers are already {what}, quantized by an "
                     "earlier quantize_weights or loaded with weights='native'; quantizing them again would round "
                     "those values, not the float weights: load the model again in float (attnlab.load_model(ref)) "
                     f"and quantize that to {fmt}")  # fmt: skip


def set_activations(model: nn.Module, activations: str) -> nn.Module:
    """Sets what every QuantizedLinear of `model` multiplies its input as: "fp32" (the default: exact against the
    dequantized weights) or "q8" (8-bit codes per block of 32, llama.cpp's arithmetic: integer dot products, not
    exact; layers held in fp16 keep float32). Returns the model. InputError for another value, or for "q8" on a
    model without a layer whose weights have codes (nothing would change: quantize its weights first, or load them
    natively)."""
    check_model("set_activations", model)
    if activations not in ACTIVATIONS:
        raise InputError(f"activations={activations!r} is not known (use {' or '.join(ACTIVATIONS)})")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if activations == "q8" and not any(layer.fmt != "fp16" for layer in layers):
        raise InputError("activations=q8 quantizes the inputs of layers whose weights are q8_0, q4_0 or q4_1, and "
                         "this model has none (load it with weights native or a block format, e.g. q8_0)")  # fmt: skip
    for layer in layers:
        layer.activations = activations
        if activations == "q8":
            layer.pack()
        else:
            layer.packed = None
    return model
