"""lm-evaluation-harness over attnlab models (attnlab.eval.lmeval), checked against independent scorers: attnlab's
own multiple choice item by item, lm-eval's Hugging Face model (HFLM) on the same weights, attnlab's perplexity,
and attnlab's `generate` (also under a quantized KV cache)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import smollm_file, tiny_model

from attnlab.data.tokenizers import ByteTokenizer
from attnlab.errors import ConfigError, DataError, InputError
from attnlab.eval import EvalModel, load_for_eval
from attnlab.eval.multiple_choice import encode_item, load_arc_easy, loglikelihoods, run_multiple_choice
from attnlab.eval.perplexity import window_losses
from attnlab.generate import generate

lm_eval = pytest.importorskip("lm_eval")  # the `lmeval` extra
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from attnlab.eval import lmeval  # noqa: E402
from attnlab.eval.lmeval import AttnlabLM, run_lm_eval, task_specs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TASKS = Path(__file__).resolve().parents[2] / "configs" / "lm_eval"
ARC = "eval/arc_easy/ARC-Easy-validation.json"


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """The `datasets` library caches what it reads in tmp_path, not in the user's home."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))


def request(kind: str, *args) -> Instance:
    return Instance(kind, {}, tuple(args), 0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """folder(add_bos) -> a tiny random Hugging Face Llama folder (max_position_embeddings 128, so about half of
    the first 40 ARC-Easy prompts are cut on the left) whose byte-level tokenizer puts BOS first or not."""
    transformers = pytest.importorskip("transformers")
    from test_pretrained import write_tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    folders = {}
    for add_bos in (False, True):
        folder = tmp_path_factory.mktemp(f"llama-bos-{add_bos}")
        model.save_pretrained(folder)
        write_tokenizer(folder, add_bos=add_bos)
        folders[add_bos] = folder
    return folders.__getitem__


@pytest.fixture(scope="module")
def byte_model():
    """A tiny random attnlab model over UTF-8 bytes (one token per byte), max_seq_len 32."""
    model = tiny_model(vocab_size=257, max_seq_len=32, seed=1, perturb=True)
    return EvalModel("tiny-bytes", Path("tiny-bytes"), model.cfg, model, ByteTokenizer(), {})


def assert_items_agree(rows: list[dict], samples: list[dict], atol: float) -> None:
    """attnlab's multiple-choice rows and lm-eval's samples of the same items: per-choice loglikelihoods, the
    chosen answers (argmax of ll and of ll / chars), acc and acc_norm item by item."""
    samples = sorted(samples, key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(len(rows)))
    for row, sample in zip(rows, samples, strict=True):
        theirs = [ll for ll, _ in sample["filtered_resps"]]
        np.testing.assert_allclose(theirs, row["loglikelihoods"], rtol=0, atol=atol, err_msg=f"item {row['id']}")
        choices = sample["doc"]["choices"]  # ARC: {"text": [...], "label": [...]}; PIQA: a list
        chars = [len(choice) for choice in (choices["text"] if isinstance(choices, dict) else choices)]
        assert chars == row["choice_chars"]
        assert int(np.argmax(theirs)) == row["predicted"], row["id"]
        assert int(np.argmax(np.array(theirs) / chars)) == row["predicted_norm"], row["id"]
        assert sample["target"] == row["gold"]
        assert sample["acc"] == float(row["predicted"] == row["gold"])
        assert sample["acc_norm"] == float(row["predicted_norm"] == row["gold"])


def test_arc_easy_agrees_with_attnlab_multiple_choice_item_by_item(llama, data_dir, tmp_path):
    model = load_for_eval(llama(False))
    rows, summary = run_multiple_choice(model, "arc_easy", limit=40, data_dir=data_dir)
    results = run_lm_eval(llama(False), ["arc_easy_local"], out_dir=tmp_path / "out", limit=40, data_dir=data_dir,
                          include_path=TASKS, batch_size=8)  # fmt: skip
    assert summary["n_truncated"] >= 10  # contexts cut on the left to max_seq_len: both cut alike
    assert_items_agree(rows, results["samples"]["arc_easy_local"], atol=1e-4)
    scores = results["results"]["arc_easy_local"]
    assert scores["acc,none"] == pytest.approx(summary["acc"], abs=1e-12)
    assert scores["acc_norm,none"] == pytest.approx(summary["acc_norm"], abs=1e-12)
    assert scores["acc_stderr,none"] == pytest.approx(summary["acc_stderr"], abs=1e-12)
    written = json.loads((tmp_path / "out" / "lm_eval.json").read_text())
    assert written["results"]["arc_easy_local"]["acc,none"] == scores["acc,none"]
    assert written["configs"]["arc_easy_local"]["dataset_kwargs"]["data_files"]["validation"] == str(data_dir / ARC)
    lines = (tmp_path / "out" / "lm_eval_samples.jsonl").read_text().splitlines()
    assert len(lines) == 40 and json.loads(lines[0])["task"] == "arc_easy_local"


def test_bos_is_put_first_as_the_tokenizer_does_for_a_prompt(llama, data_dir):
    model = load_for_eval(llama(True))
    item = load_arc_easy(data_dir / ARC)[0]
    pairs = encode_item(model.tokenizer, item)  # attnlab's encoding: no BOS
    requests = [request("loglikelihood", c, x) for c, x in zip(item.contexts, item.continuations, strict=True)]
    with_bos = AttnlabLM(model, batch_size=3).loglikelihood(requests)
    want = loglikelihoods(model.model, [([1, *context], continuation) for context, continuation in pairs])
    np.testing.assert_allclose([ll for ll, _ in with_bos], want, rtol=0, atol=1e-5)
    without = AttnlabLM(model, add_bos_token=False).loglikelihood(requests)
    np.testing.assert_allclose([ll for ll, _ in without], loglikelihoods(model.model, pairs), rtol=0, atol=1e-5)
    lm = AttnlabLM(model)
    assert lm.tok_encode("<s>hi") == lm.tok_encode("hi") == [1, *model.tokenizer.encode("hi")]  # never two BOS
    assert lm.prefix_token_id == 1 and lm.eot_token_id == 2


def test_scores_equal_lm_eval_hugging_face_model(llama):
    """lm-eval's own HFLM on the transformers model of the same folder: loglikelihood (empty context, trailing
    space, a context cut on the left, BOS text in the context), rolling windows, greedy generation."""
    pytest.importorskip("accelerate")  # lm_eval.models.huggingface imports it
    from lm_eval.models.huggingface import HFLM

    folder = llama(True)
    hf = HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=3)
    ours = AttnlabLM(load_for_eval(folder), batch_size=2)
    assert (ours.max_length, ours.prefix_token_id, ours.eot_token_id) == (hf.max_length, hf.prefix_token_id, 2)
    pairs = [("Question: is the cat here?\nAnswer:", " yes"), ("the dog ", "is here"), ("", "hello there"),
             ("x" * 200, " the end of it"), ("<s>hi", " there")]  # fmt: skip
    theirs = hf.loglikelihood([request("loglikelihood", *pair) for pair in pairs])
    got = ours.loglikelihood([request("loglikelihood", *pair) for pair in pairs])
    np.testing.assert_allclose([ll for ll, _ in got], [ll for ll, _ in theirs], rtol=0, atol=1e-4)
    assert [greedy for _, greedy in got] == [greedy for _, greedy in theirs]
    documents = ["this is the text " * 20, "short", "<s>with bos"]  # 340 tokens: 3 windows, the last overlapping
    theirs = hf.loglikelihood_rolling([request("loglikelihood_rolling", d) for d in documents])
    got = ours.loglikelihood_rolling([request("loglikelihood_rolling", d) for d in documents])
    np.testing.assert_allclose(got, theirs, rtol=0, atol=1e-4)
    prompts = [
        ("the cat", {"until": ["\n"], "max_gen_toks": 10, "do_sample": False}),
        ("x" * 200, {"max_gen_toks": 12}),
    ]
    theirs = hf.generate_until([request("generate_until", *p) for p in prompts])
    assert ours.generate_until([request("generate_until", *p) for p in prompts]) == theirs


def test_rolling_loglikelihood_equals_attnlab_perplexity(byte_model):
    lm, length = AttnlabLM(byte_model), byte_model.cfg.max_seq_len
    text = "".join(chr(97 + (7 * i) % 26) for i in range(3 * length))  # 3 windows of max_seq_len bytes exactly
    (got,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    tokens = np.array([lm.prefix_token_id, *lm.tok_encode(text)])
    assert lm.prefix_token_id == ByteTokenizer.eot_id and len(tokens) == 3 * length + 1
    want = -sum(loss for loss, _ in window_losses(byte_model.model, tokens, length))
    assert abs(got - want) < 1e-4
    # 5 bytes more: a 4th window that reads the last max_seq_len tokens and scores only its last 5.
    (longer,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", text + "hello")])
    tail = torch.tensor(lm.tok_encode(text + "hello")[-length - 1 :])
    with torch.no_grad():
        logits, _ = byte_model.model(tail[None, :-1], use_cache=False)  # (1, L, V)
    last = logits[0, -5:].float().log_softmax(-1).gather(-1, tail[-5:, None]).sum()
    assert abs(longer - (want + float(last))) < 1e-4


def test_generate_until_stops_at_until_strings(byte_model, monkeypatch):
    lm, prompt = AttnlabLM(byte_model), "the cat"
    want = generate(byte_model.model, lm.tok_encode(prompt), max_new_tokens=20, stop_tokens=(256,), compile=False)
    full = byte_model.tokenizer.decode(want.tolist())
    (free,) = lm.generate_until([request("generate_until", prompt, {"max_gen_toks": 20})])
    assert free == full and len(full) == 20
    stop = full[2:4]
    assert stop != full[:2] and full.index(stop) < 18  # the greedy text has a stop string to find early
    sampled, sample = [], lmeval.sample
    monkeypatch.setattr(lmeval, "sample", lambda *a, **k: sampled.append(1) or sample(*a, **k))
    out = lm.generate_until([request("generate_until", prompt, {"until": ["zz", stop], "max_gen_toks": 20})])
    assert out == [full[: full.index(stop)]]
    assert len(sampled) == full.index(stop) + len(stop)  # stopped once the stop string was there
    # Sampling: what generate samples with the same seed.
    drawn = generate(byte_model.model, lm.tok_encode(prompt), max_new_tokens=12, temperature=1.0, seed=5,
                     stop_tokens=(256,), compile=False)  # fmt: skip
    drawn = [token for token in drawn.tolist() if token != ByteTokenizer.eot_id]  # the end of text is not text
    kwargs = {"do_sample": True, "temperature": 1.0, "max_gen_toks": 12}
    out = AttnlabLM(byte_model, seed=5).generate_until([request("generate_until", prompt, kwargs)])
    assert out == [byte_model.tokenizer.decode(drawn)]


def test_a_kv_policy_scores_through_the_quantized_cache(byte_model):
    prompt = list(b"a prompt of some length")
    plain, quantized = AttnlabLM(byte_model), AttnlabLM(byte_model, kv_policy="k=q4_0,v=q4_0")
    continuation = generate(byte_model.model, prompt, max_new_tokens=8, kv_policy="k=q4_0,v=q4_0", compile=False)
    cont = continuation.tolist()
    ((ll, greedy),) = quantized._loglikelihood_tokens([(None, prompt, cont)])
    assert greedy  # generate's greedy choice under the policy is the argmax when scored under it
    ((plain_ll, _),) = plain._loglikelihood_tokens([(None, prompt, cont)])
    assert abs(ll - plain_ll) > 1e-4  # the policy is applied
    # Everything in the full-precision residual window: the cached path gives the plain forward's numbers,
    # batched over requests of different context lengths.
    lossless = AttnlabLM(byte_model, kv_policy="resid=64", batch_size=4)
    requests = [(None, prompt[:n], cont[: 1 + n % 5]) for n in (3, 3, 9, 17, 23)]
    np.testing.assert_allclose(
        [ll for ll, _ in lossless._loglikelihood_tokens(requests)],
        [ll for ll, _ in plain._loglikelihood_tokens(requests)], rtol=0, atol=1e-5,
    )  # fmt: skip
    (text,) = quantized.generate_until([request("generate_until", "a prompt of some length", {"max_gen_toks": 8})])
    assert text == byte_model.tokenizer.decode(cont)


def test_mistakes_are_typed_errors(byte_model, tmp_path, monkeypatch):
    local = TaskManager(include_path=str(TASKS), include_defaults=False)  # lm-eval's own tasks take seconds to index
    with pytest.raises(ConfigError, match="unknown lm-eval task 'arc_easy_locl'.*did you mean 'arc_easy_local'"):
        task_specs(local, ["arc_easy_locl"])
    with pytest.raises(ConfigError, match="include_path .* is not a folder"):
        run_lm_eval(byte_model, ["arc_easy_local"], include_path=tmp_path / "missing")
    monkeypatch.delenv("ATTNLAB_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(DataError, match="ARC-Easy-validation.json not found"):
        run_lm_eval(byte_model, ["arc_easy_local"], include_path=TASKS, data_dir=tmp_path)
    with pytest.raises(ConfigError, match="limit"):
        run_lm_eval(byte_model, ["arc_easy_local"], include_path=TASKS, limit=0)
    lm = AttnlabLM(byte_model)
    with pytest.raises(InputError, match="max_gen_toks=32 leaves no room"):
        lm.generate_until([request("generate_until", "x", {"max_gen_toks": 32})])
    with pytest.raises(ConfigError, match="repetition_penalty"):
        lm.generate_until([request("generate_until", "x", {"repetition_penalty": 1.1})])
    with pytest.raises(ConfigError, match="max_length=64 exceeds the model's max_seq_len=32"):
        AttnlabLM(byte_model, max_length=64)
    with pytest.raises(DataError, match="no tokenizer"):
        AttnlabLM(EvalModel("x", Path("x"), byte_model.cfg, byte_model.model, None, {}))


@pytest.mark.slow
def test_smollm2_gguf_agrees_with_attnlab_multiple_choice(data_dir):
    """ARC-Easy and PIQA (configs/lm_eval: lm-eval's own task definitions over the local files) item by item."""
    path = smollm_file()
    model = load_for_eval(path)
    for task, local in (("arc_easy", "arc_easy_local"), ("piqa", "piqa_local")):  # 5 items of each
        rows, summary = run_multiple_choice(model, task, limit=5, data_dir=data_dir)
        results = run_lm_eval(model, [local], limit=5, data_dir=data_dir, include_path=TASKS, batch_size=8)
        assert_items_agree(rows, results["samples"][local], atol=1e-3)
        assert results["results"][local]["acc,none"] == pytest.approx(summary["acc"], abs=1e-12)
        assert results["results"][local]["acc_norm,none"] == pytest.approx(summary["acc_norm"], abs=1e-12)
        assert not math.isnan(summary["acc"])
