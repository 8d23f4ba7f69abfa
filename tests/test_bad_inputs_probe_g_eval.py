"""Probe G's findings in lm-eval, multiple choice and probes: a task YAML mistake (a Jinja template, an output type,
a split, a target that is no choice, a missing include, a group member's data file) is one line naming the task
file and key before any model is loaded; a continuation too long for the model names its task file and item; a
second lm-eval into the same --out never replaces the first's results; a probe prompt outside a char vocabulary
is warned about; two probed runs that share a name are told apart."""

import json
from pathlib import Path

import pytest
from helpers import fails, lm_task_folders, lm_task_yaml, tiny_model, train_tiny_run

from attnlab.data.tokenizers import ByteTokenizer
from attnlab.errors import AttnlabWarning, ConfigError, InputError
from attnlab.eval import EvalModel
from attnlab.eval.multiple_choice import run_multiple_choice

pytestmark = pytest.mark.usefixtures("one_thread")


ITEMS = [
    {"q": "a cat", "gold": 0, "choices": [" sat", " dog"], "key": "A"},
    {"q": "the mat", "gold": 1, "choices": [" red", " door"], "key": "B"},
]


@pytest.fixture
def lm_tasks(tmp_path, monkeypatch):
    """(tasks folder, data folder): `mytask` over data/x/data.jsonl (two items), its variants written by tests."""
    return lm_task_folders(tmp_path, monkeypatch, lm_task_yaml(), ITEMS)


def variant(tasks: Path, name: str, old: str, new: str) -> None:
    """tasks/<name>.yaml: mytask's file named `name`, with the line holding `old` replaced by `new`."""
    lines = lm_task_yaml(name).splitlines()
    (tasks / f"{name}.yaml").write_text("\n".join(new if old in line else line for line in lines) + "\n")


def argv(tmp_path, tasks, data, name, *extra):
    """lm-eval on a model file that cannot load (a .gguf of other bytes, which a missing one would be refused before
    the tasks are read): a task file mistake must be refused before any model loads."""
    (tmp_path / "unloadable.gguf").write_bytes(b"not a model")
    return ["lm-eval", str(tmp_path / "unloadable.gguf"), "--tasks", name, "--include-path", str(tasks),
            "--data-dir", str(data), "--limit", "2", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def byte_model():
    """A tiny random model over UTF-8 bytes, max_seq_len 32."""
    model = tiny_model(vocab_size=257, max_seq_len=32, seed=1)
    return EvalModel("tiny-bytes", Path("tiny-bytes"), model.cfg, model, ByteTokenizer(), {})


# ----------------------------------------------------------------------------- 1. task YAML mistakes, one line


@pytest.mark.parametrize(
    "name, old, new, fragments",
    [
        ("t_bad", "doc_to_text", 'doc_to_text: "{{q}"', ("doc_to_text", "'{{q}'", "Jinja syntax error", "fix")),
        ("t_undef", "doc_to_text", 'doc_to_text: "{{nosuchfield.x}}"', ("doc_to_text", "nosuchfield", "fix")),
        ("t_type", "output_type", "output_type: loglikelihood_nonsense", ("output_type", "loglikelihood_nonsense")),
        ("t_split", "validation_split", "test_split: test", ("test_split", "no split 'test'", "validation")),
        ("t_tgt", "doc_to_target", 'doc_to_target: "{{key}}"', ("doc_to_target", "'A'", "item 0", "2 choices")),
    ],
)  # fmt: skip
def test_a_task_file_mistake_is_one_line_naming_file_and_key(lm_tasks, tmp_path, capsys, name, old, new, fragments):
    tasks, data = lm_tasks
    variant(tasks, name, old, new)
    assert fails(capsys, argv(tmp_path, tasks, data, name), f"{name}.yaml", *fragments)


def test_a_missing_include_names_the_include_not_an_unknown_task(lm_tasks, tmp_path, capsys):
    tasks, data = lm_tasks
    (tasks / "t_incl.yaml").write_text("include: nosuch_base.yaml\ntask: t_incl\n")
    line = fails(capsys, argv(tmp_path, tasks, data, "t_incl"), "t_incl.yaml", "include", "nosuch_base.yaml")
    assert "unknown lm-eval task" not in line


def test_a_group_member_finds_its_data_file_in_the_data_dir(lm_tasks, byte_model, tmp_path):
    from attnlab.eval.lmeval import run_lm_eval

    tasks, data = lm_tasks
    (tasks / "g2.yaml").write_text("group: g2\ntask: [mytask]\n")
    results = run_lm_eval(byte_model, ["g2"], include_path=tasks, data_dir=data, limit=2, bootstrap_iters=0)
    assert results["results"]["mytask"]["acc,none"] in (0.0, 0.5, 1.0)
    assert results["configs"]["mytask"]["dataset_kwargs"]["data_files"]["validation"] == str(data / "x/data.jsonl")


def test_a_group_member_that_is_no_task_is_named(lm_tasks, tmp_path, capsys):
    tasks, data = lm_tasks
    (tasks / "g1.yaml").write_text("group: g1\ntask: [mytask, nosuch_member]\n")
    assert fails(capsys, argv(tmp_path, tasks, data, "g1"), "g1.yaml", "nosuch_member")


def test_max_gen_toks_beyond_the_model_names_the_task_file(lm_tasks, byte_model):
    from attnlab.eval.lmeval import run_lm_eval

    tasks, data = lm_tasks
    (tasks / "t_gen.yaml").write_text(
        "task: t_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    validation: x/data.jsonl\n"
        "output_type: generate_until\nvalidation_split: validation\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{key}}'\n"
        "generation_kwargs: {until: ['\\n'], max_gen_toks: 100000}\nmetric_list:\n  - metric: exact_match\n"
    )
    with pytest.raises(ConfigError, match=r"t_gen\.yaml: generation_kwargs: max_gen_toks=100000 leaves no room"):
        run_lm_eval(byte_model, ["t_gen"], include_path=tasks, data_dir=data, limit=1)


# ----------------------------------------------------------------------------- 3. a continuation too long


def test_an_lm_eval_continuation_too_long_names_task_file_and_item(lm_tasks, byte_model):
    from attnlab.eval.lmeval import run_lm_eval

    tasks, data = lm_tasks
    long = {"q": "a dog", "gold": 0, "choices": [" sat", " " + "very long answer " * 4], "key": "A"}
    (data / "x" / "data.jsonl").write_text("".join(json.dumps(item) + "\n" for item in [ITEMS[0], long]))
    with pytest.raises(InputError, match=r"mytask\.yaml: item 1: a continuation of \d+ tokens exceeds max_length=32: "
                       "evaluate the task with a model of longer max_seq_len"):  # fmt: skip
        run_lm_eval(byte_model, ["mytask"], include_path=tasks, data_dir=data)


def test_mc_continuation_too_long_names_file_and_item(byte_model, tmp_path):
    arc = [
        {"id": f"q{i}", "question": "Which?", "answerKey": "A",
         "choices": {"text": ["yes", "no" if i == 0 else "a very long answer indeed " * 3], "label": ["A", "B"]}}
        for i in range(2)
    ]  # fmt: skip
    path = tmp_path / "arc.json"
    path.write_text(json.dumps(arc))
    with pytest.raises(InputError, match=rf"{path}: item q1 \(number 2\): choice 1 encodes to \d+ tokens.*"
                       r"max_seq_len=32.*--limit 1 to stop before it"):  # fmt: skip
        run_multiple_choice(byte_model, "arc_easy", path=path)
    rows, _ = run_multiple_choice(byte_model, "arc_easy", path=path, limit=1)
    assert len(rows) == 1


# ----------------------------------------------------------------------------- 4. --out keeps earlier results


def test_a_second_lm_eval_into_the_same_out_keeps_the_first_results(lm_tasks, byte_model, tmp_path):
    from attnlab.eval.lmeval import run_lm_eval

    tasks, data = lm_tasks
    out = tmp_path / "out"
    run_lm_eval(byte_model, ["mytask"], out_dir=out, include_path=tasks, data_dir=data, bootstrap_iters=0)
    before = {name: (out / name).read_bytes() for name in ("lm_eval.json", "lm_eval_samples.jsonl")}
    variant(tasks, "arc2", "task:", "task: arc2")
    with pytest.raises(ConfigError, match=r"already holds lm_eval\.json .*give another --out"):
        run_lm_eval(byte_model, ["arc2"], out_dir=out, include_path=tasks, data_dir=data, bootstrap_iters=0)
    assert {name: (out / name).read_bytes() for name in before} == before


# ----------------------------------------------------------------------------- 5. probes


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    model = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}
    return train_tiny_run(tmp_path_factory.mktemp("probe_g"), model, steps=2)


def test_a_probe_prompt_outside_the_char_vocabulary_is_warned_about(char_run, tmp_path, capsys):
    from attnlab.cli import main

    suite = tmp_path / "q.yml"
    suite.write_text(
        'name: q\ndescription: d\ndefaults: {kind: first_line}\ncases:\n  - {id: a, category: c, expected: "x", '
        'prompt: "a cat\\u20ac"}\n  - {id: b, category: c, expected: "x", prompt: "a cat"}\n'
    )
    assert main(["probes", str(suite), str(char_run), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning" in err[0] and "case a" in err[0] and "'€'" in err[0] and "<unk>" in err[0]


def test_two_probed_models_that_share_a_name_are_told_apart(tmp_path):
    from attnlab.eval.probes import distinct_names

    model = tiny_model(vocab_size=257, max_seq_len=32)
    a = EvalModel("base/seed0", tmp_path / "runs" / "tiny" / "base" / "seed0", model.cfg, model, ByteTokenizer(), {})
    b = EvalModel("base/seed0", tmp_path / "other" / "x" / "base" / "seed0", model.cfg, model, ByteTokenizer(), {})
    distinct_names([a, b])
    assert (a.name, b.name) == ("tiny/base/seed0", "x/base/seed0")
    same = EvalModel("base/seed0", a.path, model.cfg, model, ByteTokenizer(), {})
    again = EvalModel("base/seed0", a.path, model.cfg, model, ByteTokenizer(), {})
    with pytest.raises(InputError, match="given twice"):  # probe J (j13): a head-to-head of a model with itself
        distinct_names([same, again])


def test_probe_warning_is_an_attnlab_warning(char_run):
    from attnlab.eval import load_for_eval
    from attnlab.eval.probes import suite_from_dict, warn_unknown_cases

    suite = suite_from_dict(
        {"name": "q", "description": "d", "cases": [{"id": "a", "category": "c", "kind": "exact",
                                                     "expected": "x", "prompt": "\u20ac"}]},
    )  # fmt: skip
    with pytest.warns(AttnlabWarning, match="<unk>"):
        assert warn_unknown_cases(load_for_eval(char_run), suite) == 1


def test_probes_of_two_runs_that_share_a_name_print_them_apart(char_run, tmp_path, capsys):
    """pb2 through the CLI: the run and a copy of it elsewhere (both `tiny/seed0`) get different titles."""
    import shutil

    from attnlab.cli import main

    copy = tmp_path / "elsewhere" / "runs" / "tiny" / "seed0"
    shutil.copytree(char_run, copy)
    suite = tmp_path / "q.yml"
    suite.write_text('name: q\ndescription: d\ndefaults: {kind: first_line}\ncases:\n'
                     '  - {id: a, category: c, expected: "x", prompt: "a cat"}\n')  # fmt: skip
    assert main(["probes", str(suite), str(char_run), str(copy), "--out", str(tmp_path / "out")]) == 0
    titles = [line for line in capsys.readouterr().out.splitlines() if " on q (" in line]
    assert len(titles) == 2 and titles[0] != titles[1], titles
