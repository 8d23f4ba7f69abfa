"""`attnlab info REF --memory ...`: the model with another memory; `attnlab info REF --train-memory`: the per-device
memory of a training step, for DDP and FSDP at N devices."""

from __future__ import annotations

import warnings

import torch

from attnlab.cli_models import check_given_once, key_values
from attnlab.config import ModelConfig, untrainable_memory_problem
from attnlab.config_checks import MAX_INT
from attnlab.config_io import memory_from_dict
from attnlab.errors import AttnlabWarning, ConfigError, InputError
from attnlab.model.transformer import build_model
from attnlab.train.memory import train_memory_lines, train_memory_rows
from attnlab.train.optim import trainable_problem

MAX_DEVICES = 1 << 20


def memory_option(text: str):
    """--memory 'kind=bounded,recent_window=256,...' -> MemoryConfig."""
    problems: list[str] = []
    memory = memory_from_dict(key_values("--memory", text, "kind=window,recent_window=256"), problems)
    if problems:
        raise ConfigError([f"--memory: {p}" for p in problems])
    return memory


def _described(memory) -> str:
    slots = f", {memory.slots:,} slots per layer" if memory.slots is not None else ""
    return f"{memory.kind}{slots}"


def with_memory_option(cfg: ModelConfig, text: str) -> ModelConfig:
    """`cfg` with the memory of `info --memory TEXT`. On a model that has a memory of its own, the given one takes its
    place (a what-if, as `convert --memory` replaces it) and one warning line says so; the model's own memory given
    again changes nothing and is refused, as convert refuses a conversion to what the model already is."""
    memory = memory_option(text)
    own = cfg.memory
    if own.kind == "none":
        return cfg.replace(memory=memory)
    if memory == own:
        raise InputError(f"--memory {text} is this model's own memory already ({_described(own)}): it changes "
                         "nothing; leave out --memory, or give another memory to see its figures")  # fmt: skip
    warnings.warn(f"--memory replaces this model's own memory ({_described(own)}) with {_described(memory)}: the "
                  "figures are those of the model with the given memory (leave out --memory for its own)",
                  AttnlabWarning, stacklevel=2)  # fmt: skip
    return cfg.replace(memory=memory)


def add_train_memory_flags(p) -> None:
    p.add_argument("--train-memory", action="store_true",
                   help="also print the per-device memory of a training step (one process, DDP, FSDP), at "
                   "--seq-len")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=8, help="--train-memory: sequences per step, all devices (8)")
    p.add_argument("--devices", default="1,2,4,8", help="--train-memory: numbers of devices (default 1,2,4,8)")
    p.add_argument("--trainable", default=None,
                   help="--train-memory: parameter-name patterns trained, comma-separated (default: all)")  # fmt: skip
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "lion"], help="--train-memory: adamw or lion")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="--train-memory: compute precision (bf16: gathered weights, activations)")  # fmt: skip
    p.add_argument("--activation-checkpointing", action="store_true", help="--train-memory: recompute each block")


DEFAULTS = {"batch_size": 8, "devices": "1,2,4,8", "trainable": None, "optimizer": "adamw", "precision": "fp32",
            "activation_checkpointing": False}  # fmt: skip


def check_train_memory_flags(args) -> None:
    """A --train-memory flag given without --train-memory is one line (it would change nothing)."""
    given = [f"--{key.replace('_', '-')}" for key, value in DEFAULTS.items() if getattr(args, key) != value]
    if given and not args.train_memory:
        raise InputError(f"{', '.join(given)} set{'s' if len(given) == 1 else ''} the training-memory estimate: add "
                         "--train-memory (or leave the flag out)")  # fmt: skip


def _devices(text: str) -> list[int]:
    counts = []
    for item in text.split(","):
        try:
            n = int(item.strip())
        except ValueError:
            n = 0
        if not 1 <= n <= MAX_DEVICES:
            raise InputError(f"--devices {text!r}: {item.strip()!r} is not a number of devices from 1 to "
                             f"{MAX_DEVICES:,} (give a list such as 1,2,4,8)")  # fmt: skip
        counts.append(n)
    check_given_once("--devices", text, counts)
    return sorted(counts)


def train_memory_report(cfg: ModelConfig, args) -> tuple[list[dict], list[str]]:
    """(rows, lines) of --train-memory; InputError naming the flag for a bad value."""
    problem = untrainable_memory_problem(cfg.memory.kind)
    if problem:  # what training refuses has no training memory
        raise InputError(problem)
    if args.activation_checkpointing and cfg.memory.kind != "none":
        raise InputError(f"--activation-checkpointing: training refuses it for a model with memory.kind "
                         f"{cfg.memory.kind!r} (its blocks write the memory as they run): leave the flag "
                         "out")  # fmt: skip
    devices = _devices(args.devices)
    if not 1 <= args.batch_size <= MAX_INT:
        raise InputError(f"--batch-size {args.batch_size} must be a number of sequences from 1 to {MAX_INT:,}")
    if args.devices == DEFAULTS["devices"]:  # the default list: the counts that divide the batch
        devices = [n for n in devices if args.batch_size % n == 0]
    uneven = [n for n in devices if args.batch_size % n]
    if uneven:
        raise InputError(f"--batch-size {args.batch_size} is not divisible by --devices {uneven[0]} (each device "
                         "takes an equal share of the batch: change one of them)")  # fmt: skip
    trainable = None
    if args.trainable is not None:
        trainable = tuple(p.strip() for p in args.trainable.split(",") if p.strip())
        if not trainable:
            raise InputError("--trainable is empty (give name patterns such as 'blocks.*.attn.*', or leave it out)")
        with torch.device("meta"):  # the model's parameter names, nothing allocated
            names = [name for name, _ in build_model(cfg).named_parameters()]
        problem = trainable_problem(names, trainable)
        if problem:
            raise InputError(problem.replace("train.trainable", "--trainable"))
    seq_len = args.seq_len or cfg.max_seq_len
    rows = train_memory_rows(cfg, batch_size=args.batch_size, seq_len=seq_len, devices=devices, trainable=trainable,
                             optimizer=args.optimizer, compute_bytes=2 if args.precision == "bf16" else 4,
                             checkpointing=args.activation_checkpointing)  # fmt: skip
    what = (f"batch {args.batch_size} x {seq_len} tokens over all devices, {args.precision}, {args.optimizer}, "
            f"{'parameters ' + args.trainable if trainable else 'every parameter'} trained"
            f"{', activation checkpointing' if args.activation_checkpointing else ''}")  # fmt: skip
    return rows, train_memory_lines(rows, what)
