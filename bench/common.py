"""Shared helpers of the benchmark scripts: timing, a matmul throughput reference, and result records.

Figures are meant to be read as ratios against a reference measured in the same process (the machine's
speed drifts between runs); every row records what is needed to judge it later: time, versions, device,
dtype, threads, git commit and the model's config hash.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent


def time_once(fn: Callable[[], object]) -> float:
    """Wall-clock seconds of one call of fn."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_fn(fn: Callable[[], object], warmup: int = 1, repeats: int = 5) -> list[float]:
    """Seconds of each of `repeats` calls of fn, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    return [time_once(fn) for _ in range(repeats)]


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> float:
    """(max - min) / median of repeated timings: how noisy the measurement was."""
    return (max(values) - min(values)) / statistics.median(values)


def matmul_gflops(n: int = 2048, warmup: int = 2, repeats: int = 5) -> float:
    """Measured fp32 GFLOP/s of an n x n x n matmul (2 n^3 flops), median of repeats: the machine's
    practical compute ceiling, against which the models' achieved FLOP/s are compared."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen)
    b = torch.randn(n, n, generator=gen)
    out = torch.empty(n, n)
    seconds = median(time_fn(lambda: torch.mm(a, b, out=out), warmup, repeats))
    return 2 * n**3 / seconds / 1e9


class OtherLoad:
    """Share of the machine's CPU time used by *other* processes (Linux /proc), since the start or since the
    last `lap()`: 0.0 = the benchmark had the machine to itself, 0.5 = one of two cores was busy with
    something else. Recorded with the figures: on a shared machine a timing means little without it.
    Resolution is one clock tick (usually 10 ms), so it is meaningful over intervals of 0.1 s or more."""

    def __init__(self):
        self.start = self.last = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
            own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        jiffies = [int(v) for v in fields]
        busy = sum(jiffies) - jiffies[3] - jiffies[4]  # minus idle and iowait
        own_busy = int(own[11]) + int(own[12])  # utime + stime of this process (all threads)
        return float(busy), float(own_busy), time.monotonic()

    @staticmethod
    def _between(a, b) -> float | None:
        if a is None or b is None or b[2] <= a[2]:
            return None
        other_seconds = ((b[0] - a[0]) - (b[1] - a[1])) / os.sysconf("SC_CLK_TCK")
        return max(0.0, other_seconds / ((b[2] - a[2]) * (os.cpu_count() or 1)))

    def lap(self) -> float | None:
        """Share used by other processes since the previous lap (or the start)."""
        now = self._sample()
        share, self.last = self._between(self.last, now), now
        return share

    def fraction(self) -> float | None:
        """Share used by other processes since the start."""
        return self._between(self.start, self._sample())


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def environment(device: str = "cpu", dtype: str = "fp32") -> dict:
    """What every result row records about the run."""
    return {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "device": device,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "git_commit": git_commit(),
    }


def append_rows(name: str, rows: list[dict]) -> Path:
    """Appends rows as JSON lines to bench/results/<name>.jsonl, atomically (attnlab's record writer: the old
    content plus the new rows replace the file in one rename, so an interrupted run never truncates it)."""
    from attnlab.eval.records import append_records

    return append_records(RESULTS_DIR / f"{name}.jsonl", rows)


def finish(name: str, records: list[dict], other: float | None, record: bool = True) -> None:
    """The end of a benchmark script: a WARNING when other processes used more than 10% of the CPU during the run
    (`other`, from OtherLoad.fraction()), each record stamped with it, and the records appended to
    bench/results/<name>.jsonl unless `record` is False."""
    if other is not None and other > 0.1:
        print(f"\nWARNING: other processes used {other:.0%} of the machine's CPU during the run")
    records = [{**r, "other_load": other} for r in records]
    if records and record:
        print(f"recorded {len(records)} rows in {append_rows(name, records)}")


def row(benchmark: str, config_hash: str, env: dict, **figures) -> dict:
    """One result record: the environment, the config hash and the figures."""
    return {"benchmark": benchmark, **env, "config_hash": config_hash, **figures}


def print_table(headers: list[str], rows: list[list], floatfmt: str = ".3g") -> None:
    """A plain fixed-width table on stdout (also valid Markdown)."""

    def cell(value) -> str:
        if isinstance(value, float):
            return format(value, floatfmt)
        return str(value)

    cells = [[cell(v) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) + " |")
