"""Probe Y's findings on prepared data (/work/probe_y/REPORT.md): the dry run said "would train" over damaged prepared
data the run refuses (a meta.json not JSON, empty or a list; a split removed; a vocab.json of equal or missing
tokens, .bin files of out-of-range ids, an emptied test split, each with meta.json's sums re-written) (Y1); a resume
took a changed prepared tokenizer and wrote it over the run's own tokenizer/ copy (Y2)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import dry_run, fails, hat_text, snapshot, stop_after_first_checkpoint

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = ("{seq_len: 16, batch_size: 2, steps: 4, warmup_steps: 1, eval_every: 2, eval_tokens: 32, test_tokens: 32, "
         "checkpoint_every: 2}")  # fmt: skip
RUN = Path("m") / "base" / "seed0"


def manifest(root: Path) -> Path:
    """root/m.yml: the probes' tiny model on hat_text with val and test splits (char tokenizer)."""
    path = root / "m.yml"
    path.write_text("name: m\nseeds: [0]\ndefaults:\n  model: {d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 64}\n"
                    f"  data: {{source: {hat_text(root)}, tokenizer: char, val_fraction: 0.2, test_fraction: 0.2}}\n"
                    f"  train: {TRAIN}\ntargets:\n  base: {{}}\n")  # fmt: skip
    return path


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, own_cache) -> tuple[Path, Path, Path]:
    """(manifest, --out, cache) of a run stopped right after its step-2 checkpoint (of 4), its data prepared in
    cache, made once: tests copy --out and the cache."""
    root = tmp_path_factory.mktemp("stopped")
    path, out = manifest(root), root / "out"
    with pytest.MonkeyPatch.context() as patch:
        stop_after_first_checkpoint(patch, ["run", str(path), "--out", str(out), "--no-progress"])
    return path, out, Path(os.environ["XDG_CACHE_HOME"])


@pytest.fixture
def copies(stopped, tmp_path, monkeypatch) -> tuple[Path, Path, Path]:
    """(manifest, --out, prepared folder) of a copy of the stopped run and of its prepared data (XDG_CACHE_HOME)."""
    path, out, cache = stopped
    shutil.copytree(out, tmp_path / "out", symlinks=True)
    shutil.copytree(cache, tmp_path / "cache", symlinks=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (folder,) = (tmp_path / "cache" / "attnlab" / "prepared").iterdir()
    return path, tmp_path / "out", folder


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rewrite(folder: Path, edit) -> None:
    """meta.json changed by edit(meta), then its sums and counts re-written to agree with the files (a careful hand)."""
    meta = json.loads((folder / "meta.json").read_text())
    edit(meta)
    for entry in meta["splits"].values():
        entry.update(sha256=sha(folder / entry["file"]), tokens=(folder / entry["file"]).stat().st_size // 2)
    for name in meta["tokenizer"]["files"]:
        meta["tokenizer"]["files"][name] = sha(folder / name)
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))


def edit_vocab(folder: Path, edit) -> None:
    vocab = json.loads((folder / "vocab.json").read_text())
    edit(vocab["tokens"])
    (folder / "vocab.json").write_text(json.dumps(vocab))
    rewrite(folder, lambda meta: None)


def ids_out_of_range(folder: Path, split: str, value: int) -> None:
    ids = np.fromfile(folder / f"{split}.bin", dtype=np.uint16)
    ids[10:20] = value
    ids.tofile(folder / f"{split}.bin")
    rewrite(folder, lambda meta: None)


def duplicate(tokens):
    tokens[5] = tokens[6]


def empty_test(folder: Path) -> None:
    (folder / "test.bin").write_bytes(b"")
    rewrite(folder, lambda meta: None)


DAMAGE = {  # what is done to the prepared folder, what the run's line says
    "meta garbage": (lambda f: (f / "meta.json").write_text("{not json"), "meta.json is not valid JSON"),
    "meta empty": (lambda f: (f / "meta.json").write_text(""), "meta.json is not valid JSON"),
    "meta a list": (lambda f: (f / "meta.json").write_text("[1, 2]"), "meta.json: not a JSON object"),
    "no val split": (lambda f: rewrite(f, lambda m: m["splits"].pop("val")), "no 'val' split"),
    "vocab equal tokens": (lambda f: edit_vocab(f, duplicate), "vocab.json: not a valid char tokenizer file"),
    "vocab short": (lambda f: edit_vocab(f, lambda t: t.__delitem__(slice(-2, None))), "vocab.json: not a valid char"),
    "train ids out of range": (lambda f: ids_out_of_range(f, "train", 60000), "train.bin: holds token id 60000"),
    "val ids out of range": (lambda f: ids_out_of_range(f, "val", 200), "val.bin: holds token id 200, out of range"),
    "test emptied": (empty_test, "test.bin (test split): no evaluation window of seq_len=16 fits (split of 0 tokens"),
}


def refused_alike(capsys, argv: list[str], folder: Path, *fragments: str) -> str:
    """The run is refused (its --out and the prepared folder left as they were) and its dry run says it would be,
    with the run's own line: that line (after `attnlab run: error: `)."""
    out = Path(argv[argv.index("--out") + 1])
    before = snapshot(out), snapshot(folder)
    printed = dry_run(capsys, [*argv, "--dry-run"])
    line = fails(capsys, argv, *fragments).split("error: ", 1)[1]
    assert printed == f"[1/1] base seed0: would be refused: {line}\n", (printed, line)
    assert (snapshot(out), snapshot(folder)) == before
    return line


# ----------------------------------------------------------------------------- Y1: the run's data checks, dry too


@pytest.mark.parametrize("case", DAMAGE)
def test_y1_a_fresh_runs_dry_run_refuses_damaged_prepared_data_with_the_runs_line(copies, tmp_path, capsys, case):
    """Was: "would train 4 steps", the run refused (the test split's line also named no file)."""
    path, _, folder = copies
    damage, said = DAMAGE[case]
    damage(folder)
    argv = ["run", str(path), "--out", str(tmp_path / "fresh"), "--no-progress"]
    line = refused_alike(capsys, argv, folder, said)
    assert str(folder) in line
    assert not (tmp_path / "fresh" / RUN).exists()


def test_y1_a_resumes_dry_run_refuses_a_damaged_prepared_tokenizer_too(copies, capsys):
    """(Damaged token files are refused on a resume by the changed-data check already, dry or not.)"""
    path, out, folder = copies
    damage, said = DAMAGE["vocab equal tokens"]
    damage(folder)
    assert refused_alike(capsys, ["run", str(path), "--out", str(out), "--no-progress"], folder, said)


def test_y1_intact_prepared_data_still_would_train_and_resume(copies, tmp_path, capsys):
    path, out, _ = copies
    fresh = tmp_path / "fresh"
    printed = dry_run(capsys, ["run", str(path), "--out", str(fresh), "--dry-run"])
    assert printed.startswith("[1/1] base seed0: would train 4 steps")
    argv = ["run", str(path), "--out", str(out), "--no-progress"]
    assert dry_run(capsys, [*argv, "--dry-run"]) == f"[1/1] base seed0: would resume from step 2 of 4 in {out / RUN}\n"
    assert main(argv) == 0


# ----------------------------------------------------------------------------- Y2: the run's own tokenizer copy


def test_y2_a_resume_refuses_a_changed_prepared_tokenizer_and_keeps_its_own_copy(copies, capsys):
    """Was: the resume wrote the swapped vocab.json over the run's tokenizer/vocab.json, with no word."""
    path, out, folder = copies
    kept = (out / RUN / "tokenizer" / "vocab.json").read_bytes()
    edit_vocab(folder, lambda t: t.__setitem__(slice(13, 15), [t[14], t[13]]))
    argv = ["run", str(path), "--out", str(out), "--no-progress"]
    said = f"{folder / 'vocab.json'}: the prepared tokenizer differs from the run's own copy {out / RUN / 'tokenizer'}"
    line = refused_alike(capsys, argv, folder, said, "start the run again in a new --out")
    assert f"delete {folder} to prepare it again" in line
    assert (out / RUN / "tokenizer" / "vocab.json").read_bytes() == kept


def test_y2_a_copy_alike_or_not_made_yet_is_no_difference(tmp_path):
    from attnlab.data.tokenizers import CharTokenizer, tokenizer_copy_problem

    tokenizer = CharTokenizer.fit(["the cat"])
    tokenizer.save(tmp_path)
    assert tokenizer_copy_problem(tokenizer, tmp_path, tmp_path) is None
    assert tokenizer_copy_problem(tokenizer, tmp_path, tmp_path / "none") is None
    assert "differs from the run's own copy" in tokenizer_copy_problem(CharTokenizer.fit(["a dog"]), tmp_path, tmp_path)
