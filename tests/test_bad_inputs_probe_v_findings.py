"""Probe V's findings (/work/probe_v/REPORT.md): a run folder whose checkpoints/ is a file was trained from the start
(its metrics log replaced) and refused only at its first checkpoint, the dry run saying "would train" (L1); a stale
best.json was found only after the run had rewritten command.txt, the dry run saying "would resume" (L2); Mistral's
sliding_window: 0 was read as no window (S1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import dry_run, fails, hat_text, probe_manifest, snapshot, stop_after_first_checkpoint

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = "{seq_len: 16, batch_size: 2, steps: 4, warmup_steps: 1, eval_every: 2, eval_tokens: 32, checkpoint_every: 2}"
RUN = Path("m") / "base" / "seed0"


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


# ----------------------------------------------------------------------------- L1, L2: refused before writing


def test_a_checkpoints_file_is_refused_before_the_run_writes(stopped, tmp_path, capsys):
    argv, out = interrupted(stopped, tmp_path)
    shutil.rmtree(out / RUN / "checkpoints")
    (out / RUN / "checkpoints").write_text("x\n")
    line = refused_alike(capsys, argv, out)
    assert line.startswith(f"{out / RUN / 'checkpoints'}: is a file, where the run keeps its checkpoints"), line
    assert "move it away" in line
    fails(capsys, [*argv, "--no-resume"], "is a file, where the run keeps its checkpoints")
    assert (out / RUN / "checkpoints").read_text() == "x\n"


def test_a_stale_best_json_is_refused_before_the_run_writes(stopped, tmp_path, capsys):
    argv, out = interrupted(stopped, tmp_path)
    (out / RUN / "checkpoints" / "best.json").write_text(json.dumps({"dir": "step-000001", "step": 1}))
    line = refused_alike(capsys, argv, out)
    assert "best.json names step-000001, which is missing" in line, line


# ----------------------------------------------------------------------------- S1: sliding_window 0


@pytest.fixture(scope="module")
def hf_folder(tiny_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "model"
    assert main(["export", str(tiny_run), "--hf", str(out)]) == 0
    return out


def edited_copy(hf_folder: Path, tmp_path: Path, **changes) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.mark.parametrize("command", ["info", "generate"])
def test_a_mistral_sliding_window_of_zero_is_refused(command, hf_folder, tmp_path, capsys):
    folder = edited_copy(hf_folder, tmp_path, model_type="mistral", architectures=["MistralForCausalLM"],
                         sliding_window=0)  # fmt: skip
    argv = [command, str(folder)] + (["the", "--max-new-tokens", "2"] if command == "generate" else [])
    fails(capsys, argv, f"{folder / 'config.json'}: sliding_window=0 must be >= 1 or null")
