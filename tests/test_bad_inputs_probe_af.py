"""Probe AF's findings (/work/probe_af/REPORT.md). A model whose logits are NaN (activations that overflow) was
scored without a word: perplexity, rope_extrapolation and stream_loss records said status ok with loss nan, multiple
choice reported an accuracy read from NaN log-likelihoods, convert printed "perplexity nan" and saved the model.
Each now refuses in one line naming where the logits went NaN. Each test fails with its fix backed out."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from helpers import fails, refused, tiny_model
from test_bad_inputs_probe_ae import overflowing

from attnlab.eval import harness
from attnlab.eval.kvquant import chunked_logits
from attnlab.eval.longctx import position_losses, sweep_one
from attnlab.eval.multiple_choice import loglikelihoods
from attnlab.eval.perplexity import window_losses
from attnlab.eval.scoring import token_logprobs

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


# ----------------------------------------------------------------------------- NaN logits are no scores


def nan_model():
    return overflowing(tiny_model(), 1e15)


TOKENS = np.arange(3, 60, dtype=np.int64)


@pytest.mark.parametrize(
    "score, where",
    [
        (lambda m: window_losses(m, TOKENS, 16), "on the held-out window of tokens 0..16"),
        (lambda m: position_losses(m, TOKENS, 16, 2), "on the held-out window of tokens 0..16"),
        (lambda m: token_logprobs(m, list(range(3, 20))), "on a text of 16 tokens"),
        (lambda m: loglikelihoods(m, [([5, 6, 7], [8, 9])]), "on a multiple-choice item"),
        (lambda m: chunked_logits(m, torch.arange(3, 19)[None], None, 8), "on a held-out window of 16 tokens"),
        (lambda m: sweep_one(m, torch.arange(3, 20)[None], 8, 2), "at the last chunk of 16 held-out tokens"),
    ],
)
def test_scores_from_nan_logits_are_refused_in_one_line(score, where):
    assert refused(lambda: score(nan_model()), "the model's logits are NaN", where, "check the checkpoint")
    score(tiny_model())  # a sound model is scored


@pytest.mark.parametrize("benchmark", ["perplexity", "rope_extrapolation", "stream_loss"])
def test_bench_refuses_a_model_whose_logits_are_nan_and_records_nothing(benchmark, tmp_path, tiny_run, capsys,
                                                                         monkeypatch):  # fmt: skip
    measure = harness.BENCHMARKS[benchmark]

    @functools.wraps(measure)  # (its signature: the manifest's keys are checked against it)
    def broken(model, *args, **kwargs):
        overflowing(model.model, 1e15)
        return measure(model, *args, **kwargs)

    monkeypatch.setitem(harness.BENCHMARKS, benchmark, broken)
    params = {"perplexity": "{split: val, max_tokens: 64}", "rope_extrapolation": "{factors: [1], max_tokens: 64}",
              "stream_loss": "{length: 32, streams: 1, bucket: 8, split: val}"}[benchmark]  # fmt: skip
    manifest = tmp_path / "bm.yml"
    manifest.write_text(f"name: bm\ncheckpoints: [{tiny_run}]\nbenchmarks:\n  {benchmark}: {params}\n")
    out = tmp_path / "o"
    fails(capsys, ["bench", str(manifest), "--out", str(out)], benchmark, "logits are NaN", "check the checkpoint")
    records = out / "records.jsonl"
    assert not records.exists() or records.read_text() == ""


def test_convert_refuses_a_source_whose_logits_are_nan_and_writes_nothing(tmp_path, tiny_run, capsys, monkeypatch):
    from attnlab import cli_models

    load = cli_models.load_for_eval

    def broken(*args, **kwargs):
        model = load(*args, **kwargs)
        overflowing(model.model, 1e15)
        return model

    monkeypatch.setattr(cli_models, "load_for_eval", broken)
    out, data = tmp_path / "converted", tmp_path / "data"
    (data / "wikitext-2").mkdir(parents=True)
    text = (tiny_run.parent.parent.parent / "text.txt").read_text()
    for split in ("train", "valid", "test"):
        (data / "wikitext-2" / f"wiki.{split}.raw").write_text(text)
    argv = ["convert", str(tiny_run), "--attention", "kind=mha,n_kv_heads=1", "--out", str(out), "--dataset",
            "wikitext2-raw", "--data-dir", str(data), "--eval-tokens", "64", "--seq-len", "16"]  # fmt: skip
    fails(capsys, argv, str(tiny_run), "the original model", "logits are NaN", "nothing was written")
    assert not out.exists()
