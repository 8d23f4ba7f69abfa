"""Probe L's findings in `attnlab lm-eval` over a task YAML of the user's own (--include-path): a task whose data file
is empty stopped with datasets' StopIteration traceback; more few-shot examples (num_fewshot in the task file) than
its fewshot_split holds with random.sample's ValueError; `repeats: 0` with an IndexError after every item was scored;
`target_delimiter: 5` with an AttributeError; a key given twice in a task file ran with the last one, without a word;
and a task file that is empty or a YAML list was skipped, the task then called unknown without naming the file.
Each is now one line naming the task file and its key or value, before any model is loaded."""

from __future__ import annotations

import warnings

import pytest
from helpers import fails, lm_task_folders, lm_task_yaml, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

ITEMS = [
    {"q": "Sky is", "choices": [" blue", " red"], "gold": 0},
    {"q": "Fire is", "choices": [" cold", " hot"], "gold": 1},
    {"q": "Ice is", "choices": [" cold", " hot"], "gold": 0},
]


@pytest.fixture
def lm_tasks(tmp_path, monkeypatch):
    """(tasks folder holding mytask.yaml, data folder holding x/data.jsonl of ITEMS)."""
    return lm_task_folders(tmp_path, monkeypatch, lm_task_yaml(), ITEMS)


def lm_argv(tmp_path, tasks, data, name="mytask"):
    """lm-eval on a model file that cannot load (a .gguf of other bytes, which a missing one would be refused before
    the tasks are read): a task file's mistake must be refused before any model loads."""
    (tmp_path / "unloadable.gguf").write_bytes(b"not a model")
    return ["lm-eval", str(tmp_path / "unloadable.gguf"), "--tasks", name, "--include-path", str(tasks),
            "--data-dir", str(data), "--limit", "3"]  # fmt: skip


def byte_model(tmp_path):
    """A tiny untrained model over bytes, as an EvalModel (no training, no files)."""
    from attnlab.data.tokenizers import ByteTokenizer
    from attnlab.eval import EvalModel

    model = tiny_model(vocab_size=257, max_seq_len=64)
    return EvalModel("tiny-bytes", tmp_path, model.cfg, model, ByteTokenizer(), {})


# ----------------------------------------------------------------------------- l10: an empty data file


@pytest.mark.parametrize("text", ["", " \n\n"], ids=["zero-bytes", "blank-lines"])
def test_an_empty_data_file_is_named(lm_tasks, tmp_path, capsys, text):
    """l10: a 0-byte data file was datasets' StopIteration traceback; one of blank lines was `Instruction "validation"
    corresponds to no data!`."""
    tasks, data = lm_tasks
    (data / "x" / "data.jsonl").write_text(text)
    line = fails(capsys, lm_argv(tmp_path, tasks, data), "mytask.yaml: dataset_kwargs.data_files.validation:",
                 f"data file {data / 'x' / 'data.jsonl'} holds no items", "give the task's items")  # fmt: skip
    assert ("(0 bytes)" in line) == (text == "")


# ----------------------------------------------------------------------------- l11: more few-shot examples than held


def test_more_few_shot_examples_than_the_fewshot_split_holds_is_refused(lm_tasks, tmp_path, capsys):
    """l11: `ValueError: Sample larger than population or is negative` from random.sample, after the model loaded."""
    tasks, data = lm_tasks
    (tasks / "mytask.yaml").write_text(lm_task_yaml() + "fewshot_split: validation\nnum_fewshot: 5\n")
    assert fails(capsys, lm_argv(tmp_path, tasks, data), "mytask.yaml: num_fewshot: 5 is more few-shot examples",
                 "than task 'mytask' has", "3 items of its fewshot_split 'validation'",
                 "give fewer (at most 3)")  # fmt: skip


def test_more_few_shot_examples_by_the_flag_name_the_flag(lm_tasks, tmp_path, capsys):
    """The same by --num-fewshot over a task file that names no fewshot_split (lm-eval then draws from the validation
    split, one more than asked, and drops the item itself)."""
    tasks, data = lm_tasks
    argv = [*lm_argv(tmp_path, tasks, data), "--num-fewshot", "3"]
    assert fails(capsys, argv, "mytask.yaml: num_fewshot=3 (--num-fewshot) is more few-shot examples than task "
                 "'mytask' has", "3 items of its validation_split 'validation', less the item itself",
                 "give fewer (at most 2)")  # fmt: skip


def test_as_many_few_shot_examples_as_the_split_holds_are_evaluated(lm_tasks, tmp_path):
    """The check refuses no more than lm-eval would fail on: 3 examples of a fewshot_split of 3 items run."""
    from attnlab.eval.lmeval import run_lm_eval

    tasks, data = lm_tasks
    (tasks / "mytask.yaml").write_text(lm_task_yaml() + "fewshot_split: validation\nnum_fewshot: 3\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_lm_eval(byte_model(tmp_path), ["mytask"], include_path=tasks, data_dir=data, limit=3)
    assert results["n-shot"]["mytask"] == 3 and len(results["samples"]["mytask"]) == 3


# ----------------------------------------------------------------------------- l12, l13: values of the wrong kind


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "true"])
def test_repeats_below_one_is_refused(lm_tasks, tmp_path, capsys, value):
    """l12: `repeats: 0` was an IndexError in lm_eval/filters/selection.py, after every item had been scored."""
    tasks, data = lm_tasks
    (tasks / "mytask.yaml").write_text(lm_task_yaml() + f"repeats: {value}\n")
    assert fails(capsys, lm_argv(tmp_path, tasks, data), f"mytask.yaml: repeats: {value} must be a whole number >= 1",
                 "give repeats: 1")  # fmt: skip


@pytest.mark.parametrize(("key", "value", "what"), [("target_delimiter", "5", "a number"),
                                                    ("target_delimiter", "null", "empty"),
                                                    ("fewshot_delimiter", "[a]", "a list")])  # fmt: skip
def test_a_delimiter_that_is_not_text_is_refused(lm_tasks, tmp_path, capsys, key, value, what):
    """l13: `target_delimiter: 5` was `AttributeError: 'int' object has no attribute 'rstrip'`."""
    tasks, data = lm_tasks
    (tasks / "mytask.yaml").write_text(lm_task_yaml() + f"{key}: {value}\n")
    assert fails(capsys, lm_argv(tmp_path, tasks, data), f"mytask.yaml: {key}: {value} is {what}, not text",
                 "quote it")  # fmt: skip


def test_a_number_of_few_shot_examples_that_is_not_a_whole_number_is_refused(lm_tasks, tmp_path, capsys):
    tasks, data = lm_tasks
    (tasks / "mytask.yaml").write_text(lm_task_yaml() + "num_fewshot: two\n")
    assert fails(capsys, lm_argv(tmp_path, tasks, data), "mytask.yaml: num_fewshot: two must be a whole number >= 0")


# ----------------------------------------------------------------------------- l14: a key given twice


def test_a_key_given_twice_in_a_task_file_is_refused(lm_tasks, tmp_path, capsys):
    """l14: lm-eval kept the last doc_to_text without a word (attnlab refuses a key given twice in its own YAML)."""
    tasks, data = lm_tasks
    (tasks / "mytask.yaml").write_text(lm_task_yaml() + 'doc_to_text: "{{q}} again"\n')
    assert fails(capsys, lm_argv(tmp_path, tasks, data), "mytask.yaml: line 13: key 'doc_to_text' is given twice "
                 "(first at line 8", "keep one")  # fmt: skip


def test_a_key_given_twice_in_an_included_file_is_refused(lm_tasks, tmp_path, capsys):
    tasks, data = lm_tasks
    (tasks / "base.txt").write_text(lm_task_yaml() + "output_type: multiple_choice\n")
    (tasks / "mytask.yaml").write_text("include: base.txt\ntask: mytask\n")
    assert fails(
        capsys, lm_argv(tmp_path, tasks, data), "base.txt: line 13: key 'output_type' is given twice (first at line 6"
    )


def test_a_task_file_with_a_key_given_twice_that_is_not_asked_for_is_left_alone(lm_tasks, tmp_path, capsys):
    """Only the task files of the tasks asked for are read strictly: the model file's damage is the line."""
    tasks, data = lm_tasks
    (tasks / "other.yaml").write_text(lm_task_yaml("other") + "repeats: 1\nrepeats: 1\n")
    line = fails(capsys, lm_argv(tmp_path, tasks, data), "unloadable.gguf: not a readable GGUF file")
    assert "other.yaml" not in line


# ----------------------------------------------------------------------------- l15: a task file lm-eval skips


NO_TASK = [("", "is empty"), ("# nothing yet\n", "is empty"), ("- task: empty\n", "is a YAML list"),
           ("empty\n", "is a YAML string")]  # fmt: skip


@pytest.mark.parametrize(("text", "what"), NO_TASK)
def test_a_task_file_that_holds_no_task_is_named(lm_tasks, tmp_path, capsys, text, what):
    """l15: `unknown lm-eval task 'empty' (a task of an include_path folder?)`, the file that is there not named."""
    tasks, data = lm_tasks
    (tasks / "empty.yaml").write_text(text)
    line = fails(capsys, lm_argv(tmp_path, tasks, data, "empty"), f"empty.yaml: {what}",
                 "not a mapping of task keys (task:, dataset_path:, ...), so lm-eval skipped it",
                 "(fix the task file)")  # fmt: skip
    assert "unknown lm-eval task" not in line
