"""Probe R's findings (534 cases through the CLI): `report` replaced the user's own report.md or plot in the bench
folder, and wrote through a tables/ link outside it (r1); `memory ingest` on a store whose index was emptied made a
fresh index that forgot every state (r2); `mc --out` past a full disk left item rows without their summary (r3); a
GGUF byte-level tokenizer without merges loaded as one token per byte (r4); tokenizer_config.json's add_bos_token
"false" read as true and a bos_token outside the vocabulary dropped (r5); train.test_tokens without a test split,
and init_from's conversion options on a target that is not converted, did nothing without a word (r6, r7); a
config.json whose model_type and architectures disagree loaded as the architecture (r8); a NaN perplexity beside a
finite loss was drawn (r9); a link loop in a model folder ended in a traceback (r10); an unknown key in a task file
of --include-path ended in lm-eval's TypeError (r11); and lines that named the wrong thing (r12)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import PROBE_MODEL, fails, hat_text, probe_manifest, run_limited, snapshot, train_tiny_run

from attnlab.cli import main
from attnlab.data.files import sealed

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

PERPLEXITY = {"benchmark": "perplexity", "model": "m", "kind": "mha", "split": "val", "tokens": 64, "loss": 4.2,
              "loss_ci": [4.1, 4.3], "ppl": 66.7, "ppl_ci": [60.3, 73.7]}  # fmt: skip
STREAM = {"benchmark": "stream_loss", "model": "m", "status": "ok", "bucket": 4, "positions": [0, 4],
          "bucket_loss": [4.0, 3.9], "bucket_ci": [[3.9, 4.1], [3.8, 4.0]], "length": 8, "streams": 1}  # fmt: skip
USER_PNG = b"\x89PNG\r\n\x1a\n the user's own picture"


def validate_fails(capsys, path: Path, *fragments) -> str:
    """`attnlab validate path` exits 2 with one line (validate says each file's problems as `path: problem`)
    holding every fragment and no traceback: that line."""
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert all(fragment in err for fragment in fragments), err
    return err.strip()


def bench_folder(folder: Path, *rows) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(sealed(r)) + "\n" for r in rows))
    return folder


# ----------------------------------------------------------------------------- r1: report's outputs


def test_a_report_is_redrawn_over_its_own_files(tmp_path, capsys):
    folder = bench_folder(tmp_path / "b", PERPLEXITY, STREAM)
    assert main(["report", str(folder)]) == 0 and main(["report", str(folder)]) == 0
    assert (folder / "stream_loss.png").read_bytes().startswith(b"\x89PNG")
    from attnlab.eval.plots import attnlab_png

    assert attnlab_png(folder / "stream_loss.png")  # its mark: a PNG without it is the user's


@pytest.mark.parametrize("name, content", [("report.md", b"# my notes\n"), ("report.html", b"<html>mine</html>"),
                                           ("stream_loss.png", USER_PNG), ("tables/perplexity.md", b"my table\n"),
                                           ("tables/perplexity.csv", b"a,b\n")])  # fmt: skip
def test_a_report_never_replaces_the_users_own_file(tmp_path, capsys, name, content):
    folder = bench_folder(tmp_path / "b", sealed(PERPLEXITY), sealed(STREAM))  # as bench writes them
    (folder / name).parent.mkdir(exist_ok=True)
    (folder / name).write_bytes(content)
    before = snapshot(folder)
    assert fails(capsys, ["report", str(folder)], f"{folder / name}: not a file attnlab report wrote",
                 "move it away")  # fmt: skip
    assert snapshot(folder) == before  # nothing written, the user's file as it was


def test_a_report_writes_nothing_through_a_tables_link(tmp_path, capsys):
    folder, outside = bench_folder(tmp_path / "b", sealed(PERPLEXITY)), tmp_path / "elsewhere"
    outside.mkdir()
    (folder / "tables").symlink_to(outside)
    assert fails(capsys, ["report", str(folder)], f"{folder / 'tables'}: a link", "only inside its folder")
    assert list(outside.iterdir()) == [] and not (folder / "report.md").exists()


# ----------------------------------------------------------------------------- r9: NaN beside a finite figure


@pytest.mark.parametrize("changes", [{"ppl": float("nan")}, {"loss": float("nan")}, {"ppl": float("inf")}])
def test_a_perplexity_that_is_not_exp_of_its_loss_is_refused(tmp_path, capsys, changes):
    folder = bench_folder(tmp_path / "b", PERPLEXITY, {**PERPLEXITY, "model": "n", **changes})
    assert fails(capsys, ["report", str(folder)], "record 2", "which is impossible beside", "NaN with NaN")


def test_a_diverged_models_nan_figures_are_drawn(tmp_path, capsys):
    nan, inf = float("nan"), float("inf")
    diverged = [{**PERPLEXITY, "model": "n", "loss": nan, "ppl": nan, "loss_ci": [nan, nan], "ppl_ci": [nan, nan]},
                {**PERPLEXITY, "model": "i", "loss": inf, "ppl": inf, "loss_ci": [inf, inf], "ppl_ci": [inf, inf]},
                {**PERPLEXITY, "model": "o", "loss": 800.0, "ppl": inf, "loss_ci": [799.0, 801.0],
                 "ppl_ci": [inf, inf]}]  # fmt: skip
    folder = bench_folder(tmp_path / "b", PERPLEXITY, *diverged)
    assert main(["report", str(folder)]) == 0
    table = (folder / "tables" / "perplexity.md").read_text()
    assert "| n |" in table and "nan" in table and "inf" in table


# ----------------------------------------------------------------------------- r2: an emptied index


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory) -> Path:
    memory = {"kind": "streaming", "recent_window": 16, "sink_tokens": 2}
    return train_tiny_run(tmp_path_factory.mktemp("memrun"), {**PROBE_MODEL, "memory": memory}, steps=2)


def ingest(run: Path, tmp_path: Path, store: Path, name: str) -> list[str]:
    doc = tmp_path / "doc.txt"
    doc.write_text("the cat sat on the mat " * 10)
    return ["memory", "ingest", str(run), str(doc), "--name", name, "--store", str(store), "--no-progress"]


def test_ingest_into_a_store_whose_index_was_emptied_is_refused(memory_run, tmp_path, capsys):
    store = tmp_path / "store"
    assert main(ingest(memory_run, tmp_path, store, "notes")) == 0
    (store / "index.sqlite").write_bytes(b"")
    before = snapshot(store)
    capsys.readouterr()
    assert fails(capsys, ingest(memory_run, tmp_path, store, "more"), f"{store / 'index.sqlite'}: not a readable "
                 "memory index (it was emptied or replaced)", "holds 1 state file", "restore the index")  # fmt: skip
    assert snapshot(store) == before
    assert fails(capsys, ["memory", "ls", "--store", str(store)], "not a readable memory index")


def test_an_emptied_index_beside_no_state_is_made_anew(memory_run, tmp_path, capsys):
    store = tmp_path / "store"
    (store / "states").mkdir(parents=True)
    (store / "index.sqlite").write_bytes(b"")
    assert main(ingest(memory_run, tmp_path, store, "notes")) == 0  # nothing to lose
    assert main(["memory", "ls", "--store", str(store)]) == 0
    assert "notes" in capsys.readouterr().out


def test_ls_marks_a_memory_whose_state_file_is_gone(memory_run, tmp_path, capsys):
    store = tmp_path / "store"
    assert main(ingest(memory_run, tmp_path, store, "gone")) == 0
    assert main(ingest(memory_run, tmp_path, store, "kept")) == 0
    [state] = [p for p in (store / "states").iterdir() if p.name.startswith("gone")]
    state.unlink()
    capsys.readouterr()
    assert main(["memory", "ls", "--store", str(store)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert f"(its state file states/{state.name} is gone: `attnlab memory rm gone`)" in rows["gone"]
    assert "(its" not in rows["kept"]


# ----------------------------------------------------------------------------- r3: mc --out past a full disk


ITEM = {"question": "which?", "choices": {"text": ["the cat", "a dog"], "label": ["A", "B"]}, "answerKey": "A"}


def test_mc_out_past_a_full_disk_leaves_both_records_files_as_they_were(tiny_run, tmp_path, capsys,
                                                                          file_size_limit):  # fmt: skip
    items, out = tmp_path / "arc.json", tmp_path / "out"
    items.write_text(json.dumps([{**ITEM, "id": f"q{i}"} for i in range(12)]))
    mc = ["mc", "arc_easy", str(tiny_run), "--file", str(items), "--out", str(out)]
    assert main(mc) == 0
    summary, rows = out / "multiple_choice.jsonl", out / "multiple_choice_items.jsonl"
    limit = 2 * summary.stat().st_size + 16  # a second summary fits; a second set of item rows does not
    assert 2 * rows.stat().st_size > limit
    before = snapshot(out)
    capsys.readouterr()
    assert run_limited(file_size_limit, limit, mc) == 2
    assert "file too large" in capsys.readouterr().err
    assert snapshot(out) == before  # no item rows without their summary, no temporary file
    assert main(mc) == 0  # and the next run appends one of each
    assert len(summary.read_text().splitlines()) == 2 and len(rows.read_text().splitlines()) == 24


def test_records_written_together_are_all_kept_or_all_left(tmp_path, file_size_limit):
    from attnlab.eval.records import append_records_together

    small, large = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    append_records_together({small: [{"benchmark": "x", "n": 1}], large: [{"benchmark": "x", "n": 2}]})
    before = snapshot(tmp_path)
    file_size_limit(200)
    try:
        with pytest.raises(OSError):
            append_records_together({small: [{"benchmark": "x"}], large: [{"benchmark": "x", "pad": "y" * 300}]})
    finally:
        file_size_limit(None)
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- r4: a GGUF tokenizer without merges


def test_a_gguf_byte_level_tokenizer_without_merges_is_refused(tmp_path, capsys):
    pytest.importorskip("gguf")
    from gguf_files import write_gguf

    path = write_gguf(tmp_path / "nomerges.gguf", merges=None)  # its tokens "ab" and "cd" could never be made
    assert fails(capsys, ["generate", str(path), "ab", *GENERATE], f"{path}: tokenizer.ggml.model='gpt2' (byte-level "
                 "BPE) without tokenizer.ggml.merges, while tokens such as 'ab' need them", "convert the model "
                 "again")  # fmt: skip
    merged = write_gguf(tmp_path / "merges.gguf", merges=["a b", "c d"])
    assert main(["generate", str(merged), "ab", *GENERATE]) == 0


# ----------------------------------------------------------------------------- r5, r8, r10: Hugging Face folders


@pytest.fixture(scope="module")
def hf_folder(tiny_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "model"
    assert main(["export", str(tiny_run), "--hf", str(out)]) == 0
    return out


def changed(hf_folder: Path, tmp_path: Path, file: str, **changes) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    data = json.loads((folder / file).read_text())
    (folder / file).write_text(json.dumps({**data, **changes}))
    return folder


GENERATE = ["--max-new-tokens", "2"]


@pytest.mark.parametrize("changes, said", [
    ({"add_bos_token": "false"}, 'add_bos_token="false" is not true or false'),
    ({"add_eos_token": 0}, "add_eos_token=0 is not true or false"),
    ({"bos_token": "<nope>"}, "bos_token='<nope>' is not a token of tokenizer.json"),
    ({"eos_token": {"content": "<nope>"}}, "eos_token='<nope>' is not a token of tokenizer.json"),
    ({"bos_token": 5}, "bos_token=5 is not a token"),
])  # fmt: skip
def test_a_tokenizer_config_setting_of_the_wrong_kind_is_refused(hf_folder, tmp_path, capsys, changes, said):
    folder = changed(hf_folder, tmp_path, "tokenizer_config.json", **changes)
    assert fails(capsys, ["generate", str(folder), "the cat", *GENERATE], f"{folder / 'tokenizer_config.json'}: {said}")


def test_a_config_whose_model_type_and_architecture_disagree_is_refused(hf_folder, tmp_path, capsys):
    folder = changed(hf_folder, tmp_path, "config.json", model_type="gpt2")
    assert fails(capsys, ["info", str(folder)], 'model_type="gpt2" and architectures=["LlamaForCausalLM"] disagree',
                 "make model_type 'llama'")  # fmt: skip


def test_a_link_loop_in_a_model_folder_is_named(hf_folder, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    for name in ("generation_config.json", "config.json"):  # (info reads config.json alone)
        (folder / name).rename(folder / f"{name}.moved")
        (folder / name).symlink_to(name)  # a link to itself
        commands = [["generate", str(folder), "the cat", *GENERATE]]
        if name == "config.json":
            commands.append(["info", str(folder)])
        for argv in commands:
            assert fails(capsys, argv, f"{folder / name}: a symbolic link loop")
        (folder / name).unlink()
        (folder / f"{name}.moved").rename(folder / name)


def test_a_dangling_weights_link_is_named(hf_folder, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(tmp_path / "moved.safetensors")
    assert fails(capsys, ["generate", str(folder), "the cat", *GENERATE],
                 f"{folder / 'model.safetensors'}: a symbolic link to {tmp_path / 'moved.safetensors'}, which is not "
                 "there")  # fmt: skip


def test_a_chat_template_error_names_the_file_it_came_from(hf_folder, tmp_path, capsys):
    folder = changed(hf_folder, tmp_path, "tokenizer_config.json", chat_template="{{ raise_exception('no') }}")
    assert fails(capsys, ["generate", str(folder), "hi", "--chat", *GENERATE],
                 f"{folder / 'tokenizer_config.json'}: the chat template refuses the prompt: no")  # fmt: skip


# ----------------------------------------------------------------------------- r6, r7: options that would do nothing

TRAIN = "{seq_len: 16, batch_size: 2, steps: 2, warmup_steps: 1, eval_every: 2, eval_tokens: 32, test_tokens: 64}"


def test_test_tokens_without_a_test_split_is_refused_up_front(tmp_path, capsys):
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN)
    said = ("train.test_tokens=64 asks for a test score, but data.test_fraction=0", "give data.test_fraction > 0")
    assert fails(capsys, ["run", str(manifest), "--dry-run", "--out", str(tmp_path / "o")], *said)
    assert validate_fails(capsys, manifest, *said)
    assert not (tmp_path / "o").exists()
    assert main(["run", str(manifest), "--dry-run", "--set", "data.test_fraction=0.1"]) == 0


@pytest.mark.parametrize("option", ["calibration_tokens: 64", "rope_pairs: energy", "calibrate_on: wikitext2"])
def test_conversion_options_on_a_target_that_is_not_factorised_are_refused(hf_folder, tmp_path, capsys, option):
    manifest = tmp_path / "m.yml"
    manifest.write_text(f"name: m\ndefaults:\n  data: {{source: {hat_text(tmp_path)}, val_fraction: 0.2}}\n"
                        "  train: {steps: 2, seq_len: 16, batch_size: 2, eval_every: 2, eval_tokens: 32}\n"
                        f"targets:\n  gqa:\n    init_from: {{model: {hf_folder}, {option}}}\n"
                        "    model: {attention: {kind: mha, n_kv_heads: 1}}\n")  # fmt: skip
    key = option.split(":")[0]
    said = (f"targets.gqa.init_from.{key}=", "applies to bottleneck/decoupled/mla conversions", "kind is mha",
            "leave it out")  # fmt: skip
    assert validate_fails(capsys, manifest, *said)
    assert fails(capsys, ["run", str(manifest), "--dry-run", "--out", str(tmp_path / "o")], *said)


# ----------------------------------------------------------------------------- r11: lm-eval task files


def test_an_unknown_key_of_an_lm_eval_task_file_is_named(tiny_run, tmp_path, capsys, monkeypatch):
    from helpers import lm_task_folders, lm_task_yaml

    items = [{"q": "a cat", "gold": 0, "choices": ["x", "y"]}]
    tasks, data = lm_task_folders(tmp_path, monkeypatch, lm_task_yaml() + "doc_to_txt: oops\n", items)
    argv = ["lm-eval", str(tiny_run), "--tasks", "mytask", "--include-path", str(tasks), "--data-dir", str(data)]
    assert fails(capsys, argv, f"{tasks / 'mytask.yaml'}: task 'mytask' has the key 'doc_to_txt'",
                 "did you mean 'doc_to_text'?")  # fmt: skip


# ----------------------------------------------------------------------------- r12: lines that name the right thing


@pytest.mark.parametrize("policy", [",", "k=q8_0,", ",,"])
def test_an_empty_kv_policy_item_is_said_once(tiny_run, capsys, policy):
    line = fails(capsys, ["generate", str(tiny_run), "the cat", "--kv-policy", policy, *GENERATE],
                 "has an empty item (a comma at its start or end, or two in a row)")  # fmt: skip
    assert line.count("empty item") == 1


@pytest.mark.parametrize("kind", ["loop", "dangling", "fifo"])
def test_a_manifest_that_is_a_link_loop_a_dangling_link_or_a_fifo_is_named(tmp_path, capsys, kind):
    path = tmp_path / "m.yml"
    if kind == "loop":
        path.symlink_to("m.yml")
        said = "a symbolic link loop"
    elif kind == "dangling":
        path.symlink_to(tmp_path / "moved.yml")
        said = f"a symbolic link to {tmp_path / 'moved.yml'}, which is not there"
    else:
        os.mkfifo(path)
        said = "is not a regular file (a FIFO"
    assert fails(capsys, ["run", str(path), "--dry-run"], str(path), said)
    assert validate_fails(capsys, path, str(path), said)


def test_a_loss_past_exps_range_is_an_infinite_perplexity_the_report_draws(tmp_path):
    from attnlab.eval.perplexity import summarize_losses
    from attnlab.eval.records import record_problem

    summary = summarize_losses([(8000.0, 10), (7900.0, 10)], n_boot=20)  # 795 nats a token: math.exp overflows
    assert summary["loss"] == 795.0 and summary["ppl"] == float("inf") and summary["ppl_ci"] == [float("inf")] * 2
    record = {"benchmark": "perplexity", "model": "m", "kind": "mha", "split": "val", **summary}
    assert record_problem(record) is None


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_a_dry_run_refuses_a_device_this_machine_lacks(tmp_path, capsys):
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN.replace(", test_tokens: 64", ""))
    out = tmp_path / "o"
    for dry in (["--dry-run"], []):
        assert fails(capsys, ["run", str(manifest), "--out", str(out), "--set", "train.device=cuda", *dry],
                     "train.device=cuda: this machine has no CUDA")  # fmt: skip
    assert not out.exists()


def test_pruning_checkpoints_deletes_only_the_trainers_own_folders(tmp_path):
    from attnlab.train.checkpoint import _remove_unreferenced

    root, outside = tmp_path / "checkpoints", tmp_path / "outside"
    for name in ("step-000004", "step-000002"):  # the kept checkpoint and an old one of the trainer's
        (root / name).mkdir(parents=True)
        for file in ("model.safetensors", "optimizer.pt", "trainer.json", "config.json", "checksums.json"):
            (root / name / file).write_text("x")
    (root / "last.json").write_text(json.dumps({"dir": "step-000004", "step": 4}))
    (root / "step-000100-keep").mkdir()  # a user's backup
    (root / "step-000100-keep" / "notes.txt").write_text("mine")
    (root / "step-000900").mkdir()  # a model converted into the folder: no trainer state
    for file in ("model.safetensors", "config.json", "checksums.json"):
        (root / "step-000900" / file).write_text("x")
    outside.mkdir()
    (outside / "trainer.json").write_text("x")
    (root / "step-000003").symlink_to(outside)
    _remove_unreferenced(root)
    assert sorted(p.name for p in root.iterdir()) == ["last.json", "step-000003", "step-000004", "step-000100-keep",
                                                      "step-000900"]  # fmt: skip
    assert (outside / "trainer.json").exists() and (root / "step-000100-keep" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json", "config.json"])
@pytest.mark.parametrize("content, kind", [("[1, 2]", "an array"), ('"x"', "a str"), ("null", "null")])
def test_a_settings_file_that_is_no_json_object_is_refused(hf_folder, tmp_path, capsys, name, content, kind):
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    (folder / name).write_text(content)
    assert fails(capsys, ["generate", str(folder), "the cat", *GENERATE], f"{folder / name}: ", "JSON object")


@pytest.mark.parametrize("sets, said", [
    (["train.schedule=constant", "train.min_lr_ratio=0.5"], "train.min_lr_ratio=0.5 does nothing with "
     "train.schedule=constant"),
    (["train.optimizer=lion", "train.eps=0.001"], "train.eps=0.001 does nothing with train.optimizer=lion"),
    (["data.source=wikitext2"], "data.val_fraction=0.2 does nothing with data.source=wikitext2"),
])  # fmt: skip
def test_an_option_the_run_would_not_use_is_refused(tmp_path, capsys, sets, said):
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN.replace(", test_tokens: 64", ""))
    argv = ["run", str(manifest), "--dry-run", "--out", str(tmp_path / "o"), *(f"--set={s}" for s in sets)]
    assert fails(capsys, argv, said, "leave it out")
    if len(sets) > 1:  # the first setting alone is fine (the manifest's own val_fraction is the wikitext case's)
        assert main(["run", str(manifest), "--dry-run", "--out", str(tmp_path / "o"), f"--set={sets[0]}"]) == 0
