"""YAML and plain data -> validated configs: strict, every problem reported at once, with the file named.

config.py holds the dataclasses; the attention registry parses the `attention:` section (each variant's
own config class); this module puts them together for a whole model config.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from attnlab.attention.registry import parse_attention
from attnlab.config import MemoryConfig, ModelConfig, RopeScaling
from attnlab.config_checks import Quoted, build_collecting, dataclass_kwargs
from attnlab.config_memory import misplaced_options, misplaced_problem
from attnlab.data.files import unreachable
from attnlab.errors import ConfigError, InputError, given
from attnlab.jsonio import MAX_INT_BITS, MAX_INT_DIGITS, too_many_digits
from attnlab.paths import brief, unprintable_problem


def memory_from_dict(data: Any, problems: list[str], saved: bool = False) -> MemoryConfig | None:
    """The `memory:` section; problems are appended. An option of another kind than its memory.kind is refused
    whatever its value (it would do nothing); `saved`: the section is MemoryConfig.to_dict's (a run's, a
    checkpoint's or a conversion's config), which holds the first options' defaults under every kind (for its
    hash), so only one away from its default is refused."""
    data = data if data is not None else {}
    if isinstance(data, dict) and not saved:
        misplaced = misplaced_options(data)
        problems += [misplaced_problem(key, data.get("kind", "none")) for key in misplaced]
        data = {key: value for key, value in data.items() if key not in misplaced}
    kwargs = dataclass_kwargs(MemoryConfig, data, "memory.", problems)
    return None if problems else build_collecting(MemoryConfig, kwargs, problems)


def rope_scaling_from_dict(data: Any, problems: list[str]) -> RopeScaling | None:
    """The `rope_scaling:` section (null or absent: plain RoPE)."""
    if data is None:
        return None
    kwargs = dataclass_kwargs(RopeScaling, data, "rope_scaling.", problems)
    return None if problems else build_collecting(RopeScaling, kwargs, problems)


def model_config_from_dict(data: Any, source: str | None = None, saved: bool = False) -> ModelConfig:
    """Builds a validated ModelConfig from plain data; raises one ConfigError listing every problem. `saved`: the
    data is ModelConfig.to_dict's (read back from a run, a checkpoint, a conversion; memory_from_dict)."""
    problems: list[str] = []
    if isinstance(data, dict) and set(data) == {"model"}:
        data = data["model"]
    kwargs = dataclass_kwargs(ModelConfig, data, "", problems, skip=("attention", "memory", "rope_scaling"))
    attention = parse_attention(data.get("attention", {}) if isinstance(data, dict) else {}, problems)
    memory = memory_from_dict(data.get("memory", {}) if isinstance(data, dict) else {}, problems, saved)
    rope_scaling = rope_scaling_from_dict(data.get("rope_scaling") if isinstance(data, dict) else None, problems)
    name = kwargs.get("name") if not saved else None  # shown in lines, as a manifest's name (saved ones load)
    named = [p] if isinstance(name, str) and (p := unprintable_problem(name, "name")) else []
    if problems:
        raise ConfigError(problems + named, source=source)
    try:
        config = ModelConfig(attention=attention, memory=memory, rope_scaling=rope_scaling, **kwargs)
    except ConfigError as e:
        raise ConfigError(e.problems + named, source=source or e.source) from None
    if named:
        raise ConfigError(named, source=source)
    return config


class IntTooLarge(yaml.constructor.ConstructorError):
    """An integer of more digits than Python converts (jsonio.MAX_INT_DIGITS): no setting is anywhere near."""


class Yaml11Number(yaml.constructor.ConstructorError):
    """A number or boolean only YAML 1.1 reads so (010, 1:30, 1_000, 0b1100, yes, off): YAML 1.2 reads another
    number or a string."""


class DuplicateKey(yaml.constructor.ConstructorError):
    """A mapping key given twice: valid YAML and JSON (whose loaders keep the last), refused here."""


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML would keep the last silently).
    Keys a merge brings in (`<<: *anchor`) may still be overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # SafeLoader's own error ("found unhashable key") follows
            if key in first_line:
                raise DuplicateKey(
                    problem=f"key {brief(key)} is given twice (first at line {first_line[key]}; keep one)",
                    problem_mark=key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """YAML 1.1's integers but the two forms that read as another number than written: a leading zero (010 is
        octal 8) and base 60 (1:30 is 90). Refused, as YAML 1.2 reads neither so; and so are the forms YAML 1.2 reads
        as strings (1_2 and binary 0b1100 are 12 only in YAML 1.1; hex 0xC is 12 in both). So is an integer of more
        digits than Python converts (jsonio.MAX_INT_DIGITS): far too large for any setting, and it would fail to
        read."""
        text = str(node.value).replace("_", "").lstrip("+-")
        if too_many_digits(text):
            raise self._too_large(node, f"an integer of {sum(c.isalnum() for c in text)} digits")
        value = super().construct_yaml_int(node)
        if value.bit_length() > MAX_INT_BITS:  # fewer digits, in hex or binary, but still too many to print
            raise self._too_large(node, f"an integer of {value.bit_length()} bits")
        if ":" in text or (len(text) > 1 and text[0] == "0" and text[1].isdigit()):
            form = "base 60" if ":" in text else "octal (a leading zero)"
            raise Yaml11Number(
                problem=f"{node.value} reads in YAML 1.1 as {form}, the number {value}: write {value} if that is "
                f"meant, the digits without the leading zero{' or colon' if ':' in text else ''} if not, or quote it "
                "for a string",
                problem_mark=node.start_mark,
            )
        if "_" in str(node.value) or text[:2].lower() == "0b":
            raise self._yaml_11_only(node, value, "binary" if text[:2].lower() == "0b" else "its underscores dropped")
        return value

    @staticmethod
    def _yaml_11_only(node: yaml.ScalarNode, value, form: str) -> Yaml11Number:
        """The error for a number only YAML 1.1 reads (1_000, 0b1100): YAML 1.2 (and other tools reading the file)
        reads a string there."""
        return Yaml11Number(
            problem=f"{node.value} is a number only in YAML 1.1 ({form}: {value}), a string in YAML 1.2: write "
            f"{value} if that is meant, or quote it for a string",
            problem_mark=node.start_mark,
        )

    @staticmethod
    def _too_large(node: yaml.ScalarNode, what: str) -> IntTooLarge:
        return IntTooLarge(
            problem=f"{what}, far too large for any setting (at most {MAX_INT_DIGITS} digits): write the number "
            "meant, or quote it for a string",
            problem_mark=node.start_mark,
        )

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        """YAML 1.1's floats but base 60 (1:30.5 is 90.5) and underscores (1_0.5), refused as construct_yaml_int
        refuses 1:30 and 1_0."""
        value = super().construct_yaml_float(node)
        if ":" in str(node.value):
            raise Yaml11Number(
                problem=f"{node.value} reads in YAML 1.1 as base 60, the number {value}: write {value} if that is "
                "meant, or quote it for a string",
                problem_mark=node.start_mark,
            )
        if "_" in str(node.value):
            raise self._yaml_11_only(node, value, "its underscores dropped")
        return value

    def construct_yaml_str(self, node: yaml.ScalarNode) -> str:
        """A quoted scalar is Quoted (text the file meant as text: a number field refuses "0.003"); written out again
        (config.yaml) as a plain string."""
        value = super().construct_yaml_str(node)
        return Quoted(value) if node.style in ("'", '"') else value

    def construct_yaml_bool(self, node: yaml.ScalarNode) -> bool:
        """true and false (any case YAML 1.2 allows); yes, no, on and off are booleans only in YAML 1.1 (YAML 1.2
        and other tools read strings): refused, as construct_yaml_int refuses 1_000."""
        value = super().construct_yaml_bool(node)
        meant = str(value).lower()
        if str(node.value) not in ("true", "True", "TRUE", "false", "False", "FALSE"):
            raise Yaml11Number(
                problem=f"{node.value} is a boolean only in YAML 1.1 ({meant}), a string in YAML 1.2: write {meant} "
                "if that is meant, or quote it for a string",
                problem_mark=node.start_mark,
            )
        return value


StrictLoader.add_constructor("tag:yaml.org,2002:bool", StrictLoader.construct_yaml_bool)
StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)
StrictLoader.add_constructor("tag:yaml.org,2002:str", StrictLoader.construct_yaml_str)
yaml.SafeDumper.add_representer(Quoted, yaml.representer.SafeRepresenter.represent_str)

MAX_DEPTH = 100  # levels of nesting a config may have (its deepest is a handful): deeper is a mistake or an attack


class TooDeep(yaml.YAMLError):
    """YAML nested more than MAX_DEPTH levels (or too deeply for PyYAML's recursion)."""

    def __str__(self) -> str:
        return f"nested too deeply to be a config (more than {MAX_DEPTH} levels of lists or mappings)"


MAX_VALUES = 1_000_000  # values a config may hold once its aliases are expanded (its largest hold thousands)


class TooLarge(TooDeep):
    """YAML whose aliases (`*name` of an `&name` anchor) expand to more than MAX_VALUES values: a few lines of nested
    aliases make billions, which whatever reads the config would walk without end."""

    def __str__(self) -> str:
        return (f"expands to more than {MAX_VALUES:,} values through its aliases (*name of an &name anchor, nested): "
                "write the values out, or use fewer aliases of aliases")  # fmt: skip


def _too_big(data: Any) -> yaml.YAMLError | None:
    """TooDeep when lists/mappings nest more than MAX_DEPTH levels in `data`, TooLarge when it holds more than
    MAX_VALUES values with each alias counted where it is used (a cycle of aliases nests without end); None
    otherwise. One walk, iterative (no recursion), stopping at the first limit passed."""
    stack, count = [(data, 1)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            return TooLarge()
        if not isinstance(node, (list, dict)):
            continue
        if depth > MAX_DEPTH:
            return TooDeep()
        children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children)
    return None


def yaml_problem(e: yaml.YAMLError, text: str = "") -> str:
    """A PyYAML error as one line: `not valid YAML at line L, column C: what`."""
    if isinstance(e, TooDeep):
        return str(e)
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    if isinstance(e, yaml.reader.ReaderError):  # a character YAML does not allow (a control character)
        line = text.count("\n", 0, e.position) + 1
        character = f"{e.character:#04x}" if isinstance(e.character, int) else repr(e.character)
        return f"not valid YAML at line {line}: {e.reason} (character {character})"
    what = " ".join(str(getattr(e, "problem", None) or e).split())  # one line
    if isinstance(e, DuplicateKey):  # valid YAML (and JSON) that attnlab refuses: not said as a syntax error
        return f"{at.strip().removeprefix('at ')}: {what}"
    return f"not valid YAML{at}: {what}"


def parse_yaml(text: str) -> Any:
    """YAML text -> data, strictly (StrictLoader); raises yaml.YAMLError (TooDeep for data nested more than
    MAX_DEPTH levels, which would exhaust the recursion of whatever reads it; TooLarge for aliases that expand to
    more than MAX_VALUES values)."""
    try:
        data = yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader)
    except RecursionError:
        raise TooDeep() from None
    problem = _too_big(data)
    if problem is not None:
        raise problem
    return data


def read_yaml(path: str | Path) -> Any:
    """A YAML file's data ({} when empty). A missing or unreadable file, text that is not UTF-8, bad YAML or a
    key given twice is a ConfigError naming the file (and the line)."""
    path = Path(path)
    problem = unreachable(path)
    if problem:
        raise ConfigError(problem, source=str(path))
    mode = path.stat().st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a FIFO would wait for a writer without end (a folder: below)
        raise ConfigError("is not a regular file (a FIFO, socket or device): give the YAML file itself",
                          source=str(path))  # fmt: skip
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}): save the file as UTF-8",
            source=str(path),
        ) from None
    except OSError as e:
        raise ConfigError(f"cannot read the file ({e.strerror or e})", source=str(path)) from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(yaml_problem(e, text), source=str(path)) from None
    return data if data is not None else {}


def load_config(path: str | Path) -> ModelConfig:
    """Reads a model config YAML file (top-level keys = ModelConfig fields, or one `model:` key)."""
    if not isinstance(path, str | os.PathLike):
        held = " (a dict of config keys: attnlab.model_config_from_dict(data) reads it)" * isinstance(path, dict)
        raise InputError(f"load_config takes the path of a YAML file, got {given(path)}{held}")
    data = read_yaml(path)
    what = file_words(data)
    if what is not None:  # (not each of its keys said unknown, with a model key's name for each)
        raise ConfigError(f"is {what[1]}, not a model config", source=str(path))
    if data == {}:  # (not four "missing key" lines for a file that holds nothing)
        raise ConfigError("holds no keys (an empty file, or {}): a model config gives at least vocab_size, d_model, "
                          "n_layers and n_heads", source=str(path))  # fmt: skip
    return model_config_from_dict(data, source=str(path))


FILE_KINDS = (("targets", "manifest", "a run manifest (it has targets:)"),
              ("benchmarks", "bench", "a benchmark manifest (it has benchmarks:)"),
              ("cases", "probes", "a probe suite (it has cases:)"))  # fmt: skip


def file_words(data) -> tuple[str, str] | None:
    """(kind, how it reads) of a YAML file's content by the key that makes it one: a run manifest (`targets`), a
    benchmark manifest (`benchmarks`), a probe suite (`cases`); None for anything else (a model config)."""
    if isinstance(data, dict):
        for key, kind, words in FILE_KINDS:
            if key in data:
                return kind, words
    return None


GGUF_MAGIC = b"GGUF"
MODEL_KEYS = {"vocab_size", "d_model", "n_layers"}  # a model config has some of these (a Hugging Face one, model_type)
OTHER_FILE_KEYS = {"defaults", "description", "seeds", "checkpoints", "phases"}  # the other files', not a model's


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a regular file beginning as a GGUF model file does."""
    if not Path(path).is_file():  # before opening: a FIFO would wait for a writer without end
        return False
    try:
        with open(path, "rb") as file:
            return file.read(4) == GGUF_MAGIC
    except OSError:
        return False


def other_config(path: str | Path) -> str | None:
    """What a YAML or JSON file that a model config's checks refused is, when it is recognisably something else: a
    GGUF model file, an attnlab run's or checkpoint's saved config (model, data, train), a Hugging Face config.json,
    or a mapping without a model config's keys. None when it looks like a model config with mistakes (whose
    problems are then the ones to say). Read errors were said by the checks already: they give None here."""
    if is_gguf(path):
        return "a GGUF model file, not a config"
    try:
        data = read_yaml(path)
    except ConfigError:
        return None
    if not isinstance(data, dict) or not data:  # (nothing in it: load_config says so)
        return None
    if "model_type" in data:
        return "a Hugging Face model's config (model_type), not an attnlab model config"
    if isinstance(data.get("model"), dict) and ({"data", "train"} & data.keys()):
        return "an attnlab run's saved config (model, data, train), not a model config"
    if not MODEL_KEYS & data.keys() and OTHER_FILE_KEYS & data.keys():  # (a probe suite without its cases)
        return ("not a model config, nor a manifest (targets:), benchmark manifest (benchmarks:) or probe suite "
                f"(cases:), whose keys it lacks (it has {', '.join(map(str, data))})")  # fmt: skip
    json_file = Path(path).suffix.lower() == ".json"  # (a YAML file's keys mistyped get their nearest names)
    return "not a model config" if json_file and not MODEL_KEYS & data.keys() else None
