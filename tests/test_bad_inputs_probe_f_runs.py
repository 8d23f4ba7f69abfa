"""Probe H's findings in retrofit manifests, convert, report --paired, bench, lock files, the cache folder, kv-eval,
info and mc: a calibration too short to fit anything, a calibration text run refuses but validate passed,
--convert-only --no-resume, pairs of records that are not on the same windows (or say nothing of why), labels
a resumed bench changed, a fifo where a lock file or a task file belongs, an empty XDG_CACHE_HOME, kv-eval
--seq-len 1, and info's figures for a policy that quantizes nothing. Each ends in one line naming the file, key or
value and the fix, or says plainly what it did."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import dry_run, fails, hat_text, train_tiny_run
from test_pretrained import random_model, save

import attnlab
from attnlab.cli import main
from attnlab.data.files import sealed
from attnlab.errors import ConfigError, DataError, InputError
from attnlab.eval.records import read_records

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}
PERPLEXITY = ["--benchmarks", "perplexity", "--set", "perplexity.split=val", "--set", "perplexity.seq_len=16",
              "--set", "perplexity.max_tokens=64"]  # fmt: skip
DBA = "{kind: decoupled, d_sem: 16, d_geo: 32}"


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory):
    """Prepared data and compiled kernels of this module in a folder of its own, never the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        patch.setenv("ATTNLAB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Llama folder (4 heads of 16, 2 KV heads, a byte-level BPE tokenizer)."""
    return save(random_model("llama", n_kv_heads=2), tmp_path_factory.mktemp("llama") / "llama")


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return hat_text(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny trained run (char tokenizer, max_seq_len 64) at <root>/runs/tiny/seed0."""
    return train_tiny_run(tmp_path_factory.mktemp("plain"), MODEL, steps=4)


@pytest.fixture(scope="module")
def other_run(tmp_path_factory) -> Path:
    """The same config trained longer, in another folder: also labelled tiny/seed0."""
    return train_tiny_run(tmp_path_factory.mktemp("other"), MODEL, steps=6)


def retro_manifest(tmp_path, llama, text, init_from: str, attention: str = DBA) -> Path:
    path = tmp_path / "retro.yml"
    path.write_text(
        "name: retro\ndefaults:\n"
        f"  data: {{source: {text}, val_fraction: 0.2}}\n"
        "  train: {steps: 2, seq_len: 16, batch_size: 2, eval_every: 2, eval_tokens: 32, warmup_steps: 1}\n"
        f"targets:\n  dba:\n    init_from: {init_from}\n    model: {{attention: {attention}}}\n"
    )
    return path


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- RET-calib-1, CV-calib-1


def test_one_calibration_token_is_refused_by_validate_and_the_dry_run(tmp_path, llama, text, capsys):
    manifest = retro_manifest(tmp_path, llama, text, f"{{model: {llama}, calibration_tokens: 1, calibrate_on: {text}}}")
    assert main(["validate", str(manifest)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "targets.dba.init_from.calibration_tokens=1 is too few" in err[0], err
    assert "at least 2 tokens" in err[0] and "0 to fit the weights alone" in err[0]
    out = tmp_path / "runs"
    assert fails(capsys, ["run", str(manifest), "--out", str(out), "--dry-run"], "calibration_tokens=1 is too few")
    assert fails(capsys, ["run", str(manifest), "--out", str(out), "--convert-only"], "calibration_tokens=1")
    assert not out.exists()


def test_d_model_calibration_tokens_are_the_fewest_a_conversion_fits_on(llama):
    """Why the minimum is d_model (probe W; it was 2, the fewest that give a window): the factorisations are fitted
    to the second moment of the d_model-wide inputs, singular over fewer tokens than that; one token gave none."""
    from attnlab.interop.convert import calibration_minimum, convert_model

    cfg, model, _ = attnlab.load_model(llama)
    attention = {"kind": "decoupled", "d_sem": 16, "d_geo": 32}
    least = calibration_minimum(cfg)
    assert least == cfg.d_model == 64
    fitted = convert_model(cfg, model, attention, calibration=torch.arange(least) % 50)
    assert all(torch.isfinite(p).all() for p in fitted.model.parameters())
    assert f"factorisations fitted on {least} calibration tokens" in fitted.notes
    for tokens in (torch.tensor([5]), torch.arange(least - 1) % 50):
        with pytest.raises(attnlab.ConfigError, match=f"calibration tokens are too few for d_model=64: give at least "
                                                      f"{least}"):  # fmt: skip
            convert_model(cfg, model, attention, calibration=tokens)


def test_convert_refuses_one_calibration_token_before_loading(tmp_path, llama, text, capsys):
    out = tmp_path / "converted"
    command = ["convert", str(llama), "--attention", "kind=decoupled,d_sem=16,d_geo=32", "--calibration-tokens",
               "1", "--calibrate-on", str(text), "--eval-tokens", "0", "--out", str(out)]  # fmt: skip
    assert fails(capsys, command, "--calibration-tokens=1 is too few", "give 2 or more")
    assert not out.exists()


def test_a_calibration_text_of_one_token_is_named(tmp_path, llama, text, monkeypatch, capsys):
    import attnlab.cli_models

    # A text a tokenizer reads as one token (a single document of one merged token; these test tokenizers add a
    # BOS or a newline, so the stream is made here).
    monkeypatch.setattr(attnlab.cli_models, "dataset_tokens", lambda *args: np.array([5]))
    out = tmp_path / "converted"
    command = ["convert", str(llama), "--attention", "kind=decoupled,d_sem=16,d_geo=32", "--calibration-tokens",
               "64", "--calibrate-on", str(text), "--eval-tokens", "0", "--out", str(out)]  # fmt: skip
    line = fails(capsys, command, f"--calibrate-on {text}: its train split holds 1 token(s)", "fewer than the 64 a "
                 "calibration of d_model=64 needs")  # fmt: skip
    assert "--calibration-tokens 0" in line and not out.exists()


# ----------------------------------------------------------------------------- RET-calibrate-on-yml(-dry)


def test_a_calibration_text_run_cannot_read_is_refused_by_validate_and_the_dry_run(tmp_path, llama, text, capsys):
    wrong = tmp_path / "tiny.yml"
    wrong.write_text("name: x\n")
    manifest = retro_manifest(tmp_path, llama, text, f"{{model: {llama}, calibration_tokens: 64, calibrate_on: "
                                                     f"{wrong}}}")  # fmt: skip
    assert main(["validate", str(manifest), "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"targets.dba.init_from.calibrate_on='{wrong}' is not a known dataset" in err[0], err
    assert "not a .txt, .jsonl or .parquet file" in err[0]
    command = ["run", str(manifest), "--out", str(tmp_path / "runs"), "--dry-run"]
    assert fails(capsys, command, f"calibrate_on='{wrong}' is not a known dataset")


def test_a_missing_calibration_text_is_refused_where_the_data_directory_is_known(tmp_path, llama, text, capsys):
    manifest = retro_manifest(tmp_path, llama, text, f"{{model: {llama}, calibrate_on: missing.txt}}")
    assert main(["validate", str(manifest), "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "targets.dba.init_from.calibrate_on=missing.txt: source 'missing.txt' is not a known dataset" in err
    command = ["run", str(manifest), "--out", str(tmp_path / "runs"), "--data-dir", str(tmp_path), "--dry-run"]
    assert fails(capsys, command, "calibrate_on=missing.txt")
    mha = retro_manifest(tmp_path, llama, text, f"{{model: {llama}, calibrate_on: missing.txt}}",
                         "{kind: mha, n_kv_heads: 1}")  # fmt: skip
    assert main(["validate", str(mha), "--data-dir", str(tmp_path)]) == 2  # no factorisation: the option does nothing
    assert "init_from.calibrate_on='missing.txt' applies to bottleneck/decoupled/mla conversions" in (
        capsys.readouterr().err)  # fmt: skip


# ----------------------------------------------------------------------------- RET-co-noresume


def test_convert_only_no_resume_keeps_the_conversion_and_says_so(tmp_path, llama, text, capsys):
    manifest = retro_manifest(tmp_path, llama, text, str(llama), "{kind: mha, n_kv_heads: 1}")
    out = tmp_path / "runs"
    command = ["run", str(manifest), "--out", str(out), "--convert-only", "--no-progress"]
    assert main(command) == 0
    converted = out / "retro" / "dba" / "converted"
    (converted / "notes.txt").write_text("mine")
    before = snapshot(converted)
    capsys.readouterr()
    assert main([*command, "--no-resume"]) == 0
    said = capsys.readouterr().out
    assert f"dba: {converted} is made already, kept: --no-resume restarts interrupted training" in said
    assert "delete it to convert again" in said
    assert snapshot(converted) == before  # nothing deleted or rewritten
    assert main([*command, "--no-resume", "--dry-run"]) == 0
    assert f"dba: {converted} is made already, would be kept" in capsys.readouterr().out


# ----------------------------------------------------------------------------- PR-*: report --paired


def record(model: str, windows: list[tuple[float, int]], **extra) -> dict:
    from attnlab.eval.perplexity import summarize_losses

    return {"benchmark": "perplexity", "model": model, "kind": "mha", "split": "val", "dataset": "tinyshakespeare",
            "seq_len": 16, "stride": 16, "max_tokens": 256, "tokenizer": "char", "tokens_in_split": 46026,
            **summarize_losses(windows), **extra}  # fmt: skip


def windows(seed: int = 0, n: int = 16) -> list[tuple[float, int]]:
    rng = np.random.default_rng(seed)
    return [(float(16 * rng.uniform(2.0, 5.0)), 16) for _ in range(n)]


def write(folder: Path, *rows, seal: bool = True) -> str:
    """folder/records.jsonl of rows, sealed as attnlab writes them (seal=False: as an older attnlab wrote them)."""
    folder.mkdir(exist_ok=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(sealed(r) if seal else r) + "\n" for r in rows))
    return str(folder)


def test_records_of_other_tokenizers_are_not_paired(tmp_path, capsys):
    folder = write(tmp_path / "r", record("char/seed0", windows(0)),
                   record("bpe/seed0", windows(1), tokenizer="bpe:300", tokens_in_split=33457))  # fmt: skip
    line = fails(capsys, ["report", folder, "--paired", "char/seed0:bpe/seed0"], "--paired char/seed0:bpe/seed0",
                 "char/seed0's perplexity record (tokenizer char, tokens_in_split 46,026)",
                 "bpe/seed0's (tokenizer bpe:300, tokens_in_split 33,457)", "read other tokens")  # fmt: skip
    assert line.startswith(f"attnlab report: error: {folder}/records.jsonl: ")
    assert not (tmp_path / "r" / "report.md").exists()  # refused before anything is written
    for other in (record("c/seed0", windows(1), tokens_in_split=45000),  # the text prepared otherwise
                  record("c/seed0", windows(1), tokenizer="byte"),  # as many tokens (ASCII), other ids
                  record("c/seed0", windows(1), tokens_sha256="0123456789abcdef")):  # fmt: skip
        folder = write(tmp_path / "s", record("char/seed0", windows(0), tokens_sha256="fedcba9876543210"), other)
        assert fails(capsys, ["report", folder, "--paired", "char/seed0:c/seed0"], "read other tokens")


def test_one_vocabulary_under_two_names_is_paired(tmp_path):
    """A GGUF and its conversion name their (same) tokenizer after their files: the tokens decide, not the names."""
    gguf = record("gguf", windows(0), tokenizer="models/m.Q4_1.gguf", tokens_sha256="0123456789abcdef")
    converted = record("cold", windows(1), tokenizer="runs/x/cold/converted", tokens_sha256="0123456789abcdef")
    folder = write(tmp_path / "r", gguf, converted)
    assert main(["report", folder, "--paired", "cold:gguf"]) == 0
    assert (tmp_path / "r" / "tables" / "paired.csv").read_text().count("cold,gguf,perplexity") == 1
    older = [{k: v for k, v in r.items() if k != "tokens_sha256"} for r in (gguf, converted)]  # the same count
    assert main(["report", write(tmp_path / "o", *older, seal=False), "--paired", "cold:gguf", "--unsealed"]) == 0


def test_records_without_window_losses_or_a_common_setting_say_so(tmp_path, capsys):
    old = [{k: v for k, v in record(m, windows(i)).items() if k != "window_loss"} for i, m in enumerate("ab")]
    folder = write(tmp_path / "old", *old, seal=False)  # an older attnlab's records: unsealed too, which is said
    assert main(["report", folder, "--paired", "a:b", "--unsealed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0] == (f"attnlab report: warning: {folder}/records.jsonl: its records carry no sha256 "
                                        "(an older attnlab wrote them, or it was taken out): attnlab cannot tell "
                                        "whether they were changed since it wrote them, so their figures are shown "
                                        "unverified (--unsealed)"), err  # fmt: skip
    assert err[1].startswith("attnlab report: error: "), err
    for fragment in ("a's and b's perplexity records", "hold no per-window losses", "run the benchmark again"):
        assert fragment in err[1], err
    folder = write(tmp_path / "apart", record("a", windows(0)), record("b", windows(1, 8), max_tokens=128))
    assert fails(capsys, ["report", folder, "--paired", "a:b"], "a and b were never scored at the same setting",
                 "a: perplexity at", "max_tokens 256", "b: perplexity at", "max_tokens 128")  # fmt: skip
    folder = write(
        tmp_path / "none",
        record("a", windows(0)),
        {"benchmark": "multiple_choice", "model": "b", "task": "arc_easy", "n": 10, "acc": 0.5},
    )
    assert fails(capsys, ["report", folder, "--paired", "a:b"], "b has no perplexity, rope_extrapolation or needle")


def test_a_pair_that_cannot_be_paired_beside_one_that_can_is_said_in_a_warning(tmp_path, capsys):
    folder = write(tmp_path / "r", record("a", windows(0)), record("b", windows(1)),
                   record("c", windows(2, 8), max_tokens=128))  # fmt: skip
    assert main(["report", folder, "--paired", "a:b", "--paired", "a:c"]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "--paired a:c: a and c were never scored at the same setting" in err
    assert "--paired a:c: a and c were never scored" in (tmp_path / "r" / "report.md").read_text()
    rows = (tmp_path / "r" / "tables" / "paired.csv").read_text().splitlines()
    assert len(rows) == 2 and rows[1].startswith("a,b,perplexity,")


def test_a_pair_given_twice_is_compared_once(tmp_path, capsys):
    folder = write(tmp_path / "r", record("a", windows(0)), record("b", windows(1)))
    assert main(["report", folder, "--paired", "a:b", "--paired", "a:b"]) == 0
    rows = (tmp_path / "r" / "tables" / "paired.csv").read_text().splitlines()
    assert len(rows) == 2  # the header and one row, not two


def test_window_losses_of_another_length_name_the_record_and_the_lengths(tmp_path, capsys):
    from attnlab.eval.perplexity import paired_difference

    cut = record("a", windows(0))
    cut["window_loss"] = cut["window_loss"][:-1]
    folder = write(tmp_path / "r", cut, record("b", windows(1)))
    assert fails(capsys, ["report", folder, "--paired", "a:b"], f"{folder}/records.jsonl: record 1 (perplexity, a)",
                 "'window_loss' has 15 entries and 'window_tokens' 16", "the file was changed")  # fmt: skip
    with pytest.raises(InputError, match="record of a has 15 window losses and 16 window token counts"):
        paired_difference(cut, record("b", windows(1)))


def test_records_say_which_tokens_their_windows_read(run, other_run, tmp_path):
    from attnlab.eval import load_for_eval
    from attnlab.eval.longctx import run_extrapolation
    from attnlab.eval.perplexity import run_perplexity

    a, b = load_for_eval(run), load_for_eval(other_run)  # the same text and tokenizer, other weights
    (row,) = run_extrapolation(a, factors=(1,), train_seq_len=16, max_tokens=64)
    assert row["status"] == "ok" and row["tokenizer"] == "char" and row["text_tokens"] > 64
    assert row["tokens_sha256"] == run_extrapolation(b, factors=(1,), train_seq_len=16, max_tokens=64)[0][
        "tokens_sha256"]  # fmt: skip
    first, second = (run_perplexity(m, "val", seq_len=16, max_tokens=64) for m in (a, b))
    assert len(first["tokens_sha256"]) == 16 and first["tokens_sha256"] == second["tokens_sha256"]
    assert first["tokens_sha256"] != run_perplexity(a, "val", seq_len=16, max_tokens=48)["tokens_sha256"]


# ----------------------------------------------------------------------------- KILL-bench: labels after a resume


def test_a_resumed_bench_labels_the_rest_as_an_uninterrupted_one(run, other_run, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main(["bench", str(run), str(other_run), *PERPLEXITY, "--out", str(whole)]) == 0
    labels = {r["model_path"]: r["model"] for r in read_records(whole / "records.jsonl")}
    assert len(set(labels.values())) == 2 and all(v.endswith("/runs/tiny/seed0") for v in labels.values())
    resumed.mkdir()
    first = [line for line in (whole / "records.jsonl").read_text().splitlines() if str(other_run) not in line]
    (resumed / "records.jsonl").write_text("\n".join(first) + "\n")  # as if killed before the second checkpoint
    assert main(["bench", str(run), str(other_run), *PERPLEXITY, "--out", str(resumed)]) == 0
    assert {r["model_path"]: r["model"] for r in read_records(resumed / "records.jsonl")} == labels


# ----------------------------------------------------------------------------- LOCK-run-fifo


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_where_the_run_lock_belongs_is_named(tmp_path, text, capsys):
    manifest = tmp_path / "m.yml"
    manifest.write_text(f"name: m\ndefaults:\n  model: {json.dumps(MODEL)}\n"
                        f"  data: {{source: {text}, tokenizer: char, val_fraction: 0.2}}\n"
                        "  train: {seq_len: 16, batch_size: 2, steps: 2, warmup_steps: 1, eval_every: 2, "
                        "eval_tokens: 32}\ntargets:\n  base: {}\n")  # fmt: skip
    out = tmp_path / "runs"
    run_dir = out / "m" / "base" / "seed0"
    run_dir.mkdir(parents=True)
    os.mkfifo(run_dir / "run.lock")
    command = ["run", str(manifest), "--out", str(out), "--no-progress"]
    line = fails(capsys, command, f"{run_dir}/run.lock: not a regular file (a fifo, device or socket)", "delete it")
    assert "where attnlab keeps its lock file" in line
    assert [p.name for p in run_dir.iterdir()] == ["run.lock"]  # nothing written, the fifo left as it was
    assert f"would be refused: {run_dir}/run.lock: not a regular file" in dry_run(capsys, [*command, "--dry-run"])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_folder_lock_refuses_a_fifo(tmp_path):
    from attnlab.data.files import folder_lock

    os.mkfifo(tmp_path / ".bench.lock")
    with pytest.raises(InputError, match=r"\.bench\.lock: not a regular file"):
        with folder_lock(tmp_path, ".bench.lock", lambda holder: "busy"):
            pass


# ----------------------------------------------------------------------------- ENV-xdg-empty-home-unset


def test_an_empty_xdg_cache_home_is_unset(tmp_path, monkeypatch):
    from attnlab.data.prepared import default_cache_dir
    from attnlab.paths import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert cache_dir() == tmp_path / ".cache" / "attnlab"  # not ./attnlab, in whatever folder the command runs
    assert default_cache_dir().is_relative_to(tmp_path / ".cache" / "attnlab")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x" / "attnlab"


# ----------------------------------------------------------------------------- KE-seqlen-1


def test_kv_eval_and_kv_tune_need_two_inputs_per_window(run, capsys):
    common = ["--split", "val", "--seq-len", "1", "--tokens", "64"]
    for command in (
        ["kv-eval", str(run), "--policies", "k=q8_0", *common],
        ["kv-tune", str(run), "--budget", "100", "--formats", "q8_0", "--resids", "0", *common],
    ):
        fails(capsys, command, "--seq-len 1: a window needs at least 2 inputs", "give --seq-len 2 or more")
    assert main(["kv-eval", str(run), "--policies", "k=q8_0", "--split", "val", "--seq-len", "2", "--tokens",
                 "16"]) == 0  # fmt: skip


def test_the_kv_quant_benchmark_checks_its_seq_len_before_anything_runs(run, tmp_path, capsys):
    from attnlab.eval.kvquant import evaluate_policies

    command = ["bench", str(run), "--benchmarks", "kv_quant", "--set", "kv_quant.split=val", "--set",
               "kv_quant.seq_len=1", "--out", str(tmp_path / "b")]  # fmt: skip
    assert fails(capsys, command, "kv_quant.seq_len=1: a window needs at least 2 inputs")
    assert not (tmp_path / "b" / "records.jsonl").exists()
    model = attnlab.build_model(attnlab.model_config_from_dict(MODEL))
    with pytest.raises(InputError, match="seq_len=1: a window needs at least 2 inputs"):
        evaluate_policies(model, torch.zeros(3, 2, dtype=torch.long), ["k=q8_0"])


# ----------------------------------------------------------------------------- INFO-kv-resid-eq-seq


def test_info_says_when_a_policy_quantizes_nothing_at_seq_len(tmp_path, capsys):
    config = tmp_path / "m.yaml"
    config.write_text("vocab_size: 97\nd_model: 64\nn_layers: 2\nn_heads: 2\nmax_seq_len: 256\n")
    assert main(["info", str(config), "--kv-policy", "k=q4_0,v=q4_0,resid=128", "--seq-len", "128"]) == 0
    out = capsys.readouterr().out
    assert ("nothing is quantized at seq_len 128: its residual window (resid=128) keeps all 128 tokens at full "
            "precision, so the total is the plain fp16 cache's") in out  # fmt: skip
    assert "give a longer --seq-len, or a smaller resid" in out
    for seq_len in ("129", "256"):  # a token past the window is quantized: the figures agree, nothing to say
        assert main(["info", str(config), "--kv-policy", "k=q4_0,v=q4_0,resid=128", "--seq-len", seq_len]) == 0
        assert "nothing is quantized" not in capsys.readouterr().out
    assert main(["info", str(config), "--seq-len", "128"]) == 0
    assert "nothing is quantized" not in capsys.readouterr().out


# ----------------------------------------------------------------------------- MC-file-fifo


@contextlib.contextmanager
def released(fifo: Path):
    """While the block runs, a writer opens and closes `fifo` whenever a reader waits on it: a reader that should not
    have opened it reads an empty file rather than waiting without end (so a test of the refusal cannot hang)."""
    done = threading.Event()

    def writer():
        while not done.is_set():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader yet (ENXIO)
                time.sleep(0.05)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_mc_refuses_a_fifo_as_its_task_file(run, tmp_path, capsys):
    from attnlab.eval.multiple_choice import load_arc_easy

    fifo = tmp_path / "arc.json"
    os.mkfifo(fifo)
    with released(fifo):
        fails(capsys, ["mc", "arc_easy", str(run), "--file", str(fifo), "--limit", "2"],
              f"--file {fifo}: not a regular file (a fifo, device or socket)", "give the task's data file")  # fmt: skip
        with pytest.raises(DataError, match="arc.json: not a regular file"):
            load_arc_easy(fifo)
        with pytest.raises(DataError, match="a folder: give the task's data file"):
            load_arc_easy(tmp_path)


def test_manifest_checks_stay_typed(tmp_path, llama, text):
    """The library raises the project's typed error, with every problem (here two) at once."""
    from attnlab.manifest import load_manifest

    manifest = retro_manifest(tmp_path, llama, text, f"{{model: {llama}, calibration_tokens: 1, calibrate_on: x.yml}}")
    with pytest.raises(ConfigError) as error:
        load_manifest(manifest)
    assert len(error.value.problems) == 2
