"""Behaviour probes: the shipped suite, strict loading, answer matching, choice normalisation on a stub with
controlled log-probs, and a real attnlab transformer whose hand-set weights make it copy its input."""

import dataclasses
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import attnlab
from attnlab.data.tokenizers import CharTokenizer, WordTokenizer
from attnlab.errors import ConfigError, InputError, LengthWarning
from attnlab.eval import EvalModel, append_records, read_records
from attnlab.eval.probes import (
    ProbeCase,
    check_output,
    comparison_record,
    load_suite,
    probe_records,
    run_probes,
    suite_from_dict,
    summarize,
    summary_table,
)
from attnlab.eval.stats import paired_comparison

CORE = Path(__file__).resolve().parents[2] / "configs" / "probes" / "core.yml"


# ----------------------------------------------------------------------------- the shipped suite


@pytest.fixture(scope="module")
def core():
    return load_suite(CORE)


def test_shipped_suite_loads_with_enough_cases_and_categories(core):
    assert core.name == "core" and core.description
    assert len(core.cases) >= 100
    assert len(core.categories) >= 12
    assert min(core.categories.values()) >= 5, core.categories
    assert len({c.id for c in core.cases}) == len(core.cases)


def test_shipped_suite_answers_are_well_formed(core):
    for case in core.cases:
        if case.kind in ("exact", "first_line"):
            assert "\n" not in case.expected and case.expected == case.expected.strip(), case.id
        if case.category in ("copy", "termination"):  # what is to be copied is in the prompt, verbatim
            assert f": {case.expected}\n" in case.prompt, case.id
        if case.kind == "choice":
            assert 0 <= case.answer < len(case.options)
        else:
            assert case.max_new_tokens >= 1


# ----------------------------------------------------------------------------- strict loading

BAD_SUITE = """
name: broken
description: every kind of mistake at once
defaults: {kind: first_line, max_new_token: 8}
cases:
  - {id: a, category: copy, prompt: "Say: hi\\nAgain:", expect: hi}
  - {id: a, category: copy, prompt: "Say: ho\\nAgain:", expected: ho}
  - {id: c, category: knowledge, kind: choice, prompt: "The sun rises in the", options: [east, west], answer: 2}
  - {id: d, category: knowledge, kind: firstline, prompt: "x", expected: y}
  - {id: e, category: yesno, prompt: "Is fire hot?", expected: true}
  - {id: f, category: copy, expected: hi}
  - {id: g, category: sums, kind: first_integer, prompt: "2 + 2 =", expected: "4", normalize: chars}
case: []
"""


def test_malformed_suite_reports_every_problem_with_file_and_key(tmp_path):
    path = tmp_path / "broken.yml"
    path.write_text(BAD_SUITE)
    with pytest.raises(ConfigError) as info:
        load_suite(path)
    message, problems = str(info.value), info.value.problems
    assert message.startswith(f"{path}: ")
    assert info.value.source == str(path)
    expected = [
        "unknown key at the top level: 'case' (did you mean 'cases'?)",
        "unknown key in defaults: 'max_new_token' (did you mean 'max_new_tokens'?)",
        "unknown key in cases[0] (id 'a'): 'expect' (did you mean 'expected'?)",
        "cases[0] (id 'a'): missing key 'expected'",
        "duplicate id 'a' (cases[0] and cases[1]): ids must be unique",
        "cases[2] (id 'c'): answer=2 is out of range for 2 options (0 to 1)",
        "cases[3] (id 'd'): kind='firstline' is not known (did you mean 'first_line'?)",
        "cases[4] (id 'e'): expected=True must be a non-empty string",  # a YAML boolean, not a string
        "cases[5] (id 'f'): missing key 'prompt'",
        "cases[6] (id 'g'): normalize applies only to kind 'choice'",
        "cases[6] (id 'g'): expected='4' must be an integer for kind 'first_integer'",
    ]
    for fragment in expected:
        assert any(fragment in p for p in problems), (fragment, problems)
    assert len(problems) == len(expected)


def one_case(**fields) -> dict:
    return {"name": "x", "description": "y", "cases": [{"id": "a", "category": "c", "prompt": "p", **fields}]}


@pytest.mark.parametrize(
    "data,match",
    [
        ({"name": "x", "description": "y"}, "cases must be a non-empty list"),
        ({**one_case(kind="contains", expected="e"), "name": ""}, "name must be a non-empty string"),
        (one_case(expected="e"), r"missing key 'kind' \(set it on the case or in defaults"),
        (one_case(kind="choice", options=["only"], answer=0), "at least 2"),
        (one_case(kind="choice", options=["u", "u"], answer=0), "distinct"),
        (one_case(kind="choice", options=["u", "v"]), "missing key 'answer'"),
        (one_case(kind="choice", options=["u", True], answer=0), "quote yes/no"),
        (one_case(kind="choice", options=["u", "v"], answer=0, expected="u"), "expected does not apply"),
        (one_case(kind="exact", expected="e", max_new_tokens=0), "integer >= 1"),
        (one_case(kind="exact", expected="e", normalize="token"), "did you mean 'tokens'"),
        ({"name": "x", "description": "y", "cases": ["not a mapping"]}, r"cases\[0\] must be a mapping"),
        ({"name": "x", "description": "y", "defaults": [1], "cases": []}, "defaults must be a mapping"),
    ],
)
def test_suite_problems_from_dicts(data, match):
    with pytest.raises(ConfigError, match=match) as info:
        suite_from_dict(data, source="inline")
    assert str(info.value).startswith("inline: ")


def test_missing_file_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="nowhere.yml: file not found"):
        load_suite(tmp_path / "nowhere.yml")
    bad = tmp_path / "bad.yml"
    bad.write_text("name: x\ncases: [\n")
    with pytest.raises(ConfigError, match=r"bad.yml: not valid YAML at line \d+"):
        load_suite(bad)


def test_defaults_fill_cases_and_cases_override_them():
    suite = suite_from_dict({
        "name": "x", "description": "y", "defaults": {"kind": "contains", "max_new_tokens": 5, "ignore_case": True},
        "cases": [{"id": "a", "category": "c", "prompt": "p", "expected": "e"},
                  {"id": "b", "category": "c", "prompt": "p", "expected": "e", "kind": "exact", "max_new_tokens": 9},
                  {"id": "c", "category": "d", "prompt": "p", "kind": "choice", "options": ["u", "v"], "answer": 1}],
    })  # fmt: skip
    a, b, c = suite.cases
    assert (a.kind, a.max_new_tokens, a.ignore_case) == ("contains", 5, True)
    assert (b.kind, b.max_new_tokens) == ("exact", 9)
    assert (c.kind, c.options, c.answer, c.normalize) == ("choice", ("u", "v"), 1, "tokens")
    assert suite.categories == {"c": 2, "d": 1}
    assert suite.only("d").cases == (c,)
    with pytest.raises(InputError, match="no category"):
        suite.only("nope")


# ----------------------------------------------------------------------------- answer matching


def case(kind, expected, ignore_case=False):
    return ProbeCase("t", "c", kind, "prompt", expected, ignore_case=ignore_case)


@pytest.mark.parametrize(
    "kind,expected,output,ignore_case,correct",
    [
        ("exact", "red ball", " red ball\n", False, True),
        ("exact", "red ball", " red ball\nRepeat: red", False, False),  # did not stop
        ("exact", "red ball", " Red ball", False, False),
        ("exact", "red ball", " Red BALL", True, True),
        ("first_line", "red ball", " red ball\nRepeat: red", False, True),
        ("first_line", "red ball", "\n\n  red ball  \nmore", False, True),  # the first non-blank line
        ("first_line", "red ball", " red ball.", False, False),
        ("first_line", "red", " red ball", False, False),
        ("contains", "Paris", " It is Paris, I think", False, True),
        ("contains", "paris", " It is Paris", False, False),
        ("contains", "paris", " It is Paris", True, True),
        ("first_integer", 12, " 12 apples and 3 pears", False, True),
        ("first_integer", 3, " 12 apples and 3 pears", False, False),
        ("first_integer", -4, " it is -4 degrees", False, True),
        ("first_integer", 25, " twenty-five", False, False),
        ("first_integer", 6, "6, 7, 8", False, True),
    ],
)
def test_check_output(kind, expected, output, ignore_case, correct):
    assert check_output(case(kind, expected, ignore_case), output) is correct


# ----------------------------------------------------------------------------- choice: normalisation


class BigramLM(nn.Module):
    """A stub LM whose log p(next | previous) is a fixed table: `model(tokens, use_cache=False)` returns
    logits (B, T, V) = log-probs of the previous token's row, so every continuation log-prob is known."""

    def __init__(self, logprobs: torch.Tensor):
        super().__init__()
        self.table = nn.Parameter(logprobs, requires_grad=False)  # (V, V)
        self.cfg = attnlab.model_config_from_dict(
            {"vocab_size": logprobs.shape[0], "d_model": 8, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}
        )

    def forward(self, tokens, cache=None, use_cache=None):
        return self.table[tokens], None  # (B, T, V)


@pytest.fixture(scope="module")
def bigram():
    """Word tokenizer and table with: after Q, log p(short) = -2, p(long) = -1.5, p(aaaaaaaaaaaa) = -3,
    p(b) = -1.2; after long, log p(long) = -1.5; after b, log p(b) = -1.2; other mass spread evenly."""
    words = ["Q", "short", "long", "aaaaaaaaaaaa", "b", "<eos>", "<unk>", "<|endoftext|>"]
    tok = WordTokenizer(words)
    ids = tok.ids
    rows = torch.full((len(words), len(words)), float("nan"))
    rows[ids["Q"], [ids["short"], ids["long"], ids["aaaaaaaaaaaa"], ids["b"]]] = torch.tensor([-2, -1.5, -3, -1.2])
    rows[ids["long"], ids["long"]] = -1.5
    rows[ids["b"], ids["b"]] = -1.2
    probs = rows.exp().nan_to_num(0.0)  # (V, V)
    free = rows.isnan()
    rest = (1 - probs.sum(1, keepdim=True)).clamp_min(0) / free.sum(1, keepdim=True)
    logprobs = torch.where(free, rest.expand_as(probs), probs).log()
    assert torch.allclose(logprobs.exp().sum(1), torch.ones(len(words)))
    model = BigramLM(logprobs)
    return EvalModel("bigram", Path("bigram"), model.cfg, model, tok, {})


def choice_suite(normalize):
    return suite_from_dict({
        "name": "choice", "description": "normalisation",
        "defaults": {"kind": "choice", "normalize": normalize},
        "cases": [
            # a long option with the higher mean log-prob per token but the lower sum: the gold answer
            {"id": "long", "category": "c", "prompt": "Q", "options": ["short", "long long long"], "answer": 1},
            # one long-spelled token against two short ones: per character and per token disagree
            {"id": "chars", "category": "c", "prompt": "Q", "options": ["aaaaaaaaaaaa", "b b"], "answer": 0},
        ],
    })  # fmt: skip


def test_choice_scores_are_the_model_log_probs(bigram):
    long_row, chars_row = run_probes(bigram, choice_suite("none"))
    assert long_row["logprob_sums"] == pytest.approx([-2.0, -4.5], abs=1e-5)
    assert long_row["option_tokens"] == [1, 3]
    assert chars_row["logprob_sums"] == pytest.approx([-3.0, -2.4], abs=1e-5)


@pytest.mark.parametrize(
    "normalize,picks",
    [
        ("tokens", {"long": 1, "chars": 1}),  # means: -2 vs -1.5; -3 vs -1.2
        ("chars", {"long": 1, "chars": 0}),  # per character: -2/5 vs -4.5/14; -3/12 vs -2.4/3
        ("none", {"long": 0, "chars": 1}),  # sums: -2 vs -4.5; -3 vs -2.4
    ],
)
def test_choice_normalisation_decides_the_pick(bigram, normalize, picks):
    rows = {r["id"]: r for r in run_probes(bigram, choice_suite(normalize))}
    for case_id, pick in picks.items():
        row = rows[case_id]
        assert row["predicted"] == pick, (normalize, row["scores"])
        assert row["correct"] is (pick == row["answer"])
        assert row["output"] == row["options"][pick] and row["expected"] == row["options"][row["answer"]]
    if normalize == "chars":
        assert rows["long"]["scores"] == pytest.approx([-2 / 5, -4.5 / 14], abs=1e-6)


# ----------------------------------------------------------------------------- a model that copies


def copy_transformer(tokenizer, match: int = 6, max_seq_len: int = 512, stop_at_newline: bool = False):
    """A 2-layer attnlab Transformer (decoupled attention) with hand-set weights that copies its input.

    Residual stream, d_model = 1 + (match + 2) V for vocabulary V: [one | E | P_1 .. P_match | OUT].
    Layer 1: head j attends to position t - j through RoPE alone (the geometric path; constant q and k
    from the `one` channel, k rotated by j steps) and writes that token's one-hot into P_j.
    Layer 2, head 0 (the induction head; semantic path, no RoPE): the query holds the last `match` tokens
    x_t, x_{t-1}, ... weighted 2^(match-1) .. 1; the key at s holds x_{s-1}, x_{s-2}, ... So the position
    after the longest earlier match of the recent tokens wins; its token is written to OUT and read out by
    the LM head. Text after "Words: red ball\\nRepeat:" is therefore " red ball\\n..." (or " red ball" then
    end-of-text when stop_at_newline maps the copied newline to end-of-text). MLPs are zero.
    """
    vocab, heads, geo = tokenizer.vocab_size, match, 32
    d_model = 1 + (match + 2) * vocab
    E = slice(1, 1 + vocab)  # the current token
    P = [None] + [slice(1 + j * vocab, 1 + (j + 1) * vocab) for j in range(1, match + 1)]  # token j back
    OUT = slice(1 + (match + 1) * vocab, d_model)  # the token to emit
    cfg = attnlab.model_config_from_dict({
        "vocab_size": vocab, "d_model": d_model, "n_layers": 2, "n_heads": heads, "max_seq_len": max_seq_len,
        "mlp": "gelu", "d_ff": 4, "tie_embeddings": False, "norm_eps": 1e-6,
        "attention": {"kind": "decoupled", "d_sem": heads * match * vocab, "d_geo": heads * geo, "d_v": heads * vocab},
    })  # fmt: skip
    model = attnlab.build_model(cfg).eval()
    eye = torch.eye(vocab)
    sem_dim = match * vocab  # per head
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.zero_()
        model.embed.weight[:vocab, 0] = 1.0
        model.embed.weight[:vocab, E] = eye
        # Layer 1 sees one + E_x: RMSNorm scales each unit component to sqrt(d_model / 2).
        unit1 = math.sqrt(d_model / 2)
        theta = 1.0 / (cfg.rope_base ** (torch.arange(0, geo, 2).float() / geo))  # (geo/2,) RoPE frequencies
        attn = model.blocks[0].attn
        q_sem, q_geo, k_sem, k_geo, v = (torch.zeros(w, d_model) for w in attn.widths)
        amplitude = math.sqrt(40.0 * math.sqrt(geo)) / unit1  # score(offset j) - score(other) >= 0.686 * 40
        for h in range(heads):
            j, half = h + 1, h * geo + geo // 2
            q_geo[h * geo : half, 0] = amplitude
            k_geo[h * geo : half, 0] = torch.cos(j * theta) * amplitude  # q.k = sum_i cos(theta_i (t - s - j))
            k_geo[half : (h + 1) * geo, 0] = torch.sin(j * theta) * amplitude
            v[h * vocab : (h + 1) * vocab, E] = eye / unit1
            attn.out.weight[P[j], h * vocab : (h + 1) * vocab] = eye
        attn.proj.weight.copy_(torch.cat((q_sem, q_geo, k_sem, k_geo, v)))
        # Layer 2 sees one + E + P_1..P_match: unit components scale to sqrt(d_model / (match + 2)).
        unit2_sq = d_model / (match + 2)
        attn = model.blocks[1].attn
        q_sem, q_geo, k_sem, k_geo, v = (torch.zeros(w, d_model) for w in attn.widths)
        for j in range(match):
            weight = 2.0 ** (match - 1 - j) * 30.0 * math.sqrt(sem_dim) / unit2_sq  # 30 nats per least match
            q_sem[j * vocab : (j + 1) * vocab, E if j == 0 else P[j]] = eye * weight
            k_sem[j * vocab : (j + 1) * vocab, P[j + 1]] = eye
        v[:vocab, E] = eye / math.sqrt(unit2_sq)
        attn.proj.weight.copy_(torch.cat((q_sem, q_geo, k_sem, k_geo, v)))
        attn.out.weight[OUT, :vocab] = eye
        head = eye * 30.0 / math.sqrt(d_model / (match + 3))  # final RMSNorm: OUT is 1 of match + 3 units
        if stop_at_newline:
            newline = tokenizer.encode("\n")[0]
            head[tokenizer.eot_id], head[newline] = head[newline].clone(), 0.0
        model.lm_head.weight[:vocab, OUT] = head
    return model


@pytest.fixture(scope="module")
def copy_suite(core):
    return core.only("copy", "termination")


@pytest.fixture(scope="module")
def char_tokenizer(copy_suite):
    return CharTokenizer.fit(c.prompt for c in copy_suite.cases)


def as_eval(model, tokenizer, name="copier"):
    return EvalModel(name, Path(name), model.cfg, model, tokenizer, {"model": model.cfg.to_dict()})


def test_a_model_that_copies_passes_the_copy_probes(copy_suite, char_tokenizer):
    copier = as_eval(copy_transformer(char_tokenizer), char_tokenizer)
    rows = run_probes(copier, copy_suite)
    summary = summarize(rows)["categories"]
    assert summary["copy"]["correct"] == summary["copy"]["total"] == 8, [r["output"] for r in rows]
    # It copies the line and goes on ("...\nAnswer: garden\n"): termination needs the whole output to stop.
    assert summary["termination"]["correct"] == 0
    assert all(r["output"].startswith(" " + r["expected"] + "\n") for r in rows if r["category"] == "termination")


def test_a_model_that_copies_then_stops_passes_termination(copy_suite, char_tokenizer):
    stopper = as_eval(copy_transformer(char_tokenizer, stop_at_newline=True), char_tokenizer)
    rows = run_probes(stopper, copy_suite)
    assert all(r["correct"] for r in rows), [(r["id"], r["output"]) for r in rows if not r["correct"]]
    assert all(r["output"] == " " + r["expected"] for r in rows)  # end-of-text ended generation, not the budget


def test_an_untrained_model_of_the_same_shape_fails_them(copy_suite, char_tokenizer):
    random_model = copy_transformer(char_tokenizer)
    torch.manual_seed(0)
    random_model.reset_parameters()
    rows = run_probes(as_eval(random_model, char_tokenizer, "random"), copy_suite)
    assert summarize(rows)["overall"]["correct"] == 0


def test_max_new_tokens_bounds_generation(copy_suite, char_tokenizer):
    copier = as_eval(copy_transformer(char_tokenizer), char_tokenizer)
    short = dataclasses.replace(copy_suite.only("copy"), cases=tuple(
        dataclasses.replace(c, max_new_tokens=4) for c in copy_suite.only("copy").cases))  # fmt: skip
    rows = run_probes(copier, short)
    assert all(len(char_tokenizer.encode(r["output"])) == 4 and r["max_new_tokens"] == 4 for r in rows)
    assert not any(r["correct"] for r in rows)


def test_prompts_cut_to_fit_are_flagged(core):
    """A model with a 128-token window cannot see a ~700-character prompt whole: the row says so, and one
    LengthWarning names the cases."""
    long_cases = core.only("long_context").cases
    generated, choice = long_cases[0], long_cases[2]  # the number to remember is in the first sentence
    assert choice.kind == "choice"
    tokenizer = CharTokenizer.fit([generated.prompt, choice.prompt])
    copier = as_eval(copy_transformer(tokenizer, max_seq_len=128), tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = run_probes(copier, dataclasses.replace(core, cases=(generated, choice)))
    said = (f"copier on core: the prompt of 2 case(s) ({[generated.id, choice.id]}) does not fit max_seq_len=128 "
            "with its answer: cut on the left, its start unseen (truncated: true in the records; shorten these "
            "prompts)")  # fmt: skip
    assert [(w.category, str(w.message)) for w in caught] == [(LengthWarning, said)]
    assert all(r["truncated"] and r["prompt_tokens"] > 128 for r in rows)
    assert not rows[0]["correct"]


def test_records_round_trip_and_keep_the_attention_kind(tmp_path, copy_suite, char_tokenizer):
    copier = as_eval(copy_transformer(char_tokenizer), char_tokenizer)
    rows = run_probes(copier, copy_suite.only("copy"))
    records = probe_records(copier, copy_suite.only("copy"), rows)
    append_records(tmp_path / "probes.jsonl", records)
    back = read_records(tmp_path / "probes.jsonl", "probes")
    assert len(back) == len(rows) + 1
    assert {r["record"] for r in back} == {"case", "summary"}
    first = back[0]
    assert first["kind"] == "decoupled" and first["probe_kind"] == "first_line"
    assert first["config_hash"] == copier.cfg.config_hash() and first["suite"] == "core"
    assert back[-1]["overall"]["accuracy"] == 1.0
    assert "copy" in summary_table(summarize(rows))


def test_head_to_head_of_two_real_models(copy_suite, char_tokenizer):
    """The model that stops is right on the 8 termination cases where the other is wrong: p = 2 / 2^8."""
    copier = as_eval(copy_transformer(char_tokenizer), char_tokenizer, "copier")
    stopper = as_eval(copy_transformer(char_tokenizer, stop_at_newline=True), char_tokenizer, "stopper")
    result = paired_comparison(run_probes(copier, copy_suite), run_probes(stopper, copy_suite),
                               names=(copier.name, stopper.name), n_boot=2000)  # fmt: skip
    assert (result["both_right"], result["a_only"], result["b_only"], result["both_wrong"]) == (8, 0, 8, 0)
    assert result["mcnemar_p"] == 2 / 2**8 and result["winner"] == "stopper"
    assert result["categories"]["termination"]["b_only"] == 8
    record = comparison_record(copier, stopper, copy_suite, result)
    assert record["benchmark"] == "probes" and record["record"] == "paired"
    assert (record["model_a"], record["model_b"]) == ("copier", "stopper")
    assert record["config_hash_a"] == copier.cfg.config_hash() and record["suite_fingerprint"]


def test_a_model_without_tokenizer_is_refused(copy_suite, char_tokenizer):
    model = dataclasses.replace(as_eval(copy_transformer(char_tokenizer, match=1), char_tokenizer), tokenizer=None)
    with pytest.raises(InputError, match="no tokenizer"):
        run_probes(model, copy_suite)
