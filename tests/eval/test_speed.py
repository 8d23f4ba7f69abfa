"""Memory figures equal the cache tensors' bytes and the analytic formula for every cache layout; latency
rows cover the requested grid with medians and spreads (speeds are recorded, never asserted)."""

import pytest
import torch
from helpers import tiny_model
from torch import nn

from attnlab.errors import InputError
from attnlab.eval import EvalModel
from attnlab.eval.speed import is_out_of_memory, run_guarded, run_latency, run_memory, spread

BASE = {"vocab_size": 97, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64, "init_std": 0.1}
# Elements cached per token per layer, by hand: head_dim = 64 / 4 = 16.
KINDS = [
    ({"kind": "mha"}, 2 * 4 * 16),  # K and V, 4 heads
    ({"kind": "mha", "n_kv_heads": 2}, 2 * 2 * 16),  # GQA: K and V, 2 heads
    ({"kind": "decoupled", "d_sem": 16, "d_geo": 32}, (16 + 32) + (16 + 32)),  # [k_sem | k_geo] and v = d_sem + d_geo
    ({"kind": "sliding", "window": 6}, 2 * 4 * 16),  # as MHA, but at most `window` tokens
    ({"kind": "mla", "d_latent": 16}, 16 + 8),  # latent + the shared RoPE key (head_dim / 2)
]


def eval_model(attention, tmp_path, module=None):
    module = module or tiny_model(attention, **BASE)
    return EvalModel("tiny", tmp_path, module.cfg, module, None, {})


def tensor_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in layer.buffers.values())


@pytest.mark.parametrize("attention, per_token", KINDS, ids=["mha", "gqa", "decoupled", "sliding", "mla"])
def test_kv_bytes_equal_the_tensors_and_the_formula(attention, per_token, tmp_path):
    model = eval_model(attention, tmp_path)
    rows = run_memory(model, lengths=[24, 8, 100], batch_size=2, chunk_size=5)
    assert [(r["length"], r["status"]) for r in rows] == [(8, "ok"), (24, "ok"), (100, "too_long")]
    window = attention.get("window")
    for row in rows[:2]:
        held = min(row["length"], window or row["length"])
        by_hand = 2 * BASE["n_layers"] * per_token * held * 4  # batch 2, fp32
        assert row["kv_bytes"] == by_hand == row["kv_bytes_analytic"] == tensor_bytes(model.model.new_cache(2, held))
        assert row["kv_matches_analytic"] and row["held_tokens"] == held and row["peak_rss_bytes"] > 0
        assert row["kv_bytes_per_token"] == BASE["n_layers"] * per_token * 4
    if window:
        assert rows[1]["capacity"] == window and rows[1]["held_tokens"] == window  # capped at the window


def test_fp16_cache_halves_the_bytes(tmp_path):
    model = eval_model({"kind": "mha", "n_kv_heads": 2}, tmp_path)
    fp32, fp16 = (run_memory(model, lengths=[16], cache_dtype=d, fill=False)[0] for d in ("fp32", "fp16"))
    assert fp16["kv_bytes"] * 2 == fp32["kv_bytes"] and fp16["kv_matches_analytic"] and fp16["cache_dtype"] == "fp16"
    with pytest.raises(InputError, match="cache_dtype"):
        run_memory(model, cache_dtype="int3")


def test_latency_rows_cover_the_grid_with_median_and_spread(tmp_path):
    model = eval_model({"kind": "mha", "n_kv_heads": 2}, tmp_path)
    rows = run_latency(
        model, prompt_lengths=[16, 8, 62], batch_sizes=[2, 1], new_tokens=4, warmup=1, repeats=3, chunk_size=5
    )
    assert [(r["prompt_length"], r["batch_size"], r["status"]) for r in rows] == [
        (8, 1, "ok"), (8, 2, "ok"), (16, 1, "ok"), (16, 2, "ok"), (62, 1, "too_long"), (62, 2, "too_long")
    ]  # fmt: skip
    for row in rows[:4]:
        for name in ("ttft_ms", "decode_tokens_per_s"):
            assert len(row[name]) == 3
            assert row[f"{name}_min"] <= row[f"{name}_q25"] <= row[f"{name}_median"] <= row[f"{name}_q75"]
            assert row[f"{name}_q75"] <= row[f"{name}_max"]
        assert row["benchmark"] == "latency" and row["config_hash"] == model.cfg.config_hash()
    with pytest.raises(InputError, match="new_tokens"):
        run_latency(model, new_tokens=1)


class BatchTwoRunsOutOfMemory(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.cfg = inner, inner.cfg

    def new_cache(self, batch, *args, **kwargs):
        if batch > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.inner.new_cache(batch, *args, **kwargs)

    def forward(self, tokens, cache=None, use_cache=None):
        return self.inner(tokens, cache=cache, use_cache=use_cache)


def test_out_of_memory_becomes_a_record(tmp_path):
    inner = eval_model({"kind": "mha"}, tmp_path).model
    model = eval_model(None, tmp_path, module=BatchTwoRunsOutOfMemory(inner))
    rows = run_latency(model, prompt_lengths=[8], batch_sizes=[1, 2], new_tokens=2, warmup=0, repeats=1)
    assert [r["status"] for r in rows] == ["ok", "oom"] and "out of memory" in rows[1]["error"]
    memory = run_memory(model, lengths=[8], batch_size=2)
    assert memory[0]["status"] == "oom" and memory[0]["peak_rss_bytes"] > 0


def test_out_of_memory_detection_and_spread():
    assert is_out_of_memory(MemoryError()) and is_out_of_memory(torch.OutOfMemoryError("x"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert run_guarded(lambda: 3) == (3, None)
    with pytest.raises(ValueError):
        run_guarded(lambda: int("x"))
    stats = spread([4.0, 1.0, 3.0, 2.0], "t")
    assert stats["t_median"] == 2.5 and stats["t_min"] == 1.0 and stats["t_max"] == 4.0
    assert stats["t_q25"] == 1.75 and stats["t_q75"] == 3.25
