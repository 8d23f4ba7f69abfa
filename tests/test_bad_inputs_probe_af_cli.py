"""Probe AF's CLI findings (/work/probe_af/REPORT.md): `export --dtype fp16` wrote inf for weights past 65504 (AF4);
... Each test fails with its fix backed out."""

from __future__ import annotations

import pytest
import torch
from helpers import fails

from attnlab.interop import export as export_module

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


# ----------------------------------------------------------------------------- AF4: export --dtype fp16 past 65504


def test_af4_export_fp16_refuses_a_weight_fp16_cannot_hold_before_writing(tmp_path, tiny_run, capsys, monkeypatch):
    load = export_module.load_model

    def loud(*args, **kwargs):  # the checkpoint's attention weights far beyond fp16's 65504
        cfg, model, tokenizer = load(*args, **kwargs)
        with torch.no_grad():
            model.blocks[0].attn.qkv.weight.mul_(1e7)
        return cfg, model, tokenizer

    monkeypatch.setattr(export_module, "load_model", loud)
    out = tmp_path / "hf"
    fails(capsys, ["export", str(tiny_run), "--hf", str(out), "--dtype", "fp16"], "model.layers.0.self_attn.q_proj",
          "|value|=", "65504", "--dtype bf16 or fp32")  # fmt: skip
    assert not out.exists() and list(tmp_path.iterdir()) == []
