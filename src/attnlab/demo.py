"""`make demo`: the attention zoo side by side on one CPU, in about a minute.

1. The seeds' published KV-cache figures, recomputed from the shipped configs.
2. The design doc's tiny model with every attention kind: parameters, KV bytes at 256 tokens, a check
   that cached decoding reproduces the full forward pass, and greedy decode speed.
3. A real trained model, karpathy's stories260K (llama2.c format), imported and telling a story, when
   the data directory holds it (--data-dir DIR or $ATTNLAB_DATA).
4. A real pretrained model, SmolLM2-135M-Instruct (the GGUF in the data directory), loaded by reference:
   a continued prompt, its held-out perplexity and a short ARC-Easy score (about a minute).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

import attnlab
from attnlab.accounting import kv_report, param_counts
from attnlab.cli_errors import Parser
from attnlab.errors import DataError
from attnlab.eval import load_for_eval
from attnlab.eval.multiple_choice import run_multiple_choice
from attnlab.eval.perplexity import run_perplexity
from attnlab.interop import decode_llama2c, from_llama2c, load_llama2c_vocab
from attnlab.paths import find_data_file

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
PUBLISHED = {  # bytes/token at fp16, as the seed papers state them
    "dba-22l-baseline": 180_224,
    "dba-22l-decoupled": 112_640,
    "dba-12l-baseline": 98_304,
    "dba-12l-decoupled": 61_440,
    "dba-12l-gqa": 12_288,
}


def seed_figures() -> None:
    print("KV cache of the seeds' architectures (fp16, bytes per token, all layers)")
    print(f"  {'config':<20} {'attnlab':>10} {'published':>10}")
    for name, published in PUBLISHED.items():
        ours = kv_report(attnlab.load_config(CONFIGS / f"{name}.yaml"), "fp16")["kv_bytes_per_token"]
        print(f"  {name:<20} {ours:>10,} {published:>10,}  {'ok' if ours == published else 'MISMATCH'}")


def tiny_zoo(new_tokens: int = 64) -> None:
    print("\nThe design doc's tiny model (d_model 128, 8 heads, 4 layers) with each attention kind, fp32")
    header = f"  {'config':<16} {'params':>10} {'KV@256 tok':>11} {'cached=full':>12} {'decode tok/s':>13}"
    print(header)
    tokens = torch.randint(0, 4096, (1, 96), generator=torch.Generator().manual_seed(0))
    for path in sorted(CONFIGS.glob("tiny-*.yaml")):
        cfg = attnlab.load_config(path)
        torch.manual_seed(0)
        model = attnlab.build_model(cfg).eval()
        with torch.no_grad():
            full, _ = model(tokens, use_cache=False)
            cache = model.new_cache(1, cfg.max_seq_len)
            steps = [model(tokens[:, :40], cache=cache)[0]]
            steps += [model(tokens[:, t : t + 1], cache=cache)[0] for t in range(40, tokens.shape[1])]
        error = (torch.cat(steps, dim=1) - full).abs().max().item()
        attnlab.generate(model, tokens[0, :32], max_new_tokens=new_tokens)  # warm-up (first calls are slow)
        start = time.perf_counter()
        attnlab.generate(model, tokens[0, :32], max_new_tokens=new_tokens)
        speed = new_tokens / (time.perf_counter() - start)
        kv = kv_report(cfg, "fp32", 256)["kv_bytes"]
        print(
            f"  {cfg.name:<16} {param_counts(model)['total']:>10,} {kv:>11,} {'yes' if error < 1e-4 else 'NO':>12}"
            f" {speed:>13,.0f}"
        )


def story(data_dir: str | None) -> None:
    print("\nA real model: llama2.c's stories260K (GQA 8/4 heads, interleaved RoPE), greedy from BOS")
    try:
        checkpoint = find_data_file("llama2c-stories260K/stories260K.bin", data_dir)
        vocab = load_llama2c_vocab(find_data_file("llama2c-stories260K/tok512.bin", data_dir))
    except DataError as e:
        print(f"  skipped: {e}")
        return
    _, model = from_llama2c(checkpoint)
    start = time.perf_counter()
    ids = attnlab.generate(model, [1], max_new_tokens=120, compile=False)  # one short call: compiling costs more
    seconds = time.perf_counter() - start
    print("  " + decode_llama2c(vocab, ids).replace("\n", "\n  "))
    print(f"  ({len(ids)} tokens in {seconds:.2f} s)")


SMOLLM2 = "models/SmolLM2-135M-Instruct.Q4_1.gguf"


def pretrained(data_dir: str | None, tokens: int = 2048, items: int = 40) -> None:
    """4. A real pretrained model by reference, when the data directory holds it: SmolLM2-135M-Instruct (GGUF)."""
    print("\nA real pretrained model: SmolLM2-135M-Instruct (GGUF, Llama architecture), loaded by reference")
    try:
        path = find_data_file(SMOLLM2, data_dir)
    except DataError as e:
        print(f"  skipped: {e}")
        return
    start = time.perf_counter()
    model = load_for_eval(path, data_dir=data_dir)
    print(f"  {param_counts(model.model)['total']:,} parameters, loaded in {time.perf_counter() - start:.1f} s")
    prompt = "The three primary colors are"
    ids = attnlab.generate(model.model, model.tokenizer.encode_prompt(prompt), max_new_tokens=16, compile=False,
                           stop_tokens=model.tokenizer.stop_ids)  # fmt: skip
    print(f"  {prompt}{model.tokenizer.decode([i for i in ids.tolist() if i not in model.tokenizer.stop_ids])}")
    try:
        record = run_perplexity(model, seq_len=512, max_tokens=tokens, data_dir=data_dir, dataset="wikitext2-raw")
        print(f"  WikiText-2 raw test, first {tokens:,} tokens at context 512: perplexity {record['ppl']:.1f} "
              f"[{record['ppl_ci'][0]:.1f}, {record['ppl_ci'][1]:.1f}] (its own 49,152-token BPE: not comparable "
              "per token with the quickstart's 4,096-token BPE)")  # fmt: skip
        _, summary = run_multiple_choice(model, "arc_easy", limit=items, data_dir=data_dir)
        acc, acc_norm = summary["acc"], summary["acc_norm"]
        print(f"  ARC-Easy, first {items} items, zero-shot: acc {acc:.2f}, acc_norm {acc_norm:.2f} (chance 0.25; "
              "the quickstart models, trained for minutes, sit there)")  # fmt: skip
    except DataError as e:
        print(f"  scores skipped: {e}")


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m attnlab.demo", description="the attnlab demo")  # a usage error: one line, exit 2
    parser.add_argument("--data-dir", default=None, help="directory with llama2c-stories260K/ (or $ATTNLAB_DATA)")
    args = parser.parse_args(argv)
    seed_figures()
    tiny_zoo()
    story(args.data_dir)
    pretrained(args.data_dir)
    print("\nNext: `attnlab info configs/models/<name>.yaml`, `attnlab list`, and the README.")


if __name__ == "__main__":
    main()
