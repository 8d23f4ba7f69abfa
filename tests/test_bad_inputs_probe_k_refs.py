"""Probe K's findings in model references: a run's checkpoints/ folder or a folder of seed runs given as a model was
refused without pointing at the references right inside it; a checkpoint copied in from another run was loaded by
info and generate as the run's own (and `attnlab run` blamed an edited config.json for it); an empty positional
path was shown as '' or '.'; a data directory given twice was searched (and listed) twice. Each now ends in one line
naming the folder, checkpoint or value and the fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import fails, hat_text, probe_manifest

from attnlab.cli import main
from attnlab.errors import DataError, InputError
from attnlab.interop.references import load_model, model_config_of
from attnlab.paths import cache_dir, data_dirs

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = "{seq_len: 16, batch_size: 2, steps: 2, lr: 1.0e-3, warmup_steps: 1, eval_every: 2, eval_tokens: 32}"


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return hat_text(tmp_path_factory.mktemp("text"))


def trained(root: Path, text: Path, d_model: int) -> tuple[Path, Path]:
    """(the manifest, its out folder) of a finished one-seed run of the probes' tiny model at d_model, trained
    into root/out/m/base/seed0."""
    root.mkdir(parents=True, exist_ok=True)
    path = probe_manifest(root, text, TRAIN, model=f"{{d_model: {d_model}, n_layers: 1, n_heads: 2, max_seq_len: 64}}")
    assert main(["run", str(path), "--out", str(root / "out"), "--no-progress"]) == 0
    return path, root / "out"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text) -> dict:
    """Two finished runs, d_model 32 and 40: {32: (manifest, out), 40: (manifest, out)}."""
    root = tmp_path_factory.mktemp("runs")
    return {d: trained(root / f"d{d}", text, d) for d in (32, 40)}


def seed_run(out: Path) -> Path:
    return out / "m" / "base" / "seed0"


# ------------------------------------------------ k49: a run's checkpoints/ folder or a folder of runs as a model


def test_a_runs_checkpoints_folder_as_a_model_points_at_the_run_and_a_checkpoint(runs, capsys):
    run = seed_run(runs[32][1])
    checkpoints, step = run / "checkpoints", run / "checkpoints" / "step-000002"
    fragments = (f"{checkpoints}: a run's checkpoints folder, not a model: give the run's folder {run} (its best "
                 f"checkpoint) or one checkpoint in it, e.g. {step}",)  # fmt: skip
    assert fails(capsys, ["generate", str(checkpoints), "the"], *fragments)
    assert fails(capsys, ["info", str(checkpoints)], *fragments)
    with pytest.raises(DataError, match=r"a run's checkpoints folder, not a model: give the run's folder .*seed0 "):
        load_model(checkpoints)


def test_a_folder_of_seed_runs_as_a_model_names_the_runs_inside(runs, capsys, tmp_path):
    target = seed_run(runs[32][1]).parent
    line = f"{target}: no config.json naming a model here, but the folder holds model references: give one of them, "
    assert fails(capsys, ["info", str(target)], line + f"e.g. {target / 'seed0'}")
    out = tmp_path / "b"
    assert fails(capsys, ["bench", str(target), "--benchmarks", "memory", "--out", str(out)], line)
    several = tmp_path / "several"
    for seed in (0, 1, 2, 3):  # (links to the same run: each is a reference)
        (several / f"seed{seed}").mkdir(parents=True)
        (several / f"seed{seed}" / "checkpoints").symlink_to(seed_run(runs[32][1]) / "checkpoints")
    assert fails(capsys, ["generate", str(several), "the"],
                 f"e.g. {several / 'seed0'}, {several / 'seed1'} or {several / 'seed2'} (and 1 more)")  # fmt: skip


def test_a_folder_holding_no_model_is_still_said_to_hold_none(tmp_path, capsys):
    (tmp_path / "empty" / "inner").mkdir(parents=True)
    line = fails(capsys, ["info", str(tmp_path / "empty")], "no config.json naming a model here (a model reference is")
    assert "holds model references" not in line


# ------------------------------------------------------------ k50: a checkpoint copied in from another run


@pytest.fixture(scope="module")
def foreign(tmp_path_factory, runs) -> Path:
    """A copy of the d_model-40 run whose (only) checkpoint was replaced by the d_model-32 run's step folder."""
    copy = tmp_path_factory.mktemp("foreign") / "out"
    shutil.copytree(runs[40][1], copy, symlinks=True)
    step = seed_run(copy) / "checkpoints" / "step-000002"
    shutil.rmtree(step)
    shutil.copytree(seed_run(runs[32][1]) / "checkpoints" / "step-000002", step)
    return copy


def foreign_fragments(run: Path) -> tuple[str, ...]:
    step = run / "checkpoints" / "step-000002"
    return (f"{step}: this checkpoint was trained with another config than the run's {run / 'config.json'} says "
            "(model.d_model: trained with 32, now 40)",
            "it was copied in from another run, or the run's config.json was changed after training",
            "put the run's own checkpoint back (or its config.json as it was)")  # fmt: skip


def test_info_and_generate_refuse_a_checkpoint_copied_in_from_another_run(foreign, capsys):
    run = seed_run(foreign)
    fragments = foreign_fragments(run)
    assert fails(capsys, ["info", str(run)], *fragments)
    assert fails(capsys, ["info", str(run), "--json"], *fragments)
    assert fails(capsys, ["generate", str(run), "the", "--max-new-tokens", "2"], *fragments)
    assert fails(capsys, ["generate", str(run / "checkpoints" / "step-000002"), "the"], *fragments)
    with pytest.raises(DataError, match=r"trained with another config than the run's .* \(model\.d_model: trained "):
        load_model(run)
    with pytest.raises(DataError, match=r"step-000002: this checkpoint was trained with another config"):
        model_config_of(run / "checkpoints" / "step-000002")


def test_the_runs_own_checkpoint_still_loads(runs, capsys):
    run = seed_run(runs[40][1])
    assert model_config_of(run).d_model == 40
    assert main(["generate", str(run), "the", "--max-new-tokens", "2"]) == 0
    assert main(["info", str(run / "checkpoints" / "step-000002")]) == 0


def test_run_refuses_the_copied_checkpoint_without_assuming_the_config_was_edited(foreign, runs, capsys):
    run = seed_run(foreign)
    line = fails(capsys, ["run", str(runs[40][0]), "--out", str(foreign), "--no-progress"],
                 f"{run} holds a finished run trained with another config than its config.json says",
                 "model.d_model: trained with 32, now 40",
                 "the checkpoint was copied in from another run, or the run's config.json or config.yaml was edited "
                 "after training")  # fmt: skip
    assert ": the run's config.json or config.yaml was edited after training" not in line


# ------------------------------------------------------------------------- k55: an empty positional path


def test_an_empty_model_reference_is_said_to_be_an_empty_path(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = "the model reference is an empty path: give a .gguf file, a Hugging Face model folder, an attnlab run"
    for argv in (["info", ""], ["generate", "", "x"]):
        assert "'.'" not in fails(capsys, argv, line) and ": .:" not in capsys.readouterr().err
    with pytest.raises(InputError, match="the model reference is an empty path"):
        load_model("")


def test_validate_of_an_empty_path_names_it(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["validate", ""]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.strip() == ("'': an empty path names no file: `attnlab validate` takes model configs, experiment and "
                           "benchmark manifests and probe suites"), err  # fmt: skip


# ------------------------------------------------------- k35: --data-dir the same folder as $ATTNLAB_DATA


def test_a_data_directory_given_twice_is_searched_and_listed_once(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setenv("ATTNLAB_DATA", str(data))
    assert data_dirs(data) == [data, cache_dir()]
    assert data_dirs(str(data) + "/") == [data, cache_dir()]
    monkeypatch.setenv("ATTNLAB_DATA", str(cache_dir()))
    assert data_dirs(None) == [cache_dir()]
    monkeypatch.setenv("ATTNLAB_DATA", str(data))
    line = fails(capsys, ["info", "hf:nope/nope", "--data-dir", str(data)], "hf:nope/nope: not found")
    assert line.count(str(data / "models" / "nope" / "nope")) == 1, line
