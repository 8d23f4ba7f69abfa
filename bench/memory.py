"""Bounded KV memories against the full cache: prefill throughput, decode speed and memory vs context length.

    python bench/memory.py [--prefill 4096] [--contexts 512,1024,2048,4096,8192,16384] [--steps 32] [--threads N]

One CoDA model (d_model 128, 4 layers, 8 query / 2 KV heads, vocab 4096), with its full cache and with the
memories of cache/memories.py at the paper's medium size (recent window 256 + 64 exact + 64 summary slots;
window-only and StreamingLLM at the same 384 slots), and the bounded memory once more with its routing loops in
PyTorch (bounded-pytorch-routing: the C routing switched off). Weights are shared: the memory draws no random
numbers at init, so every model holds the same attention weights.

(a) prefill: a random context of --prefill tokens in chunks of --chunk, timed, alternating models; the
    ratio to the full cache (CoDA-GQA-L's own implementation reaches 1.4% of it; attnlab's goal: >= 25%).
(b) decode: after a prefill of L tokens (not timed), `steps` greedy decode steps; tok/s, the cache's bytes
    (measured from its tensors) and the process's peak RSS growth while decoding at that context.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OtherLoad, environment, finish, median, print_table, row  # noqa: E402

from attnlab import build_model, model_config_from_dict  # noqa: E402
from attnlab.generate import decode_step, prefill  # noqa: E402
from attnlab.kernels import cpu  # noqa: E402

MEMORIES = {
    "full": {"kind": "none"},
    "bounded": {"kind": "bounded", "recent_window": 256, "exact_slots": 64, "summary_slots": 64},
    "window": {"kind": "window", "recent_window": 384},
    "streaming": {"kind": "streaming", "recent_window": 380, "sink_tokens": 4},
}
# The bounded memory again with its routing loops in PyTorch (attnlab.kernels.cpu switched off): what the C routing
# (attnlab.kernels.cpu.routing) saves, in the same run.
PYTORCH_ROUTING = "bounded-pytorch-routing"
MEMORIES[PYTORCH_ROUTING] = MEMORIES["bounded"]


def routing(name: str):
    return cpu.disabled() if name == PYTORCH_ROUTING else contextlib.nullcontext()


def make(name: str, max_len: int):
    cfg = model_config_from_dict({
        "name": f"bench-memory-{name}", "vocab_size": 4096, "d_model": 128, "n_layers": 4, "n_heads": 8,
        "max_seq_len": max_len, "attention": {"kind": "coda", "n_kv_heads": 2}, "memory": MEMORIES[name],
    })  # fmt: skip
    torch.manual_seed(0)
    return build_model(cfg).eval()


@torch.no_grad()
def time_prefill(model, tokens: torch.Tensor, chunk: int) -> float:
    cache = model.new_cache(1, tokens.shape[1])
    start = time.perf_counter()
    prefill(model, tokens, cache, chunk)
    return time.perf_counter() - start


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


@torch.no_grad()
def time_decode(model, context: torch.Tensor, steps: int, chunk: int) -> tuple[float, int]:
    cache = model.new_cache(1, context.shape[1] + steps)
    logits = prefill(model, context, cache, chunk)
    start = time.perf_counter()
    for _ in range(steps):
        logits = decode_step(model, logits.argmax(dim=-1, keepdim=True), cache)
    return time.perf_counter() - start, cache.nbytes()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens per cache update)")
    parser.add_argument("--contexts", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memories", default=",".join(MEMORIES), help="the first is the reference")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.memories.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]
    max_len = max(contexts + [args.prefill]) + args.steps
    models = {name: make(name, max_len) for name in names}
    env, load, records = environment(), OtherLoad(), []
    print(f"memory: coda d_model 128, {torch.get_num_threads()} threads, torch {torch.__version__}")

    tokens = torch.randint(0, 4096, (1, args.prefill), generator=torch.Generator().manual_seed(0))
    seconds = {name: [] for name in names}
    for name in names:
        with routing(name):
            time_prefill(models[name], tokens[:, : 2 * args.chunk], args.chunk)  # warm-up
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            with routing(name):
                seconds[name].append(time_prefill(models[name], tokens, args.chunk))
    reference, table = median(seconds[names[0]]), []
    for name in names:
        tok_s = args.prefill / median(seconds[name])
        ratio = reference / median(seconds[name])
        records.append(row("memory_prefill", models[name].cfg.config_hash(), env, memory=name, tokens=args.prefill,
                           chunk=args.chunk, seconds=seconds[name], tok_per_s=tok_s, vs_first=ratio))  # fmt: skip
        table.append([name, f"{tok_s:,.0f}", f"{ratio:.1%}"])
    print(f"\n(a) prefill of {args.prefill} tokens in chunks of {args.chunk}")
    print_table(["memory", "tok/s", f"vs {names[0]}"], table)

    table = []
    for length in contexts:
        context = torch.randint(0, 4096, (1, length), generator=torch.Generator().manual_seed(length))
        for name in names:
            rss = peak_rss()
            loops, kv = [], 0
            for _ in range(args.repeats):
                with routing(name):
                    elapsed, kv = time_decode(models[name], context, args.steps, args.chunk)
                loops.append(elapsed)
            tok_s, grown = args.steps / median(loops), peak_rss() - rss
            records.append(row("memory_decode", models[name].cfg.config_hash(), env, memory=name, context=length,
                               steps=args.steps, loop_seconds=loops, tok_per_s=tok_s, kv_bytes=kv,
                               peak_rss_growth=grown))  # fmt: skip
            table.append([length, name, f"{tok_s:,.0f}", f"{kv / 2**20:.2f}", f"{grown / 2**20:.0f}"])
    print(f"\n(b) decode {args.steps} steps after a context of L tokens")
    print_table(["L", "memory", "tok/s", "KV MiB", "peak RSS growth MiB"], table)
    finish("memory", records, load.fraction(), not args.no_record)


if __name__ == "__main__":
    main()
