"""Parameter counts by component and KV-cache bytes, per token, per layer and in total."""

from __future__ import annotations

import torch

from attnlab.cache.build import check_memory_policy
from attnlab.cache.codecs import Codec, as_policy
from attnlab.cache.memories import memory_codecs
from attnlab.cache.presses import n_kept, press_codecs, resolve_budget, token_bytes
from attnlab.cache.quantized import slot_counts
from attnlab.config import ModelConfig, dtype_bytes
from attnlab.config_checks import MAX_INT
from attnlab.config_memory import PRESSES
from attnlab.errors import InputError, given
from attnlab.model.transformer import build_model


def param_counts(model_or_cfg) -> dict[str, int]:
    """Parameters by component: embedding, attention, memory (the bounded memory's write gate and EMA
    rates), mlp, norms, lm_head (0 when tied), total.

    Given a config, the model is built on the meta device, so no memory is allocated.
    """
    if isinstance(model_or_cfg, ModelConfig):
        with torch.device("meta"):
            model = build_model(model_or_cfg)
    elif isinstance(model_or_cfg, torch.nn.Module):
        model = model_or_cfg
    else:
        raise InputError(f"param_counts takes a ModelConfig or a model, got {given(model_or_cfg)} (a YAML file: "
                         "attnlab.load_config(path) reads it)")  # fmt: skip
    counts = {"embedding": 0, "attention": 0, "memory": 0, "mlp": 0, "norms": 0, "lm_head": 0}
    for name, p in model.named_parameters():  # tied weights are listed once, under the embedding
        if name.startswith("embed."):
            part = "embedding"
        elif name.startswith("lm_head."):
            part = "lm_head"
        elif ".attn." in name:
            part = "attention"
        elif ".memory." in name:
            part = "memory"
        elif ".mlp." in name:
            part = "mlp"
        else:
            part = "norms"
        counts[part] += p.numel()
    counts["total"] = sum(counts.values())
    return counts


def kv_report(cfg: ModelConfig, dtype: str = "fp16", seq_len: int | None = None, policy=None) -> dict:
    """KV-cache bytes for one sequence at `seq_len` tokens (default max_seq_len) stored as `dtype`.

    kv_bytes_per_token: all layers, per token of context; kv_bytes_per_layer: one layer at seq_len
    (a bounded cache stops growing at its capacity); kv_bytes: all layers at seq_len.
    With a KV policy (attnlab.cache.quantized) each tensor is counted in its format, per token as
    stored once it left the residual window, at seq_len with the residual window in `dtype`.
    With cfg.memory (cache/memories.py) the cache holds its slots whatever the length: per layer
    2 * H_kv * slots * head_dim * dtype bytes (CoDA-GQA-L Theorem 1), its recent window cut to seq_len when
    seq_len is shorter (a cache made for seq_len tokens holds no more); a press at decode holds what it presses
    to, min(seq_len, budget) or kvpress's max(1, int(seq_len * (1 - ratio))); quest and a press at prefill hold
    every token (quest's read_slots cut to seq_len). `memory` then also gives the slots, the tokens held per layer
    at seq_len and what the variant's own cache would hold there, and is None otherwise.
    """
    if not isinstance(cfg, ModelConfig):
        raise InputError(f"kv_report takes a ModelConfig, got {given(cfg)} (attnlab.load_config(path) reads a YAML "
                         "file, attnlab.model_config_from_dict(data) a dict)")  # fmt: skip
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise InputError(f"seq_len={seq_len!r} must be a whole number of tokens >= 1")
    if seq_len > MAX_INT:
        raise InputError(f"seq_len={seq_len} must be <= {MAX_INT:,} (2**31 - 1) tokens")
    width = dtype_bytes(dtype)
    layout = cfg.attention.cache_layout(cfg)
    fields = layout.values_per_token()  # elements per token per layer, by cached field
    capacity = layout.window
    held = seq_len if capacity is None else min(seq_len, capacity)
    policy = as_policy(policy)
    settings = cfg.memory
    if settings.kind in PRESSES and settings.budget_bytes is not None:  # bytes to tokens per KV head, as the cache
        codecs = press_codecs(layout, policy, dtype) if policy is not None else None
        settings = resolve_budget(settings, token_bytes(layout, codecs, width))
    memory = None
    if settings.kind != "none":  # preallocated: the same bytes at any length from recent_window tokens on
        memory = {**settings.to_dict(), "slots": settings.slots,
                  "unbounded_kv_bytes_per_layer": int(sum(fields.values()) * width * held)}  # fmt: skip
        if settings.kind in PRESSES and settings.press_at == "decode":
            # Pressed after every update: to the budget, or to a share of the tokens seen (n_kept), not to a ring.
            capacity, held = settings.slots, n_kept(seq_len, settings)
        elif settings.slots is None:  # quest, a press at prefill: it holds (up to) every token
            # A decode step cannot read more tokens than there are.
            memory["read_slots"] = None if settings.read_slots is None else min(settings.read_slots, seq_len)
        else:
            capacity = settings.slots
            # A cache for seq_len tokens cuts a longer recent window to seq_len slots (cache.build_cache).
            held = capacity - settings.recent_window + min(settings.recent_window, seq_len)
        memory["held_tokens"] = held
    if policy is None:
        per_field = {name: n * width for name, n in fields.items()}  # bytes per token per layer
        per_layer = int(sum(per_field.values()) * held)
    elif memory is not None:  # every slot, the ring's too, in its field's format
        check_memory_policy(policy, cfg.memory)
        if cfg.memory.kind in PRESSES:  # each KV head's row on its own (cache/presses.py)
            codecs = press_codecs(layout, policy, dtype)
            per_field = {name: codec.bytes_per_token * layout.heads for name, codec in codecs.items()}
        else:
            per_field = {name: codec.bytes_per_token for name, codec in memory_codecs(layout, policy, dtype).items()}
        per_layer = int(sum(per_field.values()) * held)
    else:
        policy.check(list(fields))
        codecs = {
            name: Codec(policy.format_of(name, dtype), n, name.startswith("k"), policy.group_size, name)
            for name, n in fields.items()
        }
        per_field = {name: codec.bytes_per_token for name, codec in codecs.items()}
        step = policy.step(codecs.values())
        ring, stored = slot_counts(held, policy.resid, step)
        per_layer = int(sum(stored * per_field[name] + ring * fields[name] * width for name in fields))
    per_token_layer = sum(per_field.values())
    out = {
        "dtype": dtype,
        "seq_len": seq_len,
        "cache_fields": {name: _number(b) for name, b in per_field.items()},  # bytes per token per layer
        "capacity": capacity,
        "kv_bytes_per_token_per_layer": _number(per_token_layer),
        "kv_bytes_per_token": _number(per_token_layer * cfg.n_layers),
        "kv_bytes_per_layer": per_layer,
        "kv_bytes": per_layer * cfg.n_layers,
        "memory": memory,
    }
    if policy is not None:
        out["kv_policy"] = str(policy)
    return out


def memory_note(report: dict) -> str:
    """The line `attnlab info` prints about a kv_report's memory (report["memory"] not None)."""
    memory = report["memory"]
    unbounded = memory["unbounded_kv_bytes_per_layer"]
    if memory["kind"] == "quest":
        return (f"quest memory: holds every token, as the variant's own cache ({unbounded:,} bytes per layer); a "
                f"decode step reads at most {memory['read_slots']} of them per KV head")  # fmt: skip
    ratio = unbounded / report["kv_bytes_per_layer"]
    if memory["kind"] in PRESSES and memory.get("press_at") == "decode":  # to_dict leaves defaults out
        if memory.get("budget") is not None:
            kept = f"presses to at most {memory['budget']:,} tokens per layer after every step"
        else:
            kept = (f"presses to max(1, int(n x {1 - memory['compression_ratio']:g})) of the n tokens seen after every "
                    "step")  # fmt: skip
        return (f"{memory['kind']} memory: {kept}, {memory['held_tokens']:,} at seq_len; the variant's own cache "
                f"would hold {unbounded:,} bytes per layer, {ratio:.1f}x")  # fmt: skip
    if memory["slots"] is None:  # a press at prefill: the prompt compressed once, every later token appended
        return (f"{memory['kind']} memory: compresses the prompt once, then holds every new token; at most the "
                f"variant's own cache ({unbounded:,} bytes per layer)")  # fmt: skip
    return (f"{memory['kind']} memory: {memory['slots']} slots per layer at any length; the variant's own cache "
            f"would hold {unbounded:,} bytes per layer, {ratio:.1f}x")  # fmt: skip


def _number(x: float) -> int | float:
    """Whole byte counts as ints (JSON prints 180224, not 180224.0); fractional ones (Q4_0: 0.5625 bytes
    per value) rounded to 4 places."""
    return int(x) if float(x).is_integer() else round(x, 4)


def info(cfg: ModelConfig, dtype: str = "fp16", seq_len: int | None = None, policy=None) -> dict:
    """Everything `attnlab info --json` prints."""
    params = param_counts(cfg)
    return {
        "name": cfg.name,
        "kind": cfg.attention.kind,
        "config_hash": cfg.config_hash(),
        "params_total": params["total"],
        "params": params,
        **kv_report(cfg, dtype, seq_len, policy),
    }
