"""The per-device training memory estimate (attnlab.train.memory, `attnlab info --train-memory`): activations counted
on the meta device equal what autograd saves on the CPU, byte for byte, for every attention kind; the parts divide
as DDP and FSDP divide them; and the total matches the peak measured on this CPU for a small model."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import CACHE_VARIANTS, fails, tiny_config

import attnlab
from attnlab.cli import main
from attnlab.train.memory import parameter_parts, saved_activation_bytes, training_memory

BENCH = Path(__file__).resolve().parents[1] / "bench" / "distributed.py"


def saved_on_cpu(cfg, batch: int, seq_len: int, trainable=None) -> int:
    """What autograd really saves for the backward pass of a forward pass and loss on the CPU (weights aside)."""
    model = attnlab.build_model(cfg).train()
    for name, p in model.named_parameters():
        p.requires_grad_(trainable is None or any(fnmatch.fnmatchcase(name, t) for t in trainable))
    weights = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    saved = {}

    def pack(t):
        if t.untyped_storage()._cdata not in weights:
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, _ = model(tokens)
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens.reshape(-1))
    return sum(saved.values())


@pytest.mark.parametrize("kind", list(CACHE_VARIANTS))
def test_activations_counted_on_the_meta_device_equal_the_cpu_s(kind):
    cfg = tiny_config(CACHE_VARIANTS[kind], max_seq_len=128)
    for batch, seq_len in ((1, 16), (2, 128)):  # at 128 a (T x T) map would show: MLA's and DIFF's keep one
        assert saved_activation_bytes(cfg, batch, seq_len)["saved"] == saved_on_cpu(cfg, batch, seq_len)
    frozen = ("blocks.*.attn.*",)
    assert saved_activation_bytes(cfg, 2, 32, trainable=frozen)["saved"] == saved_on_cpu(cfg, 2, 32, frozen)


def test_the_parts_divide_as_ddp_and_fsdp_divide_them():
    cfg = tiny_config({"kind": "mha"}, n_layers=4)
    parts = parameter_parts(cfg)
    one = training_memory(cfg, batch_size=8, seq_len=32)
    assert one["weights"] == 4 * parts["total"] and one["gradients"] == 4 * parts["trained"]
    assert one["optimizer"] == 8 * parts["trained"]  # AdamW's two moments
    ddp = training_memory(cfg, batch_size=8, seq_len=32, devices=4)
    assert ddp["weights"] == one["weights"] and ddp["gradients"] == 2 * one["gradients"]  # and its buckets
    assert ddp["activations"] < one["activations"] / 3  # a quarter of the batch each
    fsdp = training_memory(cfg, batch_size=8, seq_len=32, devices=4, mode="fsdp")
    gathered = 4 * (parts["root"] + 2 * parts["block"])
    assert fsdp["weights"] == -(-4 * parts["total"] // 4) + gathered and fsdp["optimizer"] == -(-one["optimizer"] // 4)
    assert fsdp["activations"] == ddp["activations"]
    offload = training_memory(cfg, batch_size=8, seq_len=32, devices=4, mode="fsdp", cpu_offload=True)
    assert offload["weights"] == gathered and offload["optimizer"] == 0
    assert offload["host"] == fsdp["weights"] - gathered + fsdp["optimizer"] + fsdp["gradients"] - 4 * parts["block"]
    frozen = training_memory(cfg, batch_size=8, seq_len=32, trainable=("blocks.*.attn.*",))
    assert frozen["optimizer"] == 8 * parameter_parts(cfg, ("blocks.*.attn.*",))["trained"] < one["optimizer"]
    recomputed = training_memory(cfg, batch_size=8, seq_len=32, checkpointing=True)
    assert recomputed["activations"] < one["activations"]


@pytest.mark.slow
def test_the_estimate_matches_the_peak_measured_on_this_cpu():
    """bench/distributed.py: three steps in one process, in 2 with DDP and in 2 with FSDP (torchrun, gloo)."""
    shape = ["--d-model", "256", "--layers", "4", "--vocab", "8192", "--batch", "4", "--seq-len", "128"]
    done = subprocess.run([sys.executable, str(BENCH), *shape], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    ratios = dict(re.findall(r"^\| (one|ddp|fsdp) \|.*\| ([0-9.]+) \|$", done.stdout, re.M))
    assert set(ratios) == {"one", "ddp", "fsdp"}, done.stdout
    assert all(0.85 <= float(r) <= 1.15 for r in ratios.values()), done.stdout


def test_info_prints_the_table_and_refuses_bad_flags(tmp_path, capsys):
    config = tmp_path / "model.yaml"
    config.write_text("vocab_size: 97\nd_model: 64\nn_layers: 2\nn_heads: 4\nmax_seq_len: 64\n")
    assert main(["info", str(config), "--train-memory", "--devices", "2,1", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "training memory per device, GiB (batch 4 x 64 tokens over all devices, fp32, adamw" in out
    modes = re.findall(r"^\s+(\d+)\s+(one|ddp|fsdp|fsdp\+offload)\s", out, re.M)
    assert modes == [("1", "one"), ("2", "ddp"), ("2", "fsdp"), ("2", "fsdp+offload")]
    fails(capsys, ["info", str(config), "--train-memory", "--devices", "1,x"], "--devices '1,x': 'x' is not a number")
    fails(capsys, ["info", str(config), "--train-memory", "--batch-size", "6", "--devices", "4"],
          "--batch-size 6 is not divisible by --devices 4")  # fmt: skip
    fails(capsys, ["info", str(config), "--train-memory", "--trainable", "blocks.*.atn.*"],
          "--trainable 'blocks.*.atn.*' matches no parameter")  # fmt: skip
    window = ["--memory", "kind=window,recent_window=16", "--activation-checkpointing"]
    refused = [
        (["--batch-size", "4"], "--batch-size sets the training-memory estimate: add --train-memory"),
        (["--train-memory", "--memory", "kind=snapkv,budget=8"], "it has nothing to train"),
        (["--train-memory", *window], "--activation-checkpointing: training refuses it for a model with"),
    ]
    for flags, fragment in refused:
        fails(capsys, ["info", str(config), *flags], fragment)  # probe I: i1, i2, i3
    assert main(["info", str(config), "--train-memory", "--batch-size", "4"]) == 0  # i4: the default list fits it
    assert [n for n, _ in re.findall(r"^\s+(\d+)\s+(one|ddp)\s", capsys.readouterr().out, re.M)] == ["1", "2", "4"]
    bounded = "kind=bounded,recent_window=16,exact_slots=4,summary_slots=4"
    fails(capsys, ["info", str(config), "--train-memory", "--memory", bounded, "--activation-checkpointing"],
          "--activation-checkpointing: training refuses it for a model with memory.kind 'bounded'")  # fmt: skip


@pytest.mark.parametrize("memory", [{"kind": "bounded", "recent_window": 16, "exact_slots": 4, "summary_slots": 4},
                                    {"kind": "streaming", "recent_window": 16, "sink_tokens": 4}])  # fmt: skip
def test_a_memory_the_meta_device_cannot_run_is_counted_on_the_cpu(memory):
    """Bounded and streaming memories read values: counted for one and two sequences through one and two blocks on
    the CPU, then scaled to the layers and the batch; within 3% of what autograd saves for the whole model (the
    bounded banks' writes, and so what they save, depend on the values: two runs differ by up to 1%)."""
    cfg = tiny_config(CACHE_VARIANTS["mha-gqa"], memory, n_layers=3, max_seq_len=64)
    estimate, actual = saved_activation_bytes(cfg, 3, 48)["saved"], saved_on_cpu(cfg, 3, 48)
    assert abs(estimate / actual - 1) < 0.03, (estimate, actual)
