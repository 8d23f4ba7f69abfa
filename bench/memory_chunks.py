"""What reading in blocks costs a memory: scoring a stream block by block against decoding it token by token.

    python bench/memory_chunks.py [--data-dir ../shared/data] [--windows 4] [--blocks 128,32,8,1] [--positions P]

A model with a memory reads a sequence `memory.block` tokens at a time, and each query of a block sees what the
memory holds at its own step (cache/memories.py), so with absolute positions blocks and token-by-token decoding
should agree to float rounding for every memory kind; with cache positions a block ranks the held keys once for
all its queries. This measures the difference on a real trained model, karpathy's
stories260K (llama2.c, 512 positions): a stream of `windows` x 512 tokens of its own sampled stories (BOS
between them), scored through each memory (128 slots) with StreamingLLM's cache positions (or --positions
absolute), block sizes from 128 down to 1 (block 1 is token-by-token decoding), against the plain model reading
each 512-token window fresh. Quality only: no timing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import append_rows, environment, print_table, row  # noqa: E402

import attnlab  # noqa: E402
from attnlab.config import MemoryConfig  # noqa: E402
from attnlab.interop import from_llama2c  # noqa: E402

MEMORIES = {  # 128 slots each
    "window": {"kind": "window", "recent_window": 128},
    "streaming": {"kind": "streaming", "recent_window": 124, "sink_tokens": 4},
    "h2o": {"kind": "h2o", "recent_window": 64, "heavy_slots": 64},
    "bounded": {"kind": "bounded", "recent_window": 64, "exact_slots": 32, "summary_slots": 32, "write_policy": "none"},
}


def stream_of_stories(model, cfg, windows: int) -> torch.Tensor:
    stories: list[list[int]] = []
    while sum(map(len, stories)) < windows * cfg.max_seq_len + 1:
        out = attnlab.generate(model, [1], max_new_tokens=cfg.max_seq_len - 2, temperature=1.0, seed=len(stories),
                               stop_tokens=[1], compile=False)  # fmt: skip
        stories.append([1] + out.tolist())
    return torch.tensor([sum(stories, [])[: windows * cfg.max_seq_len + 1]])


@torch.no_grad()
def mean_nll(model, stream: torch.Tensor) -> float:
    logits, _ = model(stream[:, :-1], use_cache=False)
    return float(F.cross_entropy(logits[0], stream[0, 1:]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--blocks", default="128,32,8,1")
    parser.add_argument("--positions", default="cache", help="memory.positions: cache (StreamingLLM's) or absolute")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg, plain = from_llama2c(Path(args.data_dir) / "llama2c-stories260K" / "stories260K.bin")
    stream = stream_of_stories(plain, cfg, args.windows)
    context = cfg.max_seq_len
    fresh = sum(mean_nll(plain, stream[:, i * context : (i + 1) * context + 1]) for i in range(args.windows))
    fresh /= args.windows
    blocks = [int(b) for b in args.blocks.split(",")]
    env, records, table = environment(), [], []
    for name, memory in MEMORIES.items():
        nll = {}
        for block in blocks:
            config = MemoryConfig(**memory, block=block, positions=args.positions)
            model = attnlab.build_model(cfg.replace(memory=config)).eval()
            model.load_state_dict(plain.state_dict(), strict=False)  # the bounded memory's write parameters aside
            nll[block] = mean_nll(model, stream)
            records.append(row("memory_chunks", model.cfg.config_hash(), env, memory=name, block=block,
                               positions=args.positions, tokens=stream.shape[1] - 1, nll=nll[block],
                               fresh_nll=fresh))  # fmt: skip
        gaps = [f"{nll[b] - nll[1]:+.4f}" for b in blocks if b != 1] if 1 in nll else []  # block - token by token
        table.append([name, *(f"{nll[b]:.4f}" for b in blocks), *gaps])
    print(
        f"stories260K, {stream.shape[1] - 1} tokens of its own stories, positions {args.positions}; fresh 512-token "
        f"windows: NLL {fresh:.4f}"
    )
    diff_heads = [f"block {b} - token" for b in blocks if b != 1] if 1 in blocks else []
    print_table(["memory", *(f"NLL block {b}" for b in blocks), *diff_heads], table)
    if not args.no_record:
        print(f"recorded {len(records)} rows in {append_rows('memory_chunks', records)}")


if __name__ == "__main__":
    main()
