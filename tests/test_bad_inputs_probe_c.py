"""Probe C's findings: a dry run says what the real run would download (and downloads nothing), lm-eval and the
demo print no stray lines, a run's tokenizer/ folder swapped for a smaller one is refused, a short run's default
warm-up is documented, and the probes' --out is checked before any model is loaded."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from helpers import fails, lm_task_yaml, train_tiny_run

from attnlab.cli import main
from attnlab.data.files import read_only_file_system
from attnlab.data.sources import TINYSHAKESPEARE_URL

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}
README = Path(__file__).resolve().parents[1] / "README.md"
PROBES = str(Path(__file__).resolve().parents[1] / "configs" / "probes" / "core.yml")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny_run(tmp_path_factory.mktemp("probe_c"), MODEL, steps=6)


def write_manifest(tmp_path, *sources: str, train: str = "{seq_len: 16, batch_size: 2, steps: 2}") -> Path:
    """A manifest with one target per data source (`tinyshakespeare`, or `fineweb-edu, max_tokens: 1000`)."""
    manifest = tmp_path / "m.yml"
    targets = "".join(
        f"  t{i}:\n    model: {{d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 64}}\n"
        f"    data: {{source: {source}, tokenizer: char}}\n    train: {train}\n"
        for i, source in enumerate(sources)
    )
    manifest.write_text(f"name: m\nseeds: [0]\ntargets:\n{targets}")
    return manifest


# 1. run --dry-run with downloads allowed


@pytest.fixture
def online(tmp_path, monkeypatch):
    """Downloads allowed, an empty user cache in tmp_path/xdg, and any download an error (none may happen)."""
    for name in ("ATTNLAB_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "ATTNLAB_DATA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))

    def no_download(*args, **kwargs):
        raise AssertionError(f"a dry run downloaded {args[0]!r}")

    monkeypatch.setattr(urllib.request, "urlopen", no_download)
    return tmp_path / "xdg"


def test_a_dry_run_says_which_named_datasets_it_would_download(tmp_path, capsys, online):
    manifest = write_manifest(tmp_path, "tinyshakespeare", "wikitext2")
    empty, out = tmp_path / "data", tmp_path / "runs"
    empty.mkdir()
    assert main(["run", str(manifest), "--dry-run", "--out", str(out), "--data-dir", str(empty)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert (
        f"data: tinyshakespeare: input.txt not in {empty / 'tinyshakespeare'}, {online / 'attnlab' / 'tinyshakespeare'}"
        f": the run would download it from {TINYSHAKESPEARE_URL} into {online / 'attnlab' / 'tinyshakespeare'} first"
    ) in printed
    assert (
        f"data: wikitext2: wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens not in {empty / 'wikitext-2'}, "
        f"{online / 'attnlab' / 'wikitext-2'}: the run would download them from the HF Hub (Salesforce/wikitext, "
        f"wikitext-2-v1) into {online / 'attnlab' / 'wikitext-2'} first"
    ) in printed
    assert printed[-1].endswith(f"would train 2 steps into {out / 'm' / 't1' / 'seed0'}")
    assert not online.exists() and not out.exists()  # nothing downloaded, prepared or written


def test_a_dry_run_with_the_files_in_the_data_dir_names_no_download(data_dir, tmp_path, capsys, online):
    manifest = write_manifest(tmp_path, "tinyshakespeare", "wikitext2")
    assert main(["run", str(manifest), "--dry-run", "--out", str(tmp_path / "runs"), "--data-dir", str(data_dir)]) == 0
    printed = capsys.readouterr().out
    assert "would train" in printed and "data:" not in printed and "download" not in printed


def test_a_download_that_could_not_happen_is_refused_before_anything_runs(tmp_path, capsys, online, monkeypatch):
    empty, out = tmp_path / "data", tmp_path / "runs"
    empty.mkdir()
    manifest = write_manifest(tmp_path, "fineweb-edu")  # streamed from the Hub: needs data.max_tokens
    for extra in (["--dry-run"], []):  # the real run stops at the same line, before it writes anything
        assert fails(
            capsys,
            ["run", str(manifest), "--out", str(out), "--data-dir", str(empty), *extra],
            f"fineweb-edu: no local files (looked in: {empty / 'fineweb-edu'}, ",
            "it would be streamed from the HF Hub, which needs data.max_tokens (set e.g. data.max_tokens: 100000000",
        )
    manifest = write_manifest(tmp_path, "wikitext2-raw")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else find_spec(name, *a)
    )
    assert fails(
        capsys,
        ["run", str(manifest), "--dry-run", "--out", str(out), "--data-dir", str(empty)],
        "wikitext2-raw: wiki.train.raw, wiki.valid.raw, wiki.test.raw not found",
        "downloading them from the HF Hub needs pyarrow (pip install pyarrow)",
    )
    assert not online.exists() and not out.exists()


# 2. lm-eval: no "fatal: not a git repository" line


def test_lm_eval_prints_no_git_error_outside_a_repository(run, tmp_path, capfd, monkeypatch):
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("lm_eval")
    import lm_eval.evaluator

    if shutil.which("git") is None:
        pytest.skip("no git on this machine: lm-eval then prints nothing")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    work = tmp_path / "work"
    (work / "t").mkdir(parents=True)
    (work / "data" / "x").mkdir(parents=True)
    (work / "t" / "mytask.yaml").write_text(lm_task_yaml())
    (work / "data" / "x" / "data.jsonl").write_text(json.dumps({"q": "a cat", "gold": 0, "choices": [" sat", " dog"]}))
    monkeypatch.chdir(work)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # git never looks above work/: no repository
    git = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True)
    assert git.returncode != 0 and "not a git repository" in git.stderr  # what lm-eval's own call prints
    own = lm_eval.evaluator.get_git_commit_hash
    argv = ["lm-eval", str(run), "--tasks", "mytask", "--include-path", "t", "--data-dir", "data", "--out", "o"]
    assert main(argv) == 0
    captured = capfd.readouterr()
    assert "mytask" in captured.out
    assert "not a git repository" not in captured.err and "fatal:" not in captured.err, captured.err
    assert json.loads((work / "o" / "lm_eval.json").read_text())["git_hash"] is None  # recorded as lm-eval does
    assert lm_eval.evaluator.get_git_commit_hash is own  # lm-eval's own function is put back


# 3. the demo's usage errors


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--data-dir"], "argument --data-dir: expected one argument"),
    ],
)
def test_the_demo_refuses_a_bad_flag_in_one_line(capsys, argv, message):
    from attnlab.demo import main as demo

    with pytest.raises(SystemExit) as exit_:
        demo(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing of the demo ran
    assert captured.err.splitlines() == [
        f"python -m attnlab.demo: error: {message} (see python -m attnlab.demo --help)"
    ]


# 4. a run's tokenizer/ folder swapped for another


def reseal(folder: Path) -> None:
    """checksums.json recording every file as it is now (a checkpoint made before tokenizers were recorded)."""
    checksums = json.loads((folder / "checksums.json").read_text())
    for name, entry in checksums["files"].items():
        blob = (folder / name).read_bytes()
        entry.update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    (folder / "checksums.json").write_text(json.dumps(checksums))


def test_a_smaller_or_reordered_tokenizer_swapped_into_a_run_is_refused(run, tmp_path, capsys):
    copy = tmp_path / "runs" / "tiny" / "seed0"
    shutil.copytree(run, copy)
    vocab = copy / "tokenizer" / "vocab.json"
    own = vocab.read_text()
    tokens = json.loads(own)["tokens"]
    checkpoint = next((copy / "checkpoints").glob("step-*"))
    record = json.loads((checkpoint / "trainer.json").read_text())["tokenizer"]
    assert record["vocab_size"] == len(tokens) < MODEL["vocab_size"]  # fewer ids than the model's vocab: not wrong
    generate = ["generate", str(copy), "a cat", "--max-new-tokens", "1"]
    fix = "it is not the tokenizer this model was trained with (copy the run's own tokenizer/ folder back"
    vocab.write_text(json.dumps({"name": "char", "tokens": tokens[2:]}))  # another run's: two characters fewer
    assert fails(
        capsys, generate, f"{copy / 'tokenizer'}: the tokenizer's vocab_size is {len(tokens) - 2}, the run was "
        f"trained with {len(tokens)}: {fix}",
    )  # fmt: skip
    assert fails(capsys, ["generate", str(checkpoint), "a cat"], f"vocab_size is {len(tokens) - 2}")  # the folder
    vocab.write_text(json.dumps({"name": "char", "tokens": [tokens[1], tokens[0], *tokens[2:]]}))  # same size
    assert fails(capsys, generate, "vocab.json is not the file the run was trained with (sha256 ", fix)
    vocab.write_text(own)  # its own again
    assert main(generate) == 0
    capsys.readouterr()
    # a run saved before tokenizers were recorded still loads (a smaller one is then not recognised)
    for folder in (copy / "checkpoints").glob("step-*"):
        trainer = json.loads((folder / "trainer.json").read_text())
        del trainer["tokenizer"]
        (folder / "trainer.json").write_text(json.dumps(trainer))
        reseal(folder)
    assert main(generate) == 0
    vocab.write_text(json.dumps({"name": "char", "tokens": tokens[:-3] + tokens[-2:]}))
    assert main(generate) == 0


# 5. the default warm-up of a short run


def test_a_short_runs_default_warmup_is_accepted_and_documented(tmp_path, capsys):
    from attnlab.config import TrainConfig
    from attnlab.train.optim import lr_at

    source = tmp_path / "text.txt"
    source.write_text("\n\n".join(f"a cat sat on the mat {i}" for i in range(40)))
    short = "{seq_len: 16, batch_size: 2, steps: 10}"
    manifest = write_manifest(tmp_path, str(source), train=short)
    assert main(["run", str(manifest), "--dry-run", "--out", str(tmp_path / "runs")]) == 0
    train = TrainConfig(steps=10)
    assert train.warmup_steps == 100 and max(lr_at(step, train) for step in range(10)) == pytest.approx(train.lr / 10)
    manifest = write_manifest(tmp_path, str(source), train=short.replace("}", ", warmup_steps: 20}"))
    assert fails(capsys, ["run", str(manifest), "--dry-run"], "train.warmup_steps=20 exceeds train.steps=10")
    readme = " ".join(README.read_text().split())
    training = readme[readme.index("- **Training** (`train:`)") :].split("\n- ")[0]
    assert "over `warmup_steps` (default 100): a run of fewer `steps` warms up for all of them and never reaches " \
           "`lr`" in training  # fmt: skip


# 6. probes (and mc) --out checked before a model is loaded


@pytest.mark.parametrize("command", ["probes", "mc"])
def test_out_is_checked_before_the_model_is_loaded(tmp_path, capsys, command):
    absent = str(tmp_path / "absent")  # the model does not exist: a late check would name it instead
    argv = ["probes", PROBES, absent] if command == "probes" else ["mc", "arc_easy", absent]
    name = "probes.jsonl" if command == "probes" else "multiple_choice.jsonl"
    afile = tmp_path / "afile"
    afile.write_text("keep")
    assert fails(capsys, [*argv, "--out", str(afile)], f"--out {afile}: a file, not a folder (the records go to "
                 f"{afile / name}; give a folder's path)")  # fmt: skip
    assert fails(capsys, [*argv, "--out", str(afile / "sub")], f"--out {afile / 'sub'}: cannot be made: {afile} is "
                 "a file, not a folder")  # fmt: skip
    assert afile.read_text() == "keep"
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    assert fails(capsys, [*argv, "--out", str(out)], f"{out / name}: a folder: records are appended")
    (out / name).rmdir()
    (out / name).symlink_to("/dev/full")
    assert fails(capsys, [*argv, "--out", str(out)], f"/dev/full (via the link {out / name}): not a regular file")
    assert sorted(p.name for p in out.iterdir()) == [name]


def test_probes_out_on_a_read_only_file_system_is_refused_first(tmp_path, capsys):
    readonly = Path("/proc/sys")
    if not readonly.is_dir() or os.access(readonly, os.W_OK):
        pytest.skip("no read-only folder here (/proc/sys is writable)")
    why = ("a read-only file system): give a folder on a writable one" if read_only_file_system(readonly) else
           "permission denied): make it writable, or give another folder")  # fmt: skip
    assert fails(
        capsys, ["probes", PROBES, str(tmp_path / "absent"), "--out", str(readonly / "attnlab")],
        f"--out {readonly / 'attnlab'}: probes.jsonl cannot be written in {readonly} ({why}",
    )  # fmt: skip


def test_probes_write_into_a_new_out_folder(run, tmp_path, capsys):
    out = tmp_path / "new" / "results"
    assert main(["probes", PROBES, str(run), "--out", str(out)]) == 0
    assert f"records: {out / 'probes.jsonl'}" in capsys.readouterr().out
    assert len((out / "probes.jsonl").read_text().splitlines()) > 1
