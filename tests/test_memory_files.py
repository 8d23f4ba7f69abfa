"""Memory files: a bounded memory's state saved, checked and reloaded exactly; the store and its CLI."""

import sqlite3

import pytest
import torch
from helpers import tiny_model, train_tiny_run

import attnlab
from attnlab.cli import main
from attnlab.errors import InputError
from attnlab.generate import prefill
from attnlab.memory import MemoryStateError, load_state, parse_state, read_state, save_state, store_dir

MODEL = {"vocab_size": 50, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 2304, "init_std": 0.2,
         "attention": {"kind": "coda", "n_kv_heads": 2}}  # fmt: skip
MEMORIES = {
    "window": {"kind": "window", "recent_window": 8},
    "streaming": {"kind": "streaming", "recent_window": 8, "sink_tokens": 2},
    "h2o": {"kind": "h2o", "recent_window": 8, "heavy_slots": 4},
    "bounded": {"kind": "bounded", "recent_window": 8, "exact_slots": 4, "summary_slots": 4, "tau_gate": 0.4},
}


def model_with(memory, seed=0):
    return tiny_model(memory=memory, seed=seed, **MODEL)


def tokens(n, seed=0):
    return torch.randint(0, 50, (1, n), generator=torch.Generator().manual_seed(seed))


def ingested(model, n, seed=0, chunk=24):
    cache = model.new_cache(1)
    prefill(model, tokens(n, seed), cache, chunk)
    return cache


def fields(layer):
    return layer.state()


@pytest.fixture(scope="module")
def bounded():
    return model_with(MEMORIES["bounded"])


@pytest.mark.parametrize("kind", list(MEMORIES))
def test_round_trip_gives_identical_tensors_and_next_token_logits(tmp_path, kind):
    model = model_with(MEMORIES[kind])
    original = ingested(model, 90)
    header = save_state(tmp_path / "s.safetensors", model, original, model_path="somewhere/run")
    loaded, read = load_state(tmp_path / "s.safetensors", model)
    assert read == header and read["tokens"] == loaded.seen == original.seen == 90
    assert read["memory"]["kind"] == kind and read["batch"] == 1 and read["dtype"] == "float32"
    for a, b in zip(original.layers, loaded.layers, strict=True):
        assert type(a) is type(b) and a.seen == b.seen == 90
        assert fields(a).keys() == fields(b).keys() >= {"k", "v", "ring_positions", "memory_positions"}
        for name, tensor in fields(a).items():
            assert torch.equal(tensor, fields(b)[name]), name
    assert int((original.layers[0].memory_positions >= 0).sum()) > 0 or kind == "window"  # memory slots in use
    # The same continuation, a chunk then single tokens, from the original and from the reloaded state.
    more = tokens(30, seed=1)
    with torch.no_grad():
        for piece in (more[:, :20], *more[:, 20:].split(1, dim=1)):
            logits_a, _ = model(piece, cache=original)
            logits_b, _ = model(piece, cache=loaded)
            assert torch.equal(logits_a, logits_b)
    for a, b in zip(original.layers, loaded.layers, strict=True):
        assert all(torch.equal(t, fields(b)[name]) for name, t in fields(a).items())
    # The reloaded state is what was saved, not a fresh memory: a fresh cache continues differently.
    again, _ = load_state(tmp_path / "s.safetensors", model)  # positions 90.. again: the file was not changed
    fresh = model.new_cache(1)
    fresh.seen = 90
    for layer in fresh.layers:
        layer.seen = 90
    with torch.no_grad():
        from_state, from_fresh = model(more[:, :20], cache=again)[0], model(more[:, :20], cache=fresh)[0]
        assert torch.equal(from_state, model(more[:, :20], cache=ingested(model, 90))[0])
    assert not torch.allclose(from_state, from_fresh)


def test_the_file_is_fixed_size_however_many_tokens_it_has_read(tmp_path, bounded):
    short, long = tmp_path / "short.safetensors", tmp_path / "long.safetensors"
    save_state(short, bounded, ingested(bounded, 200, chunk=64))
    save_state(long, bounded, ingested(bounded, 2000, chunk=256))
    assert read_state(short)[0]["tokens"] == 200 and read_state(long)[0]["tokens"] == 2000
    assert short.stat().st_size == long.stat().st_size
    assert short.read_bytes() != long.read_bytes()
    kv = 2 * 2 * 1 * 2 * (8 + 4 + 4) * 8 * 4  # k and v, 2 layers, B=1, H_kv=2, W + M_e + M_s slots, head_dim 8, fp32
    assert kv < short.stat().st_size < kv + 4096  # the k/v buffers, a little bookkeeping and the header


def test_a_changed_byte_anywhere_is_refused(tmp_path, bounded):
    path = tmp_path / "s.safetensors"
    save_state(path, bounded, ingested(bounded, 50))
    blob = path.read_bytes()
    reasons = ("checksum mismatch", "truncated or damaged", "not an attnlab memory state", "or damaged")
    for i in range(len(blob)):  # every byte: length prefix, tensor table, header, padding, tensor bytes
        damaged = bytearray(blob)
        damaged[i] ^= 0x01
        with pytest.raises(MemoryStateError, match="^here: ") as info:
            parse_state(bytes(damaged), "here")
        assert any(reason in str(info.value) for reason in reasons), str(info.value)
    assert parse_state(blob)[0]["tokens"] == 50
    for i in (100, len(blob) - 5):  # through a file: a header byte, a tensor byte
        path.write_bytes(blob[:i] + bytes([blob[i] ^ 0x80]) + blob[i + 1 :])
        with pytest.raises(MemoryStateError, match=f"^{path}: "):
            load_state(path, bounded)
    path.write_bytes(blob)
    assert load_state(path, bounded)[0].seen == 50


def test_a_truncated_file_is_refused(tmp_path, bounded):
    path = tmp_path / "s.safetensors"
    save_state(path, bounded, ingested(bounded, 50))
    blob = path.read_bytes()
    for length in range(len(blob)):
        with pytest.raises(MemoryStateError, match=r"^here: not a readable memory state \(truncated or damaged"):
            parse_state(blob[:length], "here")
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(MemoryStateError, match=rf"^{path}: not a readable memory state \(truncated or damaged"):
        load_state(path, bounded)
    with pytest.raises(MemoryStateError, match="cannot read"):
        load_state(tmp_path / "missing.safetensors", bounded)


def test_a_state_from_another_config_is_refused_naming_its_model(tmp_path, bounded):
    path = tmp_path / "s.safetensors"
    save_state(path, bounded, ingested(bounded, 40), model_path="/runs/first/seed0")
    other = model_with({**MEMORIES["bounded"], "tau_gate": 0.6})  # same shapes, another config
    message = (rf"{path}: made for model config {bounded.cfg.config_hash()} \(/runs/first/seed0\); "
               rf"this model's config is {other.cfg.config_hash()}")  # fmt: skip
    with pytest.raises(MemoryStateError, match=message):
        load_state(path, other)
    with pytest.raises(MemoryStateError, match="made with other weights of this model config"):
        load_state(path, model_with(MEMORIES["bounded"], seed=1))  # same config, other weights


def test_a_model_without_memory_has_no_state(tmp_path, bounded):
    dense = model_with({"kind": "none"})
    with torch.no_grad():
        _, cache = dense(tokens(10))
    with pytest.raises(InputError, match=r"no bounded memory \(memory.kind=none\)"):
        save_state(tmp_path / "s.safetensors", dense, cache)
    save_state(tmp_path / "b.safetensors", bounded, ingested(bounded, 10))
    with pytest.raises(InputError, match="no bounded memory"):
        load_state(tmp_path / "b.safetensors", dense)
    assert not (tmp_path / "s.safetensors").exists()


def test_a_cache_tensor_the_format_does_not_know_stops_the_save(tmp_path, bounded):
    cache = ingested(bounded, 10)
    cache.layers[1].new_counter = torch.zeros(3)
    with pytest.raises(MemoryStateError, match=r"BoundedCache holds tensors the state file does not know: \['new_c"):
        save_state(tmp_path / "s.safetensors", bounded, cache)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary


def test_store_folder_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_MEMORY", str(tmp_path / "env"))
    assert store_dir() == tmp_path / "env" and store_dir(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("ATTNLAB_MEMORY")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert store_dir() == tmp_path / "cache" / "attnlab" / "memory"


# ---------------------------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny trained CoDA model with a bounded memory (char tokenizer, 20 steps)."""
    model = {"vocab_size": 40, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 256,
             "attention": {"kind": "coda", "n_kv_heads": 2},
             "memory": {"kind": "bounded", "recent_window": 16, "exact_slots": 4, "summary_slots": 4}}  # fmt: skip
    return train_tiny_run(tmp_path_factory.mktemp("memrun"), model)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")


def index_rows(store):
    with sqlite3.connect(store / "index.sqlite") as db:
        return db.execute("SELECT * FROM states ORDER BY name").fetchall()


def test_cli_ingest_ls_query_rm(tmp_path, run, capsys):
    from attnlab.eval.loading import load_for_eval

    store = tmp_path / "store"
    assert main(["memory", "ls", "--store", str(store)]) == 2  # a store given that is not there: a typo?
    assert "no such memory store" in capsys.readouterr().err and not store.exists()  # reading makes nothing
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("the cat sat on the mat by the red door.")  # 39 characters
    second.write_text("a dog and a cat sat by a")  # 24: with the end-of-text between, 64 tokens
    assert main(["memory", "ingest", str(run), str(first), str(second), "--name", "notes", "--chunk", "16",
                 "--store", str(store)]) == 0  # fmt: skip
    assert "notes: 64 tokens from 2 document(s)" in capsys.readouterr().out
    [state] = (store / "states").iterdir()
    before, rows, index = state.read_bytes(), index_rows(store), (store / "index.sqlite").read_bytes()
    [(name, file, documents, n, size, config_hash, model_path, created, sha)] = rows
    loaded = load_for_eval(run)
    assert (name, n, size, config_hash) == ("notes", 64, len(before), loaded.cfg.config_hash())
    assert model_path == str(run.resolve())
    assert file == f"states/{state.name}" and created.endswith("+00:00") and sha == read_state(state)[0]["sha256"]
    assert '"tokens": 39' in documents and str(first) in documents

    assert main(["memory", "ls", "--store", str(store)]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["name", "tokens", "bytes", "model", "hash", "created"]
    assert row.split() == ["notes", "64", f"{len(before):,}", config_hash, created]

    prompt = "the dog"
    assert main(["memory", "query", "notes", prompt, "--max-new-tokens", "12", "--store", str(store)]) == 0
    answer = capsys.readouterr().out.rstrip("\n")
    # The same as reading documents and prompt in one go: the same 16-token blocks (64 = 4 * 16), then the
    # prompt and the new tokens through the reloaded memory.
    tok = loaded.tokenizer
    ids = tok.encode(first.read_text()) + [tok.eot_id] + tok.encode(second.read_text()) + tok.encode(prompt)
    expected = prompt + tok.decode(attnlab.generate(loaded.model, ids, max_new_tokens=12, prefill_chunk=16).tolist())
    assert answer == expected and len(answer) == len(prompt) + 12
    assert main(["memory", "query", "notes", prompt, "--max-new-tokens", "12", "--model", str(run),
                 "--store", str(store)]) == 0  # fmt: skip
    assert capsys.readouterr().out.rstrip("\n") == expected  # a second query starts from the same state
    assert state.read_bytes() == before and list((store / "states").iterdir()) == [state]
    assert index_rows(store) == rows and (store / "index.sqlite").read_bytes() == index

    assert main(["memory", "ingest", str(run), str(first), "--name", "notes", "--store", str(store)]) == 2
    exists = f"attnlab memory ingest: error: a memory named 'notes' exists in {store} (pass --replace)"
    assert capsys.readouterr().err == exists + "\n"
    assert state.read_bytes() == before and index_rows(store) == rows
    assert main(["memory", "ingest", str(run), str(first), "--name", "notes", "--replace", "--store", str(store)]) == 0
    [replaced] = (store / "states").iterdir()
    assert replaced != state and index_rows(store)[0][3] == 39  # the old file is gone with its row
    capsys.readouterr()

    for argv in (["query", "nope", "hi"], ["rm", "nope"]):
        assert main(["memory", *argv, "--store", str(store)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"no memory named 'nope' in {store}" in err
    assert main(["memory", "ingest", str(run), str(first), "--name", "../up", "--store", str(store)]) == 2
    assert "memory name '../up'" in capsys.readouterr().err

    assert main(["memory", "rm", "notes", "--store", str(store)]) == 0
    assert index_rows(store) == [] and list((store / "states").iterdir()) == []
    assert main(["memory", "ls", "--store", str(store)]) == 0
    assert capsys.readouterr().out.endswith(f"no memories in {store}\n")


def test_cli_query_refuses_a_state_file_changed_behind_the_index(tmp_path, run, capsys):
    store, doc = tmp_path / "store", tmp_path / "a.txt"
    doc.write_text("the red door")
    assert main(["memory", "ingest", str(run), str(doc), "--name", "x", "--store", str(store)]) == 0
    [state] = (store / "states").iterdir()
    blob = bytearray(state.read_bytes())
    blob[-1] ^= 0x01
    state.write_bytes(bytes(blob))
    capsys.readouterr()
    assert main(["memory", "query", "x", "the", "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{state}: checksum mismatch" in err


def test_a_long_ingest_shows_its_progress_and_stores_the_same_state(tmp_path, run, capsys, monkeypatch):
    """Probe L l20: an ingest of a long document printed nothing for minutes. A bar of the tokens read shows on
    stderr once PROGRESS_DELAY has passed (here at once); --no-progress shows none; both store the same state."""
    import attnlab.memory.store as store_module

    monkeypatch.setattr(store_module, "PROGRESS_DELAY", 0.0)
    doc = tmp_path / "doc.txt"
    doc.write_text("the cat sat on the mat by the red door. " * 3)  # 120 tokens
    states = []
    for name, flags in (("shown", []), ("quiet", ["--no-progress"])):
        store = tmp_path / name
        assert main(["memory", "ingest", str(run), str(doc), "--name", "n", "--chunk", "16", "--store", str(store),
                     *flags]) == 0  # fmt: skip
        err = capsys.readouterr().err
        assert ("ingest n: 100%" in err and "120/120" in err) == (name == "shown"), err
        [state] = (store / "states").iterdir()
        states.append(read_state(state)[1])
    assert states[0].keys() == states[1].keys() and all(torch.equal(states[0][k], states[1][k]) for k in states[0])
