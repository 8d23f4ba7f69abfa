"""Every layer cache is built here from its variant's layout, a memory config and a KV policy."""

from __future__ import annotations

import dataclasses

import torch

from attnlab.cache.banks import BoundedCache
from attnlab.cache.base import LayerCache
from attnlab.cache.codecs import KVPolicy, as_policy, default_format
from attnlab.cache.dense import DenseCache
from attnlab.cache.layout import CacheLayout
from attnlab.cache.memories import H2OCache, StreamingCache, WindowCache
from attnlab.cache.presses import PressCache
from attnlab.cache.quantized import QuantizedCache, QuantizedRingCache
from attnlab.cache.ring import RingCache
from attnlab.cache.sparse import QuestCache
from attnlab.config import PRESSES, MemoryConfig
from attnlab.errors import ConfigError

MEMORIES = {"window": WindowCache, "streaming": StreamingCache, "h2o": H2OCache, "bounded": BoundedCache}


def check_memory_policy(policy: KVPolicy, memory: MemoryConfig) -> None:
    """Raises ConfigError for the parts of a KV policy a memory cannot honour."""
    if memory.kind in PRESSES:  # its own checks (press_codecs): a press stores every token in its format
        return
    problems = []
    if policy.resid:
        problems.append(
            f"kv policy resid={policy.resid} keeps the newest tokens of a growing cache at full precision; with "
            f"memory.kind={memory.kind} every slot, the recent window's too, is stored in the policy's formats "
            "(leave resid out)"
        )
    if policy.flush != 1:
        problems.append(f"kv policy flush={policy.flush} does not apply to memory.kind={memory.kind}, whose slots are "
                        "written one token at a time (leave flush out)")  # fmt: skip
    if problems:
        raise ConfigError(problems)


def build_cache(
    layout: CacheLayout,
    batch: int,
    max_len: int | None,
    dtype: torch.dtype,
    device=None,
    policy: KVPolicy | str | None = None,
    memory: MemoryConfig | None = None,
) -> LayerCache:
    """One layer's cache for `batch` sequences: a memory of fixed size when `memory` has a kind (its recent window
    cut to max_len slots when max_len is given and smaller: the cache then takes at most max_len tokens; None:
    a stream of any length), else a cache for up to max_len tokens (a ring of the layout's window for a
    sliding-window variant); each field stored in the format `policy` names (None: in `dtype`)."""
    policy = as_policy(policy)
    if policy is not None:
        default_format(dtype, policy)  # InputError for a float64 cache, before any kind of cache is built
    if memory is not None and memory.kind != "none":
        if layout.window is not None:  # ModelConfig refuses this; a hand-built layout gets the same line
            raise ConfigError(f"a sliding-window attention (window {layout.window}) takes no memory: its own window "
                              f"hides every slot memory.kind={memory.kind} keeps beyond it")  # fmt: skip
        if policy is not None:
            check_memory_policy(policy, memory)
        if memory.kind == "quest":  # every token kept; a request shorter than it reads reads all (= dense)
            return QuestCache(layout, batch, memory, dtype, device, max_len, policy)
        if memory.kind in PRESSES:  # kvpress's presses: each KV head keeps its best tokens (cache/presses.py)
            return PressCache(layout, batch, memory, dtype, device, max_len, policy)
        if max_len is None or max_len >= memory.recent_window:
            return MEMORIES[memory.kind](layout, batch, memory, dtype, device, policy)
        # A sequence of at most max_len tokens never fills a longer window: a ring of max_len slots holds the same
        # tokens at the same positions (nothing leaves it, every slot is visible), as a KV cache is sized by
        # max_len. A window of millions of tokens then costs nothing for a short request.
        capped = dataclasses.replace(memory, recent_window=max_len)
        cache = MEMORIES[memory.kind](layout, batch, capped, dtype, device, policy)
        cache.max_len = max_len
        return cache
    slots = max_len if layout.window is None else min(layout.window, max_len)
    if policy is not None:
        if layout.window is not None:
            return QuantizedRingCache(layout, policy, batch, slots, max_len, dtype, device)
        return QuantizedCache(layout, policy, batch, slots, max_len, dtype, device)
    if layout.window is not None:
        return RingCache(layout, batch, slots, dtype, max_len, device)
    return DenseCache(layout, batch, max_len, dtype, device)
