"""Where a decode step's time goes with a GGUF's own weights (issue 16): the compiled step against its weight matmuls
alone and against the fused step (one C call per token), in one process, rounds interleaved.

    python bench/decode_breakdown.py [--data-dir DIR] [--weights native,native+q8] [--context 128[,4096]]
                                     [--new-tokens 32] [--rounds 5] [--fused]

step      seconds per token of `generate`'s compiled loop (fused=False, compile=True; as bench/real_model.py times
          it), the last step at --context tokens of context (random prompt tokens: the arithmetic does not depend on
          them)
fused     with --fused, the same through the fused step (attnlab.model.fused: fused=True, nothing compiled), for the
          weights it covers (native+q8); timed in the same rounds as the compiled step, the two in turn (which one
          goes first alternates from round to round)
matmuls   the step's weight matmuls alone: every QuantizedLinear of the model once, in the model's order, with its
          decoding buffers (packed rows under 8-bit activations), through the same C++ operator, from a Python loop
call      that operator's cost per call on a 16 x 32 matrix from the same loop (dispatch, checks, output allocation;
          the compiled step calls it from C++, which costs less)
rest      step - matmuls: norms, RoPE, the attention, the residual adds, the LM head's argmax, and the compiled
          regions' calls and guard checks (one region per block); fused rest likewise, fused - matmuls
Each figure is the fastest of 5 repeats within a round (steps: one run of --new-tokens); the table gives the median
over rounds and, with --fused, each round's ratio compiled / fused. Prints only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OtherLoad, print_table  # noqa: E402

from attnlab.eval.loading import load_for_eval  # noqa: E402
from attnlab.generate import generate  # noqa: E402
from attnlab.kernels.cpu import ops as cpp_ops  # noqa: E402
from attnlab.model.fused import fused_problem  # noqa: E402
from attnlab.model.qlinear import Q8, Q8P, QuantizedLinear  # noqa: E402
from attnlab.paths import find_data_file  # noqa: E402

SMOLLM2 = "models/SmolLM2-135M-Instruct.Q4_1.gguf"


def decoding_calls(model) -> list[tuple]:
    """(x, weights, bias, fmt) of each QuantizedLinear's one-row matmul as its forward makes it (model order)."""
    calls = []
    for layer in model.modules():
        if not isinstance(layer, QuantizedLinear):
            continue
        q8 = layer.activations == "q8" and layer.fmt != "fp16"
        x = torch.randn(1, 1, layer.in_features)
        if q8 and layer.packed is not None:
            calls.append((x, layer.packed, layer.bias, layer.fmt + Q8P))
        else:
            calls.append((x, layer.blocks, layer.bias, layer.fmt + (Q8 if q8 else "")))
    return calls


def loop_seconds(calls: list[tuple]) -> float:
    op = torch.ops.attnlab_cpp.qlinear
    start = time.perf_counter()
    for x, weights, bias, fmt in calls:
        op(x, weights, bias, fmt)
    return time.perf_counter() - start


def step_seconds(model, prompt: torch.Tensor, n: int, fused: bool = False) -> float:
    stamps = []
    generate(model, prompt, max_new_tokens=n + 1, compile=not fused, fused=fused,
             callback=lambda _: stamps.append(time.perf_counter()))  # fmt: skip
    return (stamps[-1] - stamps[0]) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--weights", default="native,native+q8")
    parser.add_argument("--context", default="128", help="tokens of context at the last step, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fused", action="store_true", help="time the fused step too (the weights it covers)")
    args = parser.parse_args()
    if not cpp_ops.usable():
        raise SystemExit("the C++ operators do not build here")
    path = find_data_file(SMOLLM2, args.data_dir)
    contexts = [int(c) for c in args.context.split(",")]
    prompts = {c: torch.randint(0, 10_000, (1, c - args.new_tokens), generator=torch.Generator().manual_seed(0))
               for c in contexts}  # fmt: skip
    models, fused = {}, {}
    for weights in args.weights.split(","):
        held, _, activations = weights.partition("+")
        model = models[weights] = load_for_eval(str(path), weights=held, activations=activations or "fp32").model
        problem = fused_problem(model, model.new_cache(1, 8)) if args.fused else "not asked (--fused)"
        fused[weights] = problem is None
        if args.fused and problem:
            print(f"{weights}: no fused step ({problem})")
        for prompt in prompts.values():  # compiles the step (the first length), builds fused.c, warms each length
            step_seconds(model, prompt, 2)
            if fused[weights]:
                step_seconds(model, prompt, 2, fused=True)
    tiny = [(torch.randn(1, 1, 32), torch.zeros(16, 20, dtype=torch.uint8), None, "q4_1")]
    other = OtherLoad()
    figures = {(weights, c): [] for weights in models for c in contexts}
    for round_ in range(args.rounds):
        for context in contexts:
            for weights, model in models.items():
                calls = decoding_calls(model)
                order = (False, True) if round_ % 2 == 0 else (True, False)  # which step goes first alternates
                steps = {f: step_seconds(model, prompts[context], args.new_tokens, fused=f)
                         for f in order if fused[weights] or not f}  # fmt: skip
                matmuls = min(loop_seconds(calls) for _ in range(5))
                call = min(loop_seconds(tiny * len(calls)) for _ in range(5)) / len(calls)
                figures[(weights, context)].append((steps[False], steps.get(True), matmuls, call, len(calls)))
                fused_ms = f", fused {steps[True] * 1e3:.2f} ms" if True in steps else ""
                print(f"round {round_ + 1} {weights} {context}: compiled {steps[False] * 1e3:.2f} ms{fused_ms}",
                      flush=True)  # fmt: skip
    rows = []
    for (weights, context), runs in figures.items():
        step, matmuls, call = (statistics.median(r[i] for r in runs) for i in (0, 2, 3))
        n_calls, n_blocks = runs[0][4], len(models[weights].blocks)
        for path_name, seconds in (("compiled", step), ("fused", runs[0][1] and statistics.median(r[1] for r in runs))):
            if not seconds:
                continue
            rest = seconds - matmuls
            ratios = " ".join(f"{r[0] / r[1]:.2f}" for r in runs) if path_name == "fused" else ""
            rows.append([weights, context, path_name, n_calls, seconds * 1e3, matmuls * 1e3, call * 1e6, rest * 1e3,
                         rest / n_blocks * 1e6, matmuls / seconds, step / seconds, ratios])  # fmt: skip
    print(f"{torch.get_num_threads()} thread(s), median of {args.rounds} rounds")
    print_table(["weights", "context", "step", "matmuls per step", "step ms", "matmuls ms", "call µs", "rest ms",
                 "rest per block µs", "matmuls / step", "x compiled", "compiled / fused by round"], rows)  # fmt: skip
    load = other.fraction()
    if load is not None and load > 0.1:
        print(f"\nWARNING: other processes used {load:.0%} of the machine's CPU during the run")


if __name__ == "__main__":
    main()
