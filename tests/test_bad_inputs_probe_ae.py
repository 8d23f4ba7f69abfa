"""Probe AE's findings (/work/probe_ae/REPORT.md): `bench` over a kv_quant policy that met a K/V value its format
cannot store ended in "ValueError: not enough values to unpack" (the harness rebuilt the refusal as type(e)(message),
which KVValueError does not take: AE1); a model whose logits are NaN (activations that overflow) generated token 0 at
every step without a word (AE2); new_cache(policy=<list, dict, int>) ended in AttributeError (AE3); the fp16 refusal's
example fixed the first overflowing tensor only (U3). Each test fails with its fix backed out."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import fails, refused, tiny_model
from test_sparse import QUEST

import attnlab
from attnlab.errors import ConfigError
from attnlab.eval import harness

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


# ----------------------------------------------------------------------------- AE1: bench and a KVValueError


def test_ae1_bench_refuses_a_kv_value_its_policy_cannot_store_in_one_line(tmp_path, tiny_run, capsys, monkeypatch):
    measure = harness.BENCHMARKS["kv_quant"]

    @functools.wraps(measure)  # (its signature: the manifest's keys are checked against it)
    def loud(model, *args, **kwargs):  # the checkpoint's keys and values beyond fp16
        with torch.no_grad():
            model.model.blocks[0].attn.qkv.weight.mul_(1e7)
        return measure(model, *args, **kwargs)

    monkeypatch.setitem(harness.BENCHMARKS, "kv_quant", loud)
    manifest = tmp_path / "bm.yml"
    manifest.write_text(f"name: bm\ncheckpoints: [{tiny_run}]\nbenchmarks:\n  kv_quant: "
                        "{seq_len: 16, max_tokens: 64, split: val, policies: ['k=fp16,v=fp16']}\n")  # fmt: skip
    line = fails(capsys, ["bench", str(manifest), "--out", str(tmp_path / "o")], "kv_quant", "layer 0's",
                 "fp16 holds", "leave the policy out of benchmarks.kv_quant.policies")  # fmt: skip
    assert "--kv-policy" not in line, line


# ----------------------------------------------------------------------------- AE2: NaN logits


def overflowing(model, scale: float):
    """`model` with block 0's MLP weights `scale` times larger: finite, but its activations overflow (inf, then NaN
    from the next norm)."""
    with torch.no_grad():
        for p in model.blocks[0].mlp.parameters():
            p.mul_(scale)
    return model


def test_ae2_generate_refuses_nan_logits_rather_than_emitting_token_0():
    model = overflowing(tiny_model(), 1e15)
    for options in ({}, {"temperature": 0.7, "seed": 1}, {"fused": False}):
        assert refused(lambda: attnlab.generate(model, [5, 6, 7], 4, **options), "logits are NaN at new token 0",  # noqa: B023
                       "overflow", "check the checkpoint")  # fmt: skip


def test_ae2_a_half_precision_model_that_overflows_is_told_to_load_in_float32():
    model = overflowing(tiny_model(dtype=torch.float16), 100.0)  # within fp16, its activations beyond 65504
    assert refused(lambda: attnlab.generate(model, [5, 6, 7], 4), "NaN", "a float16 model's activations overflow",
                   "dtype=torch.float32")  # fmt: skip


def test_ae2_a_sound_model_still_generates():
    assert attnlab.generate(tiny_model(), [5, 6, 7], 4).shape == (4,)


# ----------------------------------------------------------------------------- AE3: new_cache's policy type


@pytest.mark.parametrize("policy", [["k=q8_0"], {"k": "q8_0"}, 8])
def test_ae3_new_cache_refuses_a_policy_that_is_not_a_string_or_kvpolicy(policy):
    assert refused(lambda: tiny_model().new_cache(1, 16, policy=policy), f"kv policy {policy!r}", "policy string",
                   "KVPolicy")  # fmt: skip


# ----------------------------------------------------------------------------- U3: the fp16 example


def test_u3_the_fp16_refusal_suggests_bf16_for_every_fp16_tensor():
    """Was: k=bf16,v=fp16 for a k that overflowed; following it, v was refused next."""
    model = tiny_model()
    with torch.no_grad():
        model.blocks[1].attn.qkv.weight.mul_(1e6)
    message = refused(lambda: attnlab.generate(model, [5], 4, kv_policy="k=fp16,v=fp16,resid=2", fused=False),
                      "fp16 holds")  # fmt: skip
    assert "k=bf16,v=bf16,resid=2" in message, message


def test_u2_a_memory_or_quest_cache_refusing_a_per_channel_format_names_the_policy():
    """Was: "kv policy: k in a per-channel format ..." without the policy."""
    model = tiny_model(None, QUEST, d_model=128, n_heads=4)
    with pytest.raises(ConfigError, match=r"^kv policy k=kivi4,v=q8_0: k in a per-channel format"):
        model.new_cache(1, policy="k=kivi4,v=q8_0")


@pytest.mark.parametrize("stop", [[-1], [97], [3, 100000]])
def test_u6_stop_tokens_outside_the_vocabulary_are_refused(stop):
    """Was: accepted; such a stop token never stops the generation."""
    assert refused(lambda: attnlab.generate(tiny_model(), [5, 6], 4, stop_tokens=stop), "stop_tokens [",
                   "not token ids of this model (0 .. 96)")  # fmt: skip


# ----------------------------------------------------------------------------- U4, U5: whitespace, one warning


def test_u4_a_value_ending_in_a_newline_is_said_to_end_in_whitespace_not_a_space():
    from attnlab.paths import shown_value

    assert shown_value("/data\n") == "'/data\\n' (it ends with whitespace)"
    assert shown_value(" /data") == "' /data' (it starts with a space)"


def test_u5_a_cache_folder_that_cannot_be_used_is_warned_once_for_all_kernels(tmp_path, monkeypatch):
    """Was: the same line once per kernel (qattn, qmatmul, fused: three lines)."""
    import warnings

    from attnlab.errors import AttnlabWarning
    from attnlab.kernels import cpu

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "attnlab").mkdir()
    cpu.kernel_dir().write_text("a file")

    def builds(folder=None):
        if folder is None or folder == cpu.kernel_dir():
            raise FileExistsError(17, "File exists", str(cpu.kernel_dir()))
        return folder / "lib.so"

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert cpu.compiled(cpu.SOURCE, lambda path: "loaded", builds) == "loaded"
    lines = [str(w.message) for w in caught if issubclass(w.category, AttnlabWarning)]
    assert len(lines) == 1 and "is a file" in lines[0], lines
