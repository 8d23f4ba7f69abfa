"""Probe T's findings on memories: an option of another memory kind written at its default value (sink_tokens: 4
under window, bounded or h2o; tau_gate: 0.5 under window) was accepted and stored in the config, doing nothing, in a
YAML file, --set, `info --memory`, `convert --memory` and model_config_from_dict (m1); `memory ls` listed a row
changed by hand into values the store never writes (tokens -5, created 'garbage') as if intact (m2); the memory
subcommands' errors began `attnlab memory: error:`, where argparse's own say `attnlab memory query: error:` (m3)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from helpers import PROBE_MODEL, fails, hat_text, probe_manifest, train_tiny_run

from attnlab.cli import main
from attnlab.config import ConfigError
from attnlab.config_io import model_config_from_dict
from attnlab.config_memory import MEMORY_KINDS, MEMORY_OPTIONS, MEMORY_PRESETS, MemoryConfig
from attnlab.manifest import deep_merge

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = "{seq_len: 16, batch_size: 2, steps: 2, warmup_steps: 1, eval_every: 2, eval_tokens: 32}"
# Each written at its default value, under a kind that does not read it.
AT_DEFAULT = [
    ("window", "sink_tokens", 4, "memory.sink_tokens belongs to memory.kind streaming or quest, not window"),
    ("bounded", "sink_tokens", 4, "memory.sink_tokens belongs to memory.kind streaming or quest, not bounded"),
    ("h2o", "sink_tokens", 4, "memory.sink_tokens belongs to memory.kind streaming or quest, not h2o"),
    ("window", "tau_gate", 0.5, "memory.tau_gate belongs to memory.kind bounded, not window"),
    ("streaming", "heavy_slots", 32, "memory.heavy_slots belongs to memory.kind h2o, not streaming"),
    ("h2o", "preset", "attnlab", "memory.preset belongs to memory.kind bounded, not h2o"),
    ("quest", "detach_evicted", True, "memory.detach_evicted belongs to memory.kind bounded, not quest"),
]
KIND_EXAMPLES = {
    "window": {"kind": "window", "recent_window": 16},
    "streaming": {"kind": "streaming", "recent_window": 16, "sink_tokens": 2},
    "h2o": {"kind": "h2o", "recent_window": 16, "heavy_slots": 4},
    "bounded": {"kind": "bounded", "recent_window": 16, "exact_slots": 4, "summary_slots": 4},
    "bounded-reference": {"kind": "bounded", "recent_window": 16, "preset": "reference"},
    "quest": {"kind": "quest", "recent_window": 16, "page_size": 4, "pages": 2},
    "snapkv": {"kind": "snapkv", "budget": 16},
}


# ----------------------------------------------------------------------------- m1: another kind's option, written


@pytest.mark.parametrize("kind, key, value, fragment", AT_DEFAULT)
def test_m1_another_kinds_option_is_refused_at_its_default_too(kind, key, value, fragment):
    memory = {"kind": kind, "recent_window": 16, key: value}
    if kind == "quest":
        memory.update(page_size=4)
    with pytest.raises(ConfigError) as caught:
        model_config_from_dict({**PROBE_MODEL, "memory": memory})
    owner = [k for k, options in MEMORY_OPTIONS.items() if key in options][0]
    assert str(caught.value).count("\n") == 0, str(caught.value)
    assert fragment in str(caught.value) and f"(remove it, or set memory.kind: {owner})" in str(caught.value)


def test_m1_every_kind_refuses_every_option_it_does_not_read():
    names = {f for options in MEMORY_OPTIONS.values() for f in options}
    for kind in MEMORY_KINDS:
        for key in sorted(names - set(MEMORY_OPTIONS[kind])):
            default = MEMORY_PRESETS["attnlab"].get(key, getattr(MemoryConfig(), key))
            with pytest.raises(ConfigError, match=f"memory.{key} belongs to memory.kind .*, not {kind} "):
                model_config_from_dict({**PROBE_MODEL, "memory": {"kind": kind, key: default}})


@pytest.mark.parametrize("name", sorted(KIND_EXAMPLES))
def test_m1_a_saved_config_reads_back(name):
    """to_dict writes the first options' defaults under every kind (a config's hash and a memory state's check stay
    as they were): read as saved, it gives the same config; written by hand, those keys are refused."""
    cfg = model_config_from_dict({**PROBE_MODEL, "memory": KIND_EXAMPLES[name]})
    saved = json.loads(json.dumps(cfg.to_dict()))
    again = model_config_from_dict(saved, saved=True)
    assert again == cfg and again.config_hash() == cfg.config_hash()
    if name != "bounded-reference":  # (the reference preset's options are all the bounded memory's own)
        with pytest.raises(ConfigError, match="belongs to memory.kind"):
            model_config_from_dict(saved)


def test_m1_the_presets_fill_options_the_config_leaves_out():
    """What a preset fills is not written by the user: a bounded memory under either preset is accepted."""
    for preset in MEMORY_PRESETS:
        cfg = model_config_from_dict({**PROBE_MODEL, "memory": {"kind": "bounded", "preset": preset}})
        assert cfg.memory.tau_gate == MEMORY_PRESETS[preset]["tau_gate"]


def test_m1_validate_and_run_refuse_it_through_set(tmp_path, capsys):
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN)
    memory = "model.memory={kind: window, recent_window: 16, sink_tokens: 4}"
    assert main(["validate", str(manifest), "--set", memory]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "memory.sink_tokens belongs to memory.kind streaming or quest, not window" in err, err
    out = tmp_path / "out"
    fails(capsys, ["run", str(manifest), "--out", str(out), "--set", memory], "memory.sink_tokens belongs to")
    assert not out.exists()
    manifest.write_text(manifest.read_text().replace("max_seq_len: 64}", "max_seq_len: 64, memory: {kind: window, "
                                                     "recent_window: 16, tau_gate: 0.5}}"))  # fmt: skip
    assert main(["validate", str(manifest)]) == 2
    assert "memory.tau_gate belongs to memory.kind bounded, not window" in capsys.readouterr().err


def test_m1_a_manifest_target_of_another_memory_kind_does_not_inherit_the_defaults_options():
    """As for attention: a target that changes memory.kind starts from that kind's defaults, not the options of
    the defaults' kind (which it would now be refused for)."""
    defaults = {"model": {"memory": {"kind": "streaming", "recent_window": 16, "sink_tokens": 4}}}
    merged = deep_merge(defaults, {"model": {"memory": {"kind": "window", "recent_window": 8}}})
    assert merged["model"]["memory"] == {"kind": "window", "recent_window": 8}
    same = deep_merge(defaults, {"model": {"memory": {"recent_window": 8}}})
    assert same["model"]["memory"] == {"kind": "streaming", "recent_window": 8, "sink_tokens": 4}


@pytest.fixture(scope="module")
def window_run(tmp_path_factory) -> Path:
    memory = {"kind": "window", "recent_window": 8}
    return train_tiny_run(tmp_path_factory.mktemp("window"), {**PROBE_MODEL, "memory": memory}, steps=2)


@pytest.mark.parametrize("option", ["sink_tokens=4", "tau_gate=0.5", "heavy_slots=32"])
def test_m1_info_and_convert_refuse_it_in_memory(window_run, tmp_path, capsys, option):
    memory = f"kind=window,recent_window=8,{option}"
    key = option.split("=")[0]
    fails(capsys, ["info", str(window_run), "--memory", memory], f"memory.{key} belongs to memory.kind")
    out = tmp_path / "conv"
    fails(capsys, ["convert", str(window_run), "--memory", memory, "--out", str(out), "--eval-tokens", "0"],
          f"memory.{key} belongs to memory.kind")  # fmt: skip
    assert not out.exists()


def test_m1_a_run_with_a_memory_still_reads_back(window_run, tmp_path, capsys):
    """Its config.json carries sink_tokens, tau_gate, ... at their defaults (to_dict): info, convert and a
    conversion's own folder read it."""
    saved = json.loads((window_run / "config.json").read_text())["model"]["memory"]
    assert saved["sink_tokens"] == 4 and saved["tau_gate"] == 0.5  # (what makes this test one)
    assert main(["info", str(window_run)]) == 0
    assert main(["info", str(window_run), "--memory", "kind=streaming,recent_window=8,sink_tokens=4"]) == 0
    out = tmp_path / "conv"
    argv = ["convert", str(window_run), "--attention", "kind=mha,n_kv_heads=1", "--out", str(out), "--eval-tokens", "0"]
    assert main(argv) == 0  # (the source's memory kept, as saved)
    assert main(["info", str(out)]) == 0
    capsys.readouterr()


# ----------------------------------------------------------------------------- m2: a damaged row in `memory ls`


@pytest.fixture(scope="module")
def bounded_run(tmp_path_factory) -> Path:
    memory = {"kind": "bounded", "recent_window": 8, "exact_slots": 4, "summary_slots": 4}
    return train_tiny_run(tmp_path_factory.mktemp("bounded"), {**PROBE_MODEL, "memory": memory}, steps=2)


@pytest.mark.parametrize(
    "change, shown",
    [
        ("tokens = -5, created = 'garbage'", "tokens=-5 (below 0), created='garbage' (not an ISO 8601 time)"),
        ("bytes = -1", "bytes=-1 (below 0)"),
        ("tokens = 'many'", "tokens='many'"),
        ("documents = '{\"a\": 1}'", "documents (not a JSON list)"),
    ],
)
def test_m2_ls_marks_a_damaged_row_and_rm_removes_it(bounded_run, tmp_path, capsys, monkeypatch, change, shown):
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")
    doc, store = tmp_path / "doc.txt", tmp_path / "store"
    doc.write_text("the cat sat on the mat " * 20)
    ingest = ["memory", "ingest", str(bounded_run), str(doc), "--store", str(store), "--no-progress"]
    assert main([*ingest, "--name", "notes"]) == 0 and main([*ingest, "--name", "other"]) == 0
    with sqlite3.connect(store / "index.sqlite") as index:  # what a hand edit does
        index.execute(f"UPDATE states SET {change} WHERE name = 'notes'")
    capsys.readouterr()
    assert main(["memory", "ls", "--store", str(store)]) == 0
    lines = capsys.readouterr().out.splitlines()
    damaged = next(line for line in lines if line.startswith("notes "))
    assert damaged.split(" (")[0].split() == ["notes", "?", "?", "?", "?"]  # its values are not listed as the state's
    assert f"(its row was changed by hand into values the store never writes: {shown}; `attnlab memory rm notes`)" in (
        damaged
    ), damaged
    other = next(line for line in lines if line.startswith("other "))
    assert "460" in other and "(" not in other  # the intact row as before
    fails(capsys, ["memory", "query", "notes", "the", "--store", str(store)], "the row of memory 'notes' is damaged",
          shown, "`attnlab memory rm notes` it")  # fmt: skip
    files = sorted((store / "states").iterdir())
    assert main(["memory", "rm", "notes", "--store", str(store)]) == 0  # what ls and query say to do
    assert "removed notes (states/notes-" in capsys.readouterr().out
    assert len(list((store / "states").iterdir())) == len(files) - 1  # its state file went with it
    assert main(["memory", "ls", "--store", str(store)]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["name", "other"]


# ----------------------------------------------------------------------------- m3: the subcommand in the line


@pytest.mark.parametrize("verb", ["rm", "query"])
def test_m3_a_memory_subcommands_error_line_names_it(tmp_path, capsys, verb):
    argv = ["memory", verb, "nothing", *(["the cat"] if verb == "query" else []), "--store", str(tmp_path / "s")]
    (tmp_path / "s").mkdir()  # (a store that is not there is refused before any name is looked up)
    assert main(argv) == 2
    err = capsys.readouterr().err
    said = f"no memory named 'nothing' in {tmp_path / 's'} (`attnlab memory ls` lists them)"
    assert err == f"attnlab memory {verb}: error: {said}\n", err
