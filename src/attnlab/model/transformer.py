"""The pre-norm decoder-only transformer: the whole forward pass on one screen."""

from __future__ import annotations

import contextlib
import math
import re

import torch
import torch.utils.checkpoint
from torch import nn

from attnlab.attention.registry import REGISTRY
from attnlab.cache.banks import MemoryWrite
from attnlab.cache.base import ModelCache
from attnlab.cache.codecs import KVValueError
from attnlab.config import ModelConfig
from attnlab.errors import InputError, given
from attnlab.model.footprint import device_memory, parameters_memory_problem
from attnlab.ops.mlp import build_mlp
from attnlab.ops.norm import RMSNorm
from attnlab.ops.rope import Rotary


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = REGISTRY[cfg.attention.kind].build(cfg, layer_index)
        bounded = cfg.memory.kind == "bounded"  # its write gate and EMA rate are parameters of the model
        self.memory = MemoryWrite(cfg.d_model, self.attn.layout.heads, cfg.memory) if bounded else None
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = build_mlp(cfg.mlp, cfg.d_model, cfg.hidden_dim)

    def forward(self, x, positions, cache=None):
        h = self.attn_norm(x)
        # The write gates of these tokens (a bounded memory reads them when the tokens leave its window).
        write = self.memory(h) if self.memory is not None and cache is not None else None
        h, cache = self.attn(h, positions, cache, write)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache


def token_problem(tokens, vocab_size: int) -> None:
    """InputError unless `tokens` is a (B, T) tensor of integer ids in [0, vocab_size): ids in the embedding's
    padding rows (vocab_size .. padded_vocab_size - 1) would read rows no token trained, others an index error."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        what = f"a {tokens.dim()}-D {str(tokens.dtype).removeprefix('torch.')} tensor" if isinstance(
            tokens, torch.Tensor) else type(tokens).__name__  # fmt: skip
        raise InputError(f"tokens must be a (batch, length) tensor of integer token ids, got {what}")
    if tokens.numel() and tokens.device.type != "meta":  # (the meta device holds no values: memory accounting)
        low, high = (int(v) for v in torch.aminmax(tokens))
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise InputError(f"token id {bad} is outside the model's vocabulary (0 .. {vocab_size - 1})")


# The dtypes a cache holds its values in (a policy's quantized formats are chosen by the policy, not here)
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def cache_problem(batch, max_len, dtype, device, cfg: ModelConfig) -> None:
    """InputError unless new_cache's arguments make a cache: whole numbers of sequences and tokens >= 1 (max_len at
    most max_seq_len for a model without a memory, which reads no further), a floating dtype, a known device."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InputError(f"batch={batch!r} must be a whole number of sequences >= 1")
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise InputError(f"max_len={max_len!r} must be a whole number of tokens >= 1 (or None: max_seq_len)")
    if max_len is not None and cfg.memory.kind == "none" and max_len > cfg.max_seq_len:
        raise InputError(f"max_len={max_len} is past max_seq_len={cfg.max_seq_len}, the longest sequence this model "
                         f"reads (give at most {cfg.max_seq_len}, or leave max_len out)")  # fmt: skip
    if dtype is not None and dtype not in CACHE_DTYPES:
        raise InputError(f"dtype={dtype!r}: a cache needs a floating dtype (torch.float32, torch.float16, "
                         "torch.bfloat16 or torch.float64), or leave it out (the model's)")  # fmt: skip
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            raise InputError(f"device={device!r} is not a torch device (e.g. 'cpu', 'cuda' or 'cuda:0')") from None


class Transformer(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab_size). The embedding and LM head have padded_vocab_size rows
    (a multiple of 64, for speed); logits are cut back to the true vocab_size so no probability mass
    lands on padding rows."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.positions_covered = cfg.max_seq_len  # RoPE positions every layer's table covers
        self.checkpoint_blocks = False  # train.activation_checkpointing: recompute each block in the backward pass
        self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue  # RMSNorm gains start at 1
            if p.dim() >= 2:
                # GPT-2: residual-output projections scaled by 1/sqrt(2 * n_layers).
                is_residual_out = name.endswith(("attn.out.weight", "mlp.down.weight"))
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layers) if is_residual_out else std)
        for block in self.blocks:  # parameters with an init of their own (e.g. CoDA's rotation angles)
            block.attn.init_parameters()

    def new_cache(self, batch: int, max_len: int | None = None, dtype=None, device=None, policy=None) -> ModelCache:
        """An empty cache for `batch` sequences of up to max_len (default max_seq_len) tokens; with
        cfg.memory a bounded memory per layer, whose size does not depend on the length past its recent window:
        given a max_len below it, the window is cut to max_len slots (the cache then takes max_len tokens at
        most); max_len None reads a stream of any length.

        policy (a KVPolicy or a string such as "k=q8_0,v=q4_0,resid=128") stores the cached fields
        quantized (attnlab.cache.quantized, or a memory's slots in those formats); None keeps them in `dtype`
        (default: the model's)."""
        memory = self.cfg.memory
        if max_len is None and memory.kind == "none":
            max_len = self.cfg.max_seq_len
        cache_problem(batch, max_len, dtype, device, self.cfg)
        dtype = dtype or self.norm.weight.dtype  # not the embedding's: a quantized one holds bytes (model.qlinear)
        device = device or self.norm.weight.device
        layers = [b.attn.new_cache(batch, max_len, dtype, device, policy, memory) for b in self.blocks]
        return ModelCache(layers, batch=batch, made_for=(self.cfg.n_layers, self.cfg.attention, memory))

    def forward(
        self, tokens: torch.Tensor, cache: ModelCache | None = None, use_cache: bool | None = None
    ) -> tuple[torch.Tensor, ModelCache | None]:
        """tokens: (B, T) int64. With a cache, tokens continue the cached sequence.

        use_cache (default: True in eval mode or when a cache is given) makes a new cache when none is
        given and returns it; in training mode nothing is cached and the cache returned is None. With a
        bounded memory (cfg.memory) the sequence always goes through the memory, in blocks, and may run past
        max_seq_len: the memory holds its slots whatever the length, and RoPE's tables grow to the stream.
        """
        if not torch.compiler.is_compiling():
            token_problem(tokens, self.cfg.vocab_size)
            if cache is not None and not isinstance(cache, ModelCache):
                raise InputError(f"cache must be a ModelCache (from model.new_cache or a forward's result), got "
                                 f"{type(cache).__name__}")  # fmt: skip
        batch, length = tokens.shape
        made = cache.made_for if cache is not None else None
        if made is not None and made != (self.cfg.n_layers, self.cfg.attention, self.cfg.memory):
            raise InputError(f"the cache was made by another model ({made[0]} layers, attention {made[1].kind}, "
                             f"memory {made[2].kind}; this one: {self.cfg.n_layers}, {self.cfg.attention.kind}, "
                             f"{self.cfg.memory.kind}, or other options): give one of its own, "
                             f"model.new_cache({batch})")  # fmt: skip
        if cache is not None and cache.batch is not None and cache.batch != batch:
            raise InputError(f"the cache was made for batch {cache.batch} but tokens has batch {batch} (shape "
                             f"{tuple(tokens.shape)}): give a cache made for it, model.new_cache({batch})")  # fmt: skip
        if use_cache is None:
            use_cache = cache is not None or not self.training
        block = self.cfg.memory.block_size if self.cfg.memory.kind != "none" else None
        if block is not None and (cache is None or length > block):
            # A model with a bounded memory reads every sequence through it, `block` tokens at a time (also
            # in training and scoring: it never sees more than its memory holds).
            own = cache is None
            cache = self.new_cache(batch) if own else cache
            logits = torch.cat([self(tokens[:, s : s + block], cache)[0] for s in range(0, length, block)], dim=1)
            return logits, (cache if use_cache or not own else None)
        if use_cache and cache is None:
            cache = self.new_cache(batch)
        start = cache.seen if cache is not None else 0
        if block is not None:  # a memory streams past max_seq_len: RoPE's tables grow to cover it
            if start + length > self.positions_covered:
                self.extend_positions(start + length)
        elif start + length > self.cfg.max_seq_len:
            raise InputError(
                f"sequence of {start + length} tokens exceeds max_seq_len={self.cfg.max_seq_len} "
                "(shorten the input or raise max_seq_len)"
            )
        positions = torch.arange(start, start + length, device=tokens.device)
        logits = self.forward_at(tokens, positions, cache.layers if use_cache else None)
        if use_cache:
            cache.seen = start + length
        return logits, (cache if use_cache else None)

    def extend_positions(self, length: int) -> None:
        """Grows the RoPE tables to cover positions 0..length-1 (streams through a memory), at least doubling them
        each time. Layers whose tables are alike share one grown table (Rotary.extend)."""
        for module in self.modules():
            if isinstance(module, Rotary) and module.max_seq_len < length:
                module.extend(max(length, 2 * module.max_seq_len))
        self.positions_covered = min(m.max_seq_len for m in self.modules() if isinstance(m, Rotary))

    def forward_at(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        layer_caches=None,
        last_only: bool = False,
        run_block=None,
    ) -> torch.Tensor:
        """The forward pass without bookkeeping: tokens (B, T) at absolute positions (T,), one LayerCache
        per block or None -> logits (B, T, vocab_size), or (B, 1, vocab_size) for the last position only
        (all that prefill needs). Reads no Python-side counters, so with a static-mode cache and a positions
        tensor each block is a region `torch.compile` compiles once and reuses for every layer (generate's
        compiled decode step passes it as run_block(block, x, positions, layer_cache) -> x)."""
        x = self.embed(tokens)  # (B, T, d_model)
        for i, block in enumerate(self.blocks):
            cache = None if layer_caches is None else layer_caches[i]
            try:
                if run_block is not None:
                    x = run_block(block, x, positions, cache)
                elif self.checkpoint_blocks and cache is None and torch.is_grad_enabled():
                    x = torch.utils.checkpoint.checkpoint(block, x, positions, None, use_reentrant=False)[0]
                else:
                    x = block(x, positions, cache)[0]
            except KVValueError as e:  # a K or V its cache's format cannot store: say which layer and policy
                raise e.at(i, getattr(cache, "policy", None)) from None
            except RuntimeError as e:  # the same inside a compiled step, where the op's error comes wrapped
                if hasattr(cache, "unstorable") and cache.static and UNSTORABLE.search(str(e)):
                    raise cache.unstorable(i) from None
                raise
        if last_only:
            x = x[:, -1:]  # (B, 1, d_model)
        logits = self.lm_head(self.norm(x))  # (B, T, padded_vocab_size)
        return logits[..., : self.cfg.vocab_size]


# A quantized cache's static op that could not store a K or V value: the Python op's KVValueError, wrapped by a compiled
# graph, or ops.cpp's own words
UNSTORABLE = re.compile(r"KVValueError|KV cache part \w+: a value that is not finite")


def build_model(cfg: ModelConfig, device=None, dtype=None, init: bool = True) -> Transformer:
    """A freshly initialised model (fp32 unless dtype says otherwise). init=False leaves the parameters' values as
    allocated (torch.empty: anything), for a caller that then fills every one of them (a strict load_state_dict, or
    interop.hf.WeightFiller, which refuses a model with a parameter it will not fill): it skips the random init,
    some 10 s for a 135M model on one core."""
    if not isinstance(cfg, ModelConfig):
        raise InputError(f"build_model takes a ModelConfig, got {given(cfg)} (attnlab.load_config(path) reads a YAML "
                         "file, attnlab.model_config_from_dict(data) a dict)")  # fmt: skip
    built = torch.empty(0).device  # where Transformer(cfg) allocates (meta in `with torch.device("meta")`: nothing)
    targets = [(built, torch.get_default_dtype())] if built.type != "meta" else []
    if device is not None and torch.device(device).type == "cuda":  # (moved there once built)
        targets.append((torch.device(device), dtype or torch.get_default_dtype()))
    for target, target_dtype in targets:
        problem = _memory_problem(cfg, target_dtype, target)
        if problem:
            raise InputError(problem)
    if init:
        model = Transformer(cfg)
    else:
        with _init_skipped():
            model = Transformer(cfg)
    return model.to(device=device, dtype=dtype) if (device or dtype) else model


# A model whose parameter_floor is below 1/FAR of the memory fits: its parameters are not counted (parameter_parts'
# build on the meta device imports torch._dynamo the first time, some 3 s). Attention holds about half the MLP's
# parameters in the usual shapes, far from 7 times them.
FAR = 8


def _memory_problem(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why a model of `cfg` cannot be allocated in `dtype` on `device`, or None (parameters_memory_problem)."""
    have, _ = device_memory(device)
    if have is None or parameter_floor(cfg) * dtype.itemsize * FAR < have:
        return None
    return parameters_memory_problem(parameter_parts(cfg), dtype, device)


def parameter_floor(cfg: ModelConfig) -> int:
    """Parameters a model of `cfg` holds at least, counted without building anything: its embedding (and untied LM
    head), each block's MLP and norms, the final norm (not the attention's, which depend on its kind)."""
    mlp = (3 if cfg.mlp == "swiglu" else 2) * cfg.d_model * cfg.hidden_dim
    table = cfg.padded_vocab_size * cfg.d_model
    return table * (1 if cfg.tie_embeddings else 2) + cfg.n_layers * (mlp + 2 * cfg.d_model) + cfg.d_model


def parameter_parts(cfg: ModelConfig) -> dict[str, int]:
    """The parameters of a model of `cfg`, by where they are ("in the embedding": count): one block is built on the
    meta device (nothing allocated, a few ms) and counted n_layers times, as every block holds the same shapes."""
    with torch.device("meta"), _init_skipped():
        block = sum(p.numel() for p in Block(cfg, 0).parameters())
    table = cfg.padded_vocab_size * cfg.d_model
    return {"in the embedding": table, "in the LM head": 0 if cfg.tie_embeddings else table,
            f"in {cfg.n_layers:,} blocks and the final norm": cfg.n_layers * block + cfg.d_model}  # fmt: skip


# torch.nn.init's in-place initialisers (nn.Linear's and nn.Embedding's own, and Transformer.reset_parameters's)
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                 "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_")  # fmt: skip


@contextlib.contextmanager
def _init_skipped():
    """torch.nn.init's initialisers leave their tensor as it is inside the block (as transformers' no_init_weights)."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    try:
        for name in _INITIALISERS:
            setattr(nn.init, name, _left_as_is)
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _left_as_is(tensor, *args, **kwargs):
    return tensor
