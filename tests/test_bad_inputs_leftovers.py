"""What probe O noticed but did not count: an lm-eval killed between its two result files left a folder the next
evaluation refused; a failed lm-eval left behind the --out folder it had made for its results; stream_loss accepted
a bucket longer than its streams; kv-eval printed a KL of -0.000000 for a policy indistinguishable from the full
cache."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import fails, lm_task_folders, lm_task_yaml

from attnlab.cli import main
from attnlab.errors import ConfigError, InputError
from attnlab.eval import kvquant, lmeval
from attnlab.eval.harness import check_benchmarks
from attnlab.eval.loading import load_for_eval
from attnlab.eval.longctx import run_stream_loss

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

ITEM = {"q": "a cat", "gold": 0, "choices": [" sat", " dog"]}


def lm_argv(tiny_run, tmp_path, monkeypatch, out):
    tasks, data_folder = lm_task_folders(tmp_path, monkeypatch, lm_task_yaml(), [ITEM])
    return ["lm-eval", str(tiny_run), "--tasks", "mytask", "--include-path", str(tasks), "--data-dir",
            str(data_folder), "--out", str(out)]  # fmt: skip


def test_lm_eval_writes_its_results_file_last_and_replaces_an_items_file_left_alone(tiny_run, tmp_path, monkeypatch):
    out = tmp_path / "out"
    argv = lm_argv(tiny_run, tmp_path, monkeypatch, out)
    order, real = [], lmeval.atomic_write_text
    monkeypatch.setattr(lmeval, "atomic_write_text", lambda path, text, *a: (order.append(path.name), real(path, text)))
    out.mkdir()
    (out / "lm_eval_samples.jsonl").write_text('{"left": "by a run killed before its lm_eval.json"}\n')
    assert main(argv) == 0
    assert order == ["lm_eval_samples.jsonl", "lm_eval.json"]  # the results, the mark of a finished run, last
    rows = [json.loads(line) for line in (out / "lm_eval_samples.jsonl").read_text().splitlines()]
    assert rows and all(row["task"] == "mytask" for row in rows)
    assert main(argv) == 2  # a finished evaluation's results are never replaced


def test_a_failed_lm_eval_leaves_no_out_folder_it_made(tiny_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "new" / "out"
    argv = lm_argv(tiny_run, tmp_path, monkeypatch, out)

    def damaged(*_, **__):
        raise ConfigError("model.safetensors: damaged (as a truncated download would be)")

    monkeypatch.setattr(lmeval, "load_for_eval", damaged)
    assert fails(capsys, argv, "model.safetensors: damaged")
    assert not out.exists() and (tmp_path / "new").is_dir()  # only the folder it made, not its parents
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    argv[-1] = str(kept)
    assert fails(capsys, argv, "model.safetensors: damaged")
    assert sorted(p.name for p in kept.iterdir()) == [".lm_eval.lock", "notes.txt"]  # a folder the user made stays


def test_a_stream_loss_bucket_longer_than_a_stream_is_refused(tiny_run):
    assert check_benchmarks({"stream_loss": {"length": 64, "bucket": 128}}) == [
        "benchmarks.stream_loss.bucket=128 is longer than a stream (length=64): give a bucket of at most 64 positions"
    ]
    assert check_benchmarks({"stream_loss": {"length": 64, "bucket": 64}}) == []
    with pytest.raises(InputError, match=r"bucket=9 is longer than a stream \(length=8\)"):
        run_stream_loss(load_for_eval(tiny_run), length=8, streams=1, bucket=9, text="a b c " * 40)


def test_the_kl_of_a_policy_that_rounds_like_the_full_cache_is_never_printed_below_zero(tiny_run, monkeypatch):
    """Two distributions equal but for rounding: summed over tokens and a vocabulary, p (log p - log q) can come out
    a hair below zero (kv-eval printed KL -0.000000); the table prints it as 0, the record keeps the sum."""
    model = load_for_eval(tiny_run).model
    windows = torch.randint(0, model.cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1))
    shape = (4, 32, model.cfg.vocab_size)
    full = 3 * torch.randn(shape, generator=torch.Generator().manual_seed(3))
    rounded = full + 1e-7 * torch.randn(shape, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(kvquant, "chunked_logits", lambda m, w, policy, c: full if policy is None else rounded)
    p, q = full.log_softmax(-1), rounded.log_softmax(-1)
    assert (p.exp() * (p - q)).sum().item() < 0  # the case: the float sum is below zero
    rows = kvquant.evaluate_policies(model, windows, ["k=fp32,v=fp32"], greedy_prompts=0)
    assert -1e-6 < rows[0]["kl"] < 0
    assert "-0.000000" not in kvquant.table(rows) and " 0.000000" in kvquant.table(rows)
