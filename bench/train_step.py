"""Training-step throughput (forward + backward + AdamW step, fp32, CPU) of every attention variant, against
transformers' LlamaForCausalLM of the same shape, measured in the same process.

    python bench/train_step.py [--rounds 5] [--steps 2] [--threads N]

Shape: d_model 256, 4 layers, 8 heads, vocab 8192, batch 8 x 256 tokens. The models are timed in
interleaved rounds (each round runs `steps` timed steps of every model, in a rotated order), so machine
noise hits them all alike; figures are medians over the timed steps. On a shared machine, steps during
which other processes took CPU time this run's threads needed (--max-other-load) are left out of the figures (the record
keeps every step with its load). Achieved FLOP/s is compared with a large fp32 matmul measured once per
round in the same process.

FLOPs per training step (stated approximation, PaLM appendix B convention):
    6 * matmul_params * tokens                      every nn.Linear weight, LM head included, embedding
                                                    lookup excluded; x3 = forward + backward (2 matmuls)
  + 6 * n_layers * span * (d_qk + d_v) * tokens     scores q.k and the weighted sum of v; span = seq_len
                                                    (full T x T, as PaLM counts it; sliding: min(window, T))
where d_qk, d_v are the total widths over query heads (MHA: d_model each).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    OtherLoad,
    append_rows,
    environment,
    matmul_gflops,
    median,
    print_table,
    row,
    spread,
    time_once,
)

from attnlab import ModelConfig, build_model  # noqa: E402
from attnlab.attention.bottleneck import BottleneckConfig  # noqa: E402
from attnlab.attention.decoupled import DecoupledConfig  # noqa: E402
from attnlab.attention.mha import MHAConfig  # noqa: E402
from attnlab.attention.mla import MLAConfig  # noqa: E402
from attnlab.attention.sliding import SlidingConfig  # noqa: E402
from attnlab.config import AttentionConfig  # noqa: E402

D_MODEL, N_LAYERS, N_HEADS, VOCAB, BATCH, SEQ_LEN = 256, 4, 8, 8192, 8, 256

VARIANTS: dict[str, AttentionConfig] = {
    "mha": MHAConfig(),
    "gqa2": MHAConfig(n_kv_heads=2),
    "mqa": MHAConfig(n_kv_heads=1),
    "bottleneck64+null": BottleneckConfig(d_attn=64, null_attn=True),
    "decoupled32/128": DecoupledConfig(d_sem=32, d_geo=128, gate=False),
    "sliding64": SlidingConfig(window=64),
    "mla64": MLAConfig(d_latent=64),
}


def model_config(attention: AttentionConfig, name: str) -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB,
        d_model=D_MODEL,
        n_layers=N_LAYERS,
        n_heads=N_HEADS,
        max_seq_len=SEQ_LEN,
        attention=attention,
        name=f"bench-train-{name}",
    )


def hf_llama(cfg: ModelConfig) -> nn.Module:
    """transformers' Llama of the same shape as attnlab's mha config `cfg` (SDPA attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        hidden_size=cfg.d_model,
        intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(hf_cfg)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model


def attention_widths(cfg: ModelConfig) -> tuple[int, int, int]:
    """(d_qk, d_v, span): total query/key and value widths over the query heads, and keys per query."""
    att, heads = cfg.attention, cfg.n_heads
    span = cfg.max_seq_len
    if isinstance(att, MHAConfig):  # mha, gqa, mqa, sliding
        width = heads * att.dim(cfg)
        if isinstance(att, SlidingConfig):
            span = min(att.window, span)
        return width, width, span
    if isinstance(att, BottleneckConfig):
        return att.d_attn, att.d_attn, span
    if isinstance(att, DecoupledConfig):
        return att.d_sem + att.d_geo, att.value_dim, span
    if isinstance(att, MLAConfig):
        head_dim, d_rope, v_dim = att.dims(cfg)
        return heads * (head_dim + d_rope), heads * v_dim, span
    raise ValueError(f"no FLOP formula for attention kind {att.kind!r}")


def matmul_params(model: nn.Module) -> int:
    """Weights of every nn.Linear (the LM head counts even when tied to the embedding: it is a matmul)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def train_flops(model: nn.Module, cfg: ModelConfig, tokens: int) -> float:
    d_qk, d_v, span = attention_widths(cfg)
    return 6 * matmul_params(model) * tokens + 6 * cfg.n_layers * span * (d_qk + d_v) * tokens


@dataclass
class Case:
    name: str
    impl: str  # "attnlab" or "transformers"
    cfg: ModelConfig  # for HF: the equivalent attnlab config (same shape)
    model: nn.Module
    optimizer: torch.optim.Optimizer
    flops: float
    times: list[float]  # seconds of each timed step
    loads: list[float | None]  # share of the CPU used by other processes during each timed step

    def used(self, max_other_load: float) -> list[float]:
        """Step times taken while the machine was otherwise quiet (all of them if fewer than 3 were)."""
        return quiet(self.times, self.loads, max_other_load)


def quiet(times: list[float], loads: list[float | None], max_other_load: float) -> list[float]:
    kept = [t for t, share in zip(times, loads, strict=True) if share is not None and share <= max_other_load]
    return kept if len(kept) >= 3 else times


def make_step(case: Case, batch: torch.Tensor):
    inputs, targets = batch[:, :-1], batch[:, 1:]

    def step() -> None:
        if case.impl == "transformers":
            logits = case.model(input_ids=inputs, use_cache=False).logits
        else:
            logits, _ = case.model(inputs)
        # The same loss for both: mean next-token cross-entropy over all positions.
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        case.optimizer.step()
        case.optimizer.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per model per round (default 2)")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=240.0,
        help="stop starting new rounds (after at least 2) once the next one would end past this many seconds "
        "(default 240; a busy shared machine can make steps 10x slower)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per model before round 1")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of variants")
    parser.add_argument(
        "--max-other-load",
        type=float,
        default=None,
        help="figures use only steps during which other processes used at most this share of the CPU "
        "(default: the share of cores this run leaves idle + 0.1, i.e. 0.1 with all cores in use; "
        "all steps if fewer than 3 qualify)",
    )
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' Llama")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokens = BATCH * SEQ_LEN
    batch = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))

    cases: list[Case] = []
    names = [n for n in args.variants.split(",") if n]
    for name in names:
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r} (choose from {', '.join(VARIANTS)})")
    mha_cfg = model_config(VARIANTS["mha"], "mha")
    if not args.no_hf:
        model = hf_llama(mha_cfg).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        cases.append(Case("hf-llama", "transformers", mha_cfg, model, opt, train_flops(model, mha_cfg, tokens), [], []))
    for name in names:
        cfg = model_config(VARIANTS[name], name)
        model = build_model(cfg).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        cases.append(Case(name, "attnlab", cfg, model, opt, train_flops(model, cfg, tokens), [], []))

    steps = {case.name: make_step(case, batch) for case in cases}
    print(
        f"train step: batch {BATCH} x {SEQ_LEN} tokens, d_model {D_MODEL}, {N_LAYERS} layers, {N_HEADS} heads, "
        f"vocab {VOCAB}, fp32, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    load = OtherLoad()
    for case in cases:
        for _ in range(args.warmup):
            steps[case.name]()
    matmul, matmul_loads = [], []
    started = time.perf_counter()
    for r in range(args.rounds):
        elapsed = time.perf_counter() - started
        if r >= 2 and elapsed * (r + 1) / r > args.time_budget:
            print(f"  stopping after {r} rounds: the time budget of {args.time_budget:.0f}s would be exceeded")
            break
        load.lap()
        matmul.append(matmul_gflops(repeats=3))
        matmul_loads.append(load.lap())
        order = cases[r % len(cases) :] + cases[: r % len(cases)]  # rotate, so no model always runs first
        for case in order:
            for _ in range(args.steps):
                load.lap()
                case.times.append(time_once(steps[case.name]))
                case.loads.append(load.lap())
        print(
            f"  round {r + 1}/{args.rounds}: matmul {matmul[-1]:.0f} GFLOP/s, "
            + ", ".join(f"{c.name} {median(c.times[-args.steps :]):.3f}s" for c in cases)
            + ", other load "
            + ", ".join(f"{x:.2f}" for c in cases for x in c.loads[-args.steps :] if x is not None)
        )
    max_other = args.max_other_load
    if max_other is None:
        cpus = os.cpu_count() or 1
        max_other = max(0.0, cpus - torch.get_num_threads()) / cpus + 0.1
    matmul_ref = median(quiet(matmul, matmul_loads, max_other))

    by_name = {case.name: case for case in cases}
    mha_tok_s = tokens / median(by_name["mha"].used(max_other)) if "mha" in by_name else None
    hf_tok_s = tokens / median(by_name["hf-llama"].used(max_other)) if "hf-llama" in by_name else None
    env = {**environment(), "other_load": load.fraction()}
    table, records = [], []
    for case in cases:
        used = case.used(max_other)
        seconds = median(used)
        tok_s = tokens / seconds
        achieved = case.flops / seconds / 1e9
        figures = {
            "name": case.name,
            "impl": case.impl,
            "kind": case.cfg.kind,
            "attention": case.cfg.attention.to_dict(),
            "batch": BATCH,
            "seq_len": SEQ_LEN,
            "params": sum(p.numel() for p in case.model.parameters()),
            "step_seconds_median": seconds,
            "step_seconds": case.times,
            "step_other_load": case.loads,
            "steps_used": len(used),
            "max_other_load": max_other,
            "spread": spread(used),
            "tok_per_s": tok_s,
            "ratio_to_mha": tok_s / mha_tok_s if mha_tok_s else None,
            "ratio_to_hf": tok_s / hf_tok_s if hf_tok_s else None,
            "flops_per_step": case.flops,
            "achieved_gflops": achieved,
            "matmul_gflops": matmul_ref,
            "matmul_gflops_rounds": matmul,
            "matmul_other_load": matmul_loads,
            "fraction_of_matmul": achieved / matmul_ref,
            "rounds": len(matmul),
            "steps_per_round": args.steps,
        }
        records.append(row("train_step", case.cfg.config_hash(), env, **figures))
        table.append(
            [
                case.name,
                case.impl,
                f"{tok_s:.0f}",
                f"{seconds:.3f}",
                f"{len(used)}/{len(case.times)}",
                f"{figures['spread']:.2f}",
                f"{figures['ratio_to_mha']:.2f}" if mha_tok_s else "-",
                f"{achieved:.1f}",
                f"{achieved / matmul_ref:.2f}",
            ]
        )
    if env["other_load"] is not None and env["other_load"] > 0.1:
        print(f"\nWARNING: other processes used {env['other_load']:.0%} of the machine's CPU during the run")
    print(
        f"\nreference fp32 matmul 2048^3: {matmul_ref:.0f} GFLOP/s (median of {len(matmul)} rounds: "
        + ", ".join(f"{g:.0f}" for g in matmul)
        + ")"
    )
    print_table(
        ["model", "impl", "tok/s", "step s (median)", "steps used", "spread", "x mha", "GFLOP/s", "of matmul"], table
    )
    if mha_tok_s and hf_tok_s:
        print(f"\nattnlab mha / HF Llama tok/s: {mha_tok_s / hf_tok_s:.2f} (goal: >= 1.0)")
    if not args.no_record:
        print(f"recorded {len(records)} rows in {append_rows('train_step', records)}")


if __name__ == "__main__":
    main()
