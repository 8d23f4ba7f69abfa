"""The trainer end to end on a small local text: outputs, exact resume, config guards, runner, compare."""

import contextlib
import io
import json
import random
import subprocess
import sys

import pytest
import torch

import attnlab
from attnlab.config import DataConfig, TrainConfig
from attnlab.data.files import seal_kept
from attnlab.errors import ConfigError
from attnlab.train import loop
from attnlab.train.logging import MetricsLog

WORDS = "the cat sat on a mat while dogs ran over green hills and birds sang in tall old trees".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A .txt of 300 short documents (blank-line separated) with a little structure to learn."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "tiny.txt"
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30))) + "." for _ in range(300)]
    path.write_text("\n\n".join(docs) + "\n")
    return path


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")


def configs(corpus, **train):
    model = attnlab.model_config_from_dict(
        {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32,
         "attention": {"kind": "decoupled", "d_sem": 8, "d_geo": 16}}
    )  # fmt: skip
    data = DataConfig(source=str(corpus), tokenizer="char", val_fraction=0.1)
    defaults = dict(seq_len=16, batch_size=4, steps=8, lr=3e-3, warmup_steps=2, eval_every=4, eval_tokens=512,
                    log_every=1, checkpoint_every=3)  # fmt: skip
    return model, data, TrainConfig(**{**defaults, **train})


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r], [
        (r["step"], r["val_loss"]) for r in rows if "val_loss" in r
    ]


def test_training_learns_and_writes_its_outputs(corpus, tmp_path):
    model, data, train = configs(corpus, steps=40, eval_every=20)
    summary = loop.train(model, data, train, tmp_path / "run", progress=False)
    train_losses, val_losses = losses(tmp_path / "run")
    assert len(train_losses) == 40 and [s for s, _ in val_losses] == [20, 40]
    assert train_losses[-1][1] < train_losses[0][1] - 1.0  # it learns
    assert summary["status"] == "complete" and summary["steps"] == 40 and summary["tokens"] == 40 * 4 * 16
    assert summary["val_loss"] < 3.5 and "test_loss" not in summary  # a .txt has no test split here
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved == {**summary, "sha256": saved["sha256"]} and seal_kept(saved)  # sealed: a hand edit is told
    assert seal_kept({**saved, "val_loss": saved["val_loss"] + 1e-9}) is False
    assert (tmp_path / "run" / "checkpoints" / "best.json").exists()
    cfg, reloaded = attnlab.train.load_model_from_checkpoint(tmp_path / "run")
    assert cfg.attention.kind == "decoupled" and not reloaded.training


def test_resume_reproduces_an_uninterrupted_run_exactly(corpus, tmp_path, monkeypatch):
    model, data, train = configs(corpus)
    loop.train(model, data, train, tmp_path / "whole", progress=False)

    original_write = MetricsLog.write

    def crash_at_step_6(self, row):
        if row.get("step") == 6 and "loss" in row:
            raise KeyboardInterrupt  # interrupted after the step-4 eval checkpoint, before step 6 is saved
        original_write(self, row)

    monkeypatch.setattr(MetricsLog, "write", crash_at_step_6)
    with pytest.raises(KeyboardInterrupt):
        loop.train(model, data, train, tmp_path / "cut", progress=False)
    monkeypatch.setattr(MetricsLog, "write", original_write)
    assert max(s for s, _ in losses(tmp_path / "cut")[0]) == 5
    loop.train(model, data, train, tmp_path / "cut", progress=False)  # resumes from step 4
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")  # bit-identical losses, no duplicated rows


def test_a_run_folder_from_another_config_is_refused(corpus, tmp_path):
    model, data, train = configs(corpus, steps=3)
    loop.train(model, data, train, tmp_path / "run", progress=False)
    _, _, other = configs(corpus, steps=3, lr=1e-2)
    with pytest.raises(ConfigError, match=r"from another config: train\.lr: checkpoint 0\.003, now 0\.01"):
        loop.train(model, data, other, tmp_path / "run", progress=False)


def test_vocab_too_small_for_the_tokenizer(corpus, tmp_path):
    model, data, train = configs(corpus)
    with pytest.raises(ConfigError, match="smaller than the tokenizer"):
        loop.train(model.replace(vocab_size=5), data, train, tmp_path / "run", progress=False)


MANIFEST = """
name: tiny
seeds: [0, 1]
defaults:
  model: {{d_model: 32, n_layers: 1, n_heads: 4, max_seq_len: 32}}
  data: {{source: "{corpus}", tokenizer: char, val_fraction: 0.1}}
  train: {{seq_len: 16, batch_size: 4, steps: 6, lr: 3e-3, warmup_steps: 1, eval_every: 3, eval_tokens: 512,
          log_every: 1, checkpoint_every: 3}}
targets:
  baseline: {{model: {{attention: {{kind: mha}}}}}}
  gqa: {{model: {{attention: {{kind: mha, n_kv_heads: 1}}}}}}
"""


def cli(*args) -> subprocess.CompletedProcess:
    """`attnlab ARGS` in this process (a new Python would import torch again for each: seconds each), as a
    CompletedProcess; test_cli runs the command in processes of its own."""
    from attnlab.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["attnlab", *args], code, out.getvalue(), err.getvalue())


@pytest.mark.slow
def test_run_then_compare_then_skip(corpus, tmp_path):
    manifest = tmp_path / "tiny.yml"
    manifest.write_text(MANIFEST.format(corpus=corpus))
    out = tmp_path / "runs"
    first = cli("run", str(manifest), "--out", str(out), "--no-progress")
    assert first.returncode == 0, first.stderr
    assert "| baseline | 2 |" in first.stdout and "| gqa | 2 |" in first.stdout
    for target in ("baseline", "gqa"):
        for seed in (0, 1):
            run = out / "tiny" / target / f"seed{seed}"
            assert json.loads((run / "summary.json").read_text())["status"] == "complete"
            assert (run / "config.yaml").exists() and (run / "command.txt").exists()
    assert (out / "tiny" / "val_loss.png").stat().st_size > 1000
    assert (out / "tiny" / "compare.csv").read_text().startswith("target,seeds,params")
    again = cli("run", str(manifest), "--out", str(out), "--no-progress", "--target", "gqa", "--seed", "1")
    assert again.returncode == 0 and "done already" in again.stdout and "training" not in again.stdout


def test_cli_run_errors_exit_2(corpus, tmp_path):
    manifest = tmp_path / "tiny.yml"
    manifest.write_text(MANIFEST.format(corpus=corpus).replace("n_layers", "n_layer"))
    bad = cli("run", str(manifest), "--out", str(tmp_path / "runs"))
    assert bad.returncode == 2 and "did you mean 'n_layers'" in bad.stderr
    manifest.write_text(MANIFEST.format(corpus=tmp_path / "missing.txt"))
    missing = cli("run", str(manifest), "--out", str(tmp_path / "runs"))
    assert missing.returncode == 2 and "missing.txt" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    manifest.write_text(MANIFEST.format(corpus=corpus))
    typo = cli("run", str(manifest), "--target", "gqq", "--out", str(tmp_path / "runs"))
    assert typo.returncode == 2 and "did you mean 'gqa'" in typo.stderr


@pytest.mark.slow
def test_two_process_ddp_matches_one_process(corpus, tmp_path):
    manifest = tmp_path / "tiny.yml"
    manifest.write_text(MANIFEST.format(corpus=corpus))
    args = ["run", str(manifest), "--no-progress", "--target", "baseline", "--seed", "0"]
    single = cli(*args, "--out", str(tmp_path / "one"))
    assert single.returncode == 0, single.stderr
    ddp = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "attnlab.cli",
         *args, "--out", str(tmp_path / "two")],
        capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    one, _ = losses(tmp_path / "one" / "tiny" / "baseline" / "seed0")
    two, _ = losses(tmp_path / "two" / "tiny" / "baseline" / "seed0")
    assert [s for s, _ in one] == [s for s, _ in two] == list(range(1, 7))
    assert torch.allclose(torch.tensor([v for _, v in one]), torch.tensor([v for _, v in two]), atol=1e-4, rtol=0)


def test_test_tokens_scores_a_prefix_of_the_test_split_and_the_whole_split_by_default(corpus, tmp_path):
    model, data, train = configs(corpus, steps=2, eval_every=2)
    data = DataConfig(source=str(corpus), tokenizer="char", val_fraction=0.1, test_fraction=0.1)
    whole = loop.train(model, data, train, tmp_path / "whole", progress=False)
    windows = whole["test_tokens"] // 16
    assert windows > 4  # the whole split: many windows of seq_len
    model, _, train = configs(corpus, steps=2, eval_every=2, test_tokens=64)
    part = loop.train(model, data, train, tmp_path / "part", progress=False)
    assert part["test_tokens"] == 64 and part["val_loss"] == whole["val_loss"]
    with pytest.raises(ConfigError, match="train.test_tokens=8 is less than train.seq_len=16"):
        configs(corpus, test_tokens=8)
