"""Attention masks built from absolute positions (pure functions). True = may attend."""

from __future__ import annotations

import torch


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(Tq, Tk) bool: key j visible to query i iff 0 <= k_pos[j] <= q_pos[i] (and, with a window,
    q_pos[i] - k_pos[j] < window, i.e. the last `window` positions including the query's own).
    Empty cache slots carry position -1 and are never visible."""
    q, k = q_pos[:, None], k_pos[None, :]
    mask = (k >= 0) & (k <= q)
    if window is not None:
        mask &= (q - k) < window
    return mask


def memory_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, recent: int, window: int) -> torch.Tensor:
    """(B, 1, Tq, S) bool for a bounded memory (cache/memories.py), whose slots differ per sequence.

    k_pos: (B, S) slot positions, -1 = empty. The first `recent` columns are the recent window: key j is
    visible to query i iff 0 <= q_pos[i] - k_pos[j] < window. The other columns are memory-bank slots,
    visible iff 0 <= k_pos[j] <= q_pos[i]: a bank holds tokens that already left the window, so once
    filled a slot is visible to every later query.
    """
    q, k = q_pos[None, :, None], k_pos[:, None, :]  # (1, Tq, 1), (B, 1, S)
    visible = (k >= 0) & (k <= q)
    in_window = torch.arange(k_pos.shape[-1], device=k_pos.device) < recent  # (S,)
    visible &= ~in_window | ((q - k) < window)
    return visible[:, None]  # (B, 1, Tq, S): broadcast over heads


def with_null_column(mask: torch.Tensor) -> torch.Tensor:
    """Prepends an always-visible column for the null key (the explicit 'attend nowhere' option).
    mask: (..., Tq, Tk) -> (..., Tq, 1 + Tk)."""
    return torch.cat((mask.new_ones(*mask.shape[:-1], 1), mask), dim=-1)


def attention_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor | None,
    window: int | None = None,
    null: bool = False,
    static: bool = False,
) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) for `attend`. k_pos None means no cache: keys are the queries themselves,
    positions 0..T-1, and the fused causal kernel applies when nothing else restricts the scores.
    static: k_pos covers every slot of a static-mode cache, empty ones (-1) included, so always mask."""
    if k_pos is None:
        if window is None and not null:
            return None, True
        k_pos = q_pos
    elif q_pos.shape[0] == 1 and window is None and not null and not static:
        return None, False  # one new token after a dense cache sees every held slot
    mask = causal_mask(q_pos, k_pos, window)
    return (with_null_column(mask) if null else mask), False
