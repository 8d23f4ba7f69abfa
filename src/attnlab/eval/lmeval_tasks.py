"""lm-eval task files for attnlab.eval.lmeval: read without running code, their relative data files found in the data
directory (single tasks and group members alike), and built and checked before the model is loaded, so that a
mistake in a task YAML ends in one line naming the file and key (a ConfigError or DataError), not lm-eval's or
jinja's traceback halfway through an evaluation."""

from __future__ import annotations

import difflib
import errno
import math
from pathlib import Path
from typing import Any

import yaml

from attnlab.errors import AttnlabError, ConfigError, DataError
from attnlab.eval.lmeval_task_files import check_keys_once, declares, lm_eval_missing
from attnlab.paths import find_data_file

try:
    import jinja2
    from lm_eval.api.group import Group
    from lm_eval.api.task import Task
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._factory import TaskFactory
    from lm_eval.tasks._index import Entry, Kind
    from lm_eval.tasks._yaml_loader import load_yaml
except ImportError as e:  # an optional extra: the core never imports this module
    raise lm_eval_missing(e) from None

LOCAL_TASKS = "configs/lm_eval"  # attnlab's copies of lm-eval tasks over files of the data directory (`<task>_local`)
SPLIT_KEYS = ("test_split", "validation_split", "training_split", "fewshot_split")
TEMPLATE_KEYS = ("doc_to_text", "doc_to_target", "doc_to_choice")  # what every item of a task renders


def _holds_text(path: Path) -> bool:
    """Whether the file holds anything but white space (read until the first such byte: the first block, mostly)."""
    with open(path, "rb") as f:
        while block := f.read(1 << 16):
            if block.strip():
                return True
    return False


def _resolved_files(files: Any, data_dir: str | Path | None, source: str = "",
                    key: str = "dataset_kwargs.data_files") -> Any:  # fmt: skip
    """data_files with every relative path looked up in the data directory (find_data_file); absolute paths,
    URLs and glob patterns as they are. A relative path that leaves the data directory (`../x`): ConfigError
    naming the task file `source`; a named file that holds no items (empty, or white space only: `datasets` stops
    with a StopIteration traceback): DataError naming it and its `key`."""
    if isinstance(files, str):
        plain = not (Path(files).is_absolute() or "://" in files or any(c in files for c in "*?["))
        if plain and ".." in Path(files).parts:
            why = "leaves the data directory (a relative data file is looked up inside --data-dir)"
            raise ConfigError(f"data file {files!r} {why}: give a path inside it, or an absolute path", source=source)
        if Path(files).is_absolute() and not any(c in files for c in "*?[") and not Path(files).is_file():
            raise DataError(f"{source}: data file {files} is not a file (give the path of the task's data file)")
        path = find_data_file(files, data_dir) if plain else Path(files)
        if (plain or Path(files).is_absolute()) and path.is_file() and not _holds_text(path):
            size = " (0 bytes)" if path.stat().st_size == 0 else " (white space only)"
            raise DataError(f"{source}: {key}: data file {path} holds no items{size}: give the task's items in it "
                            "(for dataset_path: json, one JSON object a line)")  # fmt: skip
        return str(path) if plain else files
    if isinstance(files, list):
        return [_resolved_files(f, data_dir, source, f"{key}[{i}]") for i, f in enumerate(files)]
    if isinstance(files, dict):
        return {split: _resolved_files(f, data_dir, source, f"{key}.{split}") for split, f in files.items()}
    return files


def task_manager(include_path: list[str], tasks: list[str], broken: dict[Path, str] | None = None) -> TaskManager:
    """lm-eval's TaskManager over the include_path folders, with lm-eval's own ~15,000 tasks too (indexing them
    takes 10-30 seconds) unless every task asked for is a task of those folders (or a group of such tasks) or is
    declared by one of their broken files (check_task_files: task_specs names the file, lm-eval's tasks cannot
    stand in for it)."""
    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(_all_local(local, name) or any(declares(path, name) for path in broken or {}) for name in tasks):
            return local
    return TaskManager(include_path=include_path or None)


def _all_local(manager: TaskManager, name: str, seen: tuple[str, ...] = ()) -> bool:
    """Whether `name` is a task of `manager`, or a group of it whose members (named) all are."""
    entry = manager.task_index.get(name)
    if entry is None or name in seen:
        return False
    if entry.kind is Kind.TASK:
        return True
    if entry.kind is not Kind.GROUP or not entry.yaml_path:
        return False
    members = load_yaml(entry.yaml_path, resolve_func=True).get("task")
    return isinstance(members, list) and all(
        isinstance(m, str) and _all_local(manager, m, (*seen, name)) for m in members
    )


def task_specs(manager: TaskManager, tasks: list[str], data_dir: str | Path | None = None,
               broken: dict[Path, str] | None = None) -> list[str]:  # fmt: skip
    """The task names, checked: an unknown name is a ConfigError (naming the task file lm-eval skipped because it
    is broken, when one declares that task). data_dir: unused (the TaskManager's factory from `attach` finds a
    task's relative data files in the data directory as it builds the task)."""
    if not tasks:
        raise ConfigError("give at least one lm-eval task")
    problems = []
    broken = broken or {}
    for name in tasks:
        if name in manager.all_tasks:
            continue
        own = [f"{path}: {why} (fix the task file)" for path, why in broken.items() if declares(path, name)]
        if own:
            problems.extend(own)
            continue
        close = difflib.get_close_matches(name, manager.all_tasks, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(map(repr, close))}?" if close else "a task of an include_path folder?"
        problems.append(f"unknown lm-eval task {name!r} ({hint})")
        if broken:  # the task may be in a file lm-eval could not read
            problems.extend(f"{path}: {why} (fix the task file)" for path, why in broken.items())
    for name in [] if problems else tasks:
        problems.extend(_member_problems(manager, name))
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
    return list(tasks)


def _member_problems(manager: TaskManager, name: str, seen: tuple[str, ...] = ()) -> list[str]:
    """Members of group `name` (and of its member groups) that name no task lm-eval knows: lm-eval would build
    each as an empty inline task and fail with a TypeError."""
    entry = manager.task_index.get(name)
    if entry is None or entry.kind is not Kind.GROUP or not entry.yaml_path or name in seen:
        return []
    members = load_yaml(entry.yaml_path, resolve_func=True).get("task")
    problems = []
    for member in members if isinstance(members, list) else []:
        if isinstance(member, str) and member not in manager.task_index:
            close = difflib.get_close_matches(member, manager.all_tasks, n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(map(repr, close))}?" if close else "a task of an include_path folder?"
            problems.append(f"{entry.yaml_path}: task: member {member!r} is no lm-eval task ({hint})")
        elif isinstance(member, str):
            problems.extend(_member_problems(manager, member, (*seen, name)))
    return problems


def task_file(manager: TaskManager, name: str) -> str:
    """The YAML file of task `name` (its name when lm-eval defines it otherwise)."""
    entry = manager.task_index.get(name)
    return str(entry.yaml_path) if entry is not None and entry.yaml_path else name


def _template_key(cfg: dict, error: jinja2.TemplateError) -> str | None:
    """The key of a task config whose Jinja template `error` comes from: the one that does not compile (a syntax
    error), or the one that names the undefined field."""
    templates = {k: v for k, v in cfg.items() if isinstance(v, str) and ("{{" in v or "{%" in v)}
    env = jinja2.Environment()
    for key, text in templates.items():
        if isinstance(error, jinja2.TemplateSyntaxError):
            try:
                env.parse(text)
            except jinja2.TemplateSyntaxError:
                return key
        elif isinstance(error, jinja2.UndefinedError):
            field = str(error).split("'")[1] if str(error).count("'") >= 2 else ""
            if field and field in text:
                return key
    return None


def _task_problem(cfg: dict, source: str, error: Exception) -> AttnlabError | None:
    """A one-line error naming `source` (the task file) and its key for lm-eval's or jinja's exception `error` from
    building a task of config `cfg`; None for an exception that is not about the task file."""
    if isinstance(error, jinja2.TemplateError):
        key = _template_key(cfg, error)
        where = f"{key}: " if key else ""
        text = f" {cfg[key]!r}" if key else ""
        why = " ".join(str(error).split())
        what = "a field no item has" if isinstance(error, jinja2.UndefinedError) else "a Jinja syntax error"
        return ConfigError(f"{where}template{text} has {what} ({why}): fix the template", source=source)
    if isinstance(error, KeyError) and error.args:
        keys = [k for k in SPLIT_KEYS if error.args[0] is not None and cfg.get(k) == error.args[0]]
        if keys:
            files = (cfg.get("dataset_kwargs") or {}).get("data_files")
            has = f" (data_files names {', '.join(map(str, files))})" if isinstance(files, dict) else ""
            return ConfigError(f"{keys[0]}: the task data has no split {error.args[0]!r}{has}: name a split it "
                               "has", source=source)  # fmt: skip
        return None
    if type(error).__module__.split(".")[0] in ("datasets", "pyarrow", "fsspec"):  # `datasets` could not load it
        cause = error.__cause__ or error
        full = cache_full_line(cause)
        if full:  # not the data file's fault
            return DataError(f"{source}: {full}")
        files = (cfg.get("dataset_kwargs") or {}).get("data_files")
        return DataError(f"{source} (data files {files}): the task data could not be loaded "
                         f"({type(cause).__name__}: {' '.join(str(cause).split())}): fix the data file")  # fmt: skip
    if isinstance(error, ValueError):  # lm-eval's checks of a task config (an unknown output_type, ...)
        return ConfigError(f"{' '.join(str(error).split())} (fix the task file)", source=source)
    return None


DISK_FULL = {errno.ENOSPC: "no space left on its disk (OSError ENOSPC)", errno.EDQUOT: "its disk quota is used up "
             "(OSError EDQUOT)"}  # fmt: skip


def cache_full_line(cause: BaseException) -> str | None:
    """What is said when `datasets` could not write a task's data into its cache (a full disk, a used-up quota, a file
    size limit), naming the file or the cache; None for other errors."""
    code = getattr(cause, "errno", None) if isinstance(cause, OSError) else None
    if code not in (*DISK_FULL, errno.EFBIG):
        return None
    import datasets

    where = cause.filename or datasets.config.HF_DATASETS_CACHE
    if code == errno.EFBIG:
        return (f"the task data could not be written to the datasets cache {where}: a file there is past this "
                "process's file size limit (OSError EFBIG, ulimit -f): raise the limit")  # fmt: skip
    return (f"the task data could not be written to the datasets cache {where}: {DISK_FULL[code]}: free space there, "
            "or set HF_DATASETS_CACHE to a folder on a disk with room")  # fmt: skip


def _metric_problem(cfg: dict) -> str | None:
    """What is wrong with a metric_list entry lm-eval cannot aggregate, or None: a metric it does not know, without
    an `aggregation` (lm-eval looks for it in Hugging Face evaluate, then fails with KeyError: None), or an
    aggregation it does not know."""
    import lm_eval.api.metrics  # noqa: F401  (registers lm-eval's metrics and aggregations)
    from lm_eval.api.registry import aggregation_registry, metric_agg_registry

    entries = cfg.get("metric_list")
    for i, entry in enumerate(entries if isinstance(entries, list) else []):
        if not isinstance(entry, dict) or not isinstance(entry.get("metric"), str):
            continue
        name, aggregation = entry["metric"], entry.get("aggregation")
        if isinstance(aggregation, str) and aggregation not in aggregation_registry:
            known = ", ".join(sorted(aggregation_registry))
            return f"metric_list[{i}].aggregation={aggregation!r} is not an aggregation lm-eval knows (use one of " + (
                f"{known})")  # fmt: skip
        if "aggregation" not in entry and name not in metric_agg_registry:
            close = difflib.get_close_matches(name, list(metric_agg_registry), n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(map(repr, close))}?" if close else "e.g. acc, acc_norm"
            return (f"metric_list[{i}].metric={name!r} is not a metric lm-eval knows ({hint}): name one, or give its "
                    "aggregation (a Hugging Face evaluate metric: with hf_evaluate: true)")  # fmt: skip
    return None


def _kind(value: Any) -> str:
    """What a YAML value is, in words: `a number`, `a list`, ..."""
    if value is None:
        return "empty"
    kinds = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "a mapping"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def _shown(value: Any) -> str:
    """A value as the YAML file writes it (5, null, true, [a]), for a message."""
    return yaml.safe_dump(value, default_flow_style=True, width=1000).removesuffix("\n...\n").strip()


def _value_problem(cfg: dict) -> str | None:
    """What is wrong with a task config's value of the wrong kind that lm-eval takes as it is and fails on later (a
    traceback, some after every item was scored), or None: a delimiter that is not text, repeats or num_fewshot that
    is not a whole number in range."""
    texts = [(key, cfg[key]) for key in ("target_delimiter", "fewshot_delimiter") if key in cfg]
    fewshot = cfg.get("fewshot_config")
    if isinstance(fewshot, dict):
        texts += [(f"fewshot_config.{key}", fewshot[key]) for key in ("target_delimiter", "fewshot_delimiter")
                  if fewshot.get(key) is not None]  # fmt: skip
    for key, value in texts:
        if not isinstance(value, str):
            shown = "" if value is None else _shown(value)
            return (f"{key}: {_shown(value)} is {_kind(value)}, not text (what goes between the question and its "
                    f'answer, or between examples): quote it, {key}: "{shown}"')  # fmt: skip
    repeats = cfg.get("repeats", 1)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        return (f"repeats: {_shown(repeats)} must be a whole number >= 1 (how many times each item is scored; lm-eval "
                "would fail after scoring every item): give repeats: 1 or more")  # fmt: skip
    shots = cfg.get("num_fewshot")
    if shots is not None and (isinstance(shots, bool) or not isinstance(shots, int) or shots < 0):
        return f"num_fewshot: {_shown(shots)} must be a whole number >= 0 (the few-shot examples before each item)"
    return None


class _Factory(TaskFactory):
    """lm-eval's TaskFactory that finds a task's relative data files in the data directory (a task asked for by
    name and a member of a group alike) and turns a mistake of a task file into one typed error naming it."""

    def __init__(self, meta: dict, data_dir: str | Path | None, index: dict[str, Entry]):
        super().__init__(meta=meta)
        self.data_dir, self.index = data_dir, index

    def _source(self, entry: Entry, cfg: dict) -> str:
        if entry.yaml_path:
            return str(entry.yaml_path)
        own = self.index.get(str(cfg.get("task")))
        return str(own.yaml_path) if own is not None and own.yaml_path else f"task {cfg.get('task')!r}"

    def _load_full_config(self, entry: Entry, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        if entry.yaml_path:
            check_keys_once(Path(entry.yaml_path))
        cfg = super()._load_full_config(entry, overrides)
        kwargs = cfg.get("dataset_kwargs")
        if isinstance(kwargs, dict) and kwargs.get("data_files") is not None:
            files = _resolved_files(kwargs["data_files"], self.data_dir, self._source(entry, cfg))
            cfg["dataset_kwargs"] = {**kwargs, "data_files": files}
        return cfg

    def _build_task(self, entry: Entry, overrides: dict[str, Any] | None) -> Task:
        try:
            cfg = self._load_full_config(entry, overrides)
            problem = _value_problem(cfg) or _metric_problem(cfg)
            if problem:  # before lm-eval's log lines about it and its KeyError
                raise ConfigError(problem, source=self._source(entry, cfg))
            return super()._build_task(entry, overrides)
        except AttnlabError:
            raise
        except Exception as e:  # re-raised unless it is one of the task file's mistakes _task_problem knows
            cfg = self._load_full_config(entry, overrides)
            problem = _task_problem(cfg, self._source(entry, cfg), e)
            if problem is None:
                raise
            raise problem from None


def attach(manager: TaskManager, data_dir: str | Path | None) -> TaskManager:
    """`manager` building its tasks through _Factory (relative data files found in `data_dir`)."""
    manager._factory = _Factory(manager._factory._meta, data_dir, manager.task_index)
    return manager


def _n_docs(n: int, limit: int | float | None) -> int:
    """How many items lm-eval evaluates of a task of n items under `limit` (a count, or a fraction)."""
    if limit is None:
        return n
    return min(n, int(math.ceil(n * limit)) if limit < 1 else int(limit))


def check_items(task: Task, source: str, limit: int | float | None) -> None:
    """Render every item lm-eval will evaluate of `task`: a template naming a field an item lacks, or (multiple
    choice) a target that is neither one of the item's choices nor an index below their number, is a ConfigError
    naming the task file, the key and the item (lm-eval would stop with a traceback, or score the item wrong)."""
    docs = task.eval_docs
    multiple_choice = task.config.output_type == "multiple_choice"
    cfg = {key: getattr(task.config, key, None) for key in TEMPLATE_KEYS}
    for doc_id in range(_n_docs(len(docs), limit)):
        doc = docs[doc_id]
        try:
            task.doc_to_text(doc)
            target = task.doc_to_target(doc)
            choices = task.doc_to_choice(doc) if multiple_choice else None
        except jinja2.TemplateError as e:
            problem = _task_problem(cfg, source, e)
            raise ConfigError(f"item {doc_id}: {problem.problems[0]}", source=source) from None
        if not multiple_choice:
            continue
        for gold in target if isinstance(target, list) else [target]:
            if (isinstance(gold, int) and 0 <= gold < len(choices)) or (isinstance(gold, str) and gold in choices):
                continue
            raise ConfigError(
                f"doc_to_target {cfg['doc_to_target']!r} gives {gold!r} for item {doc_id}, which is neither one of "
                f"its {len(choices)} choices nor an index below {len(choices)}: fix doc_to_target (lm-eval would "
                "score such items wrong)", source=source,
            )  # fmt: skip


def check_fewshot(task: Task, source: str, num_fewshot: int | None = None) -> None:
    """ConfigError naming the task file `source` when the task asks for more few-shot examples (its num_fewshot, or
    `num_fewshot` of --num-fewshot as simple_evaluate sets it) than it has: random.sample would stop lm-eval with a
    ValueError once the model is loaded. lm-eval's sampler draws one more than asked and drops the item itself when
    the few-shot split is the test split (or neither is named)."""
    shots = task.config.num_fewshot
    if num_fewshot is not None and shots != 0:  # simple_evaluate keeps a task's num_fewshot of 0
        shots = num_fewshot
    sampler, fewshot_cfg = getattr(task, "sampler", None), getattr(task, "fewshot_cfg", None)
    if not shots or sampler is None or fewshot_cfg is None:  # a task of lm-eval's own Python class: its own checks
        return
    pool = len(sampler.fewshot_docs())
    own = fewshot_cfg.split == task.config.test_split
    if shots + own <= pool:
        return
    config = task.config
    if fewshot_cfg.split is not None:
        where = f"fewshot_split {fewshot_cfg.split!r}"
    elif fewshot_cfg.samples is not None:
        where = "fewshot_config.samples"
    else:  # lm-eval's rule without a fewshot_split: the training split, else the validation split, else the test one
        key = next(k for k in ("training_split", "validation_split", "test_split") if getattr(config, k) is not None)
        where = f"{key} {getattr(config, key)!r}"
    asked = f"num_fewshot={num_fewshot:,} (--num-fewshot)" if shots == num_fewshot else f"num_fewshot: {shots:,}"
    less = ", less the item itself" if own else ""
    raise ConfigError(f"{asked} is more few-shot examples than task {task.task_name!r} has (the {pool:,} items of its "
                      f"{where}{less}): give fewer (at most {max(pool - own, 0):,})", source=source)  # fmt: skip


def build_tasks(manager: TaskManager, names: list[str], limit: int | float | None,
                num_fewshot: int | None = None) -> list[Task | Group]:  # fmt: skip
    """The tasks (and groups) `names`, built by lm-eval (their data read) and their items and few-shot examples
    checked (check_items, check_fewshot; num_fewshot: --num-fewshot), before any model is loaded: what
    simple_evaluate then evaluates."""
    built: list[Task | Group] = []
    for name in names:
        obj = manager._load_spec(name)
        built.extend(obj if isinstance(obj, list) else [obj])
    for obj in built:
        for task in obj.get_all_tasks() if isinstance(obj, Group) else [obj]:
            check_items(task, task_file(manager, task.task_name), limit)
            check_fewshot(task, task_file(manager, task.task_name), num_fewshot)
    return built


def leaf_tasks(built: list[Task | Group]) -> list[Task]:
    """Every task of `built`, groups opened."""
    return [task for obj in built for task in (obj.get_all_tasks() if isinstance(obj, Group) else [obj])]


def offline_line(tasks: list[str], manager: TaskManager, error: Exception) -> str:
    """One line for tasks whose data `datasets` could not fetch from the Hugging Face Hub (no network, or
    $HF_HUB_OFFLINE): the tasks and their datasets, and the local task to use instead."""
    hub = []
    for name in tasks:
        entry = manager.task_index[name]
        cfg = load_yaml(entry.yaml_path, resolve_func=True) if entry.yaml_path else {}
        if (cfg.get("dataset_kwargs") or {}).get("data_files"):
            continue  # its data files are local
        dataset = cfg.get("dataset_path")
        hub.append(f"{name!r}" + (f" (Hub dataset {dataset})" if dataset else ""))
    folder = next((f for f in (Path(LOCAL_TASKS), Path(__file__).resolve().parents[3] / LOCAL_TASKS) if f.is_dir()),
                  Path(LOCAL_TASKS))  # fmt: skip
    local = [f"{name}_local" for name in tasks if (folder / f"{name}_local.yaml").is_file()]
    hint = (
        f"use the local copy: --include-path {folder} --tasks {','.join(local)} (its files in the data directory)"
        if local
        else "connect to the network, or give a task over local files with --include-path"
    )
    what = ", ".join(hub) or ", ".join(map(repr, tasks))
    return (f"lm-eval task {what}: its data is on the Hugging Face Hub and could not be reached "
            f"({' '.join(str(error).split())}); {hint}")  # fmt: skip
