"""Hugging Face model folders out: an attnlab model that a Llama (or Mistral) config describes, written as
transformers' save_pretrained writes one, so `AutoModelForCausalLM.from_pretrained(folder)` reads it.

    exported = export_hf("runs/tiny/seed0", "out/tiny-hf")                  # any model reference (load_model)
    exported = export_hf(model, "out/m", tokenizer=tokenizer, dtype=torch.bfloat16)

What is exported: attention kind `mha` (MHA, GQA, MQA), `sliding` (MistralForCausalLM with sliding_window) and
`bottleneck` without a null token (a Llama whose head_dim is d_attn / n_heads); with attention.qkv_bias (biases on
q, k and v only) Qwen2ForCausalLM, every layer sliding or none; SwiGLU MLP; no memory; RoPE plain or scaled `linear`
/ `llama3` (transformers' rope_type of that name); tied or untied embeddings, cut to vocab_size rows (attnlab's
padding rows dropped). Interleaved RoPE (pairs 2i, 2i+1) is exported exactly by permuting each q and k head's rows
to transformers' half-split pairing (i, i + D/2): q.k sums over every channel, so the same permutation of both
leaves every score as it was. Anything else is refused in one ConfigError naming what and why.

The folder: config.json, model.safetensors (or shards model-0000i-of-0000n.safetensors + index above
max_shard_bytes), generation_config.json and the tokenizer (tokenizer.json + tokenizer_config.json) when the
model has one. attnlab's own tokenizers become tokenizer.json files that encode text to the same ids: `gpt2`
(tiktoken's ranks as a byte-level BPE, merges derived from the ranks), `bpe:N` (already a tokenizers
Tokenizer), `byte` (the 256 bytes as a byte-level vocabulary without merges), `char` (its characters, unknown
ones to <unk>) and `word` (a WordLevel model over the same white space split, line ends as <eos>). One
difference stays: transformers reads the text "<|endoftext|>" as the end-of-text token (its special tokens
are matched in text), where attnlab's ordinary encoding reads it as plain text.

The folder is written under a temporary name beside out_dir and renamed when complete; a non-empty out_dir
is replaced only with overwrite=True, and only when it holds nothing but files an export writes (an earlier
export): a folder with anything else in it (a data directory, the user's notes) is refused, never deleted.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from attnlab.data.files import as_os_error, atomic_write_text, temp_path_beside
from attnlab.data.pretrained import PretrainedTokenizer
from attnlab.data.tokenizers import (
    EOS,
    EOT,
    UNK,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    WordTokenizer,
)
from attnlab.errors import ConfigError, DataError, InputError, check_flags
from attnlab.interop.export_folder import EXPORT_FILES, check_out_dir, replace_folder  # noqa: F401
from attnlab.interop.hf import hf_targets
from attnlab.interop.references import load_model, model_config_of
from attnlab.interop.tokenizer import _byte_alphabet
from attnlab.jsonio import loads_json
from attnlab.model.transformer import Transformer

# A folder's weights go to shards above this size, as save_pretrained's max_shard_size does.
SHARD_BYTES = 2 * 1024**3
DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}  # fmt: skip
# Attention kinds a Llama config cannot describe, and why.
REFUSED_KINDS = {
    "decoupled": "its semantic (no RoPE) and geometric (RoPE) query/key paths, scaled apart, have no Llama counterpart",
    "mla": "its keys and values are expanded from a shared low-rank latent, with a separate RoPE key",
    "diff": "each head subtracts a second softmax map (lambda-weighted) and normalises the result",
    "coda": "each head subtracts a gated attention stream of a rotated query and normalises the result",
}
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
# attnlab's RoPE scaling types that are transformers' rope_type of the same name, options and arithmetic.
HF_ROPE_TYPES = ("linear", "llama3")
# The parameters of a Llama-shaped attnlab model (besides the per-block ones below); any other has no place.
MODEL_PARAMETERS = ("embed.weight", "lm_head.weight", "norm.weight")
BLOCK_PARAMETERS = ("attn_norm.weight", "attn.qkv.weight", "attn.out.weight", "mlp_norm.weight",
                    "mlp.gate_up.weight", "mlp.down.weight")  # fmt: skip


@dataclass
class Exported:
    """What export_hf wrote: the folder, its architecture and dtype, the files, and what became of the tokenizer."""

    folder: Path
    architecture: str
    dtype: str
    files: list[str]
    tokenizer: str  # the tokenizer written ("gpt2 as tokenizer.json", ...) or why none was
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        notes = "".join(f"; {note}" for note in self.notes)
        files = f"{len(self.files)} files"
        return f"{self.folder}: {self.architecture} ({self.dtype}), {files}; tokenizer: {self.tokenizer}{notes}"


# ----------------------------------------------------------------------------- what a Llama config describes


def hf_architecture(cfg, model: Transformer | None = None) -> str:
    """LlamaForCausalLM, MistralForCausalLM (attention kind sliding) or Qwen2ForCausalLM (attention.qkv_bias) for a
    model a Llama-family config describes; else ConfigError, one line naming every problem and why."""
    kind, problems = cfg.attention.kind, []
    if kind in REFUSED_KINDS:
        problems.append(f"attention.kind={kind!r} cannot be exported as a Llama model: {REFUSED_KINDS[kind]}")
    elif kind == "bottleneck" and cfg.attention.null_attn:
        problems.append("attention.null_attn=true cannot be exported as a Llama model: its learned null key/value "
                        "(an extra column every query attends to) has no Llama counterpart")  # fmt: skip
    elif kind not in ("mha", "sliding", "bottleneck"):
        problems.append(f"attention.kind={kind!r} is not known to the export (it writes mha, sliding, bottleneck)")
    if cfg.memory.kind != "none":
        problems.append(
            f"memory.kind={cfg.memory.kind!r} cannot be exported: a Llama config has no bounded KV "
            "memory, and without it the model would attend differently (export with memory.kind none)"
        )
    if cfg.mlp != "swiglu":
        problems.append(f"mlp={cfg.mlp!r} cannot be exported as a Llama model: its MLP is SwiGLU (silu-gated)")
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.type not in HF_ROPE_TYPES:
        made = (" (a bottleneck or decoupled conversion keeps the source's RoPE on the pairs it chose: their "
                "frequencies, one per pair, are this rope_scaling)" if cfg.attention.kind in ("bottleneck", "decoupled")
                else "")  # fmt: skip
        problems.append(
            f"rope_scaling.type={scaling.type!r}{made} cannot be exported: transformers' Llama has no RoPE type with "
            f"one factor per channel pair (exported: {', '.join(HF_ROPE_TYPES)}); such a model runs in attnlab only"
        )
    if not problems and model is not None:
        names = BLOCK_PARAMETERS + (("attn.qkv.bias",) if getattr(cfg.attention, "qkv_bias", False) else ())
        blocks = {f"blocks.{i}.{name}" for i in range(cfg.n_layers) for name in names}
        expected = set(MODEL_PARAMETERS) | blocks
        extra = sorted(name for name, _ in model.named_parameters(remove_duplicate=False) if name not in expected)
        if extra:  # biases, gates: tensors the config does not declare, which no Llama tensor could hold
            more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
            problems.append(f"parameter(s) {', '.join(extra[:3])}{more} have no place in a Llama model")
    if problems:
        raise ConfigError(problems)
    if getattr(cfg.attention, "qkv_bias", False):  # Llama's attention_bias would bias o_proj too; Qwen2's not
        return "Qwen2ForCausalLM"
    return "MistralForCausalLM" if kind == "sliding" else "LlamaForCausalLM"


def hf_config(cfg, dtype: torch.dtype, tokenizer: Tokenizer | None = None) -> dict:
    """config.json of the model (LlamaConfig / MistralConfig / Qwen2Config keys, for transformers 4 and 5 alike)."""
    arch = hf_architecture(cfg)
    attention = cfg.attention
    if attention.kind == "bottleneck":
        n_kv_heads, head_dim = attention.n_kv_heads or cfg.n_heads, attention.d_attn // cfg.n_heads
    else:
        n_kv_heads, head_dim = attention.kv_heads(cfg), attention.dim(cfg)
    dtype_name = str(dtype).removeprefix("torch.")
    scaling = cfg.rope_scaling
    rope = None if scaling is None else {"rope_type": scaling.type, **scaling.to_dict()}
    rope = rope and {key: value for key, value in rope.items() if key != "type"}
    out = {
        "architectures": [arch],
        "model_type": MODEL_TYPES[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,  # transformers 4 (+ rope_scaling); 5 reads rope_parameters
        "rope_scaling": rope,
        "rope_parameters": {**(rope or {"rope_type": "default"}), "rope_theta": cfg.rope_base},
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype_name,  # transformers 4; 5 reads dtype
        "dtype": dtype_name,
        "use_cache": True,
    }
    window = attention.window if attention.kind == "sliding" else None  # itself and the window - 1 before it
    if arch == "MistralForCausalLM":
        out["sliding_window"] = window
    if arch == "Qwen2ForCausalLM":  # no o_proj or MLP bias options; sliding from layer max_window_layers on
        del out["attention_bias"], out["mlp_bias"]
        layer = "sliding_attention" if window else "full_attention"
        out.update(use_sliding_window=window is not None, sliding_window=window,
                   max_window_layers=0 if window else cfg.n_layers, layer_types=[layer] * cfg.n_layers)  # fmt: skip
    bos_id, eos_ids = special_ids(tokenizer)
    out.update({} if bos_id is None else {"bos_token_id": bos_id}, **({"eos_token_id": eos_ids[0]} if eos_ids else {}))
    return out


def special_ids(tokenizer: Tokenizer | None) -> tuple[int | None, list[int]]:
    """(BOS id or None, the ids that end a generation, end-of-sequence first) of a tokenizer."""
    if tokenizer is None:
        return None, []
    if isinstance(tokenizer, PretrainedTokenizer):
        first = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        return tokenizer.bos_id, list(dict.fromkeys(first + list(tokenizer.stop_ids)))
    return None, list(tokenizer.stop_ids)


# ----------------------------------------------------------------------------- weights


def half_split_rows(weight: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """A q or k projection (n_heads * head_dim, d_model), or its bias (n_heads * head_dim,), of interleaved RoPE
    (pairs 2i, 2i+1) with each head's rows reordered for half-split RoPE (pairs i, i + D/2): row 2i goes to i,
    row 2i + 1 to i + D/2."""
    order = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
    return weight.view(n_heads, head_dim, -1)[:, order].reshape(weight.shape)  # (H, D, d_model) -> rows


def hf_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """Hugging Face name -> tensor (views where no reordering is needed) of a model hf_architecture accepts."""
    cfg = model.cfg
    hf_architecture(cfg, model)
    tensors = dict(hf_targets(model))
    # Every weight goes out: the table covers each parameter but the embedding's (and LM head's) padding rows.
    padding = (cfg.padded_vocab_size - cfg.vocab_size) * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    held = sum(p.numel() for p in model.parameters()) - padding
    if sum(t.numel() for t in tensors.values()) != held:
        raise RuntimeError(f"interop.hf_targets names {sum(t.numel() for t in tensors.values())} of the model's "
                           f"{held} weights: the export would drop some")  # fmt: skip
    if cfg.rope_interleaved:
        for i, block in enumerate(model.blocks):
            attn, p = block.attn, f"model.layers.{i}.self_attn."
            for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias"):
                if p + name in tensors:  # a bias rotates with its rows
                    heads = attn.n_heads if name.startswith("q") else attn.n_kv_heads
                    tensors[p + name] = half_split_rows(tensors[p + name], heads, attn.head_dim)
    return tensors


def shard_plan(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shards of at most max_shard_bytes each, in order (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


@torch.no_grad()
def check_range(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors; InputError naming the first with a value `dtype` cannot hold (fp16 past 65504: written as inf)."""
    largest = torch.finfo(dtype).max
    for name, tensor in tensors.items():
        top = tensor.detach().abs().max().item() if tensor.numel() else 0.0
        if top > largest:
            raise InputError(f"dtype {str(dtype).removeprefix('torch.')}: {name} reaches |value|={top:.3g}, beyond the "
                             f"{largest:.6g} it holds (written as inf): export with --dtype bf16 or fp32")  # fmt: skip
    return tensors


@torch.no_grad()
def write_weights(
    tensors: dict[str, torch.Tensor], folder: Path, dtype: torch.dtype, max_shard_bytes: int
) -> list[str]:
    """The tensors in `dtype` as model.safetensors, or shards + model.safetensors.index.json above max_shard_bytes;
    one shard's copies held at a time. Returns the file names."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    umask = os.umask(0)  # read it: the only way is to set it, and put it back at once
    os.umask(umask)
    sizes = {name: tensor.numel() * itemsize for name, tensor in tensors.items()}
    shards = shard_plan(sizes, max_shard_bytes)
    many = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    names = ["model.safetensors"] if len(shards) == 1 else many
    for file, shard in zip(names, shards, strict=True):
        # Copies: safetensors stores no views (q, k, v are slices of one fused weight) and wants contiguous memory.
        copies = {name: tensors[name].detach().to(dtype=dtype, copy=True).contiguous() for name in shard}
        try:
            save_file(copies, str(folder / file), metadata={"format": "pt"})
        except SafetensorError as e:  # a full disk or a file size limit: the OSError it wraps, naming the file
            raise as_os_error(e, folder / file) or e from None
        os.chmod(folder / file, 0o666 & ~umask)  # safetensors creates its files owner-only; the folder's others not
    if len(shards) == 1:
        return names
    metadata = {"total_size": sum(sizes.values()), "total_parameters": sum(t.numel() for t in tensors.values())}
    weight_map = {name: file for file, shard in zip(names, shards, strict=True) for name in shard}
    index = {"metadata": metadata, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return [*names, "model.safetensors.index.json"]


# ----------------------------------------------------------------------------- tokenizers


def tiktoken_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The BPE merges tiktoken's ranks imply, in rank order: each token of two or more bytes is the merge of the
    two parts that byte-pair encoding with the ranks below its own leaves (transformers' TikTokenConverter)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            candidates = [(ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
            best = min(((r, i) for r, i in candidates if r is not None and r < rank), default=None)
            if best is None:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) != 2 or parts[0] not in ranks or parts[1] not in ranks:
            raise DataError(f"gpt2 ranks: token {token!r} (rank {rank}) is no merge of two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def _end_of_text(tokenizer: HFTokenizer, eot_id: int) -> HFTokenizer:
    tokenizer.add_special_tokens([AddedToken(EOT, normalized=False, special=True)])
    if tokenizer.token_to_id(EOT) != eot_id:
        raise DataError(f"the exported tokenizer puts {EOT} at {tokenizer.token_to_id(EOT)}, not {eot_id}")
    return tokenizer


def _byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], use_regex: bool) -> HFTokenizer:
    tokenizer = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def gpt2_tokenizer(tokenizer: TiktokenTokenizer) -> HFTokenizer:
    """GPT-2's tiktoken ranks as a byte-level BPE tokenizer.json (GPT-2's own split regex is ByteLevel's)."""
    spelling = _byte_alphabet()
    spell = lambda token: "".join(spelling[b] for b in token)  # noqa: E731
    vocab = {spell(token): rank for token, rank in tokenizer.ranks.items()}
    vocab[EOT] = tokenizer.eot_id
    merges = [(spell(left), spell(right)) for left, right in tiktoken_merges(tokenizer.ranks)]
    return _end_of_text(_byte_level_bpe(vocab, merges, use_regex=True), tokenizer.eot_id)


def byte_tokenizer(tokenizer: ByteTokenizer) -> HFTokenizer:
    """Ids 0..255 the UTF-8 bytes (a byte-level vocabulary, no merges), 256 end-of-text."""
    vocab = {char: b for b, char in _byte_alphabet().items()}
    vocab[EOT] = tokenizer.eot_id
    return _end_of_text(_byte_level_bpe(vocab, [], use_regex=False), tokenizer.eot_id)


def char_tokenizer(tokenizer: CharTokenizer) -> HFTokenizer:
    """One id per character (a vocabulary of single characters, no merges), any other character <unk>."""
    out = HFTokenizer(models.BPE(vocab=dict(tokenizer.ids), merges=[], unk_token=UNK, fuse_unk=False))
    out.decoder = decoders.Sequence([decoders.Replace(UNK, "\ufffd"), decoders.Fuse()])  # <unk> as attnlab shows it
    return _end_of_text(out, tokenizer.eot_id)


@functools.cache
def white_space_class() -> str:
    r"""Python's white space (what `\s` in attnlab's word regex matches: str.isspace) as one explicit character
    class for the tokenizers library's regex engine, whose own \s need not be the same set."""
    return "[" + "".join(f"\\x{{{c:x}}}" for c in range(0x110000) if chr(c).isspace()) + "]"


def word_tokenizer(tokenizer: WordTokenizer) -> HFTokenizer:
    """Words split at Python's white space, each line end an <eos> word, words outside the vocabulary <unk>."""
    out = HFTokenizer(models.WordLevel(vocab=dict(tokenizer.ids), unk_token=UNK))
    out.normalizer = normalizers.Replace("\n", f" {EOS} ")  # a line end is the word <eos>, as attnlab reads it
    out.pre_tokenizer = pre_tokenizers.Split(Regex(white_space_class() + "+"), behavior="removed")
    return _end_of_text(out, tokenizer.eot_id)


ATTNLAB_TOKENIZERS = {
    TiktokenTokenizer: gpt2_tokenizer, ByteTokenizer: byte_tokenizer, CharTokenizer: char_tokenizer,
    WordTokenizer: word_tokenizer,
}  # fmt: skip


def hf_tokenizer(tokenizer: Tokenizer) -> HFTokenizer:
    """A tokenizers Tokenizer that encodes text (without special tokens in it) to `tokenizer`'s ids."""
    if isinstance(tokenizer, (PretrainedTokenizer, BPETokenizer)):
        return HFTokenizer.from_str(tokenizer.tokenizer.to_str())
    for cls, convert in ATTNLAB_TOKENIZERS.items():
        if isinstance(tokenizer, cls):
            return convert(tokenizer)
    raise ConfigError(f"tokenizer {tokenizer.name!r} ({type(tokenizer).__name__}) has no tokenizer.json form")


def write_tokenizer(tokenizer: Tokenizer, folder: str | Path, max_len: int | None = None) -> str:
    """tokenizer.json + tokenizer_config.json that transformers' AutoTokenizer and attnlab's tokenizer_from_folder
    read back to the same ids. Returns what was written (for Exported.tokenizer)."""
    folder = Path(folder)
    if isinstance(tokenizer, PretrainedTokenizer):
        tokenizer.save(folder)
        settings = loads_json((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        what = f"{tokenizer.name} (its tokenizer.json)"
    else:
        atomic_write_text(folder / "tokenizer.json", hf_tokenizer(tokenizer).to_str())
        settings = {"bos_token": None, "eos_token": EOT, "add_bos_token": False}
        what = f"{tokenizer.name} as tokenizer.json"
    # The class that reads tokenizer.json as it is (else transformers picks one by model_type, which may rebuild
    # the pipeline); decoded text as the tokenizer decodes it, spaces before punctuation kept.
    settings.update(tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False)
    if max_len is not None:
        settings["model_max_length"] = max_len
    atomic_write_text(folder / "tokenizer_config.json", json.dumps(settings, indent=1, ensure_ascii=False) + "\n")
    return what


# ----------------------------------------------------------------------------- folders


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.float32/float16/bfloat16, or their names (fp32, fp16, bf16, float32, ...); InputError otherwise."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise InputError(f"dtype={dtype!r} cannot be exported (use fp32, fp16 or bf16)")


def export_hf(
    ref_or_model: str | Path | Transformer,
    out_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    *,
    tokenizer: Tokenizer | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = SHARD_BYTES,
    data_dir: str | Path | None = None,
) -> Exported:
    """Writes the model (a reference load_model reads, or a Transformer) as a Hugging Face folder at out_dir.

    dtype: the weights' dtype in the folder. tokenizer: for a Transformer (a reference brings its own); None
    writes no tokenizer. ConfigError (one line) for a model a Llama config cannot describe, InputError for a
    non-empty out_dir without overwrite."""
    check_flags(overwrite=overwrite)  # ('no' would replace an earlier export)
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise InputError(f"max_shard_bytes={max_shard_bytes!r} must be a whole number of bytes >= 1 (default "
                         f"{SHARD_BYTES:,}: a tensor larger than a shard gets one of its own)")  # fmt: skip
    out_dir, dtype = Path(out_dir), as_dtype(dtype)
    if out_dir.is_symlink() and out_dir.is_dir():  # a link to a folder: the export goes into the folder (probe N, n11)
        out_dir = out_dir.resolve()
    earlier = check_out_dir(out_dir, overwrite)
    if isinstance(ref_or_model, Transformer):
        model = ref_or_model
    else:
        hf_architecture(model_config_of(ref_or_model, data_dir))  # refuse before loading the weights
        source = Path(ref_or_model)
        if overwrite and source.exists() and source.resolve().is_relative_to(out_dir.resolve()):
            raise InputError(f"{out_dir}: holds the model {ref_or_model} itself (export it to another folder)")
        _, model, loaded = load_model(ref_or_model, data_dir=data_dir)
        tokenizer = tokenizer if tokenizer is not None else loaded
    cfg = model.cfg
    arch = hf_architecture(cfg, model)  # refuse before loading anything else or writing anything
    notes = []
    if cfg.rope_interleaved:
        notes.append("interleaved RoPE: q/k rows permuted to the half-split pairing (exact)")
    if cfg.attention.kind == "bottleneck":
        notes.append("bottleneck attention exported as Llama attention with head_dim d_attn / n_heads")
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(f"the tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} ids, more than the model's "
                          f"vocab_size={cfg.vocab_size}: its ids past the embedding could not be read")  # fmt: skip
    tensors = check_range(hf_tensors(model), dtype)  # before writing anything
    tmp = temp_path_beside(out_dir)
    try:
        tmp.mkdir()
        files = write_weights(tensors, tmp, dtype, max_shard_bytes)
        config = hf_config(cfg, dtype, tokenizer)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        files.append("config.json")
        if tokenizer is None:
            what = "none (no tokenizer given: attnlab.load_model needs one, load_hf_folder reads the weights alone)"
        else:
            what = write_tokenizer(tokenizer, tmp, cfg.max_seq_len)
            bos_id, eos_ids = special_ids(tokenizer)
            generation = {"bos_token_id": bos_id, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
            generation = {key: value for key, value in generation.items() if value not in (None, [])}
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
            files += ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
        replace_folder(tmp, out_dir, earlier)
    except OSError as e:  # a file of the temporary folder is named as the file of out_dir it would have become
        if isinstance(e.filename, str) and Path(e.filename).is_relative_to(tmp):
            e.filename = str(out_dir / Path(e.filename).relative_to(tmp))
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return Exported(out_dir, arch, str(dtype).removeprefix("torch."), sorted(files), what, notes)


def export(
    ref: str | Path,
    out_dir: str | Path,
    data_dir: str | Path | None = None,
    dtype: torch.dtype | str = "fp32",
    overwrite: bool = False,
) -> Exported:
    """`attnlab export REF --hf DIR`: the model `ref` names (with its tokenizer) as a Hugging Face folder."""
    return export_hf(ref, out_dir, dtype, overwrite=overwrite, data_dir=data_dir)
