"""Probe G's findings on runs, resumes and manifests: a resume on edited data, a refused resume that overwrote the
run's files, two runs in one folder at once, dry runs that ignored the run folder, phases and init_from targets
whose weights cannot be carried over, variables that refer to each other, absurd batches and optimizer floats,
a double Ctrl-C, and a parquet file whose text column holds numbers. Each ends in one line naming the file, key
or value and the fix, before anything is written."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import dry_run, edit_one_word, fails, snapshot

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "{d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 32, attention: {kind: mha}}"
TRAIN = "{seq_len: 16, batch_size: 2, steps: 4, warmup_steps: 1, eval_every: 4, eval_tokens: 64, checkpoint_every: 2}"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # prepared data of these tests only


def corpus(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("\n\n".join(f"the cat sat on the mat by the red door number {i}" for i in range(80)))
    return path


def write_manifest(tmp_path, targets="  base: {}\n", name="m", source=None) -> Path:
    manifest = tmp_path / f"{name}.yml"
    manifest.write_text(
        f"name: {name}\nseeds: [0]\ndefaults:\n  model: {MODEL}\n"
        f"  data: {{source: {source or corpus(tmp_path)}, tokenizer: char, val_fraction: 0.2}}\n"
        f"  train: {TRAIN}\ntargets:\n{targets}"
    )
    return manifest


def interrupted_run(tmp_path, monkeypatch, capsys) -> tuple[Path, Path, Path]:
    """A run stopped by Ctrl-C right after its step-2 checkpoint: (manifest, --out, run folder)."""
    import attnlab.train.loop as loop

    manifest, out = write_manifest(tmp_path), tmp_path / "runs"
    save = loop.save_checkpoint

    def save_then_stop(*args, **kwargs):
        save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "save_checkpoint", save_then_stop)
    assert main(["run", str(manifest), "--out", str(out), "--no-progress"]) == 130
    monkeypatch.setattr(loop, "save_checkpoint", save)
    capsys.readouterr()
    run_dir = out / "m" / "base" / "seed0"
    assert (run_dir / "checkpoints" / "step-000002").is_dir() and not (run_dir / "summary.json").exists()
    return manifest, out, run_dir


# ----------------------------------------------------------------------------- T-datachg4, T-datachg2


def test_a_resume_on_edited_data_is_refused_naming_the_data(tmp_path, monkeypatch, capsys):
    manifest, out, run_dir = interrupted_run(tmp_path, monkeypatch, capsys)
    trainer = json.loads((run_dir / "checkpoints" / "step-000002" / "trainer.json").read_text())
    assert set(trainer["data"]["splits"]) == {"train", "val"}  # the prepared tokens' sha256, recorded
    edit_one_word(tmp_path / "text.txt")
    before = snapshot(run_dir)
    command = ["run", str(manifest), "--out", str(out), "--no-progress"]
    line = fails(capsys, command, str(run_dir), "text.txt changed since this run started", "text.txt's sha256 is now")
    assert "restore the data as it was to resume, or train into a new --out" in line
    assert snapshot(run_dir) == before  # nothing written
    printed = _dry_run(command, capsys)
    assert "would be refused: " in printed and "text.txt changed since this run started" in printed


def test_the_same_data_prepared_again_resumes(tmp_path, monkeypatch, capsys):
    """The file touched (its cache key changes, so it is prepared again): the same tokens, so the run resumes."""
    manifest, out, run_dir = interrupted_run(tmp_path, monkeypatch, capsys)
    os.utime(tmp_path / "text.txt", ns=(1, 1))
    assert main(["run", str(manifest), "--out", str(out), "--no-progress"]) == 0
    assert "resuming from step 2" in capsys.readouterr().out
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4


def drop_data_record(checkpoint: Path) -> None:
    """The trainer.json of a checkpoint written before the data record (its checksum updated to match)."""
    trainer_path = checkpoint / "trainer.json"
    trainer = json.loads(trainer_path.read_text())
    del trainer["data"]
    trainer_path.write_text(json.dumps(trainer, indent=1))
    checksums = json.loads((checkpoint / "checksums.json").read_text())
    blob = trainer_path.read_bytes()
    checksums["files"]["trainer.json"] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (checkpoint / "checksums.json").write_text(json.dumps(checksums))


def test_a_checkpoint_from_before_the_data_record_still_resumes(tmp_path, monkeypatch, capsys):
    manifest, out, run_dir = interrupted_run(tmp_path, monkeypatch, capsys)
    drop_data_record(run_dir / "checkpoints" / "step-000002")
    assert main(["run", str(manifest), "--out", str(out), "--no-progress"]) == 0
    assert (run_dir / "summary.json").exists()


def test_an_old_checkpoint_on_data_of_another_size_says_the_data_changed(tmp_path, monkeypatch, capsys):
    manifest, out, run_dir = interrupted_run(tmp_path, monkeypatch, capsys)
    drop_data_record(run_dir / "checkpoints" / "step-000002")
    text = tmp_path / "text.txt"
    text.write_text(text.read_text().replace("red door", "red red door"))  # more tokens, the same characters
    line = fails(capsys, ["run", str(manifest), "--out", str(out), "--no-progress"], "text.txt changed since")
    assert "its training split has" in line and "sampler state" not in line


def test_the_sampler_says_the_training_data_changed():
    import numpy as np

    from attnlab.data import BatchSampler
    from attnlab.errors import InputError

    state = BatchSampler(np.zeros(100, dtype=np.uint16), 8, 2).state_dict()
    with pytest.raises(InputError, match="the training data changed: its split has 90 tokens, 100 when"):
        BatchSampler(np.zeros(90, dtype=np.uint16), 8, 2).load_state_dict(state)


# ----------------------------------------------------------------------------- RS-steps


def test_a_refused_resume_leaves_the_run_folder_as_it_was(tmp_path, monkeypatch, capsys):
    manifest, out, run_dir = interrupted_run(tmp_path, monkeypatch, capsys)
    before = snapshot(run_dir)
    assert b"steps: 4" in before["config.yaml"]
    command = ["run", str(manifest), "--out", str(out), "--no-progress", "--set", "train.steps=6"]
    assert main(command) == 2
    captured = capsys.readouterr()
    assert "another config: train.steps: checkpoint 4, now 6" in captured.err
    assert "training" not in captured.out
    assert snapshot(run_dir) == before  # config.yaml and command.txt too


def test_a_refused_fresh_run_leaves_no_folder(tmp_path, monkeypatch, capsys):
    import attnlab.train.budget as budget

    manifest, out = write_manifest(tmp_path), tmp_path / "runs"
    assert main(["run", str(manifest), "--out", str(out), "--no-progress", "--dry-run"]) == 0
    monkeypatch.setattr(budget, "machine_memory", lambda: 4096)  # refused by train(), after the manifest's look
    import attnlab.manifest

    monkeypatch.setattr(attnlab.manifest, "batch_memory_problem", lambda *a: None)
    command = ["run", str(manifest), "--out", str(out), "--no-progress"]
    assert fails(capsys, command, "needs at least", "this machine's 4,096 bytes")
    assert not (out / "m" / "base").exists()


# ----------------------------------------------------------------------------- CONC-diff


HOLD = """
import sys, time
from attnlab.train.lock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_run_into_a_folder_being_trained_is_refused_and_a_killed_ones_lock_frees(tmp_path, capsys):
    manifest, out = write_manifest(tmp_path), tmp_path / "runs"
    run_dir = out / "m" / "base" / "seed0"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        command = ["run", str(manifest), "--out", str(out), "--no-progress"]
        line = fails(capsys, command, str(run_dir), f"another attnlab run (pid {holder.pid}) is training it")
        assert "another --out" in line
        assert sorted(p.name for p in run_dir.iterdir()) == ["run.lock"]  # nothing of this run written
        said = dry_run(capsys, command[:-1] + ["--dry-run"])
        assert f"would be refused: {run_dir}: another attnlab run (pid {holder.pid})" in said
    finally:
        holder.kill()
        holder.wait()
    assert main(command) == 0  # the killed process's lock is gone with it
    assert (run_dir / "summary.json").exists()


def test_the_lock_is_released_when_a_run_ends(tmp_path):
    from attnlab.train.lock import busy_problem, run_lock

    with run_lock(tmp_path / "r"):
        assert "another attnlab run (pid" in busy_problem(tmp_path / "r")
    assert busy_problem(tmp_path / "r") is None
    with run_lock(tmp_path / "r"):
        pass


# ----------------------------------------------------------------------------- DRY-conflict, DRY-done, DRY-resume


def _dry_run(command, capsys) -> str:
    return dry_run(capsys, [*command, "--dry-run"])


def test_a_dry_run_says_what_the_real_run_would_do_with_the_folder(tmp_path, monkeypatch, capsys):
    manifest, out, run_dir = interrupted_run(tmp_path, monkeypatch, capsys)
    command = ["run", str(manifest), "--out", str(out), "--no-progress"]
    assert f"would resume from step 2 of 4 in {run_dir}" in _dry_run(command, capsys)
    printed = _dry_run([*command, "--set", "train.lr=0.005"], capsys)
    assert "would be refused: checkpoint" in printed and "train.lr: checkpoint 0.001, now 0.005" in printed
    assert main(command) == 0
    capsys.readouterr()
    assert "done already (val loss " in _dry_run(command, capsys) and "would be skipped" in _dry_run(command, capsys)
    printed = _dry_run([*command, "--set", "train.lr=0.005"], capsys)
    assert "would be refused: " in printed and "finished run made with another config (train.lr" in printed
    assert "would train 4 steps" in _dry_run([*command[:3], str(tmp_path / "other")], capsys)


# ----------------------------------------------------------------------------- MF-*: weights that cannot be carried


PHASES = "  a:\n    phases:\n      - {{name: p1}}\n      - {{name: p2, {change}}}\n"
INIT = "  a: {{}}\n  b: {{init_from: a, {change}}}\n"


@pytest.mark.parametrize(
    "layout, change, fragments",
    [
        (INIT, "model: {n_layers: 2}", ["targets.b:", "n_layers 2, target a's 1"]),
        (INIT, "model: {d_model: 64}", ["targets.b:", "d_model 64, target a's 32"]),
        (INIT, "data: {tokenizer: byte}", ["targets.b:", "data.tokenizer=byte is not target a's char"]),
        (PHASES, "model: {d_model: 64}", ["targets.a.phases[1]:", "d_model 64, phase p1's 32"]),
        (PHASES, "model: {attention: {kind: decoupled, d_sem: 8, d_geo: 16}}",
         ["targets.a.phases[1]:", "attention.kind 'decoupled', phase p1's 'mha'"]),
        (PHASES, "data: {tokenizer: byte}", ["targets.a.phases[1]:", "data.tokenizer=byte is not phase p1's char"]),
        (PHASES, "data: {source: tinyshakespeare}", ["data.source=tinyshakespeare is not phase p1's", "fitted"]),
        (INIT, "model: {vocab_size: 40}", ["targets.b: its model.vocab_size=40 is given", "a's is the tokenizer's"]),
    ],
)  # fmt: skip
def test_weights_that_cannot_start_a_phase_or_target_are_refused_up_front(tmp_path, capsys, layout, change, fragments):
    manifest = write_manifest(tmp_path, layout.format(change=change))
    assert main(["validate", str(manifest)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and all(f in lines[0] for f in fragments), lines
    out = tmp_path / "runs"
    assert fails(capsys, ["run", str(manifest), "--out", str(out), "--dry-run"], *fragments)
    assert fails(capsys, ["run", str(manifest), "--out", str(out), "--no-progress"], *fragments)
    assert not out.exists()  # refused before the first target trained


@pytest.mark.parametrize(
    "layout, change",
    [(INIT, "model: {memory: {kind: bounded, recent_window: 8, exact_slots: 2, summary_slots: 2}}"),
     (PHASES, "train: {lr: 0.002}"), (INIT, "data: {val_fraction: 0.2}")],
)  # fmt: skip
def test_phases_and_targets_that_fit_their_weights_pass(tmp_path, capsys, layout, change):
    assert main(["validate", str(write_manifest(tmp_path, layout.format(change=change)))]) == 0


# ----------------------------------------------------------------------------- MF-varloop


@pytest.mark.parametrize(
    "variables, fragment",
    [("{a: '${b}', b: '${a}'}", "vars: ${a} -> ${b} -> ${a}: these variables refer to each other, a cycle"),
     ("{a: '${a}'}", "vars.a: its value uses ${a}, itself"),
     ("{a: '${nope}'}", "vars.a: undefined variable ${nope}")],
)  # fmt: skip
def test_variables_that_refer_to_each_other_are_named(tmp_path, capsys, variables, fragment):
    manifest = write_manifest(tmp_path, "  base: {train: {lr: '${a}'}}\n")
    manifest.write_text(manifest.read_text() + f"vars: {variables}\n")
    assert main(["validate", str(manifest)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "must be float" not in lines[0], lines


def test_a_variable_may_use_another(tmp_path):
    from attnlab.manifest import load_manifest

    manifest = write_manifest(tmp_path, "  base: {train: {lr: '${a}'}, model: {name: 'x-${b}'}}\n")
    manifest.write_text(manifest.read_text() + "vars: {a: '${b}', b: 0.002}\n")
    run = load_manifest(manifest).runs[0]
    assert run.train.lr == 0.002 and run.model["name"] == "x-0.002"


# ----------------------------------------------------------------------------- TR3, TR9


def test_a_batch_far_beyond_the_machines_memory_is_refused_up_front(tmp_path, capsys):
    manifest = write_manifest(tmp_path)
    sets = ["--set", "train.batch_size=1000000000"]
    assert main(["validate", str(manifest), *sets]) == 2
    err = capsys.readouterr().err
    assert "train.batch_size=1000000000 x train.seq_len=16" in err and "more than this machine's" in err
    assert "lower train.batch_size or train.seq_len" in err
    fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "runs"), "--dry-run", *sets], "needs at least")
    assert main(["validate", str(manifest), "--set", "train.batch_size=64"]) == 0  # a real batch passes


@pytest.mark.parametrize(
    "d_model, n_layers, vocab_size, seq_len", [(64, 2, 97, 64), (32, 1, 67, 16), (128, 4, 1000, 64)]
)
def test_the_floor_stays_below_what_a_step_really_holds(d_model, n_layers, vocab_size, seq_len):
    """The estimate must never refuse a batch that fits: it stays below the bytes a training step keeps for its
    backward pass alone (its activations; the peak holds gradients and temporaries besides)."""
    import torch
    import torch.nn.functional as F
    from helpers import tiny_model

    from attnlab.train.budget import step_memory_floor

    model = tiny_model(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, max_seq_len=seq_len).train()
    kept: dict[int, int] = {}

    def keep(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, vocab_size, (16, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logits, _ = model(ids)
        F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    weights = sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert 0 < step_memory_floor(d_model, n_layers, 16, seq_len, vocab_size) < sum(kept.values()) - weights


@pytest.mark.parametrize(
    "value, fragment",
    [("train.eps=1e-300", "train.eps=1e-300 is 0 in float32"), ("train.eps=2", "train.eps=2.0 must be below 1"),
     ("train.weight_decay=5000", "train.lr=0.001 x train.weight_decay=5000.0 must be below 1")],
)  # fmt: skip
def test_optimizer_floats_out_of_range_are_refused(tmp_path, capsys, value, fragment):
    assert fails(capsys, ["run", str(write_manifest(tmp_path)), "--dry-run", "--set", value], fragment)


# ----------------------------------------------------------------------------- SIG-dbl1ms


def test_a_second_ctrl_c_while_the_first_is_handled_is_ignored():
    from attnlab.train.signals import first_interrupt_only

    # As in a terminal: a job started in the background (CI under nohup, `cmd &`) inherits SIGINT ignored.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), first_interrupt_only():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            except KeyboardInterrupt:
                os.kill(os.getpid(), signal.SIGINT)  # the impatient second one, while the first is handled
                time.sleep(0.2)
                raise
        os.kill(os.getpid(), signal.SIGINT)  # and while the process exits
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with first_interrupt_only():
            pass
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # not interrupted: as it was
    finally:
        signal.signal(signal.SIGINT, inherited)


DOUBLE = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job inherits it ignored)
import attnlab.train.loop as loop
from attnlab.cli import main
save = loop.save_checkpoint
def save_then_two_ctrl_c(*args, **kwargs):
    save(*args, **kwargs)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    finally:
        os.kill(os.getpid(), signal.SIGINT)  # the impatient second one, while the first unwinds
        time.sleep(0.2)
loop.save_checkpoint = save_then_two_ctrl_c
import atexit
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))  # a Ctrl-C during the exit hooks
sys.exit(main(["run", sys.argv[1], "--out", sys.argv[2], "--no-progress"]))
"""


def test_a_double_ctrl_c_during_a_run_prints_one_line(tmp_path):
    manifest = write_manifest(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", DOUBLE, str(manifest), str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 130, result.stderr
    assert result.stderr.strip().splitlines() == [
        "attnlab run: interrupted; run the same command again to resume from the last checkpoint"
    ]


# ----------------------------------------------------------------------------- DS-inttext.parquet


def test_a_parquet_text_column_of_numbers_is_named(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": pa.array(range(50), type=pa.int64())}), path)
    manifest = write_manifest(tmp_path, source=path)
    assert fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "runs"), "--no-progress"],
                 "numbers.parquet: column 'text' holds int64, not strings")  # fmt: skip


# ----------------------------------------------------------------------------- G1, CV-tiny (the tokenizer's part)


def test_a_vocabulary_tokenizer_names_what_it_would_read_as_unk():
    from attnlab.data.tokenizers import ByteTokenizer, train_tokenizer

    char = train_tokenizer("char", ["to be or not"])
    assert char.unknown("To be 😀 é, to be") == ["T", "😀", "é", ","]
    assert char.unknown("to be") == []
    word = train_tokenizer("word", ["to be or not\n"])
    assert word.unknown("to be <unk> or xyz\n") == ["xyz"]  # (WikiText's own <unk> is a word of the vocabulary)
    assert ByteTokenizer().unknown("😀") == []
