"""Nothing damaged is trusted: checkpoints and prepared token files are checked (size, sha256, structure, id
range) when read, every refusal is one line naming the file and touches nothing, and a failed checkpoint write
leaves the previous checkpoint and no temporary behind."""

import hashlib
import json
import os
import pickle
import random
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError

import attnlab
from attnlab.config import DataConfig, TrainConfig
from attnlab.data import prepare
from attnlab.errors import AttnlabWarning, DataError
from attnlab.train import checkpoint as ckpt
from attnlab.train import loop
from attnlab.train.logging import MetricsLog
from attnlab.train.optim import build_optimizer

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "the cat sat on a mat while dogs ran over green hills".split()
MODEL = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 4, "max_seq_len": 32}


def configs(corpus: Path):
    data = DataConfig(source=str(corpus), tokenizer="char", val_fraction=0.1)
    train = TrainConfig(seq_len=16, batch_size=4, steps=8, lr=3e-3, warmup_steps=2, eval_every=4, eval_tokens=256,
                        log_every=1, checkpoint_every=3)  # fmt: skip
    return attnlab.model_config_from_dict(MODEL), data, train


def losses(run: Path) -> list:
    """The rows of metrics.jsonl without their speed (which no two runs share)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "tok_per_s"} for row in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A corpus, a whole 8-step run, and the same run interrupted at step 6 (its last checkpoint: step 4)."""
    root = tmp_path_factory.mktemp("integrity")
    rng = random.Random(0)
    corpus = root / "tiny.txt"
    corpus.write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30))) for _ in range(200)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))
        mp.setenv("ATTNLAB_OFFLINE", "1")
        loop.train(*configs(corpus), root / "whole", progress=False)
        original_write = MetricsLog.write

        def crash_at_step_6(self, row):
            if row.get("step") == 6 and "loss" in row:
                raise KeyboardInterrupt
            original_write(self, row)

        mp.setattr(MetricsLog, "write", crash_at_step_6)
        with pytest.raises(KeyboardInterrupt):
            loop.train(*configs(corpus), root / "cut", progress=False)
    return {"corpus": corpus, "whole": root / "whole", "cut": root / "cut"}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")


@pytest.fixture
def cut(runs, tmp_path) -> Path:
    """A copy of the interrupted run (mtimes kept) that a test may damage."""
    return Path(shutil.copytree(runs["cut"], tmp_path / "cut"))


def snapshot(folder: Path) -> dict:
    """Every file and folder under `folder`: bytes and mtime of files, None for folders."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
        for p in sorted(folder.rglob("*"))
    }


def assert_one_line(error: pytest.ExceptionInfo, file: Path, *phrases: str) -> None:
    message = str(error.value)
    assert "\n" not in message and str(file) in message, message
    for phrase in phrases:
        assert phrase in message, message


def last_checkpoint(run: Path) -> Path:
    return ckpt.find_checkpoint(run).path


def flip_byte(path: Path, at: int) -> None:
    blob = bytearray(path.read_bytes())
    blob[at] ^= 0x55
    path.write_bytes(bytes(blob))


def weights_data_start(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


# ----------------------------------------------------------------------------- checkpoints written and checked


def test_checksums_record_every_file_of_the_checkpoint(cut):
    folder = last_checkpoint(cut)
    recorded = json.loads((folder / "checksums.json").read_text())
    assert recorded["format"] == ckpt.CHECKSUMS_FORMAT
    assert set(recorded["files"]) == {p.name for p in folder.iterdir()} - {"checksums.json"}
    for name, entry in recorded["files"].items():
        blob = (folder / name).read_bytes()
        assert entry == {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}


WEIGHTS, CONFIG, CHECKSUMS = "model.safetensors", "config.json", "checksums.json"
DAMAGE = {
    "flipped weights": (WEIGHTS, lambda p: flip_byte(p, weights_data_start(p) + 100), "sha256 does not match"),
    "truncated weights": (WEIGHTS, lambda p: p.write_bytes(p.read_bytes()[:1000]), "1,000 bytes, but"),
    "emptied weights": (WEIGHTS, lambda p: p.write_bytes(b""), "empty, but"),
    "damaged weights header": (WEIGHTS, lambda p: flip_byte(p, 12), "sha256 does not match"),
    "config changed": (CONFIG, lambda p: p.write_text(p.read_text().replace('"lr": 0.003', '"lr": 0.004')),
                       "sha256 does not match"),
    "weights missing": (WEIGHTS, lambda p: p.unlink(), "missing, but checksums.json records it"),
    "trainer state changed": ("trainer.json", lambda p: p.write_text(p.read_text().replace('"step": 4', '"step": 5')),
                              "sha256 does not match"),
    "checksums missing": (CHECKSUMS, lambda p: p.unlink(), "missing, but model.safetensors records"),
    "checksums not json": (CHECKSUMS, lambda p: p.write_text("{"), "not valid JSON"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_by_load_and_by_resume(cut, runs, case):
    name, damage, phrase = DAMAGE[case]
    folder = last_checkpoint(cut)
    damage(folder / name)
    before = snapshot(cut)
    with pytest.raises(DataError) as error:
        ckpt.load_checkpoint(cut)  # what generate, info and eval use
    assert_one_line(error, folder / name, phrase)
    assert isinstance(error.value, ckpt.CheckpointError)
    with pytest.raises(DataError) as error:
        loop.train(*configs(runs["corpus"]), cut, progress=False)
    assert_one_line(error, folder / name, phrase, "restore it from a copy")
    assert snapshot(cut) == before  # the refused resume wrote and deleted nothing


def test_a_tampered_checksum_names_the_file_it_no_longer_matches(cut):
    folder = last_checkpoint(cut)
    checksums = json.loads((folder / "checksums.json").read_text())
    checksums["files"]["model.safetensors"]["sha256"] = "0" * 64
    (folder / "checksums.json").write_text(json.dumps(checksums))
    before = snapshot(cut)
    with pytest.raises(ckpt.CheckpointError) as error:
        ckpt.load_checkpoint(cut)
    assert_one_line(error, folder / "model.safetensors", "sha256 does not match the one recorded")
    assert snapshot(cut) == before


def reseal(folder: Path) -> None:
    """Records every file's present size and sha256 in checksums.json: a damage the checksums cannot see."""
    checksums = json.loads((folder / CHECKSUMS).read_text())
    for name, entry in checksums["files"].items():
        blob = (folder / name).read_bytes()
        entry.update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    (folder / CHECKSUMS).write_text(json.dumps(checksums))


@pytest.mark.parametrize(
    "edit, phrase",
    [
        ({"step": -3}, "step=-3 must be >= 0"),
        ({"step": 2.5}, "step=2.5 must be int, got float"),
        ({"tokens": None}, "tokens is empty (null) but must be int"),
        ({"best_val_loss": "low"}, "best_val_loss='low' must be float or null, got str"),
        ({"sampler": 3}, "sampler.step is empty (null) but must be int"),
    ],
    ids=["negative step", "fractional step", "no tokens", "text loss", "no sampler"],
)
def test_a_forged_trainer_state_is_refused_on_resume_naming_the_key(cut, runs, edit, phrase):
    folder = last_checkpoint(cut)
    (folder / "trainer.json").write_text(json.dumps(json.loads((folder / "trainer.json").read_text()) | edit))
    reseal(folder)
    before = snapshot(cut)
    with pytest.raises(ckpt.CheckpointError) as error:
        loop.train(*configs(runs["corpus"]), cut, progress=False)
    assert_one_line(error, folder / "trainer.json", f"trainer.json: {phrase}", "delete the run's checkpoints")
    assert snapshot(cut) == before


def test_weights_that_do_not_fit_name_the_tensors_and_shapes(cut):
    folder = last_checkpoint(cut)
    (folder / CONFIG).write_text((folder / CONFIG).read_text().replace('"d_model": 32', '"d_model": 48'))
    reseal(folder)
    with pytest.raises(ckpt.CheckpointError) as error:
        ckpt.load_checkpoint(cut)
    shapes = "embed.weight is [64, 32] in the file, [64, 48] in the model; blocks.0.attn_norm.weight is [32] in"
    assert_one_line(error, folder / WEIGHTS, f"weights do not fit this model ({shapes} the file, [48] in the model;")


def test_a_pickled_optimizer_state_is_refused_in_one_line_without_torchs_warning(cut, runs):
    folder = last_checkpoint(cut)
    with open(folder / "optimizer.pt", "wb") as f:
        pickle.dump({"optimizer": ShellCommand()}, f, protocol=4)
    reseal(folder)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ckpt.CheckpointError) as error:
        warnings.simplefilter("always")
        loop.train(*configs(runs["corpus"]), cut, progress=False)
    assert_one_line(error, folder / "optimizer.pt", "refused: it holds Python objects besides tensors and plain data")
    assert [str(w.message) for w in caught] == []


class ShellCommand:
    """A pickle that would run a command when loaded (it never is)."""

    def __reduce__(self):
        return (os.system, ("echo loaded",))


@pytest.mark.parametrize(
    "damage, phrase",
    [
        (lambda p: flip_byte(p, p.stat().st_size // 2), "sha256 does not match"),
        (lambda p: p.write_bytes(p.read_bytes()[:-40]), "bytes were written (the file was truncated"),
        (lambda p: p.write_bytes(b""), "empty, but"),
    ],
    ids=["flipped", "truncated", "emptied"],
)
def test_damaged_optimizer_state_is_refused_on_resume(cut, runs, damage, phrase):
    folder = last_checkpoint(cut)
    damage(folder / "optimizer.pt")
    before = snapshot(cut)
    with pytest.raises(ckpt.CheckpointError) as error:
        loop.train(*configs(runs["corpus"]), cut, progress=False)
    assert_one_line(error, folder / "optimizer.pt", phrase)
    assert snapshot(cut) == before


def test_resume_after_an_interruption_is_still_bit_exact(cut, runs):
    summary = loop.train(*configs(runs["corpus"]), cut, progress=False)  # checks every file, continues at step 4
    assert summary["status"] == "complete" and summary["steps"] == 8
    assert losses(cut) == losses(runs["whole"])
    a, b = ckpt.load_checkpoint(cut).model, ckpt.load_checkpoint(runs["whole"]).model
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


# ----------------------------------------------------------------------------- checkpoints from before checksums


def make_legacy(folder: Path) -> None:
    """The checkpoint as an attnlab without checksums wrote it: no checksums.json, no mark in the weights."""
    (folder / "checksums.json").unlink()
    weights = folder / "model.safetensors"
    blob = weights.read_bytes()
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size])
    del header["__metadata__"][ckpt.CHECKSUMS_KEY]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    weights.write_bytes(len(text).to_bytes(8, "little") + text + blob[8 + size :])


def test_a_checkpoint_from_before_checksums_still_loads_and_resumes(cut, runs):
    make_legacy(last_checkpoint(cut))
    with pytest.warns(AttnlabWarning, match=r"no checksums\.json \(written by an older attnlab\)"):
        loaded = ckpt.load_checkpoint(cut)
    expected = ckpt.load_checkpoint(runs["cut"]).model.state_dict()
    assert all(torch.equal(x, expected[k]) for k, x in loaded.model.state_dict().items())
    loop.train(*configs(runs["corpus"]), cut, progress=False)
    assert losses(cut) == losses(runs["whole"])


@pytest.mark.parametrize(
    "name, damage, phrase",
    [
        ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
         "not a readable safetensors file (Error while deserializing header: incomplete metadata"),
        ("model.safetensors", lambda p: p.write_bytes(b""), "not a readable safetensors file"),
        ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:8] + b"}" + p.read_bytes()[9:]),
         "invalid JSON in header"),
        ("optimizer.pt", lambda p: p.write_bytes(b""), "not a readable optimizer state (EOFError)"),
        ("optimizer.pt", lambda p: p.write_bytes(p.read_bytes()[:-40]), "not a readable optimizer state (RuntimeError"),
    ],
    ids=["truncated weights", "emptied weights", "weights header", "emptied optimizer", "truncated optimizer"],
)  # fmt: skip
def test_an_unreadable_checkpoint_from_before_checksums_is_a_clear_error(cut, runs, name, damage, phrase):
    folder = last_checkpoint(cut)
    make_legacy(folder)
    damage(folder / name)
    before = snapshot(cut)
    with pytest.raises(ckpt.CheckpointError) as error:
        if name == "optimizer.pt":
            loop.train(*configs(runs["corpus"]), cut, progress=False)
        else:
            ckpt.load_checkpoint(cut)
    assert_one_line(error, folder / name, phrase)
    assert snapshot(cut) == before


# ----------------------------------------------------------------------------- failed writes


def small_model(seed: int = 0):
    torch.manual_seed(seed)
    model = attnlab.build_model(attnlab.model_config_from_dict(MODEL))
    optimizer = build_optimizer(model, TrainConfig())
    logits, _ = model(torch.randint(0, 64, (2, 8)))
    logits.sum().backward()
    optimizer.step()  # Adam state: optimizer.pt is about twice model.safetensors
    return model, optimizer


def raising(error):
    def fail(*args, **kwargs):
        raise error

    return fail


@pytest.mark.parametrize(
    "target, error",
    [
        ("save_model", SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")),
        ("torch.save", RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 68992 vs 68880")),
        ("torch.save", OSError(28, "No space left on device")),
        ("sha256_file", OSError(5, "Input/output error")),
        ("torch.save", KeyboardInterrupt()),
    ],
    ids=["weights", "optimizer RuntimeError", "optimizer OSError", "checksums", "interrupt"],
)
def test_a_failed_checkpoint_write_keeps_the_previous_one_and_no_temporary(tmp_path, monkeypatch, target, error):
    model, optimizer = small_model()
    config = {"model": model.cfg.to_dict()}
    ckpt.save_checkpoint(tmp_path, model, optimizer, {"step": 1}, config, tags=("last", "best"))
    before = snapshot(tmp_path)
    if target == "torch.save":
        monkeypatch.setattr(torch, "save", raising(error))
    else:
        monkeypatch.setattr(ckpt, target, raising(error))
    expected = type(error) if isinstance(error, KeyboardInterrupt) else ckpt.CheckpointError
    with pytest.raises(expected) as raised:
        ckpt.save_checkpoint(tmp_path, model, optimizer, {"step": 2}, config, tags=("last",))
    if expected is ckpt.CheckpointError:
        assert_one_line(raised, tmp_path / "checkpoints" / "step-000002", "the previous checkpoint (step 1) is intact")
    assert snapshot(tmp_path) == before  # no temporary folder, pointers unchanged
    monkeypatch.undo()
    loaded = ckpt.load_checkpoint(tmp_path)
    assert all(torch.equal(x, model.state_dict()[k]) for k, x in loaded.model.state_dict().items())


WRITER = textwrap.dedent("""
    import resource, signal, sys
    import torch
    import attnlab
    from attnlab.config import TrainConfig
    from attnlab.train import checkpoint as ckpt
    from attnlab.train.optim import build_optimizer

    run, which, ignore = sys.argv[1], sys.argv[2], sys.argv[3] == "ignore"
    folder = ckpt.find_checkpoint(run).path
    weights, optimizer_bytes = (folder / "model.safetensors").stat().st_size, (folder / "optimizer.pt").stat().st_size
    assert optimizer_bytes > weights + 4096
    limit = weights // 2 if which == "weights" else (weights + optimizer_bytes) // 2
    torch.manual_seed(1)
    model = attnlab.build_model(ckpt.load_checkpoint(run).cfg)
    optimizer = build_optimizer(model, TrainConfig())
    ckpt.load_optimizer(optimizer, ckpt.find_checkpoint(run), model)
    # Ignored (Python's own default): a write past the limit fails with EFBIG; default: the kernel kills the writer.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN if ignore else signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        ckpt.save_checkpoint(run, model, optimizer, {"step": 2}, {"model": model.cfg.to_dict()}, tags=("last",))
    except ckpt.CheckpointError as e:
        print(e)
        sys.exit(2)
""")


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="no file size limits here")
@pytest.mark.parametrize("which", ["weights", "optimizer"])
def test_a_real_full_disk_keeps_the_previous_checkpoint_and_no_temporary(tmp_path, which):
    model, optimizer = small_model()
    ckpt.save_checkpoint(tmp_path, model, optimizer, {"step": 1}, {"model": model.cfg.to_dict()}, tags=("last",))
    before = snapshot(tmp_path)
    script = tmp_path.parent / f"{tmp_path.name}-writer.py"
    script.write_text(WRITER)
    done = subprocess.run([sys.executable, str(script), str(tmp_path), which, "ignore"], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    message = done.stdout.strip()
    assert "\n" not in message and "step-000002" in message, message
    # torch's writer says only "unexpected pos A vs B": the file at the limit tells what happened (probe V)
    name = "model.safetensors" if which == "weights" else "optimizer.pt"
    assert f"{name}: File too large: a file size limit was hit" in message and "pos" not in message, message
    assert "the previous checkpoint (step 1) is intact" in message
    assert snapshot(tmp_path) == before
    assert ckpt.load_checkpoint(tmp_path).folder.name == "step-000001"


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="no file size limits here")
def test_the_temporary_of_a_killed_writer_is_removed_by_the_next_save(tmp_path):
    model, optimizer = small_model()
    config = {"model": model.cfg.to_dict()}
    ckpt.save_checkpoint(tmp_path, model, optimizer, {"step": 1}, config, tags=("last",))
    script = tmp_path.parent / f"{tmp_path.name}-writer.py"
    script.write_text(WRITER)
    done = subprocess.run([sys.executable, str(script), str(tmp_path), "optimizer", "kill"], capture_output=True)
    assert done.returncode == -signal.SIGXFSZ  # killed mid-write: it could not clean up
    left = [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    assert len(left) == 1 and left[0].startswith(".step-000002.")
    assert ckpt.load_checkpoint(tmp_path).folder.name == "step-000001"  # still intact
    ckpt.save_checkpoint(tmp_path, model, optimizer, {"step": 3}, config, tags=("last",))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.json", "step-000003"]


# ----------------------------------------------------------------------------- prepared token files


@pytest.fixture
def prepared(runs, tmp_path):
    _, data, _ = configs(runs["corpus"])
    return data, prepare(data, cache_dir=tmp_path / "prepared")


def reuse(data, folder: Path):
    return prepare(data, cache_dir=folder.parent)


def test_prepared_tokens_with_flipped_bytes_are_refused_before_training(prepared, runs, tmp_path, monkeypatch):
    data, p = prepared
    train_bin = p.path / "train.bin"
    flip_byte(train_bin, 10)  # still in range: a model would train on it "normally"
    before = snapshot(p.path)
    with pytest.raises(DataError) as error:
        reuse(data, p.path).split("train")
    assert_one_line(error, train_bin, "sha256 differs from meta.json", f"delete {p.path} to prepare it again")
    model_cfg, _, train_cfg = configs(runs["corpus"])
    monkeypatch.setattr("attnlab.train.loop.prepare_rank0_first", lambda *args: reuse(data, p.path))
    with pytest.raises(DataError, match=r"train\.bin: sha256 differs"):
        loop.train(model_cfg, data, train_cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    assert snapshot(p.path) == before


def edit_meta(folder: Path, edit) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    edit(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "edit, phrase",
    [
        (lambda m: m.pop("dtype"), "key 'dtype' is missing"),
        (lambda m: m.update(dtype="float32"), "'dtype' is 'float32' (expected uint16"),
        (lambda m: m.update(vocab_size="64"), "'vocab_size' is '64'"),
        (lambda m: m.update(eot_id=10_000), "'eot_id' is 10000"),
        (lambda m: m["splits"]["train"].pop("sha256"), "key 'splits.train.sha256' is missing"),
        (lambda m: m["splits"]["val"].update(file="../x.bin"), "'splits.val.file' is '../x.bin'"),
        (lambda m: m["splits"]["val"].update(tokens=-1), "'splits.val.tokens' is -1"),
        (lambda m: m.pop("splits"), "key 'splits' is missing"),
    ],
    ids=["no dtype", "bad dtype", "vocab text", "eot out of range", "no sha256", "file outside", "tokens", "no splits"],
)
def test_a_meta_json_with_a_missing_or_bad_key_is_refused(prepared, edit, phrase):
    data, p = prepared
    edit_meta(p.path, edit)
    before = snapshot(p.path)
    with pytest.raises(DataError) as error:
        reuse(data, p.path)
    assert_one_line(error, p.path / "meta.json", phrase, "to prepare it again")
    assert snapshot(p.path) == before


def test_a_damaged_prepared_vocabulary_names_the_file_and_the_fix(prepared):
    data, p = prepared
    vocab = p.path / "vocab.json"
    vocab.write_text(json.dumps({"name": "char", "tokens": ["a", "a"]}))
    with pytest.raises(DataError) as error:
        _ = reuse(data, p.path).tokenizer  # read when first used
    assert_one_line(error, vocab, "sha256 differs from meta.json", f"delete {p.path} to prepare it again")
    edit_meta(p.path, lambda m: m["tokenizer"].pop("files"))  # a folder prepared before the sha256 was recorded
    with pytest.raises(DataError) as error:
        _ = reuse(data, p.path).tokenizer
    assert_one_line(error, vocab, "not a valid char tokenizer file (char vocabulary must hold distinct tokens",
                    f"delete {p.path} to make it again from the data")  # fmt: skip


def test_out_of_range_token_ids_are_refused_not_an_index_error(prepared, runs, tmp_path, monkeypatch):
    data, p = prepared
    train_bin = p.path / "train.bin"
    ids = np.fromfile(train_bin, dtype=p.dtype)
    ids[5] = p.vocab_size + 3  # a consistent meta.json (sha256 updated): only the range check sees it
    ids.tofile(train_bin)
    edit_meta(p.path, lambda m: m["splits"]["train"].update(sha256=hashlib.sha256(ids.tobytes()).hexdigest()))
    with pytest.raises(DataError) as error:
        reuse(data, p.path).split("train")
    assert_one_line(error, train_bin, f"token id {p.vocab_size + 3}, out of range", f"vocab_size {p.vocab_size}")
    model_cfg, _, train_cfg = configs(runs["corpus"])
    monkeypatch.setattr("attnlab.train.loop.prepare_rank0_first", lambda *args: reuse(data, p.path))
    with pytest.raises(DataError, match="out of range"):
        loop.train(model_cfg, data, train_cfg, tmp_path / "run", progress=False)


def test_a_meta_vocab_size_that_disagrees_with_the_tokenizer_is_refused(prepared):
    data, p = prepared
    edit_meta(p.path, lambda m: m.update(vocab_size=m["vocab_size"] + 1))
    with pytest.raises(DataError) as error:
        _ = reuse(data, p.path).tokenizer
    assert_one_line(error, p.path / "meta.json", f"vocab_size is {p.vocab_size + 1}, but the tokenizer files")


def test_reused_prepared_files_are_verified_once_per_split(prepared, monkeypatch):
    data, p = prepared
    again = reuse(data, p.path)
    scanned = []
    original = attnlab.data.prepared._scan
    monkeypatch.setattr(
        attnlab.data.prepared, "_scan", lambda file, dtype: scanned.append(file.name) or original(file, dtype)
    )
    assert np.array_equal(again.split("train"), p.split("train")) and len(again.split("val")) > 0
    again.split("train")
    assert scanned == ["train.bin", "val.bin"]  # and the freshly prepared one was not scanned at all


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_only_stale_temporaries_of_a_killed_prepare_are_removed(prepared, runs):
    data, p = prepared
    dead, alive = dead_pid(), os.getpid()
    stale = p.path / f".train.bin.{dead}.0123456789ab.tmp"
    recent = p.path / f".val.bin.{dead}.0123456789ac.tmp"  # maybe a writer on another machine: still writing
    ours = p.path / f".test.bin.{alive}.0123456789ad.tmp"
    for path in (stale, recent, ours):
        path.write_bytes(b"\0" * 64)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    os.utime(ours, (time.time() - 3600, time.time() - 3600))
    (p.path / "meta.json").unlink()  # a prepare that was killed: the next one prepares the folder again
    again = reuse(data, p.path)
    assert again.meta["splits"] == p.meta["splits"]
    assert not stale.exists() and recent.exists() and ours.exists()
