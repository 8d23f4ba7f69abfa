"""Which files a named dataset's prepared folder was made from: the dataset's own, or others found in their place.

A named dataset (tinyshakespeare, WikiText) is prepared once per tokenizer and settings, in a folder keyed by its name
alone (data.prepared.cache_key) when the local files found are the dataset's own: each file's sha256 is one of
CANONICAL's for the role it plays (the files as distributed, compressed or not). Any other file found in their place
(a shortened copy, an edited, empty or binary file) keys the folder by the name and the sha256 of every file found,
so that it is prepared anew from that file by the run's readers (which refuse a file that is not UTF-8, or holds no
document, naming it), and its checkpoints record the file they were trained on. Files to be downloaded (none found)
are the dataset's own: keyed by the name. fineweb-edu's local files (a sample of any size, possibly many GB) are keyed
by their paths, sizes and modification times, as a local file source is.

Hashing the ~12 MB of WikiText costs a few tens of ms; each file is hashed once per process while it is unchanged.
"""

from __future__ import annotations

import stat
from collections import Counter
from pathlib import Path

from attnlab.data.files import sha256_file
from attnlab.data.sources import local_files

_TINYSHAKESPEARE = {"input.txt": {"plain": "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"}}
_WIKITEXT_V1 = {  # wiki.{train,valid,test}.tokens of wikitext-2-v1, as .xz and plain (pytorch/examples' train.txt, ...)
    "train": {"xz": "706ddeb595fdf90aa45292dcb3a3a74a2e330738c662b71cf15fd3f27694e392",
              "plain": "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f"},
    "val": {"xz": "b9a9e7d0f07d32a6a40f2e2b2473855568a3ab8aae7243af52a4ce356c59aaf5",
            "plain": "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8"},
    "test": {"xz": "5b89d8701c38fd05d96e78076c92cf45bca38ad7f9a8938d57ea9fc24f409416",
             "plain": "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0"},
}  # fmt: skip
_WIKITEXT_RAW = {  # wiki.test.raw of wikitext-2-raw-v1 (its train and valid files are not known here: keyed by sum)
    "test": {"xz": "69c515361535b1598c00165affb049f6d35be5f1a9fc54ad8a0cbdf3c80ba1ad",
             "plain": "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08"},
}  # fmt: skip
# source -> role (local_files' key) -> form ("xz", "plain") -> the sha256 of that file as the dataset distributes it
CANONICAL = {"tinyshakespeare": _TINYSHAKESPEARE, "wikitext2": _WIKITEXT_V1, "wikitext2-nounk": _WIKITEXT_V1,
             "wikitext2-raw": _WIKITEXT_RAW}  # fmt: skip

_digests: dict[tuple, str] = {}


def file_sha256(path: Path) -> str | None:
    """The sha256 of a file's stored bytes, hashed once per process while the file is unchanged (same size, times
    and inode); None for what is not a readable regular file (the run's reader names it)."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            return None
        key = (str(path.resolve()), info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev)
        if key not in _digests:
            _digests[key] = sha256_file(path)
    except OSError:
        return None
    return _digests[key]


def identity(source: str, sha256: str | None, role: str | None = None, path: Path | None = None) -> str | None:
    """What a file of `source` holds, for comparing records: `<source>:<role>` for a file of the dataset as
    distributed (of the role given, when given; in the form its name `path` implies, when given: the .xz sum for a
    `.xz` name, which the run decompresses, the plain sum for another, which it reads as it is, so that the plain
    text under a `.xz` name is read, and refused, as the run reads it), else its sha256."""
    form = None if path is None else "xz" if Path(path).suffix == ".xz" else "plain"
    for known, sums in CANONICAL.get(source, {}).items():
        if sha256 in (sums.values() if form is None else [sums.get(form)]) and role in (None, known):
            return f"{source}:{known}"
    return sha256


def named_source_key(source: str, data_dir: str | Path | None = None) -> str:
    """What identifies the named dataset `source`'s data for the preparation cache: its name when the files found
    are the dataset's own (or none is found: they would be downloaded), else the name and each file found (its
    sha256; fineweb-edu's by path, size and modification time)."""
    found = local_files(source, data_dir)
    if source == "fineweb-edu":
        parts = [f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}" for path in found.values()]
    else:
        sums = {role: file_sha256(path) for role, path in found.items()}
        if all(identity(source, sha, role, found[role]) != sha for role, sha in sums.items()):
            return source
        parts = [f"{role}={sha or f'{path.resolve()} (not a readable file)'}" for (role, path), sha in
                 zip(found.items(), sums.values(), strict=True)]  # fmt: skip
    return f"{source}:{','.join(sorted(parts))}" if parts else source


def recorded_identities(source: str, recorded) -> list[str]:
    """The identities of the files a meta.json's source_files list (or a checkpoint's {path: sha256}) records."""
    if isinstance(recorded, dict):
        return [identity(source, sha) for sha in recorded.values() if isinstance(sha, str)]
    entries = [e for e in recorded if isinstance(e, dict)] if isinstance(recorded, list) else []
    return [identity(source, e["sha256"]) for e in entries if isinstance(e.get("sha256"), str)]


def prepared_source_problem(folder: Path, meta: dict, source: str, data_dir: str | Path | None = None) -> str | None:
    """The line refusing the prepared folder of the named dataset `source` whose meta.json records other source files
    than those the run would read now (by sha256; the dataset's own files by the role they play, so a data folder
    moved, or decompressed, is the same data): one prepared by an older attnlab from another file in their place, or
    a record edited. None when they agree, for fineweb-edu (keyed by its files' paths, sizes and times), and when no
    file is found (the run would download the dataset's own) or none is recorded."""
    if source not in CANONICAL:
        return None
    then = recorded_identities(source, meta.get("source_files"))
    if not then:
        return None
    left = Counter(then)
    for role, path in local_files(source, data_dir).items():
        sha = file_sha256(path)
        now = identity(source, sha, role, path)
        if left[now] > 0:
            left[now] -= 1
            continue
        said = ", ".join(f"{Path(e['path']).name} sha256 {str(e['sha256'])[:12]}..." for e in meta["source_files"]
                         if isinstance(e, dict) and "path" in e and "sha256" in e)  # fmt: skip
        return (f"{folder / 'meta.json'}: source_files records {said}, but the run reads {path} (sha256 "
                f"{str(sha)[:12]}...): the folder was prepared from other files than those found now (by an older "
                f"attnlab, or its record was edited); delete {folder} to prepare it again")  # fmt: skip
    return None
