"""A folder of named memory states with a SQLite index (CoDA-GQA-L §5.3: ingest, registry, query).

    <store>/index.sqlite                      one row per name: state file, documents (path, sha256, tokens),
                                              tokens, bytes, model config hash, model path, created (UTC)
    <store>/states/<name>-<random>.safetensors   the state (attnlab.memory.state), a new file per ingest

The store folder is `store`, else $ATTNLAB_MEMORY, else $XDG_CACHE_HOME/attnlab/memory (~/.cache/...).
Ingesting writes the new state file first and registers it in one transaction. A replaced or removed state's
file is deleted inside the transaction that changes its row, which commits only once the file is gone: a file
that cannot be deleted (a read-only states/ folder) rolls the row back, so a refused rm or --replace changes
nothing. A query reads the state file into a new cache and never writes to the store.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import sqlite3
import sys
import uuid
import warnings
from collections.abc import Iterable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from attnlab.data.files import LINK_LOOP, broken_link, link_loop, read_only_file_system
from attnlab.errors import DataError, InputError, LengthWarning, check_flags, given
from attnlab.eval.loading import load_for_eval
from attnlab.generate import generate, prefill
from attnlab.interop.tokenizer import warn_unknown
from attnlab.jsonio import loads_json
from attnlab.memory.state import DamagedStateError, MemoryStateError, load_state, require_memory, save_state
from attnlab.paths import (
    blocking_file,
    brief,
    cache_dir,
    first_repeat,
    name_problem,
    nearest_existing,
    run_folder_problem,
)

SCHEMA = """CREATE TABLE IF NOT EXISTS states (
    name TEXT PRIMARY KEY, file TEXT NOT NULL, documents TEXT NOT NULL, tokens INTEGER NOT NULL,
    bytes INTEGER NOT NULL, config_hash TEXT NOT NULL, model_path TEXT NOT NULL, created TEXT NOT NULL,
    state_sha256 TEXT NOT NULL)"""
COLUMNS = ("name", "file", "documents", "tokens", "bytes", "config_hash", "model_path", "created", "state_sha256")
COLUMN_TYPES = {"name": str, "file": str, "documents": str, "tokens": int, "bytes": int, "config_hash": str,
                "model_path": str, "created": str, "state_sha256": str}  # fmt: skip


# A store inside a run's folder is refused as records there are (eval.records.records_in_run_problem).
STORE_INSIDE_A_RUN = ("a memory store there (its index.sqlite and states/) would be mixed with the run's own "
                      "files and taken for some of them: give --store a folder outside the run, e.g. --store "
                      "memories")  # fmt: skip


class StoreError(DataError):
    """The memory store or one of its entries cannot be used."""


class JournalError(StoreError):
    """The index cannot be read for the file at its journal's name (index.sqlite-journal) beside it."""


def store_dir(store: str | Path | None = None) -> Path:
    if store:
        return Path(store)
    if os.environ.get("ATTNLAB_MEMORY"):
        return Path(os.environ["ATTNLAB_MEMORY"])
    return cache_dir() / "memory"


@dataclass(frozen=True)
class Entry:
    name: str
    file: str  # relative to the store folder
    documents: list  # [{"path", "sha256", "tokens"}] in ingestion order
    tokens: int  # tokens the state has read (documents and the separators between them)
    bytes: int  # size of the state file
    config_hash: str
    model_path: str
    created: str  # UTC, ISO 8601
    state_sha256: str  # the state file's header checksum


JOURNAL_HEADER = bytes.fromhex("d9d505f920a163d7")  # how SQLite's rollback journals begin


class MemoryStore:
    """The index of one store folder. Every method opens and closes its own connection; reads open the index
    read-only. create=False (ls, query, rm) makes nothing: a store given (--store, $ATTNLAB_MEMORY) that does not
    exist is refused (a typo), the default one not made yet is empty. create=True (ingest) checks that the store can
    be made or used, and makes it when the first state is written (make()): an ingest refused on the way leaves no
    store folder behind."""

    def __init__(self, store: str | Path | None = None, create: bool = True):
        check_flags(create=create)
        if store is not None and not isinstance(store, str | os.PathLike):
            raise InputError(f"store must be the path of a memory store's folder (or None), got "
                             f"{type(store).__name__} {brief(store, 40)}")  # fmt: skip
        self.root = store_dir(store)
        self.index = self.root / "index.sqlite"
        link = broken_link(self.root) or (LINK_LOOP if link_loop(self.root) else None)  # (a loop further up too)
        if link is not None:  # a loop or a link to nothing: not a store that is empty (ls), nor one to make through it
            where = (f"--store {self.root}" if store else f"$ATTNLAB_MEMORY {self.root}"
                     if os.environ.get("ATTNLAB_MEMORY") else f"the memory store {self.root}")  # fmt: skip
            raise StoreError(f"{where}: {link}: remove the link, or give another --store")
        given = "--store" if store else "$ATTNLAB_MEMORY" if os.environ.get("ATTNLAB_MEMORY") else None
        if self.root.exists() and not self.root.is_dir():  # (named as given: the variable, when it was)
            how = "point it at a folder" if given == "$ATTNLAB_MEMORY" else "give --store a folder"
            raise StoreError(f"{given + '=' if given == '$ATTNLAB_MEMORY' else ''}{self.root}: a file, not a memory "
                             f"store folder ({how})")  # fmt: skip
        if not create and given and not self.root.exists():  # (a typo would list "no memories": as if all were lost)
            raise StoreError(f"{given} {self.root}: no such memory store (no folder there; check the path, or make "
                             f"the store with `attnlab memory ingest MODEL DOCUMENTS --name NAME --store "
                             f"{self.root}`)")  # fmt: skip
        if create:
            flag = "--store" if store else "$ATTNLAB_MEMORY" if os.environ.get("ATTNLAB_MEMORY") else "the store"
            problem = run_folder_problem(self.root, STORE_INSIDE_A_RUN, flag)
            if problem:  # (before the model is loaded and the documents read)
                raise StoreError(problem)
            self._check_creatable()
            self._check_index()
            if self.index.exists():  # (an index emptied beside no state file is made anew: nothing to lose)
                self._run(SCHEMA, write=True)

    def _check_creatable(self) -> None:
        """Refuses a store that could not be made (a file where one of its folders would go, a folder that may not
        be written), before minutes of reading: nothing is made."""
        existing = self.root if self.root.is_dir() else nearest_existing(self.root)
        problem = (errno.ENOTDIR if blocking_file(self.root) else
                   errno.EROFS if read_only_file_system(existing) else
                   errno.EACCES if not os.access(existing, os.W_OK | os.X_OK) else None)  # fmt: skip
        if problem is not None:
            raise StoreError(f"{self.root}: cannot use as a memory store ({os.strerror(problem)}: {existing})")

    def make(self) -> None:
        """Makes the store (its folder, states/ and the index's table) if it is not made yet."""
        try:
            (self.root / "states").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{self.root}: cannot use as a memory store ({e.strerror or e})") from None
        self._check_index()
        self._run(SCHEMA, write=True)

    def _check_index(self) -> None:
        """Refuses an index that lost its table (emptied or replaced) while the store holds state files: a fresh
        index in its place would forget them, where ls, query and rm refuse it (an index with no state files
        beside it has nothing to lose, and is made anew)."""
        if not self.index.exists():
            return
        try:
            tables = self._run("SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'states'")
        except JournalError:
            raise  # (the index is not known to be damaged: the journal beside it is what to see to)
        except StoreError:
            tables = []
        states = [p.name for p in (self.root / "states").glob("*.safetensors")]
        if not tables and states:
            raise StoreError(f"{self.index}: not a readable memory index (it was emptied or replaced) while "
                             f"{self.root / 'states'} holds {len(states)} state file{'s' * (len(states) > 1)}: "
                             f"restore the index from a copy, or move {self.root} away to start an empty "
                             "store")  # fmt: skip

    def _run(self, sql: str, args: tuple = (), write: bool = False, then=None, recovered: bool = False) -> list[tuple]:
        """Runs `sql` in one transaction. then: called before the commit (e.g. deleting a state file): if it
        raises (an OSError such as permission denied), the change is rolled back and the error goes on."""
        uri = f"{self.index.resolve().as_uri()}?mode={'rwc' if write else 'ro'}"
        try:
            with closing(sqlite3.connect(uri, uri=True)) as db, db:  # `with db`: one transaction, committed
                rows = db.execute(sql, args).fetchall()
                if then is not None:
                    then()  # (raises: `with db` rolls the statement back)
                return rows
        except sqlite3.IntegrityError:
            raise
        except sqlite3.Error as e:
            if getattr(e, "sqlite_errorname", "") == "SQLITE_READONLY_ROLLBACK" and not recovered:
                problem = self._journal_problem()  # (a read met SQLite's journal of an interrupted write)
                if problem is None:
                    return self._run(sql, args, write, then, recovered=True)
                raise JournalError(problem) from None
            raise StoreError(f"{self.index}: {self._problem(e)}") from None

    def _journal_problem(self) -> str | None:
        """A read-only open found index.sqlite-journal, which SQLite must roll back before the index is read. One of
        SQLite's (its header: an ingest or rm interrupted mid-write) is rolled back as any writer of the index
        would, when the store may be written (None: read again); else the line naming the journal and the fix."""
        journal = self.index.with_name(self.index.name + "-journal")
        try:
            with journal.open("rb") as file:
                ours = file.read(len(JOURNAL_HEADER)) == JOURNAL_HEADER
        except FileNotFoundError:
            return None  # (rolled back meanwhile: read again)
        except OSError as e:
            return (f"{journal}: cannot be read ({e.strerror or e}), and SQLite must roll back this journal of "
                    f"{self.index.name} before the index is read: make it readable")  # fmt: skip
        if not ours:
            return (f"{journal}: not a journal SQLite wrote (it lacks a journal's header), at the name where SQLite "
                    f"keeps the rollback journal of {self.index.name}, which cannot be read while it is there: move "
                    "it away and run again")  # fmt: skip
        if not (os.access(self.root, os.W_OK | os.X_OK) and os.access(self.index, os.W_OK)):
            return (
                f"{self.index}: read-only, and SQLite must roll back its journal {journal.name} (a write to the "
                f"index was interrupted), which needs write access: make {self.root} and its index writable, or "
                "choose another store with --store or $ATTNLAB_MEMORY"
            )
        uri = f"{self.index.resolve().as_uri()}?mode=rw"
        try:
            with closing(sqlite3.connect(uri, uri=True)) as db:  # (opening it for writing rolls the journal back)
                db.execute("SELECT count(*) FROM sqlite_master").fetchall()
        except sqlite3.Error as e:
            return f"{self.index}: {self._problem(e)}"
        return None

    def _problem(self, error: sqlite3.Error) -> str:
        """What is wrong with the index, and what to do, for SQLite's error."""
        code = getattr(error, "sqlite_errorname", "")
        elsewhere = "or choose another store with --store or $ATTNLAB_MEMORY"
        if code.startswith("SQLITE_READONLY"):
            return f"read-only ({error}): make {self.root} and its index writable, {elsewhere}"
        if code.startswith(("SQLITE_CANTOPEN", "SQLITE_PERM", "SQLITE_AUTH")):
            return f"cannot be opened ({error}): check the permissions of {self.root} and its index, {elsewhere}"
        if code.startswith("SQLITE_FULL"):
            return f"no space left on the device ({error}): free some space, {elsewhere}"
        if code in ("SQLITE_IOERR_WRITE", "SQLITE_IOERR_FSYNC", "SQLITE_IOERR_TRUNCATE", "SQLITE_IOERR_DIR_FSYNC"):
            return (f"could not be written ({error}, {code}): the disk is full or a file size limit is reached (see "
                    f"`ulimit -f`); free some space or raise the limit, {elsewhere}")  # fmt: skip
        return (f"not a readable memory index ({error}): it was damaged or replaced; restore it from a copy, or move "
                f"{self.root} away to start an empty store")  # fmt: skip

    def rows(self) -> list[tuple[object, Entry | None, str | None]]:
        """Every row of the index, by name: (name, its entry, None), or (name, None, what is wrong) for a row changed
        by hand into values the store never writes (ls marks it, rm removes it, the rest refuse it)."""
        if not self.index.exists() or self._never_written():
            return []
        out = []
        for row in self._run(f"SELECT {', '.join(COLUMNS)} FROM states ORDER BY name"):
            problem = row_problem(row)
            out.append((row[0], None, problem) if problem else (row[0], Entry(row[0], row[1], loads_json(row[2]),
                                                                                *row[3:]), None))  # fmt: skip
        return out

    def _never_written(self) -> bool:
        """An empty index file beside no state file: the store of an ingest stopped before the index's first write
        (a file-size limit, a full disk), which holds no memory yet; the next ingest writes the index."""
        try:
            return self.index.stat().st_size == 0 and not any((self.root / "states").glob("*.safetensors"))
        except OSError:
            return False

    def entries(self) -> list[Entry]:
        entries = []
        for name, entry, problem in self.rows():
            if problem:
                raise StoreError(f"{self.index}: the row of memory {name!r} is damaged ({problem}: the index was "
                                 f"changed by hand); `attnlab memory rm {name}` it, or restore the index")  # fmt: skip
            entries.append(entry)
        return entries

    def find(self, name: str) -> Entry | None:
        return next((e for e in self.entries() if e.name == name), None)

    def get(self, name: str) -> Entry:
        entry = self.find(name)
        if entry is None:
            raise StoreError(f"no memory named {name!r} in {self.root} (`attnlab memory ls` lists them)")
        return entry

    def path(self, entry: Entry) -> Path:
        if not self.holds(entry):
            raise StoreError(f"{self.index}: the row of memory {entry.name!r} names the file {entry.file!r}, which is "
                             f"not a state file of {self.root / 'states'} (the index was changed by hand); `attnlab "
                             "memory rm` it (its row goes, no file is deleted), or restore the index")  # fmt: skip
        return self.root / entry.file

    @staticmethod
    def holds(entry: Entry) -> bool:
        """Whether the row's file is one the store writes: states/<name>.safetensors, nothing outside the store (a
        row changed by hand could name any file, and `rm` or `--replace` would delete it)."""
        return MemoryStore.holds_file(entry.file)

    @staticmethod
    def holds_file(file: str) -> bool:
        parts = Path(file).parts
        return len(parts) == 2 and parts[0] == "states" and parts[1].endswith(".safetensors") and parts[1][0] != "."

    def put(self, entry: Entry, replace: bool = False) -> None:
        """Registers `entry`; with `replace`, in place of the entry of the same name (whose file goes)."""
        self.make()
        old = self.find(entry.name)
        row = (entry.name, entry.file, json.dumps(entry.documents), *[getattr(entry, c) for c in COLUMNS[3:]])
        verb = "INSERT OR REPLACE" if replace else "INSERT"
        gone = old is not None and old.file != entry.file and self.holds(old)  # never a file outside the store
        try:  # the old file is deleted before the commit: one that cannot be leaves the old row in place
            self._run(f"{verb} INTO states ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})", row, True,
                      then=(lambda: self.path(old).unlink(missing_ok=True)) if gone else None)  # fmt: skip
        except sqlite3.IntegrityError:
            raise StoreError(f"a memory named {entry.name!r} exists in {self.root} (pass --replace)") from None

    def remove(self, name: str) -> tuple[str, object]:
        """Deletes the row of memory `name`, damaged or not, and its state file when that is one of the store's;
        (name, the file its row names). A file that cannot be deleted (OSError) keeps the row: nothing changes."""
        row = next((row for row in self.rows() if row[0] == name), None)
        if row is None:
            raise StoreError(f"no memory named {name!r} in {self.root} (`attnlab memory ls` lists them)")
        (file,) = self._run("SELECT file FROM states WHERE name = ?", (name,))[0]
        ours = isinstance(file, str) and self.holds_file(file)
        # The file is deleted before the row's deletion commits: a file that cannot be deleted keeps the row.
        self._run("DELETE FROM states WHERE name = ?", (name,), write=True,
                  then=(lambda: (self.root / file).unlink(missing_ok=True)) if ours else None)  # fmt: skip
        return name, file


def row_problem(row: tuple) -> str | None:
    """What is wrong with a row of the index (its columns, COLUMNS), or None: a value of a type, or a number or
    time, the store never writes."""
    values = dict(zip(COLUMNS, row, strict=True))
    wrong = [f"{c}={brief(v)}" for c, v in values.items() if not isinstance(v, COLUMN_TYPES[c])]
    try:
        documents = loads_json(values["documents"]) if isinstance(values["documents"], str) else []
    except (TypeError, ValueError, RecursionError):  # (nested too deeply for the json module)
        documents = None
    if not isinstance(documents, list):
        wrong.append("documents (not a JSON list)")
    wrong += [f"{c}={values[c]} (below 0)" for c in ("tokens", "bytes") if isinstance(values[c], int) and values[c] < 0]
    wrong += _tokens_problem(values["tokens"], documents)
    if isinstance(values["created"], str) and not _is_time(values["created"]):
        wrong.append(f"created={brief(values['created'])} (not an ISO 8601 time)")
    if isinstance(values["name"], str) and name_problem(values["name"], "name"):  # (ingest takes plain names only)
        wrong.append(f"name={brief(values['name'])} (not a plain name)")
    return ", ".join(wrong) or None


def _tokens_problem(tokens: object, documents: object) -> list[str]:
    """A row's tokens against its documents: an ingest reads at least one token, and exactly its documents' tokens
    with the end-of-text token between two documents."""
    if not isinstance(tokens, int) or tokens < 0 or not isinstance(documents, list):
        return []  # (said already)
    counts = [d.get("tokens") if isinstance(d, dict) else None for d in documents]
    if not documents:
        return ["documents=[] (an ingest reads at least one document)"]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        return ["documents (not a list of {path, sha256, tokens})"]
    read = sum(counts) + len(counts) - 1
    if tokens != read:
        return [f"tokens={tokens} (its {len(counts)} document(s) make {read:,})"]
    if tokens < 1:
        return ["tokens=0 (an ingest reads at least one token)"]
    return []


def _is_time(text: str) -> bool:
    try:
        datetime.datetime.fromisoformat(text)
    except ValueError:
        return False
    return True


def check_name(name: str) -> None:
    """A memory's name becomes part of its state file's name: the rules of every name (attnlab.paths)."""
    problem = name_problem(name, "memory name")
    if problem:
        raise InputError(f"{problem}; give --name a plain name (e.g. --name notes)")


MAX_CHUNK = 2**31 - 1  # tokens per prefill step at most (the bound of every integer option)


def check_ingest_options(name: str, chunk: int) -> None:
    """Refuses (InputError, one line) a name that cannot name a state file and a --chunk out of range: checked
    before the store is made or the model loaded."""
    check_name(name)
    if not 1 <= chunk <= MAX_CHUNK:
        raise InputError(f"--chunk {chunk} must be in 1 .. {MAX_CHUNK:,} (2**31 - 1) tokens per prefill step (the "
                         "default is 512)")  # fmt: skip


def _load_model(path: str | Path, data_dir: str | None):
    loaded = load_for_eval(path, data_dir=data_dir)
    if loaded.tokenizer is None:
        raise InputError(f"{path}: no tokenizer saved with this checkpoint: cannot encode text")
    require_memory(loaded.model)
    return loaded


def recorded_model(ref: str | Path, data_dir: str | None) -> str:
    """What a memory records of the model it was made with, so that `memory query` finds it again from anywhere:
    a Hub reference as given (hf:ORG/NAME), anything else where it was found (a name looked up in the data
    directory included), as an absolute path."""
    if str(ref).startswith("hf:"):
        return str(ref)
    from attnlab.interop.references import resolve

    return str(Path(resolve(str(ref), data_dir)[1]).resolve())


def _gone(path: str) -> bool:
    """Whether nothing is at `path` any more (a folder that cannot be read is still there: loading it says why)."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False


def too_large(*docs: Path) -> str:
    """What is said when documents run out of memory while read and tokenized (each is read whole)."""
    try:
        size = f" ({sum(doc.stat().st_size for doc in docs) / 2**30:.1f} GiB)"
    except OSError:
        size = ""
    return (f"{', '.join(map(str, docs))}{size}: out of memory reading and tokenizing it (an ingest reads its "
            "documents whole, as one stream of tokens): too large for this machine: ingest less text, e.g. its first "
            "part (head -c 100M FILE > part.txt), or parts of it as separate memories (--name)")  # fmt: skip


def _file_identity(doc) -> tuple | str:
    """What makes two names one file: its device and inode (a hard link is the file it links), else, for a name
    that cannot be read (refused below, naming it), its resolved path."""
    try:
        found = os.stat(doc)
    except (OSError, ValueError):
        return os.path.realpath(doc)
    return (found.st_dev, found.st_ino)


PROGRESS_DELAY = 2.0  # seconds before an ingest shows its progress bar (a short one shows none)


def ingest(store: MemoryStore, model_path: str | Path, documents: list[str | Path], name: str, chunk: int = 512,
           replace: bool = False, data_dir: str | None = None, progress: bool = False) -> Entry:  # fmt: skip
    """Reads the documents (in order, the tokenizer's end-of-text id between them) into a new memory of the
    model at `model_path`, `chunk` tokens at a time, and stores the state as `name`. progress: a bar of the
    tokens read on stderr once the ingest has taken PROGRESS_DELAY seconds (a memory reads its tokens in blocks
    of its recent window, routing each one: a long document takes minutes)."""
    check_flags(replace=replace, progress=progress)
    check_store(store)
    if isinstance(documents, str | bytes | os.PathLike) or not isinstance(documents, Iterable):
        one = f" (give [{os.fsdecode(documents)!r}])" if isinstance(documents, str | bytes | os.PathLike) else ""
        raise InputError(f"documents must be a list of paths, got {given(documents)}{one}")
    documents = list(documents)
    wrong = next(((i, doc) for i, doc in enumerate(documents) if not isinstance(doc, str | os.PathLike)), None)
    if wrong is not None:
        raise InputError(f"documents[{wrong[0]}] is {given(wrong[1])}: documents must be paths (str or Path)")
    same = [_file_identity(doc) for doc in documents]  # (doc.txt, ./doc.txt, a link to it: one document)
    twice = first_repeat(same)
    if twice is not None:
        shown = ", ".join(repr(os.fsdecode(doc)) for doc, key in zip(documents, same, strict=True) if key == twice)
        first = os.path.realpath(documents[same.index(twice)])
        raise InputError(f"documents: {first} is given twice (as {shown}): give each document once (a memory "
                         "would read it twice)")  # fmt: skip
    check_ingest_options(name, chunk)
    if not replace and store.find(name) is not None:
        raise StoreError(f"a memory named {name!r} exists in {store.root} (pass --replace)")
    if not documents:
        raise InputError("give at least one document")
    texts = []
    for doc in map(Path, documents):
        if doc.exists() and not doc.is_file():  # a device (/dev/zero) or fifo would be read without end
            what = "a folder" if doc.is_dir() else "not a regular file (a device, fifo or socket)"
            raise InputError(f"{doc}: {what}: documents are read from regular text files; give a file path")
        try:
            raw = doc.read_bytes()
            texts.append((doc, raw, raw.decode("utf-8")))
        except OSError as e:
            raise DataError(f"{doc}: cannot read ({e.strerror or e})") from None
        except UnicodeDecodeError as e:
            raise DataError(f"{doc}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except MemoryError:
            raise DataError(too_large(doc)) from None
    loaded = _load_model(model_path, data_dir)
    model, tokenizer = loaded.model, loaded.tokenizer
    ids, records = [], []
    for i, (doc, raw, text) in enumerate(texts):
        try:
            warn_unknown(tokenizer, text, str(doc))  # a char or word vocabulary reads what it lacks as <unk>
            encoded = tokenizer.encode(text)
            ids += ([tokenizer.eot_id] if i else []) + encoded
        except MemoryError:
            raise DataError(too_large(doc)) from None
        records.append({"path": str(doc.resolve()), "sha256": hashlib.sha256(raw).hexdigest(), "tokens": len(encoded)})
    if not ids:
        names = ", ".join(str(doc) for doc, _, _ in texts)
        raise InputError(f"the documents hold no text to ingest ({names}): give files with text in them")
    model_path = recorded_model(model_path, data_dir)
    cache = model.new_cache(1)
    try:
        ids = torch.tensor([ids], device=loaded.device)  # (1, T)
    except MemoryError:
        raise DataError(too_large(*(doc for doc, _, _ in texts))) from None
    with tqdm(total=ids.shape[1], desc=f"ingest {name}", unit="tok", unit_scale=True, dynamic_ncols=True,
              delay=PROGRESS_DELAY, disable=not progress, file=sys.stderr) as bar:  # fmt: skip
        for start in range(0, ids.shape[1], chunk):  # what prefill does, a chunk at a time
            prefill(model, ids[:, start : start + chunk], cache, chunk)
            bar.update(min(chunk, ids.shape[1] - start))
    store.make()  # (only now: an ingest refused before this point leaves no store behind)
    final = store.root / "states" / f"{name}-{uuid.uuid4().hex[:12]}.safetensors"  # never the file of a row
    header = save_state(final, model, cache, model_path=model_path)
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    entry = Entry(name, str(final.relative_to(store.root)), records, cache.seen, final.stat().st_size,
                  header["config_hash"], model_path, created, header["sha256"])  # fmt: skip
    try:
        store.put(entry, replace)
    except (StoreError, OSError):  # (an old state that could not be deleted: the old row stays)
        final.unlink(missing_ok=True)  # registered nowhere
        raise
    return entry


MAX_ANSWER_TOKENS = 65_536  # new tokens of one query at most (a memory model is not bounded by its context)


def query(store: MemoryStore, name: str, prompt: str, model_path: str | Path | None = None,
          data_dir: str | None = None, **generate_kwargs) -> str:  # fmt: skip
    """The model's continuation of `prompt` read after the memory `name` (a copy of it: the store is only
    read). model_path: the model to use instead of the one recorded at ingestion (same config required).
    generate_kwargs: generate's options but those query sets itself (model, cache) and those of a new cache
    (kv_policy, fused=True): InputError."""
    check_store(store)
    options = generate_kwargs  # (fused=False and kv_policy=None change nothing: taken)
    clashes = {"model": "model" in options, "cache": "cache" in options,
               "kv_policy": options.get("kv_policy") is not None, "fused": options.get("fused") is True}  # fmt: skip
    taken = [key for key, clash in clashes.items() if clash]
    if taken:
        listed = " and ".join(", ".join(taken).rsplit(", ", 1))
        raise InputError(f"query reads the memory's state as the cache, with the model it was made with: "
                         f"{listed} cannot be given (leave {'it' if len(taken) == 1 else 'them'} out)")  # fmt: skip
    entry = store.get(name)
    if not store.path(entry).exists():
        raise StoreError(f"{store.path(entry)}: the state file of memory {name!r} is missing (deleted or moved): "
                         f"re-ingest the documents (attnlab memory ingest MODEL DOCS --name {name} --replace), or "
                         f"remove the entry (attnlab memory rm {name})")  # fmt: skip
    moved = not entry.model_path.startswith("hf:") and _gone(entry.model_path)  # moved or deleted since the ingest
    if model_path is None and moved:
        raise StoreError(f"memory {name!r} was made with {entry.model_path}, which is gone (moved or deleted): give "
                         "its new place with --model, or re-ingest the documents")  # fmt: skip
    loaded = _load_model(model_path or entry.model_path, data_dir)
    try:
        cache, header, entry = _load_registered(store, name, entry, loaded.model)
    except DamagedStateError as e:  # (the store's own commands are the way out)
        raise StoreError(f"{e.problem}; re-ingest memory {name!r} (attnlab memory ingest MODEL DOCS --name {name} "
                         f"--replace) or remove it (attnlab memory rm {name})") from None  # fmt: skip
    if header["sha256"] != entry.state_sha256:
        raise StoreError(f"{store.path(entry)}: not the state the index registered for {name!r} (checksum "
                         f"{header['sha256'][:12]}, index {entry.state_sha256[:12]}); re-ingest it")  # fmt: skip
    ids = loaded.tokenizer.encode(prompt)
    warn_unknown(loaded.tokenizer, prompt, "the prompt")
    asked = generate_kwargs.get("max_new_tokens")
    if isinstance(asked, int) and asked > MAX_ANSWER_TOKENS:
        # The memory reads past max_seq_len, so no context bounds an answer; a typo of a few digits would decode
        # for days. Said on stderr, as generate says a request it cuts to the context.
        warnings.warn(f"max_new_tokens={asked:,} is more than one answer may hold ({MAX_ANSWER_TOKENS:,} tokens): "
                      f"generating at most {MAX_ANSWER_TOKENS:,}", LengthWarning, stacklevel=2)  # fmt: skip
        generate_kwargs["max_new_tokens"] = MAX_ANSWER_TOKENS
    out = generate(loaded.model, torch.tensor(ids, device=loaded.device), cache=cache, **generate_kwargs)
    return loaded.tokenizer.decode(out.tolist())


def check_store(store) -> None:
    """InputError unless `store` is a MemoryStore (not the path of its folder)."""
    if not isinstance(store, MemoryStore):
        raise InputError(f"store must be a MemoryStore (attnlab.memory.MemoryStore(folder)), got {given(store)}")


def _load_registered(store: MemoryStore, name: str, entry: Entry, model) -> tuple:
    """(cache, header, entry): the state the index names for `name`, loaded. Read from the index again when the
    file went while the model loaded (an `ingest --replace` of that name registered a new state, then deleted the
    old one): that is the memory now, not a missing file."""
    while True:
        try:
            return (*load_state(store.path(entry), model), entry)
        except MemoryStateError:
            latest = store.get(name)  # (StoreError when it was removed meanwhile: said as for any missing name)
            if latest.file == entry.file:
                raise
            entry = latest
