"""Strict checking of plain data against config dataclasses (the parser config.py and config_io.py build on):
types before anything reads a value (a bool is not a number), finite numbers within fp32, bounded integers,
unknown keys with a nearest-name hint, every problem collected so that one ConfigError reports them all."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from decimal import Decimal
from typing import Any

from attnlab.errors import ConfigError
from attnlab.paths import brief

MAX_INT = 2**31 - 1  # the default bound of integer fields (see config.py for the model's own bounds)
MAX_WIDTH = 2**24  # the bound of a model's widths and counts (a config class's `int_limit`)


def _type_ok(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    return "null" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


@functools.cache
def _field_types(cls: type) -> dict[str, tuple[Any, int]]:
    """Each init field of dataclass `cls`: (its type annotation, the bound of its integer values)."""
    hints = typing.get_type_hints(cls)
    limits = getattr(cls, "int_limits", {})
    default = getattr(cls, "int_limit", MAX_INT)
    return {f.name: (hints[f.name], limits.get(f.name, default)) for f in dataclasses.fields(cls) if f.init}


FLOAT32_MAX = 3.4028234663852886e38


def value_problem(value: Any, annotation: Any, key: str, int_limit: int = MAX_INT) -> str | None:
    """Why `value` cannot be the value of a field typed `annotation` (None when it can): the wrong type (a bool
    is not a number, nor a number a bool), a float that is NaN or infinite, an integer beyond `int_limit`."""
    if value is None and not _type_ok(value, annotation):  # e.g. `--set key=` or `key:` with nothing after it
        return f"{key} is empty (null) but must be {_type_name(annotation)}: give it a value"
    if not _type_ok(value, annotation):
        return f"{key}={brief(value)} must be {_type_name(annotation)}, got {type(value).__name__}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if _type_ok(1.5, annotation):  # a float field (an int is accepted and read as a float)
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an int too large for a float
            finite = False
        if not finite:
            return f"{key}={brief(value)} must be a finite number"
        if abs(value) > FLOAT32_MAX:  # every parameter and activation is at most fp32: it would overflow
            return f"{key}={brief(value)} is too large (at most {FLOAT32_MAX:.3g} in magnitude)"
        return None
    if value > int_limit:
        return f"{key}={brief(value)} is too large (at most {int_limit:,})"
    if value < -int_limit:
        return f"{key}={brief(value)} is out of range ({-int_limit:,} .. {int_limit:,})"
    return None


EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")  # 4e0, 1E3: PyYAML reads them as strings (no dot)


PLAIN_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")  # what reads as a number written plainly


class Quoted(str):
    """A YAML scalar the file quoted ("0.003", '2'): text, even where it reads as a number (config_io.StrictLoader
    makes it). A number field refuses it (quoted_number_problem) rather than read it as the number."""


Quoted.__name__ = "str"  # what a line saying a value's type ("must be int, got str") calls it: a string


def quoted_number_problem(value: Any, annotation: Any, key: str) -> str | None:
    """The line for a number field given a quoted number: the file made it text on purpose or by mistake, and a
    number field reads text as a number nowhere else (an int field would say "got str")."""
    if not isinstance(value, Quoted) or not _type_ok(1, annotation) and not _type_ok(1.5, annotation):
        return None
    if not PLAIN_NUMBER.fullmatch(value.strip()):  # ('1_2' and 'nan' are numbers to float() alone: "got str")
        return None
    return f"{key}={brief(str(value))} is quoted, so text, not a number: write {value.strip()} without the quotes"


def exponent_text_problem(value: Any, annotation: Any, key: str) -> str | None:
    """The line for a whole-number field given a number in exponent form without a dot (4e0, 1e3): PyYAML (YAML
    1.1) reads it as a string, so "must be int, got str" would puzzle; it says so and the integer to write."""
    if not isinstance(value, str) or not EXPONENT.fullmatch(value.strip()) or not _type_ok(1, annotation):
        return None
    if _type_ok(1.5, annotation):  # (a float field reads it as a number: dataclass_kwargs)
        return None
    text = value.strip()
    number, (mantissa, exponent) = Decimal(text), re.split("[eE]", text)  # (exact: float(1e40) is not 10**40)
    dotted = f"{mantissa}{'' if '.' in mantissa else '.0'}e{exponent}"
    why = f"{text} is read as text (YAML reads a number with an exponent only when it has a dot, as in {dotted})"
    if abs(number.adjusted()) <= 30 and number == number.to_integral_value():
        return f"{key}={brief(value)} must be a whole number: {why}: write {int(number)}"
    if number == number.to_integral_value():  # (a whole number of more than 30 digits: too long to write out)
        return f"{key}={brief(value)} must be a whole number: {why}"
    return f"{key}={brief(value)} must be a whole number, and {text} is not one ({float(number):g})"


def field_problems(obj: Any, where: str) -> list[str]:
    """value_problem of every init field of dataclass instance `obj` (checked before anything reads them)."""
    out = []
    for name, (annotation, limit) in _field_types(type(obj)).items():
        problem = value_problem(getattr(obj, name), annotation, where + name, limit)
        if problem:
            out.append(problem)
    return out


def unknown_key_problem(key: str, valid: list[str], where: str, what: str = "key") -> str:
    """`unknown key 'n_kv_head' (did you mean 'n_kv_heads'?)`, or the valid choices when none is close."""
    valid = [str(v) for v in valid]
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (valid {what}s: {', '.join(sorted(valid))})"
    return f"unknown {what} {where}{key!r}{hint}"


def dataclass_kwargs(cls: type, data: Any, where: str, problems: list[str], skip: tuple[str, ...] = ()) -> dict:
    """Checks `data` against the fields of dataclass `cls`: unknown keys, missing keys, value types.

    Problems are appended (not raised) so every problem is reported at once.
    """
    if not isinstance(data, dict):
        problems.append(f"{where.rstrip('.') or 'config'} must be a mapping, got {type(data).__name__}")
        return {}
    types_of = _field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in skip}
    kwargs = {}
    for key, value in data.items():
        if key in skip:
            continue
        if not isinstance(key, str):
            problems.append(f"{where.rstrip('.') or 'config'}: key {brief(key)} must be a name (a string)")
            continue
        if key not in fields:
            problems.append(unknown_key_problem(key, list(fields) + list(skip), where))
            continue
        annotation, limit = types_of[key]
        quoted = quoted_number_problem(value, annotation, where + key)
        if quoted:
            problems.append(quoted)
            continue
        if isinstance(value, str) and _type_ok(1.5, annotation):
            # PyYAML reads 3e-4 (no dot) as a string: accept numbers written that way.
            try:
                value = float(value)
            except ValueError:
                pass
        problem = exponent_text_problem(value, annotation, where + key) or value_problem(
            value, annotation, where + key, limit
        )
        if problem:
            problems.append(problem)
            continue
        kwargs[key] = float(value) if _type_ok(1.5, annotation) and isinstance(value, int) else value
    for name, f in fields.items():
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if no_default and name not in data:
            problems.append(f"missing key {where}{name!r}")
    return kwargs


def build_collecting(cls: type, kwargs: dict, problems: list[str]):
    """cls(**kwargs), or None with its ConfigError's problems appended (to report every problem at once)."""
    try:
        return cls(**kwargs)
    except ConfigError as e:
        problems.extend(e.problems)
        return None


def idle_option_problems(spec: dict, given_train: dict, given_data: Any, own_splits) -> list[str]:
    """Options the user wrote that this run would not use (accepted, they would do nothing and still be recorded
    in its config): train.min_lr_ratio under a constant schedule, train.eps under Lion (which has none), and the
    split fractions of a dataset with splits of its own (one of `own_splits`). spec: a manifest run's resolved
    sections (train, data); given_*: the keys the user wrote."""
    problems, train, data = [], spec.get("train"), spec.get("data")
    given_data = given_data if isinstance(given_data, dict) else {}
    if train is not None and "min_lr_ratio" in given_train and train.schedule == "constant":
        problems.append(f"train.min_lr_ratio={train.min_lr_ratio} does nothing with train.schedule=constant (the rate "
                        "stays at train.lr after warm-up): leave it out, or use schedule linear or cosine")  # fmt: skip
    if train is not None and "eps" in given_train and train.optimizer == "lion":
        problems.append(f"train.eps={train.eps} does nothing with train.optimizer=lion (Lion divides by nothing): "
                        "leave it out, or use optimizer adamw")  # fmt: skip
    if data is not None and data.source in own_splits:
        for key in ("val_fraction", "test_fraction"):
            if key in given_data:
                problems.append(f"data.{key}={given_data[key]!r} does nothing with data.source={data.source} (it has "
                                "train, validation and test files of its own): leave it out")  # fmt: skip
    return problems
