"""torchrun support: the same command trains with DistributedDataParallel when WORLD_SIZE > 1."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from attnlab.data import prepare


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


def init_distributed(device_type: str) -> DistInfo:
    """Joins the process group torchrun set up (gloo on CPU, nccl on CUDA); a no-op for one process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return info


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
