"""`attnlab compare RUNS_DIR`: one row per target (mean ± std over seeds), as Markdown and CSV, and a PNG
of validation loss against tokens seen. Pure functions of the run folders' summary.json, config.json
and metrics.jsonl, so a table can be redrawn at any time without training anything."""

from __future__ import annotations

import csv
import io
import math
import re
import statistics
from pathlib import Path

from attnlab.data.files import atomic_write_text, read_json_lines, read_json_object
from attnlab.errors import DataError, InputError

SEED_DIR = re.compile(r"seed(\d+)")


def collect_runs(runs_dir: str | Path) -> list[dict]:
    """Every finished run under runs_dir: {target, seed, phase, dir, summary, val_curve [(tokens, loss)]}."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise DataError(f"{runs_dir}: no such directory (give the folder `attnlab run` wrote, e.g. runs/quickstart)")
    runs = []
    for summary_path in sorted(runs_dir.rglob("summary.json")):
        parts = summary_path.parent.relative_to(runs_dir).parts
        seed_at = next((i for i, p in enumerate(parts) if SEED_DIR.fullmatch(p)), None)
        if seed_at is None or seed_at == 0:
            continue
        metrics = summary_path.parent / "metrics.jsonl"
        curve = []
        if metrics.exists():
            for row in read_json_lines(metrics):
                if isinstance(row.get("val_loss"), int | float) and isinstance(row.get("tokens"), int):
                    curve.append((row["tokens"], row["val_loss"]))
        runs.append({
            "target": parts[seed_at - 1],
            "seed": int(SEED_DIR.fullmatch(parts[seed_at]).group(1)),
            "phase": "/".join(parts[seed_at + 1 :]) or None,
            "dir": str(summary_path.parent),
            "summary": _summary(summary_path),
            "val_curve": curve,
        })  # fmt: skip
    if not runs:
        raise DataError(f"{runs_dir}: no finished runs (summary.json) found below it")
    return runs


def _mean_std(values: list[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation over the seeds that have a value (None, None when none has); a NaN or
    infinite value (a diverged run) makes the mean NaN or infinite, so that the table shows it."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    spread = len(values) > 1 and all(math.isfinite(v) for v in values)
    return statistics.fmean(values), (statistics.stdev(values) if spread else None)


def _summary(path: Path) -> dict:
    """A run's summary.json, its figures checked (DataError naming the file when one is missing or not a number)."""
    fix = "delete the run's folder, or train it again"
    summary = read_json_object(path, fix)
    for key in ("params", "kv_bytes_per_token_fp16", "val_loss"):
        if key not in summary:
            raise DataError(f"{path}: no {key!r} in it (it was changed); {fix}")
    for key in ("params", "kv_bytes_per_token_fp16", "val_loss", "val_ppl", "test_loss", "test_ppl", "train_tok_per_s"):
        value = summary.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise DataError(f"{path}: {key}={value!r} is not a number (it was changed); {fix}")
    return summary


def compare_table(runs: list[dict], baseline: str | None = None) -> list[dict]:
    """One row per (target, phase): means and sample standard deviations over seeds, and each target's
    validation loss and KV bytes relative to the baseline (the target named by `baseline`, else one
    called baseline or mha, else the first)."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["target"], run["phase"]), []).append(run)
    rows = []
    for (target, phase), members in groups.items():
        summaries = [m["summary"] for m in members]
        row = {"target": target + (f" ({phase})" if phase else ""), "seeds": len(members)}
        row["params"] = summaries[0].get("params")
        row["kv_bytes_per_token_fp16"] = summaries[0].get("kv_bytes_per_token_fp16")
        for key in ("val_loss", "val_ppl", "test_loss", "test_ppl", "train_tok_per_s"):
            row[key], row[key + "_std"] = _mean_std([s.get(key) for s in summaries])
        rows.append(row)
    names = [r["target"] for r in rows]
    if baseline is not None and baseline not in names:
        raise InputError(f"baseline {baseline!r} is not one of the targets ({', '.join(names)})")
    base_name = baseline if baseline in names else next((n for n in ("baseline", "mha") if n in names), names[0])
    base = rows[names.index(base_name)]
    for row in rows:
        loss, base_loss = row["val_loss"], base["val_loss"]
        row["val_loss_vs_baseline"] = loss / base_loss - 1 if loss is not None and base_loss else None
        kv, base_kv = row["kv_bytes_per_token_fp16"], base["kv_bytes_per_token_fp16"]
        row["kv_vs_baseline"] = kv / base_kv if kv and base_kv else None
        row["baseline"] = base_name
    return rows


def _number(value: float | None, spec: str) -> str:
    """`value` formatted by `spec`; "-" when missing, "nan" or "inf" as such (a diverged run stays visible)."""
    if value is None:
        return "-"
    return f"{value:{spec}}" if math.isfinite(value) else str(value)


def _pm(mean: float | None, std: float | None, digits: int) -> str:
    return _number(mean, f".{digits}f") + (f" ± {std:.{digits}f}" if std is not None else "")


def to_markdown(rows: list[dict]) -> str:
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
    return "\n".join(lines) + f"\n\nBaseline: {rows[0]['baseline']}. ± is the sample standard deviation over seeds.\n"


def to_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def plot_val_loss(runs: list[dict], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {}
    for run in runs:
        if not run["val_curve"]:
            continue
        name = run["target"] + (f" ({run['phase']})" if run["phase"] else "")
        tokens, losses = zip(*run["val_curve"], strict=True)
        label = None if name in colors else name
        line = ax.plot(tokens, losses, color=colors.get(name), label=label, linewidth=1.5, alpha=0.85)[0]
        colors.setdefault(name, line.get_color())
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Validation loss (one line per seed)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def compare(runs_dir: str | Path, out_dir: str | Path | None = None, baseline: str | None = None) -> dict:
    """Writes compare.md, compare.csv and val_loss.png into out_dir (default runs_dir); returns paths + text."""

    runs = collect_runs(runs_dir)
    rows = compare_table(runs, baseline)
    out_dir = Path(out_dir or runs_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = to_markdown(rows)
    paths = {"markdown": out_dir / "compare.md", "csv": out_dir / "compare.csv", "plot": out_dir / "val_loss.png"}
    atomic_write_text(paths["markdown"], markdown)
    atomic_write_text(paths["csv"], to_csv(rows))
    plot_val_loss(runs, paths["plot"])
    return {"rows": rows, "text": markdown, **paths}
