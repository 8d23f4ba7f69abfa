"""What the C++ operators (attnlab.kernels.cpu.ops) save over the Python operators they stand in for (issue 16).

    python bench/cpp_ops.py [--threads 2] [--contexts 128,4096] [--kv fp32,q8_0] [--new-tokens 32] [--rounds 3]
                            [--data-dir DIR] [--no-record]

calls    a compiled graph of 120 one-row q4_0 matmuls (32 -> 32: the call is all there is), per call, with
         attnlab::qlinear (Python) and attnlab_cpp::qlinear (C++), and each eagerly.
decode   SmolLM2-135M with the GGUF's own weights, `generate(compile=True)` (the regional compiled step) after a
         prefill of C - N - 1 tokens (random ids: speed only), N steps timed token by token (the last at C tokens
         of context), two models: one whose compiled step calls the Python operators (attnlab.kernels.cpu.ops.usable
         patched to False while it runs), one the C++ operators; rounds alternate between them. tok/s, median of
         rounds, and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OtherLoad, environment, finish, median, print_table, row  # noqa: E402

from attnlab.eval.loading import load_for_eval  # noqa: E402
from attnlab.generate import COMPILE_OPTIONS, generate  # noqa: E402
from attnlab.kernels.cpu import ops  # noqa: E402
from attnlab.model.qlinear import encode  # noqa: E402

SMOLLM2 = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
KV_POLICIES = {"fp32": None, "q8_0": "k=q8_0,v=q8_0", "q4_0": "k=q4_0,v=q4_0"}


def _python_only() -> bool:  # one object: the Python arm's compiled step is traced with it (and guards on it)
    return False


class python_operators:
    """Within this block the Python operators run (the compiled steps traced in it keep them)."""

    def __enter__(self):
        self.usable, ops.usable = ops.usable, _python_only

    def __exit__(self, *exc):
        ops.usable = self.usable


def per_call(op, compiled: bool, calls: int = 120, repeats: int = 30) -> float:
    blocks = [encode(torch.randn(32, 32), "q4_0") for _ in range(calls)]

    def chain(x):
        for b in blocks:
            x = op(x, b, None, "q4_0")
        return x

    fn = torch.compile(chain, fullgraph=True, dynamic=True, options=COMPILE_OPTIONS) if compiled else chain
    x = torch.randn(1, 32)
    with torch.no_grad():
        fn(x)
        fn(x)
        best = min(_seconds(lambda: fn(x)) for _ in range(repeats))
    return best / calls


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode(model, tokens: torch.Tensor, n: int, policy: str | None) -> float:
    stamps = []
    generate(model, tokens, max_new_tokens=n + 1, kv_policy=policy, compile=True,
             callback=lambda _: stamps.append(time.perf_counter()))  # fmt: skip
    return n / (stamps[-1] - stamps[0])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="128,4096")
    parser.add_argument("--kv", default="fp32,q8_0")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    if not ops.load():
        sys.exit("the C++ operators do not build here: nothing to compare")
    torch.set_num_threads(args.threads)
    env, other = environment(), OtherLoad()
    records, table = [], []

    with python_operators():
        python_call = (per_call(torch.ops.attnlab.qlinear, True), per_call(torch.ops.attnlab.qlinear, False))
    cpp_call = (per_call(torch.ops.attnlab_cpp.qlinear, True), per_call(torch.ops.attnlab_cpp.qlinear, False))
    for mode, i in (("compiled", 0), ("eager", 1)):
        us = (python_call[i] * 1e6, cpp_call[i] * 1e6)
        table.append([f"one call, {mode}", "", "", f"{us[0]:.2f} us", f"{us[1]:.2f} us", f"{us[1] / us[0]:.2f}"])
        records.append(row("cpp_ops", "calls", env, mode=mode, python_us=us[0], cpp_us=us[1], threads=args.threads))

    models = {name: load_for_eval(SMOLLM2, data_dir=args.data_dir, weights="native").model for name in ("py", "cpp")}
    contexts = [int(c) for c in args.contexts.split(",")]
    ids = torch.randint(100, 20000, (max(contexts),), generator=torch.Generator().manual_seed(0))  # speed only
    for kv in args.kv.split(","):
        for context in contexts:
            prompt = ids[: context - args.new_tokens - 1]
            with python_operators():
                decode(models["py"], prompt, 4, KV_POLICIES[kv])  # warm: compiles
            decode(models["cpp"], prompt, 4, KV_POLICIES[kv])
            speeds = {"py": [], "cpp": []}
            for _ in range(args.rounds):
                with python_operators():
                    speeds["py"].append(decode(models["py"], prompt, args.new_tokens, KV_POLICIES[kv]))
                speeds["cpp"].append(decode(models["cpp"], prompt, args.new_tokens, KV_POLICIES[kv]))
            py, cpp = median(speeds["py"]), median(speeds["cpp"])
            table.append(["decode tok/s", kv, context, f"{py:.1f}", f"{cpp:.1f}", f"{cpp / py:.2f}"])
            records.append(row("cpp_ops", f"decode-{kv}-{context}", env, kv=kv, context=context, threads=args.threads,
                               python_tok_s=py, cpp_tok_s=cpp, rounds=speeds))  # fmt: skip
    print_table(["measure", "KV", "context", "Python operators", "C++ operators", "C++ / Python"], table)
    finish("cpp_ops", records, other.fraction(), record=not args.no_record)


if __name__ == "__main__":
    main()
