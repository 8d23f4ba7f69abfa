"""`attnlab report DIR`: tables (Markdown, CSV, LaTeX) and PNG plots from DIR/records.jsonl, then
DIR/report.md and a self-contained DIR/report.html (plots embedded). Pure functions of the records: a
report can be redrawn at any time without running anything."""

from __future__ import annotations

import csv
import io
import math
import os
import re
import warnings
from collections import Counter, defaultdict
from pathlib import Path

from attnlab.data.files import atomic_write_text, outputs_together, read_json_lines
from attnlab.errors import AttnlabWarning, DataError, InputError
from attnlab.eval.bench_checks import status_notes
from attnlab.eval.paired import needle_pairs, paired_rows
from attnlab.eval.plots import (
    PNG_METADATA,
    plot_val_loss,
    quiet_missing_glyphs,
    record_drawings,
)
from attnlab.eval.records import bench_records, latest_and_distinct, pair_labels, read_records
from attnlab.eval.report_html import to_html
from attnlab.eval.report_outputs import (
    check_outputs,
    check_records,
    record_outputs,
    unsealed_notes,
    warn_unknown_benchmarks,
)
from attnlab.eval.stats import paired_comparison


def _fmt(value, digits: int = 3) -> str:
    """A cell: "-" for a missing value; nan and inf as such (a diverged model's loss is not a missing one)."""
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):  # (past a billion, a diverged model's perplexity: in exponent form, not 120 digits)
        return f"{value:,.{digits}f}" if abs(value) < 1e9 else f"{value:.{digits}e}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


class Table:
    """A titled table: headers and rows of plain values; renders to Markdown, CSV and LaTeX."""

    def __init__(self, name: str, title: str, headers: list[str], rows: list[list], note: str = "",
                 formats: dict[str, str] | None = None):  # fmt: skip
        self.name, self.title, self.headers, self.rows, self.note = name, title, headers, rows, note
        self.formats = formats or {}  # header -> format spec of its finite numbers (else _fmt's)

    def _cells(self, row: list) -> list[str]:
        specs = [self.formats.get(h) for h in self.headers]
        return [format(v, spec) if spec and isinstance(v, float | int) and not isinstance(v, bool) and
                math.isfinite(v) else _fmt(v) for v, spec in zip(row, specs, strict=True)]  # fmt: skip

    def markdown(self) -> str:
        lines = ["| " + " | ".join(map(md_text, self.headers)) + " |", "|" + " --- |" * len(self.headers)]
        lines += ["| " + " | ".join(map(md_text, self._cells(row))) + " |" for row in self.rows]
        return "\n".join(lines) + (f"\n\n{self.note}" if self.note else "")

    def csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(self.headers)
        writer.writerows(self.rows)
        return out.getvalue()

    def latex(self) -> str:
        def esc(text: str) -> str:
            return re.sub(r"([&%$#_{}])", r"\\\1", text).replace("±", r"$\pm$")

        lines = [r"\begin{tabular}{" + "l" * len(self.headers) + "}", r"\hline"]
        lines.append(" & ".join(esc(h) for h in self.headers) + r" \\ \hline")
        lines += [" & ".join(map(esc, self._cells(row))) + r" \\" for row in self.rows]
        return "\n".join(lines + [r"\hline", r"\end{tabular}"]) + "\n"


MD_SPECIAL = re.compile(r"([\\|<>&])")


def md_text(text: str) -> str:
    """Text as Markdown shows it, character for character: a backslash before a backslash, a '|' (in a table it would
    open another column: a folder called a|b) and '<', '>', '&' (which a renderer would read as HTML: a model
    labelled <script> is shown, not run). to_html reads them back."""
    return MD_SPECIAL.sub(r"\\\1", text)


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status", "ok") == "ok"]


def _by_model(rows: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r["model"]].append(r)
    return groups


def perplexity_table(records: list[dict]) -> Table | None:
    rows = [r for r in records if r["benchmark"] == "perplexity"]
    if not rows:
        return None
    body = [[r["model"], r["kind"], r["split"], r["tokens"], r["loss"], "{:.3f} to {:.3f}".format(*r["loss_ci"]),
             r["ppl"], " to ".join(f"{v:.2f}" if abs(v) < 1e9 else f"{v:.2e}" for v in r["ppl_ci"])]
            for r in rows]  # fmt: skip
    return Table("perplexity", "Held-out perplexity", ["model", "kind", "split", "tokens", "loss", "loss 95% CI",
                 "ppl", "ppl 95% CI"], body, "Intervals: percentile bootstrap over windows.")  # fmt: skip


def paired_table(
    records: list[dict], pairs: list[tuple[str, str]], elsewhere: frozenset = frozenset()
) -> tuple[Table | None, list[str]]:
    """(the table of loss and perplexity of model a minus model b, per (a, b) in pairs, for every perplexity or
    extrapolation setting both were scored at on the same windows of the same tokens, with a paired bootstrap
    interval over windows; one line per pair that gave no row, saying why: eval.paired). elsewhere: the pairs
    needle_paired_table compared (no line for them when they have nothing of this table's)."""
    rows, unpaired = paired_rows(_ok(records), pairs, elsewhere)
    if not rows:
        return None, unpaired
    body = [[a, b, benchmark, record_a.get("seq_len"), d["tokens"], d["ppl_a"], d["ppl_b"], d["dppl"],
             "{:.3f} to {:.3f}".format(*d["dppl_ci"]), d["dloss"], "{:.4f} to {:.4f}".format(*d["dloss_ci"])]
            for a, b, benchmark, record_a, d in rows]  # fmt: skip
    table = Table("paired", "Paired differences (a minus b, same windows of the same tokens)",
                  ["a", "b", "benchmark", "window", "tokens", "ppl a", "ppl b", "ppl a - b", "95% CI",
                   "loss a - b", "95% CI"], body,
                  "Intervals: percentile bootstrap over windows, the same windows resampled for a and b.")  # fmt: skip
    return table, unpaired


def needle_paired_table(records: list[dict], pairs: list[tuple[str, str]]) -> Table | None:
    """Passkey retrieval of model a against model b on the trials both were given (the same key at the same token
    of the same filler), per (a, b) in pairs: how many each alone got right, McNemar's exact p (eval.paired)."""
    rows = needle_pairs(_ok(records), pairs)
    if not rows:
        return None
    body = [[a, b, c["cases"], c["both_right"], c["a_only"], c["b_only"], c["accuracy_a"], c["accuracy_b"],
             "{:+.2f} to {:+.2f}".format(c["ci_low"], c["ci_high"]), c["mcnemar_p"]] for a, b, c in rows]  # fmt: skip
    return Table("needle_paired", "Passkey retrieval, paired (a against b on the same keys at the same tokens)",
                 ["a", "b", "trials", "both right", "a alone", "b alone", "accuracy a", "accuracy b",
                  "a - b 95% CI", "McNemar p"], body,
                 "Intervals: percentile bootstrap over trials; p: McNemar's exact test on the trials one of the two "
                 "got right.")  # fmt: skip


def kv_quant_table(records: list[dict]) -> Table | None:
    """Quantized KV caches (the kv_quant benchmark, attnlab kv-eval --out): bytes against quality, each policy
    against the full-precision cache on the same windows."""
    rows = [r for r in records if r["benchmark"] == "kv_quant"]
    if not rows:
        return None
    body = [[r["model"], r["policy"], r.get("seq_len"), r["bytes_per_token"], r["vs_full"], r["dnll"],
             "{:+.5f} to {:+.5f}".format(*r["dnll_ci"]) if r.get("dnll_ci") else None, r["ppl_ratio"], r["kl"],
             r["top1"], r.get("greedy")] for r in rows]  # fmt: skip
    return Table("kv_quant", "Quantized KV caches: bytes against quality (each policy against the full cache)",
                 ["model", "policy", "window", "KV bytes/token", "vs full", "dNLL", "dNLL 95% CI", "ppl ratio", "KL",
                  "top-1", "greedy"], body,
                 "dNLL: mean NLL with the policy's cache minus with the full-precision one (nats/token), its interval "
                 "a paired bootstrap over blocks of positions; KL: mean KL(full || policy) per token; top-1 and "
                 "greedy: agreement with the full-precision cache's next token and greedy continuation.",
                 {"KV bytes/token": ",.1f", "dNLL": "+.5f", "ppl ratio": ".4f", "KL": ".6f"})  # fmt: skip


def kv_per_token(records: list[dict]) -> dict[str, float]:
    """Measured KV bytes per token of context per model (memory records at their largest length)."""
    out = {}
    for model, rows in _by_model(_ok([r for r in records if r["benchmark"] == "memory"])).items():
        largest = max(rows, key=lambda r: r["length"])
        out[model] = largest["kv_bytes"] / largest["length"] / largest.get("batch_size", 1)
    return out


def _caches(rows: list[dict]) -> list[str] | None:
    """Each row's cache (its KV policy, else its cache dtype) when the rows were measured with more than one, or
    with a policy: rows of one model and length would otherwise look alike (None: one plain cache throughout)."""
    caches = [r.get("kv_policy") or r.get("cache_dtype") or "-" for r in rows]
    return caches if len(set(caches)) > 1 or any(r.get("kv_policy") for r in rows) else None


def memory_table(records: list[dict]) -> Table | None:
    rows = [r for r in records if r["benchmark"] == "memory"]
    if not rows:
        return None
    caches = _caches(rows)
    body = [[r["model"], r["kind"], *([caches[i]] if caches else []), r["length"], r.get("status"), r.get("kv_bytes"),
             r.get("kv_bytes_analytic"), r.get("kv_matches_analytic"), r.get("peak_rss_bytes")]
            for i, r in enumerate(rows)]  # fmt: skip
    headers = ["model", "kind", *(["cache"] if caches else []), "tokens", "status", "KV bytes (measured)",
               "KV bytes (analytic)", "equal", "peak RSS bytes"]  # fmt: skip
    return Table("memory", "KV-cache memory measured from live caches", headers, body)


def latency_table(records: list[dict]) -> Table | None:
    rows = _ok([r for r in records if r["benchmark"] == "latency"])
    if not rows:
        return None
    caches = _caches(rows)
    body = [[r["model"], r["kind"], *([caches[i]] if caches else []), r["prompt_length"], r["batch_size"],
             r["decode_tokens_per_s_median"], f"{r['decode_tokens_per_s_min']:.0f}-{r['decode_tokens_per_s_max']:.0f}",
             r["ttft_ms_median"]] for i, r in enumerate(rows)]  # fmt: skip
    return Table("latency", "Cached decode speed", ["model", "kind", *(["cache"] if caches else []), "prompt", "batch",
                 "decode tok/s (median)", "range", "time to first token ms"], body,
                 "Median of repeats after warm-up.")  # fmt: skip


def probes_tables(records: list[dict]) -> list[Table]:
    summaries = [r for r in records if r["benchmark"] == "probes" and r.get("record") == "summary"]
    if not summaries:
        return []
    models = [s["model"] for s in summaries]
    categories = list(dict.fromkeys(c for s in summaries for c in s["categories"]))
    body = [[c] + [f"{s['categories'][c]['correct']}/{s['categories'][c]['total']}" if c in s["categories"] else "-"
                   for s in summaries] for c in categories]  # fmt: skip
    body.append(["overall"] + [f"{s['overall']['correct']}/{s['overall']['total']} ({s['overall']['accuracy']:.1%})"
                               for s in summaries])  # fmt: skip
    tables = [Table("probes", "Behaviour probes: correct / total by category", ["category", *models], body)]
    cases = _by_model([r for r in records if r["benchmark"] == "probes" and r.get("record") == "case"])
    if len(models) >= 2 and models[0] in cases:
        paired = []
        for other in models[1:]:
            if other not in cases:
                continue
            c = paired_comparison(cases[models[0]], cases[other], names=(models[0], other))
            paired.append([other, c["b_only"], c["a_only"], c["mcnemar_p"], c["verdict"]])
        tables.append(Table("probes_paired", f"Paired head-to-head against {models[0]} (McNemar exact, bootstrap CI)",
                            ["model", "only it right", f"only {models[0]} right", "p", "verdict"], paired))  # fmt: skip
    return tables


def multiple_choice_table(records: list[dict]) -> Table | None:
    rows = [r for r in records if r["benchmark"] == "multiple_choice"]
    if not rows:
        return None
    body = [[r["model"], r["task"], r["n"], r["acc"], r.get("acc_stderr"), r.get("acc_norm"), r.get("acc_norm_stderr")]
            for r in rows]  # fmt: skip
    return Table("multiple_choice", "Zero-shot multiple choice (lm-eval definitions)",
                 ["model", "task", "n", "acc", "± stderr", "acc_norm", "± stderr"], body)  # fmt: skip


def needle_table(records: list[dict]) -> Table | None:
    rows = [r for r in records if r["benchmark"] == "needle" and r.get("scope") == "cell"]
    if not rows:
        return None
    body = [[r["model"], r["length"], r["depth"], r.get("status"), r.get("accuracy"), r.get("gain_mean"),
             r.get("gain_sem")] for r in rows]  # fmt: skip
    return Table("needle", "Passkey retrieval: strict accuracy and the needle's likelihood gain (nats)",
                 ["model", "length", "depth", "status", "accuracy", "gain", "± sem"], body)  # fmt: skip


def extrapolation_table(records: list[dict]) -> Table | None:
    rows = [r for r in records if r["benchmark"] == "rope_extrapolation"]
    if not rows:
        return None
    body = [[r["model"], r.get("factor"), r.get("seq_len"), r.get("status"), r.get("loss"), r.get("ppl")] for r in rows]
    return Table("rope_extrapolation", "Held-out loss beyond the training context",
                 ["model", "factor", "tokens", "status", "loss", "ppl"], body)  # fmt: skip


def stream_loss_table(records: list[dict]) -> Table | None:
    rows = [r for r in records if r["benchmark"] == "stream_loss"]
    if not rows:
        return None
    body = [[r["model"], r.get("memory"), r.get("memory_slots"), r.get("length"), r.get("streams"), r.get("status"),
             r.get("ppl"), (r.get("bucket_loss") or [None])[0], (r.get("bucket_loss") or [None])[-1]]
            for r in rows]  # fmt: skip
    return Table("stream_loss", "Loss by position over long streams (first and last bucket)",
                 ["model", "memory", "slots", "tokens", "streams", "status", "ppl", "first loss", "last loss"],
                 body)  # fmt: skip


def stream_loss_plot(records: list[dict], path: Path) -> Path | None:
    """Loss against position, one line per model (bucket means, shaded bootstrap interval over streams)."""
    rows = _ok([r for r in records if r["benchmark"] == "stream_loss" and r.get("bucket_loss")])
    if not rows:
        return None
    plt = _figure()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rows:
        x = [start + r["bucket"] / 2 for start in r["positions"]]
        slots = f", {r['memory']} {r['memory_slots']}" if r.get("memory_slots") else ""
        (line,) = ax.plot(x, r["bucket_loss"], label=f"{r['model']}{slots}")
        ax.fill_between(x, [c[0] for c in r["bucket_ci"]], [c[1] for c in r["bucket_ci"]], alpha=0.15,
                        color=line.get_color())  # fmt: skip
    return _save_lines(plt, fig, ax, "position in the stream (tokens)", "loss (nats/token)", path)


def sweep_table(records: list[dict]) -> Table | None:
    rows = [r for r in records if r["benchmark"] == "context_sweep"]
    if not rows:
        return None
    body = [[r["model"], r.get("length"), r.get("status"), r.get("prefill_ms"), r.get("last_chunk_ms"),
             r.get("decode_ms_per_token"), r.get("last_chunk_loss")] for r in rows]  # fmt: skip
    return Table("context_sweep", "Context sweep (chunked prefill)", ["model", "tokens", "status", "prefill ms",
                 "last chunk ms", "decode ms/token", "last-chunk loss"], body)  # fmt: skip


# ----------------------------------------------------------------------------- plots


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quiet_missing_glyphs()
    return plt


def pareto_panels(records: list[dict]) -> list[tuple[str, str, dict[str, tuple[float, float]]]]:
    """The quality-efficiency frontier's panels, (x label, y label, {model: (x, y)}): perplexity against measured
    KV bytes/token, each multiple-choice task's accuracy against KV bytes/token, perplexity against decode tok/s;
    a panel only where some model has both figures."""
    ppl = {r["model"]: r["ppl"] for r in records if r["benchmark"] == "perplexity"}
    kv = kv_per_token(records)
    speed = {}
    for model, rows in _by_model(_ok([r for r in records if r["benchmark"] == "latency"])).items():
        speed[model] = min(rows, key=lambda r: (r["prompt_length"], r["batch_size"]))["decode_tokens_per_s_median"]
    pairs = [(kv, ppl, "KV bytes per token (measured)", "held-out perplexity")]
    for task in dict.fromkeys(r["task"] for r in records if r["benchmark"] == "multiple_choice"):
        acc = {r["model"]: r["acc"] for r in records if r["benchmark"] == "multiple_choice" and r["task"] == task}
        pairs.append((kv, acc, "KV bytes per token (measured)", f"{task} accuracy"))
    pairs.append((speed, ppl, "decode tokens/s", "held-out perplexity"))
    panels = [(xlabel, ylabel, {m: (xs[m], ys[m]) for m in ys if m in xs}) for xs, ys, xlabel, ylabel in pairs]
    return [panel for panel in panels if panel[2]]


def pareto_plot(records: list[dict], path: Path) -> Path | None:
    """pareto_panels side by side (KV bytes on a log axis; perplexity too where it spans more than 10x)."""
    panels = pareto_panels(records)
    if not panels:
        return None
    plt = _figure()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (xlabel, ylabel, points) in zip(axes[0], panels, strict=True):
        for model, (x, y) in points.items():
            ax.scatter(x, y)
            ax.annotate(model, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if xlabel.startswith("KV bytes"):
            ax.set_xscale("log")
        ys = [y for _, y in points.values() if _finite(y) and y > 0]
        if ylabel.endswith("perplexity") and ys and max(ys) > 10 * min(ys):  # one arm 10x off leaves the rest readable
            ax.set_yscale("log")
    fig.suptitle("Quality against efficiency")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return path


def _finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def lines_plot(
    records: list[dict], benchmark: str, x: str, y: str, xlabel: str, ylabel: str, path: Path
) -> Path | None:
    rows = _ok([r for r in records if r["benchmark"] == benchmark and r.get(y) is not None and r.get(x) is not None])
    if not rows:
        return None
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    caches = _caches(rows)  # (a line per model and cache when they differ: a policy's points on a line of their own)
    series = {}
    for i, r in enumerate(rows):
        series.setdefault(f"{r['model']} ({caches[i]})" if caches else r["model"], []).append(r)
    for label, group in series.items():
        group = sorted(group, key=lambda r: r[x])
        ax.plot([r[x] for r in group], [r[y] for r in group], marker="o", label=label)
    return _save_lines(plt, fig, ax, xlabel, ylabel, path)


def _save_lines(plt, fig, ax, xlabel: str, ylabel: str, path: Path) -> Path:
    """Labels, grid and legend on a line plot's axes; the figure saved to `path` and closed."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return path


def probe_bars(records: list[dict], path: Path) -> Path | None:
    summaries = [r for r in records if r["benchmark"] == "probes" and r.get("record") == "summary"]
    if not summaries:
        return None
    plt = _figure()
    categories = list(dict.fromkeys(c for s in summaries for c in s["categories"]))
    fig, ax = plt.subplots(figsize=(max(7, len(categories) * 0.7), 4))
    width = 0.8 / len(summaries)
    for i, s in enumerate(summaries):
        values = [s["categories"].get(c, {}).get("accuracy", 0) for c in categories]
        ax.bar([j + i * width for j in range(len(categories))], values, width, label=s["model"])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories, rotation=45, ha="right")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return path


def loss_curves(records: list[dict], path: Path) -> Path | None:
    """Validation loss against tokens seen, from the metrics.jsonl of each evaluated run (when present)."""
    runs, seen = [], set()
    for r in records:
        if not isinstance(r.get("model_path"), str) or r.get("model") in seen:
            continue
        metrics = Path(r["model_path"]) / "metrics.jsonl"
        if not metrics.is_file():
            continue
        seen.add(r["model"])
        rows = read_json_lines(metrics, fix="the report plots it for the checkpoint its records name: repair it, or "
                               "move it away")  # fmt: skip
        curve = [(row["tokens"], row["val_loss"]) for row in rows
                 if _finite(row.get("val_loss")) and _finite(row.get("tokens"))]  # fmt: skip
        runs.append({"target": r["model"], "phase": None, "val_curve": curve})
    return plot_val_loss(runs, path) if runs else None


# ----------------------------------------------------------------------------- report


def build_report(out_dir: str | Path, pairs: list[tuple[str, str]] = (), unsealed: bool = False) -> dict:
    """Writes tables/, plots, report.md and report.html into out_dir; returns their paths. pairs: (a, b) model
    labels whose perplexity differences (a minus b) and passkey trials get a paired table. unsealed: report records
    with no seal (an older attnlab's), unverified, rather than refuse them."""
    out_dir = Path(out_dir)
    if out_dir.is_file():
        folder = (f"give the folder that holds it: {out_dir.parent}" if out_dir.name == "records.jsonl" else
                  "give the folder `attnlab bench --out` wrote (it holds records.jsonl); a file `kv-eval --out` "
                  "or `kv-tune --out` wrote: put it in a folder of its own as records.jsonl, and give that "
                  "folder")  # fmt: skip
        raise InputError(f"{out_dir}: a file, not a folder of records; {folder}")
    records_path = bench_records(out_dir)  # (not found, a link loop, a device or fifo: refused before it is read)
    records = read_records(records_path)
    if not records:
        raise DataError(f"{records_path}: holds no records (empty): run `attnlab bench ... --out {out_dir}` first")
    check_records(records_path, records, unsealed)  # (each record as attnlab wrote it, its figures agreeing)
    warn_unknown_benchmarks(records_path, records, (*DRAWN, "kv_tune"))  # (kv-tune's: known, not drawn)
    for name, folder in (("tables", True), ("report.md", False), ("report.html", False)):  # before anything is written
        place = out_dir / name
        if os.path.lexists(place) and place.is_dir() != folder:
            what = "a folder" if place.is_dir() else "a file" if place.is_file() else "not a regular file"
            raise InputError(f"{place}: {what} where the report writes its {name}{' folder' * folder}: move it away, "
                             "then run the report again")  # fmt: skip
    unverified = unsealed_notes(records)  # (--unsealed: said in the report's files too)
    records, notes = latest_and_distinct(records, records_path)
    notes = unverified + notes
    models = list(dict.fromkeys(r["model"] for r in records))
    # a pair given twice is compared once (its rows would be the same twice)
    pairs = list(dict.fromkeys(pair_labels(f"{a}:{b}", models, records_path) for a, b in pairs))
    needles = needle_paired_table(records, pairs)
    found = frozenset((row[0], row[1]) for row in needles.rows) if needles else frozenset()
    paired, unpaired = paired_table(records, pairs, found)
    if unpaired and paired is None and needles is None:  # nothing could be paired: said before anything is written
        raise InputError(f"{records_path}: " + "; ".join(unpaired))
    for line in unpaired:
        notes.append(f"{line}.")
        warnings.warn(f"{records_path}: {line}", AttnlabWarning, stacklevel=2)
    tables = [t for t in (perplexity_table(records), paired, memory_table(records),
                          latency_table(records), multiple_choice_table(records), needle_table(records), needles,
                          sweep_table(records), extrapolation_table(records), stream_loss_table(records),
                          kv_quant_table(records))
              if t]  # fmt: skip
    tables += probes_tables(records)
    drawings = _drawings(records, out_dir)
    check_outputs(out_dir, tables, [name for name, _ in drawings.values()])  # before anything is written
    with outputs_together(out_dir, "report") as stage:  # every file written, then all renamed into out_dir
        plots = _write_report(stage, out_dir.name, records, models, tables, drawings, notes, records_path)
        record_outputs(stage, out_dir)  # (one of its own changed since it wrote it: refused, nothing replaced)
    return {"markdown": out_dir / "report.md", "html": out_dir / "report.html", "tables": [t.name for t in tables],
            "plots": [str(out_dir / name) for name in plots], "notes": notes}  # fmt: skip


def _write_report(stage: Path, folder_name: str, records: list[dict], models: list[str], tables: list[Table],
                  drawings: dict, notes: list[str], records_path: Path) -> list[str]:  # fmt: skip
    """The report's files in `stage` (a temporary folder): its tables, plots, report.md and report.html; the
    names of the plots drawn."""
    (stage / "tables").mkdir()
    for t in tables:
        for suffix, text in ((".md", t.markdown()), (".csv", t.csv()), (".tex", t.latex())):
            atomic_write_text(stage / "tables" / f"{t.name}{suffix}", text)
    plots = {title: _drawn(stage / name, draw, notes, records_path) for title, (name, draw) in drawings.items()}
    plots = {title: p for title, p in plots.items() if p}
    parts = [f"# Evaluation report: {md_text(folder_name)}", "",
             f"{_count(len(records), 'record')}, {_count(len(models), 'checkpoint')}: {md_text(', '.join(models))}.",
             ""]  # fmt: skip
    untabled = Counter(r["benchmark"] for r in records if r["benchmark"] not in DRAWN)
    if untabled:
        notes.append("Not in this report (no table or plot draws them): " + ", ".join(
            f"{n} {name} record{'s' * (n > 1)}" for name, n in untabled.items()) + ".")  # fmt: skip
    notes += status_notes(records)  # records that measured nothing (too_long, too_short, oom, ...), and why
    parts += [f"Note: {md_text(note)}\n" for note in notes]
    for t in tables:
        parts += [f"## {md_text(t.title)}", "", t.markdown(), ""]
    for title, p in plots.items():
        parts += [f"## {title}", "", f"![{title}]({Path(p).name})", ""]
    markdown = "\n".join(parts)
    atomic_write_text(stage / "report.md", markdown)
    atomic_write_text(stage / "report.html", to_html(markdown, stage))
    return [Path(p).name for p in plots.values()]


# The benchmarks a report draws (a table or a plot); records of others are counted in a note.
DRAWN = ("perplexity", "memory", "latency", "multiple_choice", "needle", "context_sweep", "rope_extrapolation",
         "stream_loss", "kv_quant", "probes", "effective_rank", "attention_maps")  # fmt: skip


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' * (n != 1)}"


def _drawings(records: list[dict], out_dir: Path) -> dict:
    """{title: (file name, draw(path))} of the plots a report may draw (a draw returns None when it has nothing)."""
    drawings = {  # title: (file name, draw(path))
        "Validation loss during training": ("loss_curves.png", lambda path: loss_curves(records, path)),
        "Quality against efficiency": ("pareto.png", lambda path: pareto_plot(records, path)),
        "Decode speed against prompt length": ("latency.png", lambda path: lines_plot(
            records, "latency", "prompt_length", "decode_tokens_per_s_median", "prompt tokens", "decode tokens/s",
            path)),
        "KV memory against context length": ("memory.png", lambda path: lines_plot(
            records, "memory", "length", "kv_bytes", "tokens", "KV bytes (measured)", path)),
        "Decode cost at context": ("context_sweep.png", lambda path: lines_plot(
            records, "context_sweep", "length", "decode_ms_per_token", "tokens", "decode ms/token", path)),
        "Probe accuracy by category": ("probes.png", lambda path: probe_bars(records, path)),
        "Loss by position over long streams": ("stream_loss.png", lambda path: stream_loss_plot(records, path)),
        "Held-out loss beyond the training context": ("rope_extrapolation.png", lambda path: lines_plot(
            records, "rope_extrapolation", "seq_len", "loss", "tokens per window", "loss (nats/token)", path)),
    }  # fmt: skip
    drawings.update(record_drawings(records))
    return drawings


def _drawn(path: Path, draw, notes: list[str], records_path: Path) -> Path | None:
    """draw(path) (a plot function writing a PNG at path, or nothing): its result. A write that fails (a full
    disk, a file size limit) leaves no half-written PNG and names the file, which the image library does not.

    Figures matplotlib cannot place (a perplexity near the largest float: its axis has no length) leave the plot
    out, and what matplotlib warns of (no positive value on a log axis) is kept; either is said in a note of the
    report and in one warning line naming the plot, not in matplotlib's own lines."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)  # (others keep their filters: a DeprecationWarning stays unsaid)
        quiet_missing_glyphs()  # (a font's missing glyphs stay unsaid: the figure is still right)
        try:
            result = draw(path)
        except OSError as e:
            path.unlink(missing_ok=True)
            if e.filename is None:
                e.filename = str(path)
            raise
        except (ValueError, OverflowError) as e:  # raised by matplotlib's layout of such figures
            _figure().close("all")
            path.unlink(missing_ok=True)
            result = None
            lines = [f"{path.name} is not drawn: its figures are beyond what a plot can show "
                     f"({' '.join(str(e).split())}); the tables show them"]  # fmt: skip
        else:
            lines = []
    for warning in caught:
        if issubclass(warning.category, AttnlabWarning) or not issubclass(warning.category, UserWarning):
            warnings.warn(warning.message, warning.category, stacklevel=2)
        else:
            said = " ".join(str(warning.message).split()).rstrip(".")
            lines.append(f"{path.name}: {said} (matplotlib, drawing its figures)")
    for line in dict.fromkeys(lines):
        notes.append(f"{line}.")
        warnings.warn(f"{records_path}: {line}", AttnlabWarning, stacklevel=2)
    return result
