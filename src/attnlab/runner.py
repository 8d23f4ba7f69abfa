"""`attnlab run`: every target x seed (x phase) of a manifest into runs/<manifest>/<target>/seed<S>/.

Finished runs (summary.json) are skipped, interrupted ones resume from their last checkpoint, and a run
folder made with another config is an error rather than silently reused. Before the first run starts (dry runs
too) every folder a run would write is checked to lie inside --out, every local data file to exist, and every
named dataset to be prepared, found or (downloads allowed) downloadable; a dry run says what the runs would
download first, and downloads nothing.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import yaml

from attnlab.config import names_model
from attnlab.config_checks import unknown_key_problem
from attnlab.data.files import atomic_write_text, downloads_allowed, read_json_object
from attnlab.data.prepared import cache_key, default_cache_dir, folder_name
from attnlab.data.pretrained import tokenizer_from_folder
from attnlab.data.sources import NAMED_SOURCES, download_plan, local_path, open_source
from attnlab.errors import ConfigError, DataError
from attnlab.manifest import Manifest, RunSpec
from attnlab.paths import inside
from attnlab.retrofit import (
    check_pretrained,
    converted_folder,
    converted_model,
    first_phases,
    model_tokenizer,
    run_config,
)
from attnlab.train.checkpoint import write_json_atomic
from attnlab.train.distributed import barrier, init_distributed, prepare_rank0_first
from attnlab.train.loop import _config_differences, full_config, pick_device, train


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


def local_source_problems(runs: list[RunSpec], data_dir: str | None) -> list[str]:
    """One line per local data.source file of the runs that is not found (named datasets are not checked)."""
    missing = []
    for source in dict.fromkeys(spec.data.source for spec in runs):
        if source not in NAMED_SOURCES:
            try:
                local_path(source, data_dir)
            except DataError as e:
                missing.append(str(e))
    return missing


def check_runs(manifest: Manifest, runs: list[RunSpec], out_root: str | Path, data_dir: str | None) -> list[str]:
    """What would fail once the runs start, checked before the first: a folder the runs write (or read a previous
    phase from) outside `out_root` (ConfigError), a local data file that is not there, a named dataset that is
    neither prepared nor found (offline) or cannot be downloaded (DataError). Downloads nothing: returns what the
    runs would download first, one line per dataset (`attnlab run --dry-run` prints them)."""
    root = Path(out_root) / manifest.name
    problems = []
    for path in [root, *(spec.run_dir(root) for spec in manifest.runs)]:
        try:
            inside(path, out_root, "run folder")
        except ConfigError as e:
            problems.extend(e.problems)
    if problems:
        raise ConfigError(problems, source=str(manifest.path))
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
    problems = check_pretrained(runs, list(manifest.runs), data_dir)  # reads the models' metadata, not weights
    if problems:
        raise ConfigError(problems, source=str(manifest.path))
    return downloads


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
) -> list[dict]:
    """Runs the selected runs in order; returns one summary per run (None for dry runs). convert_only: make the
    selected pretrained targets' conversions (<target>/converted, the cold models) and train nothing."""
    if Path(out_root).exists() and not Path(out_root).is_dir():
        raise ConfigError(f"--out {out_root}: a file, not a folder (runs are written into a folder)")
    root = Path(out_root) / manifest.name
    runs = select_runs(manifest, targets, seeds)
    downloads = check_runs(manifest, runs, out_root, data_dir)
    if dry_run:
        for plan in downloads:
            log(f"data: {plan} first")
    # Under torchrun every rank runs this loop; rank 0 alone writes files and prints.
    dist_info = init_distributed(pick_device(runs[0].train.device).type) if runs else None
    if dist_info is not None and not dist_info.is_main:
        log = lambda *a, **k: None  # noqa: E731
    prepared_by_data: dict = {}
    previous_dir: dict[tuple[str, int], Path] = {}
    summaries = []
    if convert_only:
        firsts = first_phases(list(manifest.runs))
        if not any(spec.target in firsts for spec in runs):
            raise ConfigError(
                "--convert-only: no selected target starts from a pretrained model (init_from: <model reference>): "
                "there is nothing to convert", source=str(manifest.path)
            )  # fmt: skip
        for name in dict.fromkeys(spec.target for spec in runs if spec.target in firsts):
            folder = converted_folder(root, firsts[name])
            if dry_run:
                log(f"{name}: would convert {firsts[name].source['model']} into {folder}"
                    + (" (made already)" if folder.exists() else ""))  # fmt: skip
            elif dist_info.is_main:
                folder = converted_model(firsts[name], root, data_dir, log)
                log(f"{name}: {folder}")
        return []
    for index, spec in enumerate(runs, 1):
        run_dir = spec.run_dir(root)
        label = f"[{index}/{len(runs)}] {spec.target} seed{spec.seed}" + (f" {spec.phase}" if spec.phase else "")
        init_from = previous_dir.get((spec.target, spec.seed))
        if init_from is None and spec.init_from is not None:  # another target's last phase, same seed
            source = [r for r in manifest.runs if r.target == spec.init_from and r.seed == spec.seed][-1]
            init_from = source.run_dir(root)
            if not dry_run and not (init_from / "summary.json").exists():
                raise ConfigError(
                    f"targets.{spec.target}.init_from: {init_from} is not trained yet (run target "
                    f"{spec.init_from} first, or run the whole manifest)", source=str(manifest.path)
                )  # fmt: skip
        previous_dir[(spec.target, spec.seed)] = run_dir
        converted = converted_folder(root, spec) if spec.source is not None else None
        if converted is not None and init_from is None:
            init_from = converted
        if dry_run:
            fresh = converted is not None and init_from == converted and not converted.exists()
            made = f" (converted from {spec.source['model']} first)" if fresh else ""
            log(
                f"{label}: would train {spec.train.steps} steps into {run_dir}"
                + (f" from {init_from}" if init_from else "")
                + made
            )
            summaries.append(None)
            continue
        tokenizer = None
        if converted is not None:  # the conversion, made once (by its target's first run)
            if dist_info.is_main and spec.source["target"] == spec.target:
                converted_model(first_phases(list(manifest.runs))[spec.target], root, data_dir, log)
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
        summary_path = run_dir / "summary.json"
        if summary_path.exists():
            fix = "delete the run's folder to train it again"
            saved, summary = read_json_object(run_dir / "config.json", fix), read_json_object(summary_path, fix)
            differences = _config_differences(saved, config, saved_as="saved")
            if differences:
                more = f" (and {len(differences) - 1} more)" if len(differences) > 1 else ""
                raise ConfigError(
                    f"{run_dir} holds a finished run made with another config ({differences[0]}{more}); "
                    "use another --out directory or delete that folder", source=str(manifest.path)
                )  # fmt: skip
            log(f"{label}: done already (val loss {summary.get('val_loss', float('nan')):.4f}), skipped")
            summaries.append(summary)
            continue
        if dist_info.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(config, sort_keys=False))
            atomic_write_text(run_dir / "command.txt", shlex.join(sys.argv) + "\n")
        log(f"{label}: training {spec.train.steps} steps ({model_cfg.attention.kind}) into {run_dir}")
        start = time.perf_counter()
        summary = train(
            model_cfg, spec.data, spec.train, run_dir, prepared=prepared, resume=resume, init_from=init_from,
            progress=progress,
        )  # fmt: skip
        nan = float("nan")
        log(
            f"{label}: val loss {summary.get('val_loss', nan):.4f} (ppl {summary.get('val_ppl', nan):.2f}),"
            f" {summary.get('train_tok_per_s', 0):,.0f} tok/s, {time.perf_counter() - start:.0f} s"
        )
        summaries.append(summary)
    if not dry_run and dist_info is not None and dist_info.is_main:
        write_json_atomic(root / "manifest.json", {"name": manifest.name, "path": str(manifest.path)})
    return summaries
