"""Probe H's findings in runs, conversions and paths: training through an inference-time memory (quest, the
kvpress presses) that validate and --dry-run accepted and autograd then crashed on, a finished run whose
config.json had been edited taken as done with the old model's figures, a conversion to another memory kind that
dropped the source's trained memory weights without a word, compare reading a run file that is a fifo or a device
without end, paths of the wrong kind misnamed (a folder as model.safetensors called truncated, --out under a file
'File exists', /proc 'no such file', a file as an hf: model folder 'not found'), CC with arguments taken as one
path, and ${var} in a manifest's seeds. Each ends in one line naming the key, file or value and the fix, or does
what it says."""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import PROBE_MODEL, at_most, dry_run, fails, hat_text, probe_manifest, tiny_model

from attnlab.cli import main
from attnlab.cli_errors import os_error_line
from attnlab.config import DataConfig, TrainConfig
from attnlab.config_io import model_config_from_dict
from attnlab.errors import ConfigError
from attnlab.kernels import cpu
from attnlab.manifest import load_manifest
from attnlab.train.checkpoint import CheckpointError, save_model_folder
from attnlab.train.loop import train


@pytest.fixture(scope="module")
def run(tiny_run):
    return tiny_run


pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

MODEL = PROBE_MODEL
TRAIN = "{seq_len: 16, batch_size: 2, steps: 4, lr: 1.0e-3, warmup_steps: 1, eval_every: 2, eval_tokens: 32, " \
        "log_every: 1, checkpoint_every: 2}"  # fmt: skip
INFERENCE_MEMORIES = {
    "quest": "{kind: quest, recent_window: 8, page_size: 4, pages: 1}",
    "snapkv": "{kind: snapkv, budget: 8}",
    "tova": "{kind: tova, budget: 8}",
    "knorm": "{kind: knorm, budget: 8}",
}


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return hat_text(tmp_path_factory.mktemp("text"))


def manifest(tmp_path: Path, text: Path, targets: str = "  base: {}\n", model: str = "", head: str = "") -> Path:
    return probe_manifest(tmp_path, text, TRAIN, targets, model, head)


# ------------------------------------------------------------------ h1, h2: training through an inference memory


@pytest.mark.parametrize("kind", list(INFERENCE_MEMORIES))
def test_training_through_an_inference_memory_is_refused_by_validate_dry_run_and_run(tmp_path, capsys, text, kind):
    path = manifest(tmp_path, text)
    memory = ["--set", f"model.memory={INFERENCE_MEMORIES[kind]}"]
    fragments = (f"targets.base: model.memory.kind={kind}", "nothing to train", f"convert RUN --memory kind={kind}")
    assert main(["validate", str(path), *memory]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and all(f in err for f in fragments), err
    for dry in (["--dry-run"], ["--no-progress"]):
        assert fails(capsys, ["run", str(path), *memory, "--out", str(tmp_path / "out"), *dry], *fragments)
    assert not (tmp_path / "out").exists()


def test_train_itself_refuses_an_inference_memory_before_writing(tmp_path, text):
    cfg = model_config_from_dict({**MODEL, "memory": yaml.safe_load(INFERENCE_MEMORIES["quest"])})
    data = DataConfig(source=str(text), tokenizer="char", val_fraction=0.2)
    with pytest.raises(ConfigError, match=r"model\.memory\.kind=quest .*nothing to train"):
        train(cfg, data, TrainConfig(seq_len=16, batch_size=2, steps=2), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_pretrained_target_carrying_an_inference_memory_is_refused(tmp_path, capsys, text, run):
    folder = tmp_path / "quest"
    assert main(["convert", str(run), "--memory", "kind=quest,recent_window=8,page_size=4,pages=1", "--out",
                 str(folder), "--eval-tokens", "0"]) == 0  # fmt: skip
    capsys.readouterr()
    path = manifest(tmp_path, text, model="{max_seq_len: 64}", targets=f"  b: {{init_from: {folder}}}\n")
    assert fails(capsys, ["run", str(path), "--dry-run", "--out", str(tmp_path / "out")],
                 "targets.b: model.memory.kind=quest", "nothing to train", f"(from init_from {folder})")  # fmt: skip


# ----------------------------------------------------------------- h8: a finished run's config.json edited after


def test_a_finished_run_whose_config_json_was_edited_is_not_taken_as_done(tmp_path, capsys, text):
    path = manifest(tmp_path, text)
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    folder = out / "m" / "base" / "seed0"
    config = json.loads((folder / "config.json").read_text())
    config["model"]["rope_base"] = 500.0
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    saved = yaml.safe_load((folder / "config.yaml").read_text())
    saved["model"]["rope_base"] = 500.0
    (folder / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    argv = ["run", str(path), "--set", "model.rope_base=500", "--out", str(out)]
    fragments = ("holds a finished run trained with another config than its config.json says",
                 "model.rope_base: trained with 10000.0, now 500.0", "checkpoints/step-000004/config.json",
                 "edited after training")  # fmt: skip
    assert fails(capsys, argv + ["--no-progress"], *fragments)
    said = dry_run(capsys, argv + ["--dry-run"])
    assert "would be refused" in said and "trained with 10000.0, now 500.0" in said and "done already" not in said


# ------------------------------------------------------------ h9: a conversion dropping the source's memory weights


def test_converting_away_from_a_bounded_memory_says_its_weights_are_dropped(tmp_path, capsys, run):
    bounded, quest = tmp_path / "bounded", tmp_path / "quest"
    assert main(["convert", str(run), "--memory", "kind=bounded,recent_window=8,exact_slots=4,summary_slots=4",
                 "--out", str(bounded), "--eval-tokens", "0"]) == 0  # fmt: skip
    assert "dropped" not in capsys.readouterr().out
    assert main(["convert", str(bounded), "--memory", "kind=quest,recent_window=8,page_size=4,pages=1", "--out",
                 str(quest), "--eval-tokens", "0"]) == 0  # fmt: skip
    lines = [line for line in capsys.readouterr().out.splitlines() if "dropped" in line]
    assert lines == ["  dropped: the source's memory.eta_logit, memory.write (2 tensors, memory bounded): memory quest "
                     "has no place for them"]  # fmt: skip


# ------------------------------------------------------------------ h11: compare reading a fifo or a device


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "config.json"])
def test_compare_refuses_a_run_file_that_is_a_fifo(tmp_path, capsys, run, name):
    copy = tmp_path / "runs" / "tiny"
    shutil.copytree(run.parent, copy)
    (copy / "seed0" / name).unlink()
    os.mkfifo(copy / "seed0" / name)  # no writer: reading it waits without end
    with at_most(20):
        assert fails(capsys, ["compare", str(copy), "--out", str(tmp_path / "o")], f"seed0/{name}: not a regular file",
                     f"where a run keeps its {name}")  # fmt: skip


def test_compare_refuses_a_run_file_linked_to_a_device(tmp_path, capsys, run):
    copy = tmp_path / "runs" / "tiny"
    shutil.copytree(run.parent, copy)
    (copy / "seed0" / "metrics.jsonl").unlink()
    (copy / "seed0" / "metrics.jsonl").symlink_to("/dev/null")  # (/dev/zero would be read without end before)
    assert fails(capsys, ["compare", str(copy), "--out", str(tmp_path / "o")], "metrics.jsonl: not a regular file")


# ------------------------------------------------------------------------------ h16: paths of the wrong kind


def test_a_folder_where_the_weights_go_is_called_a_folder(tmp_path, capsys, run):
    copy = tmp_path / "r"
    shutil.copytree(run, copy)
    weights = copy / "checkpoints" / "step-000004" / "model.safetensors"
    weights.unlink()
    weights.mkdir()
    line = fails(capsys, ["generate", str(copy), "a", "--max-new-tokens", "2"], f"{weights}: a folder, where "
                 "checksums.json records a file of")  # fmt: skip
    assert "truncated" not in line


def test_convert_out_under_a_file_names_the_file(tmp_path, capsys, run):
    (tmp_path / "afile").write_text("hi\n")
    out = tmp_path / "afile" / "x"
    argv = ["convert", str(run), "--memory", "kind=window,recent_window=8", "--out", str(out), "--eval-tokens", "0"]
    line = fails(capsys, argv, f"{out}: {tmp_path / 'afile'} is a file, not a folder", "choose another --out")
    assert "File exists" not in line


@pytest.mark.skipif(not os.path.isdir("/proc") or os.statvfs("/proc").f_blocks != 0, reason="needs Linux /proc")
def test_outputs_in_proc_are_said_to_be_a_virtual_file_system(run):
    model = tiny_model()
    with pytest.raises(CheckpointError, match="could not write /proc/attnlab_probe_h: /proc is on a virtual file "
                       r"system \(such as /proc or /sys\), which takes no new files or folders"):  # fmt: skip
        save_model_folder("/proc/attnlab_probe_h", model, {"model": model.cfg.to_dict()})
    error = FileNotFoundError(errno.ENOENT, "No such file or directory", "/proc/attnlab_probe_h.jsonl")
    line = os_error_line(error, argparse.Namespace(out="/proc/attnlab_probe_h.jsonl"))
    assert line.startswith("/proc/attnlab_probe_h.jsonl: no such file or folder, and none can be made there: "
                           "/proc is on a virtual file system"), line  # fmt: skip
    assert "give a path in another folder, or choose another folder with --out" in line


def test_a_file_where_an_hf_model_folder_goes_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "d" / "models" / "org").mkdir(parents=True)
    (tmp_path / "d" / "models" / "org" / "file").write_text("x\n")
    assert fails(capsys, ["info", "hf:org/file", "--data-dir", str(tmp_path / "d")],
                 f"{tmp_path / 'd' / 'models' / 'org' / 'file'} is a file, not a model folder")  # fmt: skip


# ------------------------------------------------------------------------------ h18: CC with arguments


def test_cc_with_arguments_is_split_as_make_splits_it(tmp_path, monkeypatch):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("CC", f"{gcc} -O2")
    assert cpu._compiler() == [gcc, "-O2"]
    assert cpu.build(tmp_path).is_file()  # built with it: not the PyTorch path


@pytest.mark.parametrize("value, fragment", [("nosuch-cc -O2", "$CC='nosuch-cc -O2': nosuch-cc is not found"),
                                             ("gcc 'x", "is not a command line")])  # fmt: skip
def test_a_cc_that_cannot_run_is_named_with_a_fix(monkeypatch, value, fragment):
    monkeypatch.setenv("CC", value)
    with pytest.raises(RuntimeError) as caught:
        cpu.build()
    assert fragment in str(caught.value) and "CC='ccache " in str(caught.value)


# ------------------------------------------------------------------------------ h19: ${var} in the seeds


def test_variables_apply_to_the_seeds(tmp_path, capsys, text):
    path = manifest(tmp_path, text, head="vars: {seeds: [0, 1], first: 3}\nseeds: ${seeds}")
    assert list(load_manifest(path).seeds) == [0, 1]
    path = manifest(tmp_path, text, head="vars: {first: 3}\nseeds: ['${first}', 5]")
    assert list(load_manifest(path).seeds) == [3, 5]
    path = manifest(tmp_path, text, head="vars: {first: 3}\nseeds: ${nope}")
    with pytest.raises(ConfigError) as caught:
        load_manifest(path)
    assert caught.value.problems == ["seeds: undefined variable ${nope} (defined: first)"]  # said once
