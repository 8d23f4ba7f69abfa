"""Probe AK's unclear items (/work/probe_ak/REPORT.md): a kv_policy a memory model cannot take named by its key and
model (AK8), a negative max_tokens called what it is (AK7), attention_maps regions a tokenizer cannot map told how
to give them (AK14), an effective_rank record without layers (AK6), and compare over two manifests' runs scored on
different held-out tokens (AK9). Its silent-wrong hand edits of records and summaries (AK2-5, AK10, AK13) are
refused by the records' seals: tests/test_record_seals.py. Each test fails with its fix backed out."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import fails

from attnlab.cli import main
from attnlab.eval.records import record_problem

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


@pytest.mark.parametrize("benchmark", ["memory", "latency"])
def test_ak8_a_kv_policy_a_memory_cannot_take_names_its_key_and_model(streaming_run, tmp_path, capsys, benchmark):
    argv = ["bench", str(streaming_run), "--benchmarks", benchmark, "--set", f"{benchmark}.kv_policy=k=q4_0,v=q4_0,"
            "resid=4", "--out", str(tmp_path / "out")]  # fmt: skip
    assert fails(capsys, argv, f"benchmarks.{benchmark}.kv_policy=k=q4_0,v=q4_0,resid=4 on tiny/seed0: ",
                 "resid=4", "(leave resid out)")  # fmt: skip
    assert not (tmp_path / "out").exists()  # said before anything ran


def test_ak7_a_negative_max_tokens_is_not_a_number_of_tokens(tiny_run, tmp_path, capsys):
    argv = ["bench", str(tiny_run), "--benchmarks", "perplexity", "--set", "perplexity.split=val", "--set",
            "perplexity.max_tokens=-5", "--out", str(tmp_path / "out")]  # fmt: skip
    line = fails(capsys, argv, "benchmarks.perplexity.max_tokens=-5 is not a number of tokens (give 2 or more")
    assert "too few" not in line


def test_ak14_regions_a_tokenizer_cannot_map_say_how_to_give_them(tiny_run, tmp_path, capsys):
    """The char tokenizer of a corpus without digits cannot decode the default prompt's pass key back."""
    argv = ["bench", str(tiny_run), "--benchmarks", "attention_maps", "--set", "attention_maps.prompt=The pass key "
            "is 4721.", "--out", str(tmp_path / "out")]  # fmt: skip
    assert fails(
        capsys,
        argv,
        "tokenizer 'char' does not decode the prompt back to itself",
        "give them in tokens "
        "(benchmarks.attention_maps.unit=tokens, benchmarks.attention_maps.regions={name: [start, end]}",
    )


def test_ak6_an_effective_rank_record_without_layers_is_refused():
    assert "field 'layers' is empty" in record_problem({"benchmark": "effective_rank", "model": "m", "layers": []})


def test_ak9_compare_says_when_rows_were_scored_on_different_tokens(tiny_run, tmp_path, capsys):
    for manifest in ("a", "b"):
        shutil.copytree(tiny_run.parent, tmp_path / "runs" / manifest / "tiny")
    config_path = tmp_path / "runs" / "b" / "tiny" / "seed0" / "config.json"
    config = json.loads(config_path.read_text())
    config["train"]["eval_tokens"] *= 2
    config_path.write_text(json.dumps(config))
    assert main(["compare", str(tmp_path / "runs"), "--out", str(tmp_path / "cmp")]) == 0
    err = capsys.readouterr().err
    said = "Rows scored on different held-out tokens (train.eval_tokens 256 in a/tiny, 512 in b/tiny)"
    assert said in err and said in (tmp_path / "cmp" / "compare.md").read_text(), err
    # one manifest's runs alone: nothing said
    assert main(["compare", str(tmp_path / "runs" / "a"), "--out", str(tmp_path / "cmp_a")]) == 0
    assert "held-out tokens" not in capsys.readouterr().err
