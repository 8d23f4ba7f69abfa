"""Text sources as documents with their split: `open_source(name) -> Source`, `Source.documents()`.

Named sources: `wikitext2` (the tokenized v1 files), `wikitext2-raw`, `wikitext2-nounk`, `tinyshakespeare`,
`fineweb-edu`; any
other name is a path to a local `.txt` (documents separated by blank lines), `.jsonl` (a `text` field per
line) or `.parquet` (a `text` column) file, optionally compressed (`.xz`, `.gz`; not parquet).

Splits: WikiText keeps its own train/valid/test files. Every other source assigns each document to
train / val / test by a stable hash of its text (`split_of`), so the assignment never depends on file order,
on the machine, or on where a window happens to fall.

Files are looked up in the data directories of `attnlab.paths.data_dirs` (explicit dir, $ATTNLAB_DATA, user
cache) and downloaded into the user cache only when downloads are allowed (see `files.downloads_allowed`).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import lzma
import os
import re
import shutil
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from attnlab.config import COMPRESSIONS, DATA_SOURCES, file_kind_problem, fraction_problems
from attnlab.data.files import (
    atomic_path,
    atomic_write_text,
    base_suffix,
    downloads_allowed,
    open_text,
    temp_path_beside,
)
from attnlab.errors import ConfigError, DataError, InputError, check_flags, given
from attnlab.jsonio import loads_json
from attnlab.paths import cache_dir, data_dirs, find_data_file, first_data_file

SPLITS = ("train", "val", "test")
NAMED_SOURCES = DATA_SOURCES  # the datasets known by name (config.py checks a DataConfig against them)

# WikiText: our split name -> the file's split name, and (file extension, HF Hub config) per source.
WIKITEXT_SPLITS = {"train": "train", "val": "valid", "test": "test"}
WIKITEXT = {"wikitext2": ("tokens", "wikitext-2-v1"), "wikitext2-raw": ("raw", "wikitext-2-raw-v1")}
HF_WIKITEXT_URL = (
    "https://huggingface.co/datasets/Salesforce/wikitext/resolve/main/{config}/{split}-00000-of-00001.parquet"
)
TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
FINEWEB_EDU = ("HuggingFaceFW/fineweb-edu", "sample-10BT")

# A WikiText article title: " = Title = " (sub-sections are " = = Sub = = ").
WIKITEXT_HEADING = re.compile(r"^ = [^=].* = $")


@dataclass
class Source:
    """One dataset's documents. `documents()` yields (split, text) in a fixed order; `own_splits` is True when
    the splits are the dataset's own (WikiText's files), False when they come from `split_of`."""

    name: str
    own_splits: bool
    read: Callable[[], Iterator[tuple[str, str]]]
    files: list[Path] = field(default_factory=list)  # local files read; their sha256 goes into meta.json
    streamed_from: str | None = None  # e.g. "hf:HuggingFaceFW/fineweb-edu/sample-10BT"

    def documents(self) -> Iterator[tuple[str, str]]:
        return self.read()


# ----------------------------------------------------------------------------- splits by hash


def hash_unit(text: str) -> float:
    """A number in [0, 1) fixed by the text alone: the first 8 bytes of its UTF-8 sha256."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64


def split_of(text: str, val_fraction: float, test_fraction: float) -> str:
    """'val' for a `val_fraction` share of documents, 'test' for the next `test_fraction`, else 'train'.

    Identical documents always land in the same split, so no validation text can be trained on.
    """
    unit = hash_unit(text)
    if unit < val_fraction:
        return "val"
    if unit < val_fraction + test_fraction:
        return "test"
    return "train"


def _hash_split(texts: Callable[[], Iterable[str]], val_fraction: float, test_fraction: float):
    def read() -> Iterator[tuple[str, str]]:
        for text in texts():
            yield split_of(text, val_fraction, test_fraction), text

    return read


# ----------------------------------------------------------------------------- document readers


def split_wikitext(text: str) -> list[str]:
    """WikiText articles: a document starts at each ` = Title = ` line that sits between two blank lines
    (600 / 60 / 60 articles in WikiText-2 train / valid / test, the published counts; a bare ` = X = ` line
    inside a table or formula is not a title). Lines before the first title join the first article, so the
    documents concatenate back to `text` exactly."""
    lines = text.split("\n")
    starts = [
        i
        for i in range(1, len(lines) - 1)
        if WIKITEXT_HEADING.match(lines[i]) and not lines[i - 1].strip() and not lines[i + 1].strip()
    ]
    if lines and WIKITEXT_HEADING.match(lines[0]):
        starts.insert(0, 0)
    bounds = [0, *starts[1:], len(lines)]
    docs = ["\n".join(lines[a:b]) + ("\n" if b < len(lines) else "") for a, b in zip(bounds, bounds[1:], strict=False)]
    return [doc for doc in docs if doc.strip()]


def paragraphs(lines: Iterable[str]) -> Iterator[str]:
    """Documents of a plain-text file: runs of non-blank lines (each keeps its line ends); blank lines separate."""
    doc: list[str] = []
    for line in lines:
        if line.strip():
            doc.append(line if line.endswith("\n") else line + "\n")
        elif doc:
            yield "".join(doc)
            doc = []
    if doc:
        yield "".join(doc)


def jsonl_texts(path: Path) -> Iterator[str]:
    """The `text` field of every line of a JSON-lines file (blank lines and empty texts are skipped)."""
    with open_text(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = loads_json(line).get("text")
            except (json.JSONDecodeError, AttributeError) as e:
                raise DataError(f"{path}:{number}: not a JSON object ({e})") from None
            if not isinstance(text, str):
                raise DataError(f"{path}:{number}: no 'text' string field (each line needs {{\"text\": ...}})")
            if text.strip():
                yield text


def parquet_texts(path: Path) -> Iterator[str]:
    """The `text` column of a parquet file, read in batches (needs pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet files needs pyarrow (pip install pyarrow)") from None
    import pyarrow as pa

    parquet = pq.ParquetFile(path)
    if "text" not in parquet.schema_arrow.names:
        raise DataError(f"{path}: no 'text' column (columns: {', '.join(parquet.schema_arrow.names)})")
    kind = parquet.schema_arrow.field("text").type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
        raise DataError(f"{path}: column 'text' holds {kind}, not strings (the documents must be a column of text)")
    rows = 0
    for batch in parquet.iter_batches(columns=["text"], batch_size=1024):
        column = batch.column(0)
        if column.null_count:  # (a .jsonl {"text": null} is refused too: no silent loss of documents)
            first = rows + column.is_null().to_pylist().index(True)
            nulls = sum(b.column(0).null_count for b in parquet.iter_batches(columns=["text"]))
            raise DataError(f"{path}: row {first} of column 'text' is null ({nulls} of {parquet.metadata.num_rows} "
                            "rows): give every row a text (an empty string for none), or drop those rows")  # fmt: skip
        rows += len(column)
        yield from (text for text in column.to_pylist() if text and text.strip())


def file_texts(path: Path) -> Iterator[str]:
    """Documents of one local file, by its kind (.txt / .jsonl / .parquet, optionally .xz or .gz). A file that
    cannot be read as its name says (not UTF-8, a damaged archive or parquet file) is a DataError naming it."""
    kind = base_suffix(path)
    try:
        if kind == ".jsonl":
            yield from jsonl_texts(path)
        elif kind == ".parquet":
            yield from parquet_texts(path)
        else:
            with open_text(path) as f:
                yield from paragraphs(f)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                        "save it as UTF-8") from None  # fmt: skip
    except (EOFError, lzma.LZMAError, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: a damaged or cut-short {path.suffix} archive ({e}); replace the file") from None
    except DataError:
        raise
    except Exception as e:  # pyarrow's ArrowInvalid and friends, and its OSError for a damaged page: not readable
        arrow = type(e).__module__.split(".")[0] == "pyarrow" or (isinstance(e, OSError) and e.errno is None)
        if kind != ".parquet" or not arrow:
            raise
        raise DataError(f"{path}: not a readable parquet file ({' '.join(str(e).split())}); replace the file") from None


def whole_text(path: Path) -> str:
    """A text file's whole text (.xz / .gz decompressed); DataError naming it when it is not UTF-8 or a damaged
    archive, as file_texts says."""
    try:
        with open_text(path) as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                        "save it as UTF-8") from None  # fmt: skip
    except (EOFError, lzma.LZMAError, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: a damaged or cut-short {path.suffix} archive ({e}); replace the file") from None


# ----------------------------------------------------------------------------- lookup and downloads


def _how_to_provide(what: str) -> str:
    return f"put {what} in one of those folders, pass --data-dir DIR, or set ATTNLAB_DATA"


def _download(url: str, dest: Path, by_hand: Path | None = None) -> None:
    """Fetches `url` into `dest` atomically (used only when downloads are allowed; never in tests). by_hand: the
    file a user would put in place instead (default `dest`), named when the download fails."""
    try:
        with atomic_path(dest) as tmp, urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as out:
            shutil.copyfileobj(response, out)
    except OSError as e:
        reason = getattr(e, "reason", None) or e
        raise DataError(f"download of {url} failed ({reason}); put the file at {by_hand or dest} by hand") from None


def _download_wikitext(config: str, extension: str, splits: list[str], folder: Path) -> None:
    """WikiText files from the HF Hub parquet copies (one row per line, "" for a blank line " ")."""
    for split in splits:
        file_split = WIKITEXT_SPLITS[split]
        hf_split = "validation" if split == "val" else split
        parquet = temp_path_beside(folder / f"{file_split}.parquet")
        try:
            final = folder / f"wiki.{file_split}.{extension}"
            _download(HF_WIKITEXT_URL.format(config=config, split=hf_split), parquet, by_hand=final)
            lines = [text or " " for text in parquet_texts_raw(parquet)]
            rows = [line if line.endswith("\n") else line + "\n" for line in lines]
        finally:
            parquet.unlink(missing_ok=True)
        atomic_write_text(folder / f"wiki.{file_split}.{extension}", "".join(rows))


def parquet_texts_raw(path: Path) -> Iterator[str]:
    """Every row of the `text` column, empty ones included (WikiText's blank lines)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("downloading WikiText from the HF Hub needs pyarrow (pip install pyarrow)") from None
    yield from pq.read_table(path, columns=["text"]).column(0).to_pylist()


def _wikitext_files(extension: str, dirs: list[Path]) -> dict[str, Path]:
    """split -> the first of the folders `dirs` that holds its WikiText file (plain, .xz or .txt)."""
    found = {}
    for split, file_split in WIKITEXT_SPLITS.items():
        names = [f"wiki.{file_split}.{extension}{suffix}" for suffix in ("", ".xz", ".txt")]
        names += [f"{file_split}.txt"] if extension == "tokens" else []  # pytorch/examples' names
        for folder in dirs:  # (a dangling link, a folder, a FIFO at a file's name, a file at the folder's: named)
            relative = [f"{folder.name}/{n}" for n in names]
            hit = next((path for r in relative if (path := first_data_file(r, [folder.parent])) is not None), None)
            if hit is not None:
                found[split] = hit
                break
    return found


def _wikitext(name: str, data_dir: str | Path | None, download: bool | None, splits=None) -> Source:
    extension, config = WIKITEXT[name]
    dirs = [d / "wikitext-2" for d in data_dirs(data_dir)]

    def find() -> dict[str, Path]:
        return _wikitext_files(extension, dirs)

    wanted = [s for s in WIKITEXT_SPLITS if splits is None or s in splits]
    found = {split: path for split, path in find().items() if split in wanted}
    missing = [s for s in wanted if s not in found]
    if missing and downloads_allowed(download):
        _download_wikitext(config, extension, missing, cache_dir() / "wikitext-2")
        found = {split: path for split, path in find().items() if split in wanted}
        missing = [s for s in wanted if s not in found]
    if missing:
        names = ", ".join(f"wiki.{WIKITEXT_SPLITS[s]}.{extension}" for s in missing)
        have = "".join(f"; found {p}" for p in found.values())
        raise DataError(
            f"{name}: {names} not found (looked for them, plain or .xz, in: {', '.join(map(str, dirs))}{have}); "
            f"{_how_to_provide('the files')}, or allow downloads (HF Hub Salesforce/wikitext, {config})"
        )

    def read() -> Iterator[tuple[str, str]]:
        for split, path in found.items():
            yield from ((split, doc) for doc in split_wikitext(whole_text(path)))

    return Source(name=name, own_splits=True, read=read, files=list(found.values()))


def _tinyshakespeare(data_dir, download, val_fraction, test_fraction) -> Source:
    path = first_data_file("tinyshakespeare/input.txt", data_dirs(data_dir))  # (a FIFO, a dangling link: refused)
    if path is None:
        try:
            find_data_file("tinyshakespeare/input.txt", data_dir)
        except DataError as e:
            if not downloads_allowed(download):
                raise DataError(f"tinyshakespeare: {e}; or allow downloads ({TINYSHAKESPEARE_URL})") from None
        path = cache_dir() / "tinyshakespeare" / "input.txt"
        _download(TINYSHAKESPEARE_URL, path)
    read = _hash_split(lambda: file_texts(path), val_fraction, test_fraction)
    return Source(name="tinyshakespeare", own_splits=False, read=read, files=[path])


def _fineweb_edu(data_dir, download, val_fraction, test_fraction, max_tokens, whole_split: bool = False) -> Source:
    dirs = [d / "fineweb-edu" for d in data_dirs(data_dir)]
    for folder in dirs:
        files = sorted(p for p in folder.glob("*") if p.is_file() and base_suffix(p) in (".parquet", ".jsonl"))
        if files:

            def texts(files: list[Path] = files) -> Iterator[str]:
                for path in files:
                    yield from file_texts(path)

            read = _hash_split(texts, val_fraction, test_fraction)
            return Source(name="fineweb-edu", own_splits=False, read=read, files=files)
    where = f"looked for *.parquet / *.jsonl in: {', '.join(map(str, dirs))}"
    if max_tokens is None and whole_split:  # an evaluation reads a whole split: a stream without end has no limit
        raise DataError(f"fineweb-edu: no local files ({where}) and its stream from the HF Hub has no end, while this "
                        "command reads a whole split and has no option to limit it: put *.parquet / *.jsonl files "
                        "of it in one of those folders (or give --data-dir), or use another dataset")  # fmt: skip
    if not downloads_allowed(download):
        raise DataError(f"fineweb-edu: no local files ({where}); {_how_to_provide('the files')}, or allow downloads")
    try:
        import datasets
    except ImportError:
        raise DataError(f"fineweb-edu: no local files ({where}); streaming it needs `pip install datasets`") from None
    if max_tokens is None:
        raise DataError("fineweb-edu is streamed from the HF Hub: set data.max_tokens (e.g. 100000000)")

    def stream() -> Iterator[str]:
        try:
            rows = datasets.load_dataset(FINEWEB_EDU[0], name=FINEWEB_EDU[1], split="train", streaming=True)
            yield from (row["text"] for row in rows if row["text"].strip())
        except (ConnectionError, OSError) as e:  # offline, or the Hub out of reach (datasets raises these)
            reason = " ".join(str(e).split())[:200]
            raise DataError(f"fineweb-edu: streaming from the Hub failed ({reason}); no local files ({where}); "
                            f"{_how_to_provide('*.parquet or *.jsonl files')}") from None  # fmt: skip

    read = _hash_split(stream, val_fraction, test_fraction)
    return Source(name="fineweb-edu", own_splits=False, read=read, streamed_from="hf:" + "/".join(FINEWEB_EDU))


def local_path(source: str, data_dir: str | Path | None = None) -> Path:
    """The file a non-named source refers to: the path itself, else relative to a data directory."""
    path = Path(source).expanduser()
    if not path.exists() and not path.is_absolute():
        try:
            path = find_data_file(source, data_dir)
        except DataError as e:
            raise DataError(
                f"source {source!r} is not a known dataset ({', '.join(NAMED_SOURCES)}) nor an existing file: {e}"
            ) from None
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "is not a regular file" if path.exists() else "not found"
        raise DataError(
            f"source {str(path)!r} {what} (use a known dataset: "
            f"{', '.join(NAMED_SOURCES)}, or a .txt / .jsonl / .parquet file)"
        )
    problem = file_kind_problem(path.name)
    if problem:
        kind = "".join(path.suffixes[-2:]) if path.suffix in COMPRESSIONS else path.suffix
        raise DataError(f"{path}: unknown file kind {kind!r}: {problem}")
    return path.resolve()


def source_key(source: str, data_dir: str | Path | None = None) -> str:
    """What identifies a source's content for the preparation cache: a local file by its path, size and modification
    time (an edited file is prepared anew); a named dataset by its name here (data.prepared.cache_key keys it by
    data.source_identity.named_source_key: the files found too, unless they are the dataset's own)."""
    if source in NAMED_SOURCES:
        return source
    path = local_path(source, data_dir)
    stat = path.stat()
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


def local_files(source: str, data_dir: str | Path | None = None) -> dict[str, Path]:
    """The local files the named dataset `source` would be read from now, by their role (tinyshakespeare's
    `input.txt`, WikiText's splits, fineweb-edu's file names), found as open_source finds them, without reading or
    downloading anything: empty when it would download (or stream) them, partial when it would download some."""
    dirs = data_dirs(data_dir)
    if source == "tinyshakespeare":
        found = first_data_file("tinyshakespeare/input.txt", dirs)
        return {"input.txt": found} if found is not None else {}
    if source == "fineweb-edu":
        for folder in (d / "fineweb-edu" for d in dirs):
            files = sorted(p for p in folder.glob("*") if p.is_file() and base_suffix(p) in (".parquet", ".jsonl"))
            if files:
                return {p.name: p for p in files}
        return {}
    extension = WIKITEXT["wikitext2" if source == "wikitext2-nounk" else source][0]
    return _wikitext_files(extension, [d / "wikitext-2" for d in dirs])


UNK = re.compile(r"<unk> ?")


def _without_unk(source: Source) -> Source:
    """wikitext2-nounk: the v1 files with every `<unk>` (and the space after it) removed. The raw version keeps v1's
    spacing (" , ", " @-@ ") and differs from it only where v1 has <unk>, so this is the raw text's form minus the
    rare words; raw train is not in the data directory (only raw test is), and a literal "<unk>" would teach a
    pretrained model a string the raw test split never contains."""

    def read() -> Iterator[tuple[str, str]]:
        for split, text in source.documents():
            yield split, UNK.sub("", text)

    return Source("wikitext2-nounk", True, read, source.files, source.streamed_from)


def open_source(
    source: str,
    data_dir: str | Path | None = None,
    *,
    val_fraction: float = 0.05,
    test_fraction: float = 0.0,
    max_tokens: int | None = None,
    download: bool | None = None,
    splits: tuple[str, ...] | None = None,
) -> Source:
    """The named dataset or local file `source`; DataError (where it looked, how to provide it) when missing.

    The fractions apply to sources without their own splits; `max_tokens` only matters for streaming. splits:
    the only splits needed (a dataset with its own split files then needs only those; default all): an
    evaluation's read of one whole split, which a stream without end (fineweb-edu without max_tokens) cannot give.
    ConfigError for fractions a DataConfig refuses (each in [0, 1), their sum < 1).
    """
    if not isinstance(source, str | os.PathLike):
        raise InputError(f"source must be a dataset name ({', '.join(NAMED_SOURCES)}) or a file's path, got "
                         f"{given(source)}")  # fmt: skip
    if data_dir is not None and not isinstance(data_dir, str | os.PathLike):
        raise InputError(f"data_dir must be the path of a folder of data files (or None), got {given(data_dir)}")
    if download is not None:
        check_flags(download=download)  # (None: as the environment allows)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise InputError(f"max_tokens={max_tokens!r} must be a whole number >= 1, or None (no cap)")
    if splits is not None and (isinstance(splits, str) or not all(split in SPLITS for split in splits)):
        raise InputError(f"splits={splits!r} must be a tuple of split names ({', '.join(SPLITS)}), or None (all)")
    problems = fraction_problems(val_fraction, test_fraction)
    if problems:
        raise ConfigError(problems)
    if source in WIKITEXT:
        return _wikitext(source, data_dir, download, splits)
    if source == "wikitext2-nounk":
        return _without_unk(_wikitext("wikitext2", data_dir, download, splits))
    if source == "tinyshakespeare":
        return _tinyshakespeare(data_dir, download, val_fraction, test_fraction)
    if source == "fineweb-edu":
        return _fineweb_edu(data_dir, download, val_fraction, test_fraction, max_tokens, whole_split=splits is not None)
    path = local_path(source, data_dir)
    read = _hash_split(lambda: file_texts(path), val_fraction, test_fraction)
    return Source(name=str(path), own_splits=False, read=read, files=[path])


def download_plan(source: str, data_dir: str | Path | None = None, max_tokens: int | None = None) -> str | None:
    """What opening the named dataset `source` would download, where downloads are allowed, without downloading
    anything (`attnlab run --dry-run` says it): None when its files are all in the data directories, else one line
    ("<source>: <files> not in <folders>: the run would download them from <where> into <folder>"). DataError when that
    download could not happen: a module it needs is not installed, fineweb-edu without data.max_tokens."""
    dirs = data_dirs(data_dir)
    if source == "tinyshakespeare":
        if any((d / "tinyshakespeare" / "input.txt").exists() for d in dirs):
            return None
        looked = ", ".join(str(d / "tinyshakespeare") for d in dirs)
        return (f"tinyshakespeare: input.txt not in {looked}: the run would download it from {TINYSHAKESPEARE_URL} "
                f"into {cache_dir() / 'tinyshakespeare'}")  # fmt: skip
    if source == "fineweb-edu":
        folders = [d / "fineweb-edu" for d in dirs]
        if any(p.is_file() and base_suffix(p) in (".parquet", ".jsonl") for f in folders for p in f.glob("*")):
            return None
        looked = ", ".join(map(str, folders))
        if importlib.util.find_spec("datasets") is None:
            raise DataError(f"fineweb-edu: no local files (looked for *.parquet / *.jsonl in: {looked}) and streaming "
                            "it from the HF Hub needs `pip install datasets`; "
                            f"{_how_to_provide('the files')}")  # fmt: skip
        if max_tokens is None:
            raise DataError(f"fineweb-edu: no local files (looked in: {looked}): it would be streamed from the HF Hub, "
                            "which needs data.max_tokens (set e.g. data.max_tokens: 100000000, or put *.parquet / "
                            "*.jsonl files in one of those folders)")  # fmt: skip
        return (f"fineweb-edu: no local files in {looked}: the run would stream data.max_tokens={max_tokens:,} tokens "
                f"from the HF Hub ({'/'.join(FINEWEB_EDU)})")  # fmt: skip
    extension, config = WIKITEXT["wikitext2" if source == "wikitext2-nounk" else source]
    folders = [d / "wikitext-2" for d in dirs]
    missing = [s for s in WIKITEXT_SPLITS if s not in _wikitext_files(extension, folders)]
    if not missing:
        return None
    names = ", ".join(f"wiki.{WIKITEXT_SPLITS[s]}.{extension}" for s in missing)
    looked = ", ".join(map(str, folders))
    if importlib.util.find_spec("pyarrow") is None:
        raise DataError(f"{source}: {names} not found (looked in: {looked}) and downloading them from the HF Hub "
                        f"needs pyarrow (pip install pyarrow); {_how_to_provide('the files')}")  # fmt: skip
    return (f"{source}: {names} not in {looked}: the run would download them from the HF Hub (Salesforce/wikitext, "
            f"{config}) into {cache_dir() / 'wikitext-2'}")  # fmt: skip
