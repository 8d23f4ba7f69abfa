"""`attnlab bench`: run named benchmarks on checkpoints and append their records to OUT/records.jsonl.

A benchmark manifest:

    name: wikitext2_harness
    checkpoints: [runs/wikitext2_suite/*/seed0]        # run folders or checkpoint folders; globs allowed
    benchmarks:                                        # name: parameters (all optional; see `attnlab bench --list`)
      perplexity: {split: test}
      probes: {suite: configs/probes/core.yml}
      multiple_choice: {tasks: [arc_easy, piqa]}

Every benchmark is a function (EvalModel, out_dir, data_dir, **params) -> records, registered in
BENCHMARKS below; its keyword arguments are its parameters and their defaults. A benchmark already
recorded for the same checkpoint, parameters and weights is skipped, so an interrupted harness resumes; a
checkpoint retrained at the same path is measured again (records name the weights: weights_identity). One bench
at a time writes to a folder (bench_lock), and two checkpoints never share a label there (plan_labels).
--benchmarks picks some of a manifest's benchmarks, and --set sets parameters of the benchmarks chosen: neither
adds a benchmark.
"""

from __future__ import annotations

import glob
import hashlib
import inspect
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from attnlab.cache.codecs import KVValueError
from attnlab.config_checks import unknown_key_problem
from attnlab.config_io import parse_yaml, read_yaml, yaml_problem
from attnlab.data.files import folder_lock
from attnlab.data.prepared import SPLIT_ALIASES
from attnlab.errors import ConfigError, InputError
from attnlab.eval.analysis import region_problems, run_attention_maps, run_effective_rank
from attnlab.eval.bench_checks import (
    cache_memory_problem,
    context_note,
    context_problem,
    needle_length_problem,
    needle_problems,
    own_split_problem,
    parameter_problems,
    policy_note,
    prompt_problem,
    unmeasured_problem,
)
from attnlab.eval.identity import plan_labels, weights_identity
from attnlab.eval.kvquant import MIN_SEQ_LEN, SEQ_LEN_NEED, policy_problem, run_kv_eval
from attnlab.eval.loading import load_for_eval
from attnlab.eval.longctx import context_sweep as sweep
from attnlab.eval.longctx import run_extrapolation, run_needle, run_stream_loss
from attnlab.eval.multiple_choice import run_multiple_choice
from attnlab.eval.perplexity import run_perplexity
from attnlab.eval.probes import load_suite, probe_records, run_probes
from attnlab.eval.records import append_records, read_records, records_folder
from attnlab.eval.report_outputs import check_seals
from attnlab.eval.speed import run_latency, run_memory
from attnlab.interop.references import data_config_of, model_config_of, tokenizer_of
from attnlab.paths import brief, check_name, first_repeat, in_data_dirs

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_PROMPT = (
    "The pass key is 4721. Remember it. The grass is green and the sky is blue. The pass key is"
)  # fmt: skip
DEFAULT_REGIONS = {"pass key": [16, 20]}  # characters of DEFAULT_PROMPT: "4721"


def perplexity(model, out_dir, data_dir, split: str = "test", seq_len: int | None = None, stride: int | None = None,
               max_tokens: int | None = None, dataset: str | None = None) -> list[dict]:  # fmt: skip
    """Held-out loss and perplexity with a bootstrap interval (non-overlapping windows unless stride); dataset:
    score a named dataset (e.g. wikitext2-raw) with the model's own tokenizer (pretrained models)."""
    return [run_perplexity(model, split, seq_len, stride, max_tokens, data_dir, dataset=dataset)]


def probes(model, out_dir, data_dir, suite: str = "configs/probes/core.yml") -> list[dict]:
    """Behaviour probes: per-case rows and a per-category summary."""
    loaded = load_suite(suite_path(suite))
    return probe_records(model, loaded, run_probes(model, loaded))


def suite_path(suite: str) -> Path:
    """A probe suite's file: the path given, else the shipped suite of that name (wherever attnlab is run from)."""
    shipped = REPO_ROOT / suite
    return Path(suite) if Path(suite).exists() or not shipped.exists() else shipped


def multiple_choice(model, out_dir, data_dir, tasks: list | None = None, limit: int | None = None) -> list[dict]:
    """Zero-shot multiple choice scored as lm-evaluation-harness does (acc and acc_norm)."""
    return [
        run_multiple_choice(model, task, limit=limit, data_dir=data_dir)[1] for task in tasks or ["arc_easy", "piqa"]
    ]


def effective_rank(model, out_dir, data_dir, split: str = "val", n_tokens: int = 4096, seq_len: int | None = None,
                   center: bool = False) -> list[dict]:  # fmt: skip
    """Singular-value spectra and entropy effective rank of the Q/K projections (DBA: per path)."""
    return [run_effective_rank(model, split, n_tokens, seq_len, 0, center, data_dir)]


def attention_maps(model, out_dir, data_dir, prompt: str = DEFAULT_PROMPT, regions: dict | None = None,
                   unit: str = "chars") -> list[dict]:  # fmt: skip
    """Per layer and head attention maps for a prompt (saved as .npz) and the mass on marked regions."""
    regions = regions or DEFAULT_REGIONS
    problems = region_problems(regions, unit)
    if problems:
        raise ConfigError(problems)
    regions = {k: tuple(v) for k, v in regions.items()}
    tag = hashlib.sha256(f"{model.path}|{prompt}".encode()).hexdigest()[:10]
    return [run_attention_maps(model, prompt, Path(out_dir) / f"attn_{tag}.npz", regions, unit)]


def needle(model, out_dir, data_dir, lengths: list | None = None, depths: list = (0.1, 0.3, 0.5, 0.7, 0.9),
           trials: int = 5, seed: int = 0, filler: str = "sentences", dataset: str | None = None,
           gain: bool = True) -> list[dict]:  # fmt: skip
    """Passkey retrieval at depths and lengths: strict accuracy and the likelihood gain of the needle (filler:
    "sentences", or "heldout" text: the model's own test split, or `dataset`'s, e.g. wikitext2-raw; gain: false
    for retrieval only, a third of the compute)."""
    return run_needle(model, lengths=lengths, depths=tuple(depths), trials=trials, seed=seed, filler=filler,
                      data_dir=data_dir, dataset=dataset, gain=gain)  # fmt: skip


def context_sweep(model, out_dir, data_dir, lengths: list = (256, 512, 1024), chunk_size: int = 256,
                  decode_tokens: int = 8, dataset: str | None = None) -> list[dict]:  # fmt: skip
    """Chunked prefill to each length: prefill time, last-chunk latency and loss, decode ms/token at context."""
    return sweep(model, lengths=tuple(lengths), chunk_size=chunk_size, decode_tokens=decode_tokens, data_dir=data_dir,
                 dataset=dataset)  # fmt: skip


def rope_extrapolation(model, out_dir, data_dir, factors: list = (1, 2, 4), max_tokens: int = 65536,
                       dataset: str | None = None) -> list[dict]:  # fmt: skip
    """Held-out loss at 1x, 2x and 4x the training context."""
    train_seq_len = model.config.get("train", {}).get("seq_len") or model.cfg.max_seq_len  # as run_extrapolation's
    scored = [round(f * train_seq_len) for f in factors if round(f * train_seq_len) <= model.cfg.max_seq_len]
    if scored and max_tokens < max(scored):  # every length scores one whole window at least: more than max_tokens
        raise InputError(f"max_tokens={max_tokens} is fewer than the longest window scored, {max(scored)} tokens "
                         f"(factor {max(scored) / train_seq_len:g} x the training context {train_seq_len}): give "
                         f"max_tokens >= {max(scored)}, or leave it out")  # fmt: skip
    return run_extrapolation(model, factors=tuple(factors), max_tokens=max_tokens, data_dir=data_dir, dataset=dataset)


def stream_loss(model, out_dir, data_dir, length: int = 8192, streams: int = 8, bucket: int | None = None,
                split: str | None = None, dataset: str | None = None) -> list[dict]:  # fmt: skip
    """Loss by position over long held-out streams read whole (a memory model: through its memory), in buckets."""
    return run_stream_loss(model, length=length, streams=streams, bucket=bucket, split=split, data_dir=data_dir,
                           dataset=dataset)  # fmt: skip


def latency(model, out_dir, data_dir, prompt_lengths: list = (128, 512), batch_sizes: list = (1,),
            new_tokens: int = 32, repeats: int = 5, kv_policy: str | None = None) -> list[dict]:  # fmt: skip
    """Cached decode tokens/s and time to first token against prompt length and batch size (kv_policy: a
    quantized cache, e.g. "k=q8_0,v=q4_0,resid=128")."""
    return run_latency(model, prompt_lengths=tuple(prompt_lengths), batch_sizes=tuple(batch_sizes),
                       new_tokens=new_tokens, repeats=repeats, kv_policy=kv_policy)  # fmt: skip


def memory(model, out_dir, data_dir, lengths: list = (256, 512, 1024), batch_size: int = 1,
           cache_dtype: str | None = None, kv_policy: str | None = None) -> list[dict]:  # fmt: skip
    """KV bytes measured from live caches next to the analytic figure, and peak process memory."""
    return run_memory(model, lengths=tuple(lengths), batch_size=batch_size, cache_dtype=cache_dtype,
                      kv_policy=kv_policy)  # fmt: skip


def kv_quant(model, out_dir, data_dir, policies: list = ("k=q8_0,v=q8_0", "k=q4_0,v=q4_0,resid=128"),
             split: str = "test", seq_len: int = 512, max_tokens: int = 8192, chunk: int = 1,
             dataset: str | None = None) -> list[dict]:  # fmt: skip
    """Quality cost of quantized KV caches on held-out text: dNLL, KL, top-1 and greedy agreement, bytes."""
    return run_kv_eval(model, list(policies), split=split, seq_len=seq_len, max_tokens=max_tokens, chunk=chunk,
                       data_dir=data_dir, dataset=dataset)  # fmt: skip


BENCHMARKS: dict[str, Callable[..., list[dict]]] = {
    "needle": needle,
    "context_sweep": context_sweep,
    "rope_extrapolation": rope_extrapolation,
    "stream_loss": stream_loss,
    "latency": latency,
    "memory": memory,
    "kv_quant": kv_quant,
    "perplexity": perplexity,
    "probes": probes,
    "multiple_choice": multiple_choice,
    "effective_rank": effective_rank,
    "attention_maps": attention_maps,
}
DEFAULT_SET = ("perplexity", "memory", "latency", "rope_extrapolation", "probes", "multiple_choice")


def parameters(name: str) -> dict[str, Any]:
    """A benchmark's parameters and their defaults."""
    signature = inspect.signature(BENCHMARKS[name])
    return {k: p.default for k, p in list(signature.parameters.items())[3:]}


SPLITS = ("train", "val", "test", *SPLIT_ALIASES)  # every prepared dataset's split names (or fewer)
CHOICES = {  # parameters that take one of a few words
    ("attention_maps", "unit"): ("chars", "tokens"),
    **{(bench, "split"): SPLITS for bench in ("perplexity", "effective_rank", "stream_loss", "kv_quant")},
}


def check_benchmarks(spec: dict, where: str = "benchmarks") -> list[str]:
    problems = []
    for name, params in spec.items():
        if name not in BENCHMARKS:
            problems.append(unknown_key_problem(str(name), list(BENCHMARKS), f"{where}.", what="benchmark"))
            continue
        if params is not None and not isinstance(params, dict):
            problems.append(f"{where}.{name} must be a mapping of parameters, got {type(params).__name__}")
            continue
        signature = inspect.signature(BENCHMARKS[name]).parameters
        for key, value in (params or {}).items():
            if (name, key) == ("kv_quant", "dtype"):  # (kv-eval's --dtype: a guess the close-match hint gets wrong)
                problems.append(f"{where}.kv_quant has no dtype key: it counts bytes for an fp16 cache (kv-eval's "
                                "--dtype only changes those byte counts): leave dtype out")  # fmt: skip
            elif key not in signature or key in ("model", "out_dir", "data_dir"):
                problems.append(unknown_key_problem(str(key), list(parameters(name)), f"{where}.{name}."))
            else:
                problem = parameter_problem(signature[key], value) or policy_problem(key, value)
                choices = CHOICES.get((name, key))
                if problem is None and choices and value is not None and value not in choices:
                    problem = f"is not one of {', '.join(choices)}"
                if problem:
                    problems.append(f"{where}.{name}.{key}={brief(value)} {problem}")
        specific = parameter_problems(name, params or {}, where)  # a tighter bound replaces the general one
        named = {problem.split("=", 1)[0] for problem in specific}
        problems = [problem for problem in problems if problem.split("=", 1)[0] not in named] + specific
        if name == "needle" and isinstance(params, dict):
            problems += needle_problems(params, f"{where}.{name}")
        seq_len = (params or {}).get("seq_len", 512) if name == "kv_quant" else None
        if isinstance(seq_len, int) and not isinstance(seq_len, bool) and 1 <= seq_len < MIN_SEQ_LEN:
            problems.append(f"{where}.{name}.seq_len={seq_len}: {SEQ_LEN_NEED}")
        chunk = (params or {}).get("chunk", 1) if name == "kv_quant" else None
        if isinstance(seq_len, int) and isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= seq_len:
            problems.append(f"{where}.{name}.chunk={chunk} >= seq_len={seq_len}: each window goes in as one chunk, "
                            "whose queries read their own keys at full precision, so no policy is measured (give a "
                            f"chunk below {seq_len}; 1, the default, decodes token by token)")  # fmt: skip
        if name == "attention_maps" and (params or {}).get("regions") is not None:
            unit = params.get("unit") if params.get("unit") in ("chars", "tokens") else "chars"
            problems += [f"{where}.{name}.{p}" for p in region_problems(params["regions"], unit)]
        if name == "attention_maps":
            problems += prompt_region_problems(params or {}, f"{where}.{name}")
        if name == "probes" and isinstance((params or {}).get("suite"), str):
            try:
                load_suite(suite_path(params["suite"]))
            except ConfigError as e:  # read before any model is loaded: a suite is checked whole
                problems += [f"{where}.{name}.suite={brief(params['suite'])}: {e.source}: {p}" for p in e.problems]
    return problems


def prompt_region_problems(params: dict, where: str) -> list[str]:
    """attention_maps regions in characters that end past the prompt (the default region past a short prompt given
    alone), said before any benchmark runs rather than once the model has read the prompt (char_region_to_tokens)."""
    prompt, regions = params.get("prompt", DEFAULT_PROMPT), params.get("regions")
    if params.get("unit", "chars") != "chars" or not isinstance(prompt, str) or region_problems(regions or {}):
        return []  # (regions in tokens: counted once the prompt is tokenized; other problems: said by themselves)
    past = [(name, span) for name, span in (regions or DEFAULT_REGIONS).items() if span[1] > len(prompt)]
    if regions is None and past:
        return [f"{where}.prompt={brief(prompt)} has {len(prompt)} characters: the default region (pass key: "
                f"{DEFAULT_REGIONS['pass key']}, the pass key of the default prompt) ends past it: give regions inside "
                "the prompt, e.g. regions: {start: [0, 4]}"]  # fmt: skip
    return [f"{where}.regions.{name}={brief(span)} ends past the prompt's {len(prompt)} characters: give a region "
            "inside the prompt, or a longer prompt" for name, span in past]  # fmt: skip


def benchmark_names(given: list[str]) -> list[str]:
    """--benchmarks' names, stripped; ConfigError for none, an unknown one, or one given twice (it would run once)."""
    names = [b.strip() for b in given if b.strip()]
    if not names:
        raise ConfigError("--benchmarks names no benchmark: give a comma-separated list (e.g. perplexity,needle), or "
                          "leave --benchmarks out (bench: for the default set; list: to list them all)")  # fmt: skip
    unknown = [b for b in names if b not in BENCHMARKS]
    if unknown:
        raise ConfigError([unknown_key_problem(b, list(BENCHMARKS), "", what="benchmark") for b in unknown])
    if first_repeat(names) is not None:
        raise ConfigError(f"--benchmarks {','.join(names)}: holds {brief(first_repeat(names))} twice: give each once")
    return names


NON_NEGATIVE = ("offset", "seed", "depth")  # integer parameters for which 0 means zero, not nothing


def parameter_problem(parameter: inspect.Parameter, value: Any) -> str | None:
    """Why `value` cannot be this benchmark parameter (its type read from the default or the annotation): numbers
    must be finite, counts and lengths >= 1 (offsets and seeds >= 0), lists hold such numbers. None if it can."""
    if value is None:
        return None if parameter.default is None else "must be given a value (leave it out for the default)"
    default, annotation = parameter.default, str(parameter.annotation)
    minimum = 0 if any(word in parameter.name for word in NON_NEGATIVE) else 1

    def number_problem(item: Any, kind: type) -> str | None:
        if isinstance(item, bool) or not isinstance(item, (int, float) if kind is float else int):
            return f"must be {'a number' if kind is float else 'a whole number'}"
        if not math.isfinite(item):
            return "must be finite"
        if kind is int and item < minimum:
            return f"must be >= {minimum}"
        if kind is float and item <= 0 and "factor" in parameter.name:
            return "must be > 0"
        return None

    if isinstance(default, bool) or annotation.startswith("bool"):
        return None if isinstance(value, bool) else "must be true or false"
    if isinstance(default, (list, tuple)) or annotation.startswith(("list", "tuple")):
        if not isinstance(value, list) or not value:
            return "must be a non-empty list"
        twice = first_repeat(value)
        if twice is not None:  # the same length, depth or task twice would be measured twice
            return f"holds {brief(twice)} twice: give each once"
        sample = default[0] if isinstance(default, (list, tuple)) and default else None
        kind = float if isinstance(sample, float) else int if isinstance(sample, int) else None
        if kind is None:
            return None
        return next((f"holds {brief(item)}, which {p}" for item in value if (p := number_problem(item, kind))), None)
    if isinstance(default, int) or annotation.startswith("int"):
        return number_problem(value, int)
    if isinstance(default, float) or annotation.startswith("float"):
        return number_problem(value, float)
    if isinstance(default, str) or annotation.startswith("str"):
        return None if isinstance(value, str) else "must be a string"
    return None


@dataclass(frozen=True)
class BenchPlan:
    name: str
    checkpoints: tuple[str, ...]
    benchmarks: dict  # name -> params
    data_dir: str | None = None


def load_plan(paths: list[str], benchmarks: list[str] | None = None, sets: list[str] = (), data_dir=None,
              need_checkpoints: bool = True) -> BenchPlan:  # fmt: skip
    """A plan from one benchmark manifest (YAML with `benchmarks`), or from checkpoint paths (default set).
    need_checkpoints False (`attnlab validate`): checkpoints not trained yet are left out, not a problem."""
    if len(paths) == 1 and paths[0].endswith((".yml", ".yaml")):
        path = Path(paths[0])
        raw = read_yaml(path)
        if not isinstance(raw, dict):
            raise ConfigError("a benchmark manifest is a mapping with benchmarks and checkpoints", source=str(path))
        if "benchmarks" not in raw and ("targets" in raw or "defaults" in raw):  # (a run's manifest: said as such)
            raise ConfigError(f"a run manifest (targets), not a benchmark manifest: train it with `attnlab run "
                              f"{path}`, then bench its runs", source=str(path))  # fmt: skip
        problems = [unknown_key_problem(str(k), ["name", "checkpoints", "benchmarks", "data_dir"], "")
                    for k in raw if k not in ("name", "checkpoints", "benchmarks", "data_dir")]  # fmt: skip
        if not raw.get("benchmarks"):
            raise ConfigError("no benchmarks named (benchmarks: maps each benchmark to its parameters; "
                              "`attnlab bench --list` lists them)", source=str(path))  # fmt: skip
        spec = raw.get("benchmarks") or {}
        if not isinstance(spec, dict) or not all(isinstance(v, dict | None) for v in spec.values()):
            problems.append("benchmarks must map each benchmark's name to its parameters (a mapping, or nothing)")
            spec = {}
        problems += check_benchmarks(spec)
        checkpoints = raw.get("checkpoints") or []
        if isinstance(checkpoints, str):
            checkpoints = [checkpoints]
        if not isinstance(checkpoints, list) or not all(isinstance(c, str) for c in checkpoints):
            problems.append("checkpoints must be a list of run or checkpoint folders (glob patterns allowed)")
            checkpoints = []
        elif not checkpoints:
            problems.append("checkpoints names no checkpoint: list the run or checkpoint folders to benchmark (glob "
                            "patterns allowed, e.g. checkpoints: [runs/*/seed0])")  # fmt: skip
        for key in ("name", "data_dir"):
            if raw.get(key) is not None and not isinstance(raw[key], str):
                problems.append(f"{key}={brief(raw[key])} must be a string")
        if isinstance(raw.get("data_dir"), str) and not Path(raw["data_dir"]).is_dir():  # as --data-dir is checked
            what = "a file, not a folder" if Path(raw["data_dir"]).exists() else "no such folder"
            problems.append(f"data_dir={brief(raw['data_dir'])}: {what} (name the folder that holds the data files, "
                            "or leave data_dir out)")  # fmt: skip
        if problems:
            raise ConfigError(problems, source=str(path))
        name, data_dir = raw.get("name") or path.stem, data_dir or raw.get("data_dir")
        check_name(name, "benchmark manifest name")
        chosen_by = f"{path}'s benchmarks"
    else:
        name, checkpoints, spec = "bench", paths, {b: {} for b in DEFAULT_SET}
        chosen_by = None
    if benchmarks is not None:
        benchmarks = benchmark_names(benchmarks)
        absent = [b for b in benchmarks if b not in spec]
        if chosen_by and absent:  # --benchmarks picks some of a manifest's benchmarks (with their parameters)
            raise ConfigError(
                f"--benchmarks {','.join(absent)}: not among {chosen_by} ({', '.join(spec)}): "
                f"--benchmarks picks some of them (add {absent[0]} to the manifest to run it)"
            )
        spec = {b: spec.get(b, {}) for b in benchmarks}
        chosen_by = "--benchmarks"
    spec = {k: dict(v or {}) for k, v in spec.items()}
    given: dict[str, str] = {}  # each BENCHMARK.PARAM set so far -> its value as given
    for item in sets:  # --set perplexity.split=val
        key, sep, raw_value = item.partition("=")
        bench, _, param = key.partition(".")
        if not sep or not bench or not param:  # (no `=` is not a null: that is `PARAM=`, as `run --set` reads it)
            raise ConfigError(f"--set {brief(item)} must look like BENCHMARK.PARAM=VALUE")
        if key in given:  # the last would silently win (as `run --set` and a YAML key given twice, refused)
            shown = [" ".join(v.split())[:40] for v in (given[key], raw_value)]
            raise ConfigError(f"--set {key} is given twice ({shown[0]}, then {shown[1]}): give it once")
        given[key] = raw_value
        if bench in BENCHMARKS and bench not in spec:  # a --set sets a parameter: it never adds a benchmark
            how = f"add {bench} to {chosen_by}" if chosen_by else "name it in --benchmarks (with the ones you want)"
            raise ConfigError(f"--set {brief(item)}: {bench} is not among the benchmarks to run ({', '.join(spec)}): "
                              f"{how}, or leave this --set out")  # fmt: skip
        try:
            spec.setdefault(bench, {})[param] = parse_yaml(raw_value) if raw_value.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {brief(item)}: the value is {yaml_problem(e)} (quote the whole value)") from None
    problems = check_benchmarks(spec)
    for i, problem in enumerate(problems):  # a --set of one value where a list is wanted: how to write the list
        key = problem.split("=", 1)[0].removeprefix("benchmarks.")
        if key in given and problem.endswith("must be a non-empty list") and given[key].strip()[:1] not in ("[", ""):
            value = json.dumps([spec[key.partition(".")[0]][key.partition(".")[2]]])
            problems[i] += f" (--set gives a list in YAML's brackets: --set '{key}={value}')"
    resolved = []
    for pattern in checkpoints:
        if str(pattern).startswith("hf:"):  # a Hub reference: resolved when loaded
            resolved.append(str(pattern))
            continue
        if any(c in str(pattern) for c in "*?["):
            matches = sorted(glob.glob(str(pattern)))
        else:  # models/X.gguf: also in a data directory, as every command that takes a model reference finds it
            matches = [str(in_data_dirs(pattern, data_dir))]
        if need_checkpoints and (not matches or not all(Path(m).exists() for m in matches)):
            problems.append(
                f"checkpoint {pattern!r} not found (a model reference: a run or checkpoint folder, a .gguf "
                "file, a Hugging Face folder or hf:ORG/NAME)"
            )
        resolved += [m for m in matches if Path(m).exists()]
    if problems:
        raise ConfigError(problems)
    # A checkpoint listed twice (or matched by two patterns) is benchmarked once: keyed by its real path.
    unique: dict[str, str] = {}
    for ref in resolved:
        unique.setdefault(ref if ref.startswith("hf:") else os.path.realpath(ref), ref)
    return BenchPlan(name, tuple(unique.values()), spec, data_dir)


def _key(record: dict) -> tuple:
    return record.get("benchmark"), record.get("model_path"), json.dumps(record.get("params"), sort_keys=True)


def named_parameters(benchmark: str, message: str, params: dict, model: str) -> str:
    """A benchmark's error with its parameters named as in a manifest (`length=1` -> `benchmarks.stream_loss.length=1`),
    or, when it names none, said to be the benchmark's."""
    pattern = r"(?<![\w.])(" + "|".join(map(re.escape, sorted(params, key=len, reverse=True))) + r")(?==)"
    named, count = re.subn(pattern, lambda m: f"benchmarks.{benchmark}.{m[1]}", message) if params else (message, 0)
    return named if count else f"benchmarks.{benchmark} on {model}: {message}"


def run_plan(plan: BenchPlan, out_dir: str | Path, log=print) -> Path:
    """Runs every benchmark on every checkpoint; returns the records file. One bench at a time writes to a folder
    (bench_lock). A benchmark recorded already for the same checkpoint path, parameters and weights is skipped;
    one recorded for other weights at that path (retrained since) is measured again, and said (the old records
    stay; a report shows the latest); one recorded by an attnlab that did not note the weights is kept, and said."""
    out_dir = Path(out_dir)
    records_folder(out_dir, "records.jsonl", example=f"results/{plan.name}")  # checked before anything runs
    made = [p for p in (out_dir, *out_dir.parents) if not os.path.lexists(p)]  # the folders the lock makes
    lock_made = not os.path.lexists(out_dir / LOCK)
    try:
        return _run_plan(plan, out_dir, log)
    except BaseException:
        if lock_made and (out_dir / LOCK).is_file() and not (out_dir / LOCK).is_symlink():
            (out_dir / LOCK).unlink(missing_ok=True)  # a refused bench leaves no lock file of its own behind either
        _remove_unused(made, out_dir)  # a bench refused (or stopped) before it wrote anything leaves no folder
        raise


def _remove_unused(made: list[Path], out_dir: Path) -> None:
    """Removes the folders `made` (deepest first) when they hold nothing but the bench's lock file."""
    if not made or not out_dir.is_dir() or set(os.listdir(out_dir)) - {LOCK}:
        return
    (out_dir / LOCK).unlink(missing_ok=True)
    for folder in made:
        try:
            folder.rmdir()
        except OSError:  # not empty (something else wrote there meanwhile): kept
            return


def config_problems(checkpoint: str, label: str, benchmarks, data_dir) -> list[str]:
    """What the benchmarks [(name, parameters given)] would refuse on the checkpoint, told from its config alone
    (lengths past its context, caches past this machine's memory, a prompt too long): bench says them before it
    loads any model, and validate says them of the checkpoints it finds."""
    cfg, data = model_config_of(checkpoint, data_dir), data_config_of(checkpoint, data_dir)
    return [
        p
        for name, params in benchmarks
        for full in ({**parameters(name), **params},)
        for p in (
            context_problem(name, full, cfg, label, given=params),
            own_split_problem(name, full, data, label) if "split" in full else None,
            cache_memory_problem(name, full, cfg, label),
            prompt_problem(name, full, cfg, label, lambda ref=checkpoint: tokenizer_of(ref, data_dir)),
            needle_length_problem(name, full, cfg, label, lambda ref=checkpoint: tokenizer_of(ref, data_dir)),
        )
        if p
    ]


def _run_plan(plan: BenchPlan, out_dir: Path, log) -> Path:
    records_path = out_dir / "records.jsonl"
    with bench_lock(out_dir):
        existing = read_records(records_path) if records_path.exists() else []
        check_seals(records_path, existing, measuring=True)  # (a changed record would be skipped as measured)
        recorded = {_key(r): r.get("weights") for r in existing}  # the latest record's weights, per key
        labels = plan_labels(plan.checkpoints, existing, plan.data_dir)
        plans = []  # (checkpoint, weights, label, todo): what each checkpoint still has to measure
        for checkpoint in plan.checkpoints:
            if (Path(checkpoint) / "checkpoints").exists() and not (Path(checkpoint) / "summary.json").exists():
                log(f"{checkpoint}: training has not finished (no summary.json), skipped")
                continue
            weights, label, todo = weights_identity(checkpoint, plan.data_dir), labels[checkpoint], []
            for name, params in plan.benchmarks.items():
                full = {**parameters(name), **params}
                key = (name, str(Path(checkpoint)), json.dumps(full, sort_keys=True))  # as _key reads a record
                if key in recorded and recorded[key] == weights:
                    log(f"{label} {name}: recorded already, skipped")
                elif key in recorded and recorded[key] is None:  # hours of measurements are not thrown away
                    log(f"{label} {name}: recorded already by an older attnlab, which did not note the weights it "
                        f"measured: skipped (remove them from {records_path} to measure again)")  # fmt: skip
                else:
                    todo.append((name, params, full, key in recorded))
            if todo:  # every benchmark recorded: the model is not even loaded
                plans.append((checkpoint, weights, label, todo))
        for checkpoint, _, label, todo in plans:  # lengths and caches checked from the configs, before any loading
            asked = [(name, params) for name, params, _, _ in todo]
            problems = config_problems(checkpoint, label, asked, plan.data_dir)
            if problems:
                raise InputError("; ".join(problems))
        for checkpoint, weights, label, todo in plans:
            model = load_for_eval(checkpoint, data_dir=plan.data_dir)
            model.name = label  # unique in this bench and its folder's records
            train_seq_len = model.config.get("train", {}).get("seq_len") or model.cfg.max_seq_len
            problems = (context_problem(name, full, model.cfg, label, train_seq_len, params)
                        for name, params, full, _ in todo)  # fmt: skip
            problem = next((p for p in problems if p), None)
            if problem:
                raise InputError(problem)
            for name, params, full, again in todo:
                if again:
                    log(
                        f"{label} {name}: recorded for other weights at this path (the checkpoint changed since): "
                        f"measured again (the report shows the new records; the old ones stay in {records_path})"
                    )
                else:
                    log(f"{label} {name} ...")
                for note in (context_note(name, full, model.cfg, label, train_seq_len), policy_note(name, full, label)):
                    if note:
                        log(note)
                try:
                    records = BENCHMARKS[name](model, out_dir, plan.data_dir, **params)
                except (ConfigError, InputError) as e:  # a parameter the benchmark refused once it ran: name it
                    if isinstance(e, KVValueError):  # its way out in the manifest's words
                        e = e.instead(f"leave the policy out of benchmarks.{name}.policies")
                    error = ConfigError if isinstance(e, ConfigError) else InputError  # (KVValueError and the like
                    raise error(named_parameters(name, str(e), full, model.name)) from None  # take other arguments)
                problem = unmeasured_problem(name, records, label)
                if problem:
                    raise InputError(problem)
                for record in records:
                    record["params"] = full
                    record["benchmark"] = name  # the harness's name for it (e.g. rope_extrapolation)
                    record["weights"] = weights
                append_records(records_path, records)
    return records_path


LOCK = ".bench.lock"  # in a bench's --out folder: held (flock) while a bench writes there


def bench_lock(out_dir: Path):
    """Holds out_dir's lock while a bench measures and writes there (made if missing): a second bench on the same
    folder is refused (InputError naming the first's pid) rather than timing while they compete for the machine and
    recording every benchmark twice (attnlab.data.files.folder_lock)."""
    return folder_lock(
        out_dir,
        LOCK,
        lambda holder: (
            f"--out {out_dir}: another attnlab bench{holder} is writing records in this folder: wait for it to finish, "
            "or give another --out (two at once would time each other's load and record every benchmark twice)"
        ),
    )
