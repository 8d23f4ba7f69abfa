"""Probe AB's findings (/work/probe_ab/REPORT.md): `report` rewrote its report.md, report.html, tables and plots after
the user changed them (AB4), and `compare` a compare.md whose record line the user had removed, with a note added
(AB5); a SIGTERM ended a command with no line (U7); kv-tune picked a policy that quantized nothing (U2); `report`
dropped a record of an unknown benchmark without a word (U5); `--set` values did not take the manifest's ${variables}
(U6). Each test fails with its fix backed out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fails, snapshot

from attnlab.cli import main
from attnlab.data.files import sealed

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

PERPLEXITY = {"attnlab": "0.1.0", "benchmark": "perplexity", "ci_level": 0.95, "config_hash": "d3ebf6b846b6",
              "dataset": "tinyshakespeare", "device": "cpu", "dtype": "float32", "kind": "mha", "loss": 4.0538536,
              "loss_ci": [4.032056, 4.077070], "max_tokens": 512, "model": "base/seed0", "model_path": "nowhere",
              "params": {"dataset": None, "max_tokens": 512, "seq_len": 64, "split": "test", "stride": None},
              "ppl": 57.619072, "ppl_ci": [56.376708, 58.972432], "python": "3.11.7", "seq_len": 64,
              "split": "test", "stride": 64, "threads": 1, "time": "2026-12-06T10:26:29+00:00", "tokenizer": "char",
              "tokens": 512, "tokens_in_split": 108086, "tokens_sha256": "c534c95a38cb4d58", "torch": "2.13.0+cpu",
              "weights": "sha256:" + "f" * 64, "window_loss": [263.2, 260.3, 258.6, 262.0, 258.7, 256.8, 257.1, 258.8],
              "window_tokens": [64] * 8, "windows": 8}  # fmt: skip


@pytest.fixture
def reported(tmp_path, capsys) -> Path:
    """A bench folder with one perplexity record, reported once."""
    folder = tmp_path / "bench"
    folder.mkdir()
    (folder / "records.jsonl").write_text(json.dumps(sealed(PERPLEXITY)) + "\n")  # as attnlab writes it
    assert main(["report", str(folder)]) == 0
    capsys.readouterr()
    return folder


def append(path: Path, data: bytes) -> None:
    with path.open("ab") as file:
        file.write(data)


# ----------------------------------------------------------------------- AB4: report's own files changed since


@pytest.mark.parametrize("name", ["report.md", "report.html", "tables/perplexity.csv", "tables/perplexity.md"])
def test_ab4_a_report_file_changed_since_the_report_wrote_it_is_refused(reported, capsys, name):
    """Was: `attnlab report` rewrote it, the user's note gone, rc 0."""
    append(reported / name, b"# my note\n")
    before = snapshot(reported)
    fails(capsys, ["report", str(reported)], f"{reported / name}: changed since attnlab report wrote it (it would be "
          "replaced, and the change lost): move it away, then run the report again")  # fmt: skip
    assert snapshot(reported) == before


def test_ab4_a_report_as_written_is_redrawn_and_a_moved_note_frees_the_place(reported, capsys):
    assert main(["report", str(reported)]) == 0  # unchanged: written again, as before
    capsys.readouterr()
    assert "<!-- attnlab report sha256: report.md " in (reported / "report.md").read_text().splitlines()[-1]
    append(reported / "report.md", b"# my note\n")
    (reported / "report.md").rename(reported / "notes.md")
    assert main(["report", str(reported)]) == 0
    assert (
        "# my note" in (reported / "notes.md").read_text() and "# my note" not in (reported / "report.md").read_text()
    )


def test_ab4_a_report_md_without_its_record_is_replaced_only_when_it_is_the_new_one(reported, capsys):
    """A report.md from before the record (or its last line removed) cannot be told changed: replaced only when it is
    what the report writes now, byte for byte; otherwise refused (the user's text kept)."""
    path = reported / "report.md"
    text = path.read_text().rsplit("<!-- attnlab report", 1)[0]
    path.write_text(text)
    assert main(["report", str(reported)]) == 0
    capsys.readouterr()
    path.write_text(text + "# my note\n")
    fails(capsys, ["report", str(reported)], f"{path}: holds no record of what attnlab report wrote")
    assert path.read_text().endswith("# my note\n")


# ------------------------------------------------------------- AB5: compare.md without its record, a note added


import test_bad_inputs_probe_z_unclear as z_unclear  # noqa: E402

finished, stopped = z_unclear.finished, z_unclear.stopped  # (module fixtures: a tiny manifest's run, finished)


def test_ab5_a_compare_md_whose_record_was_removed_and_a_note_added_is_kept(finished, tmp_path, capsys):
    """Was: replaced, the note lost (a compare.md without the record was taken for an older attnlab's)."""
    argv, out = z_unclear.finished_copy(finished, tmp_path)
    table = out / "m" / "compare.md"
    text = table.read_text().rsplit("<!-- attnlab compare", 1)[0]
    table.write_text(text + "my own note\n")
    before = snapshot(out)
    said = f"{table}: holds no record of what attnlab compare wrote (its last line, removed, or an older attnlab's)"
    fails(capsys, ["compare", str(out / "m")], said)
    assert snapshot(out) == before


def test_a_run_to_resume_refuses_a_compare_md_without_its_record_before_it_trains(stopped, finished, tmp_path, capsys):
    """Was: the run (and its dry run) accepted it, trained, and only the comparison at its end refused it (exit 2
    after the training; seen on a 1-hour SmolLM2 arm whose compare.md an older attnlab had written)."""
    import shutil

    manifest, out = stopped
    shutil.copytree(out, tmp_path / "out", symlinks=True)
    text = (finished[1] / "m" / "compare.md").read_text().rsplit("<!-- attnlab compare", 1)[0]
    (tmp_path / "out" / "m" / "compare.md").write_text(text)  # the finished run's table, its record line removed
    before = snapshot(tmp_path / "out")
    argv = ["run", str(manifest), "--out", str(tmp_path / "out"), "--no-progress"]
    said = "compare.md: holds no record of what attnlab compare wrote (its last line, removed, or an older attnlab's)"
    line = fails(capsys, argv, said)
    printed = main([*argv, "--dry-run"]), capsys.readouterr()
    assert printed[0] == 2 and printed[1].err.strip() == line, printed
    assert snapshot(tmp_path / "out") == before  # nothing trained


# --------------------------------------------------------------------- U7: SIGTERM ends a command in one line, 143

SRC = str(Path(__file__).resolve().parents[1] / "src")
MODEL = str(Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny-mha.yaml")
# The console script (attnlab.entry:main) with a SIGTERM sent to itself as the import of module argv[1] starts, or
# ("command") once the command named by argv[2] runs.
TERM = """
import importlib.abc, os, signal, sys, time
moment, sys.argv = sys.argv[1], ["attnlab", *sys.argv[2:]]

def term():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(2)  # (raised here; during the imports only noted, and raised once they are done)

class Term(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == moment:
            sys.meta_path.remove(self)
            term()

if moment == "command":
    import attnlab.cli
    setattr(attnlab.cli, "cmd_" + sys.argv[1], lambda args: term())
else:
    sys.meta_path.insert(0, Term())
from attnlab.entry import main
sys.exit(main())
"""


@pytest.mark.parametrize(
    ("moment", "argv", "said"),
    [
        ("command", ["info", MODEL], "attnlab info: terminated\n"),
        ("torch", ["info", MODEL], "attnlab info: terminated\n"),  # during the imports
        (
            "command",
            ["run", "m.yml"],
            "attnlab run: terminated; run the same command again to resume from the last checkpoint\n",
        ),  # fmt: skip
        (
            "command",
            ["run", "m.yml", "--no-resume"],
            "attnlab run: terminated; run it again without --no-resume to "
            "resume from the last checkpoint (with it, the run starts over)\n",
        ),  # fmt: skip
        ("command", ["run", "m.yml", "--dry-run"], "attnlab run: terminated\n"),
    ],
)
def test_u7_sigterm_is_one_line_and_exit_code_143(moment, argv, said):
    """Was: rc 143 and no line (Python's default action for SIGTERM)."""
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    process = subprocess.run([sys.executable, "-c", TERM, moment, *argv], env=env, text=True, capture_output=True,
                             timeout=60)  # fmt: skip
    assert (process.returncode, process.stderr) == (143, said), process.stderr[-3000:]
    assert process.stdout == ""


# ------------------------------------------------- U2: kv-tune and a residual window that holds the whole sequence


def tune_argv(run: Path, resids: str) -> list[str]:
    return ["kv-tune", str(run), "--budget", "100000", "--formats", "q4_0", "--resids", resids, "--tokens", "128",
            "--seq-len", "32", "--split", "val"]  # fmt: skip


def test_u2_kv_tune_leaves_out_a_policy_whose_residual_window_holds_the_whole_sequence(tiny_run, capsys):
    """Was: picked `k=q4_0,v=q4_0,resid=64` on 32-token sequences (nothing quantized, labelled q4_0), no word."""
    assert main(tune_argv(tiny_run, "0,64")) == 0
    out, err = capsys.readouterr()
    said = (
        "attnlab kv-tune: warning: left out of the choice: 1 policy under the budget (k=q4_0,v=q4_0,resid=64): "
        "resid >= seq_len 32 keeps every token in the full-precision residual window, so nothing is quantized"
    )
    assert [line for line in err.splitlines() if "warning" in line][0].startswith(said), err
    assert err.count("resid >= seq_len") == 1, err
    assert "resid=64" not in out.split("best")[-1], out


def test_u2_kv_tune_with_only_such_windows_is_refused(tiny_run, capsys):
    line = fails(capsys, tune_argv(tiny_run, "64"), "no policy under --budget 100000 bytes/token can be measured: 1 "
                 "policy under the budget (k=q4_0,v=q4_0,resid=64): resid >= seq_len 32 keeps every token")  # fmt: skip
    assert line.startswith("attnlab kv-tune: error: ")


# ------------------------------------------------------------------------- U5: a record of an unknown benchmark


def test_u5_a_record_of_a_benchmark_attnlab_does_not_know_is_one_warning_line(tmp_path, capsys):
    """Was: dropped from the report without a word (rc 0, "0 tables")."""
    folder = tmp_path / "bench"
    folder.mkdir()
    records = folder / "records.jsonl"
    newer = sealed({**PERPLEXITY, "benchmark": "zzz"})  # (sealed, as a newer attnlab would write it)
    records.write_text(json.dumps(sealed(PERPLEXITY)) + "\n\n" + json.dumps(newer) + "\n")
    assert main(["report", str(folder)]) == 0
    err = capsys.readouterr().err
    said = (
        f"attnlab report: warning: {records}: line 3 (zzz): not a benchmark attnlab knows (a hand edit, or a "
        "newer attnlab's record), so not in this report; known: perplexity, memory, latency, multiple_choice, "
        "needle, context_sweep, rope_extrapolation, stream_loss, kv_quant, probes, effective_rank, attention_maps, "
        "kv_tune"
    )
    assert err.splitlines() == [said], err


# ---------------------------------------------------------------------- U6: ${variables} in a --set value

VARS_MANIFEST = """name: vm
vars: {lr: 2.0e-3, steps: 7}
defaults:
  model: {d_model: 32, n_layers: 1, n_heads: 4, max_seq_len: 64}
  data: {source: tinyshakespeare, tokenizer: char}
  train: {seq_len: 32, batch_size: 4, steps: 12, lr: 1.0e-3, eval_every: 6, eval_tokens: 256}
targets:
  base: {}
"""


def test_u6_a_set_value_takes_the_manifests_variables(tmp_path, capsys):
    """Was: "train.lr='${lr}' must be float, got str"."""
    from attnlab.manifest import load_manifest

    path = tmp_path / "vm.yml"
    path.write_text(VARS_MANIFEST)
    (spec,) = load_manifest(path, ["train.lr=${lr}", "train.steps=${steps}"]).runs
    assert (spec.train.lr, spec.train.steps) == (2.0e-3, 7)
    fails(capsys, ["run", str(path), "--out", str(tmp_path / "o"), "--dry-run", "--set", "train.lr=${lrr}"],
          f"{path}: --set train.lr: undefined variable ${{lrr}} (did you mean ${{lr}}?)")  # fmt: skip


def seed0_table_without_record(tmp_path: Path) -> tuple[list[str], Path, str]:
    """(argv running seeds 0 and 1, compare.md, its text): seed 0 trained, its compare.md's record line removed (as an
    older attnlab wrote it)."""
    from helpers import hat_text, probe_manifest
    from test_bad_inputs_probe_v_runs import TRAIN

    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, head="seeds: [0, 1]")
    argv = ["run", str(manifest), "--out", str(tmp_path / "out"), "--no-progress"]
    assert main([*argv, "--seed", "0"]) == 0
    table = tmp_path / "out" / "m" / "compare.md"
    text = table.read_text().rsplit("<!-- attnlab compare", 1)[0]
    table.write_text(text)
    return argv, table, text


def test_a_run_keeps_a_compare_md_without_its_record_that_it_accepted_before_it_trained(tmp_path, capsys):
    """Was: accepted at the start (what compare would write then), refused at the end once the run added its result
    (exit 2 after the training); the file is compare's own text, so the run's comparison replaces it."""
    argv, table, _ = seed0_table_without_record(tmp_path)
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err
    assert "| 2 |" in table.read_text() and "<!-- attnlab compare" in table.read_text()  # both seeds, its record


def test_a_compare_md_without_its_record_changed_during_the_run_is_still_refused_at_its_end(tmp_path, capsys,
                                                                                            monkeypatch):  # fmt: skip
    """What the run accepted at its start is kept only as it was: a note added while it trained is refused."""
    import attnlab.cli

    argv, table, text = seed0_table_without_record(tmp_path)
    run_manifest = attnlab.cli.run_manifest

    def run_then_note(*args, **kwargs):
        done = run_manifest(*args, **kwargs)
        table.write_text(text + "my note\n")
        return done

    monkeypatch.setattr(attnlab.cli, "run_manifest", run_then_note)
    capsys.readouterr()
    fails(capsys, argv, f"{table}: holds no record of what attnlab compare wrote")
    assert table.read_text() == text + "my note\n"
