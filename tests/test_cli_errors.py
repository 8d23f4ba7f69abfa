"""Every bad input through the CLI: exit code 2, exactly one line on stderr (`attnlab <cmd>: error: ...`)
naming the value, file or folder and what to do, and the user's files left as they were. A bug keeps its
traceback. Also the library's own refusals (attnlab.generate) and the KV policy's `flush` bound."""

import errno
import hashlib
import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import tiny_model, train_tiny_run

import attnlab
from attnlab import cli
from attnlab.accounting import kv_report
from attnlab.cli import main
from attnlab.cli_errors import MAX_LINE, one_line
from attnlab.errors import AttnlabWarning, InputError, LengthWarning
from attnlab.generate import check_sampling

generate_module = importlib.import_module("attnlab.generate")  # the module (attnlab.generate is the function)
can_compile_on_cpu = generate_module.can_compile_on_cpu  # the real check (the fixture below replaces it)

MAX_SEQ_LEN = 64
MODEL = {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 4, "max_seq_len": MAX_SEQ_LEN}
MEMORY_MODEL = {**MODEL, "attention": {"kind": "coda", "n_kv_heads": 2},
                "memory": {"kind": "bounded", "recent_window": 16, "exact_slots": 4, "summary_slots": 4}}  # fmt: skip


@pytest.fixture(autouse=True)
def offline_and_eager(monkeypatch):
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")
    # Each command loads its model anew: compiling its decode step would cost seconds per call, for nothing here.
    monkeypatch.setattr(generate_module, "can_compile_on_cpu", lambda: False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny trained run without a memory (char tokenizer, max_seq_len 64)."""
    return train_tiny_run(tmp_path_factory.mktemp("plain"), MODEL)


@pytest.fixture(scope="module")
def memory_store(tmp_path_factory):
    """(a store folder holding the memory 'notes', the run folder of its model with a bounded memory)."""
    root = tmp_path_factory.mktemp("memory")
    model = train_tiny_run(root, MEMORY_MODEL)
    doc = root / "doc.txt"
    doc.write_text("the cat sat on the mat by the red door.")
    store = root / "store"
    assert main(["memory", "ingest", str(model), str(doc), "--name", "notes", "--store", str(store)]) == 0
    return store, model


def snapshot(*folders: Path) -> dict:
    """Every file under the folders: its bytes' sha256 and modification time (what "unchanged" means)."""
    files = {}
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                files[path] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    return files


def cli_run(capsys, argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `attnlab argv`, in this process (argparse's errors exit by SystemExit)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_error_line(err: str, command: str, *fragments: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), f"expected one line on stderr, got {err!r}"
    assert lines[0].startswith(f"attnlab {command}: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# ---------------------------------------------------------------------------------------------- sampling flags
BAD_SAMPLING = [
    (["--temperature", "nan"], "temperature=nan must be a finite number >= 0"),
    (["--temperature", "inf"], "temperature=inf must be a finite number >= 0"),
    (["--temperature", "-1"], "temperature=-1.0 must be a finite number >= 0"),
    (["--temperature", "1", "--top-k", "0"], "top_k=0 must be a whole number >= 1"),
    (["--temperature", "1", "--top-k", "-3"], "top_k=-3 must be a whole number >= 1"),
    (["--temperature", "1", "--top-p", "0"], "top_p=0.0 must be in (0, 1]"),
    (["--temperature", "1", "--top-p", "-0.5"], "top_p=-0.5 must be in (0, 1]"),
    (["--temperature", "1", "--top-p", "2"], "top_p=2.0 must be in (0, 1]"),
    (["--temperature", "1", "--top-p", "nan"], "top_p=nan must be in (0, 1]"),
    (["--max-new-tokens", "-5"], "max_new_tokens=-5 must be a whole number >= 0"),
    (["--temperature", "1", "--seed", "-1"], "seed=-1 must be a whole number from 0 to 2**64 - 1"),
    (["--temperature", "1", "--seed", str(2**64)], f"seed={2**64} must be a whole number from 0"),
    (["--top-p", "abc"], "argument --top-p: invalid float value: 'abc'"),  # argparse's own check, on one line
    (["--max-new-tokens", "1.5"], "argument --max-new-tokens: invalid int value: '1.5'"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_SAMPLING, ids=[" ".join(f) for f, _ in BAD_SAMPLING])
def test_generate_refuses_a_bad_sampling_flag_in_one_line(capsys, run, flags, message):
    before = snapshot(run)
    code, out, err = cli_run(capsys, ["generate", str(run), "the cat", *flags])
    assert code == 2 and out == ""
    assert_one_error_line(err, "generate", message)
    assert snapshot(run) == before


def test_the_installed_command_prints_one_line_and_exits_2(run):
    """Through the real entry point (a new process): nothing else reaches stderr."""
    command = [sys.executable, "-m", "attnlab.cli", "generate", str(run), "the", "--temperature", "1", "--top-k", "0"]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "ATTNLAB_OFFLINE": "1"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert_one_error_line(proc.stderr, "generate", "top_k=0 must be a whole number >= 1")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "nan"], "temperature=nan"),
        (["--temperature", "1", "--top-k", "0"], "top_k=0"),
        (["--temperature", "1", "--top-p", "2"], "top_p=2.0"),
        (["--max-new-tokens", "-5"], "max_new_tokens=-5"),
        (["--temperature", "1", "--seed", "-1"], "seed=-1"),
    ],
)
def test_memory_query_refuses_a_bad_sampling_flag_in_one_line(capsys, memory_store, flags, message):
    store, model = memory_store
    before = snapshot(store, model)
    code, out, err = cli_run(capsys, ["memory", "query", "notes", "the", "--store", str(store), *flags])
    assert code == 2 and out == ""
    assert_one_error_line(err, "memory query", message)
    assert snapshot(store, model) == before


def test_a_bad_kv_policy_flush_is_one_line(capsys, run):
    code, _, err = cli_run(capsys, ["generate", str(run), "the", "--kv-policy", "k=q8_0,flush=x"])
    assert code == 2
    assert_one_error_line(err, "generate", "kv policy flush='x' must be a whole number")


def test_a_huge_flush_generates_like_a_full_precision_cache(capsys, run):
    """flush=10**9 once tried to preallocate 10**9 quantized rows per layer: now no more than the cache holds."""
    code, out, err = cli_run(capsys, ["generate", str(run), "the cat", "--max-new-tokens", "8"])
    assert code == 0 and err == ""
    policy = "k=q4_0,v=q4_0,flush=1000000000"
    code, got, err = cli_run(capsys, ["generate", str(run), "the cat", "--max-new-tokens", "8", "--kv-policy", policy])
    assert (code, got) == (0, out)  # and it says that such a flush quantizes nothing:
    assert err == (f"attnlab generate: warning: kv_policy {policy} quantizes nothing in this generation: "
                   "flush=1000000000 quantizes tokens 1000000000 at a time, and its 14 tokens are too few for one, so "
                   "the cache is the plain one (give a smaller flush, or leave the policy out)\n")  # fmt: skip


# ---------------------------------------------------------------------------------------------- request length
def test_generate_says_when_the_context_cuts_the_request(capsys, run):
    prompt = "the cat sat"  # 11 characters: 11 tokens of the char tokenizer
    code, out, err = cli_run(capsys, ["generate", str(run), prompt, "--max-new-tokens", "100"])
    room = MAX_SEQ_LEN - len(prompt)
    assert code == 0 and len(out.rstrip("\n")) == len(prompt) + room  # what fits is generated
    assert err == (
        f"attnlab generate: warning: the prompt of {len(prompt)} tokens leaves room for {room} new tokens of the "
        f"max_new_tokens=100 asked (max_seq_len {MAX_SEQ_LEN}): generating {room}\n"
    )
    code, out, err = cli_run(capsys, ["generate", str(run), prompt, "--max-new-tokens", str(room)])
    assert code == 0 and err == ""  # exactly what fits: nothing to say
    assert cli_run(capsys, ["generate", str(run), prompt]) == (code, out, "")  # the default: up to 64, what fits
    code, out, err = cli_run(capsys, ["generate", str(run), prompt, "--max-new-tokens", "0"])
    assert (code, out, err) == (0, prompt + "\n", "")
    code, out, err = cli_run(capsys, ["generate", str(run), "a" * MAX_SEQ_LEN])
    assert code == 2 and out == ""
    assert_one_error_line(err, "generate", f"prompt of {MAX_SEQ_LEN} tokens leaves no room to generate")


def test_memory_query_streams_past_max_seq_len(capsys, memory_store):
    """A model with a memory reads past max_seq_len: the whole request, and nothing to say."""
    store, _ = memory_store
    code, out, err = cli_run(capsys, ["memory", "query", "notes", "the", "--max-new-tokens", "100", "--store",
                                      str(store)])  # fmt: skip
    assert code == 0 and err == "" and len(out.rstrip("\n")) == len("the") + 100


# ------------------------------------------------------------------------------------ folders it may not write
def permissions_hold(folder: Path) -> bool:
    """Whether the OS refuses to write in `folder` (mode 0o500): not for root, which ignores permissions."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        probe = folder / ".probe"
        try:
            probe.write_text("")
        except PermissionError:
            return True  # root without CAP_DAC_OVERRIDE (e.g. under setpriv): permissions do hold
        probe.unlink()
        return False
    return True


@pytest.fixture
def readonly(tmp_path):
    folder = tmp_path / "readonly"
    folder.mkdir()
    folder.chmod(0o500)
    if not permissions_hold(folder):
        folder.chmod(0o700)
        pytest.skip("running as root: the OS ignores folder permissions")
    yield folder
    folder.chmod(0o700)


MANIFEST = f"""
name: demo
seeds: [0]
defaults:
  model: {{d_model: 32, n_layers: 1, n_heads: 4, max_seq_len: {MAX_SEQ_LEN}, attention: {{kind: mha}}}}
  data: {{source: SOURCE, tokenizer: char}}
  train: {{steps: 2, seq_len: 16, batch_size: 2, eval_every: 2, eval_tokens: 64}}
targets:
  base: {{}}
"""


def readonly_cases(run: Path, manifest: Path, readonly: Path, doc: Path, store: Path, model: Path) -> dict:
    """case -> (command, argv, environment, fragments the line names)."""
    out = str(readonly.parent / "out")
    return {
        "run": ("run", ["run", str(manifest), "--out", str(readonly), "--no-progress"], {},
                [str(readonly), "choose another folder with --out"]),
        "run-cache": ("run", ["run", str(manifest), "--out", out, "--no-progress"], {"XDG_CACHE_HOME": str(readonly)},
                      [str(readonly), "set XDG_CACHE_HOME to another folder"]),  # prepared data goes to the cache
        "bench": ("bench", ["bench", str(run), "--benchmarks", "perplexity", "--set", "perplexity.split=val", "--set",
                            "perplexity.max_tokens=64", "--out", str(readonly / "bench")], {}, [str(readonly)]),
        "compare": ("compare", ["compare", str(run.parents[1]), "--out", str(readonly / "compare")], {},
                    [str(readonly)]),
        "kv-eval": ("kv-eval", ["kv-eval", str(run), "--policies", "k=q8_0", "--split", "val", "--seq-len", "16",
                                "--tokens", "32", "--out", str(readonly / "kv.jsonl")], {},
                    [f"{readonly / 'kv.jsonl'}: permission denied"]),  # the file, not its temporary name
        "memory": ("memory", ["memory", "ingest", str(model), str(doc), "--name", "more", "--store", str(store)], {},
                   [str(store)]),
    }  # fmt: skip


@pytest.mark.parametrize("case", ["run", "run-cache", "bench", "compare", "kv-eval", "memory"])
def test_a_folder_it_may_not_write_is_one_line(capsys, monkeypatch, tmp_path, run, memory_store, readonly, case):
    store, model = memory_store
    manifest = tmp_path / "m.yml"
    manifest.write_text(MANIFEST.replace("SOURCE", str(run.parents[2] / "text.txt")))
    doc = tmp_path / "doc.txt"
    doc.write_text("a dog sat by the door")
    command, argv, environment, fragments = readonly_cases(run, manifest, readonly, doc, store, model)[case]
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    (store / "states").chmod(0o500)
    try:
        before = snapshot(run, store, model, tmp_path)
        code, _, err = cli_run(capsys, argv)
        after = snapshot(run, store, model, tmp_path)
    finally:
        (store / "states").chmod(0o700)
    assert code == 2
    assert_one_error_line(err, command, *fragments)
    assert after == before and list(readonly.iterdir()) == []


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("notes.txt", "notes.txt: is a file, where a folder is expected (give a folder's path)"),
        ("notes.txt/tables", "notes.txt/tables: a part of this path is a file, not a folder (check the path)"),
    ],
)
def test_a_file_where_a_folder_belongs_is_one_line(capsys, tmp_path, run, out, message):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    before = snapshot(tmp_path, run)
    code, _, err = cli_run(capsys, ["compare", str(run.parents[1]), "--out", str(tmp_path / out)])
    assert code == 2
    assert_one_error_line(err, "compare", f"{tmp_path}/{message}")
    assert snapshot(tmp_path, run) == before


# Without the need for permissions to hold (root ignores them): the OS's errors as the commands meet them.
@pytest.mark.parametrize(
    ("code", "fragments"),
    [
        (
            errno.EACCES,
            [
                "permission denied: cannot create it in",
                "make that folder writable, or choose another folder with --out",
            ],
        ),  # fmt: skip
        (errno.EROFS, ["on a read-only file system (write it somewhere else, or choose another folder with --out)"]),
        (errno.ENOSPC, ["no space left on the device (free some space, or choose another folder with --out)"]),
        (errno.EDQUOT, ["disk quota exceeded"]),
    ],
)
def test_os_errors_on_any_path_are_one_line(capsys, monkeypatch, tmp_path, code, fragments):
    target = tmp_path / "out" / "compare.md"

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(target.with_name(f".compare.md.{os.getpid()}.0123456789ab.tmp")))

    monkeypatch.setattr(cli, "compare", refuse)
    exit_code, _, err = cli_run(capsys, ["compare", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert exit_code == 2
    assert_one_error_line(err, "compare", str(target), *fragments)  # the file, not its temporary name


def test_a_full_disk_during_a_write_names_the_file(capsys, monkeypatch, tmp_path, run):
    write_text = Path.write_text

    def full_disk(self, *args, **kwargs):  # what write() on a full disk raises: an error that names no file
        if self.name.endswith(".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    exit_code, _, err = cli_run(capsys, ["compare", str(run.parents[1]), "--out", str(tmp_path / "out")])
    assert exit_code == 2
    # compare.csv is written first (compare.md's last line records its sha256)
    assert_one_error_line(err, "compare", f"{tmp_path / 'out' / 'compare.csv'}: no space left on the device (free "
                          "some space, or choose another folder with --out)")  # fmt: skip
    assert not (tmp_path / "out").exists()  # nothing written, and the folder made for the outputs gone with them


def test_a_permission_error_reading_an_existing_file_names_it(capsys, monkeypatch, tmp_path):
    config = tmp_path / "model.yaml"
    config.write_text("vocab_size: 100\n")

    def refuse(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(cli, "load_config", refuse)
    exit_code, _, err = cli_run(capsys, ["info", str(config)])
    assert exit_code == 2
    assert_one_error_line(err, "info", f"{config}: permission denied (check its permissions, or give another path)")


def test_a_missing_path_the_user_gave_is_one_line_and_a_bug_keeps_its_traceback(capsys, monkeypatch, tmp_path):
    given = tmp_path / "nowhere" / "model.yaml"

    def missing(path):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))

    monkeypatch.setattr(cli, "load_config", missing)
    exit_code, _, err = cli_run(capsys, ["info", str(given)])
    assert exit_code == 2
    assert_one_error_line(err, "info", f"{given}: no such file or folder (check the path)")

    def ours(path):  # a file attnlab itself should have made: a bug, whose traceback is kept
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/nonexistent/attnlab/internal.bin")

    monkeypatch.setattr(cli, "load_config", ours)
    with pytest.raises(FileNotFoundError):
        main(["info", str(given)])

    def bug(path):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "load_config", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["info", str(given)])


def test_a_multi_line_message_becomes_one_line(capsys, monkeypatch, tmp_path):
    def refuse(path):
        raise InputError("first line\n  second line\n     ^^^^\n\nthird")

    monkeypatch.setattr(cli, "load_config", refuse)
    exit_code, _, err = cli_run(capsys, ["info", str(tmp_path / "m.yaml")])
    assert exit_code == 2
    assert err == "attnlab info: error: first line second line third\n"
    long = one_line("x" * 5000)
    assert len(long) <= MAX_LINE and "more characters" in long and "\n" not in long


# ---------------------------------------------------------------------------------------------- the library
@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=50, d_model=32, max_seq_len=48)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"temperature": float("inf")}, "temperature=inf"),
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"temperature": "1"}, "temperature='1'"),
        ({"top_k": 0}, "top_k=0"),
        ({"top_k": -1}, "top_k=-1"),
        ({"top_k": 2.5}, "top_k=2.5"),
        ({"top_k": True}, "top_k=True"),
        ({"top_p": 0}, "top_p=0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_p": float("nan")}, "top_p=nan"),
        ({"max_new_tokens": -1}, "max_new_tokens=-1"),
        ({"max_new_tokens": 2.0}, "max_new_tokens=2.0"),
        ({"seed": -1}, "seed=-1"),
        ({"seed": 2**64}, "seed=18446744073709551616"),
        ({"prefill_chunk": 0}, "prefill_chunk=0"),
    ],
)
def test_generate_refuses_bad_sampling_arguments(model, kwargs, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace("*", r"\*")):
        attnlab.generate(model, [1, 2, 3], **{"temperature": 1.0, **kwargs})


def test_check_sampling_names_every_problem_and_takes_good_values():
    with pytest.raises(InputError) as info:
        check_sampling(max_new_tokens=-1, temperature=float("nan"), top_k=0, top_p=2.0, seed=-1)
    for name in ("max_new_tokens=-1", "temperature=nan", "top_k=0", "top_p=2.0", "seed=-1"):
        assert name in str(info.value)
    assert "\n" not in str(info.value)
    check_sampling(max_new_tokens=0, temperature=0, top_k=1, top_p=1.0, seed=0)  # the bounds themselves are fine
    check_sampling(
        max_new_tokens=torch.tensor(3), temperature=torch.tensor(0.7), top_k=None, top_p=1e-9, seed=2**64 - 1
    )


def test_prompt_ids_outside_the_vocabulary_are_refused(model):
    with pytest.raises(InputError, match=r"prompt token ids must be in 0 \.\. 49 \(vocab_size=50\), got 50"):
        attnlab.generate(model, [1, 50])
    with pytest.raises(InputError, match="got -1"):
        attnlab.generate(model, [-1, 2])
    with pytest.raises(InputError, match="prompt is a torch.float32 tensor: give token ids"):
        attnlab.generate(model, torch.tensor([1.5, 2.0]))
    with pytest.raises(InputError, match="prompt is empty: give at least one token"):
        attnlab.generate(model, torch.tensor([]))  # an empty text's ids: float32, of no type that matters


def test_an_empty_prompt_is_called_empty(capsys, run, memory_store):
    code, _, err = cli_run(capsys, ["generate", str(run), ""])
    assert code == 2
    assert (
        err == "attnlab generate: error: prompt is empty: give at least one token (text to continue, or a BOS token)\n"
    )
    code, _, err = cli_run(capsys, ["memory", "query", "notes", "", "--store", str(memory_store[0])])
    assert code == 2 and err.startswith("attnlab memory query: error: prompt is empty:") and len(err.splitlines()) == 1


def test_zero_new_tokens_is_an_empty_answer(model):
    assert attnlab.generate(model, [1, 2, 3], max_new_tokens=0).tolist() == []
    assert attnlab.generate(model, torch.tensor([[1, 2], [3, 4]]), max_new_tokens=0).shape == (2, 0)
    cache = model.new_cache(1)
    assert attnlab.generate(model, [1, 2, 3], max_new_tokens=0, cache=cache).tolist() == []
    assert cache.seen == 3  # a given cache still reads the prompt


def test_a_request_past_max_seq_len_generates_what_fits_and_warns(model):
    prompt = list(range(1, 41))
    with pytest.warns(LengthWarning, match=r"prompt of 40 tokens leaves room for 8 new tokens of the "
                                           r"max_new_tokens=100 asked \(max_seq_len 48\): generating 8"):  # fmt: skip
        out = attnlab.generate(model, prompt, max_new_tokens=100)
    assert out.tolist() == attnlab.generate(model, prompt, max_new_tokens=8).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LengthWarning)  # the strict choice: an error instead
        with pytest.raises(LengthWarning):
            attnlab.generate(model, prompt, max_new_tokens=9)
        assert len(attnlab.generate(model, prompt, max_new_tokens=8)) == 8  # what fits: no warning


def test_a_model_with_a_memory_has_no_length_limit():
    memory = {"kind": "window", "recent_window": 8}
    model = tiny_model({"kind": "mha"}, memory, vocab_size=50, d_model=32, max_seq_len=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LengthWarning)
        assert len(attnlab.generate(model, list(range(1, 21)), max_new_tokens=30)) == 30


# ---------------------------------------------------------------------------------------------- KV policy flush
def test_a_flush_longer_than_the_cache_allocates_no_more_than_it_holds():
    model = tiny_model({"kind": "mha", "n_kv_heads": 2}, vocab_size=50, d_model=64, max_seq_len=64)
    dense = model.new_cache(1, 64).nbytes()
    huge = model.new_cache(1, 64, policy="k=q4_0,v=q4_0,resid=4,flush=1000000000")
    longest = model.new_cache(1, 64, policy="k=q4_0,v=q4_0,resid=4,flush=61")  # 64 - 4 + 1: never a whole block
    assert huge.nbytes() == longest.nbytes() == dense  # every token at full precision, as no block ever leaves
    assert kv_report(model.cfg, "fp32", 64, "k=q4_0,v=q4_0,resid=4,flush=1000000000")["kv_bytes"] == dense
    # A KIVI key group that does not divide the cache: only whole groups are allocated (was: rounded up).
    kivi = model.new_cache(1, 40, policy="k=kivi4,v=q8_0,group=32")
    fits = model.new_cache(1, 32, policy="k=kivi4,v=q8_0,group=32")
    assert kivi.layers[0].store_slots == 32 == fits.layers[0].store_slots
    tokens = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, _ = model(tokens, use_cache=False)
        cached, _ = model(tokens, cache=huge)
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=0)  # nothing was quantized


# ---------------------------------------------------------------------------------------------- caches it cannot use
def test_kernels_whose_cache_cannot_be_written_are_built_for_the_run_said_in_one_line(
    capsys, monkeypatch, tmp_path, run
):
    from attnlab.kernels import cpu

    if cpu._compiler() is None or os.environ.get("ATTNLAB_CPU_KERNELS", "1") in ("0", "false", "no", "off"):
        pytest.skip("no C compiler, or the CPU kernels are turned off")
    (tmp_path / "attnlab").write_text("a file where the cache folder goes")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu.library.cache_clear()
    try:
        code, out, err = cli_run(capsys, ["generate", str(run), "the cat", "--max-new-tokens", "2", "--kv-policy",
                                          "k=q8_0,v=q8_0"])  # fmt: skip
        assert cpu.library() is not None
    finally:
        cpu.library.cache_clear()
    assert code == 0 and out.startswith("the cat")
    assert err == (f"attnlab generate: warning: attnlab CPU kernels: {tmp_path}/attnlab is a file, where a folder of "
                   f"the kernels cache {tmp_path}/attnlab/kernels goes: delete it (or set XDG_CACHE_HOME to another "
                   "cache); built for this run only\n")  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attnlab"]


def test_a_compile_cache_it_cannot_write_means_eager_decoding_said_once(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # imported before the cache folder turns bad

    can_compile_on_cpu.cache_clear()
    if not can_compile_on_cpu():
        pytest.skip("inductor finds no C++ compiler here")
    cache_dir()
    afile = tmp_path / "afile"
    afile.write_text("a file where the cache folder goes")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(afile))
    can_compile_on_cpu.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert can_compile_on_cpu() is False
    finally:
        can_compile_on_cpu.cache_clear()
    assert [(w.category, str(w.message)) for w in caught] == [(AttnlabWarning, (
        f"torch.compile's cache {afile}: File exists: decoding without compiling (slower; set TORCHINDUCTOR_CACHE_DIR "
        "to a folder you may write)"))]  # fmt: skip
