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
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from attnlab.config import ModelConfig
from attnlab.config_io import model_config_from_dict
from attnlab.data.files import atomic_path, atomic_write_text
from attnlab.errors import AttnlabError
from attnlab.model.transformer import Transformer, build_model


class CheckpointError(AttnlabError):
    """A checkpoint cannot be written or read."""


def write_json_atomic(path: Path, data) -> None:
    """`data` as JSON to `path`, atomically and flushed to the disk before the rename."""
    atomic_write_text(path, json.dumps(data, indent=1), durable=True)


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
        try:
            with atomic_path(final, durable=True) as tmp:  # the folder, all its files flushed, then renamed
                tmp.mkdir()
                save_model(unwrap(model), str(tmp / "model.safetensors"), metadata={"step": str(trainer["step"])})
                state = {"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}
                torch.save(state, tmp / "optimizer.pt")
                (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1))
                (tmp / "config.json").write_text(json.dumps(config, indent=1))
                shutil.copymode(tmp / "config.json", tmp / "model.safetensors")  # safetensors makes it 0o600
        except OSError as e:
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


@dataclass
class LoadedCheckpoint:
    folder: Path  # the checkpoint folder read (<run>/checkpoints/step-N for a run's checkpoint)
    config: dict  # the full resolved config saved with it (model; data and train for a run's checkpoint)
    cfg: ModelConfig
    model: Transformer  # eval mode

    @property
    def run_dir(self) -> Path:
        """The run the checkpoint belongs to (its folder's grandparent): where its tokenizer/ folder is."""
        return self.folder.parent.parent


def load_checkpoint(path: str | Path, tag: str = "best") -> LoadedCheckpoint:
    """The model and config of a run directory (its `tag` checkpoint, else its last) or of a checkpoint
    folder, the model in eval mode. Reads safetensors and JSON only."""
    path = Path(path)
    checkpoint = (
        find_checkpoint(path, tag) or find_checkpoint(path, "last") if (path / "checkpoints").exists() else None
    )
    folder = checkpoint.path if checkpoint else path
    if not (folder / "model.safetensors").exists():
        raise CheckpointError(
            f"{path}: no checkpoint here (expected a run directory or a folder with model.safetensors)"
        )
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        detail = e.strerror if isinstance(e, OSError) else e
        raise CheckpointError(f"{config_path}: unreadable ({detail}); the checkpoint is incomplete") from None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(f"{config_path}: no model config in it (expected an object with a 'model' key)")
    cfg = model_config_from_dict(config["model"], source=str(config_path))
    model = build_model(cfg)
    load_weights(model, folder)
    return LoadedCheckpoint(folder, config, cfg, model.eval())


def load_model_from_checkpoint(path: str | Path, tag: str = "best") -> tuple[ModelConfig, Transformer]:
    """(config, model) from a run directory (its `tag` checkpoint) or a checkpoint folder, in eval mode."""
    loaded = load_checkpoint(path, tag)
    return loaded.cfg, loaded.model
