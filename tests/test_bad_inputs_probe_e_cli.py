"""Probe G's findings in the model commands (generate, kv-eval, kv-tune, memory, convert, mc, lm-eval, info,
validate, probes): --out files that are a user's corpus, repeated options, memory states of other weights,
characters a vocabulary lacks, KV policies that quantize nothing, duplicate choices, byte-order marks, deeply
nested JSON, splits a text file does not have, and messages that name the flag of the command being run."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
from helpers import error_line, fails, tiny_model, train_tiny_run

pytestmark = pytest.mark.usefixtures("one_thread")

DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested past Python's recursion limit


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """A tiny trained model (mha with 2 KV heads, char tokenizer of 'a cat and a dog sat on the mat by the red
    door', max_seq_len 64; its data has train and val splits)."""
    model = {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}
    return train_tiny_run(tmp_path_factory.mktemp("plainrun"), model, steps=4)


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory):
    model = {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64,
             "memory": {"kind": "streaming", "recent_window": 16, "sink_tokens": 2}}  # fmt: skip
    return train_tiny_run(tmp_path_factory.mktemp("memrun"), model, steps=4)


def kv_eval(run, *extra) -> list[str]:
    return ["kv-eval", str(run), "--policies", "k=q8_0", "--split", "val", "--seq-len", "16", "--tokens", "32",
            *extra]  # fmt: skip


# ----------------------------------------------------------------------------- OUT-jsonl, KE12: --out of kv-eval/tune


@pytest.mark.parametrize("command", [["kv-eval", "--policies", "k=q8_0"], ["kv-tune", "--budget", "100"]])
def test_an_out_file_holding_a_users_jsonl_corpus_is_refused_and_kept(tmp_path, capsys, command):
    """OUT-jsonl, OUT-jsonl-kvtune: JSON objects that are not records (a {"text": ...} corpus) get no rows."""
    out = tmp_path / "user.jsonl"
    corpus = "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(3))
    out.write_text(corpus)
    argv = [command[0], str(tmp_path / "no-model"), *command[1:], "--out", str(out)]
    assert fails(capsys, argv, "user.jsonl", "line 1 is not an attnlab record", "'benchmark'", "give a new file")
    assert out.read_text() == corpus


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig"])
def test_kv_eval_appends_to_a_file_of_records(plain_run, tmp_path, capsys, encoding):
    from attnlab.cli import main

    out = tmp_path / "r.jsonl"
    out.write_text(json.dumps({"benchmark": "perplexity", "loss": 1.0}) + "\n", encoding=encoding)
    assert main(kv_eval(plain_run, "--out", str(out))) == 0
    lines = out.read_text(encoding="utf-8-sig").splitlines()
    assert [json.loads(line)["benchmark"] for line in lines] == ["perplexity", "kv_quant"]


def test_kv_eval_out_with_a_trailing_slash_is_a_folder(plain_run, tmp_path, capsys):
    """KE12: --out o/kvdir/ (missing) writes o/kvdir/records.jsonl, as bench does, not a file named o/kvdir."""
    from attnlab.cli import main

    folder = tmp_path / "o" / "kvdir"
    assert main(kv_eval(plain_run, "--out", f"{folder}/")) == 0
    assert folder.is_dir() and (folder / "records.jsonl").is_file()
    assert json.loads((folder / "records.jsonl").read_text())["benchmark"] == "kv_quant"
    assert f"records: {folder / 'records.jsonl'}" in capsys.readouterr().out


# ----------------------------------------------------------------------------- KE11, CV19: a single-value option twice


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["kv-eval", "m", "--policies", "k=q8_0", "--out", "a.jsonl", "--out", "b.jsonl"], "--out"),
        (["convert", "m", "--attention", "kind=mha,n_kv_heads=1", "--attention", "kind=coda", "--out", "x"],
         "--attention"),
        (["memory", "query", "n", "hi", "--store", "a", "--store", "b"], "--store"),
        (["generate", "m", "hi", "--max-new-tokens", "2", "--max-new-tokens", "3"], "--max-new-tokens"),
    ],
)  # fmt: skip
def test_a_single_value_option_given_twice_is_refused(tmp_path, capsys, monkeypatch, argv, flag):
    """argparse keeps the last of a repeated option without a word: the first value would be dropped."""
    from attnlab.cli import main

    monkeypatch.chdir(tmp_path)  # nothing may be written, wherever it would go
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    line = error_line(capsys, argv[0] if argv[0] != "memory" else "memory query", f"argument {flag}", "given twice")
    assert "give it once" in line
    assert list(tmp_path.iterdir()) == []


def test_options_that_repeat_still_repeat(tmp_path, capsys):
    from attnlab.cli import build_parser

    args = build_parser().parse_args(["run", "m.yml", "--set", "a=1", "--set", "b=2", "--target", "x", "--target", "y"])
    assert args.set == ["a=1", "b=2"] and args.target == ["x", "y"]
    assert not hasattr(args, "_attnlab_given")


# ----------------------------------------------------------------------------- M2: a memory state of other weights


MEMORY_MODEL = {"vocab_size": 50, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 256, "init_std": 0.2,
                "attention": {"kind": "mha", "n_kv_heads": 2},
                "memory": {"kind": "bounded", "recent_window": 8, "exact_slots": 4, "summary_slots": 4}}  # fmt: skip


def ingested_state(path, model):
    from attnlab.generate import prefill
    from attnlab.memory import save_state

    cache = model.new_cache(1)
    prefill(model, torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(0)), cache, 16)
    return save_state(path, model, cache, model_path="somewhere/run")


def test_a_memory_state_made_with_other_weights_of_the_same_config_is_refused(tmp_path):
    """M2: a model retrained with the same config (same config hash) must not read the old model's memory."""
    from attnlab.memory import MemoryStateError, load_state

    model = tiny_model(**MEMORY_MODEL)
    header = ingested_state(tmp_path / "s.safetensors", model)
    assert len(header["weights_sha256"]) == 64
    load_state(tmp_path / "s.safetensors", model)  # the same weights: read
    retrained = tiny_model(**MEMORY_MODEL, seed=1)
    assert retrained.cfg.config_hash() == model.cfg.config_hash()
    with pytest.raises(MemoryStateError, match="made with other weights of this model config") as caught:
        load_state(tmp_path / "s.safetensors", retrained)
    assert "somewhere/run" in str(caught.value) and "--replace" in str(caught.value)


def test_a_memory_state_written_before_weights_were_recorded_loads_with_a_warning(tmp_path):
    from safetensors.torch import save as save_tensors

    from attnlab.errors import AttnlabWarning
    from attnlab.memory import load_state, read_state
    from attnlab.memory.state import HEADER_KEY, _checksum

    model = tiny_model(**MEMORY_MODEL)
    ingested_state(tmp_path / "s.safetensors", model)
    header, tensors = read_state(tmp_path / "s.safetensors")
    del header["weights_sha256"]  # as an earlier attnlab wrote it
    header["sha256"] = _checksum(header, tensors)
    (tmp_path / "old.safetensors").write_bytes(save_tensors(tensors, metadata={HEADER_KEY: json.dumps(header)}))
    with pytest.warns(AttnlabWarning, match="before memory states recorded their model's weights"):
        cache, _ = load_state(tmp_path / "old.safetensors", tiny_model(**MEMORY_MODEL, seed=1))
    assert cache.seen == 40


# ----------------------------------------------------------------------------- G1, CV-tiny: characters unknown


def test_generate_says_which_prompt_characters_a_char_vocabulary_lacks(plain_run, capsys):
    """G1: 'é' and '😀' are not in the run's character vocabulary: read as <unk>, and said."""
    from attnlab.cli import main

    assert main(["generate", str(plain_run), "a cat é😀é", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlab generate: warning: the prompt holds 3 characters"), err
    assert "char vocabulary, read as <unk>: 'é', '😀'" in err[0]


def test_generate_with_a_prompt_the_vocabulary_spells_warns_nothing(plain_run, capsys):
    from attnlab.cli import main

    assert main(["generate", str(plain_run), "a cat", "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().err == ""


def test_a_memory_query_says_which_prompt_characters_the_vocabulary_lacks(memory_run, tmp_path, capsys):
    from attnlab.cli import main

    doc, store = tmp_path / "doc.txt", tmp_path / "store"
    doc.write_text("a cat sat on the mat Ü")
    assert main(["memory", "ingest", str(memory_run), str(doc), "--name", "n", "--store", str(store)]) == 0
    err = capsys.readouterr().err
    assert "doc.txt holds 1 character outside the model's char vocabulary, read as <unk>: 'Ü'" in err
    assert main(["memory", "query", "n", "a ß", "--store", str(store), "--max-new-tokens", "2"]) == 0
    assert "warning: the prompt holds 1 character" in capsys.readouterr().err


def test_convert_says_how_many_held_out_tokens_are_unk(plain_run, tmp_path, capsys, data_dir):
    """CV-tiny: WikiText read through a character vocabulary of a few letters is mostly <unk>: said, with the share."""
    from attnlab.cli import main

    argv = ["convert", str(plain_run), "--attention", "kind=mha,n_kv_heads=1", "--out", str(tmp_path / "cv"),
            "--eval-tokens", "64", "--seq-len", "16", "--data-dir", str(data_dir)]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "of the 65 tokens of wikitext2-raw test scored" in err[0] and "are <unk>" in err[0], err


# ----------------------------------------------------------------------------- KE14, KT6: residual windows


def test_kv_eval_says_a_residual_window_past_seq_len_quantizes_nothing(plain_run, capsys):
    """KE14: resid=100 >= seq_len 16: the row is the full cache's (dNLL 0), which must not read as q8_0's cost."""
    from attnlab.cli import main

    argv = ["kv-eval", str(plain_run), "--policies", "k=q8_0,resid=100", "k=q8_0", "--split", "val", "--seq-len",
            "16", "--tokens", "32"]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlab kv-eval: warning: kv policy k=q8_0,resid=100: resid >="), err
    assert "nothing is quantized" in err[0] and "give a resid below 16" in err[0]


def test_kv_tune_with_residual_windows_past_seq_len_says_so(plain_run, capsys):
    """KT6: the smallest policy is the one at the --resids given (full precision), not one at resid 0."""
    argv = ["kv-tune", str(plain_run), "--budget", "10", "--resids", "100000", "--split", "val", "--seq-len", "16",
            "--tokens", "32"]  # fmt: skip
    line = fails(capsys, argv, "no policy fits --budget 10", "resid=100000", "--resids 100000 >= seq_len 16",
                 "full precision", "give --resids below 16")  # fmt: skip
    assert "raise the budget" not in line


def test_kv_tune_under_a_budget_too_small_for_any_policy_says_the_smallest_tried(plain_run, capsys):
    from attnlab.accounting import kv_report
    from attnlab.eval import load_for_eval

    cfg = load_for_eval(plain_run).cfg
    smallest = kv_report(cfg, "fp16", 16, "k=q4_0,v=q4_0,resid=4")["kv_bytes"] / 16
    argv = ["kv-tune", str(plain_run), "--budget", "1", "--resids", "8,4", "--formats", "fp16,q4_0", "--split",
            "val", "--seq-len", "16", "--tokens", "32"]  # fmt: skip
    assert fails(capsys, argv, "no policy fits --budget 1", "resid=4", f"takes {smallest:,.1f}", "raise the budget")


# ----------------------------------------------------------------------------- GG-kveval-nodata, KE10: what to score


@pytest.mark.parametrize("command", [["kv-eval", "--policies", "k=q8_0"], ["kv-tune", "--budget", "100"]])
def test_kv_eval_on_a_pretrained_model_without_dataset_names_the_flag(tmp_path, capsys, command):
    """GG-kveval-nodata: before the model is loaded, and with kv-eval's --dataset (not bench's perplexity.dataset)."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)  # not loadable: it must not be loaded
    line = fails(capsys, [command[0], str(gguf), *command[1:]], "m.gguf", "give --dataset", "--dataset wikitext2-raw")
    assert "perplexity.dataset" not in line


def test_kv_eval_on_a_converted_model_without_dataset_names_the_flag(plain_run, tmp_path, capsys):
    from attnlab.cli import main

    converted = tmp_path / "cv"
    argv = ["convert", str(plain_run), "--attention", "kind=mha,n_kv_heads=1", "--out", str(converted)]
    assert main([*argv, "--eval-tokens", "0"]) == 0
    capsys.readouterr()
    line = fails(capsys, ["kv-eval", str(converted), "--policies", "k=q8_0", "--seq-len", "16", "--tokens", "32"],
                 "give --dataset")  # fmt: skip
    assert "perplexity.dataset" not in line


def test_kv_eval_on_a_text_file_without_a_test_split_says_which_split_to_use(tmp_path, capsys):
    """KE10: a local file is split by hash into train and val; kv-eval's default --split test cannot be found."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a cat sat\n\nthe dog ran\n")
    argv = ["kv-eval", str(tmp_path / "no-model"), "--policies", "k=q8_0", "--dataset", str(corpus)]
    assert fails(capsys, argv, "corpus.txt has no 'test' split", "train and val", "give --split val")


def test_held_out_windows_of_a_file_without_a_test_split_say_which_split_to_score(plain_run, tmp_path):
    from attnlab.errors import DataError
    from attnlab.eval import load_for_eval
    from attnlab.eval.kvquant import held_out_windows

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"a cat sat on the mat {i}" for i in range(50)))
    model = load_for_eval(plain_run)
    with pytest.raises(DataError, match="has no 'test' split.*score split 'val'"):
        held_out_windows(model, "test", 9, 64, dataset=str(corpus))
    with pytest.warns(match="are <unk>"):  # the digits are not in the run's vocabulary
        assert held_out_windows(model, "train", 9, 64, dataset=str(corpus)).shape == (7, 9)


def test_convert_scoring_a_text_file_without_a_test_split_is_refused_first(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a cat sat\n")
    argv = ["convert", str(tmp_path / "no-model"), "--attention", "kind=mha,n_kv_heads=1", "--out",
            str(tmp_path / "cv"), "--dataset", str(corpus)]  # fmt: skip
    assert fails(capsys, argv, "corpus.txt has no 'test' split", "--eval-tokens 0")
    assert not (tmp_path / "cv").exists()


# ----------------------------------------------------------------------------- MC-dupchoice, MC-bom, D-mcfile


ARC = {"id": "Q1", "question": "Which?", "choices": {"text": ["phone", "radio", "phone"], "label": ["A", "B", "C"]},
       "answerKey": "A"}  # fmt: skip


def test_an_arc_item_with_a_choice_given_twice_is_refused(tmp_path):
    """MC-dupchoice: the answer and a distractor with the same text tie, and the tie goes to the first."""
    from attnlab.errors import DataError
    from attnlab.eval.multiple_choice import load_arc_easy

    path = tmp_path / "arc.json"
    path.write_text(json.dumps([ARC]))
    with pytest.raises(DataError, match=r"arc.json:1: item 'Q1': field 'choices.text' holds 'phone' twice"):
        load_arc_easy(path)


def test_a_piqa_item_with_both_solutions_the_same_is_refused(tmp_path):
    from attnlab.errors import DataError
    from attnlab.eval.multiple_choice import load_piqa

    path = tmp_path / "piqa.jsonl"
    path.write_text(json.dumps({"query": "Question: how?\n", "choices": ["stir", "stir"], "gold": 0}) + "\n")
    with pytest.raises(DataError, match=r"piqa.jsonl:1: field 'choices' holds 'stir' twice"):
        load_piqa(path)


def test_a_task_file_with_a_byte_order_mark_is_read(tmp_path):
    """MC-bom: some editors save UTF-8 with a BOM; the array after it is the file's."""
    from attnlab.eval.multiple_choice import load_arc_easy, load_piqa

    item = dict(ARC, choices={"text": ["phone", "radio"], "label": ["A", "B"]})
    (tmp_path / "arc.json").write_text(json.dumps([item]), encoding="utf-8-sig")
    assert [i.id for i in load_arc_easy(tmp_path / "arc.json")] == ["Q1"]
    piqa = json.dumps({"query": "Question: how?\n", "choices": ["stir", "shake"], "gold": 1})
    (tmp_path / "piqa.jsonl").write_text(piqa + "\n", encoding="utf-8-sig")
    assert load_piqa(tmp_path / "piqa.jsonl")[0].gold == 1


@pytest.mark.parametrize("task, name, text", [("arc_easy", "deep.json", DEEP), ("piqa", "deep.jsonl", DEEP + "\n")])
def test_a_task_file_nested_too_deeply_is_one_line(tmp_path, task, name, text):
    """D-mcfile: json's decoder runs out of recursion: a DataError naming the file and line, no traceback."""
    from attnlab.errors import DataError
    from attnlab.eval.multiple_choice import load_items

    (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=rf"{name}:1: not valid JSON \(nested too deeply"):
        load_items(task, tmp_path / name)


# ----------------------------------------------------------------------------- D-best, D-hfconfig: the CLI's net


def test_generate_with_a_best_json_nested_too_deeply_names_it(plain_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(plain_run, run)
    (run / "checkpoints" / "best.json").write_text(DEEP)
    assert fails(capsys, ["generate", str(run), "a", "--max-new-tokens", "1"], str(run / "checkpoints" / "best.json"),
                 "nested too deeply")  # fmt: skip


def test_info_on_a_config_json_nested_too_deeply_names_it(tmp_path, capsys):
    (tmp_path / "config.json").write_text(DEEP)
    assert fails(capsys, ["info", str(tmp_path)], str(tmp_path / "config.json"), "nested too deeply")


def test_a_recursion_error_that_is_no_deep_file_keeps_its_traceback():
    from attnlab.cli_errors import too_deep_line

    def forever(n):
        return forever(n + 1)

    try:
        forever(0)
    except RecursionError as e:
        assert too_deep_line(e, "generate") is None


# ----------------------------------------------------------------------------- CVM-mem: converting a memory


def test_a_model_with_a_bounded_memory_converts_to_fewer_kv_heads():
    """CVM-mem: the memory's per-KV-head eta_logit is pooled as the keys and values are, not a shape error."""
    from attnlab.interop.convert import convert_model

    model = tiny_model(**MEMORY_MODEL, perturb=True)
    conversion = convert_model(model.cfg, model, {"kind": "mha", "n_kv_heads": 1})
    for source, block in zip(model.blocks, conversion.model.blocks, strict=True):
        assert block.memory.eta_logit.shape == (1,)
        assert torch.allclose(block.memory.eta_logit, source.memory.eta_logit.mean().reshape(1))
    assert conversion.fresh == [] and any("memory.eta_logit" in note for note in conversion.notes)
    out, _ = conversion.model(torch.randint(0, 50, (1, 12)), use_cache=False)
    assert torch.isfinite(out).all()


def test_a_parameter_outside_the_attention_that_cannot_follow_is_one_line():
    from attnlab.errors import ConfigError
    from attnlab.interop.convert import outside_attention

    cfg = tiny_model(**MEMORY_MODEL).cfg
    with pytest.raises(ConfigError, match=r"blocks.0.norm.weight has shape \(32,\) in the source and \(16,\)"):
        outside_attention("blocks.0.norm.weight", torch.ones(32), torch.ones(16), cfg, cfg)


# ----------------------------------------------------------------------------- PS-mnthuge


def test_a_probe_whose_max_new_tokens_fills_the_context_names_max_new_tokens(plain_run, tmp_path, capsys):
    """PS-mnthuge: max_new_tokens 100000 on a 64-token model would cut a 2-token prompt to 1 and blame the prompt."""
    suite = tmp_path / "suite.yml"
    suite.write_text("name: s\ndescription: d\ncases:\n  - {id: big, category: c, kind: contains, prompt: 'a c', "
                     "expected: 'a', max_new_tokens: 100000}\n")  # fmt: skip
    argv = ["probes", str(suite), str(plain_run), "--out", str(tmp_path / "out")]
    assert fails(capsys, argv, "suite.yml: case big: max_new_tokens=100,000", "max_seq_len 64",
                 "give max_new_tokens 61 or less")  # fmt: skip
    assert not (tmp_path / "out" / "probes.jsonl").exists()


# ----------------------------------------------------------------------------- IN-json, V-9010: info and validate


def test_info_reads_a_json_model_config_as_validate_does(tmp_path, capsys):
    """IN-json: `validate m.json` accepts it; `info m.json` said 'not a GGUF file'."""
    from attnlab.cli import main

    config = tmp_path / "m.json"
    config.write_text(json.dumps({"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 32}))
    assert main(["validate", str(config)]) == 0
    assert main(["info", str(config)]) == 0
    assert "m.json: mha attention, 1 layers, d_model 32" in capsys.readouterr().out


def test_info_on_a_json_file_that_is_no_model_config_says_what_info_takes(plain_run, capsys):
    best = plain_run / "checkpoints" / "best.json"
    line = fails(capsys, ["info", str(best)], "best.json: not a model config", "give its folder")
    assert "unknown key" not in line


def test_validate_and_info_on_a_symlink_loop_say_so(tmp_path, capsys):
    """V-9010: the file is there (ls shows it), it cannot be reached: not 'file not found'."""
    from attnlab.cli import main

    os.symlink(tmp_path / "b.yaml", tmp_path / "a.yaml")
    os.symlink(tmp_path / "a.yaml", tmp_path / "b.yaml")
    assert main(["validate", str(tmp_path / "a.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a.yaml: a symbolic link loop" in err[0] and "not found" not in err[0], err
    assert fails(capsys, ["info", str(tmp_path / "a.yaml")], "a.yaml: a symbolic link loop")


# ----------------------------------------------------------------------------- LE-fewshot


def test_lm_eval_with_more_few_shot_examples_than_the_task_holds_is_one_line(tmp_path, data_dir):
    """LE-fewshot: lm-eval's random.sample ValueError from deep inside became a 42-line traceback."""
    pytest.importorskip("lm_eval")
    from pathlib import Path

    from attnlab.data.tokenizers import ByteTokenizer
    from attnlab.errors import ConfigError
    from attnlab.eval import EvalModel
    from attnlab.eval.lmeval import run_lm_eval

    tasks = Path(__file__).resolve().parents[1] / "configs" / "lm_eval"
    model = tiny_model(vocab_size=257, max_seq_len=32)
    byte_model = EvalModel("tiny-bytes", tmp_path, model.cfg, model, ByteTokenizer(), {})
    with warnings.catch_warnings(), pytest.raises(ConfigError, match=r"num_fewshot=100,000 \(--num-fewshot\)") as e:
        warnings.simplefilter("ignore")
        run_lm_eval(byte_model, ["arc_easy_local"], include_path=tasks, limit=1, num_fewshot=100_000,
                    data_dir=data_dir)  # fmt: skip
    assert "'arc_easy_local'" in str(e.value) and "give fewer" in str(e.value)
