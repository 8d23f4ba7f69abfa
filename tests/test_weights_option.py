"""`--weights` on the commands that run a model: fp32, a GGUF's own formats (native), or quantized after loading."""

from __future__ import annotations

import pytest
import torch
from helpers import error_line, fails, train_tiny_run

from attnlab.cli import main
from attnlab.errors import InputError
from attnlab.eval.loading import load_for_eval
from attnlab.model.qlinear import QuantizedLinear

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = {"vocab_size": 40, "d_model": 64, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny_run(tmp_path_factory.mktemp("weights"), MODEL, steps=4)


@torch.no_grad()
def test_a_format_quantizes_every_linear_after_loading_and_changes_the_logits_only_a_little(run):
    fp32, q8 = load_for_eval(run), load_for_eval(run, weights="q8_0")
    assert q8.weights == "q8_0" and fp32.weights == "fp32"
    assert not any(isinstance(m, QuantizedLinear) for m in fp32.model.modules())
    quantized = [name for name, m in q8.model.named_modules() if isinstance(m, QuantizedLinear)]
    linears = [name for name, m in fp32.model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert quantized and set(linears) <= set(quantized) | {"lm_head"}
    tokens = torch.arange(20)[None] % 40
    a, b = fp32.model(tokens, use_cache=False)[0], q8.model(tokens, use_cache=False)[0]
    assert 0 < (a - b).abs().max() < 0.05 * a.abs().max()  # q8_0: close, not identical


def test_native_is_for_gguf_files_and_an_unknown_choice_is_refused(run, capsys):
    with pytest.raises(InputError, match="native"):
        load_for_eval(run, weights="native")
    with pytest.raises(InputError, match="weights='q3'"):
        load_for_eval(run, weights="q3")
    assert fails(capsys, ["generate", str(run), "a cat", "--weights", "native"], "native")
    with pytest.raises(SystemExit) as exit_info:  # argparse's choice check
        main(["generate", str(run), "a cat", "--weights", "q3"])
    assert exit_info.value.code == 2 and error_line(capsys, "generate", "--weights", "q3")


def test_generate_runs_with_quantized_weights(run, capsys):
    assert main(["generate", str(run), "a cat", "--weights", "q4_0", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("a cat")
