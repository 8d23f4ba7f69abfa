"""Probe W's findings, fixed after it: `run --dry-run --target X` said "would train" a target whose init_from target
was not trained, where the run refused it (S3); a Hugging Face config.json with a key given twice was read with the
last value winning, a quantization_config attnlab does not implement was read over float weights, and a lm_head
tied to the embedding (tie_word_embeddings) but stored different was ignored without a word (S4). Its Ctrl-C
findings (T4, T5) are tested in tests/test_entry.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import dry_run, fails, hat_text, probe_manifest

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

# ----------------------------------------------------------------------------- S3: init_from not trained, dry run

TRAIN = "{seq_len: 16, batch_size: 2, steps: 2, warmup_steps: 1, eval_every: 2, eval_tokens: 32}"
TARGETS = "  base: {}\n  more: {init_from: base, train: {steps: 3}}\n"


def test_s3_a_dry_run_of_a_target_alone_refuses_an_untrained_init_from_with_the_runs_line(tmp_path, capsys):
    """Was: "[1/1] more seed0: would train 3 steps ... from OUT/m/base/seed0", exit 0; the run refused."""
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, TARGETS)
    argv = ["run", str(manifest), "--out", str(tmp_path / "out"), "--target", "more", "--no-progress"]
    printed = dry_run(capsys, [*argv, "--dry-run"])
    line = fails(capsys, argv, "targets.more.init_from: ", "is not trained yet (run target base first, or run the "
                 "whole manifest)").split("error: ", 1)[1]  # fmt: skip
    assert printed == f"[1/1] more seed0: would be refused: {line}\n"
    assert not (tmp_path / "out").exists()


def test_s3_the_whole_manifest_or_a_trained_init_from_would_train(tmp_path, capsys):
    """The earlier target trained first (the whole manifest, or both targets named), or trained already: would
    train, in the dry run as in the run."""
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, TARGETS)
    out = tmp_path / "out"
    base = out / "m" / "base" / "seed0"
    argv = ["run", str(manifest), "--out", str(out), "--no-progress"]
    for targets in ([], ["--target", "base", "--target", "more"]):
        printed = dry_run(capsys, [*argv, *targets, "--dry-run"])
        assert f"[2/2] more seed0: would train 3 steps into {out / 'm' / 'more' / 'seed0'} from {base}\n" in printed
    assert main([*argv, "--target", "base"]) == 0
    capsys.readouterr()
    printed = dry_run(capsys, [*argv, "--target", "more", "--dry-run"])
    assert printed == f"[1/1] more seed0: would train 3 steps into {out / 'm' / 'more' / 'seed0'} from {base}\n"
    assert main([*argv, "--target", "more"]) == 0


# ----------------------------------------------------------------------------- S4: Hugging Face folders


@pytest.fixture(scope="module")
def hf_folder(tiny_run, tmp_path_factory) -> Path:
    """An exported tiny run: tie_word_embeddings true, no lm_head.weight stored, a tokenizer, one weight file."""
    out = tmp_path_factory.mktemp("hf") / "model"
    assert main(["export", str(tiny_run), "--hf", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    return out


def copied(hf_folder: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    return folder


def sharded(folder: Path) -> None:
    """model.safetensors as the one shard an index lists."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {name: "model-00001-of-00001.safetensors" for name in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def given_twice(file: str, key: str, value: str):
    """An edit that gives `key` first as `value` (JSON text), then as the file has it."""

    def edit(folder: Path) -> None:
        path = folder / file
        text = path.read_text()
        opening = '"weight_map": {' if file.endswith("index.json") else "{"
        path.write_text(text.replace(opening, f'{opening}"{key}": {value}, ', 1))

    return edit


TWICE = {
    "config.json": (given_twice("config.json", "hidden_size", "64"), "key 'hidden_size' is given twice (64, then "),
    "generation_config.json": (given_twice("generation_config.json", "eos_token_id", "3"),
                               "key 'eos_token_id' is given twice (3, then "),
    "tokenizer_config.json": (given_twice("tokenizer_config.json", "add_bos_token", "true"),
                              "key 'add_bos_token' is given twice (true, then false)"),
    "model.safetensors.index.json": (
        lambda f: (sharded(f), given_twice("model.safetensors.index.json", "model.norm.weight", '"x.safetensors"')(f)),
        "key 'model.norm.weight' is given twice (\"x.safetensors\", then \"model-00001-of-00001.safetensors\")",
    ),
}  # fmt: skip


@pytest.mark.parametrize("file", sorted(TWICE))
@pytest.mark.parametrize("command", ["info", "generate"])
def test_s4_a_key_given_twice_in_a_hf_folders_json_is_refused(hf_folder, tmp_path, capsys, file, command):
    """Was: read with the last value winning (json.loads', and transformers', reading), rc 0."""
    folder = copied(hf_folder, tmp_path)
    edit, said = TWICE[file]
    edit(folder)
    argv = [command, str(folder)] + (["the", "--max-new-tokens", "2"] if command == "generate" else [])
    line = fails(capsys, argv, f"{folder / file}: {said}")
    assert line.endswith("keep one"), line


@pytest.mark.parametrize("command", ["info", "generate"])
def test_s4_a_quantization_config_is_refused_naming_its_method(hf_folder, tmp_path, capsys, command):
    """Was: a quantization_config over the float weights read without a word."""
    folder = copied(hf_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq",
                                                                                      "bits": 4}}))  # fmt: skip
    argv = [command, str(folder)] + (["the", "--max-new-tokens", "2"] if command == "generate" else [])
    fails(capsys, argv, f'{folder / "config.json"}: quantization_config (quant_method "gptq") is not supported')
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {}}))  # (says nothing)
    assert main(argv) == 0
    assert capsys.readouterr().err == ""


def generated(capsys, folder: Path) -> tuple[str, str]:
    assert main(["generate", str(folder), "the cat", "--max-new-tokens", "8"]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_s4_a_tied_models_stored_lm_head_that_differs_is_ignored_with_a_warning(hf_folder, tmp_path, capsys):
    """Was: ignored without a word. tie_word_embeddings: true makes the embedding the output layer; a lm_head.weight
    the file also holds is ignored (the text is the same as without it), and a warning says so when it differs."""
    from safetensors.torch import load_file, save_file

    expected, _ = generated(capsys, hf_folder)
    folder = copied(hf_folder, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    embedding = tensors["model.embed_tokens.weight"]
    for head, warned in ((embedding.clone(), False), (embedding.flip(0).contiguous(), True)):
        save_file({**tensors, "lm_head.weight": head}, str(folder / "model.safetensors"))
        out, err = generated(capsys, folder)
        assert out == expected
        said = (
            f"attnlab generate: warning: {folder / 'model.safetensors'}: lm_head.weight differs from the "
            "embedding (model.embed_tokens.weight) and is ignored: config.json's tie_word_embeddings is true"
        )
        assert (err.startswith(said) and len(err.splitlines()) == 1) if warned else err == "", err
