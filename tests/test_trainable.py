"""train.trainable: only the named parameters train; the rest stay as they started and get no optimizer state."""

import random

import pytest
import torch
from safetensors.torch import load_file

import attnlab
from attnlab.config import DataConfig, TrainConfig
from attnlab.errors import ConfigError
from attnlab.train.loop import train

MODEL = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32}


def corpus(root):
    rng = random.Random(0)
    words = "a cat and a dog sat on the mat by the red door".split()
    path = root / "text.txt"
    path.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(30)) for _ in range(100)))
    return DataConfig(source=str(path), tokenizer="char", val_fraction=0.2)


def test_only_the_named_parameters_train_and_hold_optimizer_state(tmp_path):
    data, cfg = corpus(tmp_path), attnlab.model_config_from_dict(MODEL)
    train_cfg = TrainConfig(seq_len=16, batch_size=4, steps=6, eval_every=3, eval_tokens=64, weight_decay=0.1,
                            trainable=["blocks.*.attn.*"])  # fmt: skip
    train(cfg, data, train_cfg, tmp_path / "run", progress=False)
    torch.manual_seed(train_cfg.seed)
    start = attnlab.build_model(cfg).state_dict()  # what train() built before its first step
    folder = next((tmp_path / "run" / "checkpoints").glob("step-*"))
    saved = load_file(folder / "model.safetensors")
    moved = {name for name in saved if not torch.equal(saved[name], start[name])}
    assert moved and all(".attn." in name for name in moved)
    assert {n for n in saved if ".attn." in n and n.endswith("weight")} <= moved  # every attention weight trained
    state = torch.load(folder / "optimizer.pt", weights_only=True)["optimizer"]
    attention = [p for n, p in attnlab.build_model(cfg).named_parameters() if ".attn." in n]
    assert len(state["state"]) == len(attention)  # moments for the trained parameters only
    summary = train(cfg, data, train_cfg, tmp_path / "run", progress=False)  # resumes: the config compares equal
    assert summary["steps"] == 6


def test_a_pattern_that_matches_nothing_is_refused_before_training(tmp_path):
    data, cfg = corpus(tmp_path), attnlab.model_config_from_dict(MODEL)
    bad = TrainConfig(seq_len=16, batch_size=4, steps=2, eval_tokens=64, trainable=["blocks.*.atn.*"])
    with pytest.raises(ConfigError, match=r"'blocks\.\*\.atn\.\*' matches no parameter .*blocks\.0\.attn\.qkv\.weight"):
        train(cfg, data, bad, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()
    for value in ([], [""], [3], "blocks.*"):
        with pytest.raises(ConfigError, match="train.trainable"):
            TrainConfig(trainable=value)
