"""torchrun support: the same command trains with DistributedDataParallel when WORLD_SIZE > 1."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from attnlab.data import prepare
from attnlab.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def _whole(name: str, low: int, text: str | None = None) -> int:
    text = os.environ[name] if text is None else text
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < low:
        raise ConfigError(f"${name}={text!r} must be a whole number >= {low} (start distributed runs with torchrun)")
    return value


def dist_env(join: bool = False) -> DistInfo:
    """The process group torchrun describes in the environment ($WORLD_SIZE, $RANK, $LOCAL_RANK, $MASTER_ADDR),
    checked before anything joins it: ConfigError naming the variable. One process when $WORLD_SIZE is unset (or
    empty, or 1), unless `join` (FSDP joins a group even of one process: then checked as any)."""
    text = os.environ.get("WORLD_SIZE", "").strip()
    world_size = _whole("WORLD_SIZE", 1) if text else 1
    if world_size == 1 and not join and os.environ.get("RANK", "").strip() and _whole("RANK", 0) != 0:  # (stale)
        raise ConfigError(f"$RANK={os.environ['RANK'].strip()} but $WORLD_SIZE is {text or 'unset'}: one process is "
                          "rank 0 (a variable left from another job? unset $RANK, or start with torchrun)")  # fmt: skip
    if world_size == 1 and not join:
        return DistInfo()
    missing = [f"${name}" for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name, "").strip()]
    if missing:
        needs = ", ".join(missing[:-1]) + (" and " if len(missing) > 1 else "") + missing[-1]
        raise ConfigError(f"$WORLD_SIZE={world_size} needs {needs} (start with torchrun, or unset $WORLD_SIZE)")
    rank = _whole("RANK", 0)
    if rank >= world_size:
        raise ConfigError(f"$RANK={rank} must be below $WORLD_SIZE={world_size} (start with torchrun)")
    local_rank = _whole("LOCAL_RANK", 0) if os.environ.get("LOCAL_RANK", "").strip() else 0
    if os.environ.get("MASTER_PORT", "").strip():
        port = _whole("MASTER_PORT", 1)
        if port > 65535:
            raise ConfigError(f"$MASTER_PORT={port} must be a port number from 1 to 65535 (start with torchrun)")
    address = os.environ["MASTER_ADDR"].strip()
    try:  # an address that names no host would be retried without end
        socket.getaddrinfo(address, None)
    except (socket.gaierror, UnicodeError):
        raise ConfigError(f"$MASTER_ADDR={address!r} names no host this machine can resolve (start with torchrun, "
                          "or give the address of rank 0's machine)") from None  # fmt: skip
    return DistInfo(rank, world_size, local_rank)


def init_distributed(device_type: str, join: bool = False) -> DistInfo:
    """Joins the process group torchrun set up (gloo on CPU, nccl on CUDA); a no-op for one process unless `join`
    (FSDP shards over a group even of one process started by torchrun). The environment is checked first
    (dist_env)."""
    info = dist_env(join)
    if (info.enabled or join) and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if os.environ.get("TORCHELASTIC_RUN_ID") or info.world_size == 1:
            dist.init_process_group(backend=backend)
        else:
            _join_by_hand(backend, info)
    return info


def _join_by_hand(backend: str, info: DistInfo) -> None:
    """A group described by variables set by hand (not torchrun: perhaps left over in a shell) may have no other
    processes at all: say what this one waits for, and wait at most $ATTNLAB_DIST_TIMEOUT seconds (default 300)
    instead of torch's 30 minutes; ConfigError when nobody came."""
    text = os.environ.get("ATTNLAB_DIST_TIMEOUT", "").strip()
    seconds = _whole("ATTNLAB_DIST_TIMEOUT", 1) if text else 300
    where = f"{os.environ['MASTER_ADDR'].strip()}:{os.environ['MASTER_PORT'].strip()}"
    print(f"attnlab: process {info.rank} of $WORLD_SIZE={info.world_size} (set by hand, not by torchrun) waits up to "
          f"{seconds} s for the others at {where}", file=sys.stderr, flush=True)  # fmt: skip
    try:
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=seconds))
    except (RuntimeError, TimeoutError) as e:  # DistStoreError (a RuntimeError) when the others never came
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        raise ConfigError(f"$WORLD_SIZE={info.world_size}: the other processes never joined at {where} within "
                          f"{seconds} s (unset $WORLD_SIZE and $RANK to run in one process, start with torchrun, "
                          "or raise $ATTNLAB_DIST_TIMEOUT)") from None  # fmt: skip


def all_reduce_mean(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= info.world_size
    return value


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def prepare_rank0_first(data_cfg, data_dir, info: DistInfo, tokenizer=None):
    """Prepares data on rank 0 while the other ranks wait, then they reuse its cached files. tokenizer: a model's,
    when data_cfg.tokenizer names one (prepare's)."""
    prepared = prepare(data_cfg, data_dir=data_dir, tokenizer=tokenizer) if info.is_main else None
    barrier(info)
    return prepared or prepare(data_cfg, data_dir=data_dir, tokenizer=tokenizer)
