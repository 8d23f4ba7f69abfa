"""A checkpoint's files and their checks (attnlab.train.checkpoint writes and reads them): the names, the
checksums.json that records every other file's size and sha256, and the one-line refusals for a file that is
missing, damaged or changed.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from attnlab.data.files import failure_words, file_kind, sha256_file
from attnlab.errors import AttnlabWarning, DataError
from attnlab.jsonio import loads_json

WEIGHTS, OPTIMIZER, TRAINER, CONFIG = "model.safetensors", "optimizer.pt", "trainer.json", "config.json"
CHECKSUMS = "checksums.json"
CHECKPOINT_FILES = {WEIGHTS, OPTIMIZER, TRAINER, CONFIG, CHECKSUMS}  # what save_checkpoint writes, and nothing else
CHECKSUMS_FORMAT = "attnlab-checkpoint-checksums"
CHECKSUMS_KEY = "attnlab.checksums"  # in the weights' safetensors metadata: this checkpoint has a checksums.json

_unchecked_warned: set[Path] = set()  # checkpoints from before checksums, warned about once per process


class CheckpointError(DataError):
    """A checkpoint cannot be written or read (missing, damaged, changed, or not for this model)."""


def _fix(folder: Path) -> str:
    if folder.parent.name == "checkpoints":
        return f"restore it from a copy, or delete {folder.parent} to train the run again from the start"
    made = _conversion_of(folder)
    if made == "run":  # <out>/<manifest>/<target>/converted: the run made it and makes it again
        return f"delete {folder}: `attnlab run` converts the target's init_from model into it again"
    if made == "convert":
        return f"restore it from a copy, or delete {folder} and make it again with `attnlab convert`"
    return "restore it from a copy of the checkpoint"


def _conversion_of(folder: Path) -> str | None:
    """ "run" for a conversion `attnlab run` made for a target (its config.json holds the recipe), "convert" for one
    `attnlab convert` made, None for another folder or a config.json that cannot be read (said apart)."""
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(config, dict) or "conversion" not in config:
        return None
    return "run" if "recipe" in config else "convert"


def recorded_checksums(folder: Path) -> dict | None:
    """{file name: {"bytes", "sha256"}} recorded when the checkpoint was written; None for a checkpoint written
    before checksums were (no checksums.json, and its weights do not say it had one)."""
    folder = Path(folder)
    path = folder / CHECKSUMS
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if _weights_say_checksummed(folder):
            raise CheckpointError(
                f"{path}: missing, but {WEIGHTS} records that the checkpoint was written with it (the checkpoint "
                f"was changed or copied in part); {_fix(folder)}"
            ) from None
        if folder not in _unchecked_warned:
            _unchecked_warned.add(folder)
            warnings.warn(
                f"{folder}: no {CHECKSUMS} (written by an older attnlab): its files cannot be checked",
                AttnlabWarning,
                stacklevel=2,
            )
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({failure_words(e)}); {_fix(folder)}") from None
    try:
        data = loads_json(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}): it was damaged or changed; {_fix(folder)}") from None
    files = data.get("files") if isinstance(data, dict) and data.get("format") == CHECKSUMS_FORMAT else None
    if not isinstance(files, dict) or not all(
        isinstance(entry, dict)
        and isinstance(entry.get("bytes"), int)
        and isinstance(entry.get("sha256"), str)
        and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])
        for entry in files.values()
    ):
        raise CheckpointError(
            f"{path}: not a checkpoint checksum list (expected format {CHECKSUMS_FORMAT!r} and files: {{name: "
            f"{{bytes, sha256}}}}): the file was damaged or changed; {_fix(folder)}"
        )
    return files


def _weights_say_checksummed(folder: Path) -> bool:
    weights = folder / WEIGHTS
    if not weights.exists():
        return False
    try:
        with safe_open(str(weights), "pt") as f:
            metadata = f.metadata() or {}
    except SafetensorError as e:
        raise _unreadable_weights(weights, e) from None
    except OSError as e:
        raise CheckpointError(f"{weights}: unreadable ({failure_words(e)}); {_fix(folder)}") from None
    return CHECKSUMS_KEY in metadata


def verify_file(folder: Path, name: str, recorded: dict | None) -> Path:
    """folder/name, after checking its size and sha256 against `recorded` (recorded_checksums(folder)); nothing
    is checked when None (a checkpoint from before checksums)."""
    path = Path(folder) / name
    if recorded is None:
        return path
    if name not in recorded:
        raise CheckpointError(f"{path}: not listed in {CHECKSUMS} (the checkpoint was changed); {_fix(path.parent)}")
    expected = recorded[name]
    try:
        size, kind = path.stat().st_size, file_kind(path)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: missing, but {CHECKSUMS} records it ({expected['bytes']:,} bytes); {_fix(path.parent)}"
        ) from None
    if kind is not None:  # (a folder's size is its directory entries', no truncation)
        raise CheckpointError(f"{path}: {kind}, where {CHECKSUMS} records a file of {expected['bytes']:,} bytes; "
                              f"{_fix(path.parent)}")  # fmt: skip
    if size != expected["bytes"]:
        found = "empty" if size == 0 else f"{size:,} bytes"
        raise CheckpointError(
            f"{path}: {found}, but {expected['bytes']:,} bytes were written (the file was truncated, damaged or "
            f"changed); {_fix(path.parent)}"
        )
    try:
        digest = sha256_file(path)
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({failure_words(e)}); {_fix(path.parent)}") from None
    if digest != expected["sha256"]:
        raise CheckpointError(
            f"{path}: sha256 does not match the one recorded when it was written (the file was damaged or "
            f"changed); {_fix(path.parent)}"
        )
    return path


def _read_json(folder: Path, name: str, recorded: dict | None):
    path = verify_file(folder, name, recorded)
    try:
        return loads_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        detail = e.strerror if isinstance(e, OSError) else e
        raise CheckpointError(f"{path}: unreadable ({detail}); the checkpoint is incomplete or damaged") from None


SIZE_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\(\[([^\]]*)\]\) from "
                           r"checkpoint, the shape in current model is torch\.Size\(\[([^\]]*)\]\)")  # fmt: skip


def _misfits(error: BaseException) -> str:
    """torch's load_state_dict error on one line: the first three tensors whose shapes differ, else its text."""
    found = SIZE_MISMATCH.findall(str(error))
    if not found:
        return " ".join(str(error).split())
    shown = "; ".join(f"{name} is [{file}] in the file, [{model}] in the model" for name, file, model in found[:3])
    return shown + (f"; and {len(found) - 3} more" if len(found) > 3 else "")


def _unreadable_weights(path: Path, error: BaseException) -> CheckpointError:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return CheckpointError(f"{path}: not a readable safetensors file ({first}): it was truncated or damaged; "
                           f"{_fix(path.parent)}")  # fmt: skip


# safetensors' names of the dtypes a model's state holds
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}  # fmt: skip


def weights_dtype_problem(path: Path, model: torch.nn.Module) -> str | None:
    """Which tensors of a safetensors file (its header; no data read) are of another dtype than `model` holds them
    in (a run saves its weights in the dtype it trains them in), or None; once their names and shapes fit
    (checkpoint.weights_fit_problem)."""
    state = model.state_dict()
    with safe_open(str(path), framework="pt") as f:
        found = {name: f.get_slice(name).get_dtype() for name in f.keys() if name in state}
    wrong = {name: dtype for name, dtype in found.items() if dtype != DTYPE_NAMES.get(state[name].dtype, "?")}
    if not wrong:
        return None
    first = min(wrong)
    more = f" and {len(wrong) - 1} more" if len(wrong) > 1 else ""
    saved = DTYPE_NAMES.get(state[first].dtype, state[first].dtype)
    return (f"{first}{more} {'are' if more else 'is'} {wrong[first]}, where the run saves {saved} (the file was "
            "re-saved in another dtype)")  # fmt: skip


# ----------------------------------------------------------------------------- pointers (last.json, best.json)


def read_pointer(root: Path, tag: str) -> dict | None:
    """{"dir": "step-N", "step": N} of a tag (last, best), or None when there is none."""
    path = Path(root) / f"{tag}.json"
    if not path.exists():
        return None
    try:
        pointer = loads_json(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); {_pointer_fix(Path(root), tag)}") from None
    if not (
        isinstance(pointer, dict)
        and isinstance(pointer.get("dir"), str)
        and re.fullmatch(r"step-\d+", pointer["dir"])
        and isinstance(pointer.get("step"), int)
    ):
        raise CheckpointError(f'{path}: not a checkpoint pointer (expected {{"dir": "step-N", "step": N}}); '
                              f"{_pointer_fix(Path(root), tag)}")  # fmt: skip
    if pointer["step"] != int(pointer["dir"][5:]):  # a resume (and a dry run) would count from the wrong step
        fix = _pointer_fix(Path(root), tag, Path(root) / pointer["dir"])
        raise CheckpointError(f"{path}: names {pointer['dir']} but step {pointer['step']} (a checkpoint folder holds "
                              f"the step in its name); {fix}")  # fmt: skip
    return pointer


def _pointer_fix(root: Path, tag: str, named: Path | None = None) -> str:
    """How to mend a damaged pointer (last.json, best.json), each way saying what it does: deleting last.json does not
    start the run over while checkpoint folders are there (find_checkpoint refuses that), and deleting best.json
    alone lets the run resume from its last checkpoint, forgetting which one scored best. named: the checkpoint
    folder the pointer names (its step wrong), proposed when it is there."""
    folders = step_folders(root)
    name = f"{tag}.json"
    if tag == "last":
        if not folders:
            return f"delete it and the run starts over (no checkpoint folder is left in {root})"
        target = named if named in folders else folders[-1]
        return (f"write {pointer_text(target)} into {name} to resume from step {int(target.name[5:])}, or delete "
                f"{root} to start over")  # fmt: skip
    try:
        last = read_pointer(root, "last")
    except CheckpointError:
        last = None
    if last is None or not (root / last["dir"]).is_dir():  # (a resume refuses the last pointer first)
        return f"write the pointer of the run's best checkpoint into {name}, or delete it alone"
    earlier = [f for f in folders if int(f.name[5:]) < last["step"]]  # the best is the last or an earlier one
    best, why = (named, "") if named in folders else (None, "")
    if best is None and not earlier:
        best, why = root / last["dir"], "its last checkpoint: no earlier one is kept"
    elif best is None and len(earlier) == 1:
        best, why = earlier[0], "the one checkpoint kept before its last"
    resumes = f"delete {name} alone: the run resumes from step {last['step']}"
    if best is None:
        return f"write the pointer of the run's best checkpoint into {name}, or {resumes} and no longer keeps its best"
    said = f" ({best.name}, {why})" if why else ""
    kept = "" if best.name == last["dir"] else f" and no longer keeps {best.name} as its best"
    return f"write {pointer_text(best)} into {name}{said}, or {resumes}{kept}"


def step_folders(root: Path) -> list[Path]:
    """The checkpoint folders (step-N holding model.safetensors) under a run's checkpoints/, oldest step first."""
    if not Path(root).is_dir():
        return []
    found = [p for p in Path(root).iterdir() if re.fullmatch(r"step-\d+", p.name) and (p / WEIGHTS).is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def pointer_text(folder: Path) -> str:
    return json.dumps({"dir": folder.name, "step": int(folder.name[5:])})


def _stale_pointer(root: Path, tag: str, missing: str) -> str:
    """The one line for a pointer (last.json, best.json) naming a checkpoint folder that is not there."""
    pointer = root / f"{tag}.json"
    folders = step_folders(root)
    if not folders:
        return (f"{pointer} names {missing}, which is missing (an incomplete or corrupt checkpoint), and no other "
                f"checkpoint is in {root}; delete {root} to train the run again from the start")  # fmt: skip
    newest = folders[-1]
    resumes = f" (the run then resumes from step {int(newest.name[5:])})" if tag == "last" else ""
    return (f"{pointer} names {missing}, which is missing (a stale pointer), but {newest.name} is intact: write "
            f"{pointer_text(newest)} into {pointer.name} to use it{resumes}, or give {newest} itself")  # fmt: skip
