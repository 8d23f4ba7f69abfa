"""Optimizers and schedules against plain references."""

import math

import pytest
import torch
from helpers import tiny_model

from attnlab.config import TrainConfig
from attnlab.train.optim import Lion, build_optimizer, lr_at, param_groups

SIZES = {"vocab_size": 64, "d_model": 32, "n_layers": 1}


def test_weight_decay_only_on_linear_weights():
    model = tiny_model({"kind": "decoupled", "d_sem": 8, "d_geo": 16, "null_attn": True, "gate": True}, **SIZES)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decayed == {
        n
        for n, _ in model.named_parameters()
        if n.endswith(("proj.weight", "out.weight", "gate_up.weight", "down.weight"))
    }
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert {"embed.weight", "norm.weight", "blocks.0.attn.null_k", "blocks.0.attn.gate_logit"} <= skipped
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_untied_lm_head_is_decayed_but_embedding_is_not():
    model = tiny_model(tie_embeddings=False, **SIZES)
    decay, _ = param_groups(model, 0.1)
    assert any(p is model.lm_head.weight for p in decay["params"])
    assert not any(p is model.embed.weight for p in decay["params"])


def test_lion_matches_the_paper_update():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    reference, m = p.detach().clone(), torch.zeros(5)
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    for _ in range(3):
        grad = torch.randn(5)
        p.grad = grad.clone()
        opt.step()
        update = torch.sign(0.9 * m + 0.1 * grad)
        reference = reference * (1 - 0.1 * 0.5) - 0.1 * update
        m = 0.99 * m + 0.01 * grad
    torch.testing.assert_close(p.detach(), reference)


def test_build_optimizer_kinds():
    model = tiny_model(**SIZES)
    assert isinstance(build_optimizer(model, TrainConfig(optimizer="adamw")), torch.optim.AdamW)
    assert isinstance(build_optimizer(model, TrainConfig(optimizer="lion")), Lion)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_schedules(schedule):
    cfg = TrainConfig(lr=1.0, steps=110, warmup_steps=10, min_lr_ratio=0.1, schedule=schedule)
    assert [lr_at(s, cfg) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert lr_at(9, cfg) == pytest.approx(1.0)
    last = lr_at(109, cfg)
    middle = lr_at(10 + 99 // 2, cfg)
    if schedule == "constant":
        assert last == middle == 1.0
    elif schedule == "linear":
        assert last == pytest.approx(0.1) and middle == pytest.approx(1 - 0.9 * (49 / 99))
    else:
        assert last == pytest.approx(0.1)
        assert middle == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 49 / 99)))
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) - 1e-12 for s in range(10, 109))
