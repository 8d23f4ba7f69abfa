"""The task files of `lm-eval --include-path` folders, checked before lm-eval reads them: each parses, is UTF-8,
gives each key once, uses only TaskConfig's keys, and no two declare one task."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

import yaml

from attnlab.config_io import StrictLoader
from attnlab.errors import ConfigError


def lm_eval_missing(error: ImportError) -> ConfigError:
    """The line for an import of lm-eval (an optional extra: the core never imports these modules) that failed."""
    return ConfigError(
        f"lm-evaluation-harness is not installed ({error}): pip install 'attnlab[lmeval]' (lm-eval==0.4.13)"
    )


try:
    from lm_eval.api.task import TaskConfig
    from lm_eval.tasks._yaml_loader import load_yaml
except ImportError as e:
    raise lm_eval_missing(e) from None


class _TaskFileLoader(yaml.SafeLoader):
    """Reads a task YAML without running anything: every tag (`!function module.name`) is read as plain data
    and recorded in `tags`."""

    def __init__(self, stream):
        super().__init__(stream)
        self.tags: list[str] = []


def _any_tag(loader: _TaskFileLoader, suffix: str, node):
    loader.tags.append("!" + suffix)
    if isinstance(node, yaml.ScalarNode):
        return loader.construct_scalar(node)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    return loader.construct_mapping(node)


class _StrictTaskFileLoader(StrictLoader):
    """_TaskFileLoader that also refuses a key given twice in one mapping (config_io.StrictLoader)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.tags: list[str] = []


for _loader in (_TaskFileLoader, _StrictTaskFileLoader):
    _loader.add_multi_constructor("!", _any_tag)
# lm-eval reads its task files as YAML 1.1 (PyYAML): there `yes` is true, as it is to lm-eval
_StrictTaskFileLoader.add_constructor("tag:yaml.org,2002:bool", yaml.SafeLoader.construct_yaml_bool)


def _read_task_file(path: Path, strict: bool = False) -> tuple[Any, list[str]]:
    """(the YAML data, its tags) of a task file, read without running anything; yaml.YAMLError if it is not YAML
    (strict: or if it gives a key twice)."""
    loader = (_StrictTaskFileLoader if strict else _TaskFileLoader)(path.read_text(encoding="utf-8", errors="replace"))
    try:
        return loader.get_single_data(), loader.tags
    finally:
        loader.dispose()


def _not_utf8(path: Path) -> str | None:
    """What is wrong with a task file that is not UTF-8 text (lm-eval reads only that, and skips the file), or None:
    its first such byte and the offset of it, which _read_task_file would read as a replacement character."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}): save it as UTF-8"
    return None


def check_keys_once(path: Path) -> None:
    """ConfigError naming the task file `path` (or a file it `include`s) and the line of a key it gives twice in one
    mapping: lm-eval keeps the last without a word (attnlab refuses a key given twice in its own YAML files).
    Called for the task files of the tasks asked for only; a file lm-eval could not read was named already."""
    seen: set[Path] = set()
    while path.is_file() and path.resolve() not in seen:
        seen.add(path.resolve())
        try:
            data, _ = _read_task_file(path, strict=True)
        except yaml.constructor.ConstructorError as e:
            if "given twice" not in str(e.problem):
                return
            line = f"line {e.problem_mark.line + 1}: " if e.problem_mark else ""
            raise ConfigError(
                f"{line}{e.problem}: lm-eval would keep the last without a word", source=str(path)
            ) from None
        except yaml.YAMLError:
            return
        include = data.get("include") if isinstance(data, dict) else None
        if not isinstance(include, str):
            return
        path = Path(include) if Path(include).is_absolute() else path.parent / include


def check_task_files(folders: list[str]) -> dict[Path, str]:
    """Every task YAML file of the include_path folders (and the files they `include`), read without running
    anything: a file using the `!function` tag (lm-eval would import and run Python code next to it) is refused
    (ConfigError naming it); {file: what is wrong} for files that are not UTF-8 text, not valid YAML or `include` a
    missing file (lm-eval then skips them: named when a task is not found)."""
    broken: dict[Path, str] = {}
    todo = [f for folder in folders for f in sorted(Path(folder).rglob("*")) if f.suffix in (".yaml", ".yml")]
    seen: set[Path] = set()
    while todo:
        path = todo.pop(0)
        if path.resolve() in seen or not path.is_file():
            continue
        seen.add(path.resolve())
        not_utf8 = _not_utf8(path)
        if not_utf8:
            broken[path] = not_utf8
            continue
        try:
            data, tags = _read_task_file(path)
        except yaml.YAMLError as e:
            broken[path] = f"not valid YAML ({' '.join(str(e).split())})"
            continue
        if any(tag == "!function" for tag in tags):
            raise ConfigError(f"{path}: uses the !function tag, which would import and run Python code: attnlab "
                              f"does not run code from task files (remove it, or run lm-eval itself)")  # fmt: skip
        if not isinstance(data, dict):  # lm-eval's index skips it without a word
            kind = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(
                type(data), "value"
            )
            what = "is empty" if data is None else f"is a YAML {kind}"
            broken[path] = f"{what}, not a mapping of task keys (task:, dataset_path:, ...), so lm-eval skipped it"
            continue
        include = data.get("include") if isinstance(data, dict) else None
        if isinstance(include, str):
            target = Path(include) if Path(include).is_absolute() else path.parent / include
            if not target.is_file():
                broken[path] = f"include: {include}: no such file {target} (give the file it builds on)"
                continue
            todo.append(target)
        unknown_task_key(path)
    return broken


# The keys of a task file: lm-eval's TaskConfig's, and those its factory takes away before it builds one.
TASK_KEYS = (*(f.name for f in dataclasses.fields(TaskConfig)), "tag", "group", "task_list", "include")


def unknown_task_key(path: Path) -> None:
    """ConfigError naming the file and key when a task file (one task: `task` a name, with its includes merged)
    gives a key lm-eval's TaskConfig does not have: lm-eval would stop with a TypeError when it builds the task.
    Groups, task lists and Python tasks (`class`) are left to lm-eval."""
    try:
        cfg = load_yaml(path, resolve_func=False, recursive=True)
    except Exception:  # noqa: BLE001  (an include that cannot be read: named by check_task_files or lm-eval)
        return
    if not isinstance(cfg.get("task"), str) or "class" in cfg or "task_list" in cfg:
        return
    for key in cfg:
        if key not in TASK_KEYS:
            close = difflib.get_close_matches(str(key), TASK_KEYS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{path}: task {cfg['task']!r} has the key {key!r}, which lm-eval's task files do not "
                              f"have ({hint}see lm-eval's docs/task_guide.md): fix or remove it")  # fmt: skip


def check_duplicate_tasks(folders: list[str], tasks: list[str]) -> None:
    """ConfigError naming the task files when two files of the include_path folders declare a task (or group) asked
    for, or a member of a group asked for: lm-eval would index the first in file order and skip the other with a
    log line, so which one runs would be a matter of file names. Read as lm-eval's index reads them (its `*.yaml`
    files, `include`s merged, no code run: check_task_files refused !function first)."""
    declared: dict[str, list[Path]] = {}
    members: dict[str, list] = {}
    roots: dict[Path, Path] = {}
    for folder in folders:  # a folder given twice is read once
        roots.setdefault(Path(folder).resolve(), Path(folder))
    for root in roots.values():
        for path in sorted(root.glob("**/*.yaml"), key=lambda p: p.as_posix()):
            if any(part in ("__pycache__", ".ipynb_checkpoints") for part in path.parts):
                continue
            try:
                cfg = load_yaml(path, resolve_func=False, recursive=True)
            except Exception:  # noqa: BLE001  (lm-eval skips a file it cannot read; check_task_files names it)
                continue
            name = cfg.get("group") if "group" in cfg and "class" not in cfg else cfg.get("task")
            if isinstance(name, str):
                declared.setdefault(name, []).append(path)
                if "group" in cfg and "class" not in cfg:
                    members.setdefault(name, cfg.get("task") if isinstance(cfg.get("task"), list) else [])
    problems, todo, seen = [], list(tasks), set()
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        files = declared.get(name, [])
        if len(files) > 1:
            problems.append(f"task {name!r} is declared by {len(files)} task files, {', '.join(map(str, files))}: "
                            "lm-eval would run one and skip the others: give each task a name of its own "
                            "(task: ...)")  # fmt: skip
        todo += [m for m in members.get(name, []) if isinstance(m, str)]
    if problems:
        raise ConfigError(problems)


def declares(path: Path, name: str) -> bool:
    """Whether the task file `path` is the one of task `name` (its `task:`, or its file name if it cannot be read)."""
    try:
        data, _ = _read_task_file(path)
    except yaml.YAMLError:
        return path.stem == name
    declared = data.get("task", data.get("group")) if isinstance(data, dict) else None
    return declared == name if isinstance(declared, str) else path.stem == name
