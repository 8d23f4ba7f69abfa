"""Probe AG's findings on configs, benches and the CLI (/work/probe_ag/REPORT.md): a memory that training never fills
was accepted (AG2; a bounded memory without banks, AG3, is the CoDA paper's window-only ablation, kept); validate
passed bench manifests that bench refuses, and bench refused some only after loading a model (AG4); an unknown
dataset got advice about its splits (AG5); kv_quant's seq_len past the context named an argument nobody gave (AG6);
a run manifest read as a probe suite or a model config got "did you mean" lines (AG7); compare showed a NaN summary
(AG8); convert and kv-eval cut a count past the split without a word (AG9, AG10); a stale $RANK beside one process
was taken (AG19); export and open_source read "no" as true and took shard sizes, caps and split names they cannot
use (AG1, AG20, AG21). Each test fails with its fix backed out."""

from __future__ import annotations

import io
import json
import shutil
import sys

import pytest
import torch
from helpers import fails, refused, unsealed

import attnlab
from attnlab.cli import main
from attnlab.config import DataConfig, MemoryConfig, TrainConfig, idle_memory_problem
from attnlab.errors import ConfigError
from attnlab.train import train

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = ("{seq_len: 32, batch_size: 2, steps: 2, warmup_steps: 1, eval_every: 2, eval_tokens: 64, "
         "checkpoint_every: 2}")  # fmt: skip


def manifest(tmp_path, targets: str):
    text = tmp_path / "text.txt"
    text.write_text("".join(f"the cat {i} sat on the mat, and the dog sat by door {i}.\n\n" for i in range(60)))
    path = tmp_path / "m.yml"
    path.write_text(f"name: m\nseeds: [0]\ndefaults:\n  model: {{d_model: 16, n_layers: 1, n_heads: 2, "
                    f"max_seq_len: 64}}\n  data: {{source: {text}, tokenizer: char}}\n  train: {TRAIN}\n"
                    f"targets:\n{targets}")  # fmt: skip
    return path


# ----------------------------------------------------------------------------- AG2, AG3: memories that never act


def test_ag2_a_run_whose_sequences_fit_in_its_memory_is_refused_by_the_dry_run_and_by_train(tmp_path, capsys):
    path = manifest(tmp_path, "  win: {model: {memory: {kind: bounded, recent_window: 32}}}\n"
                              "  sinks: {model: {memory: {kind: streaming, sink_tokens: 4, recent_window: 28}}}\n"
                              "  ok: {model: {memory: {kind: bounded, recent_window: 31}}}\n")  # fmt: skip
    assert main(["run", str(path), "--out", str(tmp_path / "o"), "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert (
        "win seed0: would be refused: train.seq_len=32 fits in memory.recent_window (32): no token would leave "
        "it in training, so the memory would never act"
    ) in out, out
    assert "sinks seed0: would be refused: train.seq_len=32 fits in the streaming memory's slots (32)" in out, out
    assert "ok seed0: would train 2 steps" in out, out
    memory = {"kind": "window", "recent_window": 40}
    model = attnlab.model_config_from_dict({"vocab_size": 40, "d_model": 16, "n_layers": 1, "n_heads": 2,
                                            "max_seq_len": 64, "memory": memory})  # fmt: skip
    data = DataConfig(source=str(tmp_path / "text.txt"), tokenizer="char")
    with pytest.raises(ConfigError, match=r"train.seq_len=32 fits in memory.recent_window \(40\)"):
        train(model, data, TrainConfig(seq_len=32, steps=1), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_ag3_a_bounded_memory_without_banks_is_the_papers_window_only_ablation():
    """Accepted on purpose: the CoDA package's module with no landmarks (its window rule through the bounded
    machinery; test_bounded_reference compares the two so); training it on sequences that fit in its window is not."""
    memory = MemoryConfig(kind="bounded", recent_window=8, exact_slots=0, summary_slots=0)
    assert memory.slots == 8
    assert idle_memory_problem(8, memory) and idle_memory_problem(9, memory) is None


# ----------------------------------------------------------------------------- AG4-AG6: bench manifests


def bench_file(tmp_path, run, line: str):
    path = tmp_path / "b.yml"
    path.write_text(f"name: b\ncheckpoints: [{run}]\nbenchmarks:\n  {line}\n")
    return path


@pytest.mark.parametrize(("line", "said"), [
    ("needle: {lengths: [64], filler: lorem}", "benchmarks.needle.filler='lorem' is not known (use 'sentences'"),
    ("multiple_choice: {tasks: [nosuch]}", "benchmarks.multiple_choice.tasks: unknown task 'nosuch' (valid tasks:"),
    ("memory: {lengths: [100000]}", "benchmarks.memory.lengths=[100000]: 100000 exceeds tiny/seed0's max_seq_len 64"),
    ("effective_rank: {seq_len: 1000}", "benchmarks.effective_rank.seq_len=1000: 1000 exceeds tiny/seed0's max_seq"),
    ("kv_quant: {seq_len: 1000, split: val}", "benchmarks.kv_quant.seq_len=1000: 1000 exceeds tiny/seed0's max_seq"),
    ("needle: {lengths: [8]}", "benchmarks.needle: lengths 8 are too short on tiny/seed0 to hold the prompt"),
    ("perplexity: {dataset: nosuch}", "benchmarks.perplexity.dataset='nosuch' is not a known dataset"),
])  # fmt: skip
def test_ag4_validate_says_what_bench_refuses_and_bench_says_it_before_loading(tiny_run, tmp_path, capsys,
                                                                               monkeypatch, line, said):  # fmt: skip
    path = bench_file(tmp_path, tiny_run, line)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: {said}" in err and "Traceback" not in err, err
    from attnlab.eval import harness

    monkeypatch.setattr(harness, "load_for_eval", lambda *a, **k: pytest.fail("a model was loaded"))
    line = fails(capsys, ["bench", str(path), "--out", str(tmp_path / "o")], said)
    assert "split" not in line or "dataset" not in said, line  # AG5: the unknown name, not its splits
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- AG7: a run manifest read as another file


def test_ag7_a_run_manifest_given_as_a_model_config_or_a_probe_suite_is_said_to_be_one(tmp_path, tiny_run, capsys):
    path = manifest(tmp_path, "  base: {}\n")
    with pytest.raises(ConfigError) as caught:
        attnlab.load_config(path)
    assert str(caught.value) == f"{path}: is a run manifest (it has targets:), not a model config"
    argv = ["bench", str(tiny_run), "--benchmarks", "probes", "--set", f"probes.suite={path}", "--out",
            str(tmp_path / "o")]  # fmt: skip
    line = fails(capsys, argv, f"{path}: is a run manifest (it has targets:), not a probe suite")
    assert "did you mean" not in line, line


# ----------------------------------------------------------------------------- AG8: a summary's NaN


def test_ag8_compare_refuses_a_summary_whose_loss_was_made_nan(tiny_run, tmp_path, capsys):
    root = tmp_path / "runs"
    shutil.copytree(tiny_run.parent, root / "tiny")
    summary = root / "tiny" / "seed0" / "summary.json"
    data = json.loads(summary.read_text())
    data["val_loss"], data["val_ppl"] = float("nan"), float("nan")
    summary.write_text(json.dumps(unsealed(data)))  # an older attnlab's summary: checked by its figures
    assert fails(capsys, ["compare", str(root / "tiny"), "--out", str(tmp_path / "c")],
                 f"{summary}: field 'val_loss' is nan, which a run never writes", "changed by hand")  # fmt: skip


# ----------------------------------------------------------------------------- AG9, AG10: counts past the split


def test_ag9_convert_says_when_calibration_tokens_are_more_than_the_text_holds(tiny_run, tmp_path, capsys):
    text = tiny_run.parents[2] / "text.txt"
    out = tmp_path / "c"
    argv = ["convert", str(tiny_run), "--attention", "kind=decoupled,d_sem=8,d_geo=8", "--calibrate-on", str(text),
            "--calibration-tokens", "99999999", "--eval-tokens", "0", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "--calibration-tokens" in line]
    assert lines == [f"attnlab convert: warning: --calibration-tokens 99,999,999: {text}'s train split holds "
                     f"{lines[0].split('holds ')[1].split(' ')[0]} tokens, all fitted on"], lines  # fmt: skip
    assert (out / "model.safetensors").exists()


def test_ag10_kv_eval_says_when_tokens_are_more_than_the_split_holds(tiny_run, capsys):
    base = ["kv-eval", str(tiny_run), "--policies", "k=q8_0", "--seq-len", "16", "--split", "val"]
    assert main([*base, "--tokens", "99999999"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "more than" in line]
    assert len(lines) == 1 and lines[0].startswith("attnlab kv-eval: warning: --tokens 99,999,999 is more than"), lines
    assert "'val' split holds" in lines[0], lines
    assert main(base) == 0  # (the default: as many as there are, up to 8192, said nowhere)
    assert "more than" not in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_ag10_kv_policies_show_a_bar_of_the_windows_on_a_terminal(monkeypatch):
    from attnlab.eval import kvquant, perplexity

    model = attnlab.build_model(attnlab.ModelConfig(vocab_size=11, d_model=64, n_layers=1, n_heads=2, max_seq_len=32))
    stderr = Terminal()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(perplexity, "BAR_DELAY", 0.0)
    windows = (torch.arange(6 * 17) % 11).view(6, 17)
    kvquant.evaluate_policies(model, windows, ["k=q8_0"], greedy_tokens=0)
    assert "kv policies:" in stderr.getvalue() and "/6 [" in stderr.getvalue(), stderr.getvalue()


# ----------------------------------------------------------------------------- AG19: a stale $RANK


@pytest.mark.parametrize("world", ["1", None])
def test_ag19_a_rank_other_than_0_beside_one_process_is_refused(tmp_path, capsys, monkeypatch, world):
    path = manifest(tmp_path, "  base: {}\n")
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", "5")
    dry = ["run", str(path), "--out", str(tmp_path / "o"), "--dry-run"]
    assert fails(capsys, dry, f"$RANK=5 but $WORLD_SIZE is {world or 'unset'}: one process is rank 0", "unset $RANK")
    monkeypatch.setenv("RANK", "abc")
    assert fails(capsys, dry, "$RANK='abc' must be a whole number >= 0")
    monkeypatch.setenv("RANK", "0")
    assert main(dry) == 0


# ----------------------------------------------------------------------------- AG1 (export), AG20, AG21: API flags


def test_ag1_ag21_export_refuses_an_overwrite_not_true_or_false_and_a_shard_size_below_1(tiny_run, tmp_path):
    from attnlab.interop.export import export_hf

    out = tmp_path / "hf"
    export_hf(tiny_run, out)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    cases = (({"overwrite": "no"}, "overwrite='no' must be True or False"),
             ({"overwrite": True, "max_shard_bytes": 0}, "max_shard_bytes=0 must be a whole number"),
             ({"overwrite": True, "max_shard_bytes": -1}, "max_shard_bytes=-1 must be a whole number"))  # fmt: skip
    for kwargs, said in cases:
        assert refused(lambda kwargs=kwargs: export_hf(tiny_run, out, **kwargs), said)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_ag20_open_source_refuses_a_download_flag_split_names_and_a_cap_it_cannot_use():
    from attnlab.data import open_source

    assert refused(lambda: open_source("tinyshakespeare", download="no"), "download='no' must be True or False")
    assert refused(lambda: open_source("wikitext2", splits=("tset",)), "splits=('tset',) must be a tuple of split")
    assert refused(lambda: open_source("wikitext2", splits="test"), "splits='test' must be a tuple of split names")
    assert refused(lambda: open_source("fineweb-edu", max_tokens=-1), "max_tokens=-1 must be a whole number >= 1")
