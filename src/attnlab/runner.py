"""`attnlab run`: every target x seed (x phase) of a manifest into runs/<manifest>/<target>/seed<S>/.

Finished runs (summary.json) are skipped, interrupted ones resume from their last checkpoint, and a run folder made
with another config, or a checkpoint trained on other data, is an error rather than silently reused; so is a run
folder another `attnlab run` is training (train.lock). A refused run writes nothing into its folder. Before the
first run starts (dry runs too) every folder a run would write is checked to lie inside --out (run_checks.py), every
local data file to exist, every named dataset to be prepared, found or (downloads allowed) downloadable, and the
comparison's files (compare.md, ...) to be attnlab's own; a dry run says what the runs would download first, and
downloads nothing; for each run it says what the real run would do with its folder (train, resume from step K, skip it
as finished, or refuse it and why: a conversion of another recipe, data its preparation cannot read included).
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import sys
import time
from pathlib import Path

import yaml

from attnlab.compare import (
    OWN_START,
    check_outputs,
    check_run_file,
    check_unsealed,
    config_fix,
    markdown_now,
    read_runs,
    summary_problem,
)
from attnlab.config import idle_memory_problem, names_model
from attnlab.config_checks import unknown_key_problem
from attnlab.data.files import broken_link, lock_file_problem, read_json_object, seal_kept
from attnlab.data.pretrained import tokenizer_from_folder
from attnlab.data.sampler import sampler_state
from attnlab.data.sources import NAMED_SOURCES, local_files, local_path
from attnlab.errors import ConfigError, DataError
from attnlab.manifest import Manifest, RunSpec
from attnlab.paths import blocking_file, brief, run_folder_problem
from attnlab.retrofit import (
    conversion_problem,
    converted_folder,
    converted_model,
    first_phases,
    model_tokenizer,
    run_config,
    unfinished_source_warning,
)
from attnlab.run_checks import (
    RUNS_NEST,
    check_runs,
    local_data_problem,
    manifest_folder_problem,
    out_folder_problem,
    prepared_folder_problem,
    prepared_meta,
    training_data_problem,
)
from attnlab.train.checkpoint import (
    CheckpointError,
    checkpoints_folder_problem,
    find_checkpoint,
    step_folders,
    write_json_atomic,
)
from attnlab.train.distributed import barrier, dist_env, init_distributed, prepare_rank0_first
from attnlab.train.fsdp import check_launch
from attnlab.train.lock import LOCK_NAME, busy_problem, run_lock
from attnlab.train.loop import SUMMARY_STATUS, full_config, pick_device, train
from attnlab.train.resume import (
    FINISHED,
    check_resume,
    config_differences,
    found_files_change,
    prepared_data_check,
    read_files_problem,
    resumed_files_problem,
    source_file_change,
)
from attnlab.train.signals import first_interrupt_only


def select_runs(manifest: Manifest, targets=None, seeds=None) -> list[RunSpec]:
    problems = [
        unknown_key_problem(t, manifest.targets, "", what="target") for t in targets or [] if t not in manifest.targets
    ]
    problems += [
        f"--seed {s} is not in the manifest's seeds {list(manifest.seeds)}"
        for s in seeds or []
        if s not in manifest.seeds
    ]
    if problems:
        raise ConfigError(problems, source=str(manifest.path))
    return [r for r in manifest.runs if (not targets or r.target in targets) and (not seeds or r.seed in seeds)]


def untrained_init_from(
    manifest: Manifest, spec: RunSpec, source: RunSpec, root: Path, before: list[RunSpec]
) -> ConfigError | None:
    """The refusal of a run that starts from another target's last phase (source, same seed) when that run is neither
    trained (its summary.json) nor one of `before`, the runs this `attnlab run` trains ahead of it (`--target`
    selected this target alone); None when it can start. The run raises it; its dry run says it (one check)."""
    folder = source.run_dir(root)
    if (folder / "summary.json").exists() or any(run is source for run in before):
        return None
    return ConfigError(f"targets.{spec.target}.init_from: {folder} is not trained yet (run target {spec.init_from} "
                       "first, or run the whole manifest)", source=str(manifest.path))  # fmt: skip


def finished_run(run_dir: Path, config: dict, source=None, data_problem=None) -> dict | None:
    """The summary of the finished run in run_dir (None when it is not finished); ConfigError when it was made with
    another config than `config`; DataError when data_problem (see _data_problem) says its last checkpoint was
    trained on other data than today's (also when the config differs only in the vocabulary, fitted on the data):
    skipped, the run would report its old results as if for the new data."""
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        return None
    for path in (summary_path, run_dir / "config.json"):
        check_run_file(path)  # (a link to /dev/zero would be read without end)
    saved = read_json_object(run_dir / "config.json", config_fix(run_dir))
    try:
        summary = read_json_object(summary_path)
    except DataError as e:  # the checkpoints are all there: the summary alone is rewritten by the run
        raise DataError(f"{e}; {summary_fix(run_dir, config)}") from None
    if seal_kept(summary) is False:
        raise DataError(f"{summary_path}: changed after the run wrote it (its sha256 no longer matches its fields); "
                        f"{summary_fix(run_dir, config)}")  # fmt: skip
    if summary.get("status") != SUMMARY_STATUS:  # the one status train() writes, when the run is finished
        said = f"status={brief(summary['status'])}" if "status" in summary else "no 'status'"
        raise DataError(f"{summary_path}: {said}, where a finished run's summary has status {SUMMARY_STATUS!r} "
                        f"(the only value attnlab writes: it was changed by hand); "
                        f"{summary_fix(run_dir, config)}")  # fmt: skip
    differences = config_differences(saved, config, saved_as="saved")
    derived = all(d.startswith("model.vocab_size:") for d in differences)  # the tokenizer's, fitted on the data
    checkpoint = find_checkpoint(run_dir) if not differences or (derived and data_problem is not None) else None
    problem = data_problem(checkpoint) if checkpoint is not None and data_problem is not None else None
    if problem:
        raise DataError(problem)
    if checkpoint is not None and not differences:
        # The run's config.json and config.yaml are plain files anyone may edit; its last checkpoint's config.json
        # is checksummed: the config its weights were trained with (which of the two changed cannot be told: a
        # step folder copied in from another run brings its own, checksums and all).
        trained = config_differences(checkpoint.config, config, saved_as="trained with")
        if trained:
            more = f" (and {len(trained) - 1} more)" if len(trained) > 1 else ""
            raise ConfigError(
                f"{run_dir} holds a finished run trained with another config than its config.json says "
                f"({trained[0]}{more}, by {checkpoint.path / 'config.json'}): the checkpoint was copied in from "
                "another run, or the run's config.json or config.yaml was edited after training; use another --out "
                "directory, or delete that folder to train it again",
                source=str(source) if source else None,
            )  # fmt: skip
    if differences:
        more = f" (and {len(differences) - 1} more)" if len(differences) > 1 else ""
        raise ConfigError(
            f"{run_dir} holds a finished run made with another config ({differences[0]}{more}); "
            "use another --out directory or delete that folder", source=str(source) if source else None
        )  # fmt: skip
    problem = summary_problem(summary, saved, config, checkpoint)
    if problem:  # another run's summary.json beside this one (copied in): its results are not this run's
        raise DataError(f"{summary_path}: not this run's summary ({problem}): it was copied in from another run or "
                        f"edited; {summary_fix(run_dir, config)}")  # fmt: skip
    return summary


def _ppl(value: float) -> str:
    """A perplexity as the run's line shows it: 2 decimals, in exponent form past a million (a diverged model's)."""
    return f"{value:.2f}" if not math.isfinite(value) or value < 1e6 else f"{value:.3e}"


def summary_fix(run_dir: Path, config: dict) -> str:
    """What to do about a run's summary.json that cannot be read: delete it alone, and the run resumes from its last
    checkpoint (an interrupted run) or writes it again there (a finished one); never the folder, which holds them."""
    try:
        checkpoint = find_checkpoint(run_dir)
    except (CheckpointError, DataError, ConfigError):  # (said when the run resumes)
        checkpoint = None
    if checkpoint is None:
        return "delete summary.json alone and run again (the run has no checkpoint: it trains from the start)"
    steps = (config.get("train") or {}).get("steps")
    if isinstance(steps, int) and checkpoint.step < steps:
        return (f"the run was interrupted at step {checkpoint.step} of {steps} (its last checkpoint): delete "
                "summary.json alone and run again to resume it from there")  # fmt: skip
    return (f"its last checkpoint is the last step ({checkpoint.step} of {steps}): delete summary.json alone and run "
            "again to write it again from there")  # fmt: skip


def interrupted_run_problem(run_dir: Path, config: dict) -> str | None:
    """For --no-resume, which restarts an interrupted run (its checkpoints and metrics are replaced): the one line
    refusing it when the interrupted run in run_dir was made with another config than `config` (nothing of another
    experiment is deleted without being asked); None when run_dir holds no checkpoint, or one of this config."""
    problem = checkpoints_folder_problem(run_dir)  # (the run would fail at its first checkpoint)
    if problem:
        return problem
    step, saved = interrupted_config(run_dir)
    differences = config_differences(saved, config, saved_as="saved") if saved is not None else []
    if not differences:
        return None
    more = f" (and {len(differences) - 1} more)" if len(differences) > 1 else ""
    return (f"{run_dir} holds an interrupted run made with another config, checkpointed at step {step} "
            f"({differences[0]}{more}): --no-resume would delete it; use another --out directory, or delete that "
            "folder")  # fmt: skip


def interrupted_config(run_dir: Path) -> tuple[int, dict | None]:
    """(the newest checkpoint's step, the config it was trained with: its config.json, else the run's), or (0, None)
    when run_dir holds no checkpoint or neither config can be read."""
    folders = step_folders(run_dir / "checkpoints")
    if not folders:
        return 0, None
    for path in (folders[-1] / "config.json", run_dir / "config.json"):
        try:
            return int(folders[-1].name[5:]), read_json_object(path)
        except DataError:
            continue
    return 0, None


def _missing_folders(path: Path) -> list[Path]:
    """path and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_empty(made: list[Path]) -> None:
    """Removes the folders a refused run made (deepest first), when they hold nothing but its lock file."""
    for folder in made:
        try:
            if [p.name for p in folder.iterdir()] == [LOCK_NAME]:
                (folder / LOCK_NAME).unlink()
            folder.rmdir()
        except OSError:
            return  # not empty: something was written, keep it


def _dry_config(spec: RunSpec, converted: Path | None, meta: dict | None, saved: dict) -> dict | None:
    """The config the run would have, as far as it is known without preparing the data: the vocabulary is the
    prepared data's when prepared, else the saved run's (the same tokenizer on the same data has the same);
    None for a converted target whose conversion is not made yet."""
    if converted is not None:
        if not (converted / "config.json").exists():
            return None
        model_cfg = run_config(spec, converted)
    else:
        vocab = meta.get("vocab_size") if meta else None
        if not isinstance(vocab, int):
            model = saved.get("model") if isinstance(saved, dict) else None
            vocab = model.get("vocab_size") if isinstance(model, dict) else None
        model_cfg = spec.model_config(vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None)
    return full_config(model_cfg, spec.data, spec.train)


def _data_problem(data, meta: dict | None, data_dir, run_dir: Path, finished: bool = False):
    """How to check a checkpoint of run_dir against today's data (a function: the checkpoint -> the line refusing
    it, or None): by the prepared data's meta when known, else (a dry run, before the data is prepared again) by
    the local source file, or a named dataset's files found (data.source_identity). finished: the words for a
    finished run."""
    source, where, words = data.source, str(run_dir), FINISHED if finished else {}
    if meta is not None:
        return prepared_data_check(meta, source, where, **words)
    if source not in NAMED_SOURCES:
        path = local_path(source, data_dir)
        return lambda checkpoint: source_file_change(checkpoint, path, source, where, **words)
    files = local_files(source, data_dir)  # (none found: the dataset's own would be downloaded)
    return lambda checkpoint: found_files_change(checkpoint, files, source, where, **words)


def refuse_resume(spec: RunSpec, run_dir: Path, checkpoint, config: dict | None, meta: dict | None, data_dir) -> None:
    """What `attnlab run` and its dry run check before resuming the run from `checkpoint` (one function, so that the
    dry run says what the run would do): train.resume.check_resume (its trainer state, the config, the data, the
    sampler that would continue: meta, the prepared data's meta.json, None when not prepared yet) and the run files it
    writes again (resumed_files_problem). Raises the run's error; config None: not known yet (a dry run's conversion
    not made)."""
    tokens = (meta["splits"].get("train") or {}).get("tokens") if meta is not None else None
    sampler = sampler_state(spec.train.seed, spec.train.seq_len, spec.train.batch_size, tokens)
    check_resume(checkpoint, config, sampler, _data_problem(spec.data, meta, data_dir, run_dir))
    problem = resumed_files_problem(run_dir, checkpoint, config, yaml_copy=True) if config is not None else None
    if problem:
        raise DataError(problem)


def dry_run_status(
    spec: RunSpec, run_dir: Path, converted: Path | None, data_dir, resume: bool, start: str, before: str | None = None
) -> str:
    """What `attnlab run` would do with a run, for --dry-run: train it, resume it from its last checkpoint, skip it
    (finished) or refuse it (another config, other data, another process training it, a damaged checkpoint). before:
    the line the run would be refused with before it reaches its folder (first_problem)."""
    if before:
        return f"would be refused: {before}"
    busy = busy_problem(run_dir) or lock_file_problem(run_dir / LOCK_NAME)
    if busy:
        return f"would be refused: {busy}"
    try:
        problem = prepared_folder_problem(spec.data, data_dir)  # (the run opens its data before anything else)
        if problem:
            return f"would be refused: {problem}"
        meta = prepared_meta(spec.data, data_dir)
        if (run_dir / "summary.json").exists():
            saved = read_json_object(run_dir / "config.json", config_fix(run_dir))
            config = _dry_config(spec, converted, meta, saved)
            check = _data_problem(spec.data, meta, data_dir, run_dir, finished=True)
            summary = finished_run(run_dir, config, data_problem=check) if config is not None else None
            loss = f" (val loss {summary.get('val_loss', float('nan')):.4f})" if summary else ""
            return f"done already{loss}, would be skipped ({run_dir})"
        if not resume:
            config = _dry_config(spec, converted, meta, interrupted_config(run_dir)[1] or {})
            problem = interrupted_run_problem(run_dir, config) if config is not None else None
            if problem:
                return f"would be refused: {problem}"
        checkpoint = find_checkpoint(run_dir) if resume else None
        if checkpoint is not None:
            refuse_resume(spec, run_dir, checkpoint, _dry_config(spec, converted, meta, checkpoint.config), meta,
                          data_dir)  # fmt: skip
            problem = training_data_problem(spec, data_dir, run_dir) or read_files_problem(
                checkpoint, run_dir, spec.train
            )  # what the run reads next
            if problem:
                return f"would be refused: {problem}"
            return f"would resume from step {checkpoint.step} of {spec.train.steps} in {run_dir}"
        problem = training_data_problem(spec, data_dir, run_dir) or idle_memory_problem(
            spec.train.seq_len, spec.model.get("memory")
        )
        if problem:
            return f"would be refused: {problem}"
    except (ConfigError, DataError) as e:
        return "would be refused: " + " ".join(str(e).split())
    return f"would train {spec.train.steps} steps into {run_dir}{start}"


def first_problem(spec: RunSpec, firsts: dict[str, RunSpec], root: Path, data_dir, seen: dict) -> str | None:
    """For a dry run, the line the run would be refused with before it reaches its folder, as the run finds it: its
    target's conversion made with another recipe (converted_model, by each run of the converted target), then its
    local data not readable as its preparation reads it (run_checks.local_data_problem). seen: the lines found so far,
    by target and by data (each found once)."""
    if spec.source is not None and spec.source["target"] == spec.target:
        if spec.target not in seen:
            seen[spec.target] = _conversion_line(firsts[spec.target], root, data_dir)
        if seen[spec.target]:
            return seen[spec.target]
    if spec.data not in seen:
        seen[spec.data] = local_data_problem(spec.data, data_dir)
    return seen[spec.data]


def _conversion_line(first: RunSpec, root: Path, data_dir) -> str | None:
    """The line converted_model would refuse the target's conversion made already with (its first phase: first)."""
    try:
        return conversion_problem(first, root, data_dir)
    except (ConfigError, DataError) as e:
        return " ".join(str(e).split())


def _kept(folder: Path, resume: bool, dry_run: bool = False) -> str:
    """What is said of a conversion made already: kept. --no-resume restarts interrupted training; what is finished
    stays (a finished run is skipped, a conversion kept): nothing the user made is deleted without being asked."""
    why = "" if resume else ": --no-resume restarts interrupted training, and keeps what is finished, as runs are"
    return f"{folder} is made already, {'would be ' if dry_run else ''}kept{why} (delete it to convert again)"


def run_manifest(
    manifest: Manifest,
    out_root: str | Path = "runs",
    targets=None,
    seeds=None,
    data_dir: str | None = None,
    dry_run: bool = False,
    resume: bool = True,
    progress: bool = True,
    log=print,
    convert_only: bool = False,
    unsealed: bool = False,
) -> list[dict]:
    """Runs the selected runs in order; returns one summary per run (None for dry runs). convert_only: make the
    selected pretrained targets' conversions (<target>/converted, the cold models) and train nothing. unsealed: take
    finished runs whose summary.json has no seal (an older attnlab's; refused otherwise, before anything runs). A
    dry run says what each run would do: train, resume from its checkpoint, skip (finished) or be refused (and why).

    Each run folder is locked while its run trains (train.lock: a second `attnlab run` into it is refused), and
    nothing is written into it before every check has passed. Ctrl-C stops the runs once: a second one right
    after it is ignored while they stop (train.signals)."""
    with first_interrupt_only():
        return _run_manifest(manifest, out_root, targets, seeds, data_dir, dry_run, resume, progress, log,
                             convert_only, unsealed)  # fmt: skip


def command_line() -> str:
    """The command that started this run, as one can run it again: `python -m attnlab.cli` for the module (its
    argv[0] is cli.py's path), under torchrun with its number of processes per node."""
    program = sys.argv[0]
    if Path(program).name == "cli.py":
        program = f"{Path(sys.executable).name} -m attnlab.cli"
        if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("LOCAL_WORLD_SIZE"):
            program = f"torchrun --nproc_per_node {os.environ['LOCAL_WORLD_SIZE']} -m attnlab.cli"
        return " ".join([program, shlex.join(sys.argv[1:])]).strip()
    return shlex.join(sys.argv)


def _run_manifest(manifest, out_root, targets, seeds, data_dir, dry_run, resume, progress, log, convert_only, unsealed):
    link = broken_link(out_root)
    if link is not None:  # (a loop would end in pathlib's RuntimeError; a dangling link would be written through)
        raise ConfigError(f"--out {out_root}: {link}: remove the link, or give another --out")
    if Path(out_root).exists() and not Path(out_root).is_dir():
        raise ConfigError(f"--out {out_root}: a file, not a folder (runs are written into a folder)")
    blocker = blocking_file(out_root)  # (the run could make no folder there: the dry run says so too)
    if blocker is not None:
        raise ConfigError(f"--out {out_root}: {blocker} is a file, not a folder: choose another --out")
    problem = (
        run_folder_problem(out_root, RUNS_NEST) or manifest_folder_problem(out_root) or out_folder_problem(out_root)
    )
    if problem:
        raise ConfigError(problem)
    env = dist_env()  # torchrun's variables, checked before anything else (a dry run never joins a process group)
    root = Path(out_root) / manifest.name
    runs = select_runs(manifest, targets, seeds)
    downloads = check_runs(manifest, runs, out_root, data_dir)
    if not convert_only and root.is_dir():  # `attnlab run` compares the runs once they are done: what compare
        # would refuse of the other runs there (a changed or unsealed summary, impossible figures, a fifo) is refused
        # now, not after the training (a dry run too); the runs it trains are checked as it reaches them (in their
        # words), and their summaries here for a seal only
        own = {spec.run_dir(root).resolve() for spec in manifest.runs}
        selected = {spec.run_dir(root).resolve() for spec in runs}
        check_unsealed(read_runs(root, own, selected), unsealed, quiet=True, root=root, own=own)
    if not convert_only:  # `attnlab run` compares the runs once they are done: the user's own compare.md said now
        # a compare.md with no record is refused now, not after the training, when it is not what compare would
        # write from the runs there now (compare refuses it at the end with the same line)
        check_outputs(
            (root / name for name in OWN_START), markdown_now(root) if (root / "compare.md").is_file() else None
        )
    if dry_run:
        for plan in downloads:
            log(f"data: {plan} first")
    # Under torchrun every rank runs this loop; rank 0 alone writes files and prints.
    for spec in runs:
        check_launch(spec.train)  # fsdp outside torchrun: one line, also for a dry run
        pick_device(spec.train.device)  # a device this machine lacks (cuda here): refused before any run, dry or not
    sharded = any(spec.train.distributed == "fsdp" for spec in runs)
    dist_info = env if dry_run else init_distributed(pick_device(runs[0].train.device).type, sharded) if runs else None
    if dist_info is not None and not dist_info.is_main:
        log = lambda *a, **k: None  # noqa: E731
    prepared_by_data: dict = {}
    previous_dir: dict[tuple[str, int], Path] = {}
    kept: set[Path] = set()  # conversions --no-resume kept (said once)
    summaries = []
    if convert_only:
        firsts = first_phases(list(manifest.runs))
        if not any(spec.target in firsts for spec in runs):
            raise ConfigError(
                "--convert-only: no selected target starts from a pretrained model (init_from: <model reference>): "
                "there is nothing to convert", source=str(manifest.path)
            )  # fmt: skip
        names = list(dict.fromkeys(spec.target for spec in runs if spec.target in firsts))
        refused = []
        for name in names:
            folder = converted_folder(root, firsts[name])
            if dry_run:
                problem = _conversion_line(firsts[name], root, data_dir)
                refused += [name] if problem else []
                if not folder.exists() and not problem:
                    unfinished_source_warning(firsts[name], data_dir)
                log(f"{name}: would convert {firsts[name].source['model']} into {folder}" if not folder.exists() else
                    f"{name}: would be refused: {problem}" if problem else
                    f"{name}: {_kept(folder, resume, dry_run=True)}")  # fmt: skip
            elif dist_info.is_main:
                made = folder.exists()
                folder = converted_model(firsts[name], root, data_dir, log)
                log(f"{name}: {_kept(folder, resume)}" if made else f"{name}: {folder}")
        if refused:
            raise ConfigError(f"{len(refused)} of {len(names)} conversions would be refused ({', '.join(refused)}): "
                              "the reasons are printed above", source=str(manifest.path))  # fmt: skip
        return []
    refused: list[str] = []  # runs a dry run finds would be refused
    seen: dict = {}  # the lines a dry run found for each converted target and each data (first_problem)
    warned: set[str] = set()  # the targets whose conversion a dry run warned of (once, not per seed)
    for index, spec in enumerate(runs, 1):
        run_dir = spec.run_dir(root)
        label = f"[{index}/{len(runs)}] {spec.target} seed{spec.seed}" + (f" {spec.phase}" if spec.phase else "")
        init_from = previous_dir.get((spec.target, spec.seed))
        untrained = None  # the refusal of a run whose init_from target is not trained (nor trained before it here)
        if init_from is None and spec.init_from is not None:  # another target's last phase, same seed
            source = [r for r in manifest.runs if r.target == spec.init_from and r.seed == spec.seed][-1]
            init_from = source.run_dir(root)
            untrained = untrained_init_from(manifest, spec, source, root, runs[: index - 1])
            if untrained is not None and not dry_run:
                raise untrained
        previous_dir[(spec.target, spec.seed)] = run_dir
        converted = converted_folder(root, spec) if spec.source is not None else None
        if converted is not None and init_from is None:
            init_from = converted
        if dry_run:
            fresh = converted is not None and init_from == converted and not converted.exists()
            if fresh and spec.source["target"] == spec.target and spec.target not in warned:  # as the run would
                warned.add(spec.target)
                unfinished_source_warning(first_phases(list(manifest.runs))[spec.target], data_dir)
            made = f" (converted from {spec.source['model']} first)" if fresh else ""
            start = f" from {init_from}" if init_from else ""
            before = (" ".join(str(untrained).split()) if untrained is not None else
                      first_problem(spec, first_phases(list(manifest.runs)), root, data_dir, seen))  # fmt: skip
            status = dry_run_status(spec, run_dir, converted, data_dir, resume, start + made, before)
            log(f"{label}: {status}")
            if status.startswith("would be refused"):
                refused.append(label)
            summaries.append(None)
            continue
        tokenizer = None
        if converted is not None:  # the conversion, made once (by its target's first run)
            if dist_info.is_main and spec.source["target"] == spec.target:
                made = converted.exists()
                converted_model(first_phases(list(manifest.runs))[spec.target], root, data_dir, log)
                if made and not resume and converted not in kept:  # said once, not per seed
                    kept.add(converted)
                    log(f"{spec.target}: {_kept(converted, resume)}")
            barrier(dist_info)
            tokenizer = tokenizer_from_folder(converted / "tokenizer", name=spec.data.tokenizer)
        elif names_model(spec.data.tokenizer) and spec.data not in prepared_by_data:  # a model's tokenizer alone
            tokenizer = model_tokenizer(spec.data.tokenizer, data_dir)
        if spec.data not in prepared_by_data:
            prepared_by_data[spec.data] = prepare_rank0_first(spec.data, data_dir, dist_info, tokenizer)
        prepared = prepared_by_data[spec.data]
        if converted is not None:
            model_cfg = run_config(spec, converted)
        else:
            model_cfg = spec.model_config(prepared.vocab_size)
        config = full_config(model_cfg, spec.data, spec.train)
        check = _data_problem(spec.data, prepared.meta, data_dir, run_dir, finished=True)
        summary = finished_run(run_dir, config, manifest.path, check)
        if summary is not None:
            log(f"{label}: done already (val loss {summary.get('val_loss', float('nan')):.4f}), skipped")
            summaries.append(summary)
            continue
        made = _missing_folders(run_dir)
        with run_lock(run_dir) if dist_info.is_main else contextlib.nullcontext():
            try:
                summary = finished_run(run_dir, config, manifest.path, check)  # (finished by another process just now)
                if summary is not None:
                    log(f"{label}: done already (val loss {summary.get('val_loss', float('nan')):.4f}), skipped")
                    summaries.append(summary)
                    continue
                problem = None if resume else interrupted_run_problem(run_dir, config)
                if problem:
                    raise ConfigError(problem, source=str(manifest.path))
                checkpoint = find_checkpoint(run_dir) if resume else None
                if checkpoint is not None:  # before anything is written or said: a refusal leaves the folder as it was
                    refuse_resume(spec, run_dir, checkpoint, config, prepared.meta, data_dir)
                resuming = f" (resuming from step {checkpoint.step})" if checkpoint is not None else ""
                log(f"{label}: training {spec.train.steps} steps ({model_cfg.attention.kind}) into {run_dir}"
                    f"{resuming}")  # fmt: skip
                start = time.perf_counter()
                files = {"config.yaml": yaml.safe_dump(config, sort_keys=False),
                         "command.txt": command_line() + "\n"}  # fmt: skip
                summary = train(
                    model_cfg, spec.data, spec.train, run_dir, prepared=prepared, resume=resume, init_from=init_from,
                    progress=progress, run_files=files if dist_info.is_main else None,
                )  # fmt: skip
            except BaseException:
                if dist_info.is_main:
                    _remove_empty(made)  # a refused fresh run leaves no folder behind
                raise
        nan = float("nan")
        log(
            f"{label}: val loss {summary.get('val_loss', nan):.4f} (ppl {_ppl(summary.get('val_ppl', nan))}),"
            f" {summary.get('train_tok_per_s', 0):,.0f} tok/s, {time.perf_counter() - start:.0f} s"
        )
        summaries.append(summary)
    if not dry_run and dist_info is not None and dist_info.is_main:
        # Which manifest made this folder, for the reader: nothing reads it back (the runs' own folders say what they
        # were trained with), so a damaged one is simply written again, as compare.md is drawn again.
        write_json_atomic(root / "manifest.json", {"name": manifest.name, "path": str(manifest.path)})
    if refused:  # a dry run says so in its exit code too, as the run would (each run's reason is printed above)
        raise ConfigError(f"{len(refused)} of {len(runs)} runs would be refused ({', '.join(refused)}): the reasons "
                          "are printed above", source=str(manifest.path))  # fmt: skip
    return summaries
