"""Probe H's findings on the caches that choose what they hold (presses, quest) and the commands that measure them:
SnapKV failed (a traceback) whenever it held no more tokens than its observation window; a quest cache allocated
every slot a request asked for (a large --max-new-tokens was a traceback); attention_maps on a model with a memory
and a prompt longer than its block was a traceback; the KV figures of a press at decode were negative or counted a
budget above seq_len in full, quest's read figure was not cut to the tokens there are, and a ratio at decode was
described as a press at prefill; stream_loss and perplexity of a press measured the dense model; kv-eval/kv-tune on
quest or a press gave advice that could not be followed, named --dtype fp8 a policy format and found an --out it
could not write only after the whole evaluation; an empty text file was said to have no train split."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import fails, tiny_config, tiny_model

from attnlab.accounting import kv_report, memory_note
from attnlab.cache.presses import snapkv_scores
from attnlab.cache.sparse import INITIAL_SLOTS
from attnlab.cli import main
from attnlab.generate import generate
from attnlab.ops.attend import grouped_logits


@pytest.fixture(scope="module")
def run(tiny_run):
    return tiny_run


pytestmark = pytest.mark.usefixtures("one_thread", "offline")

GQA = {"kind": "mha", "n_kv_heads": 2}


@pytest.fixture(scope="module")
def converted(run, tmp_path_factory):
    """convert(memory) -> the converted model's folder, made once per memory."""
    made = {}

    def make(memory: str):
        if memory not in made:
            out = tmp_path_factory.mktemp("converted") / "model"
            assert main(["convert", str(run), "--memory", memory, "--out", str(out), "--eval-tokens", "0"]) == 0
            made[memory] = out
        return made[memory]

    return make


def text_of(run):
    return str(run.parents[2] / "text.txt")


# ---------------------------------------------------------------------------------------------- h1: snapkv


def test_snapkv_keeps_the_newest_of_a_prompt_no_longer_than_its_window():
    """kvpress's setting (ratio 0.75, window 64) on an 11-token prompt: was avg_pool1d on an empty tensor."""
    model = tiny_model(GQA, {"kind": "snapkv", "compression_ratio": 0.75}, perturb=True)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model.new_cache(2)
        model(tokens[:, :11], cache)
        assert all(layer.positions().tolist() == [[[9, 10]] * 2] * 2 for layer in cache.layers)  # int(11 * 0.25)
        logits = torch.cat([model(tokens[:, t : t + 1], cache)[0] for t in range(11, 16)], dim=1)
    assert torch.isfinite(logits).all()
    out = generate(model, tokens[0, :11], max_new_tokens=5, temperature=0.0, compile=False)
    assert out.shape == (5,)


@pytest.mark.parametrize("memory", [{"budget": 4}, {"compression_ratio": 0.5, "window_size": 8}])
def test_snapkv_at_decode_decodes_token_by_token(memory):
    """press_at=decode: a budget below the window (every prompt failed), a ratio (below the window at first, then
    above it: the window kept, the rest scored)."""
    model = tiny_model(GQA, {"kind": "snapkv", "press_at": "decode", **memory}, perturb=True)
    tokens = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model.new_cache(1)
        for t in range(30):
            assert torch.isfinite(model(tokens[:, t : t + 1], cache)[0]).all()
            held = cache.layers[0].positions()[0, 0].tolist()
            seen = t + 1
            kept = min(seen, memory["budget"]) if "budget" in memory else max(1, int(seen * 0.5))
            assert len(held) == kept
            window = memory.get("window_size", 64)
            assert held[-min(kept, window) :] == list(range(seen - min(kept, window), seen))  # the window, newest first


def test_snapkv_scores_rank_the_window_newest_first_and_keep_the_rest_as_before():
    torch.manual_seed(2)
    q, k = torch.randn(1, 4, 4, 8), torch.randn(1, 2, 12, 8)
    visible = torch.arange(12)[None, :] <= torch.arange(8, 12)[:, None]  # (w, S): causal
    visible = visible.expand(1, 2, 4, 12)
    scores = snapkv_scores(q, k, visible, 0.3, 3)
    window = scores[..., 8:]
    assert (window > 1).all() and (window.diff(dim=-1) > 0).all()  # above any probability, newest highest
    # The other columns: the window queries' attention without the window's columns, pooled with zero padding.
    probs = grouped_logits(q, k, 0.3).masked_fill(~visible[:, :, None], float("-inf")).softmax(dim=-1)[..., :8]
    mean = probs.mean(dim=-2).reshape(1, 4, 8)
    pooled = torch.nn.functional.avg_pool1d(mean, 3, stride=1, padding=1).reshape(1, 2, 2, 8).mean(dim=2)
    torch.testing.assert_close(scores[..., :8], pooled)
    # Fewer tokens than the window: every one is the window's, ranked newest first.
    short = snapkv_scores(q[:, :, -3:], k[:, :, :3], visible[:, :, -3:, :3], 0.3, 3)
    assert short.argsort(dim=-1).tolist() == [[[0, 1, 2]] * 2]


# ---------------------------------------------------------------------------------------------- h3: quest


def test_quest_starts_small_and_grows_to_what_it_holds():
    model = tiny_model(None, {"kind": "quest", "recent_window": 16, "page_size": 8, "pages": 2})
    huge = model.new_cache(1, 10**12)  # was 10**12 slots allocated (or an overflow past 2**63)
    assert huge.layers[0].buffers["k"].shape[-2] == INITIAL_SLOTS
    cache = model.new_cache(1, 300)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 300)), cache)
    assert cache.layers[0].buffers["k"].shape[-2] == 300  # grown, capped at max_len
    every = list(range(97))  # any token stops the generation: only the request is huge
    assert generate(model, [1, 2], max_new_tokens=10**23, stop_tokens=every, compile=False).shape == (1,)


# ---------------------------------------------------------------------------------------------- h4: attention_maps


@pytest.mark.parametrize("memory", ["kind=quest,recent_window=16,page_size=8,pages=2",
                                    "kind=streaming,recent_window=8,sink_tokens=2"])  # fmt: skip
def test_attention_maps_past_a_memory_block_is_refused(converted, tmp_path, capsys, memory):
    model = converted(memory)
    argv = ["bench", str(model), "--benchmarks", "attention_maps", "--set", "attention_maps.unit=tokens",
            "--set", "attention_maps.regions={a: [0, 4]}", "--out", str(tmp_path / "b")]  # fmt: skip
    prompt = "the cat sat on the mat by the red door"  # 38 characters: more than the block
    block = 16 if "quest" in memory else 8
    assert fails(capsys, [*argv, "--set", f"attention_maps.prompt={prompt}"], "has 38 tokens",
                 f"blocks of {block} tokens (memory.block)", f"at most {block} tokens")  # fmt: skip
    assert main([*argv, "--set", f"attention_maps.prompt={prompt[:block]}"]) == 0  # one block: the maps are right


# ---------------------------------------------------------------------------------------------- h5, h6: accounting


def per_token(cfg) -> int:
    return kv_report(cfg, "fp16", 1)["kv_bytes_per_token_per_layer"]


@pytest.mark.parametrize(
    ("memory", "seq_len", "held"),
    [
        ({"kind": "knorm", "budget": 4}, 16, 4),  # was negative
        ({"kind": "tova", "budget": 64}, 100, 64),  # was 36 tokens
        ({"kind": "tova", "budget": 2**24}, 128, 128),  # was 2**24 tokens
        ({"kind": "tova", "budget": 1}, 32, 1),
        ({"kind": "tova", "compression_ratio": 0.5}, 256, 128),  # was every token
        ({"kind": "snapkv", "compression_ratio": 0.9}, 5, 1),  # kvpress's max(1, int(...))
    ],
)
def test_a_press_at_decode_counts_what_it_holds_at_seq_len(memory, seq_len, held):
    cfg = tiny_config(None, {**memory, "press_at": "decode"})
    report = kv_report(cfg, "fp16", seq_len)
    assert report["kv_bytes_per_layer"] == held * per_token(cfg)
    assert report["memory"]["held_tokens"] == held
    note = memory_note(report)
    assert "after every step" in note and f"{held:,} at seq_len" in note and "compresses the prompt once" not in note
    assert "-" not in note


def test_quest_reads_at_most_the_tokens_there_are():
    big = 2**24
    memory = {"kind": "quest", "recent_window": big, "page_size": big, "pages": big, "sink_tokens": big}
    report = kv_report(tiny_config(None, memory), "fp16", 128)
    assert report["memory"]["read_slots"] == 128
    assert "reads at most 128 of them" in memory_note(report)


def test_the_memory_benchmark_agrees_for_a_ratio_at_decode(converted, tmp_path):
    model = converted("kind=tova,compression_ratio=0.5,press_at=decode")
    out = tmp_path / "b"
    argv = ["bench", str(model), "--benchmarks", "memory", "--set", "memory.lengths=[32,64]", "--out", str(out)]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [r["kv_matches_analytic"] for r in rows] == [True, True]  # was half the analytic figure
    assert [r["held_tokens"] for r in rows] == [16, 32]


# ---------------------------------------------------------------------------------------------- h7: a press scored


@pytest.mark.parametrize("press_at", ["prefill", "decode"])
@pytest.mark.parametrize(
    ("sets", "fragments"),
    [
        (["--benchmarks", "stream_loss", "--set", "stream_loss.length=48", "--set", "stream_loss.split=train"],
         ["benchmarks.stream_loss.length=48"]),
        (["--benchmarks", "perplexity", "--set", "perplexity.split=train", "--set", "perplexity.seq_len=32"],
         ["benchmarks.perplexity.seq_len=32"]),
    ],
)  # fmt: skip
def test_a_press_read_in_one_chunk_is_not_scored(converted, run, tmp_path, capsys, press_at, sets, fragments):
    """Each window was read as one chunk, pressed after its attention: the dense model's losses, for any budget."""
    model = converted(f"kind=snapkv,budget=4,window_size=4,press_at={press_at}")
    name = sets[1]
    argv = ["bench", str(model), *sets, "--set", f"{name}.dataset={text_of(run)}", "--out", str(tmp_path / "b")]
    assert fails(capsys, argv, *fragments, "memory.kind=snapkv", "dense model's", "context_sweep", "memory.block")


def test_a_press_is_scored_when_read_in_blocks(converted, run, tmp_path, capsys):
    out = tmp_path / "b"
    sets = ["--benchmarks", "stream_loss", "--set", "stream_loss.length=48", "--set", "stream_loss.split=train",
            "--set", f"stream_loss.dataset={text_of(run)}", "--set", "stream_loss.bucket=16",
            "--out", str(out)]  # fmt: skip
    block = converted("kind=snapkv,budget=4,window_size=4,block=32")  # 48 tokens: one block of 32, then 16
    assert fails(capsys, ["bench", str(converted("kind=snapkv,budget=4,window_size=4,block=48")), *sets],
                 "(memory.block=48)", "memory.block below 48")  # fmt: skip
    assert main(["bench", str(block), *sets]) == 0
    assert json.loads((out / "records.jsonl").read_text())["status"] == "ok"


# ---------------------------------------------------------------------------------------------- h12, h13, h20: kv-*


def kv(command, model, run, *extra):
    argv = [command, str(model), "--dataset", text_of(run), "--split", "train", "--seq-len", "32", "--tokens", "66"]
    return argv + (["--budget", "100"] if command == "kv-tune" else ["--policies", "none"]) + list(extra)


@pytest.mark.parametrize("memory", ["kind=tova,budget=24,press_at=decode", "kind=quest,recent_window=16,page_size=8"])
def test_kv_eval_measures_quest_and_a_press_through_a_policy(converted, run, capsys, memory):
    """h12: kv-tune and kv-eval refused quest and the presses (they took no KV policy); both now store their tokens
    in a policy's formats, and kv-eval measures them."""
    model = converted(memory)
    argv = kv("kv-eval", model, run)
    argv[argv.index("--policies") + 1] = "k=fp16,v=fp16"
    assert main(argv) == 0
    assert "k=fp16,v=fp16" in capsys.readouterr().out


def test_kv_tune_names_an_unknown_dtype_as_the_flag(run, capsys):
    assert fails(capsys, ["kv-tune", str(run), "--budget", "200", "--dtype", "fp8", "--split", "val", "--seq-len",
                          "32", "--tokens", "66"], "--dtype 'fp8' is not known", "fp32, fp16, bf16")  # fmt: skip


@pytest.mark.parametrize("command", ["kv-eval", "kv-tune"])
@pytest.mark.parametrize("out", ["/proc/x.jsonl", "/sys/x.jsonl"])
def test_kv_commands_check_their_out_before_measuring(run, capsys, command, out):
    argv = [command, str(run), "--split", "val", "--seq-len", "32", "--tokens", "66", "--out", out]
    argv += ["--budget", "200"] if command == "kv-tune" else ["--policies", "k=q8_0"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing measured, no table printed
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"attnlab {command}: error: {out}: "), lines


# ---------------------------------------------------------------------------------------------- h14: an empty text


@pytest.mark.parametrize("content", ["", "\n\n\n", "  \n\t\n"])
def test_an_empty_or_blank_text_file_is_said_to_hold_no_text(run, tmp_path, capsys, content):
    text = tmp_path / "empty.txt"
    text.write_text(content)
    fragments = (str(text), "holds no text")
    assert fails(capsys, ["kv-eval", str(run), "--policies", "k=q8_0", "--dataset", str(text), "--split", "train",
                          "--seq-len", "32", "--tokens", "66"], *fragments)  # fmt: skip
    assert fails(capsys, ["convert", str(run), "--attention", "kind=bottleneck,d_attn=16", "--calibrate-on", str(text),
                          "--calibration-tokens", "64", "--out", str(tmp_path / "c"), "--eval-tokens", "0"],
                 "--calibrate-on", *fragments)  # fmt: skip
    assert fails(capsys, ["bench", str(run), "--benchmarks", "perplexity", "--set", f"perplexity.dataset={text}",
                          "--set", "perplexity.split=train", "--out", str(tmp_path / "b")], *fragments)  # fmt: skip


def test_a_converted_models_missing_data_names_the_fix_of_the_benchmark_at_hand(converted, tmp_path, capsys):
    """Probe I (i12, i13): kv_quant's refusal named perplexity.dataset (refused there: not among the benchmarks);
    effective_rank's said no fix."""
    model = converted("kind=tova,budget=24,press_at=decode")
    argv = ["bench", str(model), "--benchmarks", "kv_quant", "--set", "kv_quant.policies=[k=fp16]", "--set",
            "kv_quant.split=val", "--set", "kv_quant.seq_len=32", "--out", str(tmp_path / "a")]  # fmt: skip
    assert fails(capsys, argv, "benchmarks.kv_quant.dataset=wikitext2-raw")
    assert fails(capsys, ["bench", str(model), "--benchmarks", "effective_rank", "--out", str(tmp_path / "b")],
          "effective_rank reads the split the model was trained on, so give a run's folder")  # fmt: skip
