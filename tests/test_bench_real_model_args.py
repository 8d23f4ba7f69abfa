"""bench/real_model.py's options (probe AD: AD8, AD9, U10). A bad value ended in a Python traceback, some after
minutes of measuring (AD8); a context at or below --new-tokens + 1 was measured after another prompt and labelled with
the one asked for, and an unknown --impls name was dropped without a word (AD9); a missing --data-dir was ignored
and --impls '' measured only the bandwidth (U10). Each is now refused at the start, in one line `real_model.py:
error: ...` (exit code 2) naming the option, the value and what works, before a model, the test set or the bandwidth
test is loaded: here every slow step raises, so a test reaching one fails. Each test fails with its fix backed out."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "real_model.py"
SMOLLM2 = "models/SmolLM2-135M-Instruct.Q4_1.gguf"


class Measured(Exception):
    """A slow step of the benchmark was reached (its options passed the checks)."""


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_real_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_work(bench, monkeypatch):
    """The benchmark's slow steps (the bandwidth test, loading a model or its tokenizer, the test set, the
    llama.cpp probe) raise Measured."""

    def slow(*args, **kwargs):
        raise Measured

    for name in ("read_bandwidth", "dataset_tokens", "load_for_eval", "llama_cpp_problem"):
        monkeypatch.setattr(bench, name, slow)
    monkeypatch.setattr(bench.attnlab, "load_model", slow)
    return bench


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    """A data folder whose SmolLM2 GGUF is the tests' tiny llama model (max_seq_len 64, vocab 97)."""
    pytest.importorskip("gguf")
    from gguf_files import write_gguf

    root = tmp_path_factory.mktemp("data")
    (root / "models").mkdir()
    write_gguf(root / SMOLLM2)
    return root


BASE = {"--impls": "attnlab", "--weights": "fp32", "--kv": "fp32", "--threads": "1", "--contexts": "16",
        "--prefill": "", "--new-tokens": "2", "--repeats": "1"}  # fmt: skip


def argv(data: Path, **options: str) -> list[str]:
    """BASE's options with `options` over them (contexts="" -> --contexts ''), --no-record, --data-dir data."""
    given = {**BASE, **{"--" + key.replace("_", "-"): value for key, value in options.items()}}
    return ["--no-record", "--data-dir", str(data), *(part for item in given.items() for part in item)]


def refused(bench, capsys, args: list[str], *fragments: str) -> str:
    """bench.main(args) exits 2 with one stderr line `real_model.py: error: ...` holding every fragment."""
    with pytest.raises(SystemExit) as done:
        bench.main(args)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("real_model.py: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


BAD = {
    "threads_empty": ({"threads": ""}, "--threads ''", "positive"),
    "threads_word": ({"threads": "abc"}, "--threads abc", "'abc'", "positive"),
    "threads_zero": ({"threads": "0"}, "--threads 0", "positive"),
    "threads_negative": ({"threads": "1,-1"}, "--threads 1,-1", "-1"),
    "contexts_float": ({"contexts": "1e3"}, "--contexts 1e3", "whole number"),
    "contexts_negative": ({"contexts": "-5"}, "--contexts -5", "at least 4"),
    "context_le_n": ({"contexts": "3"}, "--contexts 3", "--new-tokens 2", "at least 4"),
    "context_le_n_with_prefill": ({"contexts": "2", "prefill": "20"}, "--contexts 2", "at least 4"),
    "context_default_new_tokens": ({"contexts": "16,48", "new_tokens": "32"}, "--contexts 16,48", "at least 34"),
    "prefill_zero": ({"contexts": "", "prefill": "0"}, "--prefill 0", "positive"),
    "nothing": ({"contexts": "", "prefill": ""}, "--contexts ''", "--prefill ''", "nothing to measure"),
    "weights_unknown": ({"weights": "q3_k"}, "--weights q3_k", "fp32", "native", "q8_0"),
    "weights_empty": ({"weights": ""}, "--weights ''", "native"),
    "weights_activations": ({"weights": "native+q4"}, "--weights native+q4", "+q8"),
    "weights_q8_unquantized": ({"weights": "fp32+q8"}, "--weights fp32+q8", "native"),
    "kv_unknown": ({"kv": "q5"}, "--kv q5", "fp32, fp16, q8_0, q4_0"),
    "kv_nf4": ({"kv": "fp32,nf4"}, "--kv fp32,nf4", "'nf4'", "fp32, fp16, q8_0, q4_0"),
    "kv_empty": ({"kv": ""}, "--kv ''", "fp32, fp16, q8_0, q4_0"),
    "kv_policy": ({"kv": "k=q8_0,v=q8_0"}, "--kv k=q8_0,v=q8_0", "'k=q8_0'"),
    "llama_kv_unknown": ({"llama_kv": "f32"}, "--llama-kv f32", "f16, q8_0, q4_0"),
    "llama_kv_empty": ({"llama_kv": ""}, "--llama-kv ''", "f16, q8_0, q4_0"),
    "new_tokens_zero": ({"new_tokens": "0"}, "--new-tokens 0", "at least 1"),
    "new_tokens_negative": ({"new_tokens": "-3"}, "--new-tokens -3", "at least 1"),
    "new_tokens_word": ({"new_tokens": "abc"}, "--new-tokens", "'abc'"),
    "repeats_zero": ({"repeats": "0"}, "--repeats 0", "at least 1"),
    "impls_typo": ({"impls": "attnlab,llamacpp"}, "--impls attnlab,llamacpp", "'llamacpp'", "llama.cpp"),
    "impls_bogus": ({"impls": "bogus"}, "--impls bogus", "attnlab, transformers, llama.cpp"),
    "impls_empty": ({"impls": ""}, "--impls ''", "attnlab, transformers, llama.cpp"),
    "models_missing": ({"models": "nosuch/run"}, "--models nosuch/run", "no such"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_bad_option_is_refused_in_one_line_before_anything_is_measured(no_work, tiny_data, capsys, case):
    options, *fragments = BAD[case]
    assert refused(no_work, capsys, argv(tiny_data, **options), *fragments)


def test_a_missing_data_dir_is_refused(no_work, tmp_path, capsys):
    assert refused(no_work, capsys, argv(tmp_path / "nowhere"), f"--data-dir {tmp_path / 'nowhere'}", "no such folder")


@pytest.mark.parametrize(
    "options, fragments",
    [({"contexts": "65"}, ("--contexts 65", "max_seq_len 64")),
     ({"contexts": "", "prefill": "8,9000"}, ("--prefill 8,9000", "9000", "max_seq_len 64"))],
)  # fmt: skip
def test_a_length_past_the_models_context_is_refused_from_its_header(no_work, tiny_data, capsys, options, fragments):
    assert refused(no_work, capsys, argv(tiny_data, **options), *fragments)


def test_smollm2s_context_is_read_from_its_gguf(no_work, data_dir, capsys):
    if not (data_dir / SMOLLM2).is_file():
        pytest.skip(f"no {SMOLLM2} in {data_dir}")
    assert refused(no_work, capsys, argv(data_dir, contexts="", prefill="9000"), "--prefill 9000", "max_seq_len 8192")


def test_a_model_of_another_vocabulary_is_refused(no_work, tiny_data, tiny_run, capsys):
    """--models takes conversions of SmolLM2: the prompts are its tokens (a run of vocab 40 would fail mid-run)."""
    ref = str(tiny_run)
    assert refused(no_work, capsys, argv(tiny_data, models=ref), f"--models {ref}", "vocab", "40", "97")


def test_only_llama_cpp_asked_and_it_cannot_run_is_refused(no_work, tiny_data, monkeypatch, capsys):
    monkeypatch.setattr(no_work, "llama_cpp_problem", lambda path: "a test evaluation failed: no")
    assert refused(no_work, capsys, argv(tiny_data, impls="llama.cpp"), "--impls llama.cpp", "nothing to measure")


@pytest.mark.parametrize(
    "options",
    [{}, {"contexts": "", "prefill": "8"}, {"prefill": ""}, {"contexts": "", "prefill": "64"},
     {"contexts": "4,64", "prefill": "1", "threads": "1,2", "weights": "fp32,native+q8,q4_0+q8", "kv": "fp16,q4_0",
      "impls": "attnlab,transformers", "models": ""}],
)  # fmt: skip
def test_good_options_reach_the_measuring(no_work, tiny_data, options):
    """--contexts '' or --prefill '' runs one half (on purpose: the other half is left out); lengths up to the model's
    context, contexts from --new-tokens + 2."""
    with pytest.raises(Measured):
        no_work.main(argv(tiny_data, **options))


def test_an_attnlab_error_while_measuring_is_one_line(no_work, tiny_data, monkeypatch, capsys):
    """What the checks cannot see (a model that fails to load, say) is said as attnlab's CLI says it."""
    from attnlab.errors import DataError

    def fail(*args):
        raise DataError("x.gguf: not a readable GGUF file (truncated);\n is it truncated?")

    monkeypatch.setattr(no_work, "measure", fail)
    assert refused(no_work, capsys, argv(tiny_data), "x.gguf: not a readable GGUF file (truncated); is it truncated?")


def test_models_take_every_weights_value_but_the_ggufs_own(bench):
    """--models (converted run folders, fp32) are measured with each --weights value they can have: not native (a
    GGUF's own blocks), fp32 when only native ones were asked for."""
    assert bench.model_weights(["native+q8", "fp32", "q8_0", "q4_0+q8", "native"]) == ["fp32", "q8_0", "q4_0+q8"]
    assert bench.model_weights(["native", "native+q8"]) == ["fp32"]


def test_a_run_folder_is_labelled_by_its_target_not_seed0(bench, tmp_path):
    """Was: Path(ref).stem, 'seed0' for every --models run folder: their rows collapsed into one in the table and
    could not be told apart in the records."""
    from helpers import train_tiny_run

    run = train_tiny_run(tmp_path, {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64},
                         steps=2)  # fmt: skip
    assert bench.Attnlab(str(run), "fp32", "fp32", None).label == "tiny/seed0"
