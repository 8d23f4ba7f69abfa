"""Held-out loss on non-overlapping windows, scored over the true vocabulary."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def evaluate_loss(model, batches, device=None, autocast_dtype=None) -> dict:
    """Mean next-token loss over every target in `batches` ((x, y) int64 pairs, (B, T) each).

    Returns {"loss", "ppl", "tokens"}; each token counts once (windows do not overlap).
    """
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
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
    finally:
        model.train(was_training)
    if count == 0:
        return {"loss": float("nan"), "ppl": float("nan"), "tokens": 0}
    loss = total / count
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count}
