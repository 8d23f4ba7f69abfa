"""train.distributed under torchrun, continued from tests/test_fsdp.py (its helpers and module fixtures, imported):
the launches that need no FSDP run of that module's fixture, in a file of their own so that pytest-xdist can run
them beside it, and the checks of torchrun's variables, a group set by hand and refusals said once."""

from __future__ import annotations

import json
import socket

import pytest
import test_fsdp as fsdp
import torch
from helpers import fails
from test_fsdp import BOUNDED, KINDS, MODEL, TRAIN, close, job, launch, rows, run_under_torchrun, torchrun

import attnlab
from attnlab.cli import main
from attnlab.config import DataConfig, TrainConfig
from attnlab.errors import InputError
from attnlab.train.checkpoint import load_checkpoint
from attnlab.train.loop import train

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")
env, data = fsdp.env, fsdp.data  # the module-scoped fixtures: one prepared-data cache for this module's processes


def test_a_global_batch_the_processes_do_not_divide_is_refused(tmp_path, data, env):
    done = torchrun(2, [job(tmp_path / "run", data, KINDS["mha"], distributed="fsdp", batch_size=3)], tmp_path, env)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert lines and "train.batch_size=3 must be divisible by the 2 processes" in lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_ddp_trains_a_model_with_a_bounded_memory_as_one_process_does(tmp_path, data, env):
    """Probe L's l3: DDP (the default under torchrun) stopped at its second step on a bounded memory's parameters
    that a step does not use ("Expected to have finished reduction in the prior iteration")."""
    run = job(tmp_path / "ddp", data, KINDS["mha"], steps=6, eval_every=6, checkpoint_every=6)
    run["model"]["memory"] = BOUNDED
    done = torchrun(2, [run], tmp_path, env)
    assert done.returncode == 0, done.stderr[-2000:]
    cfg = attnlab.model_config_from_dict({**MODEL, "attention": KINDS["mha"], "memory": BOUNDED})
    changes = {"steps": 6, "eval_every": 6, "checkpoint_every": 6}
    train(cfg, DataConfig(**data), TrainConfig(**{**TRAIN, **changes}), tmp_path / "one", progress=False)
    assert close(rows(tmp_path / "ddp"), rows(tmp_path / "one"))


def test_a_retrofit_manifest_runs_under_torchrun_with_fsdp_unchanged(tmp_path, env):
    """Item 3: the factorial's shape (two conversions of a pretrained model, then phase-two arms through a bounded
    memory) trained by 2 processes with --set train.distributed=fsdp; rank 0 converts, every process trains."""
    from test_pretrained import random_model, save
    from test_retrofit import FACTORIAL

    source = save(random_model("llama", n_kv_heads=2), tmp_path / "llama")
    corpus = tmp_path / "text.txt"
    corpus.write_text("\n\n".join(f"the cat is on the mat and this is the hat {i}" for i in range(60)))
    manifest = tmp_path / "m.yml"
    manifest.write_text(FACTORIAL.format(corpus=corpus, source=source))
    done = run_under_torchrun(manifest, tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    for target in ("gqa", "coda", "gqa_bounded", "coda_bounded"):
        summary = json.loads((tmp_path / "runs" / "fact" / target / "seed0" / "summary.json").read_text())
        assert summary["status"] == "complete" and summary["steps"] == 2, target
        config = json.loads((tmp_path / "runs" / "fact" / target / "seed0" / "config.json").read_text())
        assert config["train"]["distributed"] == "fsdp"
    command = (tmp_path / "runs" / "fact" / "gqa" / "seed0" / "command.txt").read_text()
    assert command.startswith("torchrun --nproc_per_node 2 -m attnlab.cli run ")  # probe I (i5): runnable again
    cfg = load_checkpoint(tmp_path / "runs" / "fact" / "coda_bounded" / "seed0").cfg
    assert (cfg.attention.kind, cfg.memory.kind) == ("coda", "bounded")


def test_a_refusal_on_one_process_is_one_line_on_the_others_too(tmp_path, env):
    """Probe I (i7): rank 0 refuses the data in its line; rank 1, waiting in a collective, printed gloo's traceback.
    Each now says one line (torchrun's own summary of the failed launch follows, as it always does)."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    manifest = tmp_path / "m.yml"
    manifest.write_text(f"name: m\nseeds: [0]\ndefaults:\n  model: {json.dumps(MODEL)}\n  data: {{source: {empty}, "
                        f"tokenizer: char}}\n  train: {json.dumps(TRAIN)}\ntargets:\n  base: {{}}\n")  # fmt: skip
    done = run_under_torchrun(manifest, tmp_path, env)
    assert done.returncode != 0
    assert "[rank1]: Traceback" not in done.stderr and "[rank0]: Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "attnlab run: error:" in line]
    assert len(lines) == 2 and any("empty.txt" in line for line in lines), lines
    assert any("another process ended first" in line for line in lines), lines


@pytest.mark.parametrize(
    ("variables", "fragment"),
    [({"RANK": "3", "MASTER_PORT": "29500"}, "$RANK=3 but $WORLD_SIZE is 1: one process is rank 0"),
     ({"RANK": "0", "MASTER_PORT": "99999"}, "$MASTER_PORT=99999 must be a port number"),
     ({"RANK": "0", "MASTER_PORT": "29500", "MASTER_ADDR": "nonexistent.invalid"},
      "$MASTER_ADDR='nonexistent.invalid' names no host")],
)  # fmt: skip
def test_fsdp_of_one_process_checks_torchruns_variables_before_joining(tmp_path, data, capsys, monkeypatch,
                                                                       variables, fragment):  # fmt: skip
    """Probe I (i14-i16): FSDP joins a group even of one process; its variables were checked only for several (a
    traceback, a hang in the rendezvous, a hang on an address that resolves nowhere)."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    manifest = tmp_path / "m.yml"
    manifest.write_text(f"name: m\nseeds: [0]\ndefaults:\n  model: {json.dumps(MODEL)}\n  data: {json.dumps(data)}\n"
                        f"  train: {json.dumps(TRAIN)}\ntargets:\n  base: {{}}\n")  # fmt: skip
    fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "out"), "--set", "train.distributed=fsdp"], fragment)
    assert not torch.distributed.is_initialized()


def test_dry_run_and_validate_refuse_what_the_run_would(tmp_path, data, capsys, monkeypatch):
    """Probe I (i18, i19): activation checkpointing with a memory, and a batch the torchrun processes do not divide,
    were accepted by validate and --dry-run and refused only once the run started (after earlier targets)."""
    manifest = tmp_path / "m.yml"
    manifest.write_text(f"name: m\nseeds: [0]\ndefaults:\n  model: {json.dumps(MODEL)}\n  data: {json.dumps(data)}\n"
                        f"  train: {json.dumps(TRAIN)}\ntargets:\n  base: {{}}\n")  # fmt: skip
    memory = ["--set", "model.memory={kind: window, recent_window: 8}", "--set", "train.activation_checkpointing=true"]
    fragment = "train.activation_checkpointing=true: model.memory kind 'window'"
    assert main(["validate", str(manifest), *memory]) == 2 and fragment in capsys.readouterr().err
    fails(capsys, ["run", str(manifest), "--dry-run", "--out", str(tmp_path / "o"), *memory], fragment)
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    fails(capsys, ["run", str(manifest), "--dry-run", "--out", str(tmp_path / "o"), "--set", "train.batch_size=3"],
          "targets.base: train.batch_size=3 must be divisible by the 2 processes torchrun started")  # fmt: skip


def test_other_commands_under_torchrun_are_refused(tmp_path, capsys, monkeypatch):
    """Probe I (i20): bench, convert, ... under torchrun ran whole in every process and raced for their outputs."""
    for name, value in {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    assert fails(capsys, ["info", str(tmp_path / "m.yaml")], "only `attnlab run` shares its work among torchrun's")
    monkeypatch.setenv("RANK", "1")  # rank 0 says it (probe I, i24)
    assert main(["info", str(tmp_path / "m.yaml")]) == 2 and capsys.readouterr().err == ""


def test_an_offline_variable_that_is_neither_yes_nor_no_is_one_line(tmp_path, capsys, monkeypatch):
    """Probe I (i23): ATTNLAB_OFFLINE=maybe silently meant online."""
    from attnlab.data.files import downloads_allowed

    monkeypatch.setenv("ATTNLAB_OFFLINE", "maybe")
    with pytest.raises(InputError, match=r"\$ATTNLAB_OFFLINE='maybe' is neither yes nor no"):
        downloads_allowed()
    monkeypatch.setenv("ATTNLAB_OFFLINE", "off")
    assert downloads_allowed()


def test_a_group_set_by_hand_says_what_it_waits_for_and_stops_waiting(tmp_path, data, capsys, monkeypatch):
    """Probe I (i17): $WORLD_SIZE=2 and $RANK=0 left in a shell, no other process: the run waited silently for
    torch's 30 minutes. It now says what it waits for, and stops after $ATTNLAB_DIST_TIMEOUT seconds in one line."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    variables = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "ATTNLAB_DIST_TIMEOUT": "2"}  # fmt: skip
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    manifest = tmp_path / "m.yml"
    manifest.write_text(f"name: m\nseeds: [0]\ndefaults:\n  model: {json.dumps(MODEL)}\n  data: {json.dumps(data)}\n"
                        f"  train: {json.dumps(TRAIN)}\ntargets:\n  base: {{}}\n")  # fmt: skip
    assert main(["run", str(manifest), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    said = err.strip().splitlines()
    assert said[0] == (f"attnlab: process 0 of $WORLD_SIZE=2 (set by hand, not by torchrun) waits up to 2 s for the "
                       f"others at 127.0.0.1:{port}")  # fmt: skip
    gave_up = f"attnlab run: error: $WORLD_SIZE=2: the other processes never joined at 127.0.0.1:{port} within 2 s"
    assert len(said) == 2 and said[1].startswith(gave_up + " (unset $WORLD_SIZE"), said
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("ATTNLAB_DIST_TIMEOUT", "soon")
    fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "out"), "--no-progress"],
          "$ATTNLAB_DIST_TIMEOUT='soon' must be a whole number >= 1")  # fmt: skip


def test_a_refusal_every_process_shares_is_said_once(tmp_path, data, env):
    """Probe I (i24): a config refusal under torchrun was printed by every process, the same line N times. Rank 0
    says it; the others end with exit code 2 quietly (a file one process failed to read is still said by it)."""
    manifest = tmp_path / "m.yml"
    manifest.write_text(f"name: m\nseeds: [0]\ndefaults:\n  model: {json.dumps(MODEL)}\n  data: {json.dumps(data)}\n"
                        f"  train: {json.dumps(TRAIN)}\ntargets:\n  base: {{}}\n")  # fmt: skip
    args = ["-m", "attnlab.cli", "run", str(manifest), "--out", str(tmp_path / "runs"), "--no-progress", "--set",
            "train.batch_size=3"]  # fmt: skip
    done = launch(2, args, env, tmp_path)
    assert done.returncode != 0
    assert done.stderr.count("attnlab run: error:") == 1, done.stderr[-3000:]  # (two copies can share a line)
    assert done.stderr.count("train.batch_size=3 must be divisible by the 2 processes") == 1
