"""Probe A's findings: bad input ends in exit code 2 and one line `attnlab <command>: error: ...` naming the
path, key or flag to fix, with no traceback and nothing silently wrong."""

from __future__ import annotations

import json

import pytest
from helpers import fails, lm_task_folders, lm_task_yaml, train_tiny_run

from attnlab.cli import main
from attnlab.errors import InputError
from attnlab.eval.records import append_records

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}
KV = ["--policies", "k=q8_0", "--split", "val", "--seq-len", "16", "--tokens", "32"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny_run(tmp_path_factory.mktemp("probe_a"), MODEL, steps=6)


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory):
    model = {**MODEL, "memory": {"kind": "window", "recent_window": 16}}
    return train_tiny_run(tmp_path_factory.mktemp("probe_a_memory"), model, steps=6)


# 1. records targets and memory documents that are not regular files


def test_records_refuse_a_folder_and_write_through_a_symlink(tmp_path):
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(InputError, match="folder.jsonl: a folder"):
        append_records(tmp_path / "folder.jsonl", [{"a": 1}])
    target = tmp_path / "real.jsonl"
    target.write_text('{"a": 0}\n')
    (tmp_path / "link.jsonl").symlink_to(target)
    append_records(tmp_path / "link.jsonl", [{"a": 1}])
    assert (tmp_path / "link.jsonl").is_symlink()
    assert [json.loads(line)["a"] for line in target.read_text().splitlines()] == [0, 1]


@pytest.mark.parametrize("command", ["kv-eval", "kv-tune"])
def test_kv_out_a_device_is_refused_before_evaluating(tmp_path, capsys, command):
    extra = ["--budget", "100"] if command == "kv-tune" else ["--policies", "k=q8_0"]
    # the checkpoint does not exist: --out is refused before the model is loaded (or /dev/full read)
    assert fails(
        capsys, [command, str(tmp_path / "absent"), *extra, "--out", "/dev/full"], "/dev/full", "not a regular file"
    )


def test_kv_eval_out_through_a_symlink_keeps_the_link(run, tmp_path, capsys):
    target = tmp_path / "real.jsonl"
    target.write_text("")
    (tmp_path / "link.jsonl").symlink_to(target)
    assert main(["kv-eval", str(run), *KV, "--out", str(tmp_path / "link.jsonl")]) == 0
    assert (tmp_path / "link.jsonl").is_symlink() and len(target.read_text().splitlines()) == 1


def test_memory_ingest_refuses_a_device_and_names_empty_documents(memory_run, tmp_path, capsys):
    run = memory_run
    store = str(tmp_path / "st")
    assert fails(
        capsys,
        ["memory", "ingest", str(run), "/dev/zero", "--name", "n", "--store", store],
        "/dev/zero",
        "not a regular file",
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert fails(
        capsys,
        ["memory", "ingest", str(run), str(empty), "--name", "n", "--store", store],
        "no text to ingest",
        "empty.txt",
    )


# 5. kv-eval / kv-tune flags


@pytest.mark.parametrize(("flag", "value"), [("--tokens", "0"), ("--tokens", "-4"), ("--seq-len", "0")])
@pytest.mark.parametrize("command", ["kv-eval", "kv-tune"])
def test_kv_tokens_and_seq_len_must_be_positive(run, capsys, command, flag, value):
    extra = ["--budget", "100"] if command == "kv-tune" else ["--policies", "k=q8_0"]
    assert fails(capsys, [command, str(run), *extra, flag, value], f"{flag}={value} must be >= 1")


def test_kv_eval_refuses_an_empty_policy(run, capsys):
    assert fails(
        capsys,
        ["kv-eval", str(run), "--policies", "", "--seq-len", "16", "--tokens", "32"],
        "--policies",
        "empty policy",
    )


# 2. lm-eval task files


@pytest.fixture
def lm_tasks(tmp_path, monkeypatch):
    """(tasks folder, data folder) with `mytask` over data/x/data.jsonl (one good item)."""
    item = {"q": "a cat", "gold": 0, "choices": [" sat", " dog"]}
    return lm_task_folders(tmp_path, monkeypatch, lm_task_yaml(name="mytask", data="x/data.jsonl"), [item])


def lm_eval_argv(run, tasks, data, *extra):
    return ["lm-eval", str(run), "--tasks", "mytask", "--include-path", str(tasks), "--data-dir", str(data), *extra]


def test_lm_eval_refuses_a_function_tag_and_runs_no_code(run, lm_tasks, tmp_path, capsys):
    tasks, data = lm_tasks
    marker = tmp_path / "ran"
    (tasks / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef process(docs):\n    return docs\n")
    with open(tasks / "mytask.yaml", "a") as f:
        f.write("process_docs: !function evil.process\n")
    assert fails(
        capsys, lm_eval_argv(run, tasks, data), "mytask.yaml", "!function", "does not run code from task files"
    )
    assert not marker.exists()


def test_lm_eval_data_file_leaving_the_data_dir_or_unreadable(run, lm_tasks, capsys):
    tasks, data = lm_tasks
    (tasks / "mytask.yaml").write_text(lm_task_yaml(name="mytask", data="../../../../etc/hostname"))
    assert fails(
        capsys, lm_eval_argv(run, tasks, data), "mytask.yaml", "../../../../etc/hostname", "leaves the data dir"
    )
    (tasks / "mytask.yaml").write_text(lm_task_yaml(name="mytask", data=str(data / "absent.jsonl")))
    assert fails(capsys, lm_eval_argv(run, tasks, data), "mytask.yaml", "absent.jsonl", "is not a file")
    (tasks / "mytask.yaml").write_text(lm_task_yaml(name="mytask", data="x/data.jsonl"))
    (data / "x" / "data.jsonl").write_text('{"q": "a", broken\n')
    assert fails(capsys, lm_eval_argv(run, tasks, data), "mytask.yaml", "data.jsonl", "could not be loaded")


def test_lm_eval_names_a_task_file_that_is_not_yaml(run, lm_tasks, capsys, monkeypatch):
    """And without indexing lm-eval's own ~15,000 tasks first (10-30 s): they cannot stand in for a task file of
    the include_path that declares the task."""
    from attnlab.eval import lmeval_tasks

    built, manager = [], lmeval_tasks.TaskManager
    monkeypatch.setattr(lmeval_tasks, "TaskManager", lambda **kw: built.append(kw) or manager(**kw))
    tasks, data = lm_tasks
    (tasks / "bad_task.yaml").write_text("task: bad_task\ndoc_to_text: [unclosed\n")
    argv = lm_eval_argv(run, tasks, data)
    argv[3] = "bad_task"
    assert fails(capsys, argv, "bad_task.yaml", "not valid YAML")
    assert built and all(kw.get("include_defaults") is False for kw in built), built


def test_lm_eval_out_is_checked_before_evaluating(lm_tasks, tmp_path, capsys):
    tasks, data = lm_tasks
    (tmp_path / "f").write_text("keep")
    # the checkpoint does not exist: --out is refused before the model is loaded
    assert fails(
        capsys, lm_eval_argv(tmp_path / "absent", tasks, data, "--out", str(tmp_path / "f")), str(tmp_path / "f")
    )
    assert (tmp_path / "f").read_text() == "keep"


# 3. export


@pytest.mark.parametrize("hf", [".", "..", "./"])
def test_export_refuses_the_current_folder_or_a_parent(run, tmp_path, monkeypatch, capsys, hf):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    (work / "keep.txt").write_text("keep")
    monkeypatch.chdir(work)
    assert fails(
        capsys, ["export", str(run), "--hf", hf, "--overwrite"], f"{hf.rstrip('/') or '.'}: is the current folder"
    )
    assert (work / "keep.txt").read_text() == "keep"


# 4. convert


def test_convert_bad_dataset_leaves_no_out_behind(run, tmp_path, capsys):
    out = tmp_path / "conv"
    argv = [
        "convert",
        str(run),
        "--attention",
        "kind=mha,n_kv_heads=1",
        "--out",
        str(out),
        "--seq-len",
        "16",
        "--eval-tokens",
        "32",
        "--dataset",
        str(tmp_path / "missing.txt"),
    ]
    assert fails(capsys, argv, "missing.txt")
    assert not out.exists()


def test_convert_refuses_negative_eval_tokens(run, tmp_path, capsys):
    out = tmp_path / "conv"
    assert fails(
        capsys,
        ["convert", str(run), "--attention", "kind=mha,n_kv_heads=1", "--out", str(out), "--eval-tokens", "-5"],
        "--eval-tokens=-5 must be >= 0",
    )
    assert not out.exists()


@pytest.mark.parametrize("attention", [None, ""])
def test_convert_with_nothing_to_convert_is_refused(run, tmp_path, capsys, attention):
    out = tmp_path / "conv"
    argv = ["convert", str(run), "--out", str(out)] + ([] if attention is None else ["--attention", attention])
    assert fails(capsys, argv, "nothing to convert", "--attention", "--memory")
    assert not out.exists()


def test_duplicate_keys_are_refused(run, tmp_path, capsys):
    assert fails(
        capsys,
        ["convert", str(run), "--attention", "kind=mha,kind=diff", "--out", str(tmp_path / "conv")],
        "--attention",
        "kind is given twice",
    )
    assert fails(
        capsys,
        ["info", str(run), "--memory", "kind=window,recent_window=8,recent_window=16"],
        "--memory",
        "recent_window is given twice",
    )


def test_convert_says_why_calibration_text_is_needed(run, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("ATTNLAB_DATA", raising=False)
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "conv"
    assert fails(
        capsys,
        ["convert", str(run), "--attention", "kind=decoupled", "--out", str(out)],
        "calibration text for the factorisations (--calibrate-on wikitext2-nounk, train split) was not found",
        "--data-dir",
        "--calibration-tokens 0",
    )
    assert not out.exists()
