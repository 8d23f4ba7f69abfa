"""Zero-shot multiple choice (ARC-Easy, PIQA, WinoGrande, HellaSwag) scored as lm-evaluation-harness does.

Checked against EleutherAI/lm-evaluation-harness (v0.4 layout) source:

* acc (`lm_eval/api/task.py`, `ConfigurableTask.process_results`, output_type multiple_choice):
  `pred = argmax_i ll_i`, where `ll_i = sum_t log p(cont_i[t] | ctx_i, cont_i[:t])` is the summed
  log-likelihood of choice i's continuation tokens given its context. Ties go to the first index (np.argmax).
* acc_norm (same function): `completion_len = [float(len(c)) for c in doc_to_choice(doc)]` and
  `pred_norm = argmax_i ll_i / completion_len_i`: the length is in **characters** (Python `len` of the str,
  not bytes, not tokens) of the choice text **without** the " " target delimiter put before it.
* stderr (`lm_eval/api/metrics.py`, `mean_stderr`): sample stddev / sqrt(n), which for 0/1 scores is
  `sqrt(p (1 - p) / (n - 1))`. With n < 2 we report None.
* Requests: each choice is one `loglikelihood(context, target_delimiter + continuation)` request,
  target_delimiter " ". Encoding (`lm_eval/api/model.py`, `TemplateLM._encode_pair`): trailing whitespace of
  the context moves to the front of the continuation; the continuation's tokens are
  `encode(context + continuation)[len(encode(context)):]`. An empty context is replaced by the end-of-text
  token (`loglikelihood`: `[self.prefix_token_id]`, GPT-2's eot); no BOS is added otherwise.
* Windows (`lm_eval/models/huggingface.py`, `_loglikelihood_tokens`): the model reads
  `(context + continuation)[-(max_length + 1):][:-1]`, i.e. contexts are cut on the left so at most
  max_seq_len tokens go in; the continuation's log-probs are the last len(continuation) positions.
  (`attnlab.eval.continuation_logprobs` keeps one context token fewer once it cuts, so we do not call it.)

Prompts, from lm-eval's task files (all zero-shot):

* arc_easy (`tasks/arc/arc_easy.yaml`): context `"Question: {question}\\nAnswer:"`, continuations
  `" {text}"` for `choices.text`, gold `choices.label.index(answerKey)`.
* piqa (`tasks/piqa/piqa.yaml`): context `"Question: {goal}\\nAnswer:"`, continuations `" {sol1}"`,
  `" {sol2}"`. The MosaicML file stores `query = "Question: {goal}\\n"`, so the context is `query + "Answer:"`
  (a query not of that form is rejected), the continuations `" " + choice`, gold `gold`.
* hellaswag (`tasks/hellaswag/utils.py`): `ctx = ctx_a + " " + ctx_b.capitalize()` (str.capitalize also
  lower-cases the rest, as lm-eval does), context `preprocess(activity_label + ": " + ctx)`, continuations
  `" " + preprocess(ending)`, where preprocess strips, turns " [title]" into ". ", deletes `[...]` and
  replaces "  " by " " once (an ending that began with a marker keeps a leading space); gold `int(label)`.
* winogrande (`tasks/winogrande/default.yaml` + `preprocess_winogrande.py`, "partial evaluation"): choice i's
  context is the sentence up to the blank with option i in it (`sentence[:idx] + option`), the continuation
  is `" " + sentence[idx + 1:].strip()`, the same for both options. The MosaicML file stores those contexts
  as `context_options` and the text after the blank as `continuation`: we score
  `(context_options[i], " " + continuation.strip())`. lm-eval reports only acc for WinoGrande (its
  doc_to_choice returns the contexts, so a length normalisation would be meaningless): acc_norm is None.

Scoring batches (context + continuation) sequences, longest first, right-padded: the model is causal, so
padding after a sequence never changes its logits. Log-softmax is taken in fp32.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnlab.config_checks import unknown_key_problem
from attnlab.data.files import special_file
from attnlab.errors import ConfigError, DataError, InputError
from attnlab.eval.loading import EvalModel
from attnlab.eval.records import append_records_together, make_record
from attnlab.generate import refuse_nan_logits
from attnlab.jsonio import BoundedDecoder, loads_json
from attnlab.paths import find_data_file


@dataclass(frozen=True)
class Item:
    """One question: choice i is scored as log p(continuations[i] | contexts[i])."""

    id: str
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    gold: int
    choice_chars: tuple[int, ...] | None  # acc_norm divisors: len(choice) in characters; None = no acc_norm


# ----------------------------------------------------------------------------- strict readers


def _read_text(path: Path) -> str:
    """The file's UTF-8 text; a leading byte-order mark (some editors write one) is dropped, not read as text. A
    fifo or device is refused, not read (it would wait for a writer without end)."""
    what = special_file(path)
    if what is not None:
        raise DataError(f"{path}: {what}: give the task's data file (a regular file)")
    try:
        return path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise DataError(f"{path} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path} cannot be read as UTF-8 text ({e})") from None


def _read_jsonl(path: Path, task: str = "", fields: str = "") -> list[tuple[int, Any]]:
    """(line number, object) for every non-blank line. A file that is one JSON document instead (an array, such as
    ARC's, or one object over many lines) is said to be that, for `task`, which reads one {`fields`} object a
    line, not called invalid JSON."""
    out, text = [], _read_text(path)
    for line, raw in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may sit in a string
        if raw.strip():
            try:
                out.append((line, loads_json(raw)))
            except json.JSONDecodeError as e:
                _not_jsonl(path, text, task, fields, first=not out)
                raise DataError(f"{path}:{line}: not valid JSON ({e.msg}, column {e.colno})") from None
            except RecursionError:
                raise DataError(f"{path}:{line}: {TOO_DEEP}") from None
            if len(out) == 1 and isinstance(out[0][1], list):  # an array on one line
                _not_jsonl(path, text, task, fields, first=True)
    if not out:
        raise DataError(f"{path}: no items")
    return out


def _not_jsonl(path: Path, text: str, task: str, fields: str, first: bool) -> None:
    """DataError when `text`, read as JSONL for `task` (its items' `fields`), is one JSON document instead: what
    it holds, said on its first line only."""
    whole = _one_document(text) if first and task else None
    if whole is not None:
        raise DataError(f"{path}: {task} reads JSONL, one {{{fields}}} object a line; this file is one JSON {whole}: "
                        f"give a {task} file")  # fmt: skip


def _one_document(text: str) -> str | None:
    """What a text that is one JSON document spread over lines holds ("array of N items (an arc_easy file? ...)",
    "object spread over N lines"), or None when it is not one."""
    try:
        whole = loads_json(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if isinstance(whole, dict):
        return f"object spread over {text.count(chr(10)) + 1} lines"
    if not isinstance(whole, list):
        return None
    arc = whole and all(isinstance(item, dict) and {"question", "answerKey"} <= item.keys() for item in whole)
    return f"array of {len(whole)} items" + (" (an arc_easy file? `attnlab mc arc_easy` reads it)" if arc else "")


_WS = re.compile(r"\s*")
TOO_DEEP = "not valid JSON (nested too deeply to read: the file is damaged or not a task file)"


def _read_json_array(path: Path) -> list[tuple[int | str, Any]]:
    """(where the item starts, object) for every item of a file holding one JSON array: its line number, or
    "LINE (item N)" (N counted from 1 over the whole array) when other items start on that line too, as in a file
    written on one line."""
    text, decoder, out = _read_text(path), BoundedDecoder(), []
    pos = _WS.match(text).end()
    if not text.startswith("[", pos):
        jsonl = " (this file starts with an object: JSONL, as piqa, winogrande and hellaswag read?)"
        raise DataError(f"{path}: expected one JSON array of items{jsonl * text.startswith('{', pos)}")
    pos, line, counted = _WS.match(text, pos + 1).end(), 1, 0
    if text.startswith("]", pos):
        raise DataError(f"{path}: no items")
    while True:
        line, counted = line + text.count("\n", counted, pos), pos
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
        except RecursionError:
            raise DataError(f"{path}:{line}: {TOO_DEEP}") from None
        out.append((line, obj))
        pos = _WS.match(text, end).end()
        if text.startswith("]", pos):
            break
        if not text.startswith(",", pos):
            raise DataError(f"{path}:{line + text.count(chr(10), counted, pos)}: expected ',' or ']' after an item")
        pos = _WS.match(text, pos + 1).end()
    if text[pos + 1 :].strip():
        raise DataError(f"{path}: text after the closing ']'")
    starts = Counter(line for line, _ in out)
    return [(line if starts[line] == 1 else f"{line} (item {n})", obj) for n, (line, obj) in enumerate(out, 1)]


_KINDS = {str: "a string", int: "an integer", list: "a list", dict: "an object"}


def _get(obj: Any, key: str, kind: type, path: Path, line: int | str, name: str | None = None) -> Any:
    """obj[key], checked to be of `kind`; the DataError names file, line and field."""
    name = name or key
    if not isinstance(obj, dict):
        raise DataError(f"{path}:{line}: expected a JSON object holding {name!r}, got {type(obj).__name__}")
    if key not in obj:
        raise DataError(f"{path}:{line}: field {name!r} is missing")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DataError(f"{path}:{line}: field {name!r} must be {_KINDS[kind]}, got {json.dumps(value)[:80]}")
    return value


def _strings(obj: Any, key: str, path: Path, line: int | str, name: str | None = None, item: str = "",
             distinct: bool = False) -> list[str]:  # fmt: skip
    """A list of at least two non-empty strings (the choices of one question); with `distinct`, no two the same
    (a choice given twice ties with itself, and the tie goes to whichever comes first: the item scores nothing)."""
    value = _get(obj, key, list, path, line, name)
    if len(value) < 2 or not all(isinstance(v, str) and v.strip() for v in value):
        got = json.dumps(value)[:80]
        raise DataError(f"{path}:{line}: field {name or key!r} must list at least 2 non-empty strings, got {got}")
    twice = next((v for i, v in enumerate(value) if v in value[:i]), None)
    if distinct and twice is not None:
        raise DataError(f"{path}:{line}: {item}field {name or key!r} holds {twice[:60]!r} twice: the choices must be "
                        "distinct (fix or remove the item)")  # fmt: skip
    return value


def _gold(value: Any, n_choices: int, key: str, path: Path, line: int | str) -> int:
    """An index into the choices: an int, or a string of digits (HellaSwag's HF copy stores "0".."3")."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n_choices:
        raise DataError(
            f"{path}:{line}: field {key!r} must be a choice index 0..{n_choices - 1}, got {json.dumps(value)}"
        )
    return value


# ----------------------------------------------------------------------------- the four schemas

# the fields of one item of the JSONL tasks, named when a file of another shape is given
PIQA_FIELDS = '"query", "choices", "gold"'
WINOGRANDE_FIELDS = '"context_options", "continuation", "gold"'
HELLASWAG_FIELDS = '"activity_label", "ctx_a", "ctx_b", "endings", "label"'


def load_arc_easy(path: str | Path) -> list[Item]:
    """HF `allenai/ai2_arc` schema, one JSON array: {id, question, choices: {text, label}, answerKey}."""
    path, items, seen = Path(path), [], {}
    for line, obj in _read_json_array(path):
        item_id, question = _get(obj, "id", str, path, line), _get(obj, "question", str, path, line)
        if item_id in seen:
            raise DataError(f"{path}:{line}: item id {item_id!r} is also the id of the item at line "
                            f"{seen[item_id]}: the ids must be distinct (its records would mix two questions); "
                            "fix or remove one")  # fmt: skip
        seen[item_id] = line
        if not question.strip():
            raise DataError(f"{path}:{line}: item {item_id!r}: field 'question' is empty (fix or remove the item)")
        choices = _get(obj, "choices", dict, path, line)
        texts = _strings(choices, "text", path, line, "choices.text", item=f"item {item_id!r}: ", distinct=True)
        labels = _strings(choices, "label", path, line, "choices.label")
        if len(labels) != len(texts) or len(set(labels)) != len(labels):
            raise DataError(
                f"{path}:{line}: field 'choices.label' must hold {len(texts)} distinct labels, got {labels}"
            )
        answer = _get(obj, "answerKey", str, path, line)
        if answer not in labels:
            raise DataError(f"{path}:{line}: field 'answerKey' {answer!r} is not one of choices.label {labels}")
        context = f"Question: {question}\nAnswer:"
        items.append(
            Item(item_id, (context,) * len(texts), tuple(" " + t for t in texts), labels.index(answer),
                 tuple(len(t) for t in texts))
        )  # fmt: skip
    return items


def load_piqa(path: str | Path) -> list[Item]:
    """llm-foundry jsonl: {"query": "Question: {goal}\\n", "choices": [sol1, sol2], "gold": 0|1}."""
    path, items = Path(path), []
    for index, (line, obj) in enumerate(_read_jsonl(path, "piqa", PIQA_FIELDS)):
        query = _get(obj, "query", str, path, line)
        if not (query.startswith("Question: ") and query.endswith("\n")):
            raise DataError(f"{path}:{line}: field 'query' must read 'Question: {{goal}}\\n', got {query[:60]!r}")
        if not query.removeprefix("Question: ").strip():
            raise DataError(f"{path}:{line}: field 'query' holds an empty question (fix or remove the item)")
        choices = _strings(obj, "choices", path, line, distinct=True)
        gold = _gold(_get(obj, "gold", int, path, line), len(choices), "gold", path, line)
        context = query + "Answer:"  # = lm-eval's "Question: {goal}\nAnswer:"
        items.append(
            Item(str(index), (context,) * len(choices), tuple(" " + c for c in choices), gold,
                 tuple(len(c) for c in choices))
        )  # fmt: skip
    return items


def load_winogrande(path: str | Path) -> list[Item]:
    """MosaicML schema jsonl: {"context_options": [sentence up to the blank with each option], "continuation":
    the text after the blank, "gold": index}. Partial scoring: the continuation after each context."""
    path, items = Path(path), []
    for index, (line, obj) in enumerate(_read_jsonl(path, "winogrande", WINOGRANDE_FIELDS)):
        contexts = _strings(obj, "context_options", path, line)
        continuation = _get(obj, "continuation", str, path, line).strip()
        if not continuation:
            raise DataError(f"{path}:{line}: field 'continuation' is empty")
        gold = _gold(_get(obj, "gold", int, path, line), len(contexts), "gold", path, line)
        items.append(Item(str(index), tuple(contexts), (" " + continuation,) * len(contexts), gold, None))
    return items


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's `preprocess` for HellaSwag (WikiHow's bracketed markers are artifacts)."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def load_hellaswag(path: str | Path) -> list[Item]:
    """rowanz/hellaswag jsonl: {ind, activity_label, ctx_a, ctx_b, endings: [4 str], label, ...}."""
    path, items = Path(path), []
    for index, (line, obj) in enumerate(_read_jsonl(path, "hellaswag", HELLASWAG_FIELDS)):
        label, ctx_a, ctx_b = (_get(obj, key, str, path, line) for key in ("activity_label", "ctx_a", "ctx_b"))
        endings = [hellaswag_preprocess(e) for e in _strings(obj, "endings", path, line)]
        if not all(endings):
            raise DataError(f"{path}:{line}: field 'endings' holds an ending that preprocessing leaves empty")
        gold = _gold(obj.get("label"), len(endings), "label", path, line)
        context = hellaswag_preprocess(label + ": " + ctx_a + " " + ctx_b.capitalize())
        item_id = str(obj["ind"]) if isinstance(obj.get("ind"), int | str) else str(index)
        items.append(
            Item(item_id, (context,) * len(endings), tuple(" " + e for e in endings), gold,
                 tuple(len(e) for e in endings))
        )  # fmt: skip
    return items


@dataclass(frozen=True)
class Task:
    name: str
    file: str  # default location, relative to a data directory
    load: Callable[[Path], list[Item]]


TASKS = {
    "arc_easy": Task("arc_easy", "eval/arc_easy/ARC-Easy-validation.json", load_arc_easy),
    "piqa": Task("piqa", "eval/piqa/piqa_valid_1838.llmfoundry.jsonl", load_piqa),
    "winogrande": Task("winogrande", "eval/winogrande/winogrande.jsonl", load_winogrande),
    "hellaswag": Task("hellaswag", "eval/hellaswag/hellaswag_val.jsonl", load_hellaswag),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(unknown_key_problem(name, list(TASKS), "", what="task"))
    return TASKS[name]


def task_given_first(task: str, model: str) -> Task:
    """The task of `attnlab mc TASK CHECKPOINT`, checked before the model loads. The two given the other way round
    (the model first, as generate, info and probes take it) are one line saying the order, not "no such file" of
    the task name read as a model."""
    if task in TASKS:
        return TASKS[task]
    order = f"the order is `attnlab mc TASK CHECKPOINT`, the task first: attnlab mc {model} {task}"
    if model in TASKS:
        raise InputError(f"{model} is a task and {task} is not one: {order}")
    tasks = ", ".join(TASKS)
    if task.startswith("hf:") or Path(task).exists():
        if _names_a_model(model) and not _names_a_model(task):  # (a text or data file before a model: no task)
            raise InputError(f"{task} is not a task: name one ({tasks}); a task's items are read from the data "
                             f"directory, or from a file given as --file: attnlab mc TASK {model} --file "
                             f"{task}")  # fmt: skip
        raise InputError(f"{task} is a model, not a task ({tasks}): the order is `attnlab mc TASK CHECKPOINT`, the "
                         "task first")  # fmt: skip
    return get_task(task)


def _names_a_model(ref: str) -> bool:
    """Whether `ref` names a model (a Hub reference, or a file or folder resolve takes)."""
    from attnlab.interop.references import resolve

    try:
        return ref.startswith("hf:") or bool(resolve(ref))
    except (DataError, InputError):
        return False


def load_items(task: str, path: str | Path | None = None, data_dir: str | Path | None = None) -> list[Item]:
    """A task's items from `path`, else from its default file in the data directory ($ATTNLAB_DATA, cache)."""
    spec = get_task(task)
    return spec.load(Path(path) if path is not None else find_data_file(spec.file, data_dir))


# ----------------------------------------------------------------------------- scoring


def encode_item(tokenizer, item: Item) -> list[tuple[list[int], list[int]]]:
    """(context ids, continuation ids) per choice, as lm-eval's `_encode_pair`; a context shared by several
    choices is encoded once."""
    pairs, context_ids = [], {}
    for context, continuation in zip(item.contexts, item.continuations, strict=True):
        stripped = context.rstrip()
        context, continuation = stripped, context[len(stripped) :] + continuation
        if not context:
            pairs.append(([tokenizer.eot_id], tokenizer.encode(continuation)))
            continue
        if context not in context_ids:
            context_ids[context] = tokenizer.encode(context)
        ids = context_ids[context]
        pairs.append((ids, tokenizer.encode(context + continuation)[len(ids) :]))
    for i, (_, continuation_ids) in enumerate(pairs):
        if not continuation_ids:
            raise DataError(f"item {item.id}: choice {i} encodes to no continuation tokens")
    return pairs


@torch.no_grad()
def loglikelihoods(model, pairs: list[tuple[list[int], list[int]]], batch_size: int = 16) -> list[float]:
    """Summed log p(continuation | context) per (context ids, continuation ids) pair.

    `model(tokens (B, T), use_cache=False) -> (logits (B, T, V), _)` with `model.cfg.max_seq_len`; contexts
    are cut on the left so at most max_seq_len tokens go in (lm-eval's window).
    """
    max_len = model.cfg.max_seq_len
    device = next(model.parameters()).device
    windows = []
    for context, continuation in pairs:
        if len(continuation) > max_len:
            raise InputError(f"a continuation of {len(continuation)} tokens exceeds max_seq_len={max_len}")
        windows.append((context + continuation)[-(max_len + 1) :])  # the last token is only a target
    order = sorted(range(len(pairs)), key=lambda i: -len(windows[i]))  # similar lengths share a batch
    out = [0.0] * len(pairs)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        tokens = torch.zeros(len(chunk), len(windows[chunk[0]]) - 1, dtype=torch.long)  # (B, T), right-padded
        for row, i in enumerate(chunk):
            tokens[row, : len(windows[i]) - 1] = torch.tensor(windows[i][:-1])
        logits, _ = model(tokens.to(device), use_cache=False)  # (B, T, V)
        refuse_nan_logits(model, logits, "on a multiple-choice item's context and choice")
        for row, i in enumerate(chunk):
            n_in, n_cont = len(windows[i]) - 1, len(pairs[i][1])
            targets = torch.tensor(windows[i][-n_cont:], device=device)
            logprobs = logits[row, n_in - n_cont : n_in].float().log_softmax(dim=-1)  # (n_cont, V)
            out[i] = float(logprobs.gather(-1, targets[:, None]).sum())
    return out


def predictions(lls: list[float], choice_chars: tuple[int, ...] | None) -> tuple[int, int | None]:
    """(argmax ll, argmax ll / chars), the first index on ties as np.argmax; None when there is no acc_norm."""
    pred = max(range(len(lls)), key=lambda i: lls[i])
    if choice_chars is None:
        return pred, None
    return pred, max(range(len(lls)), key=lambda i: lls[i] / choice_chars[i])


def _stderr(p: float | None, n: int) -> float | None:
    """lm-eval's mean_stderr of 0/1 scores: sqrt(p (1 - p) / (n - 1))."""
    return None if p is None or n < 2 else math.sqrt(p * (1 - p) / (n - 1))


def run_multiple_choice(
    model: EvalModel,
    task: str,
    path: str | Path | None = None,
    limit: int | None = None,
    data_dir: str | Path | None = None,
    batch_size: int = 16,
) -> tuple[list[dict], dict]:
    """Scores `task` (a TASKS name) zero-shot; returns (per-item rows, summary record).

    A row: index, id, gold, predicted, predicted_norm, loglikelihoods, choice_chars, continuation_tokens,
    truncated (the context was cut to fit max_seq_len). The summary is a `make_record("multiple_choice")`
    row with acc, acc_norm, their stderr, n, the data file and its sha256.
    """
    spec = get_task(task)
    if limit is not None and limit < 1:
        raise ConfigError(f"limit={limit} must be >= 1")
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be >= 1")
    if model.tokenizer is None:
        raise DataError(f"{model.path}: no tokenizer is known for this model; multiple choice scores text")
    path = Path(path) if path is not None else find_data_file(spec.file, data_dir)
    items = spec.load(path)[:limit]
    encoded = [encode_item(model.tokenizer, item) for item in items]
    for index, (item, pairs) in enumerate(zip(items, encoded, strict=True)):  # before any item is scored
        longest = max(range(len(pairs)), key=lambda i: len(pairs[i][1]))
        if len(pairs[longest][1]) > model.model.cfg.max_seq_len:
            stop = f", or --limit {index} to stop before it" if index else ""
            raise InputError(
                f"{path}: item {item.id} (number {index + 1}): choice {longest} encodes to {len(pairs[longest][1])} "
                f"tokens, more than the model's max_seq_len={model.model.cfg.max_seq_len}, so it cannot be scored: "
                f"evaluate {spec.name} with a model of longer max_seq_len{stop}"
            )  # fmt: skip
    lls = loglikelihoods(model.model, [pair for pairs in encoded for pair in pairs], batch_size)
    max_len, rows, offset = model.model.cfg.max_seq_len, [], 0
    for index, (item, pairs) in enumerate(zip(items, encoded, strict=True)):
        item_lls, offset = lls[offset : offset + len(pairs)], offset + len(pairs)
        pred, pred_norm = predictions(item_lls, item.choice_chars)
        rows.append({
            "index": index, "id": item.id, "gold": item.gold, "predicted": pred, "predicted_norm": pred_norm,
            "loglikelihoods": item_lls, "choice_chars": list(item.choice_chars) if item.choice_chars else None,
            "continuation_tokens": [len(c) for _, c in pairs],
            "truncated": any(len(a) + len(c) > max_len + 1 for a, c in pairs),
        })  # fmt: skip
    n = len(rows)
    acc = sum(r["predicted"] == r["gold"] for r in rows) / n
    acc_norm = None if items[0].choice_chars is None else sum(r["predicted_norm"] == r["gold"] for r in rows) / n
    summary = make_record(
        "multiple_choice", model, task=spec.name, n=n, limit=limit,
        acc=acc, acc_stderr=_stderr(acc, n), acc_norm=acc_norm, acc_norm_stderr=_stderr(acc_norm, n),
        n_truncated=sum(r["truncated"] for r in rows), max_seq_len=max_len, tokenizer=model.tokenizer.name,
        data_file=str(path), data_sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        scoring="lm-evaluation-harness multiple_choice, zero-shot (acc_norm: ll / len(choice) in characters)",
    )  # fmt: skip
    return rows, summary


def write_multiple_choice(out_dir: str | Path, rows: list[dict], summary: dict) -> tuple[Path, Path]:
    """Appends the summary to OUT/multiple_choice.jsonl and the item rows (tagged with model, task, config
    hash and time) to OUT/multiple_choice_items.jsonl; returns both paths."""
    out_dir = Path(out_dir)
    tag = {k: summary.get(k) for k in ("model", "config_hash", "task", "time")}
    items = [{**tag, **row} for row in rows]
    summary_path, items_path = append_records_together(
        {out_dir / "multiple_choice.jsonl": [summary], out_dir / "multiple_choice_items.jsonl": items}
    )
    return summary_path, items_path
