"""Probe W's unclear findings and nits (/work/probe_w/REPORT.md): `bench`, `mc`, `probes`, `kv-eval`, `kv-tune`,
`lm-eval` and `memory ingest` wrote into a run's folder, where `compare`, `convert` and `export` refuse to; `memory
ls` listed a state file cut short and a row whose tokens its documents contradict as intact; a bottleneck attention
as wide as d_model (plain mha) and an MLA latent wider than d_model were accepted; kv-tune took a negative
--max-dnll and formats or residual windows given twice; a low-rank conversion fitted on fewer calibration tokens
than d_model; a summary.json with a status attnlab never writes was taken for a finished run; the manifest
docstring's example of a target continuing another was refused. And what a KV policy does to a memory model."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import (
    PROBE_MODEL,
    dry_run,
    fails,
    hat_text,
    probe_manifest,
    snapshot,
    tiny_model,
    train_tiny_run,
    unsealed,
)

import attnlab.manifest
from attnlab.cli import main
from attnlab.config_io import model_config_from_dict
from attnlab.errors import ConfigError
from attnlab.eval.records import records_in_run_problem
from attnlab.interop.convert import calibration_minimum

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

BOUNDED = {"kind": "bounded", "recent_window": 8, "exact_slots": 4, "summary_slots": 4}


@pytest.fixture(scope="module")
def bounded_run(tmp_path_factory) -> Path:
    """A tiny run of a model with a bounded memory (what `memory ingest` takes)."""
    return train_tiny_run(tmp_path_factory.mktemp("bounded"), {**PROBE_MODEL, "memory": BOUNDED}, steps=2)


def run_copy(tiny_run: Path, tmp_path: Path) -> Path:
    """A copy of the tiny run at tmp_path/out/m/base/seed0 (a refused command must leave it as it is), and a document
    to ingest at tmp_path/doc.txt."""
    run = tmp_path / "out" / "m" / "base" / "seed0"
    shutil.copytree(tiny_run, run)
    (tmp_path / "doc.txt").write_text("the cat sat on the mat " * 20)
    return run


# ----------------------------------------------------------------------------- eval records into a run's folder

# (argv given the run's folder, the model run and a store/records path) -> the fix the refusal names
INTO_A_RUN = {
    "bench": (lambda run, model, at: ["bench", str(run), "--benchmarks", "perplexity", "--out", str(at)],
              "give --out a folder outside the run, e.g. --out results/bench"),
    "mc": (lambda run, model, at: ["mc", "arc_easy", str(run), "--out", str(at)],
           "give --out a folder outside the run, e.g. --out results"),
    "probes": (lambda run, model, at: ["probes", "configs/probes/core.yml", str(run), "--out", str(at)],
               "give --out a folder outside the run, e.g. --out results"),
    "kv-eval file": (lambda run, model, at: ["kv-eval", str(run), "--policies", "k=q8_0", "--split", "val", "--out",
                                             str(at / "kv.jsonl")], "give --out a file outside the run, e.g. --out "
                     "results/kv.jsonl"),
    "kv-eval folder": (lambda run, model, at: ["kv-eval", str(run), "--policies", "k=q8_0", "--split", "val", "--out",
                                               f"{at}/"], "give --out a folder outside the run, e.g. --out results/"),
    "kv-tune": (lambda run, model, at: ["kv-tune", str(run), "--budget", "100", "--split", "val", "--out",
                                        str(at / "kv.jsonl")], "e.g. --out results/kv.jsonl"),
    "lm-eval": (lambda run, model, at: ["lm-eval", str(run), "--tasks", "arc_easy", "--out", str(at / "lm")],
                "give --out a folder outside the run, e.g. --out results/lm_eval"),
    "memory ingest": (lambda run, model, at: ["memory", "ingest", str(model), str(run.parents[3] / "doc.txt"),
                                              "--name", "n", "--store", str(at), "--no-progress"],
                      "give --store a folder outside the run, e.g. --store memories"),
}  # fmt: skip


@pytest.mark.parametrize("inside", [False, True], ids=["the run", "a folder in it"])
@pytest.mark.parametrize("command", list(INTO_A_RUN))
def test_records_and_stores_in_a_runs_folder_are_refused_before_anything_is_written(
    command, inside, tiny_run, bounded_run, tmp_path, capsys
):
    run = run_copy(tiny_run, tmp_path)
    make_argv, fix = INTO_A_RUN[command]
    at = run / "mine" if inside else run
    before = snapshot(run)
    below = inside or command in ("kv-eval file", "kv-tune", "lm-eval")  # (a file or folder of its own in `at`)
    where = f"is inside {run}, which is a run's folder" if below else "is a run's folder"
    what = "a memory store there" if command == "memory ingest" else "records written there would be mixed"
    line = fails(capsys, make_argv(run, bounded_run, at), where, "(it holds config.json and its checkpoints)", what,
                 "the run's own files", fix)  # fmt: skip
    assert "Traceback" not in line and snapshot(run) == before and not (run / "mine").exists()


def test_a_store_in_a_runs_folder_named_by_attnlab_memory_is_refused_as_such(tiny_run, bounded_run, tmp_path,
                                                                              monkeypatch, capsys):  # fmt: skip
    run = run_copy(tiny_run, tmp_path)
    monkeypatch.setenv("ATTNLAB_MEMORY", str(run / "memories"))
    argv = ["memory", "ingest", str(bounded_run), str(run.parents[3] / "doc.txt"), "--name", "n", "--no-progress"]
    fails(capsys, argv, f"$ATTNLAB_MEMORY {run / 'memories'} is inside", "give --store a folder outside the run")
    assert not (run / "memories").exists()


def test_a_folder_that_holds_runs_and_a_results_folder_are_still_accepted(tiny_run, bounded_run, tmp_path, capsys,
                                                                          monkeypatch):  # fmt: skip
    run = run_copy(tiny_run, tmp_path)
    runs = tmp_path / "out"  # holds out/m/base/seed0: --out of `attnlab run`, not a run's folder
    monkeypatch.chdir(tmp_path)
    for folder in (runs, runs / "m", Path("results"), Path("results") / "bench"):
        assert records_in_run_problem(folder) is None
    kv = ["kv-eval", str(run), "--policies", "k=q8_0", "--split", "val", "--seq-len", "16", "--tokens", "34"]
    assert main([*kv, "--out", str(runs / "kv.jsonl")]) == 0
    assert main([*kv, "--out", "results/kv.jsonl"]) == 0
    ingest = ["memory", "ingest", str(bounded_run), str(run.parents[3] / "doc.txt"), "--name", "n", "--no-progress"]
    assert main([*ingest, "--store", str(runs / "memories")]) == 0
    capsys.readouterr()
    assert (runs / "kv.jsonl").is_file() and Path("results/kv.jsonl").is_file()
    assert (runs / "memories" / "index.sqlite").is_file()


# ----------------------------------------------------------------------------- memory ls: a state cut short


@pytest.fixture
def store(bounded_run, tmp_path, capsys) -> Path:
    """A store holding 'notes' (one document) and 'two' (two documents)."""
    doc, other, store = tmp_path / "doc.txt", tmp_path / "other.txt", tmp_path / "store"
    doc.write_text("the cat sat on the mat " * 20)
    other.write_text("a hat on the cat\n" * 5)
    ingest = ["memory", "ingest", str(bounded_run), "--store", str(store), "--no-progress"]
    assert main([*ingest, str(doc), "--name", "notes"]) == 0
    assert main([*ingest, str(doc), str(other), "--name", "two"]) == 0
    capsys.readouterr()
    return store


def validate_refuses(capsys, argv: list[str], *fragments) -> str:
    """`attnlab validate ...` exits 2 with one line (naming the file) holding every fragment: that line."""
    assert main(["validate", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and all(fragment in lines[0] for fragment in fragments), lines
    return lines[0]


def listing(capsys, store: Path) -> dict[str, str]:
    assert main(["memory", "ls", "--store", str(store)]) == 0
    return {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}


def test_memory_ls_marks_a_state_file_of_another_size_than_its_row(store, capsys):
    assert all("(" not in line for line in listing(capsys, store).values())  # intact: no mark
    (state,) = (store / "states").glob("notes-*.safetensors")
    size = state.stat().st_size
    with state.open("r+b") as file:
        file.truncate(50)
    lines = listing(capsys, store)
    assert (
        f"(its state file states/{state.name} is 50 bytes, the index records {size:,}: cut short or changed since "
        "the ingest; ingest it again with --replace, or `attnlab memory rm notes`)" in lines["notes"]
    ), lines
    assert "(" not in lines["two"]
    fails(capsys, ["memory", "query", "notes", "the", "--store", str(store)], "not a readable memory state")


@pytest.mark.parametrize("tokens", [0, 1])
def test_memory_ls_marks_a_row_whose_tokens_its_documents_contradict(store, capsys, tokens):
    with sqlite3.connect(store / "index.sqlite") as index:
        (documents,) = index.execute("SELECT documents FROM states WHERE name = 'notes'").fetchone()
        index.execute("UPDATE states SET tokens = ? WHERE name = 'notes'", (tokens,))
    read = json.loads(documents)[0]["tokens"]
    lines = listing(capsys, store)
    assert lines["notes"].split(" (")[0].split() == ["notes", "?", "?", "?", "?"]
    assert (
        f"changed by hand into values the store never writes: tokens={tokens} (its 1 document(s) make {read:,})"
        in (lines["notes"])
    ), lines
    assert "(" not in lines["two"]  # two documents and the end-of-text token between them: as the ingest counted


def test_a_row_of_no_tokens_is_damaged_whatever_its_documents_say(store, capsys):
    with sqlite3.connect(store / "index.sqlite") as index:
        index.execute("""UPDATE states SET tokens = 0, documents = '[{"path": "x", "sha256": "y", "tokens": 0}]'
                         WHERE name = 'notes'""")
    assert "tokens=0 (an ingest reads at least one token)" in listing(capsys, store)["notes"]
    with sqlite3.connect(store / "index.sqlite") as index:
        index.execute("UPDATE states SET documents = '[]' WHERE name = 'notes'")
    assert "documents=[] (an ingest reads at least one document)" in listing(capsys, store)["notes"]


# ----------------------------------------------------------------------------- widths that narrow nothing


@pytest.mark.parametrize("d_attn", [32, 64])
def test_a_bottleneck_as_wide_as_d_model_is_refused(d_attn):
    with pytest.raises(ConfigError) as caught:
        model_config_from_dict({**PROBE_MODEL, "attention": {"kind": "bottleneck", "d_attn": d_attn}})
    line = str(caught.value)
    assert "\n" not in line and f"attention.d_attn={d_attn} is not less than d_model=32" in line, line
    head_dim = "" if d_attn == 32 else f", head_dim: {d_attn // 2}"
    assert f"plain mha (use attention.kind: mha{head_dim}, or a d_attn below 32)" in line, line


def test_a_bottleneck_below_d_model_or_with_its_null_key_is_accepted():
    for attention in ({"d_attn": 16}, {"d_attn": 32, "null_attn": True}, {"d_attn": 64, "null_attn": True}):
        cfg = model_config_from_dict({**PROBE_MODEL, "attention": {"kind": "bottleneck", **attention}})
        assert cfg.attention.d_attn == attention["d_attn"]


def test_a_bottleneck_as_wide_as_d_model_is_refused_by_validate(tmp_path, capsys):
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), "{seq_len: 16, batch_size: 2, steps: 2}")
    argv = [str(manifest), "--set", "model.attention={kind: bottleneck, d_attn: 32, n_kv_heads: 1}"]
    assert validate_refuses(capsys, argv, "attention.d_attn=32 is not less than d_model=32", "kind: mha, n_kv_heads: 1")


def test_an_mla_latent_wider_than_d_model_is_refused():
    model_config_from_dict({**PROBE_MODEL, "attention": {"kind": "mla", "d_latent": 32}})  # as wide: accepted
    with pytest.raises(ConfigError) as caught:
        model_config_from_dict({**PROBE_MODEL, "attention": {"kind": "mla", "d_latent": 33}})
    line = str(caught.value)
    assert "attention.d_latent=33 is more than d_model=32" in line and "at most 32" in line, line


# ----------------------------------------------------------------------------- kv-tune's own flags


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--max-dnll", "-1"], "--max-dnll=-1.0 must be a finite number >= 0"),
        (["--max-dnll", "nan"], "--max-dnll=nan must be a finite number >= 0"),
        (["--max-dnll", "inf"], "--max-dnll=inf must be a finite number >= 0"),
        (["--formats", "q8_0,q4_0,q8_0"], "--formats 'q8_0,q4_0,q8_0': q8_0 is given twice: give each once"),
        (["--resids", "0,0"], "--resids '0,0': 0 is given twice: give each once"),
    ],
)
def test_kv_tune_refuses_a_negative_max_dnll_and_a_value_given_twice(tiny_run, capsys, flags, fragment):
    assert fails(capsys, ["kv-tune", str(tiny_run), "--budget", "100", "--split", "val", *flags], fragment)


# ----------------------------------------------------------------------------- calibration tokens below d_model


def test_the_fewest_calibration_tokens_give_d_model_inputs():
    """input_whitening reads windows of 512 tokens and leaves out a last window of one token."""
    for d_model, max_seq_len, least in ((32, 64, 32), (576, 2048, 576), (4096, 8192, 4096), (513, 1024, 514),
                                        (65, 64, 66), (64, 64, 64)):  # fmt: skip
        assert calibration_minimum(SimpleNamespace(d_model=d_model, max_seq_len=max_seq_len)) == least


def test_a_conversion_on_fewer_calibration_tokens_than_d_model_is_refused(tiny_run, tmp_path, capsys):
    text, out = tiny_run.parents[2] / "text.txt", tmp_path / "converted"
    argv = ["convert", str(tiny_run), "--attention", "kind=decoupled,d_sem=8,d_geo=16", "--calibrate-on", str(text),
            "--eval-tokens", "0", "--out", str(out), "--calibration-tokens"]  # fmt: skip
    fails(capsys, [*argv, "10"], "--calibration-tokens=10 is too few for a model of d_model=32", "give 32 or more",
          "or 0 to fit the weights alone")  # fmt: skip
    assert not out.exists()
    assert main([*argv, "32"]) == 0
    assert "factorisations fitted on 32 calibration tokens" in capsys.readouterr().out


def test_a_manifest_conversion_on_fewer_calibration_tokens_than_d_model_is_refused(tiny_run, tmp_path, capsys):
    text = tiny_run.parents[2] / "text.txt"
    manifest = tmp_path / "m.yml"

    def write(tokens: int) -> None:
        manifest.write_text(f"name: m\nseeds: [0]\ndefaults:\n  data: {{source: {text}, val_fraction: 0.2}}\n"
                            "  train: {seq_len: 16, batch_size: 2, steps: 2, eval_every: 2, eval_tokens: 32}\n"
                            f"targets:\n  dba:\n    init_from: {{model: {tiny_run}, calibration_tokens: {tokens}, "
                            f"calibrate_on: {text}}}\n    model: {{attention: {{kind: decoupled, d_sem: 8, "
                            "d_geo: 16}}\n")  # fmt: skip

    write(10)
    said = "targets.dba.init_from.calibration_tokens=10 is too few for a model of d_model=32"
    validate_refuses(capsys, [str(manifest)], said, "give 32 or more")
    fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "o"), "--dry-run"], said)
    assert not (tmp_path / "o").exists()
    write(32)
    assert "would train 2 steps" in dry_run(capsys, ["run", str(manifest), "--out", str(tmp_path / "o"), "--dry-run"])


# ----------------------------------------------------------------------------- summary.json's status


@pytest.mark.parametrize("status", ["partial", None])
def test_a_summary_whose_status_attnlab_never_writes_is_refused(tmp_path, capsys, status):
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), "{seq_len: 16, batch_size: 2, steps: 2, eval_every: 2, "
                                                            "eval_tokens: 32}")  # fmt: skip
    argv = ["run", str(manifest), "--out", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == 0
    path = tmp_path / "out" / "m" / "base" / "seed0" / "summary.json"
    summary = json.loads(path.read_text())
    assert summary["status"] == "complete"
    summary.pop("status") if status is None else summary.update(status=status)
    path.write_text(json.dumps(unsealed(summary)))  # an older attnlab's summary (unsealed): checked by its figures
    said = "status='partial'" if status else "no 'status'"
    line = f"{path}: {said}, where a finished run's summary has status 'complete' (the only value attnlab writes: " \
           "it was changed by hand); its last checkpoint is the last step (2 of 2): delete summary.json alone and " \
           "run again to write it again from there"  # fmt: skip
    capsys.readouterr()
    assert dry_run(capsys, [*argv, "--dry-run", "--unsealed"]) == f"[1/1] base seed0: would be refused: {line}\n"
    assert fails(capsys, [*argv, "--unsealed"], line)
    path.unlink()
    assert main(argv) == 0
    assert json.loads(path.read_text())["status"] == "complete"


# ----------------------------------------------------------------------------- the manifest docstring's example


def test_the_manifest_docstrings_target_continuing_another_validates(tmp_path, capsys):
    """Its dba_bounded continues dba under defaults that name no attention of dba's: it repeats dba's attention
    (it was refused: "its model cannot start from target dba's weights")."""
    doc = attnlab.manifest.__doc__
    example = doc[doc.index("      dba:\n") : doc.index("      smollm_mqa:")]
    targets = yaml.safe_load("\n".join(line[6:] for line in example.splitlines()))
    assert targets["dba_bounded"]["init_from"] == "dba" and "memory" in targets["dba_bounded"]["model"]
    manifest = tmp_path / "doc.yml"
    manifest.write_text(yaml.safe_dump({
        "name": "doc", "seeds": [0],
        "defaults": {"model": {"d_model": 64, "n_layers": 1, "n_heads": 4, "max_seq_len": 512,
                               "attention": {"kind": "mha"}},
                     "data": {"source": str(hat_text(tmp_path)), "tokenizer": "char", "val_fraction": 0.2},
                     "train": {"seq_len": 32, "batch_size": 1, "steps": 4, "eval_tokens": 512}},
        "targets": targets,
    }))  # fmt: skip
    assert main(["validate", str(manifest)]) == 0, capsys.readouterr().err


# ----------------------------------------------------------------------------- a KV policy on a memory model


def test_a_kv_policy_is_applied_to_every_slot_of_a_memory_model(bounded_run, capsys):
    """Not changed (probe W's "no word whether it applies"): the slots of a model with a memory, the recent window's
    and the banks', are stored in the policy's formats (README: KV policy). The probe's greedy tokens agreed because
    a 4-step model's logits move by less than 0.01 under q4_0."""
    model = tiny_model(memory=BOUNDED, perturb=True)
    tokens = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))  # past the window and banks
    logits = {}
    for policy in (None, "k=q4_0,v=q4_0"):
        cache = model.new_cache(1, policy=policy)
        with torch.no_grad():
            logits[policy] = model(tokens, cache=cache)[0]
        assert all(layer.slots.quantized == (policy is not None) for layer in cache.layers)
        logits[f"{policy} bytes"] = sum(layer.slots.nbytes() for layer in cache.layers)
    assert not torch.equal(logits[None], logits["k=q4_0,v=q4_0"])
    torch.testing.assert_close(logits[None], logits["k=q4_0,v=q4_0"], rtol=0, atol=0.5)
    assert logits["k=q4_0,v=q4_0 bytes"] < logits["None bytes"] / 3  # 0.5625 bytes a value, not 4
    assert main(["generate", str(bounded_run), "the", "--max-new-tokens", "3", "--kv-policy", "k=q4_0"]) == 0
    assert capsys.readouterr().err == ""
