"""Multiple choice as lm-evaluation-harness scores it: loaders, prompts, acc / acc_norm, batching, errors."""

import hashlib
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_model, unsealed

import attnlab
from attnlab.data.files import seal_kept
from attnlab.data.tokenizers import ByteTokenizer
from attnlab.errors import ConfigError, DataError, InputError
from attnlab.eval import EvalModel, continuation_logprobs, read_records
from attnlab.eval.multiple_choice import (
    TASKS,
    Item,
    encode_item,
    hellaswag_preprocess,
    load_arc_easy,
    load_hellaswag,
    load_items,
    load_piqa,
    load_winogrande,
    loglikelihoods,
    predictions,
    run_multiple_choice,
    write_multiple_choice,
)

WINOGRANDE = [
    {"context_options": ["The trophy doesn't fit into the brown suitcase because the trophy",
                         "The trophy doesn't fit into the brown suitcase because the suitcase"],
     "continuation": "is too large.", "gold": 0},
    {"context_options": ["Jim comforted Kevin because Jim", "Jim comforted Kevin because Kevin"],
     "continuation": " was so upset. ", "gold": 1},
]  # fmt: skip
HELLASWAG = [
    {"ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
     "ctx": "A man is sitting on a roof. he", "split": "val", "split_type": "indomain", "label": 3,
     "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                 "is holding a rubik's cube.", "starts pulling up roofing on a roof."],
     "source_id": "activitynet~v_-JhWjGDPHMY"},
    {"ind": 92, "activity_label": "Home and Garden",
     "ctx_a": "[header] How to clean a grill [title] Heat the grill. [step] Turn it to high.", "ctx_b": "",
     "label": "1",
     "endings": ["[substeps] Scrub the  grates with a wire brush.", "Then the man grabs a DVD.",
                 "Pour water on it [title] Let it cool.", "Eat the grill."]},
    {"activity_label": "Bowling", "ctx_a": "A woman holds a ball.", "ctx_b": "then the woman throws a DVD",
     "label": 0, "endings": ["at the pins.", "into the lake."]},
]  # fmt: skip


def write_jsonl(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


@pytest.fixture
def small_files(tmp_path):
    return {
        "winogrande": write_jsonl(tmp_path / "winogrande.jsonl", WINOGRANDE),
        "hellaswag": write_jsonl(tmp_path / "hellaswag_val.jsonl", HELLASWAG),
    }


def eval_model(module, tmp_path, max_seq_len=512):
    cfg = attnlab.ModelConfig(vocab_size=257, d_model=16, n_layers=1, n_heads=2, max_seq_len=max_seq_len)
    return EvalModel("stub", tmp_path, cfg, module, ByteTokenizer(), {})


class UnigramStub(torch.nn.Module):
    """Every position predicts log_softmax(bias), whatever the context: controlled log-probs per byte."""

    def __init__(self, bias, max_seq_len=512):
        super().__init__()
        self.bias = torch.nn.Parameter(bias)
        self.cfg = SimpleNamespace(max_seq_len=max_seq_len)

    def forward(self, tokens, use_cache=False):
        return self.bias.expand(*tokens.shape, -1), None


class OracleStub(torch.nn.Module):
    """Knows the gold sequences: after a prefix of one, puts logit 30 on its next token, else uniform."""

    def __init__(self, gold_sequences, max_seq_len=1024):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.cfg = SimpleNamespace(max_seq_len=max_seq_len)
        self.next = {tuple(ids[:t]): ids[t] for ids in gold_sequences for t in range(1, len(ids))}

    def forward(self, tokens, use_cache=False):
        logits = torch.zeros(*tokens.shape, 257)  # (B, T, V)
        for b, seq in enumerate(tokens.tolist()):
            for t in range(len(seq)):
                if (nxt := self.next.get(tuple(seq[: t + 1]))) is not None:
                    logits[b, t, nxt] = 30.0
        return logits, None


BYTE_MODEL = {"vocab_size": 257, "d_model": 32, "init_std": 0.2}  # for ByteTokenizer (2 layers of 4 heads)


# ----------------------------------------------------------------------------- loaders on the stored files


def test_arc_easy_loader_follows_the_label_rule(data_dir):
    path = data_dir / "eval/arc_easy/ARC-Easy-validation.json"
    raw = json.loads(path.read_text())
    items = load_arc_easy(path)
    assert len(items) == 570
    for obj, item in zip(raw, items, strict=True):
        assert item.id == obj["id"]
        assert item.gold == obj["choices"]["label"].index(obj["answerKey"])
        assert item.continuations == tuple(" " + t for t in obj["choices"]["text"])
        assert item.choice_chars == tuple(len(t) for t in obj["choices"]["text"])
    numeric = [i for i, obj in zip(items, raw, strict=True) if obj["choices"]["label"][0] == "1"]
    assert len(numeric) == 21 and {i.gold for i in numeric} <= {0, 1, 2, 3}
    assert sorted(len(i.continuations) for i in items)[:1] == [3] and sum(len(i.continuations) == 5 for i in items) == 2


def test_piqa_loader(data_dir):
    path = data_dir / "eval/piqa/piqa_valid_1838.llmfoundry.jsonl"
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    items = load_piqa(path)
    assert len(items) == 1838
    assert [i.gold for i in items] == [r["gold"] for r in raw]
    assert all(i.contexts[0] == r["query"] + "Answer:" for i, r in zip(items, raw, strict=True))


def test_default_locations_and_explicit_paths(data_dir, small_files, tmp_path, monkeypatch):
    monkeypatch.delenv("ATTNLAB_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert len(load_items("piqa", data_dir=data_dir)) == 1838
    assert len(load_items("hellaswag", path=small_files["hellaswag"])) == 3
    with pytest.raises(DataError, match=r"eval/winogrande/winogrande\.jsonl not found.*--data-dir"):
        load_items("winogrande", data_dir=data_dir)
    with pytest.raises(DataError, match="nowhere.jsonl not found"):
        load_items("piqa", path=tmp_path / "nowhere.jsonl")


# ----------------------------------------------------------------------------- lm-eval's prompts, exactly


def test_arc_and_piqa_prompts(data_dir):
    arc = load_arc_easy(data_dir / "eval/arc_easy/ARC-Easy-validation.json")[0]
    assert arc.contexts == ("Question: Which technology was developed most recently?\nAnswer:",) * 4
    assert arc.continuations == (" cellular telephone", " television", " refrigerator", " airplane")
    assert (arc.gold, arc.choice_chars) == (0, (18, 10, 12, 8))
    piqa = load_piqa(data_dir / "eval/piqa/piqa_valid_1838.llmfoundry.jsonl")[1]
    assert piqa.contexts == ("Question: dresser\nAnswer:",) * 2
    assert piqa.continuations == (" replace drawer with bobby pin", " finish, woodgrain with  bobby pin")
    assert (piqa.gold, piqa.choice_chars) == (1, (29, 33))


def test_hellaswag_prompts(small_files):
    roof, grill, bowling = load_hellaswag(small_files["hellaswag"])
    assert roof.id == "24" and roof.gold == 3
    assert roof.contexts[0] == "Roof shingle removal: A man is sitting on a roof. He"
    assert roof.continuations[3] == " starts pulling up roofing on a roof."
    assert roof.choice_chars == tuple(len(e) for e in HELLASWAG[0]["endings"])
    # " [title]" -> ". ", brackets deleted, one pass of "  " -> " ", empty ctx_b leaves a stripped space.
    assert grill.contexts[0] == "Home and Garden: How to clean a grill. Heat the grill. Turn it to high."
    # preprocess strips before deleting "[substeps]", so that ending keeps a leading space (as in lm-eval).
    assert grill.continuations == (
        "  Scrub the grates with a wire brush.", " Then the man grabs a DVD.", " Pour water on it. Let it cool.",
        " Eat the grill.",
    )  # fmt: skip
    assert grill.gold == 1 and grill.choice_chars[0] == len(" Scrub the grates with a wire brush.")
    assert bowling.id == "2"
    assert bowling.contexts[0] == "Bowling: A woman holds a ball. Then the woman throws a dvd"  # str.capitalize
    assert hellaswag_preprocess(" a [b] c [title] d ") == "a c. d"


def test_winogrande_partial_scoring_items(small_files):
    trophy, jim = load_winogrande(small_files["winogrande"])
    assert trophy.contexts == tuple(WINOGRANDE[0]["context_options"])
    assert trophy.continuations == (" is too large.",) * 2 and trophy.gold == 0 and trophy.choice_chars is None
    assert jim.continuations == (" was so upset.",) * 2 and jim.gold == 1


def test_encoding_moves_trailing_space_and_shares_the_context():
    calls = []

    class Counting(ByteTokenizer):
        def encode(self, text):
            calls.append(text)
            return super().encode(text)

    tok = Counting()
    item = Item("x", ("Q: a\nAnswer: ",) * 3 + ("",), (" yes", "no", "maybe", "solo"), 0, (3, 2, 5, 4))
    pairs = encode_item(tok, item)
    assert pairs[0] == (list(b"Q: a\nAnswer:"), list(b"  yes"))  # the context's space joins the continuation
    assert pairs[1][1] == list(b" no")
    assert pairs[3] == ([tok.eot_id], list(b"solo"))  # lm-eval: an empty context is the end-of-text token
    assert calls.count("Q: a\nAnswer:") == 1  # the shared context is encoded once (plus once per whole pair)


# ----------------------------------------------------------------------------- scoring


def test_batched_scores_equal_one_by_one_scoring():
    model = tiny_model(max_seq_len=128, **BYTE_MODEL)
    rng = torch.Generator().manual_seed(1)
    sizes = [(5, 3), (40, 1), (1, 9), (17, 17), (60, 2)]
    pairs = [tuple(torch.randint(0, 256, (n,), generator=rng).tolist() for n in size) for size in sizes]
    reference = [float(continuation_logprobs(model, a, c).sum()) for a, c in pairs]
    for batch_size in (1, 2, 16):
        assert loglikelihoods(model, pairs, batch_size) == pytest.approx(reference, abs=1e-4)


def test_long_contexts_are_cut_on_the_left_as_lm_eval_does():
    model = tiny_model(max_seq_len=16, **BYTE_MODEL)
    context, continuation = list(range(10, 50)), [7, 8, 9, 10, 11]
    window = (context + continuation)[-17:]  # lm-eval: (ctx + cont)[-(max_length + 1):], the input is [:-1]
    with torch.no_grad():
        logits, _ = model(torch.tensor([window[:-1]]), use_cache=False)
    reference = logits[0, -5:].log_softmax(-1).gather(-1, torch.tensor(continuation)[:, None]).sum()
    short = ([1, 2], [3])
    assert loglikelihoods(model, [(context, continuation), short], 2) == pytest.approx(
        [float(reference), float(continuation_logprobs(model, *short).sum())], abs=1e-4
    )
    with pytest.raises(InputError, match="max_seq_len=16"):
        loglikelihoods(model, [([1], list(range(17)))])


def test_predictions_take_the_first_index_on_ties():
    assert predictions([-2.0, -1.0, -1.0], (1, 1, 1)) == (1, 1)
    assert predictions([-4.0, -6.0], (1, 8)) == (0, 1)
    assert predictions([-1.0, -3.0], None) == (0, None)


def test_summed_and_normalised_scoring_disagree_as_defined(tmp_path):
    # A unigram model with log p(" ") = -1.2, log p("x") = -1.2, log p("y") = -1.3 (the rest on "z"). Choices
    # "x" and "yy": the sum picks " x" (-2.4 > -3.8); per character of the choice text lm-eval picks "yy"
    # (-2.4 / 1 < -3.8 / 2); counting the delimiter's space (or byte tokens) would pick " x" again (-1.2 > -1.27).
    ls, lx, ly = -1.2, -1.2, -1.3
    bias = torch.full((257,), -1e9)
    bias[ord(" ")], bias[ord("x")], bias[ord("y")] = ls, lx, ly
    bias[ord("z")] = math.log(1 - math.exp(ls) - math.exp(lx) - math.exp(ly))
    item = {"question": "q", "choices": {"text": ["x", "yy"], "label": ["A", "B"]}}
    arc = [dict(item, id=str(i), answerKey=key) for i, key in enumerate("ABB")]
    (tmp_path / "arc.json").write_text(json.dumps(arc, indent=2))
    rows, summary = run_multiple_choice(eval_model(UnigramStub(bias), tmp_path), "arc_easy", tmp_path / "arc.json")
    assert rows[0]["loglikelihoods"] == pytest.approx([ls + lx, ls + 2 * ly], abs=1e-5)
    assert [(r["predicted"], r["predicted_norm"]) for r in rows] == [(0, 1)] * 3
    assert rows[0]["choice_chars"] == [1, 2] and rows[0]["continuation_tokens"] == [2, 3]
    assert (summary["acc"], summary["acc_norm"]) == pytest.approx((1 / 3, 2 / 3))
    # lm-eval's mean_stderr: sqrt(p (1 - p) / (n - 1)) = sqrt(2/9 / 2) = 1/3 for both.
    assert (summary["acc_stderr"], summary["acc_norm_stderr"]) == pytest.approx((1 / 3, 1 / 3))
    assert summary["benchmark"] == "multiple_choice" and summary["task"] == "arc_easy" and summary["n"] == 3
    assert summary["data_sha256"] == hashlib.sha256((tmp_path / "arc.json").read_bytes()).hexdigest()

    summary_path, items_path = write_multiple_choice(tmp_path / "out", rows, summary)
    written = read_records(summary_path)  # (attnlab seals every record it writes: the seal holds, over the figures)
    assert [unsealed(r) for r in written] == [json.loads(json.dumps(summary))]
    items = read_records(items_path)
    assert all(seal_kept(r) is True for r in written + items)
    assert [r["id"] for r in items] == ["0", "1", "2"]
    assert items[0]["task"] == "arc_easy"


@pytest.mark.parametrize("task", ["arc_easy", "piqa", "winogrande", "hellaswag"])
def test_an_oracle_scores_one(task, small_files, tmp_path, request):
    path = small_files[task] if task in small_files else request.getfixturevalue("data_dir") / TASKS[task].file
    items = load_items(task, path)[:20]
    golds = [list((i.contexts[i.gold] + i.continuations[i.gold]).encode()) for i in items]
    rows, summary = run_multiple_choice(eval_model(OracleStub(golds), tmp_path), task, path, limit=20)
    assert len(rows) == len(items) and summary["acc"] == 1.0 and summary["acc_stderr"] == 0.0
    assert summary["acc_norm"] == (None if task == "winogrande" else 1.0)


def test_smoke_real_tiny_model_on_arc(data_dir, tmp_path):
    module = tiny_model(max_seq_len=64, **BYTE_MODEL)
    model = EvalModel("tiny", tmp_path, module.cfg, module, ByteTokenizer(), {})
    rows, summary = run_multiple_choice(model, "arc_easy", data_dir=data_dir, limit=5)
    items = load_items("arc_easy", data_dir=data_dir)[:5]
    assert [len(r["loglikelihoods"]) for r in rows] == [len(i.continuations) for i in items]
    assert all(math.isfinite(x) and x < 0 for r in rows for x in r["loglikelihoods"])
    assert 0 <= summary["acc"] <= 1 and 0 <= summary["acc_norm"] <= 1 and summary["n"] == 5
    assert summary["n_truncated"] > 0 and summary["kind"] == model.cfg.attention.kind


# ----------------------------------------------------------------------------- errors


def test_unknown_task_suggests_the_nearest():
    with pytest.raises(ConfigError, match="unknown task 'arc_eazy' \\(did you mean 'arc_easy'\\?\\)"):
        load_items("arc_eazy")
    with pytest.raises(ConfigError, match="valid tasks: arc_easy, hellaswag, piqa, winogrande"):
        load_items("mmlu")


GOOD_PIQA = {"query": "Question: q\n", "choices": ["a", "b"], "gold": 0}


@pytest.mark.parametrize(
    "loader, lines, line, message",
    [
        (load_piqa, [GOOD_PIQA, {"query": "Question: q\n", "choices": ["a", "b"]}], 2, "field 'gold' is missing"),
        (load_piqa, [dict(GOOD_PIQA, gold=2)], 1, "field 'gold' must be a choice index 0..1"),
        (load_piqa, [GOOD_PIQA, GOOD_PIQA, "{oops"], 3, "not valid JSON"),
        (load_piqa, [dict(GOOD_PIQA, query="q\n")], 1, "field 'query' must read 'Question: "),
        (load_piqa, [dict(GOOD_PIQA, choices=["a", ""])], 1, "field 'choices' must list at least 2 non-empty"),
        (load_winogrande, [dict(WINOGRANDE[0], context_options="x")], 1, "field 'context_options' must be a list"),
        (load_winogrande, [WINOGRANDE[0], dict(WINOGRANDE[1], gold=True)], 2, "field 'gold' must be an integer"),
        (load_winogrande, [dict(WINOGRANDE[0], continuation=" ")], 1, "field 'continuation' is empty"),
        (load_hellaswag, [{k: v for k, v in HELLASWAG[0].items() if k != "endings"}], 1, "field 'endings' is missing"),
        (load_hellaswag, [HELLASWAG[0], dict(HELLASWAG[1], label="x")], 2, "field 'label' must be a choice index"),
        (load_hellaswag, [dict(HELLASWAG[0], ctx_b=None)], 1, "field 'ctx_b' must be a string"),
    ],
)  # fmt: skip
def test_malformed_jsonl_names_file_line_and_field(tmp_path, loader, lines, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with pytest.raises(DataError, match=re.escape(f"{path}:{line}: {message}")):
        loader(path)


def test_malformed_arc_names_file_line_and_field(tmp_path):
    good = {"id": "a", "question": "q", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "answerKey": "A"}
    path = tmp_path / "arc.json"
    path.write_text(json.dumps([good, dict(good, id="b", answerKey="E")], indent=2))
    second = [n for n, text in enumerate(path.read_text().splitlines(), 1) if text == "  {"][1]
    with pytest.raises(DataError, match=re.escape(f"{path}:{second}: field 'answerKey' 'E' is not one of")):
        load_arc_easy(path)
    path.write_text(json.dumps([dict(good, choices={"text": ["x", "y"], "label": ["A"]})]))
    with pytest.raises(DataError, match=re.escape(f"{path}:1: field 'choices.label' must list at least 2")):
        load_arc_easy(path)
    path.write_text(json.dumps([good, dict(good, question=3)], indent=2))
    with pytest.raises(DataError, match=re.escape(f"{path}:{second}: field 'question' must be a string")):
        load_arc_easy(path)
    path.write_text(json.dumps(good))
    with pytest.raises(DataError, match="expected one JSON array"):
        load_arc_easy(path)
    path.write_text('[{"id": "a"},\n]')
    with pytest.raises(DataError, match=re.escape(f"{path}:2: not valid JSON")):
        load_arc_easy(path)
