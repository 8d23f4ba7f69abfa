"""Converting a model's attention to another variant of the zoo, initialised from its weights (`attnlab convert`).

    conversion = convert_model(cfg, model, {"kind": "mha", "n_kv_heads": 1})       # MQA by mean-pooling
    conversion = convert_model(cfg, model, {"kind": "coda", "gate_bias": -20})      # CoDA, gated off
    conversion = convert_model(cfg, model, memory={"kind": "streaming", "recent_window": 252})

The source is a per-head softmax attention (mha or sliding, as every pretrained model attnlab loads is). Every
weight outside the attention is copied; inside it:

- mha / sliding with other KV heads: query and output projections copied, key and value heads mean-pooled over
  each group of source KV heads that the new head replaces (Ainslie et al. 2023, GQA's uptraining init), or
  repeated when the new model has more KV heads (exact). With the same KV heads the model is the source.
- coda: q, k, v and output copied (its signal stream is the source's attention), the rotation angles at pi/2,
  the gate's weights at zero and its bias at `gate_bias`, so lambda = sigmoid(gate_bias) for every token: the
  paper's near-transparent start at -6 (lambda 0.0025), gated off at -20 (2e-9). The head norm defaults to off
  here (the paper's "identity" mode, which its Mistral retrofit used): with it on the layer is not the source.
- diff: per head, the first halves of q and k are the source's q and k and the second halves zero, so head_dim
  is twice the source's (q1 . k1 / sqrt(head_dim / 2) is the source's score); v is the source's padded with
  zeros; lambda is made exactly 0 (lambda_q1 = lambda_k1 = 0, lambda_q2 . lambda_k2 = ln(1 + lambda_init)); the
  output projection takes 1 / (1 - lambda_init) to undo eq. 3's scale; the head norm defaults to off. The
  cache then holds twice the source's bytes per token (k1, k2 of head_dim / 2 and v of head_dim).
- any of them with a memory (`memory=`): the memory's own parameters (the bounded memory's write gate) start
  as a freshly built model's; nothing else does.

`Conversion.fresh` names every parameter not taken from the source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnlab.config import ModelConfig
from attnlab.config_io import model_config_from_dict
from attnlab.errors import ConfigError
from attnlab.model.transformer import Transformer, build_model
from attnlab.train.checkpoint import save_model_folder

SOURCE_KINDS = ("mha", "sliding")
TARGET_KINDS = ("mha", "sliding", "coda", "diff")
DEFAULTS = {"coda": {"head_norm": False}, "diff": {"head_norm": False}}  # transparent unless asked otherwise


@dataclass
class Conversion:
    cfg: ModelConfig
    model: Transformer  # eval mode
    source: ModelConfig
    fresh: list[str] = field(default_factory=list)  # parameters not taken from the source (their init as built)
    notes: list[str] = field(default_factory=list)  # what was pooled, padded or changed


def target_config(source: ModelConfig, attention: dict | None, memory: dict | None) -> ModelConfig:
    """The source's config with `attention` (a kind and its options; unset options keep the source's head count,
    KV heads and head_dim where the kind has them) and `memory` in place."""
    if source.attention.kind not in SOURCE_KINDS:
        raise ConfigError(f"convert: the source's attention is {source.attention.kind}; a conversion starts from "
                          f"{' or '.join(SOURCE_KINDS)} (a pretrained model's)")  # fmt: skip
    attention = dict(attention or {})
    kind = attention.get("kind", source.attention.kind)
    if kind not in TARGET_KINDS:
        raise ConfigError(f"convert: attention.kind={kind!r} cannot be converted to yet (use one of "
                          f"{', '.join(TARGET_KINDS)})")  # fmt: skip
    data = source.to_dict()
    old = data["attention"]
    head_dim = source.attention.dim(source)
    inherited = {
        "n_kv_heads": old.get("n_kv_heads"),
        "head_dim": old.get("head_dim") if kind != "diff" else 2 * head_dim,
    }
    if kind in ("mha", "sliding") and old.get("qkv_bias"):
        inherited["qkv_bias"] = True
    if kind == "sliding" and "window" in old:
        inherited["window"] = old["window"]
    new = {"kind": kind, **inherited, **DEFAULTS.get(kind, {}), **attention}
    data["attention"] = {k: v for k, v in new.items() if v is not None}
    if memory is not None:
        data["memory"] = dict(memory)
    cfg = model_config_from_dict(data, source="convert")
    want = 2 * head_dim if kind == "diff" else head_dim
    if cfg.attention.dim(cfg) != want:
        raise ConfigError(f"convert: attention.head_dim={cfg.attention.dim(cfg)} cannot be initialised from the "
                          f"source's head_dim {head_dim} (a {kind} conversion keeps head_dim={want})")  # fmt: skip
    n_src, n_new = source.attention.kv_heads(source), cfg.attention.kv_heads(cfg)
    if n_src % n_new and n_new % n_src:
        raise ConfigError(f"convert: attention.n_kv_heads={n_new} cannot be pooled from the source's {n_src} KV heads "
                          f"(use a divisor or a multiple of {n_src})")  # fmt: skip
    if getattr(source.attention, "qkv_bias", False) and not getattr(cfg.attention, "qkv_bias", False):
        raise ConfigError(f"convert: the source has q/k/v biases and attention.kind {kind} has none (use mha or "
                          "sliding with qkv_bias: true)")  # fmt: skip
    return cfg


def pool_heads(weight: torch.Tensor, n_src: int, n_new: int) -> torch.Tensor:
    """Rows of n_src heads (n_src * D, ...) -> n_new heads: the mean of each group of n_src / n_new consecutive
    heads, or each head repeated n_new / n_src times."""
    heads = weight.unflatten(0, (n_src, -1))  # (n_src, D, ...)
    if n_new <= n_src:
        return heads.unflatten(0, (n_new, n_src // n_new)).mean(dim=1).flatten(0, 1)
    return heads.repeat_interleave(n_new // n_src, dim=0).flatten(0, 1)


def _qkv(attn, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """The source layer's q, k, v rows (weight, and bias or None each)."""
    h, hk, d = cfg.n_heads, cfg.attention.kv_heads(cfg), cfg.attention.dim(cfg)
    weights = attn.qkv.weight.detach().split((h * d, hk * d, hk * d), dim=0)
    bias = attn.qkv.bias
    biases = bias.detach().split((h * d, hk * d, hk * d)) if bias is not None else (None, None, None)
    return weights, biases


@torch.no_grad()
def convert_layer(src, dst, source: ModelConfig, cfg: ModelConfig) -> None:
    """Initialises layer `dst` (the target's attention) from `src` (a HeadAttention of the source)."""
    (q, k, v), (qb, kb, vb) = _qkv(src, source)
    n_src, n_new = source.attention.kv_heads(source), cfg.attention.kv_heads(cfg)
    k, v = pool_heads(k, n_src, n_new), pool_heads(v, n_src, n_new)
    kind, h, d = cfg.attention.kind, cfg.n_heads, source.attention.dim(source)
    if kind == "diff":
        pad = torch.zeros_like  # per head: [source rows | zero rows]
        q, k, v = (torch.cat((x.unflatten(0, (-1, d)), pad(x.unflatten(0, (-1, d)))), dim=1).flatten(0, 1)
                   for x in (q, k, v))  # fmt: skip
        out = src.out.weight.detach().unflatten(1, (h, d)) / (1 - dst.lambda_init)
        dst.out.weight.copy_(torch.cat((out, torch.zeros_like(out)), dim=2).flatten(1, 2))
        dst.lambda_q1.zero_(), dst.lambda_k1.zero_()
        dst.lambda_q2.fill_(math.sqrt(math.log1p(dst.lambda_init) / dst.half))  # lambda_q2 . lambda_k2 = ln(1 + init)
        dst.lambda_k2.copy_(dst.lambda_q2)
    else:
        dst.out.weight.copy_(src.out.weight)
    dst.qkv.weight.copy_(torch.cat((q, k, v)))
    if qb is not None:
        dst.qkv.bias.copy_(torch.cat((qb, pool_heads(kb, n_src, n_new), pool_heads(vb, n_src, n_new))))
    if kind == "coda":
        dst.gate.weight.zero_()  # lambda = sigmoid(gate_bias) for every token (init_parameters set the bias)


def convert_model(cfg: ModelConfig, model: Transformer, attention: dict | None = None,
                  memory: dict | None = None) -> Conversion:  # fmt: skip
    """`model` (config `cfg`) with another attention and/or memory, initialised from its weights (module
    docstring). ConfigError (one line each) for a target the source cannot initialise."""
    new_cfg = target_config(cfg, attention, memory)
    new = build_model(new_cfg, device=next(model.parameters()).device, dtype=next(model.parameters()).dtype)
    source_state = model.state_dict()
    taken = set()
    with torch.no_grad():
        for name, tensor in new.state_dict().items():
            if ".attn." in name or name not in source_state:
                continue
            if source_state[name].shape != tensor.shape:
                raise ConfigError(f"convert: {name} has shape {tuple(source_state[name].shape)} in the source and "
                                  f"{tuple(tensor.shape)} in the target")  # fmt: skip
            tensor.copy_(source_state[name])
            taken.add(name)
        for src_block, dst_block in zip(model.blocks, new.blocks, strict=True):
            convert_layer(src_block.attn, dst_block.attn, cfg, new_cfg)
    for i in range(new_cfg.n_layers):
        taken |= {f"blocks.{i}.attn.{name}" for name in ("qkv.weight", "qkv.bias", "out.weight")}
        if new_cfg.attention.kind == "diff":
            taken |= {f"blocks.{i}.attn.lambda_{n}" for n in ("q1", "k1", "q2", "k2")}
    fresh = [name for name, _ in new.named_parameters() if name not in taken]
    notes = []
    n_src, n_new = cfg.attention.kv_heads(cfg), new_cfg.attention.kv_heads(new_cfg)
    if n_new != n_src:
        how = f"mean-pooled in groups of {n_src // n_new}" if n_new < n_src else f"repeated {n_new // n_src}x"
        notes.append(f"keys and values: {n_src} -> {n_new} KV heads, {how}")
    if new_cfg.attention.kind == "diff":
        notes.append(f"diff: head_dim {cfg.attention.dim(cfg)} -> {new_cfg.attention.dim(new_cfg)} (q2, k2 and v's "
                     "second half zero, lambda 0)")  # fmt: skip
    return Conversion(new_cfg, new.eval(), cfg, fresh, notes)


def save_conversion(folder: str | Path, conversion: Conversion, tokenizer=None, source: str | None = None) -> Path:
    """The converted model as a checkpoint folder that every command takes as a model reference: its weights,
    config.json ({"model", "source", "conversion"}) and the source's tokenizer in tokenizer/ (tokenizer.json)."""
    from attnlab.interop.export import write_tokenizer  # export imports much of interop: only when saving

    config = {
        "model": conversion.cfg.to_dict(),
        "source": source,
        "tokenizer": None if tokenizer is None else tokenizer.name,
        "conversion": {"from": conversion.source.to_dict(), "fresh": conversion.fresh, "notes": conversion.notes},
    }
    extra = (
        None
        if tokenizer is None
        else lambda tmp: write_tokenizer(tokenizer, tmp / "tokenizer", conversion.cfg.max_seq_len)
    )
    return save_model_folder(folder, conversion.model, config, extra)
