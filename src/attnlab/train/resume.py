"""What a run resumed from its checkpoint must find as the checkpoint left it: the same config and the same data.

Each checkpoint's trainer.json records the data it was trained on ("data": data_fingerprint): the sha256 of every
prepared split (meta.json's) and of the source files they were made from. A run whose data changed since (a text
file edited between an interruption and the resume) is refused with one line naming the data and what changed,
instead of continuing silently on other tokens. Checkpoints written before the record existed (no "data" key) still
resume (a change of the training split's size is still caught, from the sampler's token count); a record that is
there but damaged (a hand edit, checksums.json made to agree) is refused naming trainer.json, since the change
could not be told. Keys of trainer.json the resume does not read are left alone.

check_resume is what `attnlab run`, its dry run and `train` check before a resume (the trainer state, the config,
the data, the sampler that would continue), so that a dry run says what the run would do; read_files_problem is the
dry run's check of what the run reads next (the weights' and optimizer state's checksums, the metrics log).

The run's own copies of what its checkpoint holds (config.json, the runner's config.yaml, the tokenizer/ folder's
files) are written again when it resumes; one that is damaged or says something else than the checkpoint is refused
first, naming it (resumed_files_problem), as a finished run's damaged config.json is: a damaged file is never
silently replaced, and deleting it alone lets the run write it again.
"""

from __future__ import annotations

from pathlib import Path

import torch

from attnlab.config_checks import value_problem
from attnlab.config_io import model_config_from_dict, read_yaml
from attnlab.data.files import file_kind, read_json_object, sha256_file
from attnlab.data.sampler import state_problem
from attnlab.data.source_identity import file_sha256, identity, recorded_identities
from attnlab.errors import ConfigError, DataError
from attnlab.model.transformer import build_model
from attnlab.paths import brief
from attnlab.train.checkpoint import (
    CONFIG,
    CheckpointError,
    find_checkpoint,
    load_optimizer,
    load_resumed_weights,
)
from attnlab.train.logging import metrics_rows
from attnlab.train.optim import build_optimizer, freeze

HOW = "restore the data as it was to resume, or train into a new --out"
AGAIN = "delete the run's checkpoints to train again from the start"
# What data_change and source_file_change say of a finished run (skipped, its results reported) on changed data.
FINISHED = {"since": "this run was trained", "again": "delete the run's folder to train it again",
            "how": "restore the data as it was, or train into a new --out (or delete the run's folder to train it "
                   "again)"}  # fmt: skip


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


def _digests(value) -> bool:
    """A {name: sha256} mapping, as data_fingerprint and tokenizer_record write them."""
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _damaged(checkpoint, record: str, value, lost: str, again: str) -> str:
    """The line refusing a trainer.json record that is there but not as a run writes it (a hand edit, checksums.json
    made to agree): the resume would skip the check the record is for."""
    return (f"{checkpoint.path / 'trainer.json'}: its {record} record is damaged ({brief(value, 40)}, not the record "
            f"a run writes), so {lost}; restore the file from a copy, or {again}")  # fmt: skip


def data_record(checkpoint, again: str = AGAIN) -> dict | None:
    """What the checkpoint's trainer.json records of its data (data_fingerprint's {"splits", "source_files"}), or
    None for a checkpoint from before the record (no "data" key); CheckpointError naming the file when the record is
    there but damaged: a resume (or a finished run's skip) on changed data could not be told from one on the same
    data. Keys it does not know are left alone. again: the fix besides restoring the file."""
    if "data" not in checkpoint.trainer:
        return None
    saved = checkpoint.trainer["data"]
    if (
        isinstance(saved, dict)
        and saved.get("splits")
        and _digests(saved["splits"])
        and _digests(saved.get("source_files"))
    ):
        return {"splits": saved["splits"], "source_files": saved["source_files"]}
    raise CheckpointError(_damaged(checkpoint, "data", saved, "whether the data changed since cannot be told", again))


def _edited(saved: dict, now: dict) -> str | None:
    """Which source file is not what it was, in words, or None when none of those recorded both times differs."""
    for path in sorted(set(saved) & set(now)):
        if saved[path] != now[path]:
            return f"{Path(path).name}'s sha256 is now {str(now[path])[:12]}..., {str(saved[path])[:12]}... then"
    return None


def data_change(checkpoint, meta: dict, source: str, where: str, since: str = "this run started", how: str = HOW,
                again: str = AGAIN) -> str | None:  # fmt: skip
    """The one line refusing a resume of `checkpoint` on data other than its own (meta: the meta.json of the data
    prepared today; where: the run folder), or None when it is the same data. A checkpoint from before the data record
    is checked by its training split's token count (token_count_change); a damaged record is a CheckpointError
    (data_record). since, how, again: when the data was the checkpoint's, and the fixes (FINISHED's for a finished
    run, which would be skipped with results of the old data)."""
    saved = data_record(checkpoint, again)
    if saved is None:
        tokens = (meta["splits"].get("train") or {}).get("tokens")
        return token_count_change(checkpoint.trainer, tokens, source, where, since, how) if _whole(tokens) else None
    now = data_fingerprint(meta)
    before, after = saved["splits"], now["splits"]
    changed = [s for s in sorted(set(before) | set(after)) if before.get(s) != after.get(s)]
    if not changed:
        return source_record_problem(checkpoint, saved["source_files"], now["source_files"], source, again)
    what = _edited(saved["source_files"], now["source_files"])
    if what is None and saved["source_files"] and set(saved["source_files"]) != set(now["source_files"]):
        what = "it is read from other files than then"
    if what is None:
        what = "the same source files, tokenized otherwise (another attnlab or tokenizer version)"
    return (f"{where}: the data {source} changed since {since} ({what}; its prepared {', '.join(changed)} "
            f"tokens differ from those the checkpoint was trained on); {how}")  # fmt: skip


def source_record_problem(checkpoint, saved: dict, now: dict, source: str, again: str = AGAIN) -> str | None:
    """For the same prepared tokens: the line refusing a checkpoint whose data record names other source files than
    those the data was prepared from (compared by sha256 alone, so a data folder moved elsewhere resumes; the
    dataset's own files by what they hold, data.source_identity), naming trainer.json and both; else None."""
    then, made = (sorted(map(str, recorded_identities(source, files))) for files in (saved, now))
    if not then or not made or then == made:
        return None

    def said(files: dict) -> str:
        return ", ".join(f"{path} (sha256 {str(sha)[:12]}...)" for path, sha in sorted(files.items()))

    return (f"{checkpoint.path / 'trainer.json'}: data.source_files records {said(saved)}, but the prepared data "
            f"the run reads was made from {said(now)}: the record was edited, or the source files were replaced by "
            f"others that tokenize alike; restore the file (or the data) from a copy, or {again}")  # fmt: skip


def found_files_change(checkpoint, files: dict, source: str, where: str, since: str = "this run started",
                       how: str = HOW, again: str = AGAIN) -> str | None:  # fmt: skip
    """data_change for a dry run of a named dataset not prepared yet, from the files it would be prepared from
    (files: data.sources.local_files'): the line refusing the resume when one is not among those the checkpoint
    records (by what it holds, data.source_identity), else None."""
    saved = data_record(checkpoint, again)
    then = recorded_identities(source, saved["source_files"]) if saved is not None else []
    for role, path in files.items() if then else ():
        sha = file_sha256(path)
        if identity(source, sha, role, path) not in then:
            return (f"{where}: the data {source} changed since {since} ({Path(path).name}'s sha256 is now "
                    f"{str(sha)[:12]}..., not that of a file the checkpoint was trained on); {how}")  # fmt: skip
    return None


def source_file_change(checkpoint, path: Path, source: str, where: str, since: str = "this run started",
                       how: str = HOW, again: str = AGAIN) -> str | None:  # fmt: skip
    """data_change for a dry run, from a local source file alone (before it is prepared again): the line refusing
    the resume when the checkpoint recorded `path` with another sha256, else None."""
    saved = data_record(checkpoint, again)
    if saved is None or str(path) not in saved["source_files"]:
        return None
    now = sha256_file(path)
    if now == saved["source_files"][str(path)]:
        return None
    what = _edited(saved["source_files"], {str(path): now})
    return f"{where}: the data {source} changed since {since} ({what}); {how}"


def token_count_change(trainer: dict, n_tokens: int, source: str, where: str, since: str = "this run started",
                       how: str = HOW) -> str | None:  # fmt: skip
    """For a checkpoint from before the data record: the line refusing a resume whose training split has another
    number of tokens than the sampler recorded, else None."""
    sampler = trainer.get("sampler")
    then = sampler.get("n_tokens") if isinstance(sampler, dict) else None
    if not _whole(then) or then == n_tokens:
        return None
    return (f"{where}: the data {source} changed since {since} (its training split has {n_tokens:,} tokens, "
            f"{then:,} then); {how}")  # fmt: skip


def prepared_data_check(meta: dict, source: str, where: str, **words):
    """data_change against the data prepared today (meta: its meta.json), as a function of the checkpoint."""
    return lambda checkpoint: data_change(checkpoint, meta, source, where, **words)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def step_problem(checkpoint) -> str | None:
    """Why a checkpoint's trainer.json does not say where the run stands, or None: its step is not its folder's
    (step-N, which the runner names as the step it resumes from), or its sampler has not drawn step x grad_accum
    batches. The loop would count from one and draw the batches of the other: extra (or missing) steps, other
    weights than an uninterrupted run's. Values of the wrong type (or < 0) are named by trainer_problem."""
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


# What the loop continues from (trainer.json's keys), each a number >= 0 of this type.
TRAINER_STATE = {"step": int, "tokens": int, "best_val_loss": float | None, "train_seconds": float, "sampler.step": int}
# The sum of the losses and the number of steps since the last metrics row, so that the first row after a resume
# is the mean over the same steps as without the interruption (older checkpoints have none: the row then averages
# fewer).
WINDOW_STATE = {"window_loss": float, "window_steps": int}


def trainer_values(trainer: dict) -> dict:
    """trainer.json's TRAINER_STATE and WINDOW_STATE values by key (as checked by trainer_problem)."""
    sampler = trainer.get("sampler") if isinstance(trainer.get("sampler"), dict) else {}
    values = {key: trainer.get(key) for key in TRAINER_STATE} | {"sampler.step": sampler.get("step")}
    return values | {key: trainer.get(key, kind()) for key, kind in WINDOW_STATE.items()}


def trainer_problem(checkpoint, sampler: dict | None = None) -> str | None:
    """Why the loop cannot continue from the checkpoint's trainer.json, or None: a value it reads (TRAINER_STATE,
    WINDOW_STATE) of the wrong type or < 0, a tokenizer record not as a run writes it, or (sampler: the state of the
    sampler that would continue, data.sampler.sampler_state) a sampler state of another seed, seq_len, global batch
    or split size. Its data record is data_record's."""
    path, fix = checkpoint.path / "trainer.json", "delete the run's checkpoints to train again from the start"
    values = trainer_values(checkpoint.trainer)
    for key, kind in (TRAINER_STATE | WINDOW_STATE).items():
        problem = value_problem(values[key], kind, key)
        if problem is None and values[key] is not None and values[key] < 0:
            problem = f"{key}={values[key]!r} must be >= 0"
        if problem:
            return f"{path}: {problem} (the file was changed); {fix}"
    record = checkpoint.trainer.get("tokenizer")  # (None: a checkpoint from before the record)
    if record is not None and not (isinstance(record, dict) and _digests(record.get("files"))):
        return _damaged(checkpoint, "tokenizer", record, "the run's tokenizer/ files cannot be checked", AGAIN)
    saved = checkpoint.trainer.get("sampler")
    problem = state_problem(saved, sampler) if sampler is not None and isinstance(saved, dict) else None
    return f"{path}: {problem}; {fix}" if problem else None


def check_resume(checkpoint, config: dict | None, sampler: dict, data_problem=None) -> None:
    """Refuses to resume `checkpoint` (a train.checkpoint.Checkpoint) whose trainer state disagrees with itself or
    with the sampler that would continue (CheckpointError: step_problem, trainer_problem), with another config
    (ConfigError listing each difference; config None: not known yet, a dry run's conversion not made), or on other
    data (DataError, data_problem(checkpoint)'s line; also when the vocabulary differs only because the data did).
    sampler: the state of the run's sampler (data.sampler.sampler_state; n_tokens None when the data is not prepared
    yet). Reads the checkpoint's JSON only: done before anything is written into the run folder, by the run, its dry
    run and train alike."""
    problem = step_problem(checkpoint) or trainer_problem(checkpoint)
    if problem:
        raise CheckpointError(problem)
    if checkpoint.path.parent.name == "checkpoints":  # best.json, which the run scores at its end: there and whole
        find_checkpoint(checkpoint.path.parent.parent, "best")
    differences = config_differences(checkpoint.config, config) if config is not None else []
    problem = data_problem(checkpoint) if data_problem is not None else None
    derived = [d for d in differences if d.startswith("model.vocab_size:")]  # the tokenizer's, fitted on the data
    if differences and (problem is None or len(derived) < len(differences)):
        raise ConfigError(
            [f"checkpoint {checkpoint.path} is from another config: {d}" for d in differences]
            + ["use another --out directory, or delete the run to start over"]
        )
    if problem:
        raise DataError(problem)
    problem = trainer_problem(checkpoint, sampler)
    if problem:
        raise CheckpointError(problem)


def read_files_problem(checkpoint, run_dir: Path, train_cfg) -> str | None:
    """For a dry run: the line the resume would refuse the files it reads after check_resume with, or None: the
    checkpoint's weights and optimizer state not as written or not of this model (by the run's own
    load_resumed_weights and load_optimizer, on a model built on the meta device: their checksums, the weights' names,
    shapes and dtypes from their header, the best checkpoint's weights too, the optimizer state's structure and
    shapes), the run's metrics log damaged (as the run reads it,
    train.logging.metrics_rows). train_cfg: the run's TrainConfig (which parameters it trains, its optimizer)."""
    try:
        _load_on_meta(checkpoint, train_cfg)
        metrics_rows(run_dir / "metrics.jsonl", checkpoint.step, train_cfg)  # (a warning names rows it lacks)
    except DataError as e:
        return str(e)
    return None


def _load_on_meta(checkpoint, train_cfg) -> None:
    """What the run's resume does with the checkpoint's weights and optimizer state (train.loop.train), on a model of
    the checkpoint's config built on the meta device: the same checks, no weights allocated or loaded."""
    cfg = model_config_from_dict(checkpoint.config["model"], source=str(checkpoint.path / CONFIG), saved=True)
    with torch.device("meta"):
        model = build_model(cfg, init=False)
    load_resumed_weights(model, checkpoint, header_only=True)
    freeze(model, train_cfg.trainable)
    optimizer = build_optimizer(model, train_cfg)
    rng = torch.get_rng_state()
    try:
        load_optimizer(optimizer, checkpoint, model)  # (its moments moved to the meta device)
    finally:
        torch.set_rng_state(rng)  # (the optimizer state's, which the run continues with)


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
