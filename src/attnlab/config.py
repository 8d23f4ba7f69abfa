"""Frozen, validated configuration dataclasses and the strict dict -> dataclass parser.

Each attention variant's own config (`MHAConfig`, `DecoupledConfig`, ...) lives next to its maths in
`attnlab/attention/<kind>.py`, so a new variant is one new file plus one registry line; they all derive
from `AttentionConfig` here. Every config is checked when it is built, and every problem is reported at
once in one `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, ClassVar

from attnlab.config_checks import (
    MAX_INT,
    MAX_WIDTH,
    dataclass_kwargs,
    field_problems,
    unknown_key_problem,
    value_problem,
)
from attnlab.config_memory import MEMORY_KINDS, MEMORY_OPTIONS, MEMORY_PRESETS, PRESSES, UNSET, MemoryConfig  # noqa: F401
from attnlab.errors import ConfigError
from attnlab.paths import brief

DTYPE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0}
# Integer fields are bounded far beyond any real model or run, so that an absurd value is one clear error instead
# of an overflow (or a model of a million layers built) deep inside: a model's widths and counts (a class's
# `int_limit`, with exceptions in its `int_limits`), everything else (steps, lengths, token counts).
MAX_SEED = 2**32 - 1  # a seed is 0 .. 2^32 - 1 (what every random generator here accepts)
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
# Data sources: these named datasets, or a local file with one of these suffixes; a .txt or .jsonl file may also be
# compressed (.txt.xz, .jsonl.gz: attnlab.data.files.open_text); a parquet file is read as it is (it compresses inside).
DATA_SOURCES = ("wikitext2", "wikitext2-raw", "wikitext2-nounk", "tinyshakespeare", "fineweb-edu")
DATA_FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
COMPRESSIONS = (".xz", ".gz")
COMPRESSIBLE_SUFFIXES = (".txt", ".jsonl")


def file_kind_problem(name: str) -> str | None:
    """Why a file named `name` is not of a kind the data readers take, in words, or None."""
    path = PurePath(name)
    if path.suffix in DATA_FILE_SUFFIXES:
        return None
    if path.suffix not in COMPRESSIONS:
        return "not a .txt, .jsonl or .parquet file (a .txt or .jsonl file may be compressed too: .txt.xz, .jsonl.gz)"
    inner = PurePath(path.stem).suffix
    if inner in COMPRESSIBLE_SUFFIXES:
        return None
    if inner == ".parquet":
        return f"a parquet file compressed with {path.suffix}: give it uncompressed (parquet compresses inside)"
    ends = f"ends in {inner}" if inner else "has no suffix"
    wikitext = " (WikiText-2's files: data.source wikitext2 or wikitext2-raw)" if inner in (".tokens", ".raw") else ""
    return (f"a {path.suffix} compressed file whose name before {path.suffix} {ends}: only a compressed .txt or .jsonl "
            f"file is read (plain text: name it NAME.txt{path.suffix}){wikitext}")  # fmt: skip


def source_problem(source: str, key: str) -> str | None:
    """Why `source` (the value of `key`: data.source, a calibration text) names neither a known dataset nor a file
    of a kind the data readers take, or None. Whether such a file exists is checked where the data directory is
    known (attnlab.runner.local_source_problems)."""
    problem = None if source in DATA_SOURCES else file_kind_problem(source)
    if problem is None:
        return None
    return f"{key}={brief(source, 300)} is not a known dataset ({', '.join(DATA_SOURCES)}), and as a file: {problem}"


def fraction_problems(val_fraction, test_fraction, prefix: str = "") -> list[str]:
    """Why the split fractions of a source without splits of its own cannot be used (DataConfig's and open_source's
    check): each a number in [0, 1) (NaN is none), their sum < 1."""
    problems = []
    for key, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{prefix}{key}={value!r} must be a number in [0, 1)")
        elif not 0.0 <= value < 1.0:
            problems.append(f"{prefix}{key}={value} must be in [0, 1)")
    if not problems and val_fraction + test_fraction >= 1.0:
        problems.append(f"{prefix}val_fraction + {prefix}test_fraction = {val_fraction + test_fraction} must be < 1 "
                        "(leave documents for training)")  # fmt: skip
    return problems


def dtype_bytes(dtype: str) -> float:
    """Bytes per stored element for a dtype name (quantized formats register here later)."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype={dtype!r} is not known (use one of {', '.join(DTYPE_BYTES)})")
    return DTYPE_BYTES[dtype]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def head_counts(width: int) -> str:
    """The head counts that split `width` channels into heads of an even width (RoPE rotates pairs), in words:
    "1, 2, 4, 8, 16 or 32"."""
    counts = [str(d) for d in divisors(width) if (width // d) % 2 == 0]
    return ", ".join(counts[:-1]) + " or " + counts[-1] if len(counts) > 1 else "".join(counts) or "none"


def check_head_split(model: ModelConfig, head_dim: int | None) -> list[str]:
    """Problems with `attention.head_dim`: below 1 (0 is no width, not "unset": leave the key out for that), or
    derived as d_model / n_heads (head_dim None) when n_heads does not divide d_model."""
    if head_dim is not None and head_dim < 1:
        return [f"attention.head_dim={head_dim} must be >= 1 (or leave it out: d_model / n_heads)"]
    if head_dim is None and model.d_model % model.n_heads:
        return [f"d_model={model.d_model} must be divisible by n_heads={model.n_heads} (or set attention.head_dim)"]
    return []


def check_kv_heads(n_kv_heads: int | None, n_heads: int) -> list[str]:
    """Problems with `attention.n_kv_heads` (None means n_heads)."""
    if n_kv_heads is None:
        return []
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        options = ", ".join(str(d) for d in divisors(n_heads))
        return [f"attention.n_kv_heads={n_kv_heads} must divide n_heads={n_heads} (use {options})"]
    return []


@dataclass(frozen=True)
class AttentionConfig:
    """Base of every variant's config. `kind` is the registry key; subclasses add their options.

    Each subclass registers itself under its kind in `AttentionConfig.kinds` (the registry in
    attnlab.attention.registry maps kinds to modules and parses configs; this only lets ModelConfig default
    to `mha` without importing the attention package)."""

    kind: ClassVar[str] = ""
    kinds: ClassVar[dict[str, type]] = {}
    int_limit: ClassVar[int] = MAX_WIDTH

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            AttentionConfig.kinds.setdefault(cls.kind, cls)

    def __post_init__(self) -> None:
        # Types, finite floats and bounded integers first: `problems(model)` does arithmetic on the values.
        problems = field_problems(self, "attention.")
        if problems:
            raise ConfigError(problems)

    def problems(self, model: ModelConfig) -> list[str]:
        """Everything wrong with this config inside `model` (empty when valid)."""
        return []

    def cache_layout(self, model: ModelConfig):
        """The variant's attnlab.cache.layout.CacheLayout in `model`: what a token leaves in the cache, declared
        once (accounting, every cache kind and the KV-policy names derive from it)."""
        raise NotImplementedError(f"attention kind {self.kind!r} declares no cache layout")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}


# The options each RoPE scaling type reads (besides type): all required, another type's refused. Factors are
# bounded far beyond any real model, so that no frequency over- or underflows in float32.
ROPE_SCALING_OPTIONS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "freq_factors": ("freq_factors",),
}
UNSUPPORTED_ROPE_TYPES = ("dynamic", "yarn", "longrope")  # transformers' others (they change with the length)
ROPE_FACTOR_RANGE = (1e-6, 1e6)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (attnlab.ops.rope.scaled_frequencies): pair i's inverse frequency base^(-2i/d) is

    linear (position interpolation): divided by `factor` (positions read as position / factor);
    llama3 (Llama 3.1): kept where its wavelength 2 pi / freq < original_max_position_embeddings /
      high_freq_factor, divided by `factor` where it is > original_max_position_embeddings / low_freq_factor,
      interpolated smoothly between (transformers' _compute_llama3_parameters, to the bit);
    freq_factors: divided by freq_factors[i], one per rotated pair (llama.cpp's rope_freqs.weight in GGUF files).
    """

    type: str
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    freq_factors: tuple[float, ...] | None = None  # a list in YAML and JSON
    int_limit: ClassVar[int] = MAX_INT

    def __post_init__(self) -> None:
        if isinstance(self.freq_factors, list):  # as YAML and JSON give it; a tuple keeps the config hashable
            object.__setattr__(self, "freq_factors", tuple(self.freq_factors))
        problems, factors = field_problems(self, "rope_scaling."), self.freq_factors
        if factors is not None and not isinstance(factors, tuple):
            problems.append(f"rope_scaling.freq_factors={brief(factors)} must be a list of numbers")
        elif factors:  # the first bad one
            found = (value_problem(v, float, f"rope_scaling.freq_factors[{i}]") for i, v in enumerate(factors))
            problems += [p for p in found if p][:1]
        if problems:
            raise ConfigError(problems)
        if factors:
            object.__setattr__(self, "freq_factors", tuple(float(v) for v in factors))
        if self.type not in ROPE_SCALING_OPTIONS:
            known = ", ".join(ROPE_SCALING_OPTIONS)
            raise ConfigError(
                f"rope_scaling.type={self.type!r} is not supported (use {known})"
                if self.type in UNSUPPORTED_ROPE_TYPES
                else unknown_key_problem(self.type, list(ROPE_SCALING_OPTIONS), "rope_scaling.type=", "value")
            )
        options = ROPE_SCALING_OPTIONS[self.type]
        missing = [key for key in options if getattr(self, key) is None]
        if missing:
            problems.append(f"rope_scaling.type {self.type} needs {', '.join(missing)} (missing)")
        for key in [f.name for f in dataclasses.fields(self) if f.name != "type" and f.name not in options]:
            if getattr(self, key) is not None:
                owners = " or ".join(t for t, names in ROPE_SCALING_OPTIONS.items() if key in names)
                problems.append(
                    f"rope_scaling.{key} belongs to rope_scaling.type {owners}, not {self.type} (remove it)"
                )
        low, high = ROPE_FACTOR_RANGE
        values = {key: getattr(self, key) for key in ("factor", "low_freq_factor", "high_freq_factor")}
        outside = [i for i, v in enumerate(self.freq_factors or ()) if not low <= v <= high][:1]  # the first one
        values.update({f"freq_factors[{i}]": self.freq_factors[i] for i in outside})
        for key, value in values.items():
            if value is not None and not low <= value <= high:
                problems.append(f"rope_scaling.{key}={value} must be in [{low:g}, {high:g}]")
        if self.original_max_position_embeddings is not None and self.original_max_position_embeddings < 1:
            problems.append(f"rope_scaling.original_max_position_embeddings={self.original_max_position_embeddings} "
                            "must be >= 1")  # fmt: skip
        if self.freq_factors == ():
            problems.append("rope_scaling.freq_factors is empty (one factor per rotated channel pair)")
        if self.type == "llama3" and not problems and not self.high_freq_factor > self.low_freq_factor:
            problems.append(f"rope_scaling.high_freq_factor={self.high_freq_factor} must be > low_freq_factor="
                            f"{self.low_freq_factor} (Llama 3.1 uses 4 and 1)")  # fmt: skip
        if problems:
            raise ConfigError(problems)

    def to_dict(self) -> dict[str, Any]:
        """The type and its options (the other types' options, all None, left out)."""
        out = {"type": self.type, **{key: getattr(self, key) for key in ROPE_SCALING_OPTIONS[self.type]}}
        return {**out, "freq_factors": list(self.freq_factors)} if self.freq_factors is not None else out


@dataclass(frozen=True)
class ModelConfig:
    """A pre-norm decoder-only transformer. Validated at construction."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    max_seq_len: int = 1024
    attention: AttentionConfig = field(default_factory=lambda: _default_attention())
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    mlp: str = "swiglu"
    d_ff: int | None = None
    tie_embeddings: bool = True
    rope_base: float = 10000.0
    rope_interleaved: bool = False
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    norm_eps: float = 1e-5
    vocab_multiple: int = 64
    init_std: float = 0.02
    name: str = ""
    int_limit: ClassVar[int] = MAX_WIDTH
    int_limits: ClassVar[dict[str, int]] = {"max_seq_len": MAX_INT, "n_layers": 4096, "n_heads": 2**16}

    def __post_init__(self) -> None:
        problems = field_problems(self, "")
        if problems:
            raise ConfigError(problems)
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "vocab_multiple"):
            if getattr(self, key) < 1:
                problems.append(f"{key}={getattr(self, key)} must be >= 1")
        if self.mlp not in ("swiglu", "gelu"):
            problems.append(f"mlp={self.mlp!r} is not known (use 'swiglu' or 'gelu')")
        if self.d_ff is not None and self.d_ff < 1:
            problems.append(f"d_ff={self.d_ff} must be >= 1 (or leave it out: the MLP's default width)")
        if self.rope_base <= 1:  # theta_i = base^(-2i/d): base 1 rotates every pair alike, below 1 the ladder inverts
            problems.append(f"rope_base={self.rope_base} must be > 1 (10000 is usual; Llama 3 uses 500000)")
        if not 0 < self.norm_eps < 1:
            problems.append(f"norm_eps={self.norm_eps} must be > 0 and < 1 (1e-5 or 1e-6 are usual)")
        if self.init_std <= 0:
            problems.append(f"init_std={self.init_std} must be > 0 (0.02 is usual)")
        if not problems:
            problems += self.attention.problems(self)
        layout = None if problems else self.attention.cache_layout(self)
        window = None if layout is None else layout.window
        if self.rope_scaling is not None and layout is not None:
            problems += rope_scaling_problems(self.rope_scaling, layout, self.attention.kind)
        if self.memory.positions == "cache" and layout is not None and layout.null_key:
            problems.append(
                f"memory.positions='cache' re-rotates the held keys to their ranks, but attention.kind="
                f"{self.attention.kind!r} prepends a learned null key that carries no RoPE, whose score would still "
                "follow each query's stream position (use memory.positions: absolute, or null_attn: false)"
            )
        if self.memory.kind != "none" and window is not None:
            problems.append(
                f"memory.kind={self.memory.kind!r} has no meaning with attention.kind={self.attention.kind!r}: its "
                f"own window of {window} tokens hides every slot a memory keeps beyond it (use attention.kind mha "
                f"with memory.kind window, recent_window {window}, for the same attention; or memory.kind: none)"
            )
        if problems:
            raise ConfigError(problems)

    # Derived values.
    @property
    def padded_vocab_size(self) -> int:
        """Embedding/LM-head rows: vocab_size rounded up to vocab_multiple (faster matmuls)."""
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def hidden_dim(self) -> int:
        """MLP hidden width: d_ff, or Llama's 8/3 d_model (SwiGLU) / 4 d_model (GELU)."""
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "swiglu":
            return (int(8 * self.d_model / 3) + 63) // 64 * 64
        return 4 * self.d_model

    @property
    def kind(self) -> str:
        return self.attention.kind

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["attention"] = self.attention.to_dict()
        if self.memory.kind == "none":
            del out["memory"]  # the default: configs (and their hashes) read as before memories existed
        else:
            out["memory"] = self.memory.to_dict()
        if self.rope_scaling is None:
            del out["rope_scaling"]  # the default: configs (and their hashes) read as before scaled RoPE
        else:
            out["rope_scaling"] = self.rope_scaling.to_dict()
        return out

    def config_hash(self) -> str:
        """Short stable hash of the resolved config, for records."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def rope_scaling_problems(scaling: RopeScaling, layout, kind: str) -> list[str]:
    """Problems with `rope_scaling` in a model whose attention declares cache layout `layout`: the variant must
    rotate with it (its layout says so: the kinds built on attnlab.attention.mha.HeadAttention do), and
    freq_factors must give one factor per pair of each rotated field."""
    if layout.rope_scaling != scaling:
        return [
            f"rope_scaling is not applied by attention.kind={kind!r} (its RoPE is unscaled): use attention.kind "
            "mha, sliding, bottleneck, decoupled or mla, or remove rope_scaling"
        ]
    widths = sorted({f.width for f in layout.fields if f.rope})
    if scaling.freq_factors is not None and any(len(scaling.freq_factors) != w // 2 for w in widths):
        return [
            f"rope_scaling.freq_factors has {len(scaling.freq_factors)} factors, the rotated width "
            f"{' and '.join(map(str, widths))} has {' and '.join(str(w // 2) for w in widths)} channel pairs"
        ]
    return []


def _default_attention() -> AttentionConfig:
    if "mha" not in AttentionConfig.kinds:  # importing attnlab imports every variant: only a broken install
        raise ConfigError("attention.kind mha is not registered (import attnlab.attention.registry first)")
    return AttentionConfig.kinds["mha"]()


# ----------------------------------------------------------------------------- data and training


def names_model(tokenizer: str) -> bool:
    """Whether a data.tokenizer value names a model whose tokenizer is used (a pretrained model's): a .gguf file,
    a path with a folder separator, or hf:ORG/NAME, rather than one of the built-in kinds."""
    return tokenizer.startswith("hf:") or tokenizer.lower().endswith(".gguf") or "/" in tokenizer or "\\" in tokenizer


@dataclass(frozen=True)
class DataConfig:
    """Which text, tokenized how. Sources: wikitext2 (tokenized v1 files), wikitext2-raw, tinyshakespeare,
    fineweb-edu, or a path to a local .txt / .jsonl (a `text` field per line) / .parquet file."""

    source: str = "wikitext2"
    tokenizer: str = "gpt2"  # gpt2 | bpe:<vocab size> | word | byte | char
    val_fraction: float = 0.05  # for sources without their own splits: share of documents, by hash
    test_fraction: float = 0.0
    max_tokens: int | None = None  # cap on the training split's tokens (the budget for streamed fineweb-edu)
    int_limits: ClassVar[dict[str, int]] = {"max_tokens": 2**53}

    def __post_init__(self) -> None:
        problems = field_problems(self, "data.")
        if problems:
            raise ConfigError(problems)
        problems += fraction_problems(self.val_fraction, self.test_fraction, "data.")
        problem = source_problem(self.source, "data.source")
        if problem:
            problems.append(problem)
        problem = tokenizer_name_problem(self.tokenizer, "data.tokenizer")
        if problem:
            problems.append(problem)
        if self.max_tokens is not None and self.max_tokens < 1:
            problems.append(f"data.max_tokens={self.max_tokens} must be >= 1 (or leave it out: no cap)")
        if problems:
            raise ConfigError(problems)


def tokenizer_name_problem(name: str, what: str = "tokenizer") -> str | None:
    """Why `name` is not a tokenizer (gpt2, bpe:<N> with 257 <= N <= MAX_WIDTH, word, byte, char, or a model
    reference: names_model), or None. A BPE of far more ids would abort the process in the trainer, out of memory."""
    bpe = name.startswith("bpe:") and name[4:].isascii() and name[4:].isdigit()
    if name not in ("gpt2", "word", "byte", "char") and not bpe and not names_model(name):
        return (f"{what}={name!r} is not known (use gpt2, bpe:<vocab size>, word, byte, char, or a model reference: a "
                ".gguf file, a model folder path with a /, or hf:ORG/NAME)")  # fmt: skip
    if bpe and not 257 <= int(name[4:]) <= MAX_WIDTH:
        return f"{what}={name!r}: a byte-level BPE needs 257 to {MAX_WIDTH:,} ids (256 bytes + end-of-text)"
    return None


def trainable_string_problem(value: str) -> str:
    """train.trainable given as one string (YAML `trainable: blocks.*`, `--set train.trainable=blocks.*`)."""
    return f"train.trainable must be a list of name patterns, got the string {value!r} (write [{json.dumps(value)}])"


INFERENCE_MEMORIES = ("quest", *PRESSES)  # memory kinds that only choose, at inference, which held tokens are read


def untrainable_memory_problem(kind: Any) -> str | None:
    """Why a model whose memory is `kind` cannot be trained, or None: quest and the presses hold every token (or
    the best ones) and choose which a query reads; they have no parameters, and backpropagating through their
    in-place cache edits fails deep in autograd. They are applied to a trained model instead (attnlab convert)."""
    if kind not in INFERENCE_MEMORIES:
        return None
    return (f"model.memory.kind={kind} chooses at inference which held tokens attention reads: it has nothing to "
            f"train (train without it, then apply it to the trained model: attnlab convert RUN --memory "
            f"kind={kind},... --out FOLDER)")  # fmt: skip


def checkpointing_memory_problem(checkpointing: bool, kind: Any) -> str | None:
    """Why train.activation_checkpointing cannot go with a model's memory, or None."""
    if not checkpointing or kind in (None, "none"):
        return None
    return (f"train.activation_checkpointing=true: model.memory kind {kind!r} writes its memory as each block runs, "
            "which recomputing a block would repeat (turn one off)")  # fmt: skip


def idle_memory_problem(seq_len: int, memory: MemoryConfig | dict | None) -> str | None:
    """Why training on sequences of seq_len tokens would never make the memory act, or None: every sequence fits
    in what it holds before a token leaves (a bounded memory's recent window, whose leavers go to its banks; the
    slots of a window, streaming or h2o memory), so the run would train plain attention under the memory's name."""
    if isinstance(memory, dict):
        try:
            memory = MemoryConfig(**memory)
        except (ConfigError, TypeError):  # (said by the config's own check)
            return None
    if not isinstance(memory, MemoryConfig) or memory.kind not in ("bounded", "window", "streaming", "h2o"):
        return None
    held = memory.recent_window if memory.kind in ("bounded", "window") else memory.slots
    if seq_len > held:
        return None
    what = "memory.recent_window" if memory.kind in ("bounded", "window") else f"the {memory.kind} memory's slots"
    return (f"train.seq_len={seq_len} fits in {what} ({held}): no token would leave it in training, so the memory "
            f"would never act and the run would train plain attention (give train.seq_len above {held}, or a "
            "smaller memory)")  # fmt: skip


@dataclass(frozen=True)
class TrainConfig:
    """How to train. Steps count optimizer updates; one update sees batch_size * grad_accum sequences."""

    seq_len: int = 256
    batch_size: int = 16
    grad_accum: int = 1
    steps: int = 1000
    optimizer: str = "adamw"  # adamw | lion
    lr: float = 1e-3
    schedule: str = "cosine"  # constant | linear | cosine
    warmup_steps: int = 100  # linear warm-up to lr; a run of fewer steps never reaches lr (given > steps: refused)
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1  # never applied to norms, biases or embeddings
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    eval_every: int = 200
    eval_tokens: int = 65536
    test_tokens: int | None = None  # the final test score's budget (the first windows of the split); None: all of it
    log_every: int = 10
    checkpoint_every: int = 200
    seed: int = 0
    precision: str = "auto"  # auto (bf16 autocast where the device is fast at it, else fp32) | fp32 | bf16
    compile: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    trainable: tuple[str, ...] | None = None  # parameter-name patterns (fnmatch) to train; the rest is frozen
    # How several processes (torchrun) share the work: ddp (a whole copy of the model, its gradients and optimizer
    # state in each) or fsdp (FSDP2: each process holds 1/N of them, gathered a block at a time).
    distributed: str = "ddp"
    activation_checkpointing: bool = False  # recompute each block's activations in the backward pass
    cpu_offload: bool = False  # fsdp: parameters, gradients and optimizer state in host memory; the step runs there
    int_limits: ClassVar[dict[str, int]] = {"seed": MAX_SEED}

    def __post_init__(self) -> None:
        if isinstance(self.trainable, list):  # as YAML and JSON give it; a tuple keeps the config hashable
            object.__setattr__(self, "trainable", tuple(self.trainable))
        if isinstance(self.trainable, str):
            raise ConfigError(trainable_string_problem(self.trainable))
        problems = field_problems(self, "train.")
        if problems:
            raise ConfigError(problems)
        if self.trainable is not None and (
            not isinstance(self.trainable, tuple)
            or not self.trainable
            or not all(isinstance(p, str) and p.strip() for p in self.trainable)
        ):
            shown = list(self.trainable) if isinstance(self.trainable, tuple) else self.trainable
            raise ConfigError(f"train.trainable={brief(shown)} must be a non-empty list of parameter "
                              "name patterns, e.g. ['blocks.*.attn.*'] (or leave it out)")  # fmt: skip
        for key in ("seq_len", "batch_size", "grad_accum", "steps", "eval_every", "log_every", "checkpoint_every",
                    "eval_tokens"):  # fmt: skip
            if getattr(self, key) < 1:
                problems.append(f"train.{key}={getattr(self, key)} must be >= 1")
        if 1 <= self.eval_tokens < self.seq_len:
            problems.append(f"train.eval_tokens={self.eval_tokens} is less than train.seq_len={self.seq_len}: "
                            "evaluation scores whole windows of seq_len tokens (use eval_tokens >= "
                            f"{self.seq_len})")  # fmt: skip
        if self.test_tokens is not None and self.test_tokens < self.seq_len:
            problems.append(f"train.test_tokens={self.test_tokens} is less than train.seq_len={self.seq_len}: the "
                            f"final test scores whole windows of seq_len tokens (use test_tokens >= {self.seq_len}, "
                            "or leave it out to score the whole split)")  # fmt: skip
        for key in ("warmup_steps", "seed"):
            if getattr(self, key) < 0:
                problems.append(f"train.{key}={getattr(self, key)} must be >= 0")
        if self.optimizer not in ("adamw", "lion"):
            problems.append(f"train.optimizer={self.optimizer!r} is not known (use adamw or lion)")
        if self.schedule not in ("constant", "linear", "cosine"):
            problems.append(f"train.schedule={self.schedule!r} is not known (use constant, linear or cosine)")
        if self.distributed not in ("ddp", "fsdp"):
            problems.append(f"train.distributed={brief(self.distributed)} is not known (use ddp or fsdp)")
        elif self.cpu_offload and self.distributed != "fsdp":
            problems.append("train.cpu_offload=true needs train.distributed: fsdp (it offloads FSDP's shards)")
        if self.precision not in ("auto", "fp32", "bf16"):
            problems.append(f"train.precision={self.precision!r} is not known (use auto, fp32 or bf16)")
        if not re.fullmatch(r"auto|cpu|mps|cuda(:[0-9]+)?", self.device):
            problems.append(f"train.device={brief(self.device)} is not known (use auto, cpu, cuda, cuda:N or mps)")
        for key in ("lr", "eps"):
            if getattr(self, key) <= 0:
                problems.append(f"train.{key}={getattr(self, key)} must be > 0")
        if 0 < self.eps < FLOAT32_TINY:  # the optimizer's state is float32: a smaller eps is 0 there
            problems.append(f"train.eps={self.eps} is 0 in float32 (below {FLOAT32_TINY:.1e}): Adam would divide by "
                            "zero (1e-8 is usual)")  # fmt: skip
        elif self.eps >= 1:
            problems.append(f"train.eps={self.eps} must be below 1: it would swamp every update (1e-8 is usual)")
        if self.lr > 0 and self.weight_decay > 0 and self.lr * self.weight_decay >= 1:
            problems.append(f"train.lr={self.lr} x train.weight_decay={self.weight_decay} must be below 1: each "
                            "step multiplies the weights by 1 - lr x weight_decay (0.1 is usual)")  # fmt: skip
        if self.weight_decay < 0:
            problems.append(f"train.weight_decay={self.weight_decay} must be >= 0 (0 = no decay)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            problems.append(f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                problems.append(f"train.{key}={getattr(self, key)} must be in [0, 1)")
        if self.grad_clip is not None and self.grad_clip <= 0:
            problems.append(f"train.grad_clip={self.grad_clip} must be > 0 (or null for no clipping)")
        if problems:
            raise ConfigError(problems)


def section_from_dict(cls: type, data: Any, where: str, source: str | None = None):
    """A validated DataConfig / TrainConfig from plain data; every problem in one ConfigError."""
    problems: list[str] = []
    kwargs = dataclass_kwargs(cls, data if data is not None else {}, where, problems)
    if problems:
        raise ConfigError(problems, source=source)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise (e.with_source(source) if source else e) from None
