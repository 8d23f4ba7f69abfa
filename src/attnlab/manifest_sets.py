"""`attnlab run --set KEY.PATH=VALUE`: the overrides as one nested mapping, each value a YAML scalar, each key given
once."""

from __future__ import annotations

import yaml

from attnlab.config_io import IntTooLarge, TooDeep, Yaml11Number, parse_yaml, yaml_problem
from attnlab.errors import ConfigError
from attnlab.paths import brief

SECTION_KEYS = ("model", "data", "train")


def parse_set(assignments: list[str] | tuple[str, ...]) -> dict:
    """['train.lr=3e-4', 'model.attention.d_sem=64'] -> nested dict; values parsed as YAML scalars. A key set twice
    (given twice, or inside a mapping given by another --set) is refused: the last would silently win, and a key
    given twice in a YAML file is refused too."""
    out: dict = {}
    given: dict[tuple[str, ...], str] = {}  # each key set so far -> its value as given
    for item in assignments:
        key, sep, raw = item.partition("=")
        parts = [part.strip() for part in key.split(".")]
        if not sep or not all(parts) or parts[0] not in SECTION_KEYS:
            raise ConfigError(f"--set {brief(item)} must look like model.KEY=VALUE, data.KEY=VALUE or train.KEY=VALUE")
        try:
            value = parse_yaml(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            plain = isinstance(e, (TooDeep, IntTooLarge, Yaml11Number))  # (quoting would not help, or is said)
            fix = "" if plain else " (quote the whole value, or drop a stray quote or bracket)"
            raise ConfigError(f"--set {brief(item)}: the value {brief(raw)} is {yaml_problem(e)}{fix}") from None
        if len(parts) == 1 and not isinstance(value, dict):  # train=null would drop the whole section, defaults in
            raise ConfigError(f"--set {brief(item)}: {parts[0]} is a section, not a value: set its keys "
                              f"(--set {parts[0]}.KEY=VALUE), or give a mapping ({parts[0]}={{KEY: V}})")  # fmt: skip
        node = out
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    f"--set {brief(item)}: {'.'.join(parts[: i + 1])} is set to a value by an earlier --set, "
                    "so it has no keys"
                )
        path = tuple(parts)
        if parts[-1] in node:
            raise ConfigError(_set_twice(path, raw, given))
        node[parts[-1]] = value
        given[path] = raw
    return out


def _shown(raw: str) -> str:
    text = " ".join(raw.split())
    return text if len(text) <= 40 else text[:37] + "..."


def _set_twice(path: tuple[str, ...], raw: str, given: dict[tuple[str, ...], str]) -> str:
    """The line refusing a --set of `path` whose key an earlier --set set already: the same key, a mapping holding
    it, or (path naming a mapping) one of its keys."""
    name = ".".join(path)
    if path in given:
        return f"--set {name} is given twice ({_shown(given[path])}, then {_shown(raw)}): give it once"
    earlier = next(k for k in given if k[: len(path)] == path or path[: len(k)] == k)
    return (f"--set {name}={_shown(raw)} sets what --set {'.'.join(earlier)}={_shown(given[earlier])} set before it "
            f"(the last would silently win): give each key once")  # fmt: skip
