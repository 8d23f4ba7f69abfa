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
- bottleneck, decoupled (convert_low_rank) and mla (convert_mla): RoPE pairs kept (kept_pairs) at the source's
  frequencies (rope_scaling freq_factors), the rest factorised (truncated SVDs, activation-aware with calibration
  tokens); see those functions.
- any of them with a memory (`memory=`): the memory's own parameters (the bounded memory's write gate) start
  as a freshly built model's (seed 0); nothing else does. A source's own memory is kept, its per-KV-head
  parameters (eta_logit) pooled or repeated with the keys and values; given another memory kind, the source's
  memory parameters the target has no place for are dropped, and a note says so.

`Conversion.fresh` names every parameter not taken from the source.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnlab.config import ModelConfig, RopeScaling
from attnlab.config_io import model_config_from_dict
from attnlab.errors import ConfigError
from attnlab.model.transformer import Transformer, build_model
from attnlab.train.checkpoint import save_model_folder

SOURCE_KINDS = ("mha", "sliding")
TARGET_KINDS = ("mha", "sliding", "coda", "diff", "bottleneck", "decoupled", "mla")
LOW_RANK = ("bottleneck", "decoupled", "mla")  # fewer channels than the source: RoPE pairs chosen, the rest factorised
# transparent unless asked otherwise (MLA: no norm on the latent, so a full-rank latent is the source)
DEFAULTS = {"coda": {"head_norm": False}, "diff": {"head_norm": False}, "mla": {"latent_norm": False}}


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
        if attention:
            raise ConfigError(f"convert: the source's attention is {source.attention.kind}; a conversion of the "
                              f"attention starts from {' or '.join(SOURCE_KINDS)} (a pretrained model's); a memory "
                              "alone can be given to any model (--memory without --attention)")  # fmt: skip
        data = source.to_dict()  # a memory alone: the attention stays as it is, weights and all
        if memory is not None:
            data["memory"] = dict(memory)
        return model_config_from_dict(data, source="convert", saved=memory is None)
    attention = dict(attention or {})
    kind = attention.get("kind", source.attention.kind)
    if kind not in TARGET_KINDS:
        from attnlab.attention.registry import REGISTRY

        if kind not in REGISTRY:  # (a slip such as MHA: not a kind at all, not one conversions lack)
            same = [k for k in TARGET_KINDS if k == str(kind).lower()]
            hint = f"did you mean {same[0]!r}?" if same else f"the kinds a model converts to: {', '.join(TARGET_KINDS)}"
            raise ConfigError(f"convert: attention.kind={kind!r} is not an attention kind ({hint})")
        raise ConfigError(f"convert: attention.kind={kind!r} cannot be converted to yet (use one of "
                          f"{', '.join(TARGET_KINDS)})")  # fmt: skip
    data = source.to_dict()
    old = data["attention"]
    head_dim = source.attention.dim(source)
    inherited = {"n_kv_heads": old.get("n_kv_heads")} if kind != "mla" else mla_dims(source, attention)
    if kind not in LOW_RANK:
        inherited["head_dim"] = old.get("head_dim") if kind != "diff" else 2 * head_dim
    if kind in ("mha", "sliding") and old.get("qkv_bias"):
        inherited["qkv_bias"] = True
    if kind == "sliding" and "window" in old:
        inherited["window"] = old["window"]
    new = {"kind": kind, **inherited, **DEFAULTS.get(kind, {}), **attention}
    data["attention"] = {k: v for k, v in new.items() if v is not None}
    if memory is not None:
        data["memory"] = dict(memory)
    cfg = model_config_from_dict(data, source="convert", saved=memory is None)  # the source's memory: as saved
    if kind in LOW_RANK:
        low_rank_problem(source, cfg)
    elif cfg.attention.dim(cfg) != (want := 2 * head_dim if kind == "diff" else head_dim):
        raise ConfigError(f"convert: attention.head_dim={cfg.attention.dim(cfg)} cannot be initialised from the "
                          f"source's head_dim {head_dim} (a {kind} conversion keeps head_dim={want})")  # fmt: skip
    n_src, n_new = kv_heads(source), kv_heads(cfg)
    if n_src % n_new and n_new % n_src:
        raise ConfigError(f"convert: attention.n_kv_heads={n_new} cannot be pooled from the source's {n_src} KV heads "
                          f"(use a divisor or a multiple of {n_src})")  # fmt: skip
    if getattr(source.attention, "qkv_bias", False) and not getattr(cfg.attention, "qkv_bias", False):
        raise ConfigError(f"convert: the source has q/k/v biases and attention.kind {kind} has none (use mha or "
                          "sliding with qkv_bias: true)")  # fmt: skip
    return cfg


def unchanged(source: ModelConfig, target: ModelConfig) -> bool:
    """Whether a conversion's target is the source itself (KV heads and head_dim left unset read as the values
    they stand for): such a conversion would write a copy of the source."""
    if source.attention.kind != target.attention.kind:
        return False

    def resolved(cfg: ModelConfig) -> ModelConfig:
        attention = cfg.attention
        values = {"n_kv_heads": kv_heads(cfg), "head_dim": attention.dim(cfg)}
        fields = {f.name for f in dataclasses.fields(attention)}
        return cfg.replace(attention=dataclasses.replace(attention, **{k: v for k, v in values.items() if k in fields}))

    return resolved(source) == resolved(target)


def kv_heads(cfg: ModelConfig) -> int:
    """Key/value heads of any per-head attention (its cache layout's)."""
    return cfg.attention.cache_layout(cfg).heads


def rotated_width(cfg: ModelConfig) -> int:
    """Channels per head a low-rank target rotates (of each source head): a bottleneck's whole head, a decoupled
    model's k_geo, an MLA conversion's 2r (its k_rope holds r pairs of each source KV head: v_head_dim, the
    source's head_dim, minus the unrotated head_dim)."""
    a = cfg.attention
    if a.kind == "mla":
        head_dim, _, v_dim = a.dims(cfg)
        return v_dim - head_dim
    return a.d_attn // cfg.n_heads if a.kind == "bottleneck" else a.d_geo // cfg.n_heads


def mla_dims(source: ModelConfig, attention: dict) -> dict:
    """An MLA conversion's widths: d_rope = n_kv * 2r (r kept pairs of each source KV head, side by side in the
    shared k_rope; default r = head_dim / 16, at least 1), head_dim = the source's minus 2r (the unrotated rest of
    each query and key head), v_head_dim = the source's. ConfigError when the given ones do not fit."""
    d, n_kv = source.attention.dim(source), kv_heads(source)
    usual = n_kv * 2 * max(1, d // 16)
    d_rope = attention.get("d_rope", usual)
    if not isinstance(d_rope, int) or d_rope < 2 * n_kv or d_rope % (2 * n_kv) or d_rope // n_kv > d - 2:
        raise ConfigError(
            f"convert: attention.d_rope={d_rope} must be a multiple of 2 x the source's {n_kv} KV heads (k_rope "
            f"holds r RoPE pairs of each), at most {n_kv * (d - 2)} (e.g. {usual})"
        )
    want = {"d_rope": d_rope, "head_dim": d - d_rope // n_kv, "v_head_dim": d}
    full = n_kv * (2 * d - d_rope // n_kv)  # the unrotated keys and the values of all KV heads
    latent = attention.get("d_latent")
    if isinstance(latent, int) and latent > full:
        raise ConfigError(f"convert: attention.d_latent={latent} is more than the source's {full} unrotated key and "
                          f"value channels per token (full rank, exact: use at most {full})")  # fmt: skip
    for key, value in want.items():
        if key in attention and attention[key] != value:
            raise ConfigError(f"convert: attention.{key}={attention[key]} cannot be initialised from the source "
                              f"(an MLA conversion with d_rope={d_rope} has {key}={value}: leave it out)")  # fmt: skip
    return want


def low_rank_problem(source: ModelConfig, cfg: ModelConfig) -> None:
    """ConfigError (one line) for a bottleneck, decoupled or MLA target the source cannot initialise."""
    a, head_dim, kind = cfg.attention, source.attention.dim(source), cfg.attention.kind
    width = rotated_width(cfg)
    what = "d_attn / n_heads" if kind == "bottleneck" else "d_geo / n_heads"
    if width > head_dim:
        raise ConfigError(f"convert: attention.{what} = {width} is more than the source's head_dim {head_dim} (its "
                          f"RoPE pairs are chosen among the source's {head_dim // 2}: at most {head_dim})")  # fmt: skip
    if source.rope_scaling is not None:
        raise ConfigError(f"convert: the source's rope_scaling ({source.rope_scaling.type}) cannot be kept when "
                          f"choosing RoPE pairs for attention.kind {kind} (convert to mha, coda, diff)")  # fmt: skip
    if getattr(source.attention, "qkv_bias", False):
        raise ConfigError(f"convert: the source's q/k/v biases cannot be factorised into attention.kind {kind} yet")
    if kind == "mla" and a.latent_norm:
        raise ConfigError("convert: an MLA conversion has no norm on the latent (latent_norm: false): the source's "
                          "keys and values are linear in the input")  # fmt: skip
    if kind == "decoupled" and (a.tie_qk or not a.rope or a.rope_semantic):
        raise ConfigError("convert: a decoupled conversion keeps RoPE on the geometric path only (rope: true, "
                          "rope_semantic: false) and separate semantic W_Q, W_K (tie_qk: false)")  # fmt: skip
    if kind == "decoupled":  # wider than the source's rank: zero rows that only cost cache bytes
        h = cfg.n_heads
        rest = head_dim - width  # channels per head the geometric path leaves to the semantic one
        if a.d_sem // h > max(rest, 1):  # (one channel per head is the least: zero when every pair is kept)
            raise ConfigError(f"convert: attention.d_sem={a.d_sem} gives {a.d_sem // h} semantic channels per head, "
                              f"more than the {rest} of the source's head_dim {head_dim} that d_geo / n_heads = "
                              f"{width} leaves (the rest would be zeros: use at most d_sem="
                              f"{max(rest, 1) * h})")  # fmt: skip
        if a.value_dim // h > head_dim:
            key = "d_v" if a.d_v is not None else "d_v (d_sem + d_geo when unset)"
            raise ConfigError(f"convert: attention.{key}={a.value_dim} gives {a.value_dim // h} value channels per "
                              f"head, more than the source's head_dim {head_dim} (n_heads x head_dim = "
                              f"{h * head_dim} value channels: the rest would be zeros; use at most d_v="
                              f"{h * head_dim})")  # fmt: skip


def pair_rows(pairs: torch.Tensor, dim: int, interleaved: bool) -> torch.Tensor:
    """The channels of a head of width `dim` that make up RoPE pairs `pairs`, in the order a head of width
    2 len(pairs) pairs them: (i, i + w/2) half-split, (2i, 2i + 1) interleaved."""
    if interleaved:
        return torch.stack((2 * pairs, 2 * pairs + 1), dim=1).flatten()
    return torch.cat((pairs, pairs + dim // 2))


@torch.no_grad()
def pair_energy(model: Transformer, cfg: ModelConfig, whitening: list | None = None) -> torch.Tensor:
    """(head_dim / 2,) the query-key energy of each RoPE pair, summed over layers and query heads: |q of the pair|
    |k of the pair| (the key of the query head's KV head), as RMS over the calibration inputs when `whitening`
    (per layer (C^1/2, C^-1/2) of the inputs' second moment C) is given, else the rows' Frobenius norms (inputs of
    unit norm): MHA2MLA's 2-norm criterion."""
    h, hk, d = cfg.n_heads, kv_heads(cfg), cfg.attention.dim(cfg)
    first = pair_rows(torch.arange(d // 2), d, cfg.rope_interleaved).unflatten(0, (-1, 2) if cfg.rope_interleaved
                                                                                else (2, -1))  # fmt: skip
    first, second = (first[:, 0], first[:, 1]) if cfg.rope_interleaved else (first[0], first[1])
    energy = torch.zeros(d // 2, dtype=torch.float64)
    for i, block in enumerate(model.blocks):
        (q, k, _), _ = _qkv(block.attn, cfg)
        root = whitening[i][0] if whitening else None
        q2, k2 = ((w.double() if root is None else w.double() @ root).unflatten(0, (-1, d)).pow(2).sum(-1)
                  for w in (q, k))  # (heads, D): squared row norms  # fmt: skip
        qe, ke = (q2[:, first] + q2[:, second]).sqrt(), (k2[:, first] + k2[:, second]).sqrt()  # (heads, D/2)
        energy += (qe * ke.repeat_interleave(h // hk, dim=0)).sum(0)
    return energy


@torch.no_grad()
def input_whitening(model: Transformer, tokens: torch.Tensor, seq_len: int, floor: float = 1e-6) -> list:
    """Per layer (C^1/2, C^-1/2) (float64) of C = E[x x^T], the second moment of the attention's input x (after
    the block's norm) over calibration `tokens` (1-D ids) read in windows of seq_len; eigenvalues below floor *
    the largest are raised to it. Factorising W C^1/2 minimises the error on these inputs, not on the weights
    (activation-aware SVD)."""
    sums = [torch.zeros(model.cfg.d_model, model.cfg.d_model, dtype=torch.float64) for _ in model.blocks]
    count = 0

    def hook(i):
        def record(module, args):
            x = args[0].detach().double().flatten(0, 1)  # (B * T, d_model)
            sums[i].add_(x.T @ x)

        return record

    seq_len = min(seq_len, model.cfg.max_seq_len)
    handles = [block.attn.register_forward_pre_hook(hook(i)) for i, block in enumerate(model.blocks)]
    try:
        for start in range(0, len(tokens) - 1, seq_len):
            window = tokens[start : start + seq_len][None]
            model(window.to(next(model.parameters()).device), use_cache=False)
            count += window.shape[1]
    finally:
        for handle in handles:
            handle.remove()
    roots = []
    for total in sums:
        values, vectors = torch.linalg.eigh(total / count)
        values = values.clamp_min(floor * values.max()).sqrt()
        roots.append(((vectors * values) @ vectors.T, (vectors / values) @ vectors.T))
    return roots


CALIBRATION_SEQ_LEN = 512  # the windows convert_model reads calibration tokens in (the model's context at most)


def calibration_minimum(cfg: ModelConfig, seq_len: int = CALIBRATION_SEQ_LEN) -> int:
    """The fewest calibration tokens whose attention inputs can span the d_model-wide input space: the second moment
    C (input_whitening) of fewer than d_model inputs is singular, and a factorisation of W C^1/2 then fits the few
    directions they reach and leaves the rest to the floor. input_whitening reads windows of seq_len (cut to the
    context) and leaves out a last window of one token."""
    seq_len, d_model = min(seq_len, cfg.max_seq_len), cfg.d_model
    return d_model if (d_model - 1) % seq_len else d_model + 1


PAIR_RULES = ("energy", "high", "low", "uniform")  # MHA2MLA's S_2-norm (on the weights), S_high, S_low, S_uniform


def kept_pairs(model: Transformer, cfg: ModelConfig, n: int, rule: str = "energy", whitening=None) -> torch.Tensor:
    """The n RoPE pairs of the source the geometric path keeps, in ascending order (highest frequency first),
    the same for every layer and head (the model's RoPE is one table): those with the most query-key weight
    energy (pair_energy), the n highest or lowest frequencies, or n spread evenly."""
    half = cfg.attention.dim(cfg) // 2
    if rule == "energy":
        return pair_energy(model, cfg, whitening).topk(n).indices.sort().values
    if rule == "high":
        return torch.arange(n)
    if rule == "low":
        return torch.arange(half - n, half)
    if rule == "uniform":
        return torch.linspace(0, half - 1, n).round().long().unique()
    raise ConfigError(f"convert: rope_pairs={rule!r} is not known (use {', '.join(PAIR_RULES)})")


def pair_factors(pairs: torch.Tensor, source: ModelConfig, width: int) -> tuple[float, ...]:
    """rope_scaling.freq_factors that make pair i of a head of `width` channels turn at the source's pair
    pairs[i]: base^(-2i/width) / factor_i = base^(-2 pairs[i] / head_dim)."""
    d, base = source.attention.dim(source), source.rope_base
    i = torch.arange(len(pairs), dtype=torch.float64)
    return tuple((base ** (2 * pairs.double() / d - 2 * i / width)).tolist())


def joint_low_rank(left: torch.Tensor, right: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """left (n, m) @ right (m, k) ~= a (n, rank) @ b (rank, k), the best approximation of that rank in the Frobenius
    norm (truncated SVD of the product, computed through two QRs), the singular values split evenly between a
    and b; a rank above the product's is padded with zeros (exact)."""
    ql, rl = torch.linalg.qr(left.double())  # (n, m), (m, m)
    qr, rr = torch.linalg.qr(right.double().T)  # (k, m), (m, m)
    u, s, vh = torch.linalg.svd(rl @ rr.T)
    r = min(rank, s.numel())
    root = s[:r].sqrt()
    a = torch.zeros(left.shape[0], rank, dtype=torch.float64)
    b = torch.zeros(rank, right.shape[1], dtype=torch.float64)
    a[:, :r], b[:r] = (ql @ u[:, :r]) * root, root[:, None] * (vh[:r] @ qr.T)
    return a.to(left.dtype), b.to(right.dtype)


def factorised_values(src, v: torch.Tensor, source: ModelConfig, n_kv: int, width: int, whitening=None):
    """V rows (n_kv * width, d_model) and output columns (d_model, H * width) of a value width `width` per head:
    per KV head, the best rank-`width` approximation of its query heads' W_o,h W_v stacked (joint_low_rank), on
    the calibration inputs when `whitening` (C^1/2, C^-1/2) is given: W_v C^1/2 is factorised, then C^-1/2 undone."""
    h, d = source.n_heads, source.attention.dim(source)
    group = h // n_kv
    out = src.out.weight.detach().unflatten(1, (h, d))  # (d_model, H, D)
    root, inverse = whitening if whitening else (None, None)
    values, outs = [], []
    for g in range(n_kv):
        heads = out[:, g * group : (g + 1) * group].permute(1, 0, 2).flatten(0, 1)  # (group * d_model, D)
        right = v.unflatten(0, (n_kv, d))[g]
        a, b = joint_low_rank(heads, right if root is None else (right.double() @ root), width)
        values.append(b if inverse is None else (b.double() @ inverse).to(v.dtype))
        outs.append(a.unflatten(0, (group, -1)).to(v.dtype))  # (group, d_model, width)
    return torch.cat(values), torch.cat(outs).permute(1, 0, 2).flatten(1, 2)


@torch.no_grad()
def convert_low_rank(src, dst, source: ModelConfig, cfg: ModelConfig, pairs: torch.Tensor, whitening=None) -> None:
    """A bottleneck or decoupled layer from a per-head layer: the kept RoPE pairs' rows of q and k (the
    geometric path), the rest's q-k bilinear form factorised per KV head into the semantic path (decoupled),
    V and the output factorised jointly; q scaled so every path keeps the source's 1/sqrt(head_dim)."""
    (q, k, v), _ = _qkv(src, source)
    n_src, n_kv = kv_heads(source), kv_heads(cfg)
    k, v = pool_heads(k, n_src, n_kv), pool_heads(v, n_src, n_kv)
    h, d, interleaved = cfg.n_heads, source.attention.dim(source), cfg.rope_interleaved
    width, rows = rotated_width(cfg), pair_rows(pairs, d, interleaved)
    q_geo = q.unflatten(0, (h, d))[:, rows].flatten(0, 1) * math.sqrt(width / d)
    k_geo = k.unflatten(0, (n_kv, d))[:, rows].flatten(0, 1)
    if cfg.attention.kind == "bottleneck":
        values, out = factorised_values(src, v, source, n_kv, width, whitening)
        dst.qkv.weight.copy_(torch.cat((q_geo, k_geo, values)))
        dst.out.weight.copy_(out)
        return
    sem, v_width, group = cfg.attention.d_sem // h, cfg.attention.value_dim // h, h // n_kv
    rest = pair_rows(torch.tensor([p for p in range(d // 2) if p not in set(pairs.tolist())], dtype=torch.long),
                     d, interleaved)  # fmt: skip
    q_rest, k_rest = q.unflatten(0, (h, d))[:, rest], k.unflatten(0, (n_kv, d))[:, rest]  # (H, m, dm), (H_kv, m, dm)
    root, inverse = whitening if whitening else (None, None)
    if root is not None:  # the bilinear form on the calibration inputs: C^1/2 W_q^T W_k C^1/2
        q_rest, k_rest = q_rest.double() @ root, k_rest.double() @ root
    q_sem, k_sem = [], []
    for g in range(n_kv):  # q_h . k_g over the remaining pairs, read without rotation, for the group's query heads
        left = q_rest[g * group : (g + 1) * group].transpose(1, 2).flatten(0, 1)  # (group * d_model, m)
        a, b = joint_low_rank(left, k_rest[g], sem)
        q_sem.append(a.unflatten(0, (group, -1)).transpose(1, 2))  # (group, sem, d_model)
        k_sem.append(b)
    q_sem, k_sem = torch.cat(q_sem).flatten(0, 1), torch.cat(k_sem)
    if inverse is not None:
        q_sem, k_sem = q_sem.double() @ inverse, k_sem.double() @ inverse
    q_sem, k_sem = q_sem.to(q.dtype) * math.sqrt(sem / d), k_sem.to(q.dtype)
    values, out = factorised_values(src, v, source, n_kv, v_width, whitening)
    dst.proj.weight.copy_(torch.cat((q_sem, q_geo, k_sem, k_geo, values)))
    dst.out.weight.copy_(out)


def low_rank(weight: torch.Tensor, rank: int, whitening=None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (n, m) ~= up (n, rank) @ down (rank, m): its truncated SVD (the singular values split evenly), of
    W C^1/2 when `whitening` (C^1/2, C^-1/2) is given (then C^-1/2 undone on `down`); zero-padded beyond W's rank."""
    root, inverse = whitening if whitening else (None, None)
    w = weight.double() if root is None else weight.double() @ root
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    r = min(rank, s.numel())
    up = torch.zeros(w.shape[0], rank, dtype=torch.float64)
    down = torch.zeros(rank, w.shape[1], dtype=torch.float64)
    up[:, :r], down[:r] = u[:, :r] * s[:r].sqrt(), s[:r].sqrt()[:, None] * vh[:r]
    if inverse is not None:
        down = down @ inverse
    return up.to(weight.dtype), down.to(weight.dtype)


@torch.no_grad()
def convert_mla(src, dst, source: ModelConfig, cfg: ModelConfig, pairs: torch.Tensor, whitening=None) -> None:
    """An MLA layer from a per-head layer (MHA2MLA's partial RoPE plus a joint low-rank latent, made exact where it
    can be): the shared k_rope holds the kept pairs of every source KV head side by side, and each query head's
    q_rope is zero outside its KV head's block, so q_rope . k_rope is the source's kept-pair score; the latent is
    the joint truncated SVD of the other channels' keys and the values of all KV heads (activation-aware with
    `whitening`); k_up and v_up give each query head its KV head's rows; queries scaled to keep 1/sqrt(head_dim)."""
    (q, k, v), _ = _qkv(src, source)
    h, n_kv, d, interleaved = cfg.n_heads, kv_heads(source), source.attention.dim(source), cfg.rope_interleaved
    head_dim, d_rope, _ = cfg.attention.dims(cfg)
    r, group = len(pairs), h // n_kv
    kept = pair_rows(pairs, d, interleaved)
    rest = pair_rows(torch.tensor([p for p in range(d // 2) if p not in set(pairs.tolist())], dtype=torch.long),
                     d, interleaved)  # fmt: skip
    qh, kh, vh = q.unflatten(0, (h, d)), k.unflatten(0, (n_kv, d)), v.unflatten(0, (n_kv, d))
    q_rope = q.new_zeros(h, d_rope, q.shape[1])
    k_rope = k.new_zeros(d_rope, k.shape[1])
    for g in range(n_kv):
        block = pair_rows(torch.arange(g * r, (g + 1) * r), d_rope, interleaved)  # the channels of its r pairs
        k_rope[block] = kh[g, kept]
        q_rope[g * group : (g + 1) * group, block] = qh[g * group : (g + 1) * group][:, kept]
    scale = math.sqrt((head_dim + d_rope) / d)
    dst.q_proj.weight.copy_(torch.cat((qh[:, rest], q_rope), dim=1).flatten(0, 1) * scale)
    up, down = low_rank(torch.cat((kh[:, rest].flatten(0, 1), vh.flatten(0, 1))), cfg.attention.d_latent, whitening)
    up_k, up_v = up.split((n_kv * head_dim, n_kv * d))
    dst.kv_down.weight.copy_(torch.cat((down, k_rope)))
    dst.k_up.weight.copy_(up_k.unflatten(0, (n_kv, head_dim)).repeat_interleave(group, dim=0).flatten(0, 1))
    dst.v_up.weight.copy_(up_v.unflatten(0, (n_kv, d)).repeat_interleave(group, dim=0).flatten(0, 1))
    dst.out.weight.copy_(src.out.weight)


def pool_heads(weight: torch.Tensor, n_src: int, n_new: int) -> torch.Tensor:
    """Rows of n_src heads (n_src * D, ...) -> n_new heads: the mean of each group of n_src / n_new consecutive
    heads, or each head repeated n_new / n_src times."""
    heads = weight.unflatten(0, (n_src, -1))  # (n_src, D, ...)
    if n_new <= n_src:
        return heads.unflatten(0, (n_new, n_src // n_new)).mean(dim=1).flatten(0, 1)
    return heads.repeat_interleave(n_new // n_src, dim=0).flatten(0, 1)


def _qkv(attn, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """The source layer's q, k, v rows (weight, and bias or None each)."""
    h, hk, d = cfg.n_heads, kv_heads(cfg), cfg.attention.dim(cfg)
    weights = attn.qkv.weight.detach().split((h * d, hk * d, hk * d), dim=0)
    bias = attn.qkv.bias
    biases = bias.detach().split((h * d, hk * d, hk * d)) if bias is not None else (None, None, None)
    return weights, biases


@torch.no_grad()
def convert_layer(src, dst, source: ModelConfig, cfg: ModelConfig) -> None:
    """Initialises layer `dst` (the target's attention) from `src` (a HeadAttention of the source)."""
    (q, k, v), (qb, kb, vb) = _qkv(src, source)
    n_src, n_new = kv_heads(source), kv_heads(cfg)
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


def outside_attention(name: str, weight: torch.Tensor, target: torch.Tensor, source: ModelConfig,
                      cfg: ModelConfig) -> torch.Tensor:  # fmt: skip
    """The source's `weight` for the target's parameter `name` outside the attention: itself, or, for a memory's
    per-KV-head parameter (the bounded memory's eta_logit) when the KV heads change, pooled or repeated over the
    heads as the keys and values are. ConfigError for a shape that cannot follow."""
    if weight.shape == target.shape:
        return weight
    n_src, n_new = kv_heads(source), kv_heads(cfg)
    if ".memory." in name and weight.shape[:1] == (n_src,) and target.shape == (n_new, *weight.shape[1:]):
        return pool_heads(weight, n_src, n_new)
    fix = " (convert with --memory kind=none, then add the memory)" if ".memory." in name else ""
    raise ConfigError(f"convert: {name} has shape {tuple(weight.shape)} in the source and {tuple(target.shape)} in "
                      f"the target: it cannot be initialised from the source{fix}")  # fmt: skip


def convert_model(cfg: ModelConfig, model: Transformer, attention: dict | None = None, memory: dict | None = None,
                  rope_pairs: str = "energy", calibration: torch.Tensor | None = None,
                  calibration_seq_len: int = CALIBRATION_SEQ_LEN) -> Conversion:  # fmt: skip
    """`model` (config `cfg`) with another attention and/or memory, initialised from its weights (module
    docstring). ConfigError (one line each) for a target the source cannot initialise, or for calibration tokens
    too few to fit on (calibration_minimum)."""
    new_cfg = target_config(cfg, attention, memory)
    kept = new_cfg.attention == cfg.attention  # a memory alone: the attention's weights are copied as they are
    low_rank = new_cfg.attention.kind in LOW_RANK and not kept
    whitening = None
    least = calibration_minimum(cfg, calibration_seq_len)
    if low_rank and calibration is not None and torch.as_tensor(calibration).numel() < least:
        raise ConfigError(f"convert: {torch.as_tensor(calibration).numel()} calibration tokens are too few for "
                          f"d_model={cfg.d_model}: give at least {least} (or none: the weights alone)")  # fmt: skip
    if low_rank and calibration is not None:  # activation-aware: the factorisations fit the calibration inputs
        whitening = input_whitening(model, torch.as_tensor(calibration).long().flatten(), calibration_seq_len)
    if low_rank:  # the kept RoPE pairs turn at the source's frequencies
        pairs = kept_pairs(model, cfg, rotated_width(new_cfg) // 2, rope_pairs, whitening)
        if new_cfg.attention.kind == "mla":  # k_rope: the kept pairs of each source KV head, side by side
            factors = pair_factors(pairs.repeat(kv_heads(cfg)), cfg, new_cfg.attention.dims(new_cfg)[1])
        else:
            factors = pair_factors(pairs, cfg, rotated_width(new_cfg))
        new_cfg = new_cfg.replace(rope_scaling=RopeScaling(type="freq_factors", freq_factors=factors))
    with torch.random.fork_rng(devices=[]):  # the fresh parameters (a memory's gate) start the same every time
        torch.manual_seed(0)
        new = build_model(new_cfg, device=next(model.parameters()).device, dtype=next(model.parameters()).dtype)
    source_state = model.state_dict()
    taken, pooled = set(), []  # pooled: a memory's per-KV-head parameters, pooled like the keys and values
    with torch.no_grad():
        for name, tensor in new.state_dict().items():
            if (".attn." in name and not kept) or name not in source_state:
                continue
            if source_state[name].shape != tensor.shape:
                pooled.append(name.split(".", 2)[-1])
            tensor.copy_(outside_attention(name, source_state[name], tensor, cfg, new_cfg))
            taken.add(name)
        for i, (src_block, dst_block) in enumerate(zip(model.blocks, new.blocks, strict=True)):
            if kept:
                continue
            if new_cfg.attention.kind == "mla":
                convert_mla(src_block.attn, dst_block.attn, cfg, new_cfg, pairs, whitening and whitening[i])
            elif low_rank:
                convert_low_rank(src_block.attn, dst_block.attn, cfg, new_cfg, pairs, whitening and whitening[i])
            else:
                convert_layer(src_block.attn, dst_block.attn, cfg, new_cfg)
    for i in range(new_cfg.n_layers):
        taken |= {f"blocks.{i}.attn.{name}" for name in ("qkv.weight", "qkv.bias", "proj.weight", "out.weight",
                                                           "q_proj.weight", "kv_down.weight", "k_up.weight",
                                                           "v_up.weight")}  # fmt: skip
        if new_cfg.attention.kind == "diff":
            taken |= {f"blocks.{i}.attn.lambda_{n}" for n in ("q1", "k1", "q2", "k2")}
    fresh = [name for name, _ in new.named_parameters() if name not in taken]
    notes = []
    held = new.state_dict()  # the source's own parameters outside the attention the target has no place for
    dropped = [name for name, _ in model.named_parameters() if ".attn." not in name and name not in held]
    if dropped:
        names = ", ".join(sorted({n.split(".", 2)[-1] for n in dropped}))
        whose = f"memory {new_cfg.memory.kind}" if cfg.memory.kind != new_cfg.memory.kind else "the target"
        notes.append(f"dropped: the source's {names} ({len(dropped)} tensors, memory {cfg.memory.kind}): {whose} "
                     "has no place for them")  # fmt: skip
    n_src, n_new = kv_heads(cfg), kv_heads(new_cfg)
    if n_new != n_src:
        how = f"mean-pooled in groups of {n_src // n_new}" if n_new < n_src else f"repeated {n_new // n_src}x"
        also = f" (and so is {', '.join(sorted(set(pooled)))})" if pooled else ""
        notes.append(f"keys and values: {n_src} -> {n_new} KV heads, {how}{also}")
    if low_rank:
        d = cfg.attention.dim(cfg)
        notes.append(f"RoPE pairs kept (of {d // 2}, rule {rope_pairs}): {pairs.tolist()}")
        fitted = (
            f"on {len(torch.as_tensor(calibration).flatten()):,} calibration tokens" if whitening else "weights only"
        )
        notes.append(f"factorisations fitted {fitted}")
    if new_cfg.attention.kind == "diff":
        notes.append(f"diff: head_dim {cfg.attention.dim(cfg)} -> {new_cfg.attention.dim(new_cfg)} (q2, k2 and v's "
                     "second half zero, lambda 0)")  # fmt: skip
    return Conversion(new_cfg, new.eval(), cfg, fresh, notes)


def save_conversion(folder: str | Path, conversion: Conversion, tokenizer=None, source: str | None = None,
                    recipe: dict | None = None) -> Path:  # fmt: skip
    """The converted model as a checkpoint folder that every command takes as a model reference: its weights,
    config.json ({"model", "source", "conversion", and `recipe`: what asked for it, when given}) and the source's
    tokenizer in tokenizer/ (tokenizer.json)."""
    from attnlab.interop.export import write_tokenizer  # export imports much of interop: only when saving

    config = {
        "model": conversion.cfg.to_dict(),
        "source": source,
        "tokenizer": None if tokenizer is None else tokenizer.name,
        "conversion": {"from": conversion.source.to_dict(), "fresh": conversion.fresh, "notes": conversion.notes},
    }
    if recipe is not None:
        config["recipe"] = recipe
    extra = (
        None
        if tokenizer is None
        else lambda tmp: write_tokenizer(tokenizer, tmp / "tokenizer", conversion.cfg.max_seq_len)
    )
    return save_model_folder(folder, conversion.model, config, extra)
