"""Probe U's findings on resumed runs, fixed after it (probe V): `run --dry-run` said "would resume" where the run
refused a checkpoint's trainer state (a sampler of another seed, a value of the wrong type), its weights or optimizer
state not as written, or a damaged metrics log (v1: the dry run now makes the run's checks, by the same function);
a trainer.json whose data record is damaged skipped the changed-data guard, in the run and its dry run (v2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import (
    dry_run,
    edit_trainer,
    error_line,
    fails,
    hat_text,
    probe_manifest,
    run_limited,
    snapshot,
    stop_after_first_checkpoint,
    tiny_model,
    unsealed,
)

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = "{seq_len: 16, batch_size: 2, steps: 4, warmup_steps: 1, eval_every: 2, eval_tokens: 32, checkpoint_every: 2}"
RUN = Path("m") / "base" / "seed0"
STEP = RUN / "checkpoints" / "step-000002"


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, own_cache) -> tuple[Path, Path]:
    """(manifest, --out) of a run stopped right after its step-2 checkpoint (of 4), made once: tests copy --out."""
    root = tmp_path_factory.mktemp("stopped")
    manifest, out = probe_manifest(root, hat_text(root), TRAIN), root / "out"
    with pytest.MonkeyPatch.context() as patch:
        stop_after_first_checkpoint(patch, ["run", str(manifest), "--out", str(out), "--no-progress"])
    return manifest, out


def interrupted(stopped, tmp_path: Path) -> tuple[list[str], Path]:
    """(the argv resuming it, --out) of a copy of the stopped run."""
    manifest, out = stopped
    shutil.copytree(out, tmp_path / "out", symlinks=True)
    return ["run", str(manifest), "--out", str(tmp_path / "out"), "--no-progress"], tmp_path / "out"


def refused_alike(capsys, argv: list[str], out: Path) -> str:
    """The run is refused (nothing under --out changed) and its dry run says it would be, with the run's own line:
    that line (after `attnlab run: error: `)."""
    before = snapshot(out)
    printed = dry_run(capsys, [*argv, "--dry-run"])
    line = fails(capsys, argv).split("error: ", 1)[1]
    assert printed == f"[1/1] base seed0: would be refused: {line}\n", (printed, line)
    assert snapshot(out) == before
    return line


# ----------------------------------------------------------------------------- v1: the resume's checks, dry too

TRAINER_EDITS = {
    "sampler seed": (lambda t: t["sampler"].update(seed=5), "sampler state does not match this sampler: seed=5 "
                     "(this sampler: 0)"),
    "sampler seq_len": (lambda t: t["sampler"].update(seq_len=8), "seq_len=8 (this sampler: 16)"),
    "sampler split size": (lambda t: t["sampler"].update(n_tokens=7), "the training data changed: its split has "),
    "tokens < 0": (lambda t: t.update(tokens=-1), "tokens=-1 must be >= 0 (the file was changed)"),
    "best_val_loss text": (lambda t: t.update(best_val_loss="low"), "best_val_loss='low' must be"),
    "window_steps text": (lambda t: t.update(window_steps="2"), "window_steps='2' must be"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(TRAINER_EDITS))
def test_v1_a_dry_run_refuses_the_trainer_state_the_run_refuses_with_its_line(stopped, tmp_path, capsys, case):
    """Was: the dry run said "would resume from step 2", the run refused (N2)."""
    argv, out = interrupted(stopped, tmp_path)
    edit, said = TRAINER_EDITS[case]
    edit_trainer(out / STEP, edit)
    line = refused_alike(capsys, argv, out)
    assert line.startswith(f"{out / STEP / 'trainer.json'}: ") and said in line, line
    assert "delete the run's checkpoints to train again from the start" in line


def truncate(path: Path) -> str:
    path.write_bytes(path.read_bytes()[:-10])
    return "bytes were written (the file was truncated, damaged or changed)"


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt"])
def test_v1_a_dry_run_refuses_weights_or_optimizer_state_not_as_written(stopped, tmp_path, capsys, name):
    argv, out = interrupted(stopped, tmp_path)
    said = truncate(out / STEP / name)
    line = refused_alike(capsys, argv, out)
    assert line.startswith(f"{out / STEP / name}: ") and said in line, line


def test_v1_a_dry_run_refuses_a_damaged_metrics_log_as_the_run_does(stopped, tmp_path, capsys):
    argv, out = interrupted(stopped, tmp_path)
    log = out / RUN / "metrics.jsonl"
    log.write_bytes(log.read_bytes() + b'{"step": 3, "loss": \xff}\n')
    line = refused_alike(capsys, argv, out)
    assert line.startswith(f"{log}: line ") and "is not UTF-8 text (the metrics log was damaged)" in line, line


def test_v1_an_intact_interrupted_run_still_would_resume_and_resumes(stopped, tmp_path, capsys):
    argv, out = interrupted(stopped, tmp_path)
    assert dry_run(capsys, [*argv, "--dry-run"]) == f"[1/1] base seed0: would resume from step 2 of 4 in {out / RUN}\n"
    assert main(argv) == 0
    assert json.loads((out / RUN / "summary.json").read_text())["steps"] == 4


# ----------------------------------------------------------------------------- v2: a damaged data record

DATA_RECORDS = {
    "text": "garbage",
    "a list": [1, 2],
    "no splits": {"source_files": {}},
    "splits of numbers": {"splits": {"train": 1, "val": 2}, "source_files": {}},
    "source_files text": {"splits": {"train": "ab", "val": "cd"}, "source_files": "none"},
}


@pytest.mark.parametrize("case", sorted(DATA_RECORDS))
def test_v2_a_damaged_data_record_is_refused_by_the_run_and_its_dry_run(stopped, tmp_path, capsys, case):
    """Was: both took it for a checkpoint from before the record and resumed without the changed-data check (N3)."""
    argv, out = interrupted(stopped, tmp_path)
    edit_trainer(out / STEP, lambda t: t.update(data=DATA_RECORDS[case]))
    line = refused_alike(capsys, argv, out)
    assert line.startswith(f"{out / STEP / 'trainer.json'}: its data record is damaged ("), line
    assert ("whether the data changed since cannot be told; restore the file from a copy, or delete the run's "
            "checkpoints to train again from the start") in line  # fmt: skip


def test_v2_a_damaged_data_record_at_the_last_step_is_refused_too(stopped, tmp_path, capsys):
    """The probe's `c1.trainer_json_extra_rng_garbage_sumfixed`: a run whose last checkpoint is its last step (the
    summary not written yet) is resumed to write it; its data record is checked as any other's."""
    manifest, _ = stopped
    argv = ["run", str(manifest), "--out", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == 0
    out, last = tmp_path / "out", tmp_path / "out" / RUN / "checkpoints" / "step-000004"
    (out / RUN / "summary.json").unlink()
    edit_trainer(last, lambda t: t.update(data="garbage", torch_rng="garbage"))
    capsys.readouterr()
    line = refused_alike(capsys, argv, out)
    assert line.startswith(f"{last / 'trainer.json'}: its data record is damaged ('garbage', "), line


def test_v2_a_finished_runs_damaged_data_record_is_refused_not_skipped(stopped, tmp_path, capsys):
    """A finished run is skipped only when its data is the data it was trained on: with the record damaged, that
    cannot be told (deleting its checkpoints would not do: the run's folder is what to delete)."""
    manifest, _ = stopped
    argv = ["run", str(manifest), "--out", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == 0
    out, last = tmp_path / "out", tmp_path / "out" / RUN / "checkpoints" / "step-000004"
    edit_trainer(last, lambda t: t.update(data={"splits": "x"}))
    capsys.readouterr()
    line = refused_alike(capsys, argv, out)
    assert line.startswith(f"{last / 'trainer.json'}: its data record is damaged (")
    assert line.endswith("restore the file from a copy, or delete the run's folder to train it again"), line


def test_v2_a_damaged_tokenizer_record_is_refused(stopped, tmp_path, capsys):
    argv, out = interrupted(stopped, tmp_path)
    edit_trainer(out / STEP, lambda t: t.update(tokenizer={"files": ["vocab.json"]}))
    line = refused_alike(capsys, argv, out)
    assert line.startswith(f"{out / STEP / 'trainer.json'}: its tokenizer record is damaged ("), line


def test_v2_keys_trainer_json_does_not_know_are_left_alone(stopped, tmp_path, capsys):
    """Extra keys (the probe's 'rng' garbage) are not read by the resume: it goes on, as an unknown key of a run's
    summary is left alone."""
    argv, out = interrupted(stopped, tmp_path)
    edit_trainer(out / STEP, lambda t: t.update(torch_rng="garbage", data={**t["data"], "note": "mine"}))
    assert "would resume from step 2" in dry_run(capsys, [*argv, "--dry-run"])
    assert main(argv) == 0


# ----------------------------------------------------------------------------- v3: compare's contradicting summary


@pytest.fixture
def finished_copy(tiny_run, tmp_path) -> Path:
    """A copy of the module's tiny finished run: its runs/ folder (runs/tiny/seed0)."""
    shutil.copytree(tiny_run.parent.parent, tmp_path / "runs")
    return tmp_path / "runs"


SUMMARY_EDITS = {
    "NaN loss beside a finite ppl": ({"val_loss": float("nan")}, "field 'val_loss' is nan, which a run never "
                                     "writes (training stops when its loss is not finite)"),
    "a ppl not exp(loss)": ({"val_ppl": 2.0}, "field 'val_ppl' is 2.0, which is impossible (it is exp(val_loss) = "),
    "a loss below 0": ({"val_loss": -1.0, "val_ppl": 0.36787944117144233}, "field 'val_loss' is -1.0, which is "
                       "impossible (it is >= 0)"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(SUMMARY_EDITS))
def test_v3_compare_refuses_a_summary_whose_figures_contradict_each_other(finished_copy, tmp_path, capsys, case):
    """Was: the table showed loss nan beside ppl 58.37 (N6); `attnlab report` refuses such records by the same
    check (eval.records.exponential_problem, range_problem)."""
    summary = finished_copy / "tiny" / "seed0" / "summary.json"
    edit, *said = SUMMARY_EDITS[case]
    summary.write_text(json.dumps(unsealed({**json.loads(summary.read_text()), **edit})))  # an older attnlab's
    line = fails(capsys, ["compare", str(finished_copy), "--out", str(tmp_path / "cmp")], f"{summary}: ", *said)
    assert line.endswith(
        "it was changed by hand; delete summary.json alone and `attnlab run` the manifest again: it "
        "writes the summary again from the run's last checkpoint"
    ), line
    assert not (tmp_path / "cmp").exists()


# ----------------------------------------------------------------------------- v4: export --hf inside a run


@pytest.mark.parametrize("inside", ["", "hf", "checkpoints/step-000009", "tokenizer/mine"])
def test_v4_export_into_a_run_folder_is_refused_as_convert_is(tiny_run, capsys, inside):
    """Was: taken, the export's config.json and weights written among the run's own files (convert --out there was
    refused: the same check, run_checks.run_folder_problem)."""
    out = tiny_run / inside if inside else tiny_run
    before = snapshot(tiny_run)
    where = f"--hf {out} is a run's folder" if not inside else f"--hf {out} is inside {tiny_run}, which is a run's"
    fails(capsys, ["export", str(tiny_run), "--hf", str(out)], where, "an export saved there would be mixed with the "
          "run's own files", "give a folder outside any run, e.g. --hf hf/NAME")  # fmt: skip
    assert snapshot(tiny_run) == before


def test_v4_export_outside_a_run_is_taken(tiny_run, tmp_path, capsys):
    out = tmp_path / "hf-export"
    assert main(["export", str(tiny_run), "--hf", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


# ----------------------------------------------------------------------------- v5: a checkpoint write cut short


def test_v5_a_checkpoint_write_past_a_file_size_limit_says_so_without_torch_internals(stopped, tmp_path, capsys,
                                                                                       file_size_limit):  # fmt: skip
    """Was "optimizer.pt: the write stopped short: unexpected pos 102272 vs 102164 (is the disk full, ...)": torch's
    writer loses the OSError; the file at this process's limit tells what happened."""
    argv, out = interrupted(stopped, tmp_path)
    weights, optimizer = ((out / STEP / name).stat().st_size for name in ("model.safetensors", "optimizer.pt"))
    assert optimizer > weights + 4096
    assert run_limited(file_size_limit, (weights + optimizer) // 2, argv) == 2
    line = error_line(capsys, "run", f"could not write checkpoint {out / RUN / 'checkpoints' / 'step-000004'}: "
                      "optimizer.pt: File too large: a file size limit was hit (`ulimit -f`, or the file system's "
                      "largest file); the previous checkpoint (step 2) is intact")  # fmt: skip
    assert "pos" not in line and "enforce" not in line
    assert sorted(p.name for p in (out / RUN / "checkpoints").iterdir()) == ["best.json", "last.json", "step-000002"]


def test_v5_a_short_torch_write_on_a_full_disk_says_the_disk_is_full(tmp_path, monkeypatch):
    import torch

    from attnlab.data import files
    from attnlab.train import checkpoint as ckpt

    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt.save_checkpoint(tmp_path, model, optimizer, {"step": 1}, {}, tags=("last",))

    def short_write(state, path):  # what torch.save does on a full disk: a part written, then its RuntimeError
        Path(path).write_bytes(b"PK" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", short_write)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0))
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.save_checkpoint(tmp_path, model, optimizer, {"step": 2}, {}, tags=("last",))
    assert str(raised.value) == (
        f"could not write checkpoint {tmp_path / 'checkpoints' / 'step-000002'}: "
        "optimizer.pt: No space left on device; the previous checkpoint (step 1) is intact"
    )
