"""kv-eval / kv-tune: the quality figures of quantized KV caches, and the CLI around them."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import train_tiny_run

import attnlab
import attnlab.cli_models
from attnlab.cli import main
from attnlab.eval.kvquant import chunked_logits, evaluate_policies, tune
from attnlab.eval.loading import load_for_eval
from attnlab.eval.records import read_records

MODEL = {
    "vocab_size": 40,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "max_seq_len": 96,
    "attention": {"kind": "mha", "n_kv_heads": 2},
}  # fmt: skip  (a token's k row: 2 x 16 = 32 values)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny trained run (char tokenizer, 30 steps)."""
    return train_tiny_run(tmp_path_factory.mktemp("kvq"), MODEL, steps=30, seq_len=64, words=40)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")


@pytest.fixture(scope="module")
def windows(run):
    from attnlab.eval.kvquant import held_out_windows

    return held_out_windows(load_for_eval(run), "val", 65, 65 * 3)


def test_a_lossless_policy_costs_nothing_and_a_4bit_one_costs_something(run, windows):
    model = load_for_eval(run).model
    rows = evaluate_policies(model, windows, ["k=q4_0,resid=64", "k=q4_0,v=q4_0", "k=fp32,v=fp32"], greedy_tokens=8)
    covered, lossy, lossless = rows
    for row in (covered, lossless):  # the residual window holds every token / storage in the compute dtype
        assert row["dnll"] == 0 and row["kl"] == pytest.approx(0, abs=1e-7) and row["top1"] == 1 and row["greedy"] == 1
    assert lossy["dnll"] != 0 and lossy["kl"] > 1e-9  # a 30-step model predicts softly: small, not zero
    assert lossy["ppl_ratio"] == pytest.approx(math.exp(lossy["dnll"]))
    assert lossy["bytes_per_token"] == 2 * 32 * (18 / 32 + 18 / 32)  # 2 layers, rows of 32 values, Q4_0
    assert lossy["tokens"] == windows.shape[0] * 64


def test_kl_and_dnll_against_a_direct_computation(run, windows):
    model = load_for_eval(run).model
    ids = windows[:1]
    with torch.no_grad():
        full = model(ids[:, :-1], use_cache=False)[0].log_softmax(-1)
        quant = chunked_logits(model, ids[:, :-1], "k=q8_0,v=q4_0", chunk=1).log_softmax(-1)
    (row,) = evaluate_policies(model, ids, ["k=q8_0,v=q4_0"], greedy_prompts=0)
    kl = F.kl_div(quant, full, log_target=True, reduction="sum").item() / 64
    nll = lambda logp: -logp.gather(-1, ids[:, 1:, None]).mean().item()  # noqa: E731
    assert row["kl"] == pytest.approx(kl, rel=1e-3, abs=1e-7)
    assert row["dnll"] == pytest.approx(nll(quant) - nll(full), abs=1e-5)
    # the interval: a paired bootstrap over the window's 64-position block, here one block (no spread)
    diff = (-quant.gather(-1, ids[:, 1:, None]) + full.gather(-1, ids[:, 1:, None])).sum().item() / 64
    assert row["dnll_ci"] == pytest.approx([diff, diff], abs=1e-5)


def test_the_dnll_interval_resamples_blocks_of_positions(run, windows):
    from attnlab.eval.kvquant import block_sums

    diff = torch.arange(2 * 130, dtype=torch.float64).view(2, 130)
    assert block_sums(diff, 64) == [sum(range(0, 64)), sum(range(64, 128)), sum(range(130, 194)),
                                    sum(range(194, 258))]  # fmt: skip
    model = load_for_eval(run).model
    lossy, lossless = evaluate_policies(model, windows, ["k=q4_0,v=q4_0", "k=fp32,v=fp32"], greedy_prompts=0)
    assert lossless["dnll_ci"] == pytest.approx([0, 0], abs=1e-6)
    low, high = lossy["dnll_ci"]
    assert low < lossy["dnll"] < high and high - low > 1e-6  # three windows: three blocks, some spread


def test_tune_picks_a_policy_within_the_budget(run, windows):
    model = load_for_eval(run).model
    budget = 2 * 2 * 32 * 1.0625  # Q8_0 everywhere fits; fp16 everywhere (2 * 2 * 32 * 2 bytes) does not
    result = tune(model, windows[:2], budget, formats=("fp16", "q8_0", "q4_0"), resids=(0, 16), log=lambda _: None)
    best = result["best"]
    assert best["bytes_at_seq_len"] / 64 <= budget
    assert best["kl"] == min(r["kl"] for r in result["verified"])
    assert {r["policy"] for r in result["sensitivity"]} >= {"k=q8_0,v=fp16", "k=fp16,v=q4_0,resid=16"}


def test_cli_kv_eval_and_kv_tune(run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "kv.jsonl"
    args = ["--split", "val", "--seq-len", "32", "--tokens", "99", "--out", str(out)]
    assert main(["kv-eval", str(run), "--policies", "k=q8_0,v=q8_0", "ksem=q4_0", *args]) == 2
    assert "'ksem', which this model does not cache" in capsys.readouterr().err
    assert main(["kv-eval", str(run), "--policies", "k=q8_0,v=q8_0", "k=q4_0,v=q4_0,resid=8", *args]) == 0
    text = capsys.readouterr().out
    assert "k=q4_0,v=q4_0,resid=8" in text and "dNLL" in text
    rows = read_records(out, "kv_quant")
    assert [r["policy"] for r in rows] == ["k=q8_0,v=q8_0", "k=q4_0,v=q4_0,resid=8"] and rows[0][
        "model"
    ] == "tiny/seed0"
    tune_args = ["kv-tune", str(run), "--budget", "100", "--max-dnll", "0", "--formats", "q8_0,q4_0", "--resids", "0"]
    assert main([*tune_args, *args]) == 0  # (this barely trained model loses nothing to q4_0: a dNLL of -0.00002)
    out = capsys.readouterr().out
    assert "best under 100 bytes/token" in out and "(--max-dnll 0: meets)" in out
    real_tune = attnlab.cli_models.tune  # a winner above --max-dnll: exit 1 (a negative --max-dnll is refused)
    monkeypatch.setattr(attnlab.cli_models, "tune", lambda *a, **k: real_tune(*a[:3], -1.0, *a[4:], **k))
    assert main([*tune_args, *args]) == 1
    assert "(--max-dnll 0: EXCEEDS)" in capsys.readouterr().out
    assert main(["kv-tune", str(run), "--budget", "10", *args]) == 2
    assert "raise the budget" in capsys.readouterr().err


def test_info_with_a_policy_matches_a_live_cache(tmp_path, capsys):
    config = tmp_path / "m.yaml"
    config.write_text(json.dumps({**MODEL, "name": "m"}))
    policy = "k=q4_0,v=q8_0,resid=16"
    assert main(["info", str(config), "--dtype", "fp32", "--seq-len", "80", "--kv-policy", policy, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    model = attnlab.build_model(attnlab.load_config(str(config)))
    assert report["kv_bytes"] == model.new_cache(1, 80, policy=policy).nbytes()
    assert report["kv_policy"] == policy and report["cache_fields"] == {"k": 18, "v": 34}
    assert main(["info", str(config), "--kv-policy", "k=q5_1"]) == 2
    assert "unknown format" in capsys.readouterr().err


def test_bench_manifest_takes_policies(run, tmp_path):
    manifest = tmp_path / "bench.yml"
    manifest.write_text(
        f"name: kv\ncheckpoints: ['{run}']\nbenchmarks:\n"
        "  kv_quant: {policies: ['k=q8_0,v=q8_0'], split: val, seq_len: 32, max_tokens: 99}\n"
        "  memory: {lengths: [32], kv_policy: 'k=q4_0,v=q4_0,resid=8'}\n"
    )
    assert main(["bench", str(manifest), "--out", str(tmp_path / "out")]) == 0
    records = read_records(tmp_path / "out" / "records.jsonl")
    assert {r["benchmark"] for r in records} == {"kv_quant", "memory"}
    memory = next(r for r in records if r["benchmark"] == "memory")
    assert memory["kv_matches_analytic"] and memory["kv_policy"] == "k=q4_0,v=q4_0,resid=8"


def test_generate_with_a_policy(run, capsys):
    assert main(["generate", str(run), "a cat", "--max-new-tokens", "8", "--kv-policy", "k=q8_0,v=q8_0"]) == 0
    assert capsys.readouterr().out.startswith("a cat")
