"""What compiling the decode step costs and buys on a real model (issue 16, item 3): SmolLM2-135M (the GGUF in the
data directory), each case in a fresh Python process, CPU.

    python bench/compile_cost.py [--weights native,fp32] [--prompt 128] [--new-tokens 64] [--threads 2]
                                 [--data-dir DIR] [--no-record]

For each weight format, in this order, each in a new process (model loading not timed):
  eager      generate(compile=False)
  cold       generate(compile=True) with an empty inductor cache (TORCHINDUCTOR_CACHE_DIR: a new folder)
  warm       generate(compile=True) again in a new process with that cache folder, now filled
  auto       generate() (compile=None) in a new process with another empty cache folder: it decides
Times from the call of `generate` (its callback's timestamps): the first new token (from the prefill), the
second (the first decode step: the one that waits for a compile), and the median decode step of the last half
of the tokens (compiled, if it compiled by then). Issue 16's goal: the time to the first new token at most 2x the
eager path's, cold, in a fresh process. The rows say whether each process compiled, and the other processes'
share of the CPU during its decode steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OtherLoad, environment, finish, median, print_table, row  # noqa: E402

SMOLLM2 = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
MODES = {"eager": False, "cold": True, "warm": True, "auto": None}


def child(args) -> None:
    """One case in this process: prints one JSON line of figures."""
    import importlib

    import torch

    from attnlab.eval.loading import load_for_eval

    torch.set_num_threads(args.threads)
    generate_module = importlib.import_module("attnlab.generate")
    model = load_for_eval(SMOLLM2, data_dir=args.data_dir, weights=args.child_weights).model
    prompt = torch.randint(0, 40_000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    stamps, load = [], OtherLoad()
    start = time.perf_counter()
    tokens = generate_module.generate(
        model,
        prompt,
        max_new_tokens=args.new_tokens,
        compile=MODES[args.child_mode],
        callback=lambda _: stamps.append(time.perf_counter()),
    )
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    step = generate_module._COMPILED.get(model)
    print(json.dumps({
        "first_token_s": stamps[0] - start,
        "second_token_s": stamps[1] - start,
        "total_s": stamps[-1] - start,
        "step_ms": 1e3 * median(steps[len(steps) // 2 :]),
        "compiled": bool(step is not None and step.compiled),
        "other_load_decode": load.lap(),
        "tokens": tokens.tolist(),
    }))  # fmt: skip


def run_case(args, weights: str, mode: str, cache_dir: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, OMP_NUM_THREADS=str(args.threads))
    command = [sys.executable, __file__, "--child-mode", mode, "--child-weights", weights, "--prompt",
               str(args.prompt), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]  # fmt: skip
    if args.data_dir:
        command += ["--data-dir", args.data_dir]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the {mode} case with {weights} weights failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="native,fp32")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--child-mode", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--child-weights", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_mode:
        child(args)
        return
    env, records, table = environment(), [], []
    print(f"compile cost: SmolLM2-135M, prompt {args.prompt}, {args.new_tokens} new tokens, {args.threads} threads")
    for weights in [w for w in args.weights.split(",") if w]:
        with tempfile.TemporaryDirectory() as cold, tempfile.TemporaryDirectory() as auto:
            results = {mode: run_case(args, weights, mode, auto if mode == "auto" else cold) for mode in MODES}
        eager = results["eager"]
        for mode, r in results.items():
            same = r["tokens"] == eager["tokens"]
            table.append([weights, mode, r["compiled"], f"{r['first_token_s']:.2f}", f"{r['second_token_s']:.2f}",
                          f"{r['second_token_s'] / eager['second_token_s']:.1f}", f"{r['step_ms']:.1f}",
                          f"{r['total_s']:.1f}", same, f"{r['other_load_decode'] or 0:.0%}"])  # fmt: skip
            figures = {k: v for k, v in r.items() if k != "tokens"}
            setting = {"weights": weights, "mode": mode, "prompt": args.prompt, "new_tokens": args.new_tokens}
            records.append(
                row("compile_cost", weights, env, **setting, threads=args.threads, same_tokens=same, **figures)
            )
    print_table(["weights", "mode", "compiled", "1st token s", "2nd token s", "2nd x eager", "step ms", "total s",
                 "same tokens", "other load"], table)  # fmt: skip
    finish("compile_cost", records, None, record=not args.no_record)


if __name__ == "__main__":
    main()
