"""Probe S's lines that named the wrong thing, fixed in session T: a head count that does not divide the embedding
length said to be partial RoPE (t1); a GGUF token list stored as a string blamed on the merges (t2); config.json's
architectures given as a string listed letter by letter (t3); two NaN rope_theta said to disagree (t4); a safetensors
index's weight_map of the wrong type said to be missing (t5); a warm start's d_model change beside an added memory
blamed on the memory (t6); perplexity.seq_len past the context said without its key, after loading the weights (t7);
a damaged summary.json of an interrupted run said to need the whole run folder deleted (t8); convert --out and export
--hf through a dangling link or a link loop said late or as "does not exist" (t9, t10); a full disk while lm-eval
caches its data said to be the data file's fault (t11); lm-eval's progress bar printed before an error's line (t12);
and generate's <unk> warning before the error that ends it (t13). Each is now one line naming the key or file."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from helpers import fails, hat_text, probe_manifest, stop_after_first_checkpoint

from attnlab.cli import main
from attnlab.errors import DataError

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 97, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64,
             "rms_norm_eps": 1e-5}  # fmt: skip


def hf_folder(tmp_path: Path, text: str | None = None, **changes) -> Path:
    """tmp_path/model holding a config.json of HF_CONFIG with `changes` (or `text`, as written): what `info` reads."""
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(text if text is not None else json.dumps({**HF_CONFIG, **changes}))
    return folder


def edit_gguf(path, **values) -> None:
    """Sets the whole-number metadata keys `values` (dots as __) of a GGUF file in place."""
    import gguf

    reader = gguf.GGUFReader(path, "r+")
    for key, value in values.items():
        reader.fields[key.replace("__", ".")].parts[-1][0] = value
    reader.data.flush()
    del reader


# ----------------------------------------------------------------------------- t1: heads that do not divide the width


@pytest.mark.parametrize("rope_dims", [32, None], ids=["rope-dimension-count", "no-rope-key"])
@pytest.mark.parametrize("heads", [3, 5])
def test_a_gguf_head_count_that_does_not_divide_the_embedding_length_is_named(tmp_path, capsys, heads, rope_dims):
    """t1: with llama.rope.dimension_count (as real files have) 3 heads of a 64-wide model were "partial RoPE is not
    supported"; without it, "head_dim=21 must be even" or a tensor shape said damaged."""
    pytest.importorskip("gguf")
    from gguf_files import write_gguf

    extra = (lambda writer: writer.add_rope_dimension_count(rope_dims)) if rope_dims else None
    path = write_gguf(tmp_path / "m.gguf", extra=extra)
    edit_gguf(path, llama__attention__head_count=heads, llama__attention__head_count_kv=heads)
    line = fails(capsys, ["info", str(path)], f"{path}: metadata llama.attention.head_count={heads} does not divide "
                 "llama.embedding_length=64 (without llama.attention.key_length a head is embedding_length / "
                 "head_count wide; head counts that fit: 1, 2, 4, 8, 16 or 32)",
                 "download or convert it again")  # fmt: skip
    assert "partial RoPE" not in line and "head_dim" not in line


@pytest.mark.parametrize("heads", [3, 5])
def test_an_hf_head_count_that_does_not_divide_hidden_size_is_named(tmp_path, capsys, heads):
    """t1: 3 heads of a 64-wide model were "head_dim=21 must be even for RoPE"; 5 heads were accepted (heads of 12,
    60 of the 64 channels)."""
    folder = hf_folder(tmp_path, num_attention_heads=heads, num_key_value_heads=heads)
    assert fails(capsys, ["info", str(folder)], f"{folder / 'config.json'}: num_attention_heads={heads} does not "
                 "divide hidden_size=64 (without head_dim a head is hidden_size / num_attention_heads wide; head "
                 "counts that fit: 1, 2, 4, 8, 16 or 32): fix num_attention_heads, or give head_dim")  # fmt: skip


def test_an_hf_head_count_with_its_own_head_dim_is_read(tmp_path, capsys):
    """The config alone (`info` now also checks the weights' headers, which this folder has not)."""
    from attnlab.interop.references import model_config_of

    folder = hf_folder(tmp_path, num_attention_heads=5, num_key_value_heads=5, head_dim=16)
    config = model_config_of(folder)
    assert (config.n_heads, config.attention.head_dim, config.d_model) == (5, 16, HF_CONFIG["hidden_size"])


# ----------------------------------------------------------------------------- t2: a token list that is a string


def test_a_gguf_token_list_stored_as_a_string_is_named(tmp_path, capsys):
    """t2: was "tokenizer.ggml.merges[0]='a b' names the token 'ab', which is not in tokenizer.ggml.tokens"."""
    pytest.importorskip("gguf")
    from gguf_files import TOKENS, write_gguf

    path = write_gguf(tmp_path / "m.gguf", tokens=None,
                      extra=lambda writer: writer.add_string("tokenizer.ggml.tokens", "".join(TOKENS)))  # fmt: skip
    line = fails(capsys, ["generate", str(path), "ab", "--max-new-tokens", "1"],
                 f"{path}: tokenizer.ggml.tokens is a string ('<|endoftext|>!", "not an array of strings (one per "
                 "token): the file is damaged; download or convert it again")  # fmt: skip
    assert "merges" not in line


def test_a_gguf_token_list_of_numbers_is_named(tmp_path):
    pytest.importorskip("gguf")
    from gguf_files import write_gguf

    from attnlab.interop.references import tokenizer_of

    path = write_gguf(tmp_path / "m.gguf", tokens=None,
                      extra=lambda writer: writer.add_array("tokenizer.ggml.tokens", list(range(97))))  # fmt: skip
    said = r"tokenizer\.ggml\.tokens\[0\]=0 is not a string \(the tokens must be an array of strings\): the file"
    with pytest.raises(DataError, match=said):
        tokenizer_of(path)


# ----------------------------------------------------------------------------- t3: architectures as a string


def test_architectures_given_as_a_string_is_named(tmp_path, capsys):
    """t3: was "architecture L, l, a, m, a, F, o, r, C, a, u, s, a, l, L, M is not supported"."""
    folder = hf_folder(tmp_path, architectures="LlamaForCausalLM")
    line = fails(capsys, ["info", str(folder)], f'{folder / "config.json"}: architectures="LlamaForCausalLM" must be '
                 'a list of names: write "architectures": ["LlamaForCausalLM"]')  # fmt: skip
    assert "L, l, a" not in line


def test_architectures_of_other_kinds_are_named(tmp_path, capsys):
    folder = hf_folder(tmp_path, architectures=[5])
    assert fails(capsys, ["info", str(folder)], "architectures=[5] must be a list of names")


# ----------------------------------------------------------------------------- t4: NaN rope_theta


@pytest.mark.parametrize("changes, said", [
    ('"rope_theta": NaN, "rope_parameters": {"rope_type": "default", "rope_theta": NaN}',
     "rope_theta=NaN must be a finite number > 0 (the RoPE base, e.g. 10000.0); rope_parameters.rope_theta=NaN must "
     "be a finite number > 0 (the RoPE base, e.g. 10000.0)"),
    ('"rope_theta": 10000, "rope_parameters": {"rope_theta": NaN}', "rope_parameters.rope_theta=NaN must be a finite "
     "number > 0"),
    ('"rope_theta": NaN', "rope_theta=NaN must be a finite number > 0"),
    ('"rope_theta": -Infinity', "rope_theta=-Infinity must be a finite number > 0"),
    ('"rope_theta": 0', "rope_theta=0 must be a finite number > 0"),
])  # fmt: skip
def test_a_rope_theta_that_is_not_a_finite_positive_number_is_named(tmp_path, capsys, changes, said):
    """t4: two NaN were "rope_theta=nan and rope_parameters.rope_theta=nan disagree"; one NaN "rope_base=nan must be
    a finite number" (attnlab's name, not config.json's)."""
    folder = hf_folder(tmp_path, json.dumps(HF_CONFIG)[:-1] + ", " + changes + "}")
    line = fails(capsys, ["info", str(folder)], *(f"{folder / 'config.json'}: {part}" for part in said.split("; ")))
    assert "disagree" not in line and "rope_base" not in line


# ----------------------------------------------------------------------------- t5: weight_map of the wrong type


@pytest.mark.parametrize("weight_map, said", [
    ([], "weight_map=[] must be a JSON object of tensor name -> shard file (such as {\"model.norm.weight\": "
         "\"model-00001-of-00002.safetensors\"}); the index is damaged"),
    ("x", 'weight_map="x" must be a JSON object of tensor name -> shard file'),
    ({}, "weight_map={} names no tensor (the index is damaged)"),
])  # fmt: skip
def test_a_weight_map_of_the_wrong_type_is_named(tmp_path, weight_map, said):
    """t5: a list was "no weight_map in it"."""
    from attnlab.interop.hf import load_hf_folder

    folder = hf_folder(tmp_path)
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(DataError) as caught:
        load_hf_folder(folder)
    assert str(caught.value) == f"{index}: {said}" or str(caught.value).startswith(f"{index}: {said}")


def test_an_index_without_a_weight_map_is_still_said_so(tmp_path):
    from attnlab.interop.hf import load_hf_folder

    folder = hf_folder(tmp_path)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(DataError, match="no weight_map in it"):
        load_hf_folder(folder)


# ----------------------------------------------------------------------------- t6: d_model beside an added memory


def validate_fails(capsys, path: Path, *fragments) -> str:
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert all(fragment in err for fragment in fragments), err
    return err.strip()


TRAIN = "{seq_len: 16, batch_size: 2, steps: 4, lr: 1.0e-3, warmup_steps: 1, eval_every: 4, eval_tokens: 32, " \
        "log_every: 1, checkpoint_every: 2}"  # fmt: skip
MEMORY = "{kind: streaming, recent_window: 16, sink_tokens: 2}"


def test_a_warm_start_of_another_width_beside_an_added_memory_names_the_width(tmp_path, capsys):
    """t6: was "(memory.kind 'streaming', target a's None)": the memory may be added; the width may not change."""
    targets = f"  a: {{}}\n  b:\n    init_from: a\n    model: {{d_model: 64, memory: {MEMORY}}}\n"
    path = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, targets)
    line = validate_fails(capsys, path, "targets.b: its model cannot start from target a's weights (d_model 64, "
                          "target a's 32)", "only a memory may be added")  # fmt: skip
    assert "memory.kind" not in line


def test_a_memory_alone_of_another_kind_is_still_named(tmp_path, capsys):
    """With the width the same, a trained memory's weights that the new memory lacks are what is named."""
    trained = "{kind: bounded, recent_window: 16, exact_slots: 8, summary_slots: 8}"
    targets = f"  a: {{model: {{memory: {trained}}}}}\n  b:\n    init_from: a\n    model: {{memory: {MEMORY}}}\n"
    path = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, targets)
    line = validate_fails(capsys, path, "targets.b: its model cannot start from target a's weights (memory.kind "
                          "'streaming', target a's 'bounded')")  # fmt: skip
    assert "d_model" not in line


# ----------------------------------------------------------------------------- t7: perplexity.seq_len past the context


@pytest.fixture
def no_loading(monkeypatch):
    from attnlab.eval import harness

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(harness, "load_for_eval", load)


def test_a_perplexity_seq_len_past_a_gguf_models_context_is_named_before_loading(tmp_path, capsys, no_loading):
    """t7: was "benchmarks.perplexity on g: sequence of 100 tokens exceeds max_seq_len=64 (shorten the input or raise
    max_seq_len)", after the weights were loaded and the text tokenized."""
    pytest.importorskip("gguf")
    from gguf_files import write_gguf

    path, text = write_gguf(tmp_path / "g.gguf"), hat_text(tmp_path)
    argv = ["bench", str(path), "--benchmarks", "perplexity", "--out", str(tmp_path / "o"), "--set",
            "perplexity.seq_len=100", "--set", f"perplexity.dataset={text}", "--set",
            "perplexity.split=val"]  # fmt: skip
    line = fails(capsys, argv, "benchmarks.perplexity.seq_len=100: 100 exceeds g's max_seq_len 64 (nothing would "
                 "be measured): give seq_len <= 64")  # fmt: skip
    assert "sequence of" not in line


def test_run_perplexity_names_a_seq_len_past_the_context(tmp_path):
    """The library's own check (bench names the parameter before loading; a caller of run_perplexity gets this)."""
    pytest.importorskip("gguf")
    from gguf_files import write_gguf

    from attnlab.errors import InputError
    from attnlab.eval.loading import load_for_eval
    from attnlab.eval.perplexity import run_perplexity

    model = load_for_eval(write_gguf(tmp_path / "g.gguf"))
    with pytest.raises(InputError, match=r"^seq_len=100 exceeds g's max_seq_len 64 \(a window is read in one pass\): "
                       r"give seq_len <= 64$"):  # fmt: skip
        run_perplexity(model, "val", 100, dataset=str(hat_text(tmp_path)))


def test_a_perplexity_seq_len_within_the_context_is_measured(tmp_path, capsys):
    pytest.importorskip("gguf")
    from gguf_files import write_gguf

    path, text = write_gguf(tmp_path / "g.gguf"), hat_text(tmp_path)
    argv = ["bench", str(path), "--benchmarks", "perplexity", "--out", str(tmp_path / "o"), "--set",
            "perplexity.seq_len=64", "--set", f"perplexity.dataset={text}", "--set", "perplexity.split=val",
            "--set", "perplexity.max_tokens=256"]  # fmt: skip
    assert main(argv) == 0


# ----------------------------------------------------------------------------- t8: a damaged summary.json


def test_a_damaged_summary_of_an_interrupted_run_says_to_delete_it_alone(tmp_path, capsys, monkeypatch):
    """t8: was "summary.json: unreadable (...); delete the run's folder to train it again": the folder holds the
    checkpoint the run resumes from."""

    path, out = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN), tmp_path / "out"
    stop_after_first_checkpoint(monkeypatch, ["run", str(path), "--out", str(out), "--no-progress"])
    folder = out / "m" / "base" / "seed0"
    (folder / "summary.json").write_text("{ damaged")
    capsys.readouterr()
    argv = ["run", str(path), "--out", str(out), "--no-progress"]
    line = fails(capsys, argv, f"{folder / 'summary.json'}: unreadable", "the run was interrupted at step 2 of 4 (its "
                 "last checkpoint): delete summary.json alone and run again to resume it from there")  # fmt: skip
    assert "run's folder" not in line
    (folder / "summary.json").unlink()
    assert main(argv) == 0
    assert json.loads((folder / "summary.json").read_text())["steps"] == 4


def test_a_damaged_summary_of_a_finished_run_says_to_delete_it_alone(tmp_path, capsys):
    path, out = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN), tmp_path / "out"
    argv = ["run", str(path), "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    folder = out / "m" / "base" / "seed0"
    (folder / "summary.json").write_text("[]")
    capsys.readouterr()
    line = fails(capsys, argv, f"{folder / 'summary.json'}: not a JSON object", "its last checkpoint is the last step "
                 "(4 of 4): delete summary.json alone and run again to write it again from there")  # fmt: skip
    assert "run's folder" not in line
    (folder / "summary.json").unlink()
    assert main(argv) == 0
    assert json.loads((folder / "summary.json").read_text())["steps"] == 4


# ----------------------------------------------------------------------------- t9, t10: --out through a broken link


@pytest.fixture
def conversion_source(tiny_run):
    return tiny_run


@pytest.mark.parametrize("link", ["dangling", "loop"])
def test_convert_out_through_a_broken_link_is_refused_before_converting(conversion_source, tmp_path, capsys,
                                                                         monkeypatch, link):  # fmt: skip
    """t9: a dangling link was "could not write X: checksums.json: Not a directory", after the conversion."""
    from attnlab import cli_models

    out = tmp_path / "out"
    out.symlink_to(tmp_path / "nowhere" / "x" if link == "dangling" else out)
    monkeypatch.setattr(cli_models, "load_for_eval", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = ["convert", str(conversion_source), "--attention", "kind=mha,n_kv_heads=1", "--eval-tokens", "0",
            "--out", str(out)]  # fmt: skip
    said = (f"a symbolic link to {tmp_path / 'nowhere' / 'x'}, which is not there" if link == "dangling" else
            "a symbolic link loop (too many levels of symbolic links)")  # fmt: skip
    line = fails(capsys, argv, f"--out {out}: {said}", "remove the link, or give another --out")
    assert "Not a directory" not in line and out.is_symlink()


def test_export_hf_into_a_link_loop_is_named(tiny_run, tmp_path, capsys):
    """t10: was "is a symbolic link to X, which does not exist" of a link to itself."""
    out = tmp_path / "hf"
    out.symlink_to(out)
    line = fails(capsys, ["export", str(tiny_run), "--hf", str(out)], f"{out}: is a symbolic link loop (too many "
                 "levels of symbolic links): remove the link, or give a folder's path")  # fmt: skip
    assert "does not exist" not in line


# ----------------------------------------------------------------------------- t11, t12: lm-eval


ITEMS = [{"q": "the cat", "choices": [" sat", " ran"], "gold": 0}] * 3


def lm_argv(run, tasks, data):
    return ["lm-eval", str(run), "--tasks", "mytask", "--include-path", str(tasks), "--data-dir", str(data),
            "--limit", "3"]  # fmt: skip


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG])
def test_a_full_disk_while_lm_eval_caches_its_data_is_said(tiny_run, tmp_path, capsys, monkeypatch, code):
    """t11: was "the task data could not be loaded (OSError: [Errno 27] File too large): fix the data file"."""
    from helpers import lm_task_folders, lm_task_yaml

    tasks, data = lm_task_folders(tmp_path, monkeypatch, lm_task_yaml(), ITEMS)
    import datasets.arrow_writer

    def full(*args, **kwargs):
        raise OSError(code, "No space left on device" if code == errno.ENOSPC else "File too large")

    monkeypatch.setattr(datasets.arrow_writer.ArrowWriter, "write_table", full)
    monkeypatch.setattr(datasets.arrow_writer.ArrowWriter, "write", full)
    cache = datasets.config.HF_DATASETS_CACHE
    said = ("no space left on its disk (OSError ENOSPC): free space there, or set HF_DATASETS_CACHE to a folder on a "
            "disk with room" if code == errno.ENOSPC else "a file there is past this process's file size limit "
            "(OSError EFBIG, ulimit -f): raise the limit")  # fmt: skip
    line = fails(capsys, lm_argv(tiny_run, tasks, data), f"mytask.yaml: the task data could not be written to the "
                 f"datasets cache {cache}: {said}")  # fmt: skip
    assert "fix the data file" not in line


def test_lm_eval_prints_no_progress_bar_before_an_error(tiny_run, tmp_path, capsys, monkeypatch):
    """t12: "0%| | 0/3" and "100%|##| 3/3" (lm-eval's building of the requests) stood before the error's line."""
    from helpers import lm_task_folders, lm_task_yaml

    long_items = [{"q": "the cat", "choices": [" sat", " ran" * 30], "gold": 0}] * 3
    tasks, data = lm_task_folders(tmp_path, monkeypatch, lm_task_yaml(), long_items)
    line = fails(capsys, lm_argv(tiny_run, tasks, data), "mytask.yaml: item 0: a continuation of",
                 "exceeds max_length=64")  # fmt: skip
    assert "%|" not in line


# ----------------------------------------------------------------------------- t13: a warning before the error


def test_generate_says_only_the_error_when_a_prompt_of_unk_leaves_no_room(tiny_run, capsys):
    """t13: the prompt's <unk> warning stood before the error that ended the command."""
    line = fails(capsys, ["generate", str(tiny_run), "Q" * 80, "--max-new-tokens", "2"],
                 "prompt of 80 tokens leaves no room to generate: max_seq_len=64")  # fmt: skip
    assert "<unk>" not in line


def test_generate_still_warns_of_unk_in_a_prompt_that_fits(tiny_run, capsys):
    assert main(["generate", str(tiny_run), "QQ the cat", "--max-new-tokens", "2"]) == 0
    assert "read as <unk>: 'Q'" in capsys.readouterr().err
