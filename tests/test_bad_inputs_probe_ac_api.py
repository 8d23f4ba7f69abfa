"""Probe AC's Python-API findings (/work/probe_ac/REPORT.md): quantize_weights on a model already quantized to another
format did nothing and said nothing (AC1); load_model(run, tag=...) took any tag and loaded the last checkpoint
(AC2); generate read a list of floats, or bools, as token ids (AC3); load_model's dtype and a ragged batch prompt
ended in torch's own exceptions (AC4); load_model(weights='q8_0') did not say how to get q8_0 weights (U2). Each
test fails with its fix backed out."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import refused, tiny_model

import attnlab
from attnlab.model.qlinear import QuantizedEmbedding, QuantizedLinear

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


def formats(model) -> set[str]:
    return {m.fmt for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}


# ----------------------------------------------------------------------- AC1: quantize_weights over quantized layers


def test_ac1_quantizing_a_quantized_model_to_another_format_is_refused_naming_both():
    """Was: the q8_0 layers stayed q8_0, no word, and the model came back as if it were q4_0."""
    model = attnlab.quantize_weights(tiny_model(seed=0), "q8_0")
    before = {name: t.clone() for name, t in model.state_dict().items()}
    refused(lambda: attnlab.quantize_weights(model, "q4_0"), "quantize_weights(model, 'q4_0')", "already q8_0",
            "weights='native'", "load the model again in float", "quantize that to q4_0")  # fmt: skip
    assert formats(model) == {"q8_0"}
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())  # nothing changed


def test_ac1_the_same_format_again_changes_nothing_and_says_nothing(recwarn):
    model = attnlab.quantize_weights(tiny_model(seed=0), "q4_1")
    before = {name: t.clone() for name, t in model.state_dict().items()}
    assert attnlab.quantize_weights(model, "q4_1") is model
    assert formats(model) == {"q4_1"} and not recwarn.list
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())


def test_ac1_a_native_gguf_model_is_refused_another_format(tmp_path):
    """Was: load_model(gguf, weights='native') then quantize_weights(model, 'q4_0') kept the file's q8_0 layers."""
    pytest.importorskip("gguf")
    from gguf_files import Q, write_gguf

    path = write_gguf(tmp_path / "q8.gguf", quant=Q.Q8_0)
    _, model, _ = attnlab.load_model(path, weights="native")
    assert formats(model) == {"q8_0"}
    refused(lambda: attnlab.quantize_weights(model, "q4_0"), "already q8_0", "attnlab.load_model(ref)")
    assert formats(model) == {"q8_0"}


def test_ac1_layers_of_several_formats_are_counted_per_format():
    model = tiny_model(seed=0, tie_embeddings=False)
    attnlab.quantize_weights(model.blocks[0], "q4_0")  # one block by hand, the rest later
    attnlab.quantize_weights(model.blocks[1], "fp16")
    message = refused(lambda: attnlab.quantize_weights(model, "q8_0"), "already q4_0", "fp16")
    assert re.search(r"q4_0 \(\d+ layers?, e\.g\. blocks\.0\.", message), message


# ----------------------------------------------------------------------- AC2: load_model(run, tag=...)


@pytest.mark.parametrize("tag", ["bset", "step-000004", "../../etc", "", "Best"])
def test_ac2_a_tag_other_than_best_or_last_is_refused_naming_the_checkpoint_folders(tiny_run, tag):
    """Was: every one loaded the run's last checkpoint, without a word."""
    step = sorted((tiny_run / "checkpoints").glob("step-*"))[-1]
    assert refused(lambda: attnlab.load_model(tiny_run, tag=tag), f"tag={tag!r} is not 'best' or 'last'",
            f"give its folder, e.g. {step}")  # fmt: skip


def test_ac2_best_last_and_a_step_folder_still_load(tiny_run):
    step = sorted((tiny_run / "checkpoints").glob("step-*"))[-1]
    for ref, tag in ((tiny_run, "best"), (tiny_run, "last"), (step, "best")):
        assert attnlab.load_model(ref, tag=tag)[1] is not None


def test_ac2_a_tag_that_is_no_string_is_refused(tiny_run):
    assert refused(lambda: attnlab.load_model(tiny_run, tag=4), "tag=4 is not 'best' or 'last'")


# ----------------------------------------------------------------------- AC3: generate's prompt values


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.mark.parametrize(
    "prompt, shown",
    [([1.7, 2.9, 3.2], "float"), ([1.0, 2.0], "float"), ([[1, 2], [3, 4.5]], "float"), ([True, False], "bool"),
     (torch.tensor([True, True, False]), "torch.bool")],
)  # fmt: skip
def test_ac3_a_prompt_of_floats_or_bools_is_refused_as_a_float_tensor_is(model, prompt, shown):
    """Was: the list's floats truncated to ids (1.7 -> 1), and bools read as ids 1 and 0."""
    assert refused(lambda: attnlab.generate(model, prompt, 3), "prompt", shown,
            "give token ids (an integer tensor or a list of ints)")  # fmt: skip


def test_ac3_integer_prompts_still_go_through(model):
    import numpy as np

    expected = attnlab.generate(model, [1, 2, 3], 3)
    for prompt in (torch.tensor([1, 2, 3]), np.array([1, 2, 3]), [np.int64(1), 2, 3], torch.tensor([1, 2, 3]).int()):
        assert torch.equal(attnlab.generate(model, prompt, 3), expected)
    refused(lambda: attnlab.generate(model, [], 3), "prompt is empty")


# ----------------------------------------------------------------------- AC4: torch's exceptions


@pytest.mark.parametrize(
    "dtype, fragments",
    [("float16", ("dtype='float16' is not a torch dtype", "give dtype=torch.float16")),
     ("fp16", ("dtype='fp16' is not a torch dtype", "give dtype=torch.float16")),
     (torch.int8, ("dtype=torch.int8", "torch.float32, torch.float16, torch.bfloat16 or torch.float64")),
     ("int8", ("dtype='int8'", "torch.float32, torch.float16, torch.bfloat16 or torch.float64"))],
)  # fmt: skip
def test_ac4_a_dtype_that_is_no_floating_torch_dtype_is_one_input_error(tiny_run, dtype, fragments):
    """Was: RuntimeError "Invalid device string: 'float16'" and nn.Module.to's TypeError for torch.int8."""
    assert refused(lambda: attnlab.load_model(tiny_run, dtype=dtype), *fragments)


def test_ac4_floating_dtypes_still_load(tiny_run):
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        assert next(attnlab.load_model(tiny_run, dtype=dtype)[1].parameters()).dtype == dtype


@pytest.mark.parametrize(
    "prompt, fragments",
    [([[1, 2, 3], [4, 5]], ("prompt rows have lengths 3 and 2", "generate them one at a time, or pad")),
     ([[1, 2], [3, 4], [5]], ("prompt rows have lengths 2, 2 and 1",)),
     ([1, [2]], ("prompt mixes ids and lists",)),
     ("hello", ("prompt is a str", "tokenizer.encode")),
     (["a", "b"], ("prompt holds a str", "tokenizer.encode"))],
)  # fmt: skip
def test_ac4_a_ragged_batch_or_text_prompt_is_one_input_error(model, prompt, fragments):
    """Was: torch's ValueError "expected sequence of length 3 at dim 1 (got 2)" (and TypeError for text)."""
    refused(lambda: attnlab.generate(model, prompt, 3), *fragments)


# ----------------------------------------------------------------------- U2: load_model(weights='q8_0')


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "fp16"])
def test_u2_a_quantized_format_as_weights_says_how_to_get_it(tiny_run, fmt):
    assert refused(lambda: attnlab.load_model(tiny_run, weights=fmt), f"weights={fmt!r} is not a choice",
            f"attnlab.quantize_weights(model, {fmt!r})")  # fmt: skip
