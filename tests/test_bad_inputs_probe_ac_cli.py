"""Probe AC's command-line findings (/work/probe_ac/REPORT.md): a dry run said "would train" with a bad
$ATTNLAB_CPU_KERNELS that the run refused at its first step (AC6); report --paired printed nan rows from a record whose
window_loss held NaN (AC5); and the UNCLEAR items: --weights native refused in the Python API's words (U1), a false
"model must be a mapping" after a refused init_from (U3), bench's "no 'test' split here" (U4), the kernel cache's
"make it writable" (U5), names of 227-255 bytes refused (U6), info reading a manifest as a model config (U7), a
dangling $XDG_CACHE_HOME called "a file" (U8), values with stray spaces unquoted (U9), RUN/../seed1 "inside RUN"
(U10)."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import fails, hat_text, probe_manifest

from attnlab.cli import main
from attnlab.data.files import sealed

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = "{seq_len: 16, batch_size: 2, steps: 4, warmup_steps: 1, eval_every: 2, eval_tokens: 32, checkpoint_every: 2}"
MEMORY = "{kind: bounded, recent_window: 8, exact_slots: 2, summary_slots: 2}"


# ----------------------------------------------------------------------------- AC6: $ATTNLAB_CPU_KERNELS


@pytest.mark.parametrize("memory", [True, False])
def test_ac6_a_bad_cpu_kernels_value_is_refused_by_the_dry_run_and_before_the_run_starts(
    tmp_path, capsys, monkeypatch, memory
):
    """Was: the dry run of a memory model said "would train"; the run refused at its first step, its folder made."""
    model = f"{{d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 64{', memory: ' + MEMORY if memory else ''}}}"
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, model=model)
    monkeypatch.setenv("ATTNLAB_CPU_KERNELS", "nope")
    argv = ["run", str(manifest), "--out", str(tmp_path / "o"), "--no-progress"]
    said = "$ATTNLAB_CPU_KERNELS='nope' is not one of 0, false, no, off (kernels off) or 1, true, yes, on"
    line = fails(capsys, argv, said)
    assert fails(capsys, [*argv, "--dry-run"], said) == line
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- AC5: report --paired, NaN windows


def ppl_record(model: str, seed: int) -> dict:
    from attnlab.eval.perplexity import summarize_losses

    rng = np.random.default_rng(seed)
    windows = [(float(16 * rng.uniform(2.0, 5.0)), 16) for _ in range(8)]
    return {"benchmark": "perplexity", "model": model, "kind": "mha", "split": "val", "dataset": "tinyshakespeare",
            "seq_len": 16, "stride": 16, "max_tokens": 128, "tokenizer": "char", "tokens_in_split": 46026,
            **summarize_losses(windows)}  # fmt: skip


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_ac5_a_non_finite_window_loss_beside_a_finite_loss_is_refused_naming_record_and_field(tmp_path, capsys, bad):
    """Was: report --paired printed a row of nan (rc 0) while the perplexity table showed the record's finite loss."""
    damaged = ppl_record("b", 1)
    damaged["window_loss"][3] = bad
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "records.jsonl").write_text("".join(json.dumps(sealed(r)) + "\n" for r in (ppl_record("a", 0), damaged)))
    shown = "NaN" if math.isnan(bad) else "Infinity"
    line = fails(capsys, ["report", str(folder), "--paired", "a:b"], "records.jsonl: record 2 (perplexity, b)",
                 f"field 'window_loss' holds {shown} at window 3", "'loss'")  # fmt: skip
    assert not (folder / "report.md").exists()
    assert line == fails(capsys, ["report", str(folder)], "window_loss")  # (not only when paired)


def test_ac5_a_diverged_records_windows_are_still_shown(tmp_path):
    """A loss of NaN (a diverged model) with NaN windows contradicts nothing: shown as such, as before."""
    diverged = ppl_record("b", 1)
    diverged["window_loss"][0] = math.nan
    diverged.update(loss=math.nan, ppl=math.nan, loss_ci=[math.nan, math.nan], ppl_ci=[math.nan, math.nan])
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "records.jsonl").write_text("".join(json.dumps(sealed(r)) + "\n" for r in (ppl_record("a", 0), diverged)))
    assert main(["report", str(folder)]) == 0


# ----------------------------------------------------------------------------- U1: --weights native on a run


@pytest.mark.parametrize("command", ["generate", "kv-eval"])
def test_u1_weights_native_on_a_run_is_refused_in_the_flags_words(tiny_run, capsys, command):
    """Was: "weights='native' ... (leave weights='fp32'; attnlab.quantize_weights(model, 'q8_0') ...)"."""
    rest = ["the"] if command == "generate" else ["--policies", "k=q8_0,v=q8_0"]
    line = fails(capsys, [command, str(tiny_run), *rest, "--weights", "native"],
                 "--weights native keeps a GGUF file's own quantized matrices", f"{tiny_run} is an attnlab run",
                 "give --weights fp16, q8_0, q4_0 or q4_1", "or leave --weights out")  # fmt: skip
    assert "weights='" not in line and "quantize_weights" not in line


# ----------------------------------------------------------------------------- U3: init_from, what it likely meant


def init_manifest(root: Path, init_from: str) -> Path:
    path = root / "rfu.yml"
    path.write_text(f"name: rfu\nseeds: [0]\ndefaults:\n  data: {{source: {hat_text(root)}, tokenizer: char}}\n"
                    f"  train: {TRAIN}\ntargets:\n  a: {{init_from: {init_from!r}}}\n")  # fmt: skip
    return path


def test_u3_init_from_with_a_trailing_space_says_so_without_a_false_model_problem(tmp_path, capsys, monkeypatch):
    """Was: "... must name an earlier target (none) or a model (...); rfu.yml: targets.a: model must be a mapping"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "g.gguf").write_bytes(b"GGUF")
    argv = ["run", str(init_manifest(tmp_path, "g.gguf ")), "--out", str(tmp_path / "o"), "--dry-run"]
    line = fails(capsys, argv, "targets.a.init_from='g.gguf ' must name an earlier target", "(it ends in a space: "
                 "write 'g.gguf')")  # fmt: skip
    assert "must be a mapping" not in line


def test_u3_init_from_naming_a_folder_that_holds_a_gguf_says_to_name_the_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ggdir").mkdir()
    (tmp_path / "ggdir" / "g.gguf").write_bytes(b"GGUF")
    argv = ["run", str(init_manifest(tmp_path, "ggdir")), "--out", str(tmp_path / "o"), "--dry-run"]
    line = fails(capsys, argv, "targets.a.init_from='ggdir'", "(ggdir is a folder holding g.gguf: name the file, "
                 "ggdir/g.gguf)")  # fmt: skip
    assert "must be a mapping" not in line


# ----------------------------------------------------------------------------- U7: info on a manifest


MANIFESTS = [("a run manifest", "name: m\nseeds: [0]\ntargets:\n  base: {}\n"),
             ("a benchmark manifest", "name: b\ncheckpoints: [x]\nbenchmarks: {}\n")]  # fmt: skip


@pytest.mark.parametrize(("kind", "text"), MANIFESTS)
def test_u7_info_on_a_manifest_says_what_it_is_and_what_info_takes(tmp_path, capsys, kind, text):
    """Was: "tiny.yml: unknown key 'seeds' (did you mean 'n_heads'?); ..." (read as a model config)."""
    path = tmp_path / "tiny.yml"
    path.write_text(text)
    line = fails(capsys, ["info", str(path)], f"{path}: is {kind}", "info takes a model config or a model reference",
                 f"attnlab validate {path}")  # fmt: skip
    assert "n_heads" not in line


# ----------------------------------------------------------------------------- U10: '..' out of a run's folder


def test_u10_a_path_that_leaves_a_runs_folder_through_dotdot_is_not_inside_it(tiny_run, capsys, tmp_path):
    """Was: convert --out RUN/../seed1 refused as "inside RUN" (the lexical parents of the unresolved path)."""
    from attnlab.paths import run_folder_problem

    beside = tiny_run / ".." / "seed1"
    assert run_folder_problem(beside, "why") is None
    assert run_folder_problem(tiny_run.parent / "seed1", "why") is None  # the same place, written plainly
    assert "is inside" in run_folder_problem(tiny_run / "x" / ".." / "y", "why")  # (still inside it)
    (tmp_path / "x").mkdir()
    assert main(["export", str(tiny_run), "--hf", str(tmp_path / "x" / ".." / "hf1")]) == 0
    assert (tmp_path / "hf1" / "config.json").is_file()


# ----------------------------------------------------------------------------- U4: bench, a split the dataset lacks


@pytest.mark.parametrize("split", ["", ", split: test"])
def test_u4_bench_names_the_split_setting_and_the_splits_a_dataset_has(tiny_run, tmp_path, capsys, split):
    """Was: "tinyshakespeare has no 'test' split here (check the split's name, or the data directory)" after
    loading, though the user wrote no split; validate said ok."""
    path = tmp_path / "bm.yml"
    path.write_text(f"name: bm\ncheckpoints: [{tiny_run}]\nbenchmarks:\n  perplexity: {{seq_len: 16, max_tokens: 64, "
                    f"dataset: tinyshakespeare{split}}}\n")  # fmt: skip
    said = "benchmarks.perplexity.split=test" + ("" if split else " (the default)")
    fragments = (said, "tinyshakespeare has no 'test' split", "into train and val", "set perplexity.split: val")
    line = fails(capsys, ["bench", str(path), "--out", str(tmp_path / "o")], *fragments)
    assert main(["validate", str(path)]) != 0  # (said ok)
    said = capsys.readouterr()
    assert all(fragment in said.out + said.err for fragment in fragments), said
    assert not (tmp_path / "o").exists() and "split here" not in line


# ----------------------------------------------------------------------------- U5: the kernel cache's advice


def fake_builds(folder_of_cache: Path, built: list):
    """A builder as cpu.build's: the library's path in the cache (None) or the folder given, "built" (written)."""

    def builder(folder):
        folder = folder or folder_of_cache
        folder.mkdir(parents=True, exist_ok=True)
        built.append(folder)
        library = folder / "ops.so"
        if not library.exists() or folder != folder_of_cache or len(built) > 1:
            library.write_text("good")
        return library

    return builder


def load_good(path: Path) -> str:
    if path.read_text() != "good":
        raise OSError(f"{path}: invalid ELF header")
    return "loaded"


def test_u5_a_cached_library_that_does_not_load_is_built_again_in_place(tmp_path, monkeypatch):
    """Was: built in a temporary folder on every run, with "cannot use the cache ... (make it writable ...)"."""
    from attnlab.errors import AttnlabWarning
    from attnlab.kernels import cpu

    monkeypatch.delenv("ATTNLAB_CPU_KERNELS", raising=False)
    cache = tmp_path / "kernels"
    cache.mkdir()
    (cache / "ops.so").write_text("garbage whose checksum was rewritten with it")
    built: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu.compiled(cpu.SOURCE, load_good, fake_builds(cache, built)) == "loaded"
    assert built == [cache, cache] and (cache / "ops.so").read_text() == "good"
    assert not [w for w in caught if issubclass(w.category, AttnlabWarning)]


def test_u5_a_file_where_the_kernels_folder_goes_is_named_with_its_fix(tmp_path, monkeypatch):
    """Was: "cannot use the cache .../kernels (File exists): built for this run only (make it writable, ...)"."""
    from attnlab.errors import AttnlabWarning
    from attnlab.kernels import cpu

    monkeypatch.delenv("ATTNLAB_CPU_KERNELS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "attnlab").mkdir()
    cpu.kernel_dir().write_text("a file")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu.compiled(cpu.SOURCE, load_good, fake_builds(cpu.kernel_dir(), [])) == "loaded"
    [warning] = [str(w.message) for w in caught if issubclass(w.category, AttnlabWarning)]
    assert f"{cpu.kernel_dir()} is a file, where the kernels folder goes: delete it" in warning, warning
    assert "make it writable" not in warning


# ----------------------------------------------------------------------------- U8: $XDG_CACHE_HOME a dangling link


def test_u8_a_dangling_link_at_xdg_cache_home_is_named_as_such(tmp_path, capsys, monkeypatch):
    """Was: ".../xdg_dang/attnlab/prepared/<name>: a file stands where the prepared data's folder goes"."""
    (tmp_path / "xdg_dang").symlink_to("/nonexistent/c")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg_dang"))
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN)
    argv = ["run", str(manifest), "--out", str(tmp_path / "o"), "--no-progress"]
    said = f"$XDG_CACHE_HOME {tmp_path / 'xdg_dang'} is a link to /nonexistent/c, which does not exist (mount it"
    line = fails(capsys, argv, said, "or set XDG_CACHE_HOME to another folder")
    assert fails(capsys, [*argv, "--dry-run"], said) == line and "a file stands" not in line


# ----------------------------------------------------------------------------- U9: values with spaces at their ends


def test_u9_a_data_folder_with_a_stray_space_is_shown_quoted(tmp_path, capsys, monkeypatch, data_dir):
    """Was: "$ATTNLAB_DATA= /work/shared/data: no such folder" (the space easy to miss)."""
    monkeypatch.setenv("ATTNLAB_DATA", f" {data_dir}")
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN)
    assert fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "o"), "--dry-run"],
                 f"$ATTNLAB_DATA=' {data_dir}' (it starts with a space): no such folder")  # fmt: skip
    monkeypatch.delenv("ATTNLAB_DATA")
    assert fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "o"), "--dry-run", "--data-dir",
                  f"{data_dir} "], f"--data-dir '{data_dir} ' (it ends with a space): no such folder")  # fmt: skip


# ----------------------------------------------------------------------------- U6: names of 230-255 bytes


@pytest.mark.parametrize("length", [240, 255])
def test_u6_export_takes_a_folder_name_the_file_system_allows(tiny_run, tmp_path, length):
    """Was: "xeee…: file name too long: the whole path is 257 bytes, more than the system allows (4096 ...)": the
    temporary folder beside it (about 26 bytes longer) passed 255 bytes."""
    out = tmp_path / ("e" * length)
    assert main(["export", str(tiny_run), "--hf", str(out)]) == 0
    assert (out / "config.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_u6_a_name_over_255_bytes_is_refused_naming_the_part_not_the_whole_path(tiny_run, tmp_path, capsys):
    out = tmp_path / ("e" * 256)
    line = fails(capsys, ["export", str(tiny_run), "--hf", str(out)], "file name too long: a part of it is 256 bytes, "
                 "more than the file system allows (255 bytes a part")  # fmt: skip
    assert "whole path" not in line


def test_u6_the_temporary_of_a_long_name_is_short_enough_and_its_own(tmp_path):
    from attnlab.data.files import TEMPORARY, temp_path_beside, temporary_stem

    for name in ("a" * 226, "a" * 255, "é" * 127, "a" * 240 + "x", "a" * 240 + "y"):
        tmp = temp_path_beside(tmp_path / name)
        assert len(os.fsencode(tmp.name)) <= 255 and TEMPORARY.fullmatch(tmp.name)["name"] == temporary_stem(name)
    assert temporary_stem("a" * 226) == "a" * 226
    assert temporary_stem("a" * 240 + "x") != temporary_stem("a" * 240 + "y")


def test_u6_convert_takes_a_250_byte_out_name(tiny_run, tmp_path):
    """Was: "could not write ceee…: its folder: File name too long; nothing was written" (after loading the model)."""
    out = tmp_path / ("c" * 250)
    argv = ["convert", str(tiny_run), "--attention", "kind=sliding,window=8", "--eval-tokens", "0", "--out", str(out)]
    assert main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
