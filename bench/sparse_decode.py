"""Decode speed of content-selected KV caches on a real model (issue 17, item 5): SmolLM2-135M at long contexts,
the dense cache against quest (dynamic sparse attention) at a share of the pages and the presses at a budget, in one
run, as ratios to the dense cache.

    python bench/sparse_decode.py [--ref models/SmolLM2-135M-Instruct.Q4_1.gguf] [--weights native]
                                  [--contexts 4096,8192] [--shares 0.25,0.125] [--page-size 16]
                                  [--kinds dense,quest,tova,knorm,snapkv,h2o] [--steps 16] [--rounds 3] [--data-dir DIR]
                                  [--no-record]

After an untimed prefill of C - steps * rounds tokens of WikiText-2 raw test text into every arm's cache,
`--rounds` rounds of `--steps` single-token decode steps (eager, fed the text's own next tokens), the last at C
tokens of context; in each round every arm decodes the same tokens, in an order rotated each round. tok/s = steps /
seconds, the median of the rounds; the ratio to the dense cache is the median of each round's ratio.
quest reads `share` of the pages (pages of `--page-size`; recent window 64 and 4 sinks on top); a press keeps the same
number of tokens (`budget`, press_at decode; h2o: half of them heavy hitters, half its recent window). Bytes: what
one step reads from the KV cache of every layer (`read_nbytes()`), and what the cache holds (`nbytes()`).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OtherLoad, environment, finish, median, print_table, row  # noqa: E402

import attnlab  # noqa: E402
from attnlab.config import MemoryConfig  # noqa: E402
from attnlab.eval.perplexity import dataset_tokens  # noqa: E402

SMOLLM2 = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
WINDOW, SINKS, CHUNK = 64, 4, 512


def memory_for(kind: str, context: int, share: float, page_size: int) -> MemoryConfig | None:
    if kind == "dense":
        return None
    pages = max(1, int(context * share) // page_size)
    if kind == "quest":
        return MemoryConfig(kind="quest", recent_window=WINDOW, page_size=page_size, pages=pages, sink_tokens=SINKS)
    budget = pages * page_size + WINDOW + SINKS
    if kind == "h2o":  # half heavy hitters, half recent window, as bench/presses.py's decode-time h2o
        return MemoryConfig(kind="h2o", recent_window=budget - budget // 2, heavy_slots=budget // 2)
    return MemoryConfig(kind=kind, budget=budget, press_at="decode")


def with_memory(model, memory: MemoryConfig | None):
    """The model reading through `memory`: these memories have no parameters, so the same modules (native weight
    blocks included) serve, under a config that names the memory (read by new_cache and forward)."""
    if memory is None:
        return model
    out = copy.copy(model)  # shares every submodule, parameter and buffer
    out.cfg = model.cfg.replace(memory=memory)
    return out


@torch.no_grad()
def prefill(model, tokens: torch.Tensor, context: int, steps: int, rounds: int):
    """A cache for `model` holding tokens[: context - steps * rounds] (untimed, in chunks)."""
    cache = model.new_cache(1, context if model.cfg.memory.kind == "none" else None)
    end = context - steps * rounds
    for start in range(0, end, CHUNK):
        model(tokens[None, start : min(end, start + CHUNK)], cache)
    return cache


@torch.no_grad()
def decode_round(model, cache, tokens: torch.Tensor, start: int, steps: int) -> float:
    """tok/s of `steps` single-token steps fed tokens[start:start + steps]."""
    began = time.perf_counter()
    for t in range(start, start + steps):
        model(tokens[None, t : t + 1], cache)
    return steps / (time.perf_counter() - began)


def interleaved_rates(arms: list, tokens: torch.Tensor, context: int, steps: int, rounds: int) -> tuple[list, list]:
    """(each arm's tok/s in each round, each arm's cache). Every arm is prefilled first; then in each round every
    arm decodes the same `steps` tokens, in an order rotated each round, so a change of the machine's load falls on
    all arms alike (the last round ends at `context` tokens)."""
    caches = [prefill(model, tokens, context, steps, rounds) for model in arms]
    rates = [[0.0] * rounds for _ in arms]
    first = context - steps * rounds
    for r in range(rounds):
        for i in [(j + r) % len(arms) for j in range(len(arms))]:
            rates[i][r] = decode_round(arms[i], caches[i], tokens, first + r * steps, steps)
    return rates, caches


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", default=SMOLLM2)
    parser.add_argument("--weights", default="native")
    parser.add_argument("--contexts", default="4096,8192")
    parser.add_argument("--shares", default="0.25,0.125")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kinds", default="dense,quest,tova,knorm")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",") if x]
    shares = [float(x) for x in args.shares.split(",") if x]
    kinds = [k for k in args.kinds.split(",") if k]

    cfg, model, tokenizer = attnlab.load_model(args.ref, data_dir=args.data_dir, weights=args.weights)
    stream = torch.as_tensor(dataset_tokens(tokenizer, "wikitext2-raw", "test", args.data_dir))
    env, records, table, load = environment(), [], [], OtherLoad()
    for context in contexts:
        tokens = stream[:context]
        arms = [(kind, share) for kind in kinds for share in ([1.0] if kind == "dense" else shares)]
        models = [with_memory(model, memory_for(kind, context, share, args.page_size)) for kind, share in arms]
        rates, caches = interleaved_rates(models, tokens, context, args.steps, args.rounds)
        other = load.lap()
        dense = next((i for i, (kind, _) in enumerate(arms) if kind == "dense"), None)
        for (kind, share), arm_rates, cache in zip(arms, rates, caches, strict=True):
            rate = median(arm_rates)
            # the ratio of each round (both arms in the same minute), median over rounds
            ratio = None if dense is None else median([a / d for a, d in zip(arm_rates, rates[dense], strict=True)])
            read, held = sum(layer.read_nbytes() for layer in cache.layers), cache.nbytes()
            records.append(row("sparse_decode", cfg.config_hash(), env, context=context, kind=kind, share=share,
                               weights=args.weights, tok_s=rate, ratio_to_dense=ratio, read_bytes=read,
                               held_bytes=held, rounds_tok_s=arm_rates, interleaved=True,
                               other_load=other))  # fmt: skip
            table.append([context, kind, share, rate, ratio, read / 1e6, held / 1e6, other])
            print(
                f"C={context} {kind:6s} share {share:<6g} {rate:7.2f} tok/s  x{ratio or 1:.2f}  "
                f"reads {read / 1e6:.1f} MB holds {held / 1e6:.1f} MB  other load {other or 0:.0%}",
                flush=True,
            )
    print_table(["context", "kind", "share", "tok/s", "x dense", "MB read/step", "MB held", "other load"], table, ".3g")
    finish("sparse_decode", records, load.fraction(), record=not args.no_record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
