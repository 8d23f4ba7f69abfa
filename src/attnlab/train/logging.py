"""Run logging: metrics.jsonl (always), TensorBoard event files (when tensorboard is installed) and a
progress bar with loss, tok/s and ETA (tqdm, when wanted)."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

from tqdm.auto import tqdm

from attnlab.data.files import atomic_write_text, file_kind
from attnlab.errors import AttnlabWarning, DataError
from attnlab.jsonio import loads_json

PENDING = "metrics.pending.jsonl"  # a run started over (--no-resume): its rows until its first checkpoint


class MetricsLog:
    def __init__(self, run_dir: Path, enabled: bool = True, resume_step: int = 0, train_cfg=None,
                 pending: bool = False):  # fmt: skip
        """train_cfg: the run's TrainConfig, whose steps, log_every and eval_every say which rows a resume from
        resume_step should find (a warning names the ones missing). pending: the run starts over a folder whose
        checkpoints are an earlier run's (run --no-resume): its rows go to metrics.pending.jsonl, which replaces
        metrics.jsonl once its first checkpoint replaces theirs (commit), so a run stopped before then leaves the
        earlier run's checkpoints and metrics as they were, to resume. A pending log left by such a stop is removed
        by the next run."""
        self.enabled, self.pending = enabled, pending
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tensorboard = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        (self.path.parent / PENDING).unlink(missing_ok=True)
        if pending:
            self.final, self.path = self.path, self.path.parent / PENDING
        else:
            self._truncate_after(resume_step, train_cfg)
        self.file = open(self.path, "ab", buffering=0)  # unbuffered: a failed write leaves nothing to flush later
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=resume_step or None)
        except ImportError:  # tensorboard is optional
            self.tensorboard = None

    def _truncate_after(self, step: int, train_cfg=None) -> None:
        """On resume, rows logged after the checkpoint will be logged again: drop them (atomically)."""
        rows, kept = metrics_rows(self.path, step, train_cfg)
        if len(kept) != len(rows) or (rows and not _ends_a_line(self.path)):  # (appended rows start on a new line)
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        data = memoryview((json.dumps(row) + "\n").encode())
        length = os.fstat(self.file.fileno()).st_size
        try:
            while data:  # a raw write may write a part (up to a file size limit), the next one then fails
                data = data[self.file.write(data) :]
        except OSError as e:  # a full disk: write() names no file
            e.filename = e.filename or str(self.path)
            self._cut_back(length)
            raise
        if self.tensorboard is not None:
            for key, value in row.items():
                if key not in ("step", "tokens") and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, row["step"])

    def commit(self) -> None:
        """After a checkpoint of this run is written: a pending log becomes metrics.jsonl (the earlier run's rows
        go with its checkpoints). The open file keeps appending to it under its new name."""
        if self.enabled and self.pending:
            os.replace(self.path, self.final)
            self.path, self.pending = self.final, False

    def _cut_back(self, length: int) -> None:
        """The log back to `length` bytes after a failed append: no row cut short is left for a resume to read (one
        a kill leaves, or that this could not cut, is dropped by the resume, metrics_rows)."""
        try:
            os.ftruncate(self.file.fileno(), length)
        except OSError:  # the write's own error is the one said
            pass

    def progress_bar(self, total: int, initial: int, wanted: bool):
        if not (self.enabled and wanted):
            return None
        return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)

    def advance(self, bar, steps: int, row: dict) -> None:
        if bar is not None:
            bar.update(steps)
            bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tok_per_s']:,.0f}", refresh=False)

    def close(self, bar) -> None:
        if bar is not None:
            bar.close()
        if self.enabled:
            self.file.close()
            if self.tensorboard is not None:
                self.tensorboard.close()


def _ends_a_line(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


# What the trainer logs only as finite numbers (a loss that is not stops the run before its row is written; a
# validation loss is of at least one window; its perplexity is infinite only past a float's range). The gradient
# norm may be infinite.
FINITE_KEYS = ("loss", "lr", "tok_per_s", "val_loss", "val_ppl")


def metrics_rows(path: Path, step: int, train_cfg=None) -> tuple[list[str], list[str]]:
    """(every row of a run's metrics log, those of steps <= step: what a resume from `step` keeps), ([], []) when
    there is none; DataError naming the line that is not UTF-8, not JSON or not a metrics row, or holds a value the
    trainer never logs (a NaN loss): a resume and its dry run refuse the log alike. A last line cut short (no
    newline, not JSON: a write stopped by a full disk or a kill) is dropped with a warning: it was written after the
    last checkpoint, as every row a resume logs again. train_cfg (the run's TrainConfig): rows the run logged up to
    `step` and the log lacks (it was deleted, emptied or cut) are named in a warning: they are not logged again."""
    if not path.exists():
        if train_cfg is not None:
            _missing_rows(path, step, train_cfg, None)
        return [], []
    kind = file_kind(path)
    if kind is not None:  # (a FIFO would be waited on without end)
        raise DataError(f"{path} is {kind}, not the run's metrics log (a file): move it away, and the run starts the "
                        "log afresh")  # fmt: skip
    data = path.read_bytes()
    data, torn = _torn_last_line(path, data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(f"{path}: line {line} is not UTF-8 text (the metrics log was damaged); repair or "
                        "remove that line, or delete the file to start the log afresh") from None  # fmt: skip
    rows = [line for line in text.splitlines() if line.strip()]
    kept, kept_rows = [], []
    fix = "repair or remove that line, or delete the file to start the log afresh"
    for number, line in enumerate(rows, 1):
        try:
            row = loads_json(line)
        except json.JSONDecodeError:
            raise DataError(f"{path}: line {number} is not JSON (the metrics log was damaged); {fix}") from None
        if not isinstance(row, dict) or not isinstance(row.get("step", 0), int):
            raise DataError(f"{path}: line {number} is not a metrics row (an object with an integer step)")
        for key in FINITE_KEYS:
            value = row.get(key, 0)
            number_ = not isinstance(value, bool) and isinstance(value, (int, float))
            infinite_ppl = key == "val_ppl" and value == math.inf  # (exp of a finite loss past a float's range)
            if not number_ or not (math.isfinite(value) or infinite_ppl):
                raise DataError(f"{path}: line {number}: {key} is {json.dumps(value)}, which the trainer never logs "
                                f"(the metrics log was changed); {fix}")  # fmt: skip
        if row.get("step", 0) <= step:
            kept.append(line)
            kept_rows.append(row)
    if train_cfg is not None:
        _missing_rows(path, step, train_cfg, kept_rows)
    return rows + torn, kept


def _missing_rows(path: Path, step: int, train_cfg, rows: list[dict] | None) -> None:
    """A warning naming the rows a run resuming from `step` logged before it (a training row every log_every
    steps, a validation row every eval_every steps, both at the last step) that its log lacks (rows None: the log
    is missing): they are not logged again."""
    wanted = {"loss": "training", "val_loss": "validation"}
    every = {"loss": train_cfg.log_every, "val_loss": train_cfg.eval_every}
    lacking = {}
    for key in wanted:
        logged = {row.get("step") for row in rows or () if key in row}
        last = {train_cfg.steps} if train_cfg.steps <= step else set()  # (a resume to write the summary)
        expected = set(range(every[key], step + 1, every[key])) | last
        if expected - logged:
            lacking[key] = sorted(expected - logged)
    if not lacking:
        return
    resumes = (f"the run resumes from step {step} and logs only the steps after it (restore the file from a copy "
               "first to keep them)")  # fmt: skip
    if not rows:
        what = ("missing: the rows the run logged up to step {step} are gone" if rows is None else
                "holds none of the rows the run logged up to step {step} (it was emptied or cut)")  # fmt: skip
        warnings.warn(f"{path}: {what.format(step=step)}; {resumes}", AttnlabWarning, stacklevel=3)
        return
    said = "; ".join(f"{wanted[key]} loss at step{'s' * (len(steps) > 1)} {_steps(steps)}" for key, steps in
                     lacking.items())  # fmt: skip
    warnings.warn(f"{path}: lacks rows the run logged before its checkpoint ({said}); {resumes}", AttnlabWarning,
                  stacklevel=3)  # fmt: skip


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:3])) + (f" and {len(steps) - 3} more" if len(steps) > 3 else "")


def _torn_last_line(path: Path, data: bytes) -> tuple[bytes, list[str]]:
    """(the log without its last line when that was cut short, [that line] or []), warning when it was."""
    start = data.rfind(b"\n") + 1
    tail = data[start:]
    if not tail.strip():
        return data, []
    try:
        loads_json(tail.decode("utf-8"))
        return data, []  # whole JSON, only its newline missing: a row, or refused as any other line that is not one
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    number = data.count(b"\n") + 1
    warnings.warn(f"{path}: its last line was cut short (line {number}, {len(tail)} bytes: a write interrupted by a "
                  "full disk, a file size limit or a kill); dropped, as rows after the checkpoint are logged again",
                  AttnlabWarning, stacklevel=3)  # fmt: skip
    return data[:start], [tail.decode("utf-8", "replace")]
