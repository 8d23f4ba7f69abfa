"""Probe G's findings in runs: torchrun's environment variables (checked before anything joins a process group; a
dry run never joins one), --no-resume over an interrupted run of another config, --out inside a run's folder,
defaults blamed on a pretrained target, train.trainable given as a string, checks the dry run missed (a file as
XDG_CACHE_HOME, a vocab_size below the tokenizer's), stale checkpoint pointers, ATTNLAB_CPU_KERNELS typos, and
checkpoint weights that differed byte for byte between two saves of the same state. Each ends in one line naming
the variable, key, folder or value and the fix, or does what it says."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import dry_run, fails, hat_text, tiny_model

from attnlab.cli import main
from attnlab.config import DataConfig
from attnlab.data.prepared import default_cache_dir, prepare
from attnlab.errors import ConfigError, DataError
from attnlab.kernels import cpu
from attnlab.manifest import load_manifest
from attnlab.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, save_model_folder
from attnlab.train.distributed import dist_env


@pytest.fixture(scope="module")
def run(tiny_run):
    return tiny_run


pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

A = "{d_model: 32, n_layers: 1, n_heads: 2}"
TRAIN = "{seq_len: 16, batch_size: 2, steps: 4, lr: 1.0e-3, warmup_steps: 1, eval_every: 2, eval_tokens: 32, " \
        "log_every: 1, checkpoint_every: 2}"  # fmt: skip


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return hat_text(tmp_path_factory.mktemp("text"))


def manifest(tmp_path: Path, text: Path, name: str = "m", targets: str = "  base: {}\n", model: str = "") -> Path:
    path = tmp_path / f"{name}.yml"
    model = model or "{d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 64}"
    path.write_text(f"name: {name}\nseeds: [0]\ndefaults:\n  model: {model}\n"
                    f"  data: {{source: {text}, tokenizer: char, val_fraction: 0.2}}\n  train: {TRAIN}\n"
                    f"targets:\n{targets}")  # fmt: skip
    return path


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


# ----------------------------------------------------------------------------- v14-v19: torchrun's variables


@pytest.mark.parametrize(
    ("env", "line"),
    [
        ({"WORLD_SIZE": "abc"}, "$WORLD_SIZE='abc' must be a whole number >= 1"),
        ({"WORLD_SIZE": "0"}, "$WORLD_SIZE='0' must be a whole number >= 1"),
        ({"WORLD_SIZE": "2"}, "$WORLD_SIZE=2 needs $RANK, $MASTER_ADDR and $MASTER_PORT (start with torchrun"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "29555"}, "$WORLD_SIZE=2 needs $MASTER_ADDR (start with"),
        ({"WORLD_SIZE": "2", "RANK": "x", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "$RANK='x' must be a whole"),
        ({"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"},
         "$RANK=5 must be below $WORLD_SIZE=2"),
    ],
)  # fmt: skip
def test_distributed_variables_checked_before_any_rendezvous(tmp_path, capsys, monkeypatch, text, env, line):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(line)):
        dist_env()
    for dry in (["--dry-run"], ["--no-progress"]):  # (RANK=5 blocked in init_process_group, even for a dry run)
        assert fails(capsys, ["run", str(manifest(tmp_path, text)), "--out", str(tmp_path / "out"), *dry], line)
    assert not (tmp_path / "out").exists()


def test_one_process_and_a_valid_group_pass(monkeypatch):
    assert not dist_env().enabled
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not dist_env().enabled
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(name, value)
    info = dist_env()
    assert (info.rank, info.world_size, info.is_main) == (1, 2, False)


def test_a_dry_run_under_torchrun_joins_no_process_group(tmp_path, capsys, monkeypatch, text):
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(name, value)
    assert main(["run", str(manifest(tmp_path, text)), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    assert "would train 4 steps" in capsys.readouterr().out
    assert not torch.distributed.is_initialized()


# ----------------------------------------------------------------------------- x11: --no-resume, another config


@pytest.fixture
def interrupted(tmp_path, text) -> tuple[Path, Path]:
    """(the manifest, its run folder): trained 4 steps, then its summary.json removed: interrupted at step 4."""
    path = manifest(tmp_path, text)
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    folder = tmp_path / "out" / "m" / "base" / "seed0"
    (folder / "summary.json").unlink()
    return path, folder


def test_no_resume_refuses_an_interrupted_run_of_another_config(interrupted, capsys):
    path, folder = interrupted
    before = snapshot(folder)
    argv = ["run", str(path), "--out", str(folder.parents[2]), "--no-resume", "--set", "train.lr=5e-3"]
    capsys.readouterr()
    said = dry_run(capsys, [*argv, "--dry-run"])
    assert f"would be refused: {folder} holds an interrupted run made with another config" in said
    assert "checkpointed at step 4 (train.lr: saved 0.001, now 0.005)" in said
    assert fails(capsys, [*argv, "--no-progress"], str(folder), "interrupted run made with another config",
                 "step 4", "train.lr: saved 0.001, now 0.005", "--no-resume would delete it")  # fmt: skip
    assert snapshot(folder) == before  # its checkpoints and metrics are all there


def test_no_resume_still_restarts_an_interrupted_run_of_the_same_config(interrupted, capsys):
    path, folder = interrupted
    argv = ["run", str(path), "--out", str(folder.parents[2]), "--no-resume"]
    assert main([*argv, "--dry-run"]) == 0
    assert "would train 4 steps" in capsys.readouterr().out
    assert main([*argv, "--no-progress"]) == 0
    assert (folder / "summary.json").exists()


# ----------------------------------------------------------------------------- rt6, rt7: --out inside a run


def test_out_in_a_run_folder_is_refused(tmp_path, capsys, text, run):
    before = snapshot(run)
    path = manifest(tmp_path, text)
    for out, where in ((run, "is a run's folder"), (run / "tokenizer", "which is a run's folder")):
        for dry in (["--dry-run"], ["--no-progress"]):
            assert fails(capsys, ["run", str(path), "--out", str(out), *dry], f"--out {out} ", where, "--out runs")
    assert snapshot(run) == before


# ------------------------------------------------------------------- mf12-mf19: defaults and a pretrained target


def test_model_keys_of_defaults_are_blamed_on_defaults(tmp_path, text, run):
    targets = f"  a: {{}}\n  b: {{init_from: {run}, model: {{attention: {{kind: mha}}}}}}\n"
    path = manifest(tmp_path, text, targets=targets)
    with pytest.raises(ConfigError) as caught:
        load_manifest(path)
    assert caught.value.problems == [
        "defaults.model.d_model, defaults.model.n_layers, defaults.model.n_heads (inherited by target b, which starts "
        "from a pretrained model): a pretrained model's d_model, n_layers, n_heads are fixed by its weights; move them "
        "into the other targets' model sections"
    ]


def test_a_model_key_the_target_writes_is_blamed_on_the_target(tmp_path, text, run):
    path = manifest(tmp_path, text, model="{max_seq_len: 64}",
                    targets=f"  b: {{init_from: {run}, model: {{d_model: 32}}}}\n")  # fmt: skip
    with pytest.raises(ConfigError, match=r"targets\.b\.model\.d_model: a pretrained model's d_model is fixed"):
        load_manifest(path)


def test_tokenizer_of_defaults_leaves_a_pretrained_target_its_own(tmp_path, capsys, text, run):
    targets = f"  a: {{model: {A}}}\n  b: {{init_from: {run}}}\n"
    path = manifest(tmp_path, text, model="{max_seq_len: 64}", targets=targets)
    specs = {spec.target: spec for spec in load_manifest(path).runs}
    assert specs["a"].data.tokenizer == "char" and specs["b"].data.tokenizer == str(run)
    assert main(["run", str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    assert "b seed0: would train 4 steps" in capsys.readouterr().out


# ----------------------------------------------------------------------------- r10, r11: trainable as a string


def test_trainable_as_a_string(tmp_path, capsys, text):
    line = """train.trainable must be a list of name patterns, got the string 'blocks.*' (write ["blocks.*"])"""
    path = manifest(tmp_path, text)
    assert fails(capsys, ["run", str(path), "--dry-run", "--set", "train.trainable=blocks.*"], "targets.base: " + line)
    path.write_text(path.read_text().replace("base: {}", 'base: {train: {trainable: "blocks.*"}}'))
    with pytest.raises(ConfigError) as caught:
        load_manifest(path)
    assert caught.value.problems == ["targets.base: " + line]


# ----------------------------------------------------------------------------- v05, rs18: what the dry run missed


def test_a_file_as_the_cache_is_refused_by_the_dry_run_as_by_the_run(tmp_path, capsys, monkeypatch, text):
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(afile))
    path = manifest(tmp_path, text)
    lines = [fails(capsys, ["run", str(path), "--out", str(tmp_path / "out"), *flag], f"{afile}/attnlab/prepared/",
                   "a file stands where the prepared data's folder goes") for flag in (["--dry-run"], [])]  # fmt: skip
    assert lines[0] == lines[1] and afile.read_text() == "x\n"
    assert main(["validate", str(path)]) == 2  # validate names each problem as `FILE: problem`
    assert "a file stands where the prepared data's folder goes" in capsys.readouterr().err


def test_a_vocab_size_below_the_prepared_tokenizers_is_refused_by_the_dry_run(tmp_path, capsys, text):
    path = manifest(tmp_path, text)
    prepare(DataConfig(source=str(text), tokenizer="char", val_fraction=0.2))
    argv = ["run", str(path), "--out", str(tmp_path / "out"), "--set", "model.vocab_size=10"]
    line = "targets.base: model vocab_size=10 is smaller than the tokenizer's "
    lines = [fails(capsys, [*argv, *flag], line) for flag in (["--dry-run"], ["--no-progress"])]
    assert lines[0] == lines[1] and not (tmp_path / "out").exists()
    assert main(["validate", str(path), "--set", "model.vocab_size=10"]) == 2
    assert f"{path}: {line}" in capsys.readouterr().err


def test_a_refused_preparation_leaves_no_folder_in_the_cache(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a single document, so no other split gets one")
    with pytest.raises(DataError, match="no document fell in the"):
        prepare(DataConfig(source=str(one), tokenizer="char", val_fraction=0.2))
    assert not list(default_cache_dir().glob("one*"))


# ----------------------------------------------------------------------------- ptr2, ptr6: checkpoint pointers


def test_a_stale_pointer_names_the_intact_checkpoint(tmp_path, run):
    copy = shutil.copytree(run, tmp_path / "run")
    pointer = json.dumps({"dir": "step-000099", "step": 99})
    (copy / "checkpoints" / "best.json").write_text(pointer)
    (copy / "checkpoints" / "last.json").write_text(pointer)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(copy)
    assert str(caught.value) == (
        f"{copy}/checkpoints/best.json names step-000099, which is missing (a stale pointer), but step-000004 is "
        f'intact: write {{"dir": "step-000004", "step": 4}} into best.json to use it, or give '
        f"{copy}/checkpoints/step-000004 itself"
    )
    (copy / "checkpoints" / "best.json").unlink()
    with pytest.raises(CheckpointError, match=r"last\.json names step-000099.* \(the run then resumes from step 4\)"):
        load_checkpoint(copy)
    (copy / "checkpoints" / "last.json").write_text(json.dumps({"dir": "step-000004", "step": 4}))
    assert load_checkpoint(copy).folder.name == "step-000004"


def test_checkpoints_without_pointers_are_named(tmp_path, capsys, run):
    copy = shutil.copytree(run, tmp_path / "run")
    for tag in ("best", "last"):
        (copy / "checkpoints" / f"{tag}.json").unlink()
    assert fails(capsys, ["generate", str(copy), "The", "--max-new-tokens", "1"],
                 f"{copy}: no last.json or best.json in {copy}/checkpoints, but step-000004 is there: give "
                 f"{copy}/checkpoints/step-000004 itself")  # fmt: skip


# ----------------------------------------------------------------------------- v11: ATTNLAB_CPU_KERNELS


def test_an_unknown_cpu_kernels_value_is_refused(monkeypatch):
    monkeypatch.setenv("ATTNLAB_CPU_KERNELS", "maybe")
    with pytest.raises(ConfigError, match=r"\$ATTNLAB_CPU_KERNELS='maybe' is not one of 0, false, no, off"):
        cpu.turned_off()
    for value, off in (("0", True), ("Off", True), ("1", False), ("yes", False), ("", False)):
        monkeypatch.setenv("ATTNLAB_CPU_KERNELS", value)
        assert cpu.turned_off() is off


# ----------------------------------------------------------------------------- bx01: byte-identical weights


def test_two_saves_of_the_same_state_are_byte_identical(tmp_path):
    model = tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    trainer, config = {"step": 5}, {"model": model.cfg.to_dict()}
    digests = set()
    for i in range(8):  # safetensors wrote its two metadata keys in a hash map's order: one save in two differed
        folder = save_checkpoint(tmp_path / f"run{i}", model, optimizer, trainer, config)
        digests.add(hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest())
        folder = save_model_folder(tmp_path / f"model{i}", model, config)
        digests.add("folder " + hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest())
    assert len(digests) == 2
    loaded = load_checkpoint(tmp_path / "run0").model
    assert all(
        torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values(), strict=True)
    )


# A real torchrun launch of `attnlab run` with 2 processes still trains after these checks: tests/test_train.py
# (test_two_process_ddp_matches_one_process) and tests/test_fsdp.py run one.
