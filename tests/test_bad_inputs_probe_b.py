"""Probe B's findings: each bad input ends in exit code 2 and one line `attnlab <command>: error: ...` naming the
file, key or value and the fix (no traceback), or is accepted where it was wrongly refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import fails

from attnlab.cli import main


def write_manifest(tmp_path, train="{seq_len: 16, batch_size: 2, steps: 2, eval_every: 2, eval_tokens: 64}",
                   source=None):  # fmt: skip
    if source is None:
        source = tmp_path / "text.txt"
        source.write_text("\n\n".join(f"a cat and a dog sat on the mat by the red door {i}" for i in range(80)))
    manifest = tmp_path / "m.yml"
    manifest.write_text(
        "name: m\nseeds: [0]\ntargets:\n  base:\n    model: {d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 64}\n"
        f"    data: {{source: {source}, tokenizer: char, val_fraction: 0.2}}\n    train: {train}\n"
    )
    return manifest


def test_a_finished_run_saved_before_a_new_field_is_not_refused(tmp_path, capsys):
    """A config.json saved before `train.trainable` existed (the key missing, today None) is the same config; a
    real difference is named in the refusal (key, saved value, value now)."""
    manifest = write_manifest(tmp_path)
    out = tmp_path / "runs"
    assert main(["run", str(manifest), "--out", str(out)]) == 0
    saved_path = out / "m" / "base" / "seed0" / "config.json"
    saved = json.loads(saved_path.read_text())
    assert "trainable" in saved["train"]
    del saved["train"]["trainable"]
    saved_path.write_text(json.dumps(saved))
    capsys.readouterr()
    assert main(["run", str(manifest), "--out", str(out)]) == 0
    assert "done already" in capsys.readouterr().out
    saved["train"]["lr"] = 0.5
    saved_path.write_text(json.dumps(saved))
    assert fails(capsys, ["run", str(manifest), "--out", str(out)], "another config", "train.lr: saved 0.5, now")


def test_a_set_value_nested_thousands_deep_is_refused(tmp_path, capsys):
    manifest = write_manifest(tmp_path)
    deep = "[" * 3000 + "]" * 3000
    assert fails(
        capsys, ["run", str(manifest), "--dry-run", "--set", f"model.attention={deep}"], "--set", "nested too deeply"
    )
    deep = "[" * 500 + "]" * 500  # parsed by PyYAML, too deep for what reads it
    assert fails(
        capsys, ["run", str(manifest), "--dry-run", "--set", f"model.attention={deep}"], "--set", "nested too deeply"
    )


def test_a_cache_that_cannot_be_created_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/xdg")
    manifest = write_manifest(tmp_path)
    assert fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "runs")], "/proc/xdg", "set XDG_CACHE_HOME")


def write_metadata_gguf(path, **metadata):
    """A GGUF file holding llama metadata (defaults of a tiny model, overridden by `metadata`) and no tensors."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    values = {"block_count": 1, "embedding_length": 8, "feed_forward_length": 16, "attention.head_count": 2}
    values.update(metadata)
    for name, value in values.items():
        if isinstance(value, str):
            writer.add_string(f"llama.{name}", value)
        elif isinstance(value, float):
            writer.add_float32(f"llama.{name}", value)
        else:
            writer.add_uint32(f"llama.{name}", value)
    from gguf_files import finish

    return finish(writer, path)


@pytest.mark.parametrize(
    "metadata, named",
    [
        ({"attention.head_count": 0}, "llama.attention.head_count=0"),
        ({"rope.freq_base": "abc"}, "llama.rope.freq_base"),
    ],
)
def test_gguf_metadata_of_the_wrong_type_or_value_is_named(tmp_path, capsys, metadata, named):
    path = write_metadata_gguf(tmp_path / "bad.gguf", **metadata)
    assert fails(capsys, ["info", str(path)], "bad.gguf", named)


def test_a_chat_template_that_overflows_is_refused(tmp_path, capsys):
    pytest.importorskip("transformers")
    from test_pretrained import random_model, save

    folder = save(random_model("llama", n_kv_heads=2), tmp_path / "m")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for i in range(10**12) %}x{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert fails(
        capsys, ["generate", str(folder), "hi", "--chat", "--max-new-tokens", "1"], "chat template does not render"
    )


@pytest.mark.parametrize(
    "command, line",
    [
        ("run", "attnlab run: interrupted; run the same command again to resume from the last checkpoint"),
        ("bench", "attnlab bench: interrupted"),
    ],
)
def test_an_interrupted_command_says_so_in_one_line(capsys, command, line):
    """Ctrl-C: one line, exit code 130 (main() calls interrupted() on KeyboardInterrupt)."""
    from attnlab.entry import interrupted

    assert interrupted(command) == 130
    assert capsys.readouterr().err.splitlines() == [line]


def test_ctrl_c_during_run_ends_in_one_line_and_exit_code_130(tmp_path, capsys, monkeypatch):
    import attnlab.cli

    def stopped(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(attnlab.cli, "cmd_run", stopped)
    assert main(["run", str(write_manifest(tmp_path))]) == 130
    assert capsys.readouterr().err.splitlines() == [
        "attnlab run: interrupted; run the same command again to resume from the last checkpoint"
    ]
    assert main(["run", str(write_manifest(tmp_path)), "--dry-run"]) == 130  # a dry run: nothing to resume
    assert capsys.readouterr().err.splitlines() == ["attnlab run: interrupted"]


def test_a_checkpoint_from_before_checksums_is_one_warning_line(tmp_path, capsys):
    from helpers import train_tiny_run
    from test_integrity import make_legacy

    from attnlab.train.checkpoint import CHECKSUMS

    run = train_tiny_run(
        tmp_path, {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}, steps=2
    )
    for checksums in run.rglob(CHECKSUMS):
        make_legacy(checksums.parent)
    capsys.readouterr()
    assert main(["generate", str(run), "a cat", "--max-new-tokens", "1"]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab generate: warning: "), lines
    assert "no checksums.json (written by an older attnlab)" in lines[0]


def test_an_undefined_variable_is_the_only_problem_reported(tmp_path, capsys):
    manifest = write_manifest(tmp_path, train="{seq_len: 16, batch_size: 2, steps: 2, lr: '${nope}'}")
    assert main(["validate", str(manifest)]) == 2
    captured = capsys.readouterr()
    lines = (captured.err + captured.out).strip().splitlines()  # validate: one line per file with problems
    assert len(lines) == 1 and "m.yml" in lines[0] and "train.lr: undefined variable ${nope}" in lines[0], lines
    assert "must be" not in lines[0] and "Traceback" not in captured.err


@pytest.mark.parametrize(
    "text, named", [("{broken", "config.json: not valid JSON"), ("[1, 2]", "config.json: not a JSON object")]
)
def test_a_broken_hf_config_json_is_named(tmp_path, capsys, text, named):
    folder = tmp_path / "h"
    folder.mkdir()
    (folder / "config.json").write_text(text)
    assert fails(capsys, ["info", str(folder)], named)


def test_a_run_holding_another_runs_tokenizer_is_refused(tmp_path, capsys):
    import shutil
    import string

    from helpers import train_tiny_run

    from attnlab.data.tokenizers import train_tokenizer

    run = train_tiny_run(
        tmp_path, {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}, steps=2
    )
    shutil.rmtree(run / "tokenizer")
    (run / "tokenizer").mkdir()
    train_tokenizer("char", [string.printable]).save(run / "tokenizer")  # another run's: 100 characters
    capsys.readouterr()
    assert fails(capsys, ["generate", str(run), "a cat", "--max-new-tokens", "1"], "tokenizer", "vocab_size is 40")


def test_a_dry_run_checks_that_a_named_dataset_can_be_found(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # empty: nothing prepared or downloaded
    manifest = write_manifest(tmp_path, source="fineweb-edu")
    assert fails(
        capsys,
        ["run", str(manifest), "--dry-run", "--data-dir", str(tmp_path / "nonexistent")],
        "--data-dir",
        "nonexistent",
        "no such folder",
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert fails(capsys, ["run", str(manifest), "--dry-run"], "fineweb-edu", "downloads are off")


def test_rope_parameters_and_rope_scaling_that_disagree_are_refused(tmp_path, capsys):
    pytest.importorskip("transformers")
    from test_pretrained import random_model, save

    folder = save(random_model("llama", n_kv_heads=2), tmp_path / "h")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert fails(capsys, ["info", str(folder)], "config.json", "rope_parameters and rope_scaling disagree", "'yarn'")


@pytest.mark.parametrize(
    "sets, named",
    [
        (["needle.dataset=nope.txt"], "needle.dataset='nope.txt' is read only with filler=heldout"),
        (["needle.lengths=[0]"], "needle.lengths=[0] holds 0"),
        (["needle.lengths=[64, 1]"], "which must be a whole number >= 2"),
        (["needle.gain=sometimes"], ("needle.gain='sometimes'",)),
        (["needle.gain=1"], ("needle.gain=1",)),
    ],
)
def test_needle_parameters_that_would_be_ignored_or_meaningless_are_refused(tmp_path, capsys, sets, named):
    bench = tmp_path / "b.yml"
    bench.write_text("name: b\ncheckpoints: [nowhere]\nbenchmarks: {needle: {}}\n")
    argv = ["bench", str(bench), "--out", str(tmp_path / "o")]
    for item in sets:
        argv += ["--set", item]
    assert fails(capsys, argv, *([named] if isinstance(named, str) else named))


def test_an_empty_benchmark_list_is_refused(tmp_path, capsys):
    """`--benchmarks ''` is refused, not read as "every benchmark"."""
    assert main(["bench", str(tmp_path), "--benchmarks", ""]) == 2
    assert "--benchmarks names no benchmark" in capsys.readouterr().err


def test_a_report_of_an_empty_records_file_is_refused(tmp_path, capsys):
    (tmp_path / "records.jsonl").write_text("")
    assert fails(capsys, ["report", str(tmp_path)], "records.jsonl", "no records")
    assert not (tmp_path / "report.md").exists()


def test_warmup_longer_than_the_run_is_refused(tmp_path, capsys):
    manifest = write_manifest(tmp_path, train="{seq_len: 16, batch_size: 2, steps: 20, warmup_steps: 500}")
    assert fails(capsys, ["run", str(manifest), "--dry-run"], "train.warmup_steps=500 exceeds train.steps=20")


def test_any_folder_under_a_cache_that_cannot_exist_is_one_line(monkeypatch):
    """Downloads and kernels write under $XDG_CACHE_HOME too: a cache under /proc is named, with the fix."""
    import argparse
    import errno

    from attnlab.cli_errors import os_error_line

    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/xdg")
    error = FileNotFoundError(errno.ENOENT, "No such file or directory", "/proc/xdg/attnlab/tinyshakespeare")
    line = os_error_line(error, argparse.Namespace(command="run"))
    assert line is not None and "/proc/xdg" in line and "set XDG_CACHE_HOME to a writable folder" in line


def test_a_benchmark_kv_policy_is_checked_before_anything_runs_and_info_refuses_an_empty_one(tmp_path, capsys):
    """memory.kv_policy=k=q3_0 used to be recorded with exit 0 when no length fit a cache; `info --kv-policy ''`
    was accepted."""
    assert main(["bench", str(tmp_path), "--benchmarks", "memory", "--set", "memory.kv_policy=k=q3_0"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "memory.kv_policy='k=q3_0' is not a KV policy" in err
    config = Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny-mha.yaml"
    with pytest.raises(SystemExit) as exited:  # argparse's refusal, as for any other bad flag
        main(["info", str(config), "--kv-policy", ""])
    assert exited.value.code == 2 and "--kv-policy: is empty" in capsys.readouterr().err
