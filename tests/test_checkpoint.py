"""Checkpoints: safetensors round trip, atomic pointers, a full disk loses nothing, mismatches are clear."""

import errno
import hashlib
import json
import os

import pytest
import torch

import attnlab
from attnlab.config import TrainConfig
from attnlab.train import checkpoint as ckpt
from attnlab.train.optim import build_optimizer


def make(seed=0, **extra):
    torch.manual_seed(seed)
    cfg = attnlab.model_config_from_dict({"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 4, **extra})
    model = attnlab.build_model(cfg)
    return model, build_optimizer(model, TrainConfig())


def one_step(model, opt):
    logits, _ = model(torch.randint(0, 64, (2, 8)))
    logits.sum().backward()
    opt.step()
    opt.zero_grad()


def test_round_trip_restores_weights_and_optimizer(tmp_path):
    model, opt = make()
    one_step(model, opt)
    config = {"model": model.cfg.to_dict()}
    ckpt.save_checkpoint(tmp_path, model, opt, {"step": 1, "sampler": {"k": 1}}, config, tags=("last", "best"))
    found = ckpt.find_checkpoint(tmp_path)
    assert found.step == 1 and found.trainer["sampler"] == {"k": 1} and found.config == config
    other, other_opt = make(seed=1)
    ckpt.load_weights(other, found)
    ckpt.load_optimizer(other_opt, found, other)
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert other.lm_head.weight is other.embed.weight  # tying survives loading
    state_a, state_b = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert all(torch.equal(state_a[k]["exp_avg"], state_b[k]["exp_avg"]) for k in state_a)
    cfg, loaded = ckpt.load_model_from_checkpoint(tmp_path)
    assert cfg == model.cfg and not loaded.training


def test_only_referenced_checkpoints_are_kept(tmp_path):
    model, opt = make()
    ckpt.save_checkpoint(tmp_path, model, opt, {"step": 1}, {}, tags=("last", "best"))
    ckpt.save_checkpoint(tmp_path, model, opt, {"step": 2}, {}, tags=("last",))
    ckpt.save_checkpoint(tmp_path, model, opt, {"step": 3}, {}, tags=("last",))
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert kept == ["step-000001", "step-000003"]  # best and last
    assert json.loads((tmp_path / "checkpoints" / "best.json").read_text())["step"] == 1


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = make()
    ckpt.save_checkpoint(tmp_path, model, opt, {"step": 1}, {}, tags=("last",))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "save_model", disk_full)
    with pytest.raises(
        ckpt.CheckpointError, match=r"No space left on device; the previous checkpoint \(step 1\) is intact"
    ):
        ckpt.save_checkpoint(tmp_path, model, opt, {"step": 2}, {}, tags=("last",))
    assert ckpt.find_checkpoint(tmp_path).step == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.json", "step-000001"]


def test_an_interrupt_mid_save_keeps_the_previous_checkpoint_and_no_temporary(tmp_path, monkeypatch):
    model, opt = make()
    ckpt.save_checkpoint(tmp_path, model, opt, {"step": 1}, {}, tags=("last",))

    def interrupted(*args, **kwargs):  # Ctrl-C after the weights were written
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, model, opt, {"step": 2}, {}, tags=("last",))
    assert ckpt.find_checkpoint(tmp_path).step == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.json", "step-000001"]


def test_checkpoint_files_are_readable_by_others(tmp_path):
    model, opt = make()
    previous = os.umask(0o022)
    try:
        final = ckpt.save_checkpoint(tmp_path, model, opt, {"step": 1}, {}, tags=("last",))
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [final, *final.iterdir(), final.parent / "last.json"]}
    assert modes == {
        "step-000001": 0o755, "model.safetensors": 0o644, "optimizer.pt": 0o644, "trainer.json": 0o644,
        "config.json": 0o644, "checksums.json": 0o644, "last.json": 0o644,
    }  # fmt: skip


def test_weights_of_another_shape_are_a_clear_error(tmp_path):
    model, opt = make()
    ckpt.save_checkpoint(tmp_path, model, opt, {"step": 1}, {}, tags=("last",))
    other, _ = make(d_model=64)
    with pytest.raises(ckpt.CheckpointError, match="weights do not fit this model"):
        ckpt.load_weights(other, ckpt.find_checkpoint(tmp_path))


def test_missing_or_corrupt_checkpoints(tmp_path):
    assert ckpt.find_checkpoint(tmp_path) is None
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint here"):
        ckpt.load_model_from_checkpoint(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.json").write_text('{"dir": "step-000009", "step": 9}')
    with pytest.raises(ckpt.CheckpointError, match="incomplete or corrupt checkpoint"):
        ckpt.find_checkpoint(tmp_path)


def test_a_checkpoint_folder_without_its_config_is_a_clear_error(tmp_path):
    model, opt = make()
    final = ckpt.save_checkpoint(tmp_path, model, opt, {"step": 1}, {"model": model.cfg.to_dict()})
    loaded = ckpt.load_checkpoint(final)
    assert loaded.folder == final and loaded.run_dir == tmp_path and loaded.config["model"] == model.cfg.to_dict()
    (final / "config.json").write_text('{"data": {}}')
    checksums = json.loads((final / "checksums.json").read_text())  # as if written so: only the content is wrong
    checksums["files"]["config.json"] = {"bytes": 12, "sha256": hashlib.sha256(b'{"data": {}}').hexdigest()}
    (final / "checksums.json").write_text(json.dumps(checksums))
    with pytest.raises(ckpt.CheckpointError, match=r"config\.json: no model config in it"):
        ckpt.load_model_from_checkpoint(final)
    (final / "config.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"config\.json: unreadable \(No such file or directory\)"):
        ckpt.load_model_from_checkpoint(final)


@pytest.mark.parametrize("damage", ["shape", "extra", "groups"])
def test_an_optimizer_state_of_another_model_is_refused_before_it_is_used(tmp_path, damage):
    """Probe I (i8, i10, i11): moments of another shape, state for a parameter the optimizer does not train, or
    groups listing none of its parameters, in an optimizer.pt whose checksum was written to match: one line naming
    the file, not a traceback at the first step (or a silent resume)."""
    model, opt = make()
    one_step(model, opt)
    ckpt.save_checkpoint(tmp_path, model, opt, {"step": 1}, {"model": model.cfg.to_dict()}, tags=("last",))
    found = ckpt.find_checkpoint(tmp_path)
    path = found.path / "optimizer.pt"
    state = torch.load(path, weights_only=True)
    name = next(iter(state["optimizer"]["state"]))
    if damage == "shape":
        state["optimizer"]["state"][name]["exp_avg"] = torch.zeros(3, 3)
    elif damage == "extra":
        state["optimizer"]["state"]["blocks.9.attn.qkv.weight"] = state["optimizer"]["state"][name]
    else:
        for group in state["optimizer"]["param_groups"]:
            group["params"] = []
    torch.save(state, path)
    checksums = json.loads((found.path / "checksums.json").read_text())
    checksums["files"]["optimizer.pt"] = {"bytes": path.stat().st_size, "sha256": ckpt.sha256_file(path)}
    (found.path / "checksums.json").write_text(json.dumps(checksums))
    other, other_opt = make(seed=1)
    with pytest.raises(ckpt.CheckpointError, match="optimizer.pt: .*it does not belong to this run's model"):
        ckpt.load_optimizer(other_opt, found, other)


def draws_no_random_numbers(build) -> bool:
    torch.manual_seed(0)
    build()
    after = torch.rand(4)
    torch.manual_seed(0)
    return torch.equal(after, torch.rand(4))


def test_a_model_built_to_be_filled_skips_the_random_init_and_one_with_parameters_no_file_fills_does_not():
    """build_model(init=False) draws no random numbers (its parameters are filled afterwards) and leaves torch's
    initialisers as they were; interop.hf.fillable_model uses it only when the Hugging Face names cover every
    parameter, and otherwise initialises exactly as build_model does."""
    from torch import nn

    from attnlab.interop.hf import fillable_model

    plain = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4}
    cfg = attnlab.model_config_from_dict(plain)
    normal = nn.init.normal_
    assert not draws_no_random_numbers(lambda: attnlab.build_model(cfg))  # (the test can fail)
    assert draws_no_random_numbers(lambda: attnlab.build_model(cfg, init=False))
    assert nn.init.normal_ is normal
    assert draws_no_random_numbers(lambda: fillable_model(cfg))
    memory = {"kind": "bounded", "recent_window": 8, "exact_slots": 4, "summary_slots": 4}
    bounded = attnlab.model_config_from_dict({**plain, "memory": memory})  # its write gate: no Hugging Face name
    torch.manual_seed(1)
    filled = fillable_model(bounded)
    torch.manual_seed(1)
    built = attnlab.build_model(bounded)
    assert any("memory" in name for name, _ in built.named_parameters())
    for (name, a), (_, b) in zip(filled.named_parameters(), built.named_parameters(), strict=True):
        assert torch.equal(a, b), name
