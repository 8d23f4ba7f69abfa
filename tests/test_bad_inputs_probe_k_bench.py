"""Probe K's findings in bench and report: report read a records.jsonl linked to a device (/dev/zero) whole, until the
kernel's OOM killer ended it with no word, and called a records.jsonl caught in a symbolic link loop "not found"; a
bench manifest's attention_maps prompt longer than a memory model's memory.block (or its max_seq_len) was refused only
after every other benchmark of every checkpoint had run. Each now ends in one line, before anything is read or run."""

from __future__ import annotations

import os
import re

import pytest
from helpers import PROBE_MODEL, at_most, fails, train_tiny_run

from attnlab.errors import ConfigError, DataError, InputError
from attnlab.eval.harness import load_plan, run_plan
from attnlab.eval.report import build_report

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


# ------------------------------------------------------------ k54: report on a records.jsonl that is no regular file


@pytest.mark.parametrize("kind", ["device", "fifo", "folder"])
def test_report_refuses_a_records_file_that_is_no_regular_file(tmp_path, capsys, kind):
    """k54: a link to /dev/zero was read whole (17 GB, then the OOM killer). /dev/null stands in for it here: the same
    check refuses both, and /dev/null cannot hang the suite before the fix (it read as an empty file)."""
    folder = tmp_path / "b"
    folder.mkdir()
    records = folder / "records.jsonl"
    what = {"device": "a character device", "fifo": "a FIFO (named pipe)", "folder": "a folder"}[kind]
    if kind == "device":
        records.symlink_to("/dev/null")
    elif kind == "fifo":
        os.mkfifo(records)  # no writer: reading it waits without end
    else:
        records.mkdir()
    with at_most(20):
        line = fails(capsys, ["report", str(folder)], f"{records}: {what}, not a records file (give the folder "
                     "`attnlab bench --out` wrote: its records.jsonl is a regular file)")  # fmt: skip
    assert "run `attnlab bench" not in line and "empty" not in line
    with pytest.raises(DataError, match=re.escape(f"records.jsonl: {what}, not a records file")):
        build_report(folder)


# --------------------------------------------------------------- k53: report on a records.jsonl in a symlink loop


def test_report_on_a_records_file_in_a_symlink_loop_says_so(tmp_path, capsys):
    """k53: was "records.jsonl not found: run attnlab bench first", where validate and info say "symlink loop"."""
    folder = tmp_path / "rp"
    folder.mkdir()
    (folder / "records.jsonl").symlink_to("loop")
    (folder / "loop").symlink_to("records.jsonl")
    line = fails(capsys, ["report", str(folder)], f"{folder / 'records.jsonl'}: a symbolic link loop (too many "
                 "levels of symbolic links): point the link at the records file itself")  # fmt: skip
    assert "not found" not in line


def test_bench_into_a_records_file_in_a_symlink_loop_says_so(tiny_run, tmp_path, capsys):
    """The writing side of k53: bench's check of its --out folder raised Path.resolve's RuntimeError (a traceback)."""
    (tmp_path / "records.jsonl").symlink_to("loop")
    (tmp_path / "loop").symlink_to("records.jsonl")
    argv = ["bench", str(tiny_run), "--benchmarks", "perplexity", "--out", str(tmp_path)]
    assert fails(capsys, argv, f"{tmp_path / 'records.jsonl'}: a symbolic link loop (too many levels of symbolic "
                 "links): point the link at the records file itself, or give another path")  # fmt: skip


def test_report_on_a_missing_records_file_still_says_run_bench_first(tmp_path, capsys):
    (tmp_path / "dangling").mkdir()
    (tmp_path / "dangling" / "records.jsonl").symlink_to("nowhere")
    for folder in (tmp_path, tmp_path / "dangling"):
        assert fails(capsys, ["report", str(folder)], f"{folder / 'records.jsonl'} not found: run `attnlab bench ... "
                     f"--out {folder}` first")  # fmt: skip


# ------------------------------------------- k27: an attention_maps prompt too long for a checkpoint, said up front

PROMPT = "the cat sat on the mat by the red door"  # 38 characters: 38 tokens of the char tokenizer


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory):
    """A tiny run whose model reads a prompt in blocks of 16 tokens (memory.block: its recent_window)."""
    model = {**PROBE_MODEL, "memory": {"kind": "window", "recent_window": 16}}
    return train_tiny_run(tmp_path_factory.mktemp("memory"), model, steps=4)


def bench_manifest(tmp_path, checkpoints, prompt: str, regions: str = "{cat: [4, 7]}"):
    path = tmp_path / "bench.yml"
    path.write_text(f"name: maps\ncheckpoints: [{', '.join(str(c) for c in checkpoints)}]\nbenchmarks:\n"
                    "  perplexity: {split: val, seq_len: 16}\n"
                    f"  attention_maps: {{prompt: '{prompt}', regions: {regions}}}\n")  # fmt: skip
    return path


def test_an_attention_maps_prompt_past_memory_block_is_refused_before_anything_runs(tiny_run, memory_run, tmp_path,
                                                                                    capsys):  # fmt: skip
    """k27: refused only once every other benchmark of both checkpoints had run (hours on real models)."""
    out = tmp_path / "out"
    argv = ["bench", str(bench_manifest(tmp_path, [tiny_run, memory_run], PROMPT)), "--out", str(out)]
    line = fails(capsys, argv, f"benchmarks.attention_maps.prompt='{PROMPT}' has 38 tokens on ",
                 "a model with memory.kind=window reads a prompt in blocks of 16 tokens (memory.block)",
                 "give a prompt of at most 16 tokens")  # fmt: skip
    assert line.count("has 38 tokens on ") == 1  # the plain run reads it in one pass: only the memory run is named
    assert not out.exists()  # nothing ran: no records, no folder left


def test_an_attention_maps_prompt_past_max_seq_len_is_refused_before_anything_runs(tiny_run, tmp_path):
    long_prompt = " ".join([PROMPT] * 2)  # 77 tokens; the model's max_seq_len is 64
    plan = load_plan([str(bench_manifest(tmp_path, [tiny_run], long_prompt))])
    with pytest.raises(InputError, match=r"benchmarks\.attention_maps\.prompt='the cat .* has 77 tokens on tiny/seed0: "
                       r"give one of 1\.\.64 tokens \(the model's max_seq_len\)"):  # fmt: skip
        run_plan(plan, tmp_path / "out", log=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_an_attention_maps_prompt_that_fits_is_measured(memory_run, tmp_path):
    plan = load_plan([str(bench_manifest(tmp_path, [memory_run], PROMPT[:16]))])
    records = run_plan(plan, tmp_path / "out", log=lambda _: None)
    assert '"attention_maps"' in records.read_text()


def test_the_default_region_past_a_short_prompt_is_refused_before_anything_runs(tiny_run, tmp_path, capsys):
    """Was refused once the model had read the prompt, after the other benchmarks: `character region 16:20 is outside
    the prompt`, naming no parameter."""
    manifest = tmp_path / "bench.yml"
    manifest.write_text(f"checkpoints: [{tiny_run}]\nbenchmarks:\n  perplexity: {{split: val, seq_len: 16}}\n"
                        "  attention_maps: {prompt: a cat sat}\n")  # fmt: skip
    out = tmp_path / "out"
    argv = ["bench", str(manifest), "--out", str(out)]
    assert fails(capsys, argv, "benchmarks.attention_maps.prompt='a cat sat' has 9 characters: the default region "
                 "(pass key: [16, 20], the pass key of the default prompt) ends past it: give regions inside the "
                 "prompt, e.g. regions: {start: [0, 4]}")  # fmt: skip
    assert not out.exists()
    manifest.write_text(manifest.read_text().replace("a cat sat}", "a cat sat, regions: {cat: [2, 5], mat: [6, 12]}}"))
    with pytest.raises(ConfigError, match=re.escape("benchmarks.attention_maps.regions.mat=[6, 12] ends past the "
                                                    "prompt's 9 characters: give a region inside the prompt, or a "
                                                    "longer prompt")):  # fmt: skip
        load_plan([str(manifest)])


def test_a_checkpoint_named_relative_to_the_data_directory_is_found_as_other_commands_find_it(tmp_path, monkeypatch):
    """`attnlab info models/X.gguf --data-dir D` finds D/models/X.gguf; `attnlab bench models/X.gguf --data-dir D` said
    the checkpoint was not found (found while running the SmolLM2 factorial's baseline)."""

    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    (data / "models" / "x.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    plan = load_plan(["models/x.gguf"], ["perplexity"], data_dir=str(data))
    assert plan.checkpoints == (str(data / "models" / "x.gguf"),)
    with pytest.raises(ConfigError, match="checkpoint 'models/y.gguf' not found"):
        load_plan(["models/y.gguf"], ["perplexity"], data_dir=str(data))
