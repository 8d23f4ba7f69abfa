"""Probe AF's last findings (/work/probe_af/REPORT.md): `run --target X` was refused for a problem of a target it
does not run, and a problem every target had alike was said once per target (AF26); a target's conversion that
lost its checksums.json advised restoring it from a copy, though `attnlab run` makes it again (AF30); a whole
split was scored with no sign of progress (AF28); a model read from a run that wrote its next checkpoint meanwhile
was refused as damaged (AF24). Each test fails with its fix backed out."""

from __future__ import annotations

import io
import json
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import fails

import attnlab
from attnlab.cli import main
from attnlab.manifest_select import merged_repeats

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = "{seq_len: 16, batch_size: 2, steps: 2, warmup_steps: 1, eval_every: 2, eval_tokens: 32, checkpoint_every: 2}"
MODEL = "{d_model: 16, n_layers: 1, n_heads: 2, max_seq_len: 32}"


def manifest(tmp_path, targets: str):
    text = tmp_path / "text.txt"
    text.write_text("".join(f"the cat {i} sat on the mat, and the dog sat by door {i}.\n\n" for i in range(60)))
    path = tmp_path / "m.yml"
    path.write_text(f"name: m\nseeds: [0]\ndefaults:\n  model: {MODEL}\n  data: {{source: {text}, tokenizer: char}}\n"
                    f"  train: {TRAIN}\ntargets:\n{targets}")  # fmt: skip
    return path


TWO = ("  base: {model: {attention: {kind: mha}}}\n"
       "  mem: {model: {attention: {kind: mha}, memory: {kind: bounded, recent_window: 8, exact_slots: 4, "
       "summary_slots: 4}}}\n")  # fmt: skip


# ----------------------------------------------------------------------------- AF26: --target and --set


def test_af26_a_problem_of_a_target_not_run_does_not_refuse_the_targets_run(tmp_path, capsys):
    path = manifest(tmp_path, TWO)
    dry = ["run", str(path), "--out", str(tmp_path / "o"), "--dry-run", "--set", "train.activation_checkpointing=true"]
    assert fails(capsys, dry, "targets.mem: train.activation_checkpointing=true", "turn one off")
    assert main([*dry, "--target", "base"]) == 0
    out = capsys.readouterr().out
    assert "base seed0: would train 2 steps" in out and "mem" not in out, out
    assert fails(capsys, [*dry, "--target", "mem"], "targets.mem: train.activation_checkpointing=true")


def test_af26_a_target_run_is_still_refused_for_the_target_it_starts_from(tmp_path, capsys):
    path = manifest(tmp_path, "  a: {model: {attention: {kind: sliding, window: -3}}}\n  b: {init_from: a}\n"
                              "  c: {model: {attention: {kind: mha}}}\n")  # fmt: skip
    dry = ["run", str(path), "--out", str(tmp_path / "o"), "--dry-run"]
    assert fails(capsys, [*dry, "--target", "b"], "targets.a", "window=-3")
    assert main([*dry, "--target", "c"]) == 0
    assert "c seed0: would train" in capsys.readouterr().out


def test_af26_a_problem_every_target_has_alike_is_said_once_naming_them(tmp_path, capsys):
    path = manifest(tmp_path, TWO)
    dry = ["run", str(path), "--out", str(tmp_path / "o"), "--dry-run", "--set", "train.lr=nan", "--set",
           "model.d_model=-1"]  # fmt: skip
    line = fails(capsys, dry, "targets.base and targets.mem: train.lr=nan must be a finite number",
                 "targets.base.model and targets.mem.model: d_model=-1 must be >= 1")  # fmt: skip
    assert line.count("train.lr=nan") == 1 and line.count("d_model=-1") == 1, line
    one = fails(capsys, [*dry, "--target", "mem"], "targets.mem: train.lr=nan must be a finite number")
    assert "targets.base" not in one, one


def test_af26_an_unknown_target_is_said_with_the_manifest_targets_whatever_else_is_wrong(tmp_path, capsys):
    path = manifest(tmp_path, TWO)
    argv = ["run", str(path), "--out", str(tmp_path / "o"), "--dry-run", "--target", "nope", "--set", "train.lr=nan"]
    line = fails(capsys, argv, "unknown target 'nope' (valid targets: base, mem)")
    assert "train.lr" not in line, line


def test_af26_merged_repeats_keeps_order_and_names_with_regex_characters():
    problems = ["name: x", "targets.a+b: lr bad", "targets.c.model: d bad", "targets.c: lr bad",
                "targets.a+b.model: d bad"]  # fmt: skip
    assert merged_repeats(problems, ["a+b", "c"]) == [
        "name: x", "targets.a+b and targets.c: lr bad", "targets.c.model and targets.a+b.model: d bad"
    ]  # fmt: skip
    assert merged_repeats(["targets.ab: x", "targets.a: x"], ["a", "ab"]) == ["targets.ab and targets.a: x"]


# ----------------------------------------------------------------------------- AF30: a conversion's lost checksums


def test_af30_a_conversion_that_lost_its_checksums_is_made_again_not_restored(tiny_run, tmp_path, capsys):
    text = tiny_run.parents[2] / "text.txt"
    path = tmp_path / "s.yml"
    path.write_text(f"name: s\nseeds: [0]\ndefaults:\n  data: {{source: {text}, val_fraction: 0.2}}\n  train: {TRAIN}\n"
                    f"targets:\n  a: {{init_from: {tiny_run}}}\n")  # fmt: skip
    run = ["run", str(path), "--out", str(tmp_path / "o"), "--no-progress"]
    assert main([*run, "--convert-only"]) == 0
    converted = tmp_path / "o" / "s" / "a" / "converted"
    (converted / "checksums.json").unlink()
    capsys.readouterr()
    line = fails(capsys, run, f"{converted}/checksums.json: missing",
                 f"delete {converted}: `attnlab run` converts the target's init_from model into it again")  # fmt: skip
    assert "restore it from a copy" not in line, line


# ----------------------------------------------------------------------------- AF28: a whole split scored in silence


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_af28_perplexity_shows_a_bar_of_the_tokens_scored_on_a_terminal_only(monkeypatch, terminal):
    from attnlab.eval import perplexity

    model = attnlab.build_model(attnlab.ModelConfig(vocab_size=11, d_model=8, n_layers=1, n_heads=2, max_seq_len=16))
    stderr = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(perplexity, "BAR_DELAY", 0.0)
    tokens = np.arange(101) % 11
    plain = perplexity.window_losses(model, tokens, 16)
    assert sum(n for _, n in plain) == 100
    said = stderr.getvalue()
    assert ("perplexity:" in said and "/100 [" in said and "tok/s" in said) == terminal, said
    assert said.endswith("\r") == terminal, repr(said)  # (the bar is cleared at the end: leave=False)


# ----------------------------------------------------------------------------- AF24: a checkpoint replaced in a read


def test_af24_a_run_moving_on_while_its_checkpoint_is_read_gives_the_new_checkpoint(tiny_run, tmp_path, monkeypatch):
    from attnlab.train import checkpoint as module

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    root = run / "checkpoints"
    old = root / json.loads((root / "best.json").read_text())["dir"]
    new = root / "step-000099"
    load = module.load_weights
    calls = []

    def trainer_steps_on(model, folder, *args, **kwargs):  # as a trainer does: new checkpoint, pointers, prune
        calls.append(Path(folder))
        if len(calls) == 1:
            shutil.copytree(old, new)
            for tag in ("last", "best"):
                (root / f"{tag}.json").write_text(json.dumps({"dir": new.name, "step": 99}))
            (old / "checksums.json").unlink()
            shutil.rmtree(old)
        return load(model, folder, *args, **kwargs)

    monkeypatch.setattr(module, "load_weights", trainer_steps_on)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no warning of the checkpoint that went: it is not the one read)
        loaded = module.load_checkpoint(run)
    assert loaded.folder == new and calls == [old, new]


def test_af24_a_checkpoint_damaged_with_the_pointers_unchanged_is_still_refused(tiny_run, tmp_path):
    from attnlab.train import checkpoint as module

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    folder = run / "checkpoints" / json.loads((run / "checkpoints" / "best.json").read_text())["dir"]
    (folder / "model.safetensors").unlink()
    with pytest.raises(module.CheckpointError) as caught:
        module.load_checkpoint(run)
    assert str(caught.value).startswith(f"{folder}/model.safetensors: missing"), caught.value
