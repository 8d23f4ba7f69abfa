"""What a run resumed from its checkpoint must find as the checkpoint left it: the same config and the same data.

Each checkpoint's trainer.json records the data it was trained on ("data": data_fingerprint): the sha256 of every
prepared split (meta.json's) and of the source files they were made from. A run whose data changed since (a text
file edited between an interruption and the resume) is refused with one line naming the data and what changed,
instead of continuing silently on other tokens. Checkpoints written before the record existed still resume (a
change of the training split's size is still caught, from the sampler's token count).

The run's own copies of what its checkpoint holds (config.json, the runner's config.yaml, the tokenizer/ folder's
files) are written again when it resumes; one that is damaged or says something else than the checkpoint is refused
first, naming it (resumed_files_problem), as a finished run's damaged config.json is: a damaged file is never
silently replaced, and deleting it alone lets the run write it again.
"""

from __future__ import annotations

from pathlib import Path

from attnlab.config_io import read_yaml
from attnlab.data.files import file_kind, read_json_object, sha256_file
from attnlab.errors import ConfigError, DataError
from attnlab.train.checkpoint import CheckpointError

HOW = "restore the data as it was to resume, or train into a new --out"
# What data_change and source_file_change say of a finished run (skipped, its results reported) on changed data.
FINISHED = {"since": "this run was trained", "how": "restore the data as it was, or train into a new --out (or "
            "delete the run's folder to train it again)"}  # fmt: skip


# How the work is spread over processes and memory, not what is computed: a run saved with DDP resumes with FSDP
# (or with activation checkpointing, to fit a smaller device) and continues with the same losses within float
# tolerance, so changing these is not another config.
EXECUTION_KEYS = frozenset({"train.distributed", "train.activation_checkpointing", "train.cpu_offload"})


def config_differences(saved: dict, current: dict, prefix: str = "", saved_as: str = "checkpoint") -> list[str]:
    """Every key whose value differs (`key: <saved_as> <saved value>, now <value>`), EXECUTION_KEYS aside. A key
    missing on one side counts as None: a config saved before a field (default None) existed equals today's."""
    out = []
    for key in sorted(set(saved) | set(current)):
        if f"{prefix}{key}" in EXECUTION_KEYS:
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{prefix}{key}.", saved_as)
        elif a != b:
            out.append(f"{prefix}{key}: {saved_as} {a!r}, now {b!r}")
    return out


def data_fingerprint(meta: dict) -> dict:
    """What a checkpoint records of its data: {"splits": {split: sha256 of its tokens}, "source_files": {path:
    sha256}}, from a prepared folder's (checked) meta.json; nothing is read again."""
    files = {}
    for entry in meta.get("source_files") or []:
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) and isinstance(entry.get("sha256"), str):
            files[entry["path"]] = entry["sha256"]
    return {"splits": {name: entry["sha256"] for name, entry in meta["splits"].items()}, "source_files": files}


def _recorded(trainer: dict) -> dict | None:
    saved = trainer.get("data")
    if not isinstance(saved, dict) or not isinstance(saved.get("splits"), dict):
        return None  # a checkpoint from before the record
    files = saved.get("source_files")
    return {"splits": saved["splits"], "source_files": files if isinstance(files, dict) else {}}


def _edited(saved: dict, now: dict) -> str | None:
    """Which source file is not what it was, in words, or None when none of those recorded both times differs."""
    for path in sorted(set(saved) & set(now)):
        if saved[path] != now[path]:
            return f"{Path(path).name}'s sha256 is now {str(now[path])[:12]}..., {str(saved[path])[:12]}... then"
    return None


def data_change(trainer: dict, now: dict, source: str, where: str, since: str = "this run started",
                how: str = HOW) -> str | None:  # fmt: skip
    """The one line refusing a resume on data other than the checkpoint's (trainer: its trainer.json; now:
    data_fingerprint of the data prepared today; where: the run folder), or None when it is the same data or the
    checkpoint recorded none. since, how: when the data was the checkpoint's, and the fix (FINISHED's for a finished
    run, which would be skipped with results of the old data)."""
    saved = _recorded(trainer)
    if saved is None:
        return None
    before, after = saved["splits"], now["splits"]
    changed = [s for s in sorted(set(before) | set(after)) if before.get(s) != after.get(s)]
    if not changed:
        return None
    what = _edited(saved["source_files"], now["source_files"])
    if what is None and saved["source_files"] and set(saved["source_files"]) != set(now["source_files"]):
        what = "it is read from other files than then"
    if what is None:
        what = "the same source files, tokenized otherwise (another attnlab or tokenizer version)"
    return (f"{where}: the data {source} changed since {since} ({what}; its prepared {', '.join(changed)} "
            f"tokens differ from those the checkpoint was trained on); {how}")  # fmt: skip


def source_file_change(trainer: dict, path: Path, source: str, where: str, since: str = "this run started",
                       how: str = HOW) -> str | None:  # fmt: skip
    """data_change for a dry run, from a local source file alone (before it is prepared again): the line refusing
    the resume when the checkpoint recorded `path` with another sha256, else None."""
    saved = _recorded(trainer)
    if saved is None or str(path) not in saved["source_files"]:
        return None
    now = sha256_file(path)
    if now == saved["source_files"][str(path)]:
        return None
    what = _edited(saved["source_files"], {str(path): now})
    return f"{where}: the data {source} changed since {since} ({what}); {how}"


def token_count_change(trainer: dict, n_tokens: int, source: str, where: str) -> str | None:
    """For a checkpoint from before the data record: the line refusing a resume whose training split has another
    number of tokens than the sampler recorded, else None."""
    sampler = trainer.get("sampler")
    then = sampler.get("n_tokens") if isinstance(sampler, dict) else None
    if not isinstance(then, int) or isinstance(then, bool) or then == n_tokens:
        return None
    return (f"{where}: the data {source} changed since this run started (its training split has {n_tokens:,} tokens, "
            f"{then:,} then); {HOW}")  # fmt: skip


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def step_problem(checkpoint) -> str | None:
    """Why a checkpoint's trainer.json does not say where the run stands, or None: its step is not its folder's
    (step-N, which the runner names as the step it resumes from), or its sampler has not drawn step x grad_accum
    batches. The loop would count from one and draw the batches of the other: extra (or missing) steps, other
    weights than an uninterrupted run's. Values of the wrong type (or < 0) are named by train.loop.resumed_state."""
    trainer, path = checkpoint.trainer, checkpoint.path / "trainer.json"
    step, folder = trainer.get("step"), checkpoint.path.name
    fix = ("the file was changed after it was written: restore it from a copy, or delete the run's checkpoints to "
           "train again from the start")  # fmt: skip
    if not _whole(step) or step < 0:
        return None
    if folder.startswith("step-") and folder[5:].isdigit() and int(folder[5:]) != step:
        return f"{path}: step={step} is not its folder's {int(folder[5:])} ({folder}); {fix}"
    sampler = trainer.get("sampler") if isinstance(trainer.get("sampler"), dict) else {}
    train = checkpoint.config.get("train") if isinstance(checkpoint.config.get("train"), dict) else {}
    drawn, accum = sampler.get("step"), train.get("grad_accum", 1)
    if _whole(drawn) and _whole(accum) and drawn != step * accum:
        per = f" x train.grad_accum={accum}" if accum != 1 else ""
        return (f"{path}: sampler.step={drawn} is not step={step}{per} (the batches drawn by step {step}); "
                f"{fix}")  # fmt: skip
    return None


def check_resume(checkpoint, config: dict, source: str, prepared) -> None:
    """Refuses to resume `checkpoint` (a train.checkpoint.Checkpoint) whose trainer state disagrees with itself
    (CheckpointError), with another config (ConfigError listing each difference) or on other data (DataError, one
    line; also when the vocabulary differs only because the data did). Reads the checkpoint's JSON only: done before
    anything is written into the run folder."""
    problem = step_problem(checkpoint)
    if problem:
        raise CheckpointError(problem)
    differences = config_differences(checkpoint.config, config)
    where = str(checkpoint.path.parent.parent)
    problem = data_change(checkpoint.trainer, data_fingerprint(prepared.meta), source, where)
    if problem is None and _recorded(checkpoint.trainer) is None and "train" in prepared.meta["splits"]:
        problem = token_count_change(checkpoint.trainer, prepared.meta["splits"]["train"]["tokens"], source, where)
    derived = [d for d in differences if d.startswith("model.vocab_size:")]  # the tokenizer's, fitted on the data
    if differences and (problem is None or len(derived) < len(differences)):
        raise ConfigError(
            [f"checkpoint {checkpoint.path} is from another config: {d}" for d in differences]
            + ["use another --out directory, or delete the run to start over"]
        )
    if problem:
        raise DataError(problem)


def resumed_files_problem(run_dir: Path, checkpoint, config: dict, yaml_copy: bool = False) -> str | None:
    """The line refusing to resume `checkpoint` (of run_dir, already checked against `config` by check_resume) over a
    run file it would write again that is damaged or says otherwise: config.json (and config.yaml with yaml_copy)
    unreadable or of another config, a tokenizer/ file other than the one the checkpoint records; None when each is
    as the run wrote it, or missing (written again)."""
    again = f"delete it alone and run again: the run resumes from its last checkpoint (step {checkpoint.step}) and "
    fix = again + "writes it again from that checkpoint's config"
    copies = [(run_dir / "config.json", "JSON")] + ([(run_dir / "config.yaml", "YAML")] if yaml_copy else [])
    for path, kind in copies:
        if not path.exists() and not path.is_symlink():
            continue
        try:
            saved = read_json_object(path) if kind == "JSON" else read_yaml(path)
        except (ConfigError, DataError) as e:
            detail = " ".join(str(e).split())
            return f"{detail if detail.startswith(str(path)) else f'{path}: {detail}'}: it was damaged; {fix}"
        if not isinstance(saved, dict):
            return f"{path}: not a {kind} mapping (it was damaged or changed); {fix}"
        differences = config_differences(saved, config, saved_as="saved")
        if differences:
            more = f" (and {len(differences) - 1} more)" if len(differences) > 1 else ""
            return (f"{path}: says another config than the run's checkpoint {checkpoint.path} ({differences[0]}"
                    f"{more}): it was edited or damaged; {fix}")  # fmt: skip
    record = checkpoint.trainer.get("tokenizer")
    files = record.get("files") if isinstance(record, dict) else None
    for name, digest in files.items() if isinstance(files, dict) else ():
        path = run_dir / "tokenizer" / str(name)
        if not path.exists() or Path(str(name)).name != name:
            continue
        fix = again + "writes it again from the prepared data"
        try:
            kind = file_kind(path)
            found = None if kind else sha256_file(path)
        except OSError as e:
            return f"{path}: unreadable ({e.strerror or e}); {fix}"
        if kind:
            return f"{path} is {kind}, not the tokenizer file the run's checkpoint records; {fix}"
        if found != digest:
            return (f"{path}: not the file the run was trained with (sha256 {str(found)[:12]}..., its checkpoint "
                    f"records {str(digest)[:12]}...); {fix}")  # fmt: skip
    return None
