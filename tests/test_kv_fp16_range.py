"""An fp16 KV cache and values beyond fp16's range (issue 13, left from probe AD): a finite K or V above 65504 became
inf without a word on the eager step (Codec.encode: x.to(float16)), the compiled one (ops.cpp's encode_into) and the
fused one (fused.c's store_row), and the model then attended over inf. Each path now refuses it as the block formats'
overflow is refused (attnlab.cache.codecs.KVValueError, one line naming the layer, the policy and a format with more
range); NaN and inf themselves are stored as they are, as an fp32 cache would. Each test fails with its fix backed out.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import refused, tiny_model
from test_bad_inputs_probe_ad_api import loud_model as ad_loud_model
from test_sparse import QUEST

import attnlab
from attnlab.cache.codecs import Codec, KVValueError
from attnlab.kernels.cpu import fused as fused_kernel
from attnlab.model.fused import FusedDecode

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")
generate_module = importlib.import_module("attnlab.generate")
needs_fused = pytest.mark.skipif(not fused_kernel.available(), reason="no compiler for fused.c, or no AVX2 / VNNI")
POLICY = "k=fp16,v=fp16,resid=3"


def loud_model(scale: float = 1e6, layer: int = 1):
    """Probe AD's loud model, keys and values ~1e6 times too large by default: beyond fp16's 65504."""
    return ad_loud_model(scale, layer)


def test_the_codec_refuses_a_finite_value_beyond_fp16_and_keeps_the_rest_bit_for_bit():
    codec = Codec("fp16", 4, True, 32, "k")
    x = torch.tensor([[[1.5, -65504.0, 65519.0, float("nan")]]])  # 65519 rounds to 65504: storable; NaN: as it is
    (stored,) = codec.encode(x)
    assert torch.equal(stored, x.to(torch.float16).contiguous().view(torch.uint8))
    with pytest.raises(KVValueError) as error:
        codec.encode(torch.tensor([[[1.0, 2.0, -70000.0, 3.0]]]))
    assert "reach |k|=7e+04" in str(error.value) and "fp16 holds (|x| <= 6.55e+04)" in str(error.value)
    (stored,) = codec.encode(torch.tensor([[[float("inf"), 0.0, 1.0, 2.0]]]))  # inf in, inf stored
    assert stored.view(torch.float16)[0, 0, 0].item() == float("inf")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_generate_refuses_keys_beyond_fp16_naming_layer_policy_and_a_format_with_more_range(fused):
    if fused and not fused_kernel.available():
        pytest.skip("no fused step here")
    fragments = f"kv policy {POLICY}: layer 1's", "fp16 holds (|x| <= 6.55e+04)", "bf16", "check the checkpoint"
    message = refused(lambda: attnlab.generate(loud_model(), [5], 8, kv_policy=POLICY, fused=fused), *fragments)
    assert "block scale" not in message and "not finite" not in message, message


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_values_within_fp16_decode_as_before(fused):
    """The check refuses nothing it should not: a model 100x louder than usual still fits fp16 and decodes the same
    tokens on either path."""
    if fused and not fused_kernel.available():
        pytest.skip("no fused step here")
    tokens = attnlab.generate(loud_model(100.0), [5, 6], 6, kv_policy=POLICY, fused=fused)
    assert torch.equal(tokens, attnlab.generate(loud_model(100.0), [5, 6], 6, kv_policy=POLICY, fused=False))


def test_a_static_cache_refuses_through_the_cpp_op_in_the_same_words():
    """A static cache (the compiled and fused steps' layout) stores through ops.cpp's encode_into: the uncompiled
    static step (generate's compiled step without the compiler) refuses as the eager forward does."""
    quiet, model = tiny_model(), loud_model()
    cache = model.new_cache(1, 16, policy=POLICY)
    generate_module.prefill_last(quiet, torch.tensor([[5]]), cache)  # a quiet model fills position 0
    cache.set_static(True)

    def steps():
        for token in range(1, 8):
            generate_module.static_decode_step(model, torch.tensor([[token]]), torch.tensor([cache.seen]), cache.layers)
            cache.seen += 1

    with torch.no_grad():
        static = refused(steps, f"kv policy {POLICY}: layer 1's", "fp16 holds", "bf16")
        eager = refused(lambda: attnlab.generate(model, [5, 1, 2, 3, 4, 5, 6, 7], 1, kv_policy=POLICY, fused=False))
    assert eager.split("reach")[0] == static.split("reach")[0], (eager, static)


@needs_fused
def test_a_new_token_the_fused_step_cannot_store_in_fp16_is_refused_without_saying_not_finite():
    """resid 0: the refused row is the new token's own; fp16 stores NaN, so the line speaks of range only."""
    model = loud_model(layer=0)
    cache = model.new_cache(1, 16, policy="k=fp16,v=fp16")
    generate_module.prefill_last(tiny_model(), torch.tensor([[5]]), cache)  # a quiet model fills position 0
    message = refused(lambda: FusedDecode(model, cache)(torch.tensor([[7]])), "kv policy k=fp16,v=fp16: layer 0's",
                      "keys or values (k, v) hold a value beyond what fp16 holds", "bf16")  # fmt: skip
    assert "not finite" not in message, message


PRESS = {"kind": "knorm", "budget": 12, "press_at": "decode"}


@pytest.mark.parametrize("memory", [PRESS, QUEST], ids=["press", "quest"])
def test_a_press_or_quest_cache_names_its_policy_in_the_refusal(memory):
    """Was: "kv policy: layer 0's ..." (these caches did not keep their policy for the line)."""
    model = tiny_model(None, memory, d_model=128, n_heads=4)
    with torch.no_grad():
        model.blocks[0].attn.qkv.weight.mul_(1e12)  # q8_0's scale holds |x| <= 8.3e6
    cache = model.new_cache(1, policy="k=q8_0,v=q8_0")
    with torch.no_grad():
        assert refused(lambda: model(torch.tensor([[5, 6, 7]]), cache), "kv policy k=q8_0,v=q8_0: layer 0's",
                       "k=bf16")  # fmt: skip


def test_kv_eval_names_its_own_flag_as_the_way_out(tmp_path, capsys, monkeypatch):
    """Was: "leave the KV policy out (--kv-policy, kv_policy)", flags kv-eval does not have."""
    from helpers import fails, train_tiny_run

    from attnlab import cli_models

    run = train_tiny_run(tmp_path, {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64},
                         steps=2)  # fmt: skip
    load = cli_models.load_for_eval

    def loud(*args, **kwargs):  # the checkpoint's keys and values beyond fp16
        model = load(*args, **kwargs)
        with torch.no_grad():
            model.model.blocks[0].attn.qkv.weight.mul_(1e7)
        return model

    monkeypatch.setattr(cli_models, "load_for_eval", loud)
    argv = ["kv-eval", str(run), "--policies", "k=fp16", "--split", "val", "--seq-len", "16", "--tokens", "32"]
    line = fails(capsys, argv, "kv policy k=fp16: layer 0's", "fp16 holds", "leave the policy out of --policies")
    assert "--kv-policy" not in line, line
