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
        init_from: dba                 # optional: start from another (earlier) target's last phase, with its
        model:                         # attention repeated (the defaults' would not fit its weights) and a
          attention: {kind: decoupled, d_sem: 32, d_geo: 64}    # bounded memory added (its gates start fresh)
          memory: {kind: bounded}
      smollm_mqa:
        init_from: models/SmolLM2-135M-Instruct.Q4_1.gguf   # or a pretrained model (any model reference)
        model: {attention: {kind: mha, n_kv_heads: 1}}      # converted first (attnlab convert); data.tokenizer
                                                            # defaults to the model's

`init_from` may name a model reference instead of a target (a .gguf file, a model folder, an attnlab
checkpoint, hf:ORG/NAME; a relative path is looked up in the working directory, then in the data
directories), or be a mapping {model: REF, rope_pairs: energy, calibration_tokens: 4096, calibrate_on:
wikitext2-nounk} with `attnlab convert`'s options. Such a target's `model` section holds changes to the
pretrained model's config, and only those a conversion can initialise from its weights (attention, memory,
max_seq_len, name); its runs start from the converted model, saved once per target in <target>/converted (a
checkpoint folder: the cold model, which every command takes as a reference). A target whose init_from names such
a target continues from its weights and lists its changes the same way (a memory, say); it keeps that target's
attention (left out, it is taken from there). A target continuing one trained from scratch (dba_bounded above) is
merged with the defaults as any target is: it repeats that target's attention where the defaults name another.

A target's config is the defaults deep-merged with its own sections (an `attention` block whose `kind`
differs from the default's replaces it whole); a phase merges on top of its target; `--set a.b=v`
overrides go on top of everything. `model.vocab_size` may be left out: the tokenizer's is used. Strict
throughout: unknown keys, undefined ${vars} (a variable may use another; a cycle is refused), a key given twice
and values of the wrong type are errors naming the file, the key path and the nearest valid name, all reported at
once.

Everything `attnlab run` would refuse once a run starts is refused here, so `validate` and `run --dry-run`
catch it: names that are not plain folder names (the manifest's, targets', phases'; attnlab.paths.name_problem),
seeds outside 0 .. 2^32 - 1 or given twice, a train.seed (`seeds` would override it), an unknown data source or
tokenizer, an init_from's calibrate_on that is neither a dataset nor a text file or calibration_tokens too few to
fit on (1), a model vocab_size smaller than a fixed tokenizer's (gpt2, byte), a data.max_tokens that holds no
training window, train.eval_tokens below train.seq_len, a batch whose activations cannot fit this machine's
memory (train.budget), a phase or init_from target whose model cannot start from the weights it continues (other
shapes, the same read otherwise: train.warm_start; another tokenizer, or a fitted tokenizer on other data), and
train.seq_len above the model's max_seq_len. The last holds with a memory too (memory.kind != none): such a model
reads streams of any length when it scores or generates, but it trains on sequences of at most max_seq_len (raise
model.max_seq_len to train on longer ones; the trainer refuses them as well). Whether a local data file exists
depends on --data-dir: `run` checks it (dry runs included) before the first run starts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from attnlab.config import (
    DATA_SOURCES,
    MAX_SEED,
    DataConfig,
    ModelConfig,
    TrainConfig,
    checkpointing_memory_problem,
    names_model,
    section_from_dict,
    trainable_string_problem,
    untrainable_memory_problem,
)
from attnlab.config_checks import idle_option_problems, unknown_key_problem
from attnlab.config_io import file_words, model_config_from_dict, read_yaml
from attnlab.errors import ConfigError
from attnlab.jsonio import loads_json
from attnlab.manifest_pretrained import (
    conversion_options_problem,
    init_from_hint,
    missing_model_problems,
    plain_name_problem,
    pretrained_model_problems,
    pretrained_source,
)
from attnlab.manifest_select import merged_repeats, needed_targets, owned_problems
from attnlab.manifest_sets import SECTION_KEYS, parse_set
from attnlab.manifest_vars import check_vars, resolve_vars, substitute, undefined_keys
from attnlab.model.transformer import build_model
from attnlab.paths import brief, name_problem
from attnlab.train.budget import batch_memory_problem, positions_memory_problem
from attnlab.train.optim import trainable_problem
from attnlab.train.warm_start import architecture_problem

TOP_KEYS = ("name", "description", "vars", "seeds", "defaults", "targets")
TARGET_KEYS = ("description", "phases", "init_from", *SECTION_KEYS)
PHASE_KEYS = ("name", *SECTION_KEYS)
PLACEHOLDER_VOCAB = {"gpt2": 50257, "byte": 260, "word": 33280, "char": 256}
FIXED_VOCAB = {"gpt2": 50257, "byte": 257}  # tokenizers whose vocabulary does not depend on the data
OWN_SPLITS = tuple(s for s in DATA_SOURCES if s.startswith("wikitext"))  # with val/test files (others: by hash)
# init_from a pretrained model: the conversion's options (attnlab convert's) and what `model` may change


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
    # A pretrained model the target is converted from ({model: REF, rope_pairs, calibration_tokens, calibrate_on,
    # target: the target whose conversion it is, this one's or the one it continues through init_from}), on every
    # phase: `model` then holds changes to that model's config (PRETRAINED_CHANGES), not a whole config.
    source: dict | None = None

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        if self.source is not None:
            raise ConfigError(f"target {self.target}: its model is {self.source['model']}, converted (the runner "
                              "builds its config: attnlab.runner.pretrained_config)")  # fmt: skip
        model = dict(self.model)
        if "vocab_size" not in model:
            model["vocab_size"] = vocab_size if vocab_size is not None else placeholder_vocab(self.data.tokenizer)
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


KIND_DEFAULTS = {"attention": "mha", "memory": "none"}  # the sections whose options depend on their kind


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if key in KIND_DEFAULTS and isinstance(value, dict) and isinstance(out.get(key), dict):
            if value.get("kind", out[key].get("kind")) != out[key].get("kind", KIND_DEFAULTS[key]):
                out[key] = copy.deepcopy(value)  # another kind: the default's options do not apply
                continue
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _check_keys(data: Any, allowed: tuple[str, ...], where: str, problems: list[str]) -> dict:
    """`data` when a mapping ({} when None) with only `allowed` keys (each other key is a problem) and, for the
    model/data/train sections among them, mapping (or null) values; the keys that pass."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        problems.append(f"{where or 'manifest'} must be a mapping, got {type(data).__name__}")
        return {}
    out = {}
    for key, value in data.items():
        if key not in allowed:
            problems.append(unknown_key_problem(str(key), list(allowed), f"{where}." if where else ""))
        elif key in SECTION_KEYS and value is not None and not isinstance(value, dict):
            problems.append(f"{where + '.' if where else ''}{key} must be a mapping, got {type(value).__name__}")
        elif key == "description" and value is not None and not isinstance(value, str):
            problems.append(f"{where + '.' if where else ''}description must be text, got {type(value).__name__}")
        else:
            out[key] = {} if key in SECTION_KEYS and value is None else value  # `model:` alone changes nothing
    return out


def _run_tokenizer(ref: str) -> str | None:
    """The data.tokenizer an attnlab run or checkpoint folder was trained with (its config.json's), else None."""
    try:
        config = loads_json((Path(ref) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    data = config.get("data") if isinstance(config, dict) else None
    return data.get("tokenizer") if isinstance(data, dict) and isinstance(data.get("tokenizer"), str) else None


def _given_keys(layers) -> dict[str, set]:
    """The keys of the model and data sections the given layers (a target, a phase, the --set overrides) write."""
    keys: dict[str, set] = {"model": set(), "data": set()}
    for layer in layers:
        for section in keys:
            value = layer.get(section) if isinstance(layer, dict) else None
            keys[section] |= set(value) if isinstance(value, dict) else set()
    return keys


def _resolve_sections(config: dict, where: str, problems: list[str], spec: dict, pretrained: bool = False,
                      inherited: tuple[str, set] = ("", set())) -> None:  # fmt: skip
    """Validates one fully merged {model, data, train} config; records problems; fills spec. `pretrained`: the
    model section holds changes to a pretrained model's config (checked against that model by the runner).
    inherited: (the target's name, the model keys it takes from `defaults` alone), to blame them on defaults."""
    if isinstance(config.get("train"), dict) and "seed" in config["train"]:
        problems.append(
            f"{where}: train.seed={brief(config['train']['seed'])} would be ignored: each run's seed comes from the "
            "manifest's `seeds` (remove train.seed; list the seeds in seeds: [...])"
        )
    try:
        spec["data"] = section_from_dict(DataConfig, config.get("data"), "data.")
    except ConfigError as e:
        problems.extend(f"{where}: {p}" for p in e.problems)
    data = spec.get("data")
    if data is not None and data.val_fraction == 0 and data.source not in OWN_SPLITS:
        # Training scores the validation split (every eval_every steps and at the end): it would be refused then,
        # after writing the run's folder.
        problems.append(
            f"{where}: data.val_fraction=0 leaves data.source={brief(data.source)} no validation split (only "
            f"{', '.join(OWN_SPLITS)} have their own), and training scores one every train.eval_every steps and at "
            "its end: give data.val_fraction > 0 (e.g. 0.05)"
        )
    train = config.get("train")
    if isinstance(train, dict) and isinstance(train.get("trainable"), str):  # not a list: not one per character
        problems.append(f"{where}: {trainable_string_problem(train['trainable'])}")
        train = {key: value for key, value in train.items() if key != "trainable"}
    try:
        spec["train"] = section_from_dict(TrainConfig, train, "train.")
    except ConfigError as e:
        problems.extend(f"{where}: {p}" for p in e.problems)
    if (data is not None and "train" in spec and spec["train"].test_tokens is not None and data.test_fraction == 0
            and data.source not in OWN_SPLITS):  # fmt: skip
        # the final test score would be left out without a word: there is no test split to score
        problems.append(
            f"{where}: train.test_tokens={spec['train'].test_tokens} asks for a test score, but data.test_fraction=0 "
            f"leaves data.source={brief(data.source)} no test split (only {', '.join(OWN_SPLITS)} have their own): "
            "give data.test_fraction > 0 (e.g. 0.05), or remove train.test_tokens"
        )
    model = config.get("model")
    if model is None and pretrained:  # the pretrained model as it is
        model = {}
    if not isinstance(model, dict):
        problems.append(f"{where}: model must be a mapping")
        return
    tokenizer = spec["data"].tokenizer if "data" in spec else "gpt2"
    if pretrained:  # the whole config is the model's with these changes: checked once the model is read
        problems += pretrained_model_problems(model, where, inherited, spec.get("train"))
        spec["model"] = model
        return
    try:
        cfg = model_config_from_dict({"vocab_size": placeholder_vocab(tokenizer), **model})
    except ConfigError as e:
        problems.extend(f"{where}.model: {p}" for p in e.problems)
        return
    spec["model"] = model
    # What train() refuses before its first step, refused here (validate, run --dry-run) already.
    checkpointing = getattr(spec.get("train"), "activation_checkpointing", False)
    for problem in (untrainable_memory_problem(cfg.memory.kind),
                    checkpointing_memory_problem(checkpointing, cfg.memory.kind)):  # fmt: skip
        if problem:
            problems.append(f"{where}: {problem}")
    if "train" in spec and spec["train"].seq_len > cfg.max_seq_len:
        memory = " (a memory model too trains on at most max_seq_len tokens)" if cfg.memory.kind != "none" else ""
        problems.append(
            f"{where}: train.seq_len={spec['train'].seq_len} exceeds model.max_seq_len={cfg.max_seq_len}{memory} "
            "(lower train.seq_len or raise model.max_seq_len)"
        )
    given_train = config.get("train") if isinstance(config.get("train"), dict) else {}
    problems += [f"{where}: {p}" for p in idle_option_problems(spec, given_train, config.get("data"), OWN_SPLITS)]
    if "train" in spec and "warmup_steps" in given_train and spec["train"].warmup_steps > spec["train"].steps:
        # (the default warmup of 100 steps is not refused: a short run warms up for all its steps)
        problems.append(
            f"{where}: train.warmup_steps={spec['train'].warmup_steps} exceeds train.steps={spec['train'].steps}: "
            "the learning rate would never reach train.lr (lower warmup_steps or raise steps)"
        )
    if "train" in spec and spec["train"].trainable is not None:
        with torch.device("meta"):  # the parameters' names, without their memory
            names = [name for name, _ in build_model(cfg).named_parameters()]
        problem = trainable_problem(names, spec["train"].trainable)
        if problem:
            problems.append(f"{where}: {problem}")
    if "train" in spec:
        known = cfg.vocab_size if "vocab_size" in model else FIXED_VOCAB.get(tokenizer)
        problem = batch_memory_problem(cfg, spec["train"], known)
        if problem:
            problems.append(f"{where}: {problem}")
    problem = positions_memory_problem(cfg)  # built with the model: the run would end in the allocator
    if problem:
        problems.append(f"{where}: {problem}")
    max_tokens = spec["data"].max_tokens if "data" in spec else None
    if "train" in spec and max_tokens is not None and max_tokens <= spec["train"].seq_len:
        problems.append(
            f"{where}: data.max_tokens={spec['data'].max_tokens} leaves no training window: a window is "
            f"train.seq_len + 1 = {spec['train'].seq_len + 1} tokens (raise data.max_tokens, or leave it out)"
        )
    if "vocab_size" in model and cfg.vocab_size < FIXED_VOCAB.get(tokenizer, 0):
        problems.append(
            f"{where}: model.vocab_size={cfg.vocab_size} is smaller than tokenizer {tokenizer}'s "
            f"{FIXED_VOCAB[tokenizer]} (leave vocab_size out to take the tokenizer's)"
        )


def _check_seeds(seeds: Any, problems: list[str]) -> list[int]:
    if not isinstance(seeds, list) or not seeds:
        problems.append(f"seeds={brief(seeds)} must be a non-empty list of integers")
        return [0]
    good = []
    for i, seed in enumerate(seeds):
        if not isinstance(seed, int) or isinstance(seed, bool):
            problems.append(f"seeds[{i}]={brief(seed)} must be an integer, got {type(seed).__name__}")
        elif not 0 <= seed <= MAX_SEED:
            problems.append(f"seeds[{i}]={brief(seed)} must be in 0 .. {MAX_SEED}")
        elif seed in good:
            problems.append(f"seeds[{i}]={seed} is given twice (each seed is one run folder)")
        else:
            good.append(seed)
    return good or [0]


FITTED_TOKENIZERS = ("char", "word")  # and bpe:<N>: fitted on the training split, so their ids depend on the data
DATA_KEYS = ("source", "val_fraction", "test_fraction", "max_tokens")  # what a fitted tokenizer is fitted on


def _fitted(tokenizer: str) -> bool:
    return tokenizer in FITTED_TOKENIZERS or tokenizer.startswith("bpe:")


def _start_problem(spec: RunSpec, previous: RunSpec, where: str, whose: str) -> str | None:
    """Why `spec`'s model cannot start from the weights `previous` leaves (a previous phase, or the init_from
    target's last phase), as train() would find once `previous` is trained: another tokenizer (its ids mean other
    tokens), a fitted tokenizer (char, word, bpe) on other data, or weights of other shapes (only a memory may be
    added) or read otherwise (other heads, RoPE: warm_start.reading_changes). whose: "phase p1's", "target a's"."""
    data, before = spec.data, previous.data
    if data.tokenizer != before.tokenizer:
        return (f"{where}: data.tokenizer={data.tokenizer} is not {whose} {before.tokenizer}, whose ids its weights "
                f"read (keep data.tokenizer={before.tokenizer})")  # fmt: skip
    if _fitted(data.tokenizer):
        keys = DATA_KEYS if not data.source.startswith("wikitext") else ("source", "max_tokens")  # own splits
        for key in keys:
            if getattr(data, key) != getattr(before, key):
                return (
                    f"{where}: data.{key}={getattr(data, key)} is not {whose} {getattr(before, key)}, and tokenizer "
                    f"{data.tokenizer} is fitted on the data: its ids would not be the ones {whose} weights read "
                    f"(keep {whose} data, or use a fixed tokenizer such as byte or gpt2 in both)"
                )
    mine, theirs = dict(spec.model), dict(previous.model)
    fixed = FIXED_VOCAB.get(data.tokenizer)
    if ("vocab_size" in mine) != ("vocab_size" in theirs) and fixed is None:  # the tokenizer's: known once prepared
        given, other = ("its", f"{whose} is") if "vocab_size" in mine else (f"{whose}", "this one's is")
        size = mine.get("vocab_size", theirs.get("vocab_size"))
        return (f"{where}: {given} model.vocab_size={size} is given, {other} the tokenizer's ({data.tokenizer}, "
                "known once the data is prepared): give both the same vocab_size, or leave it out of both")  # fmt: skip
    for model in (mine, theirs):
        model.setdefault("vocab_size", fixed or placeholder_vocab(data.tokenizer))
    try:
        cfg, before_cfg = model_config_from_dict(mine), model_config_from_dict(theirs)
    except ConfigError:
        return None  # said where the config is checked
    problem = architecture_problem(cfg, before_cfg, whose)
    return f"{where}: {problem}" if problem else None


def _start_problems(runs: list[RunSpec], order: list[str]) -> list[str]:
    """_start_problem of every phase that continues a previous one and every target with init_from another
    (trained from scratch: a pretrained model's targets are checked against the model, retrofit.check_pretrained)."""
    problems = []
    seed = runs[0].seed if runs else 0
    phases = {name: [r for r in runs if r.target == name and r.seed == seed] for name in order}
    for name, specs in phases.items():
        for i, spec in enumerate(specs):
            if spec.source is not None:
                continue
            if i > 0:
                previous, whose = specs[i - 1], f"phase {specs[i - 1].phase}'s"
                where = f"targets.{name}.phases[{i}]"
            elif spec.init_from is not None and phases.get(spec.init_from):
                previous, whose = phases[spec.init_from][-1], f"target {spec.init_from}'s"
                where = f"targets.{name}"
            else:
                continue
            problem = _start_problem(spec, previous, where, whose)
            if problem:
                problems.append(problem)
    return problems


# Files `attnlab run` and `attnlab compare` write in <out>/<manifest>/, beside the targets' folders.
RESERVED_NAMES = ("manifest.json", "compare.md", "compare.csv", "val_loss.png")


def load_manifest(
    path: str | Path, sets: list[str] | tuple[str, ...] = (), data_dir=None, targets_run=None
) -> Manifest:
    """Reads and fully resolves a manifest; raises one ConfigError listing every problem. data_dir (--data-dir)
    is where an init_from model missing from the working directory may be. targets_run (`run --target`): the
    problems of other targets are not said, unless the targets run start from them (init_from)."""
    path = Path(path)
    raw = read_yaml(path)
    if isinstance(raw, dict) and "benchmarks" in raw and "targets" not in raw:  # (said as such, not as key errors)
        raise ConfigError(f"a benchmark manifest (checkpoints, benchmarks), not a run manifest: run it with `attnlab "
                          f"bench {path}`", source=str(path))  # fmt: skip
    problems: list[str] = []
    raw = _check_keys(raw, TOP_KEYS, "", problems)
    # ${name} applies anywhere (manifest_vars): in the name and the seeds too, as in defaults and targets
    variables, broken = resolve_vars(check_vars(raw.get("vars"), problems), problems)
    name = substitute(raw.get("name"), variables, "name", problems, broken)
    named = name is not None
    if not named:
        name = path.stem
        problem = name_problem(name, "the manifest's name (its file name, as no `name:` is given)")
    else:
        problem = name_problem(name, "name")
    if problem:
        problems.append(problem + ("" if named else " (set `name:`)"))
    defaults = _check_keys(raw.get("defaults"), SECTION_KEYS, "defaults", problems)
    defaults = substitute(defaults, variables, "defaults", problems, broken)
    said = len(problems)
    seeds = substitute(raw.get("seeds", [0]), variables, "seeds", problems, broken)
    seeds = _check_seeds(seeds, problems) if len(problems) == said else [0]  # (an undefined variable: said once)
    targets = raw.get("targets")
    if not isinstance(targets, dict) or not targets:
        problems.append("targets must be a non-empty mapping of target names to configs")
        targets = {}
    # --set values take the manifest's ${variables} as the manifest's own values do (`--set 'train.lr=${lr}'`)
    overrides = {k: substitute(v, variables, f"--set {k}", problems, broken) for k, v in parse_set(sets).items()}
    order = list(targets)
    runs = []
    sources: dict[str, dict | None] = {}  # each target's pretrained source (RunSpec.source)
    attentions: dict[str, dict | None] = {}  # the attention changes of a pretrained target's first phase
    refused_targets: set[str] = set()  # targets whose init_from is refused: their model problems would follow from it
    marks: list[tuple[int, str | None]] = []  # (index of a target's first problem, its name): whose each one is
    for name_, target in targets.items():
        marks.append((len(problems), None))  # (a target name refused: said whichever targets run)
        problem = name_problem(name_, "target name")
        if problem is None and name_ in RESERVED_NAMES:
            problem = f"target name {name_!r} is a file attnlab writes beside the targets' folders (choose another)"
        if problem:
            problems.append(f"targets: {problem}")
            continue
        marks.append((len(problems), name_))
        where = f"targets.{name_}"
        target = _check_keys(target, TARGET_KEYS, where, problems)
        target = substitute(target, variables, where, problems, broken)
        base = deep_merge(defaults, {k: v for k, v in target.items() if k in SECTION_KEYS})
        phases = target.get("phases")
        if phases is None:
            phases = [{}]
        elif not isinstance(phases, list) or not phases:
            problems.append(
                f"{where}.phases must be a non-empty list (or leave it out: one phase), got {brief(phases)}"
            )
            continue
        start_from, source, refused = target.get("init_from"), None, False
        if isinstance(start_from, dict) or (isinstance(start_from, str) and start_from not in targets
                                            and (names_model(start_from) or start_from.startswith("."))):  # fmt: skip
            source, start_from = pretrained_source(start_from, f"{where}.init_from", problems), None
            source["target"] = name_  # whose conversion (<target>/converted) the target's runs start from
            problem = plain_name_problem(source["model"], f"{where}.init_from", targets)
            if problem and source["model"] in targets:  # {model: a} meant init_from: a
                problems.append(problem)
                source["model"] = None
        elif start_from is not None and not isinstance(start_from, str):
            problems.append(
                f"{where}.init_from={brief(start_from)} must be a target name or a model reference, got "
                f"{type(start_from).__name__}"
            )
            start_from = None
        elif start_from is not None and (start_from not in targets or order.index(start_from) >= order.index(name_)):
            earlier = ", ".join(map(str, order[: order.index(name_)])) or "none"
            chain = [name_, start_from]  # a later target: the targets it starts from in turn (a cycle ends at name_)
            while chain[-1] != name_ and len(chain) <= len(order) and isinstance(chain[-1], str) and \
                    isinstance(targets.get(chain[-1]), dict):  # fmt: skip
                chain.append(targets[chain[-1]].get("init_from"))
            if start_from in targets and chain[-1] == name_ and start_from != name_:
                problems.append(f"{where}.init_from={start_from!r} makes a cycle ({' -> '.join(chain)}): let one of "
                                "them start from a model or from scratch (leave its init_from out)")  # fmt: skip
            elif start_from in targets and start_from != name_:
                problems.append(f"{where}.init_from={start_from!r} names a target defined after {name_}: list "
                                f"{start_from} before {name_} (a target starts from an earlier one)")  # fmt: skip
            else:
                problems.append(
                    f"{where}.init_from={start_from!r} must name an earlier target ({earlier}) or a model (a .gguf "
                    f"file, a path with a /, hf:ORG/NAME){init_from_hint(start_from, targets, data_dir)}"
                )
            start_from, refused = None, True  # (its model section is then not said to be missing: it meant one)
            refused_targets.add(name_)
        elif start_from in refused_targets:  # (starts from a refused target: its model, too, is not said missing)
            refused = True
        inherited = None  # the attention a continued conversion fixed, when this target does not repeat it
        if start_from is not None and sources.get(start_from) is not None:  # continues a pretrained model's target:
            source = sources[start_from]  # its `model` holds changes to that model's config too
            inherited = attentions.get(start_from)
        sources[name_] = source
        phase_names = []
        for i, phase in enumerate(phases):
            phase_where = f"{where}.phases[{i}]"
            if phase is None or not isinstance(phase, dict):
                problems.append(f"{phase_where} must be a mapping, got {brief(phase)}")
                continue
            phase = _check_keys(phase, PHASE_KEYS, phase_where, problems)
            phase_name = phase.get("name")
            if phase_name is None and len(phases) > 1:
                problems.append(f"{phase_where} needs a name (phases are saved in folders by name)")
                continue
            problem = name_problem(phase_name, "name") if phase_name is not None else None
            if problem:
                problems.append(f"{phase_where}: phase {problem}")
                continue
            phase_name = phase_name if len(phases) > 1 else None  # one phase: the run folder is the seed's
            if phase_name is not None and phase_name in phase_names:
                problems.append(f"{where}.phases: the name {phase_name!r} is given twice (names must be unique)")
            phase_names.append(phase_name)
            merged = deep_merge(deep_merge(base, {k: v for k, v in phase.items() if k in SECTION_KEYS}), overrides)
            own = _given_keys((target, phase, overrides))  # what the target, phase or --set wrote (not defaults)
            if (
                source is not None
                and source["model"] is not None
                and (
                    "tokenizer" not in merged.get("data", {})
                    or (
                        "tokenizer" not in own["data"]
                        and merged["data"]["tokenizer"] == _run_tokenizer(source["model"])
                    )
                )
            ):  # the pretrained model's own (data.tokenizer in `defaults` naming the tokenizer it was trained with)
                problem = plain_name_problem(source["model"], f"{where}.init_from", ())
                if problem is None:
                    merged.setdefault("data", {})["tokenizer"] = source["model"]
                elif problem not in problems:  # (not data.tokenizer='NAME' is not known: the user wrote no tokenizer)
                    problems.append(problem)
            model_section = merged.get("model")
            if inherited is not None and isinstance(model_section, dict) and "attention" not in model_section:
                merged["model"] = {**model_section, "attention": copy.deepcopy(inherited)}
            if i == 0 and source is not None and isinstance(merged.get("model"), dict):
                attentions[name_] = merged["model"].get("attention")
                problem = conversion_options_problem(target.get("init_from"), attentions[name_], f"{where}.init_from")
                if problem:
                    problems.append(problem)
            spec: dict = {}
            found: list[str] = []
            from_defaults = set(merged.get("model") or {}) - own["model"] if source is not None else set()
            _resolve_sections(merged, phase_where if len(phases) > 1 else where, found, spec, source is not None,
                              (name_, from_defaults))  # fmt: skip
            undefined = undefined_keys(merged, variables)  # each said once (undefined variable), not again
            found = [p for p in found if not (refused and (p.endswith(": model must be a mapping")
                                                           or ".model: missing key" in p))]  # fmt: skip
            problems += [p for p in found if not any(f" {key}=" in p or f".{key}=" in p for key in undefined)
                         and p not in problems]  # fmt: skip
            if len(spec) == 3:
                for seed in seeds:
                    runs.append(RunSpec(name_, seed, phase_name, spec["model"], spec["data"],
                                        replace(spec["train"], seed=seed), start_from if i == 0 else None,
                                        source))  # fmt: skip
    marks.append((len(problems), None))
    needed = needed_targets(targets, targets_run)
    problems = [unknown_key_problem(t, list(targets), "", what="target") for t in targets_run or [] if t not in targets
                ] + owned_problems(problems, marks, needed)  # fmt: skip
    if not problems:
        problems = _start_problems([r for r in runs if needed is None or r.target in needed],
                                   [t for t in order if isinstance(t, str)])  # fmt: skip
    problems = merged_repeats(problems, [t for t in order if isinstance(t, str)])
    if problems:  # (an init_from model that is nowhere is said first: the other problems may follow from it)
        raise ConfigError(missing_model_problems(problems, sources, targets, data_dir), source=str(path))
    runs.sort(key=lambda r: (order.index(r.target), seeds.index(r.seed)))  # stable: phases keep order
    return Manifest(name, path, tuple(seeds), tuple(runs))


def file_kind(path: str | Path) -> str:
    """What a YAML file holds, from its keys: "manifest" (`targets`), "bench" (a benchmark manifest: `benchmarks`),
    "probes" (a probe suite: `cases`), else "model" (a model config). A file that cannot be read as YAML is
    "model" (load_config then says why, naming the file)."""
    try:
        data = read_yaml(path)
    except ConfigError:
        return "model"
    return (file_words(data) or ("model",))[0]
