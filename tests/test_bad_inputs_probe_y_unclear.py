"""Probe Y's unclear findings and nits (/work/probe_y/REPORT.md): a target or phase started from weights of the same
shapes read otherwise (another n_heads, head_dim or RoPE) with no word (U1); init_from an unfinished run (U2); a
missing init_from path reported as a pretrained model's keys "fixed by its weights" (U3); a prepared meta.json whose
`data` record is not its folder's (U4); a char vocab.json with a token of two characters (U5); kv-tune's default
--resids refused for a memory model (U6); an upper-case sha256 said not to be hex digits; report.md's labels not
escaped; bench's record temporaries of a killed process never swept."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
from helpers import (
    PROBE_MODEL,
    dry_run,
    fails,
    hat_text,
    probe_manifest,
    stop_after_first_checkpoint,
    train_tiny_run,
)
from test_integrity import dead_pid

import attnlab
from attnlab.cli import main
from attnlab.config import DataConfig, TrainConfig
from attnlab.data import prepare
from attnlab.data.files import sealed
from attnlab.errors import ConfigError
from attnlab.train import train
from attnlab.train.checkpoint import load_model_from_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = "{seq_len: 16, batch_size: 2, steps: 2, warmup_steps: 1, eval_every: 2, eval_tokens: 32, checkpoint_every: 2}"
FOUR_HEADS = "{d_model: 32, n_layers: 1, n_heads: 4, max_seq_len: 64}"  # head_dim 8


def refused(capsys, path: Path, tmp_path: Path, *fragments: str) -> str:
    """validate, run --dry-run and run refuse the manifest at `path` alike, in one line holding every fragment,
    and nothing is trained: that line (after the manifest's path)."""
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    line = err.strip().split(f"{path}: ", 1)[1]
    out = tmp_path / "out"
    for argv in (["run", str(path), "--out", str(out), "--dry-run"], ["run", str(path), "--out", str(out)]):
        said = fails(capsys, argv, *fragments)
        assert said.endswith(f"{path}: {line}"), (said, line)
    assert not out.exists()
    return line


# ----------------------------------------------------------------------------- U1: weights read otherwise


SAME_SHAPES = {  # b's model section, starting from a (4 heads of 8): what the line names
    "n_heads": ("{n_heads: 2}", "n_heads 2, target a's 4"),
    "n_heads and head_dim": ("{n_heads: 2, attention: {kind: mha, head_dim: 16}}", "n_heads 2, target a's 4; "
                             "attention.head_dim 16, target a's None"),
    "rope_base": ("{rope_base: 500.0}", "rope_base 500.0, target a's 10000.0"),
    "rope_interleaved": ("{rope_interleaved: true}", "rope_interleaved True, target a's False"),
    "rope_scaling": ("{rope_scaling: {type: linear, factor: 2.0}}", "rope_scaling {'type': 'linear'"),
    "norm_eps": ("{norm_eps: 1.0e-6}", "norm_eps 1e-06, target a's 1e-05"),
}  # fmt: skip


@pytest.mark.parametrize("case", SAME_SHAPES)
def test_u1_a_target_from_another_of_the_same_shapes_read_otherwise_is_refused(tmp_path, capsys, case):
    """Was: b trained from a's weights with no word (the same matrices split into 2 heads of 16, RoPE over other
    pairs), though a model given as init_from refuses such a change ("fixed by its weights")."""
    model, said = SAME_SHAPES[case]
    targets = f"  a: {{}}\n  b: {{init_from: a, model: {model}}}\n"
    path = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, targets, model=FOUR_HEADS)
    line = refused(capsys, path, tmp_path, f"targets.b: its model cannot start from target a's weights ({said}")
    assert "the same tensors, read otherwise" in line and "it needs the same architecture and vocabulary" in line


def test_u1_a_phase_of_the_same_shapes_read_otherwise_is_refused(tmp_path, capsys):
    phases = "    phases:\n      - {name: p1}\n      - {name: p2, model: {n_heads: 2}}\n"
    path = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, f"  a:\n{phases}", model=FOUR_HEADS)
    line = refused(capsys, path, tmp_path, "targets.a.phases[1]: its model cannot start from phase p1's weights "
                   "(n_heads 2, phase p1's 4; the same tensors, read otherwise)")  # fmt: skip
    assert line.startswith("targets.a.phases[1]: ")


def test_u1_another_attention_kind_of_other_tensors_is_still_refused(tmp_path, capsys):
    targets = "  a: {}\n  b: {init_from: a, model: {attention: {kind: diff}}}\n"
    path = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, targets, model=FOUR_HEADS)
    line = refused(capsys, path, tmp_path, "(attention.kind 'diff', target a's 'mha')",
                   "the attention's window changed: mha and sliding differ only in it")  # fmt: skip
    assert line.startswith("targets.b")


SAME_READING = {  # b's model section, which reads a's weights as a does (options left out or written out)
    "head_dim and n_kv_heads written out": "{attention: {kind: mha, head_dim: 8, n_kv_heads: 4}}",
    "a longer context": "{max_seq_len: 128}",
    "init_std": "{init_std: 0.05}",
}


@pytest.mark.parametrize("case", SAME_READING)
def test_u1_what_reads_the_weights_alike_is_accepted(tmp_path, capsys, case):
    targets = f"  a: {{}}\n  b: {{init_from: a, model: {SAME_READING[case]}}}\n"
    path = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, targets, model=FOUR_HEADS)
    assert main(["validate", str(path)]) == 0
    assert "ok (manifest m: 2 targets" in capsys.readouterr().out


def test_u1_a_phase_may_restrict_full_attention_to_a_window_and_back(tmp_path, capsys):
    """mha and sliding have the same tensors, read alike but for how far back a query reads (docs/guarantees.md):
    train with full attention, then within a window, then with full attention again."""
    window = "{name: window, model: {attention: {kind: sliding, window: 8}}}"
    phases = f"    phases:\n      - {{name: full}}\n      - {window}\n      - {{name: again}}\n"
    path = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, f"  a:\n{phases}", model=FOUR_HEADS)
    out = tmp_path / "out"
    printed = dry_run(capsys, ["run", str(path), "--out", str(out), "--dry-run"])
    assert "would be refused" not in printed and printed.count("would train") == 3, printed
    assert main(["run", str(path), "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    cfg, _ = load_model_from_checkpoint(out / "m" / "a" / "seed0" / "window", tag="last")
    assert cfg.attention.kind == "sliding" and cfg.attention.window == 8


def test_u1_train_refuses_init_from_weights_it_would_read_otherwise(tiny_run, tmp_path):
    """The library's train(init_from=...) checks it too (the manifest's check is made before anything runs)."""
    data = DataConfig(source=str(tiny_run.parents[2] / "text.txt"), tokenizer="char", val_fraction=0.2)
    cfg = attnlab.model_config_from_dict({**PROBE_MODEL, "n_heads": 1})  # PROBE_MODEL: 2 heads of 16
    train_cfg = TrainConfig(seq_len=16, batch_size=2, steps=2, eval_every=2, eval_tokens=32)
    with pytest.raises(ConfigError, match=r"\(init_from\): this run's model cannot start from this checkpoint's weig"
                       r"hts \(n_heads 1, this checkpoint's 2; the same tensors, read otherwise\)"):  # fmt: skip
        train(cfg, data, train_cfg, tmp_path / "run", progress=False, init_from=tiny_run)
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- U3: an init_from that is nowhere


MISSING = {  # init_from -> what the line says
    "a target's phase": ("a/p1", "targets.b.init_from: a/p1: no such model file or folder (init_from: a starts from "
                         "target a's last phase; no other phase of a target can be named)"),
    "a model file": ("nothere/model.gguf", "targets.b.init_from: nothere/model.gguf: no such model file or folder"),
}  # fmt: skip


@pytest.mark.parametrize("case", MISSING)
def test_u3_an_init_from_that_is_nowhere_is_said_rather_than_the_keys_its_model_would_fix(tmp_path, capsys, case):
    """Was only: "defaults.model.d_model, ... (inherited by target b, which starts from a pretrained model): a
    pretrained model's d_model, n_layers, n_heads are fixed by its weights": fixing that led to a second refusal."""
    ref, said = MISSING[case]
    targets = f"  a:\n    phases:\n      - {{name: p1}}\n      - {{name: p2}}\n  b: {{init_from: {ref}}}\n"
    path = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, targets)
    line = refused(capsys, path, tmp_path, said)
    assert line == said and "fixed by its weights" not in line


def test_u3_a_model_found_in_the_data_directory_is_not_said_missing(tmp_path, capsys, tiny_run):
    """A relative init_from is looked up in --data-dir too, as the run loads it: there, the model's own keys are
    still what is refused."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "models").symlink_to(tiny_run.parent)
    path = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, "  b: {init_from: models/seed0}\n")
    argv = ["validate", str(path), "--data-dir", str(tmp_path / "data")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "d_model, n_layers, n_heads are fixed by its weights" in err and "no such model" not in err, err


# ----------------------------------------------------------------------------- U2: init_from an unfinished run


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> Path:
    """A run stopped right after its step-2 checkpoint, of 4 steps: out/m/base/seed0 (its text beside m.yml)."""
    root = tmp_path_factory.mktemp("stopped")
    path = probe_manifest(root, hat_text(root), TRAIN.replace("steps: 2,", "steps: 4,"))
    with pytest.MonkeyPatch.context() as patch:
        stop_after_first_checkpoint(patch, ["run", str(path), "--out", str(root / "out"), "--no-progress"])
    return root / "out" / "m" / "base" / "seed0"


def starting_from(tmp_path: Path, text: Path, ref: Path) -> Path:
    """tmp_path/s.yml: one target trained from the model `ref` (its tokenizer, its architecture)."""
    path = tmp_path / "s.yml"
    path.write_text(f"name: s\nseeds: [0]\ndefaults:\n  data: {{source: {text}, val_fraction: 0.2}}\n  train: {TRAIN}\n"
                    f"targets:\n  a: {{init_from: {ref}}}\n")  # fmt: skip
    return path


def test_u2_init_from_an_unfinished_run_says_so_in_one_warning_line(stopped_run, tmp_path, capsys):
    """Was: converted and trained from with no word."""
    path, out = starting_from(tmp_path, stopped_run.parents[3] / "text.txt", stopped_run), tmp_path / "out"
    checkpoint = stopped_run / "checkpoints" / "step-000002"
    said = (f"targets.a.init_from: {stopped_run} is not finished: step 2 of 4; its best checkpoint (step 2) is what "
            f"target a starts from (finish that run first, or give init_from: {checkpoint} to start from it on "
            "purpose)")  # fmt: skip
    run = ["run", str(path), "--out", str(out)]
    for argv in ([*run, "--convert-only", "--dry-run"], [*run, "--dry-run"], [*run, "--no-progress"]):
        assert main(argv) == 0
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines == [f"attnlab run: warning: {said}"], lines
    assert (out / "s" / "a" / "seed0" / "summary.json").is_file()


def test_u2_a_finished_run_or_a_checkpoint_named_on_purpose_is_no_warning(stopped_run, tiny_run, tmp_path, capsys):
    checkpoint = stopped_run / "checkpoints" / "step-000002"
    for i, ref in enumerate((tiny_run, checkpoint)):
        path = starting_from(tmp_path, stopped_run.parents[3] / "text.txt", ref)
        assert main(["run", str(path), "--out", str(tmp_path / f"out{i}"), "--dry-run"]) == 0
        assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- U4, U5, a nit: prepared data edited


@pytest.fixture
def prepared(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(manifest, prepared folder): the probes' manifest and its data prepared in a cache of the test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    text = hat_text(tmp_path)
    path = probe_manifest(tmp_path, text, TRAIN)  # (data: this text, char tokenizer, val_fraction 0.2)
    return path, prepare(DataConfig(source=str(text), tokenizer="char", val_fraction=0.2)).path


def edit_meta(folder: Path, edit) -> None:
    """meta.json changed by edit(meta), its tokenizer files' sums re-written to agree (a careful hand)."""
    meta = json.loads((folder / "meta.json").read_text())
    edit(meta)
    for name in meta["tokenizer"]["files"]:
        meta["tokenizer"]["files"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))


def refused_alike(capsys, path: Path, out: Path, *fragments: str) -> str:
    """The run is refused, and its dry run says it would be, with the run's own line: that line."""
    printed = dry_run(capsys, ["run", str(path), "--out", str(out), "--dry-run"])
    line = fails(capsys, ["run", str(path), "--out", str(out)], *fragments).split("error: ", 1)[1]
    assert printed == f"[1/1] base seed0: would be refused: {line}\n", (printed, line)
    assert not out.exists()
    return line


def multi_character(meta: dict, folder: Path) -> None:
    vocab = json.loads((folder / "vocab.json").read_text())
    vocab["tokens"][13] = "AB"
    (folder / "vocab.json").write_text(json.dumps(vocab))


EDITS = {  # what is done to meta.json (and the files its sums cover), what the line says
    "U4 data record": (lambda meta, folder: meta["data"].update(val_fraction=0.1),
                       "meta.json: 'data.val_fraction' is 0.1, but the folder is named for data.val_fraction=0.2 (its "
                       "record was changed by hand"),
    "U5 char token of two characters": (multi_character, "vocab.json: not a valid char tokenizer file (char vocabulary "
                                        "must hold single characters besides <unk> and <|endoftext|>, but token 13 is "
                                        "'AB')"),
    "sha256 upper case": (lambda meta, folder: meta["splits"]["val"].update(sha256=meta["splits"]["val"]["sha256"]
                                                                            .upper()),
                          "meta.json: 'splits.val.sha256' is '", "(expected 64 lower-case hex digits)"),
}  # fmt: skip


@pytest.mark.parametrize("case", EDITS)
def test_prepared_data_edited_by_hand_is_refused_by_the_run_and_its_dry_run(prepared, tmp_path, capsys, case):
    """Were: the data record and the two-character token used with no word; the upper-case sha256 said to be "not
    64 hex digits"."""
    path, folder = prepared
    edit, *said = EDITS[case]
    edit_meta(folder, lambda meta: edit(meta, folder))
    line = refused_alike(capsys, path, tmp_path / "out", *said)
    fix = f"delete {folder} to prepare it again" if "U5" not in case else f"delete {folder} to make it again from"
    assert line.startswith(str(folder)) and fix in line


def test_u4_what_the_folders_key_does_not_hold_is_not_compared(tmp_path):
    """A local source spelled otherwise (the key holds the file, not its spelling), a dataset's own splits (no
    fractions in its key), a folder prepared before the record, a key it lacks: no refusal."""
    from attnlab.data.prepared_meta import data_record_problem

    text = DataConfig(source=str(hat_text(tmp_path)), tokenizer="char", val_fraction=0.2)
    record = {"source": "./text.txt", "tokenizer": "char", "val_fraction": 0.2, "test_fraction": 0.0}
    assert data_record_problem(tmp_path, {"data": record}, text) is None
    assert data_record_problem(tmp_path, {}, text) is None
    assert data_record_problem(tmp_path, {"data": {"tokenizer": "char"}}, text) is None
    wikitext = DataConfig(source="wikitext2", tokenizer="word", val_fraction=0.1)
    assert data_record_problem(tmp_path, {"data": {"source": "wikitext2", "val_fraction": 0.05}}, wikitext) is None
    assert "'data.source' is 'wikitext2-raw'" in data_record_problem(tmp_path, {"data": {"source": "wikitext2-raw"}},
                                                                     wikitext)  # fmt: skip


# ----------------------------------------------------------------------------- U6: kv-tune's default --resids


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory) -> Path:
    """A tiny run of a model with a bounded memory."""
    memory = {"kind": "bounded", "recent_window": 8, "exact_slots": 4, "summary_slots": 4}
    return train_tiny_run(tmp_path_factory.mktemp("memory"), {**PROBE_MODEL, "memory": memory}, steps=2)


def test_u6_kv_tune_without_resids_tries_0_alone_for_a_model_with_a_memory(memory_run, capsys):
    """Was: "--resids 0,32,128: a model with a memory ... takes --resids 0", though no --resids was given."""
    argv = ["kv-tune", str(memory_run), "--budget", "150", "--split", "val", "--seq-len", "16", "--tokens", "32",
            "--formats", "fp16,q8_0"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith("k=")]
    assert rows and all(",resid=" not in row for row in rows), out


# ----------------------------------------------------------------------------- a nit: labels in report.md


def test_a_label_of_html_characters_is_escaped_in_report_md_and_shown_as_written_in_report_html(tmp_path, capsys):
    """Was: report.html escaped a label <script>alert(1)</script>, report.md held it raw (a renderer runs it)."""
    label, other = "<script>alert(1)</script>", "a&b|c\\d"
    record = {"benchmark": "perplexity", "kind": "mha", "split": "val", "tokens": 64, "loss": 4.2,
              "loss_ci": [4.1, 4.3], "ppl": 66.7, "ppl_ci": [60.3, 73.7], "seq_len": 32, "stride": 32}  # fmt: skip
    folder = tmp_path / "b<&>"
    folder.mkdir()
    rows = [record | {"model": label}, record | {"model": other}]
    (folder / "records.jsonl").write_text("".join(json.dumps(sealed(r)) + "\n" for r in rows))
    assert main(["report", str(folder)]) == 0
    capsys.readouterr()
    markdown, page = (folder / "report.md").read_text(), (folder / "report.html").read_text()
    record_line = markdown.splitlines()[-1]  # (the sums of what report wrote, an HTML comment: report's own)
    assert record_line.startswith("<!-- attnlab report sha256: ") and record_line.endswith(" -->")
    markdown = markdown[: -len(record_line) - 1]
    shown, other_shown = "\\<script\\>alert(1)\\</script\\>", "a\\&b\\|c\\\\d"
    assert "<" not in markdown.replace("\\<", "") and "&" not in markdown.replace("\\&", ""), markdown
    assert markdown.startswith("# Evaluation report: b\\<\\&\\>\n")
    assert f"2 checkpoints: {shown}, {other_shown}." in markdown  # the labels as they are listed
    assert f"| {shown} |" in markdown and f"| {other_shown} |" in markdown  # and in the table
    assert f"| {shown} |" in (folder / "tables" / "perplexity.md").read_text()
    assert "<script>" not in page and "\\" not in page.replace("c\\d", "")
    assert "<h1>Evaluation report: b&lt;&amp;&gt;</h1>" in page
    assert "2 checkpoints: &lt;script&gt;alert(1)&lt;/script&gt;, a&amp;b|c\\d.</p>" in page
    assert "<td>&lt;script&gt;alert(1)&lt;/script&gt;</td>" in page and "<td>a&amp;b|c\\d</td>" in page


# ----------------------------------------------------------------------------- records' temporaries of a killed bench


def test_a_killed_appends_temporary_is_removed_by_the_next_append(tiny_run, tmp_path, capsys):
    """Was: `.records.jsonl.<pid>.<hex>.tmp` of a bench killed mid-append stayed for good (as a killed report's stage
    is removed by the next report: its writer gone and the temporary idle a minute)."""
    out = tmp_path / "b"
    out.mkdir()
    (out / "records.jsonl").write_text("")
    dead = dead_pid()
    stale = out / f".records.jsonl.{dead}.0123456789ab.tmp"
    recent = out / f".records.jsonl.{dead}.0123456789ac.tmp"  # maybe a bench on another machine: still writing
    other = out / f".probes.jsonl.{dead}.0123456789ad.tmp"  # another file's: its own append sweeps it
    for path in (stale, recent, other):
        path.write_text('{"benchmark": "mem')
    minutes_ago = time.time() - 120
    for path in (stale, other):
        os.utime(path, (minutes_ago, minutes_ago))
    argv = ["bench", str(tiny_run), "--benchmarks", "memory", "--set", "memory.lengths=[16]", "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    assert not stale.exists() and recent.exists() and other.exists()
    assert (out / "records.jsonl").read_text().count("\n") >= 1
