"""A manifest's targets that start from a pretrained model (`init_from: REF` or `init_from: {model: REF, ...}`):
what their model sections may change (the rest is fixed by the weights), and the conversion's calibration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnlab.config import checkpointing_memory_problem, names_model, source_problem, untrainable_memory_problem
from attnlab.config_checks import MAX_INT, unknown_key_problem
from attnlab.errors import DataError, InputError
from attnlab.interop.convert import LOW_RANK, PAIR_RULES, calibration_minimum
from attnlab.interop.references import resolve
from attnlab.paths import brief, in_data_dirs

SOURCE_DEFAULTS = {"model": None, "rope_pairs": "energy", "calibration_tokens": 4096, "calibrate_on": "wikitext2-nounk"}
MIN_CALIBRATION_TOKENS = 2  # a calibration needs one window of 2 tokens (calibration_tokens_problem)
PRETRAINED_CHANGES = ("attention", "memory", "max_seq_len", "name")


def pretrained_model_problems(model: dict, where: str, inherited: tuple[str, set], train) -> list[str]:
    """The problems of a pretrained target's model section: changes to the model's config, checked against the model
    itself by the runner. inherited: (the target's name, the model keys it takes from `defaults` alone), to blame
    them on defaults; train: the target's TrainConfig, or None after a problem."""
    problems: list[str] = []
    fixed = [key for key in model if key not in PRETRAINED_CHANGES and key in inherited[1]]
    if fixed:
        keys = ", ".join(f"defaults.model.{key}" for key in fixed)
        problems.append(
            f"{keys} (inherited by target {inherited[0]}, which starts from a pretrained model): a pretrained "
            f"model's {', '.join(fixed)} {'is' if len(fixed) == 1 else 'are'} fixed by its weights; move "
            f"{'it' if len(fixed) == 1 else 'them'} into the other targets' model sections"
        )
    for key in model:
        if key not in PRETRAINED_CHANGES and key not in inherited[1]:
            problems.append(
                f"{where}.model.{key}: a pretrained model's {key} is fixed by its weights (a target with "
                f"init_from a model may change {', '.join(PRETRAINED_CHANGES)})"
            )
    for key in ("attention", "memory"):
        if key in model and not isinstance(model[key], dict):
            problems.append(f"{where}.model.{key} must be a mapping, got {brief(model[key])}")
    memory = model.get("memory") if isinstance(model.get("memory"), dict) else {}
    for problem in (untrainable_memory_problem(memory.get("kind")),
                    checkpointing_memory_problem(getattr(train, "activation_checkpointing", False),
                                                 memory.get("kind"))):  # fmt: skip
        if problem:
            problems.append(f"{where}: {problem}")
    return problems


def pretrained_source(value: Any, where: str, problems: list[str]) -> dict:
    """init_from a pretrained model: REF, or {model: REF, rope_pairs, calibration_tokens, calibrate_on}, checked and
    completed with SOURCE_DEFAULTS (source["model"] is None after a problem)."""
    raw = {"model": value} if isinstance(value, str) else value
    source = dict(SOURCE_DEFAULTS)
    for key, item in raw.items():
        if key not in SOURCE_DEFAULTS:
            problems.append(unknown_key_problem(str(key), list(SOURCE_DEFAULTS), f"{where}."))
        else:
            source[key] = item
    model, rule, tokens, text = (source[k] for k in SOURCE_DEFAULTS)
    if not isinstance(model, str) or not model.strip():
        problems.append(f"{where}.model={brief(model)} must be a model reference (a .gguf file, a model folder, an "
                        "attnlab checkpoint, hf:ORG/NAME)")  # fmt: skip
        source["model"] = None
    if rule not in PAIR_RULES:
        problems.append(f"{where}.rope_pairs={brief(rule)} is not known (use {', '.join(PAIR_RULES)})")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens <= MAX_INT:
        problems.append(
            f"{where}.calibration_tokens={brief(tokens)} must be an integer >= 0 (0: fit the weights alone)"
        )
    else:
        problem = calibration_tokens_problem(tokens, f"{where}.calibration_tokens")
        if problem:
            problems.append(problem)
    if not isinstance(text, str) or not text:
        problems.append(f"{where}.calibrate_on={brief(text)} must be a dataset name or a text file")
    else:
        problem = source_problem(text, f"{where}.calibrate_on")  # what the run would refuse once it reads it
        if problem:
            problems.append(problem)
    return source


def plain_name_problem(ref: Any, where: str, targets) -> str | None:
    """init_from {model: NAME} with a plain name (no folder separator, not .gguf, not hf:): the mapping form takes a
    model reference, which data.tokenizer then defaults to, and a plain name is no tokenizer (a model is named there
    by a path with a /). A target's name is said to be one (init_from: NAME names a target). None for other refs."""
    if not isinstance(ref, str) or not ref.strip() or names_model(ref):
        return None
    if ref in targets and not Path(ref).exists():
        return (f"{where}.model={ref!r}: no such model file or folder (the mapping form takes a model reference; a "
                f"target is named as init_from: {ref})")  # fmt: skip
    return (f"{where}.model={ref!r} is not a model reference: name a model folder by a path with a / (./{ref} for "
            "one in the working directory), a model file by its .gguf name, a Hub model as hf:ORG/NAME")  # fmt: skip


def calibration_tokens_problem(tokens: int, what: str) -> str | None:
    """Why `tokens` calibration tokens (0 = none) cannot fit a low-rank conversion, or None: the inputs' second
    moment is gathered over windows of at least MIN_CALIBRATION_TOKENS tokens (interop.convert.input_whitening
    leaves out a last window of one token), so fewer give no window at all, and no moment."""
    if 0 < tokens < MIN_CALIBRATION_TOKENS:
        return (f"{what}={tokens} is too few: the factorisations fit the second moment of the attention's inputs "
                f"over windows of at least {MIN_CALIBRATION_TOKENS} tokens (give {MIN_CALIBRATION_TOKENS} or more, "
                "e.g. 4096, or 0 to fit the weights alone)")  # fmt: skip
    return None


def calibration_size_problem(tokens: int, cfg, what: str) -> str | None:
    """Why `tokens` calibration tokens (0 = none) are too few to fit a low-rank conversion of a model of config
    `cfg`, or None: fewer than d_model inputs leave the second moment the fit weighs the weights by singular
    (interop.convert.calibration_minimum)."""
    least = calibration_minimum(cfg)
    if 0 < tokens < least:
        return (f"{what}={tokens} is too few for a model of d_model={cfg.d_model}: the factorisations are fitted to "
                f"the second moment of the attention's {cfg.d_model}-wide inputs, which fewer than {least} tokens "
                f"cannot span (the fit would ignore every direction they do not reach); give {least} or more (e.g. "
                f"4096), or 0 to fit the weights alone")  # fmt: skip
    return None


def conversion_options_problem(init_from: Any, attention: Any, where: str) -> str | None:
    """An init_from mapping's options of a low-rank conversion (rope_pairs, calibration_tokens other than 0,
    calibrate_on) given for a target whose attention is not bottleneck/decoupled/mla: they would do nothing (as
    `attnlab convert` refuses them)."""
    kind = attention.get("kind") if isinstance(attention, dict) else None
    if not isinstance(init_from, dict) or kind in LOW_RANK:
        return None
    given = [key for key in ("rope_pairs", "calibration_tokens", "calibrate_on")
             if key in init_from and not (key == "calibration_tokens" and init_from[key] == 0)]  # fmt: skip
    if not given:
        return None
    this = f"this target's model.attention.kind is {kind}" if kind else "this target keeps the source's attention"
    return (f"{where}.{given[0]}={brief(init_from[given[0]])} applies to bottleneck/decoupled/mla conversions "
            f"({this}): leave it out")  # fmt: skip


def missing_model_problems(problems: list[str], sources: dict, targets, data_dir) -> list[str]:
    """`problems` with, first, each init_from naming a local model file or folder that is nowhere (as given, nor in
    a data directory) or is no model (a text file, a folder of data), in place of what those targets' model sections
    may not change (a pretrained model's keys "fixed by its weights", which presume a model): `init_from: a/p1`
    meant a target, or a path was mistyped.
    sources: each target's pretrained source (None: trained from scratch); data_dir: --data-dir or None."""
    missing: dict[str, str] = {}
    for source in sources.values():
        ref = source and source["model"]
        if not isinstance(ref, str) or not names_model(ref) or ref.startswith("hf:") or source["target"] in missing:
            continue  # (a plain name is said not to be a model reference: plain_name_problem)
        try:
            found = in_data_dirs(ref, data_dir).exists()
        except DataError:  # $ATTNLAB_DATA names a file: said where the model is loaded
            continue
        if found:
            try:  # (a file or folder that is no model: README.md, a data folder)
                resolve(ref, data_dir)
            except (DataError, InputError) as e:
                missing[source["target"]] = f"targets.{source['target']}.init_from: {' '.join(str(e).split())}"
            continue
        head, _, tail = ref.partition("/")
        hint = (f" (init_from: {head} starts from target {head}'s last phase; no other phase of a target can be "
                "named)" if head in targets and tail else "")  # fmt: skip
        missing[source["target"]] = f"targets.{source['target']}.init_from: {ref}: no such model file or folder{hint}"
    if not missing:
        return problems
    moot = [name for name, source in sources.items() if source is not None and source["target"] in missing]

    def presumes(problem: str) -> bool:  # a model key "fixed by its weights" of a target starting from no model
        whose = (f"target {name}," in problem or problem.startswith(f"targets.{name}.") for name in moot)
        return "fixed by its weights" in problem and any(whose)

    kept = [problem for problem in problems if not presumes(problem)]
    return [*missing.values(), *kept]


def init_from_hint(value: str, targets, data_dir) -> str:
    """What a refused `init_from: value` (neither an earlier target nor a model reference) likely meant, as a
    parenthesis for its line, or '': a target or model with a stray space around it, or a folder holding .gguf
    files (a GGUF model is its file, not its folder)."""
    stripped = value.strip()
    if stripped and stripped != value and (stripped in targets or names_model(stripped)):
        where = "ends" if value.lstrip() == value else "starts" if value.rstrip() == value else "starts and ends"
        return f" (it {where} in a space: write {stripped!r})"
    try:
        folder = in_data_dirs(value, data_dir)
        files = sorted(p.name for p in folder.glob("*.gguf")) if value and folder.is_dir() else []
    except (DataError, OSError):
        return ""
    return f" ({value} is a folder holding {', '.join(files)}: name the file, {value}/{files[0]})" if files else ""
