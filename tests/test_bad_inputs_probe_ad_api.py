"""Probe AD's generate-API findings (/work/probe_ad/REPORT.md): a K/V value a block format cannot store ended in a bare
ValueError on the fused step and in "x has values ... rescale x first" on the eager one (AD3, U1); a float64 model with
a kv_policy in KeyError (AD4); generate(kv_policy=<dict or int>) in AttributeError and stop_tokens='2' in ValueError
(AD5); generate(fused='false') used the fused step and fused=0 meant auto (AD6); a numpy float prompt was refused
"(e.g. 1)" (U8). Each test fails with its fix backed out."""

from __future__ import annotations

import contextlib
import importlib

import numpy as np
import pytest
import torch
from helpers import refused, tiny_model

import attnlab
from attnlab.errors import InputError
from attnlab.kernels.cpu import fused as fused_kernel
from attnlab.model.fused import FusedDecode

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")
generate_module = importlib.import_module("attnlab.generate")
needs_fused = pytest.mark.skipif(not fused_kernel.available(), reason="no compiler for fused.c, or no AVX2 / VNNI")
POLICY = "k=q8_0,v=q8_0,resid=3"


def loud_model(scale: float = 1e7, layer: int = 1):
    """The tiny model (2 layers) whose block `layer` computes keys and values ~`scale` times too large: beyond what
    q8_0's fp16 block scale holds (|x| <= 8.3e6) once scale is 1e7; inf makes them not finite."""
    model = tiny_model()
    with torch.no_grad():
        model.blocks[layer].attn.qkv.weight.mul_(scale)
    return model


# ----------------------------------------------------------------------- AD3 / U1: K or V a block format cannot store


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "eager"])
def test_ad3_a_kv_value_too_large_for_the_format_is_one_input_error_naming_layer_and_policy(fused):
    """Was (fused): builtins.ValueError "fused decode: a K or V value ..."; (eager) "x has values up to ...; rescale
    x first", which a CLI user has no x to rescale in."""
    if fused is None and not fused_kernel.available():
        pytest.skip("no fused step here")
    fragments = f"kv policy {POLICY}", "layer 1", "q8_0", "fp16 block scale", "bf16", "check the checkpoint"
    message = refused(lambda: attnlab.generate(loud_model(), [5], 8, kv_policy=POLICY, fused=fused), *fragments)
    assert "rescale x" not in message and "x has" not in message


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "eager"])
def test_ad3_a_kv_value_that_is_not_finite_is_one_input_error(fused):
    if fused is None and not fused_kernel.available():
        pytest.skip("no fused step here")
    model = loud_model(float("inf"), layer=0)  # a prompt past resid=3: its first keys leave the window in prefill
    # (a shorter one is refused for its NaN logits before any K/V is stored: probe AE's AE2)
    assert refused(lambda: attnlab.generate(model, [5, 6, 7, 8, 9], 8, kv_policy=POLICY, fused=fused), "layer 0",
                   "not finite", "check the checkpoint")  # fmt: skip


def test_ad3_the_eager_refusal_names_the_tensor_and_its_largest_value():
    message = refused(lambda: attnlab.generate(loud_model(), [5], 8, kv_policy=POLICY, fused=False), "layer 1's")
    assert "keys (k)" in message or "values (v)" in message, message
    assert "reach |" in message, message


@pytest.mark.slow
def test_ad3_the_compiled_step_refuses_in_the_same_words():
    """Inside a compiled step the static op's error came wrapped in a RuntimeError (fused=False, compile=True)."""
    if not generate_module.can_compile_on_cpu():
        pytest.skip("no C++ compiler for torch.compile")
    message = refused(lambda: attnlab.generate(loud_model(), [5], 8, kv_policy=POLICY, fused=False, compile=True),
                      f"kv policy {POLICY}: layer 1's", "check the checkpoint")  # fmt: skip
    assert message == str(pytest.raises(InputError, attnlab.generate, loud_model(), [5], 8, kv_policy=POLICY).value)


@needs_fused
def test_ad3_a_refused_fused_step_leaves_a_cache_that_refuses_further_steps():
    """fused.c has written the token into the layers before the refusing one: the step says so and takes no more."""
    model = loud_model()
    cache = model.new_cache(1, 16, policy=POLICY)
    generate_module.prefill_last(model, torch.tensor([[5]]), cache)
    step = FusedDecode(model, cache)
    with pytest.raises(InputError):
        for token in range(1, 10):
            step(torch.tensor([[token]]))
    assert refused(lambda: step(torch.tensor([[1]])), "refused", "new cache")


@needs_fused
def test_ad3_a_new_token_the_fused_step_cannot_store_is_refused_naming_the_layer_and_its_tensors():
    """With resid 0 the refused row is the new token's own (no copy of it is left to look at): the line names the
    layer and every block-format tensor of it."""
    model = tiny_model()
    with torch.no_grad():
        model.embed.weight[7] = float("inf")  # its keys and values NaN after the norm
    cache = model.new_cache(1, 16, policy="k=q8_0,v=q4_0")
    generate_module.prefill_last(model, torch.tensor([[5]]), cache)
    assert refused(lambda: FusedDecode(model, cache)(torch.tensor([[7]])), "kv policy k=q8_0,v=q4_0: layer 0's keys or "
            "values (k, v)", "not finite", "q8_0's fp16 block scale", "q4_0's", "check the checkpoint")  # fmt: skip


@pytest.mark.parametrize("kernels", [True, False], ids=["fused", "eager"])
def test_ad3_the_cli_refuses_in_one_line_on_either_path(tmp_path, capsys, kernels):
    """Was (fused, the default): a traceback ending in ValueError, rc 1; (ATTNLAB_CPU_KERNELS=0) "x has values"."""
    pytest.importorskip("gguf")
    from gguf_files import write_gguf
    from helpers import fails

    from attnlab.kernels import cpu

    path = write_gguf(tmp_path / "loud.gguf", poison=("attn_k", 1e8))  # layer 0's first key row 1e8 times too large
    argv = ["generate", str(path), "ab cd", "--max-new-tokens", "6", "--kv-policy", "k=q8_0,v=q8_0,resid=2"]
    with contextlib.nullcontext() if kernels else cpu.disabled():
        assert fails(capsys, argv, "kv policy k=q8_0,v=q8_0,resid=2: layer 0's keys (k) reach", "k=bf16,v=q8_0,resid=2",
              "--kv-policy", "check the checkpoint")  # fmt: skip


# ----------------------------------------------------------------------- AD4: a float64 model with a kv_policy


def test_ad4_a_float64_model_with_a_kv_policy_is_refused_naming_the_dtype_and_what_works():
    """Was: KeyError: torch.float64 (cache/quantized.py, FORMAT_OF_DTYPE[dtype])."""
    model = tiny_model(dtype=torch.float64)
    for call in (lambda: attnlab.generate(model, [1, 2, 3], 5, kv_policy="k=q8_0"),
                 lambda: model.new_cache(1, 8, policy="k=q8_0")):  # fmt: skip
        assert refused(call, "torch.float64", "float32", "k=q8_0")
    assert attnlab.generate(model, [1, 2, 3], 2).shape == (2,)  # without a policy it generates


# ----------------------------------------------------------------------- AD5: kv_policy and stop_tokens of other types


@pytest.mark.parametrize("policy", [{"k": "q8_0"}, 8, ["k=q8_0"]], ids=["dict", "int", "list"])
def test_ad5_a_kv_policy_of_another_type_is_refused_saying_what_is_accepted(policy):
    """Was: AttributeError: 'dict' object has no attribute 'strip'."""
    assert refused(lambda: attnlab.generate(tiny_model(), [1, 2, 3], 5, kv_policy=policy), f"kv_policy={policy!r}",
            "'k=q8_0,v=q4_0'", "KVPolicy")  # fmt: skip


@pytest.mark.parametrize("stop", ["2", 2, [1.5], [True], [None]], ids=["str", "int", "float", "bool", "none"])
def test_ad5_stop_tokens_other_than_a_list_of_ids_are_refused(stop):
    """Was: ValueError: too many dimensions 'str'."""
    assert refused(lambda: attnlab.generate(tiny_model(), [1, 2, 3], 5, stop_tokens=stop), f"stop_tokens={stop!r}",
            "list of token ids")  # fmt: skip


def test_ad5_stop_tokens_as_a_tuple_or_a_tensor_still_stop():
    model = tiny_model()
    first = int(attnlab.generate(model, [1, 2, 3], 1)[0])
    for stop in ((first,), [first], torch.tensor([first]), np.array([first])):
        assert attnlab.generate(model, [1, 2, 3], 5, stop_tokens=stop).tolist() == [first]


# ----------------------------------------------------------------------- AD6: fused other than True, False, None


@pytest.mark.parametrize("fused", ["false", 0, 1, "no", np.bool_(False)])
def test_ad6_fused_other_than_true_false_or_none_is_refused(fused):
    """Was: 'false' required the fused step, 0 meant auto."""
    assert refused(lambda: attnlab.generate(tiny_model(), [1, 2, 3], 4, fused=fused), f"fused={fused!r}",
            "True, False or None")  # fmt: skip


# ----------------------------------------------------------------------- U8: a numpy float prompt


def test_u8_a_numpy_float_prompt_is_refused_naming_its_dtype_and_showing_a_float():
    """Was: "prompt holds float values (e.g. 1): give token ids" (1 reads as the integer the user meant)."""
    message = refused(lambda: attnlab.generate(tiny_model(), np.array([1.0, 2.0, 3.0]), 5), "float64", "1.0",
                      "token ids are integers")  # fmt: skip
    assert "e.g. 1)" not in message and "e.g. 1:" not in message
    assert refused(lambda: attnlab.generate(tiny_model(), [1.0, 2.5], 5), "2.5", "token ids are integers")
