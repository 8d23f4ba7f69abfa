"""Probe O's findings: records appended by two commands at once lost one's rows (o3), two lm-evals into one --out
both wrote (the second silently replaced the first's results, o178), a memory query that raced an ingest --replace
blamed a missing file (o8), kv-eval measured a policy given twice twice (o131), an empty --dataset was named '.'
(o139), the kernel cache's warning hid the path in the way (o141), a YAML alias bomb hung every command reading it
(o166), and a checkpoint pointer whose step disagrees with its folder was trusted by the dry run and not by the run
(o186). (o11, an FSDP run with a bounded memory could not resume, is tested in test_fsdp, under its torchruns.)"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import warnings
from pathlib import Path

import pytest
from helpers import PROBE_MODEL, at_most, fails, lm_task_folders, lm_task_yaml, train_tiny_run

from attnlab.cli import main
from attnlab.config_io import parse_yaml
from attnlab.data.files import folder_lock
from attnlab.errors import AttnlabWarning
from attnlab.eval import records

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


def test_two_appends_to_one_records_file_at_once_keep_both_rows(tmp_path, monkeypatch):
    """o3: six `kv-eval --out race.jsonl` at once left five records: each read the file, then renamed the old rows
    plus its own over it. A second append that starts while the first has read the file now waits for it."""
    path = tmp_path / "r.jsonl"
    real, other = records.atomic_path, []

    @contextlib.contextmanager
    def write_late(target, durable=False):
        if not other:  # the first append has read the file: a second one starts now
            other.append(threading.Thread(target=records.append_records, args=(path, [{"benchmark": "b", "n": 2}])))
            other[0].start()
            other[0].join(timeout=1)  # unlocked, it writes its row now; locked, it waits for this one
        with real(target, durable) as tmp:
            yield tmp

    monkeypatch.setattr(records, "atomic_path", write_late)
    records.append_records(path, [{"benchmark": "b", "n": 1}])
    other[0].join()
    assert sorted(json.loads(line)["n"] for line in path.read_text().splitlines()) == [1, 2]


def test_an_lm_eval_into_a_folder_another_one_evaluates_into_is_refused(tiny_run, tmp_path, monkeypatch, capsys):
    """o178: two `lm-eval --out lm9` at once both exited 0 and the second's results replaced the first's."""
    item = {"q": "a cat", "gold": 0, "choices": [" sat", " dog"]}
    tasks, data_folder = lm_task_folders(tmp_path, monkeypatch, lm_task_yaml(), [item])
    out = tmp_path / "out"
    argv = ["lm-eval", str(tiny_run), "--tasks", "mytask", "--include-path", str(tasks), "--data-dir",
            str(data_folder), "--out", str(out)]  # fmt: skip
    with folder_lock(out, ".lm_eval.lock", lambda holder: "held"):  # as another lm-eval holds it
        assert fails(capsys, argv, f"--out {out}: another attnlab lm-eval", "is evaluating into this folder",
                     "give another --out")  # fmt: skip
    assert not (out / "lm_eval.json").exists()
    assert main(argv) == 0 and (out / "lm_eval.json").is_file()  # once it is free


@pytest.fixture(scope="module")
def bounded_run(tmp_path_factory) -> Path:
    memory = {"kind": "bounded", "recent_window": 8, "exact_slots": 4, "summary_slots": 4}
    return train_tiny_run(tmp_path_factory.mktemp("bounded"), {**PROBE_MODEL, "memory": memory}, steps=2)


def test_a_query_that_an_ingest_replace_overtakes_reads_the_new_state(bounded_run, tmp_path, monkeypatch, capsys):
    """o8: `memory query` read the index, an `ingest --replace` of the same name finished while the model loaded
    (its old state deleted), and the query ended in "states/notes-<old>.safetensors: cannot read the memory state (No
    such file or directory)" for a memory that exists."""
    from attnlab.memory import store as memory_store

    doc, store = tmp_path / "doc.txt", tmp_path / "store"
    doc.write_text("the cat sat on the mat " * 20)
    ingest = ["memory", "ingest", str(bounded_run), str(doc), "--store", str(store), "--name", "notes", "--no-progress"]
    assert main(ingest) == 0
    real = memory_store._load_model

    def load_then_replace(path, data_dir):
        loaded = real(path, data_dir)
        monkeypatch.setattr(memory_store, "_load_model", real)
        assert main([*ingest, "--replace"]) == 0  # the old state's file is gone now
        return loaded

    monkeypatch.setattr(memory_store, "_load_model", load_then_replace)
    capsys.readouterr()
    assert main(["memory", "query", "notes", "the cat", "--store", str(store), "--max-new-tokens", "2"]) == 0
    assert "error" not in capsys.readouterr().err


def test_kv_eval_refuses_a_policy_given_twice(tiny_run, capsys):
    """o131: `--policies none none` measured the full cache twice and recorded two identical rows (bench's
    kv_quant.policies refuses a policy given twice)."""
    argv = ["kv-eval", str(tiny_run), "--split", "val", "--seq-len", "16", "--tokens", "32", "--policies"]
    assert fails(capsys, [*argv, "none", "none"], "--policies: 'none' is given twice", "give each policy once")
    assert fails(capsys, [*argv, "k=q8_0,v=q4_0", "v=q4_0,k=q8_0"], "'k=q8_0,v=q4_0' is given twice",
                 "'v=q4_0,k=q8_0'")  # fmt: skip


@pytest.mark.parametrize("command", ["kv-eval", "kv-tune"])
def test_an_empty_dataset_is_named_as_empty(command, tiny_run, capsys):
    """o139: `--dataset ""` said "--dataset : source '.' is a folder"."""
    extra = ["--policies", "none"] if command == "kv-eval" else ["--budget", "40"]
    argv = [command, str(tiny_run), "--dataset", "", "--split", "val", "--seq-len", "16", "--tokens", "32", *extra]
    line = fails(capsys, argv, "--dataset is empty: give a named dataset (wikitext2", "or a text file")
    assert "'.'" not in line


def test_the_kernel_cache_warning_names_the_path_in_the_way(tmp_path, monkeypatch):
    """o141: a folder where a library's .sha256 goes gave "cannot use the cache .../kernels (Is a directory) ... make it
    writable": the folder was writable; the path in the way was not named."""
    from attnlab.kernels import cpu

    in_the_way = cpu.kernel_dir() / "qmatmul-x86_64-0123.so.sha256"

    def builder(folder):
        if folder is None:
            raise IsADirectoryError(21, "Is a directory", str(in_the_way))
        return folder / "lib.so"

    monkeypatch.delenv("ATTNLAB_CPU_KERNELS", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu.compiled(cpu.SOURCE, lambda path: "loaded", builder) == "loaded"
    [warning] = [w for w in caught if issubclass(w.category, AttnlabWarning)]
    assert f"({in_the_way}: Is a directory)" in str(warning.message)


def alias_bomb(levels: int) -> str:
    """YAML whose `levels` nested aliases, 9 at each level, expand to 9**levels values."""
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, capsys):
    """o166: twenty nested levels of 9 aliases (a 21-line file) hung `validate` (and every command reading the file):
    the config's checks walked the 9**20 values. More than MAX_VALUES values after expansion are refused."""
    path = tmp_path / "bomb.yml"
    path.write_text(
        alias_bomb(20) + "name: m\ndefaults:\n  model: {vocab_size: 40, d_model: 32, n_layers: 1, n_heads: 2}\n"
        "  data: {source: text.txt, tokenizer: char}\ntargets:\n  base: {model: {nosuch: *a19}}\n"
    )
    with at_most(30):
        assert main(["validate", str(path)]) == 2
    from attnlab.config_io import MAX_VALUES, TooLarge

    err = capsys.readouterr().err
    assert f"bomb.yml: expands to more than {MAX_VALUES:,} values through its aliases" in err, err
    with pytest.raises(TooLarge):
        parse_yaml(alias_bomb(8))
    assert len(parse_yaml(alias_bomb(5))["a4"]) == 9  # aliases as configs use them still load
    assert parse_yaml("base: &b {x: 1}\nother: {<<: *b, y: 2}\n")["other"] == {"x": 1, "y": 2}


def test_a_pointer_whose_step_is_not_its_folders_is_refused(tiny_run, tmp_path, capsys):
    """o186: last.json {"dir": "step-000008", "step": 6}: `run --dry-run` said "would resume from step 6 of 8", the
    run resumed from step 8 (the folder's own trainer.json); best.json's "step": -4 was taken too."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    pointer = run / "checkpoints" / "best.json"
    step = json.loads(pointer.read_text())["step"]
    pointer.write_text(json.dumps({"dir": f"step-{step:06d}", "step": -4}))
    assert fails(capsys, ["generate", str(run), "ab", "--max-new-tokens", "1"],
                 f"best.json: names step-{step:06d} but step -4", f'write {{"dir": "step-{step:06d}", "step": {step}}}'
                 " into best.json")  # fmt: skip
