"""Optimizers and learning-rate schedules.

Weight decay applies only to the weights of linear layers: never to norms, biases, embeddings, null
tokens or gate logits (a tied LM head shares the embedding, so it is not decayed either).
"""

from __future__ import annotations

import fnmatch
import math

import torch
from torch import nn

from attnlab.config import TrainConfig
from attnlab.errors import ConfigError


def trainable_problem(names: list[str], patterns: tuple[str, ...]) -> str | None:
    """Why `patterns` (train.trainable) cannot select from parameter `names`: the patterns that match none."""
    unmatched = [p for p in patterns if not fnmatch.filter(names, p)]
    if not unmatched:
        return None
    examples = ", ".join(names[:2] + [n for n in names if ".attn." in n][:2])
    patterns_text = ", ".join(map(repr, unmatched))
    return f"train.trainable {patterns_text} matches no parameter of the model (its names look like {examples})"


def freeze(model: nn.Module, patterns: tuple[str, ...] | None) -> list[str]:
    """Train only the parameters whose names match one of `patterns` (fnmatch, e.g. "blocks.*.attn.*"); the others
    are frozen: no gradient, no optimizer state. Returns the trained names (all of them when patterns is None).
    ConfigError naming each pattern that matches no parameter."""
    names = [name for name, _ in model.named_parameters()]
    if patterns is None:
        return names
    problem = trainable_problem(names, patterns)
    if problem:
        raise ConfigError(problem)
    trained = [name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns)]
    for name, p in model.named_parameters():
        p.requires_grad_(name in trained)
    return trained


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():  # shared (tied) parameters are listed once
        if not p.requires_grad:
            continue
        (decay if id(p) in linear_weights and id(p) not in embeddings else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2):
    update = sign(beta1 m + (1 - beta1) g); p <- p - lr (update + wd p); m <- beta2 m + (1 - beta2) g."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                update = (m * beta1 + p.grad * (1 - beta1)).sign_()
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "lion":
        return Lion(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up from lr/warmup to lr over
    warmup_steps, then constant, or linear / cosine decay to lr * min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, cfg.steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - floor) * progress
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
