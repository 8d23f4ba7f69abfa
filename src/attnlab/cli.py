"""The `attnlab` command: thin argparse subcommands over library functions.

User mistakes (bad config, bad input, a damaged file, a folder it may not write) print one clear line and exit
with code 2; a bug of attnlab's still shows its traceback.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # `python -m attnlab.cli`: through the entry point, which says a Ctrl-C during the imports
    from attnlab.entry import main as entry_main  # below in one line, as the `attnlab` command does

    sys.exit(entry_main())

import argparse
import dataclasses
import json
import os
import tempfile
import warnings
from pathlib import Path

try:  # importing torch writes a file in the temporary directory: with none usable, one line (not a traceback)
    tempfile.gettempdir()
except OSError:
    from attnlab.entry import command_name
    from attnlab.paths import temporary_directory_problem

    command = command_name(sys.argv[1:])
    print(f"attnlab{' ' + command if command else ''}: error: {temporary_directory_problem()}", file=sys.stderr)
    sys.exit(2)

import torch

from attnlab.accounting import info, memory_note
from attnlab.attention.registry import REGISTRY
from attnlab.cli_errors import (
    Parser,
    check_greedy_flags,
    check_torchrun,
    check_utf8_arguments,
    echoed_by_rank0,
    escaped_stdout,
    fail,
    item_limit,
    kv_policy_text,
    os_error_line,
    peer_lost_line,
    too_deep_line,
    warning_printer,
)
from attnlab.cli_memory import add_train_memory_flags, check_train_memory_flags, train_memory_report, with_memory_option
from attnlab.cli_models import (
    check_given_once,
    check_results_folder,
    cmd_convert,
    cmd_export,
    cmd_kv_eval,
    cmd_kv_tune,
    unquantized_note,
)
from attnlab.cli_store import DEFAULT_NEW_TOKENS, REFERENCE_HELP, add_memory_parser, add_sampling_arguments
from attnlab.cli_validate import LINK_LOOP, cmd_validate
from attnlab.compare import UNSEALED_HELP, compare
from attnlab.config import ModelConfig
from attnlab.config_checks import MAX_INT
from attnlab.config_io import FILE_KINDS, load_config, other_config
from attnlab.data.files import link_loop, seal_kept, special_file
from attnlab.data.stream import TextStream
from attnlab.entry import Terminated, interrupted
from attnlab.envcheck import kernels_env_problem, thread_env_problem
from attnlab.errors import AttnlabError, AttnlabWarning, ConfigError, InputError, LengthWarning
from attnlab.eval import append_records, load_for_eval
from attnlab.eval.harness import BENCHMARKS, benchmark_names, load_plan, parameters, run_plan
from attnlab.eval.loading import WEIGHTS
from attnlab.eval.multiple_choice import run_multiple_choice, task_given_first, write_multiple_choice
from attnlab.eval.probes import (
    comparison_record,
    distinct_names,
    load_suite,
    probe_records,
    run_probes,
    summarize,
    summary_table,
)
from attnlab.eval.records import read_records, records_folder
from attnlab.eval.report import build_report
from attnlab.eval.stats import paired_comparison
from attnlab.generate import generate, room_problem
from attnlab.interop.convert import PAIR_RULES
from attnlab.interop.references import checked_model_config
from attnlab.interop.tokenizer import warn_unknown
from attnlab.manifest import file_kind, load_manifest
from attnlab.model.qlinear import ACTIVATIONS
from attnlab.paths import cache_dir, check_data_dirs
from attnlab.runner import run_manifest


def cmd_list(args) -> int:
    for kind, variant in REGISTRY.items():
        print(f"{kind}: {variant.summary}")
        for f in dataclasses.fields(variant.config):
            default = "required" if f.default is dataclasses.MISSING else f"default {f.default!r}"
            print(f"    {f.name}: {f.type} ({default})")
    return 0


def cmd_run(args) -> int:
    manifest = load_manifest(args.manifest, args.set, args.data_dir, args.target)
    table = Path(args.out) / manifest.name / "compare.md"
    kept = table.read_bytes() if table.is_file() else None  # with no record: accepted by run_manifest, or refused
    run_manifest(
        manifest, args.out, targets=args.target, seeds=args.seed, data_dir=args.data_dir, dry_run=args.dry_run,
        resume=not args.no_resume, progress=not args.no_progress, convert_only=args.convert_only,
        unsealed=args.unsealed,
    )  # fmt: skip
    if not args.dry_run and not args.convert_only and os.environ.get("RANK", "0") == "0":  # rank 0 reports
        result = compare(Path(args.out) / manifest.name, kept=kept, unsealed=args.unsealed)
        print("\n" + result["text"])
        print(f"table: {result['markdown']}  csv: {result['csv']}  plot: {result['plot']}")
    return 0


def cmd_compare(args) -> int:
    result = compare(args.runs_dir, args.out, args.baseline, unsealed=args.unsealed)
    print(result["text"])
    print(f"table: {result['markdown']}  csv: {result['csv']}  plot: {result['plot']}")
    return 0


def _fmt(n: float) -> str:
    return f"{n:,.0f}"


CONFIG_SUFFIXES = (".yaml", ".yml", ".json")  # what `info` reads as a model config file (not a model reference)


def config_file(path: str) -> ModelConfig:
    """A model config file (load_config); a file of something else (a run's config.yaml or config.json, a Hugging
    Face config.json, best.json) is one line saying what `info` takes, not every key it lacks."""
    try:
        return load_config(path)
    except ConfigError:
        what = other_config(path)
        if what is not None:
            raise ConfigError(f"{what}: `attnlab info` takes a model config file (.yaml or .json, keys vocab_size, "
                              f"d_model, ...) or a model reference: {REFERENCE_HELP} (for a run, a checkpoint or a "
                              "Hugging Face model, give its folder)", source=path) from None  # fmt: skip
        raise


def cmd_info(args) -> int:
    if link_loop(args.config):
        raise ConfigError(LINK_LOOP, source=str(args.config))
    # A model config file, as `validate` reads one: YAML, or JSON (which YAML reads too); else a model reference.
    is_config = Path(args.config).suffix.lower() in CONFIG_SUFFIXES and not Path(args.config).is_dir()
    kind = file_kind(args.config) if is_config and Path(args.config).is_file() else "model"
    if kind != "model":  # (read as a model config, its keys were said to be unknown ones: `seeds`, n_heads?)
        what = next(words for _, named, words in FILE_KINDS if named == kind)
        raise InputError(f"{args.config}: is {what}: info takes a model config or a model reference (e.g. a run's "
                         f"folder, a .gguf file); to check a manifest: attnlab validate {args.config}")  # fmt: skip
    cfg = config_file(args.config) if is_config else checked_model_config(args.config, args.data_dir)
    if args.memory is not None:
        cfg = with_memory_option(cfg, args.memory)
    if args.seq_len is not None and not 1 <= args.seq_len <= MAX_INT:
        raise InputError(f"--seq-len {args.seq_len} must be in 1 .. {MAX_INT:,} (2**31 - 1) tokens")
    report = info(cfg, dtype=args.dtype, seq_len=args.seq_len, policy=args.kv_policy)
    check_train_memory_flags(args)
    training = train_memory_report(cfg, args) if args.train_memory else None
    if report["seq_len"] > cfg.max_seq_len and cfg.memory.kind == "none":
        # Said beside the figures, not refused: the bytes of a longer context are what a model made longer needs.
        warnings.warn(f"--seq-len {report['seq_len']} is past max_seq_len {cfg.max_seq_len}: the KV figures are the "
                      f"cache's size at {report['seq_len']:,} tokens, a context this model (no memory) does not read "
                      f"(generate and bench stop at {cfg.max_seq_len} tokens; --memory gives a cache that streams)",
                      AttnlabWarning, stacklevel=1)  # fmt: skip
    if args.json:
        print(json.dumps(report if training is None else {**report, "train_memory": training[0]}))
        return 0
    print(f"{args.config}: {report['kind']} attention, {cfg.n_layers} layers, d_model {cfg.d_model}")
    print("parameters:")
    for part, n in report["params"].items():
        print(f"  {part:<10} {_fmt(n):>15}")
    policy = f", policy {report['kv_policy']}" if "kv_policy" in report else ""
    print(f"KV cache ({report['dtype']}, seq_len {report['seq_len']}{policy}):")
    for name, size in report["cache_fields"].items():
        print(
            f"  {name:<10} {size:>15,.4g} bytes/token/layer"
            if size % 1
            else f"  {name:<10} {_fmt(size):>15} bytes/token/layer"
        )
    print(f"  per token  {_fmt(report['kv_bytes_per_token']):>15} bytes (all layers)")
    print(f"  per layer  {_fmt(report['kv_bytes_per_layer']):>15} bytes at seq_len")
    print(f"  total      {_fmt(report['kv_bytes']):>15} bytes at seq_len")
    note = unquantized_note(cfg, report, args.kv_policy)
    if note:
        print(f"  ({note})")
    if report["memory"] is not None:
        print(f"  ({memory_note(report)})")
    elif report["capacity"] is not None:
        print(f"  (bounded cache: at most {report['capacity']} tokens per layer)")
    for line in training[1] if training else []:
        print(line)
    return 0


def _pm(value, stderr) -> str:
    return "n/a" if value is None else f"{value:.4f}" + ("" if stderr is None else f" ± {stderr:.4f}")


def cmd_mc(args) -> int:
    if args.out:  # before minutes of scoring
        records_folder(args.out, "multiple_choice.jsonl", "multiple_choice_items.jsonl")
    what = special_file(args.file) if args.file is not None else None
    if what is not None:  # before the model is loaded (a fifo would be waited on without end)
        raise InputError(f"--file {args.file}: {what}: give the task's data file (a regular file)")
    task_given_first(args.task, args.checkpoint)  # (before the model loads)
    model = load_for_eval(args.checkpoint, data_dir=args.data_dir, weights=args.weights, activations=args.activations)
    rows, s = run_multiple_choice(model, args.task, path=args.file, limit=args.limit, data_dir=args.data_dir)
    print(
        f"{model.name} {s['task']} (n={s['n']}, {s['n_truncated']} contexts cut to {s['max_seq_len']} tokens): "
        f"acc {_pm(s['acc'], s['acc_stderr'])}  acc_norm {_pm(s['acc_norm'], s['acc_norm_stderr'])}"
    )
    if args.out:
        summary_path, items_path = write_multiple_choice(args.out, rows, s)
        print(f"records: {summary_path}  items: {items_path}")
    return 0


def cmd_probes(args) -> int:
    if not 0 <= args.seed < 2**32:
        raise InputError(f"--seed {args.seed} must be from 0 to 2**32 - 1 (the bootstrap's seed)")
    records_folder(args.out, "probes.jsonl")  # before the models are loaded and probed
    suite, out, runs = load_suite(args.suite), Path(args.out), []
    paths = [args.checkpoint] + ([args.checkpoint_b] if args.checkpoint_b else [])
    models = [
        load_for_eval(path, data_dir=args.data_dir, weights=args.weights, activations=args.activations)
        for path in paths
    ]
    distinct_names(models)  # two runs both named base/seed0 are told apart by their folders
    for model in models:
        rows = run_probes(model, suite)
        print(summary_table(summarize(rows), title=f"{model.name} on {suite.name} ({len(rows)} cases)"))
        append_records(out / "probes.jsonl", probe_records(model, suite, rows))
        runs.append((model, rows))
    if len(runs) == 2:
        (a, rows_a), (b, rows_b) = runs
        names = (a.name, b.name) if a.name != b.name else ("A", "B")
        comparison = paired_comparison(rows_a, rows_b, names=names, seed=args.seed)
        print(comparison["verdict"])
        append_records(out / "probes.jsonl", [comparison_record(a, b, suite, comparison)])
    print(f"records: {out / 'probes.jsonl'}")
    return 0


def cmd_bench(args) -> int:
    if args.list:
        return list_benchmarks(args)
    if not args.targets:
        raise ConfigError("give a benchmark manifest or checkpoint folders (or --list)")
    benchmarks = args.benchmarks.split(",") if args.benchmarks is not None else None
    plan = load_plan(args.targets, benchmarks, args.set, args.data_dir)
    out = Path(args.out or Path("results") / plan.name)
    records = run_plan(plan, out)
    unsealed = " --unsealed" if any(seal_kept(r) is None for r in read_records(records)) else ""
    print(f"records: {records}  (render them with: attnlab report {out}{unsealed})")
    return 0


def list_benchmarks(args) -> int:
    """`bench --list [--benchmarks A,B]`: each benchmark (those named) with its parameters. An option --list does not
    use (a target, --out, --set, --data-dir) is one line, not silently ignored."""
    if args.targets:
        raise InputError(f"--list takes no manifest or checkpoint ({' '.join(args.targets)}): give --list alone")
    unused = [flag for flag, given in (("--out", args.out is not None), ("--set", bool(args.set)),
                                       ("--data-dir", args.data_dir is not None)) if given]  # fmt: skip
    if unused:
        raise InputError(f"--list prints the benchmarks and runs none: {' and '.join(unused)} "
                         f"{'is' if len(unused) == 1 else 'are'} not used with it (remove {' and '.join(unused)}, or "
                         "drop --list to run benchmarks; --benchmarks A,B lists only those)")  # fmt: skip
    names = list(BENCHMARKS)
    if args.benchmarks is not None:
        names = benchmark_names(args.benchmarks.split(","))
    for name in dict.fromkeys(names):
        params = ", ".join(f"{k}={v!r}" for k, v in parameters(name).items())
        print(f"{name}: {BENCHMARKS[name].__doc__.splitlines()[0]}\n    {params}")
    return 0


def cmd_generate(args) -> int:
    check_greedy_flags(args)  # before the model loads
    if args.chat and not args.prompt.strip():  # as an empty prompt is refused without --chat
        raise InputError(f"prompt {args.prompt!r} is an empty chat turn: give the user's message (--chat answers it)")
    model = load_for_eval(args.checkpoint, data_dir=args.data_dir, weights=args.weights, activations=args.activations)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ConfigError(f"{args.checkpoint}: no tokenizer saved with this checkpoint: cannot encode a prompt")
    if args.chat and not getattr(tokenizer, "chat_template", None):  # named as given, not as the tokenizer names it
        raise InputError(f"{args.checkpoint}: the model has no chat template (--chat needs one; leave it out)")
    prompt = tokenizer.encode_chat(args.prompt) if args.chat else tokenizer.encode_prompt(args.prompt)
    cfg, new_tokens = model.model.cfg, args.max_new_tokens
    if new_tokens is None:  # the default: up to DEFAULT_NEW_TOKENS, as many as the context leaves room for
        room = cfg.max_seq_len - len(prompt) if cfg.memory.kind == "none" else DEFAULT_NEW_TOKENS
        new_tokens = min(DEFAULT_NEW_TOKENS, max(1, room))  # no room at all: said just below
    problem = room_problem(cfg, len(prompt), new_tokens)  # before the warning: a refused command says one line
    if problem:
        raise InputError(problem)
    warn_unknown(tokenizer, args.prompt, "the prompt")  # a char or word vocabulary reads what it lacks as <unk>
    lead = "" if args.chat else args.prompt
    with TextStream(tokenizer, skip=tokenizer.stop_ids, lead=lead) as stream:  # as it comes: an interrupt keeps it
        generate(model.model, torch.tensor(prompt), max_new_tokens=new_tokens, temperature=args.temperature,
                 top_k=args.top_k, top_p=args.top_p, seed=args.seed, kv_policy=args.kv_policy,
                 stop_tokens=tokenizer.stop_ids, callback=stream)  # fmt: skip
    return 0


def cmd_lm_eval(args) -> int:
    tasks = [task.strip() for task in args.tasks.split(",")]  # (checked before lm-eval's minutes of imports)
    if not any(tasks):
        raise ConfigError(f"--tasks {args.tasks!r} names no task (give lm-eval task names separated by commas, e.g. "
                          "arc_easy,piqa)")  # fmt: skip
    if any(not task for task in tasks):
        raise ConfigError(f"--tasks {args.tasks!r}: holds an empty task name (give names separated by single commas, "
                          "e.g. arc_easy,piqa)")  # fmt: skip
    tasks = [task for task in tasks if task]
    check_given_once("--tasks", args.tasks, tasks)
    if args.out:
        check_results_folder(args.out, "results/lm_eval")  # before the model loads, not after the evaluation
    from attnlab.eval.lmeval import run_lm_eval, table  # lm-eval is an optional extra: pip install 'attnlab[lmeval]'

    results = run_lm_eval(args.checkpoint, tasks, out_dir=args.out, kv_policy=args.kv_policy, limit=args.limit,
                          num_fewshot=args.num_fewshot, data_dir=args.data_dir, include_path=args.include_path,
                          batch_size=args.batch_size, weights=args.weights, activations=args.activations)  # fmt: skip
    print(table(results))
    if args.out:
        print(f"results: {Path(args.out) / 'lm_eval.json'}  items: {Path(args.out) / 'lm_eval_samples.jsonl'}")
    return 0


def cmd_report(args) -> int:
    pairs = []
    for pair in args.paired:
        a, sep, b = pair.partition(":")
        if not sep or not a or not b:
            raise InputError(f"--paired {pair!r}: give two model labels as A:B (e.g. --paired gqa_bounded/seed0:"
                             "gqa_unbounded/seed0), A minus B")  # fmt: skip
        pairs.append((a, b))
    result = build_report(args.dir, pairs, args.unsealed)
    counts = f"{len(result['tables'])} tables, {len(result['plots'])} plots"
    print(f"report: {result['markdown']}  {result['html']}  ({counts})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="attnlab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="attention kinds and their options").set_defaults(func=cmd_list)
    p = sub.add_parser(
        "validate", help="check model configs, manifests, benchmark manifests and probe suites, reporting every problem"
    )
    p.add_argument("files", nargs="+")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="manifest override")
    p.add_argument("--data-dir", help="where data files and models are (else $ATTNLAB_DATA): a manifest target's "
                   "init_from model is looked up there and checked")  # fmt: skip
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("run", help="train a manifest's targets x seeds, then compare them")
    p.add_argument("manifest")
    p.add_argument("--target", action="append", help="only this target (repeatable)")
    p.add_argument("--seed", action="append", type=int, help="only this seed (repeatable)")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override, e.g. --set train.lr=3e-4 (repeatable)")  # fmt: skip
    p.add_argument("--data-dir", default=None, help="where data files are (else $ATTNLAB_DATA, then the user cache)")
    p.add_argument("--out", default="runs", help="output root (default runs/); runs go to OUT/<manifest>/...")
    p.add_argument("--dry-run", action="store_true", help="print what would run")
    p.add_argument("--convert-only", action="store_true", help="only make the conversions of the targets that "
                   "start from a pretrained model (<target>/converted: the cold models), train nothing")  # fmt: skip
    p.add_argument("--no-resume", action="store_true",
                   help="ignore existing checkpoints (by default interrupted runs continue from them)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--unsealed", action="store_true", help=UNSEALED_HELP.format(what="run summaries"))
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("compare", help="table and plot of the runs under a folder")
    p.add_argument("runs_dir")
    p.add_argument("--out", default=None, help="where to write compare.md/.csv/val_loss.png (default RUNS_DIR; "
                   "not in a run's folder)")  # fmt: skip
    p.add_argument("--baseline", default=None, help="target the others are compared with")
    p.add_argument("--unsealed", action="store_true", help=UNSEALED_HELP.format(what="run summaries"))
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("mc", help="zero-shot multiple choice (arc_easy, piqa, winogrande, hellaswag), lm-eval style")
    p.add_argument("task", help="arc_easy, piqa, winogrande or hellaswag")
    p.add_argument("checkpoint", help="a model reference: " + REFERENCE_HELP)
    p.add_argument("--limit", type=int, default=None, help="only the first N items")
    p.add_argument("--file", default=None, help="the task's data file (default: its place in the data directory)")
    p.add_argument("--data-dir", default=None, help="where data files are (else $ATTNLAB_DATA, then the user cache)")
    p.add_argument("--out", default=None, help="append records to OUT/multiple_choice.jsonl and *_items.jsonl")
    p.set_defaults(func=cmd_mc)
    p = sub.add_parser("probes", help="behaviour probes per category; with two checkpoints, a paired head-to-head")
    p.add_argument("suite", help="probe suite YAML (e.g. configs/probes/core.yml)")
    p.add_argument("checkpoint", help="a model reference: " + REFERENCE_HELP)
    p.add_argument("checkpoint_b", nargs="?", default=None, help="second checkpoint: McNemar exact test, bootstrap CI")
    p.add_argument("--out", default="results", help="folder for probes.jsonl (default results/)")
    p.add_argument("--data-dir", default=None, help="where data files are (else $ATTNLAB_DATA, then the user cache)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    p.set_defaults(func=cmd_probes)
    p = sub.add_parser("bench", help="run benchmarks on checkpoints (a benchmark manifest or folders) as records")
    p.add_argument("targets", nargs="*", help="a benchmark manifest (.yml) or checkpoint/run folders")
    p.add_argument("--benchmarks", default=None, help="comma-separated subset, e.g. perplexity,needle")
    p.add_argument("--set", action="append", default=[], metavar="BENCH.PARAM=VALUE", help="parameter override")
    p.add_argument("--data-dir", default=None, help="where data files are (else $ATTNLAB_DATA, then the user cache)")
    p.add_argument("--out", default=None, help="artifacts folder (default results/<manifest name>)")
    p.add_argument("--list", action="store_true", help="list the benchmarks and their parameters")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("report", help="tables, plots, report.md and report.html from a bench folder's records")
    p.add_argument("dir", help="the folder `attnlab bench` wrote (holds records.jsonl)")
    p.add_argument("--paired", action="append", default=[], metavar="A:B",
                   help="model labels A:B: perplexity of A minus B on the same windows, paired interval; "
                   "passkey trials of A against B, McNemar's exact p")  # fmt: skip
    p.add_argument("--unsealed", action="store_true", help=UNSEALED_HELP.format(what="records"))
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("info", help="parameters by component and KV-cache bytes of a model config or reference")
    p.add_argument("config", help="a model config (.yaml or .json) or a model reference: " + REFERENCE_HELP)
    p.add_argument("--memory", default=None, help="a memory, e.g. 'kind=bounded,recent_window=256,exact_slots=64,"
                   "summary_slots=64' (model.memory keys); in place of the model's own, if it has one")  # fmt: skip
    p.add_argument("--data-dir", default=None, help="where data files are (else $ATTNLAB_DATA)")
    p.add_argument("--dtype", default="fp16", help="KV storage dtype: fp32, fp16, bf16 (default fp16)")
    p.add_argument("--seq-len", type=int, default=None, help="context length (default max_seq_len)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--kv-policy",
        default=None,
        type=kv_policy_text,
        help='quantized KV cache, e.g. "ksem=q4_0,kgeo=q8_0,v=q4_0,resid=128"',
    )
    add_train_memory_flags(p)
    p.set_defaults(func=cmd_info)
    kv_help = "KV policies, e.g. 'k=q8_0,v=q4_0,resid=128' (formats: fp16 bf16 q8_0 q4_0 nf4 kivi2 kivi4 kivi8)"
    for name, func, text in (
        ("kv-eval", cmd_kv_eval, "quality cost of quantized KV caches on held-out text (dNLL, KL, agreement)"),
        ("kv-tune", cmd_kv_tune, "the KV policy with the least quality loss (KL) under a memory budget"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("checkpoint", help="a model reference: " + REFERENCE_HELP)
        if name == "kv-eval":
            p.add_argument("--policies", nargs="+", required=True, help=kv_help)
        else:
            p.add_argument("--budget", type=float, required=True,
                           help="bytes per token at --seq-len, all layers, residual window included")  # fmt: skip
            p.add_argument("--max-dnll", type=float, default=None, help="exit 1 when the best dNLL is above this")
            p.add_argument("--formats", default="fp16,q8_0,q4_0,nf4", help="formats to try per tensor")
            p.add_argument("--resids", default=None, help="residual window sizes to try (default 0,32,128; 0 for a "
                           "model with a memory, which stores every slot in the policy's formats)")  # fmt: skip
        p.add_argument("--split", default="test", help="held-out split of the checkpoint's dataset (default test)")
        p.add_argument("--dataset", default=None, help="score a named dataset or text file instead, tokenized with "
                       "the model's tokenizer (a pretrained model: e.g. wikitext2-raw)")  # fmt: skip
        p.add_argument("--seq-len", type=int, default=None,
                       help="window length (default 512, or the model's max_seq_len when shorter)")  # fmt: skip
        p.add_argument("--tokens", type=int, default=None, help="held-out tokens to score (default 8192, or the "
                       "whole split when it holds fewer)")  # fmt: skip
        p.add_argument("--chunk", type=int, default=1, help="tokens fed per cache update (default 1: decoding)")
        p.add_argument("--dtype", default="fp16", help="dtype of the residual window and unquantized tensors in "
                                                       "the byte counts (default fp16)")  # fmt: skip
        p.add_argument("--data-dir", default=None, help="where data files are (else $ATTNLAB_DATA)")
        p.add_argument("--out", default=None, help="append records to this JSONL file")
        p.set_defaults(func=func)
    p = sub.add_parser("generate", help="continue a prompt with a model (optionally a quantized KV cache)")
    p.add_argument("checkpoint", help="a model reference: " + REFERENCE_HELP)
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="the prompt as a user turn of the model's chat template; "
                   "prints the answer only")  # fmt: skip
    add_sampling_arguments(p, streams=False)
    p.add_argument("--kv-policy", default=None, type=kv_policy_text, help=kv_help.replace("policies", "policy"))
    p.add_argument("--data-dir", default=None, help="where data files are (else $ATTNLAB_DATA)")
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks on a model (needs the lmeval extra)")
    p.add_argument("checkpoint", help="a model reference: " + REFERENCE_HELP)
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names, e.g. arc_easy,hellaswag")
    p.add_argument("--include-path", action="append", default=None, metavar="DIR",
                   help="a folder of task YAML files besides lm-eval's own (repeatable); a relative data file a task "
                        "names is looked up in the data directory")  # fmt: skip
    p.add_argument("--kv-policy", default=None, type=kv_policy_text, help=kv_help.replace("policies", "policy"))
    p.add_argument("--limit", type=item_limit, default=None,
                   help="the first N items of each task, or a fraction of them (0.1: the first tenth)")  # fmt: skip
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences scored per forward pass (default 1)")
    p.add_argument("--out", default=None, help="write OUT/lm_eval.json and the items to OUT/lm_eval_samples.jsonl")
    p.add_argument("--data-dir", default=None, help="where data files are (else $ATTNLAB_DATA, then the user cache)")
    p.set_defaults(func=cmd_lm_eval)
    p = sub.add_parser(
        "export", help="write a model as a Hugging Face folder (Llama, Mistral or Qwen2) for transformers"
    )
    p.add_argument("ref", help="a model reference: " + REFERENCE_HELP)
    p.add_argument("--hf", required=True, metavar="DIR", help="the folder to write (new or empty, else --overwrite)")
    p.add_argument("--dtype", default="fp32", help="the weights' dtype: fp32, fp16 or bf16 (default fp32)")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it holds an earlier export, nothing else")
    p.add_argument("--data-dir", default=None, help="where data files are (else $ATTNLAB_DATA)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("convert", help="give a model another attention or memory, initialised from its weights")
    p.add_argument("ref", help="a model reference: " + REFERENCE_HELP)
    p.add_argument("--attention", default=None, help="the new attention, e.g. kind=mha,n_kv_heads=1 (MQA), "
                   "kind=coda,gate_bias=-20 or kind=diff; unset options keep the source's heads")  # fmt: skip
    p.add_argument("--memory", default=None, help="a memory, e.g. kind=streaming,recent_window=252")
    p.add_argument("--rope-pairs", default=None, choices=PAIR_RULES, help="bottleneck/decoupled: the source's "
                   "RoPE pairs kept: most q-k weight energy (default), high or low frequencies, uniform")  # fmt: skip
    p.add_argument("--calibration-tokens", type=int, default=None, help="bottleneck/decoupled: tokens the "
                   "factorisations are fitted on (default 4096; 0: the weights alone)")  # fmt: skip
    p.add_argument("--calibrate-on", default=None, help="the text whose train split they come from "
                   "(default wikitext2-nounk: WikiText-2 train, <unk> removed)")  # fmt: skip
    p.add_argument("--out", required=True, metavar="DIR", help="the checkpoint folder to write (must not exist)")
    p.add_argument("--eval-tokens", type=int, default=8192, help="held-out tokens on which to print the original's "
                   "and the cold conversion's perplexity (default 8192; 0 skips it)")  # fmt: skip
    p.add_argument("--dataset", default=None, help="the held-out text (its test split; default "
                   "wikitext2-raw)")  # fmt: skip
    p.add_argument("--seq-len", type=int, default=None, help="the context of that perplexity (default 512)")
    p.add_argument("--data-dir", default=None, help="where data files are (else $ATTNLAB_DATA)")
    p.set_defaults(func=cmd_convert)
    add_memory_parser(sub)
    for name in ("generate", "mc", "probes", "kv-eval", "kv-tune", "lm-eval"):  # the commands that run a model
        sub.choices[name].add_argument(
            "--weights", default="fp32", choices=WEIGHTS, metavar="{" + ",".join(WEIGHTS) + "}",
            help="fp32 (default: every format dequantized, as transformers runs it); native: a GGUF file's "
                 "own F16/Q8_0/Q4_0/Q4_1 matrices, multiplied as stored; or a format to quantize to")  # fmt: skip
        sub.choices[name].add_argument(
            "--activations", default="fp32", choices=ACTIVATIONS, help="fp32 (default: exact against the "
            "dequantized weights) or q8: the inputs of q8_0/q4_0/q4_1 layers quantized to 8 bits per block of 32, "
            "as llama.cpp does (not exact; needs --weights native or a block format)")  # fmt: skip
    return parser


PATH_OPTIONS = ("out", "hf", "store", "data_dir", "model")  # options that name a file or folder


def main(argv: list[str] | None = None) -> int:
    """Runs one command: its exit code. A user's mistake or a damaged file (an AttnlabError, or an OS error
    the user can act on, see os_error_line) ends in one line on stderr, `attnlab <command>: error: ...`, and
    exit code 2; any other exception is a bug and keeps its traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # The command the lines name: `attnlab memory ingest`, as argparse's own errors name a subcommand's.
    command = args.command if getattr(args, "verb", None) is None else f"{args.command} {args.verb}"
    with warnings.catch_warnings(), escaped_stdout():  # restores showwarning, the filters and stdout on the way out
        warnings.simplefilter("always", LengthWarning)  # every cut request said, not only the first
        warnings.showwarning = warning_printer(command, warnings.showwarning)
        try:
            if thread_env_problem():  # (libgomp read it already, at torch's import above: its own line came first)
                raise InputError(thread_env_problem())
            if kernels_env_problem():  # (read at a command's first kernel: a dry run, which builds none, would not)
                raise InputError(kernels_env_problem())
            cache_dir()  # (a relative $XDG_CACHE_HOME: said to be ignored at the start, once)
            for dest in PATH_OPTIONS:  # an empty path ('' from an unset shell variable) names no file or folder
                if getattr(args, dest, None) == "":
                    raise InputError(f"--{dest.replace('_', '-')} is empty: give a path")
            check_utf8_arguments(args, parser.argument_names(args))  # a path of bytes that are not UTF-8
            check_torchrun(args.command)  # only `run` shares its work among torchrun's processes
            if hasattr(args, "data_dir"):
                check_data_dirs(args.data_dir)  # --data-dir and $ATTNLAB_DATA name folders: checked before anything
            return args.func(args)
        except AttnlabError as e:
            if echoed_by_rank0(e):
                return 2
            return fail(command, str(e))
        except KeyboardInterrupt as e:  # Ctrl-C: one line (a run resumes from its last checkpoint), exit code 130
            return interrupted(
                command, getattr(args, "no_resume", False), getattr(args, "dry_run", False), isinstance(e, Terminated)
            )  # SIGTERM (the entry point's handler): 143
        except BrokenPipeError:  # output piped into `head` and the like
            sys.stderr.close()
            return 0
        except OSError as e:
            line = os_error_line(e, args)
            if line is None:
                raise
            return fail(command, line)
        except RecursionError as e:  # a file nested too deeply for the json module (a reader that does not say so)
            line = too_deep_line(e, command)
            if line is None:
                raise
            return fail(command, line)
        except RuntimeError as e:  # under torchrun: another process stopped (said in its own line) or was killed
            line = peer_lost_line(e)
            if line is None:
                raise
            return fail(command, line)
        except MemoryError:  # numpy's and the allocator's out-of-memory: the sizes asked for, not a bug
            advice = ("lower train.batch_size, seq_len, the model's size or max tokens" if args.command == "run" else
                      "smaller inputs: the text, --seq-len, --tokens or the batch")  # fmt: skip
            return fail(command, f"out of memory: the sizes asked for do not fit this machine ({advice})")
