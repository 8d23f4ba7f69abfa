"""Inside the attention layers: Q/K projection spectra and effective rank, attention maps, mass on regions.

Nothing here changes the model, and nothing here knows a variant's maths: forward hooks on each layer's
attention module capture its input x (after the block's attn_norm) and its output y; the variant's own hooks
(attnlab.attention.base.Attention) then give its per-head projections before RoPE (`projections(x)`, for the
effective ranks) and its attention maps recomputed in fp32 (`scores(x, positions)`). Every map set is checked
against the forward pass: combine({name: map @ values}) must reproduce the captured output y, so the maps
saved are the ones the model used (for diff and coda too, whose output is signal - lambda * noise).

Effective rank (Roy & Vetterli 2007): erank(X) = exp(H(p)), p_i = s_i / sum_j s_j over the singular values s
of the (N tokens x width) activation matrix (the seeds' dba-scaling-low-rank-routing.md, appendix B).
"""

from __future__ import annotations

import io
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from attnlab.attention.base import Attention, AttentionScores
from attnlab.config import DataConfig
from attnlab.data import prepare
from attnlab.data.files import atomic_write_bytes
from attnlab.errors import ConfigError, DataError, InputError, LengthWarning
from attnlab.eval.records import make_record
from attnlab.paths import brief

# ---- capture -------------------------------------------------------------------------------------------


def _attention(block: nn.Module) -> Attention:
    """A block's attention module, which must expose the base class's `scores` and `projections` hooks."""
    if not isinstance(block.attn, Attention):
        raise InputError(
            f"attention module {type(block.attn).__name__} does not derive from attnlab.attention.base.Attention: "
            "attnlab.eval.analysis reads a layer through its scores() and projections()"
        )
    return block.attn


@dataclass
class Capture:
    inputs: list[torch.Tensor]  # per layer: the attention module's input x (B, T, d_model), after attn_norm
    outputs: list[torch.Tensor]  # per layer: the attention module's output y (B, T, d_model)
    positions: torch.Tensor  # (T,) 0..T-1: one forward without a cache


@torch.no_grad()
def capture(model, tokens: torch.Tensor) -> Capture:
    """Runs model(tokens) once without a cache (tokens: (B, T) or (T,) int64) and returns each layer's
    attention input and output, taken with forward hooks on `block.attn` that are removed afterwards."""
    if tokens.dim() == 1:
        tokens = tokens[None]
    n_layers = len(model.blocks)
    inputs: list = [None] * n_layers
    outputs: list = [None] * n_layers
    handles = []

    def keep(i: int):
        def hook(module, args, out):  # forward(x, positions, cache, write) -> (y, cache)
            inputs[i], outputs[i] = args[0].detach(), out[0].detach()

        return hook

    try:
        for i, block in enumerate(model.blocks):
            handles.append(_attention(block).register_forward_hook(keep(i)))
        model(tokens.to(next(model.parameters()).device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return Capture(inputs, outputs, torch.arange(tokens.shape[1], device=outputs[0].device))


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

    tokens: (B, T). Paths are the layer's `projections(x)` except "v" (mha, bottleneck, sliding, coda: q, k;
    decoupled: q_sem (absent with tie_qk), q_geo, k_sem, k_geo; mla: q_nope, q_rope, k_nope, k_rope; diff: q1,
    q2, k1, k2). Rows are the B*T token positions. "erank" and "singular_values" are POOLED over heads: the
    whole projection output of the path (N x heads*head_dim, heads concatenated); "erank_heads" lists each
    head's own (N x head_dim) effective rank. Activations are the projection outputs, before RoPE. Rows of
    tokens run in chunks of about tokens_per_forward tokens; only float64 Gram matrices are kept between them.
    """
    rows = max(1, tokens_per_forward // tokens.shape[1])
    sums: list[dict] = [{} for _ in model.blocks]  # per layer: path -> (X^T X (D, D), column sums (D,), N, shape)
    for chunk in tokens.split(rows):
        cap = capture(model, chunk)
        for block, x, acc in zip(model.blocks, cap.inputs, sums, strict=True):
            for name, part in block.attn.projections(x).items():  # (B, heads, T, head_dim) each
                if name == "v":
                    continue
                flat = part.transpose(1, 2).reshape(-1, part.shape[1] * part.shape[3]).double()  # (B*T, heads*hd)
                gram, total, count, _ = acc.get(name, (0.0, 0.0, 0, None))
                acc[name] = (gram + flat.T @ flat, total + flat.sum(0), count + flat.shape[0], part.shape)
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
    data = eval_model.config.get("data")
    if not data:
        raise DataError(f"{eval_model.path}: no data config saved with this checkpoint (a converted or pretrained "
                        "model keeps none): effective_rank reads the split the model was trained on, so give a "
                        "run's folder (the run it was converted from)")  # fmt: skip
    max_len = eval_model.cfg.max_seq_len
    if seq_len is not None and seq_len > max_len:  # a length asked for is scored as asked, or refused
        raise InputError(f"seq_len={seq_len} is more than the model's max_seq_len={max_len}: give seq_len {max_len} "
                         "or less (or leave it out for the training context)")  # fmt: skip
    if seq_len is not None and seq_len > n_tokens:
        raise InputError(f"seq_len={seq_len} is more than n_tokens={n_tokens}: a row needs seq_len tokens (give "
                         f"n_tokens >= {seq_len}, or a smaller seq_len)")  # fmt: skip
    seq_len = seq_len or eval_model.config.get("train", {}).get("seq_len") or max_len
    seq_len = min(seq_len, n_tokens, max_len)  # the default, the training context, within what is asked and fits
    stream = prepare(DataConfig(**data), data_dir=data_dir, tokenizer=eval_model.tokenizer).split(split)
    rows = (min(n_tokens, len(stream) - offset)) // seq_len
    if rows < 1:
        raise DataError(f"split {split!r} has {len(stream)} tokens: too few for offset={offset}, seq_len={seq_len}")
    if n_tokens > len(stream) - offset:
        warnings.warn(f"effective_rank: n_tokens={n_tokens} is more than split {split!r} holds after offset={offset} "
                      f"({len(stream) - offset} tokens): measured on {rows * seq_len} tokens (the record's tokens)",
                      LengthWarning, stacklevel=2)  # fmt: skip
    tokens = torch.from_numpy(stream[offset : offset + rows * seq_len].astype(np.int64)).view(rows, seq_len)
    return make_record(
        "effective_rank", eval_model, dataset=data["source"], split=split, offset=offset, seq_len=seq_len,
        tokens=rows * seq_len, center=center, activations="projection outputs before RoPE",
        pooled="heads concatenated (N x heads*head_dim)", layers=effective_ranks(eval_model.model, tokens, center),
    )  # fmt: skip


# ---- attention maps ------------------------------------------------------------------------------------


def reproduce_output(scores: AttentionScores) -> torch.Tensor:
    """The layer output implied by its maps: combine({name: map @ values}), (B, T, d_model)."""
    return scores.combine({name: probs @ scores.values[name] for name, probs in scores.maps.items()})


@dataclass
class AttentionMaps:
    """One prompt's maps, every layer. `maps`: map name -> (n_layers, H, T, S) fp32, in the order of the
    variant's scores() (mha, bottleneck, sliding, decoupled, mla: "attention"; diff, coda: "signal", then
    "noise", the inhibitory map whose weighted values are subtracted). S = T, or 1 + T with the null key in
    column 0. `probs` is the first map: the attention map, or the signal map of a differential variant."""

    maps: dict[str, np.ndarray]
    null: bool
    output_error: float  # max over layers of max|reproduced - actual output| / max|actual output|

    @property
    def probs(self) -> np.ndarray:
        return next(iter(self.maps.values()))


@torch.no_grad()
def attention_maps(model, tokens: torch.Tensor, rtol: float | None = None) -> AttentionMaps:
    """Every layer's attention probabilities for one prompt, tokens (T,) or (1, T), from each layer's
    `scores(x, positions)`. Raises if the maps do not reproduce a layer's output to rtol (relative to its
    largest entry; default 1e-4 in fp32, 3e-2 otherwise)."""
    tokens = tokens.reshape(1, -1)
    cap = capture(model, tokens)
    dtype = next(model.parameters()).dtype
    tolerance = rtol if rtol is not None else 1e-4 if dtype == torch.float32 else 3e-2
    maps: dict[str, list[np.ndarray]] = {}
    error, worst, null = 0.0, 0, False
    for i, (block, x, actual) in enumerate(zip(model.blocks, cap.inputs, cap.outputs, strict=True)):
        scores = block.attn.scores(x, cap.positions)
        actual = actual.float()
        miss = (reproduce_output(scores) - actual).abs().max().item() / actual.abs().max().clamp_min(1e-12).item()
        if miss > error:
            error, worst = miss, i
        null = scores.null
        for name, probs in scores.maps.items():  # (1, H, T, S) each
            maps.setdefault(name, []).append(probs[0].cpu().numpy())
    if error > tolerance:
        raise RuntimeError(
            f"recomputed attention maps miss the layer outputs by {error:.2e} (relative, tolerance {tolerance:.0e}) "
            f"at layer {worst}: {type(model.blocks[worst].attn).__name__}.scores() disagrees with its forward()"
        )
    return AttentionMaps({name: np.stack(layers) for name, layers in maps.items()}, null, error)


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
        raise InputError(f"tokenizer {tokenizer.name!r} does not decode the prompt back to itself, so regions in "
                         "characters cannot be told in tokens: give them in tokens (unit=tokens, regions={name: "
                         "[start, end]} in token positions)")  # fmt: skip
    if not 0 <= start < end:
        raise InputError(f"character region {start}:{end} is reversed or empty: a region [start, end) needs "
                         "0 <= start < end")  # fmt: skip
    if end > len(text):
        raise InputError(f"character region {start}:{end} is outside the prompt (its end is past its {len(text)} "
                         "characters)")  # fmt: skip
    # a token overlaps [start, end) if its span does; an empty span (part of character s) counts as [s, s + 1)
    hits = [i for i, (s, e) in enumerate(token_offsets(tokenizer, ids, text)) if s < end and max(e, s + 1) > start]
    return hits[0], hits[-1] + 1


UNITS = {"chars": "characters", "tokens": "tokens"}


def region_problems(regions, unit: str = "chars") -> list[str]:
    """Why `regions` cannot be attention_maps regions, each problem naming `regions.<name>`: a mapping of names to
    [start, end), whole numbers of `unit` (characters or tokens of the prompt) with 0 <= start < end."""
    example = "(e.g. {pass key: [16, 20]})"
    if not isinstance(regions, dict):
        return [f"regions={brief(regions)} must map each region's name to [start, end] {example}"]
    problems = []
    for name, span in regions.items():
        where = f"regions.{name}={brief(span)}"
        if not isinstance(name, str) or not name.strip():
            problems.append(f"regions: {brief(name)} is not a region's name (a non-empty string) {example}")
        elif not isinstance(span, list | tuple) or len(span) != 2:
            problems.append(f"{where} must be [start, end]: two whole numbers ({UNITS[unit]} of the prompt)")
        elif any(isinstance(x, bool) or not isinstance(x, int) for x in span):
            bad = next(x for x in span if isinstance(x, bool) or not isinstance(x, int))
            problems.append(f"{where} holds {brief(bad)}: start and end are whole numbers ({UNITS[unit]} of the "
                            "prompt)")  # fmt: skip
        elif span[0] < 0:
            problems.append(f"{where}: start must be >= 0")
        elif span[0] >= span[1]:
            what = "reversed" if span[0] > span[1] else "empty"
            problems.append(f"{where} is {what}: a region [start, end) needs start < end (e.g. [{min(span)}, "
                            f"{max(span[1], span[0] + 1) if what == 'empty' else max(span)}])")  # fmt: skip
    return problems


def run_attention_maps(
    eval_model,
    prompt: str,
    maps_path: str | Path,
    regions: dict[str, tuple[int, int]] | None = None,
    unit: str = "chars",
) -> dict:
    """An `attention_maps` record for one prompt; the maps go to maps_path (.npz, written atomically) and the
    record names that file. The .npz holds the first map under key "probs" (the attention map; diff and coda:
    the signal map) and any other map under its own name (diff and coda: "noise"); the record's `map_names`
    lists the layer's maps in that order. regions: name -> (start, end), in characters of the prompt
    (unit="chars") or tokens (unit="tokens"); each gets its mass per layer and head on the first map (see
    region_mass), and `<name>_mass` on each other map (diff, coda: `noise_mass`)."""
    if unit not in ("chars", "tokens"):
        raise ConfigError(f"unit={unit!r} must be chars or tokens (the regions' start and end are counted in it)")
    problems = region_problems(regions or {}, unit)
    if problems:
        raise ConfigError(problems)
    tokenizer = eval_model.tokenizer
    ids = tokenizer.encode(prompt)
    if not ids or len(ids) > eval_model.cfg.max_seq_len:
        raise InputError(f"prompt={brief(prompt)} has {len(ids)} tokens: give one of 1..{eval_model.cfg.max_seq_len} "
                         "tokens (the model's max_seq_len)")  # fmt: skip
    memory = eval_model.cfg.memory
    if memory.kind != "none" and len(ids) > memory.block_size:
        # The model reads a longer prompt in blocks, the later ones through its memory: one pass's maps are not
        # what those queries saw. The first block, from an empty memory, attends in full (the maps are right).
        raise InputError(f"prompt={brief(prompt)} has {len(ids)} tokens: a model with memory.kind={memory.kind} "
                         f"reads a prompt in blocks of {memory.block_size} tokens (memory.block), the later ones "
                         "through its memory, which one pass's attention maps cannot show: give a prompt of at most "
                         f"{memory.block_size} tokens")  # fmt: skip
    maps = attention_maps(eval_model.model, torch.tensor(ids))
    names = list(maps.maps)
    rows = []
    for region, (start, end) in (regions or {}).items():
        span = char_region_to_tokens(tokenizer, prompt, ids, start, end) if unit == "chars" else (start, end)
        mass = region_mass(maps.probs, *span, null=maps.null)  # (n_layers, H)
        row = {
            "name": region, unit: [start, end], "tokens": list(span), "text": tokenizer.decode(ids[slice(*span)]),
            "mass": mass.round(6).tolist(), "mass_by_layer": mass.mean(axis=1).round(6).tolist(),
        }  # fmt: skip
        for name in names[1:]:
            row[f"{name}_mass"] = region_mass(maps.maps[name], *span, null=maps.null).round(6).tolist()
        rows.append(row)
    maps_path = Path(maps_path)
    save_maps(maps_path, maps.probs, **{name: maps.maps[name] for name in names[1:]})
    return make_record(
        "attention_maps", eval_model, prompt=prompt, token_ids=ids, token_text=[tokenizer.decode([i]) for i in ids],
        n_layers=maps.probs.shape[0], n_heads=maps.probs.shape[1], null=maps.null, map_names=names,
        maps_file=maps_path.name, output_error=maps.output_error, regions=rows,
    )  # fmt: skip


def save_maps(path: Path, probs: np.ndarray, **others: np.ndarray) -> Path:
    """Writes maps (n_layers, H, T, S) as fp32 to a compressed .npz, atomically: probs under key "probs", each
    of `others` under its own name (e.g. noise=...). The file gets the usual permissions (0o644 under the
    common umask 022), like the records written beside it."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, probs=probs.astype(np.float32), **{k: v.astype(np.float32) for k, v in others.items()})
    atomic_write_bytes(path, buffer.getvalue())
    return path


def load_maps(record: dict, records_dir: str | Path, name: str = "probs") -> np.ndarray:
    """The (n_layers, H, T, S) maps of an attention_maps record, from the .npz beside its records file: the
    first map ("probs"), or another map by name (diff, coda: "noise")."""
    path = Path(records_dir) / record["maps_file"]
    if not path.exists():
        raise DataError(f"{path}: attention maps file named by the record is missing")
    with np.load(path) as data:
        if name not in data.files:
            raise DataError(f"{path}: no map {name!r} in this file (it holds {', '.join(data.files)})")
        return data[name]
