"""Typed errors. The CLI turns any `AttnlabError` into one clear message and exit code 2."""

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
