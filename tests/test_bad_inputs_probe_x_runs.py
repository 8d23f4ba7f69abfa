"""Probe X's findings on run folders (/work/probe_x/REPORT.md): a full disk during a metrics append left a row cut
short in metrics.jsonl, and every resume then refused the log until it was edited by hand (L1); another run's
summary.json beside an interrupted run made it "done" (S1); the dry run did not check a resume checkpoint's tensor
names and shapes or its optimizer state, which the run refuses (S2)."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import dry_run, hat_text, probe_manifest, unsealed

from attnlab.cli import main
from attnlab.data.files import sealed

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

# the stopped run and its copies are probe V's resume tests' (a run stopped after its step-2 checkpoint of 4)
import test_bad_inputs_probe_v_runs as v_runs  # noqa: E402

RUN, STEP, TRAIN, interrupted, refused_alike, stopped = (v_runs.RUN, v_runs.STEP, v_runs.TRAIN, v_runs.interrupted,
                                                         v_runs.refused_alike, v_runs.stopped)  # fmt: skip


def run_with_warnings(capsys, argv: list[str]) -> tuple[int, str, list[str]]:
    """main(argv): (its exit code, stdout, its stderr lines)."""
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    return code, captured.out, captured.err.strip().splitlines()


def rows(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


# ----------------------------------------------------------------------------- L1: a metrics row cut short


def test_l1_a_failed_metrics_append_leaves_the_log_as_it_was(tmp_path, file_size_limit):
    """Was: the part of the row written before the file size limit (or a full disk) stayed in the file."""
    from attnlab.train.logging import MetricsLog

    log = MetricsLog(tmp_path)
    log.write({"step": 1, "loss": 3.5})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    file_size_limit(len(before) + 20)  # room for a part of the next row
    try:
        with pytest.raises(OSError) as raised:
            log.write({"step": 2, "loss": 3.25, "note": "x" * 100})
    finally:
        file_size_limit(None)
    assert raised.value.errno == errno.EFBIG and raised.value.filename == str(tmp_path / "metrics.jsonl")
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    log.write({"step": 2, "loss": 3.25})  # (space freed) the log goes on whole
    log.close(None)
    assert [row["step"] for row in rows(tmp_path / "metrics.jsonl")] == [1, 2]


def test_l1_a_failed_metrics_append_on_a_full_disk_is_cut_back(tmp_path):
    """A write that stops part-way, then fails with ENOSPC: the part written is taken back."""
    from attnlab.train.logging import MetricsLog

    class FillsUp:  # the log's file on a disk with room for 10 more bytes
        def __init__(self, file):
            self.file, self.room = file, 10

        def write(self, data):
            if not self.room:
                raise OSError(errno.ENOSPC, "No space left on device")
            written, self.room = self.file.write(data[: self.room]), 0
            return written

        def __getattr__(self, name):
            return getattr(self.file, name)

    log = MetricsLog(tmp_path)
    log.write({"step": 1, "loss": 3.5})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    log.file = FillsUp(log.file)
    with pytest.raises(OSError, match="No space left"):
        log.write({"step": 2, "loss": 3.25})
    log.close(None)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_l1_a_torn_last_line_is_dropped_by_the_resume_and_its_dry_run_with_a_warning(stopped, tmp_path, capsys):
    """Was: "line N is not JSON (the metrics log was damaged)", from the dry run and the run alike."""
    argv, out = interrupted(stopped, tmp_path)
    log = out / RUN / "metrics.jsonl"
    log.write_bytes(log.read_bytes() + b'{"step": 3, "tokens": 96, "loss": 2.')
    warning = f"attnlab run: warning: {log}: its last line was cut short ("
    code, printed, err = run_with_warnings(capsys, [*argv, "--dry-run"])
    assert (code, printed) == (0, f"[1/1] base seed0: would resume from step 2 of 4 in {out / RUN}\n")
    assert len(err) == 1 and err[0].startswith(warning) and err[0].endswith("; dropped, as rows after the checkpoint "
                                                                             "are logged again"), err  # fmt: skip
    code, _, err = run_with_warnings(capsys, argv)
    assert code == 0 and len(err) == 1 and err[0].startswith(warning), err
    steps = [row["step"] for row in rows(log)]
    assert steps == sorted(steps) and steps[-1] == 4 and b'"loss": 2.\n' not in log.read_bytes()


@pytest.mark.parametrize("tail", [b'{"step": 3, "loss": 2.\n', b'{"step": 3, "loss": 2.\n{"step": 3, "loss": 2.5}\n'])
def test_l1_a_bad_line_that_is_not_the_cut_last_line_is_still_refused(stopped, tmp_path, capsys, tail):
    argv, out = interrupted(stopped, tmp_path)
    log = out / RUN / "metrics.jsonl"
    log.write_bytes(log.read_bytes() + tail)
    line = refused_alike(capsys, argv, out)
    assert line.startswith(f"{log}: line ") and "is not JSON (the metrics log was damaged)" in line, line


# ----------------------------------------------------------------------------- S1: another run's summary.json


@pytest.fixture(scope="module")
def other_summary(tmp_path_factory, own_cache) -> Path:
    """The summary.json of another config's finished run (d_model 16, 3 steps), trained once."""
    root = tmp_path_factory.mktemp("other")
    train = TRAIN.replace("steps: 4", "steps: 3")
    manifest = probe_manifest(root, hat_text(root), train, model="{d_model: 16, n_layers: 1, n_heads: 2, "
                              "max_seq_len: 64}")  # fmt: skip
    assert main(["run", str(manifest), "--out", str(root / "out"), "--no-progress"]) == 0
    return root / "out" / RUN / "summary.json"


def test_s1_another_runs_summary_beside_an_interrupted_run_is_refused(stopped, other_summary, tmp_path, capsys):
    """Was: "done already (val loss ...), would be skipped", and compare reported the other run's loss."""
    argv, out = interrupted(stopped, tmp_path)
    summary = out / RUN / "summary.json"
    shutil.copy(other_summary, summary)
    line = refused_alike(capsys, argv, out)
    assert line.startswith(f"{summary}: not this run's summary (config_hash "), line
    assert "; steps 3, the config's train.steps 4; its last checkpoint is at step 2)" in line, line
    assert line.endswith("the run was interrupted at step 2 of 4 (its last checkpoint): delete summary.json alone and "
                         "run again to resume it from there"), line  # fmt: skip
    summary.unlink()
    assert main(argv) == 0 and json.loads(summary.read_text())["steps"] == 4


SUMMARY_EDITS = {
    "config_hash": (lambda s: s.update(config_hash="0123456789ab"), "config_hash '0123456789ab', the run's config's"),
    "steps": (lambda s: s.update(steps=3), "steps 3, the config's train.steps 4; its last checkpoint is at step 4"),
}


@pytest.mark.parametrize("case", sorted(SUMMARY_EDITS))
def test_s1_a_finished_runs_summary_that_disagrees_with_the_run_is_refused(stopped, tmp_path, capsys, case):
    manifest, _ = stopped
    argv, out = ["run", str(manifest), "--out", str(tmp_path / "out"), "--no-progress"], tmp_path / "out"
    assert main(argv) == 0
    summary = out / RUN / "summary.json"
    edited = json.loads(summary.read_text())
    edit, said = SUMMARY_EDITS[case]
    edit(edited)
    summary.write_text(json.dumps(sealed(edited)))  # (sealed: as another run of the manifest would have written it)
    capsys.readouterr()
    line = refused_alike(capsys, argv, out)
    assert line.startswith(f"{summary}: not this run's summary (") and said in line, line
    assert line.endswith("its last checkpoint is the last step (4 of 4): delete summary.json alone and run again to "
                         "write it again from there"), line  # fmt: skip


@pytest.mark.parametrize("case", ["no config_hash, no steps", "an older attnlab's hash"])
def test_s1_a_genuine_finished_run_is_still_skipped(stopped, tmp_path, capsys, case):
    """A summary without config_hash or steps is not compared on them; an older attnlab's config (a model field it
    did not have yet: None today) hashes otherwise than today's, and its summary holds that hash."""
    manifest, _ = stopped
    argv, out = ["run", str(manifest), "--out", str(tmp_path / "out"), "--no-progress"], tmp_path / "out"
    assert main(argv) == 0
    summary = json.loads((out / RUN / "summary.json").read_text())
    if case == "no config_hash, no steps":
        del summary["config_hash"], summary["steps"]
    else:
        config = json.loads((out / RUN / "config.json").read_text())
        field = next(key for key, value in config["model"].items() if value is None)
        del config["model"][field]
        (out / RUN / "config.json").write_text(json.dumps(config, indent=1))
        summary["config_hash"] = hashlib.sha256(json.dumps(config["model"], sort_keys=True).encode()).hexdigest()[:12]
    (out / RUN / "summary.json").write_text(json.dumps(unsealed(summary)))  # an older attnlab's: no sha256 either
    capsys.readouterr()
    assert dry_run(capsys, [*argv, "--dry-run", "--unsealed"]).startswith("[1/1] base seed0: done already (val loss ")
    assert main([*argv, "--unsealed"]) == 0 and "done already" in capsys.readouterr().out


# ----------------------------------------------------------------------------- S2: the resume's loads, dry too


def fix_checksums(folder: Path) -> None:
    """checksums.json made to agree with the files as they are now (as /work/probe_x/fixsum.py does)."""
    checksums = json.loads((folder / "checksums.json").read_text())
    for name in checksums["files"]:
        data = (folder / name).read_bytes()
        checksums["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "checksums.json").write_text(json.dumps(checksums, indent=1))


def edit_weights(edit):
    def run(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        path = folder / "model.safetensors"
        metadata = __import__("safetensors").safe_open(str(path), framework="pt").metadata()
        tensors = load_file(str(path))
        edit(tensors)
        save_file(tensors, str(path), metadata=metadata)

    return run


def edit_optimizer(edit):
    def run(folder: Path) -> None:
        path = folder / "optimizer.pt"
        state = torch.load(path, weights_only=True)
        torch.save(edit(state), path)

    return run


def _cut_exp_avg(state: dict) -> dict:
    moments = state["optimizer"]["state"]
    name = next(name for name, value in moments.items() if value["exp_avg"].dim() == 2)
    moments[name]["exp_avg"] = moments[name]["exp_avg"][:1]
    return state


CHECKPOINT_EDITS = {
    "an extra tensor": (edit_weights(lambda t: t.update({"extra.weight": torch.zeros(3)})),
                        "weights do not fit this model (missing [], unexpected ['extra.weight'])"),
    "a missing tensor": (edit_weights(lambda t: t.pop("norm.weight")),
                         "weights do not fit this model (missing ['norm.weight'], unexpected [])"),
    "a tensor of another shape": (edit_weights(lambda t: t.update({"norm.weight": torch.ones(5)})),
                                  "weights do not fit this model (norm.weight is [5] in the file, [32] in the model)"),
    "a wrong-shaped exp_avg": (edit_optimizer(_cut_exp_avg), "exp_avg of "),
    "an empty optimizer.pt": (lambda f: (f / "optimizer.pt").write_bytes(b""), "not a readable optimizer state"),
    "an empty dict saved": (edit_optimizer(lambda state: {}), "not a readable optimizer state (KeyError: "),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CHECKPOINT_EDITS))
def test_s2_the_dry_run_refuses_the_weights_and_optimizer_state_the_run_refuses(stopped, tmp_path, capsys, case):
    """Was: "would resume from step 2", then the run refused (each edit needs checksums.json made to agree)."""
    argv, out = interrupted(stopped, tmp_path)
    edit, said = CHECKPOINT_EDITS[case]
    edit(out / STEP)
    fix_checksums(out / STEP)
    line = refused_alike(capsys, argv, out)
    name = "model.safetensors" if "tensor" in case else "optimizer.pt"
    assert line.startswith(f"{out / STEP / name}: ") and said in line, line


def test_s2_the_dry_run_leaves_the_random_state_as_it_was(stopped, tmp_path, capsys):
    argv, _ = interrupted(stopped, tmp_path)
    torch.manual_seed(12345)  # (not the state the stopped run saved, which this process may still be in)
    state = torch.get_rng_state()
    assert "would resume from step 2" in dry_run(capsys, [*argv, "--dry-run"])
    assert torch.equal(torch.get_rng_state(), state)
