"""Probe V's findings (/work/probe_v/REPORT.md): a run folder whose checkpoints/ is a file was trained from the start
(its metrics log replaced) and refused only at its first checkpoint, the dry run saying "would train" (L1); a stale
best.json was found only after the run had rewritten command.txt, the dry run saying "would resume" (L2); Mistral's
sliding_window: 0 was read as no window (S1); `info` on a Hugging Face folder or a run printed figures its weights
contradict, or exited 0 on damaged weights and tokenizer files (S2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import dry_run, fails, snapshot

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

# the stopped run and its copies are probe V's resume tests' (the same manifest, stopped after its step-2 checkpoint)
import test_bad_inputs_probe_v_runs as v_runs  # noqa: E402

RUN, interrupted, stopped = v_runs.RUN, v_runs.interrupted, v_runs.stopped


def refused_alike(capsys, argv: list[str], out: Path) -> str:
    """The run is refused (nothing under --out changed) and its dry run says it would be, with the run's own line:
    that line (after `attnlab run: error: `)."""
    before = snapshot(out)
    printed = dry_run(capsys, [*argv, "--dry-run"])
    line = fails(capsys, argv).split("error: ", 1)[1]
    assert printed == f"[1/1] base seed0: would be refused: {line}\n", (printed, line)
    assert snapshot(out) == before
    return line


# ----------------------------------------------------------------------------- L1, L2: refused before writing


def test_a_checkpoints_file_is_refused_before_the_run_writes(stopped, tmp_path, capsys):
    argv, out = interrupted(stopped, tmp_path)
    shutil.rmtree(out / RUN / "checkpoints")
    (out / RUN / "checkpoints").write_text("x\n")
    line = refused_alike(capsys, argv, out)
    assert line.startswith(f"{out / RUN / 'checkpoints'}: is a file, where the run keeps its checkpoints"), line
    assert "move it away" in line
    fails(capsys, [*argv, "--no-resume"], "is a file, where the run keeps its checkpoints")
    assert (out / RUN / "checkpoints").read_text() == "x\n"


def test_a_stale_best_json_is_refused_before_the_run_writes(stopped, tmp_path, capsys):
    argv, out = interrupted(stopped, tmp_path)
    (out / RUN / "checkpoints" / "best.json").write_text(json.dumps({"dir": "step-000001", "step": 1}))
    line = refused_alike(capsys, argv, out)
    assert "best.json names step-000001, which is missing" in line, line


# ----------------------------------------------------------------------------- S1: sliding_window 0


@pytest.fixture(scope="module")
def hf_folder(tiny_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "model"
    assert main(["export", str(tiny_run), "--hf", str(out)]) == 0
    return out


def edited_copy(hf_folder: Path, tmp_path: Path, **changes) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.mark.parametrize("command", ["info", "generate"])
def test_a_mistral_sliding_window_of_zero_is_refused(command, hf_folder, tmp_path, capsys):
    folder = edited_copy(hf_folder, tmp_path, model_type="mistral", architectures=["MistralForCausalLM"],
                         sliding_window=0)  # fmt: skip
    argv = [command, str(folder)] + (["the", "--max-new-tokens", "2"] if command == "generate" else [])
    line = fails(capsys, argv, f"{folder / 'config.json'}: sliding_window=0 must be >= 1 or null")
    assert "use_sliding_window" not in line  # the key the file has, not another's


# ----------------------------------------------------------------------------- S2: info checks what it is given


def _config_edit(**changes):
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))

    return edit


def _weights(edit):
    """An edit of model.safetensors' tensors (a dict of name -> tensor), saved again."""

    def run(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(folder / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(folder / "model.safetensors"))

    return run


def _truncate(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _sharded(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


HF_DAMAGE = {
    "hidden_size edited": (_config_edit(hidden_size=64), "32), the config implies ("),
    "vocab_size edited": (_config_edit(vocab_size=10), "the config implies (10, 32)"),
    "untied without lm_head": (_config_edit(tie_word_embeddings=False), "missing tensor(s) lm_head.weight"),
    "truncated weights": (_truncate, "unreadable safetensors file"),
    "garbage weights": (lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 64), "unreadable safetensors"),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), "no model.safetensors"),
    "a tensor missing": (_weights(lambda t: t.pop("model.norm.weight")), "missing tensor(s) model.norm.weight"),
    "an extra tensor": (
        _weights(lambda t: t.update({"model.norm.bias": t["model.norm.weight"].clone()})),
        "unexpected tensor 'model.norm.bias'",
    ),
    "an int tensor": (
        _weights(lambda t: t.update({"model.norm.weight": t["model.norm.weight"].int()})),
        "not floating point",
    ),
    "a missing shard": (_sharded, "model-00002-of-00002.safetensors: not found"),
    "no tokenizer.json": (lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json: not found"),
    "garbage tokenizer.json": (lambda f: (f / "tokenizer.json").write_text("{]"), "tokenizer.json"),
    "add_bos_token a string": (
        lambda f: (f / "tokenizer_config.json").write_text('{"add_bos_token": "yes"}'),
        "add_bos_token",
    ),
    "bos_token_id past the vocabulary": (_config_edit(bos_token_id=500), "bos_token_id=500 is not a token id"),
}


@pytest.mark.parametrize("damage", list(HF_DAMAGE))
def test_info_on_a_hugging_face_folder_checks_its_weights_and_tokenizer(damage, hf_folder, tmp_path, capsys):
    edit, fragment = HF_DAMAGE[damage]
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    edit(folder)
    before = snapshot(folder)
    fails(capsys, ["info", str(folder)], fragment)
    assert snapshot(folder) == before


def test_info_on_a_hugging_face_folder_loads_no_tensor_data(hf_folder, capsys, monkeypatch):
    from attnlab.interop import hf

    monkeypatch.setattr(hf, "load_hf_folder", None)  # info reads the headers: never the tensors
    assert main(["info", str(hf_folder)]) == 0
    assert "mha attention" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_info_on_a_run_checks_its_weights_checksums(damage, tiny_run, tmp_path, capsys):
    run = tmp_path / "seed0"
    shutil.copytree(tiny_run, run)
    best = json.loads((run / "checkpoints" / "best.json").read_text())["dir"]
    weights = run / "checkpoints" / best / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flipped":
        data[-1] ^= 1
    weights.write_bytes(bytes(data) if damage == "flipped" else bytes(data[:100]))
    line = fails(capsys, ["info", str(run)], str(weights))
    assert ("sha256" if damage == "flipped" else "truncated") in line, line


# ----------------------------------------------------------------------------- compare without a loss history


def test_compare_says_in_one_line_that_a_run_has_no_loss_history(tiny_run, tmp_path, capsys):
    run = tmp_path / "runs" / "tiny" / "seed0"
    shutil.copytree(tiny_run, run)
    (run / "metrics.jsonl").unlink()
    assert main(["compare", str(tmp_path / "runs")]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{run}: no validation loss history to plot" in lines[0], lines


# ----------------------------------------------------------------------------- memories that are the window memory


@pytest.mark.parametrize(("memory", "line"), [
    ("{kind: streaming, recent_window: 16, sink_tokens: 0}", "memory.sink_tokens=0 makes streaming the window memory"),
    ("{kind: h2o, recent_window: 16, heavy_slots: 0}", "memory.heavy_slots=0 makes h2o the window memory"),
])  # fmt: skip
def test_a_memory_option_that_makes_it_the_window_memory_is_refused(memory, line, tmp_path, capsys):
    config = tmp_path / "model.yaml"
    config.write_text(f"vocab_size: 64\nd_model: 32\nn_layers: 1\nn_heads: 2\nmax_seq_len: 64\nmemory: {memory}\n")
    before = snapshot(tmp_path)
    fails(capsys, ["info", str(config)], line, "use memory.kind window")
    assert snapshot(tmp_path) == before
