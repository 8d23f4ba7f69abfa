"""`attnlab compare RUNS_DIR`: one row per target (mean ± std over seeds), as Markdown and CSV, and a PNG
of validation loss against tokens seen. Pure functions of the run folders' summary.json, config.json
and metrics.jsonl, so a table can be redrawn at any time without training anything.

RUNS_DIR is the folder `attnlab run` wrote for a manifest (runs/<manifest>), or any folder above or below it: a
folder holding several manifests' runs, a target's folder or one run's (then with --out elsewhere: a run's folder
keeps only what training wrote). Seeds are averaged only when they are runs of one target folder trained with one
config (train.seed apart): targets of the same name from different manifests, or seeds trained with another config
(a --set on one seed), are rows of their own, and said."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
import statistics
import warnings
from pathlib import Path

from attnlab.data.files import (
    atomic_write_text,
    outputs_together,
    read_json_lines,
    read_json_object,
    seal_kept,
    sha256_file,
    special_file,
)
from attnlab.errors import AttnlabWarning, DataError, InputError
from attnlab.eval.plots import plot_val_loss
from attnlab.eval.records import distinct_labels, exponential_problem, range_problem
from attnlab.output_record import changed_output, record_line
from attnlab.paths import SUMMARY_STATUS, brief, cache_folder_problem, is_run_folder

SEED_DIR = re.compile(r"seed(\d+)")
WHERE = "give the folder `attnlab run --out` wrote for a manifest, e.g. runs/quickstart"


def collect_runs(runs_dir: str | Path, quiet: bool = False, unsealed: bool = False) -> list[dict]:
    """Every finished run under runs_dir (runs_dir itself may be a target's or a run's folder): {target, seed,
    phase, dir, target_dir, config (its config.json without train.seed, as a string), summary, val_curve
    [(tokens, loss)]}. Summaries without a seal (an older attnlab's) are refused (DataError, unsealed_problem) unless
    unsealed: then one AttnlabWarning line names them (unless quiet)."""
    runs_dir = Path(runs_dir)
    if runs_dir.is_file():
        raise DataError(f"{runs_dir}: a file, not a folder ({WHERE})")
    if not runs_dir.is_dir():
        raise DataError(f"{runs_dir}: no such directory ({WHERE})")
    runs = read_runs(runs_dir)
    if not runs:
        raise DataError(f"{runs_dir}: no finished runs (<target>/seed<S>/summary.json) in it or below it ({WHERE})")
    check_unsealed(runs, unsealed, quiet)
    return runs


def read_runs(runs_dir: Path, own: set[Path] | None = None, skip: set[Path] = frozenset()) -> list[dict]:
    """collect_runs' runs, each file checked (DataError naming it: not a regular file, a summary changed after the
    run wrote it, impossible figures), none refused for want of a seal. own: the run folders (resolved) `attnlab
    run` of a manifest writes, when it looks before it trains: the others' fix is not to run it again. skip: run
    folders (resolved) checked elsewhere (the runs `attnlab run` trains, as it reaches them), of which only a
    readable summary with no seal is taken (for check_unsealed)."""
    above = runs_dir.resolve().parts[-2:]  # runs_dir and its parent: a run's folder is <target>/seed<S>
    runs = []
    for summary_path in sorted(runs_dir.rglob("summary.json")):
        parts = (*above, *summary_path.parent.relative_to(runs_dir).parts)
        seed_at = next((i for i, p in enumerate(parts) if i > 0 and SEED_DIR.fullmatch(p)), None)
        if seed_at is None:
            continue
        if summary_path.parent.resolve() in skip:
            try:
                check_run_file(summary_path)
                summary = read_json_object(summary_path)
            except DataError:  # (said by the run's own checks, in its words)
                continue
            runs += [{"dir": str(summary_path.parent), "summary": summary}] if seal_kept(summary) is None else []
            continue
        phase = parts[seed_at + 1 :]
        seed_dir = summary_path.parents[len(phase)]
        metrics = summary_path.parent / "metrics.jsonl"
        for path in (summary_path, metrics, summary_path.parent / "config.json"):
            check_run_file(path)
        curve = []
        if metrics.exists():
            for row in read_json_lines(metrics):
                if isinstance(row.get("val_loss"), int | float) and isinstance(row.get("tokens"), int):
                    curve.append((row["tokens"], row["val_loss"]))
        runs.append({
            "target": parts[seed_at - 1],
            "seed": int(SEED_DIR.fullmatch(parts[seed_at]).group(1)),
            "phase": "/".join(phase) or None,
            "dir": str(summary_path.parent),
            "target_dir": str(seed_dir.parent),
            "config": _config(summary_path.parent / "config.json"),
            "summary": _summary(summary_path, None if own is None or summary_path.parent.resolve() in own else
                                foreign_fix(summary_path, runs_dir)),
            "val_curve": curve,
        })  # fmt: skip
    return runs


def check_unsealed(runs: list[dict], unsealed: bool, quiet: bool, root: Path | None = None, own=None) -> None:
    """Refuses (DataError, unsealed_problem) runs whose summary has no seal, unless unsealed: then one
    AttnlabWarning line names them, unless quiet. root and own: read_runs' (`attnlab run`'s look before it trains)."""
    unverified = [Path(run["dir"]) / "summary.json" for run in runs if seal_kept(run["summary"]) is None]
    if unverified and not unsealed:
        foreign = [p for p in unverified if own is not None and p.parent.resolve() not in own]
        raise DataError(unsealed_problem(foreign[:1], foreign_fix(foreign[0], root)) if foreign else
                        unsealed_problem(unverified))  # fmt: skip
    if unverified and not quiet:  # (one line for them all; quiet: compare says it when it runs)
        many = len(unverified) > 1
        more, it, they, its = (f" and {len(unverified) - 1} more", "them", "they", "their") if many else (
            "", "it", "it", "its")  # fmt: skip
        warnings.warn(f"{unverified[0]}{more}: no sha256 in {it} (an older attnlab wrote {it}, or it was taken out): "
                      f"attnlab cannot tell whether {they} changed since the run wrote {it}, so {its} figures are "
                      "shown unverified (--unsealed)", AttnlabWarning, stacklevel=3)  # fmt: skip


def foreign_fix(path: Path, root: Path) -> str:
    """The way on for a summary below a manifest's folder that no run of the manifest writes (another manifest's
    target, an old copy): `attnlab run` does not write it again, and compare reads every run below the folder."""
    return (
        f"it is no run of this manifest, so `attnlab run` does not write it again: move its run folder "
        f"({path.parent}) out of {root}, where compare reads every run"
    )


# `--unsealed` (report, compare, run): what has no seal is shown, unverified, rather than refused
UNSEALED_HELP = (
    "show {what} with no sha256 (an older attnlab's, or with it taken out: attnlab cannot tell whether "
    "they changed since it wrote them) unverified, with a warning, rather than refuse them"
)


def unsealed_problem(paths: list[Path], fix: str | None = None) -> str:
    """The one line refusing run summaries with no seal (paths: their summary.json files; fix: in place of writing
    them again, foreign_fix's)."""
    more, it, they = (f" and {len(paths) - 1} more", "them", "they") if len(paths) > 1 else ("", "it", "it")
    again = fix or (f"delete {'each' if len(paths) > 1 else 'that'} summary.json alone and `attnlab run` the manifest "
                    f"again (it writes {it} again, sealed, from the run's last checkpoint)")  # fmt: skip
    return (f"{paths[0]}{more}: no sha256 in {it} (an older attnlab wrote {it}, or it was taken out), so attnlab "
            f"cannot tell whether {they} changed since the run wrote {it}: give --unsealed to show {it} unverified, "
            f"or {again}")  # fmt: skip


def unfinished_runs(runs_dir: str | Path) -> dict[Path, str]:
    """Run folders under runs_dir (or runs_dir itself) without summary.json, which compare leaves out: folder -> its
    target's name (the folder above seed<S>)."""
    runs_dir = Path(runs_dir)
    folders = [runs_dir, *(p.parent for p in sorted(runs_dir.rglob("config.json")) if p.parent != runs_dir)]
    above = runs_dir.resolve().parts[-2:]
    unfinished = {}
    for folder in folders:
        if is_run_folder(folder) and not (folder / "summary.json").exists():
            parts = (*above, *folder.relative_to(runs_dir).parts)
            seed_at = next((i for i, p in enumerate(parts) if i > 0 and SEED_DIR.fullmatch(p)), None)
            unfinished[folder] = parts[seed_at - 1] if seed_at is not None else folder.name
    return unfinished


def check_run_file(path: Path) -> None:
    """Refuses (DataError, naming it) a folder, fifo, device or socket where a run keeps a file: reading a fifo
    waits for a writer without end, and a device (a link to /dev/zero) never ends."""
    what = special_file(path)
    if what is not None:
        raise DataError(f"{path}: {what}, where a run keeps its {path.name}: put the run's own file back, or "
                        "delete the run's folder and train it again")  # fmt: skip


def config_fix(run_dir: Path) -> str:
    """What to do about a run's config.json that cannot be read: copy the one its newest checkpoint keeps (the same
    config: a run resumes only with its own); only with no checkpoint's readable, delete the folder and train again."""
    for folder in sorted(Path(run_dir).glob("checkpoints/step-*"), reverse=True):
        try:
            read_json_object(folder / "config.json")
        except DataError:
            continue
        return f"copy {folder / 'config.json'} over it (each checkpoint keeps the run's config)"
    return "delete the run's folder, and train it again"


def _config(path: Path) -> str | None:
    """A run's resolved config (config.json) without train.seed, as a string: equal for the seeds of one config.
    None when the run has none (seeds without one are taken as one config)."""
    if not path.is_file():
        return None
    config = read_json_object(path, config_fix(path.parent))
    train = config.get("train")
    if isinstance(train, dict):
        config = {**config, "train": {k: v for k, v in train.items() if k != "seed"}}
    return json.dumps(config, sort_keys=True, default=str)


def _mean_std(values: list[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation over the seeds that have a value (None, None when none has); a NaN or
    infinite value (a diverged run) makes the mean NaN or infinite, so that the table shows it."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    spread = len(values) > 1 and all(math.isfinite(v) for v in values)
    return statistics.fmean(values), (statistics.stdev(values) if spread else None)


def summary_problem(summary: dict, saved: dict, config: dict, checkpoint) -> str | None:
    """What in a finished run's summary.json disagrees with the run (train() writes it at the last step, when the
    last checkpoint is saved): its config_hash (of the model config) neither the config's nor that of the run's
    config.json (as an older attnlab hashed it), its steps not train.steps, or the last checkpoint at another step;
    None when nothing does. A key the summary lacks is not compared."""
    said, steps = [], (config.get("train") or {}).get("steps")
    if "config_hash" in summary:
        ours = _model_hash(config.get("model"))
        if summary["config_hash"] not in {ours, _model_hash(saved.get("model") if isinstance(saved, dict) else None)}:
            said.append(f"config_hash {brief(summary['config_hash'])}, the run's config's {ours!r}")
    if "steps" in summary and summary["steps"] != steps:
        said.append(f"steps {brief(summary['steps'])}, the config's train.steps {steps}")
    if checkpoint is not None and checkpoint.step != summary.get("steps", steps):
        said.append(f"its last checkpoint is at step {checkpoint.step}")
    return "; ".join(said) or None


def _model_hash(model) -> str | None:
    """ModelConfig.config_hash of a saved config's model (a dict, as to_dict gave it)."""
    if not isinstance(model, dict):
        return None
    return hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()[:12]


def _summary(path: Path, fix: str | None = None) -> dict:
    """A run's summary.json, its figures checked (DataError naming the file when one is missing or not a number, is
    impossible, or a perplexity that is not the exponential of its loss). fix: foreign_fix's, for a run that
    `attnlab run` does not write again."""
    # (the run's checkpoints are all there: `attnlab run` writes a finished run's summary again from its last one)
    fix = fix or (
        "delete summary.json alone and `attnlab run` the manifest again: it writes the summary again from the run's "
        "last checkpoint"
    )
    summary = read_json_object(path, fix)
    if seal_kept(summary) is False:
        raise DataError(f"{path}: changed after the run wrote it (its sha256 no longer matches its fields); {fix}")
    for key in ("params", "kv_bytes_per_token_fp16", "val_loss"):
        if key not in summary:
            raise DataError(f"{path}: no {key!r} in it (it was changed); {fix}")
    for key in ("params", "kv_bytes_per_token_fp16", "val_loss", "val_ppl", "test_loss", "test_ppl", "train_tok_per_s"):
        value = summary.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise DataError(f"{path}: {key}={value!r} is not a number (it was changed); {fix}")
    # whole numbers (a model has parameters; a split's score is over tokens)
    for key, least in (("params", 1), ("steps", 0), ("tokens", 0), ("val_tokens", 0), ("test_tokens", 0)):
        value = summary.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise DataError(f"{path}: field '{key}' is {value!r}, which is impossible (a whole number >= {least}): it "
                            f"was changed by hand; {fix}")  # fmt: skip
    for key in ("kv_bytes_per_token_fp16", "train_tok_per_s"):  # measured, whatever the model learned: finite
        value = summary.get(key)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise DataError(f"{path}: field '{key}' is {value!r}, which is impossible (a finite number >= 0): it "
                            f"was changed by hand; {fix}")  # fmt: skip
    for split in ("val", "test"):  # figures that contradict each other, refused as `attnlab report` refuses them
        loss, ppl = f"{split}_loss", f"{split}_ppl"
        for key in (loss, ppl):  # (a run whose loss is not finite stops there, DivergedError: it writes no summary;
            value = summary.get(key)  # a finite loss past exp's range has an infinite perplexity)
            if isinstance(value, float) and (math.isnan(value) or (key == loss and math.isinf(value))):
                raise DataError(f"{path}: field '{key}' is {value}, which a run never writes (training stops when its "
                                f"loss is not finite): it was changed by hand; {fix}")  # fmt: skip
        if summary.get(loss) is not None and summary.get(f"{split}_tokens") == 0:
            raise DataError(f"{path}: field '{loss}' is given over '{split}_tokens' 0, which is impossible (a loss "
                            f"is a mean over tokens): it was changed by hand; {fix}")  # fmt: skip
        value = summary.get(loss)
        if isinstance(value, int | float) and value > 50 and summary.get(ppl) == math.exp(50.0):
            continue  # (an older attnlab wrote exp(min(loss, 50)))
        problem = (range_problem(loss, summary.get(loss), "loss") or range_problem(ppl, summary.get(ppl), "ppl")
                   or exponential_problem(summary, loss, ppl))  # fmt: skip
        if problem:
            raise DataError(f"{path}: {problem}: it was changed by hand; {fix}")
    if summary.get("status") != SUMMARY_STATUS:  # (the one status a finished run writes)
        said = f"status={brief(summary['status'])}" if "status" in summary else "no 'status'"
        raise DataError(f"{path}: {said}, where a finished run's summary has status {SUMMARY_STATUS!r} (the only "
                        f"value attnlab writes: it was changed by hand); {fix}")  # fmt: skip
    try:  # (a run's config.json that cannot be read is said where the configs are read)
        saved = read_json_object(path.parent / "config.json") if (path.parent / "config.json").is_file() else None
    except DataError:
        saved = None
    problem = summary_problem(summary, saved, saved, None) if saved is not None else None
    if problem:
        raise DataError(f"{path}: not this run's summary ({problem}): it was copied in from another run or edited; "
                        f"{fix}")  # fmt: skip
    return summary


def group_runs(runs: list[dict]) -> tuple[dict[str, list[dict]], list[str]]:
    """({row name: its runs}, notes): the seeds of one target folder, phase and config (train.seed apart) make a
    row, named by the target (and phase); a target name that several folders hold (several manifests' runs) is
    named by the folders' last parts (tiny/base, mem/base), and a target whose seeds differ in config by what
    differs (base (train.lr=0.03)). Each such split is said in a note."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["target_dir"], run["phase"], run.get("config")), []).append(run)
    folders = distinct_labels({run["target_dir"]: run["target"] for run in runs})
    names = {key: folders[key[0]] + (f" ({key[1]})" if key[1] else "") for key in groups}
    notes = []
    shared = sorted({folders[d] for d in folders if folders[d] != Path(d).name})
    if shared:
        notes.append(f"Targets of one name in several folders (several manifests' runs) are shown apart: "
                     f"{', '.join(shared)}.")  # fmt: skip
    for name in dict.fromkeys(names.values()):
        keys = [key for key in groups if names[key] == name]
        if len(keys) < 2:
            continue
        configs = {key: _flat(json.loads(key[2])) if key[2] else {} for key in keys}
        differ = sorted({k for c in configs.values() for k in c if len({json.dumps(x.get(k)) for x in
                                                                          configs.values()}) > 1})  # fmt: skip
        for key in keys:
            shown = ", ".join(f"{k}={configs[key].get(k)}" for k in differ[:2]) + (", ..." if len(differ) > 2 else "")
            names[key] = f"{name} ({shown})"
        seeds = "; ".join(f"seed{', seed'.join(str(r['seed']) for r in groups[key])}: " + ", ".join(
            f"{k} {configs[key].get(k)}" for k in differ[:3]) for key in keys)  # fmt: skip
        notes.append(f"{name}: its seeds were trained with different configs ({seeds}): each config is a row of its "
                     "own, not averaged as seeds of one target.")  # fmt: skip
    out: dict[str, list[dict]] = {}
    for key, members in groups.items():
        out[names[key]] = members
    unlike = scoring_note(out)
    return out, [*notes, unlike] if unlike else notes


# What a run's held-out losses are over: its data and its evaluation windows. Rows that differ in one compare losses
# over different tokens (two manifests' runs in one folder), which "val loss vs base" would hide.
SCORED_BY = ("train.seq_len", "train.eval_tokens", "train.test_tokens")


def scoring_note(groups: dict[str, list[dict]]) -> str | None:
    """A note when the rows' losses were scored on different held-out tokens (data.* or SCORED_BY differ), naming
    the first such key and two rows that differ in it; None when every row was scored alike."""
    scored = {}
    for name, members in groups.items():
        config = _flat(json.loads(members[0]["config"])) if members[0].get("config") else {}
        scored[name] = {k: v for k, v in config.items() if k.startswith("data.") or k in SCORED_BY}
    for key in sorted({k for c in scored.values() for k in c}):
        values = {}
        for name, config in scored.items():
            values.setdefault(json.dumps(config.get(key)), name)
        if len(values) > 1:
            (a, first), (b, second) = list(values.items())[:2]
            return (f"Rows scored on different held-out tokens ({key} {a} in {first}, {b} in {second}): their "
                    "losses, and 'val loss vs base', compare unlike things; compare each manifest's runs on their "
                    "own.")  # fmt: skip
    return None


def _flat(config: dict, prefix: str = "") -> dict:
    """{"train.lr": 0.001, ...}: a nested config's leaves by dotted key."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def baseline_name(names: list[str], baseline: str | None = None) -> str:
    """The baseline among row or target names: `baseline` if there, else one called baseline or mha, else the first."""
    return baseline if baseline in names else next((n for n in ("baseline", "mha") if n in names), names[0])


def compare_table(runs: list[dict], baseline: str | None = None) -> list[dict]:
    """One row per target and phase (see group_runs): means and sample standard deviations over seeds, and each
    row's validation loss and KV bytes relative to the baseline (the row named by `baseline`, else one called
    baseline or mha, else the first)."""
    rows = []
    for name, members in group_runs(runs)[0].items():
        summaries = [m["summary"] for m in members]
        row = {"target": name, "seeds": len(members)}
        row["params"] = summaries[0].get("params")
        row["kv_bytes_per_token_fp16"] = summaries[0].get("kv_bytes_per_token_fp16")
        for key in ("val_loss", "val_ppl", "test_loss", "test_ppl", "train_tok_per_s"):
            row[key], row[key + "_std"] = _mean_std([s.get(key) for s in summaries])
        rows.append(row)
    names = [r["target"] for r in rows]
    if baseline is not None and baseline not in names:
        raise InputError(f"baseline {baseline!r} is not one of the targets ({', '.join(names)})")
    base_name = baseline_name(names, baseline)
    base = rows[names.index(base_name)]
    for row in rows:
        loss, base_loss = row["val_loss"], base["val_loss"]
        row["val_loss_vs_baseline"] = loss / base_loss - 1 if loss is not None and base_loss else None
        kv, base_kv = row["kv_bytes_per_token_fp16"], base["kv_bytes_per_token_fp16"]
        row["kv_vs_baseline"] = kv / base_kv if kv and base_kv else None
        row["baseline"] = base_name
    return rows


def _number(value: float | None, spec: str) -> str:
    """`value` formatted by `spec`; "-" when missing, "nan" or "inf" as such (a diverged run stays visible), and in
    exponent form past a billion (a diverged run's perplexity, not 134 digits), as `attnlab report` shows it."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.3e}" if abs(value) >= 1e9 and spec.endswith("f") else f"{value:{spec}}"


def _pm(mean: float | None, std: float | None, digits: int) -> str:
    return _number(mean, f".{digits}f") + (f" ± {_number(std, f'.{digits}f')}" if std is not None else "")


def to_markdown(rows: list[dict], notes: list[str] = ()) -> str:
    header = ("| target | seeds | params | KV B/token (fp16) | KV vs base | val loss | val ppl | val loss vs base "
              "| test loss | test ppl | train tok/s |")  # fmt: skip
    lines = [header, "|" + " --- |" * 11]
    for r in rows:
        lines.append(
            f"| {r['target']} | {r['seeds']} | {r['params']:,} | {r['kv_bytes_per_token_fp16']:,} "
            f"| {_number(r['kv_vs_baseline'], '.3f')}x | {_pm(r['val_loss'], r['val_loss_std'], 4)} "
            f"| {_pm(r['val_ppl'], r['val_ppl_std'], 2)} | {_number(r['val_loss_vs_baseline'], '+.1%')} "
            f"| {_pm(r['test_loss'], r['test_loss_std'], 4)} | {_pm(r['test_ppl'], r['test_ppl_std'], 2)} "
            f"| {_pm(r['train_tok_per_s'], r['train_tok_per_s_std'], 0)} |"
        )
    text = "\n".join(lines) + f"\n\nBaseline: {rows[0]['baseline']}. ± is the sample standard deviation over seeds.\n"
    return text + "".join(f"\nNote: {note}\n" for note in notes)


def to_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def compare(
    runs_dir: str | Path,
    out_dir: str | Path | None = None,
    baseline: str | None = None,
    kept: bytes | None = None,
    unsealed: bool = False,
) -> dict:
    """Writes compare.md, compare.csv and val_loss.png into out_dir (default runs_dir), all three or none; returns
    paths + text. A run's folder (or a folder inside one) is refused as out_dir: the run's files are training's.
    kept: a compare.md with no record that `attnlab run` accepted before it trained (check_outputs). unsealed:
    compare summaries with no seal (an older attnlab's), unverified, rather than refuse them."""

    runs = collect_runs(runs_dir, unsealed=unsealed)
    unfinished = unfinished_runs(runs_dir)
    finished = {run["target"] for run in runs}
    if baseline is not None and baseline not in finished and baseline in unfinished.values():
        raise InputError(f"--baseline {baseline}: that target has no finished run (no summary.json): let its "
                         f"training finish, or give another baseline ({', '.join(sorted(finished))})")  # fmt: skip
    for folder in unfinished:
        warnings.warn(f"{folder}: no summary.json (its training is unfinished, interrupted or damaged): left out of "
                      "the comparison", AttnlabWarning, stacklevel=2)  # fmt: skip
    rows = compare_table(runs, baseline)
    every = sorted(finished | set(unfinished.values()))  # the baseline with every run finished (compare_table's)
    default = baseline_name(every)
    if baseline is None and default not in finished:
        warnings.warn(f"target {default!r} has no finished run: the baseline is {rows[0]['baseline']!r} instead",
                      AttnlabWarning, stacklevel=2)  # fmt: skip
    groups, notes = group_runs(runs)
    unverified = [name for name, members in groups.items() if any(seal_kept(m["summary"]) is None for m in members)]
    if unverified:  # (--unsealed: said in the files too, which are shared without the warning)
        notes.append(f"Unverified: {', '.join(unverified)}: {'its' if len(unverified) == 1 else 'their'} summary.json "
                     "carries no sha256 (an older attnlab's, or it was taken out), so attnlab cannot tell whether the "
                     "figures were changed since the run wrote them; shown as read (--unsealed).")  # fmt: skip
    unlike = scoring_note(groups)
    if unlike:  # (group_runs says it in the table's notes too)
        warnings.warn(unlike, AttnlabWarning, stacklevel=2)
    runs = [{**run, "row": name} for name, members in groups.items() for run in members]  # the plot's names
    check_not_in_run(runs_dir, out_dir)
    out_dir = Path(out_dir or runs_dir)
    paths = {"markdown": out_dir / "compare.md", "csv": out_dir / "compare.csv", "plot": out_dir / "val_loss.png"}
    markdown = to_markdown(rows, notes)
    check_outputs(paths.values(), markdown, kept)  # nothing written while one of them is the user's own
    with outputs_together(out_dir, "compare") as stage:  # the three written, then renamed: together or not at all
        atomic_write_text(stage / "compare.csv", to_csv(rows))
        try:
            plot_val_loss(runs, stage / "val_loss.png")
        except OSError as e:  # (the image library names no file: a file size limit would name nothing)
            if e.filename is None:
                e.filename = str(stage / "val_loss.png")
            raise
        written = {name: sha256_file(stage / name) for name in ("compare.csv", "val_loss.png")}
        atomic_write_text(stage / "compare.md", markdown + record_line("compare", "compare.md", markdown, written))
    return {"rows": rows, "text": markdown, **paths}


def markdown_now(runs_dir: Path) -> str | None:
    """compare.md's text as compare would write it from runs_dir's runs now (`attnlab run` checks, before it trains,
    a compare.md with no record against it); None where compare has nothing to say yet or would refuse a run (it
    names that itself when it runs); "" where no run has finished (no table yet)."""
    if runs_dir.is_dir() and not any(runs_dir.rglob("summary.json")):
        return ""
    try:
        runs = collect_runs(runs_dir, quiet=True, unsealed=True)
        return to_markdown(compare_table(runs), group_runs(runs)[1])
    except (DataError, InputError, OSError, ValueError, KeyError, TypeError):
        return None


def check_not_in_run(runs_dir: str | Path, out_dir: str | Path | None) -> None:
    """Refuses (InputError, one line) writing compare's files into a run's folder or a folder inside one (the
    default out_dir when runs_dir is one run's folder): that folder holds what training wrote, and is kept as
    training left it; a comparison of one run goes where --out says."""
    given = Path(out_dir if out_dir is not None else runs_dir)
    problem = cache_folder_problem(out_dir) if out_dir is not None else None
    if problem:
        raise InputError(problem)
    path = given.resolve()
    run = next((folder for folder in (path, *path.parents) if is_run_folder(folder)), None)
    if run is None:
        return
    where = "is" if run == path else f"is inside {run}, which is"
    files = "compare.md, compare.csv and val_loss.png"
    if out_dir is not None:
        raise InputError(f"--out {out_dir} {where} a run's folder (it holds config.json and the run's checkpoints): "
                         f"compare writes {files} elsewhere; give --out a folder outside the run")  # fmt: skip
    manifest = next((f.parent.parent for f in (run, *run.parents) if SEED_DIR.fullmatch(f.name)), None)
    above = f", or compare the folder above the runs ({manifest}) to write them there" if manifest else ""
    raise InputError(f"{runs_dir} {where} a run's folder (it holds config.json and the run's checkpoints): compare "
                     f"would write {files} among the run's own files; give --out another folder{above}")  # fmt: skip


# How compare's own files begin: another file at their place is the user's, never replaced.
OWN_START = {"compare.md": b"| target | seeds | params |", "compare.csv": b"target,seeds,params,",
             "val_loss.png": b"\x89PNG"}  # fmt: skip


def check_outputs(paths, new_markdown: str | None = None, kept: bytes | None = None) -> None:
    """Refuses (InputError, naming it) a folder or other non-file where compare writes a file, a file there that
    compare did not write (the user's own compare.md is never replaced), and one of compare's own changed since it
    wrote it (a note added to compare.md: its last line records what it wrote, output_record); a compare.md without
    that line only when it is not `new_markdown` (None: not known yet, accepted) nor `kept` (the bytes of one that
    `attnlab run` accepted before it trained, as what compare would write then: the run's result replaces it)."""
    paths = list(paths)
    for path in paths:
        if path.exists() and not path.is_file():
            what = "a folder" if path.is_dir() else "not a regular file"
            raise InputError(f"{path}: {what} where compare writes its {path.name}: move it away, or give another "
                             "--out")  # fmt: skip
        if path.is_file():
            with path.open("rb") as file:
                start = file.read(len(OWN_START[path.name]))
            if start != OWN_START[path.name]:
                raise InputError(f"{path}: not a file attnlab compare wrote (it would be replaced): move it away, "
                                 "or give another --out")  # fmt: skip
    for folder in dict.fromkeys(path.parent for path in paths):
        line = changed_output(folder, "compare", "compare.md", ("compare.csv", "val_loss.png"), new_markdown, kept=kept)
        if line:
            raise InputError(line)
