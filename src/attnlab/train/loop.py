"""The training loop: one function, `train`, driven by a ModelConfig, DataConfig and TrainConfig."""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from attnlab.accounting import kv_report, param_counts
from attnlab.config import DataConfig, ModelConfig, TrainConfig, idle_memory_problem, untrainable_memory_problem
from attnlab.data import BatchSampler
from attnlab.data.files import atomic_write_text, sealed
from attnlab.data.prepared_meta import _redo
from attnlab.data.sampler import eval_window_problem
from attnlab.data.tokenizers import tokenizer_copy_problem, tokenizer_record
from attnlab.errors import ConfigError, DataError, DivergedError
from attnlab.model.transformer import build_model
from attnlab.paths import SUMMARY_STATUS
from attnlab.train.budget import batch_memory_problem, positions_memory_problem
from attnlab.train.checkpoint import (
    WEIGHTS,
    CheckpointError,
    find_checkpoint,
    load_model_from_checkpoint,
    load_optimizer,
    load_resumed_weights,
    load_weights,
    recorded_checksums,
    save_checkpoint,
    unwrap,
    verify_file,
    write_json_atomic,
)
from attnlab.train.distributed import all_reduce_mean, barrier, init_distributed, prepare_rank0_first
from attnlab.train.evaluate import evaluate_split
from attnlab.train.fsdp import (
    check_launch,
    gathered_optimizer,
    gathered_weights,
    is_sharded,
    load_full_weights,
    shard,
    sync_gradients,
    tied_duplicates,
)
from attnlab.train.logging import MetricsLog
from attnlab.train.optim import build_optimizer, freeze, lr_at
from attnlab.train.resume import (
    check_resume,
    data_fingerprint,
    prepared_data_check,
    resumed_files_problem,
    trainer_problem,
    trainer_values,
)
from attnlab.train.warm_start import misfits as weight_misfits
from attnlab.train.warm_start import reading_problem


def pick_device(name: str) -> torch.device:
    """train.device as a torch device; ConfigError when this machine has no such device."""
    if name != "auto":
        device = torch.device(name)
        if device.type == "cuda" and (
            not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()
        ):
            have = f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA"
            raise ConfigError(f"train.device={name}: this machine has {have} (use train.device: auto or cpu)")
        if device.type == "mps" and not torch.backends.mps.is_available():
            raise ConfigError(f"train.device={name}: this machine has no MPS device (use train.device: auto or cpu)")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def vocab_problem(model_vocab: int, tokenizer_vocab: int) -> str | None:
    """A model.vocab_size too small for the prepared data's tokenizer (checked by train and run --dry-run)."""
    if model_vocab >= tokenizer_vocab:
        return None
    return (f"model vocab_size={model_vocab} is smaller than the tokenizer's {tokenizer_vocab} (leave vocab_size "
            "out of the manifest to take the tokenizer's)")  # fmt: skip


def check_training_data(prepared, train_cfg: TrainConfig, run_dir: str | Path) -> None:
    """What `train` checks of its prepared data before it writes anything (run --dry-run makes the same checks):
    every split's sha256 and id range (Prepared.verify reads each .bin once, ~1.5 GB/s), a 'val' split, the tokenizer
    loaded from the folder, an evaluation window in the val and test splits (scored in training and at the end), and
    the run's own tokenizer/ copy, if it has one, unchanged (never overwritten). DataError naming the file."""
    prepared.verify()
    prepared.split("val")  # a data without one is refused here already
    tokenizer = prepared.tokenizer
    for split in ("val", "test"):
        if split not in prepared.splits:
            continue
        tokens = prepared.meta["splits"][split]["tokens"]
        budget = (train_cfg.test_tokens or tokens) if split == "test" else train_cfg.eval_tokens
        problem = eval_window_problem(tokens, train_cfg.seq_len, budget)
        if problem:
            file = prepared.path / prepared.meta["splits"][split]["file"]
            raise DataError(f"{file} ({split} split): {problem}; lower train.seq_len, or prepare more data "
                            f"({_redo(prepared.path)})")  # fmt: skip
    problem = tokenizer_copy_problem(tokenizer, prepared.path, Path(run_dir) / "tokenizer")
    if problem:
        raise DataError(problem)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast only where the device is fast at it: on this kind of CPU bf16 matmuls run ~300x
    slower than fp32, so `auto` means fp32 on the CPU."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def full_config(model: ModelConfig, data: DataConfig, train: TrainConfig) -> dict:
    """The run's config as it is saved (JSON's types: lists, not tuples, so a resumed run compares equal)."""
    return json.loads(json.dumps({"model": model.to_dict(), "data": asdict(data), "train": asdict(train)}))


def resumed_state(checkpoint, sampler: BatchSampler) -> dict:
    """The trainer state saved with `checkpoint` (its trainer.json), every value checked before it is used (a
    number >= 0 of the right type, train.resume.trainer_problem); `sampler` continues from it. CheckpointError naming
    the file and key."""
    problem = trainer_problem(checkpoint, sampler.state_dict())
    if problem:
        raise CheckpointError(problem)
    sampler.load_state_dict(checkpoint.trainer["sampler"])
    values = trainer_values(checkpoint.trainer)
    return {key: value for key, value in values.items() if "." not in key}


def train(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    train_cfg: TrainConfig,
    run_dir: str | Path,
    *,
    prepared=None,
    data_dir: str | None = None,
    resume: bool = True,
    init_from: str | Path | None = None,
    progress: bool = True,
    run_files: dict[str, str] | None = None,
) -> dict:
    """Trains into run_dir (metrics.jsonl, checkpoints/, summary.json) and returns the summary.

    With resume (the default) an existing last checkpoint is continued exactly: the same batches, learning
    rates and optimizer state, so the losses equal those of an uninterrupted run. init_from starts from
    another run's weights (a previous phase) with a fresh optimizer and schedule. Nothing is written into run_dir
    before every check has passed (a refused resume leaves the folder as it was); `run_files` ({name: text}, the
    runner's config.yaml and command.txt) are written then, with config.json.
    """
    run_dir = Path(run_dir)
    device = pick_device(train_cfg.device)
    check_launch(train_cfg)
    problem = untrainable_memory_problem(model_cfg.memory.kind) or idle_memory_problem(train_cfg.seq_len,
                                                                                     model_cfg.memory)  # fmt: skip
    if problem:
        raise ConfigError(problem)
    sharded = train_cfg.distributed == "fsdp"
    dist_info = init_distributed(device.type, join=sharded)
    if dist_info.enabled and device.type == "cuda":
        device = torch.device("cuda", dist_info.local_rank)
    if train_cfg.batch_size % dist_info.world_size:
        raise ConfigError(
            f"train.batch_size={train_cfg.batch_size} must be divisible by the {dist_info.world_size} processes"
        )
    if train_cfg.activation_checkpointing and model_cfg.memory.kind != "none":
        raise ConfigError(
            f"train.activation_checkpointing=true: model.memory kind {model_cfg.memory.kind!r} writes "
            "its memory as each block runs, which recomputing a block would repeat (turn one off)"
        )
    if model_cfg.max_seq_len < train_cfg.seq_len:
        raise ConfigError(f"train.seq_len={train_cfg.seq_len} exceeds model max_seq_len={model_cfg.max_seq_len}")
    prepared = prepared or prepare_rank0_first(data_cfg, data_dir, dist_info)
    check_training_data(prepared, train_cfg, run_dir)  # before anything is written
    val_tokens = prepared.split("val")  # scored every eval_every steps
    problem = vocab_problem(model_cfg.vocab_size, prepared.vocab_size)
    if problem:
        raise ConfigError(problem)
    problem = batch_memory_problem(model_cfg, train_cfg, model_cfg.vocab_size) or positions_memory_problem(model_cfg)
    if problem:
        raise ConfigError(problem)
    config = full_config(model_cfg, data_cfg, train_cfg)

    torch.manual_seed(train_cfg.seed)
    model = build_model(model_cfg).to(device)
    model.checkpoint_blocks = train_cfg.activation_checkpointing
    freeze(model, train_cfg.trainable)
    sampler = BatchSampler(
        prepared.split("train"), train_cfg.seq_len, train_cfg.batch_size // dist_info.world_size, train_cfg.seed,
        rank=dist_info.rank, world_size=dist_info.world_size,
    )  # fmt: skip
    state = {"step": 0, "tokens": 0, "best_val_loss": None, "train_seconds": 0.0, "window_loss": 0.0, "window_steps": 0}
    checkpoint = find_checkpoint(run_dir) if resume else None
    if checkpoint is not None:
        data_problem = prepared_data_check(prepared.meta, data_cfg.source, str(run_dir))
        check_resume(checkpoint, config, sampler.state_dict(), data_problem)  # the same config, data and sampler
        problem = resumed_files_problem(run_dir, checkpoint, config, yaml_copy="config.yaml" in (run_files or {}))
        if problem:  # the files written again below: a damaged one is named, not silently replaced
            raise DataError(problem)
        # Every file is checked (sha256) before it is used; a refusal leaves the run folder as it was.
        load_resumed_weights(model, checkpoint)  # into the whole model, before it is sharded
        state.update(resumed_state(checkpoint, sampler))
    elif init_from is not None:
        previous_cfg, previous = load_model_from_checkpoint(init_from, tag="last")
        # A phase may add a bounded memory: its write gate and EMA rate are new (freshly initialised);
        # any other missing or unexpected weight means the phases do not fit together (train.warm_start).
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        wrong, _ = weight_misfits(shapes, {k: v.shape for k, v in previous.state_dict().items()})
        if wrong:
            raise ConfigError(
                f"{init_from}: its weights do not fit this model's shapes ({', '.join(wrong[:3])}"
                f"{', ...' if len(wrong) > 3 else ''}): init_from needs the same architecture and vocabulary"
            )
        problem = reading_problem(model_cfg, previous_cfg, "this checkpoint's")  # the same shapes, read alike?
        if problem:
            raise ConfigError(f"{init_from} (init_from): this run's model {problem.removeprefix('its model ')}")
        missing, unexpected = model.load_state_dict(previous.state_dict(), strict=False)
        misfits = [k for k in missing if ".memory." not in k] + list(unexpected)
        if misfits:
            raise ConfigError(
                f"{init_from}: its weights do not fit this phase's model ({', '.join(misfits[:4])}"
                f"{', ...' if len(misfits) > 4 else ''}): only a bounded memory may be added between phases"
            )

    dropped = tied_duplicates(model)  # what a save leaves out (a tied LM head): read before sharding
    amp_dtype = autocast_dtype(train_cfg.precision, device)
    if sharded:
        shard(model, device, dist_info.world_size, amp_dtype, train_cfg.cpu_offload)
    optimizer = build_optimizer(model, train_cfg)  # over the shards, with FSDP
    if checkpoint is not None:
        load_optimizer(optimizer, checkpoint, model)

    started_over = not resume and any((Path(run_dir) / "checkpoints").glob("step-*"))  # over an earlier run's
    log = MetricsLog(run_dir, enabled=dist_info.is_main, resume_step=state["step"], train_cfg=train_cfg,
                     pending=started_over)  # fmt: skip
    saved_tokenizer = None  # what the checkpoints record of the tokenizer saved with the run (rank 0 writes them)
    if dist_info.is_main:
        for name, text in (run_files or {}).items():
            atomic_write_text(run_dir / name, text)
        write_json_atomic(run_dir / "config.json", config)
        (run_dir / "tokenizer").mkdir(parents=True, exist_ok=True)
        prepared.tokenizer.save(run_dir / "tokenizer")  # so the run can be evaluated without its data
        saved_tokenizer = tokenizer_record(prepared.tokenizer, run_dir / "tokenizer")  # a swapped one is refused
    train_model = model
    if train_cfg.compile:
        train_model = torch.compile(train_model)
    if dist_info.enabled and not sharded:
        # A bounded memory's write gate and EMA rate take part in a step only when the step's tokens reach its banks
        # in a way that uses them: DDP must look for the parameters a step left out, or it waits for them forever.
        unused = model.cfg.memory.kind == "bounded"
        train_model = torch.nn.parallel.DistributedDataParallel(train_model, find_unused_parameters=unused)
    data = data_fingerprint(prepared.meta)  # in every checkpoint: a resume on other data is refused

    def run_eval() -> dict:  # every process scores its share of the windows
        size = train_cfg.seq_len, train_cfg.batch_size, train_cfg.eval_tokens
        return evaluate_split(model if sharded else unwrap(model), val_tokens, *size, device, amp_dtype, dist_info)

    def save(tags) -> None:
        trainer = {**state, "sampler": sampler.state_dict(), "tokenizer": saved_tokenizer, "data": data}
        # A sharded model's full state is gathered to rank 0 (every process takes part) and saved as one model's.
        gathered = (gathered_weights(model, dropped), gathered_optimizer(model, optimizer)) if sharded else None
        if dist_info.is_main:
            save_checkpoint(run_dir, model, optimizer, trainer, config, tags, gathered)
            log.commit()
        barrier(dist_info)

    tokens_per_step = train_cfg.batch_size * train_cfg.grad_accum * train_cfg.seq_len
    bar = log.progress_bar(train_cfg.steps, state["step"], progress)
    model.train()
    window_start, resumed_steps = time.perf_counter(), state["window_steps"]  # steps of the row timed before
    while state["step"] < train_cfg.steps:
        step = state["step"]
        lr = lr_at(step, train_cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss = torch.zeros((), device=device)
        for micro in range(train_cfg.grad_accum):
            x, y = (t.to(device, non_blocking=True) for t in sampler.next_batch())
            sync = micro == train_cfg.grad_accum - 1 or not dist_info.enabled
            if sharded:
                sync_gradients(model, sync)
            with contextlib.nullcontext() if sync or sharded else train_model.no_sync():
                with torch.autocast(device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                    logits, _ = train_model(x)
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
                (loss / train_cfg.grad_accum).backward()
            step_loss += loss.detach() / train_cfg.grad_accum
        # The norm over every gradient (of all shards, with FSDP); without train.grad_clip only measured.
        trained = [p for p in model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(trained, train_cfg.grad_clip or math.inf)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1
        state["tokens"] += tokens_per_step
        loss_value = all_reduce_mean(step_loss, dist_info).item()
        if not math.isfinite(loss_value):
            raise DivergedError(f"{run_dir}: the loss became {loss_value} at step {step} (lower train.lr, set "
                                "train.grad_clip or a smaller model.init_std)")  # fmt: skip
        state["window_loss"] += loss_value
        state["window_steps"] += 1
        if state["step"] % train_cfg.log_every == 0 or state["step"] == train_cfg.steps:
            elapsed = time.perf_counter() - window_start
            state["train_seconds"] += elapsed
            timed = state["window_steps"] - resumed_steps  # the steps this process ran and timed
            row = {
                "step": state["step"], "tokens": state["tokens"], "loss": state["window_loss"] / state["window_steps"],
                "lr": lr, "grad_norm": float(grad_norm), "tok_per_s": timed * tokens_per_step / max(elapsed, 1e-9),
            }  # fmt: skip
            log.write(row)
            log.advance(bar, timed, row)
            state["window_loss"], state["window_steps"], resumed_steps = 0.0, 0, 0
            window_start = time.perf_counter()
        is_last = state["step"] == train_cfg.steps
        if state["step"] % train_cfg.eval_every == 0 or is_last:
            result = run_eval()  # the same on every process
            tags = ["last"]
            log.write({"step": state["step"], "tokens": state["tokens"], "val_loss": result["loss"],
                       "val_ppl": result["ppl"]})  # fmt: skip
            best = state["best_val_loss"]
            if best is None or result["loss"] < best:
                state["best_val_loss"] = result["loss"]
                tags.append("best")
            save(tags)
            window_start = time.perf_counter()  # evaluation and checkpointing are not training time
        elif state["step"] % train_cfg.checkpoint_every == 0:
            save(["last"])
            window_start = time.perf_counter()
    log.close(bar)
    summary = finish(model, prepared, train_cfg, state, config, run_dir, device, amp_dtype, dist_info, dropped)
    return summary


def finish(model, prepared, train_cfg, state, config, run_dir, device, amp_dtype, dist_info, dropped) -> dict:
    """Final validation (and test, where the dataset has one) loss of the best checkpoint, scored by every process
    (its share of the windows); summary.json."""
    summary = {"status": SUMMARY_STATUS, "steps": state["step"], "tokens": state["tokens"]}
    best = find_checkpoint(run_dir, "best")
    if best is not None and is_sharded(model):
        load_full_weights(model, load_file(verify_file(best.path, WEIGHTS, recorded_checksums(best.path))), dropped)
    elif best is not None:
        load_weights(model, best, exact=True)  # (the run's own: in the dtype it saves)
    scored = model if is_sharded(model) else unwrap(model)
    for split in ("val", "test"):
        if split not in prepared.splits:
            continue
        tokens = prepared.split(split)  # validation: the in-training windows; test: test_tokens, else the whole split
        budget = (train_cfg.test_tokens or len(tokens)) if split == "test" else train_cfg.eval_tokens
        result = evaluate_split(scored, tokens, train_cfg.seq_len, train_cfg.batch_size, budget, device, amp_dtype,
                                dist_info)  # fmt: skip
        summary.update(
            {f"{split}_loss": result["loss"], f"{split}_ppl": result["ppl"], f"{split}_tokens": result["tokens"]}
        )
    if dist_info.is_main:
        model_cfg = unwrap(model).cfg
        summary.update(
            best_step=best.step if best else state["step"],
            params=param_counts(model_cfg)["total"],
            kv_bytes_per_token_fp16=kv_report(model_cfg, "fp16")["kv_bytes_per_token"],
            train_tok_per_s=state["tokens"] / max(state["train_seconds"], 1e-9),
            train_seconds=state["train_seconds"],
            config_hash=model_cfg.config_hash(),
        )
        write_json_atomic(Path(run_dir) / "summary.json", sealed(summary))  # (a copy changed later is refused)
    barrier(dist_info)
    return summary
