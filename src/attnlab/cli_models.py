"""The `attnlab` commands that make or measure one model: convert, export, kv-eval and kv-tune (cli.py builds the
parser and dispatches to them)."""

from __future__ import annotations

import math
import os
import re
import tempfile
import warnings
from pathlib import Path

import torch
import yaml

from attnlab.accounting import kv_report
from attnlab.cache.codecs import FORMATS, KVPolicy, KVValueError
from attnlab.cli_errors import calibration_error, one_line
from attnlab.config import DTYPE_BYTES, source_problem
from attnlab.config_io import parse_yaml
from attnlab.data.files import (
    TEMPORARY,
    broken_link,
    read_only_file_system,
    remove_stale_temporaries,
    temporary_stem,
)
from attnlab.data.prepared import SPLIT_ALIASES
from attnlab.data.sources import NAMED_SOURCES, local_path, open_source
from attnlab.errors import AttnlabError, AttnlabWarning, ConfigError, DataError, InputError, LengthWarning
from attnlab.eval import append_records, load_for_eval, make_record
from attnlab.eval.kvquant import (
    KV_TOKENS,
    MIN_SEQ_LEN,
    SEQ_LEN_NEED,
    chunk_problem,
    formatless_problem,
    held_out_windows,
    run_kv_eval,
    split_problem,
    table,
    too_large,
    tune,
)
from attnlab.eval.perplexity import (
    dataset_tokens,
    missing_split,
    prepared_heldout,
    summarize_losses,
    window_losses,
)
from attnlab.eval.records import records_folder, records_in_run_problem, records_target
from attnlab.interop.convert import (
    LOW_RANK,
    calibration_minimum,
    convert_model,
    kv_heads,
    save_conversion,
    target_config,
    unchanged,
)
from attnlab.interop.export import export
from attnlab.interop.references import model_config_of, resolve
from attnlab.interop.tokenizer import warn_unknown_tokens
from attnlab.jsonio import loads_json
from attnlab.manifest_pretrained import calibration_size_problem, calibration_tokens_problem
from attnlab.paths import first_repeat, run_folder_problem
from attnlab.train.checkpoint import CheckpointError


def check_given_once(flag: str, given: str, values) -> None:
    """InputError for a comma-separated flag naming one value twice (it would be merged or measured twice), as
    kv-eval refuses a policy given twice."""
    twice = first_repeat(values)
    if twice is not None:
        raise InputError(f"{flag} {given!r}: {twice} is given twice: give each once")


def key_values(flag: str, text: str, example: str) -> dict:
    """'kind=bounded,recent_window=256,...' -> {key: value} (values read as YAML scalars), one-line errors."""
    data = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} {text!r}: {item!r} must look like KEY=VALUE (e.g. {example})")
        if key.strip() in data:
            raise ConfigError(f"{flag} {text!r}: {key.strip()} is given twice (give each key once)")
        try:
            data[key.strip()] = parse_yaml(value) if value.strip() else None
        except yaml.YAMLError:  # a value such as an unbalanced quote
            raise ConfigError(f"{flag} {text!r}: the value of {key.strip()} is not a plain value") from None
    return data


RECORDS = "records.jsonl"  # the file --out DIR/ (a folder) gets, as `attnlab bench` names it (`attnlab report DIR`)


def records_file(out: str) -> Path:
    """The file kv-eval/kv-tune append their records to: --out itself, or OUT/records.jsonl when OUT ends with a
    slash (a folder, made if missing). Refused (InputError): a path in a run's folder (records_in_run_problem), a
    path records_target refuses, and an existing file whose lines are JSON objects but not attnlab records (a user's
    {"text": ...} corpus): the rows would be mixed into it."""
    if out.endswith(("/", os.sep)):
        return records_folder(out, RECORDS, example="results/")[0]
    problem = records_in_run_problem(out, example="results/kv.jsonl")
    if problem:
        raise InputError(problem)
    target = records_target(out)  # a regular file of JSON objects, or none yet
    if target.is_file():
        for number, line in enumerate(target.read_bytes().decode("utf-8-sig").splitlines(), 1):
            if line.strip() and "benchmark" not in loads_json(line):
                raise InputError(f"--out {out}: line {number} is not an attnlab record (a JSON object without "
                                 f"'benchmark': {line.strip()[:60]}): records are appended only to a file of "
                                 "records (one kv-eval, kv-tune or bench wrote); give a new file, or a folder as "
                                 "DIR/")  # fmt: skip
    return target


def check_results_folder(out: str, example: str) -> None:
    """--out of a command that writes its results into a folder, checked before the model loads: not a run's folder
    nor inside one (records_in_run_problem, suggesting `example`), and writable (check_writable)."""
    problem = records_in_run_problem(out, example=example)
    if problem:
        raise InputError(problem)
    check_writable("--out", Path(out))


def check_writable(flag: str, path: Path) -> None:
    """InputError (one line naming `flag`) when `path` (a file to append to, or a file or folder to make) cannot be
    written: said before the work, not after it. A path that does not exist yet needs its nearest existing folder
    writable (the folders between are made)."""
    target = path if path.exists() else next((p for p in path.absolute().parents if p.exists()), None)
    if target is not None and target != path and not target.is_dir():  # (nothing can be made below a file)
        raise InputError(f"{flag} {path}: {target} is a file, not a folder: choose another {flag}")
    if target is not None and not os.access(target, os.W_OK | (os.X_OK if target.is_dir() else 0)):
        what = "the file" if target == path else f"its folder {target}"
        if read_only_file_system(target):
            raise InputError(f"{flag} {path}: {what} is on a read-only file system: give a path on a writable "
                             "one")  # fmt: skip
        raise InputError(f"{flag} {path}: {what} is not writable by this user (permission denied): give a path you "
                         "can write to")  # fmt: skip
    # os.access says yes to root anywhere, also in /proc or /sys, where nothing can be made: a file made and removed
    # in the folder that gets the result (files are written beside themselves, then renamed) tells. Its error names
    # `path`, as the write would have, and is said as the CLI says any such error of the system.
    folder = target if target is None or target.is_dir() else target.parent
    if folder is not None:
        try:
            handle, probe = tempfile.mkstemp(dir=folder, prefix=".attnlab-write-check-")
        except OSError as e:
            raise type(e)(e.errno, e.strerror, str(path)) from None
        os.close(handle)
        os.unlink(probe)


def check_kv_dataset(args) -> None:
    """--dataset and --split checked before the model is loaded: a reference without a held-out split of its own
    (a .gguf file, a Hugging Face model) needs --dataset; a dataset without split files has train and val only."""
    args.split = SPLIT_ALIASES.get(args.split, args.split)  # (valid, validation: as a benchmark manifest takes them)
    if args.split not in ("train", "val", "test"):
        raise InputError(f"--split {args.split!r} is not a split: give train, val or test (valid and validation "
                         "mean val)")  # fmt: skip
    if args.dataset is None:
        kind, _ = resolve(args.checkpoint, args.data_dir)
        if kind != "run":
            no_dataset(args.checkpoint)
        return
    check_dataset_path("--dataset", args.dataset, args.data_dir)
    problem = split_problem(args.dataset, args.split)
    if problem:
        raise InputError(f"--dataset {problem}: give --split val to score the held-out part (or --split train)")


def check_dataset_path(flag: str, dataset: str, data_dir) -> None:
    """A --dataset that is not a named dataset must be a text file (DataError naming it otherwise): said before its
    splits are, since a folder or device has none."""
    if not dataset.strip():  # (Path("") is ".", which would be named as a folder)
        raise InputError(f"{flag} is empty: give a named dataset ({', '.join(NAMED_SOURCES)}) or a text file")
    if dataset not in NAMED_SOURCES:
        try:
            local_path(dataset, data_dir)
        except DataError as e:
            raise DataError(f"{flag} {dataset}: {one_line(e)}") from None


def no_dataset(ref) -> None:
    raise InputError(f"{ref}: no held-out split of its own (a pretrained or converted model keeps no data "
                     "config): give --dataset, e.g. --dataset wikitext2-raw (--split test), or a text file (--split "
                     "val)")  # fmt: skip


DEFAULT_KV_SEQ_LEN = 512


def default_kv_seq_len(args) -> int:
    """kv-eval/kv-tune's --seq-len when it is left out: DEFAULT_KV_SEQ_LEN, or a shorter model's max_seq_len (a
    model without a memory reads no more; one with a memory reads any length). The model's config is read without
    its weights; a reference that cannot be read is said when the model loads."""
    try:
        cfg = model_config_of(args.checkpoint, args.data_dir)
    except AttnlabError:
        return DEFAULT_KV_SEQ_LEN
    return min(DEFAULT_KV_SEQ_LEN, cfg.max_seq_len) if cfg.memory.kind == "none" else DEFAULT_KV_SEQ_LEN


def check_kv_arguments(args) -> Path | None:
    """kv-eval/kv-tune flags checked before a model is loaded: one line naming the flag. The records file (--out),
    or None. A --seq-len left out is set to its default for this model (default_kv_seq_len)."""
    if args.seq_len is None:
        args.seq_len = default_kv_seq_len(args)
    args.over_split = "--tokens" if args.tokens is not None else None  # (one given and more than the split: said)
    args.tokens = KV_TOKENS if args.tokens is None else args.tokens
    for flag, value in (("--tokens", args.tokens), ("--seq-len", args.seq_len), ("--chunk", args.chunk)):
        if value < 1:
            raise InputError(f"{flag}={value} must be >= 1")
    if args.seq_len < MIN_SEQ_LEN:
        raise InputError(f"--seq-len {args.seq_len}: {SEQ_LEN_NEED} (give --seq-len {MIN_SEQ_LEN} or more)")
    for policy in getattr(args, "policies", None) or ():
        if not policy.strip():
            raise InputError(f"--policies: {policy!r} is an empty policy (give e.g. 'k=q8_0,v=q4_0,resid=128', "
                             f"or 'none' for the full-precision cache)")  # fmt: skip
        KVPolicy.parse(policy)  # a typo is said before the model is loaded
        if formatless_problem(policy):
            raise InputError(f"--policies: {policy.strip()!r} {formatless_problem(policy)}")
    policies = getattr(args, "policies", None)  # (kv-tune: None, it measures policies of its own)
    named = [",".join(sorted(str(KVPolicy.parse(p)).split(","))) for p in policies or ()]  # (k=..,v=.. as v=..,k=..)
    twice = first_repeat(named)
    if twice is not None:  # it would be measured twice, and its rows recorded twice
        given = ", ".join(repr(p) for p, n in zip(policies, named, strict=True) if n == twice)
        raise InputError(f"--policies: {twice!r} is given twice (as {given}): give each policy once")
    problem = chunk_problem(args.seq_len, args.chunk)
    if problem and (policies is None or any(KVPolicy.parse(p).formats for p in policies)):
        raise InputError(problem)
    if args.dtype not in DTYPE_BYTES:  # kv-tune would name it as a policy's format; said before the model loads
        raise InputError(f"--dtype {args.dtype!r} is not known: give one of {', '.join(DTYPE_BYTES)} (the dtype of the "
                         "residual window and of the tensors left unquantized)")  # fmt: skip
    if args.tokens < args.seq_len + 1:
        raise InputError(f"--tokens {args.tokens} is fewer than one window of --seq-len {args.seq_len} (each window "
                         f"holds {args.seq_len} inputs and one more target): give --tokens >= {args.seq_len + 1}, or "
                         "a smaller --seq-len")  # fmt: skip
    records = records_file(args.out) if args.out else None
    if records is not None:
        check_writable("--out", records)
    check_kv_dataset(args)
    return records


def check_kv_model(args, model) -> None:
    """--seq-len within the model's context (a model with a memory reads any length), and a held-out split to
    read (a converted model keeps no data config; a run's data may have no --split), before data is read."""
    if args.dataset is None and not model.config.get("data"):
        no_dataset(args.checkpoint)
    if args.dataset is None:  # said with the flag to give (the prepared folder alone does not say it)
        prepared = prepared_heldout(model, args.data_dir)
        problem = missing_split(model, prepared, args.split, f"--split {args.split}")
        if problem:
            has = "val" if "val" in prepared.splits else prepared.splits[-1]
            raise InputError(f"{problem}: give --split {has}")
    cfg = model.model.cfg
    if cfg.memory.kind == "none" and args.seq_len > cfg.max_seq_len:
        raise InputError(f"--seq-len {args.seq_len} is more than {model.name}'s max_seq_len={cfg.max_seq_len}: give "
                         f"--seq-len {cfg.max_seq_len} or less")  # fmt: skip


def cmd_kv_eval(args) -> int:
    records = check_kv_arguments(args)
    model = load_for_eval(args.checkpoint, data_dir=args.data_dir, weights=args.weights, activations=args.activations)
    check_kv_model(args, model)
    try:
        rows = run_kv_eval(model, args.policies, split=args.split, seq_len=args.seq_len, max_tokens=args.tokens,
                           chunk=args.chunk, dtype=args.dtype, data_dir=args.data_dir, dataset=args.dataset,
                           over_split=args.over_split)  # fmt: skip
    except KVValueError as e:  # its way out in this command's words
        raise e.instead("leave the policy out of --policies") from None
    print(f"{model.name}: KV policies on {rows[0]['tokens']:,} held-out tokens ({rows[0]['dataset']}:{args.split}), "
          f"seq_len {args.seq_len}, "
          f"fed {args.chunk} token(s) at a time; NLL with the full cache {rows[0]['nll_full']:.4f}")  # fmt: skip
    print(table(rows))
    if records:
        print(f"records: {append_records(records, rows)}")
    return 0


DEFAULT_RESIDS = "0,32,128"  # kv-tune's residual windows, for a model without a memory


def cmd_kv_tune(args) -> int:
    formats = tuple(f.strip() for f in args.formats.split(","))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise InputError(f"--formats {args.formats!r}: {', '.join(map(repr, unknown)) or 'nothing'} is not a format "
                         f"(use some of {', '.join(FORMATS)}, comma-separated)")  # fmt: skip
    try:  # (not given: DEFAULT_RESIDS, or 0 alone for a model with a memory, once the model is loaded)
        resids = tuple(int(r) for r in (args.resids or DEFAULT_RESIDS).split(","))
    except ValueError:
        raise InputError(
            f"--resids {args.resids!r} must be whole numbers of tokens, comma-separated (e.g. 0,64)"
        ) from None
    if any(r < 0 for r in resids):
        raise InputError(f"--resids {args.resids!r} must be >= 0")
    for flag, given, values in (("--formats", args.formats, formats), ("--resids", args.resids, resids)):
        check_given_once(flag, given, values)
    if not (math.isfinite(args.budget) and args.budget > 0):
        raise InputError(f"--budget={args.budget!r} must be a finite number of bytes per token > 0")
    if args.max_dnll is not None and not (math.isfinite(args.max_dnll) and args.max_dnll >= 0):
        raise InputError(f"--max-dnll={args.max_dnll!r} must be a finite number >= 0 (nats per token a policy may add "
                         "to the full cache's NLL; 0: none)")  # fmt: skip
    records = check_kv_arguments(args)
    model = load_for_eval(args.checkpoint, data_dir=args.data_dir, weights=args.weights, activations=args.activations)
    check_kv_model(args, model)
    memory = model.model.cfg.memory.kind
    if memory != "none" and args.resids is None:  # its recent window is quantized too: a residual window is moot
        resids = (0,)
    kivi = [f for f in formats if f.startswith("kivi")]
    if memory != "none" and kivi:  # (its candidates would be refused as policies the user never wrote)
        raise InputError(f"--formats {args.formats}: a model with a memory (memory.kind={memory}) stores single "
                         f"tokens, so per-channel formats ({', '.join(kivi)}) do not apply: leave them out of "
                         "--formats")  # fmt: skip
    if memory != "none" and any(resids):  # before minutes of measuring
        raise InputError(f"--resids {args.resids}: a model with a memory (memory.kind={memory}) stores every slot, "
                         "the recent window's too, in the policy's formats: it takes --resids 0")  # fmt: skip
    windows = held_out_windows(model, args.split, args.seq_len + 1, args.tokens, args.data_dir, args.dataset,
                               args.over_split)  # fmt: skip
    try:
        result = tune(model.model, windows, args.budget, args.max_dnll, formats=formats, resids=resids,
                      chunk=args.chunk, dtype=args.dtype)  # fmt: skip
    except KVValueError as e:
        raise e.instead("leave the format out of --formats") from None
    print(table(result["verified"], at_seq_len=True))
    best = result["best"]
    verdict = "meets" if result["meets_max_dnll"] else "EXCEEDS"
    limit = f" (--max-dnll {args.max_dnll:g}: {verdict})" if args.max_dnll is not None else ""
    print(f"best under {args.budget:g} bytes/token held at seq_len {args.seq_len} (column B/tok@{args.seq_len}): "
          f"{best['policy']}  dNLL {best['dnll']:+.5f}{limit}")  # fmt: skip
    if records:
        rows = [make_record("kv_tune", model, budget=args.budget, max_dnll=args.max_dnll, role=role, **row)
                for role, group in (("sensitivity", result["sensitivity"]), ("verified", result["verified"]))
                for row in group]  # fmt: skip
        print(f"records: {append_records(records, rows)}")
    return 0 if result["meets_max_dnll"] else 1


def unquantized_note(cfg, report: dict, policy: str | None) -> str | None:
    """What `info` says when a KV policy quantizes nothing at seq_len: every token is still in its full-precision
    residual window (resid >= seq_len, or a flush that never comes), so the total is the plain cache's while the
    per-token figure is that of the tokens past the window; None otherwise."""
    if policy is None or report["memory"] is not None:  # (a memory stores every slot in its format)
        return None
    plain = kv_report(cfg, report["dtype"], report["seq_len"])
    if report["kv_bytes"] != plain["kv_bytes"] or report["kv_bytes_per_token"] == plain["kv_bytes_per_token"]:
        return None
    cause, fix = KVPolicy.parse(policy).idle_cause(report["seq_len"])  # (the window, a KIVI group or a flush)
    return (f"nothing is quantized at seq_len {report['seq_len']}: {cause}, so the total is the plain "
            f"{report['dtype']} cache's; the {format(report['kv_bytes_per_token'], ',')} bytes per token are "
            f"what tokens past the window take: give a longer --seq-len, or {fix}")  # fmt: skip


def remove_killed_temporaries(out: Path, what: str) -> None:
    """Removes the hidden temporaries beside `out` that a `what` (conversion, export) killed while writing left
    (SIGKILL, out of memory: .OUT.<pid>.<hex>.tmp, data.files.temp_path_beside), saying so in a warning. Those of
    `out` itself go as soon as their process is gone from this machine, since this command is about to write `out`
    again; the temporaries of other names only after 10 idle minutes (a writer on another machine sharing the
    folder, whose process cannot be seen from here, is left alone)."""
    folder = out.parent  # where temp_path_beside(out) puts them
    try:
        removed = remove_stale_temporaries(folder, names=re.escape(temporary_stem(out.name)), idle_seconds=0)
        removed += remove_stale_temporaries(folder)
    except PermissionError:  # a folder this user may write to but not list: nothing of theirs to clean
        return
    if removed:
        pids = sorted({TEMPORARY.fullmatch(path.name)["pid"] for path in removed})
        warnings.warn(f"removed {', '.join(str(path) for path in removed)}: left by a {what} or another write "
                      f"killed before it finished (process {', '.join(pids)}, gone)", AttnlabWarning,
                      stacklevel=2)  # fmt: skip


# An export inside a run's folder is refused as a conversion there is (INSIDE_A_RUN): its config.json and weights would
# sit among the run's own files (in checkpoints/, beside the run's checkpoints, which the run loads and prunes).
EXPORT_INSIDE_A_RUN = ("an export saved there would be mixed with the run's own files (in its checkpoints/, with its "
                       "checkpoints, which the run loads and prunes): give a folder outside any run, e.g. --hf "
                       "hf/NAME")  # fmt: skip


def cmd_export(args) -> int:
    problem = run_folder_problem(args.hf, EXPORT_INSIDE_A_RUN, flag="--hf")
    if problem:
        raise InputError(problem)
    remove_killed_temporaries(Path(args.hf), "export")
    exported = export(args.ref, args.hf, data_dir=args.data_dir, dtype=args.dtype, overwrite=args.overwrite)
    print(exported.summary())
    return 0


# convert's defaults: cli.py leaves these options None unless given, so that an option given at its default value is
# told from one left out (and must do something for this conversion)
CONVERT_DEFAULTS = {"rope_pairs": "energy", "calibration_tokens": 4096, "calibrate_on": "wikitext2-nounk",
                    "seq_len": 512, "dataset": "wikitext2-raw"}  # fmt: skip


def convert_options_given(args) -> set[str]:
    """The names of convert's defaulted options the user gave; the others take CONVERT_DEFAULTS (set on args)."""
    given = {key for key in CONVERT_DEFAULTS if getattr(args, key) is not None}
    for key in CONVERT_DEFAULTS.keys() - given:
        setattr(args, key, CONVERT_DEFAULTS[key])
    return given


def check_convert_flags(args, attention: dict | None, given: set[str]) -> None:
    """convert's options that would do nothing for this conversion, refused (InputError, one line) before the model
    is loaded."""
    kind = (attention or {}).get("kind")
    flag = lambda key: f"--{key.replace('_', '-')} {getattr(args, key)}"  # noqa: E731
    if kind not in LOW_RANK:
        this = f"this one is {kind}" if kind else "this one keeps the source's attention kind"
        for key in ("rope_pairs", "calibration_tokens", "calibrate_on"):
            if key in given and getattr(args, key) != 0:  # (--calibration-tokens 0: no calibration, as is)
                raise InputError(f"{flag(key)} applies to bottleneck/decoupled/mla conversions ({this}): leave "
                                 "it out")  # fmt: skip
    elif args.calibration_tokens == 0 and "calibrate_on" in given:
        raise InputError(f"{flag('calibrate_on')} does nothing with --calibration-tokens 0 (the factorisations "
                         "then fit the weights alone): leave one of them out")  # fmt: skip
    for key in ("seq_len", "dataset") if args.eval_tokens == 0 else ():
        if key in given:
            raise InputError(f"{flag(key)} applies to the perplexity that --eval-tokens 0 skips: leave it out, or "
                             "give --eval-tokens")  # fmt: skip


def check_convert_source(args, cfg, name, given: set[str], calibrating: bool) -> None:
    """convert's --seq-len within the source's context (when it was given: the default is cut to it), and enough
    --calibration-tokens to fit on for its d_model (when they are used)."""
    if args.eval_tokens and "seq_len" in given and args.seq_len > cfg.max_seq_len:
        raise InputError(f"--seq-len {args.seq_len} is more than {name}'s max_seq_len={cfg.max_seq_len}: give "
                         f"--seq-len {cfg.max_seq_len} or less")  # fmt: skip
    problem = calibration_size_problem(args.calibration_tokens, cfg, "--calibration-tokens") if calibrating else None
    if problem:
        raise InputError(problem)


def check_something_to_convert(args, source, target) -> None:
    """A conversion whose target is the source (e.g. --attention kind=mha of an mha model) would write a copy of it:
    refused as "nothing to convert", as convert without --attention and --memory is."""
    if not unchanged(source, target):
        return
    asked = " ".join(f"--{key} {getattr(args, key)}" for key in ("attention", "memory") if getattr(args, key))
    attention, n_kv = source.attention, kv_heads(source)
    window = f" (window {attention.window})" if attention.kind == "sliding" else ""
    memory = "no memory" if source.memory.kind == "none" else f"memory {source.memory.kind}"
    example = "--attention kind=mha,n_kv_heads=1" if n_kv > 1 else "--attention kind=coda"
    raise InputError(f"nothing to convert: {asked} asks for {args.ref} as it already is: attention {attention.kind}"
                     f"{window} with {n_kv} KV heads for its {source.n_heads} query heads, head_dim "
                     f"{attention.dim(source)}, and {memory}; give an attention or a memory it does not have (e.g. "
                     f"{example})")  # fmt: skip


INSIDE_A_RUN = ("a conversion saved there would be taken for the run's own files (in its checkpoints/, for one of "
                "its checkpoints, which the run loads and prunes): give a folder outside any run, e.g. --out "
                "converted/NAME")  # fmt: skip


def cmd_convert(args) -> int:
    try:
        return convert(args)
    except ConfigError as e:
        raise flagged_problems(e) from None


def flagged_problems(error: ConfigError) -> ConfigError:
    """A conversion's ConfigError (its problems said as "convert: attention.window ...", for a manifest's init_from)
    named by their flags, as `info --memory` names its problems: "--memory: memory.recent_window=0 must be >= 1"
    (other errors as they are)."""
    if error.source != "convert" and not any(p.startswith("convert: ") for p in error.problems):
        return error
    problems = []
    for problem in (p.removeprefix("convert: ") for p in error.problems):
        section = next((s for s in ("attention", "memory") if problem.startswith(f"{s}.")), None)
        problems.append(f"--{section}: {problem}" if section else problem)
    return ConfigError(problems)


def convert(args) -> int:
    broken = broken_link(args.out)  # (the conversion's folder is renamed onto --out itself: "Not a directory")
    if broken:
        raise InputError(f"--out {args.out}: {broken}: remove the link, or give another --out")
    if Path(args.out).exists():  # before minutes of loading and scoring
        raise InputError(f"--out {args.out}: already exists (choose another folder, or delete it first)")
    problem = run_folder_problem(args.out, INSIDE_A_RUN)
    if problem:
        raise InputError(problem)
    out_was_there = os.path.lexists(args.out)  # (a link to nothing)
    check_writable("--out", Path(args.out))
    remove_killed_temporaries(Path(args.out), "conversion")
    given = convert_options_given(args)
    for flag, value, least in (("--eval-tokens", args.eval_tokens, 0), ("--calibration-tokens",
                               args.calibration_tokens, 0), ("--seq-len", args.seq_len, 1)):  # fmt: skip
        if value < least:
            raise InputError(f"{flag}={value} must be >= {least}" + (" (0 = skip)" if least == 0 else ""))
    for problem in (calibration_tokens_problem(args.calibration_tokens, "--calibration-tokens"),
                    source_problem(args.calibrate_on, "--calibrate-on")):  # fmt: skip
        if problem:
            raise InputError(problem)
    attention = key_values("--attention", args.attention, "kind=mha,n_kv_heads=1") if args.attention else None
    memory = key_values("--memory", args.memory, "kind=streaming,recent_window=252") if args.memory else None
    if not attention and not memory:
        raise InputError(
            "nothing to convert: give --attention and/or --memory (e.g. --attention kind=mha,n_kv_heads=1)"
        )
    check_convert_flags(args, attention, given)
    if args.eval_tokens:
        check_dataset_path("--dataset", args.dataset, args.data_dir)
    problem = split_problem(args.dataset, "test") if args.eval_tokens else None
    if problem:
        raise InputError(f"--dataset {problem}; convert scores a test split: give a dataset with one (e.g. "
                         "wikitext2-raw), or --eval-tokens 0")  # fmt: skip
    calibrating = args.calibration_tokens and (attention or {}).get("kind") in LOW_RANK
    if calibrating:  # its text opened (its first document read) before the model is loaded
        try:
            next(iter(open_source(args.calibrate_on, args.data_dir, splits=("train",)).documents()), None)
        except DataError as e:
            raise calibration_error(args, e) from None
    try:  # the source's config alone (a .gguf file's header): a target it cannot make is said before loading
        header = model_config_of(args.ref, args.data_dir)
    except AttnlabError:  # (loading it says what is wrong with the reference)
        header = None
    if header is not None:
        check_convert_source(args, header, args.ref, given, calibrating)
        check_something_to_convert(args, header, target_config(header, attention, memory))
    source = load_for_eval(args.ref, data_dir=args.data_dir)
    check_convert_source(args, source.cfg, source.name, given, calibrating)
    check_something_to_convert(args, source.cfg, target_config(source.cfg, attention, memory))
    calibration = None
    if calibrating:  # activation-aware factorisations
        try:
            calibration = dataset_tokens(source.tokenizer, args.calibrate_on, "train", args.data_dir)
        except MemoryError:
            raise DataError(f"--calibrate-on {too_large(args.calibrate_on, args.data_dir)}") from None
        except DataError as e:
            raise calibration_error(args, e) from None
        held, calibration = len(calibration), calibration[: args.calibration_tokens]
        if len(calibration) < calibration_minimum(source.cfg):
            raise DataError(f"--calibrate-on {args.calibrate_on}: its train split holds {len(calibration)} "
                            f"token(s) for {source.name}'s tokenizer, fewer than the {calibration_minimum(source.cfg)} "
                            f"a calibration of d_model={source.cfg.d_model} needs: give a longer text, or "
                            "--calibration-tokens 0 to fit the weights alone")  # fmt: skip
        if held < args.calibration_tokens:  # (fitted on what there is, said)
            warnings.warn(f"--calibration-tokens {args.calibration_tokens:,}: {args.calibrate_on}'s train split holds "
                          f"{held:,} tokens, all fitted on", LengthWarning, stacklevel=1)  # fmt: skip
    # the held-out text is read before the conversion and --out is written last: a mistake leaves no --out behind
    try:
        tokens = dataset_tokens(source.tokenizer, args.dataset, "test", args.data_dir) if args.eval_tokens else None
    except MemoryError:
        raise DataError(f"--dataset {too_large(args.dataset, args.data_dir)}") from None
    conversion = convert_model(source.cfg, source.model, attention, memory, rope_pairs=args.rope_pairs,
                               calibration=None if calibration is None else torch.from_numpy(calibration))  # fmt: skip
    seq_len = min(args.seq_len, source.cfg.max_seq_len)
    scores = []
    if tokens is not None:
        warn_unknown_tokens(source.tokenizer, tokens[: args.eval_tokens + 1], f"{args.dataset} test scored")
        for name, model in (("original", source.model), ("converted, cold", conversion.model)):
            try:
                s = summarize_losses(window_losses(model, tokens, seq_len, max_tokens=args.eval_tokens))
            except InputError as e:  # NaN logits: a broken source (or conversion) is no model to save
                raise InputError(f"{args.ref}: the {name.split(',')[0]} model: {e}; nothing was written") from None
            scores.append(f"  {name}: perplexity {s['ppl']:.2f} [{s['ppl_ci'][0]:.2f}, {s['ppl_ci'][1]:.2f}] on the "
                          f"first {s['tokens']:,} tokens of {args.dataset} test, context {seq_len}")  # fmt: skip
    try:
        folder = save_conversion(args.out, conversion, source.tokenizer, source=str(args.ref))
    except CheckpointError:
        if out_was_there or not os.path.lexists(args.out):
            raise
        # made since the check above: another command (a second convert into the same --out, say) wrote it, and the
        # rename of this conversion's complete folder, which puts a folder over a missing or empty one only, failed
        raise InputError(f"--out {args.out}: already exists: another command wrote it while this conversion ran (it "
                         "is left as it is; this conversion was not saved): choose another --out, or delete it and "
                         "convert again") from None  # fmt: skip
    rows = []
    for name, cfg in (("original", source.cfg), ("converted", conversion.cfg)):
        what = ", ".join(f"{k}={v}" for k, v in cfg.attention.to_dict().items())
        what += "" if cfg.memory.kind == "none" else f"; memory {cfg.memory.kind}"
        rows.append(f"  {name}: {what}; KV {kv_report(cfg, 'fp16', seq_len)['kv_bytes'] / seq_len:,.0f} bytes/token "
                    f"at {seq_len} (fp16)")  # fmt: skip
    print(f"{source.name} -> {folder}\n" + "\n".join(rows + [f"  {note}" for note in conversion.notes]))
    print(
        f"  {len(conversion.fresh)} parameter tensors start as built (the source has nothing for them)"
        + (f": {', '.join(sorted({n.split('.', 2)[-1] for n in conversion.fresh}))}" if conversion.fresh else "")
    )
    if scores:
        print("\n".join(scores))
    return 0
