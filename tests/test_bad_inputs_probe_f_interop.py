"""Probe H's findings in model references (attnlab.interop, attnlab.data.pretrained): export --overwrite deleting a
folder that holds no export, GGUF tokenizers that do not fit their model (bad merges, a token list shorter or longer
than the embedding), a GGUF without its context length, NaN and integer weights, damaged safetensors indexes, a
folder with two sets of weights, a chat template that is not UTF-8, FIFOs and unreadable files, and hf:ORG/NAME@REV
with a copy of the model in the data directory. Every fixture is tiny and made here (no test loads a real model)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import at_most, fails
from safetensors.torch import load_file, save_file

import attnlab
from attnlab.cli import main
from attnlab.errors import AttnlabWarning, DataError, InputError
from attnlab.interop.export import export_hf, replace_folder
from attnlab.interop.references import model_config_of
from attnlab.interop.tokenizer import tokenizer_from_gguf

gguf = pytest.importorskip("gguf")
from gguf_files import TOKENS, small_model, write_gguf  # noqa: E402  (needs gguf)

pytestmark = pytest.mark.usefixtures("one_thread")

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "ok.gguf")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, good_gguf):
    """A Hugging Face folder (config.json, model.safetensors, tokenizer files) exported from the good GGUF."""
    return export_hf(good_gguf, tmp_path_factory.mktemp("hf") / "hf").folder


@pytest.fixture
def hf_copy(exported, tmp_path):
    return shutil.copytree(exported, tmp_path / "model")


def generate(ref, *extra) -> list[str]:
    return ["generate", str(ref), "ab", "--max-new-tokens", "1", *extra]


def snapshot(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- EX-hf-datadir, EX-hf-nonempty-overwrite


def test_export_overwrite_never_deletes_a_folder_that_holds_no_export(tmp_path, capsys, good_gguf):
    """--overwrite replaced any non-empty folder (a data directory was deleted so): only an earlier export is."""
    data = tmp_path / "data"
    (data / "wikitext-2").mkdir(parents=True)
    (data / "wikitext-2" / "wiki.test.raw").write_text("years of work")
    (data / "notes.txt").write_text("keep")
    (data / "config.json").write_text("{}")  # a name an export writes does not make the folder an export
    before = snapshot(data)
    line = fails(capsys, ["export", str(good_gguf), "--hf", str(data), "--overwrite"], "data: holds notes.txt",
                 "wikitext-2/", "an export does not write", "nothing else is deleted")  # fmt: skip
    assert "config.json" not in line
    assert snapshot(data) == before and sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no temporary left

    earlier = tmp_path / "earlier"
    export_hf(good_gguf, earlier)
    (earlier / "model-00001-of-00002.safetensors").write_bytes(b"an older export's shard")
    assert main(["export", str(good_gguf), "--hf", str(earlier), "--overwrite"]) == 0
    assert not (earlier / "model-00001-of-00002.safetensors").exists() and (earlier / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "earlier"]


def test_a_file_put_in_the_export_folder_while_exporting_is_kept(tmp_path, exported):
    """replace_folder looks again after moving the old folder aside: a file written there meanwhile is never lost."""
    out = shutil.copytree(exported, tmp_path / "out")
    (out / "notes.txt").write_text("written while the weights loaded")
    new = shutil.copytree(exported, tmp_path / "new")
    before = snapshot(out)
    with pytest.raises(InputError, match="holds notes.txt, which an export does not write"):
        replace_folder(new, out)
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- GG-tok_short, GG-bad_merge


def test_gguf_merges_naming_a_token_not_in_the_list_are_one_line(tmp_path, capsys):
    path = write_gguf(tmp_path / "bad_merge.gguf", merges=["a b", "zzz qqq"])
    assert fails(capsys, generate(path), "bad_merge.gguf", "tokenizer.ggml.merges[1]='zzz qqq'", "'zzz'",
          "not in tokenizer.ggml.tokens")  # fmt: skip
    short = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": TOKENS[:50], "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(DataError, match=r"short.gguf: tokenizer.ggml.merges\[0\]='a b' names the token 'a'"):
        tokenizer_from_gguf(short, source="short.gguf")
    sentencepiece = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a", "b"],
                     "tokenizer.ggml.merges": ["a b"]}  # fmt: skip
    with pytest.raises(DataError, match="names the token 'ab'"):  # the merged token must be in the list too
        tokenizer_from_gguf(sentencepiece, source="sp.gguf")


# ----------------------------------------------------------------------------- GG-tok_short2(b), GG-tok_special-*


@pytest.mark.parametrize(
    "tokens, named",
    [
        (TOKENS[:50], ["holds 50 tokens", "token_embd.weight has 97 rows", "ids 50 .. 96 of the model have no token"]),
        (TOKENS + [f"<|s{i}|>" for i in range(100)], ["holds 197 tokens", "97 rows", "'<|s0|>'", "no embedding"]),
    ],
    ids=["shorter", "longer"],
)
@pytest.mark.parametrize("command", ["generate", "info"])
def test_a_gguf_token_list_that_differs_from_the_embedding_is_refused(tmp_path, capsys, tokens, named, command):
    """Ids the model emits that decode to nothing, or tokenizer ids past the embedding (the prompt was blamed)."""
    path = write_gguf(tmp_path / "tok.gguf", tokens=tokens)
    argv = generate(path) if command == "generate" else ["info", str(path)]
    assert fails(capsys, argv, "tok.gguf", "tokenizer.ggml.tokens", *named)


# ----------------------------------------------------------------------------- HF-tok_addedbig


def test_hf_tokenizer_ids_past_the_vocabulary_are_refused_at_load(tmp_path, capsys, hf_copy, good_gguf):
    config = json.loads((hf_copy / "tokenizer.json").read_text())
    config["added_tokens"].append({"id": 500, "content": "<|big|>", "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": True})  # fmt: skip
    (hf_copy / "tokenizer.json").write_text(json.dumps(config))
    assert fails(capsys, ["generate", str(hf_copy), "a<|big|>", "--max-new-tokens", "1"], "model/tokenizer.json",
          "'<|big|>' has id 97", "97 embedding rows")  # fmt: skip
    # More embedding rows than tokenizer ids is how many Hugging Face models pad their vocabulary: that loads.
    _, _, tokenizer = attnlab.load_model(good_gguf)
    export_hf(small_model(vocab_size=128), tmp_path / "padded", tokenizer=tokenizer)
    cfg, _, loaded = attnlab.load_model(tmp_path / "padded")
    assert (cfg.vocab_size, loaded.vocab_size) == (128, 97)


# ----------------------------------------------------------------------------- GG-no_ctx


def test_a_gguf_without_a_context_length_is_refused(tmp_path, capsys):
    path = write_gguf(tmp_path / "no_ctx.gguf", context=False)
    assert fails(capsys, ["info", str(path)], "no_ctx.gguf", "metadata llama.context_length is missing")
    assert fails(capsys, generate(path), "llama.context_length is missing")


# ----------------------------------------------------------------------------- GG-nan_weights, HF-st_nan, RET-nan-model


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("weights", ["fp32", "native"])
def test_non_finite_gguf_weights_are_refused_naming_the_tensor(tmp_path, capsys, value, weights):
    """In a Q8_0 matrix (native keeps its blocks: their scales are checked) and in the library call alike."""
    path = write_gguf(tmp_path / "bad.gguf", poison=("attn_q", value), quant=Q.Q8_0)
    assert fails(capsys, generate(path, "--weights", weights), "bad.gguf", "blk.0.attn_q.weight", "NaN or infinite")
    with pytest.raises(DataError, match="bad.gguf.*blk.0.attn_q.weight.*NaN or infinite"):
        attnlab.load_model(path, weights=weights)


def test_non_finite_safetensors_weights_are_refused(capsys, hf_copy):
    tensors = load_file(hf_copy / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"][3, 5] = float("nan")
    save_file(tensors, hf_copy / "model.safetensors")
    assert fails(capsys, generate(hf_copy), "model/model.safetensors", "'model.layers.0.self_attn.q_proj.weight'",
          "holds 1 NaN or infinite values")  # fmt: skip


def test_a_conversion_of_non_finite_weights_is_refused_and_writes_nothing(tmp_path, capsys):
    path = write_gguf(tmp_path / "nan.gguf", poison=("ffn_down", float("nan")))
    out = tmp_path / "converted"
    argv = ["convert", str(path), "--attention", "kind=mha,n_kv_heads=1", "--out", str(out), "--eval-tokens", "0"]
    assert fails(capsys, argv, "nan.gguf", "blk.0.ffn_down.weight", "NaN or infinite")
    assert not out.exists()


# ----------------------------------------------------------------------------- HF-st_int8


def test_integer_weight_tensors_are_refused(capsys, hf_copy):
    tensors = load_file(hf_copy / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = (tensors["model.layers.0.mlp.up_proj.weight"] * 100).to(torch.int8)
    save_file(tensors, hf_copy / "model.safetensors")
    assert fails(capsys, generate(hf_copy), "'model.layers.0.mlp.up_proj.weight' is int8, not floating point",
          "quantized checkpoint")  # fmt: skip


# ----------------------------------------------------------------------------- HF-idx_nonstr, HF-idx_both


def shard(folder, keep_single: bool = False, scale: float = 1.0) -> dict:
    """The folder's model.safetensors split into two shards (weights times `scale`) with their index."""
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}  # fmt: skip
    for file, part in halves.items():
        save_file({name: tensors[name] * scale for name in part}, folder / file)
    index = {"metadata": {}, "weight_map": {name: file for file, part in halves.items() for name in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    if not keep_single:
        (folder / "model.safetensors").unlink()
    return index


def test_an_index_naming_a_shard_by_a_non_string_is_one_line(capsys, hf_copy):
    index = shard(hf_copy)
    index["weight_map"]["model.norm.weight"] = 7
    (hf_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    assert fails(capsys, generate(hf_copy), "model.safetensors.index.json", "weight_map['model.norm.weight']=7",
          "must be the name of a shard file")  # fmt: skip
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    (hf_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    assert fails(capsys, generate(hf_copy), "weight_map['model.norm.weight']=\"../elsewhere.safetensors\"")


def test_a_folder_with_model_safetensors_and_shards_reads_model_safetensors_as_transformers_does(hf_copy):
    """transformers' from_pretrained takes model.safetensors first (modeling_utils: SAFE_WEIGHTS_NAME before
    SAFE_WEIGHTS_INDEX_NAME); attnlab loaded the shards, another model from the same folder, without a word."""
    single = load_file(hf_copy / "model.safetensors")
    shard(hf_copy, keep_single=True, scale=2.0)
    with pytest.warns(AttnlabWarning, match="model.safetensors is read \\(as transformers does\\) and the shards are"):
        _, model, _ = attnlab.load_model(hf_copy)
    assert torch.equal(model.norm.weight, single["model.norm.weight"])
    index = {"metadata": {}, "weight_map": dict.fromkeys(single, "model.safetensors")}  # an index of the one file
    (hf_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttnlabWarning)
        attnlab.load_model(hf_copy)


# ----------------------------------------------------------------------------- HF-tmpl_jinja_bad


def test_a_chat_template_file_that_is_not_utf8_is_one_line(capsys, hf_copy):
    settings = json.loads((hf_copy / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (hf_copy / "tokenizer_config.json").write_text(json.dumps(settings))
    (hf_copy / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    assert fails(capsys, generate(hf_copy, "--chat"), "model/chat_template.jinja", "not UTF-8 text")


# ----------------------------------------------------------------------------- FIFO-*, RET-fifo-model, PERM-hf-*


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors", "tokenizer_config.json"])
def test_a_fifo_in_a_model_folder_is_named_not_read(capsys, hf_copy, name):
    (hf_copy / name).unlink()
    os.mkfifo(hf_copy / name)
    with at_most(20):
        assert fails(capsys, generate(hf_copy), f"model/{name}: is a FIFO (named pipe), where a file is expected")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_given_as_a_model_is_not_called_missing(tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo.gguf")
    with at_most(20):
        assert fails(capsys, ["info", str(tmp_path / "fifo.gguf")], "fifo.gguf: is a FIFO (named pipe)")
        with pytest.raises(DataError, match="is a FIFO") as error:  # validate's and the retrofit's path
            model_config_of(tmp_path / "fifo.gguf")
    assert "no such file" not in str(error.value)


def unreadable_command(argv: list[str]) -> list[str] | None:
    """argv for a subprocess in which file permissions hold: as is for a user, under setpriv without the capability
    to override them for root; None when neither is possible."""
    if os.geteuid() != 0:
        return argv
    if shutil.which("setpriv") is None:
        return None
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *argv]


@pytest.mark.parametrize("name", ["tokenizer.json", "model.safetensors", "config.json", "tokenizer_config.json"])
def test_an_unreadable_file_is_a_permission_error_naming_it(hf_copy, name):
    (hf_copy / name).chmod(0)
    command = unreadable_command([sys.executable, "-m", "attnlab.cli", *generate(hf_copy)])
    if command is None:
        pytest.skip("running as root without setpriv: permissions cannot hold")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [f"attnlab generate: error: {hf_copy / name}: permission denied (check its permissions, or give "
                     "another path)"]  # fmt: skip


# ----------------------------------------------------------------------------- HUB-rev-local, HUB-rev-slash


@pytest.mark.parametrize("revision", ["main", "refs/pr/1"])
def test_a_revision_of_a_model_copied_into_the_data_directory_says_to_drop_it(
    tmp_path, capsys, monkeypatch, exported, revision
):
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty Hugging Face cache
    monkeypatch.delenv("ATTNLAB_DATA", raising=False)
    copy = shutil.copytree(exported, tmp_path / "data" / "models" / "org" / "good")
    line = fails(capsys, ["info", f"hf:org/good@{revision}", "--data-dir", str(tmp_path / "data")],
                 f"{copy} holds a copy", f"drop @{revision} to use it (hf:org/good)")  # fmt: skip
    assert "put the model folder in" not in line
    assert main(["info", "hf:org/good", "--data-dir", str(tmp_path / "data")]) == 0
    capsys.readouterr()
