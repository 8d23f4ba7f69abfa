"""Probe U's findings about configs and arguments fixed at once (branch fix13-cfg): a sliding window that covers the
context (v1); lm-eval's local arguments checked before its tasks reach the Hub (v2); a link loop or dangling link as a
memory --store (v3); convert's --memory errors and its "nothing to convert" line (v4, v5); kv-tune's default
--seq-len (v6); a data source of an unknown suffix (v7); no usable temporary directory (v8)."""

from __future__ import annotations

import os

import pytest
from helpers import fails, hat_text, probe_manifest

from attnlab.attention.mha import MHAConfig
from attnlab.attention.sliding import SlidingConfig
from attnlab.cli import main
from attnlab.config import ModelConfig
from attnlab.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = "{seq_len: 16, batch_size: 2, steps: 4, warmup_steps: 1, eval_every: 2, eval_tokens: 32, checkpoint_every: 2}"


# ----------------------------------------------------------------------------- v1: a window that hides nothing


@pytest.mark.parametrize("window", [64, 1000])
def test_v1_a_sliding_window_not_below_max_seq_len_is_refused_by_validate_dry_run_and_run(tmp_path, capsys, window):
    """max_seq_len 64: a window of 64 or more is full attention (a model without a memory reads at most 64 tokens)."""
    targets = f"  base: {{model: {{attention: {{kind: sliding, window: {window}}}}}}}\n"
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, targets=targets)
    said = (f"attention.window={window} is not less than max_seq_len=64", "plain mha", "use attention.kind: mha",
            "a window below 64")  # fmt: skip
    assert main(["validate", str(manifest)]) == 2
    captured = capsys.readouterr()
    assert all(part in captured.out + captured.err for part in said) and "Traceback" not in captured.err
    out = tmp_path / "runs"
    for extra in (["--dry-run"], []):
        assert fails(capsys, ["run", str(manifest), "--out", str(out), "--no-progress", *extra], *said)
    assert not out.exists()


def test_v1_a_window_below_max_seq_len_is_kept_and_the_library_refuses_the_rest():
    base = dict(vocab_size=50, d_model=32, n_layers=1, n_heads=4, max_seq_len=64)
    assert ModelConfig(attention=SlidingConfig(window=63), **base).attention.window == 63
    with pytest.raises(ConfigError, match=r"attention\.window=64 is not less than max_seq_len=64"):
        ModelConfig(attention=SlidingConfig(window=64), **base)


def test_v1_a_hugging_face_window_covering_the_context_imports_as_mha():
    """Tiny Mistral models ship sliding_window 4096 over 512 positions: transformers attends fully, so does mha."""
    from attnlab.interop.hf import config_from_hf

    hf = dict(architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=50, hidden_size=32,
              intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-5)  # fmt: skip
    assert config_from_hf({**hf, "sliding_window": 4096}).attention == MHAConfig(n_kv_heads=2, head_dim=8)
    assert config_from_hf({**hf, "sliding_window": 64}).attention.kind == "mha"
    assert config_from_hf({**hf, "sliding_window": 63}).attention == SlidingConfig(window=63, n_kv_heads=2, head_dim=8)


# ----------------------------------------------------------------------------- v2: lm-eval's local arguments first


@pytest.mark.parametrize(
    ("model", "extra", "said"),
    [
        ("seed0", ["--kv-policy", "k=zz"], "kv policy k='zz': unknown format"),
        ("seed0", ["--batch-size", "0"], "batch_size=0 must be a whole number >= 1"),
        ("nosuch", [], "nosuch: no such file or folder"),
    ],
)
def test_v2_lm_eval_checks_its_local_arguments_before_the_tasks(tiny_run, capsys, monkeypatch, model, extra, said):
    """A task of Hub data (arc_easy) retried the Hub for about a minute offline before a bad --kv-policy (or a model
    reference that names nothing) was said."""
    pytest.importorskip("lm_eval")
    import attnlab.eval.lmeval as lmeval

    monkeypatch.setattr(lmeval, "task_manager", lambda *a, **k: pytest.fail("the tasks were read first"))
    assert fails(capsys, ["lm-eval", str(tiny_run.parent / model), "--tasks", "arc_easy", *extra], said)


# ----------------------------------------------------------------------------- v3: a --store that is a broken link


@pytest.mark.parametrize("case", ["loop", "dangling"])
def test_v3_every_memory_command_refuses_a_store_that_is_a_broken_link(tiny_run, tmp_path, capsys, case):
    """`memory ls` said "no memories in mloop" (exit 0), as for a store not made yet; the others, no such memory."""
    store, doc = tmp_path / "store", tmp_path / "doc.txt"
    doc.write_text("the cat sat on the mat\n")
    os.symlink(store if case == "loop" else tmp_path / "nowhere", store)
    said = "a symbolic link loop" if case == "loop" else f"a symbolic link to {tmp_path / 'nowhere'}, which is not"
    for argv in (["ls"], ["rm", "x"], ["query", "x", "hi"], ["ingest", str(tiny_run), str(doc), "--name", "x"]):
        assert fails(capsys, ["memory", *argv, "--store", str(store)], f"--store {store}: {said}", "remove the link")
    assert os.path.islink(store) and not (tmp_path / "nowhere").exists()
    missing = tmp_path / "not-made-yet"  # a store given that is not there is refused too (probe AA, U5)
    assert fails(capsys, ["memory", "ls", "--store", str(missing)], f"--store {missing}: no such memory store")


# ----------------------------------------------------------------------------- v4, v5: convert's lines


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--memory", "kind=window,recent_window=0"], "--memory: memory.recent_window=0 must be >= 1"),
        (["--memory", "kind=window,sink_tokens=4"], "--memory: memory.sink_tokens belongs to memory.kind streaming"),
        (["--attention", "window=8"], "--attention: attention.window belongs to attention kind sliding"),
        (["--attention", "kind=mha,n_kv_heads=3"], "--attention: attention.n_kv_heads=3 must divide n_heads=2"),
    ],
)
def test_v4_convert_names_the_flag_of_a_bad_option_once(tiny_run, tmp_path, capsys, flags, said):
    """It read "attnlab convert: error: convert: memory.recent_window=0 ...": convert twice, and no --memory."""
    out = tmp_path / "converted"
    line = fails(capsys, ["convert", str(tiny_run), *flags, "--out", str(out), "--eval-tokens", "0"], said)
    assert line.startswith(f"attnlab convert: error: {said}") and "convert: " not in line.split("error: ", 1)[1]
    assert not out.exists()


def test_v5_nothing_to_convert_says_what_the_model_has(tiny_run, tmp_path, capsys):
    """It said "mha with 2 KV heads of 16": 16 what? Now: which heads, and head_dim."""
    argv = ["convert", str(tiny_run), "--attention", "kind=mha", "--out", str(tmp_path / "c"), "--eval-tokens", "0"]
    assert fails(capsys, argv, f"--attention kind=mha asks for {tiny_run} as it already is: attention mha with 2 KV "
                 "heads for its 2 query heads, head_dim 16, and no memory")  # fmt: skip


# ----------------------------------------------------------------------------- v6: kv-tune's default --seq-len


@pytest.mark.parametrize("command", [["kv-tune", "--budget", "0.5"], ["kv-eval", "--policies", "k=q8_0"]])
def test_v6_the_default_seq_len_fits_a_short_model_and_only_a_given_one_is_refused(tiny_run, capsys, command):
    """A 64-token model: kv-tune without --seq-len was refused for "--seq-len 512", which the user never typed."""
    name, *flags = command
    argv = [name, str(tiny_run), *flags, "--split", "val", "--tokens", "10"]  # (fewer tokens than one window)
    assert fails(capsys, argv, "--tokens 10 is fewer than one window of --seq-len 64")
    assert fails(capsys, [*argv[:-2], "--seq-len", "512"], "--seq-len 512 is more than", "max_seq_len=64")


# ----------------------------------------------------------------------------- v7: what a compressed source may be


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("wiki.valid.tokens.xz", "a .xz compressed file whose name before .xz ends in .tokens: only a compressed .txt"),
        ("docs.parquet.gz", "a parquet file compressed with .gz: give it uncompressed"),
        ("notes.csv", "not a .txt, .jsonl or .parquet file (a .txt or .jsonl file may be compressed too"),
    ],
)
def test_v7_a_source_of_another_kind_is_refused_saying_what_is_read(tmp_path, capsys, name, said):
    """`foo.tokens.xz` was refused with "(.xz compressed allowed)"; a .parquet.gz was taken, then not readable."""
    from attnlab.config import DataConfig

    with pytest.raises(ConfigError, match="is not a known dataset") as error:
        DataConfig(source=str(tmp_path / name))
    assert said in str(error.value) and "compressed allowed" not in str(error.value)
    assert DataConfig(source=str(tmp_path / "notes.txt.xz")).source and DataConfig(source="a.jsonl.gz").source
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN)
    argv = ["run", str(manifest), "--out", str(tmp_path / "runs"), "--dry-run", "--set", f"data.source={name}"]
    assert fails(capsys, argv, f"data.source='{name}' is not a known dataset", said)


# ----------------------------------------------------------------------------- v8: no usable temporary directory


@pytest.mark.parametrize("command", [["info", "model.yaml"], ["memory", "ls"]])
def test_v8_no_usable_temporary_directory_is_one_line_before_torch(tmp_path, command):
    """`(ulimit -f 0; attnlab info ...)`: torch's import needs a temporary file, and died in a FileNotFoundError
    traceback ("No usable temporary directory"). The shell ignores SIGXFSZ, so a write fails with EFBIG."""
    import resource
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import attnlab

    def no_file_bytes():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    src = str(Path(attnlab.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": src, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("TMPDIR", None)
    script = "import sys; from attnlab.cli import main; sys.exit(main())"
    done = subprocess.run([sys.executable, "-c", script, *command], cwd=tmp_path, env=env, preexec_fn=no_file_bytes,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"attnlab {' '.join(command[:2] if command[0] == 'memory' else command[:1])}: error: "
                               "no usable temporary directory (TMPDIR is not set): "), lines  # fmt: skip
    assert "a file-size limit (ulimit -f) of 0" in lines[0] and "set TMPDIR to a writable folder" in lines[0]
