"""attnlab bench and report: strict plans, resumable records, reports rendered from records alone."""

import pytest
from helpers import train_tiny_run

from attnlab.cli import main
from attnlab.errors import ConfigError
from attnlab.eval.harness import load_plan
from attnlab.eval.records import read_records
from attnlab.eval.report import build_report


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny trained run (char tokenizer, 20 steps) to evaluate."""
    model = {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 4, "max_seq_len": 64}
    return train_tiny_run(tmp_path_factory.mktemp("bench"), model)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")


def test_plan_errors_name_the_nearest(tmp_path, checkpoint):
    with pytest.raises(ConfigError, match=r"unknown benchmark 'perplexty' \(did you mean 'perplexity'\?\)"):
        load_plan([str(checkpoint)], ["perplexty"])
    with pytest.raises(ConfigError, match=r"perplexity\.'splt' \(did you mean 'split'\?\)"):
        load_plan([str(checkpoint)], ["perplexity"], ["perplexity.splt=val"])
    with pytest.raises(ConfigError, match="not found"):
        load_plan([str(tmp_path / "nowhere")])
    manifest = tmp_path / "b.yml"
    manifest.write_text(f"checkpoints: [{checkpoint}]\nbenchmarks: {{needel: {{}}}}\nchekpoints: []\n")
    with pytest.raises(ConfigError) as info:
        load_plan([str(manifest)])
    assert "did you mean 'needle'" in str(info.value) and "did you mean 'checkpoints'" in str(info.value)


def test_bench_records_resume_and_report(tmp_path, checkpoint):
    out = tmp_path / "out"
    manifest = tmp_path / "bench.yml"
    manifest.write_text(
        f"name: tiny\ncheckpoints: ['{checkpoint.parent}/seed*']\nbenchmarks:\n"
        "  perplexity: {split: val, max_tokens: 200}\n  memory: {lengths: [16, 32]}\n"
        "  latency: {prompt_lengths: [8], new_tokens: 4, repeats: 2}\n"
        "  stream_loss: {length: 32, streams: 2, bucket: 8, split: val}\n"
    )
    assert main(["bench", str(manifest), "--out", str(out)]) == 0
    records = read_records(out / "records.jsonl")
    assert {r["benchmark"] for r in records} == {"perplexity", "memory", "latency", "stream_loss"}
    ppl = next(r for r in records if r["benchmark"] == "perplexity")
    assert ppl["model"] == "tiny/seed0" and ppl["split"] == "val" and ppl["tokens"] == 200
    assert ppl["params"] == {"split": "val", "seq_len": None, "stride": None, "max_tokens": 200, "dataset": None}
    assert all(r["kv_bytes"] == r["kv_bytes_analytic"] for r in records if r["benchmark"] == "memory")
    assert main(["bench", str(manifest), "--out", str(out)]) == 0  # everything recorded already: skipped
    assert len(read_records(out / "records.jsonl")) == len(records)

    result = build_report(out)
    assert set(result["tables"]) >= {"perplexity", "memory", "latency", "stream_loss"}
    assert (out / "stream_loss.png").exists() and "## Loss by position over long streams" in (
        out / "report.md"
    ).read_text()
    markdown = (out / "report.md").read_text()
    assert "## Held-out perplexity" in markdown and "tiny/seed0" in markdown
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(result["plots"]) >= 3
    assert (out / "tables" / "perplexity.csv").read_text().startswith("model,kind,split")
    assert "\\begin{tabular}" in (out / "tables" / "memory.tex").read_text()
    (out / "report.md").unlink()
    again = build_report(out)  # a pure function of the records
    assert (out / "report.md").read_text() == markdown and again["tables"] == result["tables"]


def test_report_without_records_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "records.jsonl not found" in capsys.readouterr().err


def test_bench_list_names_every_benchmark(capsys):
    from attnlab.eval.harness import BENCHMARKS

    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"{name}:" in out for name in BENCHMARKS)
