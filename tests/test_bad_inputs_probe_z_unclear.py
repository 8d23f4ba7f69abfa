"""Probe Z's unclear findings (/work/probe_z/REPORT.md, U1-U8): fix lines that did not do what they said (a damaged
last.json or best.json, an interrupted --no-resume run), a resume that went on silently over a damaged metrics log or
weights re-saved in another dtype, a rerun that replaced a compare.md the user had added to, `memory ls` blaming
permissions for a journal file, YAML 1.1-only integers in --set, and an --out that is a manifest's own folder. Each
test fails with its fix backed out."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import dry_run, edit_trainer, fails, snapshot
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from attnlab.cli import main
from attnlab.errors import AttnlabWarning

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

import test_bad_inputs_probe_v_runs as v_runs  # noqa: E402

RUN, STEP, interrupted, refused_alike = v_runs.RUN, v_runs.STEP, v_runs.interrupted, v_runs.refused_alike
stopped = v_runs.stopped  # (a module fixture: a run stopped right after its step-2 checkpoint, of 4)


@pytest.fixture(scope="module")
def finished(stopped, tmp_path_factory) -> tuple[Path, Path]:
    """(manifest, --out) of the stopped run finished (its manifest folder: manifest.json, compare.md, ...), made
    once: tests copy --out."""
    manifest, out = stopped
    done = tmp_path_factory.mktemp("finished") / "out"
    shutil.copytree(out, done, symlinks=True)
    assert main(["run", str(manifest), "--out", str(done), "--no-progress"]) == 0
    return manifest, done


def finished_copy(finished, tmp_path: Path) -> tuple[list[str], Path]:
    """(the argv rerunning it, --out) of a copy of the finished run."""
    manifest, out = finished
    shutil.copytree(out, tmp_path / "out", symlinks=True)
    return ["run", str(manifest), "--out", str(tmp_path / "out"), "--no-progress"], tmp_path / "out"


# ----------------------------------------------------------------------------- U8: an interrupted --no-resume run


def test_u8_an_interrupted_no_resume_run_says_to_run_it_again_without_no_resume(stopped, tmp_path, capsys,
                                                                                monkeypatch):  # fmt: skip
    """Was: "run the same command again to resume", whose --no-resume would start over."""
    from attnlab.train import loop

    manifest, _ = stopped
    argv = ["run", str(manifest), "--out", str(tmp_path / "out"), "--no-progress"]
    save = loop.save_checkpoint

    def save_then_ctrl_c(*args, **kwargs):
        save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "save_checkpoint", save_then_ctrl_c)
    assert main([*argv, "--no-resume"]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        "attnlab run: interrupted; run it again without --no-resume to resume from the last checkpoint (with it, "
        "the run starts over)"
    )
    monkeypatch.undo()
    assert "would resume from step 2 of 4" in dry_run(capsys, [*argv, "--dry-run"])  # what the line says


def test_u8_the_entry_point_reads_no_resume_and_dry_run_from_the_arguments_as_given(capsys):
    """A Ctrl-C during the imports, before the arguments are parsed (argparse takes an abbreviation)."""
    from attnlab.entry import given, interrupted

    assert given("--no-resume", "--no-r", ["run", "m.yml", "--no-res"]) and given(
        "--no-resume", "--no-r", ["--no-resume"]
    )
    assert not given("--no-resume", "--no-r", ["run", "m.yml", "--no-progress"]) and not given(
        "--no-resume", "--no-r", []
    )
    assert given("--dry-run", "--dr", ["run", "m.yml", "--dry"]) and not given("--dry-run", "--dr", ["--data-dir", "d"])
    assert interrupted("run", True) == 130 and "without --no-resume" in capsys.readouterr().err


def test_an_interrupted_dry_run_says_nothing_of_resuming(capsys):
    """A dry run trains nothing: 'run the same command again to resume' would only dry-run again."""
    from attnlab.entry import interrupted

    assert interrupted("run", False, dry_run=True) == 130 and interrupted("run", True, dry_run=True) == 130
    assert capsys.readouterr().err.splitlines() == ["attnlab run: interrupted"] * 2


# ----------------------------------------------------------------------------- U6: YAML 1.1-only numbers

YAML_11_ONLY = {"1_2": ("its underscores dropped", "12"), "0b1100": ("binary", "12"), "-1_000": (
    "its underscores dropped", "-1000"), "1_0.5": ("its underscores dropped", "10.5")}  # fmt: skip


@pytest.mark.parametrize("text", sorted(YAML_11_ONLY))
def test_u6_numbers_only_yaml_1_1_reads_are_refused_in_set_and_in_files(stopped, tmp_path, capsys, text):
    """Was: `--set train.steps=1_2` (or 0b1100) trained 12 steps; YAML 1.2 (and other tools) read a string there."""
    manifest, _ = stopped
    form, value = YAML_11_ONLY[text]
    said = f"{text} is a number only in YAML 1.1 ({form}: {value}), a string in YAML 1.2: write {value} if that is "
    argv = ["run", str(manifest), "--out", str(tmp_path / "out"), "--dry-run", "--set", f"train.steps={text}"]
    line = fails(capsys, argv, said + "meant, or quote it for a string")
    assert "stray quote" not in line  # (the value is YAML: the line says how to quote it)
    config = tmp_path / "model.yaml"
    config.write_text(f"vocab_size: 97\nd_model: 64\nn_layers: 2\nn_heads: 4\nmax_seq_len: {text}\n")
    assert main(["validate", str(config)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"{config}: ") and "line 5, column 14" in line and said + "meant" in line, line
    assert not (tmp_path / "out").exists()


def test_u6_hex_and_quoted_values_are_still_read(stopped, tmp_path, capsys):
    """0xC is 12 in YAML 1.2 as in 1.1; a quoted '1_2' is the string it always was (refused by the type check)."""
    manifest, _ = stopped
    argv = ["run", str(manifest), "--out", str(tmp_path / "out"), "--dry-run"]
    assert "would train 12 steps" in dry_run(capsys, [*argv, "--set", "train.steps=0xC"])
    assert fails(capsys, [*argv, "--set", "train.steps='1_2'"]).endswith("train.steps='1_2' must be int, got str")


# ----------------------------------------------------------------------------- U7: --out a manifest's own folder


@pytest.mark.parametrize("below", ["", "base"])
def test_u7_an_out_that_is_a_manifests_folder_is_refused_by_the_run_and_its_dry_run(finished, tmp_path, capsys,
                                                                                     below):  # fmt: skip
    """Was: `run m.yml --out out/m` trained into out/m/m/base/seed0, a second manifest folder inside the first."""
    argv, out = finished_copy(finished, tmp_path)
    given = out / "m" / below if below else out / "m"
    argv[argv.index("--out") + 1] = str(given)
    before = snapshot(out)
    where = "is" if not below else f"is inside {out / 'm'}, which is"
    said = (f"error: --out {given} {where} the folder of manifest m's runs (it holds manifest.json): runs go to "
            f"OUT/<manifest>/<target>/seed<S>; give the folder that holds it, --out {out}")  # fmt: skip
    for command in ([*argv, "--dry-run"], argv):
        assert fails(capsys, command).endswith(said)
    assert snapshot(out) == before
    argv[argv.index("--out") + 1] = str(out)
    assert "done already" in dry_run(capsys, [*argv, "--dry-run"])  # the folder the line names


def test_u7_a_manifest_json_of_another_kind_is_not_taken_for_a_manifests_folder(stopped, tmp_path, capsys):
    """A web app's manifest.json (its own "name") in --out, or one naming another folder, is not attnlab's."""
    manifest, _ = stopped
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "manifest.json").write_text('{"name": "My app", "start_url": "/"}')
    argv = ["run", str(manifest), "--out", str(tmp_path / "site"), "--dry-run"]
    assert "would train 4 steps" in dry_run(capsys, argv)


# ----------------------------------------------------------------------------- U1: a damaged last.json or best.json

CHECKPOINTS = RUN / "checkpoints"
POINTER = '{"dir": "step-000002", "step": 2}'


@pytest.mark.parametrize("text", ['{"dir": "step-000002", "step": 2.0}', '{"dir": "step-000002/", "step": 2}', "xx",
                                  '{"dir": "step-000002", "step": 3}'])  # fmt: skip
def test_u1_a_damaged_last_json_says_which_pointer_resumes_and_what_starts_over(stopped, tmp_path, capsys, text):
    """Was: "...; delete it to start over", but with last.json deleted the run refused again (its checkpoint folders
    are there); the line's two ways now do what it says."""
    argv, out = interrupted(stopped, tmp_path)
    (out / CHECKPOINTS / "last.json").write_text(text)
    line = refused_alike(capsys, argv, out)
    assert line.startswith(f"{out / CHECKPOINTS / 'last.json'}: ") and "delete it to start over" not in line, line
    assert line.endswith(f"; write {POINTER} into last.json to resume from step 2, or delete {out / CHECKPOINTS} to "
                         "start over")  # fmt: skip
    (out / CHECKPOINTS / "last.json").write_text(POINTER)
    assert "would resume from step 2 of 4" in dry_run(capsys, [*argv, "--dry-run"])
    shutil.rmtree(out / CHECKPOINTS)
    assert "would train 4 steps" in dry_run(capsys, [*argv, "--dry-run"])


def test_u1_a_damaged_best_json_says_deleting_it_resumes(stopped, tmp_path, capsys):
    """Was: "unreadable ...; delete it to start over", but with best.json deleted the run resumes from step 2."""
    argv, out = interrupted(stopped, tmp_path)
    best = out / CHECKPOINTS / "best.json"
    best.write_text("xx")
    line = refused_alike(capsys, argv, out)
    assert line == (f"{best}: unreadable (Expecting value: line 1 column 1 (char 0)); write {POINTER} into best.json "
                    "(step-000002, its last checkpoint: no earlier one is kept), or delete best.json alone: the "
                    "run resumes from step 2"), line  # fmt: skip
    best.unlink()
    assert "would resume from step 2 of 4" in dry_run(capsys, [*argv, "--dry-run"])
    assert main(argv) == 0 and capsys.readouterr()


def test_u1_the_best_json_line_names_the_checkpoint_before_the_last_when_there_is_one(tmp_path):
    """A run keeps its last checkpoint and its best (an earlier one, or the last itself): best.json names the one
    before the last, and deleting it would let the next checkpoint's pruning delete that one."""
    from attnlab.train.checkpoint import CheckpointError, read_pointer

    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):  # (step-000006: a newer folder no pointer names yet, as a kill before last.json leaves)
        (root / f"step-{step:06d}").mkdir(parents=True)
        (root / f"step-{step:06d}" / "model.safetensors").write_bytes(b"")
    (root / "last.json").write_text('{"dir": "step-000004", "step": 4}')
    (root / "best.json").write_text("[]")
    with pytest.raises(CheckpointError) as refused:
        read_pointer(root, "best")
    assert str(refused.value).endswith(f"; write {POINTER} into best.json (step-000002, the one checkpoint kept "
                                       "before its last), or delete best.json alone: the run resumes from step 4 and "
                                       "no longer keeps step-000002 as its best")  # fmt: skip


# ----------------------------------------------------------------------------- U2: a damaged metrics log on resume

RESUMES = (
    "the run resumes from step 2 and logs only the steps after it (restore the file from a copy first to keep them)"
)


def warned_alike(capsys, argv: list[str]) -> str:
    """The dry run says "would resume" and the run resumes, each with the same one warning line: that line."""
    assert main([*argv, "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "would resume from step 2 of 4" in captured.out
    (line,) = captured.err.strip().splitlines()
    assert main(argv) == 0
    assert capsys.readouterr().err.strip().splitlines() == [line]
    assert line.startswith("attnlab run: warning: ")
    return line.removeprefix("attnlab run: warning: ")


@pytest.mark.parametrize("how", ["deleted", "emptied"])
def test_u2_a_resume_over_a_deleted_or_emptied_metrics_log_says_which_rows_it_lacks(stopped, tmp_path, capsys, how):
    """Was: "would resume from step 2" and a resume without a word, the log then lacking the rows up to step 2."""
    argv, out = interrupted(stopped, tmp_path)
    log = out / RUN / "metrics.jsonl"
    log.unlink() if how == "deleted" else log.write_text("")
    said = ("missing: the rows the run logged up to step 2 are gone" if how == "deleted" else
            "holds none of the rows the run logged up to step 2 (it was emptied or cut)")  # fmt: skip
    assert warned_alike(capsys, argv) == f"{log}: {said}; {RESUMES}"
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [4, 4]  # (what the warning said)


def test_u2_a_nan_in_the_metrics_log_is_refused_as_damage_by_the_run_and_its_dry_run(stopped, tmp_path, capsys):
    """Was: taken as a row (the JSON NaN token) and kept: the trainer never logs one (a NaN loss stops the run)."""
    argv, out = interrupted(stopped, tmp_path)
    log = out / RUN / "metrics.jsonl"
    row = json.loads(log.read_text())
    log.write_text(json.dumps({**row, "val_loss": float("nan")}) + "\n")
    line = refused_alike(capsys, argv, out)
    assert line == (f"{log}: line 1: val_loss is NaN, which the trainer never logs (the metrics log was changed); "
                    "repair or remove that line, or delete the file to start the log afresh")  # fmt: skip


def test_u2_the_warning_names_the_rows_a_log_lacks_in_its_middle(tmp_path):
    """log_every 2, eval_every 4: a resume from step 8 should find training rows at 2, 4, 6, 8 and validation rows
    at 4 and 8; a gradient norm may be infinite (clip_grad_norm_ of an overflow), a loss may not."""
    from attnlab.train.logging import metrics_rows

    train_cfg = SimpleNamespace(steps=20, log_every=2, eval_every=4)
    log = tmp_path / "metrics.jsonl"
    rows = [{"step": 2, "loss": 3.0, "grad_norm": float("inf")}, {"step": 6, "loss": 2.0}, {"step": 8, "loss": 1.0},
            {"step": 8, "val_loss": 1.5, "val_ppl": 4.48}, {"step": 10, "loss": 0.5}]  # fmt: skip
    log.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.warns(AttnlabWarning) as said:
        assert len(metrics_rows(log, 8, train_cfg)[1]) == 4
    assert [str(w.message) for w in said] == [f"{log}: lacks rows the run logged before its checkpoint (training loss "
                                              f"at step 4; validation loss at step 4); the run resumes from step 8 and "
                                              "logs only the steps after it (restore the file from a copy first to "
                                              "keep them)"]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics_rows(log, 2, train_cfg)  # (all there up to step 2)


# ----------------------------------------------------------------------------- U3: weights re-saved in another dtype


def resave(folder: Path, dtype: torch.dtype) -> None:
    """folder's model.safetensors re-saved with every tensor in `dtype` (its metadata kept), checksums.json made to
    agree (as a careful hand would)."""
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    save_file({name: t.to(dtype) for name, t in load_file(path).items()}, path, metadata=metadata)
    checksums = json.loads((folder / "checksums.json").read_text())
    data = path.read_bytes()
    checksums["files"]["model.safetensors"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "checksums.json").write_text(json.dumps(checksums, indent=1))


@pytest.mark.parametrize("dtype, name", [(torch.float16, "F16"), (torch.float64, "F64")])
def test_u3_weights_re_saved_in_another_dtype_are_refused_by_the_resume_and_its_dry_run(stopped, tmp_path, capsys,
                                                                                       dtype, name):  # fmt: skip
    """Was: resumed without a word (F16 rounds every weight: the resume is no longer bit-exact)."""
    argv, out = interrupted(stopped, tmp_path)
    resave(out / STEP, dtype)
    line = refused_alike(capsys, argv, out)
    weights = out / STEP / "model.safetensors"
    assert line.startswith(f"{weights}: blocks.0.attn.out.weight and 7 more are {name}, where the run saves F32 (the "
                           "file was re-saved in another dtype), so the run would not resume exactly; restore it from "
                           f"a copy, or delete {out / CHECKPOINTS}"), line  # fmt: skip


def test_u3_the_best_checkpoint_a_resume_scores_at_its_end_is_checked_before_it_starts(stopped, tmp_path, capsys):
    """A run resumed at its last step to write its summary scores its best checkpoint (step 2 here, its step-4 loss
    no better than the best_val_loss step 2 records): re-saved in F16, it is refused now, not after training."""
    argv, out = interrupted(stopped, tmp_path)
    edit_trainer(out / STEP, lambda t: t.update(best_val_loss=0.0))  # (so step 4 does not beat step 2)
    assert main(argv) == 0
    capsys.readouterr()
    assert json.loads((out / CHECKPOINTS / "best.json").read_text())["dir"] == "step-000002"
    (out / RUN / "summary.json").unlink()
    resave(out / STEP, torch.float16)
    line = refused_alike(capsys, argv, out)
    assert line.startswith(f"{out / STEP / 'model.safetensors'}: blocks.0.attn.out.weight and 7 more are F16"), line


# ----------------------------------------------------------------------------- U4: a compare.md the user added to


def test_u4_a_compare_md_changed_since_attnlab_wrote_it_is_refused_by_a_rerun_and_its_dry_run(finished, tmp_path,
                                                                                             capsys):  # fmt: skip
    """Was: the finished manifest rerun (its run skipped) rewrote compare.md, the user's line gone; the dry run said
    only "done already, would be skipped"."""
    argv, out = finished_copy(finished, tmp_path)
    table = out / "m" / "compare.md"
    with table.open("a") as file:
        file.write("# my notes\n")
    before = snapshot(out)
    said = (f"error: {table}: changed since attnlab compare wrote it (it would be replaced, and the change lost): "
            "move it away, or give another --out")  # fmt: skip
    for command in ([*argv, "--dry-run"], argv, ["compare", str(out / "m")]):
        assert fails(capsys, command).endswith(said)
    assert snapshot(out) == before
    table.rename(tmp_path / "notes.md")
    assert main(argv) == 0 and capsys.readouterr()
    assert table.read_text().startswith("| target | seeds | params |") and "# my notes" not in table.read_text()


def test_u4_the_files_written_with_compare_md_are_checked_by_its_record(finished, tmp_path, capsys):
    argv, out = finished_copy(finished, tmp_path)
    with (out / "m" / "compare.csv").open("a") as file:
        file.write("mine,1\n")
    line = fails(capsys, ["compare", str(out / "m")])
    assert line.endswith(f"error: {out / 'm' / 'compare.csv'}: changed since attnlab compare wrote it (it would be "
                         "replaced, and the change lost): move it away, or give another --out")  # fmt: skip
    (out / "m" / "compare.csv").unlink()
    assert main(["compare", str(out / "m")]) == 0 and capsys.readouterr()


def test_u4_a_compare_md_from_before_the_record_is_still_redrawn(finished, tmp_path, capsys):
    """One written by an older attnlab (no record line) cannot be told changed: it is replaced, as before."""
    argv, out = finished_copy(finished, tmp_path)
    table = out / "m" / "compare.md"
    table.write_text(table.read_text().split("<!-- attnlab compare")[0])
    assert main(argv) == 0 and capsys.readouterr()
    assert "<!-- attnlab compare sha256: compare.md " in table.read_text()


# ----------------------------------------------------------------------------- U5: a journal beside a memory index

from test_bad_inputs_probe_w_unclear import bounded_run  # noqa: E402,F401 (a module fixture: a bounded-memory run)

HOT_JOURNAL = """
import os, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
db.execute("PRAGMA cache_size = 1")  # pages spill to the index (its journal holding their old content) at once
db.execute("BEGIN")
db.execute("DELETE FROM states")
db.execute("CREATE TABLE filler (x)")
db.executemany("INSERT INTO filler VALUES (?)", [("x" * 500,)] * 200)
os._exit(0)  # killed mid-write: the transaction never committed, its journal left behind
"""


@pytest.fixture
def store(bounded_run, tmp_path, capsys) -> Path:  # noqa: F811
    """A store holding one memory, 'notes'."""
    (tmp_path / "doc.txt").write_text("the cat sat on the mat " * 20)
    argv = ["memory", "ingest", str(bounded_run), str(tmp_path / "doc.txt"), "--name", "notes", "--store"]
    assert main([*argv, str(tmp_path / "store"), "--no-progress"]) == 0
    capsys.readouterr()
    return tmp_path / "store"


def test_u5_a_file_at_the_journals_name_that_sqlite_did_not_write_is_named(store, bounded_run, tmp_path, capsys):  # noqa: F811
    """Was: "read-only (attempt to write a readonly database): make <store> and its index writable", the store being
    writable (and ingest took the index for emptied). The file is left as it is (SQLite, opening the index for
    writing, would delete it)."""
    journal = store / "index.sqlite-journal"
    shutil.copy(store / "index.sqlite", journal)
    before = journal.read_bytes()
    ingest = ["memory", "ingest", str(bounded_run), str(tmp_path / "doc.txt"), "--name", "more", "--no-progress"]
    for argv in (["memory", "ls", "--store", str(store)], ["memory", "rm", "notes", "--store", str(store)],
                 [*ingest, "--store", str(store)]):  # fmt: skip
        assert fails(capsys, argv).endswith(
            f"error: {journal}: not a journal SQLite wrote (it lacks a journal's header), at the name where SQLite "
            "keeps the rollback journal of index.sqlite, which cannot be read while it is there: move it away and "
            "run again"
        )
    assert journal.read_bytes() == before
    journal.rename(tmp_path / "moved")
    assert main(["memory", "ls", "--store", str(store)]) == 0 and "notes" in capsys.readouterr().out


def test_u5_sqlites_own_journal_of_an_interrupted_write_is_rolled_back_by_a_read(store, capsys):
    """A write killed mid-transaction leaves a hot journal, which a read-only open cannot roll back (it said
    "read-only"): `memory ls` rolls it back, as any writer would, and lists the store as it was."""
    subprocess.run([sys.executable, "-c", HOT_JOURNAL, str(store / "index.sqlite")], check=True, timeout=60)
    assert (store / "index.sqlite-journal").read_bytes()[:8] == bytes.fromhex("d9d505f920a163d7")
    assert main(["memory", "ls", "--store", str(store)]) == 0
    assert "notes" in capsys.readouterr().out
    assert not (store / "index.sqlite-journal").exists()
