"""Typed errors and warnings. The CLI turns any `AttnlabError` into one clear line and exit code 2, and an
`AttnlabWarning` (e.g. a `LengthWarning`) into one line on stderr."""

from __future__ import annotations


class AttnlabError(Exception):
    """Base class for user-facing errors (bad config, bad input, missing data)."""


class ConfigError(AttnlabError, ValueError):
    """A configuration has one or more problems; `problems` lists every one of them."""

    def __init__(self, problems: list[str] | str, source: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("; ".join(prefix + p for p in self.problems))

    def with_source(self, source: str) -> ConfigError:
        """The same problems, attributed to a file."""
        return ConfigError(self.problems, source=source)


class InputError(AttnlabError, ValueError):
    """A call's input cannot be used (e.g. a prompt longer than the model allows)."""


class DataError(AttnlabError):
    """A dataset or file is missing or malformed."""


class AttnlabWarning(UserWarning):
    """Something the user should know (e.g. a slower fallback was taken); the CLI prints it as one line."""


class LengthWarning(AttnlabWarning):
    """A request was cut to fit a limit, e.g. more new tokens asked than a model's max_seq_len leaves room for.
    `warnings.simplefilter("error", LengthWarning)` turns it into an error."""


class VocabularyWarning(AttnlabWarning):
    """A fitted tokenizer has fewer ids than asked: its training text allowed no more merges (or words)."""


class UnquantizedWarning(AttnlabWarning):
    """A KV policy that quantizes nothing in this use: its full-precision residual window holds every token."""


class DivergedError(AttnlabError, FloatingPointError):
    """Training diverged (a non-finite loss): the run's settings, not a bug, are to blame."""


def given(value) -> str:
    """How an error names a value of the wrong kind: its type, then its repr cut to 40 characters (e.g. "str
    'configs/models/tiny.yaml'", "dict {'d_model': 32}")."""
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"{type(value).__name__} {shown}"


def check_flags(**flags) -> None:
    """InputError naming every flag that is not True or False (a string such as 'no' would read as True)."""
    wrong = [f"{key}={value!r}" for key, value in flags.items() if not isinstance(value, bool)]
    if wrong:
        raise InputError(f"{' and '.join(wrong)} must be True or False")
