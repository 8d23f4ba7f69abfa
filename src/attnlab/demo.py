"""`make demo`: the attention zoo side by side on one CPU, in about a minute.

1. The seeds' published KV-cache figures, recomputed from the shipped configs.
2. The design doc's tiny model with every attention kind: parameters, KV bytes at 256 tokens, a check
   that cached decoding reproduces the full forward pass, and greedy decode speed.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

import attnlab
from attnlab.accounting import kv_report, param_counts

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


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    seed_figures()
    tiny_zoo()
    print("\nNext: `attnlab info configs/models/<name>.yaml`, `attnlab list`, and the README.")


if __name__ == "__main__":
    main()
