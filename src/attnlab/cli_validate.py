"""`attnlab validate FILE...`: the checks `attnlab run` and `attnlab bench` make on a file, without running anything:
one line per problem, naming the file; a file that is something else (a GGUF model, a run's or a Hugging Face
model's saved config) is said to be, in one line."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from attnlab.config_io import is_gguf, load_config, other_config
from attnlab.data.files import LINK_LOOP as LOOP_WORDS
from attnlab.data.files import link_loop
from attnlab.errors import AttnlabWarning, ConfigError
from attnlab.eval.harness import config_problems, load_plan
from attnlab.eval.identity import plan_labels
from attnlab.eval.probes import load_suite
from attnlab.manifest import file_kind, load_manifest
from attnlab.retrofit import check_pretrained
from attnlab.run_checks import local_data_problem, local_source_problems, prepared_problems, vocab_problems
from attnlab.train.loop import pick_device

LINK_LOOP = f"{LOOP_WORDS}: point the link at the file itself"


VALIDATE_TAKES = "`attnlab validate` takes model configs, experiment and benchmark manifests and probe suites"


def cmd_validate(args) -> int:
    status = 0
    for path in args.files:
        kind = None
        if path == "":  # ('' from an unset shell variable) Path('') is the working directory, a name it would not say
            print(f"'': an empty path names no file: {VALIDATE_TAKES}", file=sys.stderr)
            status = 2
            continue
        try:
            if link_loop(path):
                raise ConfigError(LINK_LOOP, source=str(path))
            if is_gguf(path):
                raise ConfigError(f"a GGUF model file, not a config: {VALIDATE_TAKES} (for a model's parameters and "
                                  f"KV cache: attnlab info {path})", source=str(path))  # fmt: skip
            kind = file_kind(path)
            if args.set and kind not in ("manifest", "bench"):  # a --set nothing would read is not silently ignored
                raise ConfigError("--set applies to experiment and benchmark manifests only (this is a "
                                  f"{'probe suite' if kind == 'probes' else 'model config'}: edit the file)",
                                  source=str(path))  # fmt: skip
            if kind == "manifest":
                manifest = load_manifest(path, args.set, args.data_dir)
                problems = check_pretrained(list(manifest.runs), list(manifest.runs), args.data_dir)
                if args.data_dir:  # where the data is was said: its local files must be there, as `run` checks
                    problems += local_source_problems(list(manifest.runs), args.data_dir)
                for data in dict.fromkeys(spec.data for spec in manifest.runs):  # a local file found: readable
                    if args.data_dir or Path(data.source).expanduser().exists():  # (else --data-dir may find another)
                        problem = local_data_problem(data, args.data_dir)
                        problems += [problem] if problem and problem not in problems else []
                problems += vocab_problems(list(manifest.runs), args.data_dir)  # as run and --dry-run refuse them
                cache_problem = prepared_problems(list(manifest.runs), args.data_dir)
                problems += [cache_problem] if cache_problem else []
                if problems:
                    raise ConfigError(problems, source=str(path))
                warn_devices(path, manifest)
                print(f"{path}: ok (manifest {manifest.name}: {len(manifest.targets)} targets, "
                      f"{len(manifest.seeds)} seeds, {len(manifest.runs)} runs)")  # fmt: skip
                continue
            if kind == "bench":
                plan = load_plan([str(path)], sets=args.set, need_checkpoints=False)
                labels = plan_labels(plan.checkpoints, [], plan.data_dir)  # (as bench labels them in a new folder)
                problems = [p for checkpoint in plan.checkpoints for p in config_problems(
                    checkpoint, labels[checkpoint], plan.benchmarks.items(), plan.data_dir)]  # fmt: skip
                if problems:
                    raise ConfigError(list(dict.fromkeys(problems)), source=str(path))
                print(f"{path}: ok (benchmark manifest {plan.name}: {len(plan.benchmarks)} benchmarks, "
                      f"{len(plan.checkpoints)} checkpoints found)")  # fmt: skip
                continue
            if kind == "probes":
                suite = load_suite(path)
                print(f"{path}: ok (probe suite {suite.name}: {len(suite.cases)} cases)")
                continue
            cfg = load_config(path)
        except ConfigError as error:
            problems = error.problems
            what = other_config(path) if kind == "model" else None
            if what is not None:  # one line for a file that is something else, not each model key it lacks
                model = what.startswith(("an attnlab run", "a Hugging Face", "a GGUF"))  # (a model's own file)
                model = f" (for this model: attnlab info {Path(path).parent})" if model else ""
                problems = [f"{what}: {VALIDATE_TAKES}{model}"]
            for problem in problems:
                print(f"{path}: {problem}", file=sys.stderr)
            status = 2
            continue
        print(f"{path}: ok ({cfg.attention.kind}, {cfg.n_layers} layers, d_model {cfg.d_model})")
    return status


def warn_devices(path, manifest) -> None:
    """A train.device this machine lacks: validate checks the file, which may be meant for another machine, so it
    says so in one warning line and passes; `run` and `run --dry-run` check this machine and refuse it."""
    for device in dict.fromkeys(spec.train.device for spec in manifest.runs):
        try:
            pick_device(device)
        except ConfigError as e:
            lacks = e.problems[0].split(" (use ")[0]
            warnings.warn(f"{path}: {lacks}: `attnlab run` here would refuse it (validate checks the file, for any "
                          "machine; `run --dry-run` checks this one)", AttnlabWarning, stacklevel=1)  # fmt: skip
