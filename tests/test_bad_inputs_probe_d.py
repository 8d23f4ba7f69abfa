"""Probe D's findings: damaged record fields, offline lm-eval tasks, mistyped HF config fields, odd tokenizer
chat templates, huge memory windows, full disks, --out files that are not records, empty or repeated bench
checkpoints, and messages that name the flag or key to fix."""

from __future__ import annotations

import json

import pytest
from helpers import error_line, fails, run_limited

from attnlab.data.files import sealed

pytestmark = pytest.mark.usefixtures("one_thread")

PERPLEXITY = {"benchmark": "perplexity", "model": "m", "kind": "mha", "split": "val", "tokens": 64, "loss": 4.2,
              "loss_ci": [4.1, 4.3], "ppl": 66.7, "ppl_ci": [60.3, 73.7]}  # fmt: skip
STREAM = {"benchmark": "stream_loss", "model": "m", "status": "ok", "bucket": 4, "positions": [0, 4],
          "bucket_loss": [4.0, 3.9], "bucket_ci": [[3.9, 4.1], [3.8, 4.0]], "length": 8, "streams": 1}  # fmt: skip


def write_records(folder, *rows):
    folder.mkdir(exist_ok=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(sealed(r)) + "\n" for r in rows))
    return str(folder)


# ----------------------------------------------------------------------------- 1. report on damaged fields


def test_a_report_of_intact_records_is_drawn(tmp_path, capsys):
    from attnlab.cli import main

    assert main(["report", write_records(tmp_path / "r", PERPLEXITY, STREAM)]) == 0
    assert (tmp_path / "r" / "report.md").exists()


@pytest.mark.parametrize(
    "damage, field",
    [
        ({"kind": None}, "'kind'"),
        ({"loss_ci": None}, "'loss_ci'"),
        ({"loss": "4.2"}, "'loss'"),
        ({"tokens": 6.5}, "'tokens'"),
    ],
)
def test_a_perplexity_record_with_a_damaged_field_is_refused(tmp_path, capsys, damage, field):
    row = {k: v for k, v in {**PERPLEXITY, **damage}.items() if v is not None}
    folder = write_records(tmp_path / "r", PERPLEXITY, row)
    assert fails(capsys, ["report", folder], "records.jsonl: record 2", field)
    assert not (tmp_path / "r" / "report.md").exists()


@pytest.mark.parametrize(
    "damage, field",
    [({"positions": 5}, "'positions'"), ({"positions": [0]}, "one entry per bucket"),
     ({"bucket_loss": [4.0, "x"]}, "'bucket_loss'")],
)  # fmt: skip
def test_a_stream_loss_record_with_damaged_positions_is_refused(tmp_path, capsys, damage, field):
    folder = write_records(tmp_path / "r", PERPLEXITY, {**STREAM, **damage})
    assert fails(capsys, ["report", folder], "records.jsonl: record 2", field)


# ----------------------------------------------------------------------------- 2. lm-eval offline


def test_an_lm_eval_task_whose_data_is_on_an_unreachable_hub_is_one_line(tmp_path, monkeypatch):
    """A task over a Hub dataset, offline: a DataError naming the task and dataset and the local copy to use."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("lm_eval")
    import huggingface_hub.constants
    from helpers import tiny_model

    from attnlab.data.tokenizers import ByteTokenizer
    from attnlab.errors import DataError
    from attnlab.eval import EvalModel
    from attnlab.eval.lmeval import run_lm_eval

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "arc_easy.yaml").write_text(
        "task: arc_easy\ndataset_path: nobody/no_such_dataset_xyz\noutput_type: multiple_choice\n"
        "validation_split: validation\ndoc_to_text: '{{question}}'\ndoc_to_target: 0\ndoc_to_choice: ['a', 'b']\n"
        "metric_list:\n  - metric: acc\n"
    )
    model = tiny_model(vocab_size=257, max_seq_len=32)
    byte_model = EvalModel("tiny-bytes", tmp_path, model.cfg, model, ByteTokenizer(), {})
    with pytest.raises(DataError) as caught:
        run_lm_eval(byte_model, ["arc_easy"], include_path=tasks, limit=1)
    message = str(caught.value)
    assert "'arc_easy'" in message and "nobody/no_such_dataset_xyz" in message and "could not be reached" in message
    assert "--tasks arc_easy_local" in message and "configs/lm_eval" in message
    assert "\n" not in message


def test_an_empty_lm_eval_task_name_is_refused(tmp_path, capsys):
    assert fails(capsys, ["lm-eval", str(tmp_path), "--tasks", "arc_easy,,piqa"], "--tasks", "empty task name")


# ----------------------------------------------------------------------------- 3, 4. HF folders


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_pretrained import random_model, save

    return save(random_model(), tmp_path_factory.mktemp("hf") / "llama")


def copy_with(folder, tmp_path, file: str, **changes):
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    data = json.loads((copy / file).read_text())
    (copy / file).write_text(json.dumps({**data, **changes}))
    return str(copy)


@pytest.mark.parametrize(
    "changes, fragments",
    [
        ({"rms_norm_eps": "abc"}, ["rms_norm_eps", "must be a number"]),
        ({"tie_word_embeddings": "false"}, ["tie_word_embeddings", "must be true or false"]),
        ({"hidden_size": 64.0}, ["hidden_size", "must be an integer"]),
    ],
)
def test_a_mistyped_hf_config_field_is_refused(hf_folder, tmp_path, capsys, changes, fragments):
    model = copy_with(hf_folder, tmp_path, "config.json", **changes)
    assert fails(capsys, ["info", model], "config.json", *fragments)


@pytest.mark.parametrize("template", [["x"], 5, [{"name": "default", "template": 7}]])
def test_a_chat_template_that_is_no_template_is_refused(hf_folder, tmp_path, capsys, template):
    model = copy_with(hf_folder, tmp_path, "tokenizer_config.json", chat_template=template)
    argv = ["generate", model, "a", "--max-new-tokens", "1"]
    assert fails(capsys, argv, "tokenizer_config.json", "chat_template", "Jinja template string")


def test_named_chat_templates_are_read(hf_folder, tmp_path):
    from attnlab.data.pretrained import tokenizer_from_folder

    named = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "{{ 'd' }}"}]
    model = copy_with(hf_folder, tmp_path, "tokenizer_config.json", chat_template=named)
    assert tokenizer_from_folder(model).chat_template == "{{ 'd' }}"


# ----------------------------------------------------------------------------- 6. full disks


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory):
    """A tiny trained model with a streaming memory (char tokenizer)."""
    from helpers import train_tiny_run

    model = {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64,
             "memory": {"kind": "streaming", "recent_window": 16, "sink_tokens": 2}}  # fmt: skip
    return train_tiny_run(tmp_path_factory.mktemp("memrun"), model, steps=4)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """A tiny trained model (mha, char tokenizer)."""
    from helpers import train_tiny_run

    model = {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}
    return train_tiny_run(tmp_path_factory.mktemp("plainrun"), model, steps=4)


def test_an_export_past_a_file_size_limit_names_the_file(plain_run, tmp_path, capsys, file_size_limit):
    out = tmp_path / "hf"
    assert run_limited(file_size_limit, 20_000, ["export", str(plain_run), "--hf", str(out)]) == 2
    error_line(capsys, "export", f"{out}/model.safetensors", "file too large", "ulimit -f")
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


def test_a_memory_ingest_past_a_file_size_limit_names_the_file(memory_run, tmp_path, capsys, file_size_limit):
    doc, store = tmp_path / "doc.txt", tmp_path / "store"
    doc.write_text("a cat sat on the mat " * 20)
    store.mkdir()
    argv = ["memory", "ingest", str(memory_run), str(doc), "--name", "m", "--store", str(store)]
    assert run_limited(file_size_limit, 2_000, argv) == 2  # the index cannot grow
    error_line(capsys, "memory ingest", "index.sqlite", "file size limit", "ulimit -f")
    from attnlab.cli import main

    assert main(argv) == 0  # the store is intact, and its index holds the state
    capsys.readouterr()
    state = next(p for p in store.rglob("*") if p.is_file() and p.suffix != ".sqlite")
    assert state.stat().st_size > 3_000
    argv[argv.index("m")] = "m2"
    assert run_limited(file_size_limit, 3_000, argv) == 2  # the state file cannot be written
    error_line(capsys, "memory ingest", "file too large")
    assert not any(p.name.endswith(".tmp") for p in store.rglob("*"))


def test_a_report_past_a_file_size_limit_names_the_plot(tmp_path, capsys, file_size_limit):
    row = {**STREAM, "positions": list(range(0, 400, 4)), "bucket_loss": [4.0] * 100, "bucket_ci": [[3.9, 4.1]] * 100}
    folder = write_records(tmp_path / "r", sealed(row))  # as bench writes it
    assert run_limited(file_size_limit, 3_000, ["report", folder]) == 2
    error_line(capsys, "report", "stream_loss.png", "file too large")
    assert not (tmp_path / "r" / "stream_loss.png").exists() and not (tmp_path / "r" / "report.md").exists()


def test_data_preparation_past_a_file_size_limit_names_the_file(tmp_path, capsys, file_size_limit, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    corpus = tmp_path / "big.txt"
    corpus.write_text("\n\n".join("a cat sat on the mat by the red door " * 20 for _ in range(60)))
    manifest = tmp_path / "m.yml"
    manifest.write_text(
        "targets:\n  t:\n    model: {d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 64}\n"
        f"    data: {{source: {corpus}, tokenizer: char}}\n    train: {{seq_len: 16, batch_size: 2, steps: 1}}\n"
    )
    argv = ["run", str(manifest), "--out", str(tmp_path / "runs"), "--no-progress"]
    assert run_limited(file_size_limit, 30_000, argv) == 2
    error_line(capsys, "run", ".bin", "file too large")
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.name.endswith(".tmp")]


# ----------------------------------------------------------------------------- 7. --out files that are not records


@pytest.mark.parametrize("command", [["kv-eval", "--policies", "k=q8_0"], ["kv-tune", "--budget", "100"]])
def test_an_out_file_that_is_not_records_is_refused_and_kept(tmp_path, capsys, command):
    out = tmp_path / "settings.yml"
    out.write_text("model:\n  d_model: 64\n")
    argv = [command[0], str(tmp_path / "no-model"), *command[1:], "--out", str(out)]
    assert fails(capsys, argv, "settings.yml", "not a file of attnlab records", "line 1")
    assert out.read_text() == "model:\n  d_model: 64\n"


def test_records_are_appended_to_a_records_file(tmp_path):
    from attnlab.eval.records import append_records

    out = tmp_path / "r.jsonl"
    append_records(out, [{"benchmark": "x", "a": 1}])
    append_records(out, [{"benchmark": "x", "a": 2}])
    assert [json.loads(line)["a"] for line in out.read_text().splitlines()] == [1, 2]


# ----------------------------------------------------------------------------- 8. bench checkpoints


def test_a_bench_manifest_without_checkpoints_is_refused(tmp_path, capsys):
    manifest = tmp_path / "b.yml"
    manifest.write_text("checkpoints: []\nbenchmarks: {perplexity: {split: val}}\n")
    assert fails(capsys, ["bench", str(manifest), "--out", str(tmp_path / "out")], "b.yml", "checkpoints names no")
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_listed_twice_is_benchmarked_once(tmp_path):
    from attnlab.eval.harness import load_plan

    run = tmp_path / "run"
    run.mkdir()
    manifest = tmp_path / "b.yml"
    manifest.write_text(f"checkpoints: [{run}, {run}/, {tmp_path}/./run, {tmp_path}/r*]\n"
                        "benchmarks: {perplexity: {split: val}}\n")  # fmt: skip
    assert load_plan([str(manifest)]).checkpoints == (str(run),)


# ----------------------------------------------------------------------------- 9. attention_maps.unit


def test_an_attention_maps_unit_other_than_chars_or_tokens_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    argv = ["bench", str(run), "--benchmarks", "attention_maps", "--set", "attention_maps.unit=bytes",
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert fails(capsys, argv, "attention_maps.unit='bytes'", "is not one of chars, tokens")


# ----------------------------------------------------------------------------- 10. vocab_size below the tokenizer's


@pytest.mark.parametrize("command", [["validate"], ["run", "--dry-run"]])
def test_a_vocab_size_below_a_model_tokenizers_is_refused(hf_folder, tmp_path, capsys, command):
    corpus = tmp_path / "text.txt"
    corpus.write_text("the cat sat on the mat\n\n" * 50)
    manifest = tmp_path / "m.yml"
    manifest.write_text(
        "targets:\n  small:\n    model: {vocab_size: 40, d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 64}\n"
        f"    data: {{source: {corpus}, tokenizer: {hf_folder}}}\n    train: {{seq_len: 16, batch_size: 2, steps: 1}}\n"
    )
    from attnlab.cli import main

    argv = [command[0], str(manifest), *command[1:]] + (["--out", str(tmp_path / "runs")] if command[1:] else [])
    assert main(argv) == 2  # validate lists its problems one a line, run refuses in one line
    err = capsys.readouterr().err
    assert "targets.small.model.vocab_size=40 is smaller than the 263 ids of data.tokenizer" in err, err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- 11. data folders that are not there


def write_small_manifest(tmp_path, source: str):
    manifest = tmp_path / "m.yml"
    manifest.write_text(
        "targets:\n  t:\n    model: {d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 64}\n"
        f"    data: {{source: {source}, tokenizer: char}}\n    train: {{seq_len: 16, batch_size: 2, steps: 1}}\n"
    )
    return str(manifest)


@pytest.mark.parametrize("command", [["validate", "M"], ["generate", "MODEL", "a"], ["run", "M", "--dry-run"]])
def test_a_data_dir_that_does_not_exist_is_refused(tmp_path, capsys, command):
    argv = [{"M": write_small_manifest(tmp_path, "text.txt"), "MODEL": str(tmp_path)}.get(a, a) for a in command]
    assert fails(capsys, [*argv, "--data-dir", str(tmp_path / "nosuch")], "--data-dir", "nosuch", "no such folder")


def test_an_attnlab_data_that_does_not_exist_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ATTNLAB_DATA", str(tmp_path / "nosuch"))
    argv = ["run", write_small_manifest(tmp_path, "text.txt"), "--dry-run"]
    assert fails(capsys, argv, "$ATTNLAB_DATA=", "nosuch", "no such folder")


def test_validate_with_a_data_dir_checks_the_local_data_files(tmp_path, capsys):
    from attnlab.cli import main

    (tmp_path / "data").mkdir()
    manifest = write_small_manifest(tmp_path, "missing.txt")
    assert main(["validate", manifest, "--data-dir", str(tmp_path / "data")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    (tmp_path / "data" / "missing.txt").write_text("a cat\n")  # one document: the run finds its val split empty
    assert main(["validate", manifest, "--data-dir", str(tmp_path / "data")]) == 2
    assert "no document fell in the" in capsys.readouterr().err
    (tmp_path / "data" / "missing.txt").write_text("\n\n".join(f"a cat number {i}" for i in range(400)))
    assert main(["validate", manifest, "--data-dir", str(tmp_path / "data")]) == 0


# ----------------------------------------------------------------------------- 12. the first row after a resume


def test_the_first_metrics_row_after_a_resume_off_a_log_boundary_is_the_uninterrupted_one(tmp_path, monkeypatch):
    from test_train import configs, losses

    from attnlab.train import loop
    from attnlab.train.logging import MetricsLog

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("\n\n".join(f"the cat {'sat ' * (i % 7)}on the mat {i}." for i in range(300)) + "\n")
    model, data, train = configs(corpus, steps=8, log_every=4, eval_every=8, checkpoint_every=3)
    loop.train(model, data, train, tmp_path / "whole", progress=False)

    original_write = MetricsLog.write

    def crash_at_step_8(self, row):
        if row.get("step") == 8 and "loss" in row:
            raise KeyboardInterrupt  # after the step-6 checkpoint, two steps into the row of steps 5..8
        original_write(self, row)

    monkeypatch.setattr(MetricsLog, "write", crash_at_step_8)
    with pytest.raises(KeyboardInterrupt):
        loop.train(model, data, train, tmp_path / "cut", progress=False)
    monkeypatch.setattr(MetricsLog, "write", original_write)
    loop.train(model, data, train, tmp_path / "cut", progress=False)  # resumes from step 6
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")


# ----------------------------------------------------------------------------- 13, 20. KV policy options and names


def test_a_kivi_group_without_a_kivi_format_is_refused():
    from attnlab.cache.codecs import KVPolicy
    from attnlab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"group=7 is the group size of the KIVI formats .*leave group out"):
        KVPolicy.parse("k=q8_0,v=q8_0,group=7")
    assert KVPolicy.parse("k=kivi2,v=q8_0,group=16").group == 16


def test_a_policy_key_that_names_no_tensor_says_so(tmp_path, capsys):
    from attnlab.cache.codecs import KVPolicy
    from attnlab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'nosuch' is not a cached tensor name \(k, v, ksem, .*\) nor resid"):
        KVPolicy.parse("k=q8_0,v=q8_0,nosuch=1")
    with pytest.raises(ConfigError, match=r"k='zz': unknown format"):
        KVPolicy.parse("k=zz")
    argv = ["kv-eval", str(tmp_path), "--policies", "k=q8_0,nosuch=1"]
    assert fails(capsys, argv, "'nosuch' is not a cached tensor name")


# ----------------------------------------------------------------------------- 14, 19. memory queries


@pytest.fixture
def ingested(memory_run, tmp_path, capsys):
    from attnlab.cli import main

    doc, store = tmp_path / "doc.txt", tmp_path / "store"
    doc.write_text("a cat sat on the mat by the red door. " * 3)
    assert main(["memory", "ingest", str(memory_run), str(doc), "--name", "notes", "--store", str(store)]) == 0
    capsys.readouterr()
    return store


def test_a_memory_query_asking_for_days_of_tokens_is_cut_and_says_so(ingested, capsys, monkeypatch):
    from attnlab.cli import main
    from attnlab.memory import store

    assert store.MAX_ANSWER_TOKENS == 65_536
    monkeypatch.setattr(store, "MAX_ANSWER_TOKENS", 80)  # the same rule, fast: past max_seq_len (64) still
    argv = ["memory", "query", "notes", "a", "--store", str(ingested), "--max-new-tokens", "1000000000"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "warning: max_new_tokens=1,000,000,000" in captured.err and "generating at most 80" in captured.err
    assert len(captured.out.rstrip("\n")) <= len("a") + 80


def test_a_memory_whose_state_file_is_gone_says_how_to_recover(ingested, capsys):
    for state in ingested.rglob("*.safetensors"):
        state.unlink()
    argv = ["memory", "query", "notes", "a", "--store", str(ingested), "--max-new-tokens", "2"]
    assert fails(capsys, argv, "state file of memory 'notes' is missing", "--replace", "attnlab memory rm notes")


# ----------------------------------------------------------------------------- 15. info --seq-len


@pytest.mark.parametrize("seq_len", ["99999999999999999999", "2147483648", "0"])
def test_an_info_seq_len_out_of_range_is_refused(tmp_path, capsys, seq_len):
    config = tmp_path / "c.yml"
    config.write_text("vocab_size: 97\nd_model: 64\nn_layers: 2\nn_heads: 4\nmax_seq_len: 64\n")
    assert fails(capsys, ["info", str(config), "--seq-len", seq_len], f"--seq-len {seq_len}", "2,147,483,647")


def test_an_info_seq_len_past_the_context_is_still_estimated(tmp_path, capsys):
    from attnlab.cli import main

    config = tmp_path / "c.yml"
    config.write_text("vocab_size: 97\nd_model: 64\nn_layers: 2\nn_heads: 4\nmax_seq_len: 64\n")
    assert main(["info", str(config), "--seq-len", "2147483647"]) == 0
    assert "1,099,511,627,264 bytes" in capsys.readouterr().out  # 512 bytes a token


# ----------------------------------------------------------------------------- 18. empty paths


@pytest.mark.parametrize("argv", [["convert", "M", "--attention", "kind=mha,n_kv_heads=1", "--out", ""],
                                  ["export", "M", "--hf", ""], ["bench", "M", "--out", ""]])  # fmt: skip
def test_an_empty_path_option_is_refused(tmp_path, capsys, argv):
    argv = [str(tmp_path) if a == "M" else a for a in argv]
    assert fails(capsys, argv, f"{argv[-2]} is empty: give a path")


# ----------------------------------------------------------------------------- 16. kv-eval's flags


def test_kv_eval_tokens_below_one_window_names_the_flags(tmp_path, capsys):
    argv = ["kv-eval", str(tmp_path), "--policies", "k=q8_0", "--tokens", "10", "--seq-len", "16"]
    assert fails(capsys, argv, "--tokens 10 is fewer than one window of --seq-len 16", "--tokens >= 17")


def test_kv_eval_seq_len_past_the_context_names_the_limit(plain_run, capsys):
    argv = ["kv-eval", str(plain_run), "--policies", "k=q8_0", "--split", "val", "--seq-len", "100"]
    assert fails(capsys, argv, "--seq-len 100", "max_seq_len=64", "--seq-len 64 or less")


def test_kv_eval_at_the_full_context_warns_nothing():
    """A window as long as the context: the greedy check continues half a window by what the context leaves
    (16 tokens here, not 32), with no LengthWarning."""
    import warnings

    import torch
    from helpers import tiny_model

    from attnlab.eval.kvquant import evaluate_policies

    model = tiny_model(max_seq_len=32)
    windows = torch.randint(0, 97, (2, 33), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = evaluate_policies(model, windows, ["k=q8_0"], greedy_prompts=2)
    assert rows[0]["greedy"] is not None


# ----------------------------------------------------------------------------- 17. benchmark parameters named


@pytest.mark.parametrize(
    "sets, fragment",
    [
        (["stream_loss.length=1", "stream_loss.streams=1"], "benchmarks.stream_loss.length=1 must be >= 2"),
        (["attention_maps.prompt=" + "a cat " * 20], "benchmarks.attention_maps.prompt='a cat a cat"),
    ],
)
def test_a_parameter_a_benchmark_refuses_is_named_with_its_benchmark(plain_run, tmp_path, capsys, sets, fragment):
    benchmark = sets[0].partition(".")[0]
    argv = ["bench", str(plain_run), "--benchmarks", benchmark, "--out", str(tmp_path / "out")]
    for item in sets:
        argv += ["--set", item]
    assert fails(capsys, argv, fragment)


def test_named_parameters_leave_other_names_alone():
    from attnlab.eval.harness import named_parameters

    message = "depths=[1.5] must lie in [0, 1] (max_seq_len=32, the model's)"
    assert named_parameters("needle", message, {"depths": [0.5], "seq_len": 3}, "m") == (
        "benchmarks.needle.depths=[1.5] must lie in [0, 1] (max_seq_len=32, the model's)"
    )
    assert named_parameters("needle", "no data", {"depths": [0.5]}, "m") == "benchmarks.needle on m: no data"


# ----------------------------------------------------------------------------- 5. huge memory windows


@pytest.mark.parametrize("kind", ["window", "streaming", "h2o", "bounded"])
def test_a_huge_recent_window_allocates_only_what_a_request_can_hold(kind):
    """A cache made for 12 tokens holds 12 ring slots, not recent_window's 100,000, reads exactly as the
    uncut memory does, and refuses a 13th token; kv_report counts the same bytes."""
    import torch
    from helpers import tiny_model

    from attnlab.accounting import kv_report
    from attnlab.errors import InputError
    from attnlab.generate import prefill

    extra = {"window": {}, "streaming": {"sink_tokens": 2}, "h2o": {"heavy_slots": 3},
             "bounded": {"exact_slots": 2, "summary_slots": 2}}[kind]  # fmt: skip
    model = tiny_model(memory={"kind": kind, "recent_window": 100_000, **extra}, n_layers=1, perturb=True)
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    cut, whole = model.new_cache(1, 12), model.new_cache(1)
    assert cut.layers[0].capacity == 12 + model.cfg.memory.slots - 100_000
    assert cut.nbytes() == kv_report(model.cfg, "fp32", 12)["kv_bytes"] < whole.nbytes() / 1000
    with torch.no_grad():
        want = torch.cat([prefill(model, tokens[:, :7], whole, 3)] + [model(tokens[:, i : i + 1], whole)[0][:, -1]
                                                                      for i in range(7, 12)])  # fmt: skip
        got = torch.cat([prefill(model, tokens[:, :7], cut, 3)] + [model(tokens[:, i : i + 1], cut)[0][:, -1]
                                                                   for i in range(7, 12)])  # fmt: skip
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # (float sums over buffers of other lengths)
        with pytest.raises(InputError, match="made for max_len=12 tokens got 13"):
            model(tokens[:, :1], cut)


def test_generate_with_a_huge_recent_window_is_small():
    import torch
    from helpers import tiny_model

    from attnlab.generate import generate

    model = tiny_model(memory={"kind": "streaming", "recent_window": 16_000_000, "sink_tokens": 4}, n_layers=1)
    made = []
    original = model.new_cache
    model.new_cache = lambda *a, **k: made.append(original(*a, **k)) or made[-1]
    out = generate(model, torch.tensor([1, 2, 3]), max_new_tokens=3, compile=False)
    assert out.shape == (3,) and made and all(c.nbytes() < 100_000 for c in made)
