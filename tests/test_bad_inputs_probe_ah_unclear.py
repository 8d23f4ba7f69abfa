"""Probe AH's unclear findings (/work/probe_ah/REPORT.md): `generate` printed its text only once it ended, so a
long generation showed nothing and an interrupt lost all of it (AH1); a run whose config.json was damaged was to be
deleted, though each of its checkpoints keeps that config (AH3). Each test fails with its fix backed out."""

from __future__ import annotations

import io
import shutil

import pytest
import torch
from helpers import dry_run, fails, hat_text, probe_manifest, run_limited
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import attnlab.cli
from attnlab.cli import main
from attnlab.data.stream import TextStream
from attnlab.data.tokenizers import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


class Writes(io.StringIO):
    """A text stream that keeps each write apart."""

    def __init__(self):
        super().__init__()
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return super().write(text)


def streamed(tokenizer, ids: list[int], skip=()) -> Writes:
    out = Writes()
    with TextStream(tokenizer, out=out, skip=skip) as stream:
        for token in ids:
            stream(torch.tensor([[token]]))
    return out


def test_ah1_a_stream_writes_whole_characters_and_adds_up_to_the_decoding():
    tokenizer = ByteTokenizer()
    text = "héllo wörld € 😀 done"
    ids = tokenizer.encode(text) + [tokenizer.eot_id]
    out = streamed(tokenizer, ids, skip=[tokenizer.eot_id])
    assert out.getvalue() == text + "\n"  # the end-of-text token is not text
    assert not any("\ufffd" in part for part in out.parts)  # a character's first bytes wait for the rest
    assert len(out.parts) == len(text) + 1  # each character as soon as it is whole, then the line end


class Pieces:
    """A SentencePiece-like tokenizer (Metaspace: "▁" for a space, dropped at the start of a decoding)."""

    def __init__(self):
        vocab = {"<unk>": 0, "▁once": 1, "▁upon": 2, "▁a": 3, "▁time": 4, "s": 5, "▁": 6}
        self.tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        self.tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        self.tokenizer.decoder = decoders.Metaspace()

    def decode(self, ids):
        return self.tokenizer.decode(ids)


def test_ah1_a_stream_keeps_the_spaces_a_piece_decoded_alone_loses():
    tokenizer, ids = Pieces(), [1, 2, 3, 4, 5, 1, 2, 3, 4]
    whole = tokenizer.decode(ids)
    assert whole == "once upon a times once upon a time"
    assert "".join(tokenizer.decode([i]) for i in ids) != whole  # each piece alone drops its space
    assert streamed(tokenizer, ids).getvalue() == whole + "\n"


def test_ah1_an_interrupted_generation_keeps_the_text_it_made(streaming_run, capsys, monkeypatch):
    argv = ["generate", str(streaming_run), "the cat", "--max-new-tokens"]
    assert main([*argv, "12"]) == 0
    twelve = capsys.readouterr().out
    assert twelve.startswith("the cat") and len(twelve) == len("the cat") + 12 + 1  # char tokens, a line end
    real = attnlab.cli.generate

    def interrupted_after_twelve(*args, callback=None, **kwargs):
        calls = []

        def counted(tokens):
            if callback is not None:
                callback(tokens)
            calls.append(tokens)
            if len(calls) == 12:  # Ctrl-C while a memory model streams a count past any context
                raise KeyboardInterrupt

        return real(*args, callback=counted, **kwargs)

    monkeypatch.setattr(attnlab.cli, "generate", interrupted_after_twelve)
    assert main([*argv, "100000000"]) == 130
    captured = capsys.readouterr()
    assert captured.out == twelve  # what was made before the interrupt, as the 12-token run printed it
    assert "attnlab generate: interrupted" in captured.err


def test_ah3_a_damaged_run_config_is_fixed_by_copying_its_checkpoints(streaming_run, tmp_path, capsys):
    runs = tmp_path / "runs"
    shutil.copytree(streaming_run.parent, runs / "tiny")
    config = runs / "tiny" / "seed0" / "config.json"
    kept = next((runs / "tiny" / "seed0" / "checkpoints").glob("step-*")) / "config.json"
    config.write_text('{"model": ')
    argv = ["compare", str(runs), "--out", str(tmp_path / "out")]
    line = fails(capsys, argv, f"{config}: unreadable", f"copy {kept} over it")
    assert "delete" not in line  # a finished run is not thrown away for a copy of what its checkpoints keep
    shutil.copyfile(kept, config)
    assert main(argv) == 0


def test_ah3_run_says_the_same_of_a_finished_runs_damaged_config(tmp_path, capsys):
    train = "{seq_len: 16, batch_size: 2, steps: 2, warmup_steps: 1, eval_every: 2, eval_tokens: 32}"
    argv = ["run", str(probe_manifest(tmp_path, hat_text(tmp_path), train)), "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    capsys.readouterr()
    run = tmp_path / "out" / "m" / "base" / "seed0"
    kept = run / "checkpoints" / "step-000002" / "config.json"
    (run / "config.json").write_text("[")
    line = fails(capsys, argv, f"{run / 'config.json'}: unreadable", f"copy {kept} over it")
    planned = dry_run(capsys, [*argv, "--dry-run"])
    for said in (line, planned):
        assert f"copy {kept} over it" in said and "delete" not in said
    shutil.copyfile(kept, run / "config.json")
    assert main(argv) == 0
    assert "done already" in capsys.readouterr().out


def test_ah1_a_generation_refused_before_its_first_token_writes_nothing():
    for lead in ("the cat", ""):  # a prompt, or --chat's answer alone
        out = Writes()
        with pytest.raises(ValueError), TextStream(ByteTokenizer(), out=out, lead=lead):
            raise ValueError("temperature=nan must be a finite number >= 0")
        assert out.getvalue() == ""  # the error line alone, not the prompt before it
        with TextStream(ByteTokenizer(), out=out, lead=lead):  # no new token (max_new_tokens 0): the prompt
            pass
        assert out.getvalue() == lead + "\n"


def test_ah6_a_store_whose_first_ingest_hit_a_file_size_limit_lists_as_empty(streaming_run, tmp_path, capsys,
                                                                               file_size_limit):  # fmt: skip
    doc = tmp_path / "doc1.txt"
    doc.write_text("the cat sat on the mat " * 4)
    store = tmp_path / "store"
    ingest = ["memory", "ingest", str(streaming_run), str(doc), "--store", str(store), "--name", "u", "--no-progress"]
    assert run_limited(file_size_limit, 2048, ingest) == 2
    assert "could not be written" in capsys.readouterr().err
    assert (store / "index.sqlite").stat().st_size == 0  # SQLite made the file, and could write nothing in it
    assert main(["memory", "ls", "--store", str(store)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "no memories" in captured.out
    assert main(ingest) == 0
    capsys.readouterr()
    assert main(["memory", "ls", "--store", str(store)]) == 0
    assert "u" in capsys.readouterr().out


@pytest.mark.parametrize(("name", "text"), [("empty.txt", ""), ("empty.yml", "{}\n"), ("empty.json", "{}"),
                                            ("comments.yaml", "# vocab_size: 97\n")])  # fmt: skip
def test_ah7_validate_says_an_empty_file_holds_no_keys_in_one_line(tmp_path, capsys, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert main(["validate", str(path)]) == 2
    said = "holds no keys (an empty file, or {}): a model config gives at least vocab_size, d_model, n_layers"
    assert capsys.readouterr().err.splitlines() == [f"{path}: {said} and n_heads"]  # not four "missing key" lines


@pytest.mark.parametrize("form", ["{path}", "{{model: {path}}}"])
def test_ah8_init_from_a_file_that_is_no_model_is_said_first_and_alone(tmp_path, capsys, form):
    notes = tmp_path / "README.md"
    notes.write_text("# my notes\n")
    targets = f"  a: {{model: {{attention: {{kind: mha}}}}}}\n  b: {{init_from: {form.format(path=notes)}}}\n"
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), "{seq_len: 16, steps: 2}", targets=targets)
    line = fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "out"), "--dry-run"],
                 f"targets.b.init_from: {notes}: not a GGUF file")  # fmt: skip
    assert "fixed by its weights" not in line  # (defaults.model's d_model... presumed a model)
