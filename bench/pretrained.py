"""A real pretrained model, SmolLM2-135M-Instruct (the GGUF in the data directory), fp32, CPU, batch 1: attnlab
against transformers on the same weights.

    python bench/pretrained.py [--part load,prefill,decode] [--repeats 3] [--prefill 512,2048]
                               [--prompt 128] [--new-tokens 64] [--data-dir DIR] [--threads N]

load     each library loads the GGUF file in a fresh subprocess, weights dequantized to fp32:
         `attnlab.load_model(path)` against `AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
         dtype=float32)`; seconds from the call to a ready model (imports not counted), and the process's peak
         resident memory (ru_maxrss) with its resident memory after the imports.
prefill  one forward pass over the first L tokens of WikiText-2 raw test through a fresh cache (attnlab:
         `model(ids, cache=model.new_cache(1, L))`; transformers: `model(ids, use_cache=True)`), L / seconds,
         median of rotated rounds after one warm-up each; the last position's logits are compared.
decode   greedy generate of N new tokens after a P-token prompt (bench/decode.py's method): attnlab with its
         compiled decode step and eager, transformers' generate; end to end and per token; same tokens checked.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OtherLoad, environment, finish, matmul_gflops, median, print_table, row, spread  # noqa: E402
from decode import generate_rounds  # noqa: E402

from attnlab.paths import find_data_file  # noqa: E402

SMOLLM2 = "models/SmolLM2-135M-Instruct.Q4_1.gguf"

LOADERS = {  # name: (imports, the load), run in a fresh interpreter by MEASURE
    "attnlab": ("import attnlab", "cfg, model, tok = attnlab.load_model(PATH)"),
    "transformers": (
        "import transformers",
        "model = transformers.AutoModelForCausalLM.from_pretrained(PATH.parent, gguf_file=PATH.name, "
        "dtype=torch.float32).eval()",
    ),
}
MEASURE = """
import json, resource, sys, time
from pathlib import Path
import torch
torch.set_num_threads({threads})
PATH = Path({path!r})
def rss_mb():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
{imports}
start = time.perf_counter()
{load}
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rss_mb": rss_mb()}}))
"""


def measure(path: Path, imports: str, load: str) -> dict:
    """{"seconds", "peak_rss_mb", "rss_mb"} of `load` run after `imports` in a fresh interpreter."""
    script = MEASURE.format(threads=torch.get_num_threads(), path=str(path), imports=imports, load=load)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_part(path: Path, repeats: int, env: dict) -> list[dict]:
    records, table = [], []
    for name, (imports_code, load_code) in LOADERS.items():
        runs = [measure(path, imports_code, load_code) for _ in range(repeats)]
        imports = measure(path, imports_code, "pass")  # the process's size before the model
        seconds = [r["seconds"] for r in runs]
        figures = {"part": "load", "impl": name, "load_seconds": seconds, "load_seconds_median": median(seconds),
                   "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "rss_after_imports_mb": imports["rss_mb"],
                   "repeats": repeats}  # fmt: skip
        records.append(row("pretrained", "smollm2-135m", env, **figures))
        table.append([name, f"{median(seconds):.1f}", f"{spread(seconds):.2f}", f"{figures['peak_rss_mb']:.0f}",
                      f"{imports['rss_mb']:.0f}", f"{figures['peak_rss_mb'] - imports['rss_mb']:.0f}"])  # fmt: skip
    print(f"\nload {path.name} (fp32), fresh process each, {repeats} runs")
    print_table(["impl", "load s (median)", "spread", "peak RSS MB", "RSS after imports MB", "difference MB"], table)
    return records


def prefill_part(model, hf, text: torch.Tensor, lengths: list[int], repeats: int, env: dict) -> list[dict]:
    def run_attnlab(ids):
        with torch.no_grad():
            return model(ids, cache=model.new_cache(1, ids.shape[1]))[0][0, -1]

    def run_hf(ids):
        with torch.no_grad():
            return hf(ids, use_cache=True).logits[0, -1]

    runs = {"attnlab": run_attnlab, "transformers": run_hf}
    records, table = [], []
    for length in lengths:
        ids = text[None, :length]
        last = {name: fn(ids) for name, fn in runs.items()}  # warm-up
        gap = (last["attnlab"] - last["transformers"]).abs().max().item()
        times = {name: [] for name in runs}
        for r in range(repeats):
            for name in list(runs)[r % 2 :] + list(runs)[: r % 2]:
                start = time.perf_counter()
                runs[name](ids)
                times[name].append(time.perf_counter() - start)
        speed = {name: length / median(t) for name, t in times.items()}
        for name in runs:
            figures = {"part": "prefill", "impl": name, "tokens": length, "seconds": times[name],
                       "tok_per_s": speed[name], "spread": spread(times[name]),
                       "ratio_vs_hf": speed[name] / speed["transformers"], "max_logit_gap": gap,
                       "repeats": repeats}  # fmt: skip
            records.append(row("pretrained", "smollm2-135m", env, **figures))
            table.append([length, name, f"{speed[name]:.0f}", f"{spread(times[name]):.2f}",
                          f"{speed[name] / speed['transformers']:.2f}", f"{gap:.1e}"])  # fmt: skip
    print(f"\nprefill, batch 1, one forward pass through a fresh cache, {repeats} rounds")
    print_table(["tokens", "impl", "tok/s", "spread", "x HF", "max |logit gap|"], table)
    return records


def decode_part(model, hf, text: torch.Tensor, prompt: int, n: int, repeats: int, env: dict) -> list[dict]:
    timed = generate_rounds(model, hf, text[None, :prompt], n, repeats)
    totals, steps, tokens, first = timed["totals"], timed["steps"], timed["tokens"], timed["first_call"]
    records, table = [], []
    for name in totals:
        e2e, per_token = n / median(totals[name]), 1 / median(steps[name])
        hf_e2e, hf_per_token = n / median(totals["transformers"]), 1 / median(steps["transformers"])
        figures = {"part": "decode", "impl": name, "prompt_tokens": prompt, "new_tokens": n,
                   "generate_seconds": totals[name], "first_call_seconds": first[name],
                   "tok_per_s_end_to_end": e2e, "tok_per_s_per_token": per_token,
                   "ratio_end_to_end_vs_hf": e2e / hf_e2e, "ratio_per_token_vs_hf": per_token / hf_per_token,
                   "same_tokens": torch.equal(tokens[name], tokens["transformers"]), "repeats": repeats}  # fmt: skip
        records.append(row("pretrained", "smollm2-135m", env, **figures))
        table.append([name, f"{e2e:.1f}", f"{spread(totals[name]):.2f}", f"{e2e / hf_e2e:.2f}", f"{per_token:.1f}",
                      f"{per_token / hf_per_token:.2f}", f"{first[name]:.1f}", figures["same_tokens"]])  # fmt: skip
    print(f"\ngreedy generate, batch 1, prompt {prompt} + {n} new tokens, {repeats} rounds")
    print_table(["impl", "tok/s end-to-end", "spread", "x HF", "tok/s per token", "x HF", "first call s",
                 "same tokens as HF"], table)  # fmt: skip
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="load,prefill,decode", help="parts to run (default all three)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (load: runs) per figure")
    parser.add_argument("--prefill", default="512,2048", help="prefill lengths")
    parser.add_argument("--prompt", type=int, default=128, help="decode: prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode: generated tokens")
    parser.add_argument("--data-dir", default=None, help="where the data files are (else $ATTNLAB_DATA)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = set(args.part.split(","))
    path = find_data_file(SMOLLM2, args.data_dir)
    env = {**environment(), "matmul_gflops": matmul_gflops(repeats=3)}
    print(f"pretrained: {path.name}, fp32, CPU, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"fp32 matmul 2048^3 {env['matmul_gflops']:.0f} GFLOP/s")  # fmt: skip
    records, load = [], OtherLoad()
    if "load" in parts:
        records += load_part(path, args.repeats, env)
    if parts & {"prefill", "decode"}:
        import transformers

        from attnlab.eval.loading import load_for_eval
        from attnlab.eval.perplexity import dataset_split

        evaluated = load_for_eval(str(path), data_dir=args.data_dir)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                               dtype=torch.float32).eval()  # fmt: skip
        hf.generation_config.eos_token_id = None  # every run generates exactly N tokens
        text = torch.from_numpy(dataset_split(evaluated, "wikitext2-raw", "test", args.data_dir)[:8192].copy())
        if "prefill" in parts:
            lengths = [int(x) for x in args.prefill.split(",")]
            records += prefill_part(evaluated.model, hf, text, lengths, args.repeats, env)
        if "decode" in parts:
            records += decode_part(evaluated.model, hf, text, args.prompt, args.new_tokens, args.repeats, env)
    finish("pretrained", records, load.fraction(), not args.no_record)


if __name__ == "__main__":
    main()
