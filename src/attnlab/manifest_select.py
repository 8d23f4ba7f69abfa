"""The problems `attnlab run --target` is told of: those of the targets it runs and of the targets they start from
(init_from), not those of targets it leaves alone; and a problem every target has alike (a `--set` value, a
default) said once, naming the targets, not once per target."""

from __future__ import annotations

import re


def needed_targets(targets: dict, selected) -> set | None:
    """The selected targets and every target they start from (init_from naming a target, in turn); None when
    nothing is selected (every target is)."""
    if not selected:
        return None
    needed, todo = set(), [t for t in selected if t in targets]
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        body = targets.get(name)
        start = body.get("init_from") if isinstance(body, dict) else None
        if isinstance(start, str) and start in targets:
            todo.append(start)
    return needed


def owned_problems(problems: list[str], marks: list[tuple[int, str | None]], needed: set | None) -> list[str]:
    """problems without those of the targets not needed; marks[i] = (index of a target's first problem, its
    name), in order, the last one (len(problems), None)."""
    if needed is None:
        return problems
    kept = problems[: marks[0][0]] if marks else list(problems)
    for (start, name), (end, _) in zip(marks, marks[1:], strict=False):
        if name is None or name in needed:
            kept += problems[start:end]
    return kept


def merged_repeats(problems: list[str], names) -> list[str]:
    """Each problem that several targets have in the same words (`targets.<name>...: text`) said once, at the
    first one's place: `targets.a and targets.b: text` (the where of each, as it was)."""
    pattern = re.compile(r"targets\.(" + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) +
                         r")((?:\.[^:]*)?): (.*)", re.S) if names else None  # fmt: skip
    groups: dict[tuple[str, str], list[str]] = {}
    order: list = []
    for problem in problems:
        found = pattern.fullmatch(problem) if pattern else None
        if found is None:
            order.append(problem)
            continue
        key = (found.group(2), found.group(3))  # the where below the target and the text
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(f"targets.{found.group(1)}{found.group(2)}")
    said = []
    for item in order:
        if isinstance(item, str):
            said.append(item)
            continue
        wheres = list(dict.fromkeys(groups[item]))
        joined = wheres[0] if len(wheres) == 1 else ", ".join(wheres[:-1]) + " and " + wheres[-1]
        said.append(f"{joined}: {item[1]}")
    return said
