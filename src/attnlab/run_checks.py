"""What `attnlab run` checks before the first run starts (dry runs too), and `attnlab validate` with it: every folder
the runs write inside --out (and no link in a run's folder leading the run to write out of it), no --out inside a
run's folder, every local data file there (and, for dry runs and validate, readable as its preparation reads it),
every named dataset prepared, found or downloadable, the prepared cache makeable, model.vocab_size against a prepared
vocabulary, and the pretrained targets' models (runner.py runs them)."""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

from attnlab.config import names_model
from attnlab.data.files import downloads_allowed, read_only_file_system
from attnlab.data.prepared import (
    cache_key,
    check_source,
    default_cache_dir,
    folder_name,
    folder_problem,
    open_prepared,
)
from attnlab.data.source_identity import named_source_key, prepared_source_problem
from attnlab.data.sources import NAMED_SOURCES, download_plan, local_path, open_source
from attnlab.errors import AttnlabWarning, ConfigError, DataError
from attnlab.interop.convert import LOW_RANK
from attnlab.jsonio import loads_json
from attnlab.manifest import Manifest, RunSpec
from attnlab.paths import as_reached, cache_folder_problem, inside, system_folder
from attnlab.retrofit import changes, check_pretrained, first_phases
from attnlab.train.distributed import dist_env
from attnlab.train.loop import check_training_data, vocab_problem

# What a run writes through an entry of its folder (its other files are written to a temporary and renamed over the
# entry: a link there is replaced, not written through).
WRITTEN_THROUGH = {"checkpoints": "write (and prune) its checkpoints", "tokenizer": "save its tokenizer",
                   "metrics.jsonl": "append its metrics"}  # fmt: skip


def local_source_problems(runs: list[RunSpec], data_dir: str | None) -> list[str]:
    """One line per local file the runs read that is not found (named datasets are not checked): their data.source
    files, and the calibration texts (init_from.calibrate_on) of the low-rank conversions they make."""
    missing = []
    for source in dict.fromkeys(spec.data.source for spec in runs):
        if source not in NAMED_SOURCES:
            try:
                local_path(source, data_dir)
            except DataError as e:
                missing.append(str(e))
    for target, spec in first_phases(runs).items():
        text, kind = spec.source["calibrate_on"], (changes(spec)[0] or {}).get("kind")
        if spec.source["calibration_tokens"] and kind in LOW_RANK and text not in NAMED_SOURCES:
            try:
                local_path(text, data_dir)
            except DataError as e:
                missing.append(f"targets.{target}.init_from.calibrate_on={text}: {e}")
    return missing


def check_runs(manifest: Manifest, runs: list[RunSpec], out_root: str | Path, data_dir: str | None) -> list[str]:
    """What would fail once the runs start, checked before the first: a folder the runs write (or read a previous
    phase from) outside `out_root`, or a link in a run's folder they would write through (ConfigError), a local data
    file that is not there, a named dataset that is neither prepared nor found (offline) or cannot be downloaded
    (DataError). Downloads nothing: returns what the runs would download first, one line per dataset (`attnlab run
    --dry-run` prints them)."""
    root = Path(out_root) / manifest.name
    problems = []
    for path in [root, *(spec.run_dir(root) for spec in manifest.runs)]:
        try:
            inside(path, out_root, "run folder")
        except ConfigError as e:
            problems.extend(e.problems)
    problems += [] if problems else link_problems(runs, root)
    if problems:
        raise ConfigError(problems, source=str(manifest.path))
    unmakeable = unmakeable_folder([spec.run_dir(root) for spec in runs])
    if unmakeable is not None:  # the run's own error, which the CLI says in one line naming the folder
        raise unmakeable_error(unmakeable)
    world = dist_env().world_size  # under torchrun: each process takes an equal share of every batch
    uneven = [spec for spec in runs if spec.train.batch_size % world]
    if uneven:
        raise ConfigError(f"targets.{uneven[0].target}: train.batch_size={uneven[0].train.batch_size} must be "
                          f"divisible by the {world} processes torchrun started (each takes an equal share of every "
                          "batch)", source=str(manifest.path))  # fmt: skip
    missing, downloads = [], []
    if data_dir and not Path(data_dir).exists():  # a typo would fall back to the cache (or a download) silently
        missing.append(f"--data-dir {data_dir}: no such folder (name the folder that holds the data files)")
    missing += local_source_problems(runs, data_dir)
    online = downloads_allowed()
    for data in dict.fromkeys(spec.data for spec in runs):  # a named dataset: prepared already, or its files here
        if data.source not in NAMED_SOURCES:
            continue
        if (
            not names_model(data.tokenizer)
            and (  # (a model's tokenizer is keyed by its contents: not read yet)
                default_cache_dir() / folder_name(data, cache_key(data, data_dir)) / "meta.json"
            ).exists()
        ):
            continue
        if not names_model(data.tokenizer):  # the folder the run would prepare it in: the run's line if unmakeable
            unmakeable = unmakeable_folder([default_cache_dir() / folder_name(data, cache_key(data, data_dir))])
            if unmakeable is not None:
                raise unmakeable_error(unmakeable)
        try:
            if online:  # what the run would download (or why it could not), said before it starts
                plan = download_plan(data.source, data_dir, data.max_tokens)
                if plan is not None and plan not in downloads:
                    downloads.append(plan)
            else:
                open_source(data.source, data_dir, download=False)  # finds the files; reads nothing
        except DataError as e:
            offline = (
                "" if online else " (downloads are off: $HF_HUB_OFFLINE, $HF_DATASETS_OFFLINE or $ATTNLAB_OFFLINE)"
            )
            if f"{e}{offline}" not in missing:
                missing.append(f"{e}{offline}")
    if missing:
        raise DataError("; ".join(missing))
    problem = prepared_problems(runs, data_dir)
    if problem:
        raise DataError(problem)
    problems = vocab_problems(runs, data_dir)
    problems += check_pretrained(runs, list(manifest.runs), data_dir)  # reads the models' metadata, not weights
    if problems:
        raise ConfigError(problems, source=str(manifest.path))
    return downloads


def prepared_problems(runs: list[RunSpec], data_dir: str | None) -> str | None:
    """The line the first preparation would refuse the runs with because a file stands where its folder goes in the
    cache (XDG_CACHE_HOME naming a file), said before anything starts (dry runs too)."""
    for data in dict.fromkeys(spec.data for spec in runs):
        if names_model(data.tokenizer):  # its folder's name needs the model's tokenizer: the cache's own is checked
            problem = folder_problem(default_cache_dir())
        else:
            folder = default_cache_dir() / folder_name(data, cache_key(data, data_dir))
            problem = None if (folder / "meta.json").exists() else folder_problem(folder)
        if problem:
            return problem
    return None


def vocab_problems(runs: list[RunSpec], data_dir: str | None) -> list[str]:
    """A model.vocab_size below the vocabulary of the data's tokenizer, where the data is prepared already (a fitted
    tokenizer's size is known only then), refused with train's line before any run starts."""
    problems = []
    for spec in runs:
        given = spec.model.get("vocab_size") if spec.source is None else None
        meta = prepared_meta(spec.data, data_dir) if isinstance(given, int) else None
        known = meta.get("vocab_size") if meta else None
        problem = vocab_problem(given, known) if isinstance(known, int) else None
        if problem and f"targets.{spec.target}: {problem}" not in problems:
            problems.append(f"targets.{spec.target}: {problem}")
    return problems


def unmakeable_folder(run_dirs: list[Path]) -> Path | None:
    """The first folder a run would make (the first missing one on the way to its run folder) in an existing folder
    this user cannot write to (os.access: also a read-only file system, or `chattr +i` for root), or None: the run
    would fail making it, after preparing its data; its dry run says so too."""
    for run_dir in dict.fromkeys(run_dirs):
        missing = next((p for p in (run_dir, *run_dir.parents) if p.parent.exists() or p.parent == p), None)
        if missing is None or missing.exists() or missing.is_symlink() or missing.parent == missing:
            continue
        parent = missing.parent
        if parent.is_dir() and (not os.access(parent, os.W_OK | os.X_OK) or system_folder(missing) is not None):
            return missing  # (on a virtual file system, /proc or /sys, making it fails even for root)
    return None


def unmakeable_error(folder: Path) -> OSError:
    """The error making `folder` would end in: on a virtual file system ENOENT, on a read-only one EROFS (making its
    parent writable is not the fix), else a permission error."""
    if system_folder(folder) is not None:
        return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(folder))
    code = errno.EROFS if read_only_file_system(folder.parent) else errno.EACCES
    return (OSError if code == errno.EROFS else PermissionError)(code, os.strerror(code), str(folder))


def out_folder_problem(out_root: str | Path) -> str | None:
    """The line refusing an --out inside attnlab's own cache (cache_dir(): prepared data, downloads, compiled
    kernels), which one clears to free space or start afresh, deleting the runs with it. An --out inside a Hugging
    Face model folder (an `attnlab export --hf` folder: config.json beside model.safetensors) is said in one warning
    line: the runs would be mixed with the model's files (nothing is lost: `export --hf --overwrite` refuses a
    folder holding other files), and such a folder is no export of attnlab's alone, so it is not refused."""
    problem = cache_folder_problem(out_root)
    if problem:
        return problem
    try:
        resolved = Path(out_root).resolve()
    except (OSError, RuntimeError):  # a link loop (RuntimeError before Python 3.13): the run's own checks name it
        return None
    for folder in (resolved, *resolved.parents):
        weights = (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
        if weights and (folder / "config.json").is_file():
            warnings.warn(f"--out {out_root} is inside {folder}, a Hugging Face model folder (config.json, "
                          "model.safetensors): the runs are mixed with its files; give a folder of their own",
                          AttnlabWarning, stacklevel=2)  # fmt: skip
            break
    return None


# why runner refuses an --out in a run's folder (paths.run_folder_problem)
RUNS_NEST = "runs go to OUT/<manifest>/<target>/seed<S>; give the folder that holds your runs, e.g. --out runs"


def manifest_folder_problem(out_root: str | Path) -> str | None:
    """The line refusing an --out that is (or is inside) the folder of a manifest's runs, OUT/<manifest> (it holds
    the manifest.json `attnlab run` writes there), before anything is written: the runs would go into a second
    manifest folder nested inside the first, and `compare` of it would show both."""
    absolute = as_reached(out_root)
    for folder in (absolute, *absolute.parents):
        name = _manifest_named(folder)
        if name is None:
            continue
        shown = [p.relative_to(Path.cwd()) if p.is_relative_to(Path.cwd()) else p for p in (folder, folder.parent)]
        where = "is" if folder == absolute else f"is inside {shown[0]}, which is"
        return (f"--out {out_root} {where} the folder of manifest {name}'s runs (it holds manifest.json): runs go to "
                f"OUT/<manifest>/<target>/seed<S>; give the folder that holds it, --out {shown[1]}")  # fmt: skip
    return None


def _manifest_named(folder: Path) -> str | None:
    """The manifest's name when `folder` is where `attnlab run` put its runs: its manifest.json (a small object of
    the manifest's name and path, the name the folder's own) says so; else None."""
    path = folder / "manifest.json"
    try:
        if not path.is_file() or path.stat().st_size > 1 << 16:
            return None
        record = loads_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not (isinstance(record, dict) and isinstance(record.get("path"), str) and record.get("name") == folder.name):
        return None
    return folder.name


def prepared_meta(data, data_dir) -> dict | None:
    """The meta.json of the data's prepared folder when it is prepared already (a dry run prepares nothing)."""
    if names_model(data.tokenizer):  # its cache key needs the model's tokenizer
        return None
    path = default_cache_dir() / folder_name(data, cache_key(data, data_dir)) / "meta.json"
    try:
        meta = loads_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    ok = isinstance(meta, dict) and isinstance(meta.get("splits"), dict)
    return meta if ok and all(isinstance(e, dict) and "sha256" in e for e in meta["splits"].values()) else None


def _prepared_folder(data, data_dir) -> Path | None:
    """The data's prepared folder when the run would open it rather than prepare it (its meta.json is there)."""
    if names_model(data.tokenizer):  # its cache key needs the model's tokenizer
        return None
    folder = default_cache_dir() / folder_name(data, cache_key(data, data_dir))
    return folder if (folder / "meta.json").exists() else None


def prepared_folder_problem(data, data_dir) -> str | None:
    """The line the run would refuse the data's prepared folder with when it opens it (meta.json not a valid one, a
    token file of another size, a tokenizer file whose sha256 differs, a named dataset's source files not those
    found now), where it is prepared already: a dry run opens it as the run does (data.prepared.prepare)."""
    folder = _prepared_folder(data, data_dir)
    try:
        meta = open_prepared(folder, data_cfg=data).meta if folder is not None else None
    except DataError as e:
        return str(e)
    return prepared_source_problem(folder, meta, data.source, data_dir) if meta is not None else None


def training_data_problem(spec: RunSpec, data_dir, run_dir: Path) -> str | None:
    """The line the run would refuse to train (or resume) `spec` with over its prepared data, where it is prepared
    already: train.loop.check_training_data, the run's own check (every .bin read once for its sha256 and id range,
    ~1.5 GB/s; the tokenizer loaded; an evaluation window in val and test; the run's tokenizer/ copy unchanged)."""
    folder = _prepared_folder(spec.data, data_dir)
    try:
        check_training_data(open_prepared(folder, data_cfg=spec.data), spec.train, run_dir) if folder else None
    except DataError as e:
        return str(e)
    return None


def link_problems(runs: list[RunSpec], root: Path) -> list[str]:
    """One line per link in a run's folder that the run would write through (its checkpoints/, tokenizer/,
    metrics.jsonl) and that leads out of that folder: the run would write (and prune) there, outside --out or in
    another run's folder."""
    problems = []
    for run_dir in dict.fromkeys(spec.run_dir(root) for spec in runs):
        for name, what in WRITTEN_THROUGH.items():
            path = run_dir / name
            if path.is_symlink() and not path.resolve().is_relative_to(run_dir.resolve()):
                points, resolved = os.readlink(path), path.resolve()
                shown = points if Path(points) == resolved else f"{points} ({resolved})"
                kind = "file" if "." in name else "folder"
                problems.append(f"{path}: a link to {shown}, outside the run's folder, where the run would {what}: "
                                f"replace the link with a {kind} of the run's own (move what it links to there), or "
                                "give another --out")  # fmt: skip
    return problems


def local_data_problem(data, data_dir) -> str | None:
    """The line the run's data preparation would refuse a local data.source with (not readable as its kind, or too
    few documents for a split), found by reading it as the preparation does (data.prepared.check_source); the same
    for a named dataset's files found that are not the dataset's own (data.source_identity). None for the dataset's
    own files, a missing file (check_runs says so), or data prepared already (the run reads it no more)."""
    try:
        if data.source not in NAMED_SOURCES:
            local_path(data.source, data_dir)
        elif named_source_key(data.source, data_dir) == data.source:
            return None
        else:
            open_source(data.source, data_dir, download=False)  # all its files found (else check_runs says so)
    except DataError:
        return None
    if prepared_meta(data, data_dir) is not None:
        return None
    try:
        check_source(data, data_dir)
    except DataError as e:
        return " ".join(str(e).split())
    return None
