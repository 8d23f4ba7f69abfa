"""Where `attnlab report` writes, checked before it writes anything: a file there that the report did not write (the
user's own report.md, table or plot) is refused, never replaced, and so is a link."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from attnlab.data.files import atomic_write_text, seal_kept, sha256_file
from attnlab.errors import AttnlabWarning, DataError, InputError
from attnlab.eval.plots import attnlab_png
from attnlab.eval.records import record_problem
from attnlab.output_record import changed_output, record_line

# How the report's own files begin (and its tables' Markdown and LaTeX): another file at their place is the user's,
# never replaced. PNGs carry attnlab's mark (plots.attnlab_png); a table's CSV goes with its Markdown.
OWN_START = {"report.md": "# Evaluation report: ", "report.html": "<!doctype html><html><head><meta charset='utf-8'>",
             ".md": "| ", ".tex": "\\begin{tabular}"}  # fmt: skip
MATPLOTLIB_PNG = b"tEXtSoftware\x00Matplotlib version"


def _ours(path: Path, start: str) -> bool:
    with path.open("rb") as file:
        return file.read(len(start.encode())) == start.encode()


def check_outputs(out_dir: Path, tables: list, plots: list[str]) -> None:
    """Refuses (InputError, naming it) a file at a place the report writes that the report did not write (the
    user's own report.md or pareto.png is never replaced), a link there, and a tables/ folder that is a link (the
    report writes only inside the bench folder)."""

    def refuse(path: Path, what: str) -> None:
        raise InputError(f"{path}: {what} (the report would replace it): move it away, then run the report "
                         "again")  # fmt: skip

    folder = out_dir / "tables"
    if folder.is_symlink():
        refuse(folder, "a link, not the tables folder a report makes (the report writes only inside its folder)")
    places = [(out_dir / "report.md", OWN_START["report.md"]), (out_dir / "report.html", OWN_START["report.html"])]
    for t in tables:
        places += [(folder / f"{t.name}.md", OWN_START[".md"]), (folder / f"{t.name}.tex", OWN_START[".tex"]),
                   (folder / f"{t.name}.csv", None)]  # fmt: skip
    places += [(out_dir / name, "png") for name in plots]
    old = out_dir / "report.md"  # a plot of a report drawn before PNGs carried the mark: matplotlib's, in its report.md
    earlier = (old.read_text(encoding="utf-8", errors="replace") if old.is_file() and not old.is_symlink() and
               _ours(old, OWN_START["report.md"]) else "")  # fmt: skip
    for path, start in places:
        if path.is_symlink():
            refuse(path, "a link where the report writes a file")
        if not os.path.lexists(path):
            continue
        if not path.is_file():
            refuse(path, "not a regular file where the report writes one")
        if start is None:  # a table's CSV: the report's own when its Markdown is
            markdown = path.with_suffix(".md")
            own = markdown.is_file() and _ours(markdown, OWN_START[".md"])
        else:
            own = ((attnlab_png(path) or (f"]({path.name})" in earlier and attnlab_png(path, MATPLOTLIB_PNG)))
                   if start == "png" else _ours(path, start))  # fmt: skip
        if not own:
            refuse(path, "not a file attnlab report wrote")


def record_outputs(stage: Path, out_dir: Path) -> None:
    """Before the report's files in `stage` replace those in `out_dir`: refuses (InputError, one line) one of the
    report's own there changed since it wrote it (a note added to report.md, a table edited: report.md's last line
    records the sha256 of each, output_record), and a report.md without that line that is not the new one byte for
    byte; then ends stage/report.md with the record of the files written now."""
    names = sorted(p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file())
    names.remove("report.md")
    markdown = (stage / "report.md").read_bytes().decode("utf-8")
    line = changed_output(out_dir, "report", "report.md", names, markdown, "move it away, then run the report again")
    if line:
        raise InputError(line)
    written = {name: sha256_file(stage / name) for name in names}
    atomic_write_text(stage / "report.md", markdown + record_line("report", "report.md", markdown, written))


def warn_unknown_benchmarks(records_path: Path, records: list[dict], known) -> None:
    """One AttnlabWarning line naming records_path's lines whose benchmark attnlab does not know (a hand edit, or a
    newer attnlab's record): the report draws nothing of them, and says so rather than dropping them silently."""
    unknown = [(i, r["benchmark"]) for i, r in enumerate(records) if r["benchmark"] not in known]
    if not unknown:
        return
    text = records_path.read_text(encoding="utf-8-sig").splitlines()
    lines = [number for number, line in enumerate(text, 1) if line.strip()]  # (records are its non-blank lines)
    at = [(lines[i], benchmark) for i, benchmark in unknown]
    shown = ", ".join(f"line {n} ({b if b.isprintable() and b.strip() else repr(b)})" for n, b in at[:3])
    more = f" and {len(at) - 3} more" if len(at) > 3 else ""
    said = (f"{records_path}: {shown}{more}: not a benchmark attnlab knows (a hand edit, or a newer attnlab's "
            f"record), so not in this report; known: {', '.join(known)}")  # fmt: skip
    warnings.warn(said, AttnlabWarning, stacklevel=3)


def _which(number: int, record: dict) -> str:
    model = record.get("model")
    model = model if isinstance(model, str) and model.isprintable() and model.strip() else repr(model)
    return f"record {number} ({record.get('benchmark')}, {model})"  # (one line, whatever it holds)


def check_seals(records_path: Path, records: list[dict], measuring: bool = False) -> None:
    """Refuses (DataError, one line naming the record) a record changed after attnlab wrote it (its sha256 no longer
    matches its fields): report would draw it, and bench would skip its benchmark as measured. measuring (bench): one
    AttnlabWarning line says records with no seal count as measured, and report shows them only with --unsealed."""
    kept = [seal_kept(record) for record in records]  # (one sha256 per record)
    for number, (record, ok) in enumerate(zip(records, kept, strict=True), 1):
        if ok is False:
            raise DataError(f"{records_path}: {_which(number, record)} was changed after attnlab wrote it (its sha256 "
                            f"no longer matches its fields): {AGAIN}")  # fmt: skip
    unsealed = kept.count(None)
    if measuring and unsealed:
        warnings.warn(f"{records_path}: {unsealed} of its {len(records)} records carry no sha256 (an older attnlab's, "
                      "or it was taken out): bench takes what they measured as measured, and report shows them only "
                      "with --unsealed (take those lines out to have them measured again)", AttnlabWarning,
                      stacklevel=3)  # fmt: skip


# A records file's damaged line: bench measures what its records lack, so taking the line out is the way to have it
# measured again (bench refuses the file while the line is there, rather than skip its benchmark as measured).
AGAIN = "take that line out, then run the benchmark again (attnlab bench measures what the file lacks)"


def check_records(records_path: Path, records: list[dict], unsealed: bool = False) -> None:
    """Refuses (DataError, one line naming the record) a record changed after attnlab wrote it (check_seals), or one
    whose figures are impossible or contradict each other (record_problem). Records with no seal (an older
    attnlab's, or its seal taken out) are refused unless unsealed (`report --unsealed`): then they are checked by
    their figures alone and one AttnlabWarning line counts them."""
    for number, record in enumerate(records, 1):
        if not isinstance(record.get("benchmark"), str) or not isinstance(record.get("model"), str):
            raise DataError(f"{records_path}: record {number} names no benchmark or model (the file was changed): "
                            f"{AGAIN}")  # fmt: skip
    check_seals(records_path, records)
    count = sum(seal_kept(record) is None for record in records)
    said = f"{count} of its {len(records)} records carry" if count < len(records) else "its records carry"
    if count and not unsealed:
        first = next(number for number, record in enumerate(records, 1) if seal_kept(record) is None)
        raise DataError(f"{records_path}: {said} no sha256 (the first: {_which(first, records[first - 1])}; an older "
                        "attnlab wrote them, or it was taken out), so attnlab cannot tell whether their figures were "
                        "changed since it wrote them: give --unsealed to report them unverified, or take those lines "
                        "out and run the benchmark again (attnlab bench measures what the file lacks)")  # fmt: skip
    for number, record in enumerate(records, 1):
        problem = record_problem(record)
        if problem:
            raise DataError(f"{records_path}: {_which(number, record)}: {problem} (the file was changed): {AGAIN}")
    if count:
        warnings.warn(f"{records_path}: {said} no sha256 (an older attnlab wrote them, or it was taken out): attnlab "
                      "cannot tell whether they were changed since it wrote them, so their figures are shown "
                      "unverified (--unsealed)", AttnlabWarning, stacklevel=3)  # fmt: skip


def unsealed_notes(records: list[dict]) -> list[str]:
    """The report's note naming the records read with --unsealed (no seal): the files are shared without the
    warning line, so they say it too."""
    unverified = [r for r in records if seal_kept(r) is None]
    if not unverified:
        return []
    which = list(dict.fromkeys(f"{r['model']} ({r['benchmark']})" for r in unverified))
    return [f"Unverified: {len(unverified)} of the {len(records)} records carry no sha256 (an older attnlab's, or it "
            "was taken out), so attnlab cannot tell whether their figures were changed since it wrote them; shown as "
            f"read (--unsealed): {', '.join(which[:6])}{', ...' if len(which) > 6 else ''}."]  # fmt: skip
