"""Two-phase training (CoDA-GQA-L §4): phase 1 with the full cache, phase 2 from its weights with a bounded
memory whose own parameters start fresh; a memory model reads every sequence through its memory."""

import random

import pytest
import torch
from helpers import tiny_model

from attnlab.errors import ConfigError
from attnlab.manifest import load_manifest
from attnlab.runner import run_manifest
from attnlab.train.checkpoint import load_model_from_checkpoint

MODEL = {"vocab_size": 50, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 64, "init_std": 0.02,
         "attention": {"kind": "coda", "n_kv_heads": 2}}  # fmt: skip
BOUNDED = {"kind": "bounded", "recent_window": 8, "exact_slots": 4, "summary_slots": 4, "block": 8}


def model_with(memory, seed=0):
    return tiny_model(memory=memory, seed=seed, **MODEL)


def test_a_memory_model_reads_a_sequence_through_its_memory_in_blocks():
    model = model_with(BOUNDED)
    ids = torch.randint(0, 50, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole, _ = model(ids, use_cache=False)
        cache, pieces = model.new_cache(2), []
        for start in range(0, 30, 8):  # by hand: the same blocks through one cache
            pieces.append(model(ids[:, start : start + 8], cache=cache)[0])
    assert torch.equal(whole, torch.cat(pieces, dim=1))
    plain = model_with({"kind": "none"})
    with torch.no_grad():
        assert not torch.allclose(whole, plain(ids, use_cache=False)[0], atol=1e-3)  # 30 tokens > 16 slots


def test_training_mode_backpropagates_through_the_memory_into_its_gate():
    model = model_with({**BOUNDED, "detach_evicted": False}).train()
    ids = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(1))
    logits, cache = model(ids)
    assert cache is None  # training: nothing returned
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    gates = [p.grad for n, p in model.named_parameters() if ".memory." in n]
    assert gates and all(g is not None and g.abs().sum() > 0 for g in gates)


@pytest.fixture()
def corpus(tmp_path):
    rng = random.Random(0)
    words = "a cat and a dog sat on the mat by the red door".split()
    path = tmp_path / "text.txt"
    path.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(40)) for _ in range(100)))
    return path


MANIFEST = """
name: phases
defaults:
  model: {{d_model: 32, n_layers: 2, n_heads: 4, max_seq_len: 64, attention: {{kind: coda, n_kv_heads: 2}}}}
  data: {{source: {corpus}, tokenizer: char, val_fraction: 0.2}}
  train: {{steps: 4, seq_len: 32, batch_size: 2, eval_every: 4, eval_tokens: 64, lr: 0.003}}
targets:
  full: {{}}
  bounded:
    init_from: full
    model: {{memory: {{kind: bounded, recent_window: 8, exact_slots: 4, summary_slots: 4}}}}
    train: {{steps: 2, lr: 0.001}}
"""


def test_phase_two_starts_from_phase_one_with_fresh_memory_parameters(tmp_path, corpus):
    path = tmp_path / "m.yml"
    path.write_text(MANIFEST.format(corpus=corpus))
    manifest = load_manifest(path)
    assert [(r.target, r.init_from) for r in manifest.runs] == [("full", None), ("bounded", "full")]
    with pytest.raises(ConfigError, match="is not trained yet"):
        run_manifest(manifest, tmp_path / "runs", targets=["bounded"], progress=False, log=lambda *a: None)
    run_manifest(manifest, tmp_path / "runs", progress=False, log=lambda *a: None)
    _, full = load_model_from_checkpoint(tmp_path / "runs/phases/full/seed0", tag="last")
    cfg, bounded = load_model_from_checkpoint(tmp_path / "runs/phases/bounded/seed0", tag="last")
    assert cfg.memory.kind == "bounded"
    before = dict(full.named_parameters())
    moved = [n for n, p in bounded.named_parameters() if ".memory." not in n and not torch.equal(p, before[n])]
    assert moved  # phase 2 trained the phase-1 weights further (2 steps at lr 1e-3)
    assert {n for n, _ in bounded.named_parameters()} - set(before) == {
        f"blocks.{i}.memory.{p}" for i in range(2) for p in ("write", "eta_logit")
    }


def test_init_from_must_name_an_earlier_target(tmp_path, corpus):
    text = MANIFEST.format(corpus=corpus).replace("init_from: full", "init_from: later")
    path = tmp_path / "m.yml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="init_from='later' must name an earlier target \\(full\\)"):
        load_manifest(path)
