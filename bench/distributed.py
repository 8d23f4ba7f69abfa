"""Training in one process, with DDP and with FSDP on this CPU: the per-device memory `attnlab info REF
--train-memory` estimates against the peak measured, and the time of a step.

    python bench/distributed.py [--d-model 512 --layers 8 --vocab 16384 --batch 8 --seq-len 256] [--time]

Memory: three training steps (forward, backward, clipping, AdamW) of a model of that shape in one process, in 2
processes with DDP and in 2 with FSDP (torchrun, gloo), each process measuring its peak resident memory above what it
held before the model was built (getrusage's maxrss; glibc returns large blocks to the system when freed, so the
peak is the step's). Prints the estimate, the measurement and their ratio per mode; memory does not depend on the
CPU's load.

--time: instead, the median time of a step (of 10, after 2 unmeasured) and the training tokens per second: one
process with 2 threads against 2 processes of 1 thread each with DDP and with FSDP, the same global batch; the
modes run in turn, `--rounds` times (the CPU may be shared: compare within a round).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnlab
from attnlab.config import TrainConfig
from attnlab.train.memory import training_memory


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def model_config(args) -> attnlab.ModelConfig:
    return attnlab.model_config_from_dict({"vocab_size": args.vocab, "d_model": args.d_model, "n_layers": args.layers,
                                           "n_heads": args.d_model // 64, "max_seq_len": args.seq_len})  # fmt: skip


def worker(args) -> None:
    """One process of a mode: three steps, then its peak above the baseline as JSON on stdout."""
    from attnlab.train import fsdp
    from attnlab.train.distributed import init_distributed
    from attnlab.train.optim import build_optimizer

    mode = args.worker
    info = init_distributed("cpu", join=mode == "fsdp")

    def steps(cfg, batch: int, seq_len: int, n: int) -> list[float]:
        """n steps; each one's seconds (the processes synchronise at every step through the gradients)."""
        torch.manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (batch // info.world_size, seq_len + 1))
        model = attnlab.build_model(cfg).train()
        if mode == "fsdp":
            fsdp.shard(model, torch.device("cpu"), info.world_size, None, False)
        step_model = torch.nn.parallel.DistributedDataParallel(model) if mode == "ddp" else model
        optimizer = build_optimizer(model, TrainConfig(lr=1e-4, weight_decay=0.0))
        seconds = []
        for _ in range(n):
            start = time.perf_counter()
            logits, _ = step_model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds.append(time.perf_counter() - start)
        return seconds

    if args.time:
        seconds = steps(model_config(args), args.batch, args.seq_len, 12)[2:]
        print(json.dumps({"rank": info.rank, "step": statistics.median(seconds)}))
        return
    # A small model first, through the same code: what loads or initialises once (libraries, thread pools, the
    # communication buffers) is in the baseline, not in the step's peak.
    steps(model_config(argparse.Namespace(vocab=256, d_model=64, layers=2, seq_len=32)), 2, 32, 2)
    base = rss()
    steps(model_config(args), args.batch, args.seq_len, 3)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    print(json.dumps({"rank": info.rank, "peak": peak}))


def measure(mode: str, args) -> dict[str, float]:
    """The highest peak (or step time, with --time) over the mode's processes."""
    shape = ["--d-model", str(args.d_model), "--layers", str(args.layers), "--vocab", str(args.vocab), "--batch",
             str(args.batch), "--seq-len", str(args.seq_len), "--worker", mode]  # fmt: skip
    shape += ["--time"] if args.time else []
    # Blocks of 128 KiB and more mapped on their own and returned when freed (glibc otherwise raises that threshold
    # as a program frees large blocks, and keeps what it frees on its heap: the peak would count memory freed long
    # before, such as the whole weights FSDP replaces with their shards). Timed: the whole CPU to each mode, one
    # process of 2 threads or 2 of 1.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    if args.time:
        env = {**os.environ, "OMP_NUM_THREADS": "2" if mode == "one" else "1"}
    if mode == "one":
        command = [sys.executable, __file__, *shape]
    else:
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                   "127.0.0.1", "--master_port", str(port), __file__, *shape]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    lines = [json.loads(found) for found in re.findall(r"\{[^{}]*\}", done.stdout)]  # the processes' lines
    return {key: max(line[key] for line in lines) for key in lines[0] if key != "rank"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--time", action="store_true", help="time a step instead of measuring memory")
    parser.add_argument("--rounds", type=int, default=3, help="--time: rounds of the three modes")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    cfg = model_config(args)
    if args.time:
        return timing(args)
    print(f"model: d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}; global batch {args.batch} x "
          f"{args.seq_len} tokens; fp32, AdamW\n")  # fmt: skip
    print("| mode | processes | estimate (MiB) | measured peak (MiB) | measured / estimate |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for mode, devices in (("one", 1), ("ddp", 2), ("fsdp", 2)):
        estimate = training_memory(cfg, batch_size=args.batch, seq_len=args.seq_len, devices=devices,
                                   mode="fsdp" if mode == "fsdp" else "ddp")["total"]  # fmt: skip
        peak = measure(mode, args)["peak"]
        print(f"| {mode} | {devices} | {estimate / 2**20:,.0f} | {peak / 2**20:,.0f} | {peak / estimate:.2f} |")


def timing(args) -> None:
    tokens = args.batch * args.seq_len
    print(f"model: d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}; global batch {args.batch} x "
          f"{args.seq_len} tokens; fp32, AdamW; load before: {os.getloadavg()[0]:.2f}\n")  # fmt: skip
    print(
        "| round | one process, 2 threads (s/step) | DDP, 2 x 1 thread | FSDP, 2 x 1 thread | DDP / one | FSDP / one |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for round_ in range(1, args.rounds + 1):
        step = {mode: measure(mode, args)["step"] for mode in ("one", "ddp", "fsdp")}
        print(f"| {round_} | {step['one']:.3f} ({tokens / step['one']:,.0f} tok/s) | {step['ddp']:.3f} | "
              f"{step['fsdp']:.3f} | {step['ddp'] / step['one']:.2f} | {step['fsdp'] / step['one']:.2f} |")  # fmt: skip
    print(f"\nload after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    main()
