"""Probe M's findings (m8, a stream_loss that scored fewer streams than asked, is tested in tests/eval/test_longctx.py):
an empty setting named as empty (m2) and a latency bench's new_tokens=0 refused once, not twice (m10)."""

from __future__ import annotations

import pytest

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "offline")


def test_an_empty_setting_says_it_is_empty(tmp_path, capsys):
    """m2: `--set train.distributed=` (null) said "train.distributed=None must be str, got NoneType"."""
    manifest = tmp_path / "m.yml"
    manifest.write_text("name: m\ndefaults:\n  model: {vocab_size: 97, d_model: 32, n_layers: 1, n_heads: 4, "
                        "max_seq_len: 32}\n  data: {source: tinyshakespeare, tokenizer: char}\n"
                        "targets:\n  base: {}\n")  # fmt: skip
    assert main(["validate", str(manifest), "--set", "train.distributed="]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "targets.base: train.distributed is empty (null) but must be str: give it" in err
    assert "NoneType" not in err and "Traceback" not in err


def test_a_latency_bench_of_no_new_tokens_is_refused_once():
    """m10: latency.new_tokens=0 was refused twice in one line ("must be >= 1; ... must be >= 2")."""
    from attnlab.eval.harness import check_benchmarks

    for value in (0, 1):
        [problem] = check_benchmarks({"latency": {"new_tokens": value}})
        assert problem.startswith(f"benchmarks.latency.new_tokens={value} must be >= 2 (the first token ends"), problem
    assert check_benchmarks({"latency": {"new_tokens": 2}}) == []
    assert check_benchmarks({"latency": {"repeats": 0}}) == ["benchmarks.latency.repeats=0 must be >= 1"]
