"""Cached decode speed with quantized KV caches, relative to the fp32 cache, batch 1, fp32 model, CPU.

    python bench/kv_decode.py [--context 4096] [--steps 32] [--repeats 3] [--policies P;P;...] [--model mha]
                              [--paths compiled,kernels,pytorch] [--no-compiled]

The decode benchmark's shape (d_model 128, 4 layers, 8 heads, vocab 4096, max_seq_len 4352): prefill a
random context of `context` tokens into a cache made with each policy (not timed), then time `steps`
greedy decode steps, the rows taking turns in every repeat. References: the fp32 cache with eager steps
(the first row) and, unless --no-compiled, through generate's compiled static-shape step (what
`attnlab.generate` runs). Each policy runs on the paths named by --paths: `compiled`, generate's compiled
step with the attention as one opaque op running the C kernels (what `attnlab.generate` runs where the
cache has a static mode); `kernels`, eager steps with the C kernels reading the stored blocks
(attnlab.kernels.cpu); `pytorch`, eager steps that dequantize everything the cache holds into a
full-precision copy at every step, which shows where dequantization costs more than the bandwidth it saves.
Reports tok/s, the time per token relative to both references, and the KV bytes measured from the live cache.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OtherLoad, append_rows, environment, matmul_gflops, median, print_table, row  # noqa: E402
from decode import VARIANTS, timed_decode, variant_config  # noqa: E402

from attnlab import build_model  # noqa: E402
from attnlab.generate import can_compile_on_cpu, prefill  # noqa: E402
from attnlab.kernels import cpu as cpu_kernels  # noqa: E402

POLICIES = {
    "mha": "k=fp16,v=fp16;k=q8_0,v=q8_0;k=q8_0,v=q8_0,flush=32;k=q8_0,v=q4_0;k=q4_0,v=q4_0;"
    "k=q4_0,v=q4_0,flush=32;k=q4_0,v=q4_0,resid=128;k=nf4,v=nf4;k=kivi4,v=kivi4,resid=128",
    "decoupled32/64": "k=fp16,v=fp16;ksem=q4_0,kgeo=q8_0,v=fp16;ksem=q4_0,kgeo=q8_0,v=q4_0;"
    "ksem=q4_0,kgeo=q8_0,v=q4_0,resid=128",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="mha", help=f"one of the decode benchmark's variants ({', '.join(VARIANTS)})"
    )
    parser.add_argument("--context", type=int, default=4096, help="tokens in the cache before decoding")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policies", default=None, help="';'-separated KV policies (the fp32 cache is always run)")
    parser.add_argument("--paths", default="compiled,kernels,pytorch", help="compiled, kernels and/or pytorch")
    parser.add_argument("--no-compiled", action="store_true", help="skip the compiled fp32 reference")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    policies = (args.policies or POLICIES.get(args.model, POLICIES["mha"])).split(";")
    paths = [p for p in args.paths.split(",") if p]
    if not set(paths) <= {"compiled", "kernels", "pytorch"}:
        raise SystemExit(f"--paths {args.paths!r}: use a comma-separated selection of compiled, kernels, pytorch")
    if "kernels" in paths and not cpu_kernels.available():
        print("the C kernels are unavailable here (no compiler?): their rows run the PyTorch path")
    compiled = not args.no_compiled and can_compile_on_cpu()
    if not can_compile_on_cpu():
        paths = [p for p in paths if p != "compiled"]
    env = {**environment(), "matmul_gflops": matmul_gflops(repeats=3)}
    print(f"kv_decode: {args.model}, context {args.context}, {args.steps} steps, {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    model = build_model(variant_config(args.model)).eval()
    context = torch.randint(0, model.cfg.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    # Rows: (label, policy, path, compiled step)
    rows = [("fp32", "none", "eager", False)] + ([("fp32", "none", "compiled", True)] if compiled else [])
    rows += [(p, p, path, path == "compiled") for p in policies for path in paths]
    load = OtherLoad()
    prefilled, compiled_step = {}, {}
    for label, policy, path, step_compiled in rows:
        cache = model.new_cache(1, args.context + args.steps, policy=None if policy == "none" else policy)
        prefilled[(label, path)] = (cache, prefill(model, context, cache))
        if step_compiled and not cache.supports_static():
            print(f"{label}: no static mode for this cache (e.g. a KIVI format), its compiled row decodes eagerly")
            step_compiled = False
        cache.set_static(step_compiled)
        compiled_step[(label, path)] = step_compiled
        with paths_of(path):  # warm-up (compiled: compiles the step for this cache size), not timed
            timed_decode(model, copy.deepcopy(cache), prefilled[(label, path)][1], 4, step_compiled)
    loops = {(label, path): [] for label, _, path, _ in rows}
    for r in range(args.repeats):
        for label, _, path, _ in rows[r % len(rows) :] + rows[: r % len(rows)]:
            cache, logits = prefilled[(label, path)]
            with paths_of(path):
                seconds = timed_decode(model, copy.deepcopy(cache), logits, args.steps, compiled_step[(label, path)])[0]
            loops[(label, path)].append(seconds)
    other = load.fraction()
    eager_ref = median(loops[("fp32", "eager")])
    compiled_ref = median(loops[("fp32", "compiled")]) if compiled else None
    records, table = [], []
    for label, policy, path, _ in rows:
        cache = prefilled[(label, path)][0]
        seconds = median(loops[(label, path)])
        shown = path if compiled_step[(label, path)] or path != "compiled" else "eager (no static mode)"
        figures = {"model": args.model, "policy": policy, "path": shown, "context": args.context,
                   "decode_steps": args.steps, "loop_seconds": loops[(label, path)], "tok_per_s": args.steps / seconds,
                   "time_vs_fp32_eager": seconds / eager_ref,
                   "time_vs_fp32_compiled": None if compiled_ref is None else seconds / compiled_ref,
                   "kv_bytes": cache.nbytes(), "other_load": other}  # fmt: skip
        records.append(row("kv_decode", model.cfg.config_hash(), env, **figures))
        versus_compiled = "-" if compiled_ref is None else f"{seconds / compiled_ref:.2f}"
        table.append([label, shown, f"{cache.nbytes() / 2**20:.2f}", f"{args.steps / seconds:.0f}",
                      f"{seconds / eager_ref:.2f}", versus_compiled])  # fmt: skip
    print_table(["policy", "path", "KV MiB", "tok/s", "time x fp32 eager", "time x fp32 compiled"], table)
    if other is not None and other > 0.1:
        print(f"WARNING: other processes used {other:.0%} of the machine's CPU during the run")
    if not args.no_record:
        print(f"recorded {len(records)} rows in {append_rows('kv_decode', records)}")


def paths_of(path: str):
    """The quantized caches' decode path for a row: the PyTorch one turns the C kernels off."""
    return cpu_kernels.disabled() if path == "pytorch" else contextlib.nullcontext()


if __name__ == "__main__":
    main()
