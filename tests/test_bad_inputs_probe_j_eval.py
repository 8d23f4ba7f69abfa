"""Probe J's findings in the commands that measure models: kv-eval of a run without a test split named the prepared
cache folder, not --split; kv-eval/kv-tune rows measured the full-precision cache with no word when --chunk >=
--seq-len, a KIVI group never filled, or a residual window left no quantized token for any query to read (kv-tune then
picked its "best" policy on those zeros); `report --paired A:A` and `probes SUITE RUN RUN` compared a model with
itself; a label holding ':' could not be named in --paired; an ARC file (one JSON array) given to piqa was called
invalid JSON; an unknown metric in an lm-eval task file was reported as a split problem; two task files declaring one
task name ran whichever came first; and convert/export left the hidden temporary folder of a SIGKILLed run in place
for the next one."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import fails, lm_task_folders, lm_task_yaml, tiny_model

from attnlab.cli import main
from attnlab.data.files import sealed
from attnlab.errors import DataError, InputError

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

KV = ["--split", "val", "--seq-len", "16", "--tokens", "32"]  # tiny_run: a char run with train and val only


def warnings_of(capsys, command: str) -> list[str]:
    """The stderr lines of a command that succeeded: each `attnlab <command>: warning: ...`, no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert all(line.startswith(f"attnlab {command}: warning: ") for line in lines), lines
    return lines


# ----------------------------------------------------------------------------- j11: a run without a test split


def test_kv_eval_of_a_run_without_a_test_split_says_give_split_val(tiny_run, capsys):
    """kv01: was `split 'test' is not in <cache folder> (it has train, val)`: the run and the flag to give."""
    argv = ["kv-eval", str(tiny_run), "--policies", "k=q8_0", "--seq-len", "16", "--tokens", "32"]
    line = fails(capsys, argv, "--split test", "tiny/seed0's data", "has no 'test' split", "it has train, val",
                 "data.test_fraction", "give --split val")  # fmt: skip
    assert "prepared in" in line


def test_the_library_says_which_split_and_the_one_to_give(tiny_run):
    """The bench harness names its own parameter (split=) in the same line: an InputError, no longer a DataError."""
    from attnlab.eval import load_for_eval
    from attnlab.eval.perplexity import heldout_split

    with pytest.raises(InputError, match=r"split='test': tiny/seed0's data .*\(e\.g\. split='val'\)"):
        heldout_split(load_for_eval(tiny_run), "test")


# ----------------------------------------------------------------------------- j12: rows that measure nothing


@pytest.mark.parametrize("command", ["kv-eval", "kv-tune"])
def test_a_chunk_as_long_as_the_window_is_refused(tiny_run, capsys, command):
    """kv06, kv13, kt10: one prefill per window never reads the quantized cache; every dNLL was 0, and kv-tune picked
    a "best" policy on those zeros."""
    what = ["--policies", "k=q4_0,v=q4_0"] if command == "kv-eval" else ["--budget", "100"]
    argv = [command, str(tiny_run), *what, *KV, "--chunk", "16"]
    assert fails(capsys, argv, "--chunk 16 >= --seq-len 16", "no policy's quantized cache is ever read",
                 "give --chunk below 16")  # fmt: skip


def test_tune_itself_refuses_a_chunk_as_long_as_the_window():
    from attnlab.eval.kvquant import tune

    windows = torch_windows(2, 17)
    with pytest.raises(InputError, match="--chunk 16 >= --seq-len 16"):
        tune(tiny_model(), windows, budget=1000, chunk=16, log=lambda _: None)


def torch_windows(n: int, length: int):
    import torch

    return torch.from_numpy(np.arange(n * length).reshape(n, length) % 90)


def kv_rows(path) -> dict[str, dict]:
    from attnlab.eval.records import read_records

    return {row["policy"]: row for row in read_records(path, "kv_quant")}


def test_kv_eval_says_a_kivi_group_longer_than_the_window_quantizes_nothing_read(tiny_run, tmp_path, capsys):
    """kv16: kivi2's default group of 32 never fills in a window of 16 (a row of dNLL 0 next to 48 B/token);
    group=8 does, and is not warned about."""
    out = tmp_path / "kv.jsonl"
    argv = ["kv-eval", str(tiny_run), "--policies", "k=kivi2,v=kivi2", "k=kivi2,v=kivi2,group=8", *KV, "--out",
            str(out)]  # fmt: skip
    assert main(argv) == 0
    (line,) = warnings_of(capsys, "kv-eval")
    assert "kv policy k=kivi2,v=kivi2:" in line and "group=32" in line and "group=8" not in line
    assert "full-precision cache (dNLL 0, KL 0)" in line and "give a seq_len above 32" in line
    rows = kv_rows(out)  # what the warning says is so (exactly the full cache's figures), of that policy only
    assert rows["k=kivi2,v=kivi2"]["kl"] == 0 and rows["k=kivi2,v=kivi2,group=8"]["kl"] != 0


def test_kv_eval_says_a_chunk_that_starts_before_a_quantized_token_is_held(tiny_run, tmp_path, capsys):
    """resid=8 fed 8 at a time: the last chunk starts at token 8, and a quantized token is held only from 9."""
    out = tmp_path / "kv.jsonl"
    argv = ["kv-eval", str(tiny_run), "--policies", "k=q8_0,resid=8", "k=q8_0,resid=7", *KV, "--chunk", "8", "--out",
            str(out)]  # fmt: skip
    assert main(argv) == 0
    (line,) = warnings_of(capsys, "kv-eval")
    assert "kv policy k=q8_0,resid=8: fed 8 tokens at a time" in line and "starts at token 8" in line
    assert "give a smaller chunk" in line
    rows = kv_rows(out)
    assert rows["k=q8_0,resid=8"]["kl"] == 0 and rows["k=q8_0,resid=7"]["kl"] != 0


def test_kv_eval_says_a_residual_window_one_short_of_the_window_quantizes_nothing_read(tiny_run, tmp_path, capsys):
    """resid=15 of seq_len 16: the last query reads the 15 tokens before it, all still at full precision (the old
    warning began at resid >= seq_len only); resid=14 leaves one quantized token for it to read."""
    out = tmp_path / "kv.jsonl"
    argv = ["kv-eval", str(tiny_run), "--policies", "k=q8_0,resid=15", "k=q8_0,resid=14", *KV, "--out", str(out)]
    assert main(argv) == 0
    (line,) = warnings_of(capsys, "kv-eval")
    assert "kv policy k=q8_0,resid=15:" in line and "reads the 15 before it" in line and "above 16" in line
    rows = kv_rows(out)
    assert rows["k=q8_0,resid=15"]["kl"] == 0 and rows["k=q8_0,resid=14"]["kl"] != 0


def test_kv_tune_leaves_out_policies_whose_quantized_tokens_no_query_reads(tiny_run, capsys):
    """resid=15 of seq_len 16 counts one token quantized (fits the budget of 125 bytes/token, fp16 takes 128) but
    measures KL 0: it was picked as the best over every policy actually measured."""
    argv = ["kv-tune", str(tiny_run), "--budget", "125", "--formats", "fp16,q8_0", "--resids", "0,15", *KV]
    assert main(argv) == 0
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab kv-tune: warning: left out of the choice"), lines
    assert "resid=15" in lines[0] and "measured on nothing" in lines[0]
    best = next(line for line in out.out.splitlines() if line.startswith("best under"))
    assert "resid=15" not in best


# ----------------------------------------------------------------------------- j13, j14: --paired and probes


def ppl_record(model: str, shift: float = 0.0) -> dict:
    from attnlab.eval.perplexity import summarize_losses

    windows = [(float(n * (3.0 + shift + 0.1 * i)), n) for i, n in enumerate([6, 8, 5, 7, 8, 6])]
    return {"benchmark": "perplexity", "model": model, "kind": "mha", "split": "val", "dataset": "text",
            "seq_len": 8, **summarize_losses(windows)}  # fmt: skip


def records(folder, *models: str) -> str:
    """folder/records.jsonl: a perplexity record of each model, sealed as bench writes them."""
    folder.mkdir()
    rows = [sealed(ppl_record(model, 0.1 * i)) for i, model in enumerate(models)]
    (folder / "records.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(folder)


def test_report_refuses_a_model_paired_with_itself(tmp_path, capsys):
    """rp02: a row of difference 0.000, interval 0.000 to 0.000."""
    folder = records(tmp_path / "b", "base/seed0", "other/seed0")
    assert fails(capsys, ["report", folder, "--paired", "base/seed0:base/seed0"], "compares base/seed0 with itself",
                 "give two different model labels")  # fmt: skip
    assert not (tmp_path / "b" / "report.md").exists()


def test_probes_refuses_one_checkpoint_given_twice(tiny_run, tmp_path, capsys):
    """pb07b: a head-to-head of one checkpoint, labelled A and B ("no significant difference")."""
    suite = tmp_path / "p.yml"
    suite.write_text('name: p\ndescription: d\ndefaults: {kind: first_line}\ncases:\n'
                     '  - {id: a, category: c, expected: "x", prompt: "a cat"}\n')  # fmt: skip
    argv = ["probes", str(suite), str(tiny_run), str(tiny_run), "--out", str(tmp_path / "po")]
    assert fails(capsys, argv, "given twice", "with itself", "two different checkpoints")
    assert not (tmp_path / "po" / "probes.jsonl").exists()


def test_report_paired_reads_a_label_holding_a_colon(tmp_path, capsys):
    """rp08: a folder named x:y gives the label x:y/seed0, which --paired split at its first colon."""
    folder = records(tmp_path / "b", "x:y/seed0", "base/seed0")
    assert main(["report", folder, "--paired", "x:y/seed0:base/seed0"]) == 0
    table = (tmp_path / "b" / "tables" / "paired.csv").read_text().splitlines()
    assert table[1].startswith("x:y/seed0,base/seed0,perplexity,"), table
    capsys.readouterr()
    assert fails(capsys, ["report", folder, "--paired", "x:y/seed1:base/seed0"], "no records of 'x:y/seed1'",
                 "a label that holds ':' is given as it is")  # fmt: skip


def test_report_paired_refuses_a_pair_that_reads_two_ways(tmp_path, capsys):
    folder = records(tmp_path / "b", "a", "b:c", "a:b", "c")
    assert fails(capsys, ["report", folder, "--paired", "a:b:c"], "'a' minus 'b:c' or 'a:b' minus 'c'", "rename")


# ----------------------------------------------------------------------------- j17: an ARC file given to piqa


ARC = [{"id": f"q{i}", "question": "Which?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "A"}
       for i in range(2)]  # fmt: skip


@pytest.mark.parametrize("indent", [2, None])
def test_piqa_given_a_json_array_says_it_reads_jsonl(tmp_path, indent):
    """mc04: `ARC-Easy-validation.json:1: not valid JSON (Expecting value, column 2)` for a valid JSON file."""
    from attnlab.eval.multiple_choice import load_items

    path = tmp_path / "ARC-Easy-validation.json"
    path.write_text(json.dumps(ARC, indent=indent))
    with pytest.raises(DataError, match=r"piqa reads JSONL, one \{\"query\", \"choices\", \"gold\"\} object a line; "
                                        r"this file is one JSON array of 2 items \(an arc_easy file\?"):  # fmt: skip
        load_items("piqa", path)


def test_mc_piqa_with_an_arc_file_is_one_line(tiny_run, tmp_path, capsys):
    path = tmp_path / "arc.json"
    path.write_text(json.dumps(ARC, indent=1))
    argv = ["mc", "piqa", str(tiny_run), "--file", str(path), "--limit", "2"]
    line = fails(capsys, argv, "piqa reads JSONL", "one JSON array of 2 items", "`attnlab mc arc_easy` reads it")
    assert "not valid JSON" not in line


# ----------------------------------------------------------------------------- j18, j19: lm-eval task files


@pytest.fixture
def lm_tasks(tmp_path, monkeypatch):
    items = [{"q": "a cat", "gold": 0, "choices": [" sat", " dog"]}, {"q": "a mat", "gold": 1, "choices": [" a", " b"]}]
    return lm_task_folders(tmp_path, monkeypatch, lm_task_yaml(), items)


def lm_argv(tmp_path, tasks, data, name):
    """lm-eval on a model file that cannot load (a .gguf of other bytes, which a missing one would be refused before
    the tasks are read): a task file's mistake must be refused before any model loads."""
    (tmp_path / "unloadable.gguf").write_bytes(b"not a model")
    return ["lm-eval", str(tmp_path / "unloadable.gguf"), "--tasks", name, "--include-path", str(tasks),
            "--data-dir", str(data), "--limit", "2"]  # fmt: skip


def test_an_unknown_metric_names_the_metric_not_a_split(lm_tasks, tmp_path, capsys):
    """le09: `test_split: the task data has no split None`, after three lines of lm-eval's log."""
    tasks, data = lm_tasks
    (tasks / "mytask.yaml").write_text(lm_task_yaml().replace("metric: acc", "metric: bleu_bogus"))
    line = fails(capsys, lm_argv(tmp_path, tasks, data, "mytask"), "mytask.yaml",
                 "metric_list[0].metric='bleu_bogus' is not a metric lm-eval knows", "aggregation")  # fmt: skip
    assert "test_split" not in line and "no split" not in line


def test_two_task_files_declaring_one_task_are_refused(lm_tasks, tmp_path, capsys):
    """le10: lm-eval ran the first file in name order and logged that it skipped the other."""
    tasks, data = lm_tasks
    (tasks / "twin_a.yaml").write_text(lm_task_yaml("twin"))
    (tasks / "twin_b.yaml").write_text(lm_task_yaml("twin").replace("metric: acc", "metric: acc_norm"))
    assert fails(capsys, lm_argv(tmp_path, tasks, data, "twin"), "task 'twin' is declared by 2 task files",
                 "twin_a.yaml", "twin_b.yaml", "give each task a name of its own")  # fmt: skip


# ----------------------------------------------------------------------------- j21: a killed convert or export


def stale_temporary(folder, name: str):
    """A hidden temporary folder of `name` as a writer killed a moment ago left it (its process is gone)."""
    stale = folder / f".{name}.999999999.0123456789ab.tmp"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "model.safetensors").write_bytes(b"partial")
    return stale


@pytest.mark.parametrize("command", ["convert", "export"])
def test_a_killed_runs_fresh_temporary_is_removed_by_the_next_run(tiny_run, tmp_path, capsys, command):
    """int04, int06: the temporary of `kill -9` a second ago was left (only temporaries idle for 10 minutes went),
    and export swept none. Those of other names, fresh, stay (a writer on another machine may own them)."""
    out = tmp_path / "out"
    stale, other = stale_temporary(tmp_path, "out"), stale_temporary(tmp_path, "notes")
    if command == "convert":
        argv = ["convert", str(tiny_run), "--attention", "kind=mha,n_kv_heads=1", "--out", str(out), "--eval-tokens",
                "0"]  # fmt: skip
    else:
        argv = ["export", str(tiny_run), "--hf", str(out)]
    assert main(argv) == 0
    assert not stale.exists() and other.exists() and out.is_dir()
    (line,) = warnings_of(capsys, command)
    assert f"removed {stale}" in line and "process 999999999, gone" in line


def test_a_bench_manifest_whose_kv_quant_chunk_reads_no_cache_is_refused_up_front():
    """Probe J (j12), for bench manifests: checked with the other parameters, so validate and the dry run say it."""
    from attnlab.eval.harness import check_benchmarks

    problems = check_benchmarks({"kv_quant": {"seq_len": 64, "chunk": 64}})
    assert problems == ["benchmarks.kv_quant.chunk=64 >= seq_len=64: each window goes in as one chunk, whose queries "
                        "read their own keys at full precision, so no policy is measured (give a chunk below 64; 1, "
                        "the default, decodes token by token)"]  # fmt: skip
    assert check_benchmarks({"kv_quant": {"chunk": 600}})  # the default seq_len, 512
    assert not check_benchmarks({"kv_quant": {"seq_len": 64, "chunk": 8}})
