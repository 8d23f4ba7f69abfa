"""Held-out loss on non-overlapping windows, scored over the true vocabulary."""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from attnlab.data import eval_batches


@torch.no_grad()
def evaluate_loss(model, batches, device=None, autocast_dtype=None, pad_to: int | None = None) -> dict:
    """Mean next-token loss over every target in `batches` ((x, y) int64 pairs, (B, T) each).

    Returns {"loss", "ppl", "tokens", "sum"}; each token counts once (windows do not overlap). pad_to: run the model
    on that many batches in all, the ones past `batches` on a dummy window scored nowhere (a sharded model's
    processes must all run it the same number of times).
    """
    was_training = model.training
    model.eval()
    total, count, runs, shape = 0.0, 0, 0, None
    try:
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            with torch.autocast(
                x.device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None
            ):
                logits, _ = model(x, use_cache=False)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
            total += loss.item()
            count += y.numel()
            runs, shape = runs + 1, x[:1].shape
        while pad_to is not None and runs < pad_to:
            model(torch.zeros(shape or (1, 1), dtype=torch.long, device=device), use_cache=False)
            runs += 1
    finally:
        model.train(was_training)
    return _result(total, count)


def _result(total: float, count: int) -> dict:
    if count == 0:
        return {"loss": float("nan"), "ppl": float("nan"), "tokens": 0, "sum": 0.0}
    loss = total / count
    # exp(loss) as it is, as a perplexity record holds it (infinite past a float's range): the summary's figures agree
    ppl = math.exp(loss) if loss < math.log(sys.float_info.max) else math.inf
    return {"loss": loss, "ppl": ppl, "tokens": count, "sum": total}


def evaluate_split(model, tokens, seq_len: int, batch_size: int, max_tokens, device, autocast_dtype, info) -> dict:
    """evaluate_loss over a split's windows (eval_batches), shared out over the processes of `info` (a DistInfo):
    each scores windows rank, rank + world_size, ... and the sums are added up, so every process returns the loss
    of the whole set. Every process runs the model the same number of times (a sharded model's requirement)."""
    world = info.world_size if dist.is_initialized() else 1
    rank = info.rank if world > 1 else 0
    if world == 1:
        return evaluate_loss(model, eval_batches(tokens, seq_len, batch_size, max_tokens), device, autocast_dtype)
    windows = min((len(tokens) - 1) // seq_len, (max_tokens if max_tokens is not None else len(tokens)) // seq_len)
    first = -(-windows // world)  # rank 0 scores the most windows: ceil(windows / world_size)
    most = -(-first // batch_size)  # batches
    batches = eval_batches(tokens, seq_len, batch_size, max_tokens, rank=rank, world_size=world)
    mine = evaluate_loss(model, batches, device, autocast_dtype, pad_to=most)
    sums = torch.tensor([mine["sum"], mine["tokens"]], dtype=torch.float64)
    dist.all_reduce(sums)
    return _result(float(sums[0]), int(sums[1]))
