"""Whether a model can start from another's weights (a later phase from the previous one, a target from its
init_from target): the same tensors of the same shapes, except a memory's, which a phase may add (its write gate
and EMA rate start fresh). train() loads them so; a manifest checks it from the two configs before anything runs.
"""

from __future__ import annotations

import torch

from attnlab.config import ModelConfig
from attnlab.model.transformer import build_model


def misfits(shapes: dict, given: dict) -> tuple[list[str], list[str]]:
    """(tensors whose shapes differ, tensors missing or unexpected): the model's `shapes` ({name: shape}) against
    the weights `given` ({name: shape}); a missing memory tensor is no misfit."""
    wrong = [f"{k} {tuple(v)} vs {tuple(shapes[k])}" for k, v in given.items() if k in shapes and v != shapes[k]]
    other = [k for k in shapes if k not in given and ".memory." not in k] + [k for k in given if k not in shapes]
    return wrong, other


def _flat(value: dict, prefix: str = "") -> dict:
    out = {}
    for key, item in value.items():
        out.update(_flat(item, f"{prefix}{key}.") if isinstance(item, dict) else {f"{prefix}{key}": item})
    return out


def architecture_problem(cfg: ModelConfig, before: ModelConfig, whose: str) -> str | None:
    """Why a model of `cfg` cannot start from the weights of a model of `before` (the config keys that differ:
    "d_model 64, phase p1's 32"), or None. whose: how the other model is named ("phase p1's")."""
    with torch.device("meta"):  # the weights' names and shapes, without their memory
        shapes = {k: v.shape for k, v in build_model(cfg).state_dict().items()}
        given = {k: v.shape for k, v in build_model(before).state_dict().items()}
    wrong, other = misfits(shapes, given)
    if not wrong and not other:
        return None
    now, then = _flat(cfg.to_dict()), _flat(before.to_dict())
    keys = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k) and k != "name")
    keys = [k for k in keys if not k.startswith("memory.")] or keys  # a memory may be added: what else changed
    keys = [k for k in keys if k.endswith("kind")] or keys  # another kind: its options differ as a matter of course
    differ = [f"{k} {now.get(k)!r}, {whose} {then.get(k)!r}" for k in keys]
    shown = "; ".join(differ[:3]) + ("; ..." if len(differ) > 3 else "")
    shown = shown or "tensors " + ", ".join((wrong + other)[:3])
    return (f"its model cannot start from {whose} weights ({shown}): it needs the same architecture and vocabulary "
            "(only a memory may be added)")  # fmt: skip
