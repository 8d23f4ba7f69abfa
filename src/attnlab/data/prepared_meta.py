"""What a prepared folder's meta.json must hold (attnlab.data.prepared writes it last and checks it on every reuse),
and the token dtype its vocabulary size gives."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from attnlab.config import names_model
from attnlab.data.sources import NAMED_SOURCES, SPLITS, WIKITEXT
from attnlab.errors import DataError

FORMAT_VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id (< vocab_size) fits in 16 bits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _redo(path: Path) -> str:
    return f"delete {path} to prepare it again"


def _check_meta(path: Path, meta) -> None:
    """DataError naming meta.json and the key, unless meta.json has every key a Prepared reads, well typed."""
    where, redo = path / "meta.json", _redo(path)

    def fail(key: str, problem: str) -> DataError:
        return DataError(f"{where}: {key} {problem}; {redo}")

    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not isinstance(meta, dict):
        raise DataError(f"{where}: not a JSON object; {redo}")
    if "format_version" not in meta:
        raise fail("key 'format_version'", "is missing")
    if meta["format_version"] != FORMAT_VERSION:
        raise DataError(f"{path}: format version {meta['format_version']}, this attnlab reads {FORMAT_VERSION}; {redo}")
    for key in ("vocab_size", "eot_id", "dtype", "tokenizer", "splits"):
        if key not in meta:
            raise fail(f"key {key!r}", "is missing")
    vocab_size, eot_id, dtype = meta["vocab_size"], meta["eot_id"], meta["dtype"]
    if not whole(vocab_size) or vocab_size < 1:
        raise fail("'vocab_size'", f"is {vocab_size!r} (expected a whole number >= 1)")
    if not whole(eot_id) or not 0 <= eot_id < vocab_size:
        raise fail("'eot_id'", f"is {eot_id!r} (expected a token id below vocab_size={vocab_size})")
    if dtype not in ("uint16", "uint32") or np.dtype(dtype).itemsize < token_dtype(vocab_size).itemsize:
        raise fail("'dtype'", f"is {dtype!r} (expected {token_dtype(vocab_size).name} for vocab_size={vocab_size})")
    tokenizer = meta["tokenizer"]
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("name"), str):
        raise fail("'tokenizer'", f"is {tokenizer!r} (expected an object with a 'name')")
    files = tokenizer.get("files", {})  # (absent in a folder prepared before they were recorded)
    if not isinstance(files, dict):
        raise fail("'tokenizer.files'", f"is {files!r} (expected an object: file name -> sha256)")
    for name, sha256 in files.items():
        if Path(name).name != name or name in ("", ".", ".."):
            raise fail(f"'tokenizer.files.{name}'", "is not a file name in the folder")
        if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise fail(f"'tokenizer.files.{name}'", f"is {sha256!r} (expected 64 lower-case hex digits)")
    splits = meta["splits"]
    if not isinstance(splits, dict) or not splits:
        raise fail("'splits'", f"is {splits!r} (expected an object: split name -> file, tokens, sha256)")
    for split, entry in splits.items():
        key = f"'splits.{split}'"
        if split not in SPLITS:
            raise fail(key, f"is not a split (expected {', '.join(SPLITS)})")
        if not isinstance(entry, dict):
            raise fail(key, f"is {entry!r} (expected an object with file, tokens, sha256)")
        for field in ("file", "tokens", "sha256"):
            if field not in entry:
                raise fail(f"key 'splits.{split}.{field}'", "is missing")
        file, tokens, sha256 = entry["file"], entry["tokens"], entry["sha256"]
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise fail(f"'splits.{split}.file'", f"is {file!r} (expected a file name in the folder)")
        if not whole(tokens) or tokens < 0:
            raise fail(f"'splits.{split}.tokens'", f"is {tokens!r} (expected a whole number >= 0)")
        if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise fail(f"'splits.{split}.sha256'", f"is {sha256!r} (expected 64 lower-case hex digits)")


def data_record_problem(path: Path, meta: dict, data_cfg) -> str | None:
    """Why meta.json's `data` record (the DataConfig the folder was prepared with) is not that of `data_cfg`, whose
    cache key named the folder, or None: a record changed by hand (the folder's token files were made as its name
    says, so the record cannot be trusted). Compared on what the key holds and a record says alike: a local
    source's path may be spelled otherwise, a model's tokenizer reached by another name, and a dataset with its own
    splits has no split fractions. A folder without the record (prepared before it) is not compared, nor a key it
    lacks."""
    record, where, redo = meta.get("data"), path / "meta.json", _redo(path)
    if record is None:
        return None
    if not isinstance(record, dict):
        return f"{where}: 'data' is {record!r} (expected an object: the data config it was prepared with); {redo}"
    keys = ["max_tokens"]
    keys += [] if data_cfg.source in WIKITEXT else ["val_fraction", "test_fraction"]
    keys += [] if names_model(data_cfg.tokenizer) else ["tokenizer"]
    keys += ["source"] if data_cfg.source in NAMED_SOURCES or record.get("source") in NAMED_SOURCES else []
    for key in keys:
        if key in record and record[key] != getattr(data_cfg, key):  # (a key not recorded is not said otherwise)
            return (f"{where}: 'data.{key}' is {record.get(key)!r}, but the folder is named for data.{key}="
                    f"{getattr(data_cfg, key)!r} (its record was changed by hand: it no longer says how its token "
                    f"files were made); {redo}")  # fmt: skip
    return None
