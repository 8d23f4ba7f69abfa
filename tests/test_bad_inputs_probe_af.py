"""Probe AF's findings (/work/probe_af/REPORT.md). A model whose logits are NaN (activations that overflow) was
scored without a word: perplexity, rope_extrapolation and stream_loss records said status ok with loss nan, multiple
choice reported an accuracy read from NaN log-likelihoods, convert printed "perplexity nan" and saved the model.
Each now refuses in one line naming where the logits went NaN. Each test fails with its fix backed out."""

from __future__ import annotations

import functools
import json

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
    argv = ["bench", str(manifest), "--out", str(out)]
    assert fails(capsys, argv, benchmark, "logits are NaN", "check the checkpoint")
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
    assert fails(capsys, argv, str(tiny_run), "the original model", "logits are NaN", "nothing was written")
    assert not out.exists()


# ----------------------------------------------------------------------------- run --no-resume, stopped early


def test_a_run_started_over_and_stopped_before_its_first_checkpoint_leaves_the_earlier_run_to_resume(
    tmp_path, monkeypatch, capsys
):
    """--no-resume truncated metrics.jsonl at once while the earlier run's checkpoints stayed until the new run's
    first one: stopped in between, the resume it advised went on from the earlier checkpoint without its rows."""
    from helpers import Stop, hat_text, stop_after_first_checkpoint
    from test_bad_inputs_probe_g_runs import manifest, snapshot

    from attnlab.cli import main
    from attnlab.train import loop

    path = manifest(tmp_path, hat_text(tmp_path))
    argv = ["run", str(path), "--out", str(tmp_path / "out"), "--no-progress"]
    stop_after_first_checkpoint(monkeypatch, argv)  # the earlier run: checkpointed at step 2 of 4
    folder = tmp_path / "out" / "m" / "base" / "seed0"
    earlier = snapshot(folder)
    rows = (folder / "metrics.jsonl").read_text()
    assert '"step": 2' in rows

    def stop(*args, **kwargs):
        raise Stop

    with monkeypatch.context() as patch:
        patch.setattr(loop, "save_checkpoint", stop)  # the run started over stops before its first checkpoint
        with pytest.raises(Stop):
            main([*argv, "--no-resume"])
    assert (folder / "metrics.pending.jsonl").exists()
    assert {k: v for k, v in snapshot(folder).items() if k != "metrics.pending.jsonl"} == earlier
    capsys.readouterr()
    assert main(argv) == 0  # resumes the earlier run from step 2, its rows all there
    assert "missing" not in capsys.readouterr().err
    assert not (folder / "metrics.pending.jsonl").exists()
    logged = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == [1, 2, 3, 4]
    assert (folder / "metrics.jsonl").read_text().startswith(rows)


def test_a_run_started_over_replaces_the_earlier_runs_metrics_at_its_first_checkpoint(tmp_path, monkeypatch):
    from helpers import hat_text, stop_after_first_checkpoint
    from test_bad_inputs_probe_g_runs import manifest

    from attnlab.cli import main

    path = manifest(tmp_path, hat_text(tmp_path))
    argv = ["run", str(path), "--out", str(tmp_path / "out"), "--no-progress"]
    stop_after_first_checkpoint(monkeypatch, argv)
    folder = tmp_path / "out" / "m" / "base" / "seed0"
    earlier = (folder / "metrics.jsonl").read_text()
    (folder / "metrics.jsonl").write_text(earlier.replace('"step": 1,', '"step": 1, "x": 0,'))  # marked
    assert main([*argv, "--no-resume"]) == 0
    logged = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == [1, 2, 3, 4] and not any("x" in r for r in logged)
    assert not (folder / "metrics.pending.jsonl").exists()


# ----------------------------------------------------------------------------- KV policies


@pytest.mark.parametrize(
    "policy, fragments",
    [
        ("k=q8_0,resid=9223372036854775808", ["resid=9223372036854775808", "at most 2,147,483,647"]),
        ("k=q8_0,flush=2147483648", ["flush=2147483648", "more tokens than any cache holds"]),
        ("k=kivi2,group=99999999999999999999996", ["group=99999999999999999999996", "at most"]),
        ("k=kivi2,group=7", ["group=7", "kivi2", "whole bytes", "a multiple of 4"]),
        ("v=kivi2,k=q8_0,group=6", ["group=6", "a multiple of 4"]),
        (5, ["kv policy 5 must be a string"]),
    ],
)
def test_policy_counts_past_a_c_int_and_kivi_groups_that_split_a_byte_are_refused_when_parsed(policy, fragments):
    from attnlab.cache.codecs import KVPolicy
    from attnlab.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        KVPolicy.parse(policy)
    assert "\n" not in str(caught.value) and all(f in str(caught.value) for f in fragments), str(caught.value)


def test_a_kivi_group_that_splits_a_byte_is_refused_by_validate_as_by_bench(tmp_path, tiny_run, capsys):
    from attnlab.cli import main

    manifest = tmp_path / "b.yml"
    manifest.write_text(
        f"name: b\ncheckpoints: [{tiny_run}]\nbenchmarks:\n  latency: {{kv_policy: 'k=kivi2,group=7'}}\n"
    )
    assert main(["validate", str(manifest)]) == 2
    said = capsys.readouterr()
    assert "benchmarks.latency.kv_policy='k=kivi2,group=7'" in said.out + said.err
    assert KVPolicy_ok("k=kivi4,group=6") and KVPolicy_ok("k=kivi8,group=7")  # whole bytes: accepted


def KVPolicy_ok(text: str) -> bool:
    from attnlab.cache.codecs import KVPolicy

    return str(KVPolicy.parse(text)) == text


# ----------------------------------------------------------------------------- the model's tokens


@pytest.mark.parametrize(
    "tokens, fragments",
    [
        (torch.tensor([[5, -1]]), ["token id -1", "outside the model's vocabulary (0 .. 96)"]),
        (torch.tensor([[5, 97]]), ["token id 97", "(0 .. 96)"]),  # the padded rows 97 .. 127 trained nothing
        (torch.tensor([[5.0, 6.0]]), ["integer token ids", "2-D float32 tensor"]),
        (torch.tensor([5, 6]), ["(batch, length)", "1-D int64 tensor"]),
        (torch.tensor([[[5, 6]]]), ["3-D int64 tensor"]),
        (torch.tensor([[True, False]]), ["2-D bool tensor"]),
        ([[5, 6]], ["got list"]),
    ],
)
def test_the_model_refuses_what_is_no_batch_of_token_ids_in_its_vocabulary(tokens, fragments):
    model = tiny_model()
    assert model.cfg.padded_vocab_size > 97
    assert refused(lambda: model(tokens), *fragments)
    assert model(torch.tensor([[5, 96]]))[0].shape == (1, 2, 97)
    assert model(torch.tensor([[5, 96]], dtype=torch.int32))[0].shape == (1, 2, 97)
