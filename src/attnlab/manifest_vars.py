"""Manifest variables: `vars: {lr: 3.0e-4}` and `${lr}` anywhere in a manifest (a value that is exactly
'${name}' keeps the variable's type); a variable may use another, and a cycle or an undefined name is one problem
naming it. Split from attnlab.manifest."""

from __future__ import annotations

import difflib
import re
from typing import Any

from attnlab.paths import brief

VAR = re.compile(r"\$\{([^}]*)\}")


def undefined(name: str, variables: dict) -> str:
    """'undefined variable ${name}' with the closest defined name, or the defined ones."""
    close = difflib.get_close_matches(name, list(variables), n=1, cutoff=0.5)
    hint = f" (did you mean ${{{close[0]}}}?)" if close else f" (defined: {', '.join(variables) or 'none'})"
    return f"undefined variable ${{{name}}}{hint}"


def substitute(value: Any, variables: dict, where: str, problems: list[str], broken=frozenset()) -> Any:
    """Replaces ${name}: a value that is exactly '${name}' keeps the variable's type. `broken`: variables whose own
    problem was said already (a cycle), left in place without another."""
    if isinstance(value, dict):
        return {
            k: substitute(v, variables, f"{where}.{k}" if where else str(k), problems, broken) for k, v in value.items()
        }
    if isinstance(value, list):
        return [substitute(v, variables, f"{where}[{i}]", problems, broken) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value
    for name in VAR.findall(value):
        if name not in variables and name not in broken:
            problems.append(f"{where}: {undefined(name, variables)}")
    whole = VAR.fullmatch(value)
    if whole:
        return variables.get(whole.group(1), value)
    return VAR.sub(lambda m: str(variables.get(m.group(1), m.group(0))), value)


def used_names(value: Any) -> list[str]:
    """The variables a value uses (${name}), anywhere inside it."""
    if isinstance(value, dict):
        return [name for v in value.values() for name in used_names(v)]
    if isinstance(value, list):
        return [name for v in value for name in used_names(v)]
    return VAR.findall(value) if isinstance(value, str) else []


def resolve_vars(variables: dict, problems: list[str]) -> tuple[dict, set[str]]:
    """The variables with the ${names} their values use replaced (a variable may use another); a cycle
    (`a: ${b}`, `b: ${a}`) or an undefined name is one problem naming them. Returns (the resolved variables, the
    names that could not be resolved: left out, their uses not reported again)."""
    resolved: dict = {}
    broken: set[str] = set()

    def resolve(name: str, chain: list[str]) -> bool:
        if name in resolved or name in broken:
            return name in resolved
        if name in chain:
            cycle = chain[chain.index(name) :]
            if not broken & set(cycle):
                if len(cycle) == 1:
                    problems.append(f"vars.{name}: its value uses ${{{name}}}, itself (give it a value)")
                else:
                    shown = " -> ".join(f"${{{n}}}" for n in [*cycle, name])
                    problems.append(f"vars: {shown}: these variables refer to each other, a cycle (give one of "
                                    "them a value)")  # fmt: skip
            broken.update(cycle)
            return False
        ok = True
        for used in dict.fromkeys(used_names(variables[name])):
            if used not in variables:
                problems.append(f"vars.{name}: {undefined(used, variables)}")
                ok = False
            elif not resolve(used, [*chain, name]):
                ok = False
        if ok and name not in broken:
            resolved[name] = substitute(variables[name], resolved, f"vars.{name}", problems)
        else:
            broken.add(name)
        return name in resolved

    for name in variables:
        resolve(name, [])
    return resolved, broken


def undefined_keys(value: Any, variables: dict, where: str = "") -> list[str]:
    """The keys (`train.lr`) whose value still holds an undefined ${variable} (after substitute)."""
    if isinstance(value, dict):
        return [
            k for key, v in value.items() for k in undefined_keys(v, variables, f"{where}.{key}" if where else str(key))
        ]
    if isinstance(value, list):
        return [k for v in value for k in undefined_keys(v, variables, where)]
    if isinstance(value, str) and any(name not in variables for name in VAR.findall(value)):
        return [where]
    return []


def check_vars(variables: Any, problems: list[str]) -> dict:
    """The manifest's `vars` mapping, without the keys that are not variable names (each a problem)."""
    if variables is None:
        return {}
    if not isinstance(variables, dict):
        problems.append(f"vars must be a mapping of names to values, got {type(variables).__name__}")
        return {}
    bad = [k for k in variables if not isinstance(k, str) or not k or "}" in k]
    problems.extend(f"vars: {brief(k)} is not a variable name (use text, without '}}')" for k in bad)
    return {k: v for k, v in variables.items() if k not in bad}
