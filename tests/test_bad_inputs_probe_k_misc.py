"""Probe K's findings in probe suites, conversions and memory states: a first_line case whose expected answer holds
a line break was accepted and silently scored a miss on every model (k41); `convert --attention kind=mha,n_kv_heads=
<the source's> --memory kind=none` wrote an identical copy with exit 0, where no flags at all is "nothing to convert"
(k46); and a query of a truncated memory state named the file but no fix (k17). Each now ends in one line naming the
case, flags or file and the fix."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from helpers import PROBE_MODEL, fails, train_tiny_run

from attnlab.cli import main
from attnlab.errors import ConfigError
from attnlab.eval.probes import check_output, suite_from_dict

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

generate_module = importlib.import_module("attnlab.generate")  # the module (attnlab.generate is the function)
MEMORY_MODEL = {**PROBE_MODEL, "memory": {"kind": "bounded", "recent_window": 16, "exact_slots": 4,
                                          "summary_slots": 4}}  # fmt: skip


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    # Each command loads its model anew: compiling its decode step would cost seconds per call, for nothing here.
    monkeypatch.setattr(generate_module, "can_compile_on_cpu", lambda: False)


def suite(**case) -> dict:
    return {"name": "s", "description": "d", "cases": [{"id": "a", "category": "c", "prompt": "the", **case}]}


# ----------------------------------------------------------------------------- k41


@pytest.mark.parametrize("expected", ["a\nb", "a\r\nb", "a\rb", "a\u2028b", "  a\n\nb  "])
def test_a_first_line_case_whose_expected_answer_holds_a_line_break_is_refused(expected):
    """It was accepted, and the first line of an output never holds a line break: a miss on every model."""
    message = (f"s.yml: cases[0] (id 'a'): expected={expected!r} holds a line break, which kind 'first_line' can "
               "never match (it compares the first line of the output alone): use kind exact or contains")  # fmt: skip
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        suite_from_dict(suite(kind="first_line", expected=expected), source="s.yml")
    # The kind from defaults is checked too.
    data = {**suite(expected=expected), "defaults": {"kind": "first_line"}}
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        suite_from_dict(data, source="s.yml")


def test_line_breaks_that_the_kinds_can_match_are_accepted():
    # Surrounding whitespace is stripped before comparing; exact and contains compare across lines.
    loaded = suite_from_dict(suite(kind="first_line", expected="a b\n"))
    assert check_output(loaded.cases[0], "\n a b \nc")
    for kind in ("exact", "contains"):
        loaded = suite_from_dict(suite(kind=kind, expected="a\nb"))
        assert check_output(loaded.cases[0], "a\nb")


# ----------------------------------------------------------------------------- k46


@pytest.mark.parametrize(("flags", "asked"), [
    (["--attention", "kind=mha,n_kv_heads=2", "--memory", "kind=none"],
     "--attention kind=mha,n_kv_heads=2 --memory kind=none"),
    (["--attention", "kind=mha"], "--attention kind=mha"),
    (["--memory", "kind=none"], "--memory kind=none"),
])  # fmt: skip
def test_a_conversion_to_what_the_model_already_is_is_refused(tiny_run, tmp_path, capsys, flags, asked):
    """It wrote an identical copy with exit 0 (no flags at all is refused as nothing to convert)."""
    out = tmp_path / "c"
    line = fails(capsys, ["convert", str(tiny_run), "--out", str(out), "--eval-tokens", "0", *flags])
    assert line == (f"attnlab convert: error: nothing to convert: {asked} asks for {tiny_run} as it already is: "
                    "attention mha with 2 KV heads for its 2 query heads, head_dim 16, and no memory; give an "
                    "attention or a memory it does not have (e.g. --attention kind=mha,n_kv_heads=1)")  # fmt: skip
    assert not out.exists()


# ----------------------------------------------------------------------------- k17


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory) -> Path:
    """A tiny trained run whose model has a bounded memory."""
    return train_tiny_run(tmp_path_factory.mktemp("memory"), MEMORY_MODEL, steps=4)


def test_a_truncated_memory_state_says_to_re_ingest_or_remove_it(memory_run, tmp_path, capsys):
    """It named the file and 'truncated or damaged', and no way out (the swapped-file case says re-ingest it)."""
    doc, store = tmp_path / "doc.txt", tmp_path / "store"
    doc.write_text("the cat sat on the mat by the red door")
    assert main(["memory", "ingest", str(memory_run), str(doc), "--name", "doc", "--store", str(store)]) == 0
    capsys.readouterr()
    (state,) = (store / "states").glob("*.safetensors")
    written = state.read_bytes()
    state.write_bytes(written[:5000])
    query = ["memory", "query", "doc", "the", "--store", str(store), "--max-new-tokens", "2"]
    line = fails(capsys, query)
    assert re.fullmatch(
        rf"attnlab memory query: error: {re.escape(str(state))}: not a readable memory state \(truncated or damaged: "
        r".+\); re-ingest memory 'doc' \(attnlab memory ingest MODEL DOCS --name doc --replace\) or remove it "
        r"\(attnlab memory rm doc\)",
        line,
    ), line
    # A state changed in place (its checksum) says the same way out, once.
    state.write_bytes(written[:-1] + bytes([written[-1] ^ 1]))
    assert fails(capsys, query) == (
        f"attnlab memory query: error: {state}: checksum mismatch: the memory state was modified or damaged after it "
        "was written; re-ingest memory 'doc' (attnlab memory ingest MODEL DOCS --name doc --replace) or remove it "
        "(attnlab memory rm doc)"
    )
    assert main(["memory", "rm", "doc", "--store", str(store)]) == 0
    assert not state.exists()
