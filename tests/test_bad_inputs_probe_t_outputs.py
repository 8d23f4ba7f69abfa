"""Probe S's findings on where commands write, fixed in round T: `compare` on one run's folder wrote its files among
the run's own (t1); past a full disk, `report` left tables/ without report.md and `compare` its .md and .csv without
the .png (t2); a refused `memory ingest` made the store folder (t3); `bench --list` ignored --out and --benchmarks
(t4); `memory ingest --chunk` took any number (t5); `info --seq-len` far past max_seq_len printed bytes with no word
(t6)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import PROBE_MODEL, error_line, fails, run_limited, snapshot, train_tiny_run

from attnlab.cli import main
from attnlab.data.files import sealed

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"
FILES = "compare.md, compare.csv and val_loss.png"


# ----------------------------------------------------------------------------- t1: compare into a run's folder


def test_compare_of_one_runs_folder_writes_nothing_into_it(tiny_run, capsys):
    before = snapshot(tiny_run)
    assert fails(capsys, ["compare", str(tiny_run)], f"{tiny_run} is a run's folder", f"would write {FILES} among "
                 "the run's own files", "give --out another folder", f"compare the folder above the runs "
                 f"({tiny_run.resolve().parents[1]}) to write them there")  # fmt: skip
    assert snapshot(tiny_run) == before


@pytest.mark.parametrize("inside", [".", "checkpoints", "new/sub"])
def test_compare_out_inside_a_run_is_refused(tiny_run, tmp_path, capsys, inside):
    out = tiny_run / inside
    before = snapshot(tiny_run)
    where = "is" if inside == "." else f"is inside {tiny_run.resolve()}, which is"
    assert fails(capsys, ["compare", str(tiny_run.parents[1]), "--out", str(out)], f"--out {out} {where} a run's "
                 "folder", f"compare writes {FILES} elsewhere; give --out a folder outside the run")  # fmt: skip
    assert snapshot(tiny_run) == before and not (tiny_run / "new").exists()


def test_compare_of_one_run_writes_where_out_says(tiny_run, tmp_path, capsys):
    out = tmp_path / "one"
    assert main(["compare", str(tiny_run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["compare.csv", "compare.md", "val_loss.png"]
    assert main(["compare", str(tiny_run.parent)]) == 0  # a target's folder is not a run's: written there
    assert (tiny_run.parent / "compare.md").is_file()
    for name in ("compare.md", "compare.csv", "val_loss.png"):
        (tiny_run.parent / name).unlink()


# ----------------------------------------------------------------------------- t2: all outputs or none


PERPLEXITY = {"benchmark": "perplexity", "model": "m", "kind": "mha", "split": "val", "tokens": 64, "loss": 4.2,
              "loss_ci": [4.1, 4.3], "ppl": 66.7, "ppl_ci": [60.3, 73.7]}  # fmt: skip
STREAM = {"benchmark": "stream_loss", "model": "m", "status": "ok", "bucket": 4, "positions": [0, 4],
          "bucket_loss": [4.0, 3.9], "bucket_ci": [[3.9, 4.1], [3.8, 4.0]], "length": 8, "streams": 1}  # fmt: skip
LIMIT = 8 * 1024  # every table and text file fits; no plot does


@pytest.fixture(autouse=True)
def fonts_cached():
    """matplotlib's font list written to its cache before a file size limit (else it says, on stderr, that it could
    not write it)."""
    import matplotlib.font_manager  # noqa: F401  (its import writes the list)


def bench_folder(folder: Path) -> Path:
    """folder/records.jsonl: PERPLEXITY and STREAM, sealed as bench writes them."""
    folder.mkdir()
    (folder / "records.jsonl").write_text("".join(json.dumps(sealed(r)) + "\n" for r in (PERPLEXITY, STREAM)))
    return folder


def test_a_report_past_a_full_disk_writes_nothing(tmp_path, capsys, file_size_limit):
    folder = bench_folder(tmp_path / "b")
    before = snapshot(folder)
    assert run_limited(file_size_limit, LIMIT, ["report", str(folder)]) == 2
    error_line(capsys, "report", f"{folder / 'stream_loss.png'}: file too large")
    assert snapshot(folder) == before and sorted(p.name for p in folder.iterdir()) == ["records.jsonl"]


def test_a_report_past_a_full_disk_leaves_the_earlier_report_whole(tmp_path, capsys, file_size_limit):
    folder = bench_folder(tmp_path / "b")
    assert main(["report", str(folder)]) == 0
    before = snapshot(folder)
    assert {"report.md", "report.html", "stream_loss.png", "tables/perplexity.md"} <= set(before)
    with (folder / "records.jsonl").open("a") as records:  # the next report has other figures
        records.write(json.dumps(sealed({**PERPLEXITY, "model": "n", "loss": 3.0, "loss_ci": [2.9, 3.1],
                                         "ppl": math.exp(3.0), "ppl_ci": [math.exp(2.9), math.exp(3.1)]}))
                      + "\n")  # fmt: skip
    before["records.jsonl"] = (folder / "records.jsonl").read_bytes()
    capsys.readouterr()
    assert run_limited(file_size_limit, LIMIT, ["report", str(folder)]) == 2
    error_line(capsys, "report", "file too large")
    assert snapshot(folder) == before  # the earlier tables beside the earlier report.md, no temporary
    assert main(["report", str(folder)]) == 0 and "| n |" in (folder / "tables" / "perplexity.md").read_text()


def test_compare_past_a_full_disk_writes_none_of_its_files(tiny_run, tmp_path, capsys, file_size_limit):
    out, runs = tmp_path / "c", tiny_run.parents[1]
    assert run_limited(file_size_limit, LIMIT, ["compare", str(runs), "--out", str(out)]) == 2
    error_line(capsys, "compare", f"{out / 'val_loss.png'}: file too large")
    assert not out.exists()  # no .md and .csv without their plot, and not the folder made for them
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert run_limited(file_size_limit, LIMIT, ["compare", str(runs), "--out", str(out)]) == 2
    assert snapshot(out) == {"notes.txt": b"mine"}  # a folder of the user's stays
    capsys.readouterr()
    assert main(["compare", str(runs), "--out", str(out)]) == 0
    before = snapshot(out)
    assert run_limited(file_size_limit, LIMIT, ["compare", str(runs), "--out", str(out)]) == 2
    assert snapshot(out) == before  # the earlier three whole


def test_outputs_together_rename_all_or_none(tmp_path, file_size_limit):
    from attnlab.data.files import outputs_together

    folder = tmp_path / "f"
    with outputs_together(folder, "x") as stage:
        (stage / "a.txt").write_text("old a")
        (stage / "sub").mkdir()
        (stage / "sub" / "b.txt").write_text("old b")
    assert snapshot(folder) == {"a.txt": b"old a", "sub/b.txt": b"old b"}
    file_size_limit(100)
    try:
        with pytest.raises(OSError) as caught, outputs_together(folder, "x") as stage:
            (stage / "a.txt").write_text("new a")
            (stage / "sub").mkdir()
            (stage / "sub" / "b.txt").write_text("b" * 200)
    finally:
        file_size_limit(None)
    assert caught.value.filename is None or ".tmp" not in str(caught.value.filename)
    assert snapshot(folder) == {"a.txt": b"old a", "sub/b.txt": b"old b"}  # no new a beside the old b


# ----------------------------------------------------------------------------- t3, t5: memory ingest's options


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory) -> Path:
    memory = {"kind": "streaming", "recent_window": 16, "sink_tokens": 2}
    return train_tiny_run(tmp_path_factory.mktemp("memrun"), {**PROBE_MODEL, "memory": memory}, steps=2)


def ingest(run: Path, tmp_path: Path, store: Path, *options: str) -> list[str]:
    doc = tmp_path / "doc.txt"
    doc.write_text("the cat sat on the mat " * 10)
    return ["memory", "ingest", str(run), str(doc), "--store", str(store), "--no-progress", *options]


@pytest.mark.parametrize("name, said", [("../x", "memory name '../x'"), ("", "memory name must not be empty"),
                                        ("a/b", "memory name 'a/b'")])  # fmt: skip
def test_a_refused_ingest_makes_no_store(memory_run, tmp_path, capsys, name, said):
    store = tmp_path / "store"
    assert fails(capsys, ingest(memory_run, tmp_path, store, "--name", name), said)
    assert not store.exists()


def test_an_ingest_refused_after_the_model_loads_makes_no_store(tiny_run, tmp_path, capsys):
    store = tmp_path / "deep" / "store"
    assert main(ingest(tiny_run, tmp_path, store, "--name", "notes")) == 2  # a model without a memory
    assert "Traceback" not in capsys.readouterr().err
    assert not (tmp_path / "deep").exists()


def test_a_store_that_cannot_be_made_is_said_before_the_model_loads(memory_run, tmp_path, capsys, monkeypatch):
    (tmp_path / "afile").write_text("x")
    store = tmp_path / "afile" / "store"
    import attnlab.memory.store as store_module

    monkeypatch.setattr(store_module, "_load_model", lambda *a: pytest.fail("the model was loaded"))
    assert fails(capsys, ingest(memory_run, tmp_path, store, "--name", "notes"), f"{store}: cannot use as a memory "
                 f"store (Not a directory: {tmp_path / 'afile'})")  # fmt: skip


def test_an_ingest_makes_its_store_and_a_second_one_adds_to_it(memory_run, tmp_path, capsys):
    store = tmp_path / "new" / "store"
    assert main(ingest(memory_run, tmp_path, store, "--name", "one")) == 0
    assert main(ingest(memory_run, tmp_path, store, "--name", "two")) == 0
    capsys.readouterr()
    assert main(["memory", "ls", "--store", str(store)]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == ["one", "two"]


@pytest.mark.parametrize("chunk", ["100000000000000000000", "2147483648", "0", "-5"])
def test_an_ingest_chunk_out_of_range_is_refused(memory_run, tmp_path, capsys, chunk):
    store = tmp_path / "store"
    assert fails(capsys, ingest(memory_run, tmp_path, store, "--name", "n", "--chunk", chunk), f"--chunk {chunk} "
                 "must be in 1 .. 2,147,483,647 (2**31 - 1) tokens per prefill step (the default is 512)")  # fmt: skip
    assert not store.exists()


def test_the_largest_chunk_is_taken(memory_run, tmp_path):
    assert main(ingest(memory_run, tmp_path, tmp_path / "store", "--name", "n", "--chunk", "2147483647")) == 0


# ----------------------------------------------------------------------------- t4: bench --list's options


@pytest.mark.parametrize("options, unused", [(["--out", "x"], "--out"), (["--set", "perplexity.split=val"],
                                             "--set"), (["--data-dir", "."], "--data-dir"),
                                             (["--out", "x", "--set", "a.b=1"], "--out and --set")])  # fmt: skip
def test_bench_list_refuses_an_option_it_does_not_use(tmp_path, capsys, monkeypatch, options, unused):
    monkeypatch.chdir(tmp_path)
    verb = "are" if " and " in unused else "is"
    assert fails(capsys, ["bench", "--list", *options], f"--list prints the benchmarks and runs none: {unused} {verb} "
                 f"not used with it (remove {unused}, or drop --list to run benchmarks")  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_bench_list_lists_the_benchmarks_named(capsys):
    assert main(["bench", "--list", "--benchmarks", "needle, perplexity"]) == 0
    listed = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert listed == ["needle", "perplexity"]
    assert main(["bench", "--list"]) == 0
    assert len([line for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]) > 2


@pytest.mark.parametrize("names, said", [("perplexty", "unknown benchmark 'perplexty' (did you mean 'perplexity'?)"),
                                         (" , ", "--benchmarks names no benchmark")])  # fmt: skip
def test_bench_list_refuses_a_benchmark_it_does_not_know(capsys, names, said):
    assert fails(capsys, ["bench", "--list", "--benchmarks", names], said)


# ----------------------------------------------------------------------------- t6: info past max_seq_len

PAST = ("attnlab info: warning: --seq-len 100000 is past max_seq_len 256: the KV figures are the cache's size at "
        "100,000 tokens, a context this model (no memory) does not read (generate and bench stop at 256 tokens; "
        "--memory gives a cache that streams)")  # fmt: skip


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_info_past_max_seq_len_says_so_beside_the_figures(capsys, json_flag):
    assert main(["info", str(MODELS / "tiny-mha.yaml"), "--seq-len", "100000", *json_flag]) == 0
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [PAST]
    if json_flag:
        assert json.loads(out)["seq_len"] == 100000  # stdout stays one JSON object
    else:
        assert "seq_len 100000" in out


@pytest.mark.parametrize("options", [["--seq-len", "256"], ["--seq-len", "100000", "--memory",
                                                            "kind=window,recent_window=64"]])  # fmt: skip
def test_info_within_max_seq_len_or_with_a_memory_says_nothing(capsys, options):
    assert main(["info", str(MODELS / "tiny-mha.yaml"), *options]) == 0
    assert capsys.readouterr().err == ""
