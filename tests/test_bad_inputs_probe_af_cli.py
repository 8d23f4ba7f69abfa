"""Probe AF's CLI findings (/work/probe_af/REPORT.md): `export --dtype fp16` wrote inf for weights past 65504 (AF4);
compare left out unfinished runs and changed the baseline without a word (AF6); mc took an empty question and an id
given twice (AF21); generate --chat answered an empty turn (AF22); context_sweep cut decode_tokens and effective_rank
n_tokens silently (AF29); a model config's name with a newline passed (AF20); a missing model reference ending in
whitespace was shown raw (AF19); report on a run's folder advised an --out bench refuses (AF23); YAML 1.1-only
booleans were read (AF25); an --out holding a newline was made (AF27); a damaged conversion recipe was said to be
missing (AF30, part). Each test fails with its fix backed out."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import fails

from attnlab.cli import main
from attnlab.interop import export as export_module

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


# ----------------------------------------------------------------------------- AF4: export --dtype fp16 past 65504


def test_af4_export_fp16_refuses_a_weight_fp16_cannot_hold_before_writing(tmp_path, tiny_run, capsys, monkeypatch):
    load = export_module.load_model

    def loud(*args, **kwargs):  # the checkpoint's attention weights far beyond fp16's 65504
        cfg, model, tokenizer = load(*args, **kwargs)
        with torch.no_grad():
            model.blocks[0].attn.qkv.weight.mul_(1e7)
        return cfg, model, tokenizer

    monkeypatch.setattr(export_module, "load_model", loud)
    out = tmp_path / "hf"
    argv = ["export", str(tiny_run), "--hf", str(out), "--dtype", "fp16"]
    assert fails(capsys, argv, "model.layers.0.self_attn.q_proj", "|value|=", "65504", "--dtype bf16 or fp32")
    assert not out.exists() and list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- AF6: compare and unfinished runs


def test_af6_compare_names_each_unfinished_run_it_leaves_out_and_the_baseline_it_lost(tmp_path, tiny_run, capsys):
    runs = tmp_path / "m"
    for target in ("base", "mem"):
        shutil.copytree(tiny_run, runs / target / "seed0")
    (runs / "base" / "seed0" / "summary.json").unlink()  # interrupted, or still training
    assert main(["compare", str(runs), "--out", str(tmp_path / "o")]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("attnlab compare: warning: ") and str(runs / "base" / "seed0") in lines[0], lines
    assert "no summary.json" in lines[0] and "left out" in lines[0], lines
    assert lines[1] == "attnlab compare: warning: target 'base' has no finished run: the baseline is 'mem' instead"
    assert fails(capsys, ["compare", str(runs), "--out", str(tmp_path / "o2"), "--baseline", "base"], "--baseline base",
          "no finished run", "(mem)")  # fmt: skip


# ----------------------------------------------------------------------------- AF21: mc items


def arc_items(n: int = 3) -> list[dict]:
    return [{"id": f"q{i}", "question": f"What is {i}?", "answerKey": "A",
             "choices": {"text": ["a cat", "a dog"], "label": ["A", "B"]}} for i in range(n)]  # fmt: skip


def test_af21_mc_refuses_an_empty_question_and_an_id_given_twice(tmp_path, tiny_run, capsys):
    empty, twice = arc_items(), arc_items()
    empty[1]["question"] = "  "
    twice[2]["id"] = "q0"
    for name, items, fragments in (("empty.json", empty, ("item 'q1'", "'question' is empty")),
                                   ("twice.json", twice, ("'q0'", "also the id", "distinct"))):  # fmt: skip
        path = tmp_path / name
        path.write_text(json.dumps(items, indent=1))
        assert fails(capsys, ["mc", "arc_easy", str(tiny_run), "--file", str(path)], str(path), *fragments)
    piqa = tmp_path / "piqa.jsonl"
    piqa.write_text(json.dumps({"query": "Question:  \n", "choices": ["a", "b"], "gold": 0}) + "\n")
    assert fails(capsys, ["mc", "piqa", str(tiny_run), "--file", str(piqa)], f"{piqa}:1", "empty question")


# ----------------------------------------------------------------------------- AF22: generate --chat ''


def test_af22_generate_chat_refuses_an_empty_turn_as_plain_generate_refuses_an_empty_prompt(tiny_run, capsys):
    for prompt in ("", " \n"):
        argv = ["generate", str(tiny_run), prompt, "--chat"]
        assert fails(capsys, argv, "empty chat turn", "give the user's message")


# ----------------------------------------------------------------------------- AF29: cut decode_tokens and n_tokens


def warnings_of(capsys, argv) -> list[str]:
    """main(argv) succeeds; its stderr lines."""
    assert main(argv) == 0
    return capsys.readouterr().err.strip().splitlines()


def test_af29_context_sweep_says_when_decode_tokens_are_cut_and_effective_rank_when_n_tokens_is(tmp_path, tiny_run,
                                                                                                  capsys):  # fmt: skip
    sets = ["context_sweep.lengths=[32]", "context_sweep.chunk_size=16", "context_sweep.decode_tokens=1000"]
    argv = ["bench", str(tiny_run), "--benchmarks", "context_sweep", "--out", str(tmp_path / "cs")]
    lines = warnings_of(capsys, argv + [arg for s in sets for arg in ("--set", s)])
    assert len(lines) == 1 and lines[0].startswith("attnlab bench: warning: context_sweep: decode_tokens=1000"), lines
    assert "max_seq_len=64" in lines[0] and "32 at length 32" in lines[0], lines
    argv = ["bench", str(tiny_run), "--benchmarks", "effective_rank", "--out", str(tmp_path / "er"),
            "--set", "effective_rank.n_tokens=100000000", "--set", "effective_rank.seq_len=32"]  # fmt: skip
    lines = warnings_of(capsys, argv)
    assert len(lines) == 1 and lines[0].startswith("attnlab bench: warning: effective_rank: n_tokens=100000000"), lines


# ----------------------------------------------------------------------------- AF20: a model config's name


def test_af20_validate_refuses_a_model_config_name_with_a_control_character_as_a_manifest_name(tmp_path, capsys):
    for name, problem in (("tiny\n", "must not contain control characters"),
                          ("tiny\t", "must not contain control characters"),
                          ("tiny ", "must not start or end with white space")):  # fmt: skip
        path = tmp_path / "m.yaml"
        path.write_text(f"name: {json.dumps(name)}\nvocab_size: 100\nd_model: 32\nn_layers: 1\nn_heads: 2\n"
                        "max_seq_len: 64\nattention: {kind: mha}\n")  # fmt: skip
        assert main(["validate", str(path)]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"{path}: name {name!r} {problem}"]
        assert fails(capsys, ["info", str(path)], str(path), "name", problem)


# ----------------------------------------------------------------------------- AF19: a model reference's whitespace


def test_af19_a_missing_model_reference_ending_in_whitespace_is_shown_quoted_and_said(tmp_path, tiny_run, capsys):
    cases = ((f"{tiny_run}\n", "generate"), (f"{tiny_run}\t", "generate"), (f"{tmp_path}/m.yaml\n", "info"))
    for ref, command in cases:
        argv = [command, ref] + (["The"] if command == "generate" else [])
        line = fails(capsys, argv, f"{ref!r} (it ends with whitespace): no such file or folder")
        assert ref not in line, line


# ----------------------------------------------------------------------------- AF23: report on a run's folder


def test_af23_report_on_a_run_folder_gives_advice_bench_accepts(tiny_run, capsys):
    line = fails(capsys, ["report", str(tiny_run)], f"{tiny_run}: is a run's folder, not a bench folder",
                 f"attnlab bench {tiny_run} --out DIR", "outside the run", "attnlab compare")  # fmt: skip
    assert f"--out {tiny_run}" not in line, line  # what bench refuses


# ----------------------------------------------------------------------------- AF25: YAML 1.1-only booleans


def test_af25_yaml_11_only_booleans_are_refused_as_yaml_11_only_numbers_are(tmp_path, capsys):
    config = ("name: x\nvocab_size: 100\nd_model: 32\nn_layers: 1\nn_heads: 2\nmax_seq_len: 64\n"
              "attention: {kind: mha}\ntie_embeddings: ")  # fmt: skip
    for word, meant in (("yes", "true"), ("off", "false"), ("No", "false"), ("ON", "true")):
        path = tmp_path / "m.yaml"
        path.write_text(config + word + "\n")
        assert main(["validate", str(path)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"{word} is a boolean only in YAML 1.1" in lines[0], lines
        assert f"write {meant} if that is meant, or quote it" in lines[0] and str(path) in lines[0], lines
    for word in ("true", "False"):  # YAML 1.2's booleans are read as ever
        (tmp_path / "m.yaml").write_text(config + word + "\n")
        assert main(["validate", str(tmp_path / "m.yaml")]) == 0
    capsys.readouterr()
    manifest = tmp_path / "t.yml"
    manifest.write_text("name: t\nseeds: [0]\ndefaults:\n  model: {d_model: 32, n_layers: 1, n_heads: 2, "
                        f"max_seq_len: 64}}\n  data: {{source: {tmp_path / 'text.txt'}, tokenizer: char}}\n"
                        "  train: {steps: 2, seq_len: 32}\ntargets:\n  base: {}\n")  # fmt: skip
    argv = ["run", str(manifest), "--dry-run", "--out", str(tmp_path / "o"), "--set", "train.compile=yes"]
    assert fails(capsys, argv, "--set 'train.compile=yes'", "boolean only in YAML 1.1", "write true")


# ----------------------------------------------------------------------------- AF27: an --out with a newline


def test_af27_an_out_whose_new_folder_name_holds_a_control_character_is_refused(tmp_path, tiny_run, capsys):
    manifest = tmp_path / "t.yml"
    manifest.write_text("name: t\nseeds: [0]\ndefaults:\n  model: {d_model: 32, n_layers: 1, n_heads: 2, "
                        f"max_seq_len: 64}}\n  data: {{source: {tiny_run.parents[2] / 'text.txt'}, tokenizer: char}}\n"
                        "  train: {steps: 2, seq_len: 32}\ntargets:\n  base: {}\n")  # fmt: skip
    for out in (tmp_path / "o" / "nl\nx", tmp_path / "tab\t"):
        assert fails(capsys, ["run", str(manifest), "--dry-run", "--out", str(out)], f"--out {str(out)!r}",
              "must not contain control characters", "it names a folder or file this makes")  # fmt: skip
        assert not (tmp_path / "o").exists()
    assert fails(capsys, ["bench", str(tiny_run), "--benchmarks", "effective_rank", "--out", str(tmp_path / "b\nx")],
          "must not contain control characters")  # fmt: skip


# ----------------------------------------------------------------------------- AF30: a damaged conversion's recipe


def test_af30_a_conversion_whose_saved_recipe_is_damaged_is_not_said_to_have_none():
    from attnlab import retrofit

    assert retrofit._first_difference(None, {"kind": "mha"}) == "no recipe saved"
    said = retrofit._first_difference("x", {"kind": "mha"})
    assert said.startswith("its saved recipe is 'x', not a mapping") and "damaged" in said, said
