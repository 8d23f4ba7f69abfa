"""Checkpoints that never lose work and never execute code when loaded.

    <run>/checkpoints/step-000200/   model.safetensors  optimizer.pt  trainer.json  config.json
    <run>/checkpoints/last.json      {"dir": "step-000200", "step": 200}   (and best.json)

A checkpoint folder is written under a temporary name and renamed into place; the last.json / best.json
pointers are then replaced atomically, so an interruption (or a full disk) at any moment leaves the
previous checkpoint intact. Folders no pointer names any more are removed. Weights are safetensors;
optimizer and RNG state are read with torch.load(weights_only=True).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from attnlab.errors import AttnlabError


class CheckpointError(AttnlabError):
    """A checkpoint cannot be written or read."""


def write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model inside DistributedDataParallel and/or torch.compile wrappers."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


@dataclass
class Checkpoint:
    path: Path
    step: int
    trainer: dict  # step, tokens, sampler and RNG state, best validation loss, ...
    config: dict  # the full resolved config of the run


def save_checkpoint(run_dir: Path, model, optimizer, trainer: dict, config: dict, tags=("last",)) -> Path:
    """Writes step-<trainer['step']> and points each tag (last, best) at it."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{trainer['step']:06d}"
    if not final.exists():
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            save_model(unwrap(model), str(tmp / "model.safetensors"), metadata={"step": str(trainer["step"])})
            torch.save({"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}, tmp / "optimizer.pt")
            write_json_atomic(tmp / "trainer.json", trainer)
            write_json_atomic(tmp / "config.json", config)
            os.rename(tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            previous = read_pointer(root, "last")
            kept = f"the previous checkpoint (step {previous['step']}) is intact" if previous else "nothing was kept"
            raise CheckpointError(f"could not write checkpoint {final}: {e.strerror or e}; {kept}") from None
    for tag in tags:
        write_json_atomic(root / f"{tag}.json", {"dir": final.name, "step": trainer["step"]})
    _remove_unreferenced(root)
    return final


def read_pointer(root: Path, tag: str) -> dict | None:
    path = Path(root) / f"{tag}.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: unreadable ({e}); delete it to start over") from None


def _remove_unreferenced(root: Path) -> None:
    keep = {p["dir"] for tag in ("last", "best") if (p := read_pointer(root, tag))}
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith("step-") and path.name not in keep:
            shutil.rmtree(path, ignore_errors=True)


def find_checkpoint(run_dir: Path, tag: str = "last") -> Checkpoint | None:
    """The checkpoint a tag points at, or None when the run has none."""
    root = Path(run_dir) / "checkpoints"
    pointer = read_pointer(root, tag)
    if pointer is None:
        return None
    path = root / pointer["dir"]
    try:
        trainer = json.loads((path / "trainer.json").read_text())
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: incomplete or corrupt checkpoint ({e}); delete it to start over") from None
    return Checkpoint(path, pointer["step"], trainer, config)


def load_weights(model: torch.nn.Module, checkpoint: Checkpoint | Path) -> None:
    path = Path(getattr(checkpoint, "path", checkpoint)) / "model.safetensors"
    try:
        missing, unexpected = load_model(unwrap(model), str(path), strict=False)
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: weights do not fit this model ({str(e).splitlines()[0]})") from None
    if missing or unexpected:
        detail = f"missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
        raise CheckpointError(f"{path}: weights do not fit this model ({detail})")


def load_optimizer(optimizer, checkpoint: Checkpoint) -> None:
    state = torch.load(checkpoint.path / "optimizer.pt", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])


def load_model_from_checkpoint(path: str | Path, tag: str = "best"):
    """(config, model) from a run directory (its `tag` checkpoint) or a checkpoint folder, in eval mode."""
    from attnlab.config_io import model_config_from_dict
    from attnlab.model.transformer import build_model

    path = Path(path)
    checkpoint = (
        find_checkpoint(path, tag) or find_checkpoint(path, "last") if (path / "checkpoints").exists() else None
    )
    folder = checkpoint.path if checkpoint else path
    if not (folder / "model.safetensors").exists():
        raise CheckpointError(
            f"{path}: no checkpoint here (expected a run directory or a folder with model.safetensors)"
        )
    config = json.loads((folder / "config.json").read_text())
    cfg = model_config_from_dict(config["model"], source=str(folder / "config.json"))
    model = build_model(cfg)
    load_weights(model, folder)
    return cfg, model.eval()
