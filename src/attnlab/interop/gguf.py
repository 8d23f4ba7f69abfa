"""GGUF files (llama.cpp's format) in: metadata -> ModelConfig, tensors -> an attnlab model.

    cfg, model, tokenizer = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # fp32 weights, rebuilt tokenizer
    cfg, model, tokenizer = load_gguf(path, weights="native")              # the file's F16/Q8_0/Q4_x blocks kept

Read with the `gguf` package (gguf-py, llama.cpp's own reader; an optional dependency): F32, F16, BF16,
Q8_0, Q4_0/1, Q5_0/1, the K-quants and whatever else `gguf.quants.dequantize` knows. Weights are
dequantized one tensor at a time into the model, so the peak is the model plus one tensor in fp32.

weights="native" keeps the matrices stored in F16, Q8_0, Q4_0 or Q4_1 as they are: each linear layer (q, k and v
in one, gate and up in one) whose tensors share one of these formats becomes a QuantizedLinear holding their bytes
(attnlab.model.qlinear), the tied embedding and LM head one table; any other layer (Q6_K, Q5_x, the K-quants, F32,
BF16, or parts in different formats) is dequantized to fp32 as with weights="fp32" (`native_layers` tells which).

Architectures `llama` and `qwen2` (Llama with biases on q/k/v: attention.qkv_bias). Two things differ from a
Hugging Face checkpoint, and are undone here:
* shapes are listed innermost first (ggml's ne0, the input dimension of a matrix), so a (out, in) weight
  is listed as [in, out];
* for `llama`, llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute) reorders the rows of q and k
  (weights and biases) within each head so that its RoPE, which rotates adjacent pairs (2i, 2i+1), equals
  Hugging Face's half-split rotation (i, i + head_dim/2). Head h's row (h, s, j) (s in {0, 1} the half,
  j < head_dim/2) is stored as row (h, j, s); `unpermute` puts it back, so the model uses Hugging Face's layout
  and rope_interleaved=False. `qwen2` is stored unpermuted: llama.cpp runs it with its NEOX RoPE, which is the
  half-split rotation (transformers' GGUF loader reverses the permutation for llama only, too).

RoPE scaling: `<arch>.rope.scaling.type` linear (with its factor) becomes rope_scaling linear; the tensor
rope_freqs.weight, llama.cpp's form of Llama 3.1's scaling (per rotated pair, the divisor of its frequency),
becomes rope_scaling freq_factors.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnlab.attention.mha import MHAConfig
from attnlab.config import ModelConfig, RopeScaling, head_counts
from attnlab.data.pretrained import regular_file
from attnlab.errors import ConfigError, DataError, InputError
from attnlab.interop.gguf_table import read_gguf_table
from attnlab.interop.hf import WeightFiller, fillable_model
from attnlab.interop.tokenizer import PretrainedTokenizer, tokenizer_from_gguf
from attnlab.model.qlinear import FORMATS, QuantizedEmbedding, QuantizedLinear, dequantize_blocks, row_bytes
from attnlab.model.transformer import Transformer
from attnlab.paths import brief

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
REFUSED_ARCHITECTURES: dict[str, str] = {}
PERMUTED_ARCHITECTURES = ("llama",)  # q/k rows permuted by llama.cpp's converter (see the module docstring)
ROPE_FREQS = "rope_freqs.weight"
TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
QKV_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
WEIGHTS = {
    "fp32": "every tensor dequantized (to the dtype asked, float32 by default)",
    "native": "F16, Q8_0, Q4_0 and Q4_1 matrices kept as stored, multiplied as they are",
}
NATIVE_FORMATS = {"F16": "fp16", "Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}  # GGUF type -> QuantizedLinear's
# Each layer a native GGUF holds as one QuantizedLinear: its attnlab module and the GGUF tensors stacked in it.
NATIVE_BLOCK_LAYERS = {
    "attn.qkv": ("attn_q", "attn_k", "attn_v"),
    "attn.out": ("attn_output",),
    "mlp.gate_up": ("ffn_gate", "ffn_up"),
    "mlp.down": ("ffn_down",),
}


def import_gguf():
    """The `gguf` package (a dependency, imported here only: 0.1 s that only reading a .gguf needs), or ConfigError
    saying how to get it."""
    try:
        import gguf
    except ImportError:
        raise ConfigError("reading .gguf files needs the gguf package (pip install 'gguf>=0.10')") from None
    return gguf


@dataclass
class GGUFFile:
    """An opened GGUF file: its metadata (key -> value) and its tensors (name -> GGUFTensor of gguf_table)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in PyTorch order (outermost first): GGUF lists ne0, the innermost dimension, first."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))


def open_gguf(path: str | Path) -> GGUFFile:
    """Reads a GGUF file's header, metadata and tensor table (the tensor data stays memory-mapped).
    DataError (one line naming the file) when it is not a complete GGUF file."""
    import_gguf()  # the table reader uses gguf's type tables: without the package, a ConfigError saying how to get it
    path = Path(path)
    if not regular_file(path):  # a FIFO or device: DataError saying what it is
        raise DataError(f"{path}: not found")
    try:
        reader = read_gguf_table(path)
        metadata = reader.metadata
    except PermissionError:  # not a damaged file: the OS's error names it
        raise
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError, struct.error) as e:
        reason = " ".join(str(e).split())
        raise DataError(f"{path}: not a readable GGUF file ({reason}); is it truncated or altered?") from None
    size = path.stat().st_size
    tensors = {}
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size or tensor.data.nbytes != tensor.n_bytes:
            raise DataError(f"{path}: tensor {tensor.name!r} runs past the end of the file; is it truncated?")
        if tensor.name in tensors:
            raise DataError(f"{path}: tensor {tensor.name!r} is stored twice")
        tensors[tensor.name] = tensor
    check_tensor_ranges(path, tensors.values(), int(reader.data_offset), int(reader.alignment))
    return GGUFFile(path, metadata, tensors)


def check_tensor_ranges(path: Path, tensors, data_start: int, alignment: int) -> None:
    """DataError (one line naming the file and the tensors) when a tensor's data does not start on the file's
    alignment or its bytes overlap another tensor's: a damaged tensor table, whose tensors would be read from wrong
    bytes without a word (llama.cpp refuses both)."""
    previous = None
    for tensor in sorted(tensors, key=lambda t: (t.data_offset, t.name)):
        offset = tensor.data_offset - data_start  # as the tensor table stores it: from the start of the data
        if offset % alignment:
            raise DataError(f"{path}: tensor {tensor.name!r} starts at data offset {offset}, not a multiple of the "
                            f"file's alignment {alignment}: the tensor table is damaged (llama.cpp refuses it "
                            "too); download or convert the file again")  # fmt: skip
        if tensor.n_bytes == 0:  # no bytes to overlap (a shape of 0 rows: said by the metadata's checks)
            continue
        if previous is not None and tensor.data_offset < previous.data_offset + previous.n_bytes:
            end = previous.data_offset - data_start + previous.n_bytes
            raise DataError(f"{path}: tensors {previous.name!r} (data bytes {previous.data_offset - data_start} .. "
                            f"{end - 1}) and {tensor.name!r} (from byte {offset}) overlap: the tensor table is "
                            "damaged, so one of them would be read from the other's bytes (llama.cpp refuses it "
                            "too); download or convert the file again")  # fmt: skip
        previous = tensor


def config_from_gguf(file: GGUFFile) -> ModelConfig:
    """ModelConfig of a GGUF file's metadata (`<arch>.*` keys, and the rope_freqs.weight tensor); ConfigError (one
    line) for what attnlab cannot express: another architecture, mixture of experts, partial RoPE or RoPE scaled
    otherwise than linearly or by frequency factors, per-layer head counts; DataError (one line) for a tensor whose
    shape the metadata does not imply (check_tensor_shapes), a block's tensor missing or one past the blocks it
    counts (check_block_tensors)."""
    meta, source = file.metadata, str(file.path)
    arch = meta.get("general.architecture")
    if arch in REFUSED_ARCHITECTURES:
        raise ConfigError(f"general.architecture={arch!r} is not supported yet: {REFUSED_ARCHITECTURES[arch]}", source)
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        if arch is None:  # (not "None is not supported": the key is not there)
            raise ConfigError(f"metadata general.architecture is missing (supported: {supported}): the file is not "
                              "a model's GGUF, or its metadata was damaged", source=source)  # fmt: skip
        raise ConfigError(f"general.architecture={arch!r} is not supported (supported: {supported})", source=source)

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    # context_length too: llama.cpp refuses a file without it, and any default would be a guess at the model's context
    required = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count")
    problems = [f"metadata {arch}.{name} is missing" for name in required if key(name) is None]
    problems += metadata_type_problems(meta, arch)
    if problems:
        raise ConfigError(problems, source=source)
    d_model, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    n_kv_heads = key("attention.head_count_kv", n_heads)
    if isinstance(n_kv_heads, list):
        if len(set(n_kv_heads)) != 1:
            problems.append(f"per-layer KV head counts {sorted(set(n_kv_heads))} are not supported")
        n_kv_heads = n_kv_heads[0]
    if key("attention.key_length") is None and d_model % n_heads:  # (llama.cpp asserts it too)
        raise ConfigError(f"metadata {arch}.attention.head_count={n_heads} does not divide {arch}.embedding_length="
                          f"{d_model} (without {arch}.attention.key_length a head is embedding_length / head_count "
                          f"wide; head counts that fit: {head_counts(d_model)}): the file's metadata is damaged; "
                          "download or convert it again", source=source)  # fmt: skip
    head_dim = int(key("attention.key_length") or d_model // n_heads)
    if key("attention.value_length", head_dim) != head_dim:
        problems.append(f"value heads of {key('attention.value_length')} != key heads of {head_dim} are not supported")
    if key("rope.dimension_count", head_dim) != head_dim:
        problems.append(
            f"{arch}.rope.dimension_count={key('rope.dimension_count')} != head_dim={head_dim}: partial RoPE "
            "is not supported"
        )
    scaling, scaling_problems = rope_scaling_of(file, arch)
    problems += scaling_problems
    if key("expert_count", 0):
        problems.append(f"{arch}.expert_count={key('expert_count')}: mixtures of experts are not supported")
    if problems:
        raise ConfigError(problems, source=source)
    check_token_count(file)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens) if isinstance(tokens, list) else 0)  # (a string is no token list)
    if not vocab and "token_embd.weight" in file.tensors:
        vocab = file.shape("token_embd.weight")[0]
    try:
        cfg = ModelConfig(
            vocab_size=int(vocab),
            d_model=d_model,
            n_layers=int(key("block_count")),
            n_heads=n_heads,
            max_seq_len=int(key("context_length")),
            attention=MHAConfig(n_kv_heads=int(n_kv_heads), head_dim=head_dim, qkv_bias=has_qkv_bias(file)),
            mlp="swiglu",
            d_ff=int(key("feed_forward_length")),
            tie_embeddings="output.weight" not in file.tensors,
            rope_base=float(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            name=file.path.stem,
        )
    except ConfigError as e:
        raise e.with_source(source) from None
    check_tensor_shapes(file, cfg)
    check_block_tensors(file, cfg)
    return cfg


def implied_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape (PyTorch order) of each tensor a GGUF file of `cfg` may hold: GGUF name -> (rows, columns)."""
    d_model, vocab, d_ff = cfg.d_model, cfg.vocab_size, cfg.hidden_dim
    head_dim = cfg.attention.head_dim or d_model // cfg.n_heads
    q_rows, kv_rows = cfg.n_heads * head_dim, (cfg.attention.n_kv_heads or cfg.n_heads) * head_dim
    shapes = {"token_embd.weight": (vocab, d_model), "output.weight": (vocab, d_model)}
    shapes["output_norm.weight"] = (d_model,)
    per_block = {
        "attn_norm.weight": (d_model,), "ffn_norm.weight": (d_model,),
        "attn_q.weight": (q_rows, d_model), "attn_k.weight": (kv_rows, d_model), "attn_v.weight": (kv_rows, d_model),
        "attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,),
        "attn_output.weight": (d_model, q_rows),
        "ffn_gate.weight": (d_ff, d_model), "ffn_up.weight": (d_ff, d_model), "ffn_down.weight": (d_model, d_ff),
    }  # fmt: skip
    for i in range(cfg.n_layers):
        shapes.update({f"blk.{i}.{name}": shape for name, shape in per_block.items()})
    return shapes


def check_tensor_shapes(file: GGUFFile, cfg: ModelConfig) -> None:
    """DataError (one line naming the file, the tensor, its shape and the shape the metadata implies) for the first
    tensor whose shape does not fit the config read from the metadata: a damaged file, or tensors of another model.
    Checked before any weight is read (q and k rows are regrouped per head, which a wrong shape would break)."""
    arch = file.metadata.get("general.architecture")
    implied = implied_shapes(cfg)
    for name in file.tensors:
        if name in implied and file.shape(name) != implied[name]:
            raise DataError(f"{file.path} ({name}): the tensor has shape {file.shape(name)}, but the file's metadata "
                            f"({arch}.*) implies {implied[name]}: the file is damaged or its tensors are not its "
                            "metadata's model; download or convert it again")  # fmt: skip


def check_block_tensors(file: GGUFFile, cfg: ModelConfig) -> None:
    """DataError (one line naming the file, the first tensors missing or past the last block, and the block count)
    unless the file holds every tensor of the blocks its metadata counts ({arch}.block_count) and none past them.
    From the header alone, before any weight is read: `info` would otherwise print the figures of a depth the
    tensors contradict, where loading the model refuses it."""
    arch = file.metadata.get("general.architecture")
    parts = [f"{part}.weight" for part in BLOCK_NAMES] + (list(QKV_BIASES) if cfg.attention.qkv_bias else [])
    required = ["token_embd.weight", "output_norm.weight"]
    required += [f"blk.{i}.{part}" for i in range(cfg.n_layers) for part in parts]
    blocks = {int(m.group(1)) for name in file.tensors if (m := BLOCK_TENSOR.fullmatch(name))}
    held = max(blocks) + 1 if blocks else 0
    depth = f"{arch}.block_count is {cfg.n_layers} but the tensors are of {held} block{'s' * (held != 1)}"
    fix = "the file is damaged or its metadata is not its tensors' model; download or convert it again"
    missing = [name for name in required if name not in file.tensors]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        why = f" ({depth})" if held != cfg.n_layers else ""
        raise DataError(f"{file.path}: missing tensor(s) {', '.join(missing[:3])}{more}{why}: {fix}")
    past = [name for name in file.tensors if (m := BLOCK_TENSOR.fullmatch(name)) and int(m.group(1)) >= cfg.n_layers]
    if past:
        more = f" and {len(past) - 3} more" if len(past) > 3 else ""
        raise DataError(f"{file.path}: tensor(s) {', '.join(past[:3])}{more} of no block ({depth}): {fix}")


def check_token_count(file: GGUFFile) -> None:
    """DataError (one line naming the file and both counts) unless the file's token list has one token per row of
    its embedding (token_embd.weight; without it, `<arch>.vocab_size`), as llama.cpp requires: fewer tokens leave ids
    the model emits with no text, more give the tokenizer ids with no embedding."""
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    arch = file.metadata.get("general.architecture")
    if not isinstance(tokens, list) or not tokens:
        return  # no tokenizer in the file (tokenizer_from_gguf says so when one is needed)
    if "token_embd.weight" in file.tensors:
        rows = file.shape("token_embd.weight")[0]
        what = f"token_embd.weight has {rows:,} rows"
    elif _is_whole(file.metadata.get(f"{arch}.vocab_size")):
        rows = file.metadata[f"{arch}.vocab_size"]
        what = f"{arch}.vocab_size is {rows:,}"
    else:
        return
    if len(tokens) == rows:
        return
    if len(tokens) == rows + 1:
        detail = f"token {rows} ({brief(tokens[rows])}) has no embedding"
    elif len(tokens) > rows:
        detail = f"tokens {rows} .. {len(tokens) - 1} ({brief(tokens[rows])} first) have no embedding"
    else:
        detail = f"ids {len(tokens)} .. {rows - 1} of the model have no token"
    raise DataError(
        f"{file.path}: tokenizer.ggml.tokens holds {len(tokens):,} tokens but {what} (one per token): "
        f"{detail}; the file is damaged or mixes two models (llama.cpp refuses it too)"
    )


# Metadata config_from_gguf reads, with what each must be: a whole number >= the least, or a number > 0.
WHOLE_KEYS = {
    "block_count": 1,
    "embedding_length": 1,
    "feed_forward_length": 1,
    "attention.head_count": 1,
    "attention.head_count_kv": 1,
    "attention.key_length": 1,
    "attention.value_length": 1,
    "rope.dimension_count": 1,
    "context_length": 1,
    "vocab_size": 1,
    "expert_count": 0,
}
POSITIVE_KEYS = ("rope.freq_base", "attention.layer_norm_rms_epsilon")


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def metadata_type_problems(meta: dict, arch: str) -> list[str]:
    """A problem for each `<arch>.*` key config_from_gguf reads whose value has the wrong type or range (a head
    count of 0, a base stored as a string); head_count_kv may be a list (one per layer)."""
    problems = []
    for name, least in WHOLE_KEYS.items():
        value = meta.get(f"{arch}.{name}")
        values = value if isinstance(value, list) and name == "attention.head_count_kv" else [value]
        if value is not None and not all(_is_whole(v) and v >= least for v in values) or values == []:
            problems.append(f"metadata {arch}.{name}={brief(value)} must be a whole number >= {least}")
    for name in POSITIVE_KEYS:
        value = meta.get(f"{arch}.{name}")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if value is not None and not (number and math.isfinite(value) and value > 0):
            problems.append(f"metadata {arch}.{name}={brief(value)} must be a number > 0")
    return problems


def rope_scaling_of(file: GGUFFile, arch: str) -> tuple[RopeScaling | None, list[str]]:
    """(rope_scaling or None, problems) of a file: `<arch>.rope.scaling.type` none, or linear with its factor (or
    the older `<arch>.rope.scale_linear`); or the rope_freqs.weight tensor, one frequency divisor per rotated pair."""
    meta = file.metadata
    kind, factor = meta.get(f"{arch}.rope.scaling.type", "none"), meta.get(f"{arch}.rope.scaling.factor", 1.0)
    if f"{arch}.rope.scaling.type" not in meta and f"{arch}.rope.scale_linear" in meta:
        kind, factor = "linear", meta[f"{arch}.rope.scale_linear"]
    if kind not in ("none", "linear"):
        return None, [f"{arch}.rope.scaling.type={kind!r} is not supported (only linear, or {ROPE_FREQS})"]
    if not isinstance(factor, int | float) or isinstance(factor, bool) or not factor > 0:
        return None, [f"{arch}.rope.scaling.factor={factor!r} must be a number > 0"]
    linear = kind == "linear" and factor != 1.0  # a factor of 1 is plain RoPE
    if ROPE_FREQS in file.tensors:
        if linear:
            return None, [f"{arch}.rope.scaling.factor={factor} together with {ROPE_FREQS} is not supported"]
        if len(file.shape(ROPE_FREQS)) != 1:
            return None, [f"{ROPE_FREQS} has shape {file.shape(ROPE_FREQS)}, expected one factor per rotated pair"]
        factors = tuple(float(v) for v in dequantized(file, ROPE_FREQS).tolist())
        try:
            return RopeScaling(type="freq_factors", freq_factors=factors), []
        except ConfigError as e:
            return None, [f"{ROPE_FREQS}: {problem}" for problem in e.problems]
    return (RopeScaling(type="linear", factor=float(factor)) if linear else None), []


def has_qkv_bias(file: GGUFFile) -> bool:
    """Whether the blocks' q/k/v projections have biases (qwen2 always; a llama file may too)."""
    return any(name.endswith(QKV_BIASES) for name in file.tensors)


def hf_name(name: str) -> str | None:
    """The Hugging Face Llama name of a GGUF tensor name (None for names with no counterpart)."""
    if name in TOP_LEVEL_NAMES:
        return TOP_LEVEL_NAMES[name]
    match = BLOCK_TENSOR.fullmatch(name)
    if match and match.group(2) in BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{BLOCK_NAMES[match.group(2)]}.{match.group(3)}"
    return None


def unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's q/k row permutation: weight (n_heads * head_dim, d_model), or a bias (n_heads * head_dim,),
    rows per head stored as (head_dim/2, 2) pairs -> Hugging Face's (2, head_dim/2) halves."""
    rows = weight.shape[0]
    pairs = weight.reshape(n_heads, rows // n_heads // 2, 2, -1)  # (H, D/2, 2, d_model or 1)
    return pairs.transpose(1, 2).reshape(weight.shape)  # (H, 2, D/2, d_model or 1) -> rows


def dequantized(file: GGUFFile, name: str) -> torch.Tensor:
    """A tensor's values in fp32, in PyTorch shape order. The block formats attnlab multiplies natively (Q8_0, Q4_0,
    Q4_1, F16) are decoded by attnlab's own decoder (quant.dequantize: ggml's values, in one vectorised pass, some 10x
    faster than the gguf package's row groups); the other types by the gguf package."""
    gguf, tensor = import_gguf(), file.tensors[name]
    fmt, shape = NATIVE_FORMATS.get(getattr(tensor.tensor_type, "name", None)), file.shape(name)
    if fmt is not None and len(shape) >= 2:
        return dequantize_blocks(stored_rows(file, name), fmt, math.prod(shape[1:])).reshape(shape)
    try:
        with np.errstate(invalid="ignore", over="ignore"):  # a damaged block's NaN/inf: the WeightFiller names it
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, ValueError) as e:
        kind = getattr(tensor.tensor_type, "name", tensor.tensor_type)
        raise DataError(f"{file.path}: tensor {name!r} of type {kind} cannot be dequantized ({e})") from None
    values = np.asarray(values, dtype=np.float32)
    if not values.flags.writeable:  # F32 tensors come back as views of the read-only memory map
        values = values.copy()
    return torch.from_numpy(values.reshape(file.shape(name)))


def check_weights(weights: str) -> str:
    """InputError unless `weights` is one of WEIGHTS."""
    if weights not in WEIGHTS:
        choices = "; ".join(f"{name!r}: {what}" for name, what in WEIGHTS.items())
        how = (f": to get {weights} weights, quantize the loaded model, attnlab.quantize_weights(model, {weights!r}) "
               f"(what the CLI's --weights {weights} does)") if weights in FORMATS else ""  # fmt: skip
        raise InputError(f"weights={weights!r} is not a choice ({choices}){how}")
    return weights


def native_layers(file: GGUFFile, cfg: ModelConfig) -> dict[str, tuple[str, list[str]]]:
    """The layers weights="native" keeps quantized: attnlab module path -> (format, GGUF tensors stacked in it).
    The LM head and the embedding are one entry ("lm_head", with token_embd) when tied; a layer is left out when
    its tensors are in formats QuantizedLinear does not hold, or in several."""
    layers = {f"blocks.{i}.{path}": [f"blk.{i}.{name}.weight" for name in names]
              for i in range(cfg.n_layers) for path, names in NATIVE_BLOCK_LAYERS.items()}  # fmt: skip
    layers["embed"] = ["token_embd.weight"]
    layers["lm_head"] = ["token_embd.weight" if cfg.tie_embeddings else "output.weight"]
    if cfg.tie_embeddings:
        del layers["embed"]  # one table (QuantizedEmbedding.tied)
    out = {}
    for path, names in layers.items():
        kinds = {getattr(file.tensors[n].tensor_type, "name", None) for n in names if n in file.tensors}
        if len(kinds) == 1 and all(n in file.tensors for n in names) and kinds & NATIVE_FORMATS.keys():
            out[path] = (NATIVE_FORMATS[kinds.pop()], names)
    return out


def stored_rows(file: GGUFFile, name: str) -> torch.Tensor:
    """A matrix's bytes as stored, (rows, row bytes) uint8: ggml's rows, blocks along the input dimension."""
    data = np.asarray(file.tensors[name].data).view(np.uint8)
    return torch.from_numpy(data.reshape(file.shape(name)[0], -1).copy())  # copied out of the read-only map


# Bytes per block of each native block format, and how many fp16 fields open it (Q8_0 and Q4_0: the scale d; Q4_1:
# d and the minimum m): ggml's block_q8_0, block_q4_0, block_q4_1.
BLOCK_HEADERS = {"q8_0": (34, 1), "q4_0": (18, 1), "q4_1": (20, 2)}


def blocks_finite(rows: torch.Tensor, fmt: str) -> bool:
    """Whether a matrix stored as `rows` (rows, row bytes) uint8 in `fmt` decodes to finite values: for fp16 its
    values, for a block format its blocks' fp16 scales (and minima), since the 4- and 8-bit codes times a finite
    scale are finite. Reads the scales only: 1/17 of a Q8_0 matrix."""
    if fmt == "fp16":
        halves = rows.view(torch.float16)
    else:
        size, fields = BLOCK_HEADERS[fmt]
        halves = rows.reshape(-1, size)[:, : 2 * fields].contiguous().view(torch.float16)  # (blocks, fields)
    return bool(torch.isfinite(halves.sum(dtype=torch.float32)))  # exact: fp16 values never overflow an fp32 sum


def install_native(file: GGUFFile, model: Transformer, cfg: ModelConfig) -> set[str]:
    """Puts QuantizedLinear (and QuantizedEmbedding) layers holding a file's stored bytes in `model` (see
    `native_layers`), q and k rows unpermuted as `unpermute` does (exact on blocks: they run along the input
    dimension); returns the GGUF tensors so placed. A linear layer's bias stays its tensor (filled as usual)."""
    placed = set()
    n_kv_heads = cfg.attention.n_kv_heads or cfg.n_heads
    arch = file.metadata.get("general.architecture")
    for path, (fmt, names) in native_layers(file, cfg).items():
        parent_path, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        layer = getattr(parent, attribute)
        in_features = layer.embedding_dim if isinstance(layer, torch.nn.Embedding) else layer.in_features
        out_features = layer.num_embeddings if isinstance(layer, torch.nn.Embedding) else layer.out_features
        if fmt != "fp16" and in_features % 32:
            continue  # cannot happen for a well-formed file (its blocks run along the input dimension)
        parts = []
        for name in names:
            rows = stored_rows(file, name)
            if not blocks_finite(rows, fmt):
                raise DataError(f"{file.path}: tensor {name!r} holds NaN or infinite values: the weights are damaged "
                                "(a corrupt file, or a model whose training diverged) and cannot be used")  # fmt: skip
            if arch in PERMUTED_ARCHITECTURES and name.endswith(".attn_q.weight"):
                rows = unpermute(rows, cfg.n_heads)
            elif arch in PERMUTED_ARCHITECTURES and name.endswith(".attn_k.weight"):
                rows = unpermute(rows, n_kv_heads)
            parts.append(rows)
        blocks = torch.cat(parts)
        if blocks.shape[0] < out_features and path in ("embed", "lm_head"):  # the padded vocabulary rows: zeros
            blocks = torch.cat((blocks, blocks.new_zeros(out_features - blocks.shape[0], blocks.shape[1])))
        if tuple(blocks.shape) != (out_features, row_bytes(fmt, in_features)):
            shapes = ", ".join(f"{n} {file.shape(n)}" for n in names)
            raise DataError(f"{file.path}: {shapes} in {fmt} do not make the ({out_features}, {in_features}) matrix "
                            f"of {path} that the config implies")  # fmt: skip
        if path == "embed":
            quantized = QuantizedEmbedding.from_blocks(blocks, fmt, in_features)
        else:
            bias = layer.bias.detach() if layer.bias is not None else None  # the filler writes into it
            quantized = QuantizedLinear.from_blocks(blocks, fmt, in_features, bias)
        setattr(parent, attribute, quantized)
        if path == "lm_head" and cfg.tie_embeddings:
            model.embed = QuantizedEmbedding.tied(quantized)
        placed.update(names)
    return placed


@torch.no_grad()
def model_from_gguf(file: GGUFFile, cfg: ModelConfig, dtype=torch.float32, weights: str = "fp32") -> Transformer:
    """The model of `cfg` holding a GGUF file's weights (q/k unpermuted for llama): dequantized, in `dtype`, or with
    weights="native" its F16/Q8_0/Q4_0/Q4_1 matrices kept as stored (the module docstring)."""
    filler = WeightFiller(fillable_model(cfg, dtype=dtype), str(file.path))
    native = install_native(file, filler.model, cfg) if check_weights(weights) == "native" else set()
    n_kv_heads = cfg.attention.n_kv_heads or cfg.n_heads
    arch = file.metadata.get("general.architecture")
    for name in file.tensors:
        if name == ROPE_FREQS:
            continue  # read into the config (rope_scaling freq_factors)
        target = hf_name(name)
        if target is None:
            raise DataError(f"{file.path}: unexpected tensor {name!r} for architecture {arch}")
        if name in native:
            filler.placed(target)
            continue
        values = dequantized(file, name)
        if arch in PERMUTED_ARCHITECTURES and name.endswith((".attn_q.weight", ".attn_q.bias")):
            values = unpermute(values, cfg.n_heads)
        elif arch in PERMUTED_ARCHITECTURES and name.endswith((".attn_k.weight", ".attn_k.bias")):
            values = unpermute(values, n_kv_heads)
        filler.fill(target, values, where=f"{file.path} ({name})")
    return filler.finish()


def load_gguf(
    path: str | Path, dtype=torch.float32, tokenizer: bool = True, weights: str = "fp32"
) -> tuple[ModelConfig, Transformer, PretrainedTokenizer | None]:
    """(config, model, tokenizer) from a GGUF file: the weights dequantized to `dtype` (default fp32), or with
    weights="native" its F16/Q8_0/Q4_0/Q4_1 matrices kept as stored (the module docstring), and the tokenizer
    rebuilt from its tokenizer.ggml.* metadata (None when tokenizer=False)."""
    check_weights(weights)
    file = open_gguf(path)
    cfg = config_from_gguf(file)
    model = model_from_gguf(file, cfg, dtype, weights)
    return cfg, model, tokenizer_from_gguf(file.metadata, source=str(file.path)) if tokenizer else None
