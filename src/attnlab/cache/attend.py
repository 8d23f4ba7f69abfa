"""Attending through any cache: the one sequence every variant runs, written once.

    attend_cache(cache, q, new, positions, read, scale)   one softmax attention over the cached buffers
    held = read_cache(cache, new, positions); attend_held(held, q, k, v, scale)   the same in two steps, for
                                                          variants that read the buffers their own way (DIFF's
                                                          two maps, naive MLA's up-projections)

With cache None the keys are the chunk itself (training and scoring, positions 0..T-1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.cache.base import LayerCache, Write
from attnlab.cache.layout import Read
from attnlab.ops.attend import attend, attend_with_probs
from attnlab.ops.heads import prepend_null
from attnlab.ops.masks import attention_mask


@dataclass
class Held:
    """What a chunk's queries attend over: the buffers (seq on axis -2), their slots' positions, the mask."""

    tensors: dict[str, torch.Tensor]
    positions: torch.Tensor  # (S,), or (B, S) for a cache whose slots differ per sequence
    mask: torch.Tensor | None
    is_causal: bool
    cache: LayerCache | None

    @property
    def shared_positions(self) -> bool:
        """Whether every sequence holds the same slots under the plain causal rule (fused kernels build such
        masks themselves from positions)."""
        return self.cache is None or not (self.cache.per_sequence or self.cache.selects)


def read_cache(
    cache: LayerCache | None,
    new: dict[str, torch.Tensor],
    positions: torch.Tensor,
    window: int | None = None,
    null: bool = False,
    write: Write | None = None,
) -> Held:
    """Stores the chunk `new` (the layout's buffers) in `cache` and returns what its queries attend over."""
    if cache is None:
        mask, is_causal = attention_mask(positions, None, window, null)
        return Held(new, positions, mask, is_causal, None)
    held, k_pos = cache.update(new, positions, write)
    mask, is_causal = cache.mask(positions, k_pos, window, null)
    return Held(held, k_pos, mask, is_causal, cache)


def attend_held(
    held: Held,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    null: tuple[torch.Tensor, torch.Tensor] | None = None,
    observe: bool = True,
) -> torch.Tensor:
    """softmax(q k^T scale + mask) v over `held`: q (B, H, T, D), k (B, H_kv, S, D), v (B, H_kv, S, Dv); a
    null key/value pair ((H_kv, D), (H_kv, Dv)) goes first. A cache that wants the probabilities (H2O) gets
    them (observe=False: this call's do not count, e.g. DIFF's inhibitory map). Returns (B, H, T, Dv)."""
    if null is not None:
        k, v = prepend_null(k, null[0]), prepend_null(v, null[1])
    cache = held.cache
    if observe and cache is not None and cache.selects:  # quest: each query's pages, from the queries
        held.mask = cache.resolve(q, k, scale, held.mask, null is not None)  # later maps (DIFF's) use it too
    if observe and cache is not None and cache.wants_probs:
        held.mask = cache.resolve(q, k, scale, held.mask, null is not None)  # later maps (DIFF's) use it too
        y, probs = attend_with_probs(q, k, v, held.mask, scale)
        cache.observe(probs[..., 1:] if null is not None else probs)
        return y
    return attend(q, k, v, held.mask, scale=scale, is_causal=held.is_causal)


def with_heads(x: torch.Tensor) -> torch.Tensor:
    """A buffer as attend reads it: (B, S, D) (one row shared by every head) -> (B, 1, S, D)."""
    return x[:, None] if x.dim() == 3 else x


def attend_cache(
    cache: LayerCache | None,
    q: torch.Tensor,
    new: dict[str, torch.Tensor],
    positions: torch.Tensor,
    read: Read,
    scale: float,
    window: int | None = None,
    null: tuple[torch.Tensor, torch.Tensor] | None = None,
    write: Write | None = None,
) -> torch.Tensor:
    """One attention call of queries q (B, H, T, D) at `positions` over the cache plus the chunk `new`: K is
    buffer read.keys, V the first read.value_width values of buffer read.values. A cache may do a decode
    step itself (attend_one: quantized caches read their blocks in a kernel). Returns (B, H, T, Dv)."""
    if cache is not None and null is None:
        y = cache.attend_one(q, new, positions, read, scale)
        if y is not None:
            return y
    held = read_cache(cache, new, positions, window, null is not None, write)
    k, v = with_heads(held.tensors[read.keys]), with_heads(held.tensors[read.values])
    if read.value_width is not None:
        v = v[..., : read.value_width]  # a view (MLA: the latent without its RoPE key)
    return attend_held(held, q, k, v, scale, null)
