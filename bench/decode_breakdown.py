"""Where a compiled decode step's time goes with a GGUF's own weights (issue 16): the whole step against its weight
matmuls alone, in one process, rounds interleaved.

    python bench/decode_breakdown.py [--data-dir DIR] [--weights native,native+q8] [--context 128]
                                     [--new-tokens 32] [--rounds 5]

step      seconds per token of `generate`'s compiled loop (as bench/real_model.py times it), the last step at
          --context tokens of context (random prompt tokens: the arithmetic does not depend on them)
matmuls   the step's weight matmuls alone: every QuantizedLinear of the model once, in the model's order, with its
          decoding buffers (packed rows under 8-bit activations), through the same C++ operator, from a Python loop
call      that operator's cost per call on a 16 x 32 matrix from the same loop (dispatch, checks, output allocation;
          the compiled step calls it from C++, which costs less)
rest      step - matmuls: norms, RoPE, the attention, the residual adds, the LM head's argmax, and the compiled
          regions' calls and guard checks (one region per block)
Each figure is the fastest of 5 repeats within a round; the table gives the median over rounds. Prints only.
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


def step_seconds(model, prompt: torch.Tensor, n: int) -> float:
    stamps = []
    generate(model, prompt, max_new_tokens=n + 1, compile=True, callback=lambda _: stamps.append(time.perf_counter()))
    return (stamps[-1] - stamps[0]) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--weights", default="native,native+q8")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not cpp_ops.usable():
        raise SystemExit("the C++ operators do not build here")
    path = find_data_file(SMOLLM2, args.data_dir)
    prompt = torch.randint(0, 10_000, (1, args.context - args.new_tokens), generator=torch.Generator().manual_seed(0))
    models = {}
    for weights in args.weights.split(","):
        held, _, activations = weights.partition("+")
        models[weights] = load_for_eval(str(path), weights=held, activations=activations or "fp32").model
        step_seconds(models[weights], prompt, 2)  # compiles the step (once per model)
    tiny = [(torch.randn(1, 1, 32), torch.zeros(16, 20, dtype=torch.uint8), None, "q4_1")]
    other = OtherLoad()
    figures = {weights: [] for weights in models}
    for _ in range(args.rounds):
        for weights, model in models.items():
            calls = decoding_calls(model)
            step = step_seconds(model, prompt, args.new_tokens)
            matmuls = min(loop_seconds(calls) for _ in range(5))
            call = min(loop_seconds(tiny * len(calls)) for _ in range(5)) / len(calls)
            figures[weights].append((step, matmuls, call, len(calls)))
    rows = []
    for weights, runs in figures.items():
        step, matmuls, call = (statistics.median(r[i] for r in runs) for i in range(3))
        n_calls, n_blocks = runs[0][3], len(models[weights].blocks)
        rest = step - matmuls
        rows.append([weights, n_calls, step * 1e3, matmuls * 1e3, call * 1e6, rest * 1e3, rest / n_blocks * 1e6,
                     matmuls / step])  # fmt: skip
    print(f"{torch.get_num_threads()} thread(s), {args.context} tokens of context, median of {args.rounds} rounds")
    print_table(["weights", "matmuls per step", "step ms", "matmuls ms", "call µs", "rest ms", "rest per block µs",
                 "matmuls / step"], rows)  # fmt: skip
    load = other.fraction()
    if load is not None and load > 0.1:
        print(f"\nWARNING: other processes used {load:.0%} of the machine's CPU during the run")


if __name__ == "__main__":
    main()
