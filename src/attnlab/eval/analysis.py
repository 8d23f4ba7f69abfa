"""Inside the attention layers: Q/K projection spectra and effective rank, attention maps, mass on regions.

Nothing here changes the model. Forward hooks on each layer's projection Linear modules capture their outputs
(so Q/K activations are taken BEFORE RoPE), split by the module's own widths; attention probabilities are
recomputed from those captures with the variant's own scoring (RoPE, scale, masks, null key, DBA gate) and
checked: softmax(scores) @ v through the layer's output projection must reproduce the layer's output.

Effective rank (Roy & Vetterli 2007): erank(X) = exp(H(p)), p_i = s_i / sum_j s_j over the singular values s
of the (N tokens x width) activation matrix (the seeds' dba-scaling-low-rank-routing.md, appendix B).
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from attnlab.attention.base import merge_heads, prepend_null, split_heads
from attnlab.attention.decoupled import Decoupled
from attnlab.attention.masks import causal_mask, with_null_column
from attnlab.attention.mha import HeadAttention
from attnlab.attention.mla import MLA
from attnlab.errors import DataError, InputError

SUPPORTED = "mha, bottleneck, sliding (HeadAttention), decoupled, mla"


# ---- capture -------------------------------------------------------------------------------------------


def _hooked_linears(attn: nn.Module) -> dict[str, nn.Linear]:
    """The projection modules whose outputs carry a layer's q/k/v. Only classes that keep their base class's
    forward are supported: a subclass with its own maths would be mis-read, so it gets a clear error."""
    forward = type(attn).forward
    if forward is HeadAttention.forward:
        return {"qkv": attn.qkv}
    if forward is Decoupled.forward:
        return {"proj": attn.proj}
    if forward is MLA.forward:
        return {"q_proj": attn.q_proj, "kv_down": attn.kv_down, "k_up": attn.k_up, "v_up": attn.v_up}
    raise InputError(
        f"attention module {type(attn).__name__} is not supported by attnlab.eval.analysis (supported: {SUPPORTED}); "
        "add its projection split and scoring there"
    )


@dataclass
class Capture:
    linears: list[dict[str, torch.Tensor]]  # per layer: hooked module name -> its output (B, T, width)
    outputs: list[torch.Tensor]  # per layer: the attention module's output y (B, T, d_model)
    positions: torch.Tensor  # (T,) 0..T-1: one forward without a cache


@torch.no_grad()
def capture(model, tokens: torch.Tensor) -> Capture:
    """Runs model(tokens) once without a cache (tokens: (B, T) int64) and returns each layer's projection
    outputs and attention output, taken with forward hooks that are removed afterwards."""
    if tokens.dim() == 1:
        tokens = tokens[None]
    layers = [{} for _ in model.blocks]
    outputs: list = [None] * len(model.blocks)
    handles = []

    def keep(store, key):
        return lambda module, args, out: store.__setitem__(key, (out[0] if isinstance(out, tuple) else out).detach())

    try:
        for i, block in enumerate(model.blocks):
            for name, linear in _hooked_linears(block.attn).items():
                handles.append(linear.register_forward_hook(keep(layers[i], name)))
            handles.append(block.attn.register_forward_hook(keep(outputs, i)))
        model(tokens.to(next(model.parameters()).device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return Capture(layers, outputs, torch.arange(tokens.shape[1], device=outputs[0].device))


def split_projections(attn: nn.Module, linears: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Named per-head activations (B, heads, T, dim), before RoPE, from one layer's captured projections.

    mha/bottleneck/sliding: q, k, v. decoupled: q_sem (absent with tie_qk: it is k_sem), q_geo, k_sem, k_geo, v.
    mla: q_nope, q_rope (per head), k_nope = W_uk RMSNorm(c) (per head), k_rope (one head shared by all), v.
    """
    if type(attn).forward is HeadAttention.forward:
        q_width, kv_width = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
        q, k, v = linears["qkv"].split((q_width, kv_width, kv_width), dim=-1)
        return {
            "q": split_heads(q, attn.n_heads),
            "k": split_heads(k, attn.n_kv_heads),
            "v": split_heads(v, attn.n_kv_heads),
        }
    if type(attn).forward is Decoupled.forward:
        names = (["q_sem"] if not attn.cfg.tie_qk else []) + ["q_geo", "k_sem", "k_geo", "v"]
        heads = {"q_sem": attn.n_heads, "q_geo": attn.n_heads}
        parts = linears["proj"].split(attn.widths, dim=-1)
        return {n: split_heads(p, heads.get(n, attn.n_kv_heads)) for n, p in zip(names, parts, strict=True)}
    if type(attn).forward is MLA.forward:
        q_nope, q_rope = split_heads(linears["q_proj"], attn.n_heads).split((attn.head_dim, attn.rope_dim), dim=-1)
        k_rope = linears["kv_down"][..., attn.d_latent :]  # (B, T, d_rope)
        return {
            "q_nope": q_nope, "q_rope": q_rope, "k_nope": split_heads(linears["k_up"], attn.n_heads),
            "k_rope": k_rope[:, None], "v": split_heads(linears["v_up"], attn.n_heads),
        }  # fmt: skip
    _hooked_linears(attn)  # raises the unsupported-kind error
    raise AssertionError("unreachable")


# ---- effective rank ------------------------------------------------------------------------------------


def singular_values(x: torch.Tensor, center: bool = False) -> torch.Tensor:
    """Singular values (descending, float64) of x: (N, d) activations; center subtracts the mean row first."""
    x = x.double()
    if center:
        x = x - x.mean(dim=0, keepdim=True)
    return torch.linalg.svdvals(x)


def effective_rank(s: torch.Tensor | np.ndarray) -> float:
    """Entropy effective rank exp(-sum p_i log p_i), p_i = s_i / sum s (Roy & Vetterli 2007, eq. 2-3);
    zero singular values contribute 0 log 0 = 0. 1 for rank one, k for k equal non-zero values."""
    s = torch.as_tensor(s, dtype=torch.float64)
    s = s[s > 0]
    if s.numel() == 0:
        return 0.0
    p = s / s.sum()
    return math.exp(-(p * p.log()).sum().item())


def gram_singular_values(gram: torch.Tensor, total: torch.Tensor, count: int, center: bool = False) -> torch.Tensor:
    """Singular values (descending) of the N x d matrix X whose Gram matrix X^T X and column sums are given:
    s_i = sqrt(eig_i(X^T X)), centred by X^T X - total total^T / N. Exact up to ~1e-8 * s_max in float64."""
    if center:
        gram = gram - torch.outer(total, total) / count
    return torch.linalg.eigvalsh(gram).clamp_min(0).sqrt().flip(0)


@torch.no_grad()
def effective_ranks(model, tokens: torch.Tensor, center: bool = False, tokens_per_forward: int = 2048) -> list[dict]:
    """Per layer, per Q/K path: {"path": {"erank", "erank_heads", "singular_values", "heads", "head_dim"}}.

    tokens: (B, T). Rows are the B*T token positions. "erank" and "singular_values" are POOLED over heads: the
    whole projection output of the path (N x heads*head_dim, heads concatenated); "erank_heads" lists each
    head's own (N x head_dim) effective rank. Activations are the projection outputs, before RoPE. Rows of
    tokens run in chunks of about tokens_per_forward tokens; only float64 Gram matrices are kept between them.
    """
    rows = max(1, tokens_per_forward // tokens.shape[1])
    sums: list[dict] = [{} for _ in model.blocks]  # per layer: path -> [X^T X (D, D), column sums (D,), N, shape]
    for chunk in tokens.split(rows):
        cap = capture(model, chunk)
        for block, linears, acc in zip(model.blocks, cap.linears, sums, strict=True):
            for name, x in split_projections(block.attn, linears).items():
                if name == "v":
                    continue
                flat = x.transpose(1, 2).reshape(-1, x.shape[1] * x.shape[3]).double()  # (B*T, heads*head_dim)
                gram, total, count, _ = acc.get(name, (0.0, 0.0, 0, None))
                acc[name] = (gram + flat.T @ flat, total + flat.sum(0), count + flat.shape[0], x.shape)
    layers = []
    for acc in sums:
        paths = {}
        for name, (gram, total, count, shape) in acc.items():
            heads, head_dim = shape[1], shape[3]
            pooled = gram_singular_values(gram, total, count, center)
            blocks = [slice(h * head_dim, (h + 1) * head_dim) for h in range(heads)]
            per_head = [gram_singular_values(gram[b, b], total[b], count, center) for b in blocks]
            paths[name] = {
                "erank": effective_rank(pooled), "erank_heads": [effective_rank(s) for s in per_head],
                "singular_values": [float(f"{v:.6g}") for v in pooled.tolist()], "heads": heads, "head_dim": head_dim,
            }  # fmt: skip
        layers.append(paths)
    return layers


def run_effective_rank(eval_model, split: str = "val", n_tokens: int = 4096, seq_len: int | None = None,
                       offset: int = 0, center: bool = False, data_dir: str | None = None) -> dict:  # fmt: skip
    """An `effective_rank` record for a checkpoint on a fixed slice of its own dataset's `split`:
    tokens[offset : offset + n_tokens] cut into rows of seq_len (default: the training context)."""
    from attnlab.config import DataConfig
    from attnlab.data import prepare
    from attnlab.eval.records import make_record

    data = eval_model.config.get("data")
    if not data:
        raise DataError(f"{eval_model.path}: no data config saved with this checkpoint: cannot find its tokens")
    seq_len = seq_len or eval_model.config.get("train", {}).get("seq_len") or eval_model.cfg.max_seq_len
    seq_len = min(seq_len, n_tokens, eval_model.cfg.max_seq_len)
    stream = prepare(DataConfig(**data), data_dir=data_dir).split(split)
    rows = (min(n_tokens, len(stream) - offset)) // seq_len
    if rows < 1:
        raise DataError(f"split {split!r} has {len(stream)} tokens: too few for offset={offset}, seq_len={seq_len}")
    tokens = torch.from_numpy(stream[offset : offset + rows * seq_len].astype(np.int64)).view(rows, seq_len)
    return make_record(
        "effective_rank", eval_model, dataset=data["source"], split=split, offset=offset, seq_len=seq_len,
        tokens=rows * seq_len, center=center, activations="projection outputs before RoPE",
        pooled="heads concatenated (N x heads*head_dim)", layers=effective_ranks(eval_model.model, tokens, center),
    )  # fmt: skip


# ---- attention maps ------------------------------------------------------------------------------------


def _per_query_head(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, H_kv, S, D) -> (B, H, S, D): query head h reads K/V head h // (H / H_kv), as `attend` does."""
    return x.repeat_interleave(n_heads // x.shape[1], dim=1)


def _softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)


def layer_attention(attn: nn.Module, linears: dict[str, torch.Tensor], positions: torch.Tensor):
    """(probs (B, H, T, S), values (B, H, S, Dv)) recomputed in fp32 from one layer's captured projections.
    S = T, or 1 + T with the null key first when the layer has one; values are per query head (GQA repeats)."""
    parts = {name: x.float() for name, x in split_projections(attn, linears).items()}
    null_k = null_v = None
    if type(attn).forward is HeadAttention.forward:
        q, k = attn.rotary(parts["q"], positions), attn.rotary(parts["k"], positions)
        q = q / math.sqrt(attn.head_dim)
        mask = causal_mask(positions, positions, attn.window)
        null_k, null_v = attn.null_k, attn.null_v
    elif type(attn).forward is Decoupled.forward:
        # score = 2g q_sem.k_sem / sqrt(d_sem/H) + 2(1-g) q_geo.k_geo / sqrt(d_geo/H)   (DBA eq. 5, 9)
        q_sem, q_geo, k_sem, k_geo = (parts.get(n, parts["k_sem"]) for n in ("q_sem", "q_geo", "k_sem", "k_geo"))
        if attn.rotary_geo is not None:
            q_geo, k_geo = attn.rotary_geo(q_geo, positions), attn.rotary_geo(k_geo, positions)
        if attn.rotary_sem is not None:
            q_sem, k_sem = attn.rotary_sem(q_sem, positions), attn.rotary_sem(k_sem, positions)
        sem_w = geo_w = torch.ones(attn.n_heads, device=q_sem.device)
        if attn.gate_logit is not None:
            g = torch.sigmoid(attn.gate_logit.float())
            sem_w, geo_w = 2 * g, 2 * (1 - g)
        sem_w, geo_w = sem_w[None, :, None, None], geo_w[None, :, None, None]  # (1, H, 1, 1)
        q = torch.cat((q_sem * sem_w / math.sqrt(attn.sem_dim), q_geo * geo_w / math.sqrt(attn.geo_dim)), dim=-1)
        k = torch.cat((k_sem, k_geo), dim=-1)  # (B, H_kv, T, d_sem/H + d_geo/H)
        mask = causal_mask(positions, positions)
        null_k, null_v = attn.null_k, attn.null_v
    else:  # MLA, naive path: per-head keys W_uk c plus the shared rotated k_rope
        q = torch.cat((parts["q_nope"], attn.rotary(parts["q_rope"], positions)), dim=-1) * attn.scale
        k_rope = attn.rotary(parts["k_rope"], positions).expand(-1, attn.n_heads, -1, -1)
        k = torch.cat((parts["k_nope"], k_rope), dim=-1)
        mask = causal_mask(positions, positions)
    v = parts["v"]
    if null_k is not None:
        k, v, mask = prepend_null(k, null_k.float()), prepend_null(v, null_v.float()), with_null_column(mask)
    n_heads = q.shape[1]
    scores = q @ _per_query_head(k, n_heads).transpose(-1, -2)  # (B, H, T, S)
    return _softmax(scores, mask), _per_query_head(v, n_heads)


def reproduce_output(attn: nn.Module, probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The layer output implied by the maps: out(merge_heads(probs @ values)), (B, T, d_model)."""
    weight = attn.out.weight.float()
    return nn.functional.linear(merge_heads(probs @ values), weight)


@dataclass
class AttentionMaps:
    probs: np.ndarray  # (n_layers, H, T, S) fp32, one prompt; S = T, or 1 + T with the null key in column 0
    null: bool
    output_error: float  # max over layers of max|reproduced - actual output| / max|actual output|


@torch.no_grad()
def attention_maps(model, tokens: torch.Tensor, rtol: float | None = None) -> AttentionMaps:
    """Every layer's attention probabilities for one prompt, tokens (T,) or (1, T). Raises if the maps do not
    reproduce a layer's output to rtol (relative to its largest entry; default 1e-4 in fp32, 3e-2 otherwise)."""
    tokens = tokens.reshape(1, -1)
    cap = capture(model, tokens)
    probs, error = [], 0.0
    for i, (block, linears) in enumerate(zip(model.blocks, cap.linears, strict=True)):
        p, v = layer_attention(block.attn, linears, cap.positions)
        actual = cap.outputs[i].float()
        diff = (reproduce_output(block.attn, p, v) - actual).abs().max().item() / actual.abs().max().clamp_min(
            1e-12
        ).item()
        error = max(error, diff)
        probs.append(p[0].cpu().numpy())
    dtype = next(model.parameters()).dtype
    if error > (rtol if rtol is not None else 1e-4 if dtype == torch.float32 else 3e-2):
        raise RuntimeError(
            f"recomputed attention maps miss the layer outputs by {error:.2e} (relative): analysis is out of date"
        )
    null = probs[0].shape[-1] == probs[0].shape[-2] + 1
    return AttentionMaps(np.stack(probs), null, error)


def region_mass(probs: np.ndarray, start: int, end: int, null: bool = False) -> np.ndarray:
    """Average attention mass that queries after the token region [start, end) put on it.

    probs: (..., T, S) with S = T (+1 null column first if null). Returns (...,): the mean over queries
    i in [end, T) of sum_{j in [start, end)} probs[..., i, j]."""
    length = probs.shape[-2]
    if not 0 <= start < end < length:
        raise InputError(f"region [{start}, {end}) must lie in 0..{length} tokens with at least one token after it")
    shift = 1 if null else 0
    return probs[..., end:, start + shift : end + shift].sum(axis=-1).mean(axis=-1)


def token_offsets(tokenizer, ids: list[int], text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets in text of each token: the characters of text that decoded prefixes
    ids[:i] and ids[:i + 1] reproduce. A token holding part of a character (a byte of UTF-8) gets the
    empty span (s, s) at that character, since a cut prefix decodes it to U+FFFD, not to the text."""
    done = [len(os.path.commonprefix([tokenizer.decode(ids[:i]), text])) for i in range(len(ids) + 1)]
    return list(zip(done[:-1], done[1:], strict=True))


def char_region_to_tokens(tokenizer, text: str, ids: list[int], start: int, end: int) -> tuple[int, int]:
    """The token span [a, b) covering characters [start, end) of text (every token that overlaps them)."""
    if tokenizer.decode(ids) != text:
        raise InputError(f"tokenizer {tokenizer.name!r} does not decode the prompt back to itself: give token spans")
    if not 0 <= start < end <= len(text):
        raise InputError(f"character region {start}:{end} is outside the prompt ({len(text)} characters)")
    # a token overlaps [start, end) if its span does; an empty span (part of character s) counts as [s, s + 1)
    hits = [i for i, (s, e) in enumerate(token_offsets(tokenizer, ids, text)) if s < end and max(e, s + 1) > start]
    return hits[0], hits[-1] + 1


def run_attention_maps(
    eval_model,
    prompt: str,
    maps_path: str | Path,
    regions: dict[str, tuple[int, int]] | None = None,
    unit: str = "chars",
) -> dict:
    """An `attention_maps` record for one prompt; the maps go to maps_path (.npz, key "probs", written
    atomically) and the record names that file. regions: name -> (start, end), in characters of the prompt
    (unit="chars") or tokens (unit="tokens"); each gets its mass per layer and head (see region_mass)."""
    from attnlab.eval.records import make_record

    tokenizer = eval_model.tokenizer
    ids = tokenizer.encode(prompt)
    if not ids or len(ids) > eval_model.cfg.max_seq_len:
        raise InputError(f"the prompt has {len(ids)} tokens: need 1..{eval_model.cfg.max_seq_len}")
    maps = attention_maps(eval_model.model, torch.tensor(ids))
    rows = []
    for name, (start, end) in (regions or {}).items():
        span = char_region_to_tokens(tokenizer, prompt, ids, start, end) if unit == "chars" else (start, end)
        mass = region_mass(maps.probs, *span, null=maps.null)  # (n_layers, H)
        rows.append({
            "name": name, unit: [start, end], "tokens": list(span), "text": tokenizer.decode(ids[slice(*span)]),
            "mass": mass.round(6).tolist(), "mass_by_layer": mass.mean(axis=1).round(6).tolist(),
        })  # fmt: skip
    maps_path = Path(maps_path)
    save_maps(maps_path, maps.probs)
    return make_record(
        "attention_maps", eval_model, prompt=prompt, token_ids=ids, token_text=[tokenizer.decode([i]) for i in ids],
        n_layers=maps.probs.shape[0], n_heads=maps.probs.shape[1], null=maps.null, maps_file=maps_path.name,
        output_error=maps.output_error, regions=rows,
    )  # fmt: skip


def save_maps(path: Path, probs: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".npz")
    os.close(fd)
    try:
        np.savez_compressed(tmp, probs=probs.astype(np.float32))
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; maps are shared like the records beside them
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_maps(record: dict, records_dir: str | Path) -> np.ndarray:
    """The (n_layers, H, T, S) maps of an attention_maps record, from the .npz beside its records file."""
    path = Path(records_dir) / record["maps_file"]
    if not path.exists():
        raise DataError(f"{path}: attention maps file named by the record is missing")
    with np.load(path) as data:
        return data["probs"]
