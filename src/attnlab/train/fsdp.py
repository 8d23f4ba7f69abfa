"""train.distributed: fsdp: FSDP2 (torch.distributed.fsdp.fully_shard) over the processes torchrun starts.

Each transformer block is sharded on its own and the whole model (embedding, final norm, LM head) once more, so a
process holds 1/N of every weight, gradient and optimizer state and gathers one block's weights at a time. Frozen
parameters (train.trainable) are sharded too but have no gradient and no optimizer state.

Checkpoints are world-size free: the full state is gathered to rank 0 and written as today's checkpoint (one
model.safetensors, one optimizer.pt whose state is keyed by parameter name), so a run saved by 2 processes resumes
with 1, 2 or 4, with DDP or FSDP, and every other command reads its checkpoints as any other. Gathering costs host
memory on rank 0 (the full weights and optimizer state, in fp32) once per checkpoint; sharded checkpoints (one file
per rank) would avoid that for models of tens of billions of parameters, which this trainer does not aim at.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from attnlab.errors import ConfigError

FULL = {"full_state_dict": True, "cpu_offload": True}


def launched_by_torchrun() -> str | None:
    """Why train.distributed: fsdp cannot join a process group here (it needs torchrun's variables, even for one
    process), or None."""
    names = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
    missing = [f"${name}" for name in names if not os.environ.get(name, "").strip()]
    if not missing:
        return None
    return (f"train.distributed=fsdp needs processes started by torchrun ({', '.join(missing)} unset): run "
            "`torchrun --nproc_per_node N -m attnlab.cli run ...`, or use train.distributed: ddp for one "
            "process")  # fmt: skip


def shard(model: nn.Module, device: torch.device, world_size: int, amp_dtype, cpu_offload: bool) -> nn.Module:
    """`model` sharded in place with fully_shard: each block, then the root. bf16 compute with fp32 gradient
    reduction where amp_dtype says bf16 (the device is fast at it), else fp32; cpu_offload keeps the shards, their
    gradients and the optimizer step in host memory."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    options = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32 if amp_dtype else None),
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy(),
    }
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    # The root returns the logits cut to the true vocabulary (a view); nothing writes into it in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def tied_duplicates(model: nn.Module) -> set[str]:
    """The state-dict names that share their storage with another (a tied LM head), all but the first in sorted
    order: the ones a plain save leaves out (safetensors keeps one name of each shared tensor). Read before
    sharding."""
    seen: dict[tuple, str] = {}
    dropped = set()
    for name, tensor in sorted(model.state_dict().items()):
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            dropped.add(name)
        else:
            seen[key] = name
    return dropped


def gathered_weights(model: nn.Module, dropped: set[str]) -> dict[str, torch.Tensor]:
    """The full weights on rank 0, in host memory (every rank takes part; the others get {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(**FULL))
    return {name: tensor for name, tensor in state.items() if name not in dropped}


def gathered_optimizer(model: nn.Module, optimizer) -> dict:
    """The full optimizer state on rank 0, keyed by parameter name (every rank takes part; the others get {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(**FULL))


def load_full_optimizer(model: nn.Module, optimizer, state: dict) -> None:
    """A full optimizer state keyed by parameter name (every rank read the same file) into the shards. Not strict:
    a parameter that has had no gradient yet (a bounded memory's write gate before the memory writes) has no state,
    as a plain optimizer saves it; the names were checked against the model before (checkpoint._state_problem)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, strict=False)
    set_optimizer_state_dict(model, optimizer, state, options=options)
    for name, param in model.named_parameters():  # torch made a zero state for each (one lr=0 step): a plain
        if name not in state["state"]:  # optimizer has none until the first gradient, so nor does this one
            optimizer.state.pop(param, None)


def load_full_weights(model: nn.Module, weights: dict[str, torch.Tensor], dropped: set[str]) -> None:
    """Full weights (a checkpoint's, read by every rank) into the shards; the tied names a save leaves out point at
    the tensor they share."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    names = set(model.state_dict())
    weights = dict(weights)
    for name in dropped & names:
        if name not in weights:
            twin = next(n for n in sorted(names - dropped) if _same_param(model, n, name))
            weights[name] = weights[twin]
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))


def _same_param(model: nn.Module, a: str, b: str) -> bool:
    params = dict(model.named_parameters(remove_duplicate=False))
    return a in params and b in params and params[a] is params[b]


def sync_gradients(model: nn.Module, sync: bool) -> None:
    """FSDP's no_sync: gradients of the micro-steps before the last one of an update stay unreduced."""
    model.set_requires_gradient_sync(sync)


def check_launch(cfg) -> None:
    """ConfigError when train.distributed: fsdp was asked for outside torchrun."""
    problem = launched_by_torchrun() if cfg.distributed == "fsdp" else None
    if problem:
        raise ConfigError(problem)
