"""Manifest targets that start from a pretrained model (`init_from: <model reference>`): checked, converted once,
then trained as any run (recovery fine-tuning).

    targets:
      mqa:
        init_from: models/SmolLM2-135M-Instruct.Q4_1.gguf      # or {model: REF, rope_pairs: high, ...}
        model: {attention: {kind: mha, n_kv_heads: 1}}          # the changes; `attnlab convert` makes them
        train: {trainable: ["blocks.*.attn.*"], steps: 200}

The target's conversion is saved once in <out>/<manifest>/<target>/converted: a checkpoint folder (weights,
config.json, the source's tokenizer/) that every command takes as a model reference, i.e. the cold model. Its
config.json records the recipe (the source, the conversion's options and the changes); a folder made with another
recipe is refused rather than reused. Every seed and the first phase start from it; a later phase starts from the
previous one's weights and may change the memory (the attention stays the first phase's), and so may a target whose
init_from names a converted target (the factorial's phase 2 arms). The data is read with
the model's own tokenizer (data.tokenizer defaults to the init_from reference); another tokenizer is refused unless
it is the same one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from attnlab.config import ModelConfig, names_model, untrainable_memory_problem
from attnlab.config_io import model_config_from_dict
from attnlab.data.files import read_json_object
from attnlab.errors import AttnlabError, AttnlabWarning, ConfigError, DataError
from attnlab.interop.convert import LOW_RANK, calibration_minimum
from attnlab.manifest import RunSpec
from attnlab.manifest_pretrained import PRETRAINED_CHANGES, calibration_size_problem
from attnlab.model.transformer import build_model
from attnlab.paths import brief
from attnlab.train.budget import batch_memory_problem, positions_memory_problem
from attnlab.train.optim import trainable_problem

CONVERTED = "converted"


def changes(spec: RunSpec) -> tuple[dict | None, dict | None, dict]:
    """(attention, memory, the other changes) a pretrained target's phase makes to its model's config."""
    model = spec.model
    others = {key: model[key] for key in PRETRAINED_CHANGES if key in model and key not in ("attention", "memory")}
    return model.get("attention"), model.get("memory"), others


def recipe(spec: RunSpec, data_dir=None) -> dict:
    """What decides a target's conversion (saved in the converted folder, compared on reuse): its first phase's
    changes, the conversion's options and the source's files as they are now (source_files)."""
    attention, memory, others = changes(spec)
    return {"init_from": dict(spec.source), "attention": attention, "memory": memory, **others,
            "source_files": source_files(spec.source["model"], data_dir)}  # fmt: skip


HASHED_BELOW = 1 << 28  # files under 256 MB are identified by their sha256, larger ones by size and mtime


def source_files(ref: str, data_dir=None) -> dict[str, str]:
    """The files a model reference reads, by name: "sha256:<hex>" (or "size:mtime" for files of 256 MB and more),
    so that a conversion made from since-changed files is refused rather than reused."""
    import hashlib

    from attnlab.interop.references import resolve

    kind, where = resolve(ref, data_dir)
    if kind == "gguf":
        files = [where]
    elif kind == "run":  # the pointers name the checkpoint in use; its checksums.json fingerprints its weights
        files = [p for p in (*where.glob("*.json"), *where.glob("checkpoints/*.json")) if p.is_file()]
    else:
        files = [p for p in where.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".jinja")]
    out = {}
    for path in sorted(files):
        stat = path.stat()
        if stat.st_size >= HASHED_BELOW:
            out[path.name if kind != "run" else str(path.relative_to(where))] = f"{stat.st_size}:{stat.st_mtime_ns}"
            continue
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        out[path.name if kind != "run" else str(path.relative_to(where))] = "sha256:" + digest.hexdigest()
    return out


def first_phases(runs: list[RunSpec]) -> dict[str, RunSpec]:
    """The first phase (of the first seed) of each target converted from a pretrained model, by target name (not
    the targets that continue one of them)."""
    out: dict[str, RunSpec] = {}
    for spec in runs:
        if spec.source is not None and spec.source["target"] == spec.target and spec.target not in out:
            out[spec.target] = spec
    return out


def converted_folder(root: Path, spec: RunSpec) -> Path:
    """Where the conversion a pretrained target's runs derive from is saved: <root>/<converted target>/converted."""
    return Path(root) / spec.source["target"] / CONVERTED


def target_config_of(spec: RunSpec, source_cfg: ModelConfig) -> ModelConfig:
    """The config a conversion of `source_cfg` with the phase's changes has (before a low-rank conversion picks its
    RoPE pairs); ConfigError (one line) when the weights cannot initialise it."""
    from attnlab.interop.convert import target_config

    attention, memory, others = changes(spec)
    return target_config(source_cfg.replace(**others), attention, memory)


def check_pretrained(runs: list[RunSpec], all_runs: list[RunSpec], data_dir) -> list[str]:
    """What would stop a pretrained target once it runs, found without reading the weights' data: a reference that
    names nothing or whose weights' headers or checksums are not as loading checks them (checked_model_config),
    changes the weights cannot initialise, a tokenizer other than the model's, train.trainable patterns that match
    nothing, train.seq_len above the model's context, a batch far beyond this machine's memory."""
    from attnlab.interop.references import checked_model_config, tokenizer_of

    problems: list[str] = []
    firsts = first_phases(all_runs)
    tokenizers: dict[str, object] = {}
    configs: dict[str, ModelConfig] = {}  # by reference: reading a GGUF's metadata takes seconds
    names: dict[ModelConfig, list[str]] = {}

    def fingerprint(ref: str):
        if ref not in tokenizers:
            tokenizer = tokenizer_of(ref, data_dir)
            tokenizers[ref] = getattr(tokenizer, "fingerprint", None)
        return tokenizers[ref]

    phases = {(s.target, s.phase): s for s in runs if s.source is not None}  # the seeds share one check
    for ref in dict.fromkeys(s.data.tokenizer for s in runs if s.source is None and names_model(s.data.tokenizer)):
        try:  # a model's tokenizer for a model trained from scratch
            vocab = model_tokenizer(ref, data_dir).vocab_size
        except (DataError, ConfigError) as e:
            problems.append(f"data.tokenizer: {_one_line(e)}")
            continue
        for target, size in dict.fromkeys((s.target, s.model.get("vocab_size")) for s in runs
                                          if s.source is None and s.data.tokenizer == ref):  # fmt: skip
            if isinstance(size, int) and not isinstance(size, bool) and size < vocab:
                problems.append(f"targets.{target}.model.vocab_size={size} is smaller than the {vocab} ids of "
                                f"data.tokenizer {ref} (give at least {vocab}, or leave it out to take the "
                                "tokenizer's)")  # fmt: skip
    for spec in phases.values():
        where = f"targets.{spec.target}" + (f".phases[{spec.phase}]" if spec.phase else "")
        ref = spec.source["model"]
        try:
            if ref not in configs:
                configs[ref] = checked_model_config(ref, data_dir)
            source_cfg = configs[ref]
        except (DataError, ConfigError) as e:
            problems.append(f"targets.{spec.target}.init_from: {_one_line(e)}")
            continue
        first = firsts[spec.source["target"]]  # (all_runs: the converted target, selected or not)
        if spec is not first and changes(spec)[0] != changes(first)[0]:
            problems.append(
                f"{where}.model.attention: {first.target}'s conversion fixes the attention (a later phase, or a "
                "target continuing it, may change the memory)"
            )
            continue
        try:
            cfg = target_config_of(spec, source_cfg)
        except ConfigError as e:
            problems.append(f"{where}: {_one_line(e)} (from init_from {ref})")
            continue
        if spec is first and (changes(spec)[0] or {}).get("kind") in LOW_RANK:  # (a later phase converts nothing)
            problem = calibration_size_problem(spec.source["calibration_tokens"], source_cfg,
                                               f"targets.{spec.target}.init_from.calibration_tokens")  # fmt: skip
            if problem:
                problems.append(f"{problem} (init_from {ref})")
                continue
        problem = untrainable_memory_problem(cfg.memory.kind)  # (a source folder may carry one)
        if problem:
            problems.append(f"{where}: {problem} (from init_from {ref})")
            continue
        if spec.train.seq_len > cfg.max_seq_len:
            problems.append(
                f"{where}: train.seq_len={spec.train.seq_len} exceeds the model's max_seq_len={cfg.max_seq_len} "
                "(lower train.seq_len, or raise model.max_seq_len)"
            )
        problem = batch_memory_problem(cfg, spec.train, cfg.vocab_size) or positions_memory_problem(cfg)
        if problem:
            problems.append(f"{where}: {problem}")
        if spec.train.trainable is not None:
            if cfg not in names:
                with torch.device("meta"):
                    names[cfg] = [name for name, _ in build_model(cfg).named_parameters()]
            problem = trainable_problem(names[cfg], spec.train.trainable)
            if problem:
                problems.append(f"{where}: {problem}")
        tokenizer = spec.data.tokenizer
        if tokenizer == ref:
            continue
        if not names_model(tokenizer):
            problems.append(
                f"{where}: data.tokenizer={tokenizer!r} is not the tokenizer of init_from {ref} (its "
                f"{source_cfg.vocab_size:,} embeddings read that model's ids): leave data.tokenizer out"
            )
            continue
        try:
            same = fingerprint(tokenizer) == fingerprint(ref) and fingerprint(ref) is not None
        except (DataError, ConfigError) as e:
            problems.append(f"{where}: data.tokenizer: {_one_line(e)}")
            continue
        if not same:
            problems.append(
                f"{where}: data.tokenizer={tokenizer!r} is another vocabulary than init_from {ref}'s "
                "(its embeddings read that model's ids): leave data.tokenizer out"
            )
    return problems


def model_tokenizer(ref: str, data_dir):
    """The tokenizer of the model `ref` names (data.tokenizer: <model reference>), read without its weights."""
    from attnlab.interop.references import tokenizer_of

    tokenizer = tokenizer_of(ref, data_dir)
    if tokenizer is None:
        raise DataError(f"data.tokenizer={ref}: that model was saved without a tokenizer (name another)")
    return tokenizer


def conversion_problem(spec: RunSpec, root: Path, data_dir) -> str | None:
    """The line refusing the conversion made already for the target (<root>/<target>/converted) with another recipe
    than the target's now (converted_model refuses to reuse it; run --dry-run says so); None when none is made yet,
    or it has this recipe. DataError when its config.json cannot be read."""
    folder = converted_folder(root, spec)
    if not folder.exists():
        return None
    saved = read_json_object(folder / "config.json", f"delete {folder} to convert again").get("recipe")
    wanted = _json_normal(recipe(spec, data_dir))
    if saved == wanted:
        return None
    return (f"{folder} holds a conversion made with another recipe ({_first_difference(saved, wanted)}); delete it to "
            "convert again, or use another --out")  # fmt: skip


def converted_model(spec: RunSpec, root: Path, data_dir, log: Callable = print) -> Path:
    """The folder of the target's conversion (<root>/<target>/converted), made now unless it exists with the same
    recipe. Low-rank conversions fit on calibration tokens of the source's `calibrate_on` text (train split)."""
    from attnlab.eval.perplexity import dataset_tokens
    from attnlab.interop.convert import convert_model, save_conversion
    from attnlab.interop.references import load_reference

    folder = converted_folder(root, spec)
    problem = conversion_problem(spec, root, data_dir)
    if problem:
        raise ConfigError(problem)
    if folder.exists():
        return folder
    wanted = _json_normal(recipe(spec, data_dir))
    source = spec.source
    attention, memory, others = changes(spec)
    unfinished_source_warning(spec, data_dir)
    log(f"converting {source['model']} for target {spec.target} into {folder}")
    loaded = load_reference(source["model"], data_dir=data_dir)
    calibration = None
    if source["calibration_tokens"] and (attention or {}).get("kind") in LOW_RANK:
        try:
            tokens = dataset_tokens(loaded.tokenizer, source["calibrate_on"], "train", data_dir)
        except DataError as e:
            raise DataError(
                f"targets.{spec.target}.init_from.calibrate_on={source['calibrate_on']}: {_one_line(e)} (give "
                "--data-dir, or calibration_tokens: 0 to fit the weights alone)"
            ) from None
        least = calibration_minimum(loaded.cfg)  # (calibration_tokens is 0 or at least that: check_pretrained)
        if len(tokens) < least:
            raise DataError(
                f"targets.{spec.target}.init_from.calibrate_on={source['calibrate_on']}: its train split holds "
                f"{len(tokens)} token(s) for {source['model']}'s tokenizer, fewer than the {least} a calibration of "
                f"d_model={loaded.cfg.d_model} needs (give a longer text, or calibration_tokens: 0 to fit the "
                "weights alone)"
            )
        calibration = torch.from_numpy(tokens[: source["calibration_tokens"]])
    conversion = convert_model(
        loaded.cfg.replace(**others), loaded.model, attention, memory, rope_pairs=source["rope_pairs"],
        calibration=calibration,
    )  # fmt: skip
    save_conversion(folder, conversion, loaded.tokenizer, source=source["model"], recipe=wanted)
    for note in conversion.notes:
        log(f"  {note}")
    return folder


def unfinished_source_warning(spec: RunSpec, data_dir) -> None:
    """One warning line (AttnlabWarning) when the target's init_from names an attnlab run that is not finished (an
    interrupted run, or one still training): the conversion starts from the checkpoint it has reached, not from the
    model its config describes. A checkpoint folder named as init_from is taken as chosen: no warning."""
    from attnlab.interop.references import resolve
    from attnlab.train.checkpoint import find_checkpoint

    ref = spec.source["model"]
    try:
        kind, where = resolve(ref, data_dir)
        if kind != "run" or not (where / "checkpoints").is_dir() or (where / "summary.json").exists():
            return
        last, best = find_checkpoint(where, "last"), find_checkpoint(where, "best")
        steps = last.config["train"]["steps"] if last is not None else None
    except (AttnlabError, KeyError, TypeError):
        return  # (a damaged run: refused, and named, where it is loaded)
    if last is None or not isinstance(steps, int) or last.step >= steps:
        return
    used = best or last  # what load_reference takes: the best checkpoint, else the last
    warnings.warn(f"targets.{spec.target}.init_from: {ref} is not finished: step {last.step} of {steps}; its "
                  f"{'best' if best else 'last'} checkpoint (step {used.step}) is what target {spec.target} starts "
                  f"from (finish that run first, or give init_from: {used.path} to start from it on purpose)",
                  AttnlabWarning, stacklevel=2)  # fmt: skip


def run_config(spec: RunSpec, converted: Path) -> ModelConfig:
    """A phase's model config: that of the conversion in folder `converted`, with the phase's memory and other
    changes (a later phase may add or change the memory)."""
    from attnlab.interop.references import model_config_of

    _, memory, others = changes(spec)
    data = model_config_of(converted).to_dict()
    if memory is not None:
        data["memory"] = memory
    return model_config_from_dict({**data, **others}, source=f"target {spec.target}", saved=memory is None)


def _json_normal(value):
    import json

    return json.loads(json.dumps(value))


def _first_difference(saved, wanted) -> str:
    if not isinstance(saved, dict):  # (a recipe that is there but no mapping is damaged: said so, not "none")
        return "no recipe saved" if saved is None else f"its saved recipe is {brief(saved)}, not a mapping: damaged"
    for key in sorted(set(saved) | set(wanted)):
        if saved.get(key) != wanted.get(key):
            if key == "source_files" and isinstance(saved.get(key), dict):
                old, new = saved[key], wanted[key]
                name = next(n for n in sorted(set(old) | set(new)) if old.get(n) != new.get(n))
                what = "is new" if name not in old else "is gone" if name not in new else "changed"
                return f"the source's {name} {what} since the conversion"
            return f"{key}: saved {saved.get(key)!r}, now {wanted.get(key)!r}"
    return "none"


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())
