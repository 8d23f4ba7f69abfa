"""Cached greedy decoding speed, batch 1, fp32, CPU.

    python bench/decode.py [--part a,b] [--repeats 5] [--new-tokens 128] [--steps 64] [--compiled] [--threads N]

(a) attnlab vs transformers on the same weights: a random LlamaForCausalLM (d_model 128, 4 layers, 8 heads,
    vocab 4096, intermediate 384) imported with `attnlab.from_hf_llama`; `attnlab.generate(...,
    temperature=0)` with its compiled decode step (the default on CPU) and with `compile=False`, against
    `hf_model.generate(..., do_sample=False, min_new_tokens=N)`, timed in rotated rounds after one warm-up
    call each (attnlab's compiles the step; that time is printed, not counted). Two figures: end to end
    (N / seconds of the whole call, prompt prefill included) and per token (1 / median interval between
    consecutive tokens: generate's callback for attnlab, forward calls for transformers).
(b) decode speed against context length for mha, GQA-2, bottleneck and decoupled attention on the same
    shape: prefill a random context of L tokens (not timed), then time `steps` greedy decode steps
    (`attnlab.generate.decode_step`, or with --compiled generate's compiled static-shape step, compiled
    untimed for each L), and report the KV-cache bytes of a cache holding L tokens.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OtherLoad, environment, finish, matmul_gflops, median, print_table, row, spread  # noqa: E402

import attnlab  # noqa: E402
from attnlab import ModelConfig, build_model  # noqa: E402
from attnlab.attention.bottleneck import BottleneckConfig  # noqa: E402
from attnlab.attention.decoupled import DecoupledConfig  # noqa: E402
from attnlab.attention.mha import MHAConfig  # noqa: E402
from attnlab.generate import compiled_decode_step, decode_step, prefill  # noqa: E402

D_MODEL, N_LAYERS, N_HEADS, VOCAB, D_FF, MAX_SEQ_LEN = 128, 4, 8, 4096, 384, 4352
CONTEXTS = (128, 256, 512, 1024, 2048, 4096)
VARIANTS = {
    "mha": MHAConfig(),
    "gqa2": MHAConfig(n_kv_heads=2),
    "bottleneck32": BottleneckConfig(d_attn=32),
    "decoupled16/32": DecoupledConfig(d_sem=16, d_geo=32),
    "decoupled32/64": DecoupledConfig(d_sem=32, d_geo=64),  # rows of 32 and 64: block formats for both key paths
}


class ForwardClock:
    """Records the time at the end of every forward call of a module (one call per generated token)."""

    def __init__(self, module: torch.nn.Module):
        self.stamps: list[float] = []
        self.handle = module.register_forward_hook(lambda *_: self.stamps.append(time.perf_counter()))

    def intervals(self) -> list[float]:
        """Seconds between consecutive forward calls: one decode step each (the first call is the prefill)."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        hidden_size=D_MODEL,
        intermediate_size=D_FF,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=MAX_SEQ_LEN,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(hf_cfg).eval()


def generate_rounds(model, hf, prompt: torch.Tensor, n: int, repeats: int, compiled: bool = True) -> dict:
    """attnlab's greedy generate (compiled decode step and eager) and transformers' on the same weights, after
    one warm-up call each (attnlab's first compiled call compiles the step), then `repeats` rounds with a
    rotated order. Returns {"totals", "steps", "tokens", "first_call"}, each keyed by implementation: seconds
    of each whole call, seconds between consecutive tokens, the tokens, and the first call's seconds."""
    mask = torch.ones_like(prompt)
    stamps: list[float] = []  # attnlab: the time each new token was chosen (generate's callback)

    def run_attnlab(compile: bool):
        def run() -> torch.Tensor:
            stamp = stamps.append
            return attnlab.generate(
                model,
                prompt[0],
                max_new_tokens=n,
                temperature=0,
                compile=compile,
                callback=lambda _: stamp(time.perf_counter()),
            )

        return run

    def run_hf() -> torch.Tensor:
        out = hf.generate(
            prompt,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        return out[0, prompt.shape[1] :]

    runs = {"attnlab": run_attnlab(True), "attnlab-eager": run_attnlab(False), "transformers": run_hf}
    if not compiled:
        del runs["attnlab"]
    totals = {name: [] for name in runs}
    steps = {name: [] for name in runs}
    tokens, first_call = {}, {}
    for name, fn in runs.items():  # warm-up; attnlab's first compiled call includes compiling the decode step
        start = time.perf_counter()
        tokens[name] = fn()
        first_call[name] = time.perf_counter() - start
    for r in range(repeats):
        order = list(runs)[r % len(runs) :] + list(runs)[: r % len(runs)]  # rotate which goes first
        for name in order:
            stamps.clear()
            clock = ForwardClock(hf) if name == "transformers" else None
            start = time.perf_counter()
            tokens[name] = runs[name]()
            totals[name].append(time.perf_counter() - start)
            if clock is not None:
                clock.handle.remove()
                steps[name] += clock.intervals()
            else:  # between consecutive tokens: one decode step (and choosing the token)
                steps[name] += [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    for name in runs:
        if not torch.equal(tokens[name], tokens["transformers"]):
            diverge = int((tokens[name] != tokens["transformers"]).nonzero()[0, 0])
            print(f"WARNING: {name} and transformers generated different tokens (first difference at step {diverge})")
    return {"totals": totals, "steps": steps, "tokens": tokens, "first_call": first_call}


def part_a(args, env) -> list[dict]:
    hf = hf_llama()
    cfg, model = attnlab.from_hf_llama(hf)
    n = args.new_tokens
    prompt = torch.randint(0, VOCAB, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    timed = generate_rounds(model, hf, prompt, n, args.repeats)
    totals, steps, tokens, first_call = timed["totals"], timed["steps"], timed["tokens"], timed["first_call"]
    runs = list(totals)
    same = all(torch.equal(tokens[name], tokens["transformers"]) for name in runs)
    e2e = {name: n / median(t) for name, t in totals.items()}
    per_token = {name: 1 / median(s) for name, s in steps.items()}
    compile_seconds = first_call["attnlab"] - median(totals["attnlab"])
    records, table = [], []
    for name in runs:
        figures = {
            "part": "a",
            "impl": name,
            "compiled": name == "attnlab",
            "prompt_tokens": args.prompt,
            "new_tokens": n,
            "generate_seconds": totals[name],
            "first_call_seconds": first_call[name],
            "spread": spread(totals[name]),
            "tok_per_s_end_to_end": e2e[name],
            "tok_per_s_per_token": per_token[name],
            "step_seconds_median": median(steps[name]),
            "ratio_end_to_end_vs_hf": e2e[name] / e2e["transformers"],
            "ratio_per_token_vs_hf": per_token[name] / per_token["transformers"],
            "same_tokens": same,
            "repeats": args.repeats,
        }
        records.append(row("decode", cfg.config_hash(), env, **figures))
        table.append(
            [
                name,
                f"{e2e[name]:.0f}",
                f"{figures['spread']:.2f}",
                f"{figures['ratio_end_to_end_vs_hf']:.2f}",
                f"{per_token[name]:.0f}",
                f"{median(steps[name]) * 1e3:.3f}",
                f"{figures['ratio_per_token_vs_hf']:.2f}",
            ]
        )
    print(f"\n(a) greedy generate, batch 1, prompt {args.prompt} + {n} new tokens, same weights; same tokens: {same}")
    print_table(["impl", "tok/s end-to-end", "spread", "x HF", "tok/s per token", "ms/token (median)", "x HF"], table)
    ratio = e2e["attnlab"] / e2e["transformers"]
    print(
        f"attnlab (compiled decode) / transformers: {ratio:.2f}x end to end, "
        f"{per_token['attnlab'] / per_token['transformers']:.2f}x per token (goal: >= 5x)"
    )
    print(
        f"compiling attnlab's decode step: {compile_seconds:.1f} s (first call {first_call['attnlab']:.1f} s, "
        "not in the figures; less when inductor's on-disk cache already holds it)"
    )
    return records


def variant_config(name: str) -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB,
        d_model=D_MODEL,
        n_layers=N_LAYERS,
        n_heads=N_HEADS,
        max_seq_len=MAX_SEQ_LEN,
        attention=VARIANTS[name],
        name=f"bench-decode-{name}",
    )


@torch.no_grad()
def timed_decode(model, cache, logits: torch.Tensor, steps: int, compiled: bool) -> tuple[float, list[float]]:
    """Greedy decode `steps` tokens from a prefilled cache: (seconds of the loop, seconds of each step).
    compiled: generate's compiled static-shape step (the cache must be in static mode), else the eager one."""
    per_step = []
    step = compiled_decode_step(model) if compiled else None
    positions = torch.tensor([cache.seen])
    start = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        token = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        if step is None:
            logits = decode_step(model, token, cache)
        else:
            logits, _ = step(model, token, positions, cache.layers)
            positions += 1
            cache.seen += 1
        per_step.append(time.perf_counter() - t)
    return time.perf_counter() - start, per_step


def part_b(args, env) -> list[dict]:
    names = [n for n in args.variants.split(",") if n]
    for name in names:
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r} (choose from {', '.join(VARIANTS)})")
    torch.manual_seed(0)
    models = {name: build_model(variant_config(name)).eval() for name in names}
    contexts = [int(c) for c in args.contexts.split(",")]
    records, table = [], []
    step_kind = "compiled" if args.compiled else "eager"
    print(
        f"\n(b) decode {args.steps} greedy {step_kind} steps after a context of L tokens (prefill not timed), batch 1"
    )
    for length in contexts:
        if length + args.steps > MAX_SEQ_LEN:
            raise SystemExit(f"context {length} + {args.steps} steps exceeds max_seq_len={MAX_SEQ_LEN}")
        context = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        prefilled = {}
        for name, model in models.items():
            cache = model.new_cache(1, length + args.steps)
            prefilled[name] = (cache, prefill(model, context, cache))
            cache.set_static(args.compiled)
            # warm-up (compiled: compiles the step for this cache size, not timed)
            timed_decode(model, copy.deepcopy(cache), prefilled[name][1], min(8, args.steps), args.compiled)
        loops = {name: [] for name in names}
        steps = {name: [] for name in names}
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                cache, logits = prefilled[name]
                seconds, per_step = timed_decode(models[name], copy.deepcopy(cache), logits, args.steps, args.compiled)
                loops[name].append(seconds)
                steps[name] += per_step
        ref_loop, ref_step = median(loops[names[0]]), median(steps[names[0]])
        for name in names:
            cfg = models[name].cfg
            kv_bytes = models[name].new_cache(1, length).nbytes()  # measured from the tensors of an L-token cache
            tok_s = args.steps / median(loops[name])
            tok_s_step = 1 / median(steps[name])
            figures = {
                "part": "b",
                "impl": "attnlab",
                "compiled": args.compiled,
                "name": name,
                "kind": cfg.kind,
                "attention": cfg.attention.to_dict(),
                "context": length,
                "decode_steps": args.steps,
                "loop_seconds": loops[name],
                "spread": spread(loops[name]),
                "tok_per_s": tok_s,
                "tok_per_s_median_step": tok_s_step,
                "ratio_to_first": ref_loop / median(loops[name]),
                "ratio_to_first_median_step": ref_step / median(steps[name]),
                "reference": names[0],
                "kv_cache_bytes": kv_bytes,
                "repeats": args.repeats,
            }
            records.append(row("decode", cfg.config_hash(), env, **figures))
            table.append(
                [
                    length,
                    name,
                    f"{kv_bytes / 2**20:.2f}",
                    f"{tok_s:.0f}",
                    f"{figures['spread']:.2f}",
                    f"{figures['ratio_to_first']:.2f}",
                    f"{tok_s_step:.0f}",
                    f"{figures['ratio_to_first_median_step']:.2f}",
                ]
            )
        print(f"  L={length}: " + ", ".join(f"{n} {args.steps / median(loops[n]):.0f} tok/s" for n in names))
    print_table(
        ["L", "model", "KV MiB", "tok/s", "spread", f"x {names[0]}", "tok/s (median step)", f"x {names[0]}"],
        table,
    )
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="a,b", help="which parts to run: a, b or a,b (default)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default: a 5, b 3)")
    parser.add_argument("--prompt", type=int, default=32, help="(a) prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128, help="(a) generated tokens")
    parser.add_argument("--steps", type=int, default=64, help="(b) timed decode steps per context")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="(b) context lengths")
    parser.add_argument(
        "--variants", default="mha,gqa2,bottleneck32,decoupled16/32", help="(b) variants; the first is the reference"
    )
    parser.add_argument("--compiled", action="store_true", help="(b) time the compiled decode step, not the eager one")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = set(args.part.split(","))
    # The machine's speed at the start of the run, for reading the records later (shared CPUs drift).
    env = {**environment(), "matmul_gflops": matmul_gflops(repeats=3)}
    print(
        f"decode: fp32, CPU, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"fp32 matmul 2048^3 {env['matmul_gflops']:.0f} GFLOP/s"
    )
    records, load = [], OtherLoad()
    if "a" in parts:
        records += part_a(argparse.Namespace(**{**vars(args), "repeats": args.repeats or 5}), env)
    if "b" in parts:
        records += part_b(argparse.Namespace(**{**vars(args), "repeats": args.repeats or 3}), env)
    finish("decode", records, load.fraction(), not args.no_record)


if __name__ == "__main__":
    main()
