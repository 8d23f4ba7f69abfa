"""What a bench record says about the checkpoint it measured: the identity of its weights (a checkpoint retrained at
the same path is measured again) and its label (two checkpoints never share one in a records folder)."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter

from attnlab.eval.records import distinct_labels
from attnlab.interop.references import reference_label as run_label
from attnlab.interop.references import resolve
from attnlab.train.checkpoint import WEIGHTS, find_checkpoint, recorded_checksums


def weights_identity(ref: str, data_dir=None) -> str:
    """What tells the weights `ref` loads from others found at the same path later (a run retrained in place): an
    attnlab checkpoint's recorded sha256 of its weights (checksums.json, checked when it was loaded), else the
    weight files' names, sizes and modification times (a .gguf file, a Hugging Face folder, an old checkpoint)."""
    kind, where = resolve(ref, data_dir)
    files = [where] if kind == "gguf" else sorted(where.glob("*.safetensors")) or sorted(where.glob("*.bin"))
    if kind == "run":
        checkpoint = find_checkpoint(where, "best") or find_checkpoint(where, "last") if (
            where / "checkpoints").is_dir() else None  # fmt: skip
        folder = checkpoint.path if checkpoint else where  # the one load_for_eval loads
        entry = (recorded_checksums(folder) or {}).get(WEIGHTS)
        if entry:
            return f"sha256:{entry['sha256']}"
        files = [folder / WEIGHTS]
    stats = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.is_file()]
    return "files:" + hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]


def plan_labels(checkpoints: tuple[str, ...], records: list[dict], data_dir=None) -> dict[str, str]:
    """{checkpoint: the label its records get}: the one its earlier records in the folder have, else the one
    load_for_eval gives it (<target>/seed<S> for a run), unless another checkpoint of the plan or of those records
    has it too: then the last parts of its folder's path, as many as tell them apart (runs/tiny/base/seed0 and
    runs2/tiny/base/seed0 rather than two base/seed0 a report could not tell apart). Which checkpoints share a label
    is decided from every checkpoint of the plan, measured already or not, so that a bench resumed after an
    interruption labels the rest as an uninterrupted one does."""
    real = {ref: ref if ref.startswith("hf:") else os.path.realpath(ref) for ref in checkpoints}
    recorded: dict[str, str] = {}
    for r in records:  # the latest record's label of each checkpoint path
        if isinstance(r.get("model"), str) and isinstance(r.get("model_path"), str):
            path = r["model_path"]
            recorded[path if path.startswith("hf:") else os.path.realpath(path)] = r["model"]
    names = {path: label for path, label in recorded.items() if path not in real.values()}  # outside the plan
    names.update({real[ref]: expected_label(ref, data_dir) for ref in checkpoints})
    unique = distinct_labels(names)
    counts = Counter(recorded.values())
    out = {}
    for ref in checkpoints:
        path = real[ref]
        old = recorded.get(path)
        if old is not None and counts[old] == 1:  # its records' label stays
            out[ref] = old
            continue
        label = unique[path]
        taken = [p for p, other in recorded.items() if other == label and p != path]  # another's records have it
        out[ref] = distinct_labels({p: label for p in (path, *taken)})[path] if taken else label
    return out


def expected_label(ref: str, data_dir=None) -> str:
    """The label load_for_eval gives a model reference (attnlab.interop.references), found without loading it."""
    if ref.startswith("hf:"):
        return ref[len("hf:") :]
    kind, where = resolve(ref, data_dir)
    if kind != "run":
        return where.stem if kind == "gguf" else where.name
    run_dir = where.parent.parent if where.parent.name == "checkpoints" else where
    return run_label(run_dir)
