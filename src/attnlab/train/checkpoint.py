"""Checkpoints that never lose work, never execute code when loaded, and are checked before they are trusted.

    <run>/checkpoints/step-000200/   model.safetensors  optimizer.pt  trainer.json  config.json  checksums.json
    <run>/checkpoints/last.json      {"dir": "step-000200", "step": 200}   (and best.json)

A checkpoint folder is written under a temporary name and renamed into place; the last.json / best.json
pointers are then replaced atomically, so an interruption (or a full disk) at any moment leaves the
previous checkpoint intact. Folders no pointer names any more are removed, and so are the temporaries of
writers that died (killed, out of memory) before they could remove their own. Weights are safetensors;
optimizer and RNG state are read with torch.load(weights_only=True).

checksums.json, written last inside the folder, records every other file's size and sha256; each file is
checked against it whenever it is read (weights by every load, optimizer state on resume), so a damaged or
changed file is refused with one line naming it instead of being used. The weights' safetensors metadata says
the checkpoint has a checksums.json, so one that lost it is refused too. A checkpoint written before checksums
were recorded (neither) still loads, checked only for being readable.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_file, save_model

from attnlab.config import ModelConfig
from attnlab.config_io import model_config_from_dict
from attnlab.data.files import (
    atomic_path,
    atomic_write_text,
    failure_words,
    remove_stale_temporaries,
    sha256_file,
    short_write_error,
)
from attnlab.jsonio import loads_json
from attnlab.model.transformer import Transformer, build_model
from attnlab.ops.finite import all_finite
from attnlab.paths import blocking_file, system_folder
from attnlab.train.checkpoint_files import (  # noqa: F401 (names callers import from here)
    CHECKPOINT_FILES,
    CHECKSUMS,
    CHECKSUMS_FORMAT,
    CHECKSUMS_KEY,
    CONFIG,
    OPTIMIZER,
    TRAINER,
    WEIGHTS,
    CheckpointError,
    _fix,
    _misfits,
    _pointer_fix,
    _read_json,
    _stale_pointer,
    _unreadable_weights,
    pointer_text,
    read_pointer,
    recorded_checksums,
    step_folders,
    verify_file,
    weights_dtype_problem,
)

log = logging.getLogger(__name__)


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


def save_checkpoint(
    run_dir: Path, model, optimizer, trainer: dict, config: dict, tags=("last",), gathered=None
) -> Path:
    """Writes step-<trainer['step']> and points each tag (last, best) at it. gathered: (weights, optimizer state) of
    a sharded model, gathered to this process (train.fsdp), written instead of `model`'s and `optimizer`'s."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{trainer['step']:06d}"
    if not final.exists():
        writing = WEIGHTS
        try:
            with atomic_path(final, durable=True) as tmp:  # the folder, all its files flushed, then renamed
                tmp.mkdir()
                metadata = {"step": str(trainer["step"]), CHECKSUMS_KEY: CHECKSUMS}
                weights, optimizer_state = gathered or (model, named_optimizer_state(model, optimizer))
                save_weights(weights, tmp / WEIGHTS, metadata)
                writing = OPTIMIZER
                state = {"optimizer": optimizer_state, "torch_rng": torch.get_rng_state()}
                _save_torch(state, tmp / OPTIMIZER)
                writing = TRAINER
                (tmp / TRAINER).write_text(json.dumps(trainer, indent=1))
                writing = CONFIG
                (tmp / CONFIG).write_text(json.dumps(config, indent=1))
                shutil.copymode(tmp / CONFIG, tmp / WEIGHTS)  # safetensors makes it 0o600
                writing = CHECKSUMS
                files = {name: _fingerprint(tmp / name) for name in (WEIGHTS, OPTIMIZER, TRAINER, CONFIG)}
                (tmp / CHECKSUMS).write_text(json.dumps({"format": CHECKSUMS_FORMAT, "files": files}, indent=1))
        except (OSError, RuntimeError, SafetensorError) as e:  # a full disk: an OSError, or what wraps one
            why = failure_words(e)
            raise CheckpointError(f"could not write checkpoint {final}: {writing}: {why}; {_kept(root)}") from None
    for tag in tags:
        try:
            write_json_atomic(root / f"{tag}.json", {"dir": final.name, "step": trainer["step"]})
        except OSError as e:
            raise CheckpointError(f"could not write {root / tag}.json: {failure_words(e)}; {_kept(root)}") from None
    _remove_unreferenced(root)
    return final


def save_model_folder(folder: str | Path, model, config: dict, extra=None) -> Path:
    """A checkpoint folder outside a run, which load_checkpoint (and every model reference) reads: model.safetensors,
    config.json (`config`: {"model": ..., and anything else}), whatever `extra(tmp)` writes into the folder (a
    tokenizer/ folder, say) and checksums.json of the weights and config; written under a temporary name and renamed
    into place, so an interruption leaves nothing half-written. An existing folder is refused, not overwritten."""
    folder = Path(folder)
    if folder.exists():
        raise CheckpointError(f"{folder}: already exists (choose another --out, or delete it first)")
    in_the_way = blocking_file(folder)
    if in_the_way is not None:
        raise CheckpointError(f"{folder}: {in_the_way} is a file, not a folder, so nothing can be made under it "
                              "(choose another --out)")  # fmt: skip
    writing = "its folder"
    try:
        with atomic_path(folder, durable=True) as tmp:
            tmp.mkdir(parents=True)
            writing = WEIGHTS
            save_weights(model, tmp / WEIGHTS, {CHECKSUMS_KEY: CHECKSUMS})
            writing = CONFIG
            (tmp / CONFIG).write_text(json.dumps(config, indent=1))
            shutil.copymode(tmp / CONFIG, tmp / WEIGHTS)  # safetensors makes it 0o600
            if extra is not None:
                writing = "the rest"
                extra(tmp)
            writing = CHECKSUMS
            files = {name: _fingerprint(tmp / name) for name in (WEIGHTS, CONFIG)}
            (tmp / CHECKSUMS).write_text(json.dumps({"format": CHECKSUMS_FORMAT, "files": files}, indent=1))
    except (OSError, RuntimeError, SafetensorError) as e:
        system = system_folder(folder) if isinstance(e, FileNotFoundError) else None
        if system is not None:  # (mkdir says only 'No such file or directory')
            raise CheckpointError(
                f"could not write {folder}: {system} is on a virtual file system (such as /proc "
                "or /sys), which takes no new files or folders (choose another --out)"
            ) from None
        raise CheckpointError(f"could not write {folder}: {writing}: {failure_words(e)}; nothing was written") from None
    return folder


def save_weights(model, path: Path, metadata: dict[str, str]) -> None:
    """The model's weights (or a {name: tensor} dict of them, tied duplicates left out) as safetensors, byte for
    byte the same for the same weights and metadata: safetensors writes its metadata in a hash map's order, which
    changes from one save to the next (and the sha256 with it, which bench takes as the weights' identity), so the
    header is rewritten with its keys in a fixed order."""
    if isinstance(model, dict):
        save_file({name: t.contiguous() for name, t in model.items()}, str(path), metadata=metadata)
    else:
        save_model(unwrap(model), str(path), metadata=metadata)
    canonical_header(path)


def _optimized_names(model, optimizer) -> list[str]:
    """The name of each parameter the optimizer holds, in its order (the positions its state_dict uses)."""
    names = {id(p): name for name, p in unwrap(model).named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def named_optimizer_state(model, optimizer) -> dict:
    """optimizer.state_dict() with each parameter's position replaced by its name (as torch.distributed.checkpoint
    writes a sharded model's): the same file resumes one process, DDP or FSDP at any number of processes."""
    return _by_name(optimizer.state_dict(), _optimized_names(model, optimizer))


def _by_name(state: dict, order: list[str]) -> dict:
    """An optimizer state by parameter position (torch's, and optimizer.pt's before names were used) keyed by
    name."""
    return {
        "state": {order[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [order[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def _by_position(state: dict, order: list[str]) -> dict:
    """A named optimizer state keyed by the positions of this optimizer's parameters; KeyError naming a parameter
    this optimizer does not hold."""
    index = {name: i for i, name in enumerate(order)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in state["param_groups"]],
    }


def canonical_header(path: Path) -> None:
    """Rewrites a safetensors file's JSON header with sorted metadata and the tensors in the order of their data
    (the data itself is not moved); in place when the header keeps its length, as it does when only its order
    changed."""
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = loads_json(f.read(size))
        metadata = header.pop("__metadata__", None)
        ordered = dict(sorted(header.items(), key=lambda item: (item[1]["data_offsets"], item[0])))
        if metadata is not None:
            ordered = {"__metadata__": dict(sorted(metadata.items())), **ordered}
        text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)  # safetensors pads the header so that the data starts 8-byte aligned
        if len(text) == size:
            f.seek(8)
            f.write(text)
            return
    rewritten = path.with_name(path.name + ".header")
    with open(path, "rb") as source, open(rewritten, "wb") as target:
        source.seek(8 + size)
        target.write(len(text).to_bytes(8, "little") + text)
        shutil.copyfileobj(source, target, 1 << 24)
    rewritten.replace(path)


def _fingerprint(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _save_torch(state: dict, path: Path) -> None:
    """torch.save, its short write (a RuntimeError saying only where it stopped) told as the OSError it was."""
    try:
        torch.save(state, path)
    except RuntimeError as e:
        raise short_write_error(e, path) or e from None


def _kept(root: Path) -> str:
    try:
        previous = read_pointer(root, "last")
    except CheckpointError:
        previous = None
    return f"the previous checkpoint (step {previous['step']}) is intact" if previous else "nothing was kept"


def _remove_unreferenced(root: Path) -> None:
    """Deletes the checkpoints no pointer names: folders named as the trainer names them (step-NNNNNN) that hold
    only a checkpoint's files. Anything else in checkpoints/ (a user's step-000100-keep, a model converted into
    step-000900, a folder that is a link) is the user's and stays."""
    keep = {p["dir"] for tag in ("last", "best") if (p := read_pointer(root, tag))}
    for path in root.iterdir():
        if path.name in keep or not re.fullmatch(r"step-\d{6,}", path.name) or path.is_symlink() or not path.is_dir():
            continue
        names = {p.name for p in path.iterdir()}
        if TRAINER in names and names <= CHECKPOINT_FILES:  # (a model folder has no trainer state)
            shutil.rmtree(path, ignore_errors=True)
    # A writer killed mid-write (SIGKILL, out of memory) could not remove its temporary. One process writes a
    # run's checkpoints, so any temporary whose process is gone is stale, however recent.
    remove_stale_temporaries(root, r"step-\d+|last\.json|best\.json", idle_seconds=0)


# ----------------------------------------------------------------------------- reading


def find_checkpoint(run_dir: Path, tag: str = "last") -> Checkpoint | None:
    """The checkpoint a tag points at (its trainer.json and config.json checked), or None when the run has none. A
    run whose last.json is gone while its checkpoint folders are there is a CheckpointError, not a run without
    checkpoints (a resume would start over and its checkpoint rotation delete them)."""
    root = Path(run_dir) / "checkpoints"
    problem = checkpoints_folder_problem(run_dir)
    if problem:
        raise CheckpointError(problem)
    pointer = read_pointer(root, tag)
    if pointer is None:
        folders = step_folders(root) if tag == "last" else []
        if folders:
            raise CheckpointError(f"{run_dir}: no last.json in {root}, but {folders[-1].name} is there: to resume "
                                  f"from it write {pointer_text(folders[-1])} into {root}/last.json; to start over, "
                                  f"delete {root}")  # fmt: skip
        return None
    path = root / pointer["dir"]
    if not path.is_dir():
        raise CheckpointError(_stale_pointer(root, tag, pointer["dir"]))
    recorded = recorded_checksums(path)
    trainer, config = _read_json(path, TRAINER, recorded), _read_json(path, CONFIG, recorded)
    if not isinstance(trainer, dict) or not isinstance(config, dict):
        raise CheckpointError(f"{path}: incomplete or corrupt checkpoint (trainer.json and config.json must hold "
                              f"objects); {_fix(path)}")  # fmt: skip
    return Checkpoint(path, pointer["step"], trainer, config)


def checkpoints_folder_problem(run_dir: Path) -> str | None:
    """The line refusing a run folder whose checkpoints/ is a file (or a link to nothing), said before the run writes
    anything: the run would train from the start, replace its metrics log, and fail at its first checkpoint."""
    root = Path(run_dir) / "checkpoints"
    if root.is_dir() or not (root.exists() or root.is_symlink()):
        return None
    what = "a file" if root.exists() else f"a link to {os.readlink(root)}, which is missing"
    return (f"{root}: is {what}, where the run keeps its checkpoints (a folder): move it away (or delete it) and run "
            "again")  # fmt: skip


def load_weights(
    model: torch.nn.Module, checkpoint: Checkpoint | Path, header_only: bool = False, exact: bool = False
) -> None:
    """The checkpoint's weights into `model`, after checking model.safetensors against its recorded sha256 and its
    tensors' names and shapes (its header) against the model's. header_only: those checks alone, nothing loaded (a
    dry run's, with a model on the meta device). exact: a resume's, which continues the run bit-exactly: each tensor
    of the dtype the model holds it in (the run saves that dtype; weights re-saved in another are refused)."""
    folder = Path(getattr(checkpoint, "path", checkpoint))
    path = verify_file(folder, WEIGHTS, recorded_checksums(folder))
    if not path.exists():
        raise CheckpointError(f"{path}: missing (the checkpoint is incomplete); {_fix(folder)}")
    try:
        problem = weights_fit_problem(path, unwrap(model))
        if problem:
            raise CheckpointError(f"{path}: weights do not fit this model ({problem}); {_fix(folder)}")
        problem = weights_dtype_problem(path, unwrap(model)) if exact else None
        if problem:
            raise CheckpointError(f"{path}: {problem}, so the run would not resume exactly; {_fix(folder)}")
        if header_only:
            return
        missing, unexpected = load_model(unwrap(model), str(path), strict=False)
    except SafetensorError as e:
        raise _unreadable_weights(path, e) from None
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: weights do not fit this model ({_misfits(e)}); {_fix(folder)}") from None
    if missing or unexpected:
        detail = f"missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
        raise CheckpointError(f"{path}: weights do not fit this model ({detail})")
    bad = [name for name, p in unwrap(model).state_dict().items() if p.is_floating_point() and not all_finite(p)]
    if bad:  # a diverged run saves none (the loop stops first): these were written in, checksum or not
        raise CheckpointError(f"{path}: {len(bad)} weight tensor(s) hold NaN or infinity ({', '.join(bad[:3])}); "
                              f"{_fix(folder)}")  # fmt: skip


def load_resumed_weights(model: torch.nn.Module, checkpoint: Checkpoint, header_only: bool = False) -> None:
    """A resume's weights: the checkpoint's into `model` (header_only: checked only), each tensor in the dtype the run
    saves (load_weights' exact); and the run's best checkpoint, which it scores at its end, checked so now."""
    load_weights(model, checkpoint, header_only=header_only, exact=True)
    run_dir = checkpoint.path.parent.parent if checkpoint.path.parent.name == "checkpoints" else None
    best = find_checkpoint(run_dir, "best") if run_dir is not None else None
    if best is not None and best.path != checkpoint.path:
        load_weights(model, best, header_only=True, exact=True)


def weights_fit_problem(path: Path, model: torch.nn.Module) -> str | None:
    """What in a safetensors file's header (tensor names and shapes; no data read) does not fit `model`'s state dict:
    tensors of another shape (said first, as torch's load does), else names missing or unexpected; None when all fit.
    Of the names sharing one tensor (a tied LM head) the file holds one, as save_model writes it (load_model's rule)."""
    with safe_open(str(path), framework="pt") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    state = model.state_dict(keep_vars=True)  # (tied names: the same tensor object, on the meta device too)
    wrong = [f"{name} is [{', '.join(map(str, shapes[name]))}] in the file, [{', '.join(map(str, t.shape))}] in the "
             "model" for name, t in state.items() if name in shapes and shapes[name] != list(t.shape)]  # fmt: skip
    if wrong:
        return "; ".join(wrong[:3]) + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else "")
    shared: dict[int, list[str]] = {}
    for name, tensor in state.items():
        shared.setdefault(id(tensor), []).append(name)
    missing, unexpected = [], sorted(set(shapes) - set(state))
    for names in shared.values():
        held = sorted(name for name in names if name in shapes)
        missing += [] if held else [min(names)]
        unexpected += held[1:]
    if missing or unexpected:
        return f"missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
    return None


def load_optimizer(optimizer, checkpoint: Checkpoint, model) -> None:
    """The optimizer and torch RNG state of a checkpoint, after checking optimizer.pt against its sha256. `model`:
    the model whose parameters the optimizer holds (their names key the saved state); a sharded one (train.fsdp)
    takes the full state into its shards."""
    from attnlab.train.fsdp import is_sharded, load_full_optimizer

    path = verify_file(checkpoint.path, OPTIMIZER, recorded_checksums(checkpoint.path))
    try:
        with warnings.catch_warnings():  # torch's note on a pickle protocol: the refusal below says what matters
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(path, weights_only=True)  # never executes code: only tensors and plain data
        saved, order = state["optimizer"], _optimized_names(model, optimizer)
        by_position = all(isinstance(key, int) for key in saved["state"]) and all(
            isinstance(i, int) for group in saved["param_groups"] for i in group["params"]
        )  # written before parameters were named
        problem = _state_problem(_by_name(saved, order) if by_position else saved, model, order)
        if problem:
            raise CheckpointError(f"{path}: {problem}: it does not belong to this run's model; {_fix(path.parent)}")
        if is_sharded(unwrap(model)):
            load_full_optimizer(unwrap(model), optimizer, _by_name(saved, order) if by_position else saved)
        else:
            optimizer.load_state_dict(saved if by_position else _by_position(saved, order))
        torch.set_rng_state(state["torch_rng"])
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {_fix(path.parent)}") from None
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"{path}: refused: it holds Python objects besides tensors and plain data (objects that could run "
            f"code are never loaded), or it is damaged; {_fix(path.parent)}"
        ) from None
    except (EOFError, RuntimeError, OSError, KeyError, TypeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"{path}: not a readable optimizer state ({type(e).__name__}{': ' + first if first else ''}): it was "
            f"truncated or damaged; {_fix(path.parent)}"
        ) from None


def _state_problem(saved: dict, model, order: list[str]) -> str | None:
    """What in a named optimizer state does not fit the parameters the optimizer trains: other names (missing or
    extra) or moments of another shape (the full shape, for a sharded model)."""
    groups = [name for group in saved["param_groups"] for name in group["params"]]
    if sorted(groups) != sorted(order):
        missing, extra = sorted(set(order) - set(groups)), sorted(set(groups) - set(order))
        return f"its parameter groups list {len(groups)} parameters, the optimizer trains {len(order)}" + (
            f" (missing {missing[0]})" if missing else f" ({extra[0]} is not trained here)" if extra else ""
        )
    params = dict(unwrap(model).named_parameters())
    for name in order:  # (a parameter that never had a gradient has no state: not a problem)
        for key, value in saved["state"].get(name, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() and tuple(value.shape) != tuple(params[name].shape):
                return (f"{key} of {name} has shape {list(value.shape)}, the parameter "
                        f"{list(params[name].shape)}")  # fmt: skip
    extra = sorted(set(saved["state"]) - set(order))
    return f"optimizer state for {extra[0]}, which this optimizer does not train" if extra else None


@dataclass
class LoadedCheckpoint:
    folder: Path  # the checkpoint folder read (<run>/checkpoints/step-N for a run's checkpoint)
    config: dict  # the full resolved config saved with it (model; data and train for a run's checkpoint)
    cfg: ModelConfig
    model: Transformer  # eval mode
    trainer: dict | None = None  # the trainer state saved with a run's checkpoint (None for a model folder)

    @property
    def run_dir(self) -> Path:
        """The run the checkpoint belongs to (<run>/checkpoints/step-N: its folder's grandparent), where its
        tokenizer/ folder is; a model folder outside a run (attnlab convert's, a manifest's <target>/converted) is
        its own."""
        return self.folder.parent.parent if self.folder.parent.name == "checkpoints" else self.folder


RACE_TRIES = 3  # reads of a training run's checkpoint that its trainer may replace as it is read


def load_checkpoint(path: str | Path, tag: str = "best") -> LoadedCheckpoint:
    """The model and config of a run directory (its `tag` checkpoint, else its last) or of a checkpoint
    folder, the model in eval mode. Reads safetensors and JSON only, each file checked against its sha256. A run
    that is training moves its pointers on and deletes the checkpoint they named: a read that fails while the
    pointers changed reads the new checkpoint (its warnings are said only for the read that is kept)."""
    path, tries = Path(path), 1
    while True:  # (a read that fails while the pointers changed reads again, RACE_TRIES times in all)
        before, error = _pointed(path), None
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                loaded = _load_checkpoint(path, tag)
            except CheckpointError as e:
                error = e
        if error is None or tries == RACE_TRIES or before is None or _pointed(path) == before:
            for item in said:
                warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)
            if error is not None:
                raise error
            return loaded
        tries += 1


def _pointed(path: Path) -> tuple | None:
    """The folders a run's last.json and best.json name now; None when they cannot be read (or it is no run)."""
    try:
        return tuple((read_pointer(path / "checkpoints", tag) or {}).get("dir") for tag in ("last", "best"))
    except (CheckpointError, OSError):
        return None


def _load_checkpoint(path: Path, tag: str) -> LoadedCheckpoint:
    root = path / "checkpoints"
    folders = step_folders(root)
    if folders and not any((root / f"{name}.json").exists() for name in ("best", "last")):  # both pointers gone
        raise CheckpointError(
            f"{path}: no last.json or best.json in {root}, but {folders[-1].name} is there: give "
            f"{folders[-1]} itself, or write {pointer_text(folders[-1])} into {root}/last.json"
        )
    checkpoint = find_checkpoint(path, tag) or find_checkpoint(path, "last") if root.exists() else None
    folder = checkpoint.path if checkpoint else path
    if checkpoint is None and not (folder / WEIGHTS).exists():
        raise CheckpointError(
            f"{path}: no checkpoint here (expected a run directory or a folder with model.safetensors)"
        )
    config_path = folder / CONFIG
    if checkpoint is not None:
        config, trainer = checkpoint.config, checkpoint.trainer
    else:
        recorded = recorded_checksums(folder)
        if not config_path.exists():
            missing = "unreadable (No such file or directory); the checkpoint is incomplete"
            raise CheckpointError(f"{config_path}: {missing}")
        config = _read_json(folder, CONFIG, recorded)
        # a run's step-N folder: its trainer state (what it recorded of the run's tokenizer), checked like the rest
        trainer = _read_json(folder, TRAINER, recorded) if recorded is not None and TRAINER in recorded else None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(f"{config_path}: no model config in it (expected an object with a 'model' key)")
    cfg = model_config_from_dict(config["model"], source=str(config_path), saved=True)
    model = build_model(cfg, init=False)  # load_weights fills every tensor, or refuses the checkpoint
    load_weights(model, folder)
    return LoadedCheckpoint(folder, config, cfg, model.eval(), trainer if isinstance(trainer, dict) else None)


def load_model_from_checkpoint(path: str | Path, tag: str = "best") -> tuple[ModelConfig, Transformer]:
    """(config, model) from a run directory (its `tag` checkpoint) or a checkpoint folder, in eval mode."""
    loaded = load_checkpoint(path, tag)
    return loaded.cfg, loaded.model
