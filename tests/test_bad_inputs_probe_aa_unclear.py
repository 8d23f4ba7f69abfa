"""Probe AA's unclear findings (/work/probe_aa/REPORT.md, U1, U3-U5, and its observations): a trainer.json that is not
an object says what deleting really does; `mc` with the model first says the order; `info` of a GGUF whose block
count its tensors contradict is refused as generate refuses it; `memory ls/rm/query` of a store that is not there
(a typo) is refused, not "no memories"; `lm-eval --tasks ''` is refused before lm-eval is imported; a whole number
written 4e0 (text to YAML 1.1) is said so. Each test fails with its fix backed out."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys

import pytest
from helpers import dry_run, fails, hat_text, probe_manifest, tiny_model

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

import test_bad_inputs_probe_v_runs as v_runs  # noqa: E402

RUN, STEP, interrupted, refused_alike = v_runs.RUN, v_runs.STEP, v_runs.interrupted, v_runs.refused_alike
stopped = v_runs.stopped  # (a module fixture: a run stopped right after its step-2 checkpoint, of 4)


# ----------------------------------------------------------------------------- U1: trainer.json not an object


def test_u1_a_trainer_json_that_is_not_an_object_names_the_checkpoints_to_delete(stopped, tmp_path, capsys):
    """Was: "...: incomplete or corrupt checkpoint (...); delete it to start over", and with that step folder deleted
    the next run refused again (last.json named it)."""
    argv, out = interrupted(stopped, tmp_path)
    folder = out / STEP
    (folder / "trainer.json").write_text("[1, 2]\n")
    checksums = json.loads((folder / "checksums.json").read_text())
    data = (folder / "trainer.json").read_bytes()
    checksums["files"]["trainer.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "checksums.json").write_text(json.dumps(checksums))  # (as a careful hand would)
    line = refused_alike(capsys, argv, out)
    assert line == (
        f"{folder}: incomplete or corrupt checkpoint (trainer.json and config.json must hold objects); restore it from "
        f"a copy, or delete {out / RUN / 'checkpoints'} to train the run again from the start"
    )
    shutil.rmtree(out / RUN / "checkpoints")  # what the line says: the run starts over
    assert "would train 4 steps" in dry_run(capsys, [*argv, "--dry-run"])


# ----------------------------------------------------------------------------- U3: mc with the model first


def test_u3_mc_with_the_model_first_says_the_order(tmp_path, capsys):
    """Was: "arc_easy: no such file or folder (...) (a model reference is ...)", the task read as the model."""
    model = tmp_path / "run"
    model.mkdir()
    said = "the order is `attnlab mc TASK CHECKPOINT`, the task first"
    line = fails(capsys, ["mc", str(model), "arc_easy", "--limit", "2"], said)
    assert line == f"attnlab mc: error: arc_easy is a task and {model} is not one: {said}: attnlab mc arc_easy {model}"
    line = fails(capsys, ["mc", str(model), "nosuchtask"], said)  # the task misspelt too: the model is still named
    assert f"{model} is a model, not a task (arc_easy, piqa, winogrande, hellaswag)" in line
    assert fails(capsys, ["mc", "hf:org/name", "piqa"], "piqa is a task and hf:org/name is not one", said)


def test_u3_an_unknown_task_in_the_right_order_is_named_before_the_model_loads(tmp_path, capsys):
    """The task is checked first: the line is about the task, not the model (which is not there either)."""
    line = fails(capsys, ["mc", "arc_esy", str(tmp_path / "absent")], "unknown task 'arc_esy'", "arc_easy")
    assert "no such file" not in line and "order" not in line


# ----------------------------------------------------------------------------- U4: a GGUF's block count


def gguf_of_depth(path, layers: int, block_count: int):
    """A tiny llama GGUF holding the tensors of `layers` blocks, whose llama.block_count says `block_count`."""
    pytest.importorskip("gguf")
    import gguf
    import numpy as np
    from gguf_files import TOKENS, add_hparams, add_tensors, finish
    from helpers import gguf_name

    from attnlab.interop.hf import hf_targets

    model = tiny_model(d_model=64, n_heads=2, n_layers=layers, max_seq_len=64)
    cfg = model.cfg
    writer = gguf.GGUFWriter(str(path), "llama")
    add_hparams(writer, block_count, cfg.max_seq_len, cfg.d_model, cfg.hidden_dim, (cfg.n_heads, cfg.n_heads),
                cfg.rope_base, cfg.norm_eps, cfg.vocab_size)  # fmt: skip
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in TOKENS])
    writer.add_token_merges(["a b", "c d"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    tensors = {gguf_name(hf): t.detach().float().numpy().copy() for hf, t in hf_targets(model).items()}
    add_tensors(writer, tensors, lambda name, values: gguf.GGMLQuantizationType.F32, heads=(cfg.n_heads, cfg.n_heads))
    assert np.isfinite(tensors["token_embd.weight"]).all()
    return finish(writer, path)


@pytest.mark.parametrize(("layers", "block_count"), [(1, 2), (2, 1)])
def test_u4_info_refuses_a_gguf_whose_block_count_its_tensors_contradict(tmp_path, capsys, layers, block_count):
    """Was: info printed the parameters and KV bytes of block_count layers (exit 0); generate refused the file."""
    path = gguf_of_depth(tmp_path / "m.gguf", layers, block_count)
    depth = f"llama.block_count is {block_count} but the tensors are of {layers} block{'s' * (layers > 1)}"
    what = "missing tensor(s) blk.1.attn_norm.weight, " if layers < block_count else "tensor(s) blk.1.attn_norm.weight"
    line = fails(capsys, ["info", str(path)], f"{path}: {what}", f"({depth}): the file is damaged", "download")
    generated = fails(capsys, ["generate", str(path), "ab", "--max-new-tokens", "2"])
    assert generated.split("error: ", 1)[1] == line.split("error: ", 1)[1]  # the same line
    assert main(["info", str(gguf_of_depth(tmp_path / "ok.gguf", layers, layers))]) == 0  # (the check fits a good one)
    assert f"mha attention, {layers} layers" in capsys.readouterr().out


# ----------------------------------------------------------------------------- U5: a memory store not there


@pytest.mark.parametrize("verb", [["ls"], ["rm", "d1"], ["query", "d1", "the cat"]])
def test_u5_a_memory_store_that_is_not_there_is_refused(tmp_path, capsys, monkeypatch, verb):
    """Was: `memory ls --store nostore` said "no memories in nostore" (exit 0), rm "no memory named 'd1' in ..."."""
    store = tmp_path / "nostore"
    said = (f"--store {store}: no such memory store (no folder there; check the path, or make the store with "
            f"`attnlab memory ingest MODEL DOCUMENTS --name NAME --store {store}`)")  # fmt: skip
    assert fails(capsys, ["memory", *verb, "--store", str(store)]).endswith(f"error: {said}")
    monkeypatch.setenv("ATTNLAB_MEMORY", str(store))
    assert fails(capsys, ["memory", *verb], f"$ATTNLAB_MEMORY {store}: no such memory store")
    assert list(tmp_path.iterdir()) == []  # nothing made
    monkeypatch.delenv("ATTNLAB_MEMORY")
    if verb == ["ls"]:  # the default store, not made yet (no memory ingested on this machine), is still empty
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        assert main(["memory", "ls"]) == 0
        assert capsys.readouterr().out == f"no memories in {tmp_path / 'cache' / 'attnlab' / 'memory'}\n"
        (tmp_path / "empty").mkdir()  # a folder made for it, no memory in it yet: empty too
        assert (
            main(["memory", "ls", "--store", str(tmp_path / "empty")]) == 0 and "no memories" in capsys.readouterr().out
        )


# ----------------------------------------------------------------------------- lm-eval --tasks ''


@pytest.mark.parametrize("tasks", ["", " ", ",", " , "])
def test_lm_eval_tasks_naming_no_task_is_refused_before_lm_eval_is_imported(tmp_path, capsys, monkeypatch, tasks):
    """Was: refused only after lm-eval's imports and its task index (185 s under load), by run_lm_eval."""
    monkeypatch.setitem(sys.modules, "attnlab.eval.lmeval", None)  # importing it now fails
    said = f"--tasks {tasks!r} names no task (give lm-eval task names separated by commas, e.g. arc_easy,piqa)"
    assert fails(capsys, ["lm-eval", str(tmp_path / "absent"), "--tasks", tasks]).endswith(f"error: {said}")


# ----------------------------------------------------------------------------- a whole number written 4e0


def test_a_whole_number_in_exponent_form_is_said_to_be_read_as_text(tmp_path, capsys):
    """Was: "train.batch_size='4e0' must be int, got str" (YAML 1.1 reads 4e0, without a dot, as a string)."""
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), v_runs.TRAIN)
    argv = ["run", str(manifest), "--out", str(tmp_path / "out"), "--dry-run", "--set"]
    said = "4e0 is read as text (YAML reads a number with an exponent only when it has a dot, as in 4.0e0): write 4"
    assert fails(capsys, [*argv, "train.batch_size=4e0"]).endswith(
        f"train.batch_size='4e0' must be a whole number: {said}"
    )
    assert fails(capsys, [*argv, "train.steps=1e-3"]).endswith("train.steps='1e-3' must be a whole number, and 1e-3 is "
                                                              "not one (0.001)")  # fmt: skip
    config = tmp_path / "model.yaml"
    config.write_text("vocab_size: 97\nd_model: 64\nn_layers: 2e0\nn_heads: 4\nmax_seq_len: 64\n")
    assert main(["validate", str(config)]) == 2
    said = "2e0 is read as text (YAML reads a number with an exponent only when it has a dot, as in 2.0e0): write 2"
    assert capsys.readouterr().err == f"{config}: n_layers='2e0' must be a whole number: {said}\n"
    assert "would train 4 steps" in dry_run(capsys, [*argv, "train.lr=2e-3"])  # (a float field reads it as a number)
    assert not (tmp_path / "out").exists()


def test_an_exponent_in_a_whole_number_field_is_written_out_exactly():
    """float('1e40') is not 10**40: the integer to write comes from the text, exactly, or is not offered."""
    from attnlab.config_checks import exponent_text_problem

    assert exponent_text_problem("1e3", int, "train.steps").endswith(": write 1000")
    assert exponent_text_problem("1e22", int, "k").endswith(": write 1" + "0" * 22)  # float: 10000000000000000777216
    assert "write" not in exponent_text_problem("1e40", int, "k")  # (too long to write out)
    assert exponent_text_problem("25e-1", int, "k").endswith("25e-1 is not one (2.5)")
