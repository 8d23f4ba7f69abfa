"""The record `compare` and `report` keep of what they wrote: the last line of their Markdown (compare.md,
report.md), an HTML comment (not shown), holds the sha256 of the text above it and of every other file written with
it. A later run of the command refuses, before it writes anything, to replace one of its own files changed since (a
note added to report.md, a table edited): the change would be lost."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from attnlab.data.files import sha256_file

_SUM = re.compile(r"[0-9a-f]{64}")


def _marker(command: str) -> bytes:
    return f"<!-- attnlab {command} sha256: ".encode()


def record_line(command: str, markdown_name: str, markdown: str, written: dict[str, str]) -> str:
    """The line ending `markdown_name`: the sha256 of `markdown` (the text above the line) and of the files
    `written` ({name relative to the folder: sha256}). Names hold no spaces."""
    sums = [(markdown_name, hashlib.sha256(markdown.encode("utf-8")).hexdigest()), *written.items()]
    return _marker(command).decode() + " ".join(f"{name} {digest}" for name, digest in sums) + " -->\n"


def _recorded(data: bytes, command: str, markdown_name: str) -> dict[str, str] | None:
    """{name: sha256} of the record ending `data` when the text above it is as the command wrote it; {} when `data`
    holds no record (nothing is known); None when it was changed since (text added, the record damaged)."""
    marker = _marker(command)
    if marker not in data:
        return {}
    start = data.rfind(b"\n", 0, len(data) - 1) + 1  # the last line
    line = data[start:]
    if not (line.startswith(marker) and line.endswith(b" -->\n")):
        return None
    words = line[len(marker) : -len(b" -->\n")].decode("utf-8", errors="replace").split(" ")
    if len(words) % 2 or words[0] != markdown_name or not all(_SUM.fullmatch(d) for d in words[1::2]):
        return None
    sums = dict(zip(words[::2], words[1::2], strict=True))
    if hashlib.sha256(data[:start]).hexdigest() != sums.pop(markdown_name):
        return None
    return sums


def changed_output(
    folder: Path,
    command: str,
    markdown_name: str,
    names,
    new_markdown: str | None,
    fix: str = "move it away, or give another --out",
    kept: bytes | None = None,
) -> str | None:
    """The one line saying which of the command's own files in `folder` changed since it wrote them (None when
    none did): `markdown_name` by its record's sum of its text, each of `names` (the files it writes now, relative to
    `folder`) by the record's sum of it. A `markdown_name` with no record (the user removed the line, or an attnlab
    from before the record wrote it) is replaced only when it is `new_markdown` byte for byte (nothing would be lost);
    `new_markdown` None (not known yet) accepts it: the command, which knows it, decides; so does `kept`, byte for byte
    (what `attnlab run` accepted before it trained, compare's own text then). `fix` ends the line."""
    path = folder / markdown_name
    if not path.is_file():
        return None
    data = path.read_bytes()
    sums = _recorded(data, command, markdown_name)
    if sums is None:
        return (f"{path}: changed since attnlab {command} wrote it (it would be replaced, and the change lost): "
                f"{fix}")  # fmt: skip
    if not sums:
        if new_markdown is None or data == new_markdown.encode("utf-8") or data == kept:
            return None
        return (f"{path}: holds no record of what attnlab {command} wrote (its last line, removed, or an older "
                f"attnlab's) and differs from what it would write now (it would be replaced, and any change lost): "
                f"{fix}")  # fmt: skip
    for name in names:
        file = folder / name
        if name in sums and file.is_file() and sha256_file(file) != sums[name]:
            return (f"{file}: changed since attnlab {command} wrote it (it would be replaced, and the change lost): "
                    f"{fix}")  # fmt: skip
    return None
