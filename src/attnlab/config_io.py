"""YAML and plain data -> validated configs: strict, every problem reported at once, with the file named.

config.py holds the dataclasses; the attention registry parses the `attention:` section (each variant's
own config class); this module puts them together for a whole model config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from attnlab.attention.registry import parse_attention
from attnlab.config import MemoryConfig, ModelConfig, build_collecting, dataclass_kwargs
from attnlab.errors import ConfigError


def memory_from_dict(data: Any, problems: list[str]) -> MemoryConfig | None:
    kwargs = dataclass_kwargs(MemoryConfig, data if data is not None else {}, "memory.", problems)
    return None if problems else build_collecting(MemoryConfig, kwargs, problems)


def model_config_from_dict(data: Any, source: str | None = None) -> ModelConfig:
    """Builds a validated ModelConfig from plain data; raises one ConfigError listing every problem."""
    problems: list[str] = []
    if isinstance(data, dict) and set(data) == {"model"}:
        data = data["model"]
    kwargs = dataclass_kwargs(ModelConfig, data, "", problems, skip=("attention", "memory"))
    attention = parse_attention(data.get("attention", {}) if isinstance(data, dict) else {}, problems)
    memory = memory_from_dict(data.get("memory", {}) if isinstance(data, dict) else {}, problems)
    if problems:
        raise ConfigError(problems, source=source)
    try:
        return ModelConfig(attention=attention, memory=memory, **kwargs)
    except ConfigError as e:
        raise e.with_source(source) if source else e from None


def read_yaml(path: str | Path) -> Any:
    """A YAML file's data ({} when empty); a missing file or bad YAML is a ConfigError naming the file."""
    path = Path(path)
    if not path.exists():
        raise ConfigError("file not found (check the path)", source=str(path))
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"not valid YAML{at}: {getattr(e, 'problem', e)}", source=str(path)) from None
    return data if data is not None else {}


def load_config(path: str | Path) -> ModelConfig:
    """Reads a model config YAML file (top-level keys = ModelConfig fields, or one `model:` key)."""
    return model_config_from_dict(read_yaml(path), source=str(path))
