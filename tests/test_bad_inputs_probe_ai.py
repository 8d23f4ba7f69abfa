"""Probe AI's findings (/work/probe_ai/REPORT.md): a document given again through a hard link was read twice (AI1,
silent-wrong); a batch of no prompts ended generate in torch's RuntimeError (AI2, traceback); and unclear lines:
validate passed a benchmark of a split the checkpoint's data lacks, which bench refused after its first benchmark
(AI3); a GGUF with head_count_kv 0 was called a damaged tensor table (AI4), one without an end-of-sequence id was
named `gguf:NAME` with no fix (AI5), one without general.architecture said "None is not supported" (AI6); export
of a converted bottleneck named an internal RoPE type (AI8); kv-eval's --split named a Python tuple (AI9); mc called
a text file given as the task a model (AI10); kv-tune offered the full-precision cache under three residual windows
and chose the one its warning had left out (AI11); a prompt starting with '-' got argparse's --help line (AI12); a
quoted number was read as the number in a float field and refused as "got str" in an int field (AI7). Each test
fails with its fix backed out."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fails, hat_text, probe_manifest

import attnlab
import attnlab.memory
from attnlab.cli import main
from attnlab.errors import InputError
from attnlab.memory import MemoryStore

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


@pytest.fixture(scope="module")
def plain_run(tiny_run) -> Path:
    return tiny_run


def test_ai1_ingest_refuses_a_document_given_again_through_a_hard_link(streaming_run, tmp_path):
    doc, hard = tmp_path / "doc1.txt", tmp_path / "doc1hard.txt"
    doc.write_text("the cat sat on the mat " * 4)
    os.link(doc, hard)
    store = MemoryStore(tmp_path / "store")
    said = f"documents: {os.path.realpath(doc)} is given twice (as {str(doc)!r}, {str(hard)!r})"
    assert refused_by(lambda: attnlab.memory.ingest(store, streaming_run, [doc, hard], "dup"), said)
    copy = tmp_path / "copy.txt"  # the same bytes in another file: two documents, as given
    copy.write_bytes(doc.read_bytes())
    entry = attnlab.memory.ingest(store, streaming_run, [doc, copy], "two")
    assert len(entry.documents) == 2


def refused_by(call, said: str) -> bool:
    with pytest.raises(InputError) as caught:
        call()
    assert said in str(caught.value), str(caught.value)
    return True


def test_ai2_generate_refuses_a_batch_of_no_prompts():
    model = attnlab.build_model(attnlab.ModelConfig(vocab_size=40, d_model=32, n_layers=1, n_heads=2, max_seq_len=32))
    said = "prompt has shape (0, 3), a batch of no prompts: give at least one"
    assert refused_by(lambda: attnlab.generate(model.eval(), torch.empty(0, 3, dtype=torch.long)), said)


def test_ai3_validate_and_bench_refuse_a_split_the_checkpoints_data_lacks_before_any_benchmark(plain_run, tmp_path,
                                                                                                capsys):  # fmt: skip
    manifest = tmp_path / "two.yml"
    manifest.write_text(f"name: two\ncheckpoints: [{plain_run}]\nbenchmarks:\n  memory: {{lengths: [16]}}\n"
                        "  perplexity: {}\n")  # fmt: skip
    said = "benchmarks.perplexity.split='test': tiny/seed0's data ("
    fix = "score one it has (benchmarks.perplexity.split='val')"
    assert main(["validate", str(manifest)]) == 2
    err = capsys.readouterr().err
    assert said in err and fix in err and len(err.splitlines()) == 1, err
    assert fails(capsys, ["bench", str(manifest), "--out", str(tmp_path / "out")], said, fix)
    assert not (tmp_path / "out").exists()  # refused before the first benchmark wrote its record
    manifest.write_text(manifest.read_text().replace("perplexity: {}", "perplexity: {split: val}"))
    assert main(["validate", str(manifest)]) == 0


def tiny_gguf(path: Path, kv_heads: int = 2, eos: bool = True, arch: str | None = "llama") -> Path:
    """A llama GGUF of one block (width 8, 2 heads of 4) with a 4-token SentencePiece vocabulary without an
    end-of-text token: eos names its end-of-sequence id, or none."""
    writer = gguf.GGUFWriter(str(path), arch or "llama")
    if arch is None:  # (the writer always adds it: a file without the key is written by hand below)
        writer.close()
        path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16))
        return path
    writer.add_block_count(1)
    writer.add_context_length(32)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([b"<unk>", b"<s>", b"</s>", b"a"])
    writer.add_token_scores([0.0] * 4)
    writer.add_token_types([1] * 4)
    if eos:
        writer.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd": (4, 8),
        "output_norm": (8,),
        "blk.0.attn_norm": (8,),
        "blk.0.attn_q": (8, 8),
        "blk.0.attn_k": (kv_heads * 4, 8),
        "blk.0.attn_v": (kv_heads * 4, 8),
        "blk.0.attn_output": (8, 8),
        "blk.0.ffn_norm": (8,),
        "blk.0.ffn_gate": (16, 8),
        "blk.0.ffn_up": (16, 8),
        "blk.0.ffn_down": (8, 16),
    }
    for name, shape in shapes.items():  # fmt: skip
        writer.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_ai4_a_gguf_with_no_kv_heads_names_the_key_not_a_damaged_table(tmp_path, capsys):
    path = tiny_gguf(tmp_path / "kv0.gguf", kv_heads=0)
    line = fails(capsys, ["info", str(path)], f"{path}: metadata llama.attention.head_count_kv=0 must be a whole "
                 "number >= 1")  # fmt: skip
    assert "overlap" not in line and "download" not in line
    assert main(["info", str(tiny_gguf(tmp_path / "kv2.gguf"))]) == 0  # (the same file with 2 KV heads reads)


def test_ai5_a_gguf_without_an_end_of_sequence_id_is_named_as_given_with_the_key_to_set(tmp_path, capsys,
                                                                                        monkeypatch):  # fmt: skip
    tiny_gguf(tmp_path / "good.gguf", eos=False)
    monkeypatch.chdir(tmp_path)
    line = fails(capsys, ["generate", "good.gguf", "a", "--max-new-tokens", "2"], "good.gguf: the tokenizer has no "
                 "end-of-sequence token", "gguf-set-metadata good.gguf tokenizer.ggml.eos_token_id ID")  # fmt: skip
    assert "gguf:good.gguf" not in line and "needed between documents" not in line
    tiny_gguf(tmp_path / "good.gguf", eos=True)
    assert main(["generate", "good.gguf", "a", "--max-new-tokens", "2"]) == 0


def test_ai6_a_gguf_without_an_architecture_says_the_key_is_missing(tmp_path, capsys):
    path = tiny_gguf(tmp_path / "zero.gguf", arch=None)
    line = fails(capsys, ["info", str(path)], f"{path}: metadata general.architecture is missing (supported: llama")
    assert "None" not in line


def test_ai8_export_of_a_converted_bottleneck_says_where_its_rope_comes_from(plain_run, tmp_path, capsys):
    converted = tmp_path / "bn"
    assert main(["convert", str(plain_run), "--attention", "kind=bottleneck,d_attn=16", "--calibration-tokens", "0",
                 "--eval-tokens", "0", "--out", str(converted)]) == 0  # fmt: skip
    capsys.readouterr()
    assert fails(capsys, ["export", str(converted), "--hf", str(tmp_path / "hf")], "rope_scaling.type='freq_factors' "
                 "(a bottleneck or decoupled conversion keeps the source's RoPE on the pairs it chose",
                 "such a model runs in attnlab only")  # fmt: skip


@pytest.mark.parametrize("command", ["kv-eval", "kv-tune"])
def test_ai9_kv_split_is_said_as_the_flag_and_takes_the_benchmarks_aliases(plain_run, capsys, command):
    argv = [command, str(plain_run), "--tokens", "40", "--seq-len", "16", "--split"]
    extra = ["--policies", "k=q8_0,v=q8_0"] if command == "kv-eval" else ["--budget", "1000"]
    assert fails(capsys, [*argv, "dev", *extra], "--split 'dev' is not a split: give train, val or test (valid and "
                 "validation mean val)")  # fmt: skip
    assert main([*argv, "validation", *extra]) == 0
    assert ":val)" in capsys.readouterr().out if command == "kv-eval" else True


def test_ai10_mc_says_a_file_given_as_the_task_is_no_task_not_the_wrong_order(plain_run, tmp_path, capsys):
    notes = tmp_path / "doc1.txt"
    notes.write_text("not a task\n")
    line = fails(capsys, ["mc", str(notes), str(plain_run)], f"{notes} is not a task: name one (arc_easy",
                 f"--file {notes}")  # fmt: skip
    assert "the order is" not in line
    assert fails(capsys, ["mc", str(plain_run), str(plain_run)], "is a model, not a task", "the order is")


def test_ai11_kv_tune_keeps_one_full_precision_candidate_without_a_residual_window():
    from attnlab.eval.kvquant import tune

    model = attnlab.build_model(attnlab.ModelConfig(vocab_size=40, d_model=32, n_layers=1, n_heads=2, max_seq_len=64))
    windows = torch.randint(0, 40, (2, 17), generator=torch.Generator().manual_seed(0))
    result = tune(
        model.eval(),
        windows,
        1e9,
        None,
        formats=("fp16", "q8_0"),
        resids=(0, 8, 128),
        chunk=1,
        dtype="fp16",
        verify=20,
        log=lambda *_: None,
    )  # fmt: skip (every candidate verified)
    policies = [row["policy"] for row in result["verified"]]
    assert [p for p in policies if "q8_0" not in p] == ["k=fp16,v=fp16"], policies  # not also resid=8, resid=128
    assert len(policies) == 7  # 3 quantized pairs x resid 0 and 8 (128 holds a whole window: left out), fp16 once


def usage_error(capsys, argv) -> str:
    """The one stderr line of `attnlab argv` refused by argparse (which exits by SystemExit, code 2)."""
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab generate: error: "), lines
    return lines[0]


def test_ai12_a_prompt_starting_with_a_dash_is_said_to_go_after_double_dash(plain_run, capsys):
    line = usage_error(capsys, ["generate", str(plain_run), "-hello", "--max-new-tokens", "2"])
    assert (
        "to give '-hello' as the prompt, put -- before it and every option before the -- (attnlab generate ... "
        "-- -hello: what follows -- is read as the prompt)"
    ) in line  # (AM4: options after it are the prompt's)
    line = usage_error(capsys, ["generate", str(plain_run), "hi", "--bogus"])
    assert "unrecognized arguments: --bogus" in line and "as the prompt" not in line  # a mistyped option
    assert main(["generate", str(plain_run), "--max-new-tokens", "2", "--", "-hello"]) == 0
    assert capsys.readouterr().out.startswith("-hello")


@pytest.mark.parametrize(("train", "said"), [
    ('{seq_len: 16, steps: 2, lr: "0.003"}', "train.lr='0.003' is quoted, so text, not a number: write 0.003 without"),
    ("{seq_len: 16, steps: 2, lr: '3e-3'}", "train.lr='3e-3' is quoted, so text, not a number: write 3e-3 without"),
    ('{seq_len: 16, steps: 2, warmup_steps: "2"}', "train.warmup_steps='2' is quoted, so text, not a number: write "
     "2 without"),
], ids=["a float field", "a float field, exponent form", "an int field"])  # fmt: skip
def test_ai7_a_quoted_number_is_text_in_every_number_field(tmp_path, capsys, train, said):
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), train)
    assert main(["validate", str(manifest)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f"m.yml: targets.base: {said} the quotes"), err
    assert fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "o")], said)


def test_ai7_unquoted_numbers_and_quoted_text_are_read_as_before(tmp_path, capsys):
    """3e-3 unquoted (text to YAML 1.1) is the number; a quoted name is a name, and written back as one."""
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), "{seq_len: 16, steps: 2, lr: 3e-3}",
                              targets='  "base": {description: "a quoted note"}\n')  # fmt: skip
    assert main(["validate", str(manifest)]) == 0, capsys.readouterr().err
    assert fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "o"), "--dry-run", "--set",
                          'train.lr="3e-3"'], "train.lr='3e-3' is quoted")  # fmt: skip
    assert main(["run", str(manifest), "--out", str(tmp_path / "o")]) == 0
    saved = (tmp_path / "o" / "m" / "base" / "seed0" / "config.yaml").read_text()
    assert "lr: 0.003" in saved and "!!python" not in saved, saved
