"""Probe AB's findings on data and --out (/work/probe_ab/REPORT.md): a FIFO at a named dataset's file hung the run,
its dry run and kv-eval (AB3); a dangling link, a folder or a file where a named dataset's file or folder goes in
--data-dir was skipped without a word for the next data folder's file (U1)."""

from __future__ import annotations

import lzma
import os
import signal
from pathlib import Path

import pytest
from helpers import dry_run, fails

from attnlab.compare import check_not_in_run
from attnlab.data.source_identity import named_source_key
from attnlab.errors import InputError
from attnlab.paths import run_folder_problem

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = ("{seq_len: 16, batch_size: 2, steps: 4, warmup_steps: 1, eval_every: 2, eval_tokens: 32, "
         "checkpoint_every: 2}")  # fmt: skip


def manifest(root: Path, source: str) -> Path:
    path = root / "m.yml"
    extra = ", val_fraction: 0.2" if source == "tinyshakespeare" else ""
    data = f"{{source: {source}, tokenizer: char{extra}}}"
    path.write_text("name: m\nseeds: [0]\ndefaults:\n  model: {d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 64}\n"
                    f"  data: {data}\n  train: {TRAIN}\ntargets:\n  base: {{}}\n")  # fmt: skip
    return path


@pytest.fixture
def no_hang():
    """A test that would wait on a FIFO fails after 60 s instead of hanging the suite."""

    def stop(*_):
        raise TimeoutError("waited on a FIFO")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def both_refused(capsys, argv: list[str], *fragments: str) -> str:
    """The run is refused with one line holding every fragment, and its dry run with the same line."""
    line = fails(capsys, argv, *fragments)
    assert fails(capsys, [*argv, "--dry-run"], *fragments) == line
    assert not (Path(argv[argv.index("--out") + 1]) / "m").exists()
    return line


# ----------------------------------------------------------------------------- AB3, U1: what stands at a file's name


def test_ab3_a_fifo_at_input_txt_is_named_not_waited_on(tmp_path, capsys, no_hang):
    """Was: the run and its dry run waited for a writer forever, printing nothing."""
    (tmp_path / "dd" / "tinyshakespeare").mkdir(parents=True)
    os.mkfifo(tmp_path / "dd" / "tinyshakespeare" / "input.txt")
    argv = ["run", str(manifest(tmp_path, "tinyshakespeare")), "--out", str(tmp_path / "o"), "--no-progress",
            "--data-dir", str(tmp_path / "dd")]  # fmt: skip
    line = both_refused(capsys, argv, "is a FIFO, not a regular file")
    assert line.startswith(f"attnlab run: error: {tmp_path / 'dd' / 'tinyshakespeare' / 'input.txt'}: is a FIFO")


def test_ab3_kv_eval_names_a_fifo_at_its_dataset_file_not_waits_on_it(tiny_run, tmp_path, capsys, no_hang):
    """Was: kv-eval --dataset tinyshakespeare waited for a writer forever, printing nothing."""
    (tmp_path / "dd" / "tinyshakespeare").mkdir(parents=True)
    os.mkfifo(tmp_path / "dd" / "tinyshakespeare" / "input.txt")
    argv = ["kv-eval", str(tiny_run), "--policies", "k=q8_0", "--dataset", "tinyshakespeare", "--seq-len", "16",
            "--tokens", "32", "--split", "val", "--data-dir", str(tmp_path / "dd")]  # fmt: skip
    line = fails(capsys, argv, "is a FIFO, not a regular file")
    assert line.startswith(f"attnlab kv-eval: error: {tmp_path / 'dd' / 'tinyshakespeare' / 'input.txt'}: is a FIFO")


def test_ab3_a_fifo_at_a_wikitext_file_is_named_not_waited_on(tmp_path, capsys, no_hang, data_dir):
    (tmp_path / "dd" / "wikitext-2").mkdir(parents=True)
    os.mkfifo(tmp_path / "dd" / "wikitext-2" / "wiki.valid.tokens.xz")
    for split in ("train", "test"):
        (tmp_path / "dd" / "wikitext-2" / f"wiki.{split}.tokens.xz").symlink_to(
            data_dir / "wikitext-2" / f"wiki.{split}.tokens.xz"
        )
    argv = ["run", str(manifest(tmp_path, "wikitext2")), "--out", str(tmp_path / "o"), "--no-progress",
            "--data-dir", str(tmp_path / "dd")]  # fmt: skip
    line = both_refused(capsys, argv, f"{tmp_path / 'dd' / 'wikitext-2' / 'wiki.valid.tokens.xz'}: is a FIFO")
    assert "is a FIFO, not a regular file" in line and line.startswith("attnlab run: error: ")


def test_u1_a_dangling_link_at_input_txt_is_named_not_skipped(tmp_path, capsys, data_dir, monkeypatch):
    """Was: trained on $ATTNLAB_DATA's input.txt without a word (a disk not mounted means other data)."""
    monkeypatch.setenv("ATTNLAB_DATA", str(data_dir))
    (tmp_path / "dd" / "tinyshakespeare").mkdir(parents=True)
    (tmp_path / "dd" / "tinyshakespeare" / "input.txt").symlink_to("/nonexistent/input.txt")
    argv = ["run", str(manifest(tmp_path, "tinyshakespeare")), "--out", str(tmp_path / "o"), "--no-progress",
            "--data-dir", str(tmp_path / "dd")]  # fmt: skip
    line = both_refused(capsys, argv, f"{tmp_path / 'dd' / 'tinyshakespeare' / 'input.txt'}: a link to "
                         "/nonexistent/input.txt, which does not exist")  # fmt: skip
    assert str(data_dir) not in line  # (not the next data folder's file)


@pytest.mark.parametrize("case", ["folder at the file", "file at the folder"])
def test_u1_a_folder_or_file_in_wikitexts_place_is_named_not_skipped(tmp_path, capsys, data_dir, monkeypatch, case):
    """Was: $ATTNLAB_DATA's WikiText was used without a word (a folder at tinyshakespeare/input.txt was refused)."""
    monkeypatch.setenv("ATTNLAB_DATA", str(data_dir))
    dd = tmp_path / "dd"
    if case == "folder at the file":
        (dd / "wikitext-2" / "wiki.train.tokens.xz").mkdir(parents=True)
        said = f"{dd / 'wikitext-2' / 'wiki.train.tokens.xz'}: is a folder, where a file is expected"
    else:
        dd.mkdir()
        (dd / "wikitext-2").write_text("not a folder")
        said = f"{dd / 'wikitext-2'}: a file, not a folder, where the folder of the data file"
    argv = ["run", str(manifest(tmp_path, "wikitext2")), "--out", str(tmp_path / "o"), "--no-progress",
            "--data-dir", str(dd)]  # fmt: skip
    both_refused(capsys, argv, said)


# ----------------------------------------------------------------------------- AB1: a sum matched to the name's form


@pytest.fixture
def plain_under_xz(tmp_path, data_dir) -> Path:
    """A --data-dir whose wikitext-2/wiki.valid.tokens.xz holds WikiText's own valid text, not compressed."""
    folder = tmp_path / "dd" / "wikitext-2"
    folder.mkdir(parents=True)
    for split in ("train", "test"):
        (folder / f"wiki.{split}.tokens.xz").symlink_to(data_dir / "wikitext-2" / f"wiki.{split}.tokens.xz")
    xz = data_dir / "wikitext-2" / "wiki.valid.tokens.xz"
    (folder / "wiki.valid.tokens.xz").write_bytes(lzma.decompress(xz.read_bytes()))
    return tmp_path / "dd"


def test_ab1_plain_text_under_an_xz_name_is_not_the_datasets_own_file(plain_under_xz, data_dir, tmp_path):
    """The plain sum matches a plain name only: the .xz name is read as the run reads it (decompressed)."""
    assert named_source_key("wikitext2", data_dir) == "wikitext2"
    assert named_source_key("wikitext2", plain_under_xz).startswith("wikitext2:")
    plain = tmp_path / "plain" / "wikitext-2"
    plain.mkdir(parents=True)
    (plain / "wiki.valid.tokens").write_bytes((plain_under_xz / "wikitext-2" / "wiki.valid.tokens.xz").read_bytes())
    for split in ("train", "test"):
        (plain / f"wiki.{split}.tokens.xz").symlink_to(data_dir / "wikitext-2" / f"wiki.{split}.tokens.xz")
    assert named_source_key("wikitext2", tmp_path / "plain") == "wikitext2"


def test_ab1_the_dry_run_refuses_plain_text_under_an_xz_name_as_the_run_does(
    plain_under_xz, tmp_path, capsys, monkeypatch
):
    """Was: the dry run trusted the sum and said "would train"; the run refused a damaged .xz."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    argv = ["run", str(manifest(tmp_path, "wikitext2")), "--out", str(tmp_path / "o"), "--no-progress",
            "--data-dir", str(plain_under_xz)]  # fmt: skip
    said = f"{plain_under_xz / 'wikitext-2' / 'wiki.valid.tokens.xz'}: a damaged or cut-short .xz archive"
    line = fails(capsys, argv, said).split("error: ", 1)[1]
    assert dry_run(capsys, [*argv, "--dry-run"]) == f"[1/1] base seed0: would be refused: {line}\n"


# ----------------------------------------------------------------------------- AB2: a cache folder the run cannot write


def test_ab2_the_dry_run_refuses_a_cache_it_cannot_prepare_the_data_in(unwritable, data_dir, tmp_path, capsys,
                                                                       monkeypatch):  # fmt: skip
    """Was: the dry run said "would train 4 steps"; the run refused the cache folder it could not make."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(unwritable))
    argv = ["run", str(manifest(tmp_path, "tinyshakespeare")), "--out", str(tmp_path / "o"), "--no-progress",
            "--data-dir", str(data_dir)]  # fmt: skip
    said = (f"{unwritable / 'attnlab'}: permission denied: cannot create it in {unwritable} (make that folder "
            "writable, or set XDG_CACHE_HOME to another folder)")  # fmt: skip
    assert fails(capsys, [*argv, "--dry-run"], said) == fails(capsys, argv, said)
    assert list(unwritable.iterdir()) == [] and not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- U3: every --out inside the cache


@pytest.mark.parametrize("flag", ["--out", "--hf", "--store", "$ATTNLAB_MEMORY"])
def test_u3_a_folder_made_inside_attnlabs_cache_is_refused_for_every_flag(tmp_path, monkeypatch, flag):
    """Was: `convert --out` (and export --hf, the records' --out, a store) inside the cache accepted, while `run
    --out` there was refused."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    inner = tmp_path / "cache" / "attnlab" / "made"
    assert run_folder_problem(inner, "why", flag) == (
        f"{flag} {inner} is inside attnlab's cache {tmp_path / 'cache' / 'attnlab'} (prepared data, downloads, "
        "compiled kernels), which clearing the cache deletes: give a folder of your own"
    )
    assert run_folder_problem(tmp_path / "elsewhere", "why", flag) is None
    memory = tmp_path / "cache" / "attnlab" / "memory"  # the default store is the cache's own
    assert (run_folder_problem(memory, "why", flag) is None) == (flag in ("--store", "$ATTNLAB_MEMORY"))


def test_u3_convert_and_compare_refuse_an_out_inside_the_cache(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "cache" / "attnlab" / "cv"
    fails(capsys, ["convert", str(tmp_path / "nothere"), "--attention", "kind=mha", "--out", str(out)],
          f"--out {out} is inside attnlab's cache")  # fmt: skip
    with pytest.raises(InputError, match=f"--out {out} is inside attnlab's cache"):  # compare's check of --out
        check_not_in_run(tmp_path / "runs", out)
    assert not out.exists()


# ----------------------------------------------------------------------------- U8: a run folder that is a link


def test_u8_a_run_folder_linked_elsewhere_is_refused_naming_the_link(tmp_path, capsys):
    """Was: refused with advice about '..' ("use plain names, without '..'"), where the user had made a link."""
    (tmp_path / "sr" / "m" / "base").mkdir(parents=True)
    (tmp_path / "real" / "seed0").mkdir(parents=True)
    (tmp_path / "sr" / "m" / "base" / "seed0").symlink_to(tmp_path / "real" / "seed0")
    argv = ["run", str(manifest(tmp_path, "tinyshakespeare")), "--out", str(tmp_path / "sr"), "--no-progress"]
    said = (f"run folder {tmp_path / 'sr' / 'm' / 'base' / 'seed0'} is a link to {tmp_path / 'real' / 'seed0'}, "
            f"outside {tmp_path / 'sr'}: move the folder it links to")  # fmt: skip
    line = fails(capsys, argv, said)
    assert fails(capsys, [*argv, "--dry-run"], said) == line
    assert "'..'" not in line and list((tmp_path / "real" / "seed0").iterdir()) == []


def test_an_out_that_is_a_link_loop_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    """The cache check resolved --out first: Path.resolve() of a link loop raised RuntimeError (a traceback)."""
    from attnlab.paths import cache_folder_problem
    from attnlab.run_checks import out_folder_problem

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert cache_folder_problem(loop) is None and out_folder_problem(loop) is None  # named by the checks after them
    monkeypatch.chdir(tmp_path)
    manifest = tmp_path / "m.yml"
    manifest.write_text(
        "name: m\nseeds: [0]\ndefaults:\n  model: {d_model: 32, n_layers: 1, n_heads: 4, max_seq_len: 64}\n"
        "  data: {source: tinyshakespeare, tokenizer: char}\n"
        "  train: {steps: 2, batch_size: 2, seq_len: 32}\ntargets:\n  base: {}\n"
    )
    fails(capsys, ["run", str(manifest), "--out", "loop", "--dry-run"], "--out loop: a symbolic link loop")
