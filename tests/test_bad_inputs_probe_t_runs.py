"""Probe S's findings on runs, fixed after it: a dry run said "would train" where the run refused its local data (not
UTF-8, a JSON line without its text, a damaged parquet file, too few documents for a split) (t1), and "done already"
where the run refused a conversion made with another recipe (t2); `convert --out` inside a run's folder was taken
(t3); a run wrote and pruned through a checkpoints/ link out of its folder (t4); the user's own compare.md was refused
only after the runs had trained (t5)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import dry_run, fails, hat_text, probe_manifest, snapshot

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = "{seq_len: 16, batch_size: 2, steps: 2, warmup_steps: 1, eval_every: 2, eval_tokens: 32}"


def run_line(capsys, command) -> str:
    """What the refused `attnlab run` said after `attnlab run: error: `."""
    return fails(capsys, command).split("error: ", 1)[1]


# ----------------------------------------------------------------------------- t1: the local data, read by a dry run

HATS = "\n\n".join(f"the cat is on the mat and this is the hat number {i}" for i in range(40))
SOURCES = {
    "not utf-8": ("text.txt", HATS.encode() + b"\n\nthe hat \xff\xfe\n", [], "not UTF-8 text (byte 0xff"),
    "not utf-8 past max_tokens": ("text.txt", HATS.encode() + b"\n\nthe hat \xff\n", ["--set", "data.max_tokens=40"],
                                  "not UTF-8 text (byte 0xff"),  # (the run reads a whole batch of 4M characters)
    "a jsonl line without text": ("docs.jsonl", b'{"text": "the cat"}\n{"body": "the hat"}\n', [],
                                  "docs.jsonl:2: no 'text' string field"),
    "a damaged parquet file": ("docs.parquet", b"PAR1 not a parquet file at all", [], "not a readable parquet file"),
    "too few documents for val": ("text.txt", b"one document only, which falls in one split\n", [],
                                  "no document fell in the"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(SOURCES))
def test_t1_a_dry_run_refuses_the_data_the_run_refuses_with_its_line(tmp_path, capsys, case):
    name, content, sets, said = SOURCES[case]
    source = tmp_path / name
    source.write_bytes(content)
    manifest, out = probe_manifest(tmp_path, source, TRAIN), tmp_path / "runs"
    command = ["run", str(manifest), "--out", str(out), "--no-progress", *sets]
    printed = dry_run(capsys, [*command, "--dry-run"])
    line = run_line(capsys, command)
    assert said in line and str(source) in line, line
    assert printed == f"[1/1] base seed0: would be refused: {line}\n"
    assert not (out / "m").exists()
    # validate reads the file too (it is found as given): the same line
    assert main(["validate", str(manifest), *sets]) == 2
    err = capsys.readouterr().err
    assert err == f"{manifest}: {line}\n", err


def test_t1_readable_data_still_would_train_and_prepared_data_is_not_read_again(tmp_path, capsys):
    text = hat_text(tmp_path)
    manifest, out = probe_manifest(tmp_path, text, TRAIN, targets="  a: {}\n  b: {}\n"), tmp_path / "runs"
    command = ["run", str(manifest), "--out", str(out), "--no-progress"]
    printed = dry_run(capsys, [*command, "--dry-run"])
    assert printed.count("would train 2 steps") == 2 and "refused" not in printed
    assert main(["validate", str(manifest)]) == 0
    capsys.readouterr()
    assert main([*command, "--target", "a"]) == 0
    capsys.readouterr()
    printed = dry_run(capsys, [*command, "--dry-run"])
    assert "a seed0: done already" in printed and "b seed0: would train" in printed


def test_t1_a_dry_run_says_which_of_two_sources_the_run_would_refuse(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(HATS.encode() + b"\n\n\xff\n")
    targets = f"  a: {{}}\n  b: {{data: {{source: {bad}}}}}\n"
    manifest, out = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, targets=targets), tmp_path / "runs"
    printed = dry_run(capsys, ["run", str(manifest), "--out", str(out), "--dry-run"])
    lines = printed.splitlines()
    assert lines[0].startswith("[1/2] a seed0: would train"), lines
    assert lines[1].startswith(f"[2/2] b seed0: would be refused: {bad}: not UTF-8 text"), lines


# ----------------------------------------------------------------------------- t2: a conversion of another recipe

RETRO = """name: retro
defaults:
  data: {{source: {corpus}, val_fraction: 0.2}}
  train: {{steps: 2, seq_len: 16, batch_size: 2, eval_every: 2, eval_tokens: 32, lr: 0.001, warmup_steps: 1}}
targets:
  mla:
    init_from: {{model: {source}, calibration_tokens: 256, calibrate_on: {corpus}}}
    model: {{attention: {{kind: mla, d_latent: 16}}}}
    train: {{trainable: ["blocks.*.attn.*"]}}
"""


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama folder (test_pretrained's) and a text to fine-tune and calibrate on."""
    from test_pretrained import random_model, save

    folder = tmp_path_factory.mktemp("retro")
    source = save(random_model("llama", n_kv_heads=2), folder / "llama")
    rng = random.Random(0)
    words = "the cat is on the mat and this is the hat".split()
    corpus = folder / "text.txt"
    corpus.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(30)) for _ in range(60)))
    return source, corpus


@pytest.mark.parametrize("new", ["calibration_tokens: 128", "calibration_tokens: 256, rope_pairs: uniform"])
def test_t2_a_dry_run_refuses_a_conversion_of_another_recipe_as_the_run_does(tmp_path, capsys, pretrained, new):
    source, corpus = pretrained
    path, out = tmp_path / "m.yml", tmp_path / "runs"
    path.write_text(RETRO.format(source=source, corpus=corpus))
    command = ["run", str(path), "--out", str(out), "--no-progress"]
    assert main(command) == 0
    capsys.readouterr()
    assert "done already" in dry_run(capsys, [*command, "--dry-run"])  # the same recipe: skipped
    path.write_text(RETRO.format(source=source, corpus=corpus).replace("calibration_tokens: 256", new))
    before = snapshot(out)
    printed = dry_run(capsys, [*command, "--dry-run"])
    line = run_line(capsys, command)
    assert line.startswith(f"{out / 'retro/mla/converted'} holds a conversion made with another recipe"), line
    assert printed == f"[1/1] mla seed0: would be refused: {line}\n"
    assert main([*command, "--dry-run", "--convert-only"]) == 2
    said = capsys.readouterr()
    assert said.out == f"mla: would be refused: {line}\n"
    assert (
        said.err == f"attnlab run: error: {path}: 1 of 1 conversions would be refused (mla): the reasons are "
        "printed above\n"
    )
    assert fails(capsys, [*command, "--convert-only"]) == f"attnlab run: error: {line}"
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- t3: convert --out inside a run


@pytest.mark.parametrize("inside", ["checkpoints/step-000009", "converted", "tokenizer/mine"])
def test_t3_convert_into_a_run_folder_is_refused(tiny_run, capsys, inside):
    out = tiny_run / inside
    before = snapshot(tiny_run)
    fails(capsys, ["convert", str(tiny_run), "--attention", "kind=mha,n_kv_heads=1", "--eval-tokens", "0",
                   "--out", str(out)], f"--out {out} is inside {tiny_run}, which is a run's folder",
          "a conversion saved there would be taken for the run's own files", "--out converted/NAME")  # fmt: skip
    assert snapshot(tiny_run) == before and not out.exists()


def test_t3_convert_beside_a_run_is_taken(tiny_run, tmp_path, capsys):
    out = tiny_run.parent / "converted-mqa"
    assert main(["convert", str(tiny_run), "--attention", "kind=mha,n_kv_heads=1", "--eval-tokens", "0",
                 "--out", str(out)]) == 0  # fmt: skip
    assert (out / "config.json").is_file()


# ----------------------------------------------------------------------------- t4: links out of a run's folder


WRITTEN = [
    ("checkpoints", "write (and prune) its checkpoints"),
    ("tokenizer", "save its tokenizer"),
    ("metrics.jsonl", "append its metrics"),
]


@pytest.mark.parametrize("name, what", WRITTEN)
def test_t4_a_link_out_of_a_run_folder_is_refused_before_anything_is_written(tmp_path, capsys, name, what):
    manifest, out = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN), tmp_path / "runs"
    run_dir, elsewhere = out / "m" / "base" / "seed0", tmp_path / "elsewhere"
    run_dir.mkdir(parents=True)
    if name == "metrics.jsonl":
        elsewhere.mkdir()
        (elsewhere / "log.jsonl").write_text("")
        (run_dir / name).symlink_to(elsewhere / "log.jsonl")
    else:
        elsewhere.mkdir()
        (run_dir / name).symlink_to(elsewhere)
    target = elsewhere / "log.jsonl" if name == "metrics.jsonl" else elsewhere
    said = (
        f"{run_dir / name}: a link to {target}, outside the run's folder, where the run would {what}",
        f"replace the link with a {'file' if name == 'metrics.jsonl' else 'folder'} of the run's own",
    )
    command = ["run", str(manifest), "--out", str(out), "--no-progress"]
    for argv in ([*command, "--dry-run"], command):
        fails(capsys, argv, *said)
    assert sorted(p.name for p in run_dir.iterdir()) == [name] and snapshot(elsewhere) in ({}, {"log.jsonl": b""})


def test_t4_a_link_into_another_runs_folder_is_refused_too(tmp_path, capsys):
    """Inside --out, but another run's checkpoints: the run would prune them."""
    manifest, out = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, targets="  a: {}\n  b: {}\n"), tmp_path / "runs"
    assert main(["run", str(manifest), "--out", str(out), "--no-progress", "--target", "a"]) == 0
    capsys.readouterr()
    run_dir = out / "m" / "b" / "seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoints").symlink_to("../../a/seed0/checkpoints")
    before = snapshot(out / "m" / "a")
    resolved = out.resolve() / "m/a/seed0/checkpoints"
    fails(
        capsys,
        ["run", str(manifest), "--out", str(out), "--dry-run"],
        f"{run_dir / 'checkpoints'}: a link to ../../a/seed0/checkpoints ({resolved}), outside the run's folder",
    )
    assert snapshot(out / "m" / "a") == before


def test_t4_a_link_inside_the_run_folder_is_taken(tmp_path, capsys):
    manifest, out = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN), tmp_path / "runs"
    run_dir = out / "m" / "base" / "seed0"
    (run_dir / "kept").mkdir(parents=True)
    (run_dir / "checkpoints").symlink_to("kept")
    assert main(["run", str(manifest), "--out", str(out), "--no-progress"]) == 0
    assert any(p.name.startswith("step-") for p in (run_dir / "kept").iterdir())


# ----------------------------------------------------------------------------- t5: the user's own compare.md


@pytest.mark.parametrize("name, content", [("compare.md", b"# my notes\n"), ("compare.csv", b"a,b\n"),
                                           ("val_loss.png", b"\x89PNX mine")])  # fmt: skip
def test_t5_the_users_own_comparison_file_is_refused_before_any_run_trains(tmp_path, capsys, name, content):
    manifest, out = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN), tmp_path / "runs"
    (out / "m").mkdir(parents=True)
    (out / "m" / name).write_bytes(content)
    said = (f"{out / 'm' / name}: not a file attnlab compare wrote (it would be replaced): move it away",)
    command = ["run", str(manifest), "--out", str(out), "--no-progress"]
    for argv in ([*command, "--dry-run"], command):
        fails(capsys, argv, *said)
    assert snapshot(out) == {f"m/{name}": content}  # nothing trained, the user's file as it was
    assert main([*command, "--convert-only", "--dry-run"]) == 2  # (--convert-only compares nothing: its own line)
    assert "no selected target starts from a pretrained model" in capsys.readouterr().err


def test_t5_a_comparison_attnlab_wrote_is_redrawn(tmp_path, capsys):
    manifest, out = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN), tmp_path / "runs"
    command = ["run", str(manifest), "--out", str(out), "--no-progress"]
    assert main(command) == 0 and main(command) == 0
    assert json.dumps((out / "m" / "compare.md").read_text()).startswith('"| target | seeds | params |')


# ----------------------------------------------------------------------------- t6: a device this machine lacks


def test_t6_validate_passes_a_device_this_machine_lacks_with_a_warning_and_the_dry_run_refuses_it(tmp_path, capsys):
    """validate checks the file (it may be meant for another machine): ok, with one warning line; the dry run and
    the run check this machine and refuse it."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    source = tmp_path / "text.txt"
    source.write_text(HATS)
    manifest = probe_manifest(tmp_path, source, TRAIN[:-1] + ", device: cuda}")
    assert main(["validate", str(manifest)]) == 0
    said = capsys.readouterr()
    assert said.out == f"{manifest}: ok (manifest m: 1 targets, 1 seeds, 1 runs)\n"
    assert (
        said.err.count("\n") == 1
        and "warning:" in said.err
        and "train.device=cuda: this machine has no CUDA" in (said.err)
    ), said.err
    line = run_line(capsys, ["run", str(manifest), "--out", str(tmp_path / "runs"), "--dry-run"])
    assert line == "train.device=cuda: this machine has no CUDA (use train.device: auto or cpu)"
