"""JSON read from outside (a file, a line of one, a header): json.loads, but an integer of more digits than Python
converts (4,300) is refused as invalid JSON, a json.JSONDecodeError at the integer, instead of a ValueError from
deep inside the json module. Every caller that catches JSONDecodeError for a damaged file says it as one.

Imports nothing of attnlab: the lowest layers (config_io, memory) use it too."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_INT_DIGITS = 4300  # Python's own limit for int <-> str (sys.int_info.default_max_str_digits)
MAX_INT_BITS = 14_000  # 2**14000 < 10**4300: a larger value (written in hex, say) would not print either


def too_many_digits(digits: str) -> bool:
    """Whether an integer written as `digits` (a sign, underscores, a 0x-like prefix allowed) has more than
    MAX_INT_DIGITS digits."""
    return sum(c.isalnum() for c in digits) > MAX_INT_DIGITS


class IntegerTooLong(json.JSONDecodeError):
    """An integer of more than MAX_INT_DIGITS digits in JSON text: a json.JSONDecodeError at it (the text is not
    damaged JSON, but no value attnlab reads is anywhere near so large)."""


class _TooLong(Exception):
    """Raised by the parse_int hook (which is not told where the integer is); BoundedDecoder finds the place."""


def _parse_int(digits: str) -> int:
    if too_many_digits(digits):
        raise _TooLong(digits)
    return int(digits)


# A JSON string (skipped whole: digits inside one are text) or a JSON number; only scanned once the decoder has
# read the text up to the integer refused, so that text is valid JSON.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?')


class BoundedDecoder(json.JSONDecoder):
    """json.JSONDecoder refusing an integer of more than MAX_INT_DIGITS digits (IntegerTooLong, at it)."""

    def __init__(self, **kwargs: Any):
        super().__init__(parse_int=_parse_int, **kwargs)

    def raw_decode(self, s: str, idx: int = 0) -> tuple[Any, int]:
        try:
            return super().raw_decode(s, idx)
        except _TooLong as e:
            digits = e.args[0]
            pos = next((m.start() for m in _TOKEN.finditer(s, idx) if m.group() == digits), idx)
            count = sum(c.isdigit() for c in digits)
            raise IntegerTooLong(
                f"an integer of {count} digits, far too large for any value (at most {MAX_INT_DIGITS})", s, pos
            ) from None


class DuplicateKey(ValueError):
    """A JSON object that gives one key twice: valid JSON, which json.loads (and transformers) read with the last
    value winning silently; refused by loads_json(unique_keys=True)."""

    def __init__(self, key: str, first: Any, then: Any):
        self.key, self.first, self.then = key, first, then
        super().__init__(f"key {key!r} is given twice ({_shown(first)}, then {_shown(then)}): keep one")


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def _unique(pairs: list[tuple[str, Any]]) -> dict:
    data: dict = {}
    for key, value in pairs:
        if key in data:
            raise DuplicateKey(key, data[key], value)
        data[key] = value
    return data


def loads_json(text: str | bytes | bytearray, unique_keys: bool = False) -> Any:
    """json.loads(text), but an integer of more than MAX_INT_DIGITS digits is refused: IntegerTooLong, a
    json.JSONDecodeError at it. unique_keys: an object that gives a key twice is refused too (DuplicateKey, naming
    the key and both values), as attnlab's YAML and JSON configs are (config_io.StrictLoader); for files written by
    hand or by other programs (a Hugging Face model folder's)."""
    return json.loads(text, cls=BoundedDecoder, object_pairs_hook=_unique if unique_keys else None)
