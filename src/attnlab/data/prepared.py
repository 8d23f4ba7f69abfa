"""Prepared token files: `prepare(DataConfig) -> Prepared`, cached on disk and checked when reused.

A prepared folder holds, per split, a flat array of token ids (`train.bin`, `val.bin`, `test.bin`; uint16, or
uint32 when an id does not fit) read with np.memmap, the tokenizer's own files, and `meta.json` (tokenizer,
vocab size, end-of-text id, dtype, token and document counts, sha256 of every source file and .bin, format
version), and the sha256 of each tokenizer file. Every file is written to a temporary name and renamed; meta.json
is written last, so a folder without it is not prepared.

In a split, documents are concatenated with the end-of-text id between them:
    doc_0 <eot> doc_1 <eot> ... doc_n
The folder is keyed by a hash of what determines its content (source, tokenizer, split fractions,
max_tokens, format version), so a second `prepare` with the same config reads the files instead of
tokenizing again.

A reused folder is checked before it is trusted: meta.json key by key, each .bin's size at once, and each .bin's
sha256 and largest id (< vocab_size) in one pass the first time its split is read (`Prepared.verify`; the
trainer verifies every split before it starts), and the tokenizer's files' sha256 as the folder is opened (a
vocab.json changed after the ids were made would decode them as other text, and be saved as a run's tokenizer; a
folder prepared before these were recorded is read with a warning). Hashing runs at ~1.5 GB/s from the page cache
(~0.4 GB/s from a cold disk) here, so a few hundred MB of tokens cost a fraction of a second on every reuse, a
tokenizer's few MB a few ms.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np

from attnlab.config import DataConfig, names_model
from attnlab.data.files import atomic_path, atomic_write_text, file_kind, remove_stale_temporaries, sha256_file
from attnlab.data.prepared_meta import FORMAT_VERSION, _check_meta, _redo, data_record_problem, token_dtype  # noqa: F401
from attnlab.data.source_identity import file_sha256, named_source_key, prepared_source_problem
from attnlab.data.sources import NAMED_SOURCES, SPLITS, WIKITEXT, Source, open_source, source_key
from attnlab.data.tokenizers import Tokenizer, check_tokenizer_name, fit_tokenizer, load_tokenizer, needs_training
from attnlab.errors import AttnlabWarning, ConfigError, DataError
from attnlab.jsonio import loads_json
from attnlab.paths import cache_dir

ENCODE_BATCH_CHARS = 1 << 22  # documents are encoded in batches of about 4M characters (threaded encoders)
FIT_CHARS_PER_TOKEN = 8  # with max_tokens, a fitted tokenizer sees at most 8 * max_tokens training characters
SPLIT_ALIASES = {"valid": "val", "validation": "val"}

log = logging.getLogger(__name__)
_unchecked_warned: set[Path] = set()  # folders prepared before tokenizer checksums, warned about once per process


def default_cache_dir() -> Path:
    """`<user cache>/attnlab/prepared` ($XDG_CACHE_HOME or ~/.cache)."""
    return cache_dir() / "prepared"


def cache_key(data_cfg: DataConfig, data_dir: str | Path | None = None, tokenizer: Tokenizer | None = None) -> str:
    """16 hex digits of sha256 over everything that determines the prepared files. A model's tokenizer
    (data.tokenizer a model reference) counts by its fingerprint, not by the name it was reached by. A named dataset
    counts by its name while the files found are its own, else by the files found too (data.source_identity)."""
    own_splits = data_cfg.source in WIKITEXT  # the split fractions do not apply to WikiText
    blob = {
        "format_version": FORMAT_VERSION,
        "source": named_source_key(data_cfg.source, data_dir)
        if data_cfg.source in NAMED_SOURCES
        else source_key(data_cfg.source, data_dir),
        "tokenizer": _model_tokenizer(data_cfg, tokenizer).fingerprint
        if names_model(data_cfg.tokenizer)
        else data_cfg.tokenizer,
        "val_fraction": None if own_splits else data_cfg.val_fraction,
        "test_fraction": None if own_splits else data_cfg.test_fraction,
        "max_tokens": data_cfg.max_tokens,
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def folder_name(data_cfg: DataConfig, key: str) -> str:
    """A readable folder name: `wikitext2-word-<key>`, `input-bpe4096-<key>`, `wikitext2-SmolLM2-135M-<key>`."""
    source = data_cfg.source if data_cfg.source in NAMED_SOURCES else Path(data_cfg.source).name.split(".")[0]
    tokenizer = data_cfg.tokenizer
    if names_model(tokenizer):  # a model's: its file or folder name, without the .gguf
        tokenizer = re.sub(r"\.gguf$", "", tokenizer.rstrip("/\\").replace("\\", "/").split("/")[-1], flags=re.I)
    slug = re.sub(r"[^A-Za-z0-9_-]+", "", f"{source}-{tokenizer}")
    return f"{slug}-{key}"


class Prepared:
    """A prepared folder: `.path`, `.meta`, `.tokenizer`, `.vocab_size`, `.eot_id`, `.splits`, `.split(name)`."""

    def __init__(self, path: Path, meta: dict, verified: bool = False):
        """`verified`: the .bin files are known to match meta.json (they were just written), else each split is
        checked when first read."""
        self.path = Path(path)
        self.meta = meta
        self._tokenizer: Tokenizer | None = None
        self._verified: set[str] = set(meta["splits"]) if verified else set()
        self._tokenizer_checked = verified

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def eot_id(self) -> int:
        return self.meta["eot_id"]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    @property
    def splits(self) -> list[str]:
        return list(self.meta["splits"])

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the files were made with, loaded from this folder (no data directory needed)."""
        if self._tokenizer is None:
            self.verify_tokenizer()
            tokenizer = load_tokenizer(self.meta["tokenizer"]["name"], self.path, download=False)
            if tokenizer.vocab_size != self.vocab_size:
                raise DataError(
                    f"{self.path / 'meta.json'}: vocab_size is {self.vocab_size}, but the tokenizer files in the "
                    f"folder hold {tokenizer.vocab_size} tokens; {_redo(self.path)}"
                )
            if "files" not in self.meta["tokenizer"] and tokenizer.files and self.path not in _unchecked_warned:
                _unchecked_warned.add(self.path)
                warnings.warn(f"{self.path}: meta.json records no sha256 of the tokenizer's files (prepared by an "
                              f"older attnlab): {', '.join(tokenizer.files)} cannot be checked; delete the folder to "
                              "prepare it again with them", AttnlabWarning, stacklevel=2)  # fmt: skip
            self._tokenizer = tokenizer
        return self._tokenizer

    def verify_tokenizer(self) -> None:
        """Checks the tokenizer's files against the sha256 meta.json records of them, once (DataError naming the
        file). A folder prepared before they were recorded is not checked."""
        if self._tokenizer_checked:
            return
        for name, digest in self.meta["tokenizer"].get("files", {}).items():
            file = self.path / name
            if not file.exists():
                raise DataError(f"{file}: missing, but meta.json records its sha256 (the tokenizer's file was removed "
                                f"after it was prepared); {_redo(self.path)}")  # fmt: skip
            try:
                kind = file_kind(file)  # a folder or a FIFO is named rather than read (or waited on)
                found = None if kind else sha256_file(file)
            except OSError as e:
                raise DataError(f"{file}: unreadable ({e.strerror or e}); {_redo(self.path)}") from None
            if kind is not None:
                raise DataError(f"{file} is {kind}, not the tokenizer's file meta.json records; {_redo(self.path)}")
            if found != digest:
                raise DataError(f"{file}: sha256 differs from meta.json (the tokenizer file was damaged or changed "
                                f"after it was prepared); {_redo(self.path)}")  # fmt: skip
        self._tokenizer_checked = True

    def verify(self, *names: str) -> None:
        """Checks each split's .bin (all splits by default) against meta.json: its sha256, and that every id is
        below vocab_size. A split is read once for both, and only the first time (DataError naming the file). The
        tokenizer's files are checked too (verify_tokenizer)."""
        self.verify_tokenizer()
        for name in names or self.splits:
            name = SPLIT_ALIASES.get(name, name)
            if name in self._verified or name not in self.meta["splits"]:
                continue
            entry = self.meta["splits"][name]
            file = self.path / entry["file"]
            digest, largest = _scan(file, self.dtype)
            if digest != entry["sha256"]:
                raise DataError(
                    f"{file}: sha256 differs from meta.json (the token file was damaged or changed after it was "
                    f"prepared); {_redo(self.path)}"
                )
            if largest is not None and largest >= self.vocab_size:
                raise DataError(
                    f"{file}: holds token id {largest}, out of range for the tokenizer's vocab_size {self.vocab_size} "
                    f"(meta.json); {_redo(self.path)}"
                )
            self._verified.add(name)

    def split(self, name: str) -> np.ndarray:
        """The split's token ids as a read-only np.memmap of shape (n_tokens,); never loaded whole."""
        name = SPLIT_ALIASES.get(name, name)
        if name not in self.meta["splits"]:
            raise DataError(
                f"{self.path}: no {name!r} split (it has {', '.join(self.splits)}); for sources without their "
                "own splits set data.val_fraction / data.test_fraction > 0"
            )
        self.verify(name)
        entry = self.meta["splits"][name]
        if entry["tokens"] == 0:
            return np.empty(0, dtype=self.dtype)
        return np.memmap(self.path / entry["file"], dtype=self.dtype, mode="r", shape=(entry["tokens"],))

    def __repr__(self) -> str:
        counts = ", ".join(f"{s}={e['tokens']:,}" for s, e in self.meta["splits"].items())
        return f"Prepared({str(self.path)!r}, tokenizer={self.meta['tokenizer']['name']!r}, {counts})"


def _scan(file: Path, dtype: np.dtype, chunk_bytes: int = 1 << 22) -> tuple[str, int | None]:
    """(sha256, largest id or None when empty) of a token file, read once in chunks."""
    digest, largest = hashlib.sha256(), None
    try:
        with open(file, "rb") as f:
            while chunk := f.read(chunk_bytes):
                digest.update(chunk)
                ids = np.frombuffer(chunk, dtype=dtype, count=len(chunk) // dtype.itemsize)  # (n,) token ids
                if len(ids):
                    top = int(ids.max())
                    largest = top if largest is None else max(largest, top)
    except OSError as e:
        raise DataError(f"{file}: unreadable ({e.strerror or e}); {_redo(file.parent)}") from None
    return digest.hexdigest(), largest


def open_prepared(path: str | Path, verify: bool = False, data_cfg: DataConfig | None = None) -> Prepared:
    """A prepared folder, after checking meta.json, each .bin's size and the tokenizer's files' sha256; each .bin's
    sha256 and id range are checked when its split is first read, or now when `verify`. data_cfg: the DataConfig
    the folder was found for (its key named it), which meta.json's `data` record must agree with."""
    path = Path(path)
    redo = _redo(path)
    try:
        meta = loads_json((path / "meta.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{path} is not a prepared data folder (no meta.json)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path / 'meta.json'}: unreadable ({e}); {redo}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path / 'meta.json'} is not valid JSON ({e}); {redo}") from None
    _check_meta(path, meta)
    problem = data_record_problem(path, meta, data_cfg) if data_cfg is not None else None
    if problem:
        raise DataError(problem)
    itemsize = np.dtype(meta["dtype"]).itemsize
    for entry in meta["splits"].values():
        file, expected = path / entry["file"], entry["tokens"] * itemsize
        kind = file_kind(file) if file.exists() else None
        if kind is not None:  # a folder or a FIFO is no token file, not a truncated one
            raise DataError(f"{file} is {kind}, not a token file (meta.json records {entry['tokens']:,} "
                            f"{meta['dtype']} tokens there); {redo}")  # fmt: skip
        size = file.stat().st_size if file.exists() else None
        if size != expected:
            found = "missing" if size is None else f"{size:,} bytes"
            raise DataError(
                f"{file} is {found}, but meta.json records {entry['tokens']:,} {meta['dtype']} tokens "
                f"({expected:,} bytes): the token file is truncated or corrupt; {redo}"
            )
    prepared = Prepared(path, meta)
    prepared.verify_tokenizer()  # a few MB at most: now, before a run says it starts
    if verify:
        prepared.verify()
    return prepared


def prepare(
    data_cfg: DataConfig,
    data_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    *,
    download: bool | None = None,
    tokenizer: Tokenizer | None = None,
) -> Prepared:
    """Token files for `data_cfg`, prepared once under `cache_dir` (default `default_cache_dir()`) and reused.

    `data_dir` is looked in first for the source files (then $ATTNLAB_DATA, then the user cache); `download`
    (default: unless $ATTNLAB_OFFLINE is set) allows fetching missing files. A reused folder whose .bin
    sizes disagree with its meta.json is a DataError naming the file; so is one whose sha256 or token ids
    disagree, when its split is first read.

    `tokenizer`: the model's tokenizer, needed when data.tokenizer names a model, ignored otherwise (attnlab.interop
    loads it with the model; the data pipeline does not read model files). It is saved in the folder, under that
    name.
    """
    check_tokenizer_name(data_cfg.tokenizer)
    key = cache_key(data_cfg, data_dir, tokenizer)
    folder = Path(cache_dir or default_cache_dir()) / folder_name(data_cfg, key)
    if (folder / "meta.json").exists():
        prepared = open_prepared(folder, data_cfg=data_cfg)
        problem = prepared_source_problem(folder, prepared.meta, data_cfg.source, data_dir)
        if problem:
            raise DataError(problem)
        return prepared
    return _build(data_cfg, folder, data_dir, download, tokenizer)


def _model_tokenizer(data_cfg: DataConfig, tokenizer: Tokenizer | None) -> Tokenizer:
    """The tokenizer passed for a data.tokenizer that names a model; ConfigError when none (or another kind) was."""
    if tokenizer is None or not hasattr(tokenizer, "fingerprint"):
        raise ConfigError(f"data.tokenizer={data_cfg.tokenizer!r} names a model: its tokenizer is read from the model "
                          "(pass prepare(..., tokenizer=) the model's, e.g. attnlab.load_model(ref)[2])")  # fmt: skip
    return tokenizer


# ----------------------------------------------------------------------------- building


class _SplitWriter:
    """Appends documents' ids to a split's open .bin file, with <eot> between documents and an optional token
    limit."""

    def __init__(self, file: IO[bytes], dtype: np.dtype, eot_id: int, limit: int | None = None):
        self.file, self.dtype, self.eot_id, self.limit = file, dtype, eot_id, limit
        self.digest = hashlib.sha256()
        self.tokens = self.documents = 0

    @property
    def full(self) -> bool:
        return self.limit is not None and self.tokens >= self.limit

    def add(self, docs: list[list[int]]) -> None:
        flat: list[int] = []
        for ids in docs:
            if self.documents:
                flat.append(self.eot_id)
            flat.extend(ids)
            self.documents += 1
            if self.limit is not None and self.tokens + len(flat) >= self.limit:
                del flat[self.limit - self.tokens :]  # the budget cuts the last document
                break
        data = np.asarray(flat, dtype=self.dtype).tobytes()  # (n,) ids; OverflowError if an id does not fit
        self.file.write(data)
        self.digest.update(data)
        self.tokens += len(flat)

    def summary(self, file_name: str) -> dict:
        digest = self.digest.hexdigest()
        return {"file": file_name, "tokens": self.tokens, "documents": self.documents, "sha256": digest}


def _training_texts(source: Source, max_tokens: int | None) -> Iterator[str]:
    """The training split's documents, for fitting a tokenizer (never a validation or test document)."""
    budget = None if max_tokens is None else FIT_CHARS_PER_TOKEN * max_tokens
    seen = 0
    for split, text in source.documents():
        if split != "train":
            if source.own_splits:  # own-split sources yield all of train first
                return
            continue
        yield text
        seen += len(text)
        if budget is not None and seen >= budget:
            return


def _encode(source: Source, tokenizer: Tokenizer, writers: dict[str, _SplitWriter]) -> None:
    """Streams the documents through the tokenizer into the split writers, in batches of documents."""
    batch: list[tuple[str, str]] = []
    chars = 0

    train = writers["train"]

    def flush() -> None:
        ids = tokenizer.encode_batch([text for _, text in batch])
        # Walk the documents in order: once the training budget is spent, a hash-split stream stops there
        # (later validation documents are dropped too), an own-split source only skips training documents.
        kept: dict[str, list[list[int]]] = {split: [] for split in writers}
        room = None if train.limit is None else train.limit - train.tokens
        train_documents = train.documents
        for (split, _), doc_ids in zip(batch, ids, strict=True):
            if room is not None and room <= 0:
                if not source.own_splits:
                    break
                if split == "train":
                    continue
            kept[split].append(doc_ids)
            if split == "train" and room is not None:
                room -= len(doc_ids) + (1 if train_documents else 0)  # + the <eot> before it
                train_documents += 1
        for split, docs in kept.items():
            if docs:
                writers[split].add(docs)
        batch.clear()

    for split, text in source.documents():
        if split not in writers:
            raise DataError(f"{source.name}: document in unexpected split {split!r}")
        if writers["train"].full:
            if not source.own_splits:
                break  # the stream stops once the training budget is spent
            if split == "train":
                continue
        batch.append((split, text))
        chars += len(text)
        if chars >= ENCODE_BATCH_CHARS:
            flush()
            chars = 0
    flush()


def _empty_split(source: Source, split: str, train_documents: int) -> str:
    name = source.name  # a named dataset's: with the file read (another file than the dataset's may stand there)
    name += f" ({', '.join(map(str, source.files))})" if name in NAMED_SOURCES and source.files else ""
    if train_documents == 0 and split == "train":  # nothing at all: an empty file (or only blank lines)
        return f"{name}: holds no document (it is empty, or blank lines only): give a file with text"
    return (f"{name}: no document fell in the {split!r} split ({train_documents} training documents); use a "
            "larger source, more documents (blank-line separated), or other fractions")  # fmt: skip


def check_source(data_cfg: DataConfig, data_dir: str | Path | None = None) -> None:
    """Reads a local source's documents as prepare() would before it tokenizes them (run --dry-run, validate): the
    DataError prepare() would raise for a file it cannot read (not UTF-8, a JSON line without its text, a damaged
    parquet file or archive) or a split no document falls in. What prepare() may leave unread (past data.max_tokens,
    which only tokenizing can place) is not read here either, so nothing is refused that prepare() would take."""
    source = open_source(data_cfg.source, data_dir, val_fraction=data_cfg.val_fraction,
                         test_fraction=data_cfg.test_fraction, download=False)  # fmt: skip
    limit = data_cfg.max_tokens
    fit = FIT_CHARS_PER_TOKEN * limit if limit is not None and needs_training(data_cfg.tokenizer) else 0
    counts = dict.fromkeys(_expected_splits(data_cfg, source), 0)
    train_chars = batch_chars = most_tokens = 0  # most_tokens: no tokenizer makes more than a token per UTF-8 byte
    may_stop = False  # _encode may have stopped reading (its training budget spent at the end of a batch)
    for split, text in source.documents():
        counts[split] = counts.get(split, 0) + 1
        if split == "train":
            train_chars += len(text)
            most_tokens += len(text.encode("utf-8")) + 1  # (+ the <eot> between documents)
        batch_chars += len(text)
        if batch_chars >= ENCODE_BATCH_CHARS:  # where _encode flushes a batch, and may find its budget spent
            batch_chars = 0
            may_stop = may_stop or (limit is not None and most_tokens >= limit)
        if may_stop and train_chars >= fit:  # (a fitted tokenizer reads fit characters of training text first)
            return
    if limit is not None and most_tokens >= limit:  # the budget may cut a split short: only tokenizing can tell
        return
    for split, count in counts.items():
        if count == 0:
            raise DataError(_empty_split(source, split, counts["train"]))


def _expected_splits(data_cfg: DataConfig, source: Source) -> list[str]:
    if source.own_splits:
        return list(SPLITS)
    return ["train"] + (["val"] if data_cfg.val_fraction > 0 else []) + (["test"] if data_cfg.test_fraction > 0 else [])


def _versions() -> dict[str, str]:
    versions = {}
    for package in ("attnlab", "numpy", "tiktoken", "tokenizers"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def _build(data_cfg: DataConfig, folder: Path, data_dir, download, model_tokenizer=None) -> Prepared:
    started = time.perf_counter()
    source = open_source(
        data_cfg.source,
        data_dir,
        val_fraction=data_cfg.val_fraction,
        test_fraction=data_cfg.test_fraction,
        max_tokens=data_cfg.max_tokens,
        download=download,
    )
    log.info("preparing %s with %s into %s", data_cfg.source, data_cfg.tokenizer, folder)
    problem = folder_problem(folder)
    if problem:
        raise DataError(problem)
    made = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a file where the cache expects a folder
        raise DataError(FILE_IN_THE_WAY.format(folder=folder)) from None
    except FileNotFoundError as e:  # a cache under a folder that cannot hold folders (e.g. /proc)
        raise DataError(f"{folder}: cannot create the prepared data's folder ({e.strerror or e}); set "
                        "XDG_CACHE_HOME to a writable folder") from None  # fmt: skip
    try:
        return _fill(data_cfg, folder, source, data_dir, download, model_tokenizer, started)
    except BaseException:
        if made and not (folder / "meta.json").exists():  # a refused preparation leaves no folder behind
            shutil.rmtree(folder, ignore_errors=True)
        raise


FILE_IN_THE_WAY = ("{folder}: a file stands where the prepared data's folder goes (or one of its parents); remove it, "
                   "or set XDG_CACHE_HOME to another cache")  # fmt: skip


def folder_problem(folder: Path) -> str | None:
    """The line refusing a prepared data folder that cannot be made because a file stands where it or one of its
    parents goes (XDG_CACHE_HOME naming a file, say), checked before anything is prepared (run --dry-run too)."""
    for path in (folder, *folder.parents):
        if path.exists() or path.is_symlink():
            if path.is_dir():
                return None
            if not path.is_symlink() or path.exists():
                return FILE_IN_THE_WAY.format(folder=folder)
            given = os.environ.get("XDG_CACHE_HOME")  # a dangling link: named itself, not the folder three down
            named = f"$XDG_CACHE_HOME {path}" if given and Path(given).absolute() == path.absolute() else str(path)
            return (f"{named} is a link to {os.readlink(path)}, which does not exist (mount it, or set "
                    "XDG_CACHE_HOME to another folder)")  # fmt: skip
    return None


def _fill(data_cfg: DataConfig, folder: Path, source, data_dir, download, model_tokenizer, started) -> Prepared:
    (folder / "meta.json").unlink(missing_ok=True)
    remove_stale_temporaries(folder)  # .bin files of a prepare that was killed mid-write (possibly large)
    name = data_cfg.tokenizer
    if names_model(name):  # saved under the name data.tokenizer gives, so that Prepared.tokenizer reloads it
        tokenizer = copy.copy(_model_tokenizer(data_cfg, model_tokenizer))
        tokenizer.name = name
    elif needs_training(name):
        tokenizer = fit_tokenizer(name, _training_texts(source, data_cfg.max_tokens))
    else:
        tokenizer = load_tokenizer(name, data_dir=data_dir, download=download)
    tokenizer.save(folder)
    fitted_seconds = time.perf_counter() - started

    dtype = token_dtype(tokenizer.vocab_size)
    names = _expected_splits(data_cfg, source)
    writers: dict[str, _SplitWriter] = {}
    with contextlib.ExitStack() as files:  # every .bin to a temporary, renamed once all are complete (else removed)
        for s in names:
            tmp = files.enter_context(atomic_path(folder / f"{s}.bin"))
            limit = data_cfg.max_tokens if s == "train" else None
            writers[s] = _SplitWriter(files.enter_context(open(tmp, "wb")), dtype, tokenizer.eot_id, limit)
        _encode(source, tokenizer, writers)
        for split, writer in writers.items():
            if writer.tokens == 0 and writers["train"].full and not source.own_splits:
                raise DataError(
                    f"{source.name}: no document fell in the {split!r} split before data.max_tokens="
                    f"{data_cfg.max_tokens} stopped the reading ({writers['train'].documents} training documents "
                    "read); raise data.max_tokens, or use more, shorter documents (blank-line separated)"
                )
            if writer.tokens == 0:
                raise DataError(_empty_split(source, split, writers["train"].documents))
    splits = {split: writer.summary(f"{split}.bin") for split, writer in writers.items()}

    meta = {
        "format_version": FORMAT_VERSION,
        "data": dataclasses.asdict(data_cfg),
        "source": source.name,
        "split_method": "dataset" if source.own_splits else "hash",
        "source_files": [
            {"path": str(p), "bytes": p.stat().st_size, "sha256": file_sha256(p) or sha256_file(p)}
            for p in source.files
        ],
        "streamed_from": source.streamed_from,
        "tokenizer": {
            "name": tokenizer.name,
            "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id,
            "files": {name: sha256_file(folder / name) for name in tokenizer.files},
        },
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "dtype": dtype.name,
        "splits": splits,
        "seconds": {"tokenizer": round(fitted_seconds, 3), "total": round(time.perf_counter() - started, 3)},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": _versions(),
    }
    atomic_write_text(folder / "meta.json", json.dumps(meta, indent=2) + "\n")  # last: the folder is now prepared
    log.info("prepared %s in %.1f s", folder, meta["seconds"]["total"])
    return Prepared(folder, meta, verified=True)
