"""Probe J's findings in runs and bench parameters: data.val_fraction=0 on a text file passed validate and --dry-run,
then the run refused after writing its folder; the same --set key given twice (run and bench) silently took the last
value; init_from {model: NAME} naming a target was reported as an unknown data.tokenizer; a model.max_seq_len whose
RoPE tables cannot fit this machine passed validate and ended in the allocator's traceback; a checkpoint whose
trainer.json step disagreed with its folder (or its sampler) was resumed from the wrong step; bench's
memory.cache_dtype=int8 did not name its parameter; latency's advice asked for prompt lengths <= 0. Each now ends
in one line naming the key, file or value and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import PROBE_MODEL, dry_run, edit_trainer, fails, hat_text, probe_manifest, stop_after_first_checkpoint

from attnlab.cli import main
from attnlab.config import DataConfig, TrainConfig
from attnlab.config_io import model_config_from_dict
from attnlab.errors import ConfigError, DataError
from attnlab.eval.harness import load_plan
from attnlab.manifest import parse_set
from attnlab.ops.rope import Rotary
from attnlab.train import budget
from attnlab.train.loop import train

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

MODEL = PROBE_MODEL
TRAIN = "{seq_len: 16, batch_size: 2, steps: 4, lr: 1.0e-3, warmup_steps: 1, eval_every: 4, eval_tokens: 32, " \
        "log_every: 1, checkpoint_every: 2}"  # fmt: skip


@pytest.fixture(scope="module")
def run(tiny_run):
    return tiny_run


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return hat_text(tmp_path_factory.mktemp("text"))


def manifest(tmp_path: Path, text: Path, targets: str = "  base: {}\n", model: str = "") -> Path:
    return probe_manifest(tmp_path, text, TRAIN, targets, model)


def validate_refuses(capsys, argv, *fragments) -> str:
    """`attnlab validate` exits 2 with one stderr line (`FILE: problem`) holding every fragment, no traceback."""
    assert main(["validate", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert all(fragment in err for fragment in fragments), err
    return err


# ---------------------------------------------------------------- j1: data.val_fraction=0 on a text file


def test_no_validation_split_is_refused_by_validate_and_dry_run_and_the_run_writes_nothing(tmp_path, capsys, text):
    path, out = manifest(tmp_path, text), tmp_path / "out"
    zero = ["--set", "data.val_fraction=0"]
    fragments = ("targets.base: data.val_fraction=0 leaves data.source=", "no validation split",
                 "give data.val_fraction > 0")  # fmt: skip
    validate_refuses(capsys, [str(path), *zero], *fragments)
    for dry in (["--dry-run"], ["--no-progress"]):
        assert fails(capsys, ["run", str(path), *zero, "--out", str(out), *dry], *fragments)
    assert not out.exists()


def test_train_itself_refuses_data_without_a_validation_split_before_writing(tmp_path, text):
    data = DataConfig(source=str(text), tokenizer="char", val_fraction=0.0)
    with pytest.raises(DataError, match="no 'val' split"):
        train(model_config_from_dict(MODEL), data, TrainConfig(seq_len=16, batch_size=2, steps=2), tmp_path / "run",
              progress=False)  # fmt: skip
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------- j2: the same --set key twice


def test_run_set_of_one_key_twice_is_refused(tmp_path, capsys, text):
    path, out = manifest(tmp_path, text), tmp_path / "out"
    twice = ["--set", "train.steps=6", "--set", "train.steps=4"]
    line = "--set train.steps is given twice (6, then 4): give it once"
    validate_refuses(capsys, [str(path), *twice], line)
    for dry in (["--dry-run"], ["--no-progress"]):
        assert fails(capsys, ["run", str(path), *twice, "--out", str(out), *dry], line)
    assert not out.exists()


def test_run_set_of_a_key_inside_a_mapping_set_before_is_refused():
    for items in (["model.attention={kind: mha, n_kv_heads: 1}", "model.attention.n_kv_heads=2"],
                  ["model.attention.n_kv_heads=2", "model.attention={kind: mha}"]):  # fmt: skip
        with pytest.raises(ConfigError, match=r"\(the last would silently win\): give each key once") as error:
            parse_set(items)
        assert len(error.value.problems) == 1 and "--set model.attention" in str(error.value)
    merged = parse_set(["model.attention={kind: mha}", "model.attention.n_kv_heads=2"])  # other keys: merged
    assert merged == {"model": {"attention": {"kind": "mha", "n_kv_heads": 2}}}


def test_bench_set_of_one_parameter_twice_is_refused(run, tmp_path, capsys):
    out = tmp_path / "b"
    argv = ["bench", str(run), "--benchmarks", "perplexity", "--set", "perplexity.seq_len=16", "--set",
            "perplexity.seq_len=8", "--out", str(out)]  # fmt: skip
    assert fails(capsys, argv, "--set perplexity.seq_len is given twice (16, then 8): give it once")
    assert not out.exists()
    with pytest.raises(ConfigError, match="perplexity.split is given twice"):
        load_plan([str(run)], ["perplexity"], ["perplexity.split=val", "perplexity.split=test"])


# -------------------------------------------------------------- j3: init_from {model: NAME} with a plain name


def test_init_from_a_mapping_naming_a_target_says_so_not_data_tokenizer(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (no folder a or smol here)
    path = tmp_path / "m.yml"
    path.write_text("name: m\ntargets:\n  a: {init_from: {model: a}}\n")
    err = validate_refuses(capsys, [str(path)], "targets.a.init_from.model='a': no such model file or folder",
                           "a target is named as init_from: a")  # fmt: skip
    assert "data.tokenizer" not in err
    path.write_text("name: m\ntargets:\n  b: {init_from: {model: smol}}\n")
    err = validate_refuses(capsys, [str(path)], "targets.b.init_from.model='smol' is not a model reference",
                           "./smol")  # fmt: skip
    assert "data.tokenizer" not in err


# --------------------------------------------------------- j4: RoPE tables beyond this machine's memory


@pytest.fixture
def small_machine(monkeypatch):
    """This machine with 1 GiB of memory."""
    monkeypatch.setattr(budget, "machine_memory", lambda: 2**30)


def test_a_max_seq_len_whose_rope_tables_cannot_fit_is_refused_by_validate_and_dry_run(tmp_path, capsys, text,
                                                                                      small_machine):  # fmt: skip
    path, out = manifest(tmp_path, text), tmp_path / "out"
    huge = ["--set", "model.max_seq_len=100000000"]
    # head_dim 16: 8 pairs; cos and sin, and the angles: 24 floats (96 bytes) a position
    fragments = ("targets.base: model.max_seq_len=100,000,000 needs at least 9 GiB for its RoPE tables",
                 "more than this machine's 1 GiB of memory", "at most 11,184,810 fit")  # fmt: skip
    validate_refuses(capsys, [str(path), *huge], *fragments)
    assert fails(capsys, ["run", str(path), *huge, "--out", str(out), "--dry-run"], *fragments)
    assert not out.exists()


def test_a_run_with_such_a_max_seq_len_is_refused_before_building_anything(tmp_path, capsys, text, small_machine):
    path, out = manifest(tmp_path, text), tmp_path / "out"
    argv = ["run", str(path), "--set", "model.max_seq_len=2000000000", "--out", str(out), "--no-progress"]
    assert fails(capsys, argv, "model.max_seq_len=2,000,000,000 needs at least", "lower model.max_seq_len")
    assert not out.exists()


def test_a_pretrained_target_raising_max_seq_len_past_memory_is_refused(tmp_path, capsys, text, run, small_machine):
    target = f"  a: {{init_from: {run}, model: {{max_seq_len: 100000000}}}}\n"
    path, out = manifest(tmp_path, text, target, model="{max_seq_len: 64}"), tmp_path / "out"
    fragments = ("targets.a: model.max_seq_len=100,000,000 needs at least", "RoPE tables")
    validate_refuses(capsys, [str(path)], *fragments)
    assert fails(capsys, ["run", str(path), "--out", str(out), "--convert-only", "--dry-run"], *fragments)
    assert not out.exists()


def test_train_itself_refuses_rope_tables_beyond_memory(tmp_path, text, monkeypatch):
    monkeypatch.setattr(budget, "machine_memory", lambda: 50 * 2**20)  # the batch fits; 2**20 positions do not
    cfg = model_config_from_dict({**MODEL, "max_seq_len": 2**20})
    data = DataConfig(source=str(text), tokenizer="char", val_fraction=0.2)
    with pytest.raises(ConfigError, match=r"model\.max_seq_len=1,048,576 needs at least 96 MiB"):
        train(cfg, data, TrainConfig(seq_len=16, batch_size=2, steps=2), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_rope_tables_the_allocator_refuses_are_one_config_error():
    with pytest.raises(ConfigError, match=r"model\.max_seq_len=70,368,744,177,664: the RoPE tables .* do not fit"):
        Rotary(16, 10000.0, 2**46)  # 256 TB: beyond any address space, refused by the allocator at once


# ------------------------------------------------------------ j8: trainer.json's step against its folder


class Stop(Exception):
    """Stands for a run killed right after a checkpoint was written."""


def interrupted(tmp_path: Path, text: Path, monkeypatch) -> tuple[Path, Path, Path]:
    """(manifest, --out, checkpoint folder) of a run stopped right after its step-2 checkpoint."""
    path, out = manifest(tmp_path, text), tmp_path / "out"
    stop_after_first_checkpoint(monkeypatch, ["run", str(path), "--out", str(out), "--no-progress"])
    return path, out, out / "m" / "base" / "seed0" / "checkpoints" / "step-000002"


@pytest.mark.parametrize(
    "key, value, fragment",
    [("step", 1, "trainer.json: step=1 is not its folder's 2 (step-000002)"),
     ("sampler", 3, "trainer.json: sampler.step=3 is not step=2 (the batches drawn by step 2)")],
)  # fmt: skip
def test_a_checkpoint_whose_trainer_step_disagrees_is_not_resumed(tmp_path, capsys, text, monkeypatch, key, value,
                                                                  fragment):  # fmt: skip
    path, out, folder = interrupted(tmp_path, text, monkeypatch)
    capsys.readouterr()
    edit_trainer(folder, lambda t: t["sampler"].update(step=value) if key == "sampler" else t.update(step=value))
    said = dry_run(capsys, ["run", str(path), "--out", str(out), "--dry-run"])
    assert "would be refused" in said and fragment in said and "would resume" not in said, said
    before = sorted(p.name for p in folder.parent.parent.iterdir())
    line = fails(capsys, ["run", str(path), "--out", str(out), "--no-progress"], fragment, "restore it from a copy")
    assert str(folder / "trainer.json") in line
    assert sorted(p.name for p in folder.parent.parent.iterdir()) == before


# ---------------------------------------------------------------------- j15, j22: bench parameters


def test_bench_memory_cache_dtype_names_its_parameter(run, tmp_path, capsys):
    argv = ["bench", str(run), "--benchmarks", "memory", "--set", "memory.lengths=[16]", "--set",
            "memory.cache_dtype=int8", "--out", str(tmp_path / "b")]  # fmt: skip
    assert fails(capsys, argv, "benchmarks.memory.cache_dtype='int8' is not known (use one of fp32, fp16, bf16",
                 "memory.kv_policy")  # fmt: skip


def test_latency_advice_never_asks_for_prompt_lengths_below_one(run, tmp_path, capsys):
    argv = ["bench", str(run), "--benchmarks", "latency", "--set", "latency.prompt_lengths=[8]", "--set",
            "latency.new_tokens=100", "--out", str(tmp_path / "b")]  # fmt: skip
    line = fails(capsys, argv, "prompt 8 + 100 new tokens exceed", "give new_tokens <= 57 for prompt 8")
    assert "prompt lengths <=" not in line  # (new_tokens 100 > max_seq_len 64: no prompt length would do)
    argv[5], argv[7] = "latency.prompt_lengths=[8,16]", "latency.new_tokens=60"
    assert fails(capsys, argv, "give prompt lengths <= 5 or new_tokens <= 49 for prompts up to 16")
