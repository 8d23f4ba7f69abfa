"""Whether a model can start from another's weights (a later phase from the previous one, a target from its
init_from target): the same tensors of the same shapes, except a memory's, which a phase may add (its write gate
and EMA rate start fresh), read alike: the same heads, RoPE and norm (tensors of the same shapes split into other
heads, or rotated by another RoPE, would compute something else). train() loads them so; a manifest checks it from
the two configs before anything runs.
"""

from __future__ import annotations

import dataclasses

import torch

from attnlab.config import ModelConfig
from attnlab.model.transformer import build_model


def misfits(shapes: dict, given: dict) -> tuple[list[str], list[str]]:
    """(tensors whose shapes differ, tensors missing or unexpected): the model's `shapes` ({name: shape}) against
    the weights `given` ({name: shape}); a missing memory tensor is no misfit."""
    wrong = [f"{k} {tuple(v)} vs {tuple(shapes[k])}" for k, v in given.items() if k in shapes and v != shapes[k]]
    other = [k for k in shapes if k not in given and ".memory." not in k] + [k for k in given if k not in shapes]
    return wrong, other


# ModelConfig keys that change how the same tensors are read: split into other heads, rotated by other angles or
# pairs, normalised otherwise, another MLP (a pretrained model's are fixed likewise, manifest_pretrained).
READING_KEYS = ("n_heads", "rope_base", "rope_interleaved", "rope_scaling", "norm_eps", "mlp")
# Attention options the weights do not fix: a sliding window (how far back a query reads), MLA's decode path, the
# value CoDA's gate bias starts from.
FREE_ATTENTION_KEYS = ("kind", "window", "absorb", "gate_bias")
# Attention kinds with the same tensors read the same way: sliding is mha limited to a window (a model trained with
# full attention may be restricted to one, or the other way round). Any other kind change is another model.
SAME_TENSOR_KINDS = frozenset(("mha", "sliding"))
TWO_KINDS = "mha and sliding"  # as docs/guarantees.md and the refusal say it


def _unwindowed(cfg: ModelConfig):
    """The cache layout of `cfg`'s attention without its window and decode path: its resolved widths, KV heads and
    RoPE."""
    return dataclasses.replace(cfg.attention.cache_layout(cfg), window=None, read=None)


def reading_changes(cfg: ModelConfig, before: ModelConfig) -> list[str]:
    """The config keys (e.g. "n_heads", "attention.kind") whose values differ between `cfg` and `before` and would
    have the weights of `before` read otherwise by a model of `cfg`, whatever their shapes."""
    keys = [key for key in READING_KEYS if getattr(cfg, key) != getattr(before, key)]
    now, then = cfg.attention, before.attention
    if now.kind != then.kind and not {now.kind, then.kind} <= SAME_TENSOR_KINDS:
        return [*keys, "attention.kind"]
    mine, theirs = now.to_dict(), then.to_dict()
    differ = [key for key in sorted(mine.keys() | theirs.keys())
              if key not in FREE_ATTENTION_KEYS and mine.get(key) != theirs.get(key)]  # fmt: skip
    # An option left out (None: resolved from the model, e.g. head_dim = d_model / n_heads) differs only when what it
    # resolves to does: the layout's widths and KV heads say.
    unset = [key for key in differ if mine.get(key) is None or theirs.get(key) is None]
    if unset and _unwindowed(cfg) == _unwindowed(before):
        differ = [key for key in differ if key not in unset]
    return keys + [f"attention.{key}" for key in differ]


def _flat(value: dict, prefix: str = "") -> dict:
    out = {}
    for key, item in value.items():
        out.update(_flat(item, f"{prefix}{key}.") if isinstance(item, dict) else {f"{prefix}{key}": item})
    return out


NEEDS = (
    "it needs the same architecture and vocabulary (only a memory may be added, and max_seq_len or the attention's "
    f"window changed: {TWO_KINDS} differ only in it)"
)


def architecture_problem(cfg: ModelConfig, before: ModelConfig, whose: str) -> str | None:
    """Why a model of `cfg` cannot start from the weights of a model of `before` (the config keys that differ:
    "d_model 64, phase p1's 32"), or None. whose: how the other model is named ("phase p1's")."""
    with torch.device("meta"):  # the weights' names and shapes, without their memory
        shapes = {k: v.shape for k, v in build_model(cfg).state_dict().items()}
        given = {k: v.shape for k, v in build_model(before).state_dict().items()}
    wrong, other = misfits(shapes, given)
    if not wrong and not other:  # the same tensors: are they read alike?
        return reading_problem(cfg, before, whose)
    now, then = _flat(cfg.to_dict()), _flat(before.to_dict())
    keys = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k) and k != "name")
    keys = [k for k in keys if not k.startswith("memory.")] or keys  # a memory may be added: what else changed
    keys = [k for k in keys if k.endswith("kind")] or keys  # another kind: its options differ as a matter of course
    keys = [k for k in keys if k.rsplit(".", 1)[-1] not in FREE_ATTENTION_KEYS[1:]] or keys  # not what misfits
    differ = [f"{k} {now.get(k)!r}, {whose} {then.get(k)!r}" for k in keys]
    shown = _shown(differ) or "tensors " + ", ".join((wrong + other)[:3])
    return f"its model cannot start from {whose} weights ({shown}): {NEEDS}"


def reading_problem(cfg: ModelConfig, before: ModelConfig, whose: str) -> str | None:
    """Why a model of `cfg` cannot start from the weights of a model of `before` of the same tensors (they would be
    read otherwise: reading_changes), or None. whose: how the other model is named ("target a's")."""
    keys = reading_changes(cfg, before)
    if not keys:
        return None
    differ = [f"{k} {_value(cfg, k)!r}, {whose} {_value(before, k)!r}" for k in keys]
    return f"its model cannot start from {whose} weights ({_shown(differ)}; the same tensors, read otherwise): {NEEDS}"


def _value(cfg: ModelConfig, key: str):
    """cfg's value of a dotted config key ("attention.head_dim"); a RoPE scaling as its dict."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _shown(differ: list[str]) -> str:
    return "; ".join(differ[:3]) + ("; ..." if len(differ) > 3 else "")
