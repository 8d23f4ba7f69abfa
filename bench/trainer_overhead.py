"""Training throughput under attnlab's trainer vs a bare loop on the same model, in the same process.

The bare loop is forward + cross-entropy + backward + clip + AdamW on batches made in advance; the
trainer adds everything a real run does (sampling windows from the memory-mapped token file, the LR
schedule, logging, NaN checks). Rounds alternate trainer / bare so machine noise hits both. Evaluation
and checkpoint time are excluded from the trainer's figure (the trainer itself excludes them from its
tok/s). Also reports the share of a step spent drawing a batch from the token file.

    python bench/trainer_overhead.py [--steps 40] [--rounds 3] [--data-dir ../shared/data]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import attnlab  # noqa: E402
from attnlab.config import DataConfig, TrainConfig  # noqa: E402
from attnlab.data import BatchSampler, prepare  # noqa: E402
from attnlab.train.loop import train  # noqa: E402
from attnlab.train.optim import build_optimizer  # noqa: E402

MODEL = {"d_model": 128, "n_layers": 4, "n_heads": 8, "max_seq_len": 256}


def trainer_tok_s(model_cfg, data_cfg, train_cfg, prepared) -> float:
    with tempfile.TemporaryDirectory() as out:
        train(model_cfg, data_cfg, train_cfg, Path(out) / "run", prepared=prepared, progress=False)
        rows = [json.loads(line) for line in (Path(out) / "run" / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tok_per_s"] for r in rows if "tok_per_s" in r][1:]  # the first window holds the warm-up
    return statistics.median(speeds)


def bare_tok_s(model_cfg, train_cfg, batches) -> float:
    torch.manual_seed(train_cfg.seed)
    model = attnlab.build_model(model_cfg).train()
    optimizer = build_optimizer(model, train_cfg)

    def step(x, y):
        logits, _ = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for x, y in batches[: train_cfg.log_every]:  # the same warm-up the trainer's first window holds
        step(x, y)
    start = time.perf_counter()
    for x, y in batches[train_cfg.log_every :]:
        step(x, y)
    n = len(batches) - train_cfg.log_every
    return n * batches[0][0].numel() / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", default=str(common.REPO_ROOT.parent / "shared" / "data"))
    args = parser.parse_args()

    data_cfg = DataConfig(source="wikitext2", tokenizer="bpe:4096")
    prepared = prepare(data_cfg, data_dir=args.data_dir)
    model_cfg = attnlab.model_config_from_dict({**MODEL, "vocab_size": prepared.vocab_size})
    train_cfg = TrainConfig(seq_len=128, batch_size=16, steps=args.steps, lr=1e-3, warmup_steps=5, log_every=5,
                            eval_every=10**6, checkpoint_every=10**6, eval_tokens=4096)  # fmt: skip
    sampler = BatchSampler(prepared.split("train"), train_cfg.seq_len, train_cfg.batch_size, seed=0)
    batches = [sampler.next_batch() for _ in range(args.steps)]

    start = time.perf_counter()
    for _ in range(200):
        sampler.next_batch()
    sample_seconds = (time.perf_counter() - start) / 200

    env = common.environment()
    load = common.OtherLoad()
    trainer, bare = [], []
    for _ in range(args.rounds):
        trainer.append(trainer_tok_s(model_cfg, data_cfg, train_cfg, prepared))
        bare.append(bare_tok_s(model_cfg, train_cfg, batches))
    step_seconds = train_cfg.batch_size * train_cfg.seq_len / statistics.median(bare)
    figures = {
        "trainer_tok_s": statistics.median(trainer),
        "bare_tok_s": statistics.median(bare),
        "trainer_over_bare": statistics.median(trainer) / statistics.median(bare),
        "trainer_rounds": trainer,
        "bare_rounds": bare,
        "batch_sample_ms": sample_seconds * 1e3,
        "batch_sample_share_of_step": sample_seconds / step_seconds,
        "other_load": load.fraction(),
    }
    common.append_rows("trainer_overhead", [common.row("trainer_overhead", model_cfg.config_hash(), env, **figures)])
    common.print_table(
        ["trainer tok/s", "bare tok/s", "trainer / bare", "batch draw ms", "draw share of step", "other load"],
        [[figures["trainer_tok_s"], figures["bare_tok_s"], figures["trainer_over_bare"], figures["batch_sample_ms"],
          figures["batch_sample_share_of_step"], figures["other_load"]]],
    )  # fmt: skip


if __name__ == "__main__":
    main()
