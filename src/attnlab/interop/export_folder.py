"""The folder `attnlab export --hf` writes: checked before the export (missing, empty, or an earlier export that
--overwrite may replace) and put in place at its end, never deleting anything an export did not write."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

from attnlab.data.files import LINK_LOOP, broken_link, temp_path_beside
from attnlab.errors import InputError

# The files export_hf writes (EXPORT_FILES): all that a folder --overwrite replaces may hold.
EXPORT_FILES = re.compile(
    r"config\.json|generation_config\.json|model\.safetensors|model-\d{5}-of-\d{5}\.safetensors"
    r"|model\.safetensors\.index\.json|tokenizer\.json|tokenizer_config\.json"
)


def check_out_dir(out_dir: Path, overwrite: bool) -> tuple[int, int] | None:
    """InputError (one line) unless out_dir can take the export: missing, empty, or with overwrite=True a folder
    holding an earlier export only (not_exported). Returns that earlier export's identity (device, inode), which
    replace_folder alone may replace; None when out_dir is missing or empty."""
    if broken_link(out_dir) == LINK_LOOP:
        raise InputError(f"{out_dir}: is {LINK_LOOP}: remove the link, or give a folder's path")
    if out_dir.is_symlink() and not out_dir.exists():
        raise InputError(f"{out_dir}: is a symbolic link to {os.readlink(out_dir)}, which does not exist (give a "
                         "folder's path, or make the folder it points to)")  # fmt: skip
    if out_dir.is_file():
        raise InputError(f"{out_dir}: is a file, where the export's folder belongs (give a folder's path)")
    if Path.cwd().resolve().is_relative_to(out_dir.resolve()):  # it cannot be renamed (EBUSY) nor replaced
        raise InputError(f"{out_dir}: is the current folder or one of its parents, which cannot be replaced "
                         f"(give a new folder's path, e.g. {out_dir / 'hf'})")  # fmt: skip
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise InputError(f"{out_dir}: not empty (give an empty or new folder, or overwrite=True / --overwrite)")
        others = not_exported(out_dir)
        if others:
            raise InputError(refused_overwrite(out_dir, others))
        return folder_identity(out_dir)
    return None


def folder_identity(folder: Path) -> tuple[int, int]:
    """(device, inode) of the folder itself (not what a link points to): what tells the folder check_out_dir looked
    at from one another command put in its place since."""
    found = os.lstat(folder)
    return found.st_dev, found.st_ino


def written_meanwhile(out_dir: Path) -> str:
    return (
        f"{out_dir}: another command wrote it while this export ran (it is left as it is; this export was not put "
        "there): give another folder, or export again (with --overwrite to replace it)"
    )


def not_exported(folder: Path) -> list[str]:
    """The names in `folder` (a trailing / for folders) that are not a file an export writes (EXPORT_FILES, as
    regular files): what --overwrite must never delete."""
    others = []
    for path in sorted(folder.iterdir()):
        if not (EXPORT_FILES.fullmatch(path.name) and path.is_file() and not path.is_symlink()):
            others.append(path.name + ("/" if path.is_dir() and not path.is_symlink() else ""))
    return others


def refused_overwrite(out_dir: Path, others: list[str]) -> str:
    listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    return (
        f"{out_dir}: holds {listed}, which an export does not write: --overwrite replaces only a folder holding "
        "an earlier export, so nothing else is deleted (give a new or empty folder, or move those out)"
    )


def replace_folder(tmp: Path, out_dir: Path, earlier: tuple[int, int] | None = None) -> None:
    """Renames the complete folder tmp to out_dir; an existing out_dir (an earlier export: check_out_dir) is moved
    aside first, and its files removed after, one by one (never anything an export does not write). earlier: the
    identity of the export check_out_dir agreed to replace (None: out_dir was missing or empty). A folder another
    command put at out_dir since (another export into the same new folder, started at the same time) is refused,
    never replaced: rename() puts a folder over a missing or empty one only, so one that appears at the last moment
    is refused too."""
    old = None
    if out_dir.is_dir() and any(out_dir.iterdir()):
        old = temp_path_beside(out_dir)
        try:
            os.replace(out_dir, old)
        except FileNotFoundError:  # moved away by another command since it was looked at
            raise InputError(written_meanwhile(out_dir)) from None
        others = [] if old.is_symlink() else not_exported(old)
        if others:  # put there since check_out_dir looked (the weights take a while to load)
            os.replace(old, out_dir)
            raise InputError(refused_overwrite(out_dir, others))
        if folder_identity(old) != earlier:  # not the export check_out_dir looked at: another command's
            os.replace(old, out_dir)
            raise InputError(written_meanwhile(out_dir))
    try:
        os.replace(tmp, out_dir)  # over a missing or empty folder
    except OSError as e:
        if old is not None:
            os.replace(old, out_dir)  # put the old folder back
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):  # a folder filled since it was looked at
            raise InputError(written_meanwhile(out_dir)) from None
        raise
    if old is None:
        return
    with contextlib.suppress(OSError):  # a leftover hidden folder at worst; the export itself is in place
        if old.is_symlink():  # a link to the earlier export: the link goes, what it points to stays
            old.unlink()
            return
        for path in old.iterdir():
            if EXPORT_FILES.fullmatch(path.name) and path.is_file() and not path.is_symlink():
                path.unlink()
        old.rmdir()
