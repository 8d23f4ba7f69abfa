"""Probe G's findings in bench, report, compare, validate and info: benchmarks that measured nothing and said
nothing (lengths past the context, a needle too short for its prompt), caches far beyond this machine's memory,
a perplexity interval over one token, latency parameters refused after loading and with conditions that held,
`bench --list` with a stray argument, compare replacing the user's own compare.md, what is in the way of a
report or comparison, a file-size limit that named no file, a missing-glyph warning of matplotlib, and validate
ignoring --set, reading a GGUF file as text and a run's or Hugging Face's saved config as a model config."""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path

import pytest
from helpers import fails, train_tiny_run

import attnlab.eval.harness as harness
from attnlab.cli import main
from attnlab.data.files import sealed
from attnlab.eval.bench_checks import status_notes, unmeasured_problem
from attnlab.eval.report import build_report


@pytest.fixture(scope="module")
def run(tiny_run):
    return tiny_run


pytestmark = pytest.mark.usefixtures("one_thread", "offline")

MODEL = {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a model fails the test: what is refused is refused before."""

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(harness, "load_for_eval", load)


def bench(run, out, benchmark, *sets):
    argv = ["bench", str(run), "--benchmarks", benchmark, "--out", str(out)]
    for item in sets:
        argv += ["--set", item]
    return argv


@pytest.mark.parametrize(
    "benchmark, sets, fragments",
    [
        ("latency", ["latency.prompt_lengths=[60]", "latency.new_tokens=10", "latency.repeats=1"],
         ["benchmarks.latency: prompt 60 + 10 new tokens exceed tiny/seed0's max_seq_len 64",
          "nothing would be measured", "prompt lengths <= 55"]),
        ("memory", ["memory.lengths=[100000000]"], ["benchmarks.memory.lengths=[100000000]", "max_seq_len 64"]),
        ("stream_loss", ["stream_loss.length=100", "stream_loss.bucket=8"],
         ["benchmarks.stream_loss.length=100", "max_seq_len 64", "nothing would be measured"]),
        ("needle", ["needle.lengths=[1000]", "needle.trials=1"], ["benchmarks.needle.lengths=[1000]", "<= 64"]),
        ("context_sweep", ["context_sweep.lengths=[32,1000]", "context_sweep.chunk_size=16"],
         ["benchmarks.context_sweep.lengths=[32, 1000]: 1000 exceeds", "it would not be measured"]),
    ],
)  # fmt: skip
def test_lengths_past_the_context_are_refused_before_loading(run, tmp_path, capsys, no_loading, benchmark, sets,
                                                            fragments):  # fmt: skip
    assert fails(capsys, bench(run, tmp_path / "o", benchmark, *sets), *fragments)
    assert not (tmp_path / "o" / "records.jsonl").exists()


def test_factors_past_the_context_are_refused(run, tmp_path, capsys):
    argv = bench(
        run,
        tmp_path / "o",
        "rope_extrapolation",
        "rope_extrapolation.factors=[1,100]",
        "rope_extrapolation.max_tokens=512",
    )
    assert fails(capsys, argv, "benchmarks.rope_extrapolation.factors=[1, 100]: 100 x the training context 32",
                 "max_seq_len 64", "factors <= 2")  # fmt: skip


def test_a_memory_model_reads_past_its_context(tmp_path, capsys):
    memory = {"kind": "bounded", "recent_window": 16, "exact_slots": 4, "summary_slots": 4}
    run = train_tiny_run(tmp_path, {**MODEL, "memory": memory}, steps=2)
    argv = bench(run, tmp_path / "o", "stream_loss", "stream_loss.length=100", "stream_loss.streams=1",
                 "stream_loss.bucket=10", "stream_loss.split=val")  # fmt: skip
    assert main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "o" / "records.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records] == ["ok"]


def test_a_needle_too_short_for_its_prompt_is_refused():
    # (the tiny runs' char vocabulary cannot spell a passkey: the harness's check is called as run_plan calls it)
    records = [{"benchmark": "needle", "length": 48, "status": "too_short", "needs": 60}] * 2
    line = unmeasured_problem("needle", records, "base/seed0")
    assert "benchmarks.needle: lengths 48 are too short on base/seed0" in line and "nothing would be measured" in line
    assert line.endswith("give lengths >= 60")
    assert unmeasured_problem("needle", [*records, {"length": 64, "status": "ok"}], "base/seed0") is None


@pytest.mark.parametrize(
    "benchmark, sets, fragments",
    [
        ("memory", ["memory.batch_size=100000000", "memory.lengths=[64]"],
         ["benchmarks.memory.batch_size=100,000,000 needs", "of KV cache on tiny/seed0", "this machine has",
          "give at most"]),
        ("latency", ["latency.batch_sizes=[100000000]", "latency.prompt_lengths=[8]", "latency.new_tokens=2"],
         ["benchmarks.latency.batch_sizes=100,000,000 needs", "give at most"]),
    ],
)  # fmt: skip
def test_a_cache_beyond_this_machine_is_refused_before_loading(run, tmp_path, capsys, no_loading, benchmark, sets,
                                                               fragments):  # fmt: skip
    assert fails(capsys, bench(run, tmp_path / "o", benchmark, *sets), *fragments)


def test_latency_names_only_the_condition_violated_before_loading(run, tmp_path, capsys, no_loading):
    argv = bench(run, tmp_path / "o", "latency", "latency.new_tokens=1", "latency.prompt_lengths=[8]")
    line = fails(capsys, argv, "benchmarks.latency.new_tokens=1 must be >= 2")
    assert "repeats" not in line and "warmup" not in line


def test_a_perplexity_over_too_few_tokens_for_an_interval_is_refused(run, tmp_path, capsys, no_loading):
    argv = bench(run, tmp_path / "o", "perplexity", "perplexity.max_tokens=1", "perplexity.split=val")
    assert fails(capsys, argv, "benchmarks.perplexity.max_tokens=1 is too few for an interval", "2 tokens")


def test_a_perplexity_of_one_window_is_refused(run, tmp_path, capsys):
    argv = bench(run, tmp_path / "o", "perplexity", "perplexity.max_tokens=16", "perplexity.split=val",
                 "perplexity.seq_len=16")  # fmt: skip
    assert fails(capsys, argv, "max_tokens=16", "single window", "max_tokens > 16")


def test_default_lengths_past_the_context_are_said_and_the_rest_measured(run, tmp_path, capsys):
    argv = bench(run, tmp_path / "o", "rope_extrapolation", "rope_extrapolation.max_tokens=256")
    assert main(argv) == 0
    assert "factors 4 x the training context 32 exceed max_seq_len 64: recorded as too_long" in capsys.readouterr().out
    result = build_report(tmp_path / "o")
    assert any("rope_extrapolation record of tiny/seed0 measured nothing: too_long" in n for n in result["notes"])


def test_a_report_notes_records_that_measured_nothing(tmp_path):
    folder = tmp_path / "b"
    folder.mkdir()
    record = sealed({"benchmark": "latency", "model": "m", "kind": "mha", "status": "too_long", "prompt_length": 60})
    (folder / "records.jsonl").write_text(json.dumps(record) + "\n")
    result = build_report(folder)
    assert result["notes"] == ["1 latency record of m measured nothing: too_long (past the model's context "
                               "(max_seq_len))."]  # fmt: skip
    assert "measured nothing: too_long" in (folder / "report.md").read_text()
    assert status_notes([{**record, "status": "ok"}]) == []


def test_bench_list_refuses_a_stray_argument(capsys):
    assert fails(capsys, ["bench", "--list", "extra"], "--list", "extra")


@pytest.fixture(scope="module")
def runs(run):
    """The folder of the tiny run's manifest (what `attnlab compare` takes)."""
    return run.parent.parent


def test_compare_never_replaces_the_users_own_files(runs, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "compare.md").write_text("my precious notes\n")
    assert fails(capsys, ["compare", str(runs), "--out", str(out)], f"{out / 'compare.md'}: not a file attnlab "
                 "compare wrote", "move it away, or give another --out")  # fmt: skip
    assert (out / "compare.md").read_text() == "my precious notes\n" and sorted(os.listdir(out)) == ["compare.md"]
    (out / "compare.md").unlink()
    assert main(["compare", str(runs), "--out", str(out)]) == 0  # its own files it replaces
    assert main(["compare", str(runs), "--out", str(out)]) == 0
    (out / "compare.csv").write_text("a,b\n1,2\n")
    assert fails(capsys, ["compare", str(runs), "--out", str(out)], "compare.csv: not a file attnlab compare wrote")


def test_what_is_in_the_way_of_compare_and_report_is_said(runs, tmp_path, capsys):
    (tmp_path / "c" / "compare.md").mkdir(parents=True)
    line = fails(capsys, ["compare", str(runs), "--out", str(tmp_path / "c")], "compare.md: a folder where compare "
                 "writes its compare.md: move it away, or give another --out")  # fmt: skip
    assert "give a file's path" not in line
    record = sealed({"benchmark": "latency", "model": "m", "kind": "mha", "status": "too_long", "prompt_length": 60})
    for name, make in (("report.md", "mkdir"), ("tables", "touch"), ("report.html", "mkdir")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "records.jsonl").write_text(json.dumps(record) + "\n")
        getattr(folder / name, make)()
        what = "a file" if make == "touch" else "a folder"
        line = fails(capsys, ["report", str(folder)], f"{folder / name}: {what} where the report writes its {name}",
                     "move it away")  # fmt: skip
        assert "path)" not in line and not (folder / "report.md").is_file()


def test_a_plot_past_a_file_size_limit_is_named(runs, tmp_path, capsys, monkeypatch):
    import attnlab.compare as compare

    def too_large(runs, path):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(compare, "plot_val_loss", too_large)
    out = tmp_path / "o"
    assert fails(capsys, ["compare", str(runs), "--out", str(out)], f"{out / 'val_loss.png'}: file too large")
    assert not (out / "val_loss.png").exists()


def test_a_name_the_font_cannot_draw_warns_nothing(tmp_path):
    from attnlab.eval.plots import plot_val_loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plot_val_loss([{"target": "名前", "phase": None, "val_curve": [(1, 2.0), (2, 1.5)]}], tmp_path / "p.png")
    assert not [w for w in caught if "Glyph" in str(w.message)] and (tmp_path / "p.png").is_file()


def model_yaml(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("vocab_size: 40\nd_model: 32\nn_layers: 1\nn_heads: 4\nmax_seq_len: 64\n")
    return path


def validate_lines(capsys, *argv) -> list[str]:
    assert main(["validate", *map(str, argv)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err.strip().splitlines()


def test_validate_refuses_a_set_no_file_of_its_kind_reads(tmp_path, capsys):
    config = model_yaml(tmp_path)
    [line] = validate_lines(capsys, config, "--set", "attention.n_kv_heads=3")
    assert line == f"{config}: --set applies to experiment and benchmark manifests only (this is a model config: " \
        "edit the file)"  # fmt: skip
    suite = tmp_path / "s.yml"
    suite.write_text("name: s\ncases: [{id: a, prompt: x, expected: y}]\n")
    [line] = validate_lines(capsys, suite, "--set", "defaults.kind=exact")
    assert "--set applies to experiment and benchmark manifests only (this is a probe suite" in line
    assert main(["validate", str(config)]) == 0


def test_validate_says_a_gguf_file_is_a_model_not_a_config(tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(256)))
    [line] = validate_lines(capsys, gguf)
    assert f"{gguf}: a GGUF model file, not a config" in line and f"attnlab info {gguf}" in line
    assert "UTF-8" not in line


def test_validate_and_info_say_a_runs_or_hugging_faces_config_is_not_a_model_config(run, tmp_path, capsys):
    saved_configs = [run / name for name in ("config.yaml", "config.json") if (run / name).exists()]
    assert saved_configs
    for saved in saved_configs:
        [line] = validate_lines(capsys, saved)
        assert f"{saved}: an attnlab run's saved config (model, data, train), not a model config" in line
        assert f"attnlab info {run}" in line and "missing key" not in line
        assert fails(capsys, ["info", str(saved)], "an attnlab run's saved config", "give its folder")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 40, "hidden_size": 32}))
    [line] = validate_lines(capsys, hf / "config.json")
    assert "a Hugging Face model's config (model_type), not an attnlab model config" in line
    assert "did you mean" not in line
    typo = tmp_path / "typo.yaml"
    typo.write_text("vocab_size: 40\nd_model: 32\nn_layers: 1\nn_heds: 4\n")  # a model config's mistakes stay said
    assert any("did you mean 'n_heads'" in line for line in validate_lines(capsys, typo))


@pytest.mark.parametrize(("benchmark", "param"), [("perplexity", "split=nosuch"), ("kv_quant", "split=tset"),
                                                  ("effective_rank", "split=[val]")])  # fmt: skip
def test_a_split_no_dataset_has_is_refused_before_loading(run, tmp_path, capsys, no_loading, benchmark, param):
    """va4: a split name no prepared dataset has (train, val or test) was only found once the model was loaded."""
    argv = ["bench", str(run), "--benchmarks", benchmark, "--set", f"{benchmark}.{param}", "--out", str(tmp_path)]
    assert fails(capsys, argv, f"benchmarks.{benchmark}.split=")
