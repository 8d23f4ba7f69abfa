"""Behaviour probes: small suites of prompts with unambiguous answers, scored case by case.

A suite is a YAML file (configs/probes/core.yml ships with the project):

    name: core
    description: what the suite measures
    defaults: {kind: first_line, max_new_tokens: 16, ignore_case: false, normalize: tokens}   # optional
    cases:
      - {id: copy-01, category: copy, prompt: "Words: red ball\\nRepeat:", expected: red ball}
      - {id: know-01, category: world_knowledge, kind: choice, prompt: The sun rises in the,
         options: [east, west], answer: 0}

Kinds, on the greedy output (end-of-text stops it; the case's max_new_tokens bounds it):
  exact          the whole output, stripped of surrounding whitespace, equals `expected`
  first_line     the first non-blank line of the output, stripped, equals `expected`
  contains       `expected` occurs in the output
  first_integer  the first integer in the output (a run of digits, with a leading minus) equals `expected`
and, without generating:
  choice         the option with the highest score as a continuation of the prompt is `options[answer]`.
                 Each option is scored as `prompt + " " + option` (no space when the prompt ends in
                 whitespace); score = mean log-prob per token (normalize: tokens, the default), log-prob
                 per character of the option (chars, as lm-eval's acc_norm) or the summed log-prob (none).
Text comparisons are case-sensitive unless `ignore_case: true`. Options are encoded as lm-eval does
(the continuation's ids are those of encode(prompt + continuation) after the prompt's ids).

    suite = load_suite("configs/probes/core.yml")        # strict: one ConfigError listing every problem
    rows = run_probes(model, suite)                       # model: an EvalModel (load_for_eval)
    print(summary_table(summarize(rows)))                 # accuracy per category, Wilson intervals
    append_records(out / "probes.jsonl", probe_records(model, suite, rows))
    comparison = stats.paired_comparison(rows, rows_b, names=(model.name, model_b.name))   # head-to-head
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from attnlab.config_checks import unknown_key_problem
from attnlab.config_io import file_words, read_yaml
from attnlab.errors import AttnlabWarning, ConfigError, InputError, LengthWarning
from attnlab.eval.records import distinct_labels, make_record
from attnlab.eval.scoring import continuation_logprobs, greedy_text
from attnlab.eval.stats import wilson_interval
from attnlab.interop.tokenizer import unknown_line, unknown_pieces
from attnlab.paths import brief

KINDS = ("exact", "first_line", "contains", "first_integer", "choice")
NORMALIZE = ("tokens", "chars", "none")
TOP_KEYS = ("name", "description", "defaults", "cases")
DEFAULT_KEYS = ("kind", "max_new_tokens", "ignore_case", "normalize")
CASE_KEYS = ("id", "category", "kind", "prompt", "expected", "options", "answer", *DEFAULT_KEYS[1:])
BUILTIN = {"max_new_tokens": 16, "ignore_case": False, "normalize": "tokens"}
INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class ProbeCase:
    id: str
    category: str
    kind: str
    prompt: str
    expected: str | int | None = None  # str for text kinds, int for first_integer, None for choice
    options: tuple[str, ...] | None = None  # choice only
    answer: int | None = None  # choice only: index into options
    max_new_tokens: int = 16
    ignore_case: bool = False
    normalize: str = "tokens"


@dataclass(frozen=True)
class ProbeSuite:
    name: str
    description: str
    cases: tuple[ProbeCase, ...]
    source: str = "<dict>"

    @property
    def categories(self) -> dict[str, int]:
        """Cases per category, in order of first appearance."""
        counts: dict[str, int] = {}
        for case in self.cases:
            counts[case.category] = counts.get(case.category, 0) + 1
        return counts

    @property
    def fingerprint(self) -> str:
        """A hash of the cases: records of different suite versions are never mixed up."""
        blob = json.dumps([asdict(c) for c in self.cases], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def only(self, *categories: str) -> ProbeSuite:
        """The suite restricted to some categories (InputError for a category it does not have)."""
        unknown = [c for c in categories if c not in self.categories]
        if unknown:
            raise InputError(f"suite {self.name!r} has no category {unknown} (it has {list(self.categories)})")
        return replace(self, cases=tuple(c for c in self.cases if c.category in categories))


# ----------------------------------------------------------------------------- loading


def load_suite(path: str | Path) -> ProbeSuite:
    """Reads a suite file strictly; raises one ConfigError naming the file and listing every problem."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError("a folder, not a probe suite file (give a suite's YAML file, e.g. configs/probes/core.yml)",
                          source=str(path))  # fmt: skip
    data = read_yaml(path)  # (not found, a link loop, a FIFO: refused there)
    what = file_words(data)
    if what is not None and what[0] != "probes":  # (not each of its keys said unknown: `seeds`, did you mean cases?)
        raise ConfigError(f"is {what[1]}, not a probe suite (a suite has cases:, e.g. configs/probes/core.yml)",
                          source=str(path))  # fmt: skip
    return suite_from_dict(data, source=str(path))


def suite_from_dict(data: Any, source: str = "<dict>") -> ProbeSuite:
    """A suite from parsed YAML; ConfigError(problems, source) lists every problem at once."""
    problems: list[str] = []
    if not isinstance(data, dict):
        raise ConfigError(f"a probe suite must be a mapping with {', '.join(TOP_KEYS)}", source=source)
    for key in data:
        if key not in TOP_KEYS:
            problems.append(unknown_key_problem(str(key), list(TOP_KEYS), "at the top level: "))
    for key in ("name", "description"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            problems.append(f"{key} must be a non-empty string (missing or {data.get(key)!r})")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        problems.append(f"defaults must be a mapping of {', '.join(DEFAULT_KEYS)}")
        defaults = {}
    for key in defaults:
        if key not in DEFAULT_KEYS:
            problems.append(unknown_key_problem(str(key), list(DEFAULT_KEYS), "in defaults: "))
    defaults = {k: v for k, v in defaults.items() if k in DEFAULT_KEYS}
    _check_options(defaults, "defaults", problems)
    cases_raw = data.get("cases")
    if not isinstance(cases_raw, list) or not cases_raw:
        problems.append("cases must be a non-empty list of cases")
        cases_raw = []
    cases, seen = [], {}
    for i, raw in enumerate(cases_raw):
        cid = raw.get("id") if isinstance(raw, dict) else None
        if not isinstance(cid, str):
            cid = None  # _case reports an id that is not a string
        if isinstance(cid, str) and cid in seen:
            problems.append(f"duplicate id {cid!r} (cases[{seen[cid]}] and cases[{i}]): ids must be unique")
        seen.setdefault(cid, i)
        case = _case(raw, i, defaults, problems)
        if case is not None:
            cases.append(case)
    if problems:
        raise ConfigError(problems, source=source)
    return ProbeSuite(data["name"], data["description"], tuple(cases), source)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _hint(value: Any, valid: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value), valid, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else f" (use {', '.join(valid)})"


def _check_options(values: dict, where: str, problems: list[str]) -> None:
    """Checks the keys shared by defaults and cases: kind, max_new_tokens, ignore_case, normalize."""
    if "kind" in values and values["kind"] not in KINDS:
        problems.append(f"{where}: kind={values['kind']!r} is not known{_hint(values['kind'], KINDS)}")
    if "max_new_tokens" in values and not (_is_int(values["max_new_tokens"]) and values["max_new_tokens"] >= 1):
        problems.append(f"{where}: max_new_tokens={values['max_new_tokens']!r} must be an integer >= 1")
    if "ignore_case" in values and not isinstance(values["ignore_case"], bool):
        problems.append(f"{where}: ignore_case={values['ignore_case']!r} must be true or false")
    if "normalize" in values and values["normalize"] not in NORMALIZE:
        problems.append(
            f"{where}: normalize={values['normalize']!r} is not known{_hint(values['normalize'], NORMALIZE)}"
        )


def _case(raw: Any, i: int, defaults: dict, problems: list[str]) -> ProbeCase | None:
    """One validated case, or None after appending its problems."""
    if not isinstance(raw, dict):
        problems.append(f"cases[{i}] must be a mapping with {', '.join(CASE_KEYS[:4])}, ...")
        return None
    cid = raw.get("id")
    where = f"cases[{i}] (id {cid!r})" if isinstance(cid, str) and cid else f"cases[{i}]"
    before = len(problems)
    for key in raw:
        if key not in CASE_KEYS:
            problems.append(unknown_key_problem(str(key), list(CASE_KEYS), f"in {where}: "))
    for key in ("id", "category", "prompt"):
        if key not in raw:
            problems.append(f"{where}: missing key {key!r}")
        elif not isinstance(raw[key], str) or not raw[key].strip():
            problems.append(f"{where}: {key}={raw[key]!r} must be a non-empty string")
    _check_options(raw, where, problems)
    kind = raw.get("kind", defaults.get("kind"))
    if kind is None:
        problems.append(f"{where}: missing key 'kind' (set it on the case or in defaults; one of {', '.join(KINDS)})")
    elif kind in KINDS:
        _check_answer(raw, kind, where, problems)
    if len(problems) > before:
        return None
    values = {**BUILTIN, **{k: v for k, v in defaults.items() if k != "kind"}}
    values.update({k: raw[k] for k in DEFAULT_KEYS[1:] if k in raw})
    options = tuple(raw["options"]) if kind == "choice" else None
    return ProbeCase(
        raw["id"], raw["category"], kind, raw["prompt"], raw.get("expected"), options, raw.get("answer"), **values
    )


def _check_answer(raw: dict, kind: str, where: str, problems: list[str]) -> None:
    """The expected answer fits the kind, and no key of another kind is set on the case."""
    if kind == "choice":
        for key in ("expected", "max_new_tokens", "ignore_case"):
            if key in raw:
                problems.append(f"{where}: {key} does not apply to kind 'choice' (give options and answer)")
        options = raw.get("options")
        if not isinstance(options, list) or len(options) < 2:
            problems.append(f"{where}: options must be a list of at least 2 strings (got {options!r})")
        elif not all(isinstance(o, str) and o.strip() for o in options):
            problems.append(f"{where}: every option must be a non-empty string (quote yes/no/numbers in YAML)")
        elif len(set(options)) != len(options):
            problems.append(f"{where}: options must be distinct")
        answer = raw.get("answer")
        if "answer" not in raw:
            problems.append(f"{where}: missing key 'answer' (the index of the right option, from 0)")
        elif not _is_int(answer):
            problems.append(f"{where}: answer={answer!r} must be the index of the right option (an integer from 0)")
        elif isinstance(options, list) and not 0 <= answer < len(options):
            problems.append(
                f"{where}: answer={answer} is out of range for {len(options)} options (0 to {len(options) - 1})"
            )
        return
    for key in ("options", "answer", "normalize"):
        if key in raw:
            problems.append(f"{where}: {key} applies only to kind 'choice', not {kind!r}")
    if "expected" not in raw:
        problems.append(f"{where}: missing key 'expected'")
    elif kind == "first_integer" and not _is_int(raw["expected"]):
        problems.append(f"{where}: expected={raw['expected']!r} must be an integer for kind 'first_integer'")
    elif kind != "first_integer" and (not isinstance(raw["expected"], str) or not raw["expected"].strip()):
        problems.append(
            f"{where}: expected={raw['expected']!r} must be a non-empty string for kind {kind!r} "
            "(quote yes/no/true/numbers in YAML)"
        )
    elif kind == "first_line" and len(raw["expected"].strip().splitlines()) > 1:
        # (a line break by str.splitlines, as first_line splits the output: a miss on every model otherwise. The
        # other kinds can match any answer they accept: exact and contains compare across lines, and every
        # integer is some output's first.)
        problems.append(
            f"{where}: expected={raw['expected']!r} holds a line break, which kind 'first_line' can never match "
            "(it compares the first line of the output alone): use kind exact or contains"
        )


# ----------------------------------------------------------------------------- scoring


def first_line(text: str) -> str:
    """The first non-blank line, stripped ('' when there is none)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def first_integer(text: str) -> int | None:
    match = INTEGER.search(text)
    return int(match.group()) if match else None


def check_output(case: ProbeCase, output: str) -> bool:
    """Whether a generated output answers a (non-choice) case."""
    if case.kind == "first_integer":
        return first_integer(output) == case.expected
    fold = (lambda s: s.casefold()) if case.ignore_case else (lambda s: s)
    expected = fold(case.expected.strip())
    if case.kind == "exact":
        return fold(output.strip()) == expected
    if case.kind == "first_line":
        return fold(first_line(output)) == expected
    if case.kind == "contains":
        return expected in fold(output)
    raise InputError(f"case {case.id!r}: kind {case.kind!r} is not scored from generated text")


def option_text(prompt: str, option: str) -> str:
    """The continuation scored for an option: a space joins it to the prompt unless the prompt ends in one."""
    return option if not prompt or prompt[-1].isspace() else " " + option


def score_options(model, tokenizer, case: ProbeCase) -> dict:
    """Scores each option of a choice case: sums, token and character counts, normalised scores, the pick.

    Encoded as lm-eval's `_encode_pair`: the prompt's trailing whitespace moves to the continuation, and the
    continuation's ids are those of encode(prompt + continuation) after the prompt's ids.
    """
    context_ids = tokenizer.encode(case.prompt.rstrip())
    context = context_ids or [tokenizer.eot_id]  # (an all-whitespace prompt is scored after end-of-text)
    sums, n_tokens = [], []
    for option in case.options:
        full = case.prompt + option_text(case.prompt, option)
        continuation = tokenizer.encode(full)[len(context_ids) :]
        if not continuation:
            raise InputError(f"case {case.id!r}: option {option!r} encodes to no tokens after the prompt")
        logprobs = continuation_logprobs(model, context, continuation)  # (len(continuation),)
        sums.append(float(logprobs.sum()))
        n_tokens.append(len(continuation))
    n_chars = [len(o) for o in case.options]
    divisor = {"tokens": n_tokens, "chars": n_chars, "none": [1] * len(sums)}[case.normalize]
    scores = [s / d for s, d in zip(sums, divisor, strict=True)]
    predicted = max(range(len(scores)), key=scores.__getitem__)  # ties: the first option
    longest = len(context) + max(n_tokens)
    return {"scores": scores, "logprob_sums": sums, "option_tokens": n_tokens, "predicted": predicted,
            "prompt_tokens": len(context), "truncated": longest > model.cfg.max_seq_len}  # fmt: skip


def run_case(model, tokenizer, case: ProbeCase) -> dict:
    """One case's row: id, category, kind, prompt, expected, output, correct, and kind-specific details."""
    row = {"id": case.id, "category": case.category, "kind": case.kind, "prompt": case.prompt}
    if case.kind == "choice":
        scored = score_options(model, tokenizer, case)
        row.update(expected=case.options[case.answer], output=case.options[scored["predicted"]],
                   correct=scored["predicted"] == case.answer, answer=case.answer, options=list(case.options),
                   normalize=case.normalize, **scored)  # fmt: skip
        return row
    budget = min(case.max_new_tokens, model.cfg.max_seq_len - 1)  # leave room for at least one prompt token
    prompt_tokens = len(tokenizer.encode(case.prompt))
    output = greedy_text(model, tokenizer, case.prompt, max_new_tokens=budget)
    row.update(expected=case.expected, output=output, correct=check_output(case, output),
               max_new_tokens=budget, prompt_tokens=prompt_tokens,
               truncated=prompt_tokens > model.cfg.max_seq_len - budget)  # fmt: skip
    return row


def answer_room_problem(model, suite: ProbeSuite) -> str | None:
    """Why a generated case cannot run on an EvalModel: its max_new_tokens leaves no room for its prompt in the
    model's context (run_case would cut the prompt to one token and the warning would blame the prompt), or None."""
    limit = model.cfg.max_seq_len
    for case in suite.cases:
        if case.kind != "choice" and case.max_new_tokens >= limit:
            room = max(1, limit - len(model.tokenizer.encode(case.prompt)))
            return (f"{suite.source}: case {case.id}: max_new_tokens={case.max_new_tokens:,} is not less than "
                    f"{model.name}'s context (max_seq_len {limit}): the answer would leave no room for the prompt; "
                    f"give max_new_tokens {room} or less")  # fmt: skip
    return None


def warn_unknown_cases(model, suite: ProbeSuite) -> int:
    """One AttnlabWarning when the prompts (and options) of `suite` hold characters or words the model's char or
    word vocabulary reads as <unk> (as `generate` warns about a prompt): which cases and pieces; how many pieces."""
    pieces, cases = [], []
    for case in suite.cases:
        found = [p for text in (case.prompt, *(case.options or ())) for p in unknown_pieces(model.tokenizer, text)]
        if found:
            pieces.extend(found)
            cases.append(case.id)
    if pieces:
        listed = ", ".join(cases[:5]) + (", ..." if len(cases) > 5 else "")
        what = f"{suite.source}: the text of case{'' if len(cases) == 1 else 's'} {listed}"
        warnings.warn(f"{unknown_line(model.tokenizer, pieces, what)}, so {model.name} scores them over <unk> (use "
                      "text its vocabulary holds)", AttnlabWarning, stacklevel=3)  # fmt: skip
    return len(pieces)


def distinct_names(models: list) -> None:
    """Gives EvalModels that share a name (runs/a/base/seed0 and runs/b/base/seed0, both base/seed0) the last
    folders of their paths that tell them apart, as bench labels them (records.distinct_labels), so that their
    tables and records do not mix them up. The same model given twice is an InputError: a head-to-head of a model
    with itself finds no difference by construction (a typo for another checkpoint, surely)."""
    paths = [str(m.path) if str(m.path).startswith("hf:") else os.path.realpath(m.path) for m in models]
    if len(set(paths)) < len(paths):
        twice = next(m for m, path in zip(models, paths, strict=True) if paths.count(path) > 1)
        raise InputError(f"{twice.path} is given twice: a head-to-head of a model with itself finds no difference "
                         "by construction: give two different checkpoints (or one, for its table alone)")  # fmt: skip
    labels = distinct_labels(dict(zip(paths, (m.name for m in models), strict=True)))
    for model, path in zip(models, paths, strict=True):
        model.name = labels[path]


def run_probes(model, suite: ProbeSuite) -> list[dict]:
    """Runs every case of `suite` on an EvalModel; one row per case (see `run_case`).

    `truncated` marks a prompt cut on the left to fit the model's max_seq_len (the answer may be lost); one
    LengthWarning names every such case.
    """
    if model.tokenizer is None:
        raise InputError(f"{model.name} has no tokenizer: probes need one (give --data-dir to find it)")
    problem = answer_room_problem(model, suite)
    if problem:
        raise InputError(problem)
    warn_unknown_cases(model, suite)
    rows = [run_case(model.model, model.tokenizer, case) for case in suite.cases]
    cut = [row["id"] for row in rows if row["truncated"]]
    if cut:
        warnings.warn(
            f"{model.name} on {suite.name}: the prompt of {len(cut)} case(s) ({brief(cut)}) does not fit "
            f"max_seq_len={model.cfg.max_seq_len} with its answer: cut on the left, its start unseen (truncated: true "
            "in the records; shorten these prompts)",
            LengthWarning,
            stacklevel=2,
        )
    return rows


def summarize(rows: list[dict], level: float = 0.95) -> dict:
    """Accuracy overall and per category (in order of first appearance), with Wilson intervals."""

    def block(items: list[dict]) -> dict:
        correct = sum(bool(r["correct"]) for r in items)
        low, high = wilson_interval(correct, len(items), level)
        return {"correct": correct, "total": len(items), "accuracy": correct / len(items) if items else 0.0,
                "ci_low": low, "ci_high": high}  # fmt: skip

    by_category: dict[str, list[dict]] = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row)
    return {"overall": block(rows), "categories": {c: block(r) for c, r in by_category.items()}, "level": level}


# ----------------------------------------------------------------------------- records and renderings


def probe_records(model, suite: ProbeSuite, rows: list[dict]) -> list[dict]:
    """Records for append_records: one per case (record=case) and one summary (record=summary).

    A case's `kind` is stored as `probe_kind` (`kind` in a record is the model's attention kind).
    """
    common = {"suite": suite.name, "suite_path": suite.source, "suite_fingerprint": suite.fingerprint}
    out = []
    for row in rows:
        fields = {("probe_kind" if k == "kind" else k): v for k, v in row.items()}
        out.append(make_record("probes", model, record="case", **common, **fields))
    out.append(make_record("probes", model, record="summary", **common, **summarize(rows)))
    return out


def comparison_record(model_a, model_b, suite: ProbeSuite, comparison: dict) -> dict:
    """A record of stats.paired_comparison between two EvalModels on `suite`."""
    return make_record(
        "probes", None, record="paired", suite=suite.name, suite_path=suite.source,
        suite_fingerprint=suite.fingerprint, model_a=model_a.name, model_a_path=str(model_a.path),
        config_hash_a=model_a.cfg.config_hash(), model_b=model_b.name, model_b_path=str(model_b.path),
        config_hash_b=model_b.cfg.config_hash(), **comparison,
    )  # fmt: skip


def summary_table(summary: dict, title: str = "") -> str:
    """A plain-text table of a summarize() result: category, correct/total, accuracy, interval."""
    level = f"{summary['level']:.0%}"
    lines = [title] if title else []
    lines.append(f"{'category':<24} {'right':>9} {'accuracy':>9}  {level} Wilson interval")
    items = [*summary["categories"].items(), ("overall", summary["overall"])]
    for name, b in items:
        right = f"{b['correct']}/{b['total']}"
        lines.append(f"{name:<24} {right:>9} {b['accuracy']:>9.1%}  {b['ci_low']:.1%} to {b['ci_high']:.1%}")
    return "\n".join(lines)
