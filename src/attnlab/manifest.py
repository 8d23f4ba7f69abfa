"""YAML manifests: variables, defaults, targets (model + data/train overrides, optional phases), seeds.

    name: quickstart                 # optional (default: the file name)
    vars: {lr: 0.002}
    seeds: [0, 1]
    defaults: {model: {...}, data: {...}, train: {lr: ${lr}}}
    targets:
      baseline: {model: {attention: {kind: mha}}}
      dba:
        model: {attention: {kind: decoupled, d_sem: 32, d_geo: 64}}
        phases:                      # optional: train, then continue from the previous phase's weights
          - {name: short, train: {steps: 400}}
          - {name: long, train: {steps: 100, seq_len: 512}}
      dba_bounded:
        init_from: dba                 # optional: start from another (earlier) target's last phase
        model: {memory: {kind: bounded}}   # a phase may add a bounded memory (its gates start fresh)

A target's config is the defaults deep-merged with its own sections (an `attention` block whose `kind`
differs from the default's replaces it whole); a phase merges on top of its target; `--set a.b=v`
overrides go on top of everything. `model.vocab_size` may be left out: the tokenizer's is used. Strict
throughout: unknown keys and undefined ${vars} are errors naming the file, the key path and the nearest
valid name, all reported at once.
"""

from __future__ import annotations

import copy
import difflib
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from attnlab.config import DataConfig, ModelConfig, TrainConfig, section_from_dict, unknown_key_problem
from attnlab.config_io import model_config_from_dict, read_yaml
from attnlab.errors import ConfigError

TOP_KEYS = ("name", "description", "vars", "seeds", "defaults", "targets")
SECTION_KEYS = ("model", "data", "train")
TARGET_KEYS = ("description", "phases", "init_from", *SECTION_KEYS)
PHASE_KEYS = ("name", *SECTION_KEYS)
VAR = re.compile(r"\$\{([^}]*)\}")
PLACEHOLDER_VOCAB = {"gpt2": 50257, "byte": 260, "word": 33280, "char": 256}


@dataclass(frozen=True)
class RunSpec:
    """One run: a target, a seed and a phase, fully resolved."""

    target: str
    seed: int
    phase: str | None
    model: dict  # ModelConfig fields; vocab_size may be absent until the tokenizer is known
    data: DataConfig
    train: TrainConfig
    init_from: str | None = None  # first phase only: start from this target's last phase (same seed)

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        model = dict(self.model)
        if "vocab_size" not in model:
            model["vocab_size"] = vocab_size or placeholder_vocab(self.data.tokenizer)
        return model_config_from_dict(model, source=f"target {self.target}")

    def run_dir(self, root: Path) -> Path:
        path = Path(root) / self.target / f"seed{self.seed}"
        return path / self.phase if self.phase else path


@dataclass(frozen=True)
class Manifest:
    name: str
    path: Path
    seeds: tuple[int, ...]
    runs: tuple[RunSpec, ...]  # targets x seeds x phases, in order

    @property
    def targets(self) -> list[str]:
        return list(dict.fromkeys(r.target for r in self.runs))


def placeholder_vocab(tokenizer: str) -> int:
    if tokenizer.startswith("bpe:"):
        return int(tokenizer[4:])
    return PLACEHOLDER_VOCAB.get(tokenizer, 256)


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if key == "attention" and isinstance(value, dict) and isinstance(out.get(key), dict):
            if value.get("kind", out[key].get("kind")) != out[key].get("kind", "mha"):
                out[key] = copy.deepcopy(value)  # another kind: the default's options do not apply
                continue
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def substitute(value: Any, variables: dict, where: str, problems: list[str]) -> Any:
    """Replaces ${name}: a value that is exactly '${name}' keeps the variable's type."""
    if isinstance(value, dict):
        return {k: substitute(v, variables, f"{where}.{k}" if where else str(k), problems) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, variables, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value
    for name in VAR.findall(value):
        if name not in variables:
            close = difflib.get_close_matches(name, list(variables), n=1, cutoff=0.5)
            hint = f" (did you mean ${{{close[0]}}}?)" if close else f" (defined: {', '.join(variables) or 'none'})"
            problems.append(f"{where}: undefined variable ${{{name}}}{hint}")
    whole = VAR.fullmatch(value)
    if whole:
        return variables.get(whole.group(1), value)
    return VAR.sub(lambda m: str(variables.get(m.group(1), m.group(0))), value)


def parse_set(assignments: list[str] | tuple[str, ...]) -> dict:
    """['train.lr=3e-4', 'model.attention.d_sem=64'] -> nested dict; values parsed as YAML scalars."""
    out: dict = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts) or parts[0] not in SECTION_KEYS:
            raise ConfigError(f"--set {item!r} must look like model.KEY=VALUE, data.KEY=VALUE or train.KEY=VALUE")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    return out


def _check_keys(data: Any, allowed: tuple[str, ...], where: str, problems: list[str]) -> dict:
    if not isinstance(data, dict):
        problems.append(f"{where or 'manifest'} must be a mapping, got {type(data).__name__}")
        return {}
    for key in data:
        if key not in allowed:
            problems.append(unknown_key_problem(str(key), list(allowed), f"{where}." if where else ""))
    return data


def _resolve_sections(config: dict, where: str, problems: list[str], spec: dict) -> None:
    """Validates one fully merged {model, data, train} config; records problems; fills spec."""
    try:
        spec["data"] = section_from_dict(DataConfig, config.get("data"), "data.")
    except ConfigError as e:
        problems.extend(f"{where}: {p}" for p in e.problems)
    try:
        spec["train"] = section_from_dict(TrainConfig, config.get("train"), "train.")
    except ConfigError as e:
        problems.extend(f"{where}: {p}" for p in e.problems)
    model = config.get("model")
    if not isinstance(model, dict):
        problems.append(f"{where}: model must be a mapping")
        return
    tokenizer = spec["data"].tokenizer if "data" in spec else "gpt2"
    try:
        model_config_from_dict({"vocab_size": placeholder_vocab(tokenizer), **model})
        spec["model"] = model
    except ConfigError as e:
        problems.extend(f"{where}.model: {p}" for p in e.problems)


def load_manifest(path: str | Path, sets: list[str] | tuple[str, ...] = ()) -> Manifest:
    """Reads and fully resolves a manifest; raises one ConfigError listing every problem."""
    path = Path(path)
    raw = read_yaml(path)
    problems: list[str] = []
    raw = _check_keys(raw, TOP_KEYS, "", problems)
    variables = raw.get("vars") or {}
    if not isinstance(variables, dict):
        problems.append("vars must be a mapping of names to values")
        variables = {}
    defaults = _check_keys(raw.get("defaults") or {}, SECTION_KEYS, "defaults", problems)
    defaults = substitute(defaults, variables, "defaults", problems)
    seeds = raw.get("seeds", [0])
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    ):
        problems.append(f"seeds={seeds!r} must be a non-empty list of integers")
        seeds = [0]
    targets = raw.get("targets")
    if not isinstance(targets, dict) or not targets:
        problems.append("targets must be a non-empty mapping of target names to configs")
        targets = {}
    overrides = parse_set(sets)
    runs = []
    for name, target in targets.items():
        where = f"targets.{name}"
        target = _check_keys(target if target is not None else {}, TARGET_KEYS, where, problems)
        target = substitute(target, variables, where, problems)
        base = deep_merge(defaults, {k: v for k, v in target.items() if k in SECTION_KEYS})
        phases = target.get("phases") or [{}]
        if not isinstance(phases, list):
            problems.append(f"{where}.phases must be a list")
            continue
        start_from = target.get("init_from")
        if start_from is not None and (
            start_from not in targets or list(targets).index(start_from) >= list(targets).index(name)
        ):
            earlier = [t for t in list(targets)[: list(targets).index(name)]]
            problems.append(
                f"{where}.init_from={start_from!r} must name an earlier target ({', '.join(earlier) or 'none'})"
            )
        phase_names = []
        for i, phase in enumerate(phases):
            phase = _check_keys(phase, PHASE_KEYS, f"{where}.phases[{i}]", problems)
            phase_name = phase.get("name") if len(phases) > 1 else None
            if len(phases) > 1 and not phase_name:
                problems.append(f"{where}.phases[{i}] needs a name (phases are saved in folders by name)")
            phase_names.append(phase_name)
            merged = deep_merge(deep_merge(base, {k: v for k, v in phase.items() if k in SECTION_KEYS}), overrides)
            spec: dict = {}
            _resolve_sections(merged, where + (f".phases[{i}]" if len(phases) > 1 else ""), problems, spec)
            if len(spec) == 3:
                for seed in seeds:
                    runs.append(RunSpec(name, seed, phase_name, spec["model"], spec["data"],
                                        replace(spec["train"], seed=seed), start_from if i == 0 else None))  # fmt: skip
        if len(set(phase_names)) != len(phase_names):
            problems.append(f"{where}.phases: names must be unique")
    if problems:
        raise ConfigError(problems, source=str(path))
    runs.sort(key=lambda r: (list(targets).index(r.target), seeds.index(r.seed)))  # stable: phases keep order
    return Manifest(raw.get("name") or path.stem, path, tuple(seeds), tuple(runs))


def is_manifest(path: str | Path) -> bool:
    """True when a YAML file looks like a manifest (has `targets`) rather than a model config."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and "targets" in data
