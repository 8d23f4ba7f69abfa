"""train.distributed: fsdp (FSDP2 under torchrun, 2 CPU processes with gloo) against one process: the same losses
for each attention kind with gradient accumulation and clipping on, checkpoints that resume on another number of
processes (and with DDP or one process), frozen parameters that stay frozen and hold no optimizer state, and bad
launches refused in one line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import fails, hat_text
from safetensors.torch import load_file

import attnlab
from attnlab.config import DataConfig, TrainConfig
from attnlab.data.prepared import prepare
from attnlab.errors import ConfigError
from attnlab.train.checkpoint import load_checkpoint
from attnlab.train.loop import train

WORKER = Path(__file__).with_name("fsdp_worker.py")
TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
MODEL = {"vocab_size": 40, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32, "init_std": 0.05}
KINDS = {
    "mha": {"kind": "mha", "n_kv_heads": 2},
    "decoupled": {"kind": "decoupled", "d_sem": 8, "d_geo": 16},
    "mla": {"kind": "mla", "d_latent": 16},
    "coda": {"kind": "coda", "gate_bias": 0.0},
}
BOUNDED = {"kind": "bounded", "recent_window": 8, "exact_slots": 4, "summary_slots": 4}
TRAIN = {"seq_len": 16, "batch_size": 4, "grad_accum": 2, "steps": 20, "lr": 3e-3, "warmup_steps": 2,
         "grad_clip": 0.5, "eval_every": 10, "eval_tokens": 96, "log_every": 1, "checkpoint_every": 10}  # fmt: skip

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One prepared-data cache for this module's processes, no torchrun variables in this one."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache))
        patch.setenv("ATTNLAB_OFFLINE", "1")
        for name in TORCHRUN_VARS:
            patch.delenv(name, raising=False)
        yield {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def data(tmp_path_factory, env) -> dict:
    text = hat_text(tmp_path_factory.mktemp("text"))
    fields = {"source": str(text), "tokenizer": "char", "val_fraction": 0.2}
    prepare(DataConfig(**fields))  # once, before the processes read it
    return fields


def launch(nproc: int, args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N ARGS` on a free local port."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(port), *args]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=cwd)


def torchrun(nproc: int, jobs: list[dict], folder: Path, env: dict) -> subprocess.CompletedProcess:
    spec = folder / f"jobs-{len(list(folder.glob('jobs-*')))}.json"
    spec.write_text(json.dumps(jobs))
    return launch(nproc, [str(WORKER), str(spec)], env, folder)


def run_under_torchrun(manifest: Path, folder: Path, env: dict) -> subprocess.CompletedProcess:
    """`attnlab run MANIFEST` by 2 processes with FSDP, into folder/runs."""
    args = ["-m", "attnlab.cli", "run", str(manifest), "--out", str(folder / "runs"), "--no-progress", "--set",
            "train.distributed=fsdp"]  # fmt: skip
    return launch(2, args, env, folder)


def rows(run: Path, key: str = "loss") -> dict[int, float]:
    found = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if key in row:
            found[row["step"]] = row[key]
    return found


def job(run: Path, data: dict, attention: dict, stop_at=None, **train) -> dict:
    return {"model": {**MODEL, "attention": attention}, "data": data, "train": {**TRAIN, **train},
            "run_dir": str(run), "stop_at": stop_at}  # fmt: skip


def one_process(run: Path, data: dict, attention: dict, **changes) -> dict:
    cfg = attnlab.model_config_from_dict({**MODEL, "attention": attention})
    return train(cfg, DataConfig(**data), TrainConfig(**{**TRAIN, **changes}), run, progress=False)


def close(a: dict[int, float], b: dict[int, float], tol: float = 2e-4) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= tol for k in a)


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, data, env) -> Path:
    """Under one torchrun of 2 processes: each kind trained 20 steps with FSDP; mha once more interrupted after its
    step-10 checkpoint, once with the attention alone trainable, and once with activation checkpointing and CPU
    offload; mha with a bounded memory whole and interrupted after step 10."""
    root = tmp_path_factory.mktemp("fsdp")
    jobs = [job(root / kind, data, attention, distributed="fsdp") for kind, attention in KINDS.items()]
    jobs += [
        job(root / "stopped", data, KINDS["mha"], stop_at=10, distributed="fsdp"),
        job(root / "stopped-to-1", data, KINDS["mha"], stop_at=10, distributed="fsdp"),
        job(root / "stopped-to-ddp", data, KINDS["mha"], stop_at=10, distributed="fsdp"),
        job(root / "frozen", data, KINDS["mha"], distributed="fsdp", trainable=["blocks.*.attn.*"]),
        job(root / "offload", data, KINDS["mha"], distributed="fsdp", activation_checkpointing=True, cpu_offload=True),
        bounded(job(root / "bounded", data, KINDS["mha"], distributed="fsdp")),
        bounded(job(root / "bounded-stopped", data, KINDS["mha"], stop_at=10, distributed="fsdp")),
    ]
    done = torchrun(2, jobs, root, env)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def bounded(spec: dict) -> dict:
    spec["model"]["memory"] = BOUNDED
    return spec


@pytest.fixture(scope="module")
def resumed_with_two(fsdp_runs, data, env) -> Path:
    """The interrupted runs of fsdp_runs that resume under 2 processes, resumed under one torchrun."""
    jobs = [job(fsdp_runs / "stopped", data, KINDS["mha"], distributed="fsdp"),
            bounded(job(fsdp_runs / "bounded-stopped", data, KINDS["mha"], distributed="fsdp"))]  # fmt: skip
    resumed = torchrun(2, jobs, fsdp_runs, env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return fsdp_runs


@pytest.mark.parametrize("kind", list(KINDS))
def test_fsdp_losses_equal_one_process(kind, fsdp_runs, data, tmp_path):
    summary = one_process(tmp_path / "one", data, KINDS[kind])
    sharded = json.loads((fsdp_runs / kind / "summary.json").read_text())
    assert close(rows(fsdp_runs / kind), rows(tmp_path / "one")) and len(rows(tmp_path / "one")) == 20
    assert close(rows(fsdp_runs / kind, "val_loss"), rows(tmp_path / "one", "val_loss"))
    assert close(rows(fsdp_runs / kind, "grad_norm"), rows(tmp_path / "one", "grad_norm"), 1e-3)
    assert abs(sharded["val_loss"] - summary["val_loss"]) <= 2e-4  # both processes score half of the windows each
    assert sharded["val_tokens"] == summary["val_tokens"] == 96


def test_activation_checkpointing_and_cpu_offload_change_nothing(fsdp_runs):
    assert close(rows(fsdp_runs / "offload"), rows(fsdp_runs / "mha"), 1e-5)


def test_a_save_of_two_processes_resumes_with_two_bit_exactly(resumed_with_two):
    runs = resumed_with_two
    assert rows(runs / "stopped") == rows(runs / "mha")  # the same processes: the same floats
    assert rows(runs / "stopped", "val_loss") == rows(runs / "mha", "val_loss")


def test_an_fsdp_run_with_a_bounded_memory_resumes_bit_exactly(resumed_with_two):
    """Probe O's o11: every resume of an FSDP run with a bounded memory was refused: "step-000030/optimizer.pt: not
    a readable optimizer state (RuntimeError: Missing optimizer state for parameter 'blocks.0.memory.write' ...): it
    was truncated or damaged; ... delete checkpoints" (a parameter without a gradient yet has no state, and torch's
    FSDP loader was strict). The file was fine; the run now resumes and ends on the uninterrupted run's weights."""
    final = [resumed_with_two / name / "checkpoints" / "step-000020" for name in ("bounded", "bounded-stopped")]
    assert (final[0] / "model.safetensors").read_bytes() == (final[1] / "model.safetensors").read_bytes()
    moments = [torch.load(folder / "optimizer.pt", weights_only=True)["optimizer"]["state"] for folder in final]
    assert moments[0].keys() == moments[1].keys()  # no state made up for the parameters that had none


def test_a_save_of_two_processes_resumes_with_one(fsdp_runs, data, env):
    assert max(rows(fsdp_runs / "stopped-to-1")) == 10
    resumed = torchrun(1, [job(fsdp_runs / "stopped-to-1", data, KINDS["mha"], distributed="fsdp")], fsdp_runs, env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert close(rows(fsdp_runs / "stopped-to-1"), rows(fsdp_runs / "mha"))
    assert max(rows(fsdp_runs / "stopped-to-1")) == 20


def test_a_save_of_fsdp_resumes_in_one_plain_process(fsdp_runs, data):
    """The checkpoint is one model's: train.distributed is how the work is spread, not part of the config."""
    one_process(fsdp_runs / "stopped-to-ddp", data, KINDS["mha"])
    assert close(rows(fsdp_runs / "stopped-to-ddp"), rows(fsdp_runs / "mha"))
    loaded = load_checkpoint(fsdp_runs / "stopped-to-ddp")  # and every command reads it as any other
    assert loaded.cfg.attention.kind == "mha"


def test_frozen_parameters_stay_frozen_and_hold_no_optimizer_state(fsdp_runs):
    folder = load_checkpoint(fsdp_runs / "frozen").folder
    torch.manual_seed(TRAIN.get("seed", 0))
    start = attnlab.build_model(attnlab.model_config_from_dict({**MODEL, "attention": KINDS["mha"]})).state_dict()
    saved = load_file(folder / "model.safetensors")
    assert set(saved) == set(start) - {"lm_head.weight"}  # the tied head is saved once, as one process saves it
    moved = {name for name in saved if not torch.equal(saved[name], start[name])}
    assert moved == {name for name in saved if ".attn." in name}
    state = torch.load(folder / "optimizer.pt", weights_only=True)["optimizer"]
    assert set(state["state"]) == moved  # moments of the trained parameters only, keyed by name


def test_fsdp_without_torchrun_is_refused_in_one_line(tmp_path, data):
    with pytest.raises(ConfigError, match=r"train\.distributed=fsdp needs processes started by torchrun "
                       r"\(\$WORLD_SIZE, \$RANK, \$MASTER_ADDR, \$MASTER_PORT unset\)"):  # fmt: skip
        one_process(tmp_path / "run", data, KINDS["mha"], distributed="fsdp")
    assert not (tmp_path / "run").exists()


def test_activation_checkpointing_computes_the_same_gradients():
    cfg = attnlab.model_config_from_dict({**MODEL, "attention": KINDS["coda"]})
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = attnlab.build_model(cfg).train()
        model.checkpoint_blocks = recompute
        logits, _ = model(torch.randint(0, 40, (2, 16)))
        logits.square().mean().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-7, rtol=1e-6) for n in grads[0])


def test_activation_checkpointing_with_a_memory_is_refused(tmp_path, data):
    cfg = attnlab.model_config_from_dict({**MODEL, "memory": BOUNDED})
    with pytest.raises(ConfigError, match="train.activation_checkpointing=true: model.memory kind 'bounded'"):
        train(cfg, DataConfig(**data), TrainConfig(**{**TRAIN, "activation_checkpointing": True}), tmp_path / "r",
              progress=False)  # fmt: skip


def test_run_with_fsdp_outside_torchrun_is_one_line_and_exit_2(tmp_path, data, capsys):
    manifest = tmp_path / "m.yml"
    manifest.write_text(f"name: m\nseeds: [0]\ndefaults:\n  model: {json.dumps(MODEL)}\n  data: {json.dumps(data)}\n"
                        f"  train: {json.dumps(TRAIN)}\ntargets:\n  base: {{}}\n")  # fmt: skip
    for dry in ([], ["--dry-run"]):
        fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "out"), "--set", "train.distributed=fsdp", *dry],
              "train.distributed=fsdp needs processes started by torchrun", "torchrun --nproc_per_node N")  # fmt: skip
    assert not (tmp_path / "out").exists()
    fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "out"), "--set", "train.distributed=fdsp"],
          "train.distributed='fdsp' is not known (use ddp or fsdp)")  # fmt: skip
    fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "out"), "--set", "train.cpu_offload=true"],
          "train.cpu_offload=true needs train.distributed: fsdp")  # fmt: skip
